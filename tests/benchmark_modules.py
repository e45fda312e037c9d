"""The scripts under ``benchmarks/`` as modules, for the tests that call their functions."""

import importlib
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def benchmark_module(name: str):
    """``benchmarks/<name>.py`` imported (with ``benchmarks/`` on the path only meanwhile)."""
    sys.path.insert(0, BENCHMARKS)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(BENCHMARKS)

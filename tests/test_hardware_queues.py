"""The engine asks the CUDA driver for the most hardware work queues before its CUDA context
exists (``neo.engine.hardware_queues``): set when unset, a user's value kept, a warning where the
setting cannot take effect or asks for fewer; CPU engines leave it alone. On a GPU, a fresh
process that builds a CUDA engine ends with the variable set and its context made after it."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from neo import LLM
from neo.engine import hardware_queues
from neo.engine.hardware_queues import CONNECTIONS_VARIABLE, MOST_CONNECTIONS, request_hardware_queues

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def unset(monkeypatch):
    monkeypatch.delenv(CONNECTIONS_VARIABLE, raising=False)


def test_unset_becomes_the_most_queues_without_a_warning(unset, monkeypatch, caplog):
    monkeypatch.setattr(hardware_queues, "_context_exists", lambda: False)
    with caplog.at_level(logging.WARNING, logger=hardware_queues.__name__):
        request_hardware_queues()
    assert os.environ[CONNECTIONS_VARIABLE] == str(MOST_CONNECTIONS)
    assert caplog.records == []


def test_a_context_made_before_the_engine_is_named_in_a_warning(unset, monkeypatch, caplog):
    monkeypatch.setattr(hardware_queues, "_context_exists", lambda: True)
    with caplog.at_level(logging.WARNING, logger=hardware_queues.__name__):
        request_hardware_queues()
    # Set all the same: the ranks the engine spawns still get it.
    assert os.environ[CONNECTIONS_VARIABLE] == str(MOST_CONNECTIONS)
    assert len(caplog.records) == 1
    assert "CUDA was initialized before the engine" in caplog.text and CONNECTIONS_VARIABLE in caplog.text


@pytest.mark.parametrize("chosen, warned", [("32", False), ("8", True), ("1", True), ("many", True)])
def test_a_value_the_user_set_is_kept(chosen, warned, monkeypatch, caplog):
    monkeypatch.setenv(CONNECTIONS_VARIABLE, chosen)
    with caplog.at_level(logging.WARNING, logger=hardware_queues.__name__):
        request_hardware_queues()
    assert os.environ[CONNECTIONS_VARIABLE] == chosen
    assert (f"{CONNECTIONS_VARIABLE}={chosen}" in caplog.text) == warned


def test_a_cpu_engine_leaves_the_variable_alone(unset):
    LLM("neo-tiny", device="cpu")
    assert CONNECTIONS_VARIABLE not in os.environ


CUDA_ENGINE_PROBE = """
import os, torch
from neo import LLM
from neo.engine.hardware_queues import CONNECTIONS_VARIABLE, _context_exists
assert CONNECTIONS_VARIABLE not in os.environ and not _context_exists()
LLM("neo-tiny", device="cuda", gpu_kv_cache_gib=0.01)
assert _context_exists()
print(os.environ[CONNECTIONS_VARIABLE])
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_engine_sets_the_variable_before_its_context():
    environment = {name: value for name, value in os.environ.items() if name != CONNECTIONS_VARIABLE}
    result = subprocess.run([sys.executable, "-c", CUDA_ENGINE_PROBE], cwd=REPOSITORY, env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == str(MOST_CONNECTIONS)
    assert "CUDA was initialized before the engine" not in result.stderr

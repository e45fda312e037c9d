"""Parsers of the ``neo`` command's flag values, for argparse's ``type=``.

Each takes the flag's text and returns its value, or raises ``argparse.ArgumentTypeError`` with
a message that names the bound and the offending text; argparse then prints the usage and one
line ``neo <command>: error: argument --flag: <message>`` and exits with status 2.
"""

import argparse
import json
import math
import re

DEVICE_PATTERN = re.compile(r"(cpu|cuda(:[0-9]+)?)")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``."""
    if not DEVICE_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def log_level(text: str) -> str:
    """A logging level name, in any case; returned in upper case."""
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)} (any case), got "
                                         f"{text!r}")
    return text.upper()


def integer_at_least(lowest: int, highest: int | None = None):
    """A parser of integers in [``lowest``, ``highest``] (no upper bound when None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lowest or (highest is not None and value > highest):
            bound = f">= {lowest}" if highest is None else f"from {lowest} to {highest}"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text}")
        return value
    return parse


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def iteration_range(text: str) -> tuple[int, int]:
    """``FIRST:LAST``: iterations counted from 1, ``1 <= FIRST <= LAST``."""
    first, separator, last = text.partition(":")
    try:
        bounds = int(first), int(last)
    except ValueError:
        bounds = None
    if not separator or bounds is None:
        raise argparse.ArgumentTypeError(f"expected FIRST:LAST (two integers), got {text!r}")
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"needs 1 <= FIRST <= LAST, got {text}")
    return bounds


def positive_number(text: str) -> float:
    """A finite number > 0."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_number(text: str) -> float:
    """A finite number >= 0."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = _finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def number(text: str) -> float:
    """A finite number (its range is checked where it is used)."""
    return _finite(text)


def token_ids(text: str) -> list[int]:
    """A JSON list of token ids: non-negative integers."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON list of token ids such as [1, 2, 3], got "
                                         f"{text!r}") from None
    if (not isinstance(value, list) or not value
            or not all(isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in value)):
        raise argparse.ArgumentTypeError(f"expected a non-empty JSON list of non-negative integers, got "
                                         f"{text!r}")
    return value

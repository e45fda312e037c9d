"""Workload trace files: request lengths (and arrival times) from a CSV or JSONL file.

CSV (``.csv``), the Azure LLM inference trace's columns: a header row naming
``ContextTokens`` (prompt length) and ``GeneratedTokens`` (output length), and optionally
``TIMESTAMP`` (arrival time: the Azure trace's ``YYYY-MM-DD HH:MM:SS[.fraction]``, or
seconds as a number). JSONL (``.jsonl``): one JSON object per line with ``prompt_len`` and
``output_len``, and optionally ``arrival_s`` (seconds). Other columns or keys are ignored;
blank JSONL lines are skipped.

Every row is checked: lengths are integers >= 1, arrival times are given for every request or
for none, and never decrease. A file that breaks a rule, or holds no request, raises a
``ValueError`` naming the file and the line. Arrival times become offsets from the first
request.
"""

import csv
import json
import math
import os
from collections.abc import Iterable
from datetime import datetime

from .workload_request import WorkloadRequest

CSV_LENGTH_COLUMNS = ("ContextTokens", "GeneratedTokens")
CSV_TIME_COLUMN = "TIMESTAMP"
JSONL_LENGTH_KEYS = ("prompt_len", "output_len")
JSONL_TIME_KEY = "arrival_s"
EXTENSIONS = (".csv", ".jsonl")


def read_trace_file(path: str) -> list[WorkloadRequest]:
    """Every request of the file at ``path`` (format chosen by its extension)."""
    extension = os.path.splitext(path)[1].lower()
    if extension not in EXTENSIONS:
        raise ValueError(f"workload file {path!r}: unknown extension {extension!r}; use "
                         f"{' or '.join(EXTENSIONS)}")
    try:
        with open(path, newline="") as file:
            if extension == ".csv":
                return read_csv_trace(file, path)
            return read_jsonl_trace(file, path)
    except OSError as error:
        raise ValueError(f"workload file {path!r}: cannot read it ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"workload file {path!r}: not UTF-8 text ({error.reason})") from None


def read_csv_trace(lines: Iterable[str], name: str) -> list[WorkloadRequest]:
    """Requests from CSV text (``lines``: an open file or any iterable of lines); ``name``
    names the file in errors."""
    reader = csv.DictReader(lines)
    header = reader.fieldnames
    if header is None:
        raise ValueError(f"workload file {name!r}: empty (no header row)")
    missing = [column for column in CSV_LENGTH_COLUMNS if column not in header]
    if missing:
        raise ValueError(f"workload file {name!r}, line 1: header {header} lacks column(s) "
                         f"{', '.join(missing)}")
    timed = CSV_TIME_COLUMN in header
    rows = []
    for row in reader:
        where = f"workload file {name!r}, line {reader.line_num}"
        columns = (*CSV_LENGTH_COLUMNS, *((CSV_TIME_COLUMN,) if timed else ()))
        empty = [column for column in columns if row[column] is None or not row[column].strip()]
        if empty:
            raise ValueError(f"{where}: no value in column(s) {', '.join(empty)}")
        lengths = [_length(row[column].strip(), column, where) for column in CSV_LENGTH_COLUMNS]
        arrival = _csv_time(row[CSV_TIME_COLUMN].strip(), where) if timed else None
        rows.append((*lengths, arrival, where))
    return _requests(rows, name)


def read_jsonl_trace(lines: Iterable[str], name: str) -> list[WorkloadRequest]:
    """Requests from JSONL text (``lines``: an open file or any iterable of lines)."""
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"workload file {name!r}, line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error.msg})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(item).__name__}")
        missing = [key for key in JSONL_LENGTH_KEYS if key not in item]
        if missing:
            raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
        lengths = [_length(item[key], key, where) for key in JSONL_LENGTH_KEYS]
        arrival = item.get(JSONL_TIME_KEY)
        if arrival is not None and (isinstance(arrival, bool) or not isinstance(arrival, (int, float))
                                    or not math.isfinite(arrival)):
            raise ValueError(f"{where}: {JSONL_TIME_KEY} must be a number of seconds, got {arrival!r}")
        rows.append((*lengths, arrival, where))
    return _requests(rows, name)


def _length(value: object, field: str, where: str) -> int:
    """An integer >= 1 from a JSON value or CSV cell text."""
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {field} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{where}: {field} must be >= 1, got {value}")
    return value


def _csv_time(text: str, where: str) -> float:
    """Seconds from a number, or from the Azure trace's ``YYYY-MM-DD HH:MM:SS[.fraction]``
    (its seven fractional digits are more than ``%f`` takes, hence the split)."""
    try:
        seconds = float(text)
    except ValueError:
        date, _, fraction = text.partition(".")
        try:
            return datetime.strptime(date, "%Y-%m-%d %H:%M:%S").timestamp() + float("0." + (fraction or "0"))
        except ValueError:
            raise ValueError(f"{where}: {CSV_TIME_COLUMN} must be seconds or YYYY-MM-DD HH:MM:SS[.fraction], "
                             f"got {text!r}") from None
    if not math.isfinite(seconds):
        raise ValueError(f"{where}: {CSV_TIME_COLUMN} must be finite, got {text!r}")
    return seconds


def _requests(rows: list[tuple[int, int, float | None, str]], name: str) -> list[WorkloadRequest]:
    """Check the arrival times across rows and make them offsets from the first request."""
    if not rows:
        raise ValueError(f"workload file {name!r}: holds no request")
    timed = rows[0][2] is not None
    previous = None
    for _, _, arrival, where in rows:
        if (arrival is not None) != timed:
            raise ValueError(f"{where}: arrival times must be given for every request or for none "
                             f"(the first request {'has' if timed else 'has no'} {JSONL_TIME_KEY}/{CSV_TIME_COLUMN})")
        if timed and previous is not None and arrival < previous:
            raise ValueError(f"{where}: arrival time {arrival:g} s is before the previous request's "
                             f"({previous:g} s); arrivals must not decrease")
        previous = arrival
    start = rows[0][2]
    return [WorkloadRequest(prompt_len, output_len, None if arrival is None else arrival - start)
            for prompt_len, output_len, arrival, _ in rows]

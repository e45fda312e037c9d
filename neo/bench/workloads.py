"""Benchmark workloads: synthetic lengths, and the Azure LLM inference trace (code, 2023).

A workload is a list of ``WorkloadRequest`` (prompt length, output length, arrival offset in
seconds). Prompts are random token ids; the output length is forced (``ignore_eos``).
"""

import csv
import random
from dataclasses import dataclass
from datetime import datetime
from importlib import resources

AZURE_CODE_TRACE = "azure_llm_inference_trace_code_2023.csv"


@dataclass(frozen=True)
class WorkloadRequest:
    prompt_len: int
    output_len: int
    arrival_offset: float = 0.0  # seconds after the first request (trace time)


def parse_workload(spec: str, num_requests: int, seed: int = 0) -> list[WorkloadRequest]:
    """``synthetic:input=1000,output=300`` (lengths uniform within +-10% of the targets) or
    ``azure-code`` (the first ``num_requests`` requests of the trace, with their arrival times)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    kind, _, arguments = spec.partition(":")
    if kind == "synthetic":
        return synthetic(num_requests, seed=seed, **_parse_arguments(spec, arguments))
    if kind == "azure-code":
        if arguments:
            raise ValueError(f"workload azure-code takes no arguments, got {spec!r}")
        return azure_code(num_requests)
    raise ValueError(f"unknown workload {spec!r}: use synthetic:input=N,output=M or azure-code")


def _parse_arguments(spec: str, arguments: str) -> dict[str, int]:
    values = {}
    for item in filter(None, arguments.split(",")):
        key, _, value = item.partition("=")
        if key not in ("input", "output") or not value.isdigit() or int(value) < 1:
            raise ValueError(f"bad workload argument {item!r} in {spec!r}: expected input=N,output=M "
                             f"with positive integers")
        values[f"{key}_len"] = int(value)
    if set(values) != {"input_len", "output_len"}:
        raise ValueError(f"workload {spec!r} needs both input=N and output=M")
    return values


def synthetic(num_requests: int, input_len: int, output_len: int, seed: int = 0) -> list[WorkloadRequest]:
    rng = random.Random(seed)

    def around(target: int) -> int:
        return max(1, round(rng.uniform(0.9 * target, 1.1 * target)))

    return [WorkloadRequest(around(input_len), around(output_len)) for _ in range(num_requests)]


def azure_code(num_requests: int) -> list[WorkloadRequest]:
    rows = []
    with resources.files("neo.bench.data").joinpath(AZURE_CODE_TRACE).open() as file:
        for row in csv.DictReader(file):
            rows.append(row)
            if len(rows) == num_requests:
                break
    start = _timestamp(rows[0]["TIMESTAMP"])
    return [WorkloadRequest(int(row["ContextTokens"]), max(1, int(row["GeneratedTokens"])),
                            (_timestamp(row["TIMESTAMP"]) - start)) for row in rows]


def _timestamp(text: str) -> float:
    # e.g. "2023-11-16 18:17:03.9799600": seven fractional digits, more than %f takes
    date, _, fraction = text.partition(".")
    return datetime.strptime(date, "%Y-%m-%d %H:%M:%S").timestamp() + float("0." + (fraction or "0"))


def random_prompt(length: int, vocab_size: int, rng: random.Random) -> list[int]:
    """Random token ids, avoiding the first and last few ids (often special tokens)."""
    low, high = min(4, vocab_size - 1), max(min(4, vocab_size - 1), vocab_size - 257)
    return [rng.randint(low, high) for _ in range(length)]

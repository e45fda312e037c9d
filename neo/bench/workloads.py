"""Benchmark workloads: synthetic lengths, the Azure LLM inference trace (code, 2023), and
trace files.

A workload is a list of ``WorkloadRequest`` (prompt length, output length, arrival offset in
seconds or None). Prompts are random token ids; the output length is forced (``ignore_eos``).
"""

import random
from importlib import resources

from .trace_files import EXTENSIONS, read_csv_trace, read_trace_file
from .workload_request import WorkloadRequest

AZURE_CODE_TRACE = "azure_llm_inference_trace_code_2023.csv"
WORKLOAD_FORMS = "synthetic:input=N,output=M, azure-code or file:PATH (.csv or .jsonl)"


def parse_workload(spec: str, num_requests: int, seed: int = 0) -> list[WorkloadRequest]:
    """The first ``num_requests`` requests of a workload.

    ``synthetic:input=1000,output=300``: lengths uniform within +-10% of the targets, no arrival
    times. ``azure-code``: the bundled trace, with its arrival times. ``file:PATH``: a trace
    file (``neo.bench.trace_files``: CSV with the Azure trace's columns, or JSONL). A trace
    holding fewer requests than ``num_requests`` gives all of its requests: ``num_requests`` is
    an upper bound for traces."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    kind, _, arguments = spec.partition(":")
    if kind == "synthetic":
        return synthetic(num_requests, seed=seed, **_parse_arguments(spec, arguments))
    if kind == "azure-code":
        if arguments:
            raise ValueError(f"workload azure-code takes no arguments, got {spec!r}")
        return azure_code()[:num_requests]
    if kind == "file":
        if not arguments:
            raise ValueError(f"workload {spec!r} needs a path: file:PATH, PATH ending in "
                             f"{' or '.join(EXTENSIONS)}")
        return read_trace_file(arguments)[:num_requests]
    raise ValueError(f"unknown workload {spec!r}: use {WORKLOAD_FORMS}")


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


def azure_code() -> list[WorkloadRequest]:
    """Every request of the bundled Azure code trace, with arrival offsets."""
    with resources.files("neo.bench.data").joinpath(AZURE_CODE_TRACE).open(newline="") as file:
        return read_csv_trace(file, AZURE_CODE_TRACE)


def random_prompt(length: int, vocab_size: int, rng: random.Random) -> list[int]:
    """Random token ids, avoiding the first and last few ids (often special tokens)."""
    low, high = min(4, vocab_size - 1), max(min(4, vocab_size - 1), vocab_size - 257)
    return [rng.randint(low, high) for _ in range(length)]

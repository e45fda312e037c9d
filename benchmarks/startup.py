"""Engine start-up time by phase, each policy in a fresh process (so importing torch and the
extensions counts).

    python benchmarks/startup.py --policies gpu-only,neo --output results/startup.json -- \\
        --model llama-3.1-8b --load-format dummy --dtype bfloat16

Arguments after ``--`` are ``neo`` engine flags (``neo bench --help`` lists them); each policy's
process gets them plus ``--policy``. A process times ``import torch`` and ``import neo`` (the op
library and its compiled extensions), builds the engine (its phases: ``LLMEngine.startup_seconds``)
and closes it; "process start to ready" runs from spawning the process to the engine being
ready, the interpreter's own start included. Prints one table (phases by policy) and writes every
figure as JSON.
"""

import argparse
import json
import os
import subprocess
import sys
import time

IMPORT_PHASES = ("import torch", "import neo")
FROM_SPAWN = "process start to ready"


def measure_one(engine_arguments: list[str]) -> dict:
    """In this (fresh) process: time the imports, build an engine from ``engine_arguments``,
    close it; returns the figures."""
    imports = {}
    began = time.perf_counter()
    import torch  # noqa: F401  (timed)
    imports["import torch"] = time.perf_counter() - began
    began = time.perf_counter()
    import neo  # noqa: F401
    import neo.ops  # noqa: F401  (the compiled extensions)
    imports["import neo"] = time.perf_counter() - began
    import logging

    from neo import LLMEngine
    from neo.cli import add_engine_arguments, engine_config_from_args

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    parser = argparse.ArgumentParser(prog="startup.py engine arguments")
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(engine_arguments))
    engine = LLMEngine(config)
    ready = time.time()
    try:
        return {"policy": config.policy, "imports": imports, "engine": engine.startup_seconds,
                "notes": engine.startup_notes, "ready_time": ready, "device": str(engine.device)}
    finally:
        engine.close()


def measure_in_subprocess(policy: str, engine_arguments: list[str], timeout: float) -> dict:
    """``measure_one`` in a new interpreter; adds the time from spawning it to the engine being ready."""
    command = [sys.executable, os.path.abspath(__file__), "--measure-one", "--", *engine_arguments,
               "--policy", policy]
    spawned = time.time()
    completed = subprocess.run(command, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout,
                               check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"the {policy} start-up process exited with {completed.returncode}")
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    result[FROM_SPAWN] = result.pop("ready_time") - spawned
    return result


def phase_rows(results: list[dict]) -> list[tuple[str, list[str]]]:
    """Table rows ``(phase, [cell per policy])``: the imports, every engine phase in first-seen
    order (with its note), the engine's total, and the whole start from spawning the process."""
    names = list(IMPORT_PHASES)
    for result in results:
        names += [name for name in result["engine"] if name not in names and name not in ("other", "total")]
    rows = []
    for name in names + ["other", "engine total", FROM_SPAWN]:
        cells = []
        for result in results:
            seconds = (result["imports"].get(name) if name in IMPORT_PHASES
                       else result["engine"].get("total") if name == "engine total"
                       else result[FROM_SPAWN] if name == FROM_SPAWN else result["engine"].get(name))
            note = result["notes"].get(name)
            cells.append("-" if seconds is None else f"{seconds:.2f}" + (f" ({note})" if note else ""))
        rows.append((name, cells))
    return rows


def format_table(results: list[dict]) -> str:
    header = ["phase (s)"] + [result["policy"] for result in results]
    rows = [[name] + cells for name, cells in phase_rows(results)]
    widths = [max(len(row[column]) for row in [header] + rows) for column in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in [header] + rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, engine_arguments = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="gpu-only,neo", help="comma-separated policies, one process each")
    parser.add_argument("--output", default=None, help="write the figures here as JSON")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each process may take")
    parser.add_argument("--measure-one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(own)
    if args.measure_one:
        print(json.dumps(measure_one(engine_arguments)), flush=True)
        return 0
    policies = [policy for policy in args.policies.split(",") if policy]
    if not policies:
        parser.error(f"--policies names no policy: {args.policies!r}")
    results = [measure_in_subprocess(policy, engine_arguments, args.timeout) for policy in policies]
    print(format_table(results))
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as file:
            json.dump({"engine_arguments": engine_arguments, "results": results}, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

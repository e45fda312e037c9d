"""The ``neo`` command: help with defaults, every bad value refused by the parser as a usage error
(status 2, one error line, no traceback), mistakes the engine finds as ``neo: error: ...``,
global flags on either side of the subcommand, ``neo bench``'s per-device defaults, the
host-memory pre-check, and Ctrl-C (status 130, ``neo: interrupted``) through the real console
script."""

import json
import os
import resource
import select
import shutil
import signal
import subprocess
import time

import pytest

from neo.cli import BENCH_DEFAULTS, INTERRUPTED_STATUS, build_parser, main
from neo.engine.host_memory_check import available_host_bytes
from neo.kv.kv_cache import GIB

COMMANDS = ("generate", "bench", "profile", "serve")
TINY_CPU = ["--model", "neo-tiny", "--device", "cpu"]
PROCESS_TIMEOUT_SECONDS = 120
PROGRESS_TIMEOUT_SECONDS = 60
SETTLE_SECONDS = 1.0


def subcommand_parsers():
    parser = build_parser()
    commands = next(action for action in parser._actions if action.dest == "command")
    return parser, commands.choices


def test_help_shows_a_line_and_the_default_of_every_flag():
    parser, commands = subcommand_parsers()
    assert "default policy is gpu-only" in parser.format_help().replace("\n", " ")
    shared = {action.dest for action in commands["generate"]._actions}
    for name, command in commands.items():
        for action in command._actions:
            if name != "serve" or action.dest in shared:  # the server's own flags are its module's
                assert action.help, f"neo {name} {action.option_strings} has no help"
        text = " ".join(command.format_help().split())
        assert "(default: None)" not in text and "(default: False)" not in text, name
        if "policy" in {action.dest for action in command._actions}:  # the engine's flags
            assert "(default: gpu-only)" in text and "(default: 256)" in text, name
    bench = " ".join(commands["bench"].format_help().split())
    assert all(f"{requests} on" in bench and workload in bench for requests, workload in BENCH_DEFAULTS.values())


@pytest.mark.parametrize("arguments, flag", [
    (["generate", "--device", "tpu"], "--device"),
    (["generate", "--device", "cuda:x"], "--device"),
    (["generate", "--dtype", "float64"], "--dtype"),
    (["--log-level", "bogus", "generate"], "--log-level"),
    (["generate", "--log-level", "bogus"], "--log-level"),
    (["generate", "--policy", "cpu-only"], "--policy"),
    (["generate", "--block-size", "12"], "--block-size"),
    (["generate", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["generate", "--max-num-batched-tokens", "-3"], "--max-num-batched-tokens"),
    (["generate", "--max-model-len", "1"], "--max-model-len"),
    (["generate", "--cpu-attention-threads", str((os.cpu_count() or 1) + 1)], "--cpu-attention-threads"),
    (["generate", "--gpu-kv-cache-gib", "0"], "--gpu-kv-cache-gib"),
    (["generate", "--cpu-kv-cache-gib", "-1"], "--cpu-kv-cache-gib"),
    (["generate", "--cpu-kv-cache-gib", "inf"], "--cpu-kv-cache-gib"),
    (["generate", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["generate", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "--temperature", "nan"], "--temperature"),
    (["generate", "--top-k", "two"], "--top-k"),
    (["generate", "--prompt-token-ids", "[1, -2]"], "--prompt-token-ids"),
    (["generate", "--prompt-token-ids", "not json"], "--prompt-token-ids"),
    (["bench", "--duration", "-1"], "--duration"),
    (["bench", "--duration", "0"], "--duration"),
    (["bench", "--num-requests", "0"], "--num-requests"),
    (["bench", "--torch-profile-iterations", "5"], "--torch-profile-iterations"),
    (["bench", "--torch-profile-iterations", "8:5"], "--torch-profile-iterations"),
    (["profile", "--seed", "1.5"], "--seed"),
])
def test_a_bad_value_is_a_usage_error_of_one_line(arguments, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("usage: neo") and "Traceback" not in error
    assert error.rstrip("\n").splitlines()[-1].startswith(f"neo") and f"error: argument {flag}" in error


def test_a_profile_window_without_a_directory_is_refused_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.setattr("neo.engine.LLMEngine", None)  # building an engine would fail differently
    assert main(["bench", "--device", "cpu", "--torch-profile-iterations", "5:8"]) == 2
    assert capsys.readouterr().err == ("neo: error: --torch-profile-iterations needs --torch-profiler-dir: "
                                       "where to write the timelines\n")


@pytest.mark.parametrize("arguments, message", [
    (["--temperature", "-1"], "neo: error: temperature must be >= 0"),
    (["--top-p", "0"], "neo: error: top_p must be in (0, 1]"),
    (["--policy", "neo", "--cpu-kv-cache-gib", "0"], "neo: error: policy 'neo' keeps KV on the host"),
    (["--model", "no-such-model"], "neo: error: unknown model 'no-such-model'"),
    (["--perf-model", "/nonexistent/perf.json", "--policy", "neo"], "neo: error: "),
])
def test_a_mistake_the_engine_finds_is_one_error_line(arguments, message, capsys):
    assert main(["generate", "--device", "cpu", *arguments]) == 2
    error = capsys.readouterr().err
    assert error.startswith(message) and error.count("\n") == 1 and "Traceback" not in error


@pytest.mark.parametrize("arguments, level", [
    (["generate"], "WARNING"),
    (["--log-level", "debug", "generate"], "DEBUG"),
    (["generate", "--log-level", "Info"], "INFO"),
    (["--log-level", "debug", "bench", "--log-level", "error"], "ERROR"),
])
def test_global_flags_go_before_or_after_the_command(arguments, level):
    assert build_parser().parse_args(arguments).log_level == level


def test_generate_prints_the_output(capsys):
    assert main(["generate", *TINY_CPU, "--prompt-token-ids", "[1, 2, 3]", "--max-tokens", "4", "--json"]) == 0
    output = json.loads(capsys.readouterr().out)
    assert output["prompt_token_ids"] == [1, 2, 3] and len(output["token_ids"]) == 4


def test_bench_defaults_on_the_cpu_finish_in_seconds(capsys):
    start = time.perf_counter()
    assert main(["bench", *TINY_CPU, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    requests, workload = BENCH_DEFAULTS["cpu"]
    assert (result["num_requests"], result["workload"], result["finished_requests"]) == (requests, workload, requests)
    assert time.perf_counter() - start < 60


def test_a_model_larger_than_host_memory_is_refused_before_loading(capsys):
    """An 8B model in float32 (32 GB of weights) on the CPU, with a host pool that makes the total
    exceed what this machine has whatever its size: refused in seconds, without allocating."""
    available = available_host_bytes()
    assert available is not None, "/proc/meminfo has no MemAvailable"
    host_pool_gib = max(1.0, (available - 30 * GIB) / GIB + 1)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    status = main(["generate", "--model", "llama-3.1-8b", "--load-format", "dummy", "--device", "cpu",
                   "--cpu-kv-cache-gib", str(host_pool_gib)])
    assert status == 2 and time.perf_counter() - start < 30
    peak_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before
    assert peak_growth < GIB
    error = capsys.readouterr().err
    assert error.startswith("neo: error: model 'llama-3.1-8b' on cpu needs ") and error.count("\n") == 1
    for part in ("weights (float32) 29.92 GiB", "GiB are available", "smaller model", "dtype='bfloat16'",
                 "cpu_kv_cache_gib"):
        assert part in error


def test_ctrl_c_ends_the_command_with_one_line():
    """``neo bench`` (the console script) interrupted once its progress shows: status 130, the
    last line ``neo: interrupted``, no traceback. SIGINT is reset to its default in the child, so
    the test holds even where the test runner itself ignores it."""
    executable = shutil.which("neo") or pytest.fail("the neo console script is not installed")
    process = subprocess.Popen([executable, "bench", *TINY_CPU, "--num-requests", "20000"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        error = b""
        deadline = time.monotonic() + PROGRESS_TIMEOUT_SECONDS
        while b"%|" not in error:  # the progress bar
            remaining = deadline - time.monotonic()
            assert remaining > 0 and process.poll() is None, f"no progress shown: {error.decode()!r}"
            ready, _, _ = select.select([process.stderr], [], [], remaining)
            if ready:
                error += os.read(process.stderr.fileno(), 65536)
        time.sleep(SETTLE_SECONDS)  # past the bar's set-up, into the engine's iterations
        process.send_signal(signal.SIGINT)
        error += process.communicate(timeout=PROCESS_TIMEOUT_SECONDS)[1]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=PROCESS_TIMEOUT_SECONDS)
    text = error.decode()
    assert process.returncode == INTERRUPTED_STATUS, text
    assert "Traceback" not in text and "ERROR" not in text, text
    assert text.replace("\r", "\n").rstrip("\n").splitlines()[-1] == "neo: interrupted"

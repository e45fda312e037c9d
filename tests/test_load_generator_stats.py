"""The load generator's statistics (benchmarks/online_stats.py) on hand-made request records,
its arrival plans, and ``--mode report`` on a sweep written before ITL and goodput existed."""

import json
import os
import shutil
import statistics
import subprocess
import sys

import pytest

from benchmark_modules import BENCHMARKS, benchmark_module

OLD_SWEEP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "online-sweep-before-goodput.json")


online_stats = benchmark_module("online_stats")
online_client = benchmark_module("online_client")


def record(index: int, ttft: float | None, latency: float | None, output_tokens: int = 5,
           error: str | None = None, repeat: int = 0, itl: list[float] | None = None) -> dict:
    """A finished request's record (``error`` None) or an unfinished/failed one, as the client
    writes them; ``itl`` left out to stand for a record written before ITL was recorded."""
    finished = error is None
    entry = {"index": index, "prompt_tokens": 10, "requested_output_tokens": output_tokens,
             "scheduled_offset": 0.1 * index, "send_offset": 0.1 * index,
             "output_tokens": output_tokens if finished else 2,
             "ttft": ttft if finished else None, "latency": latency if finished else None,
             "tpot": (latency - ttft) / (output_tokens - 1) if finished and output_tokens > 1 else None,
             "per_token_latency": latency / output_tokens if finished else None,
             "finish_reason": "length" if finished else None, "error": error, "repeat": repeat}
    if itl is not None:
        entry["itl"] = itl
    return entry


def ten_requests(unfinished: int) -> list[dict]:
    """Ten requests: TTFT 0.1 s, E2EL 0.5 s (TPOT 0.1 s over 5 tokens), the last ``unfinished``
    of them cut off at the drain timeout."""
    records = [record(index, 0.1, 0.5, itl=[0.1] * 4) for index in range(10 - unfinished)]
    return records + [record(index, None, None, error="unfinished 300 s after the last request was sent")
                      for index in range(10 - unfinished, 10)]


def test_describe_gives_mean_median_p90_p99():
    values = [float(value) for value in range(1, 101)]
    assert online_stats.describe(values) == {"mean": 50.5, "median": 50.5, "p90": pytest.approx(90.1),
                                             "p99": pytest.approx(99.01)}
    assert online_stats.describe([]) == dict.fromkeys(("mean", "median", "p90", "p99"))


def test_parse_goodput_takes_vllm_format():
    assert online_stats.parse_goodput(["ttft:2000", "tpot:100", "e2el:30000.5"]) == {
        "ttft": 2.0, "tpot": 0.1, "e2el": pytest.approx(30.0005)}
    assert online_stats.parse_goodput([]) == {}


@pytest.mark.parametrize("items, problem", [
    (["ttft=2000"], "expected NAME:MILLISECONDS"),
    (["itl:10"], "NAME one of ttft, tpot, e2el"),
    (["tpot:fast"], "'fast' is not a number"),
    (["tpot:0"], "must be > 0 ms"),
    (["tpot:-5"], "must be > 0 ms"),
    (["ttft:1", "ttft:2"], "given twice"),
])
def test_parse_goodput_names_the_bad_objective(items, problem):
    with pytest.raises(ValueError, match=problem) as error:
        online_stats.parse_goodput(items)
    assert "--goodput" in str(error.value)


def test_unfinished_requests_are_goodput_misses_and_counted_beside_every_figure():
    objectives = {"ttft": 0.2, "tpot": 0.15}
    summary = online_stats.summarize(ten_requests(unfinished=1), 2.0, objectives)
    assert (summary["sent"], summary["completed"], summary["unfinished"], summary["failed"]) == (10, 9, 1, 0)
    assert summary["goodput"] == {"objectives_s": objectives, "good": 9, "fraction": 0.9, "left_out": 1}
    for name in ("ttft", "tpot", "itl", "e2el", "per_token_latency"):
        assert summary[name]["left_out"] == 1
    assert summary["ttft"]["requests"] == summary["e2el"]["requests"] == 9
    assert summary["ttft"]["mean"] == pytest.approx(0.1) and summary["e2el"]["p99"] == pytest.approx(0.5)
    assert summary["tpot"]["median"] == pytest.approx(0.1) and summary["itl"]["mean"] == pytest.approx(0.1)
    # Nine requests sent 0.1 s apart, the last finishing at 0.8 + 0.5 s.
    assert summary["requests_per_s"] == pytest.approx(9 / 1.3)
    assert summary["output_tokens_per_s"] == pytest.approx(45 / 1.3)
    assert summary["goodput_requests_per_s"] == pytest.approx(9 / 1.3)
    # At target 0.9 this rate counts; with a second unfinished request it does not.
    worse = online_stats.summarize(ten_requests(unfinished=2), 4.0, objectives)
    assert worse["goodput"]["fraction"] == 0.8
    points = [(2.0, summary["goodput"]["fraction"]), (4.0, worse["goodput"]["fraction"])]
    assert online_stats.goodput_rate(points, 0.9) == {"rate": 2.0, "bound": "exact"}
    assert online_stats.goodput_rate(points, 0.8) == {"rate": 4.0, "bound": "at least"}


def test_each_objective_decides_on_its_own():
    records = [record(0, 0.1, 0.5), record(1, 0.3, 0.5), record(2, 0.1, 0.9), record(3, 0.1, 0.2, output_tokens=1),
               record(4, None, None, error="HTTP 500: boom")]
    # TPOT: 0.1, 0.05, 0.2, none (one token: meets any TPOT objective).
    summary = online_stats.summarize(records, 1.0, {"ttft": 0.2, "tpot": 0.15})
    assert summary["goodput"]["good"] == 2 and summary["failed"] == 1
    summary = online_stats.summarize(records, 1.0, {"e2el": 0.6})
    assert summary["goodput"]["good"] == 3
    assert online_stats.summarize(records, 1.0, {})["goodput"]["fraction"] is None


def test_records_without_itl_give_no_itl_statistics():
    records = [record(index, 0.1, 0.5) for index in range(4)]
    summary = online_stats.summarize(records, 1.0, {"tpot": 0.2})
    assert summary["itl"]["mean"] is None and summary["itl"]["requests"] == 0
    assert summary["tpot"]["mean"] == pytest.approx(0.1) and summary["goodput"]["fraction"] == 1.0


def test_goodput_rate_interpolates_the_crossing():
    points = [(1.0, 1.0), (2.0, 0.95), (3.0, 0.75), (4.0, 0.1)]
    assert online_stats.goodput_rate(points, 0.9) == {"rate": pytest.approx(2.25), "bound": "exact"}
    assert online_stats.goodput_rate(points, 0.05) == {"rate": 4.0, "bound": "at least"}
    assert online_stats.goodput_rate([(0.5, 0.5), (1.0, 0.2)], 0.9) == {"rate": 0.5, "bound": "below"}
    assert online_stats.goodput_rate([], 0.9) == {"rate": None, "bound": None}


def test_goodput_rates_give_ratios_with_their_bounds():
    curves = {"gpu-only": [(1.0, 1.0), (2.0, 0.95), (3.0, 0.75)],
              "neo": [(1.0, 1.0), (2.0, 1.0), (3.0, 0.95)],
              "full-offload": [(1.0, 0.5), (2.0, 0.1)]}
    result = online_stats.goodput_rates(curves, "gpu-only", 0.9)
    assert result["policies"]["gpu-only"]["ratio_to_reference"] == 1.0
    assert result["policies"]["neo"] == {"rate": 3.0, "bound": "at least",
                                         "ratio_to_reference": pytest.approx(3.0 / 2.25),
                                         "ratio_bound": "at least"}
    assert result["policies"]["full-offload"] == {"rate": 1.0, "bound": "below"}


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_keep_the_rate_and_spread_by_burstiness(burstiness):
    """Gaps have mean 1/rate and a coefficient of variation of 1/sqrt(burstiness)."""
    planned = online_client.plan_requests("synthetic:input=10,output=5", "poisson", 8.0, 10_000.0,
                                          4000, 7, 4096, burstiness)
    gaps = [later.send_offset - earlier.send_offset for earlier, later in zip(planned, planned[1:])]
    mean = statistics.fmean(gaps)
    assert len(planned) == 4000 and mean == pytest.approx(1 / 8.0, rel=0.1)
    assert statistics.pstdev(gaps) / mean == pytest.approx(burstiness ** -0.5, rel=0.1)


def test_trace_arrivals_need_arrival_times(tmp_path):
    path = tmp_path / "lengths.jsonl"
    path.write_text('{"prompt_len": 10, "output_len": 4}\n')
    with pytest.raises(ValueError, match="need a workload with arrival times"):
        online_client.plan_requests(f"file:{path}", "trace", None, 60.0, 10, 0, 4096)
    with pytest.raises(ValueError, match="burstiness 2 applies to poisson arrivals"):
        online_client.plan_requests("azure-code", "scaled", 1.0, 60.0, 10, 0, 4096, 2.0)
    path.write_text('{"prompt_len": 10, "output_len": 4, "arrival_s": 5}\n'
                    '{"prompt_len": 20, "output_len": 4, "arrival_s": 5.5}\n')
    planned = online_client.plan_requests(f"file:{path}", "trace", None, 60.0, 10, 0, 4096)
    assert [(item.send_offset, item.prompt_len) for item in planned] == [(0.0, 10), (0.5, 20)]


def test_report_mode_analyzes_a_sweep_written_before_goodput(tmp_path):
    """A sweep JSON written by the load generator before ITL, goodput and the field's
    statistics were recorded: its records still give TTFT, TPOT, E2EL and goodput."""
    shutil.copy(OLD_SWEEP, tmp_path / "online-old-sweep.json")
    completed = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "online.py"), "--mode", "report", "--tag", "old",
         "--output-dir", str(tmp_path), "--goodput", "ttft:30", "tpot:5"],
        capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    with open(tmp_path / "online-old-sweep.json") as file:
        results = json.load(file)
    with open(OLD_SWEEP) as file:
        before = json.load(file)
    assert [(entry["policy"], entry["rate"]) for entry in results["summaries"]] == [
        (entry["policy"], entry["rate"]) for entry in before["summaries"]]
    for summary, old in zip(results["summaries"], before["summaries"]):
        assert summary["engine"] == old["engine"] and summary["completed"] == old["completed"]
        assert summary["ttft"]["mean"] == pytest.approx(old["ttft"]["mean"])
        assert summary["e2el"]["p99"] == pytest.approx(old["latency"]["p99"])
        assert summary["itl"]["mean"] is None
        level = [entry for entry in before["records"]
                 if (entry["policy"], entry["rate"]) == (summary["policy"], summary["rate"])]
        good = sum(entry["ttft"] <= 0.030 and entry["tpot"] <= 0.005 for entry in level)
        assert summary["goodput"]["fraction"] == pytest.approx(good / len(level))
    assert results["goodput"]["objectives_s"] == {"ttft": 0.030, "tpot": 0.005}
    assert set(results["goodput"]["policies"]) == {"gpu-only", "neo"}
    assert "goodput rate" in completed.stdout and "ttft <= 30 ms, tpot <= 5 ms" in completed.stdout
    for name in ("latency-goodput-vs-rate", "latency-vs-rate", "latency-cdf"):
        with open(tmp_path / f"online-old-{name}.png", "rb") as file:
            assert file.read(8) == b"\x89PNG\r\n\x1a\n"


def test_report_mode_places_levels_at_the_achieved_arrival_rate(tmp_path):
    """``--rate-axis achieved``: the goodput rate is interpolated over the arrival rates the
    levels' requests were sent at, not the rates asked for."""
    shutil.copy(OLD_SWEEP, tmp_path / "online-old-sweep.json")
    completed = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "online.py"), "--mode", "report", "--tag", "old",
         "--output-dir", str(tmp_path), "--goodput", "ttft:30", "tpot:5", "--rate-axis", "achieved"],
        capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    with open(tmp_path / "online-old-sweep.json") as file:
        results = json.load(file)
    assert results["goodput"]["rate_axis"] == "achieved"
    assert "highest arrival rate achieved" in completed.stdout
    for policy in ("gpu-only", "neo"):
        points = [(summary["achieved_rate"], summary["goodput"]["fraction"])
                  for summary in results["summaries"] if summary["policy"] == policy]
        assert all(rate != summary["rate"] for (rate, _), summary in zip(
            points, [s for s in results["summaries"] if s["policy"] == policy]))
        expected = online_stats.goodput_rate(points, results["goodput"]["target"])
        assert results["goodput"]["policies"][policy]["rate"] == pytest.approx(expected["rate"])
        assert results["goodput"]["policies"][policy]["bound"] == expected["bound"]

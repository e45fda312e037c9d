"""Statistics of the online benchmark, in the terms of vLLM's ``bench serve``: per load level
TTFT, TPOT, ITL and end-to-end latency (E2EL) percentiles, request and output token
throughput, and goodput under latency objectives; over a sweep, the goodput rate (the highest
request rate at which a target fraction of requests meets the objectives). Second, where each
policy's per-token latency curve bends (its "knee").

Everything here works on request records as dicts, as the client writes them
(``online_client.RequestRecord``); records written before ``itl`` was recorded lack it, and
their ITL statistics are None.

Definitions, per request: TTFT = send -> first token; E2EL (``latency``) = send -> last token;
TPOT = (E2EL - TTFT) / (output tokens - 1), for requests of two or more tokens; ITL = every gap
between successive token events (pooled over requests). Latency statistics cover the finished
requests; the unfinished ones (not done by the drain timeout, or failed) are counted beside
every figure, and in goodput they count as misses.
"""

import math

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el", "per_token_latency")
RECORD_FIELDS = {"ttft": "ttft", "tpot": "tpot", "e2el": "latency", "per_token_latency": "per_token_latency"}
STATISTICS = ("mean", "median", "p90", "p99")
OBJECTIVES = ("ttft", "tpot", "e2el")


def describe(values: list[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 of ``values`` (None when empty)."""
    if not values:
        return dict.fromkeys(STATISTICS)
    array = np.asarray(values, dtype=np.float64)
    return {"mean": float(array.mean()), "median": float(np.median(array)),
            "p90": float(np.percentile(array, 90)), "p99": float(np.percentile(array, 99))}


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``["ttft:2000", "tpot:100"]`` (milliseconds, vLLM's ``--goodput`` format) ->
    ``{"ttft": 2.0, "tpot": 0.1}`` (seconds)."""
    objectives = {}
    for item in items:
        name, separator, value = item.partition(":")
        if name not in OBJECTIVES or not separator:
            raise ValueError(f"--goodput {item!r}: expected NAME:MILLISECONDS with NAME one of "
                             f"{', '.join(OBJECTIVES)}")
        try:
            milliseconds = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not (math.isfinite(milliseconds) and milliseconds > 0):
            raise ValueError(f"--goodput {item!r}: the objective must be > 0 ms, got {value}")
        if name in objectives:
            raise ValueError(f"--goodput {item!r}: {name} is given twice")
        objectives[name] = milliseconds / 1000
    return objectives


def completed(record: dict) -> bool:
    return record["error"] is None and record["latency"] is not None


def meets_objectives(record: dict, objectives: dict[str, float]) -> bool:
    """Whether a request finished within every objective (seconds). A one-token request has no
    time per output token and meets any TPOT objective."""
    if not completed(record):
        return False
    values = {"ttft": record["ttft"], "tpot": record["tpot"] or 0.0, "e2el": record["latency"]}
    return all(values[name] <= limit for name, limit in objectives.items())


def summarize(records: list[dict], rate: float | None, objectives: dict[str, float]) -> dict:
    """One load level: counts, achieved arrival rate, throughput, latency statistics over the
    finished requests (seconds), and goodput. ``records``: ``RequestRecord`` dicts of every
    repeat, each with a ``repeat`` key. Each latency entry carries ``requests`` (how many
    requests gave values) and ``left_out`` (requests sent but not finished)."""
    done = [record for record in records if completed(record)]
    unfinished = [record for record in records
                  if record["error"] and record["error"].startswith("unfinished")]
    left_out = len(records) - len(done)
    summary = {
        "rate": rate,
        "sent": len(records),
        "completed": len(done),
        "unfinished": len(unfinished),
        "failed": left_out - len(unfinished),
        "achieved_rate": _achieved_rate(records),
        **_throughput(records, objectives),
    }
    for name in LATENCY_METRICS:
        if name == "itl":
            timed = [record for record in done if "itl" in record]
            values = [gap for record in timed for gap in record["itl"]]
        else:
            timed = [record for record in done if record[RECORD_FIELDS[name]] is not None]
            values = [record[RECORD_FIELDS[name]] for record in timed]
        summary[name] = describe(values) | {"requests": len(timed), "left_out": left_out}
    good = sum(meets_objectives(record, objectives) for record in records) if objectives else None
    summary["goodput"] = {
        "objectives_s": objectives,
        "good": good,
        "fraction": good / len(records) if objectives and records else None,
        "left_out": left_out,
    }
    by_repeat: dict[int, list[float]] = {}
    for record in done:
        by_repeat.setdefault(record["repeat"], []).append(record["per_token_latency"])
    repeat_means = [float(np.mean(values)) for _, values in sorted(by_repeat.items())]
    summary["per_token_latency_mean_by_repeat"] = repeat_means
    summary["repeat_spread"] = ((max(repeat_means) - min(repeat_means)) / np.mean(repeat_means)
                                if len(repeat_means) > 1 else None)
    return summary


def _achieved_rate(records: list[dict]) -> float | None:
    """Requests per second actually sent: (n - 1) / span of the send times, per repeat, averaged."""
    rates = []
    for repeat in {record["repeat"] for record in records}:
        sends = sorted(record["send_offset"] for record in records
                       if record["repeat"] == repeat and record["send_offset"] is not None)
        if len(sends) > 1 and sends[-1] > sends[0]:
            rates.append((len(sends) - 1) / (sends[-1] - sends[0]))
    return float(np.mean(rates)) if rates else None


def _throughput(records: list[dict], objectives: dict[str, float]) -> dict[str, float | None]:
    """Finished requests, their output tokens, and requests meeting the objectives, per second
    from the first send to the last finished request's last token; per repeat, averaged."""
    figures: dict[str, list[float]] = {"requests_per_s": [], "output_tokens_per_s": [],
                                       "goodput_requests_per_s": []}
    for repeat in {record["repeat"] for record in records}:
        done = [record for record in records if record["repeat"] == repeat and completed(record)]
        if not done:
            continue
        span = max(record["send_offset"] + record["latency"] for record in done) - min(
            record["send_offset"] for record in done)
        if span > 0:
            figures["requests_per_s"].append(len(done) / span)
            figures["output_tokens_per_s"].append(sum(record["output_tokens"] for record in done) / span)
            if objectives:
                good = sum(meets_objectives(record, objectives) for record in done)
                figures["goodput_requests_per_s"].append(good / span)
    return {name: float(np.mean(values)) if values else None for name, values in figures.items()}


def load_position(summary: dict) -> float | None:
    """Where a load level sits on the rate axis: its target rate, or for the trace's own
    timing the rate achieved."""
    return summary["rate"] if summary["rate"] is not None else summary["achieved_rate"]


def level_position(summary: dict, rate_axis: str) -> float | None:
    """A load level's place on the rate axis: "offered" (``load_position``) or "achieved"
    (the arrival rate its requests were sent at)."""
    return load_position(summary) if rate_axis == "offered" else summary["achieved_rate"]


def goodput_rate(points: list[tuple[float, float]], target: float) -> dict:
    """The highest request rate at which a fraction >= ``target`` of requests meets the
    objectives.

    points: (rate, fraction meeting the objectives). The first crossing from the lowest rate
    up is interpolated linearly between the last rate at or above the target and the first one
    below it. ``bound``:
    "exact", "at least" (never crossed: the highest rate tested) or "below" (under the target
    already at the lowest rate tested, which ``rate`` then holds).
    """
    points = sorted(points)
    if not points:
        return {"rate": None, "bound": None}
    if points[0][1] < target:
        return {"rate": points[0][0], "bound": "below"}
    for (rate0, fraction0), (rate1, fraction1) in zip(points, points[1:]):
        if fraction1 < target:
            share = (fraction0 - target) / (fraction0 - fraction1)
            return {"rate": rate0 + share * (rate1 - rate0), "bound": "exact"}
    return {"rate": points[-1][0], "bound": "at least"}


def goodput_rates(curves: dict[str, list[tuple[float, float]]], reference: str, target: float) -> dict:
    """Each policy's goodput rate (``curves``: policy -> (rate, fraction)), and its ratio to
    the reference policy's. The ratio's ``ratio_bound`` says what it is: "exact" (both rates
    exact), "at least" (this policy never crossed), "at most" (the reference never crossed);
    no ratio where either is below its lowest rate or both never crossed."""
    result = {"target": target, "reference": reference, "policies": {}}
    for policy, points in curves.items():
        result["policies"][policy] = goodput_rate(points, target)
    base = result["policies"].get(reference)
    for policy, entry in result["policies"].items():
        if base is None or None in (entry["bound"], base["bound"]) or "below" in (entry["bound"], base["bound"]):
            continue
        bounds = (entry["bound"], base["bound"])
        if bounds == ("at least", "at least") and policy != reference:
            continue
        entry["ratio_to_reference"] = entry["rate"] / base["rate"]
        entry["ratio_bound"] = ("exact" if policy == reference or bounds == ("exact", "exact")
                                else "at least" if bounds[0] == "at least" else "at most")
    return result


def knee_value(summary: dict) -> float:
    """The curve value the knee looks at: mean per-token latency, infinite when requests
    were still unfinished at the end of the load level (the load was not sustained)."""
    mean = summary["per_token_latency"]["mean"]
    return math.inf if summary["unfinished"] or mean is None else mean


def sustainable_rate(points: list[tuple[float, float]], threshold: float) -> dict:
    """The highest request rate whose value stays under ``threshold``.

    points: (rate, value) pairs. The crossing is interpolated linearly between the last rate
    under the threshold and the first one over it (or taken at the last rate under it when
    the next value is infinite). ``bound``: "exact", "at least" (never crossed: the highest
    rate tested) or "below" (already over it at the lowest rate).
    """
    points = sorted(points)
    if not points or points[0][1] > threshold:
        return {"rate": points[0][0] if points else None, "bound": "below"}
    for (rate0, value0), (rate1, value1) in zip(points, points[1:]):
        if value1 > threshold:
            if math.isinf(value1):
                return {"rate": rate0, "bound": "at least"}
            fraction = (threshold - value0) / (value1 - value0)
            return {"rate": rate0 + fraction * (rate1 - rate0), "bound": "exact"}
    return {"rate": points[-1][0], "bound": "at least"}


def knees(curves: dict[str, list[tuple[float, float]]], reference: str, factor: float,
          slo: float | None) -> dict:
    """Knee analysis over ``curves`` (policy -> (rate, mean per-token latency)).

    Each policy's own knee: where its curve passes ``factor`` x its lowest-rate value (or the
    SLO). The comparison: every policy at the reference policy's threshold, and each one's
    rate over the reference's.
    """
    result = {"factor": factor, "slo_s": slo, "own": {}, "at_reference": {}, "reference": reference}
    for policy, points in curves.items():
        finite = sorted(point for point in points if math.isfinite(point[1]))
        if not finite:
            continue
        threshold = slo if slo is not None else factor * finite[0][1]
        result["own"][policy] = {"threshold_s": threshold, **sustainable_rate(points, threshold)}
    if reference not in result["own"]:
        return result
    threshold = result["own"][reference]["threshold_s"]
    result["reference_threshold_s"] = threshold
    reference_rate = result["own"][reference]["rate"]
    for policy, points in curves.items():
        entry = sustainable_rate(points, threshold)
        if reference_rate and entry["rate"] is not None and entry["bound"] != "below":
            entry["ratio_to_reference"] = entry["rate"] / reference_rate
        result["at_reference"][policy] = entry
    return result


def compare_to_reference(summaries: list[dict], reference: str) -> list[dict]:
    """Per policy and load level: mean per-token latency over the reference policy's at the
    same level, with both levels' spread over repeats (the noise to judge the ratio by)."""
    by_key = {(summary["policy"], summary["rate"]): summary for summary in summaries}
    rows = []
    for summary in summaries:
        base = by_key.get((reference, summary["rate"]))
        if summary["policy"] == reference or base is None:
            continue
        mean, base_mean = summary["per_token_latency"]["mean"], base["per_token_latency"]["mean"]
        rows.append({"policy": summary["policy"], "rate": summary["rate"],
                     "mean_ratio": mean / base_mean if mean and base_mean else None,
                     "spread": summary["repeat_spread"], "reference_spread": base["repeat_spread"]})
    return rows

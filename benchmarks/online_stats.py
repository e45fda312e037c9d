"""Summaries of the online benchmark: per-load statistics, and where each policy's latency
curve bends (its "knee")."""

import math

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "latency", "per_token_latency")
STATISTICS = ("mean", "p50", "p90", "p99")


def describe(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 of ``values`` (None when empty)."""
    if not values:
        return dict.fromkeys(STATISTICS)
    array = np.asarray(values, dtype=np.float64)
    return {"mean": float(array.mean()), "p50": float(np.percentile(array, 50)),
            "p90": float(np.percentile(array, 90)), "p99": float(np.percentile(array, 99))}


def summarize(records: list[dict], rate: float | None) -> dict:
    """One load level: counts, achieved arrival rate, output throughput, and statistics of
    each latency metric over the completed requests (seconds). ``records``: ``RequestRecord``
    dicts of every repeat, each with a ``repeat`` key."""
    completed = [record for record in records if _completed(record)]
    unfinished = [record for record in records
                  if record["error"] and record["error"].startswith("unfinished")]
    summary = {
        "rate": rate,
        "sent": len(records),
        "completed": len(completed),
        "unfinished": len(unfinished),
        "failed": len(records) - len(completed) - len(unfinished),
        "achieved_rate": _achieved_rate(records),
        "output_tokens_per_s": _throughput(records),
    }
    for name in LATENCY_METRICS:
        summary[name] = describe([record[name] for record in completed if record[name] is not None])
    by_repeat: dict[int, list[float]] = {}
    for record in completed:
        by_repeat.setdefault(record["repeat"], []).append(record["per_token_latency"])
    repeat_means = [float(np.mean(values)) for _, values in sorted(by_repeat.items())]
    summary["per_token_latency_mean_by_repeat"] = repeat_means
    summary["repeat_spread"] = ((max(repeat_means) - min(repeat_means)) / np.mean(repeat_means)
                                if len(repeat_means) > 1 else None)
    return summary


def _completed(record: dict) -> bool:
    return record["error"] is None and record["latency"] is not None


def _achieved_rate(records: list[dict]) -> float | None:
    """Requests per second actually sent: (n - 1) / span of the send times, per repeat, averaged."""
    rates = []
    for repeat in {record["repeat"] for record in records}:
        sends = sorted(record["send_offset"] for record in records
                       if record["repeat"] == repeat and record["send_offset"] is not None)
        if len(sends) > 1 and sends[-1] > sends[0]:
            rates.append((len(sends) - 1) / (sends[-1] - sends[0]))
    return float(np.mean(rates)) if rates else None


def _throughput(records: list[dict]) -> float | None:
    """Output tokens of completed requests per second, from the first send to the last token."""
    totals = []
    for repeat in {record["repeat"] for record in records}:
        done = [record for record in records if record["repeat"] == repeat and _completed(record)]
        if done:
            span = max(record["send_offset"] + record["latency"] for record in done) - min(
                record["send_offset"] for record in done)
            if span > 0:
                totals.append(sum(record["output_tokens"] for record in done) / span)
    return float(np.mean(totals)) if totals else None


def load_position(summary: dict) -> float | None:
    """Where a load level sits on the rate axis: its target rate, or for the trace's own
    timing the rate achieved."""
    return summary["rate"] if summary["rate"] is not None else summary["achieved_rate"]


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

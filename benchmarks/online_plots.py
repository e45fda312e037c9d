"""PNG plots of the online benchmark (matplotlib, Agg backend: no display needed)."""

import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)
import numpy as np  # noqa: E402
from online_stats import level_position  # noqa: E402

# The x axis of the plots against load, by ``--rate-axis``.
RATE_AXIS_LABELS = {"offered": "request rate (requests/s)",
                    "achieved": "arrival rate achieved (requests/s)"}

MILLISECONDS = 1000.0


def plot_field_metrics(summaries: dict[str, list[dict]], goodput: dict | None, title: str,
                       path: str, rate_axis: str = "offered") -> None:
    """TTFT, TPOT and ITL (median, p90, p99; ms) and the fraction of requests meeting the
    goodput objectives against request rate: one color per policy, one line style per
    statistic. The goodput panel marks the target fraction and each policy's goodput rate."""
    figure, axes = plt.subplots(2, 2, figsize=(13, 9), sharex=True)
    styles = {"median": "-", "p90": "--", "p99": ":"}
    colors = {policy: f"C{index}" for index, policy in enumerate(summaries)}
    for axis, metric in zip(axes.flat, ("ttft", "tpot", "itl")):
        for policy, levels in summaries.items():
            for statistic, style in styles.items():
                points = sorted((level_position(level, rate_axis), level[metric][statistic]) for level in levels
                                if level[metric][statistic] is not None and level_position(level, rate_axis) is not None)
                if points:
                    rates, values = zip(*points)
                    axis.plot(rates, np.asarray(values) * MILLISECONDS, linestyle=style, marker="o",
                              markersize=3, color=colors[policy], label=f"{policy} {statistic}")
        axis.set_title(f"{metric.upper()} (finished requests)")
        axis.set_ylabel("ms")
        axis.grid(True, alpha=0.3)
        if axis.lines:
            axis.legend(fontsize=7)
        else:  # sweeps written before ITL was recorded
            axis.text(0.5, 0.5, "not recorded in this sweep", ha="center", transform=axis.transAxes)
    axis = axes[1, 1]
    for policy, levels in summaries.items():
        points = sorted((level_position(level, rate_axis), level["goodput"]["fraction"]) for level in levels
                        if level["goodput"]["fraction"] is not None and level_position(level, rate_axis) is not None)
        if points:
            rates, fractions = zip(*points)
            axis.plot(rates, fractions, marker="o", color=colors[policy], label=policy)
    if goodput:
        axis.axhline(goodput["target"], color="gray", linestyle="--", linewidth=1,
                     label=f"target {goodput['target']:g}")
        for policy, entry in goodput["policies"].items():
            if entry["bound"] == "exact":
                axis.axvline(entry["rate"], color=colors.get(policy, "gray"), linestyle=":", linewidth=0.8)
        objectives = ", ".join(f"{name} <= {limit * MILLISECONDS:g} ms"
                               for name, limit in goodput["objectives_s"].items())
        axis.set_title(f"fraction of requests meeting {objectives}", fontsize=9)
    else:
        axis.set_title("goodput: no objectives given (--goodput)")
    axis.set_ylim(-0.02, 1.02)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=7)
    for axis in axes[1]:
        axis.set_xlabel(RATE_AXIS_LABELS[rate_axis])
    figure.suptitle("\n".join(textwrap.wrap(title, 160)), fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_latency_vs_rate(summaries: dict[str, list[dict]], knee: dict | None, title: str,
                         path: str, rate_axis: str = "offered") -> None:
    """Mean, p90 and p99 per-token latency (ms) against request rate, one curve per policy.
    The mean panel also shows the knee threshold and each policy's rate at it."""
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.8), sharex=True)
    for axis, statistic in zip(axes, ("mean", "p90", "p99")):
        for policy, levels in summaries.items():
            points = sorted((level_position(level, rate_axis), level["per_token_latency"][statistic])
                            for level in levels if level["per_token_latency"][statistic] is not None
                            and level_position(level, rate_axis) is not None)
            if points:
                rates, values = zip(*points)
                axis.plot(rates, np.asarray(values) * MILLISECONDS, marker="o", label=policy)
        axis.set_title(f"{statistic} per-token latency")
        axis.set_xlabel(RATE_AXIS_LABELS[rate_axis])
        axis.set_ylabel("latency / output tokens (ms)")
        axis.grid(True, alpha=0.3)
    if knee and knee.get("reference_threshold_s") is not None:
        threshold = knee["reference_threshold_s"] * MILLISECONDS
        axes[0].axhline(threshold, color="gray", linestyle="--", linewidth=1,
                        label=f"threshold ({threshold:.1f} ms)")
        for policy, entry in knee["at_reference"].items():
            if entry["rate"] is not None and entry["bound"] != "below":
                axes[0].axvline(entry["rate"], color="gray", linestyle=":", linewidth=0.8)
    axes[0].legend()
    figure.suptitle("\n".join(textwrap.wrap(title, 160)), fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_latency_cdf(records: dict[str, list[dict]], rate_label: str, title: str, path: str) -> None:
    """Distribution (CDF) of per-token latency at one load level, one curve per policy.
    records: policy -> completed ``RequestRecord`` dicts of that level."""
    figure, axis = plt.subplots(figsize=(7, 4.8))
    for policy, level_records in records.items():
        values = np.sort([record["per_token_latency"] for record in level_records]) * MILLISECONDS
        if len(values):
            axis.step(values, np.arange(1, len(values) + 1) / len(values), where="post",
                      label=f"{policy} ({len(values)} requests)")
    axis.set_xlabel("latency / output tokens (ms)")
    axis.set_ylabel("fraction of requests")
    lines = textwrap.wrap(title, 80) + [f"per-token latency distribution at {rate_label}"]
    axis.set_title("\n".join(lines), fontsize=9)
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

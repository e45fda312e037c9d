"""Gain maps of ``neo simulate --plot``: neo's simulated output tokens/s over gpu-only's, run to
completion.

- ``heatmap``: over host read bandwidth (saturation, and per thread enough to reach it) and
  the GPU KV pool size, for one model, machine and workload;
- ``cores``: against the host cores of a list of machines (by default the A10G series, whose
  host memory bandwidth grows with its vCPUs).

``gain_grid`` and ``gain_by_cores`` compute the figures; ``draw_heatmap`` and ``draw_cores`` draw
them (matplotlib, no display needed).
"""

import dataclasses

from .hardware import Hardware, with_overrides
from .scenario import Scenario, run_scenario


def gain(scenario: Scenario) -> float:
    """neo / gpu-only output tokens per second."""
    gpu_only, neo = run_scenario(dataclasses.replace(scenario, policies=("gpu-only", "neo")))
    return neo.output_tokens_per_s / gpu_only.output_tokens_per_s


def gain_grid(scenario: Scenario, host_read_gbps: list[float], gpu_kv_cache_gib: list[float]) -> list[list[float]]:
    """``[pool][bandwidth]`` gains: each host read bandwidth is the saturation bandwidth, reached
    with the hardware's attention threads."""
    hardware = scenario.hardware
    threads = max(1, hardware.host_attention_threads)
    grid = []
    for pool in gpu_kv_cache_gib:
        row = []
        for bandwidth in host_read_gbps:
            machine = with_overrides(hardware, {"host_read_gbps": bandwidth,
                                                "host_read_gbps_per_thread": max(hardware.host_read_gbps_per_thread,
                                                                                 bandwidth / threads)})
            row.append(gain(dataclasses.replace(scenario, hardware=machine, gpu_kv_cache_gib=pool)))
        grid.append(row)
    return grid


def gain_by_cores(scenario: Scenario, machines: list[Hardware]) -> list[tuple[int, float]]:
    """(host cores, gain) per machine, in the list's order."""
    return [(machine.host_cores, gain(dataclasses.replace(scenario, hardware=machine))) for machine in machines]


def draw_heatmap(scenario: Scenario, host_read_gbps: list[float], gpu_kv_cache_gib: list[float], path: str) -> None:
    """The ``heatmap`` plot (see the module docstring) as a PNG at ``path``."""
    plt = _pyplot()
    grid = gain_grid(scenario, host_read_gbps, gpu_kv_cache_gib)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    image = axes.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
    for row, values in enumerate(grid):
        for column, value in enumerate(values):
            axes.text(column, row, f"{value:.2f}", ha="center", va="center", color="white", fontsize=8)
    axes.set_xticks(range(len(host_read_gbps)), [f"{b:g}" for b in host_read_gbps])
    axes.set_yticks(range(len(gpu_kv_cache_gib)), [f"{p:g}" for p in gpu_kv_cache_gib])
    axes.set_xlabel("host read bandwidth, GB/s")
    axes.set_ylabel("GPU KV pool, GiB")
    figure.colorbar(image, ax=axes, label="gain")
    axes.set_title(f"{_title(scenario)}\n{scenario.hardware.name}", fontsize=9)
    _save(plt, figure, path)


def draw_cores(scenario: Scenario, machines: list[Hardware], path: str) -> None:
    """The ``cores`` plot (see the module docstring) as a PNG at ``path``."""
    plt = _pyplot()
    points = gain_by_cores(scenario, machines)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.plot([cores for cores, _ in points], [value for _, value in points], marker="o")
    for machine, (cores, value) in zip(machines, points):
        axes.annotate(machine.name, (cores, value), textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("host cores (vCPUs)")
    axes.set_ylabel("gain")
    axes.set_title(_title(scenario), fontsize=9)
    _save(plt, figure, path)


def _title(scenario: Scenario) -> str:
    return f"{scenario.model}, {scenario.workload}, {scenario.num_requests} requests: neo / gpu-only"


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, figure, path: str) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

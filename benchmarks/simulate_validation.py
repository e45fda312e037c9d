"""The what-if simulator (``neo simulate``) against what was measured: prints the tables.

1. Stage times: the table synthesized for the ``h100`` preset against the measured H100
   profile of Qwen2.5-32B shapes (``neo/sim/profiles``), point by point (synthesized /
   measured).
2. The H100 offloading scenarios of ``benchmarks/offload.py`` (RESULTS.md, "Offloading
   policies offline"): neo / gpu-only, measured against simulated from hardware numbers alone
   and (32B) from the measured profile. The measured figures are steady-window ratios of runs
   cut at a time limit (``neo.bench``: the window from 20% of the run to its end), so each
   scenario is simulated with the same request count and time limit and its steady window is
   compared; the simulated ratio over the whole run to completion is shown beside it. Runs
   measured to completion are compared end to end. Each measured figure names the engine it
   came from: where the scheduler has changed since, the row compares two schedulers. Runs
   cut at their time limit are also compared over all that ran.
3. Iteration and host batch times: simulated against those measured.
4. The NEO paper's (MLSys'25) figures against simulations of its machines and workload shapes.
5. Two ranks: Llama-3.1-70B shapes on two GPUs, measured against simulated with the rank
   profile measured there (``neo/sim/profiles``), end to end and gpu-only's own throughput.
6. One H200: the offloading scenarios run to completion there, measured against simulated from
   the ``h200`` preset alone and with the model's table measured on an H200 (``neo/sim/profiles``),
   end to end and gpu-only's own throughput.

CPU only; about a minute.

    python benchmarks/simulate_validation.py
"""

import argparse
import statistics
from importlib import resources

from neo.models.loader import resolve_model_config
from neo.sched.perf_model import PerfModel, PerfTable
from neo.sim.hardware import preset, with_overrides
from neo.sim.scenario import Scenario, run_scenario
from neo.sim.stage_times import StageModel, synthesize_table

PROFILE = str(resources.files("neo.sim.profiles").joinpath("qwen2.5-32b-h100-profile.json"))
PROFILE_70B_TP2 = str(resources.files("neo.sim.profiles").joinpath("llama-3.1-70b-tp2-h200-profile.json"))
# Tables measured on one H200 machine (twenty-seventh session, start AA), per model.
PROFILES_H200 = {model: str(resources.files("neo.sim.profiles").joinpath(f"{model}-h200-profile.json"))
                 for model in ("llama-3.1-8b", "qwen2.5-32b")}
POOR = dict(gpu_kv_cache_gib=2.0, cpu_kv_cache_gib=64.0, max_num_seqs=512, max_model_len=4096)

# (label, scenario settings, requests, seconds, measured neo/gpu-only ratios, where measured). The
# scheduler changed between some of these measurements and the current code (the engine's commit is
# named where it differs from the current scheduler's): those rows compare two schedulers.
H100_SCENARIOS = [
    ("32B poor 500/500", dict(model="qwen2.5-32b", workload="synthetic:input=500,output=500", **POOR),
     200, 30, (705.3 / 325.3,), "2026-11-25 tenth session, current engine (c212560)"),
    ("32B poor 1000/300", dict(model="qwen2.5-32b", workload="synthetic:input=1000,output=300", **POOR),
     200, 30, (338.7 / 200.3,), "2026-11-25 tenth session, current engine (c212560)"),
    ("32B poor 500/500", dict(model="qwen2.5-32b", workload="synthetic:input=500,output=500", **POOR),
     200, 30, (1.91,), "2026-11-25 ninth session, 28734b7"),
    ("32B poor 500/500", dict(model="qwen2.5-32b", workload="synthetic:input=500,output=500", **POOR),
     200, 30, (1.83,), "2026-11-25 sixth session, 9cf64e2"),
    ("32B poor 500/500", dict(model="qwen2.5-32b", workload="synthetic:input=500,output=500", **POOR),
     256, 50, (1.93,), "2026-11-25 fourth session, 384a805"),
    ("32B poor 1000/300", dict(model="qwen2.5-32b", workload="synthetic:input=1000,output=300", **POOR),
     200, 30, (1.21,), "2026-11-25 sixth session, 9cf64e2"),
    ("32B poor 1000/300", dict(model="qwen2.5-32b", workload="synthetic:input=1000,output=300", **POOR),
     256, 50, (1.42, 1.51), "2026-11-25 fourth session, 384a805, two starts"),
    ("32B poor 1000/300", dict(model="qwen2.5-32b", workload="synthetic:input=1000,output=300", **POOR),
     200, 90, (1.69,), "journal 2026-11-25 first session (54a3b7d)"),
] + [
    (f"8B poor 1000/{output}", dict(model="llama-3.1-8b", workload=f"synthetic:input=1000,output={output}", **POOR),
     200, 20, (neo / gpu_only,), "2026-11-25 tenth session, current engine (c212560)")
    for output, gpu_only, neo in ((50, 1033.4, 1192.3), (100, 1303.1, 1469.0), (200, 1429.5, 1619.9),
                                  (300, 1450.1, 1629.6), (400, 1413.2, 1640.3))
] + [
    (f"8B poor 1000/{output}", dict(model="llama-3.1-8b", workload=f"synthetic:input=1000,output={output}", **POOR),
     200, 20, (ratio,), "2026-11-25 fourth session, 384a805")
    for output, ratio in ((50, 1.19), (100, 1.30), (200, 1.22), (300, 1.19), (400, 1.24))
] + [
    ("8B full memory, Azure code", dict(model="llama-3.1-8b", workload="azure-code", cpu_kv_cache_gib=64.0,
                                        max_num_seqs=512, max_model_len=8192),
     256, 30, (395.9 / 396.8,), "2026-11-25 tenth session, current engine (c212560)"),
    ("8B full memory, Azure code", dict(model="llama-3.1-8b", workload="azure-code", cpu_kv_cache_gib=64.0,
                                        max_num_seqs=512, max_model_len=8192),
     256, 30, (1.00, 1.01), "2026-11-25 fourth session, 384a805, two starts"),
]

SHORT = dict(model="llama-3.1-8b", workload="synthetic:input=370,output=45", **POOR)
# (label, scenario settings, requests, measured end-to-end neo/gpu-only ratio, where measured)
H100_WHOLE_RUNS = [
    ("8B poor, prompts ~370, outputs ~45", SHORT, 400, 2443.3 / 2579.6,
     "2026-11-25 tenth session, current engine (c212560)"),
    ("8B poor 1000/50", dict(model="llama-3.1-8b", workload="synthetic:input=1000,output=50", **POOR), 200,
     982.3 / 993.6, "2026-11-25 tenth session, current engine (c212560)"),
    ("8B poor 1000/100", dict(model="llama-3.1-8b", workload="synthetic:input=1000,output=100", **POOR), 200,
     1265.2 / 1263.8, "2026-11-25 tenth session, current engine (c212560)"),
    ("8B poor, prompts ~370, outputs ~45", SHORT, 400, 2344.7 / 2315.9, "2026-11-25 ninth session, 28734b7"),
    ("8B poor, prompts ~370, outputs ~45", SHORT, 400, 2488.2 / 2541.9, "2026-11-27 nineteenth session, 969c527"),
    ("8B poor 1000/300", dict(model="llama-3.1-8b", workload="synthetic:input=1000,output=300", **POOR), 100,
     1564.1 / 1342.4, "2026-11-27 nineteenth session, 969c527"),
    ("32B poor 500/500", dict(model="qwen2.5-32b", workload="synthetic:input=500,output=500", **POOR), 100,
     490.2 / 325.2, "2026-11-27 nineteenth session, 969c527"),
]


# One H200 with a 16-core host (the ``h200`` preset), every request to completion: (label, scenario
# settings, requests, measured gpu-only output tokens/s, the neo runs' beside it, where measured).
H200_WHOLE_RUNS = [
    ("8B poor 1000/300", dict(model="llama-3.1-8b", workload="synthetic:input=1000,output=300", **POOR), 100,
     1631.6, (1830.9, 1831.8, 1825.6), "2026-11-27 twenty-second session, start G, b7ac6cb and c3b700d"),
    ("8B poor 1000/300", dict(model="llama-3.1-8b", workload="synthetic:input=1000,output=300", **POOR), 100,
     1626.7, (1810.2,), "2026-11-27 twenty-second session, start E, b7ac6cb"),
    ("8B poor, prompts ~370, outputs ~45", SHORT, 400, 2839.6, (2812.1, 2765.9, 2899.6),
     "2026-11-27 twenty-second session, start H, b7ac6cb and c3b700d"),
    ("8B poor, prompts ~370, outputs ~45", SHORT, 400, 2847.8, (2794.0,),
     "2026-11-27 twenty-second session, start E, b7ac6cb"),
    ("32B poor 500/500", dict(model="qwen2.5-32b", workload="synthetic:input=500,output=500", **POOR), 100,
     408.7, (588.8,), "2026-11-27 twenty-second session, start E, b7ac6cb"),
    ("8B poor 1000/300", dict(model="llama-3.1-8b", workload="synthetic:input=1000,output=300", **POOR), 100,
     1619.5, (1865.2,), "2026-11-28 twenty-sixth session, c0f880d"),
    ("8B poor, prompts ~370, outputs ~45", SHORT, 400, 2768.3, (2828.6,), "2026-11-28 twenty-sixth session, c0f880d"),
    ("32B poor 500/500", dict(model="qwen2.5-32b", workload="synthetic:input=500,output=500", **POOR), 100,
     418.3, (624.8, 629.3), "2026-11-28 twenty-sixth session, c0f880d"),
    ("8B poor 1000/50", dict(model="llama-3.1-8b", workload="synthetic:input=1000,output=50", **POOR), 100,
     1073.8, (1058.8,), "2026-11-28 twenty-seventh session, start AA, c1c9fb1; one engine served 50, 100, 200"),
    ("8B poor 1000/100", dict(model="llama-3.1-8b", workload="synthetic:input=1000,output=100", **POOR), 100,
     1419.9, (1497.4,), "2026-11-28 twenty-seventh session, start AA, c1c9fb1"),
    ("8B poor 1000/200", dict(model="llama-3.1-8b", workload="synthetic:input=1000,output=200", **POOR), 100,
     1639.3, (1748.2,), "2026-11-28 twenty-seventh session, start AA, c1c9fb1"),
    ("32B poor 500/500", dict(model="qwen2.5-32b", workload="synthetic:input=500,output=500", **POOR), 100,
     405.6, (579.9,), "2026-11-28 twenty-seventh session, start AA, c1c9fb1"),
    ("32B poor 500/500", dict(model="qwen2.5-32b", workload="synthetic:input=500,output=500", **POOR), 100,
     469.5, (663.0,), "2026-11-28 twenty-eighth session, start AF, 6040d42: the tensor-core decode kernel, "
     "which the shipped tables predate"),
    ("8B poor, prompts ~370, outputs ~45", SHORT, 400, 2779.3, (2737.8,),
     "2026-11-28 thirty-first session, start AT, 93cefb8"),
    ("8B poor 1000/200", dict(model="llama-3.1-8b", workload="synthetic:input=1000,output=200", **POOR), 100,
     1713.0, (1847.2,), "2026-11-28 thirty-first session, start AT, 93cefb8; one engine served 200, 400, 100, 50, 300"),
    ("8B poor 1000/400", dict(model="llama-3.1-8b", workload="synthetic:input=1000,output=400", **POOR), 100,
     1514.7, (1950.5,), "2026-11-28 thirty-first session, start AT, 93cefb8"),
    ("8B poor 1000/100", dict(model="llama-3.1-8b", workload="synthetic:input=1000,output=100", **POOR), 100,
     1272.8, (1547.4,), "2026-11-28 thirty-first session, start AT, 93cefb8"),
    ("8B poor 1000/50", dict(model="llama-3.1-8b", workload="synthetic:input=1000,output=50", **POOR), 100,
     1119.2, (1090.4,), "2026-11-28 thirty-first session, start AT, 93cefb8"),
    ("8B poor 1000/300", dict(model="llama-3.1-8b", workload="synthetic:input=1000,output=300", **POOR), 100,
     1718.5, (1854.8,), "2026-11-28 thirty-first session, start AT, 93cefb8"),
    ("32B poor 500/500", dict(model="qwen2.5-32b", workload="synthetic:input=500,output=500", **POOR), 100,
     468.0, (653.5,), "2026-11-28 thirty-first session, start AT, 93cefb8"),
]


# Runs cut at a time limit, output tokens/s over all that ran (not only the steady window):
# (label, scenario settings, requests, seconds, measured neo/gpu-only ratio, where measured)
H100_CUT_RUNS = [
    ("32B poor 500/500", dict(model="qwen2.5-32b", workload="synthetic:input=500,output=500", **POOR), 200, 30,
     576.4 / 340.5, "2026-11-25 tenth session, current engine (c212560)"),
    ("32B poor 1000/300", dict(model="qwen2.5-32b", workload="synthetic:input=1000,output=300", **POOR), 200, 30,
     271.6 / 201.1, "2026-11-25 tenth session, current engine (c212560)"),
]


# Two ranks of Llama-3.1-70B shapes on two H200s of a 32-core host, 6 GiB GPU and 24 GiB host
# pools per rank, context 4096, every request to completion: (label, workload, requests,
# measured gpu-only and neo output tokens/s end to end, where measured)
TWO_RANK_RUNS = [
    ("70B two ranks 1000/300", "synthetic:input=1000,output=300", 100, 735.1, 736.3,
     "2026-11-27 eighteenth session, aea59dc"),
    ("70B two ranks, Azure code", "azure-code", 100, 69.6, 65.8, "2026-11-27 eighteenth session, aea59dc"),
    ("70B two ranks 1000/300", "synthetic:input=1000,output=300", 300, 762.0, 738.2,
     "2026-11-27 nineteenth session, 969c527"),
    ("70B two ranks, Azure code", "azure-code", 100, 70.4, 65.3, "2026-11-27 nineteenth session, 969c527"),
]


def ratios(results) -> tuple[float, float]:
    """(steady-window ratio, whole-run ratio) of neo over gpu-only."""
    gpu_only, neo = results
    return (neo.steady_output_tokens_per_s / gpu_only.steady_output_tokens_per_s,
            neo.output_tokens_per_s / gpu_only.output_tokens_per_s)


def simulate(settings: dict, hardware, requests: int, duration: float | None, profile: str | None = None,
             policies=("gpu-only", "neo")):
    return run_scenario(Scenario(hardware=hardware, num_requests=requests, duration=duration, profile=profile,
                                 policies=policies, **settings))


def stage_table_comparison() -> None:
    measured = PerfTable.load(PROFILE)
    stages = StageModel(resolve_model_config("qwen2.5-32b"), preset("h100"))
    print("## Stage times: synthesized h100 / measured H100 profile, Qwen2.5-32B\n")
    rows = [("linear", measured.linear_tokens, measured.linear_seconds, stages.linear),
            ("gpu_attention", measured.gpu_attention_tokens, measured.gpu_attention_seconds, stages.gpu_attention),
            ("prefill_attention", measured.prefill_lengths, measured.prefill_seconds, stages.prefill_attention),
            ("graph_decode", measured.graph_decode_requests, measured.graph_decode_seconds, stages.graph_decode)]
    print("| table | points (x: ratio) |\n| --- | --- |")
    for name, xs, ys, synthesized in rows:
        print(f"| {name} | " + ", ".join(f"{x}: {synthesized(x) / y:.2f}" for x, y in zip(xs, ys)) + " |")
    for requests, xs, ys in zip(measured.host_attention_requests, measured.host_attention_tokens,
                                measured.host_attention_seconds):
        print(f"| host_attention, {requests} requests | "
              + ", ".join(f"{x}: {stages.host_attention(requests, x) / y:.2f}" for x, y in zip(xs, ys)) + " |")
    hardware, layers = preset("h100"), stages.layers
    pipeline = layers * hardware.pipeline_overhead_us * 1e-6 / measured.pipeline_overhead
    host_batch = layers * hardware.host_batch_overhead_us * 1e-6 / measured.host_batch_overhead
    print(f"| overheads | pipeline: {pipeline:.2f}, host batch: {host_batch:.2f}, iteration: "
          f"{hardware.iteration_overhead_us * 1e-6:.4f} s vs {measured.iteration_overhead:.4f} s |\n")


def h100_scenarios() -> None:
    hardware = preset("h100")
    print("## H100 offloading scenarios: neo / gpu-only, measured vs simulated\n")
    print("Steady window of runs cut at the measured run length (as measured); whole run to completion beside it.\n")
    print("| scenario | requests, s | measured | numbers alone: steady (error) / whole run | profile: steady (error) "
          "/ whole run | simulated gpu-only / neo steady tok/s (numbers alone) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, settings, requests, seconds, measured, source in H100_SCENARIOS:
        cut = simulate(settings, hardware, requests, seconds)
        steady, _ = ratios(cut)
        whole = ratios(simulate(settings, hardware, requests, None))[1]
        reference = sum(measured) / len(measured)
        cells = [f"{steady:.2f}x ({steady / reference - 1:+.0%}) / {whole:.2f}x"]
        if settings["model"] == "qwen2.5-32b":
            profiled = ratios(simulate(settings, hardware, requests, seconds, PROFILE))[0]
            profiled_whole = ratios(simulate(settings, hardware, requests, None, PROFILE))[1]
            cells.append(f"{profiled:.2f}x ({profiled / reference - 1:+.0%}) / {profiled_whole:.2f}x")
        else:
            cells.append("-")
        print(f"| {label} | {requests}, {seconds} | {' / '.join(f'{m:.2f}x' for m in measured)} ({source}) | "
              f"{cells[0]} | {cells[1]} | {cut[0].steady_output_tokens_per_s:.0f} / "
              f"{cut[1].steady_output_tokens_per_s:.0f} |")
    print("Runs cut at the time limit, output tokens/s over all that ran:\n")
    print("| scenario | requests, s | measured | numbers alone (error) | profile (error) |\n| --- | --- | --- | --- | --- |")
    for label, settings, requests, seconds, measured, source in H100_CUT_RUNS:
        cells = []
        for profile in (None, PROFILE):
            ratio = ratios(simulate(settings, hardware, requests, seconds, profile))[1]
            cells.append(f"{ratio:.2f}x ({ratio / measured - 1:+.0%})")
        print(f"| {label} | {requests}, {seconds} | {measured:.2f}x ({source}) | {cells[0]} | {cells[1]} |")
    print()
    print("Whole runs to completion (end-to-end output tokens/s):\n")
    print("| scenario | requests | measured | numbers alone (error) | profile (error) |\n| --- | --- | --- | --- | --- |")
    for label, settings, requests, measured, source in H100_WHOLE_RUNS:
        profiles = (None, PROFILE) if settings["model"] == "qwen2.5-32b" else (None,)
        wholes = [ratios(simulate(settings, hardware, requests, None, profile))[1] for profile in profiles]
        cells = [f"{whole:.2f}x ({whole / measured - 1:+.0%})" for whole in wholes] + ["-"] * (2 - len(wholes))
        print(f"| {label} | {requests} | {measured:.2f}x ({source}) | {cells[0]} | {cells[1]} |")
    print()


def h200_whole_runs() -> None:
    hardware = preset("h200")
    print("## H200 whole runs to completion: neo / gpu-only end to end, measured vs simulated from the "
          "h200 preset alone and with the model's table measured on an H200 (PROFILES_H200)\n")
    print("| scenario | requests | measured | preset: simulated (error against their mean) | gpu-only tok/s, "
          "measured / simulated (error) | H200 table: simulated (error) | gpu-only tok/s simulated (error) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, settings, requests, gpu_only, neo, source in H200_WHOLE_RUNS:
        measured = [tokens / gpu_only for tokens in neo]
        cells = []
        for profile in (None, PROFILES_H200[settings["model"]]):
            results = simulate(settings, hardware, requests, None, profile)
            simulated, predicted_gpu_only = ratios(results)[1], results[0].output_tokens_per_s
            cells.append(f"{simulated:.2f}x ({simulated / statistics.mean(measured) - 1:+.0%})")
            cells.append(f"{predicted_gpu_only:.1f} ({predicted_gpu_only / gpu_only - 1:+.0%})")
        print(f"| {label} | {requests} | {' / '.join(f'{m:.2f}x' for m in measured)} ({source}) | {cells[0]} | "
              f"{gpu_only:.1f} / {cells[1]} | {cells[2]} | {cells[3]} |")
    print()


def iteration_times() -> None:
    """Simulated against measured iteration and host batch times (medians)."""
    print("## Iteration and host batch times, simulated vs measured (medians)\n")
    print("| what | measured | numbers alone | profile |\n| --- | --- | --- | --- |")
    hardware = preset("h100")
    model = resolve_model_config("llama-3.1-8b")
    table = synthesize_table(model, hardware, max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=8192,
                             pool_tokens=1 << 20)
    for batch, measured in ((64, 9.99), (256, 21.16)):
        seconds = PerfModel(table).graph_decode(batch, batch * 1024)
        print(f"| 8B gpu-only decode iteration, {batch} x 1024 tokens (RESULTS.md, engine_roofline, async "
              f"scheduling) | "
              f"{measured:.2f} ms | {1e3 * seconds:.2f} ms | - |")
    current = "2026-11-25 tenth session, current engine (c212560)"
    ninth = "2026-11-25 ninth session, 28734b7"
    runs = [("500/500", 200, 30, "prefill step 0.145 s", current),
            ("500/500", 200, 30, "host batch 120 requests, 0.27 s", current),
            ("500/500", 200, 30, "prefill step 0.123 s", ninth),
            ("500/500", 200, 30, "host batch 103 requests, 0.27 s", ninth),
            ("500/500", 256, 50, "prefill step 0.876 s", "2026-11-25 fourth session, 384a805"),
            ("1000/300", 256, 50, "prefill step 0.865-0.906 s", "2026-11-25 fourth session, 384a805"),
            ("500/500", 300, 60, "host batch 281 requests, 0.53 s", "journal 2026-11-25 first, 54a3b7d"),
            ("1000/300", 200, 90, "host batch 172.5 requests, 0.72 s", "journal 2026-11-25 first, 54a3b7d")]
    for shape, requests, seconds, measured, source in runs:
        prompt, output = shape.split("/")
        settings = dict(model="qwen2.5-32b", workload=f"synthetic:input={prompt},output={output}", **POOR)
        cells = []
        for profile in (None, PROFILE):
            prefill_steps = []

            def record(plan, step_seconds):
                if plan.sub_batches and plan.sub_batches[0].prefills:
                    prefill_steps.append(step_seconds)

            neo = run_scenario(Scenario(hardware=hardware, num_requests=requests, duration=seconds, profile=profile,
                                        policies=("neo",), **settings), on_iteration=record)[0].summary()
            if measured.startswith("prefill"):
                cells.append(f"prefill step {statistics.median(prefill_steps):.3f} s")
            else:
                cells.append(f"host batch {neo['host_batch_requests']['p50']} requests, "
                             f"{neo['host_batch_s']['p50']:.2f} s")
        print(f"| 32B poor {shape}, neo, {requests} requests, {seconds} s ({source}) | {measured} | "
              f"{cells[0]} | {cells[1]} |")
    print()


def paper() -> None:
    print("## The NEO paper's figures vs simulated (whole runs to completion, 200 requests)\n")
    print("| paper figure | machine, model, workload | simulated neo / gpu-only |\n| --- | --- | --- |")
    t4 = preset("g4dn.4xlarge")
    # The GPU pool (0.9 GiB, about 1800 tokens) cannot hold the trace's longest prompts: they are
    # cut to a 1536-token context there.
    for workload, context in (("synthetic:input=1000,output=300", 4096), ("synthetic:input=500,output=500", 4096),
                              ("azure-code", 1536)):
        results = simulate(dict(model="llama-2-7b", workload=workload, gpu_kv_cache_gib=0.9,
                                max_num_batched_tokens=2048, max_model_len=context), t4, 200, None)
        print(f"| T4: up to 7.5x | g4dn.4xlarge, Llama-2-7B, 0.9 GiB GPU KV pool, {workload}, context {context} | "
              f"{ratios(results)[1]:.2f}x |")
    for name, paper_figure in (("g5.2xlarge", "+12%"), ("g5.4xlarge", ""), ("g5.8xlarge", ""),
                               ("g5.16xlarge", "+79%")):
        cells = []
        for output in (50, 100, 200, 300, 400):
            results = simulate(dict(model="llama-3.1-8b", workload=f"synthetic:input=1000,output={output}",
                                    max_model_len=4096), preset(name), 200, None)
            cells.append(f"{output}: {ratios(results)[1]:.2f}x")
        print(f"| A10G host scaling (+12% at 8 to +79% at 64 vCPUs): {paper_figure or '-'} | {name}, "
              f"Llama-3-8B shapes, input 1000 | {', '.join(cells)} |")
    hardware = preset("h100")
    doubled = with_overrides(hardware, {"gpu_memory_gib": 2 * hardware.gpu_memory_gib,
                                        "hbm_gbps": 2 * hardware.hbm_gbps, "bf16_tflops": 2 * hardware.bf16_tflops})
    results = simulate(dict(model="llama-3.1-70b", workload="synthetic:input=1000,output=300", max_model_len=4096),
                       doubled, 200, None)
    print(f"| 2xH100, 70B: +14% | one 'GPU' with twice an H100's memory, bandwidth and FLOP/s (no "
          f"tensor-parallel communication), 16-core host, Llama-3.1-70B, 1000/300 | {ratios(results)[1]:.2f}x |\n")


def two_ranks() -> None:
    hardware = with_overrides(preset("h100"), {"host_cores": 32})
    print("## Two ranks: neo / gpu-only end to end, measured vs simulated with the measured rank profile\n")
    print("| scenario | requests | measured | simulated (error) | gpu-only tok/s, measured / simulated (error) |")
    print("| --- | --- | --- | --- | --- |")
    for label, workload, requests, gpu_only, neo, source in TWO_RANK_RUNS:
        settings = dict(model="llama-3.1-70b", workload=workload, gpu_kv_cache_gib=6.0, cpu_kv_cache_gib=24.0,
                        max_model_len=4096, tensor_parallel_size=2)
        results = simulate(settings, hardware, requests, None, PROFILE_70B_TP2)
        measured, simulated = neo / gpu_only, ratios(results)[1]
        predicted_gpu_only = results[0].output_tokens_per_s
        print(f"| {label} | {requests} | {measured:.3f}x ({source}) | {simulated:.3f}x "
              f"({simulated / measured - 1:+.1%}) | {gpu_only:.1f} / {predicted_gpu_only:.1f} "
              f"({predicted_gpu_only / gpu_only - 1:+.1%}) |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="stages,h100,h200,iterations,paper,two-ranks",
                        help="comma-separated: stages, h100, h200, iterations, paper, two-ranks")
    sections = parser.parse_args().sections.split(",")
    if "stages" in sections:
        stage_table_comparison()
    if "h100" in sections:
        h100_scenarios()
    if "h200" in sections:
        h200_whole_runs()
    if "iterations" in sections:
        iteration_times()
    if "paper" in sections:
        paper()
    if "two-ranks" in sections:
        two_ranks()


if __name__ == "__main__":
    main()

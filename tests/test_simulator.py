"""The what-if simulator (``neo.sim``): the real scheduler against simulated time, stage
tables synthesized from hardware numbers, and ``neo simulate`` end to end. CPU only."""

import dataclasses
import json
import random
from importlib import resources

import pytest
import torch

from neo import cli
from neo.bench.workload_request import WorkloadRequest
from neo.bench.workloads import parse_workload
from neo.config import EngineConfig
from neo.kv.kv_cache import CacheLayout
from neo.models.loader import resolve_model_config
from neo.models.parallel import rank_config
from neo.sched import stage_order as stage_orders
from neo.sched.cost import StageTimes
from neo.sched.perf_model import PerfModel, PerfTable
from neo.sched.placement import PLACEMENTS, TwoSubBatches
from neo.sched.stage_order import SEQUENTIAL, StageOrder, attn_gpu, attn_host, post, pre
from neo.sim.hardware import PRESETS, preset, with_overrides
from neo.sim.parts import graph_coverage
from neo.sim.plots import gain_grid
from neo.sim.scenario import Scenario, run_scenario, stage_table
from neo.sim.simulator import Simulation
from neo.sim.stage_times import StageModel, synthesize_table

PROFILE = str(resources.files("neo.sim.profiles").joinpath("qwen2.5-32b-h100-profile.json"))
PROFILE_70B_TP2 = str(resources.files("neo.sim.profiles").joinpath("llama-3.1-70b-tp2-h200-profile.json"))
SMALL = dict(model="llama-3.1-8b", hardware=preset("g5.2xlarge"), gpu_kv_cache_gib=0.25, cpu_kv_cache_gib=8.0,
             max_num_seqs=64, max_num_batched_tokens=2048)


def small_scenario(**changes) -> Scenario:
    settings = dict(SMALL, workload="synthetic:input=300,output=40", num_requests=48,
                    policies=("gpu-only", "neo", "full-offload"))
    settings.update(changes)
    return Scenario(**settings)


# -- the scheduler is the real one -----------------------------------------------------------


class CountingPlacement(TwoSubBatches):
    """The lockstep placement, counting its plans (a placement the simulator does not know)."""

    plans = 0

    def place(self, scheduler, batch0, host_requests, plan):
        CountingPlacement.plans += 1
        super().place(scheduler, batch0, host_requests, plan)


def test_a_new_placement_and_stage_order_are_simulated_without_simulator_changes(monkeypatch):
    monkeypatch.setitem(PLACEMENTS, "counting", (CountingPlacement, "lockstep"))
    order = StageOrder("host-first", 2, (post(1), pre(1), attn_host(1), attn_gpu(1), post(0), pre(0), attn_host(0),
                                         attn_gpu(0)), "each host attention issued before its GPU attention")
    monkeypatch.setitem(stage_orders.STAGE_ORDERS, order.name, order)
    monkeypatch.setattr(stage_orders, "TWO_SUB_BATCH_ORDERS", stage_orders.TWO_SUB_BATCH_ORDERS + (order.name,))
    CountingPlacement.plans = 0
    orders = set()
    scenario = small_scenario(policies=("neo",), host_pipeline="lockstep", placement="counting", stage_order=order.name)
    [result] = run_scenario(scenario, on_iteration=lambda plan, seconds: orders.add(plan.stage_order.name))
    assert CountingPlacement.plans >= result.iterations > 0
    assert result.two_sub_batch_iterations > 0 and order.name in orders
    assert result.finished_requests == scenario.num_requests


# -- synthesized stage tables -----------------------------------------------------------------


@pytest.mark.parametrize("hardware", sorted(PRESETS))
@pytest.mark.parametrize("model", ["llama-2-7b", "llama-3.1-8b", "qwen2.5-32b"])
def test_synthesized_tables_are_monotone(hardware, model):
    table = synthesize_table(resolve_model_config(model), preset(hardware), max_num_batched_tokens=8192,
                             max_num_seqs=256, max_model_len=8192, pool_tokens=1 << 20)

    def non_decreasing(xs, ys):
        return xs == sorted(xs) and all(b >= a > 0 for a, b in zip(ys, ys[1:]))

    assert non_decreasing(table.linear_tokens, table.linear_seconds)
    assert non_decreasing(table.gpu_attention_tokens, table.gpu_attention_seconds)
    assert non_decreasing(table.prefill_lengths, table.prefill_seconds)
    assert non_decreasing(table.graph_decode_requests, table.graph_decode_seconds)
    assert table.host_attention_requests and table.host_attention_requests == sorted(table.host_attention_requests)
    for tokens, seconds in zip(table.host_attention_tokens, table.host_attention_seconds):
        assert non_decreasing(tokens, seconds)
    for row, next_row in zip(table.host_attention_seconds, table.host_attention_seconds[1:]):
        assert all(b >= a for a, b in zip(row, next_row))  # more requests over the same tokens


def test_synthesized_times_scale_as_the_roofline_says():
    model = resolve_model_config("llama-3.1-8b")
    base = preset("a100")
    stages = StageModel(model, base)
    faster_memory = StageModel(model, with_overrides(base, {"hbm_gbps": 2 * base.hbm_gbps}))
    faster_host = StageModel(model, with_overrides(base, {"host_read_gbps": 2 * base.host_read_gbps,
                                                           "host_read_gbps_per_thread": 100.0}))
    for tokens in (1, 4, 16):  # decode batches: memory bound
        assert faster_memory.linear(tokens) == pytest.approx(stages.linear(tokens) / 2, rel=0.01)
    assert faster_memory.linear(8192) == pytest.approx(stages.linear(8192), rel=0.01)  # compute bound
    assert faster_memory.gpu_attention(1 << 20) == pytest.approx(stages.gpu_attention(1 << 20) / 2, rel=0.01)
    context = 1 << 22  # the bytes dominate the per-layer overheads
    assert faster_host.host_attention(64, context) < 0.55 * stages.host_attention(64, context)
    # host read bandwidth grows with threads up to its saturation
    hardware = preset("h100")
    assert hardware.host_read_bandwidth(4) == 4 * hardware.host_read_gbps_per_thread
    assert hardware.host_read_bandwidth(hardware.host_attention_threads) == hardware.host_read_gbps


def test_dtype_follows_the_hardware():
    assert preset("g4dn.4xlarge").dtype == "float16"
    assert preset("h100").dtype == preset("g5.2xlarge").dtype == "bfloat16"


@pytest.mark.parametrize("policy", ["gpu-only", "neo", "full-offload"])
@pytest.mark.parametrize("host_pipeline", ["async", "lockstep", "auto"])
@pytest.mark.parametrize("graphs", [True, False])
def test_the_simulated_engine_replays_the_graphs_a_cuda_engine_captures(policy, host_pipeline, graphs):
    """As ``neo.engine.build`` captures them: decode graphs always, pipeline graphs for the
    lockstep and auto host pipelines, host-batch graphs for the async and auto ones, of the
    offloading policies; none without CUDA graphs."""
    config = EngineConfig(policy=policy, host_pipeline=host_pipeline, max_num_seqs=48, use_cuda_graphs=graphs,
                          cuda_graph_max_context=4096, block_size=16)
    coverage = graph_coverage(config, max_model_len=8192)
    offloading = graphs and policy != "gpu-only"
    assert coverage.decode_max_requests == (48 if graphs else 0)
    assert coverage.max_blocks == (256 if graphs else 0)
    assert coverage.pipeline_max_requests == (48 if offloading and host_pipeline != "async" else 0)
    assert coverage.host_batch_max_requests == (48 if offloading and host_pipeline != "lockstep" else 0)


# -- simulated time ---------------------------------------------------------------------------


def test_with_a_measured_profile_each_iteration_takes_the_cost_functions_time():
    """Lockstep neo on the measured H100 profile: every plan with prefills (no CUDA graph) and
    no swaps takes exactly the cost function's time of its stage order and stage times."""
    table = PerfTable.load(PROFILE)
    model = PerfModel(table)
    checked = []

    def check(plan, seconds):
        if plan.has_swaps or not plan.sub_batches[0].prefills:
            return
        times = []
        for batch in plan.sub_batches:
            host_tokens = sum(r.num_tokens for r in batch.host_decodes)
            times.append(StageTimes(
                model.linear(batch.num_tokens),
                model.gpu_attention(sum(r.num_tokens for r in batch.gpu_decodes))
                + model.prefill_attention([r.num_tokens for r in batch.prefills]),
                model.host_attention(len(batch.host_decodes), host_tokens)))
        assert plan.stage_order is (SEQUENTIAL if len(times) == 1 else stage_orders.ASYMMETRIC)
        assert seconds == pytest.approx(model.iteration_time(plan.stage_order, times), rel=1e-9)
        checked.append(len(times))

    scenario = Scenario(model="qwen2.5-32b", hardware=preset("h100"), workload="synthetic:input=500,output=60",
                        num_requests=60, policies=("neo",), host_pipeline="lockstep", gpu_kv_cache_gib=1.0,
                        cpu_kv_cache_gib=32.0, profile=PROFILE)
    [result] = run_scenario(scenario, on_iteration=check)
    assert result.finished_requests == 60
    assert 2 in checked and 1 in checked


def test_gpu_only_decode_throughput_is_batch_over_iteration_time():
    """Requests that all fit the GPU pool: after the prefill, every iteration decodes the whole
    batch in the same time (a table without context-dependent costs), so the steady window's
    throughput is the batch over that time."""
    tokens = [1, 8192]
    table = PerfTable(linear_tokens=tokens, linear_seconds=[0.01 + 1e-6 * t for t in tokens],
                      gpu_attention_tokens=[1], gpu_attention_seconds=[0.0], prefill_lengths=[1],
                      prefill_seconds=[0.0])
    config = EngineConfig(model="llama-3.1-8b", policy="gpu-only", gpu_kv_cache_gib=2.0, max_num_seqs=32,
                          dtype="bfloat16")
    batch, output_len = 32, 201
    simulation = Simulation(config, resolve_model_config("llama-3.1-8b"), preset("h100"), table, 4096)
    result = simulation.run([WorkloadRequest(100, output_len)] * batch)
    decode_seconds = PerfModel(table).iteration_time(SEQUENTIAL, [StageTimes(PerfModel(table).linear(batch), 0.0, 0.0)])
    assert result.iterations == output_len
    assert result.steady_output_tokens_per_s == pytest.approx(batch / decode_seconds, rel=1e-6)
    assert result.tpot_s == pytest.approx([decode_seconds] * batch, rel=1e-6)
    # 10% of the 201 x 32 tokens take the prefill's iteration and 20 decodes (and the host's time
    # of the first, synchronous steps); the last 10%, 20 decodes
    head, tail = result.head_and_tail_s
    assert sum(result.iteration_s[:21]) <= head <= sum(result.iteration_s[:21]) * 1.01
    assert tail == pytest.approx(20 * decode_seconds, rel=1e-6)


def test_short_requests_on_a_small_gpu_pool_run_no_slower_under_neo():
    """Prompts of ~370 tokens, outputs of ~45, a 2 GiB GPU pool: the GPU turns its pool over
    faster than a host batch makes a request's output, so requests put in the host pool would
    come back to the GPU pool after a few host tokens; neo keeps within a few percent of
    gpu-only end to end (the async pipeline, every request to completion)."""
    scenario = Scenario(model="llama-3.1-8b", hardware=preset("h100"), workload="synthetic:input=370,output=45",
                        num_requests=200, gpu_kv_cache_gib=2.0, policies=("gpu-only", "neo"))
    gpu_only, neo = run_scenario(scenario)
    assert neo.finished_requests == gpu_only.finished_requests == 200
    assert neo.output_tokens_per_s >= 0.97 * gpu_only.output_tokens_per_s


@pytest.mark.parametrize("workload", ["synthetic:input=1000,output=300", "synthetic:input=370,output=45"])
def test_host_decodes_that_do_not_pay_do_not_run(workload):
    """Llama-3.1-70B on two GPUs (the measured profile of a rank of two H200s), 6 GiB of GPU pool
    per rank: no host population pays beside 38 GPU decodes, so neo admits none and decodes no
    request the GPU evicts to the host pool; it waits to come back, and neo runs as fast as
    gpu-only. Admitting a population that pays only at a size the host cannot finish in time,
    and decoding every host request that waited ``max_host_wait`` iterations, made it 0.93x on
    1000/300 (0.91x measured on the two GPUs)."""
    scenario = Scenario(model="llama-3.1-70b", hardware=with_overrides(preset("h100"), {"host_cores": 32}),
                        workload=workload, num_requests=100, gpu_kv_cache_gib=6.0, cpu_kv_cache_gib=24.0,
                        profile=PROFILE_70B_TP2, tensor_parallel_size=2, policies=("gpu-only", "neo"))
    gpu_only, neo = run_scenario(scenario)
    assert neo.finished_requests == gpu_only.finished_requests == 100
    assert neo.host_decode_tokens == 0
    assert neo.output_tokens_per_s >= 0.99 * gpu_only.output_tokens_per_s


def test_a_planning_profile_steers_the_scheduler_while_time_follows_the_profile(tmp_path):
    """Qwen2.5-32B on the measured H100 profile, 2 GiB of GPU pool, 500/200. Planned with a
    copy that prices host attention at 4x, neo decodes less on the host and makes fewer tokens
    per second, though time still follows the profile; gpu-only plans without a perf model and
    does not change. Planned with the profile itself, every figure is as without a planning
    profile."""
    slow = json.loads(open(PROFILE).read())
    slow["host_attention_seconds"] = [[4 * seconds for seconds in row] for row in slow["host_attention_seconds"]]
    slow_path = tmp_path / "slow.json"
    slow_path.write_text(json.dumps(slow))
    settings = dict(model="qwen2.5-32b", hardware=preset("h100"), workload="synthetic:input=500,output=200",
                    num_requests=60, gpu_kv_cache_gib=2.0, cpu_kv_cache_gib=32.0, profile=PROFILE)
    truth = run_scenario(Scenario(**settings))
    same = run_scenario(Scenario(**settings, planning_profile=PROFILE))
    steered = run_scenario(Scenario(**settings, planning_profile=str(slow_path)))
    assert [r.summary() for r in same] == [r.summary() for r in truth]
    assert steered[0].summary() == truth[0].summary()  # gpu-only
    assert truth[1].host_decode_tokens > 0
    assert steered[1].host_decode_tokens < truth[1].host_decode_tokens
    assert steered[1].output_tokens_per_s < truth[1].output_tokens_per_s
    assert all(r.finished_requests == 60 for r in truth + steered)


def test_several_ranks_are_simulated_as_one_rank_with_its_shapes_and_pools():
    """Two ranks of 70B: each rank's pools hold blocks of its half of the KV heads, so 6 GiB per
    rank holds as many blocks as 12 GiB of the whole model; 8B's KV heads do not split over 3."""
    scenario = Scenario(model="llama-3.1-70b", hardware=preset("h100"), workload="synthetic:input=200,output=20",
                        num_requests=8, gpu_kv_cache_gib=6.0, cpu_kv_cache_gib=24.0, profile=PROFILE_70B_TP2,
                        tensor_parallel_size=2, policies=("neo",))
    [result] = run_scenario(scenario)
    assert result.finished_requests == 8
    whole = resolve_model_config("llama-3.1-70b")
    rank = CacheLayout.for_budgets(rank_config(whole, 2), torch.bfloat16, 16, 6 << 30, 24 << 30)
    assert rank.num_gpu_blocks == CacheLayout.for_budgets(whole, torch.bfloat16, 16, 12 << 30, 48 << 30).num_gpu_blocks
    assert result.gpu_kv_pool_gib == pytest.approx(rank.num_gpu_blocks * rank.block_bytes / (1 << 30))
    with pytest.raises(ValueError, match="divisible|divide"):
        run_scenario(Scenario(model="llama-3.1-8b", hardware=preset("h100"), workload="synthetic:input=8,output=2",
                              num_requests=1, tensor_parallel_size=3, policies=("gpu-only",)))


@pytest.mark.parametrize("changes, phrase", [
    (dict(profile=None), r"tensor_parallel_size=2 needs a profile measured on a rank of that many"),
    (dict(tensor_parallel_size=1), r"was measured on a rank of 2, the scenario has tensor_parallel_size=1"),
    (dict(cpu_kv_cache_gib=150.0), r"2 ranks' host pools of cpu_kv_cache_gib=150.0 exceed host_memory_gib=256"),
])
def test_several_ranks_refuse_what_one_rank_cannot_simulate(changes, phrase):
    settings = dict(model="llama-3.1-70b", hardware=preset("h100"), workload="synthetic:input=8,output=2",
                    num_requests=1, gpu_kv_cache_gib=6.0, cpu_kv_cache_gib=24.0, profile=PROFILE_70B_TP2,
                    tensor_parallel_size=2, policies=("neo",))
    with pytest.raises(ValueError, match=phrase):
        run_scenario(Scenario(**(settings | changes)))


def within_objective(result, ttft_s: float, tpot_s: float) -> float:
    """The fraction of the run's requests whose first token came within ``ttft_s`` of their
    arrival and whose later tokens came ``tpot_s`` apart on average."""
    return sum(1 for ttft, tpot in zip(result.ttft_s, result.tpot_s) if ttft <= ttft_s and tpot <= tpot_s) \
        / result.num_requests


def test_under_poisson_arrivals_that_saturate_the_gpu_neo_offloads_and_keeps_the_objective():
    """Qwen2.5-32B, a 2 GiB GPU pool, prompts and outputs of 500 tokens arriving at 1 per
    second (Poisson) for a minute: more output than the GPU pool's batch makes, so requests
    queue under gpu-only; neo keeps admitting them to the host pool while the arrivals keep
    the GPU saturated, and serves at least as many within TTFT <= 2 s and TPOT <= 100 ms."""
    rng, arrival, workload = random.Random(0), 0.0, []
    for _ in range(60):
        arrival += rng.expovariate(1.0)
        workload.append(WorkloadRequest(500, 500, arrival))
    results = {}
    for policy in ("gpu-only", "neo"):
        scenario = Scenario(model="qwen2.5-32b", hardware=preset("h100"), workload="synthetic:input=1,output=1",
                            num_requests=1, policies=(policy,), gpu_kv_cache_gib=2.0, cpu_kv_cache_gib=64.0,
                            max_model_len=4096)
        config = scenario.engine_config(policy)
        simulation = Simulation(config, resolve_model_config(scenario.model), scenario.hardware,
                                stage_table(scenario, config, 4096), 4096)
        results[policy] = simulation.run(workload)
    gpu_only, neo = results["gpu-only"], results["neo"]
    assert neo.finished_requests == gpu_only.finished_requests == 60
    assert neo.host_decode_tokens > 0
    assert within_objective(neo, 2.0, 0.1) >= max(within_objective(gpu_only, 2.0, 0.1), 0.9)


@pytest.mark.parametrize("host_pipeline", ["async", "lockstep"])
def test_every_request_finishes(host_pipeline, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"prompt_len": 100 + 37 * i % 400, "output_len": 5 + 13 * i % 90,
                                         "arrival_s": 0.05 * i}) + "\n" for i in range(40)))
    for workload in ("synthetic:input=300,output=40", f"file:{trace}"):
        scenario = small_scenario(workload=workload, host_pipeline=host_pipeline)
        expected = sum(item.output_len for item in parse_workload(workload, scenario.num_requests))
        for result in run_scenario(scenario):
            assert result.finished_requests == result.num_requests, (workload, result.policy)
            assert result.output_tokens == expected
            assert len(result.ttft_s) == result.num_requests and all(t >= 0 for t in result.ttft_s)
        neo = run_scenario(small_scenario(workload=workload, host_pipeline=host_pipeline, policies=("neo",)))[0]
        assert neo.host_decode_share > 0  # the GPU pool is small: some requests decode on the host


def test_a_traces_arrival_times_are_kept_only_when_asked(tmp_path, capsys):
    """By default a trace's requests all arrive at the start, as `neo bench` submits them: the
    prediction equals that of the same trace without times. With arrivals="trace" the run
    spans the arrivals (a request every 20 s here)."""
    lines = [{"prompt_len": 200 + 50 * i, "output_len": 20 + 5 * i} for i in range(6)]
    timed, untimed = tmp_path / "timed.jsonl", tmp_path / "untimed.jsonl"
    timed.write_text("".join(json.dumps(line | {"arrival_s": 20.0 * i}) + "\n" for i, line in enumerate(lines)))
    untimed.write_text("".join(json.dumps(line) + "\n" for line in lines))
    at_once = run_scenario(small_scenario(workload=f"file:{timed}", num_requests=6))
    without_times = run_scenario(small_scenario(workload=f"file:{untimed}", num_requests=6))
    at_arrivals = run_scenario(small_scenario(workload=f"file:{timed}", num_requests=6, arrivals="trace"))
    for ran, reference, spread in zip(at_once, without_times, at_arrivals):
        assert ran.summary() == reference.summary()
        assert ran.elapsed_s < 20.0 <= 5 * 20.0 < spread.elapsed_s
    with pytest.raises(ValueError, match="unknown arrivals 'poisson'; choose from at-once, trace"):
        run_scenario(small_scenario(arrivals="poisson"))
    common = ["simulate", "--model", "llama-3.1-8b", "--hardware", "g5.2xlarge", "--gpu-kv-cache-gib", "0.25",
              "--workload", f"file:{timed}", "--num-requests", "6", "--policies", "gpu-only"]
    assert cli.main(common) == 0
    assert "6 requests submitted at once" in capsys.readouterr().out
    assert cli.main(common + ["--arrivals", "trace", "--json"]) == 0
    [result] = json.loads(capsys.readouterr().out)["results"]
    assert result["elapsed_s"] > 5 * 20.0


@pytest.mark.parametrize("override", [{"host_cores": 1}, {"host_read_gbps": 0}])
def test_no_host_attention_makes_neo_plan_as_gpu_only(override):
    hardware = with_overrides(SMALL["hardware"], override)
    gpu_only, neo = run_scenario(small_scenario(hardware=hardware, policies=("gpu-only", "neo")))
    assert neo.host_decode_share == 0 and neo.note
    assert neo.output_tokens_per_s == pytest.approx(gpu_only.output_tokens_per_s)
    assert neo.iterations == gpu_only.iterations


# -- errors and the command line --------------------------------------------------------------


@pytest.mark.parametrize("model, queued, waited_layers", [
    ("qwen2.5-32b", 56, 0), ("qwen2.5-32b", 20, 32 - 20), ("llama-3.1-8b", 20, 32 - 20), ("llama-3.1-8b", 40, 0),
    ("neo-tiny", 2, 4 - 2)])
def test_launching_a_host_batch_holds_the_engine_until_the_driver_queues_its_host_functions(model, queued,
                                                                                           waited_layers):
    """The async host pipeline (full-offload: every decode is in a host batch, whether or not it
    pays, so the tiny model launches some too): the engine queues two parts of 16 layers of a
    host batch at a launch (all the layers of a smaller model); each launch moves the clock on
    by its host attention's share of those beyond ``queued_host_functions``, before the GPU
    iteration planned with it starts."""
    hardware = with_overrides(preset("h100"), {"queued_host_functions": queued})
    config = Scenario(model=model, hardware=hardware, workload="synthetic:input=1,output=1",
                      num_requests=1, policies=("full-offload",), gpu_kv_cache_gib=1.0 if model != "neo-tiny" else 0.001,
                      cpu_kv_cache_gib=32.0).engine_config("full-offload")
    table = synthesize_table(resolve_model_config(model), hardware, max_num_batched_tokens=8192,
                             max_num_seqs=256, max_model_len=4096, pool_tokens=1 << 20)
    simulation = Simulation(config, resolve_model_config(model), hardware, table, 4096)
    launched = []
    original = simulation.launch

    def launch(plan):
        before = simulation.clock
        original(plan)
        launched.append((simulation.clock - before, simulation.in_flight.host_seconds))

    simulation.launch = launch
    result = simulation.run(parse_workload("synthetic:input=500,output=100", 60))
    assert result.host_batches == len(launched) > 0
    for held, host in launched:
        assert held == pytest.approx(host * waited_layers / resolve_model_config(model).num_layers, rel=1e-9)
    assert all(held > 0 for held, _ in launched) == (waited_layers > 0)
    with pytest.raises(ValueError, match="queued_host_functions must be a whole number, got 2.5"):
        with_overrides(preset("h100"), {"queued_host_functions": 2.5})


def test_a_host_batch_that_completes_during_an_iteration_launched_ahead_is_followed_at_once():
    """Under async scheduling the engine collects a host batch that completes while it waits
    for an iteration's tokens and launches the next one then (``Scheduler.schedule_host_batch``);
    the simulation does the same: such a batch starts when the one before it ends, and every
    host decode is counted once."""
    model = resolve_model_config("qwen2.5-32b")
    scenario = Scenario(model="qwen2.5-32b", hardware=preset("h100"), workload="synthetic:input=1,output=1",
                        num_requests=1, policies=("neo",), gpu_kv_cache_gib=2.0, cpu_kv_cache_gib=64.0)
    table = PerfTable.load(PROFILE)
    simulation = Simulation(scenario.engine_config("neo"), model, preset("h100"), table, 4096)
    launches = []  # (the batch before's end, the launch's start)
    original = simulation.launch

    def launch(plan, at=None):
        before = simulation.host_batches[-1].done_at if simulation.host_batches else None
        original(plan, at)
        launches.append((before, simulation.in_flight.done_at - simulation.in_flight.seconds, at is not None))

    simulation.launch = launch
    workload = parse_workload("synthetic:input=500,output=300", 80)
    result = simulation.run(workload)
    between = [(before, start) for before, start, between_steps in launches if between_steps]
    assert len(between) > result.host_batches / 2
    assert all(start == pytest.approx(before, rel=0, abs=1e-12) for before, start in between)
    assert result.host_decode_tokens == sum(result.host_batch_sizes)
    assert result.finished_requests == 80 and result.output_tokens == sum(r.output_len for r in workload)


def test_bad_hardware_and_overrides_are_clear_errors():
    with pytest.raises(ValueError, match="unknown hardware 'b200'; choose one of h100, h200, a100, g4dn.4xlarge"):
        preset("b200")
    with pytest.raises(ValueError, match="host_read_gbps must be >= 0, got -5"):
        with_overrides(preset("h100"), {"host_read_gbps": -5})
    with pytest.raises(ValueError, match="unknown hardware field 'cores'"):
        with_overrides(preset("h100"), {"cores": 4})
    with pytest.raises(ValueError, match="hbm_gbps must be > 0"):
        with_overrides(preset("h100"), {"hbm_gbps": 0})
    with pytest.raises(ValueError, match="do not fit gpu_memory_gib=4"):
        run_scenario(small_scenario(hardware=with_overrides(preset("h100"), {"gpu_memory_gib": 4})))


def test_cli_reports_bad_input_by_name(capsys):
    assert cli.main(["simulate", "--model", "llama-3.1-8b", "--hardware", "t4"]) == 2
    assert "unknown hardware 't4'; choose one of h100" in capsys.readouterr().err
    assert cli.main(["simulate", "--model", "llama-3.1-8b", "--policies", "gpu-only,fastest"]) == 2
    assert "--policies must list some of gpu-only" in capsys.readouterr().err


def test_cli_end_to_end_json(capsys):
    code = cli.main(["simulate", "--model", "llama-3.1-8b", "--hardware", "g5.2xlarge", "--host-read-gbps", "30",
                     "--gpu-kv-cache-gib", "0.25", "--cpu-kv-cache-gib", "8", "--workload",
                     "synthetic:input=200,output=30", "--num-requests", "24", "--max-num-seqs", "64", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scenario"]["hardware"]["host_read_gbps"] == 30
    assert [r["policy"] for r in report["results"]] == ["gpu-only", "neo", "full-offload"]
    for result in report["results"]:
        assert result["finished_requests"] == 24
        assert result["output_tokens_per_s"] > 0 and result["ttft_s"]["p50"] is not None
        head, tail = result["head_and_tail_s"]
        assert 0 < head < result["elapsed_s"] and 0 < tail < result["elapsed_s"]


def test_cli_table(capsys):
    code = cli.main(["simulate", "--model", "llama-2-7b", "--hardware", "g4dn.4xlarge", "--gpu-kv-cache-gib", "0.5",
                     "--max-num-batched-tokens", "2048", "--workload", "synthetic:input=200,output=30",
                     "--num-requests", "16", "--policies", "gpu-only,neo"])
    assert code == 0
    out = capsys.readouterr().out
    assert "llama-2-7b on g4dn.4xlarge (float16" in out
    assert out.count("x ") >= 2 and "neo" in out
    assert "head/tail s" in out


def test_a_prompt_that_never_fits_is_refused_by_name():
    with pytest.raises(ValueError, match="tokens can never fit the KV pools: the largest the gpu-only policy "
                                         "decodes in holds 400 tokens"):
        run_scenario(small_scenario(workload="synthetic:input=500,output=10", gpu_kv_cache_gib=0.05,
                                    policies=("gpu-only",)))


def test_plots_are_written(tmp_path, capsys):
    common = ["simulate", "--model", "llama-3.1-8b", "--gpu-kv-cache-gib", "0.25", "--cpu-kv-cache-gib", "8",
              "--workload", "synthetic:input=300,output=40", "--num-requests", "24", "--max-num-seqs", "64"]
    heatmap, cores = tmp_path / "heatmap.png", tmp_path / "cores.png"
    assert cli.main(common + ["--hardware", "g5.2xlarge", "--plot", "heatmap", "--sweep-host-read-gbps", "10,80",
                              "--sweep-gpu-kv-cache-gib", "0.25,0.5", "--plot-output", str(heatmap)]) == 0
    assert cli.main(common + ["--plot", "cores", "--sweep-hardware", "g5.2xlarge,g5.16xlarge",
                              "--plot-output", str(cores)]) == 0
    for path in (heatmap, cores):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(common + ["--plot", "heatmap", "--sweep-host-read-gbps", "10,-1"]) == 2
    assert "--sweep-host-read-gbps must list positive numbers" in capsys.readouterr().err


def test_gain_grows_with_host_bandwidth():
    [[slow, fast]] = gain_grid(small_scenario(), [5.0, 200.0], [0.25])
    assert fast > slow


def test_steps_not_planned_ahead_make_the_gpu_wait_for_the_host():
    """A gpu-only run with room for every request: with async scheduling off every step makes
    the GPU wait ``sync_step_us`` plus ``sync_step_request_us`` per request; with it on only the
    first step does (each later one is planned while the previous iteration runs)."""
    model = resolve_model_config("llama-3.1-8b")
    quiet, busy = preset("h100"), with_overrides(preset("h100"), {"sync_step_us": 10_000.0,
                                                                  "sync_step_request_us": 100.0})
    quiet = with_overrides(quiet, {"sync_step_us": 0.0, "sync_step_request_us": 0.0})
    table = synthesize_table(model, quiet, max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=4096,
                             pool_tokens=1 << 20)
    workload = parse_workload("synthetic:input=200,output=20", 8)
    config = Scenario(model="llama-3.1-8b", hardware=quiet, workload="synthetic:input=1,output=1", num_requests=1,
                      policies=("gpu-only",), gpu_kv_cache_gib=8.0).engine_config("gpu-only")

    def run(hardware, async_scheduling):
        steps = []
        simulation = Simulation(dataclasses.replace(config, async_scheduling=async_scheduling), model, hardware,
                                table, 4096, on_iteration=lambda plan, seconds: steps.append(len(plan.requests)))
        return simulation.run(workload).elapsed_s, steps

    base, steps = run(quiet, False)
    synchronous, _ = run(busy, False)
    ahead, _ = run(busy, True)
    assert synchronous == pytest.approx(base + len(steps) * 0.010 + sum(steps) * 100e-6, rel=1e-9)
    assert ahead == pytest.approx(base + 0.010 + steps[0] * 100e-6, rel=1e-9)


SHIPPED_TABLES = sorted(entry.name for entry in resources.files("neo.sim.profiles").iterdir()
                        if entry.name.endswith("-profile.json"))


@pytest.mark.parametrize("name", SHIPPED_TABLES)
def test_each_shipped_table_is_of_the_model_and_gpu_its_name_says(name):
    """``<model>[-tp<N>]-<gpu>-profile.json``: the table's key names the model's shape, the GPU
    and the rank count, so a simulation given it prices the model it is for."""
    table = json.loads(resources.files("neo.sim.profiles").joinpath(name).read_text())
    stem = name.removesuffix("-profile.json")
    stem, gpu = stem.rsplit("-", 1)
    model_name, _, ranks = stem.partition("-tp")
    model = resolve_model_config(model_name)
    key = table["key"]
    assert key["model_shape"] == model.shape_key
    assert gpu.upper() in key["device"].upper().replace(" ", "")
    assert key.get("tensor_parallel_size", 1) == (int(ranks) if ranks else 1)
    assert len(table["host_attention_seconds"]) == len(table["host_attention_tokens"]) > 0

"""The executor walks the plan's ``StageOrder``: the stages that actually run (the model layers'
stage methods and the host hand-off's starts, recorded as they are called) are exactly the
order's steps, for every order the engine has, eagerly and through the engine's runner for the
two-sub-batch order the setting selects."""

import pytest
import torch

from engine_reference import PROMPTS, gib_for_blocks, greedy_continuations, transformers_tiny
from neo import LLM, EngineConfig, LLMEngine, SamplingParams
from neo.request import KVLocation
from neo.runner.batch_inputs import build_batch_inputs
from neo.sched.scheduler_output import SubBatch
from neo.sched.block_manager import BlockManager
from neo.sched.calibration import HOST_TIME_PRIOR, TimeCalibration
from neo.sched.cost import StageTimes, iteration_seconds
from neo.sched.estimates import Estimates
from neo.sched.graph_coverage import GraphCoverage
from neo.sched.stage_order import ASYMMETRIC, HOST_BATCH, STAGE_ORDERS, Stage, host_batch_sub_batches
from scheduler_harness import requests_of, synthetic_model

NO_SWAPS = torch.empty((0, 2), dtype=torch.int64)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    return greedy_continuations(transformers_tiny(str(tmp_path_factory.mktemp("neo-tiny"))), PROMPTS, NEW_TOKENS)


class StageRecorder:
    """Records the stages that actually run: the model layers' stage methods and the host
    hand-off's starts, as ``str(Step)`` with the sub-batch told apart by its metadata."""

    def __init__(self, model, executor):
        self.calls: list[str] = []
        self.sub_batch_of: dict[int, int] = {}  # id(metadata) -> sub-batch index
        for index, layer in enumerate(model.layers):
            for stage, method, meta_position in (("pre", "pre_attention", 2), ("attn_gpu", "attention", 3),
                                                 ("post", "post_attention", 2)):
                setattr(layer, method, self._wrap(getattr(layer, method), stage, index, meta_position))
        start = executor.hand_off.start

        def recorded_start(sub_batch, layer, rows, meta, k_cache, v_cache):
            self.calls.append(f"attn_host({self.sub_batch_of[id(meta)]},{layer})")
            return start(sub_batch, layer, rows, meta, k_cache, v_cache)

        executor.hand_off.start = recorded_start

    def _wrap(self, method, stage: str, layer: int, meta_position: int):
        def recorded(*args, **kwargs):
            self.calls.append(f"{stage}({self.sub_batch_of[id(args[meta_position])]},{layer})")
            return method(*args, **kwargs)
        return recorded

    def expect(self, inputs) -> None:
        """The sub-batches of the next run."""
        self.expect_metadata([batch.metadata for batch in inputs])

    def expect_metadata(self, metadata) -> None:
        """The sub-batches of the next run, by their attention metadata."""
        self.sub_batch_of = {id(meta): index for index, meta in enumerate(metadata)}
        self.calls = []


def engine_with_host_and_gpu_requests(stage_order: str = "asymmetric") -> tuple[LLMEngine, list, list]:
    """A neo engine (lockstep, CPU) with one GPU request and two host requests about to decode."""
    engine = LLMEngine(EngineConfig(policy="neo", device="cpu", dtype="float32", gpu_kv_cache_gib=gib_for_blocks(16),
                                    cpu_kv_cache_gib=gib_for_blocks(16), perf_model="zero",
                                    host_pipeline="lockstep", stage_order=stage_order))
    profiler = engine.profiler
    gpu = profiler.allocate_requests(KVLocation.GPU, [9])
    host = profiler.allocate_requests(KVLocation.HOST, [7, 12])
    return engine, gpu, host


@pytest.mark.parametrize("name", sorted(STAGE_ORDERS))
def test_the_stages_the_executor_runs_are_the_orders_steps(name):
    order = STAGE_ORDERS[name]
    engine, gpu, host = engine_with_host_and_gpu_requests()
    try:
        runner = engine.runner
        recorder = StageRecorder(engine.model, runner.executor)
        batches = ([SubBatch(gpu_decodes=gpu, host_decodes=host[:1]), SubBatch(host_decodes=host[1:])]
                   if order.num_sub_batches == 2 else [SubBatch(gpu_decodes=gpu, host_decodes=host)])
        inputs = [build_batch_inputs(batch, runner.block_size, runner.device) for batch in batches]
        recorder.expect(inputs)
        logits = runner.executor.run(inputs, order, NO_SWAPS, NO_SWAPS)
        assert logits.shape[0] == 3
        assert recorder.calls == [str(step) for step in order.steps(engine.model_config.num_layers)]
    finally:
        engine.close()


@pytest.mark.parametrize("stage_order", ["asymmetric", "asymmetric-early-host"])
def test_the_engine_runs_two_sub_batch_iterations_in_the_selected_order(stage_order, expected):
    llm = LLM("neo-tiny", device="cpu", dtype="float32", policy="neo", gpu_kv_cache_gib=gib_for_blocks(6),
              cpu_kv_cache_gib=gib_for_blocks(64), perf_model="zero", host_pipeline="lockstep",
              stage_order=stage_order)
    try:
        executor = llm.engine.runner.executor
        recorder = StageRecorder(llm.engine.model, executor)
        walked = []
        run = executor.run

        def recording_run(batches, order, swap_out, swap_in):
            recorder.expect(batches)
            logits = run(batches, order, swap_out, swap_in)
            with_host = {index for index, inputs in enumerate(batches) if inputs.metadata.num_host_decodes}
            walked.append((order, recorder.calls, with_host))
            return logits

        executor.run = recording_run
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        two = [entry for entry in walked if entry[0].num_sub_batches == 2]
        assert two and llm.get_metrics()["two_batch_iterations"] == len(two)
        layers = llm.engine.model_config.num_layers
        for order, calls, with_host in two:
            assert order.name == stage_order
            # A sub-batch without host decodes hands nothing to the host.
            assert calls == [str(step) for step in order.steps(layers)
                             if step.stage is not Stage.ATTN_HOST or step.sub_batch in with_host]
    finally:
        llm.close()




@pytest.mark.parametrize("name", ["host-batch", "host-batch-pair"])
@pytest.mark.parametrize("count", range(1, 10))
def test_a_host_batch_splits_into_even_contiguous_sub_batches(name, count):
    order, parts = host_batch_sub_batches(STAGE_ORDERS[name], count)
    requests = list(range(count))
    assert [request for part in parts for request in requests[part]] == requests
    sizes = [len(requests[part]) for part in parts]
    assert all(sizes) and sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
    if count < STAGE_ORDERS[name].num_sub_batches:
        assert order is HOST_BATCH and len(parts) == 1
    else:
        assert order is STAGE_ORDERS[name] and len(parts) == order.num_sub_batches


@pytest.mark.parametrize("host_batch_order", ["host-batch", "host-batch-pair"])
def test_the_engine_runs_host_batches_in_the_selected_order(host_batch_order, expected):
    """Every host batch of the async host pipeline walks its layers in the selected order (whole
    where it holds one request), over sub-batches that hold its requests in order, and the
    tokens are transformers'."""
    llm = LLM("neo-tiny", device="cpu", dtype="float32", policy="neo", gpu_kv_cache_gib=gib_for_blocks(6),
              cpu_kv_cache_gib=gib_for_blocks(64), perf_model="zero", host_pipeline="async",
              host_batch_order=host_batch_order)
    try:
        runner = llm.engine.runner.host_batches
        executor = runner.executor
        walked = []  # (order name, requests per sub-batch, layers) of each part
        forward_layers = executor.forward_layers

        def recording_forward_layers(states, metadata, order, layers):
            walked.append((order.name, [meta.num_host_decodes for meta in metadata], layers))
            return forward_layers(states, metadata, order, layers)

        executor.forward_layers = recording_forward_layers
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert walked and llm.get_metrics()["host_batches"] > 0
        assert {layers for _, _, layers in walked} == set(runner.parts)
        for name, sizes, _ in walked:
            expected_order, parts = host_batch_sub_batches(STAGE_ORDERS[host_batch_order], sum(sizes))
            assert name == expected_order.name and sizes == [len(range(sum(sizes))[part]) for part in parts]
        if host_batch_order == "host-batch-pair":
            assert any(len(sizes) == 2 for _, sizes, _ in walked)
    finally:
        llm.close()


@pytest.mark.parametrize("count", [1, 2, 7])
def test_a_host_batch_is_estimated_in_its_order_over_its_sub_batches(count):
    """The estimate of a host batch is the cost function of its order over the sub-batches the
    runner splits it into, host attention scaled by the calibration; its GPU stages are each
    sub-batch's linear time."""
    model = synthetic_model(1e-4, 1e-7, 1e-6)
    requests = requests_of(count, prompt_len=30, max_tokens=10)
    for name in ("host-batch", "host-batch-pair"):
        estimates = Estimates(model, TimeCalibration(prior=1.5), GraphCoverage(), BlockManager(8, 64, 16),
                              ASYMMETRIC, STAGE_ORDERS[name])
        order, parts = host_batch_sub_batches(STAGE_ORDERS[name], count)
        times = [StageTimes(model.linear(len(requests[part])), 0.0,
                            1.5 * model.host_attention(len(requests[part]), 30 * len(requests[part])))
                 for part in parts]
        seconds, host = estimates.host_batch_time(requests)
        assert seconds == pytest.approx(iteration_seconds(order, times, model.table.pre_fraction,
                                                          fixed_overhead=model.table.host_batch_overhead))
        assert host == pytest.approx(sum(time.host_attention for time in times))
        assert estimates.host_batch_time_of(count, 30 * count) == pytest.approx(seconds)
        assert estimates.host_batch_gpu_time(count) == pytest.approx(sum(time.linear for time in times))


@pytest.mark.parametrize("host_batch_order", ["host-batch", "host-batch-pair"])
def test_a_host_batchs_gpu_stages_cost_a_decode_graph_of_its_rows_where_it_replays_graphs(host_batch_order):
    """A host batch replays graphs of its own for sub-batches within the host-batch graphs'
    rows: its GPU stages then cost what the profile's decode graph of as many short requests
    does (launched one by one, ``linear`` can be several times that); beyond those rows, or
    beyond the table's graph points, each sub-batch costs its linear time."""
    model = synthetic_model(1e-4, 1e-7, 1e-6)
    model.table.graph_decode_requests = [1, 4, 16, 64]
    model.table.graph_decode_seconds = [2e-4, 3e-4, 5e-4, 9e-4]
    model.table.graph_decode_context = 16
    order = STAGE_ORDERS[host_batch_order]
    for count in (1, 9, 40, 100):
        _, parts = host_batch_sub_batches(order, count)
        rows = [part.stop - part.start for part in parts]
        for covered in (0, 16, 64):
            estimates = Estimates(model, TimeCalibration(prior=HOST_TIME_PRIOR),
                                  GraphCoverage(host_batch_max_requests=covered),
                                  BlockManager(8, 64, 16), ASYMMETRIC, order)
            expected = sum(model.graph_decode(size, 0) if size <= covered else model.linear(size) for size in rows)
            assert estimates.host_batch_gpu_time(count) == pytest.approx(expected)
            if covered == 64 and count <= 64:  # every sub-batch replays: a decode graph's time, below linear's
                assert estimates.host_batch_gpu_time(count) < sum(model.linear(size) for size in rows)
    estimates = Estimates(model, TimeCalibration(prior=HOST_TIME_PRIOR), GraphCoverage(host_batch_max_requests=512),
                          BlockManager(8, 64, 16), ASYMMETRIC, STAGE_ORDERS["host-batch"])
    assert estimates.host_batch_gpu_time(100) == pytest.approx(model.linear(100))  # past the table's points


def test_the_profile_key_names_a_host_batch_order_other_than_the_default():
    """The profiled host-batch overhead is measured in the engine's order: a table of one order
    does not serve the other, and tables of the default keep their keys."""
    keys = {}
    for order in ("host-batch", "host-batch-pair"):
        engine = LLMEngine(EngineConfig(policy="neo", device="cpu", host_batch_order=order, perf_model="zero",
                                        cpu_kv_cache_gib=gib_for_blocks(16)))
        try:
            keys[order] = engine.profiler.key()
        finally:
            engine.close()
    assert "host_batch_order" not in keys["host-batch"]
    assert keys["host-batch-pair"] == keys["host-batch"] | {"host_batch_order": "host-batch-pair"}


def test_an_unknown_host_batch_order_setting_lists_the_choices():
    with pytest.raises(ValueError, match="unknown host batch order 'zigzag'; choose one of host-batch, "
                                         "host-batch-pair"):
        LLMEngine(EngineConfig(policy="neo", device="cpu", host_batch_order="zigzag", perf_model="zero"))


def test_an_unknown_stage_order_setting_lists_the_choices():
    with pytest.raises(ValueError, match="unknown two-sub-batch stage order 'zigzag'; choose one of asymmetric, "
                                         "asymmetric-early-host"):
        LLMEngine(EngineConfig(policy="neo", device="cpu", stage_order="zigzag", perf_model="zero"))

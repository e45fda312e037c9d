"""A host batch's layers in parts (``neo.runner.host_batches``): the executor's walk over layer
ranges gives exactly the whole walk's logits, the split into parts covers every layer once, and a
bad part size is refused. On CUDA, an engine whose host batches run their layers in several
parts (graph replays, or eager walks where no graph fits), each launch queuing at most two of
them, gives the tokens of one part, its graphs all captured while the engine was built.
"""

import functools
import math

import pytest
import torch

import neo.engine.build
from engine_reference import PROMPTS, gib_for_blocks
from neo import LLM, EngineConfig, LLMEngine, SamplingParams
from neo.request import KVLocation
from neo.runner.batch_inputs import build_batch_inputs
from neo.runner.executor import layer_parts
from neo.runner.host_batches import HostBatchRunner
from neo.sched.scheduler_output import SubBatch
from neo.sched.stage_order import HOST_BATCH

NO_SWAPS = torch.empty((0, 2), dtype=torch.int64)
NUM_LAYERS = 4  # neo-tiny's


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def host_batch():
    """A CPU neo engine (async host pipeline, a GPU pool of 2 blocks) stepped until at least
    three requests decode from the host pool, whose KV the engine's prefills and decodes wrote;
    yields the engine and their next host batch (slots made), not launched."""
    engine = LLMEngine(EngineConfig(model="neo-tiny", policy="neo", device="cpu", dtype="float32",
                                    gpu_kv_cache_gib=gib_for_blocks(2), cpu_kv_cache_gib=gib_for_blocks(64),
                                    perf_model="zero", host_pipeline="async", async_scheduling=False,
                                    max_num_seqs=8))
    try:
        assert engine.model_config.num_layers == NUM_LAYERS
        for prompt in PROMPTS:
            engine.add_request(prompt, greedy(64))
        host = []
        for _ in range(40):
            engine.step()
            host = [request for request in engine.scheduler.running if request.location is KVLocation.HOST
                    and request.num_output_tokens >= 2]
            if len(host) >= 3 and not engine.runner.host_batch_in_flight:
                break
        assert len(host) >= 3, "the engine put too few requests in the host pool"
        for request in host:
            engine.block_manager.append_slot(request)
        yield engine, SubBatch(host_decodes=host)
    finally:
        engine.close()


def parted_logits(executor, inputs, parts: list[range]) -> torch.Tensor:
    """The batch's logits, its layers walked part by part with ``forward_layers``."""
    executor.prepare([inputs.metadata])
    states = executor.embed([inputs.input_ids])
    for layers in parts:
        states = executor.forward_layers(states, [inputs.metadata], HOST_BATCH, layers)
    hidden = executor.final_norm(states)[0]
    logits = executor.compute_logits(hidden[inputs.logits_indices])
    executor.end()
    return logits


@pytest.mark.parametrize("parts", [
    [range(0, 4)],
    [range(0, 2), range(2, 4)],
    [range(0, 3), range(3, 4)],
    [range(0, 1), range(1, 3), range(3, 4)],
    [range(0, 1), range(1, 2), range(2, 3), range(3, 4)],
], ids=["one", "two-even", "two-uneven", "three-uneven", "four"])
@torch.inference_mode()
def test_layers_walked_in_parts_give_the_whole_walks_logits(host_batch, parts):
    engine, batch = host_batch
    executor = engine.runner.host_batches.executor
    inputs = build_batch_inputs(batch, engine.runner.block_size, engine.runner.device)
    assert inputs.metadata.num_host_decodes == len(batch.host_decodes) >= 3
    whole = executor.run([inputs], HOST_BATCH, NO_SWAPS, NO_SWAPS)
    logits = parted_logits(executor, inputs, parts)
    assert logits.shape == (len(batch.host_decodes), engine.model_config.vocab_size)
    assert torch.equal(logits, whole)
    # The host attention matters: with the host cache zeroed the parts' logits change.
    saved = [(k.clone(), v.clone()) for k, v in engine.kv_cache.host_layers]
    try:
        for k, v in engine.kv_cache.host_layers:
            k.zero_()
            v.zero_()
        assert not torch.equal(parted_logits(executor, inputs, parts), whole)
    finally:
        for (k, v), (saved_k, saved_v) in zip(engine.kv_cache.host_layers, saved):
            k.copy_(saved_k)
            v.copy_(saved_v)


@pytest.mark.parametrize("layers, message", [
    (range(2, 2), "non-empty range"),
    (range(3, 5), "within \\[0, 4\\)"),
    (range(0, 4, 2), "consecutive"),
    (range(1, 3), "must have a residual exactly when"),  # the embeddings given for layer 1
])
@torch.inference_mode()
def test_forward_layers_refuses_bad_ranges(host_batch, layers, message):
    engine, batch = host_batch
    executor = engine.runner.host_batches.executor
    inputs = build_batch_inputs(batch, engine.runner.block_size, engine.runner.device)
    with pytest.raises(ValueError, match=message):
        executor.forward_layers(executor.embed([inputs.input_ids]), [inputs.metadata], HOST_BATCH, layers)


@pytest.mark.parametrize("num_layers", [*range(1, 21), 28, 32, 36, 48, 64, 80])
def test_layer_parts_cover_every_layer_once_in_order(num_layers):
    for layers_per_part in range(1, 21):
        parts = layer_parts(num_layers, layers_per_part)
        assert [layer for part in parts for layer in part] == list(range(num_layers))
        assert all(part.step == 1 and 1 <= len(part) <= layers_per_part for part in parts)
        assert len(parts) == math.ceil(num_layers / layers_per_part)
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert layer_parts(64, 16) == [range(0, 16), range(16, 32), range(32, 48), range(48, 64)]
    assert layer_parts(4, 16) == [range(0, 4)]


@pytest.mark.parametrize("layers_per_part", [0, -3, 2.5, True, None])
def test_a_bad_layers_per_part_is_refused(host_batch, layers_per_part):
    engine, _ = host_batch
    executor = engine.runner.host_batches.executor
    message = f"layers_per_part must be an integer of at least 1, got {layers_per_part!r}"
    with pytest.raises(ValueError, match=message.replace(".", "\\.")):
        HostBatchRunner(engine.model, engine.kv_cache, executor.host_kernels, engine.worker, engine.device,
                        max_decodes=8, max_blocks_per_sequence=8, graph_context=None,
                        layers_per_part=layers_per_part)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA is not available (torch.cuda.is_available() is False)")


def generate_with_parts(layers_per_part: int, monkeypatch, graphs: bool = True) -> tuple[list[list[int]], dict]:
    """Greedy tokens of PROMPTS from a CUDA neo engine (async host pipeline; CUDA graphs unless
    ``graphs`` is False) whose host batches run in parts of ``layers_per_part`` layers, and what
    its host batches did."""
    monkeypatch.setattr(neo.engine.build, "HostBatchRunner",
                        functools.partial(HostBatchRunner, layers_per_part=layers_per_part))
    llm = LLM("neo-tiny", device="cuda", dtype="float32", policy="neo", gpu_kv_cache_gib=gib_for_blocks(10),
              cpu_kv_cache_gib=gib_for_blocks(256), perf_model="zero", max_num_seqs=8, host_pipeline="async",
              use_cuda_graphs=graphs)
    try:
        runner = llm.engine.runner.host_batches
        assert runner.asynchronous, "host work is not ordered on streams (no ISPC kernels)"
        assert (runner.graphs is not None) == graphs
        # The scheduler prices a batch's GPU stages by whether they replay these graphs.
        coverage = llm.engine.runner.graph_coverage
        assert coverage.host_batch_max_requests == (runner.graphs.sizes[-1] if graphs else 0)
        assert coverage.host_batch_graph(8) == graphs and not coverage.host_batch_graph(9)
        seen = {"replayed": 0, "launch_parts": []}
        launched_before = runner.part_launches  # by any warm-up while the engine was built
        captured_at_build = set(runner.graphs.captures) if graphs else set()
        assert len(captured_at_build) == len(runner.graph_shapes)  # every shape a host batch replays
        launch, collect = runner.launch, runner.collect

        def counting_launch(batch):
            before = runner.part_launches
            launch(batch)
            seen["launch_parts"].append(runner.part_launches - before)

        def counting_collect(wait_seconds):
            output = collect(wait_seconds)
            seen["replayed"] += output is not None and output.replayed_graph
            return output

        runner.launch, runner.collect = counting_launch, counting_collect
        outputs = llm.generate(PROMPTS, greedy(32))
        seen["parts"] = len(runner.parts)
        seen["part_launches"] = runner.part_launches - launched_before
        seen["host_batches"] = llm.get_metrics()["host_batches"]
        seen["captured_while_serving"] = (set(runner.graphs.captures) - captured_at_build) if graphs else set()
        return [output.outputs[0].token_ids for output in outputs], seen
    finally:
        llm.close()


@needs_cuda
@pytest.mark.parametrize("layers_per_part", [1, 2])
def test_graph_parts_give_the_tokens_of_one_part(layers_per_part, monkeypatch):
    expected, whole = generate_with_parts(NUM_LAYERS, monkeypatch)
    tokens, parted = generate_with_parts(layers_per_part, monkeypatch)
    assert tokens == expected
    assert whole["parts"] == 1 and parted["parts"] == NUM_LAYERS // layers_per_part
    for seen in (whole, parted):
        assert seen["replayed"] > 0 and seen["host_batches"] > 0
        assert seen["part_launches"] == seen["parts"] * seen["host_batches"]  # replayed or eager alike
        assert not seen["captured_while_serving"]  # all captured while the engine was built
    # A launch queues at most two parts; ``advance`` queued the others.
    assert max(parted["launch_parts"]) == 2 and max(whole["launch_parts"]) == 1


@needs_cuda
def test_eager_parts_give_the_tokens_of_one_part(monkeypatch):
    """Without CUDA graphs (as under tensor parallelism) a host batch is walked eagerly in the
    same parts, at most two queued per launch."""
    expected, whole = generate_with_parts(NUM_LAYERS, monkeypatch, graphs=False)
    tokens, parted = generate_with_parts(1, monkeypatch, graphs=False)
    assert tokens == expected
    assert whole["parts"] == 1 and parted["parts"] == NUM_LAYERS
    for seen in (whole, parted):
        assert seen["replayed"] == 0 and seen["host_batches"] > 0
        assert seen["part_launches"] == seen["parts"] * seen["host_batches"]
    assert max(parted["launch_parts"]) == 2 and max(whole["launch_parts"]) == 1

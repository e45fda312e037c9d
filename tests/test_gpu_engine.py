"""The engine on a CUDA device (skipped without CUDA).

- float32: the GPU engine's greedy tokens equal the CPU engine's and transformers', for every
  policy, with GPU pools small enough that requests are preempted or decode on the host;
- bfloat16: with the same tokens forced into every policy, the logits of gpu-only and the
  offloading policies agree within bf16 rounding, decode after decode.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import neo.runner.host_attention

from engine_reference import NEW_TOKENS, PROMPTS, gib_for_blocks, greedy_continuations, transformers_tiny
from mixed_batch import assert_all_blocks_free, engine_for, make_mixed_requests, run_mixed
from neo import LLM, EngineConfig, LLMEngine, SamplingParams
from neo.kv.kv_cache import CacheLayout, KVCache
from neo.ops import reference
from neo.request import KVLocation

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA is not available (torch.cuda.is_available() is False)")

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SETTINGS = {
    "gpu-only": dict(policy="gpu-only", gpu_blocks=1024),
    "gpu-only-preempting": dict(policy="gpu-only", gpu_blocks=8),
    "neo": dict(policy="neo", gpu_blocks=10),
    "full-offload": dict(policy="full-offload", gpu_blocks=10),
    "neo-async": dict(policy="neo", gpu_blocks=10, host_pipeline="async"),
    "full-offload-async": dict(policy="full-offload", gpu_blocks=10, host_pipeline="async"),
    "neo-async-pair": dict(policy="neo", gpu_blocks=10, host_pipeline="async", host_batch_order="host-batch-pair"),
    "full-offload-async-pair": dict(policy="full-offload", gpu_blocks=10, host_pipeline="async",
                                    host_batch_order="host-batch-pair"),
}


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    return greedy_continuations(transformers_tiny(str(tmp_path_factory.mktemp("neo-tiny"))))


def generate(device: str, policy: str, gpu_blocks: int, cuda_graphs: bool = True, host_pipeline: str = "lockstep",
             host_batch_order: str = "host-batch"):
    """Greedy tokens of PROMPTS, the engine's counters, and the pipeline graphs captured, as
    (stage order, shape) (those of the host batches under the async host pipeline)."""
    llm = LLM("neo-tiny", device=device, dtype="float32", policy=policy,
              gpu_kv_cache_gib=gib_for_blocks(gpu_blocks), cpu_kv_cache_gib=gib_for_blocks(256),
              perf_model="zero", max_num_seqs=8, use_cuda_graphs=cuda_graphs, host_pipeline=host_pipeline,
              host_batch_order=host_batch_order)
    try:
        outputs = llm.generate(PROMPTS, GREEDY)
        runner = llm.engine.runner
        graphs = runner.host_batches.graphs if runner.host_batches is not None else runner.pipeline_graphs
        return [o.outputs[0].token_ids for o in outputs], llm.get_metrics(), list(graphs.captures) if graphs else []
    finally:
        llm.close()


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_gpu_engine_equals_cpu_engine_float32(cuda_graphs):
    gpu_tokens, _, _ = generate("cuda", "gpu-only", 1024, cuda_graphs)
    cpu_tokens, _, _ = generate("cpu", "gpu-only", 1024)
    assert gpu_tokens == cpu_tokens


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_policies_equal_transformers_on_gpu_float32(setting, cuda_graphs, expected):
    tokens, metrics, captured = generate("cuda", cuda_graphs=cuda_graphs, **SETTINGS[setting])
    assert tokens == expected
    if setting == "gpu-only-preempting":
        assert metrics["blocks_swapped_out"] > 0 and metrics["blocks_swapped_in"] > 0
        # decode-only plans that moved blocks copied them, then replayed a decode graph
        assert (metrics["graph_swap_iterations"] > 0) == cuda_graphs
    if SETTINGS[setting]["policy"] == "gpu-only":
        return
    assert metrics["host_decode_tokens"] > 0
    if SETTINGS[setting].get("host_pipeline") == "async":
        assert metrics["host_batches"] > 0 and metrics["two_batch_iterations"] == 0
        assert (metrics["graph_host_batches"] > 0) == cuda_graphs
        order = SETTINGS[setting].get("host_batch_order", "host-batch")
        if cuda_graphs:  # captured while the engine was built: the shapes of the order's sub-batches
            assert captured and all((name, len(shape)) in (("host-batch", 1), (order, 2)) for name, shape in captured)
            assert any(name == order for name, _ in captured)
        if setting.startswith("neo-async"):  # GPU decodes replayed decode graphs meanwhile
            assert (metrics["graph_iterations"] > 0) == cuda_graphs
    else:
        assert metrics["two_batch_iterations"] > 0
        assert (metrics["graph_iterations"] > 0) == cuda_graphs
        if cuda_graphs:  # decode-only iterations with host decodes replayed pipeline graphs
            assert any(order == "asymmetric" and len(shape) == 2 for order, shape in captured)


def run_forced(policy: str, gpu_blocks: int, script: dict[int, list[int]], steps: int):
    """Run the prompts for ``steps`` iterations in bf16, forcing the tokens in ``script``;
    returns {(prompt index, token index): logits row}."""
    engine = LLMEngine(EngineConfig(model="neo-tiny", device="cuda", dtype="bfloat16", policy=policy,
                                    gpu_kv_cache_gib=gib_for_blocks(gpu_blocks, 2 * 4 * 2 * 16 * 32 * 2),
                                    cpu_kv_cache_gib=gib_for_blocks(256, 2 * 4 * 2 * 16 * 32 * 2),
                                    perf_model="zero", max_num_seqs=8, use_cuda_graphs=False,
                                    host_pipeline="lockstep",  # every token through runner.execute
                                    async_scheduling=False))
    recorded = {}
    requests = {}
    current = []  # the requests of the iteration being executed, in logits-row order
    execute = engine.runner.execute

    def execute_recording_order(plan, on_launched=None):
        current[:] = plan.requests
        return execute(plan, on_launched)

    def sampler(logits, params, generators):
        tokens = []
        for row, request in zip(logits, current):
            index = requests[request.request_id]
            position = request.num_output_tokens
            recorded[(index, position)] = row.float().cpu()
            tokens.append(script[index][position])
        return torch.tensor(tokens, device=logits.device)

    try:
        for index, prompt in enumerate(PROMPTS):
            request = engine.add_request(prompt, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
            requests[request.request_id] = index
        engine.runner.sampler = sampler
        engine.runner.execute = execute_recording_order
        while engine.has_unfinished_requests():
            engine.step()
        metrics = engine.metrics.as_dict()
    finally:
        engine.close()
    return recorded, metrics


def test_policies_agree_on_logits_in_bf16():
    steps = 12
    script = {index: [(31 * index + 7 * step) % 250 + 3 for step in range(steps)] for index in range(len(PROMPTS))}
    reference, _ = run_forced("gpu-only", 1024, script, steps)
    for policy in ("neo", "full-offload"):
        logits, metrics = run_forced(policy, 10, script, steps)
        assert metrics["host_decode_tokens"] > 0
        assert logits.keys() == reference.keys()
        for key, row in logits.items():
            expected_row = reference[key]
            error = (row - expected_row).abs().max() / expected_row.abs().max()
            assert error < 3e-2, f"{policy}: logits of prompt {key[0]} token {key[1]} differ by {error:.3g}"


def test_concurrently_replayed_graphs_are_captured_on_streams_of_their_own():
    """Under the async host pipeline the host batches' pipeline graphs replay beside the decode
    graphs. Graphs captured on one stream share its cuBLAS workspace, and GEMMs sharing a
    workspace at the same time deadlocked the GPU (benchmarks/concurrent_graphs.py)."""
    llm = LLM("neo-tiny", device="cuda", dtype="float32", policy="neo", gpu_kv_cache_gib=gib_for_blocks(10),
              cpu_kv_cache_gib=gib_for_blocks(256), perf_model="zero", max_num_seqs=8, host_pipeline="async")
    try:
        runner = llm.engine.runner
        streams = {runner.decode_graphs.capture_stream.cuda_stream,
                   runner.host_batches.graphs.capture_stream.cuda_stream}
        shared = torch.cuda.graph.default_capture_stream
        assert len(streams) == 2 and (shared is None or shared.cuda_stream not in streams)
    finally:
        llm.close()


def test_close_releases_the_decode_graphs():
    """A tensor-parallel rank must free its decode graphs before leaving its process group
    (they hold its collectives, and NCCL would wait forever to destroy it); every engine's close
    frees them."""
    llm = LLM("neo-tiny", device="cuda", dtype="float32", policy="gpu-only", gpu_kv_cache_gib=gib_for_blocks(64),
              max_num_seqs=8)
    runner = llm.engine.runner
    graphs = runner.decode_graphs
    assert graphs.graphs
    llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    llm.close()
    assert runner.decode_graphs is None and not graphs.graphs and not graphs.hidden


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gpu_store_kernel_writes_the_page_locked_host_pool_in_place(dtype):
    """The K/V a prefill makes for a host-bound request is stored by the GPU's store kernel
    through ``host_layers_for_device``: CUDA tensors over the page-locked host pool's own bytes.
    The host pool then holds what the reference store writes, in that layer only."""
    layout = CacheLayout(num_layers=2, num_kv_heads=2, block_size=16, head_dim=64, dtype=dtype,
                         num_gpu_blocks=4, num_host_blocks=8)
    cache = KVCache(layout, torch.device("cuda"))
    try:
        generator = torch.Generator().manual_seed(0)
        key, value = (torch.randn(20, 2, 64, generator=generator).to(dtype) for _ in range(2))
        slots = torch.randperm(8 * 16, generator=generator)[:20]
        device_k, device_v = cache.host_layers_for_device[1]
        host_k, host_v = cache.host_layers[1]
        assert device_k.is_cuda and device_k.data_ptr() == host_k.data_ptr()
        assert device_v.is_cuda and device_v.data_ptr() == host_v.data_ptr()
        torch.ops.neo.store_kv_cache(key.cuda(), value.cuda(), device_k, device_v, slots.cuda())
        torch.cuda.synchronize()
        expected_k, expected_v = torch.zeros_like(host_k), torch.zeros_like(host_v)
        reference.store_kv_cache(key, value, expected_k, expected_v, slots)
        assert torch.equal(host_k, expected_k) and torch.equal(host_v, expected_v)
        assert not cache.host_layers[0][0].any() and not cache.host_layers[0][1].any()
    finally:
        cache.close()


def test_serving_allocates_no_page_locked_memory():
    """Allocating page-locked memory waits for the whole device: under the async host pipeline
    an iteration that allocated it waited for the host batch in flight. Once the engine is
    built, serving (prefills of new lengths beside host batches included) allocates none."""
    llm = LLM("neo-tiny", device="cuda", dtype="float32", policy="neo", gpu_kv_cache_gib=gib_for_blocks(10),
              cpu_kv_cache_gib=gib_for_blocks(256), perf_model="zero", max_num_seqs=8, host_pipeline="async")
    try:
        before = torch.cuda.host_memory_stats()["num_host_alloc"]
        llm.generate(PROMPTS, GREEDY)
        assert llm.get_metrics()["host_batches"] > 0
        assert torch.cuda.host_memory_stats()["num_host_alloc"] == before
    finally:
        llm.close()


@pytest.mark.parametrize("host_pipeline", ["lockstep", "async"])
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_host_failure_ends_its_request_with_an_error_and_frees_blocks(cuda_graphs, host_pipeline, monkeypatch):
    engine = LLMEngine(EngineConfig(model="neo-tiny", device="cuda", dtype="float32", policy="full-offload",
                                    gpu_kv_cache_gib=gib_for_blocks(4), cpu_kv_cache_gib=gib_for_blocks(64),
                                    perf_model="zero", use_cuda_graphs=cuda_graphs, host_pipeline=host_pipeline))
    try:
        engine.add_request(PROMPTS[1], SamplingParams(max_tokens=10, temperature=0))
        engine.step()  # prefill, its KV copied to the host pool
        while engine.metrics.host_decode_tokens == 0:  # a decode on the host
            engine.step()
        if host_pipeline == "lockstep":  # replayed from a pipeline graph when graphs are on
            assert (engine.metrics.graph_iterations > 0) == cuda_graphs
        # The host metadata names a block beyond the host pool: the host kernel rejects it in
        # every layer's host function, inside the replayed graph or the queued iteration.
        load = neo.runner.host_attention.HostRowBuffers.load

        def load_corrupted(buffers, meta):
            load(buffers, meta)
            if meta.num_host_decodes:
                buffers.block_table[0, 0] = engine.layout.num_host_blocks + 7

        monkeypatch.setattr(neo.runner.host_attention.HostRowBuffers, "load", load_corrupted)
        outputs = []
        while engine.has_unfinished_requests():  # the failure surfaces when its batch is collected
            outputs += engine.step()
        monkeypatch.undo()
        (failed,) = [output for output in outputs if output.finished]
        assert failed.outputs[0].finish_reason == "error"
        assert re.search("host decode attention failed: .*block id", failed.error), failed.error
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free(KVLocation.HOST) == engine.layout.num_host_blocks
        survivor = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
        assert survivor.num_output_tokens == 5
    finally:
        engine.close()


def test_a_decode_graph_iteration_does_not_raise_an_earlier_host_failure():
    """A failed host attention leaves its flag set after its error was raised; a decode graph
    iteration after it (no host work of its own) must not read it as its own failure."""
    engine = LLMEngine(EngineConfig(model="neo-tiny", device="cuda", dtype="float32", policy="neo",
                                    host_pipeline="lockstep", gpu_kv_cache_gib=gib_for_blocks(1024),
                                    cpu_kv_cache_gib=gib_for_blocks(64), perf_model="zero"))
    try:
        request = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0))
        engine.step()  # the prefill
        engine.runner.executor.hand_off.failure[0] = 1  # as the failed iteration left it
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert engine.metrics.graph_iterations > 0
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
        assert request.num_output_tokens == 5
    finally:
        engine.close()


# Run in a fresh interpreter where the CUDA extension cannot be imported: the reference ops
# serve the GPU. Prints the greedy tokens of PROMPTS per setting as JSON.
WITHOUT_CUDA_KERNELS = """
import json, sys
sys.modules["neo.ops._cuda_kernels"] = None  # importing it raises ImportError
from engine_reference import PROMPTS, gib_for_blocks
from neo import LLM, SamplingParams
from neo.ops import select_implementation
assert select_implementation("store_kv_cache", "cuda").name == "reference"
results = {}
for name, policy, blocks, pipeline in [("gpu-only", "gpu-only", 1024, "lockstep"),
                                       ("gpu-only-preempting", "gpu-only", 8, "lockstep"),
                                       ("neo", "neo", 10, "lockstep"), ("neo-async", "neo", 10, "async")]:
    llm = LLM("neo-tiny", device="cuda", dtype="float32", policy=policy, gpu_kv_cache_gib=gib_for_blocks(blocks),
              cpu_kv_cache_gib=gib_for_blocks(256), perf_model="zero", max_num_seqs=8, host_pipeline=pipeline)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=%d, temperature=0, ignore_eos=True))
    results[name] = dict(tokens=[output.outputs[0].token_ids for output in outputs],
                         graph_iterations=llm.get_metrics()["graph_iterations"])
    llm.close()
print(json.dumps(results))
""" % NEW_TOKENS


def test_engine_runs_with_the_cuda_kernels_unavailable(expected):
    """With no CUDA extension the reference ops serve the GPU: the engine starts (CUDA graphs
    off, with a notice naming why) and every policy's tokens equal transformers'."""
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__),
                                                                os.environ.get("PYTHONPATH", "")]))
    completed = subprocess.run([sys.executable, "-c", WITHOUT_CUDA_KERNELS], capture_output=True, text=True,
                               timeout=600, env=environment)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "CUDA graphs are off" in completed.stderr and "_cuda_kernels" in completed.stderr
    results = json.loads(completed.stdout.strip().splitlines()[-1])
    for name, result in results.items():
        assert result["tokens"] == expected, name
        assert result["graph_iterations"] == 0, name


@pytest.mark.parametrize("gpu_blocks", [1024, 12], ids=["roomy", "preempting"])
def test_async_scheduling_gives_the_synchronous_tokens_on_gpu(gpu_blocks):
    """On CUDA the tokens are copied to page-locked memory behind the sampling and read after
    the next launch, whose input ids come from the samples on the device (CUDA graphs on)."""
    requests = make_mixed_requests()
    results = {}
    for async_scheduling in (False, True):
        engine = engine_for(async_scheduling, gpu_blocks, device="cuda")
        try:
            results[async_scheduling] = run_mixed(engine, requests)
            engine.step()  # the iteration still in flight, if any, only drops tokens
            assert_all_blocks_free(engine)
            assert engine.metrics.graph_iterations > 0
        finally:
            engine.close()
    assert results[True] == results[False]

"""The engine end to end on the CPU in float32, against Hugging Face transformers.

neo-tiny is saved as a Hugging Face directory and loaded into transformers; greedy tokens of
the engine must equal a plain greedy loop over transformers' full-sequence logits, for every
policy, for requests arriving together or one by one, with GEMM rows exact or padded to
buckets, and with GPU pools so small that requests are preempted (gpu-only) or decode on the
host (neo, full-offload).
"""

import json

import pytest
import torch

from engine_reference import NEW_TOKENS, PROMPTS, gib_for_blocks, greedy_continuations, transformers_tiny
from neo import LLM, EngineConfig, LLMEngine, SamplingParams
from neo.sched.perf_model import PerfTable
from neo.request import KVLocation


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    return greedy_continuations(transformers_tiny(str(tmp_path_factory.mktemp("neo-tiny"))))


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)

POLICY_SETTINGS = {
    # name: (policy, GPU pool blocks, host pipeline)
    "gpu-only": ("gpu-only", 1024, "lockstep"),
    "gpu-only-preempting": ("gpu-only", 8, "lockstep"),
    "neo": ("neo", 10, "lockstep"),
    "full-offload": ("full-offload", 10, "lockstep"),
    "neo-async": ("neo", 10, "async"),
    "full-offload-async": ("full-offload", 10, "async"),
}


@pytest.mark.parametrize("pad_gemm_rows", [False, True], ids=["exact-rows", "padded-rows"])
@pytest.mark.parametrize("setting", list(POLICY_SETTINGS))
def test_greedy_equals_transformers(setting, pad_gemm_rows, expected):
    policy, gpu_blocks, host_pipeline = POLICY_SETTINGS[setting]
    llm = LLM("neo-tiny", policy=policy, gpu_kv_cache_gib=gib_for_blocks(gpu_blocks),
              cpu_kv_cache_gib=gib_for_blocks(256), perf_model="zero", max_num_seqs=8, host_pipeline=host_pipeline,
              pad_gemm_rows=pad_gemm_rows)
    try:
        outputs = llm.generate(PROMPTS, GREEDY)
        metrics = llm.get_metrics()
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    if setting == "gpu-only-preempting":
        assert metrics["preemptions"] > 0 and metrics["blocks_swapped_in"] > 0
    if policy in ("neo", "full-offload"):
        assert metrics["host_decode_tokens"] > 0
        if host_pipeline == "async":
            assert metrics["host_batches"] > 0 and metrics["two_batch_iterations"] == 0
        else:
            assert metrics["two_batch_iterations"] > 0 and metrics["host_batches"] == 0
    if policy == "full-offload":
        assert metrics["gpu_decode_tokens"] == 0


@pytest.mark.parametrize("policy, host_pipeline", [("gpu-only", "lockstep"), ("neo", "lockstep"), ("neo", "async")])
def test_requests_arriving_one_by_one(policy, host_pipeline, expected):
    engine = LLMEngine(EngineConfig(policy=policy, gpu_kv_cache_gib=gib_for_blocks(12),
                                    cpu_kv_cache_gib=gib_for_blocks(256), perf_model="zero",
                                    host_pipeline=host_pipeline))
    try:
        results = {}
        pending = list(enumerate(PROMPTS))
        while pending or engine.has_unfinished_requests():
            if pending:  # one new request every other iteration
                index, prompt = pending.pop(0)
                engine.add_request(prompt, GREEDY, request_id=str(index))
            for _ in range(2):
                for output in engine.step():
                    if output.finished:
                        results[int(output.request_id)] = output.outputs[0].token_ids
        assert [results[i] for i in range(len(PROMPTS))] == expected
        for location in (KVLocation.GPU, KVLocation.HOST):
            pool = engine.block_manager.pools[location]
            assert pool.num_free == pool.num_blocks, f"{location.value} blocks leaked"
    finally:
        engine.close()


def test_text_prompts_and_stop_conditions():
    llm = LLM("neo-tiny")
    try:
        tokenizer = llm.get_tokenizer()
        output = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        assert output.prompt_token_ids == tokenizer.encode("Hello")
        assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids)
        reference = output.outputs[0].token_ids
        # A stop token id ends generation right after it.
        stop_id = reference[3]
        stopped = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_id]))[0]
        assert stopped.outputs[0].token_ids == reference[:reference.index(stop_id) + 1]
        assert stopped.outputs[0].finish_reason == "stop"
        # EOS ends generation unless ignore_eos.
        eos = tokenizer.eos_token_ids[0]
        forced = llm.generate([eos + 0], SamplingParams(max_tokens=4, temperature=0))[0]
        assert forced.outputs[0].finish_reason in ("stop", "length")
    finally:
        llm.close()


def test_seeded_sampling_is_reproducible_and_batch_independent():
    llm = LLM("neo-tiny")
    try:
        params = SamplingParams(max_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=1234)
        alone = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
        batched = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                               [SamplingParams(max_tokens=5, temperature=1.0), params,
                                SamplingParams(max_tokens=7)])[1].outputs[0].token_ids
        assert alone == batched
        other_seed = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.8, seed=99))
        assert other_seed[0].outputs[0].token_ids != alone
        # top_k=1 is greedy whatever the temperature.
        greedy = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=10, temperature=0))[0]
        top1 = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=10, temperature=1.5, top_k=1))[0]
        assert greedy.outputs[0].token_ids == top1.outputs[0].token_ids
    finally:
        llm.close()


def test_bad_input_is_rejected_and_the_engine_keeps_serving():
    engine = LLMEngine(EngineConfig(max_model_len=64, gpu_kv_cache_gib=gib_for_blocks(8),
                                    cpu_kv_cache_gib=gib_for_blocks(8)))
    try:
        good = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0))
        engine.step()
        with pytest.raises(ValueError, match="too long: the model's context is 64 tokens"):
            engine.add_request([5] * 64)
        with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 320\)"):
            engine.add_request([5, 320, 6])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request([-1])
        with pytest.raises(ValueError, match="the prompt is empty"):
            engine.add_request([])
        with pytest.raises(ValueError, match="the prompt is empty"):
            engine.add_request("")
        with pytest.raises(ValueError, match="list of integer token ids"):
            engine.add_request([1.5, 2])
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request([1, 2], request_id=good.request_id)
        small = LLMEngine(EngineConfig(gpu_kv_cache_gib=gib_for_blocks(2), cpu_kv_cache_gib=gib_for_blocks(1)))
        with pytest.raises(ValueError, match="can never fit the KV pools: the largest holds 32 tokens"):
            small.add_request([5] * 40)
        small.close()
        with pytest.raises(ValueError, match="exceeds max_num_batched_tokens=16"):
            LLMEngine(EngineConfig(max_num_batched_tokens=16)).add_request([5] * 17)
        while engine.has_unfinished_requests():
            engine.step()
        assert good.is_finished and good.num_output_tokens == 20
        assert engine.block_manager.num_free(KVLocation.GPU) == 8
    finally:
        engine.close()


@pytest.mark.parametrize("options, message", [
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be >= 0"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(seed="x"), "seed must be an integer"),
    (dict(stop_token_ids=[-3]), "stop_token_ids must be non-negative"),
    (dict(stop=[""]), "stop strings must be non-empty"),
])
def test_invalid_sampling_parameters(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


@pytest.mark.parametrize("options, message", [
    (dict(model="/nonexistent/model"), "unknown model"),
    (dict(policy="fastest"), "unknown policy 'fastest'"),
    (dict(block_size=12), "block_size must be a power of two"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
    (dict(gpu_kv_cache_gib=-1), "gpu_kv_cache_gib must be positive"),
    (dict(policy="neo", cpu_kv_cache_gib=0), "cpu_kv_cache_gib must be > 0"),
    (dict(load_format="pickle"), "unknown load_format"),
    (dict(dtype="int8"), "unsupported dtype"),
    (dict(cpu_attention_threads=100000), "cpu_attention_threads must be from 1 to this machine's"),
    (dict(cpu_attention_threads=0), "cpu_attention_threads must be from 1"),
    (dict(gpu_kv_cache_gib=float("inf")), "gpu_kv_cache_gib must be a finite number"),
    (dict(cpu_kv_cache_gib=float("nan")), "cpu_kv_cache_gib must be a finite number"),
    (dict(gpu_memory_utilization=float("nan")), "gpu_memory_utilization must be a finite number"),
    (dict(max_num_seqs=True), "max_num_seqs must be int, got True"),
    (dict(max_model_len=1.5), "max_model_len must be int or None, got 1.5"),
    (dict(block_size="16"), "block_size must be int, got '16'"),
    (dict(use_cuda_graphs=1), "use_cuda_graphs must be bool, got 1"),
    (dict(policy="full-offload", cpu_kv_cache_gib=1e-9), "the host KV pool of cpu_kv_cache_gib=1e-09 holds no block"),
    (dict(policy="neo", cpu_kv_cache_gib=1e-9), "the host KV pool of cpu_kv_cache_gib=1e-09 holds no block"),
])
def test_invalid_engine_settings(options, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        LLMEngine(EngineConfig(**options)).close()


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}')
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("host_pipeline", ["lockstep", "async"])
def test_worker_failure_ends_its_request_with_an_error_and_frees_blocks(host_pipeline):
    engine = LLMEngine(EngineConfig(policy="full-offload", gpu_kv_cache_gib=gib_for_blocks(4),
                                    cpu_kv_cache_gib=gib_for_blocks(64), perf_model="zero",
                                    host_pipeline=host_pipeline))
    try:
        engine.add_request(PROMPTS[1], SamplingParams(max_tokens=10, temperature=0))
        engine.step()  # prefill
        # Corrupt one layer's host cache view: the worker's kernel rejects it mid-iteration.
        k_cache, v_cache = engine.kv_cache.host_layers[2]
        engine.kv_cache.host_layers[2] = (k_cache.to(torch.float16), v_cache)
        outputs = []
        for _ in range(10):  # the async pipeline collects the failed host batch a step later
            outputs += engine.step()
            if not engine.has_unfinished_requests():
                break
        engine.kv_cache.host_layers[2] = (k_cache, v_cache)
        (failed,) = outputs
        assert failed.finished and failed.outputs[0].finish_reason == "error"
        assert "ValueError" in failed.error and "dtype" in failed.error
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free(KVLocation.HOST) == engine.layout.num_host_blocks
        # The engine serves the next request normally.
        survivor = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
        assert survivor.num_output_tokens == 5
    finally:
        engine.close()


@pytest.mark.parametrize("host_pipeline", ["lockstep", "async"])
def test_trace_records_every_iteration_and_host_batch(tmp_path, host_pipeline):
    path = tmp_path / "trace.json"
    llm = LLM("neo-tiny", policy="neo", gpu_kv_cache_gib=gib_for_blocks(10), cpu_kv_cache_gib=gib_for_blocks(256),
              perf_model="zero", max_num_seqs=8, trace_path=str(path), host_pipeline=host_pipeline)
    try:
        llm.generate(PROMPTS, GREEDY)
        metrics = llm.get_metrics()
    finally:
        llm.close()
    records = json.loads(path.read_text())
    host_batches = [r for r in records if r["host_batch"]]
    assert len(records) - len(host_batches) == metrics["iterations"]
    assert len(host_batches) == metrics["host_batches"]
    assert (len(host_batches) > 0) == (host_pipeline == "async")
    assert all(r["host_batch_wait_seconds"] >= 0 for r in host_batches)
    assert sum(r["host_decodes"] for r in records) == metrics["host_decode_tokens"] > 0
    assert sum(r["num_sub_batches"] == 2 for r in records) == metrics["two_batch_iterations"]
    assert sum(r["prefill_tokens"] for r in records) == metrics["prefill_tokens"]
    for record in records:
        assert record["measured_seconds"] > 0 and record["host_busy_seconds"] >= 0
        assert 0 <= record["launch_seconds"] + record["queue_seconds"] <= record["measured_seconds"]
        assert record["device_segments_freed"] is None  # counted on CUDA only
        assert record["predicted_seconds"] == 0.0 and record["predicted_host_seconds"] == 0.0  # zero model
        assert record["host_busy_seconds"] > 0 or not record["host_decodes"]


@pytest.mark.parametrize("host_pipeline", ["lockstep", "async"])
def test_measured_host_time_calibrates_the_schedulers_host_estimates(tmp_path, host_pipeline):
    # Whatever the host really takes against this straight-line profile, the scheduler's
    # correction is the measured over profiled host time of the last decode-only iterations, as
    # the trace records them.
    tokens = [1, 64, 4096]
    table = PerfTable(linear_tokens=tokens, linear_seconds=[1e-3 + 1e-6 * t for t in tokens],
                      gpu_attention_tokens=tokens, gpu_attention_seconds=[1e-7 * t for t in tokens],
                      prefill_lengths=tokens, prefill_seconds=[1e-7 * t for t in tokens],
                      host_attention_requests=[1, 8], host_attention_tokens=[tokens, tokens],
                      host_attention_seconds=[[1e-4 + 1e-6 * t for t in tokens]] * 2)
    table.save(str(tmp_path / "table.json"))
    path = tmp_path / "trace.json"
    engine = LLMEngine(EngineConfig(model="neo-tiny", policy="full-offload", gpu_kv_cache_gib=gib_for_blocks(10),
                                    cpu_kv_cache_gib=gib_for_blocks(256), perf_model=str(tmp_path / "table.json"),
                                    max_num_seqs=8, trace_path=str(path), host_pipeline=host_pipeline))
    try:
        for prompt in PROMPTS:
            engine.add_request(prompt, GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        calibration = engine.scheduler.estimates.host_calibration
    finally:
        engine.close()
    records = json.loads(path.read_text())
    decode_only = [(r["profiled_host_seconds"], r["host_busy_seconds"]) for r in records
                   if r["host_decodes"] and not r["prefill_tokens"]]
    assert calibration.num_samples == min(len(decode_only), 16) > 0
    assert calibration.samples == decode_only[-calibration.num_samples:]
    profiled, measured = map(sum, zip(*calibration.samples))
    assert calibration.scale == pytest.approx(min(max(measured / profiled, 0.25), 4.0))


@pytest.mark.parametrize("policy", ["gpu-only", "neo"])
def test_step_reports_its_launch_once_before_its_tokens(policy):
    """``on_launched`` runs once per step, after scheduling and before the step's tokens are
    appended, also when the plan is empty."""
    engine = LLMEngine(EngineConfig(policy=policy, gpu_kv_cache_gib=gib_for_blocks(4),
                                    cpu_kv_cache_gib=gib_for_blocks(64), perf_model="zero"))
    try:
        request = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0))
        seen = []
        while engine.has_unfinished_requests():
            engine.step(on_launched=lambda: seen.append(request.num_output_tokens))
        assert seen == [0, 1, 2]
        engine.step(on_launched=lambda: seen.append("empty"))
        assert seen[-1] == "empty"
    finally:
        engine.close()

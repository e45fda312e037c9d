"""The CPU attention kernel as a setting (``EngineConfig.cpu_attention_kernel``,
``--cpu-attention-kernel``): every available CPU implementation of ``paged_decode_attention``
runs the host side end to end with the same greedy tokens as transformers; a kernel registered
from Python runs too, is the one called, and leaves ``torch.ops.neo``'s label truthful; an
unknown or unavailable name is refused with the available ones; the perf-model key names the
kernel."""

import json

import pytest

import neo.ops
from conftest import cpu_has_bf16_dot
from engine_reference import PROMPTS, gib_for_blocks, greedy_continuations, transformers_tiny
from neo import LLM, EngineConfig, LLMEngine, SamplingParams
from neo.cli import main as cli_main
from neo.engine.build import host_kernels
from neo.ops import reference
from neo.runner.host_attention import WorkerHandOff

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
CPU_KERNELS = [impl.name for impl in neo.ops.implementations("paged_decode_attention", "cpu")]
SMALL = dict(device="cpu", dtype="float32", gpu_kv_cache_gib=gib_for_blocks(6), cpu_kv_cache_gib=gib_for_blocks(64),
             perf_model="zero", max_num_seqs=8)


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    return greedy_continuations(transformers_tiny(str(tmp_path_factory.mktemp("neo-tiny"))), PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def counting_kernel():
    """A Python kernel (the reference, counting its calls), registered once for the module."""
    calls = []

    def paged_decode_attention(out, query, k_cache, v_cache, block_table, seq_lens, scale):
        calls.append(query.shape[0])
        reference.paged_decode_attention(out, query, k_cache, v_cache, block_table, seq_lens, scale)

    neo.ops.register_kernel("paged_decode_attention", "counting_python", paged_decode_attention)
    return calls


@pytest.mark.parametrize("host_pipeline", ["lockstep", "async"])
@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_every_cpu_kernel_serves_the_same_tokens(kernel, host_pipeline, expected):
    llm = LLM("neo-tiny", policy="neo", host_pipeline=host_pipeline, cpu_attention_kernel=kernel, **SMALL)
    try:
        outputs = llm.generate(PROMPTS, GREEDY)
        assert llm.get_metrics()["host_decode_tokens"] > 0
        assert llm.engine.runner.executor.host_kernels.attention.name == kernel
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_a_kernel_registered_from_python_is_the_one_the_host_runs(counting_kernel, expected):
    dispatched_before = neo.ops.dispatched("paged_decode_attention", "cpu")
    llm = LLM("neo-tiny", policy="full-offload", host_pipeline="lockstep", cpu_attention_kernel="counting_python",
              **SMALL)
    try:
        executor = llm.engine.runner.executor
        assert isinstance(executor.hand_off, WorkerHandOff)  # a Python kernel never runs in a host function
        outputs = llm.generate(PROMPTS, GREEDY)
        host_tokens = llm.get_metrics()["host_decode_tokens"]
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    layers = 4  # neo-tiny
    assert sum(counting_kernel) == host_tokens * layers  # every host decode, every layer, through it
    assert neo.ops.dispatched("paged_decode_attention", "cpu") == dispatched_before


def test_native_kernels_may_run_in_host_functions_and_python_ones_may_not(counting_kernel):
    assert not host_kernels("counting_python").native
    assert not host_kernels("reference").native
    if "numba" in CPU_KERNELS:
        assert not host_kernels("numba").native
    if "ispc" in CPU_KERNELS:
        kernels = host_kernels("ispc")
        assert kernels.native and kernels.store.name == "ispc"


def test_an_unknown_kernel_is_refused_with_the_available_ones():
    with pytest.raises(ValueError, match="available on cpu: " + ", ".join(CPU_KERNELS)):
        LLMEngine(EngineConfig(policy="neo", cpu_attention_kernel="avx9000", **SMALL))


def test_the_command_line_refuses_an_unknown_kernel(capsys):
    assert cli_main(["generate", "--model", "neo-tiny", "--device", "cpu", "--policy", "neo", "--perf-model", "zero",
                     "--cpu-attention-kernel", "avx9000"]) == 2
    error = capsys.readouterr().err
    assert "avx9000" in error and "available on cpu" in error


def test_the_perf_model_key_names_the_kernel_and_the_stage_order():
    engines = [LLMEngine(EngineConfig(policy="neo", cpu_attention_kernel=kernel, **SMALL)) for kernel in CPU_KERNELS[:2]]
    try:
        keys = [engine.profiler.key() for engine in engines]
    finally:
        for engine in engines:
            engine.close()
    assert [key["cpu_attention_kernel"] for key in keys] == CPU_KERNELS[:2]
    assert all(key["stage_order"] == "asymmetric" for key in keys)
    if len(keys) == 2:
        assert engines[0].profiler.default_path() != engines[1].profiler.default_path()


def test_the_perf_model_key_names_the_ispc_bf16_variant(monkeypatch):
    """The ISPC kernel's bf16 variant is chosen at every call: a table measured with one does not
    serve an engine that runs the other."""
    if "ispc" not in CPU_KERNELS:
        pytest.skip("the ISPC kernels are not built")
    engine = LLMEngine(EngineConfig(policy="neo", cpu_attention_kernel="ispc", **(SMALL | {"dtype": "bfloat16"})))
    try:
        keys = {}
        for variant in ["generic", "bf16_dot"] if cpu_has_bf16_dot() else ["generic"]:
            monkeypatch.setenv("NEO_CPU_DECODE_ATTENTION_VARIANT", variant)
            keys[variant] = engine.profiler.key()
            assert keys[variant]["cpu_attention_variant"] == variant
        assert len({json.dumps(key, sort_keys=True) for key in keys.values()}) == len(keys)
    finally:
        engine.close()
    float32_engine = LLMEngine(EngineConfig(policy="neo", cpu_attention_kernel="ispc", **SMALL))
    try:
        assert "cpu_attention_variant" not in float32_engine.profiler.key()
    finally:
        float32_engine.close()

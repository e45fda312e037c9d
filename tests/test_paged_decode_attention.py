"""``neo.paged_decode_attention``: every implementation against a float64 formula, on every
device, plus thread safety of the CPU kernels and the bad-input errors.

Caches come from ``random_paged_kv``: shuffled blocks, garbage block ids in the unused table
entries and NaN in every cache slot past a sequence's length, so reading anything that is not
part of a sequence shows up as a NaN or a crash.
"""

import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import neo.ops

from conftest import (FLOAT_DTYPES, TOLERANCES, assert_close, cpu_has_bf16_dot, cpu_vendor,
                      gather_sequence, implementation_params, poisoned_like, random_paged_kv,
                      random_tensor)

OP = "paged_decode_attention"
IMPLEMENTATIONS = implementation_params(OP)
CPU_IMPLEMENTATIONS = implementation_params(OP, devices=("cpu",))

# (num_heads, num_kv_heads): GQA ratios 1, 2, 3, 4, 8 and MQA (kernels tile query heads of a KV
# head in fours, twos and ones: ratios 2 and 3 reach the smaller tiles)
HEAD_LAYOUTS = {"mha": (4, 4), "gqa2": (4, 2), "gqa3": (6, 2), "gqa4": (8, 2), "gqa8": (16, 2), "mqa": (8, 1)}


def decode_attention_float64(q, paged, scale):
    """The formula, one sequence and one query head at a time, in float64 on the CPU.
    Returns (output, the largest |score| seen)."""
    num_seqs, num_heads, _ = q.shape
    group = num_heads // paged.k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    largest_score = 0.0
    for seq in range(num_seqs):
        keys = gather_sequence(paged.k_cache, paged.block_table, paged.seq_lens, seq).double()
        values = gather_sequence(paged.v_cache, paged.block_table, paged.seq_lens, seq).double()
        for head in range(num_heads):
            scores = keys[:, head // group] @ q[seq, head].cpu().double() * scale
            largest_score = max(largest_score, float(scores.abs().max()))
            weights = torch.exp(scores - scores.max())
            out[seq, head] = (weights / weights.sum()) @ values[:, head // group]
    return out, largest_score


def make_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, generator,
              device, sharpness=1.0):
    """(q, paged cache, scale); ``sharpness`` scales the scores (larger: peakier softmax)."""
    paged = random_paged_kv(seq_lens, num_kv_heads, block_size, head_dim, dtype, generator,
                            device)
    q = random_tensor((len(seq_lens), num_heads, head_dim), dtype, generator, device)
    scale = sharpness * float(0.5 + torch.rand((), generator=generator)) / math.sqrt(head_dim)
    return q, paged, scale


def run(implementation, q, paged, scale):
    out = poisoned_like(q)
    implementation.function(out, q, paged.k_cache, paged.v_cache, paged.block_table,
                            paged.seq_lens, scale)
    return out


def assert_matches_formula(out, q, paged, scale):
    """``out`` against the float64 formula. The implementations compute scores in float32: a
    rounding of relative size eps on a score s moves its softmax weight by eps * |s| relative, so
    the tolerance also allows float32's eps times the largest |score| (sharp softmaxes over
    thousands of tokens reach it in float32)."""
    expected, largest_score = decode_attention_float64(q, paged, scale)
    tolerance = TOLERANCES[q.dtype] + torch.finfo(torch.float32).eps * largest_score
    assert_close(out, expected, q.dtype, tolerance=tolerance)


def check(implementation, q, paged, scale):
    assert_matches_formula(run(implementation, q, paged, scale), q, paged, scale)


@pytest.mark.parametrize("heads", HEAD_LAYOUTS.values(), ids=HEAD_LAYOUTS.keys())
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("implementation", "device"), IMPLEMENTATIONS)
def test_mixed_short_batch(implementation, device, dtype, head_dim, block_size, heads,
                           generator):
    """Lengths 1, a block, a block + 1 and a random one, in one batch."""
    random_length = int(torch.randint(2, 4 * block_size, (), generator=generator))
    seq_lens = [1, block_size, block_size + 1, random_length]
    check(implementation, *make_case(seq_lens, *heads, head_dim, block_size, dtype, generator,
                                     device))


@pytest.mark.parametrize("length", ["1", "block", "block+1", "long"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("implementation", "device"), IMPLEMENTATIONS)
def test_single_sequence(implementation, device, dtype, length, generator):
    block_size = 16
    seq_len = {"1": 1, "block": block_size, "block+1": block_size + 1,
               "long": int(torch.randint(3000, 5000, (), generator=generator))}[length]
    check(implementation, *make_case([seq_len], 32, 8, 128, block_size, dtype, generator,
                                     device))


@pytest.mark.parametrize("sharpness", [1.0, 12.0])
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("implementation", "device"), IMPLEMENTATIONS)
def test_long_mixed_batch(implementation, device, dtype, block_size, sharpness, generator):
    """Long and short sequences together (long ones are split across threads and merged)."""
    long_length = int(torch.randint(2000, 4000, (), generator=generator))
    seq_lens = [long_length, 1, block_size + 1, long_length // 3, 2 * block_size]
    check(implementation, *make_case(seq_lens, 8, 2, 128, block_size, dtype, generator, device,
                                     sharpness))


@pytest.mark.parametrize("layout", [(16, 8), (256, 128), (32, 64), (112, 16)],
                         ids=lambda layout: f"d{layout[0]}-bs{layout[1]}")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("implementation", "device"), IMPLEMENTATIONS)
def test_head_dim_and_block_size_extremes(implementation, device, dtype, layout, generator):
    """The ends of the supported range: head_dim 16..256, block_size 8..128."""
    head_dim, block_size = layout
    seq_lens = [1, block_size + 3, 3 * block_size]
    check(implementation, *make_case(seq_lens, 8, 2, head_dim, block_size, dtype, generator,
                                     device))


@pytest.fixture
def torch_threads():
    """Set torch's thread count for one test; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize(("implementation", "device"), CPU_IMPLEMENTATIONS)
def test_thread_counts(implementation, device, threads, torch_threads, generator):
    """Correct on any torch thread count (more threads than cores too: sequences split across
    threads are merged by whichever ends last), which the call leaves as it was."""
    torch_threads(threads)
    seq_lens = [int(torch.randint(1, 3000, (), generator=generator)) for _ in range(3)] + [64, 65, 300]
    check(implementation, *make_case(seq_lens, 16, 2, 64, 16, torch.bfloat16, generator, device))
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("threads", [2, 4, 16])
@pytest.mark.parametrize("num_seqs", [1, 3, 5, 8])
@pytest.mark.parametrize(("implementation", "device"), CPU_IMPLEMENTATIONS)
def test_kv_head_groups(implementation, device, num_seqs, threads, torch_threads, generator):
    """Short sequences, fewer than the threads' chunks: the ISPC kernel splits each sequence's 8
    KV heads into groups (2 threads: 5 sequences give groups of 4 heads, 3 of 2, 1 of 1; 8 keep
    them whole), and on 4 and 16 threads cuts a group's tokens into chunks as well; the numba
    kernel groups heads where its threads' shares are short (on as many threads as numba has:
    ``test_numba_kernel_on_sixteen_threads`` runs 16); every group's heads land in their own
    rows of the output."""
    torch_threads(threads)
    seq_lens = [900, 64, 400, 17, 700, 300, 129, 1024][:num_seqs]
    check(implementation, *make_case(seq_lens, 32, 8, 128, 16, torch.bfloat16, generator, device))


FIRST_CALL_SCRIPT = """
import torch
torch.set_num_threads(1)
import neo.ops
q = torch.randn(2, 8, 64)
cache = torch.randn(4, 2, 16, 64)
table = torch.arange(4, dtype=torch.int32).view(2, 2)
torch.ops.neo_{name}.paged_decode_attention(torch.empty_like(q), q, cache, cache, table,
                                           torch.tensor([20, 3], dtype=torch.int32), 0.125)
print(torch.get_num_threads())
"""


@pytest.mark.parametrize(("implementation", "device"), CPU_IMPLEMENTATIONS)
def test_first_call_in_a_process_keeps_torch_threads(implementation, device):
    """The first call may start a thread pool (numba's shares OpenMP settings with torch's)."""
    result = subprocess.run([sys.executable, "-c",
                             FIRST_CALL_SCRIPT.format(name=implementation.name)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "1", "the call changed torch.get_num_threads()"


@pytest.mark.parametrize("magnitude", ["subnormal", "large"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("implementation", "device"), IMPLEMENTATIONS)
def test_half_precision_extremes(implementation, device, dtype, magnitude, generator):
    """K and V near the ends of the half type's range (fp16 subnormals; huge values)."""
    q, paged, scale = make_case([70, 1, 33], 8, 2, 64, 16, dtype, generator, device)
    factor = {"subnormal": {torch.float16: 2.0 ** -20, torch.bfloat16: 2.0 ** -130},
              "large": {torch.float16: 2.0 ** 10, torch.bfloat16: 2.0 ** 100}}[magnitude][dtype]
    paged.v_cache.mul_(factor)
    if magnitude == "subnormal":
        paged.k_cache.mul_(factor)
    else:  # large values, small scores: q and the scale shrink to keep the softmax finite
        q.mul_(1.0 / factor)
    assert not paged.v_cache.isinf().any()
    subnormal_spacing = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    assert_close(run(implementation, q, paged, scale), decode_attention_float64(q, paged, scale)[0],
                 dtype, absolute=subnormal_spacing)


@pytest.mark.parametrize(("implementation", "device"), IMPLEMENTATIONS)
def test_no_sequences(implementation, device, generator):
    q, paged, scale = make_case([5], 8, 2, 64, 16, torch.float16, generator, device)
    empty = torch.empty((0, 8, 64), dtype=torch.float16, device=device)
    implementation.function(empty, empty.clone(), paged.k_cache, paged.v_cache,
                            paged.block_table[:0], paged.seq_lens[:0], scale)


# ---------------------------------------------------------------------------------------------
# Thread safety: the CPU attention runs on a worker thread while the main thread drives the GPU.

def run_in_thread(function, results, errors):
    def body():
        try:
            results.append(function())
        except BaseException as error:  # re-raised on the main thread
            errors.append(error)

    thread = threading.Thread(target=body)
    thread.start()
    return thread


@pytest.mark.parametrize(("implementation", "device"), CPU_IMPLEMENTATIONS)
def test_worker_thread_while_main_thread_works(implementation, device, generator):
    case = make_case([2500, 700, 33], 32, 8, 128, 16, torch.bfloat16, generator, device)
    expected, _ = decode_attention_float64(*case)
    matrix = torch.randn(256, 256, generator=generator)
    expected_product = matrix @ matrix
    results, errors = [], []
    thread = run_in_thread(lambda: [run(implementation, *case) for _ in range(4)], results,
                           errors)
    products = 0
    while thread.is_alive() or products < 10:
        torch.testing.assert_close(matrix @ matrix, expected_product)
        products += 1
    thread.join()
    if errors:
        raise errors[0]
    for out in results[0]:
        assert_close(out, expected, torch.bfloat16)


@pytest.mark.parametrize(("implementation", "device"), CPU_IMPLEMENTATIONS)
def test_concurrent_calls(implementation, device, generator):
    cases = [make_case([1500, 40], 16, 4, 64, 16, torch.float16, generator, device),
             make_case([900, 2100, 1], 8, 8, 128, 32, torch.float32, generator, device)]
    results, errors = [[], []], []
    threads = [run_in_thread(lambda case=case: [run(implementation, *case) for _ in range(3)],
                             outputs, errors) for case, outputs in zip(cases, results)]
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    for case, outputs in zip(cases, results):
        expected, _ = decode_attention_float64(*case)
        for out in outputs[0]:
            assert_close(out, expected, case[0].dtype)


# ---------------------------------------------------------------------------------------------
# Bad input: every implementation rejects it with a message naming the problem. The CUDA kernel
# checks only what needs no host sync (shapes, dtypes, layout); the others check values too.

def valid_arguments(device, generator, head_dim=64, block_size=16, num_heads=8, num_kv_heads=2):
    q, paged, scale = make_case([20, 5], num_heads, num_kv_heads, head_dim, block_size,
                                torch.float32, generator, device)
    return {"out": poisoned_like(q), "q": q, "k_cache": paged.k_cache,
            "v_cache": paged.v_cache, "block_table": paged.block_table,
            "seq_lens": paged.seq_lens, "scale": scale}


def with_dtype(arguments, dtype, names=("out", "q", "k_cache", "v_cache")):
    return {**arguments, **{name: arguments[name].to(dtype) for name in names}}


def non_contiguous(tensor):
    """The same values and shape, with the first two dimensions' strides swapped."""
    return tensor.transpose(0, 1).contiguous().transpose(0, 1)


def with_table_entry(arguments, seq, column, value):
    table = arguments["block_table"].clone()
    table[seq, column] = value
    return {**arguments, "block_table": table}


def with_seq_len(arguments, seq, value):
    seq_lens = arguments["seq_lens"].clone()
    seq_lens[seq] = value
    return {**arguments, "seq_lens": seq_lens}


def rebuilt(**layout):
    return lambda arguments, device, generator: valid_arguments(device, generator, **layout)


def changed(change):
    return lambda arguments, device, generator: change(arguments)


# name -> (how to break valid arguments, phrase of the error, needs a value check)
BAD_INPUTS = {
    "float64": (changed(lambda a: with_dtype(a, torch.float64)),
                "float32, float16 or bfloat16", False),
    "int32-q": (changed(lambda a: with_dtype(a, torch.int32)),
                "float32, float16 or bfloat16", False),
    "q-bf16-cache-fp32": (changed(lambda a: with_dtype(a, torch.bfloat16, ("q", "out"))),
                          "share one dtype", False),
    "out-fp16": (changed(lambda a: with_dtype(a, torch.float16, ("out",))),
                 "share one dtype", False),
    "v-cache-fp16": (changed(lambda a: with_dtype(a, torch.float16, ("v_cache",))),
                     "v_cache dtype", False),
    "q-2d": (changed(lambda a: {**a, "q": a["q"][:, 0], "out": a["out"][:, 0]}),
             r"q must be \[num_seqs, num_heads, head_dim\]", False),
    "out-shape": (changed(lambda a: {**a, "out": a["out"][:, :4].contiguous()}),
                  "out shape", False),
    "k-cache-3d": (changed(lambda a: {**a, "k_cache": a["k_cache"][0],
                                      "v_cache": a["v_cache"][0]}),
                   r"k_cache must be \[num_blocks, num_kv_heads, block_size, head_dim\]", False),
    "v-cache-shape": (changed(lambda a: {**a, "v_cache": a["v_cache"][1:].contiguous()}),
                      "v_cache shape", False),
    "q-head-dim": (changed(lambda a: {**a, "q": a["q"][..., :48].contiguous(),
                                      "out": a["out"][..., :48].contiguous()}),
                   "head_dim 48 differs", False),
    "block-table-rows": (changed(lambda a: {**a, "block_table": a["block_table"][:1]}),
                         "block_table has 1 rows", False),
    "block-table-int64": (changed(lambda a: {**a, "block_table": a["block_table"].long()}),
                          "block_table must be int32", False),
    "seq-lens-int64": (changed(lambda a: {**a, "seq_lens": a["seq_lens"].long()}),
                       "seq_lens must be int32", False),
    "seq-lens-length": (changed(lambda a: {**a, "seq_lens": a["seq_lens"][:1]}),
                        "seq_lens must be int32", False),
    "q-non-contiguous": (changed(lambda a: {**a, "q": non_contiguous(a["q"])}),
                         "must be contiguous", False),
    "out-non-contiguous": (changed(lambda a: {**a, "out": non_contiguous(a["out"])}),
                           "must be contiguous", False),
    "cache-non-contiguous": (changed(lambda a: {**a, "k_cache": non_contiguous(a["k_cache"])}),
                             "must be contiguous", False),
    "head-dim-72": (rebuilt(head_dim=72), "head_dim must be a multiple of 16", False),
    "head-dim-272": (rebuilt(head_dim=272), "head_dim must be a multiple of 16 up to 256",
                     False),
    "block-size-12": (rebuilt(block_size=12), "block_size must be a power of two", False),
    "block-size-4": (rebuilt(block_size=4), "block_size must be a power of two", False),
    "block-size-256": (rebuilt(block_size=256), "block_size must be a power of two", False),
    "heads-6-of-4": (rebuilt(num_heads=6, num_kv_heads=4), "not a multiple of num_kv_heads",
                     False),
    "block-id-too-large": (changed(lambda a: with_table_entry(a, 0, 1, a["k_cache"].shape[0])),
                           r"block id \d+ at block_table\[0, 1\] is outside", True),
    "block-id-negative": (changed(lambda a: with_table_entry(a, 1, 0, -1)),
                          r"block id -1 at block_table\[1, 0\] is outside", True),
    "seq-len-0": (changed(lambda a: with_seq_len(a, 1, 0)), "every seq_len must be >= 1", True),
    "seq-len-negative": (changed(lambda a: with_seq_len(a, 0, -7)),
                         "every seq_len must be >= 1", True),
    "seq-len-beyond-blocks": (changed(lambda a: with_seq_len(a, 1, 16 * a["block_table"].shape[1]
                                                             + 1)),
                              r"seq_len \d+ of sequence 1 needs \d+ blocks but block_table has",
                              True),
}


def bad_input_params():
    return [pytest.param(*param.values, name, marks=param.marks, id=f"{param.id}-{name}")
            for param in IMPLEMENTATIONS for name, (_, _, reads_values) in BAD_INPUTS.items()
            if not (reads_values and param.values[0].name == "cuda")]


@pytest.mark.parametrize(("implementation", "device"), IMPLEMENTATIONS)
def test_valid_arguments_are_accepted(implementation, device, generator):
    """The starting point of every bad-input case runs (and ignores the garbage table entries)."""
    arguments = valid_arguments(device, generator)
    implementation.function(*arguments.values())
    assert not arguments["out"].isnan().any()


@pytest.mark.parametrize(("implementation", "device", "name"), bad_input_params())
def test_bad_input_raises(implementation, device, name, generator):
    breaking, phrase, _ = BAD_INPUTS[name]
    arguments = breaking(valid_arguments(device, generator), device, generator)
    with pytest.raises((ValueError, RuntimeError), match=phrase):
        implementation.function(*arguments.values())


# ---------------------------------------------------------------------------------------------
# The ISPC kernel's bf16 score-pass variants (NEO_CPU_DECODE_ATTENTION_VARIANT): "generic" widens
# bf16 to float32, "bf16_dot" uses the CPU's bf16 dot-product instruction (AVX512-BF16) and is the
# default where it is the faster: on AMD CPUs that have it. The grids above run the default; these
# run each variant.

CPU_VARIANT_VARIABLE = "NEO_CPU_DECODE_ATTENTION_VARIANT"
ISPC = implementation_params(OP, devices=("cpu",), names=("ispc",))


@pytest.fixture(params=["generic", "bf16_dot"])
def cpu_variant(request, monkeypatch):
    if request.param == "bf16_dot" and not cpu_has_bf16_dot():
        pytest.skip("this CPU has no AVX512-BF16 (VDPBF16PS)")
    monkeypatch.setenv(CPU_VARIANT_VARIABLE, request.param)
    return request.param


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (10, 2), (40, 8), (64, 8), (9, 1)],
                         ids=["mha", "gqa3", "gqa5", "qwen32b", "gqa8", "mqa9"])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 256])
@pytest.mark.parametrize(("implementation", "device"), ISPC)
def test_ispc_bf16_variants(implementation, device, head_dim, heads, cpu_variant, generator):
    """Every slice of 1..8 query heads a KV head, head_dims with and without a partial last
    16-word step, lengths that end a tile of 16 tokens early or late, and a sequence long enough
    to be split across threads."""
    seq_lens = [1, 2, 17, 31, 16 * 9 + 5, int(torch.randint(2000, 3000, (), generator=generator))]
    check(implementation, *make_case(seq_lens, *heads, head_dim, 16, torch.bfloat16, generator,
                                     device, sharpness=4.0))


@pytest.mark.parametrize(("implementation", "device"), ISPC)
def test_ispc_default_bf16_variant_follows_the_cpu(implementation, device, monkeypatch, generator):
    """Unset, empty or "auto": the dot-product variant on an AMD CPU that has the instruction,
    else the generic one, bit for bit, and the extension names the variant it runs."""
    from neo.ops import _cpu_kernels

    case = make_case([700, 45, 3], 32, 8, 128, 16, torch.bfloat16, generator, device)
    expected_variant = "bf16_dot" if cpu_has_bf16_dot() and cpu_vendor() == "AuthenticAMD" else "generic"
    monkeypatch.setenv(CPU_VARIANT_VARIABLE, expected_variant)
    expected = run(implementation, *case)
    for default in ["auto", "", None]:
        if default is None:
            monkeypatch.delenv(CPU_VARIANT_VARIABLE)
        else:
            monkeypatch.setenv(CPU_VARIANT_VARIABLE, default)
        assert _cpu_kernels.bf16_decode_attention_variant() == expected_variant
        assert torch.equal(run(implementation, *case), expected)
    monkeypatch.setenv(CPU_VARIANT_VARIABLE, "generic")
    assert _cpu_kernels.bf16_decode_attention_variant() == "generic"


@pytest.mark.parametrize(("implementation", "device"), ISPC)
def test_ispc_unknown_or_unavailable_variant_is_refused(implementation, device, monkeypatch,
                                                        generator):
    case = make_case([40], 8, 2, 64, 16, torch.bfloat16, generator, device)
    from neo.ops import _cpu_kernels

    monkeypatch.setenv(CPU_VARIANT_VARIABLE, "avx9")
    message = (f"{CPU_VARIANT_VARIABLE}=avx9 names no CPU decode attention variant; choose one of "
               "auto, generic, bf16_dot")
    with pytest.raises(ValueError, match=message):
        run(implementation, *case)
    with pytest.raises(ValueError, match=message):
        _cpu_kernels.bf16_decode_attention_variant()
    monkeypatch.setenv(CPU_VARIANT_VARIABLE, "bf16_dot")
    if cpu_has_bf16_dot():
        check(implementation, *case)
    else:
        with pytest.raises(ValueError, match="bf16_dot needs a CPU with AVX512-BF16"):
            run(implementation, *case)


# ---------------------------------------------------------------------------------------------
# Building blocks of the numba kernel that the grids above reach only partly: the float16
# decoder and encoder of targets without F16C, the rounding of the encoders, and the exponential.

def numba_kernels_or_skip():
    numba = [impl for impl in neo.ops.implementations(OP, available_only=False)
             if impl.name == "numba"]
    if not numba or not numba[0].available:
        pytest.skip(f"numba: {numba[0].note if numba else 'not registered'}")
    from neo.ops import numba_kernels

    return numba_kernels


def all_bit_patterns(dtype):
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


# The numba kernel's half-precision conversions: dtype, bit-pattern dtype, and the names of the
# decoder and the encoder in ops/numba_kernels.py.
HALF_CONVERSIONS = {
    "portable-float16": (torch.float16, torch.int16, "_decode_float16", "_encode_float16"),
    "hardware-float16": (torch.float16, torch.int16, "_float16_bits_to_float32",
                         "_float32_to_float16_bits"),
    "bfloat16": (torch.bfloat16, torch.uint16, "_decode_bfloat16", "_encode_bfloat16"),
}


def half_conversion_or_skip(numba_kernels, kind):
    """HALF_CONVERSIONS[kind], skipping the hardware float16 conversions on a target without F16C."""
    if kind == "hardware-float16" and not numba_kernels.HARDWARE_FLOAT16:
        pytest.skip("numba's target CPU has no F16C")
    return HALF_CONVERSIONS[kind]


@pytest.mark.parametrize("decoder", list(HALF_CONVERSIONS))
def test_numba_half_decoders_are_exact(decoder):
    numba_kernels = numba_kernels_or_skip()
    from numba import njit

    dtype, bits_dtype, name, _ = half_conversion_or_skip(numba_kernels, decoder)
    function = getattr(numba_kernels, name)

    @njit
    def decode_all(bits):
        out = np.empty(bits.shape[0], np.float32)
        for i in range(bits.shape[0]):
            out[i] = function(bits[i])
        return out

    values = all_bit_patterns(dtype)
    decoded = torch.from_numpy(decode_all(values.view(bits_dtype).numpy()))
    expected = values.float()
    same_bits = decoded.view(torch.int32) == expected.view(torch.int32)
    assert (same_bits | (decoded.isnan() & expected.isnan())).all()


def rounding_cases(dtype, generator):
    """float32 values that ``dtype`` rounds: every halfway point between neighbouring finite
    values (the overflow threshold included) and the float32s either side of it, signed zeros,
    infinities, NaN, and random bit patterns."""
    finite = all_bit_patterns(dtype).float()
    finite = finite[finite.isfinite()].unique().double()
    overflow = finite[-1] + (finite[-1] - finite[-2]) / 2
    halfway = torch.cat(((finite[:-1] + finite[1:]) / 2, overflow.view(1),
                         -overflow.view(1))).float()
    infinity = torch.tensor(math.inf)
    random_bits = torch.randint(-(2**31), 2**31, (2**20,), generator=generator).to(torch.int32)
    return torch.cat((halfway, torch.nextafter(halfway, infinity),
                      torch.nextafter(halfway, -infinity),
                      torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan]),
                      random_bits.view(torch.float32)))


@pytest.mark.parametrize("encoder", list(HALF_CONVERSIONS))
def test_numba_half_encoders_round_as_torch(encoder, generator):
    numba_kernels = numba_kernels_or_skip()
    from numba import njit

    dtype, bits_dtype, _, name = half_conversion_or_skip(numba_kernels, encoder)
    function = getattr(numba_kernels, name)

    @njit
    def encode_all(values, out):
        for i in range(values.shape[0]):
            out[i] = function(values[i])

    values = rounding_cases(dtype, generator)
    encoded = torch.empty(values.shape, dtype=bits_dtype)
    encode_all(values.numpy(), encoded.numpy())
    expected = values.to(dtype)
    same_bits = encoded == expected.view(bits_dtype)
    assert (same_bits | (encoded.view(dtype).isnan() & expected.isnan())).all()


def test_numba_exp():
    numba_kernels = numba_kernels_or_skip()
    from numba import njit

    exp = numba_kernels._exp_nonpositive

    @njit(fastmath=numba_kernels.FAST_MATH)
    def exp_all(x):
        out = np.empty(x.shape[0], np.float32)
        for i in range(x.shape[0]):
            out[i] = exp(x[i])
        return out

    x = torch.cat((torch.linspace(-87.0, 0.0, 200001), torch.tensor([-0.0, -1e-30])))
    result = torch.from_numpy(exp_all(x.numpy())).double()
    expected = torch.exp(x.double())
    assert ((result - expected).abs() / expected).max() < 1e-5
    assert exp_all(np.array([-np.inf, -200.0, -1e30], np.float32)).tolist() == [0.0, 0.0, 0.0]


def numba_vectors_or_skip():
    numba_kernels_or_skip()
    from neo.ops import numba_vectors

    return numba_vectors


@pytest.mark.parametrize("count", [4, 8, 16])
def test_numba_vector_lane_sums(count, generator):
    """``sum_lanes`` puts the lane sum of the i-th of 4, 8 or 16 vectors in lane i."""
    vectors = numba_vectors_or_skip()
    from numba import njit

    @njit
    def lane_sums(rows):
        loaded = (vectors.load(rows, (0, 0)), vectors.load(rows, (1, 0)),
                  vectors.load(rows, (2, 0)), vectors.load(rows, (3, 0)),
                  vectors.load(rows, (4, 0)), vectors.load(rows, (5, 0)),
                  vectors.load(rows, (6, 0)), vectors.load(rows, (7, 0)),
                  vectors.load(rows, (8, 0)), vectors.load(rows, (9, 0)),
                  vectors.load(rows, (10, 0)), vectors.load(rows, (11, 0)),
                  vectors.load(rows, (12, 0)), vectors.load(rows, (13, 0)),
                  vectors.load(rows, (14, 0)), vectors.load(rows, (15, 0)))
        totals = vectors.sum_lanes(loaded[:count])
        out = np.empty(count, np.float32)
        for i in range(count):
            out[i] = vectors.lane(totals, i)
        return out

    rows = torch.randn(16, vectors.LANES, generator=generator)
    expected = rows[:count].double().sum(dim=1)
    torch.testing.assert_close(torch.from_numpy(lane_sums(rows.numpy())).double(), expected,
                               rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_numba_vector_load_decodes(dtype, generator):
    """``load`` reads 16 elements from the indexed one on, decoded to float32 exactly."""
    vectors = numba_vectors_or_skip()
    from numba import njit

    bits_dtype = {torch.float32: torch.float32, torch.bfloat16: torch.uint16,
                  torch.float16: torch.int16}[dtype]

    @njit
    def load_lanes(values, row, column):
        loaded = vectors.load(values, (row, column))
        out = np.empty(vectors.LANES, np.float32)
        for i in range(vectors.LANES):
            out[i] = vectors.lane(loaded, i)
        return out

    values = torch.randn(3, 40, generator=generator).to(dtype)
    lanes = load_lanes(values.view(bits_dtype).numpy(), 2, 7)
    assert torch.equal(torch.from_numpy(lanes), values[2, 7:23].float())


# Sequence lengths for the numba plan: a small host batch's layers (8x256, 8x768, 1x256), long
# calls, uneven lengths, and very short sequences.
PLAN_CASES = {"1x256": [256], "8x256": [256] * 8, "8x768": [768] * 8, "16x4096": [4096] * 16,
              "uneven": [900, 64, 400, 17, 700, 300, 129, 1024], "short": [5, 40, 17]}


@pytest.mark.parametrize("threads", [1, 2, 4, 15, 16])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
@pytest.mark.parametrize("case", PLAN_CASES)
def test_numba_plan_covers_every_block_of_every_head_once(case, num_kv_heads, threads):
    """The plan's units tile each (sequence, KV head group) item's blocks in order; the threads'
    shares are equal to a block; heads are grouped only where shares are short, and then into
    the fewest groups that give every thread an item."""
    numba_kernels = numba_kernels_or_skip()
    block_size = 16
    seq_lens = np.array(PLAN_CASES[case], np.int32)
    groups, unit_item, unit_first_block, unit_end_block, item_units, thread_units = \
        numba_kernels._plan(seq_lens, block_size, num_kv_heads, threads)
    seq_blocks = (seq_lens + block_size - 1) // block_size
    plan_threads = len(thread_units) - 1
    assert 1 <= plan_threads <= threads and num_kv_heads % groups == 0
    if seq_blocks.sum() * block_size >= plan_threads * numba_kernels.LONG_SHARE_TOKENS:
        assert groups == 1
    else:
        fewer = [count for count in range(1, groups) if num_kv_heads % count == 0]
        assert all(len(seq_lens) * count < plan_threads for count in fewer)
        assert len(seq_lens) * groups >= plan_threads or groups == num_kv_heads
    assert item_units[0] == 0 and item_units[-1] == len(unit_item)
    for item in range(len(seq_lens) * groups):
        units = range(item_units[item], item_units[item + 1])
        assert len(units) >= 1 and all(unit_item[unit] == item for unit in units)
        bounds = [(unit_first_block[unit], unit_end_block[unit]) for unit in units]
        assert bounds[0][0] == 0 and bounds[-1][1] == seq_blocks[item // groups]
        assert all(first < end for first, end in bounds)
        assert all(end == first for (_, end), (first, _) in zip(bounds, bounds[1:]))
    share_blocks = [sum(unit_end_block[unit] - unit_first_block[unit]
                        for unit in range(thread_units[thread], thread_units[thread + 1]))
                    for thread in range(plan_threads)]
    assert thread_units[0] == 0 and thread_units[-1] == len(unit_item)
    assert min(share_blocks) >= 1 and max(share_blocks) - min(share_blocks) <= 1


def test_numba_plan_of_a_small_host_batch():
    """8x256 on 16 threads (8 KV heads): two head groups a sequence, one whole item a thread,
    nothing to merge; 16x4096 keeps its heads whole."""
    numba_kernels = numba_kernels_or_skip()
    groups, unit_item, _, _, _, thread_units = numba_kernels._plan(
        np.full(8, 256, np.int32), 16, 8, 16)
    assert groups == 2 and list(unit_item) == list(range(16)) and list(thread_units) == list(range(17))
    groups, *_ = numba_kernels._plan(np.full(16, 4096, np.int32), 16, 8, 16)
    assert groups == 1


SIXTEEN_THREADS_SCRIPT = """
import sys
import torch
import neo.ops
torch.set_num_threads(16)
outputs = []
for q, k_cache, v_cache, block_table, seq_lens, scale in torch.load(sys.argv[1]):
    out = torch.full_like(q, float("nan"))
    torch.ops.neo_numba.paged_decode_attention(out, q, k_cache, v_cache, block_table, seq_lens,
                                               scale)
    outputs.append(out)
torch.save(outputs, sys.argv[2])
"""


def test_numba_kernel_on_sixteen_threads(tmp_path, generator):
    """numba fixes its thread count when it starts (the core count unless ``NUMBA_NUM_THREADS``
    says otherwise): a process started with 16 runs the plans of a 16-core host here too, KV head
    groups, token ranges split between threads and their merges."""
    numba_kernels_or_skip()
    cases = [make_case(seq_lens, 32, 8, 128, 16, torch.bfloat16, generator, "cpu")
             for seq_lens in ([256], [256] * 8, [768] * 3, [900, 64, 400, 17, 700],
                              [900, 64, 400, 17, 700, 300, 129, 1024], [3000, 5])]
    torch.save([(q, paged.k_cache, paged.v_cache, paged.block_table, paged.seq_lens, scale)
                for q, paged, scale in cases], tmp_path / "cases.pt")
    result = subprocess.run([sys.executable, "-c", SIXTEEN_THREADS_SCRIPT,
                             str(tmp_path / "cases.pt"), str(tmp_path / "outputs.pt")],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NUMBA_NUM_THREADS": "16"})
    assert result.returncode == 0, result.stderr
    for out, (q, paged, scale) in zip(torch.load(tmp_path / "outputs.pt"), cases, strict=True):
        assert_matches_formula(out, q, paged, scale)


WIDTH_SCRIPT = """
import torch
import neo.ops
from neo.ops import numba_kernels
q = torch.randn(1, 8, 128, dtype=torch.bfloat16)
cache = torch.randn(2, 2, 16, 128, dtype=torch.bfloat16)
torch.ops.neo_numba.paged_decode_attention(torch.empty_like(q), q, cache, cache,
                                           torch.tensor([[0, 1]], dtype=torch.int32),
                                           torch.tensor([20], dtype=torch.int32), 0.125)
for name in ("_block_scores", "_online_softmax", "_accumulate_four_heads"):
    assembly = "".join(getattr(numba_kernels, name).inspect_asm().values())
    print(name, assembly.count("%zmm"))
"""


def test_numba_loops_use_512_bit_vectors_under_intel_tuning(tmp_path):
    """Compiled for an Intel server core, whose LLVM tuning prefers 256-bit vectors, the
    kernel's loops still use the 512-bit registers (zmm) the target has."""
    numba_kernels_or_skip()
    import llvmlite.binding as llvm

    if "+avx512f" not in llvm.get_host_cpu_features().flatten().split(","):
        pytest.skip("this CPU has no AVX-512: its code cannot use 512-bit vectors")
    # the host's features with the CPU name of an Intel server core: its tuning, this
    # machine's instructions
    environment = {**os.environ, "NUMBA_CPU_NAME": "sapphirerapids",
                   "NUMBA_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", WIDTH_SCRIPT], capture_output=True, text=True,
                            timeout=600, env=environment)
    assert result.returncode == 0, result.stderr
    counts = dict(line.split() for line in result.stdout.splitlines())
    assert set(counts) == {"_block_scores", "_online_softmax", "_accumulate_four_heads"}
    assert all(int(count) > 0 for count in counts.values()), counts

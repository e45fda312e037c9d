"""The layer ops (rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul,
prefill_attention): every implementation, on every device, against an independent float64
formula, and every implementation other than the reference against the reference."""

import math

import pytest
import torch

import neo.ops
from conftest import FLOAT_DTYPES, assert_close, implementation_params, poisoned_like, \
    random_tensor


def reference_of(op):
    return next(impl for impl in neo.ops.implementations(op) if impl.name == "reference")


def check_outputs(implementation, op, run, arguments, expected, dtype):
    """Run ``implementation`` (and, for any other, the reference) on copies of ``arguments``;
    compare each output with the float64 ``expected`` (and with the reference's)."""
    outputs = run(implementation, arguments)
    for name, output in outputs.items():
        assert_close(output, expected[name], dtype, what=f"{name} vs float64 formula")
    if implementation.name != "reference":
        for name, output in run(reference_of(op), arguments).items():
            assert_close(outputs[name], output, dtype, what=f"{name} vs reference")


def copies(arguments):
    return {name: value.clone() if isinstance(value, torch.Tensor) else value
            for name, value in arguments.items()}


# ---------------------------------------------------------------------------------------------
# rms_norm and fused_add_rms_norm

def rms_norm_float64(x, weight, epsilon):
    x = x.cpu().double()
    return weight.cpu().double() * x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)


def norm_arguments(num_tokens, hidden, dtype, generator, device, magnitude):
    return {"input": random_tensor((num_tokens, hidden), dtype, generator, device, magnitude),
            "weight": random_tensor((hidden,), dtype, generator, device, scale=0.5) + 1.0,
            "epsilon": 1e-5}


def run_rms_norm(implementation, arguments):
    arguments = copies(arguments)
    out = poisoned_like(arguments["input"])
    implementation.function(out, arguments["input"], arguments["weight"], arguments["epsilon"])
    return {"out": out}


# Input magnitudes: ordinary activations, and ones so small that epsilon (1e-5) dominates.
MAGNITUDES = [3.0, 1e-3]


@pytest.mark.parametrize("magnitude", MAGNITUDES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 1000), (33, 4096)], ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("implementation", "device"), implementation_params("rms_norm"))
def test_rms_norm(implementation, device, dtype, shape, magnitude, generator):
    arguments = norm_arguments(*shape, dtype, generator, device, magnitude)
    expected = {"out": rms_norm_float64(arguments["input"], arguments["weight"],
                                        arguments["epsilon"])}
    check_outputs(implementation, "rms_norm", run_rms_norm, arguments, expected, dtype)


def run_fused_add_rms_norm(implementation, arguments):
    arguments = copies(arguments)
    implementation.function(arguments["input"], arguments["residual"], arguments["weight"],
                            arguments["epsilon"])
    return {"input": arguments["input"], "residual": arguments["residual"]}


@pytest.mark.parametrize("magnitude", MAGNITUDES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 1000), (33, 4096)], ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("implementation", "device"),
                         implementation_params("fused_add_rms_norm"))
def test_fused_add_rms_norm(implementation, device, dtype, shape, magnitude, generator):
    arguments = norm_arguments(*shape, dtype, generator, device, magnitude)
    arguments["residual"] = random_tensor(shape, dtype, generator, device, magnitude)
    residual = arguments["residual"].cpu().double() + arguments["input"].cpu().double()
    expected = {"residual": residual,
                "input": rms_norm_float64(residual, arguments["weight"], arguments["epsilon"])}
    check_outputs(implementation, "fused_add_rms_norm", run_fused_add_rms_norm, arguments,
                  expected, dtype)


# ---------------------------------------------------------------------------------------------
# rotary_embedding (GPT-NeoX halves; rotary_dim may be smaller than head_dim)

def cos_sin_cache(max_positions, rotary_dim, base=10000.0):
    """float32 [max_positions, rotary_dim]: cos of every position x frequency, then sin."""
    frequencies = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_positions, dtype=torch.float64).unsqueeze(1) * frequencies
    return torch.cat((angles.cos(), angles.sin()), dim=1).float()


def rotate_float64(x, positions, cache):
    """Rotate each head's first rotary_dim features, pairing feature i with i + rotary_dim / 2."""
    x = x.cpu().double().clone()
    half = cache.shape[1] // 2
    for token, position in enumerate(positions.tolist()):
        for i in range(half):
            cos, sin = float(cache[position, i]), float(cache[position, half + i])
            first, second = x[token, :, i].clone(), x[token, :, half + i].clone()
            x[token, :, i] = first * cos - second * sin
            x[token, :, half + i] = second * cos + first * sin
    return x


def run_rotary(implementation, arguments):
    arguments = copies(arguments)
    implementation.function(arguments["positions"], arguments["query"], arguments["key"],
                            arguments["cos_sin_cache"])
    return {"query": arguments["query"], "key": arguments["key"]}


@pytest.mark.parametrize("rotary_dim", ["full", "half"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa4", "mha"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("implementation", "device"),
                         implementation_params("rotary_embedding"))
def test_rotary_embedding(implementation, device, dtype, head_dim, heads, rotary_dim,
                          generator):
    num_tokens, (num_heads, num_kv_heads) = 11, heads
    rotated = head_dim if rotary_dim == "full" else head_dim // 2
    cache = cos_sin_cache(4096, rotated)
    positions = torch.randint(0, 4096, (num_tokens,), generator=generator)
    positions[0] = 0
    arguments = {
        "positions": positions.to(device), "cos_sin_cache": cache.to(device),
        "query": random_tensor((num_tokens, num_heads, head_dim), dtype, generator, device),
        "key": random_tensor((num_tokens, num_kv_heads, head_dim), dtype, generator, device)}
    expected = {name: rotate_float64(arguments[name], positions, cache)
                for name in ("query", "key")}
    check_outputs(implementation, "rotary_embedding", run_rotary, arguments, expected, dtype)
    outputs = run_rotary(implementation, arguments)
    for name in ("query", "key"):  # features past rotary_dim pass through untouched
        assert torch.equal(outputs[name][..., rotated:], arguments[name][..., rotated:])


# ---------------------------------------------------------------------------------------------
# silu_and_mul

def run_silu_and_mul(implementation, arguments):
    input = arguments["input"]
    out = poisoned_like(input[:, :input.shape[1] // 2])
    implementation.function(out, input.clone())
    return {"out": out}


@pytest.mark.parametrize("shape", [(1, 128), (9, 2 * 1376), (40, 2 * 4096)], ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("implementation", "device"), implementation_params("silu_and_mul"))
def test_silu_and_mul(implementation, device, dtype, shape, generator):
    arguments = {"input": random_tensor(shape, dtype, generator, device, scale=3.0)}
    gate, up = arguments["input"].cpu().double().chunk(2, dim=-1)
    expected = {"out": gate / (1 + torch.exp(-gate)) * up}
    check_outputs(implementation, "silu_and_mul", run_silu_and_mul, arguments, expected, dtype)


# ---------------------------------------------------------------------------------------------
# prefill_attention: causal attention within each of several packed prompts

def prefill_attention_float64(q, k, v, cu_seqlens, scale):
    """One prompt and one query head at a time; token i attends to tokens 0..i of its prompt."""
    q, k, v = (tensor.cpu().double() for tensor in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        for head in range(q.shape[1]):
            scores = q[start:end, head] @ k[start:end, head // group].T * scale
            weights = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
            out[start:end, head] = weights @ v[start:end, head // group]
    return out


def run_prefill(implementation, arguments):
    out = poisoned_like(arguments["q"])
    implementation.function(out, arguments["q"], arguments["k"], arguments["v"],
                            arguments["cu_seqlens"], arguments["max_seqlen"], arguments["scale"])
    return {"out": out}


@pytest.mark.parametrize("lengths", [[1], [1, 17, 5, 64], [130, 1, 2]], ids=str)
@pytest.mark.parametrize("heads", [(8, 2), (16, 2), (4, 4), (8, 1)],
                         ids=["gqa4", "gqa8", "mha", "mqa"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("implementation", "device"),
                         implementation_params("prefill_attention"))
def test_prefill_attention(implementation, device, dtype, heads, lengths, generator):
    (num_heads, num_kv_heads), head_dim, num_tokens = heads, 64, sum(lengths)
    cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    arguments = {
        "q": random_tensor((num_tokens, num_heads, head_dim), dtype, generator, device),
        "k": random_tensor((num_tokens, num_kv_heads, head_dim), dtype, generator, device),
        "v": random_tensor((num_tokens, num_kv_heads, head_dim), dtype, generator, device),
        "cu_seqlens": cu_seqlens.to(device), "max_seqlen": max(lengths),
        "scale": 1.5 / math.sqrt(head_dim)}
    expected = {"out": prefill_attention_float64(arguments["q"], arguments["k"], arguments["v"],
                                                 cu_seqlens, arguments["scale"])}
    check_outputs(implementation, "prefill_attention", run_prefill, arguments, expected, dtype)

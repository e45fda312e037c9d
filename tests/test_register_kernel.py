"""Kernels added by name (``neo.ops.register_kernel``), picking an implementation by name
(``select_implementation``), and ``dispatched()`` reading what the dispatcher holds.

Registrations last as long as the process: every test registers under names of its own, and a
kernel registered for ``torch.ops.neo`` itself (standing in for one registered behind neo.ops'
back) is removed again before the test ends."""

import re
import warnings

import pytest
import torch
from torch.library import Library

import neo.ops
from neo.ops import reference
from neo.ops.__main__ import main as list_implementations

from conftest import random_paged_kv, random_tensor

OP = "paged_decode_attention"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 32, 16


@pytest.fixture(scope="module")
def python_kernel():
    """A Python kernel of paged_decode_attention on the CPU, ``python_reference``: the reference,
    counting its calls."""
    calls = []

    def attention(out, q, k_cache, v_cache, block_table, seq_lens, scale):
        calls.append(q.shape[0])
        reference.paged_decode_attention(out, q, k_cache, v_cache, block_table, seq_lens, scale)

    return neo.ops.register_kernel(OP, "python_reference", attention), calls


def attention_case(generator):
    """(out, q, k_cache, v_cache, block_table, seq_lens, scale) of a small random batch."""
    paged = random_paged_kv([5, 40, 17], NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, torch.float32, generator)
    q = random_tensor((3, NUM_HEADS, HEAD_DIM), torch.float32, generator)
    out = torch.full_like(q, float("nan"))
    return out, q, paged.k_cache, paged.v_cache, paged.block_table, paged.seq_lens, HEAD_DIM ** -0.5


def test_python_kernel_is_listed_available_and_not_native(python_kernel):
    implementation, _ = python_kernel
    assert implementation in neo.ops.implementations(OP, "cpu")
    assert implementation not in neo.ops.implementations(OP, "cuda")
    assert implementation.available and not implementation.native
    assert implementation.devices == ("cpu",)
    assert implementation.qualified_name == "neo_python_reference::paged_decode_attention"
    assert implementation.function is torch.ops.neo_python_reference.paged_decode_attention


def test_python_kernel_runs_as_its_own_op(python_kernel, generator):
    implementation, calls = python_kernel
    out, *arguments = attention_case(generator)
    expected = torch.empty_like(out)
    reference.paged_decode_attention(expected, *arguments)
    before = len(calls)
    torch.ops.neo_python_reference.paged_decode_attention(out, *arguments)
    assert len(calls) == before + 1
    assert torch.equal(out, expected)


def test_registration_leaves_torch_ops_neo_alone(python_kernel, generator):
    implementation, calls = python_kernel
    target = neo.ops.dispatched(OP, "cpu")
    assert target in ("ispc", "numba", "reference")
    assert neo.ops.select_implementation(OP, "cpu", "auto").name == target
    before = len(calls)
    torch.ops.neo.paged_decode_attention(*attention_case(generator))
    assert len(calls) == before


def test_select_implementation_by_name(python_kernel):
    implementation, _ = python_kernel
    assert neo.ops.select_implementation(OP, "cpu", "python_reference") is implementation
    assert neo.ops.select_implementation(OP, "cpu").name == neo.ops.dispatched(OP, "cpu")
    for device in ("cpu", "cuda"):
        assert neo.ops.select_implementation(OP, device, "reference").name == "reference"


def test_select_implementation_errors_name_what_is_available(python_kernel):
    for device in ("cpu", "cuda"):
        available = [impl.name for impl in neo.ops.implementations(OP, device)]
        listed = f"available on {device}: {', '.join(available)}"
        with pytest.raises(ValueError, match=re.escape(listed)) as error:
            neo.ops.select_implementation(OP, device, "no_such_kernel")
        assert "no implementation named 'no_such_kernel'" in str(error.value)
        for implementation in neo.ops.implementations(OP, device, available_only=False):
            if not implementation.available:
                with pytest.raises(ValueError, match=re.escape(implementation.note)) as error:
                    neo.ops.select_implementation(OP, device, implementation.name)
                assert listed in str(error.value)
    with pytest.raises(ValueError, match=re.escape("'python_reference' on cuda (it runs on cpu)")):
        neo.ops.select_implementation(OP, "cuda", "python_reference")
    with pytest.raises(ValueError, match="unknown neo op"):
        neo.ops.select_implementation("no_such_op", "cpu")
    with pytest.raises(ValueError, match="unknown device"):
        neo.ops.select_implementation(OP, "tpu")


def test_one_name_serves_several_ops(python_kernel, generator):
    """A second op under a name that already has one is declared in the same namespace."""
    implementation = neo.ops.register_kernel("store_kv_cache", "python_reference",
                                             reference.store_kv_cache)
    assert implementation.name == "python_reference" and not implementation.native
    key = random_tensor((2, NUM_KV_HEADS, HEAD_DIM), torch.float32, generator)
    value = random_tensor((2, NUM_KV_HEADS, HEAD_DIM), torch.float32, generator)
    k_cache = torch.zeros(2, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    torch.ops.neo_python_reference.store_kv_cache(key, value, k_cache, v_cache, torch.tensor([3, 20]))
    assert torch.equal(k_cache[0, :, 3], key[0]) and torch.equal(v_cache[1, :, 4], value[1])


def test_python_kernel_on_cuda_is_registered_for_the_cuda_key():
    implementation = neo.ops.register_kernel("rms_norm", "python_rms_norm_cuda",
                                             reference.rms_norm, device="cuda")
    assert implementation.devices == ("cuda",) and not implementation.native
    assert torch._C._dispatch_has_kernel_for_dispatch_key(implementation.qualified_name, "CUDA")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(implementation.qualified_name, "CPU")
    assert neo.ops.select_implementation("rms_norm", "cuda", "python_rms_norm_cuda") is implementation


def test_compiled_kernel_is_found_where_its_extension_registered_it(generator):
    """``function=None`` takes the kernel already registered for ``neo_<name>::<op>``. An
    extension would register it from C++ (``TORCH_LIBRARY_IMPL``); a registration for the key
    without a declaration, made here, stands in for it."""
    name = "prebuilt_attention"
    with pytest.raises(ValueError, match=f"no compiled CPU kernel is registered for neo_{name}"):
        neo.ops.register_kernel(OP, name)
    extension = Library(f"neo_{name}", "IMPL")
    extension.impl(OP, reference.paged_decode_attention, "CPU")
    implementation = neo.ops.register_kernel(OP, name)
    assert implementation.native and implementation.available
    assert implementation in neo.ops.implementations(OP, "cpu")
    out, *arguments = attention_case(generator)
    expected = torch.empty_like(out)
    reference.paged_decode_attention(expected, *arguments)
    implementation.function(out, *arguments)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(("arguments", "message"), [
    (("no_such_op", "anything", reference.rms_norm), "unknown neo op 'no_such_op'"),
    ((OP, "anything", reference.paged_decode_attention, "tpu"), "unknown device 'tpu'"),
    ((OP, "not-a-name", reference.paged_decode_attention), "must be an identifier"),
    ((OP, "auto", reference.paged_decode_attention), "'auto' is reserved"),
    ((OP, "ispc", reference.paged_decode_attention), "'ispc' is reserved"),
    (("swap_blocks", "numba", reference.swap_blocks), "'numba' is reserved"),
    ((OP, "python_reference", reference.paged_decode_attention),
     "already has an implementation named 'python_reference'"),
    ((OP, "not_callable", 42), "must be callable"),
], ids=["unknown-op", "unknown-device", "bad-name", "auto", "built-in", "built-in-other-op",
        "taken", "not-callable"])
def test_register_kernel_errors(python_kernel, arguments, message):
    op, name, function, *device = arguments
    with pytest.raises(ValueError, match=re.escape(message)):
        neo.ops.register_kernel(op, name, function, **({"device": device[0]} if device else {}))


def test_register_kernel_refuses_ops_declared_or_implemented_elsewhere():
    declared = Library("neo_declared_elsewhere", "DEF")
    declared.define(OP + neo.ops.SCHEMAS[OP])
    with pytest.raises(ValueError, match="already declared outside neo.ops"):
        neo.ops.register_kernel(OP, "declared_elsewhere", reference.paged_decode_attention)
    implemented = Library("neo_implemented_elsewhere", "IMPL")
    implemented.impl(OP, reference.paged_decode_attention, "CPU")
    with pytest.raises(ValueError, match="already has a registered kernel"):
        neo.ops.register_kernel(OP, "implemented_elsewhere", reference.paged_decode_attention)
    names = {impl.name for impl in neo.ops.implementations(OP, available_only=False)}
    assert not names & {"declared_elsewhere", "implemented_elsewhere"}


def test_build_fingerprints_ignore_python_kernels(python_kernel):
    assert set(neo.ops.build_fingerprints()) <= {"cuda", "ispc"}


def test_listing_shows_the_registered_kernel_as_python(python_kernel, capsys):
    list_implementations()
    listing = capsys.readouterr().out
    section = re.search(rf"^neo\.{OP}\n(.*?)(?:\n\n|\Z)", listing, re.S | re.M).group(1)
    assert re.search(r"^\s+python_reference\s+cpu\s+python\s+available$", section, re.M), section
    assert f"dispatches to: cpu -> {neo.ops.dispatched(OP, 'cpu')}," in section


# dispatched() used to return a table filled once at import: a kernel registered for
# torch.ops.neo afterwards (from Python, or by an extension loaded later) ran while the label
# still named the kernel of import time.

def test_dispatched_sees_a_kernel_registered_later_for_a_free_key():
    op = "swap_blocks"
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"neo::{op}", "CPU")
    assert neo.ops.dispatched(op, "cpu") == "reference"
    on_cuda = neo.ops.dispatched(op, "cuda")  # the CUDA kernel where it is built, else the reference
    calls = []
    foreign = Library("neo", "IMPL")
    foreign.impl(op, lambda src, dst, block_mapping: calls.append(op), "CPU")
    try:
        source, destination = torch.zeros(2, 3), torch.ones(2, 3)
        torch.ops.neo.swap_blocks(source, destination, torch.tensor([[0, 1]]))
        assert calls == [op] and torch.equal(destination, torch.ones(2, 3))  # the foreign kernel ran
        with pytest.raises(RuntimeError, match=r"runs a CPU kernel that neo.ops did not register"):
            neo.ops.dispatched(op, "cpu")
        assert neo.ops.dispatched(op, "cuda") == on_cuda
    finally:
        del foreign  # deregisters its kernel
    assert neo.ops.dispatched(op, "cpu") == "reference"


def test_dispatched_sees_a_kernel_registered_over_neos(capsys):
    """Overriding the CPU kernel neo.ops registered (ISPC's or numba's) changes what runs, and
    dispatched() says so; once the override is gone, the kernel it replaced is named again."""
    before = neo.ops.dispatched(OP, "cpu")
    foreign = Library("neo", "IMPL")
    with warnings.catch_warnings():  # torch warns of the override (once per process)
        warnings.simplefilter("ignore")
        foreign.impl(OP, reference.paged_decode_attention, "CPU")
    try:
        with pytest.raises(RuntimeError, match=r"did not register \(.*test_register_kernel\.py"):
            neo.ops.dispatched(OP, "cpu")
        with pytest.raises(RuntimeError, match="did not register"):
            neo.ops.select_implementation(OP, "cpu")
        list_implementations()
        assert re.search(rf"torch.ops.neo.{OP} dispatches to: cpu -> unknown \(torch.ops.neo.{OP} "
                         r"runs a CPU kernel that neo.ops did not register", capsys.readouterr().out)
    finally:
        del foreign
    assert neo.ops.dispatched(OP, "cpu") == before

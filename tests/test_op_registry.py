"""The implementation registry: what ``python -m neo.ops`` lists, what ``implementations()`` and
``dispatched()`` say, and that they agree with each other and with torch's dispatcher.

Only the built-in implementations are checked here (kernels added by name in this process, by
other test modules, are ``test_register_kernel``'s)."""

import re
import subprocess
import sys

import pytest
import torch

import neo.ops

# Highest precedence first: the kernel ``torch.ops.neo.<op>`` runs on a device is the first
# available one that serves the device.
PRECEDENCE = ("cuda", "ispc", "numba", "reference")
NATIVE = {"cuda": True, "ispc": True, "numba": False, "reference": False}
DEVICES = ("cpu", "cuda")


def available(op, name):
    return any(impl.name == name for impl in neo.ops.implementations(op))


def built_in(op, device=None, available_only=True):
    return [impl for impl in neo.ops.implementations(op, device, available_only)
            if impl.name in PRECEDENCE]


@pytest.fixture(scope="module")
def listing():
    result = subprocess.run([sys.executable, "-m", "neo.ops"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def op_section(listing, op):
    match = re.search(rf"^neo\.{op}\n(.*?)(?:\n\n|\Z)", listing, re.S | re.M)
    assert match, f"python -m neo.ops does not list neo.{op}:\n{listing}"
    return match.group(1)


@pytest.mark.parametrize("op", neo.ops.OP_NAMES)
def test_listing_shows_implementations_and_dispatch(listing, op):
    section = op_section(listing, op)
    for implementation in built_in(op, available_only=False):
        state = "available" if implementation.available else \
            f"unavailable: {implementation.note}"
        line = re.search(rf"^\s+{implementation.name}\s+(\S+)\s+(\S+)\s+(.*)$", section, re.M)
        assert line, f"{implementation.name} missing under neo.{op}:\n{section}"
        assert line.group(1) == "/".join(implementation.devices)
        assert line.group(2) == ("native" if NATIVE[implementation.name] else "python")
        assert line.group(3) == state
    targets = ", ".join(f"{device} -> {neo.ops.dispatched(op, device)}" for device in DEVICES)
    assert f"torch.ops.neo.{op} dispatches to: {targets}" in section


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", neo.ops.OP_NAMES)
def test_dispatch_target_is_the_first_available_by_precedence(op, device):
    serving = [impl.name for impl in built_in(op, device)]
    assert serving, f"no implementation of neo.{op} serves {device}"
    expected = min(serving, key=PRECEDENCE.index)
    assert neo.ops.dispatched(op, device) == expected


@pytest.mark.parametrize("op", ["paged_decode_attention", "store_kv_cache"])
def test_cpu_attention_ops_dispatch_to_the_fastest_build(op):
    if available(op, "ispc"):
        expected = "ispc"
    elif op == "paged_decode_attention" and available(op, "numba"):
        expected = "numba"
    else:
        expected = "reference"
    assert neo.ops.dispatched(op, "cpu") == expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", neo.ops.OP_NAMES)
def test_dispatch_target_agrees_with_torch(op, device):
    """A device kernel is registered for ``neo::<op>`` exactly when something other than the
    reference (registered for every device) is said to run there."""
    key = {"cpu": "CPU", "cuda": "CUDA"}[device]
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(f"neo::{op}", key)
    assert has_kernel == (neo.ops.dispatched(op, device) != "reference")


@pytest.mark.parametrize("op", neo.ops.OP_NAMES)
def test_native_marks_the_compiled_implementations(op):
    for implementation in built_in(op, available_only=False):
        assert implementation.native == NATIVE[implementation.name], implementation.label


def test_without_ispc_the_numba_fallback_is_named():
    """Without the ISPC extension, torch.ops.neo's CPU attention is numba's kernel (the
    reference's where numba is missing), and dispatched() tells it from the reference."""
    script = "\n".join([
        "import sys",
        "sys.modules['neo.ops._cpu_kernels'] = None  # importing the ISPC extension fails",
        "import neo.ops",
        "print(neo.ops.dispatched('paged_decode_attention', 'cpu'))",
        "print(neo.ops.dispatched('store_kv_cache', 'cpu'))",
        "try:",
        "    neo.ops.select_implementation('paged_decode_attention', 'cpu', 'ispc')",
        "except ValueError as error:",
        "    print(error)",
    ])
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    attention, store, error = result.stdout.splitlines()
    assert attention == ("numba" if available("paged_decode_attention", "numba") else "reference")
    assert store == "reference"
    assert error.startswith("the ispc implementation of neo.paged_decode_attention is unavailable: "
                            "not built"), error


@pytest.mark.parametrize("op", neo.ops.OP_NAMES)
def test_implementations_are_reachable_by_name(op):
    for implementation in neo.ops.implementations(op, available_only=False):
        assert implementation.qualified_name == f"neo_{implementation.name}::{op}"
        if implementation.available:
            namespace = getattr(torch.ops, f"neo_{implementation.name}")
            assert implementation.function is getattr(namespace, op)
        else:
            assert implementation.note, f"{implementation.label} is unavailable without a reason"
            with pytest.raises(RuntimeError, match=re.escape(implementation.note)):
                implementation.function


def test_reference_serves_every_op_everywhere():
    for op in neo.ops.OP_NAMES:
        reference = [impl for impl in neo.ops.implementations(op) if impl.name == "reference"]
        assert reference and set(reference[0].devices) == set(DEVICES)


def test_device_filter_and_unknown_op():
    for op in neo.ops.OP_NAMES:
        for device in DEVICES:
            for implementation in neo.ops.implementations(op, device):
                assert implementation.available and device in implementation.devices
    with pytest.raises(ValueError, match="unknown neo op"):
        neo.ops.implementations("no_such_op")
    with pytest.raises(ValueError, match="unknown device"):
        neo.ops.implementations("rms_norm", "tpu")


def test_build_fingerprints_name_each_loaded_extension_by_its_file():
    import hashlib
    import importlib

    fingerprints = neo.ops.build_fingerprints()
    modules = {"cuda": "neo.ops._cuda_kernels", "ispc": "neo.ops._cpu_kernels"}
    for name, module in modules.items():
        built = any(available(op, name) for op in neo.ops.OP_NAMES)
        assert (name in fingerprints) == built, name
        if built:
            with open(importlib.import_module(module).__file__, "rb") as file:
                assert fingerprints[name] == hashlib.sha256(file.read()).hexdigest()[:16]
    assert set(fingerprints) <= set(modules)

"""``python -m neo.ops`` shows every registered op with its schema and the shape, dtype and
meaning of each of its tensors, in lines that fit a 100-column terminal; ``TENSORS`` describes
exactly the tensor arguments of each schema."""

import re
import subprocess
import sys

import pytest
import torch

import neo.ops
from neo.ops.schemas import TENSORS

LISTING_TIMEOUT_SECONDS = 300
WIDTH = 100


def tensor_arguments(op: str) -> list[str]:
    schema = torch._C.parse_schema(f"neo::{op}{neo.ops.SCHEMAS[op]}")
    return [argument.name for argument in schema.arguments if argument.type.kind() == "TensorType"]


@pytest.fixture(scope="module")
def listing() -> str:
    result = subprocess.run([sys.executable, "-m", "neo.ops"], capture_output=True, text=True,
                            timeout=LISTING_TIMEOUT_SECONDS)
    assert result.returncode == 0, result.stderr
    return result.stdout


def op_section(listing: str, op: str) -> str:
    match = re.search(rf"^neo\.{op}\n(.*?)(?:\n\n|\Z)", listing, re.S | re.M)
    assert match, f"python -m neo.ops does not list neo.{op}:\n{listing}"
    return match.group(1)


@pytest.mark.parametrize("op", neo.ops.OP_NAMES)
def test_every_tensor_argument_is_described(op):
    assert list(TENSORS[op]) == tensor_arguments(op)
    for name, spec in TENSORS[op].items():
        assert spec.shape.startswith("[") and spec.shape.endswith("]") and spec.dtype, (op, name)


def test_every_registered_op_has_a_description():
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("neo::")}
    assert registered == set(neo.ops.OP_NAMES) == set(TENSORS)


@pytest.mark.parametrize("op", neo.ops.OP_NAMES)
def test_listing_shows_schema_and_shapes(listing, op):
    section = op_section(listing, op)
    schema_text = re.search(r"^  schema  (.*?)\n  tensor", section, re.S | re.M).group(1)
    assert " ".join(schema_text.split()) == neo.ops.SCHEMAS[op]
    for name, spec in TENSORS[op].items():
        line = re.search(rf"^    {name} +(\[.*?\]) +(\S+)(?: +(.*))?$", section, re.M)
        assert line, f"tensor {name} missing under neo.{op}:\n{section}"
        assert (line.group(1), line.group(2)) == (spec.shape, spec.dtype)
        if spec.meaning:
            assert spec.meaning.split()[0] in line.group(3)
    assert "  implementations\n" in section and f"torch.ops.neo.{op} dispatches to: cpu -> " in section


def test_listing_fits_the_terminal(listing):
    """Every line but an unavailable implementation's, whose reason is the machine's own error
    text, kept whole on its line."""
    long_lines = [line for line in listing.splitlines() if len(line) > WIDTH and " unavailable: " not in line]
    assert not long_lines, long_lines


def test_listing_names_the_ispc_bf16_decode_variant(listing):
    ispc = [impl for impl in neo.ops.implementations("paged_decode_attention", available_only=False)
            if impl.name == "ispc"]
    if not ispc or not ispc[0].available:
        pytest.skip(f"ispc: {ispc[0].note if ispc else 'not registered'}")
    from neo.ops import _cpu_kernels

    section = " ".join(op_section(listing, "paged_decode_attention").split())
    assert f"bf16 variant {_cpu_kernels.bf16_decode_attention_variant()} " in section

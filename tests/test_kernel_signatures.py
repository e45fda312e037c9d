"""The C++ kernels' signatures follow the schemas, so CPU and CUDA kernels can both register.

The dispatcher refuses a second kernel for an op whose C++ signature differs from the first
one's, and the CUDA binding only builds on a GPU machine; this reads both sources and checks
each kernel's parameter types against what its schema implies.
"""

import pathlib
import re

import pytest

from neo.ops.registry import ISPC_OPS
from neo.ops.schemas import SCHEMAS

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = {"ops_cpu": ROOT / "ops_cpu" / "ops.h", "ops_cuda": ROOT / "ops_cuda" / "binding.cpp"}


def expected_types(schema: str) -> list[str]:
    """C++ parameter types torch uses for a schema: ``Tensor(a!)`` -> ``at::Tensor&``."""
    arguments = schema[schema.index("(") + 1:schema.index(") ->")]
    types = []
    for argument in arguments.split(","):
        kind = argument.split()[0]
        if kind.startswith("Tensor("):
            types.append("at::Tensor&")
        elif kind == "Tensor":
            types.append("const at::Tensor&")
        else:
            types.append({"float": "double", "int": "int64_t", "bool": "bool"}[kind])
    return types


def declared_types(source: str, op: str) -> list[str]:
    match = re.search(rf"\bvoid\s+{op}\s*\(([^)]*)\)", source)
    assert match, f"no definition of {op}"
    types = []
    for parameter in match.group(1).split(","):
        words = " ".join(parameter.split())
        types.append(re.sub(r"\s*&\s*", "&", words.rsplit(" ", 1)[0]))
    return types


@pytest.mark.parametrize("directory, op", [("ops_cpu", op) for op in ISPC_OPS]
                         + [("ops_cuda", op) for op in SCHEMAS])
def test_kernel_signature_matches_schema(directory, op):
    source = SOURCES[directory].read_text()
    assert declared_types(source, op) == expected_types(SCHEMAS[op])

"""``python -m neo.ops``: every op, its schema and tensors, its implementations on this machine,
and what dispatches.

Per op: the ``torch.library`` schema; one line per tensor argument with its shape, dtype and
meaning (``schemas.TENSORS``); one line per implementation: name, devices, ``native``
(compiled, runs without the Python interpreter, so it may be called from a CUDA host function)
or ``python``, and availability or why not; then the implementation ``torch.ops.neo.<op>``
runs on cpu and on cuda, read from the dispatcher (``dispatched``). ``main()`` lists the
implementations of its own process, kernels added there with ``register_kernel`` included.
Lines fit ``WIDTH`` columns.
"""

import textwrap

import torch

from . import OP_NAMES, SCHEMAS, dispatched, implementations, ispc_bf16_decode_variant
from .schemas import TENSORS

WIDTH = 100
NAME_COLUMN, SHAPE_COLUMN, DTYPE_COLUMN = 14, 28, 10
NO_BREAK = "\u00a0"  # joins the words of one schema argument (textwrap breaks at ASCII spaces only)


def dispatch_target(op: str, device: str) -> str:
    try:
        return dispatched(op, device)
    except RuntimeError as error:  # a kernel neo.ops did not register
        return f"unknown ({error})"


def wrapped(text: str, indent: str, first_indent: str | None = None) -> str:
    """``text`` wrapped to ``WIDTH`` columns, every line but the first indented by ``indent``."""
    return textwrap.fill(text, WIDTH, initial_indent=first_indent if first_indent is not None else indent,
                         subsequent_indent=indent, break_on_hyphens=False)


def schema_lines(op: str) -> str:
    """The op's schema wrapped between its arguments, never inside one."""
    arguments = [argument.replace(" ", NO_BREAK) for argument in SCHEMAS[op].split(", ")]
    return wrapped(", ".join(arguments), " " * 10, "  schema  ").replace(NO_BREAK, " ")


def tensor_lines(op: str) -> list[str]:
    """One line per tensor argument: name, shape, dtype, meaning (wrapped under itself)."""
    lines = []
    prefix_width = 4 + NAME_COLUMN + SHAPE_COLUMN + DTYPE_COLUMN
    for name, spec in TENSORS[op].items():
        prefix = f"    {name:<{NAME_COLUMN}}{spec.shape:<{SHAPE_COLUMN}}{spec.dtype:<{DTYPE_COLUMN}}"
        if not spec.meaning:
            lines.append(prefix.rstrip())
            continue
        lines.append(wrapped(spec.meaning, " " * prefix_width, prefix))
    return lines


def variant_note(op: str, impl) -> str:
    """For the ISPC decode attention: the variant its bf16 calls run now."""
    if op != "paged_decode_attention" or impl.name != "ispc" or not impl.available:
        return ""
    try:
        variant = ispc_bf16_decode_variant()
    except ValueError as error:
        return f"bf16: {error}"
    return f"bf16 variant {variant} (NEO_CPU_DECODE_ATTENTION_VARIANT: auto, generic, bf16_dot)"


def main() -> None:
    print(f"torch {torch.__version__}; CUDA available: {torch.cuda.is_available()}; "
          f"CPU threads: {torch.get_num_threads()}")
    print(wrapped("Shapes: T tokens, S sequences, H query heads, KVH key/value heads, D head dim, B cache "
                  "blocks, BS block size, hidden the model width, I the MLP's intermediate size. Dtype F: "
                  "one of float32, float16, bfloat16, shared by the op's F tensors. (a!): written in place.",
                  ""))
    print(wrapped("native: compiled, runs without the Python interpreter (a CUDA host function may call "
                  "it); python: runs in the interpreter", ""))
    for op in OP_NAMES:
        print(f"\nneo.{op}")
        print(schema_lines(op))
        print(f"  {'tensor':<{NAME_COLUMN + 2}}{'shape':<{SHAPE_COLUMN}}{'dtype':<{DTYPE_COLUMN}}meaning")
        print("\n".join(tensor_lines(op)))
        print("  implementations")
        for impl in implementations(op, available_only=False):
            kind = "native" if impl.native else "python"
            state = "available" if impl.available else f"unavailable: {impl.note}"
            print(f"    {impl.name:<10} {'/'.join(impl.devices):<9} {kind:<6} {state}")
            note = variant_note(op, impl)
            if note:
                print(wrapped(note, " " * 8, " " * 6))
        print(f"  torch.ops.neo.{op} dispatches to: cpu -> {dispatch_target(op, 'cpu')}, "
              f"cuda -> {dispatch_target(op, 'cuda')}")


if __name__ == "__main__":
    main()

"""``python -m neo.ops``: every op, its implementations on this machine, and what dispatches.

One line per implementation: name, devices, ``native`` (compiled, runs without the Python
interpreter, so it may be called from a CUDA host function) or ``python``, and availability or
why not; then the implementation ``torch.ops.neo.<op>`` runs on cpu and on cuda, read from the
dispatcher (``dispatched``). ``main()`` lists the implementations of its own process, kernels
added there with ``register_kernel`` included.
"""

import torch

from . import OP_NAMES, dispatched, implementations


def dispatch_target(op: str, device: str) -> str:
    try:
        return dispatched(op, device)
    except RuntimeError as error:  # a kernel neo.ops did not register
        return f"unknown ({error})"


def main() -> None:
    print(f"torch {torch.__version__}; CUDA available: {torch.cuda.is_available()}; "
          f"CPU threads: {torch.get_num_threads()}")
    print("native: compiled, runs without the Python interpreter (a CUDA host function may call "
          "it); python: runs in the interpreter")
    for op in OP_NAMES:
        print(f"\nneo.{op}")
        for impl in implementations(op, available_only=False):
            kind = "native" if impl.native else "python"
            state = "available" if impl.available else f"unavailable: {impl.note}"
            print(f"  {impl.name:<10} {'/'.join(impl.devices):<9} {kind:<6} {state}")
        print(f"  torch.ops.neo.{op} dispatches to: cpu -> {dispatch_target(op, 'cpu')}, "
              f"cuda -> {dispatch_target(op, 'cuda')}")


if __name__ == "__main__":
    main()

"""``python -m neo.ops``: every op, its implementations on this machine, and what dispatches."""

import torch

from . import OP_NAMES, dispatched, implementations


def main() -> None:
    print(f"torch {torch.__version__}; CUDA available: {torch.cuda.is_available()}; "
          f"CPU threads: {torch.get_num_threads()}")
    for op in OP_NAMES:
        print(f"\nneo.{op}")
        for impl in implementations(op, available_only=False):
            state = "available" if impl.available else f"unavailable: {impl.note}"
            print(f"  {impl.name:<10} {'/'.join(impl.devices):<9} {state}")
        print(f"  torch.ops.neo.{op} dispatches to: cpu -> {dispatched(op, 'cpu')}, "
              f"cuda -> {dispatched(op, 'cuda')}")


if __name__ == "__main__":
    main()

"""Test-only launcher of tensor-parallel ranks: ``size`` spawned processes on gloo over
loopback, each running one function, with a deadline on everything.

``run_ranks(function, size, *args)`` starts ``function(rank, size, *args)`` in ``size``
processes after joining them in one ``torch.distributed`` default group, waits for all of them
up to ``timeout`` seconds, and raises when one fails or the deadline passes (the others are
terminated, so no process outlives the call).
"""

import socket
import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

RANK_TIMEOUT_SECONDS = 120


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_main(rank: int, function, size: int, port: int, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=RANK_TIMEOUT_SECONDS))
    try:
        function(rank, size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(function, size: int, *args, timeout: float = RANK_TIMEOUT_SECONDS) -> None:
    """Run ``function(rank, size, *args)`` on ``size`` gloo ranks; raise if one fails or the
    whole takes longer than ``timeout`` seconds."""
    context = mp.start_processes(_rank_main, args=(function, size, free_port(), args), nprocs=size,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{size} tensor-parallel ranks did not finish within {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
            process.join(timeout=10)

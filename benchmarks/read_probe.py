"""The host's memory read bandwidth, as the CPU benchmarks and ``offload.py`` judge host attention
against it: a float32 ``torch.sum`` over a buffer in huge pages (as the host KV pool), a
different slice per call so that a slice read again has long left the caches."""

import time
from dataclasses import dataclass

import torch

from neo.kv.host_memory import huge_page_zeros

# The probe reads its buffer in this many slices, one per call, in turn.
PROBE_SLICES = 8
# The probe's figure is its fastest call out of this many rounds over all slices.
PROBE_ROUNDS = 2


@dataclass
class ReadProbe:
    """A float32 buffer of the working set's size in huge pages, summed one slice per call.

    ``buffer`` is ``[PROBE_SLICES, slice_elements]``; ``read_next()`` sums the next slice.
    """

    buffer: torch.Tensor
    next_slice: int = 0

    @classmethod
    def allocate(cls, nbytes: int) -> "ReadProbe":
        slice_elements = nbytes // 4 // PROBE_SLICES
        buffer = huge_page_zeros((PROBE_SLICES, slice_elements), torch.float32)
        buffer.fill_(1.0)
        return cls(buffer)

    @property
    def slice_bytes(self) -> int:
        return self.buffer[0].numel() * 4

    def read_next(self) -> torch.Tensor:
        total = self.buffer[self.next_slice].sum()
        self.next_slice = (self.next_slice + 1) % PROBE_SLICES
        return total

    def warm_up(self) -> None:
        """Read every slice once (the first touches of a fresh buffer are not a read rate)."""
        for _ in range(PROBE_SLICES):
            self.read_next()

    def read_bandwidth(self) -> float:
        """GB/s of the fastest of ``PROBE_ROUNDS`` rounds of slice sums on torch's current
        thread count."""
        best = float("inf")
        for _ in range(PROBE_ROUNDS * PROBE_SLICES):
            start = time.perf_counter()
            self.read_next()
            best = min(best, time.perf_counter() - start)
        return self.slice_bytes / best / 1e9


def measure_read_bandwidth(nbytes: int, threads: int) -> float:
    """GB/s of the fastest slice sum of a rotated ``nbytes`` probe on ``threads`` threads (after
    one warm-up round)."""
    probe = ReadProbe.allocate(nbytes)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        probe.warm_up()
        return probe.read_bandwidth()
    finally:
        torch.set_num_threads(previous_threads)

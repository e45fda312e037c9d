"""Host memory for KV caches: 2 MiB-aligned anonymous memory advised to use huge pages.

Decode attention over a host cache reads each block of 4 KiB-32 KiB from scattered places;
in 4 KiB pages every block costs TLB misses and the hardware prefetchers stop at each page
boundary. Transparent huge pages remove most of that. Where the system offers no huge pages the
memory stays in 4 KiB pages.

Page-locking (``cudaHostRegister``) a range faults in every page not yet present, one at a
time on the calling thread. ``zero_in_parallel`` faults them in from several threads first,
so registering only pins pages that are already there.
"""

import ctypes
import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import torch

HUGE_PAGE_BYTES = 2 << 20


def huge_page_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled host tensor starting on a 2 MiB boundary, in transparent huge pages when
    available. The tensor keeps its memory alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private: Python's default anonymous mapping is shared, which Linux backs with shmem, whose
    # huge pages are governed by shmem_enabled (usually "never") rather than the madvise below.
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # transparent huge pages are disabled: plain pages
    start = -ctypes.addressof(ctypes.c_char.from_buffer(buffer)) % HUGE_PAGE_BYTES
    return torch.frombuffer(buffer, dtype=torch.uint8)[start:start + nbytes].view(dtype).view(shape)


def zero_in_parallel(tensor: torch.Tensor, threads: int | None = None) -> None:
    """Write zeros over a contiguous host tensor's bytes from ``threads`` threads (default: the
    cores this process may run on), each over its own slice, so the page faults of untouched
    memory run side by side. ``ctypes.memset`` releases the GIL."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    threads = threads or len(os.sched_getaffinity(0))
    step = -(-nbytes // threads // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES  # whole 2 MiB ranges
    base = tensor.data_ptr()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda start: ctypes.memset(base + start, 0, min(step, nbytes - start)),
                      range(0, nbytes, step)))

"""``HostAttentionWorker``: the host thread that runs decode attention over the host KV cache
where the stream-ordered hand-off cannot (``neo.runner.host_attention``)."""

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


def default_cpu_attention_threads() -> int:
    """All cores this process may use, but one: that one launches the GPU work."""
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (available or 1) - 1)


def _start_thread(num_threads: int, cores: list[int] | None) -> None:
    """The worker thread's start: pin it to ``cores`` (None: leave it), then size its intra-op
    pool, whose threads it creates and which so inherit the pinning."""
    if cores is not None:
        os.sched_setaffinity(0, cores)  # 0: the calling thread
    torch.set_num_threads(num_threads)


class HostAttentionWorker:
    """One worker thread; tasks run in submission order, each may use ``num_threads`` cores.

    The ops it calls release the GIL, so the main thread keeps launching GPU work meanwhile.
    An exception inside a task is re-raised by ``Future.result()`` in the caller. ``cores``:
    pin the thread and its intra-op threads to these (``neo.runner.host_cores``; None: no
    pinning).
    """

    def __init__(self, num_threads: int, cores: list[int] | None = None):
        self.num_threads = num_threads
        self.cores = cores
        self._busy_seconds = 0.0
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="neo-cpu-attention",
                                            initializer=_start_thread, initargs=(num_threads, cores))

    def submit(self, task) -> Future:
        return self._executor.submit(self._timed, task)

    def _timed(self, task):
        start = time.perf_counter()
        try:
            # Inference mode is per thread: the caller's tensors are inference tensors, which
            # ops may update in place only under it.
            with torch.inference_mode():
                return task()
        finally:
            with self._lock:
                self._busy_seconds += time.perf_counter() - start

    def drain(self) -> None:
        """Wait until every task submitted so far has run (tasks run in submission order)."""
        self._executor.submit(lambda: None).result()

    def take_busy_seconds(self) -> float:
        """Seconds spent in tasks since the last call."""
        with self._lock:
            busy, self._busy_seconds = self._busy_seconds, 0.0
        return busy

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

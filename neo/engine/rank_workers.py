"""The processes of a tensor-parallel engine: the caller's process is rank 0 (the driver: the
scheduler, the tokenizer, the outputs, its own shard and runner); ``RankWorkers`` starts ranks
1..N-1, each building its own shard, KV pools and runner (``build``) and then executing the
driver's plans in lockstep (``ModelRunner.follow``; the plan and its channel are
``neo.runner.rank_plan``).

All ranks join one ``torch.distributed`` group (gloo on the CPU; NCCL for CUDA tensors and gloo
for CPU ones on GPUs, rank r on ``cuda:r``) for the model's collectives, a second one (NCCL on
GPUs) for the collectives of host batches, which run beside the iterations
(``TensorParallel.on_side_group``), and a gloo group of its own for the plans. Processes are
spawned (no fork of a process that may hold CUDA state) as daemons, so they end with the
driver's process.

Failures: a worker that raises reports its traceback on a queue and exits; its sockets close,
so the driver's next collective or plan send fails instead of waiting. The driver then names the
failed rank and its error (``failure``), stops the other workers, and every later step raises
(``raise_if_failed``). ``shutdown`` (``LLMEngine.close``) tells the workers to stop, waits for
them, and kills any that do not end in time, so no process outlives the engine.
"""

import logging
import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neo.config import EngineConfig
from neo.models.loader import resolve_model_config
from neo.models.parallel import TensorParallel, check_divisible
from neo.runner.rank_plan import PlanChannel

from .build import build, check_host_allocations
from .torch_profiler import TorchProfiler

logger = logging.getLogger(__name__)

# NVLink multicast (NVLS) off in NCCL, PyTorch's symmetric memory and NVSHMEM: on shared
# multi-GPU hosts a program using it can put the GPUs out of service.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a collective (or the start) waiting longer fails
STOP_SECONDS = 30.0  # how long a worker may take to end after being told to
REPORT_SECONDS = 5.0  # how long the driver waits for a failed worker's report
REPORT_POLL_SECONDS = 0.05


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def join_group(rank: int, size: int, port: int, device_type: str) -> tuple[TensorParallel, PlanChannel]:
    """Join the ranks' group (rendezvous on loopback ``port``) and the plans' gloo group."""
    if device_type == "cuda":
        os.environ.update(MULTICAST_OFF)
        torch.cuda.set_device(rank)
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    plan_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    # The host batches' collectives (``TensorParallel.on_side_group``): a communicator, and on
    # GPUs a stream, of their own. Set up now, while every rank is here, rather than inside the
    # first host batch.
    side_group = dist.new_group(backend="nccl" if device_type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
    probe = torch.zeros(1, device=torch.device("cuda", rank) if device_type == "cuda" else "cpu")
    dist.all_reduce(probe, group=side_group)
    return TensorParallel(dist.group.WORLD, side_group), PlanChannel(plan_group, rank)


def _worker_main(rank: int, config: EngineConfig, port: int, failures) -> None:
    """Rank ``rank``: build this rank's parts and follow the driver's plans until told to stop."""
    parts = None
    torch_profiler = (TorchProfiler(config.torch_profiler_dir, rank, config.compute_device.type)
                      if config.torch_profiler_dir else None)
    try:
        parallel, channel = join_group(rank, config.tensor_parallel_size, port, config.compute_device.type)
        parts = build(config, parallel)
        while (message := channel.receive()) is not None:
            kind, payload = message
            if kind == "execute":
                parts.runner.follow(payload)
            elif kind == "launch":
                parts.runner.follow_host_batch(payload)
            elif kind == "parts":
                parts.runner.follow_host_batch_parts(payload)
            elif kind == "profile":
                parts.profiler.run()
            elif kind == "torch_profiler" and payload == "start":
                torch_profiler.start()
            elif kind == "torch_profiler":
                torch_profiler.stop()
            else:
                raise ValueError(f"unknown message {kind!r} from the driver rank")
    except BaseException as error:
        failures.put((rank, f"{type(error).__name__}: {error}", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if torch_profiler is not None and torch_profiler.running:  # the driver closed while recording
            torch_profiler.stop()
        if parts is not None:
            try:
                parts.runner.release_graphs()  # before leaving the group: they hold its collectives
            except RuntimeError as error:  # a device in an error state refuses the release too
                logger.warning("rank %d: releasing the CUDA graphs failed: %s", rank, error)
            if parts.worker is not None:
                parts.worker.shutdown()
            parts.kv_cache.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class RankWorkers:
    """Ranks 1..N-1 of an engine with ``tensor_parallel_size`` N, started on construction (after
    checking that N divides the model's sizes); the caller's process joins as rank 0."""

    def __init__(self, config: EngineConfig):
        size = config.tensor_parallel_size
        check_divisible(resolve_model_config(config.model), size)
        check_host_allocations(config)
        if dist.is_initialized():
            raise RuntimeError(f"tensor_parallel_size {size}: this process already belongs to a "
                               f"torch.distributed group; the engine starts and owns its ranks' group")
        device_type = config.compute_device.type
        if device_type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs, this machine has "
                             f"{torch.cuda.device_count()}")
        if device_type == "cuda":
            os.environ.update(MULTICAST_OFF)  # before the workers start: they inherit it
        port = _free_port()
        context = mp.get_context("spawn")
        self.failures = context.Queue()
        self.processes = [context.Process(target=_worker_main, args=(rank, config, port, self.failures),
                                          name=f"neo-rank-{rank}", daemon=True) for rank in range(1, size)]
        self.error: RuntimeError | None = None
        self.failed_rank: int | None = None  # the worker that reported a failure
        for process in self.processes:
            process.start()
        try:
            self.parallel, self.channel = join_group(0, size, port, device_type)
        except BaseException:
            self._stop_processes()
            raise

    def failure(self, error: BaseException) -> RuntimeError:
        """The driver's work failed with ``error``: the error to report, naming the worker that
        failed and why when one did (waiting up to ``REPORT_SECONDS`` for its report). The other
        workers are stopped; every later ``raise_if_failed`` raises it."""
        if self.error is None:
            report = self._report()
            if report is not None:
                self.failed_rank, summary, details = report
                logger.error("tensor-parallel rank %d failed:\n%s", self.failed_rank, details)
                self.error = RuntimeError(f"tensor-parallel rank {self.failed_rank} failed: {summary}")
            else:
                dead = [process.name for process in self.processes if not process.is_alive()]
                cause = f"{', '.join(dead)} ended" if dead else f"{type(error).__name__}: {error}"
                self.error = RuntimeError(f"the tensor-parallel ranks stopped working together: {cause}")
            self._stop_processes()
        return self.error

    def _report(self) -> tuple[int, str, str] | None:
        """A failed worker's report, waiting up to ``REPORT_SECONDS`` for one. A worker flushes
        its report before its process ends, so once one has ended a last look suffices."""
        deadline = time.monotonic() + REPORT_SECONDS
        while True:
            ended = any(not process.is_alive() for process in self.processes)
            try:
                return self.failures.get(timeout=0.0 if ended else REPORT_POLL_SECONDS)
            except queue.Empty:
                if ended or time.monotonic() > deadline:
                    return None

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def shutdown(self) -> None:
        """Tell the workers to stop and wait for them (killing any that hang), then leave the
        group."""
        if self.error is None and any(process.is_alive() for process in self.processes):
            try:
                self.channel.send(None)
            except RuntimeError as error:
                logger.warning("telling the tensor-parallel ranks to stop failed: %s", error)
        self._stop_processes()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _stop_processes(self) -> None:
        for process in self.processes:
            process.join(timeout=STOP_SECONDS if self.error is None else 0.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=STOP_SECONDS)

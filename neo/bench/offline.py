"""Offline throughput benchmark: every request submitted at once, run to completion.

The headline is end to end: output and total (prompt + output) tokens per second from the
first step to the last request's end. The steady window (``steady_throughput``) follows,
second, then how long the run's first and last 10% of output tokens took
(``head_and_tail_seconds``). A run cut short by ``duration`` says so in its headline."""

import dataclasses
import gc
import platform
import random
import time

import torch
from tqdm import tqdm

from neo.config import EngineConfig
from neo.engine import LLMEngine
from neo.kv.kv_cache import GIB
from neo.request import KVLocation
from neo.sampling_params import SamplingParams
from .workloads import parse_workload, random_prompt


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU ({torch.get_num_threads()} threads)"


def release_device_memory() -> None:
    """Return the memory of engines already closed and dropped to the device (before the next
    engine of a benchmark loads its weights)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def steady_throughput(log: list[tuple[float, int]], cut_short: bool) -> float:
    """Output tokens/s over the steady middle of an all-at-once run.

    log: (seconds since start, cumulative output tokens) after each iteration. A run that
    finished: between the moments 10% and 90% of its output tokens were made (leaving out the
    prefill-heavy start and the draining tail). A run cut short by a time limit (its queue never
    drained): from 20% of its duration to its end."""
    if not log:
        return 0.0
    if cut_short:
        start = next(entry for entry in log if entry[0] >= 0.2 * log[-1][0])
        end = log[-1]
    else:
        start, end = _entry_at_share(log, 0.1), _entry_at_share(log, 0.9)
    if end[0] <= start[0]:
        return 0.0
    return (end[1] - start[1]) / (end[0] - start[0])


def head_and_tail_seconds(log: list[tuple[float, int]], cut_short: bool) -> tuple[float, float] | None:
    """How long a finished run took to make its first 10% of output tokens (the prefill-heavy
    start) and its last 10% (the draining tail), from the same ``log`` as ``steady_throughput``;
    None for a run cut short or with no output. Where a policy loses end to end but not in the
    steady window, these say at which end."""
    if cut_short or not log or log[-1][1] == 0:
        return None
    return _entry_at_share(log, 0.1)[0], log[-1][0] - _entry_at_share(log, 0.9)[0]


def _entry_at_share(log: list[tuple[float, int]], share: float) -> tuple[float, int]:
    """The first entry of the run's ``log`` by which ``share`` of its output tokens were made."""
    return next(entry for entry in log if entry[1] >= share * log[-1][1])


class ProfiledWindow:
    """Starts the engine's torch profiler (``LLMEngine.start_profile``) before the step that runs
    iteration ``first`` of the window and stops it once ``last`` has run; nothing without a
    window."""

    def __init__(self, engine: LLMEngine, window: tuple[int, int] | None, iterations_before: int):
        self.engine = engine
        self.window = window
        self.iterations_before = iterations_before
        self.traces: list[str] = []

    def before_step(self) -> None:
        if self.window is None:
            return
        done = self.engine.metrics.iterations - self.iterations_before
        first, last = self.window
        if not self.engine.torch_profiler.running and not self.traces and done >= first - 1:
            self.engine.start_profile()
        elif self.engine.torch_profiler.running and done >= last:
            self.traces = self.engine.stop_profile()

    def end(self) -> None:
        """The run is over: stop a timeline still recording."""
        if self.window is not None and self.engine.torch_profiler.running:
            self.traces = self.engine.stop_profile()


def run_offline_benchmark(config: EngineConfig, workload: str, num_requests: int, seed: int = 0,
                          show_progress: bool = True, engine: LLMEngine | None = None,
                          duration: float | None = None, profile_iterations: tuple[int, int] | None = None) -> dict:
    """Run the workload; returns a dict of figures (and ``summary``, a printable text).

    ``duration`` (seconds) stops the run early, aborting what is left; the figures then cover
    what ran and the steady throughput its saturated part. The progress bar counts output
    tokens against the sum of the forced output lengths. ``profile_iterations`` ``(first,
    last)``: record a ``torch.profiler`` timeline of the run's iterations ``first`` to ``last``
    (counted from 1) on every rank (the engine's ``torch_profiler_dir``); the files are listed
    under ``torch_profiler_traces``."""
    if duration is not None and not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    if profile_iterations is not None and not config.torch_profiler_dir:
        raise ValueError("profile_iterations needs torch_profiler_dir (--torch-profiler-dir): where to write "
                         "the timelines")
    requests = parse_workload(workload, num_requests, seed=seed)
    owns_engine = engine is None
    engine = engine or LLMEngine(config)
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    limit = engine.max_model_len
    expected_output_tokens = 0
    for item in requests:
        prompt_len = min(item.prompt_len, limit - 1, config.max_num_batched_tokens)
        output_len = max(1, min(item.output_len, limit - prompt_len))
        expected_output_tokens += output_len
        engine.add_request(random_prompt(prompt_len, vocab, rng),
                           SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
    metrics_before = dataclasses.replace(engine.metrics)
    progress = tqdm(total=expected_output_tokens, desc=f"bench {config.policy}", unit="tok",
                    disable=not show_progress)
    peak_blocks = {KVLocation.GPU: 0, KVLocation.HOST: 0}
    log: list[tuple[float, int]] = []
    prompt_tokens = output_tokens = finished = 0
    prefilled: set[str] = set()
    start = time.perf_counter()
    cut_short = False
    profiled = ProfiledWindow(engine, profile_iterations, metrics_before.iterations)
    while engine.has_unfinished_requests():
        if duration is not None and time.perf_counter() - start > duration:
            cut_short = True
            engine.abort_all()
            break
        profiled.before_step()
        outputs = engine.step()
        for output in outputs:
            if output.request_id not in prefilled:  # its first token: its prompt is processed
                prefilled.add(output.request_id)
                prompt_tokens += len(output.prompt_token_ids)
            finished += output.finished
        output_tokens += len(outputs)
        progress.update(len(outputs))
        log.append((time.perf_counter() - start, output_tokens))
        for location in peak_blocks:
            pool = engine.block_manager.pools[location]
            peak_blocks[location] = max(peak_blocks[location], pool.num_used)
    elapsed = time.perf_counter() - start
    profiled.end()
    progress.close()
    metrics = {key: value - getattr(metrics_before, key)
               for key, value in dataclasses.asdict(engine.metrics).items()}
    block_gib = engine.layout.block_bytes / GIB
    result = {
        "model": config.model,
        "policy": config.policy,
        "device": device_name(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "workload": workload,
        "num_requests": len(requests),
        "elapsed_s": elapsed,
        "requests_per_s": finished / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "steady_output_tokens_per_s": steady_throughput(log, cut_short),
        "head_and_tail_s": head_and_tail_seconds(log, cut_short),
        "cut_short": cut_short,
        "torch_profiler_traces": profiled.traces,
        "finished_requests": finished,
        "gpu_kv_pool_gib": engine.layout.num_gpu_blocks * block_gib,
        "cpu_kv_pool_gib": engine.layout.num_host_blocks * block_gib,
        "gpu_kv_peak_gib": peak_blocks[KVLocation.GPU] * block_gib,
        "cpu_kv_peak_gib": peak_blocks[KVLocation.HOST] * block_gib,
        "metrics": metrics,
        "config": {key: value for key, value in dataclasses.asdict(config).items()},
    }
    headline = (f"{result['output_tokens_per_s']:.1f} output tokens/s, {result['total_tokens_per_s']:.1f} "
                f"total tokens/s, {result['requests_per_s']:.3f} requests/s")
    if cut_short:
        headline = (f"cut short at the time limit after {elapsed:.1f} s, {finished} of {len(requests)} "
                    f"requests finished: {headline} over what ran")
        window = "from 20% of the run to its end"
    else:
        headline = f"end to end, every request run to completion in {elapsed:.1f} s: {headline}"
        window = "between 10% and 90% of the output tokens"
    ends = ""
    if result["head_and_tail_s"] is not None:
        head, tail = result["head_and_tail_s"]
        ends = f"  first 10% of the output tokens in {head:.2f} s, last 10% in {tail:.2f} s\n"
    result["summary"] = (
        f"{config.model} [{config.policy}] on {result['device']}, {workload}, {len(requests)} requests\n"
        f"  {headline}\n"
        f"  steady window ({window}): {result['steady_output_tokens_per_s']:.1f} output tokens/s\n"
        f"{ends}"
        f"  KV pools: GPU {result['gpu_kv_pool_gib']:.2f} GiB (peak used {result['gpu_kv_peak_gib']:.2f}), "
        f"host {result['cpu_kv_pool_gib']:.2f} GiB (peak used {result['cpu_kv_peak_gib']:.2f})\n"
        f"  iterations {metrics['iterations']}, two-sub-batch {metrics['two_batch_iterations']}, "
        f"host batches {metrics['host_batches']}, "
        f"GPU decode tokens {metrics['gpu_decode_tokens']}, host decode tokens {metrics['host_decode_tokens']}, "
        f"swapped out/in {metrics['blocks_swapped_out']}/{metrics['blocks_swapped_in']} blocks")
    if profiled.traces:
        result["summary"] += f"\n  torch.profiler timelines: {', '.join(profiled.traces)}"
    if owns_engine:
        engine.close()
    return result

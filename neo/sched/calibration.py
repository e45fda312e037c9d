"""Corrections the scheduler learns from what the engine measures while it serves.

- ``TimeCalibration``: a factor on an estimated time (host attention, the rest of a host batch,
  an iteration of GPU decodes alone).
- ``HostBatchInterference``: how much slower the GPU's iterations run beside a host batch.

How far the measured times stray from the profile on the GPU machine is in RESULTS.md.
"""

import statistics
from collections import deque


# Before its first measurement the host-attention factor is below 1 (optimistic), so that a
# scheduler that would never offload on the profile alone tries host decodes where they would pay
# at that speed, measures them, and then follows the measurement. A lower prior explores more, and
# too low a prior admits requests to the host pool that then go back to the GPU undecoded.
HOST_TIME_PRIOR = 0.67


class TimeCalibration:
    """A factor on an estimated time, learned from the times the engine measures: the measured
    over the estimated seconds of the last ``window`` samples, within ``bounds``; ``prior``
    until ``min_samples`` were taken. ``statistic`` "sum": the ratio of the sums, so long samples
    weigh more; "median": the median of the samples' ratios, which one stray sample does not
    move (for many short samples, some of which a stall of the engine's own lengthens).
    ``Estimates`` keeps three:

    - **host attention**: the profile times host attention in isolated iterations; in the
      engine's pipelined ones the same work often runs faster (the CPU's threads stay busy from
      layer to layer there), and the ratio moves with the load. Prior ``HOST_TIME_PRIOR``, sums.
    - **the rest of a host batch** (async host pipeline): its seconds less its host attention,
      i.e. its GPU stages and the hand-offs between them and the host. On a stream of its own
      its stages share the GPU with the iterations' kernels, so the rest takes longer than its
      stages' profiled times add up to, by a ratio that depends on what the GPU runs beside it
      (``HostBatches`` takes no sample from a batch that ran beside a prefill). Prior 1, sums.
    - **an iteration of GPU decodes alone** (async host pipeline): the profile times a decode
      graph replayed back to back; in serving each iteration also waits for the engine's own
      step (planning, inputs, reading the tokens) where that does not hide under the device's
      work, and the device may run slower than it did while profiling. Sampled from the
      decode-only iterations that ran beside no host batch and moved no blocks
      (``for_gpu_decodes``): medians, from 8 samples on, as an iteration held up by anything
      outside it (a stall of the engine's own thread) can take many times its estimate and,
      while host batches run back to back, no iteration alone follows to outweigh it.
    """

    def __init__(self, prior: float = 1.0, window: int = 16, bounds: tuple[float, float] = (0.25, 4.0),
                 statistic: str = "sum", min_samples: int = 1):
        if not bounds[0] <= prior <= bounds[1]:
            raise ValueError(f"prior {prior} is outside the bounds {bounds}")
        if statistic not in ("sum", "median"):
            raise ValueError(f"statistic must be 'sum' or 'median', got {statistic!r}")
        if not 1 <= min_samples <= window:
            raise ValueError(f"min_samples {min_samples} is outside [1, window={window}]")
        self.bounds = bounds
        self.statistic = statistic
        self.min_samples = min_samples
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)  # (estimated, measured)
        # Read for every estimate the scheduler makes: kept up to date in ``observe``.
        self.scale = prior

    @classmethod
    def for_gpu_decodes(cls) -> "TimeCalibration":
        """The calibration of GPU decode iterations alone: the median of the last 64 samples,
        from 8 on, prior 1."""
        return cls(window=64, statistic="median", min_samples=8)

    @property
    def samples(self) -> list[tuple[float, float]]:
        """The (estimated, measured) seconds of the samples in the window, oldest first."""
        return list(self._samples)

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def observe(self, estimated_seconds: float, measured_seconds: float) -> None:
        """One sample: the uncorrected estimate and the measured time (ignored unless both are
        positive)."""
        if estimated_seconds <= 0 or measured_seconds <= 0:
            return
        self._samples.append((estimated_seconds, measured_seconds))
        if len(self._samples) < self.min_samples:
            return
        if self.statistic == "median":
            ratio = statistics.median(measured / estimated for estimated, measured in self._samples)
        else:
            ratio = sum(sample[1] for sample in self._samples) / sum(sample[0] for sample in self._samples)
        self.scale = min(max(ratio, self.bounds[0]), self.bounds[1])


class HostBatchInterference:
    """How much slower the GPU's iterations run while a host batch is in flight, measured.

    A host batch (async host pipeline) costs the GPU's iterations more than its own stages'
    GPU time: its kernels share the SMs, and its host attention's threads share the host with
    the thread that launches the iterations. Each decode iteration gives the ratio of its
    measured to its estimated time alone; ``factor`` is the median ratio of the last ``window``
    iterations beside a batch over that of those alone (while fewer than ``min_samples`` ran
    alone, over the factor ``observe`` was given for them: the calibration of iterations alone,
    1 for the estimate itself), at least 1. None until ``min_samples`` iterations ran beside a
    batch.
    """

    def __init__(self, window: int = 64, min_samples: int = 8):
        self.min_samples = min_samples
        self._beside: deque[float] = deque(maxlen=window)
        self._alone: deque[float] = deque(maxlen=window)
        self.factor: float | None = None

    @property
    def samples(self) -> tuple[list[float], list[float]]:
        """The measured over estimated ratios in the window: (beside a batch, alone), oldest first."""
        return list(self._beside), list(self._alone)

    def observe(self, estimated_alone: float, measured: float, beside_host_batch: bool,
                alone_scale: float = 1.0) -> None:
        """One decode iteration's estimate alone and measured seconds (ignored unless both
        are positive); ``alone_scale``: measured over estimated seconds alone, assumed while
        fewer than ``min_samples`` iterations ran alone."""
        if estimated_alone <= 0 or measured <= 0:
            return
        (self._beside if beside_host_batch else self._alone).append(measured / estimated_alone)
        if len(self._beside) >= self.min_samples:
            alone = statistics.median(self._alone) if len(self._alone) >= self.min_samples else alone_scale
            self.factor = max(1.0, statistics.median(self._beside) / alone)

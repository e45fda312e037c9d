"""Sampled token ids on their way to the host, and on the device for the next iteration's input.

Under async scheduling (``EngineConfig.async_scheduling``) the engine launches iteration k+1
before it reads the tokens of iteration k. The tokens of k are copied to page-locked host memory
on the compute stream behind k's sampling, an event marks the copy's end, and the host waits for
that event only after k+1 is queued (``SampledTokens.tolist``). Meanwhile iteration k+1 takes the
input ids of k's requests from k's sampled tensor on the device (``PreviousTokens``), so those
ids never pass through the host before k+1 launches.
"""

from dataclasses import dataclass

import torch

from neo.request import Request

BUFFERS_IN_FLIGHT = 2  # the copy of k+1 is queued while the host still reads that of k


class HostTokenBuffers:
    """A ring of page-locked int64 buffers the sampled tokens are copied into (on CUDA).
    Allocating page-locked memory waits for the whole device (a host batch in flight included),
    so the buffers are made when the engine is built, ``rows`` tokens each, and only a batch
    that outgrows them grows one, to the next power of two."""

    def __init__(self, device: torch.device, rows: int):
        """``rows``: the most tokens one iteration samples (the engine's ``max_num_seqs``)."""
        self._buffers: list[torch.Tensor | None] = [
            torch.empty(rows, dtype=torch.int64, pin_memory=True) if device.type == "cuda" else None
            for _ in range(BUFFERS_IN_FLIGHT)]
        self._next = 0

    def start_copy(self, sampled: torch.Tensor) -> "SampledTokens":
        """Queue the copy of ``sampled`` int64 ``[N]`` (on the compute device) to the host behind
        the work that produces it; on the CPU the tensor itself is the host copy."""
        if sampled.device.type != "cuda":
            return SampledTokens(sampled, sampled, None)
        count = sampled.numel()
        index, self._next = self._next, (self._next + 1) % BUFFERS_IN_FLIGHT
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < count:
            capacity = 1 << max(count - 1, 0).bit_length()
            buffer = self._buffers[index] = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        host = buffer[:count]
        host.copy_(sampled, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(sampled.device))
        return SampledTokens(sampled, host, event)


@dataclass
class SampledTokens:
    """One iteration's sampled token ids: ``on_device`` int64 ``[N]`` on the compute device and
    ``on_host`` int64 ``[N]``, valid once ``copied`` (None: already valid) has completed."""

    on_device: torch.Tensor
    on_host: torch.Tensor
    copied: torch.cuda.Event | None

    def ready(self) -> bool:
        """Whether the copy has completed (``tolist`` would not wait)."""
        return self.copied is None or self.copied.query()

    def tolist(self) -> list[int]:
        """The token ids, waiting for the copy (not for work queued after it)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.on_host.tolist()


@dataclass
class PreviousTokens:
    """The samples of the iteration launched before the one being built: ``tokens`` int64 ``[N]``
    on the compute device, ``requests`` in its row order. A request whose newest token is
    unresolved takes it from here. Rows are found by request id, so that a tensor-parallel rank
    that follows, whose requests are new objects in every plan it receives, finds them too."""

    tokens: torch.Tensor
    requests: list[Request]

    def __post_init__(self):
        self._rows = {request.request_id: row for row, request in enumerate(self.requests)}

    def row_of(self, request: Request) -> int:
        """The row of ``request``'s token; raises if the iteration did not sample one for it."""
        row = self._rows.get(request.request_id)
        if row is None:
            raise RuntimeError(f"{request} waits for a token that the previous iteration did not sample")
        return row

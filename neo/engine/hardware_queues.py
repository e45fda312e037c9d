"""How many hardware work queues the CUDA driver gives this process's streams.

The driver feeds a GPU through a fixed number of hardware work queues per context
(``CUDA_DEVICE_MAX_CONNECTIONS``, 8 unless set, at most 32), read once, when the context is
created. Streams beyond that number share queues, and a queue runs its work in order: work of one
stream that waits holds back the work of every stream behind it in the same queue, though the
streams are independent (a false dependency).

A host batch of the async host pipeline is exactly such waiting work. Its graph parts stop at each
layer in a host node until the host has attended (``neo.runner.host_batches``), and a replayed
graph spreads its branches over several of the driver's streams. With 8 queues those branches
share queues with the compute stream, so the GPU's own iterations stall behind host attention and
run at the host batch's pace instead of beside it. With 32 they mostly get queues of their own.

``request_hardware_queues`` asks for 32 before the engine creates its CUDA context; the ranks of
a tensor-parallel engine are spawned after it and inherit the variable. A value the user set is
kept; a context created before the engine was built keeps the queues it has.
"""

import logging
import os

import torch

logger = logging.getLogger(__name__)

CONNECTIONS_VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"
MOST_CONNECTIONS = 32  # the most the driver grants


def request_hardware_queues() -> None:
    """Ask the CUDA driver for the most hardware work queues for this process's context (and the
    processes it spawns), unless ``CUDA_DEVICE_MAX_CONNECTIONS`` is already set. Logs a warning
    where the setting cannot take effect or asks for fewer."""
    chosen = os.environ.get(CONNECTIONS_VARIABLE)
    if chosen is None:
        os.environ[CONNECTIONS_VARIABLE] = str(MOST_CONNECTIONS)
        if _context_exists():
            logger.warning("CUDA was initialized before the engine was built, so this process keeps the "
                           "driver's default of 8 hardware work queues: host batches may stall the GPU's "
                           "iterations. Set %s=%d before the first CUDA call (the engine's other ranks get "
                           "it).", CONNECTIONS_VARIABLE, MOST_CONNECTIONS)
        return
    if not chosen.strip().isdigit() or int(chosen) < MOST_CONNECTIONS:
        logger.warning("%s=%s: with fewer than %d hardware work queues, host batches may stall the GPU's "
                       "iterations", CONNECTIONS_VARIABLE, chosen, MOST_CONNECTIONS)


def _context_exists() -> bool:
    """Whether this process already has a CUDA context on some GPU (asked of the driver without
    creating one)."""
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is None or not torch.cuda.is_available():
        return False
    return any(has_context(index) for index in range(torch.cuda.device_count()))

"""Host-decode placements: the scheduler's pluggable part. A placement decides, each iteration,
which host requests decode and where, and estimates the plan; the scheduler core
(``neo.sched.scheduler``) does everything else (slots, evictions, returns, admissions).

One file per placement:

- ``gpu_only.py``: ``GpuOnly``, no host decodes (the gpu-only policy);
- ``two_sub_batches.py``: ``TwoSubBatches``, host decodes in the lockstep pipeline's two
  sub-batches, as many as raise the estimated tokens per second;
- ``host_batches.py``: ``HostBatches``, host decodes as host batches of the async pipeline,
  launched while their tokens outweigh what they cost the GPU's iterations;
- ``hidden_host.py``: ``HiddenHost``, the example of a new placement: two sub-batches, host
  decodes admitted only while their attention stays hidden under the other sub-batch's GPU
  work (the NEO paper's rule);
- ``pipeline_choice.py``: ``PipelineChoice``, per iteration the plan of ``TwoSubBatches`` or
  of ``HostBatches``, whichever makes more estimated tokens per second (the ``auto`` host
  pipeline).

A new placement is one file with a ``Placement`` subclass that implements ``place`` (and, to
steer admissions to the host pool, ``economics``), registered in ``PLACEMENTS`` under the host
pipeline it plans for; ``EngineConfig.placement`` selects it.
"""

from .base import Placement
from .gpu_only import GpuOnly
from .hidden_host import HiddenHost
from .host_batches import HostBatches
from .pipeline_choice import PipelineChoice
from .two_sub_batches import TwoSubBatches

# name -> (class, the host pipeline its plans are for)
PLACEMENTS: dict[str, tuple[type[Placement], str]] = {
    "two-sub-batches": (TwoSubBatches, "lockstep"),
    "hidden-host": (HiddenHost, "lockstep"),
    "host-batches": (HostBatches, "async"),
    "pipeline-choice": (PipelineChoice, "auto"),
}
DEFAULT_PLACEMENTS = {"lockstep": "two-sub-batches", "async": "host-batches", "auto": "pipeline-choice"}


def make_placement(policy: str, host_pipeline: str, name: str | None = None) -> Placement:
    """The placement of a policy: ``GpuOnly`` for gpu-only; otherwise ``name`` (None: the host
    pipeline's default), for neo or, with ``full_offload``, full-offload."""
    if policy == "gpu-only":
        return GpuOnly()
    name = name or DEFAULT_PLACEMENTS[host_pipeline]
    if name not in PLACEMENTS:
        raise ValueError(f"unknown placement {name!r}; choose one of {', '.join(PLACEMENTS)}")
    cls, pipeline = PLACEMENTS[name]
    if pipeline != host_pipeline:
        raise ValueError(f"placement {name!r} plans for the {pipeline} host pipeline, not "
                         f"{host_pipeline!r}: set host_pipeline={pipeline!r}")
    return cls(full_offload=policy == "full-offload")


__all__ = ["DEFAULT_PLACEMENTS", "PLACEMENTS", "GpuOnly", "HiddenHost", "HostBatches", "PipelineChoice", "Placement",
           "TwoSubBatches", "make_placement"]

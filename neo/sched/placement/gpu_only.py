"""``GpuOnly``: no host decodes (the gpu-only policy). Every running request decodes on the
GPU; the host pool holds the requests preempted when the GPU pool runs out, which the scheduler
core brings back, oldest first, before it admits new ones."""

from neo.request import Request

from ..scheduler_output import SchedulerOutput, SubBatch
from ..stage_order import SEQUENTIAL
from .base import Placement


class GpuOnly(Placement):
    decodes_on_host = False

    def place(self, scheduler, batch0: SubBatch, host_requests: list[Request], plan: SchedulerOutput) -> None:
        if batch0:
            plan.sub_batches.append(batch0)
            plan.stage_order = SEQUENTIAL

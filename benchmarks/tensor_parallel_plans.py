"""Time the plan broadcast of a tensor-parallel engine: rank 0 sending one iteration's plan to
rank 1 over the plan channel (``neo.runner.rank_plan.PlanChannel``, gloo on loopback), for
steady decodes of 32 requests x 8 blocks, 256 x 64 and 256 x 512.

Each iteration appends a token to every request and a block to those whose last block filled
(block size 16), then rank 0 times ``PlanChannel.send_plan`` (building the planned requests,
pickling, broadcasting) while rank 1 receives and restores the tables. Two ways are timed: every
table sent whole in every plan (the driver's record of sent tables cleared before each send), and
incremental (each table whole once, then only its appended blocks). Prints the median
milliseconds per plan over ``ITERATIONS`` plans (after ``WARMUP``) as a table.

    python benchmarks/tensor_parallel_plans.py
"""

import socket
import statistics
import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from neo.request import KVLocation, Request, RequestStatus
from neo.runner.rank_plan import PlanChannel, SentTables
from neo.sampling_params import SamplingParams
from neo.sched.scheduler_output import SchedulerOutput, SubBatch

SHAPES = [(32, 8), (256, 64), (256, 512)]  # (decodes, blocks per request)
MODES = ["whole", "incremental"]
ITERATIONS = 300
WARMUP = 20
BLOCK_SIZE = 16
TIMEOUT = timedelta(seconds=120)


def decoding_requests(count: int, blocks: int) -> list[Request]:
    """``count`` running requests, each with ``blocks`` full blocks but one free slot."""
    requests = []
    for index in range(count):
        request = Request(f"request-{index}", [1] * (blocks * BLOCK_SIZE - 1), SamplingParams(max_tokens=1 << 20))
        request.status = RequestStatus.RUNNING
        request.location = KVLocation.GPU
        request.block_table = list(range(index * blocks, (index + 1) * blocks))
        requests.append(request)
    return requests


def rank_main(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=TIMEOUT)
    channel = PlanChannel(dist.new_group(backend="gloo", timeout=TIMEOUT), rank)
    for count, blocks in SHAPES:
        for mode in MODES:
            if rank == 0:
                requests = decoding_requests(count, blocks)
                plan = SchedulerOutput(sub_batches=[SubBatch(gpu_decodes=requests)])
                next_block = count * blocks
                seconds = []
                for _ in range(WARMUP + ITERATIONS):
                    for request in requests:
                        request.append_token(1)
                        if request.num_tokens > len(request.block_table) * BLOCK_SIZE:
                            request.block_table += [next_block]
                            next_block += 1
                    if mode == "whole":
                        channel.sent = SentTables()
                    began = time.perf_counter()
                    channel.send_plan(plan)
                    seconds.append(time.perf_counter() - began)
                for request in requests:  # the next shape's first plan drops their tables
                    request.status = RequestStatus.FINISHED
                results.put((count, blocks, mode, statistics.median(seconds[WARMUP:]) * 1e3))
            else:
                for _ in range(WARMUP + ITERATIONS):
                    channel.receive()
    dist.destroy_process_group()


def main() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=rank_main, args=(rank, port, results)) for rank in range(2)]
    for process in processes:
        process.start()
    medians = {}
    for _ in range(len(SHAPES) * len(MODES)):
        count, blocks, mode, milliseconds = results.get(timeout=TIMEOUT.total_seconds())
        medians[count, blocks, mode] = milliseconds
    for process in processes:
        process.join(timeout=TIMEOUT.total_seconds())
    print(f"{'decodes':>8} {'blocks':>7} {'whole ms':>9} {'incremental ms':>15}")
    for count, blocks in SHAPES:
        print(f"{count:>8} {blocks:>7} {medians[count, blocks, 'whole']:>9.3f} "
              f"{medians[count, blocks, 'incremental']:>15.3f}")


if __name__ == "__main__":
    main()

"""Tensor parallelism on two GPUs (NCCL): greedy tokens of two ranks equal one synchronous
rank's on the same GPU kind, eagerly, with the CUDA graphs captured across ranks, and with those
graphs and async scheduling (the defaults; the driver's samples broadcast to the other rank),
under gpu-only, under neo with host batches (whose collectives go over the side group, their
parts paced by the driver; with graphs, replayed from host-batch graphs) and under neo's
lockstep pipeline (with graphs, decode-only iterations with host decodes replay pipeline
graphs). Each engine's close must end (graphs that hold collectives are freed before the ranks
leave their group). Skipped on machines with fewer than two GPUs.
"""

import functools

import pytest
import torch

from engine_reference import BLOCK_BYTES, PROMPTS, gib_for_blocks
from neo import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason=f"needs two GPUs, this machine has {torch.cuda.device_count()}")


POLICIES = {"gpu-only": dict(policy="gpu-only"), "neo-async": dict(policy="neo", host_pipeline="async"),
            "neo-lockstep": dict(policy="neo", host_pipeline="lockstep")}


def generate(size: int, policy: str, graphs: bool, ahead: bool = False) -> tuple[list[list[int]], dict]:
    """Greedy tokens of PROMPTS from a float32 neo-tiny engine of ``size`` ranks whose GPU pool
    holds 12 blocks per rank (so neo puts requests in the host pool), and its counters with
    ``launched_ahead``, the iterations planned before the tokens of the one before were read
    (``ahead``: async scheduling) and ``pipeline_captures``, the lockstep pipeline's graphs
    captured."""
    block_bytes = BLOCK_BYTES // size  # a rank's block holds 1 / size of the KV heads
    llm = LLM("neo-tiny", device="cuda", dtype="float32", **POLICIES[policy], tensor_parallel_size=size,
              perf_model="zero", max_num_seqs=8, gpu_kv_cache_gib=gib_for_blocks(12, block_bytes),
              cpu_kv_cache_gib=gib_for_blocks(256, block_bytes), use_cuda_graphs=graphs,
              async_scheduling=ahead)
    runner, launched_ahead = llm.engine.runner, []
    launch = runner.launch

    def counting_launch(plan, on_launched=None, previous=None, read_later=False):
        launched_ahead.append(read_later)
        return launch(plan, on_launched, previous, read_later)

    runner.launch = counting_launch
    try:
        tokens = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, PARAMS)]
        captures = len(runner.pipeline_graphs.captures) if runner.pipeline_graphs is not None else 0
        return tokens, llm.get_metrics() | {"launched_ahead": sum(launched_ahead), "pipeline_captures": captures}
    finally:
        llm.close()


@functools.cache
def one_rank_tokens(policy: str) -> list[list[int]]:
    return generate(1, policy, graphs=True)[0]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("graphs, ahead", [(False, False), (True, False), (True, True)],
                         ids=["eager", "graphs", "graphs-ahead"])
def test_two_gpus_give_the_greedy_tokens_of_one(policy, graphs, ahead):
    expected = one_rank_tokens(policy)
    tokens, metrics = generate(2, policy, graphs, ahead)
    assert tokens == expected
    assert (metrics["graph_iterations"] > 0) == graphs
    assert (metrics["launched_ahead"] > 0) == ahead
    if policy == "neo-async":
        assert metrics["host_decode_tokens"] > 0 and metrics["host_batches"] > 0
        assert (metrics["graph_host_batches"] > 0) == graphs
    if policy == "neo-lockstep":
        assert metrics["host_decode_tokens"] > 0 and metrics["two_batch_iterations"] > 0
        assert (metrics["pipeline_captures"] > 0) == graphs

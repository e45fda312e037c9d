"""The engine on 2 tensor-parallel ranks (``neo.engine.rank_workers``), on the CPU with gloo.

Greedy tokens of ``LLM(..., tensor_parallel_size=2)`` must equal the one-rank engine's for
prompts of different lengths with a compute pool so small that requests are preempted
(gpu-only) or decode on the host (neo under both host pipelines; full-offload); both engines'
pools hold the same number of blocks, so they run the same schedule. An engine that profiles
its stage times does so on both ranks in lockstep, under a key that names the rank count. A worker rank
that fails (interrupted: it reports a ``KeyboardInterrupt``; killed: it reports nothing) must
surface as an error in the caller with the other ranks stopped; closing the engine, or the
driver's process ending without closing it, must leave no worker process behind.
"""

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import neo.engine.build
from engine_reference import BLOCK_BYTES, PROMPTS, gib_for_blocks
from neo import LLM, SamplingParams
from neo.kv.kv_cache import GIB
from neo.sched.scheduler_output import SubBatch

NEW_TOKENS = 24
GPU_BLOCKS = 12
HOST_BLOCKS = 256
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SUBPROCESS_TIMEOUT_SECONDS = 120


def engine_options(size: int, policy: str = "gpu-only", gpu_blocks: int = GPU_BLOCKS, **options) -> dict:
    """Settings of a neo-tiny engine on the CPU whose pools hold ``gpu_blocks`` and
    ``HOST_BLOCKS`` blocks on every rank (a rank's block holds 1 / size of the KV heads)."""
    block_bytes = BLOCK_BYTES // size
    return dict(device="cpu", policy=policy, tensor_parallel_size=size, perf_model="zero", max_num_seqs=8,
                gpu_kv_cache_gib=gib_for_blocks(gpu_blocks, block_bytes),
                cpu_kv_cache_gib=gib_for_blocks(HOST_BLOCKS, block_bytes), **options)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, PARAMS)]


def record_plans(llm: LLM) -> list[tuple]:
    """The "execute" and "launch" messages the driver sends from now on, each as
    ``(kind, planned requests)``: the requests in the order the message carries them, with
    their block tables as sent (whole, or the blocks from ``table_start`` on); and the "parts"
    messages as sent, ``("parts", count)``."""
    channel = llm.engine.runner.plan_channel
    send = channel.send
    recorded = []

    def record_and_send(message) -> None:
        if message is not None and message[0] in ("execute", "launch"):
            kind, payload = message[0], message[1]
            batches = [payload] if kind == "launch" else payload.sub_batches + [payload.host_batch or SubBatch()]
            recorded.append((kind, [request for batch in batches for request in batch.requests]))
        elif message is not None and message[0] == "parts":
            recorded.append(message)
        send(message)

    channel.send = record_and_send
    return recorded


def resent_whole(recorded: list[tuple]) -> set[str]:
    """The ids of the requests whose table a message sent whole after an earlier one had
    carried the request."""
    carried, resent = set(), set()
    for kind, requests in recorded:
        if kind == "parts":
            continue
        for request in requests:
            if request.table_start == 0 and request.request_id in carried:
                resent.add(request.request_id)
            carried.add(request.request_id)
    return resent


def process_exists(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie, ended but not reaped, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as status:
            return status.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def one_rank_tokens():
    llm = LLM("neo-tiny", **engine_options(1))
    try:
        tokens = greedy_tokens(llm)
        assert llm.engine.metrics.preemptions > 0, "the pool is meant to be small enough to preempt"
    finally:
        llm.close()
    return tokens


OFFLOADING = [("neo", "lockstep"), ("neo", "async"), ("full-offload", "async")]


@pytest.mark.parametrize("policy, host_pipeline", OFFLOADING, ids=[f"{policy}-{pipeline}" for policy, pipeline in OFFLOADING])
def test_two_ranks_give_the_greedy_tokens_of_one_when_offloading(one_rank_tokens, policy, host_pipeline):
    llm = LLM("neo-tiny", **engine_options(2, policy, host_pipeline=host_pipeline))
    workers = [process.pid for process in llm.engine.rank_workers.processes]
    recorded = record_plans(llm)
    try:
        assert greedy_tokens(llm) == one_rank_tokens
        assert llm.engine.metrics.host_decode_tokens > 0
        # Each host batch: "launch", then "parts" counts rising to all of its layer parts.
        launches = [index for index, (kind, _) in enumerate(recorded) if kind == "launch"]
        assert bool(launches) == (host_pipeline == "async")
        num_parts = len(llm.engine.runner.host_batches.parts) if launches else 0
        for start, end in zip(launches, launches[1:] + [len(recorded)]):
            counts = [count for kind, count in recorded[start:end] if kind == "parts"]
            assert counts and counts == sorted(counts) and counts[-1] == num_parts
        # A request swapped out (or preempted) has a new table: it is sent whole again.
        moved = llm.engine.metrics.blocks_swapped_out + llm.engine.metrics.preemptions
        assert bool(resent_whole(recorded)) == (moved > 0)
        assert llm.engine.worker.num_threads == max(1, len(os.sched_getaffinity(0)) // 2 - 1)
    finally:
        llm.close()
    assert not [pid for pid in workers if process_exists(pid)]


def test_a_steady_decode_sends_each_table_whole_once_then_appended_blocks_only():
    llm = LLM("neo-tiny", **engine_options(2, gpu_blocks=HOST_BLOCKS))
    recorded = record_plans(llm)
    try:
        outputs = llm.generate(PROMPTS, PARAMS)
        assert [len(output.outputs[0].token_ids) for output in outputs] == [NEW_TOKENS] * len(PROMPTS)
        assert llm.engine.metrics.preemptions == 0
    finally:
        llm.close()
    carried = set()
    for kind, requests in recorded:
        assert kind == "execute"
        for request in requests:
            if request.request_id not in carried:
                assert request.table_start == 0 and request.block_table, request
                carried.add(request.request_id)
            else:  # a decode: at most the one block its new token may have needed
                assert request.table_start > 0 and len(request.block_table) <= 1, request
    assert len(carried) == len(PROMPTS) and len(recorded) >= NEW_TOKENS


def test_two_ranks_profile_in_lockstep_under_their_own_key(tmp_path, monkeypatch):
    monkeypatch.setenv("NEO_CACHE_DIR", str(tmp_path))
    small = dict(gpu_kv_cache_gib=0.005, cpu_kv_cache_gib=0.01, max_num_batched_tokens=64, max_num_seqs=8,
                 max_model_len=256)
    llm = LLM("neo-tiny", device="cpu", policy="neo", perf_model="auto", tensor_parallel_size=2, **small)
    try:
        key = llm.engine.scheduler.estimates.perf_model.table.key
        assert key["tensor_parallel_size"] == 2
        assert len(llm.generate(PROMPTS[:2], PARAMS)) == 2
    finally:
        llm.close()
    assert len(list(tmp_path.rglob("*.json"))) == 1  # the driver alone saves the table


def test_two_ranks_give_the_greedy_tokens_of_one_under_gpu_only(one_rank_tokens):
    llm = LLM("neo-tiny", **engine_options(2))
    workers = [process.pid for process in llm.engine.rank_workers.processes]
    recorded = record_plans(llm)
    try:
        assert llm.engine.layout.num_gpu_blocks == GPU_BLOCKS
        assert greedy_tokens(llm) == one_rank_tokens
        assert llm.engine.metrics.preemptions > 0
        assert resent_whole(recorded), "a preempted request is prefilled again into a new table"
    finally:
        llm.close()
    assert not [pid for pid in workers if process_exists(pid)]


@pytest.fixture
def interruptible_ranks():
    """SIGINT handled in this process while the test starts its ranks, so that they start with
    its default (a KeyboardInterrupt) even where the test runner ignores it, as a background job
    does: a spawned process inherits an ignored signal, not a handler."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("signal_number, reported", [
    (signal.SIGINT, "tensor-parallel rank 1 failed: KeyboardInterrupt"),
    (signal.SIGKILL, "the tensor-parallel ranks stopped working together: neo-rank-1 ended")],
    ids=["interrupted", "killed"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["synchronous", "ahead"])
def test_a_failed_rank_surfaces_in_the_caller(signal_number, reported, async_scheduling, interruptible_ranks):
    llm = LLM("neo-tiny", **engine_options(2, async_scheduling=async_scheduling))
    worker = llm.engine.rank_workers.processes[0]
    try:
        assert len(greedy_tokens(llm)) == len(PROMPTS)
        os.kill(worker.pid, signal_number)
        with pytest.raises(RuntimeError, match=reported):
            greedy_tokens(llm)
        with pytest.raises(RuntimeError, match=reported):  # every later call too
            llm.generate(PROMPTS[:1], PARAMS)
        assert not process_exists(worker.pid)
    finally:
        llm.close()


def test_a_failed_host_batch_stops_every_rank_at_once():
    """A host batch that fails on the driver (here: its result, once collected) ends the
    engine's ranks at once rather than at the next collective's timeout: the ranks may no longer
    be in step."""
    llm = LLM("neo-tiny", **engine_options(2, policy="neo", host_pipeline="async"))
    worker = llm.engine.rank_workers.processes[0]
    runner = llm.engine.runner
    collect = runner.collect_host_batch

    def failing_collect(wait_seconds):
        if collect(wait_seconds) is not None:
            raise RuntimeError("host decode attention failed: a fault")
        return None

    runner.collect_host_batch = failing_collect
    try:
        reported = "the tensor-parallel ranks stopped working together: RuntimeError: host decode attention failed"
        with pytest.raises(RuntimeError, match=reported):
            greedy_tokens(llm)
        assert not process_exists(worker.pid)
        with pytest.raises(RuntimeError, match=reported):  # every later call too
            llm.generate(PROMPTS[:1], PARAMS)
    finally:
        llm.close()


@pytest.mark.parametrize("host_pipeline", ["lockstep", "async"])
def test_host_work_that_failed_on_another_rank_yields_no_token(host_pipeline):
    """A host function that fails on a CUDA rank records its failure while the rank's collectives
    run on; every rank then max-reduces its failure flag after the work, and the driver discards
    its tokens when the flag is set. Here the driver's own flag is set while its host work
    succeeds, as the reduction would be after another rank's failure: the driver must raise
    rather than return the tokens, and every rank stops."""
    llm = LLM("neo-tiny", **engine_options(2, policy="neo", host_pipeline=host_pipeline))
    worker = llm.engine.rank_workers.processes[0]
    runner = llm.engine.runner
    executor = runner.host_batches.executor if host_pipeline == "async" else runner.executor
    executor.host_failure_flag = lambda: torch.ones(1, dtype=torch.uint8)
    try:
        reported = ("the tensor-parallel ranks stopped working together: RuntimeError: "
                    "host decode attention failed on another tensor-parallel rank")
        with pytest.raises(RuntimeError, match=reported):
            greedy_tokens(llm)
        assert llm.engine.metrics.host_decode_tokens == 0  # no host decode's token was taken
        assert not process_exists(worker.pid)
    finally:
        llm.close()


def test_a_driver_that_exits_without_closing_leaves_no_worker(tmp_path):
    script = textwrap.dedent(f"""
        from neo import LLM, SamplingParams

        if __name__ == "__main__":
            llm = LLM("neo-tiny", **{engine_options(2)!r})
            llm.generate([[257, 72, 101]], SamplingParams(max_tokens=4, temperature=0.0))
            print(*[process.pid for process in llm.engine.rank_workers.processes])
        """)
    path = tmp_path / "driver.py"
    path.write_text(script)
    finished = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                              timeout=SUBPROCESS_TIMEOUT_SECONDS, cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr
    workers = [int(pid) for pid in finished.stdout.split()]
    assert len(workers) == 1
    assert not [pid for pid in workers if process_exists(pid)]


def test_sizes_that_do_not_divide_the_model_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide num_key_value_heads 2 of "
                                         "neo-tiny .*; sizes that work: 1, 2$"):
        LLM("neo-tiny", **engine_options(4))
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        LLM("neo-tiny", device="cpu", tensor_parallel_size=0)


def test_host_pools_beyond_the_hosts_memory_over_all_ranks_are_refused_before_any_process_starts(monkeypatch):
    """Each rank's host pool fits the memory available, two do not: refused, naming both."""
    monkeypatch.setattr(neo.engine.build, "available_host_bytes", lambda: int(1.5 * GIB))
    with pytest.raises(ValueError, match=r"host KV pool \(cpu_kv_cache_gib, 2 ranks\) 2\.00 GiB"):
        LLM("neo-tiny", device="cpu", tensor_parallel_size=2, gpu_kv_cache_gib=0.001, cpu_kv_cache_gib=1.0,
            dtype="float32")
    assert not multiprocessing.active_children()

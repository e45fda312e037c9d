"""``AsyncEngine`` on the CPU with neo-tiny, without HTTP: streaming, aborts, rejected requests,
failed iterations, an idle engine thread that sleeps, and shutdown.

Every test runs its event loop under a timeout, so a lost wake-up fails instead of hanging.
"""

import asyncio
import random
import threading
import time

import pytest

from neo import LLM, EngineConfig, LLMEngine, SamplingParams
from neo.sched.scheduler_output import SchedulerOutput
from neo.server.async_engine import AsyncEngine, EngineStopped, RequestFailed

TIMEOUT_SECONDS = 60
ENGINE_OPTIONS = dict(model="neo-tiny", device="cpu", gpu_kv_cache_gib=0.01, cpu_kv_cache_gib=0.01,
                      max_num_seqs=16)
BLOCK_BYTES = 2 * 4 * 2 * 16 * 32 * 4  # neo-tiny float32: K+V, 4 layers, 2 KV heads, 16 x 32


def run(coroutine_function, *args):
    """Run ``coroutine_function(*args)`` on a fresh event loop, failing after the timeout."""
    return asyncio.run(asyncio.wait_for(coroutine_function(*args), TIMEOUT_SECONDS))


def random_prompts(seed: int, count: int, low: int = 3, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(low, high))] for _ in range(count)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_llm():
    llm = LLM(**ENGINE_OPTIONS)
    yield llm
    llm.close()


def blocks_in_use(engine: LLMEngine) -> int:
    return sum(pool.num_used for pool in engine.block_manager.pools.values())


async def collect(async_engine: AsyncEngine, prompt, params, request_id):
    """All outputs of one request; checks that token lists only grow."""
    outputs = []
    async for output in async_engine.generate(prompt, params, request_id):
        if outputs:
            previous = outputs[-1].outputs[0].token_ids
            assert output.outputs[0].token_ids[:len(previous)] == previous
        outputs.append(output)
    return outputs


async def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-scheduling", "async-scheduling"])
def test_concurrent_streams_equal_generate(seed, reference_llm, async_scheduling):
    prompts = random_prompts(seed, 6)
    params = [greedy(4 + index * 3) for index in range(len(prompts))]
    expected = [output.outputs[0].token_ids for output in reference_llm.generate(prompts, params)]

    async def main():
        async_engine = AsyncEngine(LLMEngine(EngineConfig(**ENGINE_OPTIONS, async_scheduling=async_scheduling)))
        async_engine.start()
        try:
            streams = await asyncio.gather(*(
                collect(async_engine, prompt, param, f"request-{index}")
                for index, (prompt, param) in enumerate(zip(prompts, params))))
            await wait_until(lambda: async_engine.stats.running == 0)
            return streams, async_engine.stats, blocks_in_use(async_engine.engine)
        finally:
            await async_engine.stop()

    streams, stats, used = run(main)
    for stream, tokens, param in zip(streams, expected, params):
        assert stream[-1].finished and not any(output.finished for output in stream[:-1])
        assert stream[-1].outputs[0].token_ids == tokens
        assert stream[-1].outputs[0].finish_reason == "length"
    assert used == 0 and stats.gpu_blocks_used == 0
    assert stats.counters["requests_finished"] == len(prompts)
    assert stats.counters["output_tokens"] == sum(param.max_tokens for param in params)
    assert stats.tokens_per_second(time.monotonic()) > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-scheduling", "async-scheduling"])
def test_closing_a_stream_aborts_and_frees_blocks(seed, async_scheduling):
    prompts = random_prompts(seed, 4)

    async def main():
        async_engine = AsyncEngine(LLMEngine(EngineConfig(**ENGINE_OPTIONS, async_scheduling=async_scheduling)))
        async_engine.start()
        try:
            # Two streams are closed after two outputs...
            streams = [async_engine.generate(prompt, greedy(500), f"request-{index}")
                       for index, prompt in enumerate(prompts[:2])]
            for stream in streams:
                await anext(stream)
                await anext(stream)
            assert async_engine.stats.running == 2
            for stream in streams:
                await stream.aclose()
            # ... two are cancelled while they wait for their first output.
            waiters = [asyncio.ensure_future(anext(async_engine.generate(
                prompt, greedy(500), f"waiting-{index}")))
                for index, prompt in enumerate(prompts[2:])]
            await asyncio.sleep(0)
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
            assert all(waiter.cancelled() for waiter in waiters)
            await wait_until(lambda: async_engine.stats.counters["requests_aborted"] == 4
                             and async_engine.stats.running == 0)
            stats = async_engine.stats
            return stats, blocks_in_use(async_engine.engine)
        finally:
            await async_engine.stop()

    stats, used = run(main)
    assert used == 0 and stats.gpu_blocks_used == 0 and stats.waiting == 0
    assert stats.counters["requests_aborted"] == len(prompts)
    assert stats.counters["requests_finished"] == 0


def test_abort_ends_the_stream_with_abort(seed):
    prompt = random_prompts(seed, 1)[0]

    async def main():
        async_engine = AsyncEngine(LLMEngine(EngineConfig(**ENGINE_OPTIONS)))
        async_engine.start()
        try:
            outputs = []
            async for output in async_engine.generate(prompt, greedy(500), "victim"):
                outputs.append(output)
                if len(outputs) == 3:
                    async_engine.abort("victim")
            return outputs, blocks_in_use(async_engine.engine)
        finally:
            await async_engine.stop()

    outputs, used = run(main)
    final = outputs[-1]
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert 3 <= len(final.outputs[0].token_ids) < 500
    assert used == 0


def test_parallel_sampling_abort_and_stop_end_every_child(seed):
    """n=3 requests: ``abort`` ends the parent with every child's final state (finish reason
    "abort", logprobs kept), ``stop_accepting`` does the same for one in flight, and no KV
    block stays in use."""
    prompt = random_prompts(seed, 1)[0]
    params = SamplingParams(n=3, seed=seed, max_tokens=500, ignore_eos=True, logprobs=1)

    async def finals_of(async_engine, request_id, end) -> list:
        outputs = []
        async for output in async_engine.generate(prompt, params, request_id):
            outputs.append(output)
            if len(outputs) == 3:
                end()
        return outputs

    async def main():
        async_engine = AsyncEngine(LLMEngine(EngineConfig(**ENGINE_OPTIONS)))
        async_engine.start()
        try:
            aborted = await finals_of(async_engine, "aborted",
                                      lambda: async_engine.abort("aborted"))
            used_after_abort = blocks_in_use(async_engine.engine)
            stopped = await finals_of(async_engine, "stopped", async_engine.stop_accepting)
            await wait_until(lambda: async_engine.stats.running == 0)
            return aborted, used_after_abort, stopped, async_engine.stats
        finally:
            await async_engine.stop()

    aborted, used_after_abort, stopped, stats = run(main)
    for outputs in (aborted, stopped):
        final = outputs[-1]
        assert final.finished and final.request_id in ("aborted", "stopped")
        assert [completion.index for completion in final.outputs] == [0, 1, 2]
        for completion in final.outputs:
            assert completion.finish_reason == "abort"
            assert 2 <= len(completion.token_ids) < 500
            assert len(completion.logprobs) == len(completion.token_ids)
    assert used_after_abort == 0 and stats.gpu_blocks_used == 0
    assert stats.counters["requests_aborted"] == 6


def test_rejected_request_raises_and_others_continue(seed, reference_llm):
    prompt = random_prompts(seed, 1)[0]
    expected = reference_llm.generate(prompt, greedy(12))[0].outputs[0].token_ids

    async def main():
        async_engine = AsyncEngine(LLMEngine(EngineConfig(**ENGINE_OPTIONS)))
        async_engine.start()
        try:
            good = asyncio.ensure_future(collect(async_engine, prompt, greedy(12), "good"))
            errors = []
            for bad_prompt in ([], [1, 2, 10_000], [5] * 5000):
                with pytest.raises(ValueError) as error:
                    await collect(async_engine, bad_prompt, greedy(4), f"bad-{len(errors)}")
                errors.append(str(error.value))
            with pytest.raises(ValueError, match="already in use"):
                await asyncio.gather(collect(async_engine, prompt, greedy(50), "twice"),
                                     collect(async_engine, prompt, greedy(50), "twice"))
            return errors, (await good)[-1], async_engine.is_running
        finally:
            await async_engine.stop()

    errors, good, running = run(main)
    assert "empty" in errors[0]
    assert "10000 is outside the vocabulary [0, 320)" in errors[1]
    assert "5000 tokens is too long" in errors[2] and "4096" in errors[2]
    assert good.outputs[0].token_ids == expected
    assert running


def test_failed_iteration_ends_its_requests_only(seed, reference_llm):
    prompts = random_prompts(seed, 2)
    expected = reference_llm.generate(prompts[1], greedy(6))[0].outputs[0].token_ids

    async def main():
        engine = LLMEngine(EngineConfig(**ENGINE_OPTIONS))
        execute = engine.runner.execute

        def failing_execute(plan, on_launched=None):
            if any(request.request_id == "doomed" for request in plan.requests):
                raise RuntimeError("injected kernel failure")
            return execute(plan, on_launched)

        engine.runner.execute = failing_execute
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            with pytest.raises(RequestFailed, match="injected kernel failure"):
                await collect(async_engine, prompts[0], greedy(6), "doomed")
            after = await collect(async_engine, prompts[1], greedy(6), "after")
            return after[-1], blocks_in_use(engine), async_engine.is_running
        finally:
            await async_engine.stop()

    after, used, running = run(main)
    assert after.outputs[0].token_ids == expected
    assert used == 0 and running


def test_outputs_queued_before_a_failure_are_not_lost(seed):
    """A slow consumer finds an output and then the error in its queue: it still gets the
    output (with every token made) before the error."""
    prompt = random_prompts(seed, 1)[0]

    async def main():
        engine = LLMEngine(EngineConfig(**ENGINE_OPTIONS))
        execute = engine.runner.execute

        def failing_execute(plan, on_launched=None):  # the third token fails
            if any(request.num_output_tokens == 2 for request in plan.requests):
                raise RuntimeError("injected kernel failure")
            return execute(plan, on_launched)

        engine.runner.execute = failing_execute
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            stream = async_engine.generate(prompt, greedy(10), "slowly-read")
            outputs = [await anext(stream)]
            # Read on only once the error's delivery has reached the queue.
            await wait_until(lambda: async_engine.stats.counters["requests_aborted"] == 1)
            await asyncio.sleep(0.05)
            with pytest.raises(RequestFailed):
                while True:
                    outputs.append(await anext(stream))
            return outputs
        finally:
            await async_engine.stop()

    outputs = run(main)
    assert [len(output.outputs[0].token_ids) for output in outputs][-1] == 2
    assert not any(output.finished for output in outputs)


def test_failure_outside_a_plan_ends_every_request_and_the_loop_goes_on(seed, reference_llm):
    prompts = random_prompts(seed, 3)
    expected = reference_llm.generate(prompts[2], greedy(5))[0].outputs[0].token_ids

    async def main():
        engine = LLMEngine(EngineConfig(**ENGINE_OPTIONS))
        schedule = engine.scheduler.schedule
        failures = {"left": 0}

        def flaky_schedule():
            if failures["left"]:
                failures["left"] -= 1
                raise RuntimeError("injected scheduler failure")
            return schedule()

        engine.scheduler.schedule = flaky_schedule
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            streams = [async_engine.generate(prompt, greedy(400), f"victim-{index}")
                       for index, prompt in enumerate(prompts[:2])]
            for stream in streams:
                await anext(stream)
            failures["left"] = 1
            for stream in streams:
                with pytest.raises(RequestFailed, match="injected scheduler failure"):
                    while True:
                        await anext(stream)
            after = await collect(async_engine, prompts[2], greedy(5), "after")
            return after[-1], blocks_in_use(engine)
        finally:
            await async_engine.stop()

    after, used = run(main)
    assert after.outputs[0].token_ids == expected
    assert used == 0


def test_idle_engine_thread_sleeps(seed):
    """No iteration runs while there is no work, and a stalled queue is retried slowly."""
    prompt = random_prompts(seed, 1)[0]

    async def main():
        engine = LLMEngine(EngineConfig(**ENGINE_OPTIONS))
        calls = {"step": 0, "schedule": 0}
        step = engine.step

        def counting_step(on_launched=None):
            calls["step"] += 1
            return step(on_launched)

        engine.step = counting_step
        async_engine = AsyncEngine(engine, stalled_wait_seconds=0.01)
        async_engine.start()
        try:
            await collect(async_engine, prompt, greedy(3), "warm")
            steps_after_work = calls["step"]
            await asyncio.sleep(0.3)
            idle_steps = calls["step"] - steps_after_work

            def nothing_fits():  # a request that waits but can never be scheduled
                calls["schedule"] += 1
                return SchedulerOutput()

            engine.scheduler.schedule = nothing_fits
            stream = async_engine.generate(prompt, greedy(3), "stuck")
            waiter = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.3)
            stalled_schedules = calls["schedule"]
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
            return idle_steps, stalled_schedules
        finally:
            await async_engine.stop()

    idle_steps, stalled_schedules = run(main)
    assert idle_steps == 0
    assert 1 <= stalled_schedules <= 60  # ~0.3 s / 0.01 s; a busy loop would make thousands


def test_stop_aborts_in_flight_and_refuses_new(seed):
    prompts = random_prompts(seed, 3)

    async def main():
        async_engine = AsyncEngine(LLMEngine(EngineConfig(**ENGINE_OPTIONS)))
        async_engine.start()
        streams = [async_engine.generate(prompt, greedy(1000), f"request-{index}")
                   for index, prompt in enumerate(prompts)]
        for stream in streams:
            await anext(stream)
        stopping = asyncio.ensure_future(async_engine.stop())
        finals = []
        for stream in streams:
            async for output in stream:
                final = output
            finals.append(final)
        await stopping
        with pytest.raises(EngineStopped):
            await anext(async_engine.generate(prompts[0], greedy(2), "late"))
        return finals, async_engine

    finals, async_engine = run(main)
    assert all(final.outputs[0].finish_reason == "abort" for final in finals)
    assert not async_engine.is_running
    assert not any(thread.name == "neo-engine" for thread in threading.enumerate())
    assert blocks_in_use(async_engine.engine) == 0


def test_stats_count_requests_by_pool(seed):
    """Under the neo policy with a GPU pool of 2 blocks, running requests spill to the host
    pool; the snapshot reports where they are."""
    prompts = random_prompts(seed, 4, low=17, high=30)
    options = dict(ENGINE_OPTIONS, policy="neo", perf_model="zero",
                   gpu_kv_cache_gib=2 * BLOCK_BYTES / 2**30,
                   cpu_kv_cache_gib=64 * BLOCK_BYTES / 2**30)

    async def main():
        async_engine = AsyncEngine(LLMEngine(EngineConfig(**options)))
        async_engine.start()
        try:
            streams = [async_engine.generate(prompt, greedy(200), f"request-{index}")
                       for index, prompt in enumerate(prompts)]
            for stream in streams:
                await anext(stream)
                await anext(stream)
            return async_engine.stats
        finally:
            await async_engine.stop()

    stats = run(main)
    assert stats.running == len(prompts)
    assert stats.running_in_host_pool >= 1 and stats.running_in_gpu_pool <= 1
    assert stats.running_in_gpu_pool + stats.running_in_host_pool == len(prompts)
    assert stats.gpu_blocks_total == 2 and stats.host_blocks_total == 64
    assert stats.host_blocks_used >= 2 * stats.running_in_host_pool

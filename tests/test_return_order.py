"""Which host-pool requests move back to the GPU pool first when it has room
(``EngineConfig.return_order``): the oldest, or those with the most tokens left before
``max_tokens``; the others decode on the host. Then the order end to end in the simulator (the
real scheduler in simulated time): every request completes under both orders."""

import pytest

from neo.config import EngineConfig
from neo.request import KVLocation, Request, RequestStatus
from neo.sampling_params import SamplingParams
from neo.sim.hardware import preset
from neo.sim.scenario import Scenario, run_scenario
from scheduler_harness import TOKEN, make_scheduler

BLOCK = 16


def on_host(scheduler, request_id: str, max_tokens: int, generated: int) -> Request:
    """A running request whose KV is in the host pool: a two-block prompt and ``generated``
    output tokens."""
    request = Request(request_id, [1] * (2 * BLOCK), SamplingParams(max_tokens=max_tokens))
    for _ in range(generated):
        request.append_token(TOKEN)
    scheduler.block_manager.allocate(request, KVLocation.HOST)
    request.num_cached_tokens = request.num_tokens
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)
    return request


@pytest.mark.parametrize("order, returned, left", [("oldest", "a", {"b", "c"}),
                                                   ("most-remaining", "b", {"a", "c"})])
def test_the_gpu_pools_room_goes_to_the_request_the_order_names(order, returned, left):
    # Five GPU blocks: one request of three blocks moves back, keeping the one-block watermark;
    # the next would need four.
    scheduler = make_scheduler("neo", gpu_blocks=5, host_blocks=64, block_size=BLOCK, return_order=order)
    on_host(scheduler, "a", max_tokens=10, generated=4)  # oldest, 6 tokens left
    on_host(scheduler, "b", max_tokens=100, generated=4)  # 96 left
    on_host(scheduler, "c", max_tokens=50, generated=4)  # 46 left
    plan = scheduler.schedule()
    assert [request.request_id for request in plan.moved] == [returned]
    assert [request.request_id for request in plan.sub_batches[0].gpu_decodes] == [returned]
    host_decodes = {request.request_id for batch in plan.sub_batches for request in batch.host_decodes}
    assert host_decodes == left


def test_the_order_is_checked():
    with pytest.raises(ValueError, match="unknown return_order 'newest'; choose one of oldest, most-remaining"):
        EngineConfig(return_order="newest")


@pytest.mark.parametrize("order", ["oldest", "most-remaining"])
def test_every_request_completes_under_either_order(order):
    scenario = Scenario(model="llama-3.1-8b", hardware=preset("h100"), workload="synthetic:input=1000,output=100",
                        num_requests=40, policies=("neo",), gpu_kv_cache_gib=0.5, cpu_kv_cache_gib=16.0,
                        return_order=order)
    result, = run_scenario(scenario)
    assert result.finished_requests == 40
    assert result.host_decode_tokens > 0

"""Row buckets (``neo.gemm_rows``): the bucket function, padded batch inputs, padded logits, and
that the start-up warm-up runs every GEMM shape the engine's eager iterations then meet (on the
CPU, where nothing is captured in CUDA graphs)."""

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from engine_reference import PROMPTS, gib_for_blocks
from neo import LLM, SamplingParams
from neo.runner.batch_inputs import build_batch_inputs
from neo.models.loader import load_model
from neo.runner.gemm_rows import padded_logits, padded_rows, row_buckets, warm_up
from neo.request import KVLocation, Request
from neo.sched.scheduler_output import SubBatch


def test_padded_rows_is_the_smallest_bucket_at_or_above():
    buckets = row_buckets(3000)
    assert buckets == sorted(set(buckets)) and buckets[-1] == padded_rows(3000) == 3072
    for rows in range(1, 3001):
        bucket = padded_rows(rows)
        index = buckets.index(bucket)
        assert padded_rows(bucket) == bucket and (index == 0 or buckets[index - 1] < rows)
    assert padded_rows(0) == 0
    assert [padded_rows(n) for n in (1, 8, 9, 64, 65, 512, 513, 8192)] == [8, 8, 16, 64, 96, 512, 640, 8192]
    with pytest.raises(ValueError, match="rows must be >= 0"):
        padded_rows(-1)


def _request(name: str, length: int, location: KVLocation, prefill: bool) -> Request:
    request = Request(name, list(range(3, 3 + length)), SamplingParams(max_tokens=4))
    request.location = location
    request.block_table = list(range(-(-length // 4)))
    request.num_cached_tokens = 0 if prefill else length - 1
    return request


def test_padded_batch_inputs_add_rows_that_store_nothing():
    batch = SubBatch(prefills=[_request("p", 13, KVLocation.GPU, prefill=True)],
                     gpu_decodes=[_request("g", 6, KVLocation.GPU, prefill=False)],
                     host_decodes=[_request("c", 9, KVLocation.HOST, prefill=False)])
    plain = build_batch_inputs(batch, 4, torch.device("cpu"))
    padded = build_batch_inputs(batch, 4, torch.device("cpu"), pad_rows=True)
    meta = padded.metadata
    assert (meta.num_tokens, meta.num_padding_tokens, meta.num_rows) == (15, 1, 16)
    assert plain.metadata.num_padding_tokens == 0 and plain.metadata.num_rows == 15
    assert padded.input_ids[:15].tolist() == plain.input_ids.tolist() and padded.input_ids[15] == 0
    assert meta.positions[:15].tolist() == plain.metadata.positions.tolist() and meta.positions[15] == 0
    assert meta.slot_mapping[:15].tolist() == plain.metadata.slot_mapping.tolist() and meta.slot_mapping[15] == -1
    assert padded.logits_indices.tolist() == plain.logits_indices.tolist()


def test_padded_logits_equal_the_unpadded_rows():
    model = load_model("neo-tiny", dtype=torch.float32, device="cpu")
    for rows in (1, 8, 11, 70):
        hidden = torch.randn(rows, model.config.hidden_size)
        torch.testing.assert_close(padded_logits(model, hidden), model.compute_logits(hidden))


class _RecordLinears(TorchFunctionMode):
    """Records each ``F.linear``'s (input shape, input strides, weight shape, has bias)."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            inputs, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            self.shapes.add((tuple(inputs.shape), inputs.stride(), tuple(weight.shape), bias is not None))
        return func(*args, **kwargs)


@pytest.mark.parametrize("policy, host_pipeline", [("gpu-only", "lockstep"), ("neo", "lockstep"), ("neo", "async")])
def test_warm_up_runs_every_gemm_shape_serving_meets(policy, host_pipeline):
    llm = LLM("neo-tiny", device="cpu", policy=policy, gpu_kv_cache_gib=gib_for_blocks(10), cpu_kv_cache_gib=gib_for_blocks(256),
              perf_model="zero", max_num_seqs=8, max_num_batched_tokens=256, host_pipeline=host_pipeline,
              pad_gemm_rows=True)
    try:
        with _RecordLinears() as serving:
            outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        model = llm.engine.model
        with _RecordLinears() as warmed:
            warm_up(model, llm.engine.config.max_num_batched_tokens, llm.engine.config.max_num_seqs)
        metrics = llm.get_metrics()
    finally:
        llm.close()
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)
    if policy == "neo":
        assert metrics["host_decode_tokens"] > 0
    assert len(serving.shapes) > 4
    assert serving.shapes <= warmed.shapes, sorted(serving.shapes - warmed.shapes)

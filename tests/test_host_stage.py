"""``neo_pipeline.HostDecodeStage``: the pipeline's per-layer host hand-off on CUDA streams.

Queued directly and captured in a CUDA graph, its output rows and host cache equal the
pure-torch reference's (store the new K/V, then paged decode attention over the host cache);
a replay attends only over the rows the host metadata names at run time. The stage calls the
CPU kernels it is constructed with (the ISPC ones here), by operator name, whatever
torch.ops.neo dispatches to. Skipped without CUDA or without the ISPC kernels (CUDA host
functions may call only compiled kernels).
"""

import re
import warnings

import pytest
import torch
from torch.library import Library

import neo.ops
from neo.runner.host_attention import FAILURE_MESSAGE_BYTES, HostRowBuffers, host_stage_available
from neo.ops import reference

from conftest import assert_close, random_paged_kv, random_tensor

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 8, 2, 64, 16, 3
CAPACITY, MAX_BLOCKS = 8, 8
HOST_OPS = ("paged_decode_attention", "store_kv_cache")  # in the order the stage takes their kernels


def skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available (torch.cuda.is_available() is False)"
    if not host_stage_available():
        return "cuda: not built (no neo_pipeline.HostDecodeStage)"
    for op in HOST_OPS:
        try:
            neo.ops.select_implementation(op, "cpu", "ispc")
        except ValueError as error:
            return f"{error} (the host stage runs compiled CPU kernels)"
    return None


pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


def ispc_kernels() -> tuple[str, ...]:
    """The stage's last two arguments: the operators of the ISPC kernels, which it calls."""
    return tuple(neo.ops.select_implementation(op, "cpu", "ispc").qualified_name for op in HOST_OPS)


def make_stage(slot, failure, seconds, stream, kernels):
    return torch.classes.neo_pipeline.HostDecodeStage(
        slot.query, slot.key, slot.value, slot.output, slot.slot_mapping, slot.block_table, slot.seq_lens,
        slot.num_decodes, failure, seconds, HEAD_DIM ** -0.5, 2, NUM_LAYERS, stream.stream_id,
        stream.device_index, stream.device_type, *kernels)


class Setup:
    """A stage of one slot over random host caches, and what its host metadata says."""

    def __init__(self, generator, dtype=torch.float32, lengths=(17, 40, 5, 33)):
        self.dtype = dtype
        self.paged = random_paged_kv([length - 1 for length in lengths], NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM,
                                     dtype, generator, spare_blocks=2 * len(lengths))
        self.paged.k_cache.nan_to_num_(0.0)
        self.paged.v_cache.nan_to_num_(0.0)
        self.lengths = list(lengths)
        self.generator = generator
        self.copy_stream = torch.cuda.Stream()
        self.slot = HostRowBuffers.allocate(CAPACITY, MAX_BLOCKS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype)
        self.failure = torch.zeros(FAILURE_MESSAGE_BYTES, dtype=torch.uint8)
        self.seconds = torch.zeros(1, dtype=torch.float64)
        self.stage = make_stage(self.slot, self.failure, self.seconds, self.copy_stream, ispc_kernels())

    def load(self, rows: int) -> None:
        """Host metadata of the first ``rows`` sequences, each decoding its last token (the
        block tables grow by a spare block where the new token starts one)."""
        table = self.paged.block_table[:rows].clone()
        used = set(int(b) for b in table.flatten() if 0 <= int(b) < self.paged.k_cache.shape[0])
        spare = iter(sorted(set(range(self.paged.k_cache.shape[0])) - used))
        slots = []
        for row, length in enumerate(self.lengths[:rows]):
            block, offset = divmod(length - 1, BLOCK_SIZE)
            if offset == 0:
                table[row, block] = next(spare)
            slots.append(int(table[row, block]) * BLOCK_SIZE + offset)
        table = table[:, :MAX_BLOCKS]
        self.slot.slot_mapping[:rows] = torch.tensor(slots)
        self.slot.block_table[:rows, :table.shape[1]] = table
        self.slot.seq_lens[:rows] = torch.tensor(self.lengths[:rows], dtype=torch.int32)
        self.slot.num_decodes[0] = rows
        self.table, self.slots = table, torch.tensor(slots)

    def rows(self, count: int):
        q = random_tensor((count, NUM_HEADS, HEAD_DIM), self.dtype, self.generator, "cuda")
        k = random_tensor((count, NUM_KV_HEADS, HEAD_DIM), self.dtype, self.generator, "cuda")
        v = random_tensor((count, NUM_KV_HEADS, HEAD_DIM), self.dtype, self.generator, "cuda")
        return q, k, v

    def expected(self, q, k, v, rows: int):
        """(output rows, k cache, v cache) of the reference for the first ``rows`` rows."""
        k_cache, v_cache = self.paged.k_cache.clone(), self.paged.v_cache.clone()
        reference.store_kv_cache(k[:rows].cpu(), v[:rows].cpu(), k_cache, v_cache, self.slots)
        out = torch.empty(rows, NUM_HEADS, HEAD_DIM, dtype=self.dtype)
        reference.paged_decode_attention(out, q[:rows].cpu(), k_cache, v_cache, self.table,
                                         torch.tensor(self.lengths[:rows], dtype=torch.int32), HEAD_DIM ** -0.5)
        return out, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_queued_stage_equals_the_reference(dtype, generator):
    setup = Setup(generator, dtype)
    setup.load(4)
    q, k, v = setup.rows(4)
    out = torch.full_like(q, float("nan"))
    k_cache, v_cache = setup.paged.k_cache.clone(), setup.paged.v_cache.clone()
    expected, expected_k, expected_v = setup.expected(q, k, v, 4)
    setup.stage.start(1, q, k, v, out, k_cache, v_cache)
    setup.stage.finish()
    torch.cuda.synchronize()
    assert setup.failure[0] == 0
    assert_close(out.cpu(), expected, dtype)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert setup.seconds[0] > 0


def test_captured_stage_attends_over_the_rows_named_at_replay(generator):
    setup = Setup(generator)
    k_cache, v_cache = setup.paged.k_cache.clone(), setup.paged.v_cache.clone()
    q, k, v = (torch.zeros_like(t) for t in setup.rows(4))
    out = torch.zeros_like(q)
    setup.load(4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        setup.stage.start(0, q, k, v, out, k_cache, v_cache)
        setup.stage.finish()
    for rows in (2, 4):  # padded rows ride along in the copies but are not attended
        setup.paged.k_cache.copy_(k_cache)  # the reference starts from the cache as it is now
        setup.paged.v_cache.copy_(v_cache)
        setup.load(rows)
        fresh = setup.rows(4)
        for static, values in zip((q, k, v), fresh):
            static.copy_(values)
        expected, expected_k, expected_v = setup.expected(*fresh, rows)
        graph.replay()
        torch.cuda.synchronize()
        assert setup.failure[0] == 0
        assert_close(out[:rows].cpu(), expected, torch.float32)
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_host_failure_is_recorded_not_raised(generator):
    setup = Setup(generator)
    setup.load(2)
    setup.slot.block_table[1, 0] = setup.paged.k_cache.shape[0] + 3  # beyond the cache
    q, k, v = setup.rows(2)
    out = torch.zeros_like(q)
    for layer in range(NUM_LAYERS):  # later layers skip their work once one failed
        setup.stage.start(layer, q, k, v, out, setup.paged.k_cache, setup.paged.v_cache)
        setup.stage.finish()
    torch.cuda.synchronize()
    message = bytes(setup.failure[1:].tolist()).split(b"\0", 1)[0].decode()
    assert setup.failure[0] == 1 and "block id" in message


@pytest.mark.parametrize("case", ["too-many-rows", "rows-on-cpu", "row-counts-differ", "bad-layer", "head-dim"])
def test_bad_calls_raise(case, generator):
    setup = Setup(generator)
    q, k, v = setup.rows(CAPACITY + 1 if case == "too-many-rows" else 2)
    out = torch.zeros_like(q)
    layer = NUM_LAYERS if case == "bad-layer" else 0
    if case == "rows-on-cpu":
        q = q.cpu()
    if case == "row-counts-differ":
        k = k[:1]
    if case == "head-dim":
        q, out = q[..., :32].contiguous(), out[..., :32].contiguous()
    with pytest.raises((ValueError, RuntimeError), match="HostDecodeStage"):
        setup.stage.start(layer, q, k, v, out, setup.paged.k_cache, setup.paged.v_cache)


def test_stage_runs_the_named_kernels_not_torch_ops_neo(generator):
    """With torch.ops.neo's CPU kernels replaced by ones that fail, the stage, made with the
    ISPC kernels' names, still stores and attends with the ISPC kernels."""
    setup = Setup(generator)
    setup.load(4)
    q, k, v = setup.rows(4)
    out = torch.full_like(q, float("nan"))
    k_cache, v_cache = setup.paged.k_cache.clone(), setup.paged.v_cache.clone()
    expected, expected_k, expected_v = setup.expected(q, k, v, 4)
    calls = []

    def replaced(*arguments):
        calls.append(len(arguments))
        raise RuntimeError("torch.ops.neo's CPU kernel was called")

    replacement = Library("neo", "IMPL")
    with warnings.catch_warnings():  # torch warns of the override
        warnings.simplefilter("ignore")
        for op in HOST_OPS:
            replacement.impl(op, replaced, "CPU")
    try:
        setup.stage.start(0, q, k, v, out, k_cache, v_cache)
        setup.stage.finish()
        torch.cuda.synchronize()
    finally:
        del replacement  # deregisters its kernels
    assert neo.ops.dispatched("paged_decode_attention", "cpu") == "ispc"
    assert not calls and setup.failure[0] == 0
    assert_close(out.cpu(), expected, torch.float32)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize(("kernels", "message"), [
    (("neo_missing::paged_decode_attention", "neo_ispc::store_kv_cache"),
     "paged_decode_attention_op names no declared operator: 'neo_missing::paged_decode_attention'"),
    (("neo_ispc::paged_decode_attention", "neo_ispc::paged_decode_attention"),
     "store_kv_cache_op 'neo_ispc::paged_decode_attention' does not have the schema of neo::store_kv_cache"),
    (("neo_reference::paged_decode_attention", "neo_ispc::store_kv_cache"),
     "paged_decode_attention_op 'neo_reference::paged_decode_attention' has no CPU kernel"),
], ids=["unknown-op", "wrong-schema", "no-cpu-kernel"])
def test_bad_kernel_names_raise(kernels, message):
    slot = HostRowBuffers.allocate(CAPACITY, MAX_BLOCKS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    failure = torch.zeros(FAILURE_MESSAGE_BYTES, dtype=torch.uint8)
    seconds = torch.zeros(1, dtype=torch.float64)
    with pytest.raises((ValueError, RuntimeError), match=re.escape(message)):
        make_stage(slot, failure, seconds, torch.cuda.Stream(), kernels)

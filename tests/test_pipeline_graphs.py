"""Which plans replay a pipeline CUDA graph, and how a replay's inputs are laid out in the
captured rows (the parts of ``neo.pipeline_graphs`` that need no GPU; the replays themselves
are checked against transformers in test_gpu_engine.py)."""

import pytest
import torch

from neo.runner.batch_inputs import build_batch_inputs
from neo.runner.host_batches import host_batch_shapes
from neo.runner.pipeline_graphs import StaticInputs, graph_shape, padded, padded_counts
from neo.request import KVLocation, Request
from neo.sampling_params import SamplingParams
from neo.sched.scheduler_output import SubBatch
from neo.sched.stage_order import HOST_BATCH_ORDERS, STAGE_ORDERS, host_batch_sub_batches

BLOCK_SIZE = 4
SIZES = padded_counts(8)
MAX_BLOCKS = 6


def decoding(name: str, length: int, location: KVLocation, first_block: int) -> Request:
    """A request of ``length`` tokens about to decode its last one, blocks from ``first_block``."""
    request = Request(name, list(range(10, 10 + length)), SamplingParams(max_tokens=4))
    request.location = location
    request.block_table = list(range(first_block, first_block + -(-length // BLOCK_SIZE)))
    request.num_cached_tokens = length - 1
    return request


def inputs_of(gpu_lengths, cpu_lengths, prefill_lengths=(), pad_rows=False):
    batch = SubBatch(
        prefills=[decoding(f"p{i}", n, KVLocation.GPU, 40 + 8 * i) for i, n in enumerate(prefill_lengths)],
        gpu_decodes=[decoding(f"g{i}", n, KVLocation.GPU, 8 * i) for i, n in enumerate(gpu_lengths)],
        host_decodes=[decoding(f"c{i}", n, KVLocation.HOST, 8 * i) for i, n in enumerate(cpu_lengths)])
    for request in batch.prefills:
        request.num_cached_tokens = 0
    return build_batch_inputs(batch, BLOCK_SIZE, torch.device("cpu"), pad_rows)


def test_padded_counts_are_powers_of_two_and_the_largest():
    assert padded_counts(8) == [0, 1, 2, 4, 8]
    assert padded_counts(12) == [0, 1, 2, 4, 8, 12]
    assert padded_counts(1) == [0, 1]
    assert [padded(n, padded_counts(12)) for n in (0, 1, 3, 5, 9, 12)] == [0, 1, 4, 8, 12, 12]


def test_decode_only_plans_with_host_decodes_have_a_shape():
    two = [inputs_of([5, 9, 3], [7, 2]).metadata, inputs_of([], [6, 6, 6]).metadata]
    assert graph_shape(two, SIZES, MAX_BLOCKS) == ((4, 2), (0, 4))
    assert graph_shape([inputs_of([], [5]).metadata], SIZES, MAX_BLOCKS) == ((0, 1),)


@pytest.mark.parametrize("order", HOST_BATCH_ORDERS)
@pytest.mark.parametrize("max_decodes", [1, 2, 5, 8, 12])
def test_host_batch_shapes_are_the_shapes_host_batches_replay(order, max_decodes):
    """The shapes captured at start-up are exactly those of the host batches of every size, as
    the runner lays them out (split by the batch order, one ``BatchInputs`` per part), largest
    first: no batch captures during serving, and no shape is captured that none replays."""
    sizes = padded_counts(max_decodes)
    replayed = set()
    for count in range(1, max_decodes + 1):
        batch_order, parts = host_batch_sub_batches(STAGE_ORDERS[order], count)
        lengths = [3 + index % 7 for index in range(count)]
        metadata = [inputs_of([], lengths[part]).metadata for part in parts]
        replayed.add((batch_order.name, graph_shape(metadata, sizes, MAX_BLOCKS)))
    shapes = host_batch_shapes(STAGE_ORDERS[order], max_decodes)
    keys = [(batch_order.name, shape) for batch_order, shape in shapes]
    assert len(keys) == len(set(keys)) and set(keys) == replayed
    rows = [sum(host for _, host in shape) for _, shape in shapes]
    assert rows == sorted(rows, reverse=True)
    assert None not in {shape for _, shape in replayed}


@pytest.mark.parametrize("case", ["prefill", "gpu-only", "too-wide", "too-many"])
def test_other_plans_run_eagerly(case):
    metadata = {
        "prefill": [inputs_of([5], [7], prefill_lengths=[6]).metadata],
        "gpu-only": [inputs_of([5, 6], []).metadata],
        "too-wide": [inputs_of([MAX_BLOCKS * BLOCK_SIZE + 1], [7]).metadata],  # GPU table of 7 blocks
        "too-many": [inputs_of([], [3] * 9).metadata],
    }[case]
    assert graph_shape(metadata, SIZES, MAX_BLOCKS) is None


@pytest.mark.parametrize("pad_rows", [False, True])
def test_static_inputs_lay_out_gpu_then_host_rows_with_padding(pad_rows):
    static = StaticInputs(rows=16, gpu_rows=8, max_blocks=MAX_BLOCKS, device=torch.device("cpu"))
    wide = inputs_of([5, 9, 3, 4, 6], [7, 2, 8])  # fills more rows first: stale values to overwrite
    static.load(wide, gpu_rows=8, host_rows=4)
    inputs = inputs_of([5, 9, 3], [7, 2], pad_rows=pad_rows)
    assert inputs.input_ids.shape[0] == (8 if pad_rows else 5)  # GEMM-row padding: not copied
    static.load(inputs, gpu_rows=4, host_rows=2)
    meta = inputs.metadata
    assert static.input_ids[:3].tolist() == inputs.input_ids[:3].tolist()
    assert static.input_ids[4:6].tolist() == inputs.input_ids[3:5].tolist()
    assert static.positions[:3].tolist() == [4, 8, 2] and static.positions[4:6].tolist() == [6, 1]
    # GPU slots for the real GPU rows; nothing stored for padding and host rows.
    assert static.slot_mapping[:3].tolist() == meta.slot_mapping[:3].tolist()
    assert static.slot_mapping[3:6].tolist() == [-1, -1, -1]
    assert static.seq_lens[:4].tolist() == [5, 9, 3, 1]
    assert static.block_table[:3, :3].tolist() == meta.gpu_block_table.tolist()
    assert static.block_table[3].tolist() == [0] * MAX_BLOCKS
    captured = static.metadata(gpu_rows=4, host_rows=2)
    assert (captured.num_gpu_decodes, captured.num_host_decodes, captured.num_tokens) == (4, 2, 6)
    hidden = torch.arange(6).unsqueeze(1)
    real = torch.cat(StaticInputs.real_rows(hidden, inputs, gpu_rows=4))
    assert real.flatten().tolist() == [0, 1, 2, 4, 5]  # in the plan's request order

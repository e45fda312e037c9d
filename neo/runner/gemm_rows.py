"""Row buckets: the engine's eager GEMMs run with row counts from a fixed set, each seen once
at start-up.

The first time cuBLAS runs a GEMM shape in a process it prepares it (chooses a kernel, sets
the kernel's attributes), and that preparation waits until every CUDA host function queued on
any stream has run (``benchmarks/launch_waits.py`` measures it: a launch of a row count never
seen before keeps the launching thread about as long as the pending host function runs; a row
count seen before does not wait; the figures are in RESULTS.md). The host pipelines nearly always
have host functions queued (a host batch's attention), and the iterations beside them have
row counts that change every time (prompt lengths, request counts), so without buckets the
launching thread, and the GPU with it, waited for the host batch in most such iterations.

So a sub-batch's token rows are padded up to a bucket (``build_batch_inputs``: padding rows
have slot -1 and no attention), the logits GEMM's rows too (``padded_logits``), and
``warm_up`` runs every bucket's GEMMs once before serving. GEMM kernels compute whole tiles of
rows anyway, so the padding costs little GEMM time.
"""

import torch
import torch.nn.functional as F

# (largest row count, step): row counts up to the limit are rounded up to a multiple of step.
_STEPS = ((64, 8), (512, 32))
_LARGE_STEP = 128


def padded_rows(rows: int) -> int:
    """The bucket ``rows`` GEMM rows run as: a multiple of 8 up to 64, of 32 up to 512, then
    of 128."""
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    step = next((step for limit, step in _STEPS if rows <= limit), _LARGE_STEP)
    return -(-rows // step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every bucket a row count in ``[1, max_rows]`` pads to, ascending."""
    buckets, rows = [], 1
    while rows <= max_rows:
        bucket = padded_rows(rows)
        buckets.append(bucket)
        rows = bucket + 1
    return buckets


def padded_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """``model.compute_logits`` of ``hidden [N, hidden]`` with the GEMM run over
    ``padded_rows(N)`` rows (zero rows appended); float32 ``[N, vocab]``."""
    rows = hidden.shape[0]
    padding = padded_rows(rows) - rows
    if padding:
        hidden = torch.cat([hidden, hidden.new_zeros(padding, hidden.shape[1])])
    return model.compute_logits(hidden)[:rows]


@torch.inference_mode()
def warm_up(model, max_tokens: int, max_sequences: int) -> int:
    """Run each decoder-layer GEMM (as the layers call them: same weights' shapes, biases) for
    every bucket up to ``max_tokens`` rows, and the logits GEMM for every bucket up to
    ``max_sequences`` rows, so serving meets no GEMM shape for the first time. Returns how
    many GEMM shapes it ran."""
    linears = model.layers[0].gemm_weights()  # every layer's have the same shapes
    lm_head = model.logits_weight()
    token_buckets, sequence_buckets = row_buckets(max_tokens), row_buckets(max_sequences)
    widest = max(weight.shape[1] for weight, _ in linears + [(lm_head, None)])
    # Contiguous [rows, width] views, as the layers' inputs are (cuBLAS keys shapes by strides too).
    buffer = torch.zeros(token_buckets[-1] * widest, dtype=lm_head.dtype, device=lm_head.device)
    for rows in token_buckets:
        for weight, bias in linears:
            F.linear(buffer[:rows * weight.shape[1]].view(rows, weight.shape[1]), weight, bias)
    for rows in sequence_buckets:
        model.compute_logits(buffer[:rows * lm_head.shape[1]].view(rows, lm_head.shape[1]))
    return len(token_buckets) * len(linears) + len(sequence_buckets)

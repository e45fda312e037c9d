"""Which launches make the launching thread wait for a CUDA host function on another stream.

The async host pipeline keeps a host batch in flight on a stream of its own: CUDA host
functions that run the host attention for hundreds of milliseconds. Meanwhile the launching
thread queues the GPU's own iterations on the compute stream. If the driver makes some launch
wait for the pending host function, the GPU's iterations wait with it. This script holds a host
function (libc ``usleep``, so no Python runs in it) in flight on a side stream, then times on
the host how long each probe launch takes to return, against the same launch with nothing in
flight::

    python benchmarks/launch_waits.py [--hidden 5120 --vocab 152064 --host-ms 300] [--json PATH]

The probes include the logits GEMM at row counts never seen before, at such row counts padded
to ``neo.gemm_rows`` buckets that ran once beforehand, and at a seen row count on a new stream.
Each probe runs in modes: ``idle`` (nothing in flight), ``host-fn`` (a host function running on
the side stream), ``host-fn-queued`` (a host function queued behind a GPU sleep, not yet
started), ``graph`` (a host function inside a replayed CUDA graph). Run it under
``CUDA_MODULE_LOADING=EAGER`` too to see whether lazy kernel loading is what waits.
"""

import argparse
import ctypes
import json
import os
import time

import torch
import torch.nn.functional as F

from neo.runner.gemm_rows import padded_rows, row_buckets

_libcuda = ctypes.CDLL("libcuda.so.1")
_usleep = ctypes.cast(ctypes.CDLL(None).usleep, ctypes.c_void_p).value


def queue_host_sleep(stream: torch.cuda.Stream, microseconds: int) -> None:
    """Queue ``usleep(microseconds)`` as a host function on ``stream`` (``usleep`` reads the
    user-data pointer as its argument)."""
    status = _libcuda.cuLaunchHostFunc(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(_usleep),
                                       ctypes.c_void_p(microseconds))
    if status != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {status}")


def probes(hidden: int, vocab: int, device: torch.device) -> dict:
    """Name -> callable launching one kind of GPU work on the current stream. ``fresh`` probes
    use a row count never seen before on each call; the bucketed ones pad it to a bucket that
    ran here once."""
    dtype = torch.bfloat16
    weight = torch.randn(vocab, hidden, dtype=dtype, device=device) * 0.02
    up = torch.randn(4 * hidden, hidden, dtype=dtype, device=device) * 0.02
    bias = torch.zeros(4 * hidden, dtype=dtype, device=device)
    x_small = torch.randn(8, hidden, dtype=dtype, device=device)
    x_prefill = torch.randn(1024, hidden, dtype=dtype, device=device)
    y = torch.randn(1 << 20, device=device)
    unbucketed = [rows for rows in range(9, 4096, 7) if padded_rows(rows) != rows]
    fresh_rows, fresh_bucketed_rows = iter(unbucketed), iter(rows + 1 for rows in unbucketed)
    for rows in row_buckets(4096):
        F.linear(torch.ones(rows, hidden, dtype=dtype, device=device), weight)

    def on_new_stream():
        with torch.cuda.stream(torch.cuda.Stream(device)):
            F.linear(x_small, weight)

    def fresh(rows_iterator, pad: bool):
        rows = next(rows_iterator)
        return F.linear(torch.ones(padded_rows(rows) if pad else rows, hidden, dtype=dtype, device=device), weight)

    return {
        "elementwise": lambda: y.add_(1.0),
        "logits-gemm 8 rows": lambda: F.linear(x_small, weight),
        "logits-gemm 8 rows, new stream": on_new_stream,
        "logits-gemm fresh rows": lambda: fresh(fresh_rows, pad=False),
        "logits-gemm fresh, bucketed": lambda: fresh(fresh_bucketed_rows, pad=True),
        "prefill-gemm 1024 rows": lambda: F.linear(x_prefill, up),
        "prefill-gemm+bias 1024 rows": lambda: F.linear(x_prefill, up, bias),
        "allocate 64 MiB": lambda: torch.empty(64 << 20, dtype=torch.uint8, device=device),
        "softmax": lambda: torch.softmax(x_small.float() @ weight[:4096].float().T, dim=-1),
    }


def timed(probe) -> float:
    start = time.perf_counter()
    probe()
    return time.perf_counter() - start


def measure(probe, mode: str, side: torch.cuda.Stream, host_us: int, graph: torch.cuda.CUDAGraph) -> float:
    """Seconds the launching thread spends in ``probe`` while ``mode`` holds the side stream
    (``graph``: a captured host function of ``host_us``)."""
    torch.cuda.synchronize()
    if mode == "host-fn":
        queue_host_sleep(side, host_us)
        time.sleep(0.02)  # let the host function start
    elif mode == "host-fn-queued":
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(5e8))  # ~0.3 s of GPU cycles before the host function
        queue_host_sleep(side, host_us)
    elif mode == "graph":
        with torch.cuda.stream(side):
            graph.replay()
        time.sleep(0.02)
    seconds = timed(probe)
    torch.cuda.synchronize()
    return seconds


def host_graph(host_us: int) -> torch.cuda.CUDAGraph:
    """A graph of a kernel, a host function sleeping ``host_us`` and a kernel."""
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    scratch = torch.zeros(1, device="cuda")
    with torch.cuda.graph(graph, stream=capture):
        scratch.add_(1.0)
        queue_host_sleep(torch.cuda.current_stream(), host_us)
        scratch.add_(1.0)
    return graph


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--host-ms", type=float, default=300.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    device = torch.device("cuda")
    host_us = int(args.host_ms * 1e3)
    side = torch.cuda.Stream(device, priority=-1)
    graph = host_graph(host_us)
    table = probes(args.hidden, args.vocab, device)
    for probe in table.values():  # warm up: kernels loaded, heuristics cached, memory cached
        probe()
    torch.cuda.synchronize()
    loading = os.environ.get("CUDA_MODULE_LOADING", "LAZY (default)")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  CUDA_MODULE_LOADING={loading}  "
          f"host function {args.host_ms:.0f} ms")
    modes = ["idle", "host-fn", "host-fn-queued", "graph"]
    print(f"{'probe':32s}" + "".join(f"{mode:>16s}" for mode in modes) + "   (ms on the launching thread, max of repeats)")
    results = []
    for name, probe in table.items():
        row = {}
        for mode in modes:
            row[mode] = max(measure(probe, mode, side, host_us, graph) for _ in range(args.repeats)) * 1e3
        results.append({"probe": name, **row})
        print(f"{name:32s}" + "".join(f"{row[mode]:16.2f}" for mode in modes))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"device": torch.cuda.get_device_name(), "module_loading": loading,
                       "host_ms": args.host_ms, "results": results}, file, indent=1)


if __name__ == "__main__":
    main()

"""Trace one backward shape: the event time of the backward call and the kernels it launched.

    python3 bench/trace_bwd.py rms 131072 bf16            # RMSNorm, M = 2**27 / N rows
    python3 bench/trace_bwd.py parallel_ln 262144 bf16    # x + x1 + residual, two LayerNorms
    PYTHONPATH=/path/to/other/tree python3 bench/trace_bwd.py ln 65536 fp16

Workloads and dtypes are bench.py's, with its inputs and its clock: prints the median CUDA-event
time of the backward (L2 evicted and the host covered before each call, 30 calls), then the
profiler's kernels over 5 such calls (forward, the L2 flush's fill, backward): name, grid,
block, registers, shared memory, calls, median µs. Run it on two trees (PYTHONPATH) to find which kernel of a
row moved, as docs/tuning.md describes. GPU only.
"""

import json
import statistics
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import fused_norm


def main(argv):
    # bench.py puts this repository first on sys.path: imported after fused_norm, so that the
    # tree on PYTHONPATH is the one traced.
    import bench as B  # (this directory is sys.path[0])

    if len(argv) != 3 or argv[0] not in B.WORKLOADS or argv[2] not in B.DTYPES:
        sys.exit(__doc__)
    wl, n, dt = B.WORKLOADS[argv[0]], int(argv[1]), argv[2]
    m = (1 << 27) // n
    dev = torch.device("cuda")
    torch.manual_seed(0)
    args, leaves = B.make_inputs(wl, dt, m, n, dev)
    dys = B.make_grads(wl, dt, m, n, dev)
    forward = B._flash_style_forward(fused_norm, wl)
    clock = B.Clock(dev)

    def setup():
        return forward(*args)

    def backward(ys):
        return torch.autograd.grad(ys, leaves, dys)

    for _ in range(5):
        backward(setup())
    us = clock.median(backward, setup, 30) * 1e6
    print(f"{fused_norm.__file__}\n{wl.name} N={n} M={m} {dt} backward: event median {us:.1f} us")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        clock.median(backward, setup, 5)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            trace = json.load(g)
    kernels = {}
    for ev in trace["traceEvents"]:
        if ev.get("cat") == "kernel":
            a = ev.get("args", {})
            key = (ev["name"][:70], str(a.get("grid")), str(a.get("block")),
                   a.get("registers per thread"), a.get("shared memory"))  # fmt: skip
            kernels.setdefault(key, []).append(ev["dur"])
    for key, durs in kernels.items():
        print("  ", key, len(durs), "median us", statistics.median(durs))


if __name__ == "__main__":
    main(sys.argv[1:])

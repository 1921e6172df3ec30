"""Trace one backward shape: the event time of the backward call and the kernels it launched.

    python3 bench/trace_bwd.py rms 131072 bfloat16      # RMSNorm, M = 2**27 / N rows
    python3 bench/trace_bwd.py x1 262144 bfloat16       # x + x1 + residual, two LayerNorms
    PYTHONPATH=/path/to/other/tree python3 bench/trace_bwd.py ln 65536 float16

Workloads: ln, rms, x1 (bench.py's parallel_ln). Prints the median of a CUDA event pair around
the backward (L2 evicted before each call, 30 calls), then the profiler's kernels over 5 calls
of the whole loop (forward, the L2 flush's fill, backward): name, grid, block, registers,
shared memory, calls, median µs. Run it on two trees (PYTHONPATH) to find which kernel of a
row moved, as docs/tuning.md describes. GPU only.
"""

import json
import statistics
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import fused_norm
from fused_norm import layer_norm_fn, rms_norm_fn


def main(argv):
    if len(argv) != 3 or argv[0] not in ("ln", "rms", "x1"):
        sys.exit(__doc__)
    wl, n, dt = argv[0], int(argv[1]), getattr(torch, argv[2])
    m = (1 << 27) // n
    torch.manual_seed(0)

    def act():
        return torch.randn(m, n, device="cuda", dtype=dt, requires_grad=True)

    def param(center):
        return (center + 0.1 * torch.randn(n, device="cuda")).to(dt).requires_grad_()

    x, w = act(), param(1.0)
    if wl == "rms":
        leaves = [x, w]
        fwd = lambda: (rms_norm_fn(x, w, None, eps=1e-5),)  # noqa: E731
    elif wl == "ln":
        b = param(0.0)
        leaves = [x, w, b]
        fwd = lambda: (layer_norm_fn(x, w, b, eps=1e-5),)  # noqa: E731
    else:
        b, r, x1, w1, b1 = param(0.0), act(), act(), param(1.0), param(0.0)
        leaves = [x, w, b, r, x1, w1, b1]
        fwd = lambda: layer_norm_fn(x, w, b, residual=r, x1=x1, weight1=w1, bias1=b1,  # noqa: E731
                                    prenorm=True, eps=1e-5)  # fmt: skip
    dys = [torch.randn_like(o) for o in fwd()]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def once():
        ys = fwd()
        flush.zero_()
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        torch.autograd.grad(ys, leaves, dys)
        end.record()
        return start, end

    for _ in range(5):
        once()
    events = [once() for _ in range(30)]
    torch.cuda.synchronize()
    us = statistics.median(s.elapsed_time(e) for s, e in events) * 1e3
    print(f"{fused_norm.__file__}\n{wl} N={n} M={m} {dt} backward: event median {us:.1f} us")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            once()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
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

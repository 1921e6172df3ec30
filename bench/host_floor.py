#!/usr/bin/env python3
"""Where a small call's host time goes, and the floor a Python autograd Function can reach.

Times, per call (µs, back-to-back, median of repeats), at M x N = 1 x 4096 bf16 with gradients:
the pieces any Python implementation pays (an empty autograd Function, one allocation, one
Triton launch through a compiled kernel's C launcher, the autograd engine's backward), torch's
own RMSNorm, and fused_norm's RMSNorm; then a cProfile of fused_norm's forward and backward.

Then, for forward + backward at M·N = 2**27 (RMSNorm and add + RMSNorm, a few widths): the
wall time per call, the time to enqueue a call (no synchronize: if it matches the wall time, the
host is the bound), the kernels' device time, and the GPU's idle time between kernels, with the
kernels that the longest gaps precede.

    python3 bench/host_floor.py [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import host_cost as HC  # noqa: E402  (bench/host_cost.py: the timing, the workloads' steps)

import fused_norm  # noqa: E402


def per_call(step, dev=None, calls=2000, repeats=7) -> float:
    """Wall µs per call of back-to-back calls (bench/host_cost.py's median of repeats)."""
    return HC.wall_per_call(step, dev or torch.device("cuda"), calls, repeats) * 1e6


class _Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w)


def _no_grad(module, x):
    with torch.no_grad():
        return module(x)


def _gaps(wl, m, n, dev, fused, calls=30):
    from torch.profiler import ProfilerActivity, profile

    step = HC.make_step(fused, HC.B.WORKLOADS[wl], "bf16", m, n, dev, "fwd+bwd")
    wall = per_call(step, dev, calls, 5)
    enq = []
    for _ in range(5):
        HC.sync(dev)
        t = time.perf_counter()
        for _ in range(calls):
            step()
        enq.append((time.perf_counter() - t) / calls * 1e6)
        HC.sync(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        HC.sync(dev)
    kern = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy = sum(e - s for s, e, _ in kern)
    gaps = sorted(((b[0] - a[1], b[2][:40]) for a, b in zip(kern, kern[1:])), reverse=True)
    idle = sum(g for g, _ in gaps if g > 0)
    top = "; ".join(f"{g:.0f} {name}" for g, name in gaps[:3])
    return (
        f"| {wl} | {m} × {n} | {wall:.1f} | {statistics.median(enq):.1f} | "
        f"{busy / calls:.1f} | {idle / calls:.1f} | {top} |"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/host_floor")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    m, n = 1, 4096
    x = torch.randn(m, n, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(n, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    xs = x.detach()
    norm = torch.nn.RMSNorm(n, eps=1e-6, device=dev, dtype=torch.bfloat16)
    fused = fused_norm.RMSNorm(n, eps=1e-6, device=dev, dtype=torch.bfloat16)

    # A one-launch Triton kernel through its C launcher: the launch floor.
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(src, dst, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(dst + i, tl.load(src + i))

    y0 = torch.empty_like(xs)
    k = _copy[(1,)](xs, y0, N=n)
    from fused_norm.launch import Compiled

    c = Compiled(k, (1,))
    stream = torch._C._cuda_getCurrentRawStream(0)

    rows = {
        "torch.empty (1 x 4096)": lambda: torch.empty((m, n), dtype=torch.bfloat16, device=dev),
        "triton kernel[grid](...)": lambda: _copy[(1,)](xs, y0, N=n),
        "C launcher (launch.Compiled)": lambda: c(stream, [xs.data_ptr(), y0.data_ptr(), n]),
        "get raw stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "empty autograd Function fwd": lambda: _Empty.apply(x, w),
        "empty autograd Function fwd+bwd": lambda: torch.autograd.grad(
            _Empty.apply(x, w), (x, w), dy
        ),
        "torch nn.RMSNorm fwd": lambda: norm(x),
        "torch nn.RMSNorm fwd+bwd": lambda: torch.autograd.grad(norm(x), (x, norm.weight), dy),
        "fused_norm RMSNorm fwd": lambda: fused(x),
        "fused_norm RMSNorm fwd+bwd": lambda: torch.autograd.grad(fused(x), (x, fused.weight), dy),
        "fused_norm RMSNorm fwd, x without grad": lambda: fused(xs),
        "torch nn.RMSNorm fwd under no_grad": lambda: _no_grad(norm, x),
        "fused_norm RMSNorm fwd under no_grad": lambda: _no_grad(fused, x),
    }
    lines = [f"# Host floor: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "", "| what | µs per call |", "|---|---|"]  # fmt: skip
    for name, step in rows.items():
        t = per_call(step)
        lines.append(f"| {name} | {t:.1f} |")
        print(lines[-1], flush=True)
    for name in ("fused_norm RMSNorm fwd", "fused_norm RMSNorm fwd+bwd"):
        step = rows[name]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3000):
            step()
        torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        lines += ["", f"## cProfile of 3000 x {name} (tottime)", "", "```", s.getvalue(), "```"]
    lines += ["", "## fwd+bwd at M·N = 2**27, bf16 (µs per call)", "",
              "| workload | M × N | wall | enqueue | kernels | idle between kernels | "
              "longest gaps before |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    fused = HC.B.load_providers(["fused_norm"])[0][0]
    for wl in ("rms", "add_rms"):
        for n in (4096, 16384, 65536, 262144):
            lines.append(_gaps(wl, 2**27 // n, n, dev, fused))
            print(lines[-1], flush=True)
    (out / "host_floor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-60:]))


if __name__ == "__main__":
    main()

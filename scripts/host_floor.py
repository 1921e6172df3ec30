"""The host-time floor of a Python autograd.Function around one Triton launch, beside torch eager
and fused_norm, for small calls (M = 16, N = 4096, bf16, inputs requiring grad): microseconds
per call of back-to-back calls. It asks whether the small-batch target (no slower than torch
eager) is reachable by any design whose per-call path is Python: torch's LayerNorm is one C++
op, where a Python Function pays for apply, its context, the output allocations and a launch.

    python3 scripts/host_floor.py [--out FILE]
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's fused_norm
from _timing import per_call  # noqa: E402 - this scripts folder (on sys.path as the script's)

import fused_norm  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out")
opts = ap.parse_args()

dev = torch.device("cuda")
M, N = 16, 4096
bf = torch.bfloat16
x = torch.randn(M, N, device=dev, dtype=bf, requires_grad=True)
w = torch.ones(N, device=dev, dtype=bf, requires_grad=True)
b = torch.zeros(N, device=dev, dtype=bf, requires_grad=True)
dy = torch.randn_like(x)


@triton.jit
def _touch(X, Y, MEAN, RSTD, n, BLOCK: tl.constexpr):
    """A trivial kernel with a norm's pointers: one program per row copies 4 values."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    tl.store(Y + row * n + offs, tl.load(X + row * n + offs))
    tl.store(MEAN + row, 0.0)
    tl.store(RSTD + row, 1.0)


def launcher():
    """The compiled kernel's own launcher (what fused_norm.launch calls): its runtime
    arguments, then its constexpr values (BLOCK)."""
    y = torch.empty_like(x)
    mean = torch.empty(M, device=dev, dtype=torch.float32)
    k = _touch[(M,)](x, y, mean, mean, N, BLOCK=4)
    return k.run, k.function, k.packed_metadata


run, function, metadata = launcher()
y0, m0 = torch.empty_like(x), torch.empty(M, device=dev, dtype=torch.float32)
get_stream = triton.runtime.driver.active.get_current_stream


def launch(y, mean, rstd):
    run(M, 1, 1, get_stream(0), function, metadata, None, None, None,
        x.data_ptr(), y.data_ptr(), mean.data_ptr(), rstd.data_ptr(), N, 4)  # fmt: skip


class Bare(torch.autograd.Function):
    """Allocations and context of a norm's Function, no kernel (``LAUNCH``: one launch)."""

    LAUNCH = False

    @staticmethod
    def forward(ctx, x, w, b):
        y = torch.empty_like(x)
        mean = torch.empty(M, device=x.device, dtype=torch.float32)
        rstd = torch.empty(M, device=x.device, dtype=torch.float32)
        if Bare.LAUNCH:
            launch(y, mean, rstd)
        ctx.save_for_backward(x, w, b, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, b, mean, rstd = ctx.saved_tensors
        dx = torch.empty_like(x)
        dw = torch.empty_like(w)
        db = torch.empty_like(b)
        if Bare.LAUNCH:
            launch(dx, mean, rstd)
        return dx, dw, db


def fwd_bwd(f):
    def step():
        torch.autograd.grad(f(), (x, w, b), dy)

    return step


def bare(launch_on):
    def f():
        Bare.LAUNCH = launch_on
        return Bare.apply(x, w, b)

    return f


cases = [
    ("torch eager F.layer_norm", lambda: F.layer_norm(x, (N,), w, b)),
    ("empty Function (3 allocations, saved tensors)", bare(False)),
    ("empty Function + one direct Triton launch", bare(True)),
    ("fused_norm.layer_norm_fn", lambda: fused_norm.layer_norm_fn(x, w, b)),
]
lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}",
         f"M={M}, N={N}, bf16, inputs requiring grad; us per call (host wall time)",
         f"one direct Triton launch alone: {per_call(lambda: launch(y0, m0, m0)):.1f} us",
         f"torch.empty_like(x) alone: {per_call(lambda: torch.empty_like(x)):.1f} us"]  # fmt: skip
lines.append(f"{'':48s} {'fwd':>8s} {'fwd+bwd':>8s}")
for name, f in cases:
    lines.append(f"{name:48s} {per_call(f):8.1f} {per_call(fwd_bwd(f)):8.1f}")
text = "\n".join(lines)
print(text, flush=True)
if opts.out:
    with open(opts.out, "w") as fh:
        fh.write(text + "\n")

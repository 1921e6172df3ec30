"""Host time of small fused_norm calls (M = 16, N = 4096, bf16), where launches, not the GPU,
set the pace: microseconds per call of back-to-back calls, fused_norm with the direct launch
path on and off, torch eager beside it, and the pieces (one launch each way, one allocation).

    python3 scripts/profile_overhead.py [--profile] [--out FILE]

``--profile`` adds a cProfile of 300 add+RMSNorm forward+backward steps.
"""

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's fused_norm
from _timing import per_call  # noqa: E402 - this scripts folder (on sys.path as the script's)

import fused_norm  # noqa: E402
from fused_norm import launch, ops  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--profile", action="store_true")
ap.add_argument("--out")
opts = ap.parse_args()

dev = torch.device("cuda")
N, M = 4096, 16
bf = torch.bfloat16
torch.manual_seed(0)
x = torch.randn(M, N, device=dev, dtype=bf, requires_grad=True)
res = torch.randn_like(x, requires_grad=True)
w = torch.ones(N, device=dev, dtype=bf, requires_grad=True)
b = torch.zeros(N, device=dev, dtype=bf, requires_grad=True)
dy = torch.randn_like(x)
lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"]


def workloads():
    def add_rms():
        return fused_norm.rms_norm_fn(x, w, None, res, prenorm=True)

    def t_add_rms():
        s = x + res
        return F.rms_norm(s, (N,), w), s

    def ln():
        return (fused_norm.layer_norm_fn(x, w, b),)

    def t_ln():
        return (F.layer_norm(x, (N,), w, b),)

    def drop_ln():
        return fused_norm.layer_norm_fn(x, w, b, res, dropout_p=0.1, prenorm=True)

    def t_drop_ln():
        s = F.dropout(x, 0.1) + res
        return F.layer_norm(s, (N,), w, b), s

    return [("add_rms", add_rms, t_add_rms, (x, res, w)), ("ln", ln, t_ln, (x, w, b)),
            ("drop_add_ln", drop_ln, t_drop_ln, (x, res, w, b))]  # fmt: skip


def step_of(fwd, leaves):
    def step():
        outs = fwd()
        return torch.autograd.grad(outs, leaves, [dy] * len(outs))

    return step


def set_fast(on):
    for launcher in ops.launchers():
        launcher.fast = on and launch.FAST_LAUNCH


def no_grad(fwd, _):
    def step():
        with torch.no_grad():
            return fwd()

    return step


rows = []
for name, fused, eager, leaves in workloads():
    for mode, make in (("fwd", lambda f, _: f), ("fwd+bwd", step_of), ("no_grad", no_grad)):
        row = [name, mode]
        for fast in (True, False):
            set_fast(fast)
            row.append(per_call(make(fused, leaves)))
        set_fast(True)
        row.append(per_call(make(eager, leaves)))
        rows.append(row)
lines.append(f"M={M}, N={N}, bf16; us per call (host wall time of back-to-back calls)")
lines.append(f"{'workload':12s} {'mode':8s} {'direct':>8s} {'jit':>8s} {'torch':>8s}")
lines += [f"{r[0]:12s} {r[1]:8s} {r[2]:8.1f} {r[3]:8.1f} {r[4]:8.1f}" for r in rows]
# The no_grad rows skip the autograd Function (autograd._kernel_forward); through it instead:
graph_needed = fused_norm.autograd._graph_needed
fused_norm.autograd._graph_needed = lambda *t: True
for name, fused, _eager, leaves in workloads():
    lines.append(f"{name:12s} no_grad through the autograd Function: "
                 f"{per_call(no_grad(fused, leaves)):.1f} us")  # fmt: skip
fused_norm.autograd._graph_needed = graph_needed

# The pieces: one forward launch each way, an allocation.
y = torch.empty_like(x)
rstd = torch.empty(M, device=dev, dtype=torch.float32)


def launch_only():
    ops._fwd_launch(x.detach(), w.detach(), None, res.detach(), None, None, None, None, None,
                    None, y, None, None, None, rstd, None, None, 1e-6, 0.0, True, False)  # fmt: skip


for fast in (True, False):
    set_fast(fast)
    lines.append(f"one forward launch ({'direct' if fast else 'kernel[grid]'}): "
                 f"{per_call(launch_only):.1f} us")  # fmt: skip
set_fast(True)
lines.append(f"torch.empty(16, 4096): {per_call(lambda: torch.empty_like(x)):.1f} us")
text = "\n".join(lines)
print(text, flush=True)

if opts.profile:
    step = step_of(workloads()[0][1], (x, res, w))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    text += "\n\n" + s.getvalue()
if opts.out:
    with open(opts.out, "w") as f:
        f.write(text + "\n")

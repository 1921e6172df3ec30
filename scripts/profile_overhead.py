"""Host overhead of one fused_norm call (small M): wall time per call and a cProfile of it."""
import cProfile
import pstats
import time

import torch

import fused_norm
from fused_norm import ops

dev = "cuda"
N, M = 4096, 16
x = torch.randn(M, N, device=dev, dtype=torch.bfloat16, requires_grad=True)
res = torch.randn_like(x, requires_grad=True)
w = torch.ones(N, device=dev, requires_grad=True)
dy = torch.randn_like(x)


def fwd():
    with torch.no_grad():
        return fused_norm.rms_norm_fn(x, w, None, res, prenorm=True)


def step():
    y, r = fused_norm.rms_norm_fn(x, w, None, res, prenorm=True)
    return torch.autograd.grad([y, r], [x, res, w], [dy, dy])


def raw_launch():
    y = torch.empty_like(x)
    rstd = torch.empty(M, device=dev)
    ops._fwd_launch(x.detach(), w.detach(), None, res.detach(), None, None, None, None, None,
                    None, y, None, None, None, rstd, None, None, 1e-6, 0.0, True, False)


def torch_step():
    s = x + res
    y = torch.nn.functional.rms_norm(s, (N,), w)
    return torch.autograd.grad([y, s], [x, res, w], [dy, dy])


for name, fn in [("fwd", fwd), ("fwd+bwd", step), ("raw fwd launch", raw_launch),
                 ("torch fwd+bwd", torch_step)]:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    print(f"{name:>16}: {(time.perf_counter() - t) / 200 * 1e6:8.1f} us per call", flush=True)

pr = cProfile.Profile()
pr.enable()
for _ in range(200):
    step()
torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)

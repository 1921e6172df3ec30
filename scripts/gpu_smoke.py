"""Quick GPU correctness smoke: every feature at a few widths, fp32 and bf16, vs the fp64
reference (max abs error of outputs and grads). Prints one line per case."""

import sys

import torch

from fused_norm import layer_norm_fn, layer_norm_ref, rms_norm_ref

dev = "cuda"
torch.manual_seed(0)
worst = 0.0
for dtype in [torch.float32, torch.bfloat16]:
    for is_rms in [False, True]:
        for N in [1, 7, 300, 1024, 4096, 16384, 40000, 131072]:
            M = max(2, min(64, 2**20 // N))

            def mk(*shape, dtype=dtype):
                return torch.randn(*shape, device=dev, dtype=dtype).requires_grad_()

            x, res, x1 = mk(M, N), mk(M, N), mk(M, N)
            w, b, w1, b1 = mk(N), mk(N), mk(N), mk(N)
            rs = torch.rand(M, device=dev)
            p = 0.2
            flags = dict(dropout_p=p, rowscale=rs, prenorm=True, is_rms_norm=is_rms)
            y, y1, r, m, m1 = layer_norm_fn(
                x, w, b, res, x1, w1, b1, **flags, return_dropout_mask=True, residual_in_fp32=True
            )
            ref = rms_norm_ref if is_rms else layer_norm_ref
            leaves = [x, res, x1, w, b, w1, b1]
            dy, dy1, dr = torch.randn_like(y), torch.randn_like(y), torch.randn_like(r)
            g = torch.autograd.grad(
                (y.float() * dy).sum() + (y1.float() * dy1).sum() + (r.float() * dr).sum(), leaves
            )
            xd = [t.detach().double().requires_grad_() for t in leaves]
            xr, resr, x1r, wr, br, w1r, b1r = xd
            yr, y1r, rr = ref(
                xr, wr, br, resr, x1r, w1r, b1r, dropout_p=p, rowscale=rs.double(), prenorm=True,
                dropout_mask=m, dropout_mask1=m1,
            )  # fmt: skip
            gr = torch.autograd.grad(
                (yr * dy.double()).sum() + (y1r * dy1.double()).sum() + (rr * dr.double()).sum(), xd
            )
            errs = [
                ((a.double() - b_).abs().max() / b_.abs().max().clamp_min(1)).item()
                for a, b_ in zip([y, y1, r, *g], [yr, y1r, rr, *gr])
            ]
            worst = max(worst, max(errs)) if dtype == torch.float32 else worst
            print(
                str(dtype)[6:],
                "rms" if is_rms else "ln",
                N,
                " ".join(f"{e:.1e}" for e in errs),
                flush=True,
            )
print("worst fp32 relative error:", worst)
sys.exit(0 if worst < 1e-4 else 1)

"""Autocast: the fused ops are autocast-transparent. Under ``torch.autocast("cuda", bf16)``
nothing is cast on the way in: statistics are fp32, ``y`` has ``x``'s dtype (or ``out_dtype``),
the residual stream has ``residual``'s dtype (fp32 with ``residual_in_fp32`` and no residual,
else ``x``'s), parameter grads have the parameters' dtype, and the values are bitwise those of
the same call without autocast."""

from __future__ import annotations

import pytest
import torch
from _common import assert_bitwise, requires_gpu
from torch import nn

from fused_norm import DropoutAddLayerNorm, DropoutAddRMSNorm, LayerNorm, RMSNorm, layer_norm_fn

pytestmark = requires_gpu

BF16, FP32 = torch.bfloat16, torch.float32
D = 256


def _autocast():
    return torch.autocast("cuda", dtype=BF16)


def _norm(kind: str) -> nn.Module:
    torch.manual_seed(0)
    mod = {"layer": LayerNorm, "rms": RMSNorm}[kind](D).cuda()
    with torch.no_grad():  # away from the ones/zeros init, so a cast would show in the bits
        for p in mod.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mod


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(
    "x_dtype,res,residual_in_fp32,y_dtype,res_dtype",
    [
        # x dtype, residual given (dtype) or None, residual_in_fp32 -> y dtype, stream dtype
        (FP32, None, False, FP32, FP32),
        (BF16, None, False, BF16, BF16),
        (BF16, None, True, BF16, FP32),
        (BF16, FP32, False, BF16, FP32),
        (BF16, BF16, False, BF16, BF16),
        (BF16, BF16, True, BF16, BF16),  # a given residual decides the stream's dtype
        (FP32, BF16, False, FP32, BF16),
    ],
)  # fmt: skip
def test_module_dtypes_under_autocast(kind, x_dtype, res, residual_in_fp32, y_dtype, res_dtype):
    norm = _norm(kind)
    params = list(norm.parameters())
    torch.manual_seed(1)
    x = torch.randn(4, 16, D, device="cuda", dtype=x_dtype)
    residual = torch.randn(4, 16, D, device="cuda", dtype=res) if res is not None else None

    runs = {}
    for autocast in (True, False):
        xa = x.clone().requires_grad_()
        ra = residual.clone().requires_grad_() if residual is not None else None
        for p in params:
            p.grad = None
        with torch.autocast("cuda", dtype=BF16, enabled=autocast):
            y, s = norm(xa, ra, prenorm=True, residual_in_fp32=residual_in_fp32)
            # A loss built under autocast too, as in a training step.
            loss = (y.float() * 1.5).sum() + (s.float() * 0.5).sum()
        loss.backward()
        grads = [xa.grad] + ([ra.grad] if ra is not None else []) + [p.grad for p in params]
        runs[autocast] = (y, s, grads)

    y, s, grads = runs[True]
    assert y.dtype == y_dtype, f"y dtype {y.dtype}, expected {y_dtype}"
    assert s.dtype == res_dtype, f"residual_out dtype {s.dtype}, expected {res_dtype}"
    assert grads[0].dtype == x_dtype, f"x.grad dtype {grads[0].dtype}"
    if residual is not None:
        assert grads[1].dtype == res, f"residual.grad dtype {grads[1].dtype}"
    for p, g in zip(params, grads[-len(params) :]):
        assert g.dtype == FP32 == p.dtype, f"param grad dtype {g.dtype}"
    y_off, s_off, grads_off = runs[False]
    assert_bitwise(y, y_off, "y with vs without autocast")
    assert_bitwise(s, s_off, "residual_out with vs without autocast")
    for i, (g, g_off) in enumerate(zip(grads, grads_off)):
        assert_bitwise(g, g_off, f"grad {i} with vs without autocast")


@pytest.mark.parametrize("cls", [DropoutAddLayerNorm, DropoutAddRMSNorm])
def test_legacy_modules_under_autocast(cls):
    mod = cls(D, prenorm=True, p=0.0, residual_in_fp32=True).cuda()
    x = torch.randn(8, D, device="cuda", dtype=BF16, requires_grad=True)
    with _autocast():
        y, s = mod(x)
    assert y.dtype == BF16 and s.dtype == FP32
    (y.float().sum() + s.sum()).backward()
    assert x.grad.dtype == BF16
    assert all(p.grad.dtype == FP32 for p in mod.parameters())


def test_out_dtype_and_block_under_autocast():
    """out_dtype is honoured under autocast, and a Linear -> norm -> Linear block trains: the
    Linear emits bf16, the norm passes bf16 on, parameter grads stay fp32."""
    w = torch.ones(D, device="cuda", requires_grad=True)
    x = torch.randn(8, D, device="cuda", dtype=BF16)
    with _autocast():
        y = layer_norm_fn(x, w, None, out_dtype=FP32)
    assert y.dtype == FP32

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(D, D), LayerNorm(D, dropout_p=0.1), nn.Linear(D, D)).cuda()
    inp = torch.randn(4, 16, D, device="cuda")
    with _autocast():
        h = block[0](inp)
        assert h.dtype == BF16
        h = block[1](h)
        assert h.dtype == BF16, f"norm output {h.dtype} for a bf16 input under autocast"
        out = block[2](h)
        loss = out.float().square().mean()
    loss.backward()
    for name, p in block.named_parameters():
        assert p.grad is not None and p.grad.dtype == FP32, f"{name}.grad {p.grad}"
        assert torch.isfinite(p.grad).all(), name

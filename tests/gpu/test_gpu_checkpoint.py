"""Activation checkpointing: under ``torch.utils.checkpoint`` (reentrant and non-reentrant) the
recomputed forward draws the same dropout masks, so the gradients are bitwise those of the run
without checkpointing."""

from __future__ import annotations

import pytest
import torch
from _common import assert_bitwise, requires_gpu
from torch import nn
from torch.utils.checkpoint import checkpoint

from fused_norm import DropoutAddRMSNorm, LayerNorm, layer_norm_fn

pytestmark = requires_gpu

D, P, SEED = 512, 0.3, 1234


class _Block(nn.Module):
    def __init__(self, d: int, p: float):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.norm1 = LayerNorm(d, dropout_p=p)
        self.fc2 = nn.Linear(d, d)
        self.norm2 = DropoutAddRMSNorm(d, prenorm=False, p=p)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpoint_reproduces_dropout_and_grads_bitwise(use_reentrant):
    torch.manual_seed(0)
    block = _Block(D, P).cuda().train()
    params = list(block.parameters())
    x = torch.randn(4, 64, D, device="cuda", requires_grad=True)
    residual = torch.randn(4, 64, D, device="cuda", requires_grad=True)
    gy = torch.randn(4, 64, D, device="cuda")
    masks = []  # every mask the first norm draws, recomputations included

    def fn(x, residual):
        h = block.fc1(x)
        # The functional API with the module's parameters, so the mask itself is observable.
        y, res, mask, _ = layer_norm_fn(
            h, block.norm1.weight, block.norm1.bias, residual=residual, eps=block.norm1.eps,
            dropout_p=P, prenorm=True, return_dropout_mask=True,
        )  # fmt: skip
        masks.append(mask)
        return block.norm2(block.fc2(y), res)  # module dropout, training mode

    def run(wrapped):
        for t in (x, residual, *params):
            t.grad = None
        masks.clear()
        torch.manual_seed(SEED)
        out = wrapped(x, residual)
        # Reentrant checkpointing supports .backward() only (not torch.autograd.grad).
        out.backward(gy)
        return out.detach(), [t.grad.clone() for t in (x, residual, *params)], list(masks)

    out_plain, grads_plain, masks_plain = run(fn)
    out_ckpt, grads_ckpt, masks_ckpt = run(
        lambda a, r: checkpoint(fn, a, r, use_reentrant=use_reentrant)
    )

    assert len(masks_plain) == 1
    assert len(masks_ckpt) == 2, f"expected forward + recompute, saw {len(masks_ckpt)} calls"
    assert_bitwise(masks_ckpt[0], masks_plain[0], "forward mask under checkpoint")
    assert_bitwise(masks_ckpt[1], masks_ckpt[0], "recomputed mask")
    assert_bitwise(out_ckpt, out_plain, "output")
    names = ["x", "residual"] + [n for n, _ in block.named_parameters()]
    for name, g_ckpt, g_plain in zip(names, grads_ckpt, grads_plain):
        assert_bitwise(g_ckpt, g_plain, f"grad {name}")

"""Pure-PyTorch references: the ground truth for tests and benchmarks, and the CPU path.

They compute exactly the operation of the README, one op at a time, so that anyone can check
them by eye. ``upcast=True`` does the arithmetic in fp32 (fp64 inputs stay fp64); otherwise the
arithmetic runs in the inputs' own precision, the way a user would write it in plain PyTorch,
which is what the tests use as the "same-precision baseline" of the three-way tolerance rule.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

__all__ = ["layer_norm_ref", "rms_norm_ref"]


def _upcast(t: Optional[Tensor]) -> Optional[Tensor]:
    if t is None or t.dtype == torch.float64:
        return t
    return t.float()


def _dropout(x: Tensor, p: float, mask: Optional[Tensor]) -> Tensor:
    if p == 0.0:
        return x
    if mask is None:
        return F.dropout(x, p)
    return x.masked_fill(~mask, 0.0) / (1.0 - p)


def _rms_norm(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> Tensor:
    out = F.rms_norm(x, x.shape[-1:], weight=weight, eps=eps)  # fp32 sums for 16-bit inputs
    return out + bias if bias is not None else out


def _norm_ref(norm, x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale,
              prenorm, zero_centered_weight, dropout_mask, dropout_mask1, upcast):  # fmt: skip
    dtype = x.dtype
    if upcast:
        x, weight, bias, residual, x1, weight1, bias1, rowscale = map(
            _upcast, (x, weight, bias, residual, x1, weight1, bias1, rowscale)
        )
    if zero_centered_weight:
        weight = weight + 1.0
        if weight1 is not None:
            weight1 = weight1 + 1.0
    if rowscale is not None:
        x = x * rowscale[..., None].to(x.dtype)
    x = _dropout(x, dropout_p, dropout_mask)
    if x1 is not None:
        x = x + _dropout(x1, dropout_p, dropout_mask1)
    if residual is not None:
        x = x + residual
    # The norm runs in the parameters' dtype (fp32 master weights give fp32 maths), as a user
    # composing torch.nn.functional ops by hand would write it.
    xn = x.to(weight.dtype)
    out = norm(xn, weight, bias, eps).to(dtype)
    outs = [out]
    if weight1 is not None:
        outs.append(norm(xn, weight1, bias1, eps).to(dtype))
    if prenorm:
        outs.append(x)
    return outs[0] if len(outs) == 1 else tuple(outs)


def layer_norm_ref(
    x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
    rowscale=None, prenorm=False, zero_centered_weight=False, dropout_mask=None,
    dropout_mask1=None, upcast=False,
):  # fmt: skip
    """Reference dropout + residual add + LayerNorm.

    Args:
        x: ``(..., N)`` input. weight, bias: ``(N,)`` (bias may be None).
        residual: optional ``(..., N)`` residual added after dropout.
        x1, weight1, bias1: optional second input path / second output (see README).
        eps: variance epsilon. dropout_p: drop probability; kept values are scaled by 1/(1-p).
        rowscale: optional ``(...,)`` per-row scale of ``x`` applied before dropout.
        prenorm: also return the pre-norm residual stream.
        zero_centered_weight: use ``1 + weight`` (and ``1 + weight1``) as the scale.
        dropout_mask, dropout_mask1: bool masks (True = kept) to use instead of fresh dropout.
        upcast: compute in fp32 (fp64 stays fp64) instead of the inputs' precision.

    Returns:
        ``out``, ``(out, x)`` with prenorm, ``(out, out1)`` / ``(out, out1, x)`` with weight1;
        ``out`` in ``x``'s dtype, the residual stream ``x`` in the computation dtype.
    """

    def norm(t, w, b, e):
        return F.layer_norm(t, t.shape[-1:], weight=w, bias=b, eps=e)

    return _norm_ref(
        norm, x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale,
        prenorm, zero_centered_weight, dropout_mask, dropout_mask1, upcast,
    )  # fmt: skip


def rms_norm_ref(
    x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
    rowscale=None, prenorm=False, zero_centered_weight=False, dropout_mask=None,
    dropout_mask1=None, upcast=False,
):  # fmt: skip
    """Reference dropout + residual add + RMSNorm; same arguments and returns as
    :func:`layer_norm_ref`, with ``y = s / sqrt(mean(s^2) + eps) * w + b``."""
    return _norm_ref(
        _rms_norm, x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale,
        prenorm, zero_centered_weight, dropout_mask, dropout_mask1, upcast,
    )  # fmt: skip

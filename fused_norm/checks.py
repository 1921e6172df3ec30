"""Argument validation: the one place where a call's arguments are checked (both backends),
and the call's scalars as the layers below take them. Imports nothing but torch."""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TORCH_DTYPES = KERNEL_DTYPES + (torch.float64,)


class Flags(NamedTuple):
    """A call's scalars and switches (the same for every call of a signature)."""

    eps: float
    dropout_p: float
    prenorm: bool
    residual_dtype: torch.dtype
    zero_centered_weight: bool
    is_rms_norm: bool
    return_dropout_mask: bool
    out_dtype: torch.dtype


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _check_tensor(name, t, shape, device, dtypes, optional=True):
    if t is None:
        if not optional:
            raise TypeError(f"{name} must be a tensor, got None")
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have a floating dtype in ({names}), got {t.dtype}")
    if t.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(
            f"{name} is on {t.device} but x is on {device}; put all tensors on one device"
        )


def _is_real(v) -> bool:
    t = type(v)
    return t is float or t is int or (t is not bool and isinstance(v, numbers.Real))


def check_args(
    x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
    rowscale=None, layerscale=None, out_dtype=None, out=None, residual_out=None,
    residual_dtype=None, kernel=True,
):  # fmt: skip
    """Raise a TypeError/ValueError naming the first bad argument; return nothing."""
    dtypes = KERNEL_DTYPES if kernel else TORCH_DTYPES
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"x must have a floating dtype in ({names}), got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(
            f"x must have a non-empty last (hidden) dimension, got shape {tuple(x.shape)}"
        )
    n, dev = x.shape[-1], x.device
    _check_tensor("weight", weight, (n,), dev, dtypes, optional=False)
    _check_tensor("bias", bias, (n,), dev, dtypes)
    _check_tensor("residual", residual, x.shape, dev, dtypes)
    _check_tensor("x1", x1, x.shape, dev, dtypes)
    _check_tensor("weight1", weight1, (n,), dev, dtypes)
    _check_tensor("bias1", bias1, (n,), dev, dtypes)
    if bias1 is not None and weight1 is None:
        raise ValueError("bias1 was given without weight1")
    _check_tensor("rowscale", rowscale, x.shape[:-1], dev, dtypes)
    _check_tensor("layerscale", layerscale, (n,), dev, dtypes)
    if not _is_real(dropout_p):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}")
    if not _is_real(eps):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (0.0 <= eps < math.inf):  # also false for NaN
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if out_dtype is not None and out_dtype not in dtypes:
        raise TypeError(f"out_dtype must be one of {dtypes} or None, got {out_dtype}")
    for name, buf, dtype in (("out", out, out_dtype or x.dtype),
                             ("residual_out", residual_out, residual_dtype)):  # fmt: skip
        if buf is None:
            continue
        _check_tensor(name, buf, x.shape, dev, None)
        if dtype is not None and buf.dtype != dtype:
            raise TypeError(f"{name} must have dtype {dtype}, got {buf.dtype}")
        if buf.numel() and buf.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
        if buf.numel() and row_stride(buf) is None:
            raise ValueError(f"{name} must be viewable as (M, N) rows without a copy")


def row_stride(t) -> Optional[int]:
    """The stride between rows of ``t`` viewed as ``(M, N)`` with unit column stride, or None
    where that view needs a copy."""
    if t.dim() == 1:
        return t.shape[0]
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return None
    rs = t.stride(-2)
    size = t.shape[-2]
    for d in range(t.dim() - 3, -1, -1):  # leading dims must collapse into rows
        if t.shape[d] != 1 and size != 1 and t.stride(d) != rs * size:
            return None
        if t.shape[d] != 1 and size == 1:
            rs = t.stride(d)
        size *= t.shape[d]
    return rs if size > 1 else t.shape[-1]

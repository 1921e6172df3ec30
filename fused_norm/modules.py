"""nn.Module wrappers. Parameters are plain ``nn.Parameter``s initialised like torch.nn, so
``state_dict``, ``.to()``, DDP and FSDP treat them like any other norm layer. Dropout applies
only in training mode. Constructors validate their arguments as torch.nn's do."""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from .functional import fused_norm

__all__ = ["DropoutAddLayerNorm", "DropoutAddRMSNorm", "LayerNorm", "RMSNorm"]


def _check_init(cls, hidden_size, eps, p, p_name):
    name = cls.__name__
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, numbers.Integral):
        raise TypeError(f"{name}: hidden_size must be an int, got {type(hidden_size).__name__}")
    if hidden_size <= 0:
        raise ValueError(f"{name}: hidden_size must be positive, got {hidden_size}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{name}: eps must be a float, got {type(eps).__name__}")
    if not 0.0 <= eps < math.inf:
        raise ValueError(f"{name}: eps must be a finite number >= 0, got {eps}")
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"{name}: {p_name} must be a float, got {type(p).__name__}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name}: {p_name} must lie in [0, 1), got {p}")


class _Norm(nn.Module):
    def __init__(self, hidden_size, eps, zero_centered_weight, bias, device, dtype):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        self.zero_centered_weight = bool(zero_centered_weight)
        self.weight = nn.Parameter(torch.empty(self.hidden_size, **factory))
        self.bias = nn.Parameter(torch.empty(self.hidden_size, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        # The effective scale is 1 either way: ``1 + 0`` for zero-centred weights.
        if self.zero_centered_weight:
            nn.init.zeros_(self.weight)
        else:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _call(self, x, residual, p, prenorm, residual_in_fp32, zero_centered_weight):
        """fused_norm on this module's parameters: ``y``, or ``(y, residual_out)`` with
        prenorm; dropout only in training."""
        if type(x) is not torch.Tensor or not x.dim() or x.shape[-1] != self.hidden_size:
            self._check_input(x)
        y, _, res_out, _, _ = fused_norm(
            x, self.weight, self.bias, residual, None, None, None, self.eps,
            p if self.training else 0.0, None, None, prenorm, residual_in_fp32,
            zero_centered_weight, self._is_rms,
        )  # fmt: skip
        return (y, res_out) if prenorm else y

    def _check_input(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{type(self).__name__} expects a tensor input, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"{type(self).__name__}({self.hidden_size}) expects inputs whose last dimension "
                f"is its hidden size {self.hidden_size}, got an input of shape {tuple(x.shape)}"
            )


class LayerNorm(_Norm):
    """LayerNorm with optional fused dropout and residual add (see :func:`layer_norm_fn`).

    ``forward(x, residual=None, prenorm=False, residual_in_fp32=False)`` returns ``y``, or
    ``(y, residual_out)`` with prenorm."""

    _is_rms = False

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False,
                 bias=True, device=None, dtype=None):  # fmt: skip
        _check_init(type(self), hidden_size, eps, dropout_p, "dropout_p")
        super().__init__(hidden_size, eps, zero_centered_weight, bias, device, dtype)
        self.dropout_p = float(dropout_p)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return self._call(x, residual, self.dropout_p, prenorm, residual_in_fp32,
                          self.zero_centered_weight)  # fmt: skip

    def extra_repr(self):
        return (f"{self.hidden_size}, eps={self.eps}, dropout_p={self.dropout_p}, "
                f"zero_centered_weight={self.zero_centered_weight}, bias={self.bias is not None}")  # fmt: skip


class RMSNorm(LayerNorm):
    """RMSNorm (no bias) with optional fused dropout and residual add (see :func:`rms_norm_fn`)."""

    _is_rms = True

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False,
                 device=None, dtype=None):  # fmt: skip
        super().__init__(hidden_size, eps, dropout_p, zero_centered_weight, False, device, dtype)

    def extra_repr(self):
        return (f"{self.hidden_size}, eps={self.eps}, dropout_p={self.dropout_p}, "
                f"zero_centered_weight={self.zero_centered_weight}")  # fmt: skip


class DropoutAddLayerNorm(_Norm):
    """``LayerNorm(dropout(x0) + residual)``; with prenorm returns ``(y, residual_out)``, the
    residual stream for the next block (flash-attn's module of the same name)."""

    _is_rms = False
    _has_bias = True

    def __init__(self, hidden_size, prenorm=False, p=0.0, eps=1e-5, residual_in_fp32=False,
                 device=None, dtype=None):  # fmt: skip
        _check_init(type(self), hidden_size, eps, p, "p")
        super().__init__(hidden_size, eps, False, self._has_bias, device, dtype)
        self.prenorm = bool(prenorm)
        self.p = float(p)
        self.residual_in_fp32 = bool(residual_in_fp32)

    def forward(self, x0, residual=None):
        return self._call(x0, residual, self.p, self.prenorm, self.residual_in_fp32, False)

    def extra_repr(self):
        return (f"{self.hidden_size}, prenorm={self.prenorm}, p={self.p}, eps={self.eps}, "
                f"residual_in_fp32={self.residual_in_fp32}")  # fmt: skip


class DropoutAddRMSNorm(DropoutAddLayerNorm):
    """``RMSNorm(dropout(x0) + residual)`` with a weight and no bias."""

    _is_rms = True
    _has_bias = False

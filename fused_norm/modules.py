"""nn.Module wrappers. Parameters are plain ``nn.Parameter``s initialised like torch.nn, so
``state_dict``, ``.to()``, DDP and FSDP treat them like any other norm layer. Dropout applies
only in training mode."""

from __future__ import annotations

import torch
from torch import nn

from .autograd import dropout_add_layer_norm, dropout_add_rms_norm, layer_norm_fn

__all__ = ["DropoutAddLayerNorm", "DropoutAddRMSNorm", "LayerNorm", "RMSNorm"]


class _Norm(nn.Module):
    def __init__(self, hidden_size, eps, zero_centered_weight, bias, device, dtype):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_weight = zero_centered_weight
        self.weight = nn.Parameter(torch.empty(hidden_size, **factory))
        self.bias = nn.Parameter(torch.empty(hidden_size, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        # The effective scale is 1 either way: ``1 + 0`` for zero-centred weights.
        if self.zero_centered_weight:
            nn.init.zeros_(self.weight)
        else:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class LayerNorm(_Norm):
    """LayerNorm with optional fused dropout and residual add (see :func:`layer_norm_fn`)."""

    _is_rms = False

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False,
                 bias=True, device=None, dtype=None):  # fmt: skip
        super().__init__(hidden_size, eps, zero_centered_weight, bias, device, dtype)
        self.dropout_p = dropout_p

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        """``y`` or ``(y, residual_out)`` with prenorm, for ``x`` of shape ``(..., hidden)``."""
        return layer_norm_fn(
            x, self.weight, self.bias, residual=residual, eps=self.eps,
            dropout_p=self.dropout_p if self.training else 0.0, prenorm=prenorm,
            residual_in_fp32=residual_in_fp32, zero_centered_weight=self.zero_centered_weight,
            is_rms_norm=self._is_rms,
        )  # fmt: skip

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

    _fn = staticmethod(dropout_add_layer_norm)
    _has_bias = True

    def __init__(self, hidden_size, prenorm=False, p=0.0, eps=1e-5, residual_in_fp32=False,
                 device=None, dtype=None):  # fmt: skip
        super().__init__(hidden_size, eps, False, self._has_bias, device, dtype)
        self.prenorm = prenorm
        self.p = p
        self.residual_in_fp32 = residual_in_fp32

    def forward(self, x0, residual=None):
        return self._fn(
            x0, residual, self.weight, self.bias, self.p if self.training else 0.0, self.eps,
            prenorm=self.prenorm, residual_in_fp32=self.residual_in_fp32,
        )  # fmt: skip

    def extra_repr(self):
        return (f"{self.hidden_size}, prenorm={self.prenorm}, p={self.p}, eps={self.eps}, "
                f"residual_in_fp32={self.residual_in_fp32}")  # fmt: skip


class DropoutAddRMSNorm(DropoutAddLayerNorm):
    """``RMSNorm(dropout(x0) + residual)`` with a weight and no bias."""

    _fn = staticmethod(dropout_add_rms_norm)
    _has_bias = False

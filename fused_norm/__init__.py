"""fused_norm: fused dropout + residual add + LayerNorm/RMSNorm for transformer training.

Layers, from the user down: ``modules`` (nn.Modules) -> ``autograd`` (functional API and the
autograd Function) -> ``ops`` (validation and launchers) -> ``kernels`` (Triton). ``reference``
is the pure-PyTorch ground truth and CPU path; ``config`` holds the launch heuristics.
"""

from .autograd import (
    dropout_add_layer_norm,
    dropout_add_layer_norm_parallel_residual,
    dropout_add_rms_norm,
    dropout_add_rms_norm_parallel_residual,
    layer_norm_fn,
    rms_norm_fn,
)
from .modules import DropoutAddLayerNorm, DropoutAddRMSNorm, LayerNorm, RMSNorm
from .reference import layer_norm_ref, rms_norm_ref

__version__ = "0.1.0"

__all__ = [
    "layer_norm_fn",
    "rms_norm_fn",
    "dropout_add_layer_norm",
    "dropout_add_rms_norm",
    "dropout_add_layer_norm_parallel_residual",
    "dropout_add_rms_norm_parallel_residual",
    "layer_norm_ref",
    "rms_norm_ref",
    "DropoutAddLayerNorm",
    "DropoutAddRMSNorm",
    "LayerNorm",
    "RMSNorm",
]

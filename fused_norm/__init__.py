"""fused_norm: fused dropout + residual add + LayerNorm/RMSNorm for transformer training.

Layers, from the user down (each imports only the ones below it): ``hf`` (drop-in for
Hugging Face models) -> ``modules`` (nn.Modules) -> ``functional`` (functional API, autograd,
backend switch) -> ``ops`` (launch plans, allocation, launches; ``checks`` validates) ->
``heuristics`` (launch rules and the tuned tables) -> ``kernels`` (Triton). ``reference`` is
the pure-PyTorch ground truth and CPU path.
"""

from .functional import (
    dropout_add_layer_norm,
    dropout_add_layer_norm_parallel_residual,
    dropout_add_rms_norm,
    dropout_add_rms_norm_parallel_residual,
    layer_norm_fn,
    rms_norm_fn,
)
from .hf import replace_norms, restore_norms
from .modules import DropoutAddLayerNorm, DropoutAddRMSNorm, LayerNorm, RMSNorm
from .reference import layer_norm_ref, rms_norm_ref

__version__ = "0.2.0"

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
    "replace_norms",
    "restore_norms",
]

"""fused_norm's kernels: ``@triton.jit`` (and Gluon) code only, importing nothing from the host
layers.

* ``forward.py``: ``_fused_norm_fwd_kernel``, dropout + residual add + LayerNorm / RMSNorm of
  each row (one block, a tile of narrow rows, chunks, or a row split over several programs).
* ``backward.py``: ``_fused_norm_bwd_kernel`` (a persistent grid of row blocks writing fp32
  partial parameter gradients), ``_bwd_row_sums_kernel`` (the row sums of rows wider than one
  block, where the column blocks do not exchange them) and ``_sum_partials_kernel`` (the
  partials summed in a fixed order and cast to each parameter's dtype).
* ``hopper.py``: ``_bwd_smem_kernel``, the Gluon backward that stages rows through shared
  memory (Hopper); present where ``HOPPER_AVAILABLE``.
* ``common.py``: the dropout draws and the paired sums both directions share.
"""

from .backward import _bwd_row_sums_kernel, _fused_norm_bwd_kernel, _sum_partials_kernel
from .common import INTERPRETED
from .forward import _fused_norm_fwd_kernel
from .hopper import AVAILABLE as HOPPER_AVAILABLE

__all__ = [
    "HOPPER_AVAILABLE",
    "INTERPRETED",
    "_bwd_row_sums_kernel",
    "_fused_norm_bwd_kernel",
    "_fused_norm_fwd_kernel",
    "_sum_partials_kernel",
]

if HOPPER_AVAILABLE:
    from .hopper import _bwd_smem_kernel as _bwd_smem_kernel

    __all__.append("_bwd_smem_kernel")

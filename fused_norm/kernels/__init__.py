"""fused_norm's kernels: ``@triton.jit`` (and Gluon) code only, importing nothing from the host
layers. ``forward.py``: ``_fused_norm_fwd_kernel``; ``backward.py``: ``_fused_norm_bwd_kernel``,
``_bwd_row_sums_kernel``, ``_sum_partials_kernel``; ``hopper.py``: ``_bwd_smem_kernel``, present
where ``HOPPER_AVAILABLE``; ``common.py``: the dropout draws and paired sums they share. What each
does: its module docstring, and docs/design.md.
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

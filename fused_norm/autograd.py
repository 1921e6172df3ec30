"""The autograd Function, backend selection and the functional entry points.

``layer_norm_fn`` / ``rms_norm_fn`` are call-compatible with flash-attn's Triton layer norm;
``dropout_add_*`` with its CUDA-era wrappers. All of them funnel into :func:`fused_norm`, which
validates once, picks the backend (``FUSED_NORM_BACKEND``) and assembles the return tuple.
"""

from __future__ import annotations

import os

import torch

from . import ops
from .kernels import _fused_norm_fwd_kernel
from .reference import layer_norm_ref, rms_norm_ref

__all__ = [
    "layer_norm_fn",
    "rms_norm_fn",
    "dropout_add_layer_norm",
    "dropout_add_rms_norm",
    "dropout_add_layer_norm_parallel_residual",
    "dropout_add_rms_norm_parallel_residual",
]

# Triton decides at decoration time whether a kernel is compiled or interpreted, so the CPU
# path through the kernels exists only if TRITON_INTERPRET=1 was set before this import.
KERNELS_INTERPRETED = type(_fused_norm_fwd_kernel).__name__ == "InterpretedFunction"
_KERNEL_DEVICE_TYPES = ("cuda", "xpu")


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the Triton kernels serve ``x``, from ``FUSED_NORM_BACKEND`` (read per call)."""
    value = os.environ.get("FUSED_NORM_BACKEND", "")
    backend = "auto" if value == "" or value == "auto" else _backend(value)
    runnable = x.device.type in _KERNEL_DEVICE_TYPES or KERNELS_INTERPRETED
    if backend == "auto":
        return runnable
    if backend == "torch":
        return False
    if not runnable:
        raise RuntimeError(
            f"FUSED_NORM_BACKEND=triton, but the Triton kernels cannot run on {x.device}: "
            "use a GPU tensor, or set TRITON_INTERPRET=1 before importing fused_norm"
        )
    return True


def _backend(value: str) -> str:
    backend = value.strip().lower() or "auto"
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"FUSED_NORM_BACKEND must be 'auto', 'triton' or 'torch', got {value!r}")
    return backend


def _rows(t):
    """(..., N) -> (M, N) with a contiguous last dim (a view when possible)."""
    if t is None:
        return None
    if t.dim() != 2:
        t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _flat(t):
    """(..., N) -> (M, N), without looking at strides (torch.compile traces the backward with
    gradients whose strides it does not know yet)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _shaped(t, shape):
    """A 2-D result as ``shape`` (itself where that is already its shape)."""
    return t if t is None or len(shape) == 2 else t.view(shape)


def _kernel_forward(x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, out,
                    residual_out, opts, ctx=None):  # fmt: skip
    """The forward through the kernels: ``(y, y1, residual_out, mask, mask1)``, shaped like x.

    With ``ctx`` (FusedNormFunction.forward) it saves what the backward needs; without (no
    autograd graph to record: fused_norm's path for inference) nothing. Either way the kernels
    store the pre-norm sum unless it is x itself and normalise it as stored, so that both give
    bitwise the same outputs (activation checkpointing may run one and then the other).
    """
    (eps, dropout_p, prenorm, residual_dtype, zero_centered_weight, is_rms_norm,
     return_dropout_mask, out_dtype) = opts  # fmt: skip
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x)
    m = x2.shape[0]
    seeds, fill_seeds = None, False
    if dropout_p > 0.0:
        # One seed per row of x and x1, from torch's generator (replayed by activation
        # checkpointing, which restores the RNG state; no host sync). torch.compile traces
        # their draw on the device here; an eager forward fills them itself (ops._fwd_run).
        count = 2 * m if x1 is not None else m
        if torch.compiler.is_compiling():
            seeds = ops.draw_seeds(count, x.device)
        else:
            seeds = torch.empty((count,), device=x.device, dtype=torch.int64)
            fill_seeds = True
    # The backward needs the normalised sum s; store it unless it is x itself.
    s_is_x = (
        residual is None and x1 is None and rowscale is None and layerscale is None
        and dropout_p == 0.0 and residual_dtype == x.dtype
    )  # fmt: skip
    if rowscale is not None:
        rowscale = rowscale.reshape(-1).contiguous()
    # The kernels read parameters with unit stride (contiguous() is free where they are).
    weight = weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    if weight1 is not None:
        weight1 = weight1.contiguous()
        bias1 = bias1.contiguous() if bias1 is not None else None
    layerscale = layerscale.contiguous() if layerscale is not None else None
    dtypes = (
        x.dtype,
        residual.dtype if residual is not None else None,
        x1.dtype if x1 is not None else None,
    )
    warm_bwd = None
    if ctx is not None and any(ctx.needs_input_grad) and not torch.compiler.is_compiling():

        def warm_bwd(y, y1, res_out, mean, rstd):
            # The backward this forward's first compile will be followed by, with the
            # outputs standing in for their gradients: compiled meanwhile.
            ops.fused_norm_bwd(
                y, x2 if s_is_x else res_out, weight, bias, weight1, bias1, mean, rstd,
                dy1=y1, dresidual_out=res_out if prenorm else None,
                x0=x2 if layerscale is not None else None, layerscale=layerscale,
                rowscale=rowscale, seeds=seeds, dropout_p=dropout_p, is_rms_norm=is_rms_norm,
                zero_centered_weight=zero_centered_weight, x_dtype=dtypes[0],
                residual_dtype=dtypes[1], x1_dtype=dtypes[2], warm=True,
            )  # fmt: skip

    y, y1, res_out, mean, rstd, mask, mask1 = ops.fused_norm_fwd(
        x2, weight, bias, _rows(residual), _rows(x1), weight1, bias1, rowscale, layerscale,
        seeds, eps, dropout_p, is_rms_norm, zero_centered_weight, out_dtype or x.dtype,
        residual_dtype, store_residual_out=prenorm or not s_is_x,
        store_mask=return_dropout_mask,
        y=out.view(-1, n) if out is not None else None,
        residual_out=residual_out.view(-1, n) if residual_out is not None else None,
        warm_bwd=warm_bwd, fill_seeds=fill_seeds,
    )  # fmt: skip
    if ctx is not None:
        # Save a caller's residual_out buffer itself, not a view of it made here: it is marked
        # dirty below, and autograd refuses views of dirtied tensors made inside forward.
        saved_s = x2 if s_is_x else (residual_out if residual_out is not None else res_out)
        ctx.save_for_backward(
            saved_s, weight, bias, weight1, bias1, rowscale, layerscale,
            seeds, mean, rstd, x2 if layerscale is not None else None,
        )  # fmt: skip
        ctx.shape = shape
        ctx.dtypes = dtypes
        ctx.flags = (dropout_p, is_rms_norm, zero_centered_weight, prenorm)
        ctx.set_materialize_grads(False)
        if out is not None or (prenorm and residual_out is not None):
            ctx.mark_dirty(*(t for t in (out, residual_out if prenorm else None) if t is not None))
    y = out if out is not None else _shaped(y, shape)
    if prenorm:
        res_out = residual_out if residual_out is not None else _shaped(res_out, shape)
    else:
        res_out = None
    # Bool masks need no mark_non_differentiable: autograd never differentiates bool outputs.
    return y, _shaped(y1, shape), res_out, _shaped(mask, shape), _shaped(mask1, shape)


class FusedNormFunction(torch.autograd.Function):
    """Forward and backward through the Triton kernels.

    Inputs: the tensors, then ``opts = (eps, dropout_p, prenorm, residual_dtype,
    zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype)`` (one argument: each
    argument of ``apply`` costs host time). Outputs ``(y, y1, residual_out, mask, mask1)``, each
    None where absent.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, out,
                residual_out, opts):  # fmt: skip
        return _kernel_forward(x, weight, bias, residual, x1, weight1, bias1, rowscale,
                               layerscale, out, residual_out, opts, ctx)  # fmt: skip

    @staticmethod
    def backward(ctx, dy, dy1, dresidual_out, _dmask, _dmask1):
        s, weight, bias, weight1, bias1, rowscale, layerscale, seeds, mean, rstd, x0 = (
            ctx.saved_tensors
        )
        dropout_p, is_rms_norm, zero_centered_weight, prenorm = ctx.flags
        x_dtype, residual_dtype, x1_dtype = ctx.dtypes
        shape = ctx.shape
        s = _flat(s)
        # Grads of unused outputs arrive as None: zeros for y/y1, "absent" for the stream.
        # (.contiguous() is free for the usual contiguous grads, and keeps strides out of the
        # graph that torch.compile traces for this backward.)
        dy = _flat(dy).contiguous() if dy is not None else torch.zeros_like(s, dtype=x_dtype)
        if weight1 is not None:
            dy1 = _flat(dy1).contiguous() if dy1 is not None else torch.zeros_like(dy)
        if prenorm and dresidual_out is not None:
            dresidual_out = _flat(dresidual_out).contiguous()
        dx, dw, db, dres, dx1, dw1, db1, dls = ops.fused_norm_bwd(
            dy, s, weight, bias, weight1, bias1, mean, rstd, dy1=dy1,
            dresidual_out=dresidual_out if prenorm else None, x0=x0,
            layerscale=layerscale, rowscale=rowscale, seeds=seeds, dropout_p=dropout_p,
            is_rms_norm=is_rms_norm, zero_centered_weight=zero_centered_weight,
            x_dtype=x_dtype, residual_dtype=residual_dtype, x1_dtype=x1_dtype,
        )  # fmt: skip

        # Where dresidual / dx1 equal dx, return the very same tensor object (not a second view
        # of it): autograd then copies before accumulating one of them into a leaf's .grad,
        # instead of letting two .grad fields share storage.
        dx_full = _shaped(dx, shape)

        def full(t):
            return dx_full if t is dx else _shaped(t, shape)

        return dx_full, dw, db, full(dres), full(dx1), dw1, db1, None, dls, None, None, None


def _graph_needed(*tensors) -> bool:
    """Whether autograd would record a graph through these inputs."""
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


def _torch_forward(
    x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, eps, dropout_p,
    residual_dtype, zero_centered_weight, is_rms_norm, out_dtype, out, residual_out, prenorm,
):  # fmt: skip
    """The same operation through the reference, in fp32 (fp64 for fp64 inputs)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    if layerscale is not None:
        x = x * layerscale
    mask = mask1 = None
    if dropout_p > 0.0:
        # Contiguous masks: the draw must not depend on the inputs' memory layout.
        mask = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1.0 - dropout_p)
        if x1 is not None:
            mask1 = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(
                1.0 - dropout_p
            )

    def up(t):
        return t.to(compute) if t is not None else None

    ref = rms_norm_ref if is_rms_norm else layer_norm_ref
    outs = ref(
        up(x), up(weight), up(bias), up(residual), up(x1), up(weight1), up(bias1), eps,
        dropout_p, up(rowscale), prenorm=True, zero_centered_weight=zero_centered_weight,
        dropout_mask=mask, dropout_mask1=mask1,
    )  # fmt: skip
    y, s = outs[0], outs[-1]
    y1 = outs[1] if weight1 is not None else None
    y = y.to(out_dtype or x.dtype)
    y1 = y1.to(out_dtype or x.dtype) if y1 is not None else None
    s = s.to(residual_dtype) if prenorm else None
    if out is not None:
        y = out.copy_(y)
    if residual_out is not None and s is not None:
        s = residual_out.copy_(s)
    return y, y1, s, mask, mask1


def fused_norm(
    x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6,
    dropout_p=0.0, rowscale=None, layerscale=None, prenorm=False, residual_in_fp32=False,
    zero_centered_weight=False, is_rms_norm=False, return_dropout_mask=False, out_dtype=None,
    out=None, residual_out=None,
):  # fmt: skip
    """The one entry point: returns the tuple ``(y, y1, residual_out, mask, mask1)``."""
    if residual is not None and isinstance(residual, torch.Tensor):
        residual_dtype = residual.dtype
    elif residual_in_fp32:
        residual_dtype = torch.float32
    else:
        residual_dtype = getattr(x, "dtype", None)
    kernels = isinstance(x, torch.Tensor) and use_kernels(x)
    ops.check_args(
        x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, layerscale,
        out_dtype, out, residual_out if prenorm else None, residual_dtype, kernel=kernels,
    )  # fmt: skip
    if kernels:
        opts = (float(eps), float(dropout_p), bool(prenorm), residual_dtype,
                bool(zero_centered_weight), bool(is_rms_norm), bool(return_dropout_mask), out_dtype)  # fmt: skip
        args = (x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, out,
                residual_out if prenorm else None, opts)  # fmt: skip
        graph = _graph_needed(x, weight, bias, residual, x1, weight1, bias1, layerscale)
        if not graph and out is None and residual_out is None:
            # No autograd graph to record (inference): the Function's host time is skipped.
            return _kernel_forward(*args)
        return FusedNormFunction.apply(*args)
    return _torch_forward(
        x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, eps, dropout_p,
        residual_dtype, zero_centered_weight, is_rms_norm, out_dtype, out,
        residual_out if prenorm else None, prenorm,
    )  # fmt: skip


def _pack(y, y1, res_out, mask, mask1, has_w1, prenorm, return_dropout_mask):
    outs = [y]
    if has_w1:
        outs.append(y1)
    if prenorm:
        outs.append(res_out)
    if return_dropout_mask:
        outs += [mask, mask1]
    return outs[0] if len(outs) == 1 else tuple(outs)


def layer_norm_fn(
    x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
    rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False,
    is_rms_norm=False, return_dropout_mask=False, out_dtype=None, out=None, residual_out=None,
):  # fmt: skip
    """Fused ``[rowscale] -> dropout -> (+ dropout(x1)) -> (+ residual) -> LayerNorm/RMSNorm``.

    Args:
        x: ``(..., N)`` input (fp32, fp16 or bf16; also fp64 on the PyTorch backend).
        weight: ``(N,)`` scale; bias: ``(N,)`` or None.
        residual: ``(..., N)`` residual added after dropout, or None.
        x1: ``(..., N)`` second input, dropped out with its own mask and added; weight1 /
            bias1: ``(N,)`` second scale/shift giving a second output from the same statistics.
        eps: variance epsilon (finite, >= 0). dropout_p: drop probability in [0, 1).
        rowscale: ``(...)`` per-row scale of ``x`` before dropout (not differentiated).
        prenorm: also return the pre-norm residual stream ``residual_out``.
        residual_in_fp32: keep the stream in fp32 when no residual is given.
        zero_centered_weight: scale by ``1 + weight``. is_rms_norm: RMSNorm instead.
        return_dropout_mask: also return the bool keep-masks of x and x1.
        out_dtype: dtype of y (default x.dtype). out / residual_out: buffers to write into.

    Returns:
        ``y``, then ``y1`` (with weight1), ``residual_out`` (with prenorm), then
        ``dropout_mask, dropout_mask1`` (with return_dropout_mask); a single ``y`` bare.
    """
    outs = fused_norm(
        x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, None, prenorm,
        residual_in_fp32, zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype,
        out, residual_out,
    )  # fmt: skip
    return _pack(*outs, weight1 is not None, prenorm, return_dropout_mask)


def rms_norm_fn(
    x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
    rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False,
    return_dropout_mask=False, out_dtype=None, out=None, residual_out=None,
):  # fmt: skip
    """:func:`layer_norm_fn` with RMSNorm: ``y = s / sqrt(mean(s^2) + eps) * w + b``."""
    return layer_norm_fn(
        x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
        residual_in_fp32, zero_centered_weight, True, return_dropout_mask, out_dtype, out,
        residual_out,
    )  # fmt: skip


def _legacy(x0, x1, residual, weight, bias, weight1, bias1, dropout_p, epsilon, rowscale,
            layerscale, prenorm, residual_in_fp32, return_dropout_mask, is_rms_norm, parallel):  # fmt: skip
    y, y1, res_out, mask, mask1 = fused_norm(
        x0, weight, bias, residual, x1, weight1, bias1, epsilon, dropout_p, rowscale,
        layerscale, prenorm, residual_in_fp32, False, is_rms_norm, return_dropout_mask,
    )  # fmt: skip
    outs = [y, y1] if parallel else [y]
    if prenorm:
        outs.append(res_out)
    if return_dropout_mask:
        outs += [mask, mask1] if parallel else [mask]
    return outs[0] if len(outs) == 1 else tuple(outs)


def dropout_add_layer_norm(
    x0, residual, weight, bias, dropout_p, epsilon, rowscale=None, layerscale=None,
    prenorm=False, residual_in_fp32=False, return_dropout_mask=False,
):  # fmt: skip
    """``LayerNorm(dropout(x0 * rowscale * layerscale) + residual)`` (flash-attn CUDA-era API).

    Returns ``out``, or ``(out, residual_out)`` with prenorm; with return_dropout_mask the bool
    keep-mask of x0 follows. ``layerscale`` is an ``(N,)`` per-column scale and is differentiated.
    """
    return _legacy(x0, None, residual, weight, bias, None, None, dropout_p, epsilon, rowscale,
                   layerscale, prenorm, residual_in_fp32, return_dropout_mask, False, False)  # fmt: skip


def dropout_add_rms_norm(
    x0, residual, weight, bias, dropout_p, epsilon, rowscale=None, layerscale=None,
    prenorm=False, residual_in_fp32=False, return_dropout_mask=False,
):  # fmt: skip
    """:func:`dropout_add_layer_norm` with RMSNorm."""
    return _legacy(x0, None, residual, weight, bias, None, None, dropout_p, epsilon, rowscale,
                   layerscale, prenorm, residual_in_fp32, return_dropout_mask, True, False)  # fmt: skip


def dropout_add_layer_norm_parallel_residual(
    x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm=False,
    residual_in_fp32=False, return_dropout_mask=False,
):  # fmt: skip
    """``s = dropout(x0) + dropout(x1) + residual``; ``out0 = LN(s; w0, b0)``,
    ``out1 = LN(s; w1, b1)`` (None when weight1 is None).

    Returns ``(out0, out1)``, then ``residual_out`` with prenorm, then ``(mask0, mask1)`` with
    return_dropout_mask.
    """
    return _legacy(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, None,
                   None, prenorm, residual_in_fp32, return_dropout_mask, False, True)  # fmt: skip


def dropout_add_rms_norm_parallel_residual(
    x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm=False,
    residual_in_fp32=False, return_dropout_mask=False,
):  # fmt: skip
    """:func:`dropout_add_layer_norm_parallel_residual` with RMSNorm."""
    return _legacy(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, None,
                   None, prenorm, residual_in_fp32, return_dropout_mask, True, True)  # fmt: skip

"""The launches for ``torch.compile``: ``torch.library.triton_op``s (``fused_norm::fwd``,
``fused_norm::bwd``) whose bodies Inductor traces, so that a compiled graph launches the
kernels from its own generated code with no Python dispatch per call. ``traced_forward`` and
``traced_backward`` are the autograd Function's halves (functional._TracedNorm). A traced graph
keeps no state between calls: workspaces are fresh, dropout seeds are drawn on the device, and
the Hopper (Gluon) backward, which Inductor does not launch, gives way to kernels.py's.
Under the Triton interpreter the ops are opaque custom ops run eagerly instead.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch.library import triton_op, wrap_triton

from . import heuristics as H
from . import launch
from .checks import Flags
from .kernels import (
    _bwd_row_sums_kernel,
    _fused_norm_bwd_kernel,
    _fused_norm_fwd_kernel,
    _sum_partials_kernel,
)
from .ops import (
    INTERPRETED,
    PARTIALS_SUM_WARPS,
    SUMS_WARPS,
    _fwd_constexprs,
    _fwd_row,
    _row_kind,
    bwd_constexprs,
    bwd_plan,
    draw_seeds,
    fwd_plan,
    own_grads,
    stream_is_x,
)

Tensor = torch.Tensor


_TRACED_KERNELS: dict = {}


def _traced_kernel(kernel, num_warps: int, maxnreg):
    """``kernel`` as wrap_triton takes it with these launch options: a register cap only
    travels into Inductor's launch in a config, so a capped kernel is a one-config autotuner."""
    if maxnreg is None:
        return wrap_triton(kernel), {"num_warps": num_warps}
    key = (kernel, num_warps, maxnreg)
    tuned = _TRACED_KERNELS.get(key)
    if tuned is None:
        import triton

        cfg = triton.Config({}, num_warps=num_warps, maxnreg=maxnreg)
        tuned = _TRACED_KERNELS[key] = triton.autotune(configs=[cfg], key=[])(kernel)
    return wrap_triton(tuned), {}


def _fwd_op(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
    x1: Optional[Tensor], weight1: Optional[Tensor], bias1: Optional[Tensor],
    rowscale: Optional[Tensor], layerscale: Optional[Tensor], seeds: Optional[Tensor], eps: float,
    dropout_p: float, is_rms_norm: bool, zero_centered_weight: bool, store_residual_out: bool,
    store_mask: bool, out_dtype: torch.dtype, residual_dtype: torch.dtype,
) -> List[Tensor]:  # fmt: skip
    """The forward on contiguous ``(M, N)`` rows: ``[y, y1?, residual_out?, mean?, rstd,
    mask?, mask1?]`` (each ``?`` present where its input or flag says)."""
    return _fwd_impl(x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, seeds,
                     eps, dropout_p, is_rms_norm, zero_centered_weight, store_residual_out,
                     store_mask, out_dtype, residual_dtype)  # fmt: skip


def _fwd_impl(x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, seeds, eps,
              dropout_p, is_rms_norm, zero_centered_weight, store_residual_out, store_mask,
              out_dtype, residual_dtype, launch_kernels=True):  # fmt: skip
    m, n = x.shape
    n = int(n)  # the plan is chosen for a concrete width (a symbolic one is specialised)
    dev = x.device
    dropout = dropout_p > 0.0
    store_mask = store_mask and dropout
    y = torch.empty((m, n), dtype=out_dtype, device=dev)
    y1 = torch.empty((m, n), dtype=out_dtype, device=dev) if weight1 is not None else None
    s = torch.empty((m, n), dtype=residual_dtype, device=dev) if store_residual_out else None
    mean = None if is_rms_norm else torch.empty((m,), dtype=torch.float32, device=dev)
    rstd = torch.empty((m,), dtype=torch.float32, device=dev)
    mask = torch.empty((m, n), dtype=torch.bool, device=dev) if store_mask else None
    mask1 = (
        torch.empty((m, n), dtype=torch.bool, device=dev) if store_mask and x1 is not None else None
    )
    wbytes = max(t.element_size() for t in (weight, bias, weight1, bias1) if t is not None)
    row = _fwd_row(n, x.dtype, out_dtype, residual_dtype, None if x1 is None else x1.dtype,
                   residual_dtype if store_residual_out else None, wbytes, dropout, is_rms_norm,
                   rowscale is not None or layerscale is not None, residual is not None)  # fmt: skip
    plan = fwd_plan(dev, row)
    c = _fwd_constexprs(plan, bias is not None, residual is not None, x1 is not None,
                        weight1 is not None, bias1 is not None, rowscale is not None,
                        layerscale is not None, dropout, store_mask, store_residual_out,
                        is_rms_norm, zero_centered_weight)  # fmt: skip
    if m and launch_kernels:
        ws = ws_next = None
        if plan.split > 1:  # fresh workspaces: a traced graph keeps no state between calls
            ws = torch.zeros((m * plan.split,), dtype=torch.int64, device=dev)
            ws_next = torch.zeros_like(ws) if plan.ws_reset else None
        kernel, opts = _traced_kernel(_fused_norm_fwd_kernel, plan.num_warps, plan.maxnreg)
        kernel[plan.grid(m)](
            x, y, weight, bias, residual, x1, weight1, bias1, y1, s, rowscale, layerscale, seeds,
            None, mask, mask1, mean, rstd, ws, ws_next, n, n, n if residual is not None else 0,
            n if x1 is not None else 0, n if y1 is not None else 0, n if s is not None else 0,
            m, n, eps, dropout_p, 0, **c, **opts,
        )  # fmt: skip
    return [t for t in (y, y1, s, mean, rstd, mask, mask1) if t is not None]


def _bwd_op(
    s: Tensor, weight: Tensor, bias: Optional[Tensor], weight1: Optional[Tensor],
    bias1: Optional[Tensor], mean: Optional[Tensor], rstd: Tensor, dy: Tensor,
    dy1: Optional[Tensor], dresidual_out: Optional[Tensor], x0: Optional[Tensor],
    layerscale: Optional[Tensor], rowscale: Optional[Tensor], seeds: Optional[Tensor],
    dropout_p: float, is_rms_norm: bool, zero_centered_weight: bool, x_dtype: torch.dtype,
    residual_dtype: Optional[torch.dtype], x1_dtype: Optional[torch.dtype],
) -> List[Tensor]:  # fmt: skip
    """The backward on contiguous ``(M, N)`` rows: ``[dx, dresidual?, dx1?, *parameter grads]``
    (dresidual / dx1 where they differ from dx; the gradients of weight, bias, weight1, bias1,
    layerscale, those present, in that order)."""
    return _bwd_impl(s, weight, bias, weight1, bias1, mean, rstd, dy, dy1, dresidual_out, x0,
                     layerscale, rowscale, seeds, dropout_p, is_rms_norm, zero_centered_weight,
                     x_dtype, residual_dtype, x1_dtype)  # fmt: skip


def _bwd_impl(s, weight, bias, weight1, bias1, mean, rstd, dy, dy1, dresidual_out, x0,
              layerscale, rowscale, seeds, dropout_p, is_rms_norm, zero_centered_weight, x_dtype,
              residual_dtype, x1_dtype, launch_kernels=True):  # fmt: skip
    m, n = s.shape
    n = int(n)
    dev = s.device
    dropout = dropout_p > 0.0
    own_dres, own_dx1 = own_grads(dropout, rowscale is not None or layerscale is not None,
                                  x_dtype, residual_dtype, x1_dtype)  # fmt: skip
    params = [t for t in (weight, bias, weight1, bias1, layerscale) if t is not None]
    has_w1 = weight1 is not None
    row = H.BwdRow(
        n, x_dtype, s.element_size(), dy.element_size(), s.element_size(),
        max(t.element_size() for t in (weight, bias, weight1, bias1) if t is not None),
        len(params), _row_kind(x1_dtype is not None, dropout, residual_dtype is not None),
        is_rms_norm, dropout, dresidual_out is not None, own_dres, own_dx1, has_w1,
        x0.element_size() if x0 is not None else 0, rowscale is not None or layerscale is not None,
        0, False,  # not aligned: the Gluon kernel is not Inductor's to launch
    )  # fmt: skip
    plan = bwd_plan(dev, row)
    d = H.device(dev)
    dx = torch.empty((m, n), dtype=x_dtype, device=dev)
    dres = torch.empty((m, n), dtype=residual_dtype, device=dev) if own_dres else None
    dx1 = torch.empty((m, n), dtype=x1_dtype, device=dev) if own_dx1 else None
    if m == 0 or not launch_kernels:
        grads = [torch.zeros((n,), dtype=p.dtype, device=dev) for p in params]
        return [t for t in (dx, dres, dx1) if t is not None] + grads
    c = bwd_constexprs(plan, is_rms_norm, bias is not None, has_w1, bias1 is not None, own_dx1,
                       dresidual_out is not None, own_dres, rowscale is not None,
                       layerscale is not None, dropout, zero_centered_weight)  # fmt: skip
    c12 = ws_next = None
    if plan.exchange:
        c12 = torch.full((m, plan.chunks), -1, dtype=torch.int64, device=dev)
        ws_next = torch.empty_like(c12)
    elif plan.chunks > 1:
        c12 = torch.empty((m, 2), dtype=torch.float32, device=dev)
    resident = _traced_resident(dev, row, plan, c, s, weight, weight1, mean, dy, dy1,
                                dresidual_out, x0, layerscale, rowscale, seeds, dx, dx1, dres, c12,
                                len(params))  # fmt: skip
    programs = H.programs(d, plan, m, resident)
    parts = torch.empty((len(params), programs, n), dtype=torch.float32, device=dev)
    grads = [torch.empty((n,), dtype=p.dtype, device=dev) for p in params]
    if plan.sums is not None:
        sc = dict(plan.sums, IS_RMS_NORM=is_rms_norm, HAS_W1=has_w1,
                  ZERO_CENTERED_WEIGHT=zero_centered_weight)  # fmt: skip
        kernel, opts = _traced_kernel(_bwd_row_sums_kernel, SUMS_WARPS, None)
        kernel[(m,)](s, dy, dy1, weight, weight1, mean, rstd, c12, n, n,
                     n if dy1 is not None else 0, n, **sc, **opts)  # fmt: skip
    grid = (programs * plan.chunks,) if plan.exchange else (programs, plan.chunks)
    kernel, opts = _traced_kernel(_fused_norm_bwd_kernel, plan.num_warps, plan.maxnreg)
    kernel[grid](
        s, weight, weight1, mean, rstd, dy, dy1, dresidual_out, x0, layerscale, rowscale, seeds,
        dx, dx1, dres, parts, c12, ws_next, n, n, n if dy1 is not None else 0,
        n if dresidual_out is not None else 0, n if x0 is not None else 0, n,
        n if dx1 is not None else 0, n if dres is not None else 0, programs * n, m, n, dropout_p,
        H.cdiv(m, programs), 0, **c, **opts,
    )  # fmt: skip
    red = dict(H.partials_sum_layout(d, n, len(params), programs), GDC=False)  # no PDL here
    g = grads + [None] * (5 - len(grads))
    kernel, opts = _traced_kernel(_sum_partials_kernel, PARTIALS_SUM_WARPS, None)
    kernel[(H.cdiv(n, red["BLOCK_N"]), len(params))](parts, *g, programs, n, **red, **opts)
    return [t for t in (dx, dres, dx1) if t is not None] + grads


if INTERPRETED:  # the interpreter's kernels are not Inductor's: opaque ops, run eagerly
    torch.library.custom_op("fused_norm::fwd", _fwd_op, mutates_args=()).register_fake(
        lambda *args: _fwd_impl(*args, launch_kernels=False)
    )
    torch.library.custom_op("fused_norm::bwd", _bwd_op, mutates_args=()).register_fake(
        lambda *args: _bwd_impl(*args, launch_kernels=False)
    )
else:
    triton_op("fused_norm::fwd", mutates_args=())(_fwd_op)
    triton_op("fused_norm::bwd", mutates_args=())(_bwd_op)

_RESIDENT: dict = {}


def _traced_resident(dev, row, plan, c, *tensors) -> int:
    """The backward kernel's programs per SM that fit at once (0: unknown), for the traced
    graph: asked of the kernel compiled for Stand-ins while tracing, once per configuration."""
    if not plan.ask_resident or dev.type != "cuda" or INTERPRETED:
        return 0
    key = (dev, row, tuple(sorted(c.items())), tensors[-1],  # (a plan holds dicts)
           tuple(None if t is None else t.dtype for t in tensors[:-1]))  # fmt: skip
    hit = _RESIDENT.get(key)
    if hit is None:
        (s, weight, weight1, mean, dy, dy1, dres, x0, layerscale, rowscale, seeds, dx, dx1,
         dresidual, c12, partials) = tensors  # fmt: skip

        def st(t):  # one row of t (the row count may be symbolic while tracing)
            return None if t is None else launch.Stand(t.dtype, (1, *map(int, t.shape[1:])))

        n = int(s.shape[-1])
        bound = H.programs(H.device(dev), plan, 1 << 30)
        args = (st(s), st(weight), st(weight1), st(mean), launch.Stand(torch.float32, (1,)),
                st(dy), st(dy1), st(dres), st(x0), st(layerscale), st(rowscale), st(seeds),
                st(dx), st(dx1), st(dresidual), launch.Stand(torch.float32, (partials, bound, n)),
                st(c12), st(c12) if plan.exchange else None, n, n, n if dy1 is not None else 0,
                n if dres is not None else 0, n if x0 is not None else 0, n,
                n if dx1 is not None else 0, n if dresidual is not None else 0, bound * n, 1, n,
                0.5, 1, 0)  # fmt: skip
        hit = _RESIDENT[key] = launch.resident(
            _fused_norm_bwd_kernel, dev, args, c, launch.options(plan.num_warps, plan.maxnreg)
        )
    return hit


def _flat(t):
    return None if t is None else t.reshape(-1, t.shape[-1]).contiguous()


def traced_forward(ctx, x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale,
                   f: Flags):  # fmt: skip
    """_TracedNorm.forward: flatten, draw the seeds, run fused_norm::fwd, save for backward."""
    shape, dev = x.shape, x.device
    x2, res2, x12 = _flat(x), _flat(residual), _flat(x1)
    weight, bias, weight1, bias1, layerscale = (
        None if t is None else t.contiguous() for t in (weight, bias, weight1, bias1, layerscale)
    )
    rowscale = None if rowscale is None else rowscale.reshape(-1).contiguous()
    dropout = f.dropout_p > 0.0
    s_is_x = stream_is_x(x, residual, x1, rowscale, layerscale, f)
    store_res = f.prenorm or not s_is_x
    m = x2.shape[0]
    seeds = draw_seeds(2 * m if x1 is not None else m, dev) if dropout else None
    outs = list(torch.ops.fused_norm.fwd(
        x2, weight, bias, res2, x12, weight1, bias1, rowscale, layerscale, seeds, f.eps,
        f.dropout_p, f.is_rms_norm, f.zero_centered_weight, store_res, f.return_dropout_mask,
        f.out_dtype, f.residual_dtype,
    ))  # fmt: skip
    y = outs.pop(0)
    y1 = outs.pop(0) if weight1 is not None else None
    s = outs.pop(0) if store_res else None
    mean = None if f.is_rms_norm else outs.pop(0)
    rstd = outs.pop(0)
    mask = outs.pop(0) if f.return_dropout_mask and dropout else None
    mask1 = outs.pop(0) if mask is not None and x1 is not None else None
    ctx.save_for_backward(x2 if s_is_x else s, weight, bias, weight1, bias1, rowscale,
                          layerscale, seeds, mean, rstd, x2 if layerscale is not None else None)  # fmt: skip
    ctx.flags, ctx.shape = f, shape
    ctx.dtypes = (x.dtype, None if residual is None else residual.dtype,
                  None if x1 is None else x1.dtype)  # fmt: skip
    view = lambda t: None if t is None else t.view(shape)  # noqa: E731
    return view(y), view(y1), view(s) if f.prenorm else None, view(mask), view(mask1)


def traced_backward(ctx, dy, dy1, dres_out):
    """_TracedNorm.backward: the grads of x, weight, bias, residual, x1, weight1, bias1,
    rowscale (None), layerscale."""
    s, weight, bias, weight1, bias1, rowscale, layerscale, seeds, mean, rstd, x0 = ctx.saved_tensors
    f, shape = ctx.flags, ctx.shape
    x_dtype, res_dtype, x1_dtype = ctx.dtypes
    n = shape[-1]
    dy = _flat(dy) if dy is not None else torch.zeros((s.shape[0], n), dtype=f.out_dtype,
                                                       device=s.device)  # fmt: skip
    if weight1 is not None:
        dy1 = _flat(dy1) if dy1 is not None else torch.zeros_like(dy)
    dres_out = _flat(dres_out) if f.prenorm and dres_out is not None else None
    outs = list(torch.ops.fused_norm.bwd(
        s, weight, bias, weight1, bias1, mean, rstd, dy, dy1, dres_out, x0, layerscale,
        rowscale, seeds, f.dropout_p, f.is_rms_norm, f.zero_centered_weight, x_dtype, res_dtype,
        x1_dtype,
    ))  # fmt: skip
    dx = outs.pop(0).view(shape)
    own_dres, own_dx1 = own_grads(f.dropout_p > 0.0, rowscale is not None or layerscale is not None,
                                  x_dtype, res_dtype, x1_dtype)  # fmt: skip
    dres = dx1 = None
    if res_dtype is not None:
        dres = outs.pop(0).view(shape) if own_dres else dx
    if x1_dtype is not None:
        dx1 = outs.pop(0).view(shape) if own_dx1 else dx
    dw, db, dw1, db1, dls = (outs.pop(0) if t is not None else None
                             for t in (weight, bias, weight1, bias1, layerscale))  # fmt: skip
    return dx, dw, db, dres, dx1, dw1, db1, None, dls

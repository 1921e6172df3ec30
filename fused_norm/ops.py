"""Host side: validation (the one place), launch plans, and the launches of a call signature.

:class:`KernelCall` runs every eager call of one signature (``functional._spec``): it is built
once, validated and planned, and afterwards only allocates outputs and launches. Its backward
plan is made with it, and the backward's kernels start compiling in the background at the
first forward that records a graph. ``traced_forward`` / ``traced_backward`` serve
``torch.compile``, in ``traced.py``.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
from triton.runtime.errors import OutOfResources

from . import fast_path, launch, workspace
from . import heuristics as H
from .checks import Flags, row_stride
from .kernels import (
    HOPPER_AVAILABLE,
    _bwd_row_sums_kernel,
    _fused_norm_bwd_kernel,
    _fused_norm_fwd_kernel,
    _sum_partials_kernel,
)

if HOPPER_AVAILABLE:
    from .kernels import _bwd_smem_kernel
else:
    _bwd_smem_kernel = None

Tensor = torch.Tensor
INTERPRETED = H.INTERPRETED
# The C++ fast path (None where it is not built or not enabled): calls of a signature try this
# many times to record one that it can replay.
_FAST = fast_path.module() if launch.DIRECT else None
RECORD_TRIES = 3
SUMS_WARPS = 8  # the row-sums pre-pass: 2K-column chunks on 8 warps read at copy speed
PARTIALS_SUM_WARPS = 4


# ----------------------------------------------------------------------------------------------
# Dropout seeds
# ----------------------------------------------------------------------------------------------

# Keys lie in [KEY_LOW, KEY_HIGH): outside the int32 range, so that Triton types the forward's
# SEED_KEY alike (i64) whatever the value.
KEY_LOW, KEY_HIGH = 2**31, 2**63 - 1
_MASK64 = 2**64 - 1
_KEY_LOCK = threading.Lock()


def _mix(seed: int, offset: int) -> int:
    """A key from a generator's (seed, offset): SplitMix64's finaliser of ``seed * golden +
    offset``, its top 63 bits lifted into [KEY_LOW, KEY_HIGH)."""
    z = (seed * 0x9E3779B97F4A7C15 + offset) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z = (z ^ (z >> 31)) >> 1
    return z if z >= KEY_LOW else z + KEY_LOW


def draw_seeds(count: int, dev: torch.device, out: Optional[Tensor] = None) -> Tensor:
    """``count`` per-row dropout seeds drawn on ``dev`` by ``torch.randint`` (into ``out``)."""
    if out is None:
        return torch.randint(0, 2**31 - 1, (count,), device=dev, dtype=torch.int64)
    return torch.randint(0, 2**31 - 1, (count,), out=out)


def dropout_key(dev: torch.device) -> Optional[int]:
    """The key from which an eager forward derives its rows' seeds in the kernel (seed ``i`` =
    the key's low word + ``i`` mod 2**32: no two of a call's rows alike), or None where the
    seeds must be drawn on the device instead (CUDA graph capture: a key baked into a graph
    would repeat at every replay; other devices).

    On a CUDA GPU the key comes from the device's generator without a kernel: its (seed,
    offset) mixed, the offset then advanced as one of torch's random ops does, so that
    ``torch.cuda.manual_seed`` repeats it and ``set_rng_state`` (activation checkpointing)
    replays it. On the CPU (the interpreter) it is drawn from torch's CPU generator."""
    if dev.type == "cuda":
        if workspace.capturing(dev):
            return None
        gen = torch.cuda.default_generators[dev.index if dev.index is not None else 0]
        with _KEY_LOCK:
            offset = gen.get_offset()
            gen.set_offset(offset + 4)
            seed = gen.initial_seed()
        return _mix(seed, offset)
    if dev.type == "cpu":
        return int(torch.randint(KEY_LOW, KEY_HIGH, ()))
    return None


# ----------------------------------------------------------------------------------------------
# Plans (cached per configuration; tests that patch heuristics call clear_plans)
# ----------------------------------------------------------------------------------------------

_PLANS: dict = {}
# Caches of what plans decided, emptied by clear_plans (functional registers its call cache).
CACHES: list = [_PLANS]


def clear_plans() -> None:
    """Forget every plan and call signature made so far (after changing a heuristic)."""
    for cache in CACHES:
        cache.clear()


def _plan(direction, make, dev, row):
    key = (direction, dev, row)  # ("fwd" | "bwd", ...): what tests read back
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = make(H.device(dev), row)
    return plan


def fwd_plan(dev, row: H.FwdRow) -> H.FwdPlan:
    return _plan("fwd", H.forward_plan, dev, row)


def bwd_plan(dev, row: H.BwdRow) -> H.BwdPlan:
    return _plan("bwd", H.backward_plan, dev, row)


def _aligned(t) -> bool:
    return t.data_ptr() % 16 == 0


def _row_kind(x1, dropout, residual) -> str:
    if x1:
        return "x1drop" if dropout else "x1"
    if dropout:
        return "drop"
    return "add" if residual else ""


def _fwd_row(n, x_dtype, y_dtype, residual_dtype, x1_dtype, stream_out_dtype, weight_bytes,
             dropout, is_rms, scaled, has_residual):  # fmt: skip
    dts = [d for d in (x_dtype, y_dtype, residual_dtype if has_residual else None, x1_dtype,
                       stream_out_dtype) if d is not None]  # fmt: skip
    return H.FwdRow(
        n, x_dtype, max(d.itemsize for d in dts),
        (stream_out_dtype or residual_dtype or x_dtype).itemsize, weight_bytes,
        _row_kind(x1_dtype is not None, dropout, has_residual), bool(is_rms), bool(scaled),
    )  # fmt: skip


def stream_is_x(x, residual, x1, rowscale, layerscale, f: Flags) -> bool:
    """Whether the pre-norm sum ``s`` is ``x`` itself (nothing changed it): then the backward
    normalises x, and no stream is stored unless prenorm asks for it."""
    return (residual is None and x1 is None and rowscale is None and layerscale is None
            and f.dropout_p == 0.0 and f.residual_dtype == x.dtype)  # fmt: skip


def own_grads(dropout, scaled, x_dtype, res_dtype, x1_dtype) -> tuple:
    """``(own_dres, own_dx1)``: whether the residual's and x1's gradients are tensors of their
    own; where not (no dropout or scale between them and s, x's dtype) they equal dx."""
    plain = not dropout and not scaled
    return (res_dtype is not None and not (plain and res_dtype == x_dtype),
            x1_dtype is not None and not (plain and x1_dtype == x_dtype))  # fmt: skip


def bwd_constexprs(plan, is_rms, has_bias, has_w1, has_b1, own_dx1, has_dres_out, own_dres,
                   has_rowscale, has_layerscale, dropout, zcw) -> dict:  # fmt: skip
    """The backward kernel's constexprs (the Hopper kernel's where the plan takes it), by
    name: the plan's and the features'."""
    c = dict(
        plan.constexprs, IS_RMS_NORM=is_rms, HAS_BIAS=has_bias, HAS_W1=has_w1, HAS_B1=has_b1,
        HAS_X1=own_dx1, HAS_DRESIDUAL_OUT=has_dres_out, STORE_DRESIDUAL=own_dres,
        HAS_ROWSCALE=has_rowscale, HAS_LAYERSCALE=has_layerscale, HAS_DROPOUT=dropout,
        ZERO_CENTERED_WEIGHT=zcw,
    )  # fmt: skip
    if not plan.hopper:
        c["CHUNKS_P2"] = H.next_power_of_2(plan.chunks) if plan.exchange else 1
        c["BOUNDED_WAIT"] = plan.exchange and INTERPRETED
    return {k: c[k] for k in bwd_names(plan)}


def _fwd_constexprs(plan, has_bias, has_residual, has_x1, has_w1, has_b1, has_rowscale,
                    has_layerscale, dropout, store_mask, store_res, is_rms, zcw) -> dict:  # fmt: skip
    """The forward kernel's constexprs, by name (the plan's and the features')."""
    c = plan.constexprs
    return dict(
        BLOCK_N=c["BLOCK_N"], TAIL_N=c["TAIL_N"], NUM_CHUNKS=c["NUM_CHUNKS"], IS_RMS_NORM=is_rms,
        HAS_BIAS=has_bias, HAS_RESIDUAL=has_residual, HAS_X1=has_x1, HAS_W1=has_w1,
        HAS_B1=has_b1, HAS_ROWSCALE=has_rowscale, HAS_LAYERSCALE=has_layerscale,
        HAS_DROPOUT=dropout, STORE_MASK=store_mask, STORE_RESIDUAL_OUT=store_res,
        ZERO_CENTERED_WEIGHT=zcw, ROWS_PER_PROGRAM=c["ROWS_PER_PROGRAM"], SPLIT=c["SPLIT"],
        SPLIT_P2=H.next_power_of_2(c["SPLIT"]), SUB_N=min(c["BLOCK_N"], 128),
        BOUNDED_WAIT=INTERPRETED, HOLD=c["HOLD"], UNROLL=c["UNROLL"], FULL_ROW=c["FULL_ROW"],
        SEEDS_LAST=c["SEEDS_LAST"], WS_PREFETCH=c["WS_PREFETCH"], PARAMS_EVICT=c["PARAMS_EVICT"],
    )  # fmt: skip


_FWD_NAMES = launch.constexpr_names(_fused_norm_fwd_kernel)
_BWD_NAMES = launch.constexpr_names(_fused_norm_bwd_kernel)
_SUMS_NAMES = launch.constexpr_names(_bwd_row_sums_kernel)
_RED_NAMES = launch.constexpr_names(_sum_partials_kernel)
_SMEM_NAMES = launch.constexpr_names(_bwd_smem_kernel) if _bwd_smem_kernel is not None else []


def _ordered(names, constexprs) -> tuple:
    return tuple(constexprs[k] for k in names)


def _empty(shape, dtype, dev, fill=None) -> Tensor:
    """``torch.empty`` (``torch.full`` with a ``fill``), logged where a call is being recorded
    for the C++ fast path."""
    if fill is None:
        t = torch.empty(shape, dtype=dtype, device=dev)
    else:
        t = torch.full(shape, fill, dtype=dtype, device=dev)
    rec = fast_path.current()
    if rec is not None:
        if fill is not None:
            rec.fills[len(rec.allocs)] = fill
        rec.allocs.append(t)
    return t


def _refuse(why: str) -> None:
    """The call being recorded (if any) cannot be replayed by the C++ fast path."""
    rec = fast_path.current()
    if rec is not None:
        rec.refuse(why)


class _Launch:
    """One kernel launch of a call signature: the first call goes through ``kernel[grid]``
    (which compiles), later ones call the compiled kernel directly (launch.Compiled) with the
    tensors' addresses, where that is allowed."""

    __slots__ = ("kernel", "grid", "dev", "constexprs", "values", "opts", "compiled", "ptrs")

    def __init__(self, kernel, names, grid, dev, constexprs, opts):
        self.kernel, self.grid, self.dev = kernel, grid, dev
        self.constexprs, self.opts = constexprs, opts
        self.values = _ordered(names, constexprs) if names else ()
        self.compiled = self.ptrs = None

    def __call__(self, args):
        """``args``: the kernel's runtime arguments, tensors as themselves."""
        compiled = self.compiled
        if compiled is not None and not launch.hooked():
            a = list(args)
            for i in self.ptrs:
                a[i] = a[i].data_ptr()
            a.extend(self.values)
            dev = self.dev
            if dev.index != torch.cuda.current_device():
                with torch.cuda.device(dev):
                    compiled(torch._C._cuda_getCurrentRawStream(dev.index), a)
            else:
                compiled(torch._C._cuda_getCurrentRawStream(dev.index), a)
            rec = fast_path.current()
            if rec is not None:
                rec.launches.append((compiled, args, self.values))
            return
        _refuse("a launch through kernel[grid]")
        k = launch.launch(self.kernel, self.grid, self.dev, args, self.constexprs, self.opts)
        if launch.DIRECT and self.dev.type == "cuda" and k is not None and self.values:
            self.ptrs = [i for i, v in enumerate(args) if isinstance(v, torch.Tensor)]
            self.compiled = launch.Compiled(k, self.grid)


# ----------------------------------------------------------------------------------------------
# Eager calls
# ----------------------------------------------------------------------------------------------


class KernelCall:
    """Everything decided for one call signature: layouts, plans, kernels. ``forward`` and
    ``backward`` allocate and launch."""

    def __init__(self, tensors, flags: Flags, graph: bool, function):
        x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, out, res_out = tensors
        self.function, self.graph, self.flags = function, graph, flags
        f = flags
        self.shape, self.dev = x.shape, x.device
        self.n = n = x.shape[-1]
        self.m = m = x.numel() // n
        self.dropout = dropout = f.dropout_p > 0.0
        # (M, N) inputs are read in place where their rows have one stride, else copied.
        self.x_rs, self.res_rs, self.x1_rs = (None if t is None else row_stride(t)
                                              for t in (x, residual, x1))  # fmt: skip
        self.params_contig = all(t is None or t.is_contiguous()
                                 for t in (weight, bias, weight1, bias1, layerscale))  # fmt: skip
        self.rowscale_contig = rowscale is None or rowscale.is_contiguous()
        # The backward normalises the pre-norm sum s: x itself, unless anything changed it.
        self.s_is_x = stream_is_x(x, residual, x1, rowscale, layerscale, f)
        self.store_res = f.prenorm or not self.s_is_x
        self.out_rs = None if out is None else row_stride(out)
        self.res_out_rs = None if res_out is None else row_stride(res_out)
        self.has = (bias is not None, residual is not None, x1 is not None, weight1 is not None,
                    bias1 is not None, rowscale is not None, layerscale is not None)  # fmt: skip
        wbytes = max(t.element_size() for t in (weight, bias, weight1, bias1) if t is not None)
        stream_dt = f.residual_dtype if self.store_res else None
        row = _fwd_row(n, x.dtype, f.out_dtype, f.residual_dtype, None if x1 is None else x1.dtype,
                       stream_dt, wbytes, dropout, f.is_rms_norm,
                       rowscale is not None or layerscale is not None, residual is not None)  # fmt: skip
        self.fplan = plan = fwd_plan(self.dev, row)
        self.store_mask = f.return_dropout_mask and dropout
        self.fconst = _fwd_constexprs(plan, *self.has, dropout, self.store_mask, self.store_res,
                                      f.is_rms_norm, f.zero_centered_weight)  # fmt: skip
        opts = launch.options(plan.num_warps, plan.maxnreg)
        grid = plan.grid(m)
        # Two kernels where dropout seeds may come from a host key: with SEED_KEY, and without
        # (under CUDA graph capture).
        self._fwd = {k: _Launch(_fused_norm_fwd_kernel, _FWD_NAMES, grid, self.dev, self.fconst,
                                opts) for k in (True, False)}  # fmt: skip
        self.x_stride = self.x_rs if self.x_rs is not None else n  # (a copy's: n)
        self.dtypes = (x.dtype, None if residual is None else residual.dtype,
                       None if x1 is None else x1.dtype)  # fmt: skip
        self.param_dtypes = tuple(None if t is None else t.dtype
                                  for t in (weight, bias, weight1, bias1, layerscale))  # fmt: skip
        self._bwd = {}  # has dresidual_out -> _BwdLaunches
        # The Function's arguments (those given) and outputs (those made), by position.
        self.inputs = [i for i, t in enumerate(tensors) if t is not None]
        self.outputs = [0] + [i for i, on in ((1, weight1 is not None), (2, f.prenorm),
                                              (3, self.store_mask), (4, self.store_mask
                                                                     and x1 is not None)) if on]  # fmt: skip
        self.one_output = len(self.outputs) == 1
        self.apply = function.apply
        # The saved pre-norm sum's rows: x's, a caller's residual_out buffer's, or fresh ones.
        if self.s_is_x:
            s_aligned, self.s_stride = self.x_rs is None or _aligned(x), self.x_stride
        elif res_out is not None:
            s_aligned, self.s_stride = _aligned(res_out), self.res_out_rs or n
        else:
            s_aligned, self.s_stride = True, n
        self.bwd_aligned = s_aligned and self.s_stride % 16 == 0
        if graph:  # decide the backward now, and compile it while the forward compiles
            self._bwd_for(f.prenorm, warm=True)
        # The C++ fast path: recorded from one of the next Python-path calls (the first
        # compiles, so its launches do not go direct).
        self.fast = None
        self.not_fast = None  # why the last recording could not be replayed
        self.tries = RECORD_TRIES if _FAST is not None and self.dev.type == "cuda" else 0
        if _FAST is None and launch.DIRECT and self.dev.type == "cuda":
            fast_path.warn_if_missing()
        self.bwd_tries = [RECORD_TRIES, RECORD_TRIES]

    def __call__(self, *tensors):
        fast = self.fast
        if fast is not None:
            if not launch.hooked():
                outs = _FAST.call(fast, [tensors[i] for i in self.inputs])
                if outs:  # (empty: this call takes the Python path)
                    return self._full(outs)
        elif self.tries:
            return self._record(tensors)
        return self._python(tensors)

    def _python(self, tensors):
        if not self.graph:
            return self.forward(None, *tensors)
        # Through autograd with the tensors given and the outputs made only: each argument and
        # output of an autograd Function costs host time.
        outs = self.apply(self, *[tensors[i] for i in self.inputs])
        return self._full((outs,) if self.one_output else outs)

    def _full(self, outs):
        """``(y, y1, residual_out, mask, mask1)`` from the outputs made."""
        full = [None] * 5
        for i, t in zip(self.outputs, outs):
            full[i] = t
        return full

    # ---------------------------------------------------------------------- the C++ fast path

    def _record(self, tensors):
        """A Python-path call, recorded; from it, the C++ recipe of this signature's forward
        (its backward is recorded at the first backward the recipe cannot serve)."""
        self.tries -= 1
        with fast_path.Recording() as rec:
            result = self._python(tensors)
        try:
            stream = self.outputs.index(2) if self.graph and self.flags.prenorm else -1
            self.fast = fast_path.forward_recipe(_FAST, rec, [tensors[i] for i in self.inputs],
                                                 self.dev, self.graph, stream, self)  # fmt: skip
            self.tries = 0
        except fast_path.Unservable as exc:
            self.not_fast = str(exc)
        return result

    def fast_backward(self, saved, grads):
        """The C++ node's backward where its recipe has none for these gradients: the Python
        path's, recorded for the next ones."""
        ctx = _Saved(saved)
        variant = int(self.flags.prenorm and grads[self.outputs.index(2)] is not None)
        if self.fast is None or self.fast.has_backward(variant) or not self.bwd_tries[variant]:
            return self.backward_graph(ctx, *grads)
        self.bwd_tries[variant] -= 1
        with fast_path.Recording() as rec:
            result = self.backward_graph(ctx, *grads)
        try:
            self.fast.set_backward(variant, *fast_path.stage(rec, [*saved, *grads], result))
        except fast_path.Unservable as exc:
            self.not_fast = str(exc)
        return result

    # ------------------------------------------------------------------------------- forward

    def _rows(self, t, rs):
        """``(tensor, row stride)`` of an (M, N) input: itself, or a contiguous copy."""
        if t is None:
            return None, 0
        if rs is None:
            return t.reshape(self.m, self.n).contiguous(), self.n
        return t, rs

    def forward_graph(self, ctx, *given):
        """_FusedNorm.forward: the outputs made, from the tensors given."""
        full = [None] * 11
        for i, t in zip(self.inputs, given):
            full[i] = t
        outs = self.forward(ctx, *full)
        if self.one_output:
            return outs[0]
        return tuple(outs[i] for i in self.outputs)

    def backward_graph(self, ctx, *grads):
        """_FusedNorm.backward: the gradients of the tensors given, from those of the outputs
        made (None where unused)."""
        g = [None] * 5
        for i, t in zip(self.outputs, grads):
            g[i] = t
        full = self.backward(ctx, g[0], g[1], g[2])
        return tuple(full[i] for i in self.inputs)

    def forward(self, ctx, x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale,
                out, residual_out):  # fmt: skip
        f, m, dev = self.flags, self.m, self.dev
        x2, x_rs = self._rows(x, self.x_rs)
        res2, res_rs = self._rows(residual, self.res_rs)
        x12, x1_rs = self._rows(x1, self.x1_rs)
        if not self.params_contig:
            weight, bias, weight1, bias1, layerscale = (
                None if t is None else t.contiguous()
                for t in (weight, bias, weight1, bias1, layerscale)
            )
        if rowscale is not None and not self.rowscale_contig:
            rowscale = rowscale.contiguous()
        shape = self.shape
        y = out if out is not None else _empty(shape, f.out_dtype, dev)
        y1 = _empty(shape, f.out_dtype, dev) if weight1 is not None else None
        s = None
        if self.store_res:
            s = residual_out if residual_out is not None else _empty(shape, f.residual_dtype, dev)
        mean = None if f.is_rms_norm else _empty((m,), torch.float32, dev)
        rstd = _empty((m,), torch.float32, dev)
        seeds = mask = mask1 = None
        if self.dropout:
            seeds = _empty((2 * m if x1 is not None else m,), torch.int64, dev)
            if self.store_mask:
                _refuse("dropout masks returned")
                mask = _empty(shape, torch.bool, dev)
                mask1 = _empty(shape, torch.bool, dev) if x1 is not None else None
        if m:
            self._launch_fwd(x2, x_rs, weight, bias, res2, res_rs, x12, x1_rs, weight1, bias1,
                             rowscale, layerscale, seeds, y, y1, s, mean, rstd, mask, mask1)  # fmt: skip
        rec = fast_path.current()
        if ctx is not None:
            # (a caller's residual_out is saved itself: it is marked dirty below)
            saved = (x2 if self.s_is_x else s, weight, bias, weight1, bias1, rowscale, layerscale,
                     seeds, mean, rstd, x2 if layerscale is not None else None)  # fmt: skip
            ctx.save_for_backward(*saved)
            ctx.call = self
            dirty = [t for t in (out, residual_out) if t is not None]
            if dirty:
                ctx.mark_dirty(*dirty)
            if rec is not None:
                rec.saved = saved
        outs = (y, y1, s if f.prenorm else None, mask, mask1)
        if rec is not None:
            if out is not None or residual_out is not None:
                rec.refuse("caller buffers")
            rec.outputs = [outs[i] for i in self.outputs]
        return outs

    def _launch_fwd(self, x, x_rs, weight, bias, residual, res_rs, x1, x1_rs, weight1, bias1,
                    rowscale, layerscale, seeds, y, y1, s, mean, rstd, mask, mask1):  # fmt: skip
        plan, m, n, dev = self.fplan, self.m, self.n, self.dev
        key = None
        if seeds is not None:
            key = dropout_key(dev) if plan.seeds_from_key else None
            if key is None:
                _refuse("dropout seeds drawn by torch")
                draw_seeds(seeds.shape[0], dev, out=seeds)
        ws = ws_next = pair = None
        if plan.split > 1:
            if plan.ws_reset:
                ws, ws_next, pair = workspace.take(dev, m * plan.split, 0)
            else:
                ws = _empty((m * plan.split,), torch.int64, dev, fill=0)
        y_rs = self.out_rs or n
        s_rs = 0 if s is None else (self.res_out_rs or n)
        tensors = (x, y, weight, bias, residual, x1, weight1, bias1, y1, s, rowscale, layerscale,
                   seeds, key, mask, mask1, mean, rstd, ws, ws_next)  # fmt: skip
        ints = (x_rs, y_rs, res_rs, x1_rs, 0 if y1 is None else n, s_rs, m, n, self.flags.eps,
                self.flags.dropout_p, 0)  # fmt: skip
        self._fwd[key is not None]((*tensors, *ints))
        workspace.done(pair)

    # ------------------------------------------------------------------------------ backward

    def _bwd_for(self, has_dres_out: bool, warm: bool = False) -> _BwdLaunches:
        lau = self._bwd.get(has_dres_out)
        if lau is None:
            lau = self._bwd[has_dres_out] = _BwdLaunches(self, has_dres_out, warm)
        return lau

    def backward(self, ctx, dy, dy1, dres_out):
        s, weight, bias, weight1, bias1, rowscale, layerscale, seeds, mean, rstd, x0 = (
            ctx.saved_tensors
        )
        f, shape = self.flags, self.shape
        dy = _grad(dy, shape, self.flags.out_dtype, s.device)
        if weight1 is not None:
            dy1 = _grad(dy1, shape, self.flags.out_dtype, s.device)
        if not f.prenorm or dres_out is None:
            dres_out = None
        else:
            dres_out = _grad(dres_out, shape, dres_out.dtype, s.device)
        lau = self._bwd_for(dres_out is not None)
        dx, dres, dx1, grads = lau(s, weight, weight1, mean, rstd, dy, dy1, dres_out, x0,
                                   layerscale, rowscale, seeds)  # fmt: skip
        dw, db, dw1, db1, dls = (grads.pop(0) if t is not None else None
                                 for t in (weight, bias, weight1, bias1, layerscale))  # fmt: skip
        # Where dresidual / dx1 equal dx, the same tensor object: autograd then copies before
        # accumulating one into a leaf's .grad instead of letting two .grad share storage.
        if self.has[1] and dres is None:
            dres = dx
        if self.has[2] and dx1 is None:
            dx1 = dx
        return dx, dw, db, dres, dx1, dw1, db1, None, dls, None, None


class _Saved:
    """The ``ctx`` of a backward that the C++ node hands to the Python path."""

    __slots__ = ("saved_tensors",)

    def __init__(self, saved):
        self.saved_tensors = tuple(saved)


def _grad(g, shape, dtype, dev):
    """An incoming gradient as contiguous rows at a 16-byte aligned address (zeros if None)."""
    if g is None:
        return _empty(shape, dtype, dev, fill=0)
    if not g.is_contiguous() or g.data_ptr() % 16:
        return g.clone(memory_format=torch.contiguous_format)  # a fresh allocation is aligned
    return g


class _BwdLaunches:
    """The backward launches of one call signature (with or without a gradient of the
    residual stream coming in)."""

    def __init__(self, call: KernelCall, has_dres_out: bool, warm: bool):
        f, n, m = call.flags, call.n, call.m
        self.call, self.m, self.n, self.dev = call, m, n, call.dev
        x_dtype, res_dtype, x1_dtype = call.dtypes
        dropout = f.dropout_p > 0.0
        has_rowscale, has_layerscale = call.has[5], call.has[6]
        self.own_dres, self.own_dx1 = own_grads(dropout, has_rowscale or has_layerscale, x_dtype,
                                                res_dtype, x1_dtype)  # fmt: skip
        self.params = [d for d in call.param_dtypes if d is not None]
        s_dtype = x_dtype if call.s_is_x else f.residual_dtype
        has_w1 = call.has[3]
        dres_dtype = f.residual_dtype if has_dres_out else None
        staged = s_dtype.itemsize + f.out_dtype.itemsize * (2 if has_w1 else 1) + (
            dres_dtype.itemsize if dres_dtype else 0)  # fmt: skip
        row = H.BwdRow(
            n, x_dtype, s_dtype.itemsize, f.out_dtype.itemsize,
            (f.residual_dtype if call.store_res else x_dtype).itemsize,
            max(d.itemsize for d in call.param_dtypes[:4] if d is not None), len(self.params),
            _row_kind(call.has[2], dropout, call.has[1]), f.is_rms_norm, dropout, has_dres_out,
            self.own_dres, self.own_dx1, has_w1, x_dtype.itemsize if has_layerscale else 0,
            has_rowscale or has_layerscale, staged, call.bwd_aligned,
        )  # fmt: skip
        self.plan = plan = bwd_plan(self.dev, row)
        self.d = H.device(self.dev)
        self.dtypes = dict(s=s_dtype, dy=f.out_dtype, dres=dres_dtype, x=x_dtype, res=res_dtype,
                           x1=x1_dtype)  # fmt: skip
        self.constexprs = bwd_constexprs(
            plan, f.is_rms_norm, call.has[0], has_w1, call.has[4], self.own_dx1, has_dres_out,
            self.own_dres, has_rowscale, has_layerscale, dropout, f.zero_centered_weight,
        )  # fmt: skip
        self.programs = None  # decided at the first launch (the resident count)
        self.launches = None
        self.pending = []
        if warm and not INTERPRETED and self.dev.type == "cuda":
            self._warm()

    # Stand-ins of the backward's tensors, for compiles ahead of the first launch.
    def _stand_args(self, programs):
        dt, n, m, call = self.dtypes, self.n, max(self.m, 1), self.call
        S = launch.Stand
        row = lambda d: None if d is None else S(d, (m, n))  # noqa: E731
        weights = [S(d, (n,)) if d is not None else None for d in call.param_dtypes]
        seeds = S(torch.int64, (2 * m,)) if call.dropout else None
        mean = None if call.flags.is_rms_norm else S(torch.float32, (m,))
        c12 = self._c12_stand()
        return (row(dt["s"]), weights[0], weights[2], mean, S(torch.float32, (m,)), row(dt["dy"]),
                row(dt["dy"]) if call.has[3] else None, row(dt["dres"]),
                row(dt["x"]) if call.has[6] else None, weights[4],
                S(dt["x"], (m,)) if call.has[5] else None, seeds, row(dt["x"]),
                row(dt["x1"]) if self.own_dx1 else None, row(dt["res"]) if self.own_dres else None,
                S(torch.float32, (len(self.params), programs, n)), c12,
                c12 if self.plan.exchange else None)  # fmt: skip

    def _c12_stand(self):
        plan = self.plan
        if plan.exchange:
            return launch.Stand(torch.int64, (max(self.m, 1), plan.chunks))
        if plan.chunks > 1:
            return launch.Stand(torch.float32, (max(self.m, 1), 2))
        return None

    def _runtime(self, t, programs):
        """The backward kernel's runtime arguments after its tensors (``t``: the 18 tensors
        of _stand_args' order): row strides (0 for absent tensors), sizes, scalars."""
        n, m, s_rs = self.n, self.m, self.call.s_stride
        if self.plan.hopper:
            return (s_rs, n, n if t[6] is not None else 0, n if t[7] is not None else 0, n,
                    n if t[14] is not None else 0, programs * n, m, n, H.cdiv(m, programs),
                    self.call.flags.dropout_p)  # fmt: skip
        return (s_rs, n, n if t[6] is not None else 0, n if t[7] is not None else 0,
                self.call.x_stride if t[8] is not None else 0, n, n if t[13] is not None else 0,
                n if t[14] is not None else 0, programs * n, m, n, self.call.flags.dropout_p,
                H.cdiv(m, programs), 0)  # fmt: skip

    def _bwd_tensors(self, t):
        """The backward kernel's tensor arguments, in its order, from _stand_args' 18."""
        if self.plan.hopper:  # no x0, layerscale, rowscale or dx1 there
            return (t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[11], t[12], t[14], t[15],
                    t[16], t[17])  # fmt: skip
        return t

    def _kernel(self):
        return _bwd_smem_kernel if self.plan.hopper else _fused_norm_bwd_kernel

    def _opts(self):
        return launch.options(self.plan.num_warps, self.plan.maxnreg)

    def _grid(self, programs):
        plan = self.plan
        if plan.hopper or plan.exchange:
            return (programs * plan.chunks,)
        return (programs, plan.chunks)

    def _warm(self):
        """Start compiling the backward kernel(s) for the grid bound (any programs count)."""
        plan, dev = self.plan, self.dev
        programs = H.programs(self.d, plan, 1 << 30)
        t = self._stand_args(programs)
        args = (*self._bwd_tensors(t), *self._runtime(t, programs))
        self.pending.append(launch.warm(self._kernel(), self._grid(programs), dev, args,
                                        self.constexprs, self._opts()))  # fmt: skip
        if plan.sums is not None:
            self.pending.append(launch.warm(_bwd_row_sums_kernel, (1,), dev,
                                            self._sums_args(t[0], t[5], t[6], t[1], t[2], t[3],
                                                            t[4], t[16]),
                                            self._sums_constexprs(), launch.options(SUMS_WARPS)))  # fmt: skip
        for stages in (1, 3):  # the partials' sum: its layout at any programs count
            red, opts = _partials_sum(self.d, self.n, len(self.params),
                                      3 if stages == 1 else 1 << 30)  # fmt: skip
            g = [launch.Stand(d, (self.n,)) for d in self.params] + [None] * (5 - len(self.params))
            self.pending.append(launch.warm(_sum_partials_kernel, (1, 1), dev,
                                            (t[15], *g, programs, self.n), red, opts))  # fmt: skip

    def _sums_constexprs(self):
        c = dict(self.plan.sums, IS_RMS_NORM=self.call.flags.is_rms_norm,
                 HAS_W1=self.call.has[3], ZERO_CENTERED_WEIGHT=self.call.flags.zero_centered_weight)  # fmt: skip
        return {k: c[k] for k in _SUMS_NAMES}

    def _sums_args(self, s, dy, dy1, weight, weight1, mean, rstd, c12):
        return (s, dy, dy1, weight, weight1, mean, rstd, c12, self.call.s_stride, self.n,
                self.n if dy1 is not None else 0, self.n)  # fmt: skip

    def _prepare(self):
        """The first launch: wait for the compiles ahead, size the grid by the programs that fit
        at once (where the plan asks), and fall back to an unpipelined row loop where the
        pipeline's buffers do not fit the device's shared memory."""
        for fut in self.pending:
            if fut is not None:
                try:
                    fut.result()
                except Exception:  # noqa: BLE001 - the launch compiles again and reports it
                    pass
        self.pending = []
        plan, d = self.plan, self.d
        resident = 0
        if plan.ask_resident:
            bound = H.programs(d, plan, 1 << 30)
            st = self._stand_args(bound)
            args = (*self._bwd_tensors(st), *self._runtime(st, bound))
            while True:
                try:
                    resident = launch.resident(self._kernel(), self.dev, args, self.constexprs,
                                               self._opts())  # fmt: skip
                    break
                except OutOfResources:
                    if not self._unpipelined():
                        raise
        self.programs = H.programs(d, plan, self.m, resident)

    def _unpipelined(self) -> bool:
        """Take the row loop unpipelined (its buffers did not fit); False where it was."""
        if self.plan.hopper or self.constexprs.get("ROW_STAGES", 1) == 1:
            return False
        self.constexprs = dict(self.constexprs, ROW_STAGES=1)
        return True

    def __call__(self, s, weight, weight1, mean, rstd, dy, dy1, dres_out, x0, layerscale,
                 rowscale, seeds):  # fmt: skip
        m, n, dev, call = self.m, self.n, self.dev, self.call
        shape = call.shape
        dx = _empty(shape, self.dtypes["x"], dev)
        dres = _empty(shape, self.dtypes["res"], dev) if self.own_dres else None
        dx1 = _empty(shape, self.dtypes["x1"], dev) if self.own_dx1 else None
        if m == 0:
            grads = [torch.zeros((n,), dtype=d, device=dev) for d in self.params]
            return dx, dres, dx1, grads
        if self.programs is None:
            self._prepare()
        programs, plan = self.programs, self.plan
        parts = _empty((len(self.params), programs, n), torch.float32, dev)
        grads = [_empty((n,), d, dev) for d in self.params]
        c12 = ws_next = pair = None
        if plan.exchange:  # words of the row sums, -1 until published
            c12, ws_next, pair = workspace.take(dev, m * plan.chunks, -1)
        elif plan.chunks > 1:
            c12 = _empty((m, 2), torch.float32, dev)
        t = (s, weight, weight1, mean, rstd, dy, dy1, dres_out, x0, layerscale, rowscale, seeds,
             dx, dx1, dres, parts, c12, ws_next)  # fmt: skip
        g = grads + [None] * (5 - len(grads))
        if self.launches is None:
            self._make_launches(programs)
        sums, bwd, red = self.launches
        if sums is not None:
            sums(self._sums_args(s, dy, dy1, weight, weight1, mean, rstd, c12))
        args = (*self._bwd_tensors(t), *self._runtime(t, programs))
        if bwd.compiled is None:  # the first launch: where the pipeline does not fit, unpipelined
            while True:
                try:
                    bwd(args)
                    break
                except OutOfResources:
                    if not self._unpipelined():
                        raise
                    bwd = _Launch(self._kernel(), bwd_names(plan), self._grid(programs), dev,
                                  self.constexprs, self._opts())  # fmt: skip
                    self.launches = (sums, bwd, red)
        else:
            bwd(args)
        red((parts, *g, programs, n))
        workspace.done(pair)
        return dx, dres, dx1, grads

    def _make_launches(self, programs):
        plan, dev, n = self.plan, self.dev, self.n
        sums = None
        if plan.sums is not None:
            sums = _Launch(_bwd_row_sums_kernel, _SUMS_NAMES, (self.m,), dev,
                           self._sums_constexprs(), launch.options(SUMS_WARPS))  # fmt: skip
        bwd = _Launch(self._kernel(), bwd_names(plan), self._grid(programs), dev,
                      self.constexprs, self._opts())  # fmt: skip
        red_c, red_opts = _partials_sum(self.d, n, len(self.params), programs)
        red = _Launch(_sum_partials_kernel, _RED_NAMES,
                      (H.cdiv(n, red_c["BLOCK_N"]), len(self.params)), dev, red_c, red_opts)  # fmt: skip
        self.launches = (sums, bwd, red)


def _partials_sum(d, n: int, partials: int, programs: int):
    """The partials' sum's constexprs and launch options. On Hopper and later it launches as the
    backward kernel's programmatic dependent (PDL), so its launch does not wait behind the
    backward's last programs: +0.3 to +2.1 points of copy on the backward rows (H200,
    docs/tuning.md)."""
    c = dict(H.partials_sum_layout(d, n, partials, programs), GDC=d.pdl)
    opts = launch.options(PARTIALS_SUM_WARPS)
    if d.pdl:
        opts["launch_pdl"] = True
    return {k: c[k] for k in _RED_NAMES}, opts


def bwd_names(plan) -> list:
    return _SMEM_NAMES if plan.hopper else _BWD_NAMES

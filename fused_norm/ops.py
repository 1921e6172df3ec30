"""Host side: argument validation, and the launchers of the forward and backward kernels.

The launchers take 2-D ``(M, N)`` tensors (the autograd layer flattens), allocate every output
on the input's device, and launch under that device's guard on its current stream. The kernel
launches are wrapped as ``torch.library`` custom ops (``fused_norm::fwd`` / ``fused_norm::bwd``)
that only mutate buffers allocated outside them, so ``torch.compile`` traces the allocations and
treats the launches as opaque calls with trivial fake implementations. In eager mode the launch
functions are called directly, which skips the dispatcher's overhead.

The launch choices (config's heuristics, and for the backward the programs that fit on the
device) are made once per configuration, keyed by the device, the width, the dtypes and the
flags but never the row count, and kept in ``_FWD_PLANS`` / ``_BWD_PLANS`` until a setting of
config changes (config.DERIVED_CACHES): a repeated call only allocates and launches.
"""

from __future__ import annotations

import math
import numbers
import threading
import warnings
from typing import NamedTuple, Optional

import torch
from triton.runtime.errors import OutOfResources

from . import config, workspace
from .kernels import (
    _bwd_row_sums_kernel,
    _fused_norm_bwd_kernel,
    _fused_norm_fwd_kernel,
    _row_shares_sum_kernel,
    _sum_partials_kernel,
)
from .launch import Launcher, Stand
from .smem_kernels import AVAILABLE as _SMEM_AVAILABLE

Tensor = torch.Tensor

_FWD = Launcher(_fused_norm_fwd_kernel)
_BWD = Launcher(_fused_norm_bwd_kernel, dependent=True)
_SUMS = Launcher(_bwd_row_sums_kernel)
_ADD = Launcher(_row_shares_sum_kernel, dependent=True)
_RED = Launcher(_sum_partials_kernel, dependent=True)
if _SMEM_AVAILABLE:
    from .smem_kernels import _bwd_smem_kernel

    _SMEM = Launcher(_bwd_smem_kernel)
else:
    _SMEM = None


def launchers() -> tuple:
    """The launchers of every kernel ops launches (read when called: a sweep may replace one)."""
    return tuple(lau for lau in (_FWD, _BWD, _SUMS, _ADD, _RED, _SMEM) if lau is not None)


KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TORCH_DTYPES = KERNEL_DTYPES + (torch.float64,)


# ----------------------------------------------------------------------------------------------
# Validation: the one place where arguments are checked.
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
    """A real number that is not a bool (floats and ints first: the ABC check is slow)."""
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
    for name, buf, dtype in (
        ("out", out, out_dtype or x.dtype),
        ("residual_out", residual_out, residual_dtype),
    ):
        if buf is None:
            continue
        _check_tensor(name, buf, x.shape, dev, None)
        if dtype is not None and buf.dtype != dtype:
            raise TypeError(f"{name} must have dtype {dtype}, got {buf.dtype}")
        if buf.numel() and buf.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
        try:
            buf.view(-1, n)
        except RuntimeError as e:
            raise ValueError(f"{name} must be viewable as (M, N) rows without a copy") from e


# ----------------------------------------------------------------------------------------------
# Dropout key
# ----------------------------------------------------------------------------------------------

# Keys lie in [KEY_LOW, KEY_HIGH): ints outside the int32 range, so that Triton types the
# forward's SEED_KEY the same (i64) whatever the value (launch.key_and_pointers keys it so).
KEY_LOW, KEY_HIGH = 2**31, 2**63 - 1
_MASK64 = 2**64 - 1
_KEY_LOCK = threading.Lock()


def _mix(seed: int, offset: int) -> int:
    """A key from a generator's (seed, offset): SplitMix64's finaliser of ``seed * golden +
    offset`` (a bijection of that sum), then its top 63 bits, lifted into [KEY_LOW, KEY_HIGH)."""
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
    """The key from which one dropout call's forward derives its rows' seeds (kernels._seed_of:
    the key's low word plus the seed's index, mod 2**32: no two of a call's seeds alike, below
    2**32 of them), or None where the seeds must be drawn on the device by ``torch.randint``
    instead.

    An eager call on a CUDA GPU derives the key on the host from the device's CUDA generator:
    its (seed, offset) mixed, the offset then advanced by 4 as one of torch's random ops
    reserves its share. No kernel runs (the randint kernel cost ~3.5 µs a call, bench/NOTES.md
    #80), and the key follows that generator as a device draw would: ``torch.cuda.manual_seed``
    repeats it, ``torch.cuda.set_rng_state`` (activation checkpointing) replays it, a forked or
    swapped CUDA RNG state (model-parallel trackers) changes it. On the CPU (the interpreter)
    it is drawn from torch's CPU generator. None under CUDA graph capture (a key baked into the
    graph would repeat at every replay), on other devices and with config.DROPOUT_KEY_ON_HOST
    off. Eager forwards only (_fwd_run): torch.compile traces tensors, not host ints, so the
    autograd layer draws the seeds there (draw_seeds). The lock covers fused_norm's own calls;
    another thread drawing from the same generator between the read and the advance could
    repeat a key, as it could around torch's get/set_rng_state.
    """
    if not config.DROPOUT_KEY_ON_HOST:
        return None
    if dev.type == "cuda":
        if workspace.capturing(dev):
            return None
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        gen = torch.cuda.default_generators[index]
        with _KEY_LOCK:
            offset = gen.get_offset()
            gen.set_offset(offset + 4)
            seed = gen.initial_seed()
        return _mix(seed, offset)
    if dev.type == "cpu":
        return int(torch.randint(KEY_LOW, KEY_HIGH, ()))
    return None


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


def _stride0(t: Optional[Tensor]) -> int:
    return t.stride(0) if t is not None else 0


def _fwd_launch(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
    x1: Optional[Tensor], weight1: Optional[Tensor], bias1: Optional[Tensor],
    rowscale: Optional[Tensor], layerscale: Optional[Tensor], seeds: Optional[Tensor],
    y: Tensor, y1: Optional[Tensor], residual_out: Optional[Tensor], mean: Optional[Tensor],
    rstd: Tensor, mask: Optional[Tensor], mask1: Optional[Tensor],
    eps: float, dropout_p: float, is_rms_norm: bool, zero_centered_weight: bool,
) -> None:  # fmt: skip
    """The forward launch (the body of the ``fused_norm::fwd`` custom op)."""
    _fwd_run(
        x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, seeds, y, y1,
        residual_out, mean, rstd, mask, mask1, eps, dropout_p, is_rms_norm, zero_centered_weight,
    )  # fmt: skip


def _fwd_run(
    x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, seeds, y, y1,
    residual_out, mean, rstd, mask, mask1, eps, dropout_p, is_rms_norm, zero_centered_weight,
    on_miss=None, fill_seeds=False,
):  # fmt: skip
    """The forward launch. With ``fill_seeds`` (an eager call's empty ``seeds``), the rows'
    dropout seeds come from a key (dropout_key) that the kernel derives them from and stores
    them in ``seeds``, or where the plan or the call takes none, from draw_seeds; otherwise
    the kernel reads them."""
    m, n = x.shape
    if m == 0:
        return
    dev = x.device
    # Everything the launch choices depend on but the row count (which only sizes the grid); the
    # parameters by their dtypes (None where absent), from which a miss derives _fwd_plan's
    # flags and weight bytes, so that a hit reads no element sizes.
    params = (weight.dtype, None if bias is None else bias.dtype,
              None if weight1 is None else weight1.dtype, None if bias1 is None else bias1.dtype)  # fmt: skip
    key = (
        dev, n, x.dtype, y.dtype, None if residual is None else residual.dtype,
        None if x1 is None else x1.dtype, None if residual_out is None else residual_out.dtype,
        rowscale is not None, layerscale is not None, mask is not None, dropout_p > 0.0,
        is_rms_norm, zero_centered_weight, params,
    )  # fmt: skip
    plan = _FWD_PLANS.get(key)
    if plan is None:
        plan = _FWD_PLANS[key] = _fwd_plan(
            *key[:7], bias is not None, weight1 is not None, bias1 is not None, *key[7:13],
            _param_bytes(weight, bias, weight1, bias1),
        )  # fmt: skip
    split = plan.split
    seed_key = None
    if fill_seeds:
        seed_key = dropout_key(dev) if plan.seeds_from_key else None
        if seed_key is None:  # drawn as under capture
            draw_seeds(seeds.shape[0], dev, out=seeds)
    ws = ws_next = pair = None
    if split > 1:  # one row over `split` programs; the statistics meet in `ws` (zeros)
        grid = (m * split,)
        if plan.ws_reset:
            ws, ws_next, pair = workspace.take(dev, m * split, 0)
        else:  # no WS_NEXT: the kernel without the store (config.fwd_ws_reset)
            ws = torch.zeros((m * split,), dtype=torch.int64, device=dev)
    else:
        grid = (config.cdiv(m, plan.rows),)
    _FWD(
        grid, dev,
        (x, y, weight, bias, residual, x1, weight1, bias1, y1, residual_out,
         rowscale, layerscale, seeds, seed_key, mask, mask1, mean, rstd, ws, ws_next,
         x.stride(0), y.stride(0), _stride0(residual), _stride0(x1), _stride0(y1),
         _stride0(residual_out), m, n, eps, dropout_p, config.FWD_SPLIT_MAX_POLLS),
        plan.constexprs, plan.num_warps, on_miss=on_miss, maxnreg=plan.maxnreg,
    )  # fmt: skip
    workspace.done(pair)


# _fwd_run's key -> _fwd_plan's answer (emptied when a setting of config changes).
_FWD_PLANS: dict = {}


class _FwdPlan(NamedTuple):
    """_fwd_plan's choices for one configuration, whatever the row count."""

    split: int  # programs a row is spread over (1: not split)
    rows: int  # rows per program
    num_warps: int
    maxnreg: Optional[int]  # register cap (None: the compiler's choice)
    constexprs: dict  # the forward kernel's constexpr arguments
    ws_reset: bool  # split rows: their workspace clears itself (config.fwd_ws_reset)
    seeds_from_key: bool  # dropout seeds may come from an eager call's key (dropout_key)


def _param_bytes(*params) -> int:
    """Bytes of the widest element of the weights and biases given (None: absent), as the
    launch rules see them: with config.W4_RULES off, 4-byte ones count as 2 (the rules of
    4-byte weights, bench/NOTES.md #59, then never apply). A plain loop: torch.compile traces
    it from the backward's plan (no ``max(..., default=)``)."""
    widest = 0
    for p in params:
        if p is not None:
            widest = max(widest, p.element_size())
    return widest if config.W4_RULES or widest != 4 else 2


def _fwd_plan(
    dev, n, x_dtype, y_dtype, residual_dtype, x1_dtype, residual_out_dtype, has_bias, has_w1,
    has_b1, has_rowscale, has_layerscale, store_mask, dropout, is_rms_norm, zero_centered_weight,
    weight_bytes=2,
):  # fmt: skip
    """The forward's launch choices for rows of ``n`` columns (a _FwdPlan).
    ``weight_bytes``: of the widest weight or bias element (fp32 parameters read again for
    every row cost twice the L2 traffic of 16-bit ones: config.fwd_split, fwd_split_warps,
    fwd_block_choice)."""
    elem_bytes = max(
        d.itemsize for d in (x_dtype, y_dtype, residual_dtype, x1_dtype, residual_out_dtype) if d
    )
    has_x1 = x1_dtype is not None
    # "ln" / "rms" for a norm of x alone (no residual, x1 or dropout), which moves half the bytes
    plain = ""
    if not has_x1 and residual_dtype is None and not dropout:
        plain = "rms" if is_rms_norm else "ln"
    # What the row could be held in instead of fp32 (config.fwd_hold_kind), and whether it is.
    kind = config.fwd_hold_kind(
        x_dtype, residual_out_dtype, plain != "" and not has_rowscale and not has_layerscale
    )
    block_n, split = config.fwd_split(
        n, elem_bytes, dev, dropout, has_x1, ln_w4=plain == "ln" and weight_bytes == 4
    )
    lane = own = None
    if split > 1:
        # The rows config.fwd_split_wide_parts knows: LayerNorm of x alone held in 16 bits (no
        # rowscale or layerscale: config.fwd_hold_kind), or with dropout and no x1.
        norm = ""
        if plain == "ln" and kind in ("bf16", "fp16"):
            norm = "ln"
        elif dropout and not has_x1 and not is_rms_norm:
            norm = "dropout_ln"
        wide = config.fwd_split_wide_parts(norm, x_dtype, n, elem_bytes, weight_bytes)
        if wide:  # rows whose parts measured faster wider, on warps of their own
            block_n = wide[0] // elem_bytes
            split = config.cdiv(n, block_n)
        num_chunks, rows = 1, 1
        kernel_block, tail = block_n, 0
        hold = config.fwd_hold(kind, split, has_x1)
        dropout_2k = dropout and not has_x1 and block_n == 2048
        num_warps = wide[1] if wide else config.fwd_split_warps(
            plain, split, kind if hold else "", dropout_2k, weight_bytes
        )  # fmt: skip
    else:
        block_n, num_chunks, tail, rows, lane = config.fwd_block_layout(
            n, elem_bytes, plain, weight_bytes
        )
        kernel_block = block_n // 2 if tail else block_n  # two blocks: config.block_tail
        # rows with warps and a register cap of their own (config.fwd_block_choice)
        own = config.fwd_block_choice(
            block_n, num_chunks, tail, elem_bytes, x_dtype.itemsize, weight_bytes, dropout,
            has_x1, dev, plain,
        )  # fmt: skip
        num_warps = own[0] if own else config.fwd_num_warps(block_n, num_chunks, plain, tail, lane)
        hold = False  # config.fwd_hold: split parts only
    fills = config.fwd_fills_block(n, kernel_block, tail, num_chunks, split)
    # The key of the row rules (fwd_full_row, fwd_ws_prefetch, fwd_split_part_i32), built once.
    row_kind = plain or ("x1" if has_x1 else "dropout" if dropout else "add")
    row = (row_kind, n, x_dtype, elem_bytes, weight_bytes)
    full_row = config.fwd_full_row(row, kernel_block, num_chunks, split, fills)
    ws_prefetch = split > 1 and config.fwd_ws_prefetch(split, dev, row + (has_bias,))
    constexprs = dict(
        BLOCK_N=kernel_block,
        TAIL_N=tail,
        NUM_CHUNKS=num_chunks,
        IS_RMS_NORM=is_rms_norm,
        JOINT_STATS=config.fwd_joint_stats(block_n, tail, elem_bytes, dropout, has_x1),
        HAS_BIAS=has_bias,
        HAS_RESIDUAL=residual_dtype is not None,
        HAS_X1=has_x1,
        HAS_W1=has_w1,
        HAS_B1=has_b1,
        HAS_ROWSCALE=has_rowscale,
        HAS_LAYERSCALE=has_layerscale,
        HAS_DROPOUT=dropout,
        STORE_MASK=store_mask,
        STORE_RESIDUAL_OUT=residual_out_dtype is not None,
        ZERO_CENTERED_WEIGHT=zero_centered_weight,
        ROWS_PER_PROGRAM=rows,
        SPLIT=split,
        SPLIT_P2=config.next_power_of_2(split),
        SUB_N=min(block_n, config.FWD_SPLIT_SUB_N),
        BOUNDED_WAIT=config.INTERPRETED,  # see kernels._fwd_split_row
        HOLD=config.fwd_hold_route(kind, is_rms_norm) if hold else 0,
        EVICT_FIRST_SWEEP=config.FWD_CHUNK_EVICT[0] if num_chunks > 1 else "",
        EVICT_SECOND_SWEEP=config.FWD_CHUNK_EVICT[1] if num_chunks > 1 else "",
        UNROLL=config.fwd_chunk_unroll(lane, num_chunks),
        WS_PREFETCH=ws_prefetch,
        EARLY_PARAMS=config.fwd_early_params(plain, n, fills, tail, rows, elem_bytes, weight_bytes),
        FULL_ROW=full_row,  # the width as a constant where it measured faster
        # Dropout seeds derived from the call's key (seeds_from_key below): stored after the
        # row, or before it in the x1 path's rows and on 16 or more warps, where that measured
        # faster (bench/NOTES.md #80).
        SEEDS_LAST=not has_x1 and (split > 1 or num_warps < 16),
        PARAMS_EVICT=config.fwd_split_params_evict(elem_bytes, weight_bytes) if split > 1 else "",
        PART_I32=split > 1 and config.fwd_split_part_i32(row, is_rms_norm),
    )
    maxnreg = (
        own[1]
        if own
        else config.fwd_maxnreg(block_n, num_chunks, split, dropout, has_x1, elem_bytes, dev)
    )
    ws_reset = split > 1 and config.fwd_ws_reset(is_rms_norm, elem_bytes, n)
    # The x1 path takes the key only in one-block rows on fewer than 16 warps: its split rows
    # lost 60-90 us with it (#80), on 16 warps it measured even, and at 10240 columns it took
    # 78 registers instead of 64 offline (one program per SM instead of two). Elsewhere in
    # the x1 path the seeds are drawn on the device, as under capture.
    seeds_from_key = not has_x1 or (split == 1 and num_warps < 16)
    return _FwdPlan(split, rows, num_warps, maxnreg, constexprs, ws_reset, seeds_from_key)


_fwd_op = torch.library.custom_op(
    "fused_norm::fwd",
    _fwd_launch,
    mutates_args=("y", "y1", "residual_out", "mean", "rstd", "mask", "mask1"),
)
_fwd_op.register_fake(lambda *args, **kwargs: None)


def fused_norm_fwd(
    x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, seeds, eps, dropout_p,
    is_rms_norm, zero_centered_weight, out_dtype, residual_dtype, store_residual_out,
    store_mask=False, y=None, residual_out=None, warm_bwd=None, fill_seeds=False,
):  # fmt: skip
    """Run the forward on 2-D ``(M, N)`` tensors (last dim contiguous).

    With dropout, ``seeds`` holds the rows' seeds (x's, then x1's), or with ``fill_seeds``
    (eager calls only) is an empty int64 buffer that the forward fills (_fwd_run).

    Returns ``(y, y1, residual_out, mean, rstd, mask, mask1)``; absent parts are None.
    ``y`` / ``residual_out`` are written in place when given. ``warm_bwd(y, y1, residual_out,
    mean, rstd)`` is called if this configuration's forward has not been launched before, just
    before it compiles, so that the backward can compile meanwhile (see fused_norm_bwd).
    """
    m, n = x.shape
    dev = x.device
    if y is None:
        y = torch.empty((m, n), dtype=out_dtype, device=dev)
    y1 = torch.empty((m, n), dtype=out_dtype, device=dev) if weight1 is not None else None
    if store_residual_out and residual_out is None:
        residual_out = torch.empty((m, n), dtype=residual_dtype, device=dev)
    elif not store_residual_out:
        residual_out = None
    mean = None if is_rms_norm else torch.empty((m,), dtype=torch.float32, device=dev)
    rstd = torch.empty((m,), dtype=torch.float32, device=dev)
    mask = mask1 = None
    if store_mask and dropout_p > 0.0:
        mask = torch.empty((m, n), dtype=torch.bool, device=dev)
        if x1 is not None:
            mask1 = torch.empty((m, n), dtype=torch.bool, device=dev)
    args = (
        x, weight, bias, residual, x1, weight1, bias1, rowscale, layerscale, seeds,
        y, y1, residual_out, mean, rstd, mask, mask1,
        float(eps), float(dropout_p), bool(is_rms_norm), bool(zero_centered_weight),
    )  # fmt: skip
    if torch.compiler.is_compiling():
        assert not fill_seeds, "torch.compile traces the seeds' draw (autograd)"
        _fwd_op(*args)
    else:
        on_miss = None
        if warm_bwd is not None:

            def on_miss():
                try:
                    warm_bwd(y, y1, residual_out, mean, rstd)
                except Exception as e:  # noqa: BLE001 - an optimisation must not fail the forward
                    warnings.warn(
                        f"fused_norm: could not start compiling the backward ahead ({e!r}); "
                        "it compiles when first needed", RuntimeWarning, stacklevel=2,
                    )  # fmt: skip

        _fwd_run(*args, on_miss=on_miss, fill_seeds=fill_seeds)
    return y, y1, residual_out, mean, rstd, mask, mask1


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


def _bwd_launch(
    s: Tensor, weight: Tensor, weight1: Optional[Tensor], mean: Optional[Tensor], rstd: Tensor,
    dy: Tensor, dy1: Optional[Tensor], dresidual_out: Optional[Tensor], x0: Optional[Tensor],
    layerscale: Optional[Tensor], rowscale: Optional[Tensor], seeds: Optional[Tensor],
    dx: Tensor, dx1: Optional[Tensor], dresidual: Optional[Tensor], parts: Tensor,
    c12: Optional[Tensor], g0: Tensor, g1: Optional[Tensor], g2: Optional[Tensor],
    g3: Optional[Tensor], g4: Optional[Tensor], has_bias: bool, has_b1: bool, dropout_p: float,
    is_rms_norm: bool, zero_centered_weight: bool, block_n: int, num_chunks: int, tail: int,
    smem: bool, warps: int, max_programs: int,
) -> None:  # fmt: skip
    """The backward launches (the body of the ``fused_norm::bwd`` custom op)."""
    _bwd_run(
        s, weight, weight1, mean, rstd, dy, dy1, dresidual_out, x0, layerscale, rowscale, seeds,
        dx, dx1, dresidual, parts, c12, g0, g1, g2, g3, g4, has_bias, has_b1, dropout_p,
        is_rms_norm, zero_centered_weight, block_n, num_chunks, tail, smem, warps, max_programs,
    )  # fmt: skip


def _staged_bytes(s, dy, dresidual_out, dy1, dropout) -> int:
    """Bytes per column of the rows smem_kernels' backward stages in slices: s, dy,
    dresidual_out and dy1 (those present), but dresidual_out where it is held in registers
    (config.bwd_smem_dres_regs; ``dropout``: x was dropped)."""
    if dresidual_out is not None and config.bwd_smem_dres_regs(
        dy1 is not None, dy.element_size(), dropout
    ):
        dresidual_out = None
    return sum(t.element_size() for t in (s, dy, dresidual_out, dy1) if t is not None)


def _weight_bytes(weight_dtype, weight1_dtype) -> int:
    """Bytes per column of the weights smem_kernels' sliced backward holds in shared memory:
    the weight and any second weight (weight1), each as stored."""
    return weight_dtype.itemsize + (0 if weight1_dtype is None else weight1_dtype.itemsize)


def _aligned16(t) -> bool:
    """Whether a 2-D tensor's address is 16-byte aligned and its row stride a multiple of 16
    elements (what Triton specialises a kernel on: config.bwd_smem_partials)."""
    return t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0


def _exchanges(c12) -> bool:
    """Whether the backward's column programs exchange their row sums (kernels.py, EXCHANGE)
    instead of taking them from the row-sums pre-pass: fused_norm_bwd chose it by the dtype of
    the buffer it gave them (int64 words, not fp32 sums)."""
    return c12 is not None and c12.dtype == torch.int64


def _row_sizes(s, dy, dy1, dresidual_out, x0) -> list:
    """The element sizes of the per-row tensors the backward kernel loads (those present)."""
    return [t.element_size() for t in (s, dy, dy1, dresidual_out, x0) if t is not None]


def _dtype_name(*tensors) -> str:
    """The name of the tensors' dtype (they may be Stand-ins) where they share bf16 or fp16:
    "bf16" / "fp16", else ""."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    dtypes = {t.dtype for t in tensors}
    return names.get(dtypes.pop(), "") if len(dtypes) == 1 else ""


def _bwd_plan(
    dev, s, dy, dy1, dresidual_out, x0, weight1, layerscale, rowscale, dx1, dresidual, c12,
    has_bias, has_b1, dropout_p, is_rms_norm, zero_centered_weight, block_n, num_chunks, tail,
    partials, warps, w4=False,
):  # fmt: skip
    """(constexprs, stage_key, maxnreg) of the backward kernel: its flags with the pipeline's
    stage count (ROW_STAGES, last), the key under which a stage count that did not fit is
    remembered (_STAGES_THAT_FIT) and its register cap. Tensors may be Stand-ins; ``w4``:
    the weights are 4-byte (_param_bytes)."""
    row_sizes = _row_sizes(s, dy, dy1, dresidual_out, x0)
    row_bytes, widest = sum(row_sizes), max(row_sizes)
    tile_rows = config.bwd_tile_rows(block_n, num_chunks, tail, dropout_p > 0.0)
    exchange = _exchanges(c12)
    # A norm of x alone, and one whose row fills its one block (config.bwd_row_stages).
    plain = (dresidual_out is None and dresidual is None and dx1 is None and x0 is None
             and rowscale is None and layerscale is None and dropout_p == 0.0)  # fmt: skip
    plain_full = plain and not tail and s.shape[-1] == block_n
    plain_ln = plain and not is_rms_norm
    plain_rms = plain and is_rms_norm and partials == 1 and not zero_centered_weight
    # A tile's pipeline buffers hold tile_rows rows: the stage count sizes them per column.
    key = (dev, block_n, row_bytes * tile_rows, dropout_p > 0.0, num_chunks, partials, plain_full,
           tail)  # fmt: skip
    stages = _STAGES_THAT_FIT.get(key) or config.bwd_row_stages(*key[1:])
    if exchange:  # the row loop waits on other programs: not pipelined
        stages = 1
    # (kernels._held_row_grads has no second weight)
    row_kind = "ln" if plain_ln and has_bias and not zero_centered_weight else ""
    held = weight1 is None and config.bwd_recompute(
        block_n, num_chunks, tail, tile_rows, stages, exchange, warps, row_kind,
        _dtype_name(s, dy), w4, s.shape[-1], dev,
    )  # fmt: skip
    flags = dict(
        BLOCK_N=block_n // 2 if tail else block_n,
        TAIL_N=tail,
        NUM_CHUNKS=num_chunks,
        IS_RMS_NORM=is_rms_norm,
        HAS_BIAS=has_bias,
        HAS_W1=weight1 is not None,
        HAS_B1=has_b1,
        HAS_X1=dx1 is not None,
        HAS_DRESIDUAL_OUT=dresidual_out is not None,
        STORE_DRESIDUAL=dresidual is not None,
        HAS_ROWSCALE=rowscale is not None,
        HAS_LAYERSCALE=layerscale is not None,
        HAS_DROPOUT=dropout_p > 0.0,
        ZERO_CENTERED_WEIGHT=zero_centered_weight,
        TILE_ROWS=tile_rows,
        EXCHANGE=exchange,
        CHUNKS_P2=config.next_power_of_2(num_chunks) if exchange else 1,
        BOUNDED_WAIT=exchange and config.INTERPRETED,
        EXCHANGE_RELOAD=exchange and config.bwd_exchange_reload(partials),
        JOINT_ROW_SUMS=config.bwd_joint_row_sums(
            block_n, num_chunks, tail, partials, stages, dropout_p > 0.0
        ),
        SUM_REPEATS=config.bwd_sum_repeats(
            block_n, num_chunks, tail, tile_rows, warps, plain_rms, widest, w4, dev
        ),
        GDC=num_chunks > 1 and not exchange and config.bwd_pdl(dev),  # after the pre-pass
        ROW_STAGES=stages,
        RECOMPUTE=held,
    )
    fp16 = dy.dtype == torch.float16
    maxnreg = config.bwd_maxnreg(
        block_n, num_chunks, dropout_p > 0.0, partials, dev, tail, warps, widest, fp16, plain_ln,
        w4,
    )  # fmt: skip
    return flags, key, maxnreg


def _bwd_args(
    s, weight, weight1, mean, rstd, dy, dy1, dresidual_out, x0, layerscale, rowscale, seeds,
    dx, dx1, dresidual, parts, c12, dropout_p, programs, ws_next,
):  # fmt: skip
    """The backward kernel's runtime arguments, for a grid of ``programs`` row blocks
    (``ws_next``: the next exchanging launch's workspace, workspace.take)."""
    m, n = s.shape
    return (
        s, weight, weight1, mean, rstd, dy, dy1, dresidual_out, x0, layerscale, rowscale,
        seeds, dx, dx1, dresidual, parts, c12, ws_next,
        s.stride(0), dy.stride(0), _stride0(dy1), _stride0(dresidual_out), _stride0(x0),
        dx.stride(0), _stride0(dx1), _stride0(dresidual), programs * n,
        m, n, dropout_p, config.cdiv(m, programs), config.BWD_EXCHANGE_MAX_POLLS,
    )  # fmt: skip


# (device, dtypes, N, dropout, opts) -> _bwd_resident's answer.
_RESIDENT: dict = {}


@torch.compiler.assume_constant_result
def _bwd_resident(dev, dtypes, n, dropout, opts) -> int:
    """Programs of the backward kernel that fit on one multiprocessor at once
    (Launcher.resident, which compiles it), 0 where unknown. ``dtypes`` are those of the
    kernel's tensor arguments in order (None where absent), ``opts`` the rest of what
    selects the kernel: (has_bias, has_b1, is_rms_norm, zero_centered_weight, block_n,
    num_chunks, tail, partials, warps). The kernel is compiled for Stand-ins (16-byte aligned,
    rows of ``n`` elements apart), not specialised on the row count or the grid (kernels.py).
    Where the pipelined kernel does not fit at all, its stage count falls to 1, remembered as
    a launch that did not fit would remember it. A constant to torch.compile."""
    cache_key = (dev, dtypes, n, dropout, opts)
    hit = _RESIDENT.get(cache_key)
    if hit is None:
        hit = _RESIDENT[cache_key] = _bwd_compile_resident(dev, dtypes, n, dropout, opts)
    return hit


def _bwd_compile_resident(dev, dtypes, n, dropout, opts) -> int:
    """_bwd_resident's answer, compiling the kernel if need be."""
    dropout_p = 0.5 if dropout else 0.0  # only whether there is dropout selects the kernel
    (s, weight, weight1, mean, rstd, dy, dy1, dres_out, x0, layerscale, rowscale, seeds, dx, dx1,
     dresidual, parts, c12) = (
        None if d is None else Stand(d, (1,) if i in (3, 4, 10, 11) else (1, n))
        for i, d in enumerate(dtypes)
    )  # fmt: skip
    has_bias, has_b1, is_rms_norm, zcw, block_n, num_chunks, tail, partials, warps = opts
    flags, key, maxnreg = _bwd_plan(
        dev, s, dy, dy1, dres_out, x0, weight1, layerscale, rowscale, dx1, dresidual, c12,
        has_bias, has_b1, dropout_p, is_rms_norm, zcw, block_n, num_chunks, tail, partials, warps,
        _param_bytes(weight, weight1) == 4,
    )  # fmt: skip
    # The arguments as _bwd_run's launch passes them (WS_NEXT a workspace only where the
    # programs exchange), so that this compile is the launch's kernel, not a second one.
    args = _bwd_args(
        s, weight, weight1, mean, rstd, dy, dy1, dres_out, x0, layerscale, rowscale, seeds, dx,
        dx1, dresidual, parts, c12, dropout_p, 1, c12 if _exchanges(c12) else None,
    )  # fmt: skip
    return _fitting_stages(
        lambda f: _BWD.resident(dev, args, f, warps, maxnreg=maxnreg), flags, key
    )


def _bwd_kernel_plan(
    dev, s, dy, dy1, dresidual_out, x0, weight1, layerscale, rowscale, dx1, dresidual, c12,
    has_bias, has_b1, dropout_p, is_rms_norm, zero_centered_weight, block_n, num_chunks, tail,
    smem, partials, warps, max_programs, weight_dtype,
):  # fmt: skip
    """What _bwd_run launches with, beyond its arguments: ``(flags, stage_key, maxnreg)`` of
    the backward kernel (_bwd_plan; with ``smem`` the constexprs of smem_kernels' kernel and
    two Nones), the row-sums pre-pass's constexprs (None where the row is one block or its
    blocks exchange their sums) and the partials' sum's (for the row blocks of an unbounded
    row count, ``max_programs``). Tensors may be Stand-ins."""
    red_block, red_rows, red_stages = config.partials_sum_layout(
        s.shape[-1], partials, max_programs, dev
    )
    red = dict(BLOCK_N=red_block, BLOCK_P=red_rows, PARTIALS=partials, STAGES=red_stages,
               GDC=config.bwd_pdl(dev))  # fmt: skip
    if smem:
        flags = smem_flags(
            s.shape[-1], s.element_size(), is_rms_norm, has_bias, zero_centered_weight,
            dresidual_out is not None, dresidual is not None, dropout_p > 0.0, weight_dtype,
            _staged_bytes(s, dy, dresidual_out, dy1, dropout_p > 0.0) if num_chunks > 1 else 0,
            None if weight1 is None else weight1.dtype, has_b1, dy.element_size(),
        )  # fmt: skip
        return flags, None, None, None, red
    n = s.shape[-1]
    w4 = _param_bytes(Stand(weight_dtype, (n,)), weight1) == 4  # the weights it reads
    flags, stage_key, maxnreg = _bwd_plan(
        dev, s, dy, dy1, dresidual_out, x0, weight1, layerscale, rowscale, dx1, dresidual, c12,
        has_bias, has_b1, dropout_p, is_rms_norm, zero_centered_weight, block_n, num_chunks,
        tail, partials, warps, w4,
    )  # fmt: skip
    sums = None
    if num_chunks > 1 and not _exchanges(c12):  # rows wider than a block: c1, c2 first
        sums_block, sums_chunks, sums_parts = config.bwd_sums_layout(
            n, max(s.element_size(), dy.element_size()), w4, weight1 is not None
        )
        sums = dict(
            BLOCK_N=sums_block,
            NUM_CHUNKS=sums_chunks,
            PARTS=sums_parts,
            IS_RMS_NORM=is_rms_norm,
            HAS_W1=weight1 is not None,
            ZERO_CENTERED_WEIGHT=zero_centered_weight,
            GDC=flags["GDC"],
        )
    return flags, stage_key, maxnreg, sums, red


def smem_flags(
    n, elem_bytes, is_rms_norm, has_bias, zero_centered_weight, has_dres_out=False,
    store_dres=False, dropout=False, weight_dtype=torch.bfloat16, sliced_bytes=0,
    weight1_dtype=None, has_b1=False, dy_bytes=2,
) -> dict:  # fmt: skip
    """The constexprs of smem_kernels' kernel for rows of ``n`` columns of ``elem_bytes``-byte
    elements (s's; config.bwd_smem_layout's layout, BWD_SMEM_WARPS; scripts/compile_smem.py
    compiles what this gives): with ``has_dres_out`` a gradient of the residual stream comes
    in, with ``store_dres`` the residual's goes out, with ``dropout`` x was dropped;
    ``weight_dtype`` decides where partial dW and the weight are kept (config.bwd_smem_dw_regs).
    ``sliced_bytes`` > 0: the row is taken in slices (config.bwd_smem_slices), its staged rows
    that many bytes per column; partial dW then in registers, the weight in shared memory.
    ``weight1_dtype`` (in slices): a second output (x1's path) with a second weight of that
    dtype, and with ``has_b1`` a second bias. ``dy_bytes``: the element size of dy (x's dtype;
    4 with ``has_dres_out`` and ``dropout`` holds dresidual_out in registers in slices,
    config.bwd_smem_dres_regs, not counted in ``sliced_bytes``)."""
    warps = config.BWD_SMEM_WARPS
    has_w1 = weight1_dtype is not None
    dres_regs = (
        bool(sliced_bytes) and has_dres_out and config.bwd_smem_dres_regs(has_w1, dy_bytes, dropout)
    )
    vec = 8  # 16 bytes of a 16-bit row
    if sliced_bytes:
        weight_bytes = _weight_bytes(weight_dtype, weight1_dtype)
        width, split, stages, lag = config.bwd_smem_slices(n, sliced_bytes, weight_bytes, has_w1)
        (block, tail), dw_regs = config.slice_parts(width), True
        if elem_bytes == 4:  # whole octets of dropout decisions, or their move (smem_kernels._keep)
            fixed = weight_bytes + stages * sliced_bytes
            vec = config.bwd_smem_fp32_vec(dropout, dres_regs, width, fixed)
    else:
        block_n, tail, stages = config.bwd_smem_layout(n, has_dres_out, weight_dtype)
        block = block_n // 2 if tail else block_n
        split, lag, dw_regs = 1, False, config.bwd_smem_dw_regs(has_dres_out, weight_dtype, tail)
        if elem_bytes == 4:
            vec = config.bwd_smem_fp32_vec(dropout)
    return dict(
        BLOCK_N=block,
        TAIL_N=tail,
        IS_RMS_NORM=is_rms_norm,
        HAS_BIAS=has_bias,
        HAS_DRESIDUAL_OUT=has_dres_out,
        STORE_DRESIDUAL=store_dres,
        HAS_DROPOUT=dropout,
        ZERO_CENTERED_WEIGHT=zero_centered_weight,
        DW_REGS=dw_regs,
        STAGES=stages,
        VEC=vec,
        TAIL_VEC=max(tail // (32 * warps), 1),
        NUM_WARPS=warps,
        SPLIT=split,
        SPLIT_P2=config.next_power_of_2(split),
        LAG=lag,
        HAS_W1=has_w1,
        HAS_B1=has_b1,
        WS_PREFETCH=split > 1 and config.BWD_SMEM_WS_PREFETCH,
        DRES_REGS=dres_regs,
    )


def _bwd_run(
    s, weight, weight1, mean, rstd, dy, dy1, dresidual_out, x0, layerscale, rowscale, seeds,
    dx, dx1, dresidual, parts, c12, g0, g1, g2, g3, g4, has_bias, has_b1, dropout_p,
    is_rms_norm, zero_centered_weight, block_n, num_chunks, tail, smem, warps, max_programs,
    warm=False, kplan=None, ws_next=None,
):  # fmt: skip
    """Launch the backward and the sum of its partials into the gradients ``g0``.. (one per
    partial, None beyond), or with ``warm`` only start compiling its kernels (outputs may then
    be :class:`~fused_norm.launch.Stand`-ins). ``parts`` is the ``(partials, programs, N)`` fp32
    buffer of the partial parameter gradients (dw, then db, dw1, db1, dls where present).
    ``block_n`` is the padded block, held as two (``block_n // 2`` then ``tail`` columns) where
    ``tail`` > 0; fused_norm_bwd chose them, and ``smem``: smem_kernels' kernel instead of
    kernels.py's (one-block rows). ``kplan``: _bwd_kernel_plan's answer where the caller has
    it. ``ws_next``: the next exchanging launch's workspace (workspace.take; None: a scratch
    one, or for a warm-up ``c12``)."""
    m, n = s.shape
    if m == 0:
        return
    if ws_next is None and _exchanges(c12):
        ws_next = c12 if warm else torch.empty_like(c12)
    partials, programs = parts.shape[0], parts.shape[1]
    dev = s.device
    if kplan is None:  # the custom op's body (torch.compile): plans kept by its arguments
        key = (
            dev, n, block_n, num_chunks, tail, smem, warps, max_programs, partials, has_bias, has_b1,
            dropout_p > 0.0, is_rms_norm, zero_centered_weight,
            *(None if t is None else t.dtype
              for t in (s, weight, weight1, mean, dy, dy1, dresidual_out, x0, layerscale,
                        rowscale, dx1, dresidual, c12)),
        )  # fmt: skip
        kplan = _OP_KPLANS.get(key)
        if kplan is None:
            kplan = _OP_KPLANS[key] = _bwd_kernel_plan(
                dev, s, dy, dy1, dresidual_out, x0, weight1, layerscale, rowscale, dx1,
                dresidual, c12, has_bias, has_b1, dropout_p, is_rms_norm, zero_centered_weight,
                block_n, num_chunks, tail, smem, partials, warps, max_programs, weight.dtype,
            )  # fmt: skip
    flags, stage_key, maxnreg, sums, red = kplan
    red_grid = (config.cdiv(n, red["BLOCK_N"]), partials)
    red_args = (parts, g0, g1, g2, g3, g4, programs, n)
    if smem:
        args = (
            s, weight, weight1, mean, rstd, dy, dy1, dresidual_out, seeds, dx, dresidual, parts,
            c12, ws_next, s.stride(0), dy.stride(0), _stride0(dy1), _stride0(dresidual_out),
            dx.stride(0), _stride0(dresidual), programs * n, m, n, config.cdiv(m, programs),
            dropout_p,
        )  # fmt: skip
        (_SMEM.warm if warm else _SMEM)((programs * num_chunks,), dev, args, flags, warps)
        if warm:
            _warm_sum(dev, red_args, red, n, warps, num_chunks, smem)
        else:
            _RED(red_grid, dev, red_args, red, config.PARTIALS_SUM_WARPS)
        return
    if sums is not None:
        _row_sums(s, dy, dy1, weight, weight1, mean, rstd, c12, sums, warm)
    args = _bwd_args(
        s, weight, weight1, mean, rstd, dy, dy1, dresidual_out, x0, layerscale, rowscale,
        seeds, dx, dx1, dresidual, parts, c12, dropout_p, programs, ws_next,
    )  # fmt: skip
    grid = (programs * num_chunks,) if _exchanges(c12) else (programs, num_chunks)
    if warm:
        fallback = _unpipelined(flags)
        sizes = (s, dy, dy1, dresidual_out, x0, weight, weight1)
        if fallback is not None and _overflows(dev, flags, *sizes):
            # The launch will take the fallback: it compiles beside the pipelined kernel (which
            # the launch compiles first, and finds too big), not after it (bench/NOTES.md #86).
            _BWD.warm(grid, dev, args, fallback, warps, maxnreg=maxnreg)
            fallback = None
        _BWD.warm(grid, dev, args, flags, warps, maxnreg=maxnreg, fallback=fallback)
        _warm_sum(dev, red_args, red, n, warps, num_chunks, smem)
        return
    _fitting_stages(lambda f: _BWD(grid, dev, args, f, warps, maxnreg=maxnreg), flags, stage_key)
    _RED(red_grid, dev, red_args, red, config.PARTIALS_SUM_WARPS)


def _overflows(dev, flags, *tensors) -> bool:
    """Whether the backward kernel of these constexprs surely takes more shared memory than a
    program may: _pipeline_bytes, a lower bound, above the device's limit."""
    return dev.type == "cuda" and _pipeline_bytes(flags, *tensors) > config.max_shared(dev.index)


def _pipeline_bytes(flags, s, dy, dy1, dresidual_out, x0, weight, weight1) -> int:
    """config.bwd_pipeline_bytes of the backward kernel of these constexprs and tensors (or
    Stand-ins): the rows it loads, the weights."""
    rows = sum(_row_sizes(s, dy, dy1, dresidual_out, x0))
    weights = _weight_bytes(weight.dtype, None if weight1 is None else weight1.dtype)
    return config.bwd_pipeline_bytes(
        flags["BLOCK_N"] + flags["TAIL_N"], flags["TILE_ROWS"], rows, weights, flags["ROW_STAGES"]
    )


def _warm_sum(dev, args, red, n, warps, num_chunks, smem) -> None:
    """Start compiling the partials' sum (_RED.warm) in each layout the launch may take. A
    warm-up's plan does not know the backward's grid yet (the programs per SM that fit:
    _bwd_resident; smem_kernels' backward: one), only a bound on it, and
    config.partials_sum_layout chooses the tile and its pipelining by the row blocks: the
    layouts of every count of them that 1 to the bound's programs per SM give are compiled
    (``warps``, ``num_chunks``: the backward kernel's)."""
    per_sm = 1 if smem else max(config.BWD_WARPS_PER_SM // warps, 1)
    layouts = {
        config.partials_sum_layout(
            n, red["PARTIALS"], config.bwd_num_programs(1 << 62, dev, warps, num_chunks, r), dev
        )
        for r in range(1, per_sm + 1)
    }
    for block_n, block_p, stages in sorted(layouts):
        layout = {**red, "BLOCK_N": block_n, "BLOCK_P": block_p, "STAGES": stages}
        grid = (config.cdiv(n, block_n), red["PARTIALS"])
        _RED.warm(grid, dev, args, layout, config.PARTIALS_SUM_WARPS)


def _empty(shape, dtype, dev, warm):
    """A buffer the backward's kernels write: ``torch.empty``, or for a warm-up (which
    allocates nothing) a :class:`~fused_norm.launch.Stand`-in of that dtype and shape."""
    return Stand(dtype, shape) if warm else torch.empty(shape, dtype=dtype, device=dev)


def _row_sums(s, dy, dy1, weight, weight1, mean, rstd, c12, sums, warm) -> None:
    """Launch the row-sums pre-pass into ``c12`` (or with ``warm`` start compiling it): rows in
    ``sums["PARTS"]`` parts, whose shares go to a scratch buffer that a second kernel adds."""
    m, n = s.shape
    parts = sums["PARTS"]
    dev = s.device
    shares = _empty((m, 2, parts), torch.float32, dev, warm) if parts > 1 else c12
    args = (s, dy, dy1, weight, weight1, mean, rstd, shares, s.stride(0), dy.stride(0),
            _stride0(dy1), n)  # fmt: skip
    (_SUMS.warm if warm else _SUMS)((m * parts,), dev, args, sums, config.BWD_SUMS_WARPS)
    if parts > 1:
        rows = config.BWD_SUMS_ADD_ROWS
        add = dict(ROWS=rows, PARTS=parts, IS_RMS_NORM=sums["IS_RMS_NORM"], GDC=sums["GDC"])
        (_ADD.warm if warm else _ADD)(
            (config.cdiv(m, rows),), dev, (shares, c12, m), add, config.BWD_SUMS_ADD_WARPS
        )


def _unpipelined(flags):
    """The backward kernel's constexprs with its row loop unpipelined, the launch's fallback
    where the pipeline's buffers do not fit (_fitting_stages); None where it is unpipelined."""
    return {**flags, "ROW_STAGES": 1} if flags["ROW_STAGES"] > 1 else None


def _fitting_stages(call, flags, stage_key):
    """``call(flags)``; where the pipeline's buffers do not fit this device's shared memory
    (config sizes them from an estimate), ``call`` again unpipelined, and remember that for
    this configuration (under ``stage_key``, from _bwd_plan)."""
    try:
        return call(flags)
    except OutOfResources:
        fallback = _unpipelined(flags)
        if fallback is None:
            raise
        _STAGES_THAT_FIT[stage_key] = 1
        _BWD_PLANS.clear()  # plans made before hold the stage count that did not fit
        _OP_KPLANS.clear()
        return call(fallback)


# (device, then bwd_row_stages' arguments) -> 1 where the pipelined kernel did not fit.
_STAGES_THAT_FIT: dict = {}

# The custom op's arguments that select the kernels (_bwd_run's key) -> _bwd_kernel_plan's
# answer, for the op's body under torch.compile, which gets no _BwdPlan (emptied as those are).
_OP_KPLANS: dict = {}


_bwd_op = torch.library.custom_op(
    "fused_norm::bwd",
    _bwd_launch,
    mutates_args=("dx", "dx1", "dresidual", "parts", "c12", "g0", "g1", "g2", "g3", "g4"),
)
_bwd_op.register_fake(lambda *args, **kwargs: None)


class _BwdPlan(NamedTuple):
    """fused_norm_bwd's choices for one configuration, whatever the row count."""

    own_dresidual: bool  # dresidual in a buffer of its own (else it is dx)
    own_dx1: bool  # likewise dx1
    partials: int  # parameter gradients accumulated (slabs of the partials' buffer)
    layout: tuple  # (block_n, num_chunks, tail, smem, warps): config.bwd_launch_layout's, or
    # smem_kernels' (smem: config.bwd_smem_partials)
    c12: Optional[torch.dtype]  # int64 words of exchanged row sums, fp32 pre-pass sums, or None
    max_programs: int  # row blocks of the grid for a row count without bound
    kplan: tuple  # _bwd_kernel_plan's answer


# fused_norm_bwd's key -> _BwdPlan (emptied when a setting of config changes).
_BWD_PLANS: dict = {}
config.DERIVED_CACHES.extend((_FWD_PLANS, _BWD_PLANS, _OP_KPLANS, _RESIDENT))


def _bwd_make_plan(
    dev, n, s, dy, dy1, dresidual_out, x0, weight, bias, weight1, bias1, layerscale, rowscale,
    seeds, mean, rstd, dropout_p, is_rms_norm, zero_centered_weight, x_dtype, residual_dtype,
    x1_dtype, ask_resident, aligned,
):  # fmt: skip
    """The _BwdPlan of fused_norm_bwd's arguments; without ``ask_resident`` (a warm-up, whose
    kernel serves any grid, or no rows) it does not compile the kernel to ask how many of its
    programs fit on the device at once. ``aligned``: s and dy are 16-byte aligned with row
    strides of multiples of 16 elements, and so are dresidual_out and dy1
    (where present; config.bwd_smem_partials)."""
    # dx equals ds, the gradient of the pre-norm sum, unless x was scaled or dropped.
    dx_is_ds = dropout_p == 0.0 and rowscale is None and layerscale is None
    own_dres = residual_dtype is not None and not (dx_is_ds and residual_dtype == x_dtype)
    own_dx1 = x1_dtype is not None and not (dx_is_ds and x1_dtype == x_dtype)
    # The parameters whose gradients the kernel accumulates, in the order of their slabs.
    partials = sum(t is not None for t in (weight, bias, weight1, bias1, layerscale))
    elem_bytes = max(s.element_size(), dy.element_size(), x_dtype.itemsize)
    dropout = dropout_p > 0.0
    # A norm of x alone, as the kernel sees it: no residual gradient in or out, no x1, no dropout.
    plain = dresidual_out is None and not own_dres and not own_dx1 and not dropout
    w4 = _param_bytes(weight, bias, weight1, bias1) == 4
    # What smem_kernels' kernel would have to do beyond the norm (config.bwd_smem_partials).
    kind = None
    if not own_dx1 and rowscale is None and layerscale is None:
        kind = "x1" if dy1 is not None else "plain" if plain else "residual"
    staged = _staged_bytes(s, dy, dresidual_out, dy1, dropout)
    smem = config.bwd_smem_partials(
        n, elem_bytes, partials, kind, dev, w4, aligned, staged, bool(is_rms_norm)
    )
    if smem:  # one program per SM (its shared memory), the row held whole or in slices
        warps = config.BWD_SMEM_WARPS
        if config.bwd_smem_sliced(n, elem_bytes, kind):  # slices exchanging their row sums
            weight_bytes = _weight_bytes(weight.dtype, None if weight1 is None else weight1.dtype)
            block_n, num_chunks, _, _ = config.bwd_smem_slices(
                n, staged, weight_bytes, kind == "x1"
            )
            tail, exchange = 0, True
        else:
            block_n, tail, _ = config.bwd_smem_layout(n)  # (staging depth: smem_flags)
            num_chunks, exchange = 1, False
    else:
        block_n, num_chunks, tail, warps, exchange = config.bwd_launch_layout(
            n, elem_bytes, partials, dropout, plain, dev, w4, dy1 is not None
        )
    c12 = torch.int64 if exchange else (torch.float32 if num_chunks > 1 else None)
    # What the kernel is specialised on of the buffers allocated per call: their dtypes.
    dx, dresidual, dx1 = (
        Stand(d, (1, n)) if d is not None else None
        for d in (x_dtype, residual_dtype if own_dres else None, x1_dtype if own_dx1 else None)
    )
    c12_stand = Stand(c12, (1, 2)) if c12 is not None else None
    resident = 1 if smem else 0
    if (ask_resident and dev.type == "cuda" and config.BWD_RESIDENT_GRID and not smem
            and not config.bwd_whole_waves(block_n, num_chunks, tail, partials, dropout, plain)):  # fmt: skip
        # The persistent grid holds only programs that run at once (bwd_num_programs). A
        # warm-up (from the forward) does not wait for this compile: its kernel serves any grid.
        tensors = (s, weight, weight1, mean, rstd, dy, dy1, dresidual_out, x0, layerscale,
                   rowscale, seeds, dx, dx1, dresidual)  # fmt: skip
        dtypes = tuple(None if t is None else t.dtype for t in tensors) + (torch.float32, c12)
        opts = (bias is not None, bias1 is not None, bool(is_rms_norm), bool(zero_centered_weight),
                block_n, num_chunks, tail, partials, warps)  # fmt: skip
        resident = _bwd_resident(dev, dtypes, n, dropout, opts)
    max_programs = config.bwd_num_programs(1 << 62, dev, warps, num_chunks, resident)
    kplan = _bwd_kernel_plan(
        dev, s, dy, dy1, dresidual_out, x0, weight1, layerscale, rowscale, dx1, dresidual,
        c12_stand, bias is not None, bias1 is not None, dropout_p, is_rms_norm,
        zero_centered_weight, block_n, num_chunks, tail, smem, partials, warps, max_programs,
        weight.dtype,
    )  # fmt: skip
    layout = (block_n, num_chunks, tail, smem, warps)
    return _BwdPlan(own_dres, own_dx1, partials, layout, c12, max_programs, kplan)


def fused_norm_bwd(
    dy, s, weight, bias, weight1, bias1, mean, rstd, dy1=None, dresidual_out=None,
    x0=None, layerscale=None, rowscale=None, seeds=None, dropout_p=0.0, is_rms_norm=False,
    zero_centered_weight=False, x_dtype=None, residual_dtype=None, x1_dtype=None, warm=False,
):  # fmt: skip
    """Run the backward on 2-D tensors.

    ``s`` is the normalised pre-norm sum the forward saw. ``residual_dtype`` / ``x1_dtype`` are
    the dtypes of the residual / x1 inputs, None where absent.
    Returns ``(dx, dw, db, dresidual, dx1, dw1, db1, dlayerscale)``; absent parts are None.
    ``dresidual`` (and ``dx1``) is ``dx`` itself where the two are equal.

    ``warm=True`` allocates and launches nothing and returns None: it starts compiling, in a
    background thread, the kernels that a backward with arguments like these will launch. The
    forward asks for it before its own first compile, with its outputs standing in for their
    gradients (same dtypes and shapes), so that the two compiles overlap.
    """
    m, n = s.shape
    if warm and m == 0:
        return None
    dev = s.device
    x_dtype = x_dtype or s.dtype
    compiling = torch.compiler.is_compiling()
    cached = not (warm or compiling or m == 0)
    # smem_kernels' 16-byte copies need aligned rows; under torch.compile (fake tensors have
    # no addresses) the kernels.py kernel serves. (Stand-ins of a warm-up count as aligned.)
    aligned = (
        not compiling and config.bwd_smem_width(n) and _aligned16(s) and _aligned16(dy)
        and all(t is None or _aligned16(t) for t in (dresidual_out, dy1))
    )  # fmt: skip
    plan = None
    if cached:
        # Everything the plan depends on: the dtypes (None where absent) and the flags.
        key = (
            dev, n, s.dtype, dy.dtype, x_dtype, residual_dtype, x1_dtype,
            None if dy1 is None else dy1.dtype,
            None if dresidual_out is None else dresidual_out.dtype,
            None if x0 is None else x0.dtype, weight.dtype,
            None if bias is None else bias.dtype, None if weight1 is None else weight1.dtype,
            None if bias1 is None else bias1.dtype,
            None if layerscale is None else layerscale.dtype,
            None if rowscale is None else rowscale.dtype, seeds is not None, mean is not None,
            dropout_p > 0.0, is_rms_norm, zero_centered_weight, aligned,
        )  # fmt: skip
        plan = _BWD_PLANS.get(key)
    if plan is None:
        plan = _bwd_make_plan(
            dev, n, s, dy, dy1, dresidual_out, x0, weight, bias, weight1, bias1, layerscale,
            rowscale, seeds, mean, rstd, dropout_p, is_rms_norm, zero_centered_weight, x_dtype,
            residual_dtype, x1_dtype, not warm and m > 0, aligned,
        )  # fmt: skip
        if cached:
            _BWD_PLANS[key] = plan
    block_n, num_chunks, tail, smem, warps = plan.layout

    dx = _empty((m, n), x_dtype, dev, warm)
    dresidual = _empty((m, n), residual_dtype, dev, warm) if plan.own_dresidual else None
    dx1 = _empty((m, n), x1_dtype, dev, warm) if plan.own_dx1 else None
    c12 = ws_next = ws_pair = None
    if plan.c12 == torch.int64:  # words of the row sums, -1 until published
        if warm:
            c12 = Stand(torch.int64, (m, num_chunks))
        elif compiling or m == 0:  # (torch.compile traces the buffer: a fresh one)
            c12 = torch.full((m, num_chunks), -1, dtype=torch.int64, device=dev)
        else:
            c12, ws_next, ws_pair = workspace.take(dev, m * num_chunks, -1)
    elif plan.c12 is not None:
        c12 = _empty((m, 2), torch.float32, dev, warm)
    params = [t for t in (weight, bias, weight1, bias1, layerscale) if t is not None]
    if m == 0 and not warm:  # nothing launches
        grads = [torch.zeros((n,), dtype=p.dtype, device=dev) for p in params]
    else:
        programs = max(min(plan.max_programs, m), 1)
        parts = _empty((plan.partials, programs, n), torch.float32, dev, warm)
        # Each gradient in its parameter's dtype, in storage of its own (not views of one
        # tensor); the partials' sum writes them (g0.., in the order of the slabs).
        grads = [_empty((n,), p.dtype, dev, warm) for p in params]
        g = grads + [None] * (5 - len(grads))
        args = (
            s, weight, weight1, mean, rstd, dy, dy1, dresidual_out, x0, layerscale, rowscale,
            seeds, dx, dx1, dresidual, parts, c12, *g, bias is not None, bias1 is not None,
            float(dropout_p), bool(is_rms_norm), bool(zero_centered_weight), block_n,
            num_chunks, tail, smem, warps, plan.max_programs,
        )  # fmt: skip
        if warm:
            _bwd_run(*args, warm=True, kplan=plan.kplan)
            return None
        if compiling:
            _bwd_op(*args)
        else:
            _bwd_run(*args, kplan=plan.kplan, ws_next=ws_next)
            workspace.done(ws_pair)
    dw, db, dw1, db1, dls = (
        grads.pop(0) if p is not None else None for p in (weight, bias, weight1, bias1, layerscale)
    )
    if residual_dtype is not None and dresidual is None:
        dresidual = dx
    if x1_dtype is not None and dx1 is None:
        dx1 = dx
    return dx, dw, db, dresidual, dx1, dw1, db1, dls

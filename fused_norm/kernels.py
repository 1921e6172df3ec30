"""Triton kernels: one forward and one backward kernel, specialised by constexpr flags, the
backward's row-sums pre-pass for rows wider than one block, and the sum of the backward's
partial parameter gradients.

Design notes
------------
* Forward, one program per row (narrow rows: a tile of several, config.fwd_rows_per_program).
  The row is read once: every optional input is combined into the fp32 pre-norm sum ``s`` in
  registers, ``s`` is stored as the residual stream if asked, the statistics are taken from
  the fp32 ``s`` in registers, and ``y = xhat * w + b`` is written. LayerNorm takes sum(s) and
  sum(s^2) in one joint reduction and M2 = sum(s^2) - sum(s) * mean, unless that cancels
  (the mean beyond ~2.6 standard deviations, ``_cancels``): then M2 = sum((s - mean)^2), a
  second pass over the registers, as accurate as Welford. One whole block of 16K 16-bit
  columns without dropout or x1 always takes the mean and then that second pass
  (``JOINT_STATS``, config.fwd_joint_stats: the joint sum costs it registers). A row whose width is not a power of two may
  be held as two power-of-two blocks, ``BLOCK_N`` then ``TAIL_N`` columns, instead of one
  padded block (``config.block_tail``); the backward likewise.
  Rows wider than one block (``NUM_CHUNKS > 1``) take two sweeps over the row: the first combines
  the inputs chunk by chunk, stores the residual stream and sums ``s`` and ``s^2`` per column
  lane, reduced once per row (LayerNorm's exact M2 takes one more sweep where that cancels);
  the second re-reads the residual stream (or re-forms ``s`` from the inputs when it is not
  stored) and normalises. The first sweep's loads ask L2 to keep the row, the
  second's to let it go (config.FWD_CHUNK_EVICT).
* Rows wider than 64 KB on a CUDA GPU are instead split over several programs of 4K 16-bit
  (2K fp32) columns each (``SPLIT > 1``, ``_fwd_split_row``): each part stays in registers,
  publishes its (mean, M2) through an int64 workspace and waits for its partners' before
  normalising, so the row is read once. Where ``s`` equals a 16-bit tensor (``HOLD``,
  config.fwd_hold: x itself for a norm of x alone) the part holds that tensor, not ``s``, across
  the wait and widens it again exactly afterwards (``_widen``, or for fp16 LayerNorm
  ``_convert_copy``): half the registers.
* Dropout masks are never stored for the backward: each row has a seed (< 2**32, kept as an
  int64), and Philox(seed, col) regenerates the same keep/drop decision in the backward. Rows
  of ``x`` use ``SEEDS[row]``, rows of ``x1`` ``SEEDS[M + row]``. The forward either reads
  them (drawn by ``torch.randint``: CUDA graph capture, torch.compile) or, given the call's key
  (``SEED_KEY``, eager calls: ops.dropout_key; not the x1 path's wide rows, ops._fwd_plan),
  derives seed ``i`` as the key's low word plus ``i`` mod 2**32 (no two seeds of a call alike,
  below 2**32 of them) and stores it there for the backward.
* Backward, a persistent grid of row blocks, at most as many as fit on the device at once
  (ops sizes it after asking the compiled kernel; see the note above _fused_norm_bwd_kernel):
  program ``(p, c)`` owns the contiguous rows
  ``[p * rows_per_program, (p + 1) * rows_per_program)`` and the column block ``c``, keeps fp32
  partial sums of dW/dB for its columns in registers and writes them once to row ``p`` of its
  ``(num_row_blocks, N)`` slab of one fp32 buffer; the host then launches
  ``_sum_partials_kernel``, which sums every slab over its row blocks in a fixed order and
  casts each gradient to its parameter's dtype. No atomic accumulation: the result is bitwise
  deterministic. A row that fits one block
  (``NUM_CHUNKS == 1``) takes its sums c1, c2 in registers. Wider rows go to column blocks on
  different programs (per-program partials then span BLOCK_N columns, not N, and there are few
  row blocks however wide the row), which get c1, c2 by exchanging their blocks' partial sums a
  row ahead (EXCHANGE, one word per row and block, written once by compare-and-swap) or, where
  that does not apply (config.bwd_exchange_fits, ROCm), from ``_bwd_row_sums_kernel`` (one more
  read of s and dy, in parts of a row whose shares ``_row_shares_sum_kernel`` adds).
* Row offsets are int64 (``row.to(tl.int64) * stride``), so M*N may exceed 2**31.

The maths (per row, N columns, fp32):
    forward   s = [dropout(x * rowscale * layerscale)] + [dropout(x1)] + [residual]
              LayerNorm: mean = sum(s)/N, xhat = (s - mean) * rstd, rstd = 1/sqrt(var + eps)
              RMSNorm:   xhat = s * rstd,  rstd = 1/sqrt(sum(s^2)/N + eps)
              y = xhat * w + b, y1 = xhat * w1 + b1
    backward  wdy = w * dy (+ w1 * dy1),  c1 = sum(xhat * wdy) / N,  c2 = sum(wdy) / N
              LayerNorm: ds = (wdy - (xhat * c1 + c2)) * rstd
              RMSNorm:   ds = (wdy - xhat * c1) * rstd
              ds += dresidual_out (prenorm);  dresidual = ds
              dx = ds * keep / (1 - p) * rowscale * layerscale,  dx1 = ds * keep1 / (1 - p)
              dw += dy * xhat, db += dy (likewise dw1, db1), dlayerscale += dx_pre * x
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .config import INTERPRETED

# LayerNorm's M2 from one joint reduction of (s, s^2) is kept while sum(s^2) <= CANCEL_RATIO *
# M2 (see _cancels).
CANCEL_RATIO = tl.constexpr(8.0)
# Triton's interpreter runs a tl.reduce with a combine function element by element in Python:
# slow, and a sequential sum, less accurate than the tree a GPU (or its numpy tl.sum) adds in.
JOINT_SUMS = tl.constexpr(not INTERPRETED)
# Triton's default L2 eviction policy of a load (a constexpr: a plain "" default is not one).
NO_EVICT = tl.constexpr("")


@triton.jit
def _keep_mask(SEEDS, seed_row, col0, dropout_p, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """Dropout keep-decisions of columns ``[col0, col0 + BLOCK_N)`` of one row, or with ROWS > 0
    of ROWS rows (``seed_row`` a (ROWS, 1) tensor; the result is (ROWS, BLOCK_N)).

    Each decision takes 16 random bits: one Philox4x32-10 call (``tl.randint4x``) gives four
    32-bit numbers, i.e. eight 16-bit halves, for eight adjacent columns in a fixed interleaving.
    That is an eighth of the arithmetic of one ``tl.rand`` per column, which made dropout
    compute-bound. A column is dropped when its 16 bits fall below ``round(p * 2**16)``, so the
    drop probability is p rounded to a multiple of 2**-16 (off by at most 2**-17 ~ 7.6e-6).
    ``col0`` and BLOCK_N are multiples of 8, so the decision depends on (seed, column) alone.
    """
    if SEEDS.dtype.is_ptr():
        seed = tl.load(SEEDS + seed_row).to(tl.uint32)
    else:  # the call's key (the forward's SEED_KEY): _seed_of
        seed = _seed_of(SEEDS, seed_row)
    octet = col0 // 8 + tl.arange(0, BLOCK_N // 8)
    if ROWS > 0:
        octet = octet[None, :]
        bits = tl.reshape(_octet_bits(seed, octet), (ROWS, BLOCK_N))
    else:
        bits = tl.reshape(_octet_bits(seed, octet), (BLOCK_N,))
    return _keeps(bits, dropout_p)


@triton.jit
def _seed_of(key, i):
    """Seed ``i`` (x's rows, then x1's) of a call with the int64 key ``key``, as a uint32: the
    key's low word plus ``i``, mod 2**32."""
    return key.to(tl.uint32) + i.to(tl.uint32)


@triton.jit
def _store_seeds(SEEDS, key, row, M, ok, HAS_X1: tl.constexpr):
    """Store the seeds of x's row(s) ``row`` (and of x1's) where ``ok``, for the backward."""
    tl.store(SEEDS + row, _seed_of(key, row).to(tl.int64), mask=ok)
    if HAS_X1:
        tl.store(SEEDS + M + row, _seed_of(key, M + row).to(tl.int64), mask=ok)


@triton.jit
def _store_row_seeds(SEEDS, key, row0, M, SPLIT: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
                     HAS_X1: tl.constexpr):  # fmt: skip
    """_store_seeds of the forward program's rows (``row0``: _fused_norm_fwd_kernel's)."""
    if SPLIT > 1:  # program p: part p % SPLIT of row p // SPLIT (_fwd_split_row)
        _store_seeds(SEEDS, key, row0 // SPLIT, M, row0 % SPLIT == 0, HAS_X1)
    elif ROWS_PER_PROGRAM > 1:
        rows = row0 + tl.arange(0, ROWS_PER_PROGRAM)
        _store_seeds(SEEDS, key, rows, M, rows < M, HAS_X1)
    else:
        _store_seeds(SEEDS, key, row0, M, True, HAS_X1)


@triton.jit
def _octet_bits(seed, octet):
    """The 16 random bits of each column of the octets ``octet`` (columns ``8 * octet`` to
    ``8 * octet + 7``) of a row with seed ``seed`` (uint32), shaped ``octet.shape + (2, 2, 2)``:
    reshaped to ``(..., 8 * octet.shape[-1])`` they are in column order. Shared with
    smem_kernels (Gluon calls it on tensors with layouts), so both draw the same mask."""
    r0, r1, r2, r3 = tl.randint4x(seed, octet)
    lo = tl.join(tl.join(r0 & 0xFFFF, r1 & 0xFFFF), tl.join(r2 & 0xFFFF, r3 & 0xFFFF))
    hi = tl.join(tl.join(r0 >> 16, r1 >> 16), tl.join(r2 >> 16, r3 >> 16))
    return tl.join(lo, hi)


@triton.jit
def _keeps(bits, dropout_p):
    """Keep-decisions from _octet_bits' bits: kept unless the bits fall below p * 2**16."""
    bits = bits.to(tl.float32)  # exact: < 2**16
    # For integer bits, bits + 0.5 > p * 2**16  <=>  bits >= round(p * 2**16) (halves up).
    return bits + 0.5 > dropout_p * 65536.0


@triton.jit
def _combine_inputs(
    X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
    row, col0, cols, col_mask, M, N, stride_x_row, stride_res_row, stride_x1_row, dropout_p,
    BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_X1: tl.constexpr,
    HAS_ROWSCALE: tl.constexpr, HAS_LAYERSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    STORE_MASK: tl.constexpr, ROWS: tl.constexpr = 0, EVICT: tl.constexpr = NO_EVICT,
):  # fmt: skip
    """The fp32 pre-norm sum ``s`` of one row chunk (zero beyond N); with ROWS > 0 of ROWS rows
    at once (``row`` (ROWS, 1), ``cols`` (1, BLOCK_N): see _fwd_rows). ``EVICT``: the L2
    eviction policy of the row loads (Triton's ``eviction_policy``; "" the default)."""
    x = tl.load(X + row * stride_x_row + cols, mask=col_mask, other=0.0,
                eviction_policy=EVICT).to(tl.float32)  # fmt: skip
    if HAS_ROWSCALE:
        x *= tl.load(ROWSCALE + row).to(tl.float32)
    if HAS_LAYERSCALE:
        x *= tl.load(LAYERSCALE + cols, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = _keep_mask(SEEDS, row, col0, dropout_p, BLOCK_N, ROWS)
        x = tl.where(keep, x * (1.0 / (1.0 - dropout_p)), 0.0)
        if STORE_MASK:
            tl.store(MASK + row * N + cols, keep, mask=col_mask)
    if HAS_X1:
        x1 = tl.load(X1 + row * stride_x1_row + cols, mask=col_mask, other=0.0,
                     eviction_policy=EVICT).to(tl.float32)  # fmt: skip
        if HAS_DROPOUT:
            keep1 = _keep_mask(SEEDS, M + row, col0, dropout_p, BLOCK_N, ROWS)
            x1 = tl.where(keep1, x1 * (1.0 / (1.0 - dropout_p)), 0.0)
            if STORE_MASK:
                tl.store(MASK1 + row * N + cols, keep1, mask=col_mask)
        x += x1
    if HAS_RESIDUAL:
        x += tl.load(RESIDUAL + row * stride_res_row + cols, mask=col_mask, other=0.0,
                     eviction_policy=EVICT).to(tl.float32)  # fmt: skip
    return x


@triton.jit
def _add_pairs(a1, a2, b1, b2):
    return a1 + b1, a2 + b2


@triton.jit
def _pair_sums(a, b, axis: tl.constexpr):
    """``(sum(a), sum(b))`` along ``axis`` in one reduction: one exchange between warps
    (two tl.sum under the interpreter: see JOINT_SUMS)."""
    if JOINT_SUMS:
        sum_a, sum_b = tl.reduce((a, b), axis, _add_pairs)
    else:
        sum_a = tl.sum(a, axis=axis)
        sum_b = tl.sum(b, axis=axis)
    return sum_a, sum_b


@triton.jit
def _fold_repeats(p, BLOCK_N: tl.constexpr, REPEATS: tl.constexpr):
    """A ``(BLOCK_N,)`` row of values summed over its REPEATS quarters, element by element,
    in their order (((q0 + q1) + q2) + q3): ``(BLOCK_N // REPEATS,)`` values with the row's
    sum. Where each thread holds one value of every quarter (its REPEATS repeats of the
    layout, at a stride of BLOCK_N // REPEATS), the reshape, permute and splits move no data
    and the adds run in each thread one after another, as Triton 3.6's tl.sum added a
    thread's values; Triton 3.9 adds them in a tree (triton-lang/triton#9220), and in
    RMSNorm's backward at 4096 columns ptxas then issued a quarter of the row's loads after
    the maths on the rest (config.bwd_sum_repeats). REPEATS 1 returns the row as it is."""
    tl.static_assert(REPEATS == 1 or REPEATS == 4, "_fold_repeats: REPEATS is 1 or 4")
    if REPEATS == 4:
        q = tl.permute(tl.reshape(p, [2, 2, BLOCK_N // 4]), (2, 0, 1))
        even, odd = tl.split(q)  # quarters (0, 2) and (1, 3)
        q0, q2 = tl.split(even)
        q1, q3 = tl.split(odd)
        return ((q0 + q1) + q2) + q3
    else:
        return p


@triton.jit
def _sums(s, axis: tl.constexpr):
    """``(sum(s), sum(s * s))`` along ``axis`` in one reduction (_pair_sums)."""
    return _pair_sums(s, s * s, axis)


@triton.jit
def _cancels(squares, m2):
    """Whether ``m2 = squares - total * mean`` lost too much to cancellation, i.e. the mean is
    large against the spread (|mean| > ~2.6 standard deviations): ``m2`` is then recomputed
    exactly over ``s - mean``. Below that the relative error of m2 is at most 8x that of the
    sum of squares (a few ulps of fp32), and one joint reduction replaces two in a row
    (bench/NOTES.md #32)."""
    return squares > CANCEL_RATIO * m2


@triton.jit
def _load_affine(cols, col_mask, W, B, HAS_BIAS: tl.constexpr, EVICT: tl.constexpr = NO_EVICT):
    """One row chunk's weight and bias as stored (the weight again where there is no bias);
    ``EVICT``: their L2 eviction policy ("" the default)."""
    w = tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy=EVICT)
    b = w
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0, eviction_policy=EVICT)
    return w, b


@triton.jit
def _load_params(cols, col_mask, W, B, W1, B1, HAS_BIAS: tl.constexpr, HAS_W1: tl.constexpr,
                 HAS_B1: tl.constexpr):  # fmt: skip
    """The weights and biases of one row chunk as stored (_load_affine), loaded ahead of the
    row's statistics (config.fwd_early_params); the second pair repeats the first where there
    is no second weight."""
    w, b = _load_affine(cols, col_mask, W, B, HAS_BIAS)
    w1, b1 = w, b
    if HAS_W1:
        w1, b1 = _load_affine(cols, col_mask, W1, B1, HAS_B1)
    return w, b, w1, b1


@triton.jit
def _affine_store(xhat, cols, col_mask, row, w, b, Y, stride_y_row, HAS_BIAS: tl.constexpr,
                  ZERO_CENTERED_WEIGHT: tl.constexpr):  # fmt: skip
    """y = xhat * w + b for one row chunk (w, b as loaded), stored in Y's dtype."""
    w = w.to(tl.float32)
    if ZERO_CENTERED_WEIGHT:
        w += 1.0
    y = xhat * w
    if HAS_BIAS:
        y += b.to(tl.float32)
    tl.store(Y + row * stride_y_row + cols, y, mask=col_mask)


@triton.jit
def _normalize_store(
    xhat, cols, col_mask, row, W, B, Y, stride_y_row, W1, B1, Y1, stride_y1_row,
    HAS_BIAS: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr,
    ZERO_CENTERED_WEIGHT: tl.constexpr, params=None, EVICT: tl.constexpr = NO_EVICT,
):  # fmt: skip
    """The outputs of one row chunk: y, then y1 from the second weight and bias (HAS_W1). The
    weights and biases come from ``params`` where given (_load_params: loaded ahead of the
    statistics, config.fwd_early_params), else each pair is loaded just before its output,
    with the L2 eviction policy ``EVICT``."""
    if params is not None:
        w, b, w1, b1 = params
    else:
        w, b = _load_affine(cols, col_mask, W, B, HAS_BIAS, EVICT)
    _affine_store(xhat, cols, col_mask, row, w, b, Y, stride_y_row, HAS_BIAS,
                  ZERO_CENTERED_WEIGHT)  # fmt: skip
    if HAS_W1:
        if params is None:
            w1, b1 = _load_affine(cols, col_mask, W1, B1, HAS_B1, EVICT)
        _affine_store(xhat, cols, col_mask, row, w1, b1, Y1, stride_y1_row, HAS_B1,
                      ZERO_CENTERED_WEIGHT)  # fmt: skip


@triton.jit
def _fwd_row(
    X, Y, W, B, RESIDUAL, X1, W1, B1, Y1, RESIDUAL_OUT, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
    MEAN, RSTD, row, cols, stride_x_row, stride_y_row, stride_res_row, stride_x1_row,
    stride_y1_row, stride_res_out_row, M, N, eps, dropout_p,
    BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, IS_RMS_NORM: tl.constexpr,
    JOINT_STATS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    HAS_X1: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr,
    HAS_ROWSCALE: tl.constexpr, HAS_LAYERSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    STORE_MASK: tl.constexpr, STORE_RESIDUAL_OUT: tl.constexpr,
    ZERO_CENTERED_WEIGHT: tl.constexpr, EARLY_PARAMS: tl.constexpr,
):  # fmt: skip
    """The forward of one row held whole in registers (NUM_CHUNKS == 1): columns
    ``[0, BLOCK_N)`` and, with TAIL_N > 0, ``[BLOCK_N, BLOCK_N + TAIL_N)`` as a second block
    (5120 columns as 4096 + 1024 instead of one block padded to 8192: config.block_tail).
    LayerNorm's statistics: one joint sum where JOINT_STATS (config.fwd_joint_stats), else
    the mean, then the sum of squares about it."""
    col_mask = cols < N
    s = _combine_inputs(
        X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
        row, 0, cols, col_mask, M, N, stride_x_row, stride_res_row, stride_x1_row,
        dropout_p, BLOCK_N, HAS_RESIDUAL, HAS_X1, HAS_ROWSCALE, HAS_LAYERSCALE,
        HAS_DROPOUT, STORE_MASK,
    )  # fmt: skip
    params = None
    if EARLY_PARAMS:  # in flight beside the row's loads, not after its statistics
        params = _load_params(cols, col_mask, W, B, W1, B1, HAS_BIAS, HAS_W1, HAS_B1)
    # Both blocks are formed before either is stored: storing the first block's stream before
    # the second block's loads cost 4-5 points of copy with dropout (bench/NOTES.md #29).
    if TAIL_N > 0:
        tcols = BLOCK_N + tl.arange(0, TAIL_N)
        tmask = tcols < N
        t = _combine_inputs(
            X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
            row, BLOCK_N, tcols, tmask, M, N, stride_x_row, stride_res_row, stride_x1_row,
            dropout_p, TAIL_N, HAS_RESIDUAL, HAS_X1, HAS_ROWSCALE, HAS_LAYERSCALE,
            HAS_DROPOUT, STORE_MASK,
        )  # fmt: skip
        tparams = None
        if EARLY_PARAMS:
            tparams = _load_params(tcols, tmask, W, B, W1, B1, HAS_BIAS, HAS_W1, HAS_B1)
    if STORE_RESIDUAL_OUT:
        # Normalise the stream as stored (rounded to its dtype): the backward and the
        # next layer see that tensor; statistics of the unrounded sum would not match.
        h = s.to(RESIDUAL_OUT.dtype.element_ty)
        tl.store(RESIDUAL_OUT + row * stride_res_out_row + cols, h, mask=col_mask)
        s = h.to(tl.float32)
        if TAIL_N > 0:
            ht = t.to(RESIDUAL_OUT.dtype.element_ty)
            tl.store(RESIDUAL_OUT + row * stride_res_out_row + tcols, ht, mask=tmask)
            t = ht.to(tl.float32)
    # (t exists only where TAIL_N > 0: each use sits under that constexpr test.)
    if IS_RMS_NORM:
        m2 = tl.sum(s * s, axis=0)
        if TAIL_N > 0:
            m2 += tl.sum(t * t, axis=0)
    else:
        if JOINT_STATS:
            total, squares = _sums(s, 0)
            if TAIL_N > 0:
                t_total, t_squares = _sums(t, 0)
                total += t_total
                squares += t_squares
        else:
            total = tl.sum(s, axis=0)
            if TAIL_N > 0:
                total += tl.sum(t, axis=0)
        mean = total / N
        s = tl.where(col_mask, s - mean, 0.0)
        if TAIL_N > 0:
            t = tl.where(tmask, t - mean, 0.0)
        if JOINT_STATS:
            m2 = squares - total * mean
            if _cancels(squares, m2):
                m2 = tl.sum(s * s, axis=0)
                if TAIL_N > 0:
                    m2 += tl.sum(t * t, axis=0)
        else:
            m2 = tl.sum(s * s, axis=0)
            if TAIL_N > 0:
                m2 += tl.sum(t * t, axis=0)
        tl.store(MEAN + row, mean)
    rstd = 1.0 / tl.sqrt(m2 / N + eps)
    tl.store(RSTD + row, rstd)
    xhat = s * rstd
    _normalize_store(xhat, cols, col_mask, row, W, B, Y, stride_y_row, W1, B1, Y1,
                     stride_y1_row, HAS_BIAS, HAS_W1, HAS_B1, ZERO_CENTERED_WEIGHT,
                     params)  # fmt: skip
    if TAIL_N > 0:
        that = t * rstd
        _normalize_store(that, tcols, tmask, row, W, B, Y, stride_y_row, W1, B1, Y1,
                         stride_y1_row, HAS_BIAS, HAS_W1, HAS_B1, ZERO_CENTERED_WEIGHT,
                         tparams)  # fmt: skip


@triton.jit
def _fwd_rows(
    X, Y, W, B, RESIDUAL, X1, W1, B1, Y1, RESIDUAL_OUT, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
    MEAN, RSTD, row0, stride_x_row, stride_y_row, stride_res_row, stride_x1_row,
    stride_y1_row, stride_res_out_row, M, N, eps, dropout_p,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, IS_RMS_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_X1: tl.constexpr,
    HAS_W1: tl.constexpr, HAS_B1: tl.constexpr, HAS_ROWSCALE: tl.constexpr,
    HAS_LAYERSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_MASK: tl.constexpr,
    STORE_RESIDUAL_OUT: tl.constexpr, ZERO_CENTERED_WEIGHT: tl.constexpr,
    EARLY_PARAMS: tl.constexpr,
):  # fmt: skip
    """The forward of ROWS narrow rows from ``row0`` as one (ROWS, BLOCK_N) tile: every load of
    the tile is issued before the first reduction (config.fwd_rows_per_program). Tile rows past
    the last row repeat it, so that loads need no row mask; they store what its own tile row
    stores."""
    rows = tl.minimum(row0 + tl.arange(0, ROWS), M - 1)
    row = rows[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    col_mask = cols < N
    s = _combine_inputs(
        X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
        row, 0, cols, col_mask, M, N, stride_x_row, stride_res_row, stride_x1_row,
        dropout_p, BLOCK_N, HAS_RESIDUAL, HAS_X1, HAS_ROWSCALE, HAS_LAYERSCALE,
        HAS_DROPOUT, STORE_MASK, ROWS,
    )  # fmt: skip
    params = None
    if EARLY_PARAMS:  # in flight beside the tile's loads (as _fwd_row)
        params = _load_params(cols, col_mask, W, B, W1, B1, HAS_BIAS, HAS_W1, HAS_B1)
    if STORE_RESIDUAL_OUT:
        tl.store(RESIDUAL_OUT + row * stride_res_out_row + cols, s, mask=col_mask)
        s = s.to(RESIDUAL_OUT.dtype.element_ty).to(tl.float32)  # as stored (see _fwd_row)
    if not IS_RMS_NORM:
        mean = tl.sum(s, axis=1) / N
        s = tl.where(col_mask, s - mean[:, None], 0.0)
        tl.store(MEAN + rows, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd)
    xhat = s * rstd[:, None]
    _normalize_store(xhat, cols, col_mask, row, W, B, Y, stride_y_row, W1, B1, Y1,
                     stride_y1_row, HAS_BIAS, HAS_W1, HAS_B1, ZERO_CENTERED_WEIGHT,
                     params)  # fmt: skip


@triton.jit
def _chan_merge(mean, m2, s, col_mask, n_prev, n_c):
    """(mean, M2) of ``n_prev`` columns merged with the chunk ``s`` (``n_c`` columns where
    ``col_mask``), by Chan's formula."""
    mean_c = tl.sum(s, axis=0) / n_c
    d = tl.where(col_mask, s - mean_c, 0.0)
    delta = mean_c - mean
    n_new = n_prev + n_c
    mean += delta * (n_c / n_new)
    m2 += tl.sum(d * d, axis=0) + delta * delta * (n_prev * n_c / n_new)
    return mean, m2


@triton.jit
def _pack_stats(mean, m2):
    """One int64 word holding a part's (mean, M2): mean's fp32 bits low, M2's high with the
    sign bit set (M2 >= 0), so a published word is never the zero the workspace starts as."""
    lo = mean.to(tl.uint32, bitcast=True).to(tl.uint64)
    hi = (m2.to(tl.uint32, bitcast=True) | 0x80000000).to(tl.uint64)
    return (lo | (hi << 32)).to(tl.int64, bitcast=True)


@triton.jit
def _widen(h):
    """h (bf16 or fp16) as fp32 through its bits, exactly: a route the compiler does not merge
    with the ``h.to(tl.float32)`` the statistics were taken from, so that h (half the
    registers), not its fp32 copy, is what stays live until the row is normalised.

    bf16 is the high half of an fp32. An fp16's magnitude bits shifted to fp32's mantissa
    position read as an fp32 2**-112 times the value, subnormals included, so one multiply by
    2**112 rebiases the exponent; infinities and NaNs (exponent all ones) get fp32's all-ones
    exponent instead, and the sign is put back last."""
    bits = h.to(tl.uint16, bitcast=True).to(tl.uint32)
    if h.dtype == tl.bfloat16:
        return (bits << 16).to(tl.float32, bitcast=True)
    mag = (bits & 0x7FFF) << 13
    scaled = (mag.to(tl.float32, bitcast=True) * 5.192296858534828e33).to(tl.uint32, bitcast=True)
    wide = tl.where(mag >= 0x0F800000, mag | 0x70000000, scaled)
    return (wide | ((bits & 0x8000) << 16)).to(tl.float32, bitcast=True)


@triton.jit
def _convert_copy(h, zero):
    """fp16 h as fp32, by one conversion of ``h ^ zero``, where ``zero`` is 0 when the kernel
    runs but not to the compiler. The statistics were taken from ``h.to(tl.float32)``; a second
    conversion of h itself would be merged with that one, keeping every fp32 value live in
    place of h, and ``_widen``'s bit route for fp16 costs integer work and registers of its
    own (fp16 LayerNorm, 64K columns on 2 warps, offline: 112 registers either way, 80 this
    way; bench/NOTES.md #64). A copy the compiler cannot prove equal to h is converted anew
    where it is used."""
    bits = (h.to(tl.uint16, bitcast=True) ^ zero.to(tl.uint16)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _publish_missing_parts(
    X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, RESIDUAL_OUT, WS, words, parts, row, M, N,
    stride_x_row, stride_res_row, stride_x1_row, dropout_p,
    BLOCK_N: tl.constexpr, SUB_N: tl.constexpr, SPLIT: tl.constexpr, IS_RMS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_X1: tl.constexpr, HAS_ROWSCALE: tl.constexpr,
    HAS_LAYERSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_RESIDUAL_OUT: tl.constexpr,
):  # fmt: skip
    """The statistics of the parts of ``row`` not yet published, computed by this program from
    their inputs (SUB_N columns at a time, merged with Chan's formula) and published the same
    way as their owners would. Reached only when the owners have not published after the
    polling budget: under the CPU interpreter, which runs programs one after another, or if a
    GPU ever held a waiting part while its partners could not start. ``words`` is the last
    poll of the row's words: which parts are missing is taken from it by a reduction, so that
    every thread of the program takes the same branch (a scalar loaded from memory that others
    are writing may differ between threads, and the branch holds reductions)."""
    sub = tl.arange(0, SUB_N)
    absent = (words.to(tl.uint64, bitcast=True) >> 32) == 0
    for p in range(SPLIT):
        if tl.sum((absent & (parts == p)).to(tl.int32), axis=0) > 0:
            mean = tl.zeros((), dtype=tl.float32)
            m2 = tl.zeros((), dtype=tl.float32)
            for c in range(0, BLOCK_N, SUB_N):
                col0 = p * BLOCK_N + c
                ccols = col0 + sub
                col_mask = ccols < N
                n_c = tl.maximum(tl.minimum(N - col0, SUB_N), 0).to(tl.float32)
                if n_c > 0:
                    sp = _combine_inputs(
                        X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, SEEDS, SEEDS,
                        row, col0, ccols, col_mask, M, N, stride_x_row, stride_res_row,
                        stride_x1_row, dropout_p, SUB_N, HAS_RESIDUAL, HAS_X1, HAS_ROWSCALE,
                        HAS_LAYERSCALE, HAS_DROPOUT, False,
                    )  # fmt: skip
                    if STORE_RESIDUAL_OUT:
                        sp = sp.to(RESIDUAL_OUT.dtype.element_ty).to(tl.float32)
                    if IS_RMS_NORM:
                        m2 += tl.sum(sp * sp, axis=0)
                    else:
                        mean, m2 = _chan_merge(mean, m2, sp, col_mask, c * 1.0, n_c)
            # The zero as an int64 tensor: a literal 0 made the interpreter's exchange 32-bit.
            zero = tl.zeros((), dtype=tl.int64)
            tl.atomic_cas(WS + row * SPLIT + p, zero, _pack_stats(mean, m2), sem="relaxed")


# One predicated PTX prefetch into L2 of address $1 where $2 is not 0 ($0: a dummy output),
# with normal or evict-last priority.
_PREFETCH_L2_ASM = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.u32 $0, 0; @p prefetch.global.L2 [$1]; }"
)
_PREFETCH_L2_EVICT_LAST_ASM = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.u32 $0, 0; "
    "@p prefetch.global.L2::evict_last [$1]; }"
)  # fmt: skip


@triton.jit
def _prefetch_l2(ptrs, live, EVICT_LAST: tl.constexpr = False):
    """One PTX ``prefetch.global.L2`` for each of ``ptrs`` where ``live`` (an int32 tensor
    like it) is not 0, evict-last where EVICT_LAST: the line comes into L2 while the program
    does other work, and no register waits for it. Inline PTX: GPU builds only
    (config.fwd_ws_prefetch, BWD_SMEM_WS_PREFETCH; smem_kernels calls it too)."""
    if EVICT_LAST:
        tl.inline_asm_elementwise(_PREFETCH_L2_EVICT_LAST_ASM, "=r,l,r", [ptrs, live],
                                  dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    else:
        tl.inline_asm_elementwise(_PREFETCH_L2_ASM, "=r,l,r", [ptrs, live], dtype=tl.int32,
                                  is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _fwd_split_row(
    X, Y, W, B, RESIDUAL, X1, W1, B1, Y1, RESIDUAL_OUT, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
    MEAN, RSTD, WS, WS_NEXT, cols, stride_x_row, stride_y_row, stride_res_row, stride_x1_row,
    stride_y1_row, stride_res_out_row, M, N, eps, dropout_p, max_polls,
    BLOCK_N: tl.constexpr, IS_RMS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_X1: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr,
    HAS_ROWSCALE: tl.constexpr, HAS_LAYERSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    STORE_MASK: tl.constexpr, STORE_RESIDUAL_OUT: tl.constexpr,
    ZERO_CENTERED_WEIGHT: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr,
    SUB_N: tl.constexpr, BOUNDED_WAIT: tl.constexpr, HOLD: tl.constexpr,
    WS_PREFETCH: tl.constexpr, FULL_ROW: tl.constexpr, PARAMS_EVICT: tl.constexpr,
    PART_I32: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N-column part of a row split over SPLIT programs (rows too wide for one).

    The part stays in registers. The program publishes its (mean, M2) pair as one 64-bit word
    (``_pack_stats``), waits until all SPLIT words of its row are there, merges them (mean =
    count-weighted mean of the part means, M2 = sum of part M2s + sum of count * (part mean -
    mean)^2, the parallel-variance formula) and normalises its registers: the row is read
    once. Every part merges the same words in the same order, so all get bitwise the same
    statistics.

    Progress. On a GPU a part waits until its partners publish: the parts of a row are
    consecutive program ids, GPUs start programs in id order, and the launcher keeps SPLIT at
    most the SM count, so a row's parts are resident together (the assumption single-pass
    scans with decoupled look-back make too). Under the CPU interpreter, which runs one
    program after another, the wait is bounded (BOUNDED_WAIT): after ``max_polls`` reads the
    program computes the missing parts' statistics itself (``_publish_missing_parts``).
    Words are published by compare-and-swap from zero, so the first word of a part wins and
    every reader sees that one. The bounded wait is left out of GPU builds: forced on an H200
    (no polling budget, fallbacks racing the owners) it gave wrong outputs on rows with a
    partly filled last part, for a reason not found (bench/NOTES.md #21).
    """
    pid = tl.program_id(0).to(tl.int64)
    # This part's word of the next split launch's workspace is zeroed for it (workspace.py):
    # first thing for RMSNorm, right after the publish for LayerNorm. Where the store goes
    # moves ptxas's schedule: the other place cost RMSNorm at 256K 9 us (56 -> 70 registers)
    # and LayerNorm at 128K 7 us (same registers), bench/NOTES.md #76.
    if IS_RMS_NORM and WS_NEXT is not None:  # (None: config.fwd_ws_reset)
        tl.store(WS_NEXT + pid, tl.zeros((), dtype=tl.int64))
    row = pid // SPLIT
    part = pid % SPLIT
    if PART_I32:  # the part's columns counted in 32 bits (config.fwd_split_part_i32)
        part = part.to(tl.int32)
    col0 = part * BLOCK_N
    ccols = col0 + cols
    # FULL_ROW (parts of whole blocks, config.FWD_FULL_SPLIT_ROWS): the mask folds and every
    # part counts BLOCK_N columns; N stays a runtime value (as a constant it took fp16
    # LayerNorm at 256K from 78 registers to 127 offline, bench/NOTES.md #105).
    col_mask = _col_mask(ccols, cols, N, BLOCK_N, FULL_ROW)
    if WS_PREFETCH:  # the line of this part's word, asked of L2 by its line's first part
        # (the word is WS[pid]; written so, ptxas scheduled the part differently, offline)
        word = row * SPLIT + part + tl.zeros((1,), dtype=tl.int64)
        _prefetch_l2(WS + word, (word % 16 == 0).to(tl.int32))
    s = _combine_inputs(
        X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
        row, col0, ccols, col_mask, M, N, stride_x_row, stride_res_row, stride_x1_row,
        dropout_p, BLOCK_N, HAS_RESIDUAL, HAS_X1, HAS_ROWSCALE, HAS_LAYERSCALE,
        HAS_DROPOUT, STORE_MASK,
    )  # fmt: skip
    if STORE_RESIDUAL_OUT:
        h = s.to(RESIDUAL_OUT.dtype.element_ty)
        tl.store(RESIDUAL_OUT + row * stride_res_out_row + ccols, h, mask=col_mask)
        s = h.to(tl.float32)  # as stored (see _fwd_row)
    elif HOLD:
        h = s.to(X.dtype.element_ty)
    if IS_RMS_NORM:
        word = _pack_stats(tl.zeros((), dtype=tl.float32), tl.sum(s * s, axis=0))
    else:
        total, squares = _sums(s, 0)
        mean_p = total / _part_cols(N, col0, BLOCK_N, FULL_ROW)
        m2 = squares - total * mean_p
        if _cancels(squares, m2):
            if not HOLD:
                d = tl.where(col_mask, s - mean_p, 0.0)
            elif HOLD == 2:  # N >= 0: a zero the compiler cannot see
                d = tl.where(col_mask, _convert_copy(h, N < 0) - mean_p, 0.0)
            else:
                d = tl.where(col_mask, _widen(h) - mean_p, 0.0)
            m2 = tl.sum(d * d, axis=0)
        word = _pack_stats(mean_p, m2)
    tl.atomic_cas(WS + row * SPLIT + part, tl.zeros((), dtype=tl.int64), word, sem="relaxed")
    if not IS_RMS_NORM and WS_NEXT is not None:
        tl.store(WS_NEXT + row * SPLIT + part, tl.zeros((), dtype=tl.int64))
    parts = tl.arange(0, SPLIT_P2)
    pmask = parts < SPLIT
    ptrs = WS + row * SPLIT + parts
    words = tl.load(ptrs, mask=pmask, other=-1, volatile=True)  # -1: padding counts as published
    missing = tl.sum(((words.to(tl.uint64, bitcast=True) >> 32) == 0).to(tl.int32), axis=0)
    polls = 0
    while missing > 0:
        if BOUNDED_WAIT and polls == max_polls:  # once: then every part has one in flight
            _publish_missing_parts(
                X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, RESIDUAL_OUT, WS, words, parts,
                row, M, N,
                stride_x_row, stride_res_row, stride_x1_row, dropout_p, BLOCK_N, SUB_N, SPLIT,
                IS_RMS_NORM, HAS_RESIDUAL, HAS_X1, HAS_ROWSCALE, HAS_LAYERSCALE, HAS_DROPOUT,
                STORE_RESIDUAL_OUT,
            )  # fmt: skip
        # Poll until every word is seen: also after this program's own exchanges, which may
        # land after a load issued right behind them.
        words = tl.load(ptrs, mask=pmask, other=-1, volatile=True)
        missing = tl.sum(((words.to(tl.uint64, bitcast=True) >> 32) == 0).to(tl.int32), axis=0)
        polls += 1
    # Every word is published now, and published words never change. Threads that hold copies
    # of the same word loaded them separately, possibly before the last one landed (measured:
    # with the fallback racing the owners, columns of threads other than the first got other
    # statistics). One more load after a barrier gives every thread the same words.
    tl.debug_barrier()
    words = tl.load(ptrs, mask=pmask, other=-1, volatile=True)
    bits = words.to(tl.uint64, bitcast=True)
    m2s = tl.where(pmask, ((bits >> 32).to(tl.uint32) & 0x7FFFFFFF).to(tl.float32, bitcast=True),
                   0.0)  # fmt: skip
    if HOLD == 2:
        # The zero from the words (every one read now has its top bit set: _pack_stats, and
        # the padding's -1), so that the conversion depends on them and stays after the wait.
        s = _convert_copy(h, tl.max((bits >> 63) ^ 1, axis=0))
    elif HOLD:
        s = _widen(h)
    if IS_RMS_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(m2s, axis=0) / N + eps)
        xhat = s * rstd
    else:
        means = tl.where(pmask, (bits & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True),
                         0.0)  # fmt: skip
        counts = tl.where(pmask, _part_cols(N, parts * BLOCK_N, BLOCK_N, FULL_ROW), 0.0)
        mean = tl.sum(counts * means, axis=0) / N
        dm = tl.where(pmask, means - mean, 0.0)
        rstd = 1.0 / tl.sqrt((tl.sum(m2s, axis=0) + tl.sum(counts * dm * dm, axis=0)) / N + eps)
        tl.store(MEAN + row, mean, mask=part == 0)
        xhat = (s - mean) * rstd
    tl.store(RSTD + row, rstd, mask=part == 0)
    # The weights and biases, read by every row's part of these columns, with PARAMS_EVICT
    # (config.fwd_split_params_evict).
    _normalize_store(xhat, ccols, col_mask, row, W, B, Y, stride_y_row, W1, B1, Y1,
                     stride_y1_row, HAS_BIAS, HAS_W1, HAS_B1,
                     ZERO_CENTERED_WEIGHT, EVICT=PARAMS_EVICT)  # fmt: skip


@triton.jit
def _part_cols(N, start, BLOCK_N: tl.constexpr, FULL_ROW: tl.constexpr):
    """Columns of the row in the split part(s) starting at column ``start``, as fp32: BLOCK_N
    where every part is whole (FULL_ROW: a constant), else what is left of N, at most
    BLOCK_N."""
    if FULL_ROW:
        return tl.full((), BLOCK_N, tl.float32)
    else:
        return tl.minimum(N - start, BLOCK_N).to(tl.float32)


@triton.jit
def _col_mask(ccols, cols, N, BLOCK_N: tl.constexpr, FULL_ROW: tl.constexpr):
    """The column mask of a chunk or split part (``ccols``; ``cols`` the same columns counted
    from its first): with FULL_ROW (N a multiple of BLOCK_N) every column is in the row and
    the mask is one the compiler folds away (an arange below its own length), which
    ``ccols < N`` with the chunk's index a loop variable, or the part's a program id, is
    not."""
    if FULL_ROW:
        return cols < BLOCK_N
    else:
        return ccols < N


@triton.jit
def _chunk_sum(
    X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1, RESIDUAL_OUT, row, col0, cols,
    col_mask, M, N, stride_x_row, stride_res_row, stride_x1_row, stride_res_out_row, dropout_p,
    BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_X1: tl.constexpr,
    HAS_ROWSCALE: tl.constexpr, HAS_LAYERSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    STORE_RESIDUAL_OUT: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """The fp32 sum s of one chunk of a row whose first sweep already ran: the stream as stored,
    re-read, or else formed again from the inputs (dropout regenerates the same mask)."""
    if STORE_RESIDUAL_OUT:
        s = tl.load(RESIDUAL_OUT + row * stride_res_out_row + cols, mask=col_mask, other=0.0,
                    eviction_policy=EVICT).to(tl.float32)  # fmt: skip
    else:
        s = _combine_inputs(
            X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
            row, col0, cols, col_mask, M, N, stride_x_row, stride_res_row, stride_x1_row,
            dropout_p, BLOCK_N, HAS_RESIDUAL, HAS_X1, HAS_ROWSCALE, HAS_LAYERSCALE,
            HAS_DROPOUT, False, 0, EVICT,
        )  # fmt: skip
    return s


@triton.jit(do_not_specialize=["SEED_KEY"])
def _fused_norm_fwd_kernel(
    X,             # (M, N) input x
    Y,             # (M, N) output y
    W,             # (N,) weight
    B,             # (N,) bias (if HAS_BIAS)
    RESIDUAL,      # (M, N) residual (if HAS_RESIDUAL)
    X1,            # (M, N) second input (if HAS_X1)
    W1,            # (N,) second weight (if HAS_W1)
    B1,            # (N,) second bias (if HAS_B1)
    Y1,            # (M, N) second output (if HAS_W1)
    RESIDUAL_OUT,  # (M, N) pre-norm residual stream (if STORE_RESIDUAL_OUT)
    ROWSCALE,      # (M,) per-row scale of x (if HAS_ROWSCALE)
    LAYERSCALE,    # (N,) per-column scale of x (if HAS_LAYERSCALE)
    SEEDS,         # (2M,) int64 dropout seeds, x rows then x1 rows (if HAS_DROPOUT)
    SEED_KEY,      # None: SEEDS holds the seeds; else the call's int64 key, SEEDS filled here
    MASK,          # (M, N) bool keep-mask of x, contiguous (if STORE_MASK)
    MASK1,         # (M, N) bool keep-mask of x1, contiguous (if STORE_MASK and HAS_X1)
    MEAN,          # (M,) fp32 mean (if not IS_RMS_NORM)
    RSTD,          # (M,) fp32 1 / std
    WS,            # (M * SPLIT,) int64 zeros: the parts' statistics words (if SPLIT > 1)
    WS_NEXT,       # (M * SPLIT,) the next split launch's workspace: each part zeroes its word
                   # (None: not, config.fwd_ws_reset)
    stride_x_row, stride_y_row, stride_res_row, stride_x1_row, stride_y1_row,
    stride_res_out_row,
    M, N,          # rows, columns
    eps,           # variance epsilon
    dropout_p,     # drop probability (if HAS_DROPOUT)
    max_polls,     # reads of the statistics words a split part waits for before computing them
    BLOCK_N: tl.constexpr,        # columns per chunk (power of two)
    TAIL_N: tl.constexpr,         # one-block rows: a second block after BLOCK_N (0: none)
    NUM_CHUNKS: tl.constexpr,     # cdiv(N, BLOCK_N); 1 keeps the whole row in registers
    IS_RMS_NORM: tl.constexpr,
    JOINT_STATS: tl.constexpr,    # LayerNorm one-block rows: one joint sum (config.fwd_joint_stats)
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_X1: tl.constexpr,
    HAS_W1: tl.constexpr,
    HAS_B1: tl.constexpr,
    HAS_ROWSCALE: tl.constexpr,
    HAS_LAYERSCALE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    STORE_MASK: tl.constexpr,
    STORE_RESIDUAL_OUT: tl.constexpr,
    ZERO_CENTERED_WEIGHT: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,  # consecutive rows per program (1 for chunked rows)
    SPLIT: tl.constexpr,     # programs per row (> 1: split rows, each program BLOCK_N columns)
    SPLIT_P2: tl.constexpr,  # next power of two >= SPLIT
    SUB_N: tl.constexpr,     # columns per step where a split program computes another's part
    BOUNDED_WAIT: tl.constexpr,  # split parts stop waiting after max_polls (interpreter)
    HOLD: tl.constexpr,      # split rows: s equals a 16-bit tensor, held instead (config.fwd_hold);
                             # 2: fp16, widened by _convert_copy (config.fwd_hold_route)
    EVICT_FIRST_SWEEP: tl.constexpr,   # chunked rows: L2 eviction policy of the first sweep's
    EVICT_SECOND_SWEEP: tl.constexpr,  # loads and of the second's ("": default)
    UNROLL: tl.constexpr,      # chunked rows: unroll factor of the two sweeps (1: none)
    WS_PREFETCH: tl.constexpr,  # split rows: the row's words prefetched (config.fwd_ws_prefetch)
    EARLY_PARAMS: tl.constexpr,  # one-block rows: weights loaded ahead (config.fwd_early_params)
    FULL_ROW: tl.constexpr,  # rows that fill their blocks or parts (config.fwd_full_row)
    SEEDS_LAST: tl.constexpr = False,  # SEED_KEY: the seeds stored after the row, not before
    PARAMS_EVICT: tl.constexpr = NO_EVICT,  # split rows: the weights' eviction policy
    PART_I32: tl.constexpr = False,  # split rows: 32-bit column index (config.fwd_split_part_i32)
):  # fmt: skip
    if FULL_ROW and SPLIT == 1:  # the width as a constant: the masks fold (config.fwd_full_row)
        N = NUM_CHUNKS * BLOCK_N + TAIL_N
    cols = tl.arange(0, BLOCK_N)
    row0 = tl.program_id(0).to(tl.int64) * ROWS_PER_PROGRAM
    seeds_out = SEEDS
    if SEED_KEY is not None:  # the seeds from the call's key, stored for the backward
        if not SEEDS_LAST:
            _store_row_seeds(seeds_out, SEED_KEY, row0, M, SPLIT, ROWS_PER_PROGRAM, HAS_X1)
        SEEDS = SEED_KEY  # the helpers below derive each seed from it (_keep_mask)
    if SPLIT > 1:
        _fwd_split_row(
            X, Y, W, B, RESIDUAL, X1, W1, B1, Y1, RESIDUAL_OUT, ROWSCALE, LAYERSCALE, SEEDS,
            MASK, MASK1, MEAN, RSTD, WS, WS_NEXT, cols, stride_x_row, stride_y_row, stride_res_row,
            stride_x1_row, stride_y1_row, stride_res_out_row, M, N, eps, dropout_p, max_polls,
            BLOCK_N, IS_RMS_NORM, HAS_BIAS, HAS_RESIDUAL, HAS_X1, HAS_W1, HAS_B1, HAS_ROWSCALE,
            HAS_LAYERSCALE, HAS_DROPOUT, STORE_MASK, STORE_RESIDUAL_OUT, ZERO_CENTERED_WEIGHT,
            SPLIT, SPLIT_P2, SUB_N, BOUNDED_WAIT, HOLD, WS_PREFETCH, FULL_ROW, PARAMS_EVICT,
            PART_I32,
        )  # fmt: skip
    elif NUM_CHUNKS == 1:
        if ROWS_PER_PROGRAM == 1:  # no loop: the weights' loads stay where they are used
            _fwd_row(
                X, Y, W, B, RESIDUAL, X1, W1, B1, Y1, RESIDUAL_OUT, ROWSCALE, LAYERSCALE, SEEDS,
                MASK, MASK1, MEAN, RSTD, row0, cols, stride_x_row, stride_y_row, stride_res_row,
                stride_x1_row, stride_y1_row, stride_res_out_row, M, N, eps, dropout_p, BLOCK_N,
                TAIL_N, IS_RMS_NORM, JOINT_STATS, HAS_BIAS, HAS_RESIDUAL, HAS_X1, HAS_W1, HAS_B1,
                HAS_ROWSCALE, HAS_LAYERSCALE, HAS_DROPOUT, STORE_MASK, STORE_RESIDUAL_OUT,
                ZERO_CENTERED_WEIGHT, EARLY_PARAMS,
            )  # fmt: skip
        else:  # narrow rows, several per program as one tile (one block: TAIL_N == 0)
            _fwd_rows(
                X, Y, W, B, RESIDUAL, X1, W1, B1, Y1, RESIDUAL_OUT, ROWSCALE, LAYERSCALE, SEEDS,
                MASK, MASK1, MEAN, RSTD, row0, stride_x_row, stride_y_row, stride_res_row,
                stride_x1_row, stride_y1_row, stride_res_out_row, M, N, eps, dropout_p, BLOCK_N,
                ROWS_PER_PROGRAM, IS_RMS_NORM, HAS_BIAS, HAS_RESIDUAL, HAS_X1, HAS_W1, HAS_B1,
                HAS_ROWSCALE, HAS_LAYERSCALE, HAS_DROPOUT, STORE_MASK, STORE_RESIDUAL_OUT,
                ZERO_CENTERED_WEIGHT, EARLY_PARAMS,
            )  # fmt: skip
    else:
        row = row0
        # Sweep 1: form s chunk by chunk and store it; add s and s^2 per column lane across the
        # chunks and reduce once at the end (one exchange between warps per row, not two per
        # chunk as a Chan merge of each chunk's (mean, M2) takes; bench/NOTES.md #39).
        mean = 0.0
        lane_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
        lane_squares = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for c in tl.range(0, NUM_CHUNKS, loop_unroll_factor=UNROLL):
            ccols = c * BLOCK_N + cols
            col_mask = _col_mask(ccols, cols, N, BLOCK_N, FULL_ROW)
            s = _combine_inputs(
                X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
                row, c * BLOCK_N, ccols, col_mask, M, N, stride_x_row, stride_res_row,
                stride_x1_row, dropout_p, BLOCK_N, HAS_RESIDUAL, HAS_X1, HAS_ROWSCALE,
                HAS_LAYERSCALE, HAS_DROPOUT, STORE_MASK, 0, EVICT_FIRST_SWEEP,
            )  # fmt: skip
            if STORE_RESIDUAL_OUT:
                tl.store(RESIDUAL_OUT + row * stride_res_out_row + ccols, s, mask=col_mask)
                s = s.to(RESIDUAL_OUT.dtype.element_ty).to(tl.float32)  # as stored (see above)
            lane_squares += s * s
            if not IS_RMS_NORM:
                lane_sum += s
        if IS_RMS_NORM:
            m2 = tl.sum(lane_squares, axis=0)
        else:
            if JOINT_SUMS:
                total, squares = tl.reduce((lane_sum, lane_squares), 0, _add_pairs)
            else:
                total = tl.sum(lane_sum, axis=0)
                squares = tl.sum(lane_squares, axis=0)
            mean = total / N
            m2 = squares - total * mean
            if _cancels(squares, m2):  # the exact second moment: one more sweep
                m2 = 0.0
                for c in range(NUM_CHUNKS):
                    ccols = c * BLOCK_N + cols
                    col_mask = _col_mask(ccols, cols, N, BLOCK_N, FULL_ROW)
                    s = _chunk_sum(
                        X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
                        RESIDUAL_OUT, row, c * BLOCK_N, ccols, col_mask, M, N,
                        stride_x_row, stride_res_row, stride_x1_row, stride_res_out_row,
                        dropout_p, BLOCK_N, HAS_RESIDUAL, HAS_X1, HAS_ROWSCALE,
                        HAS_LAYERSCALE, HAS_DROPOUT, STORE_RESIDUAL_OUT, NO_EVICT,
                    )  # fmt: skip
                    d = tl.where(col_mask, s - mean, 0.0)
                    m2 += tl.sum(d * d, axis=0)
        rstd = 1.0 / tl.sqrt(m2 / N + eps)
        tl.store(RSTD + row, rstd)
        if not IS_RMS_NORM:
            tl.store(MEAN + row, mean)
        # Sweep 2: normalise. The residual stream is re-read where it was stored (mostly from
        # L2); otherwise s is formed again from the inputs (dropout regenerates the same mask).
        # Unrolled (UNROLL), every chunk's loads can be in flight before the first is used.
        for c in tl.range(0, NUM_CHUNKS, loop_unroll_factor=UNROLL):
            ccols = c * BLOCK_N + cols
            col_mask = _col_mask(ccols, cols, N, BLOCK_N, FULL_ROW)
            s = _chunk_sum(
                X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1, RESIDUAL_OUT, row,
                c * BLOCK_N, ccols, col_mask, M, N, stride_x_row, stride_res_row, stride_x1_row,
                stride_res_out_row, dropout_p, BLOCK_N, HAS_RESIDUAL, HAS_X1, HAS_ROWSCALE,
                HAS_LAYERSCALE, HAS_DROPOUT, STORE_RESIDUAL_OUT, EVICT_SECOND_SWEEP,
            )  # fmt: skip
            if IS_RMS_NORM:
                xhat = s * rstd
            else:
                xhat = (s - mean) * rstd
            _normalize_store(xhat, ccols, col_mask, row, W, B, Y, stride_y_row, W1, B1, Y1,
                             stride_y1_row, HAS_BIAS, HAS_W1, HAS_B1,
                             ZERO_CENTERED_WEIGHT)  # fmt: skip
    if SEED_KEY is not None and SEEDS_LAST:
        _store_row_seeds(seeds_out, SEED_KEY, row0, M, SPLIT, ROWS_PER_PROGRAM, HAS_X1)


@triton.jit
def _xhat(s, mean, rstd, mask, IS_RMS_NORM: tl.constexpr):
    """A backward row's normalised values, zero beyond N (``mask``) for LayerNorm, as
    _row_grads computes them (which spells them out: written through _xhat and _weight, the
    x1 path's backward at 8192 columns compiled to other SASS on triton 3.6)."""
    if IS_RMS_NORM:
        return s * rstd
    else:
        return tl.where(mask, (s - mean) * rstd, 0.0)


@triton.jit
def _weight(w, col_mask, ZERO_CENTERED_WEIGHT: tl.constexpr):
    """A backward row's weights as loaded (``w``, zero beyond N) in fp32, plus one if stored
    zero-centred."""
    w = w.to(tl.float32)
    if ZERO_CENTERED_WEIGHT:
        w = tl.where(col_mask, w + 1.0, 0.0)
    return w


@triton.jit
def _row_grads(
    S, DY, DY1, W, W1, MEAN, RSTD, row, cols, col_mask, mask, stride_s_row, stride_dy_row,
    stride_dy1_row, IS_RMS_NORM: tl.constexpr, HAS_W1: tl.constexpr,
    ZERO_CENTERED_WEIGHT: tl.constexpr,
):  # fmt: skip
    """xhat, dy, dy1 and wdy = w*dy (+ w1*dy1) of one row chunk, all fp32 and zero beyond N.
    ``mask`` is ``col_mask`` for one row; for a tile of rows (``row`` (ROWS, 1)) it also masks
    the tile's rows past the program's last, whose terms are then all zero."""
    s = tl.load(S + row * stride_s_row + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + row)
    if IS_RMS_NORM:
        xhat = s * rstd
    else:
        xhat = tl.where(mask, (s - tl.load(MEAN + row)) * rstd, 0.0)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED_WEIGHT:
        w = tl.where(col_mask, w + 1.0, 0.0)
    dy = tl.load(DY + row * stride_dy_row + cols, mask=mask, other=0.0).to(tl.float32)
    wdy = w * dy
    dy1 = dy  # placeholder when there is no second output
    if HAS_W1:
        w1 = tl.load(W1 + cols, mask=col_mask, other=0.0).to(tl.float32)
        if ZERO_CENTERED_WEIGHT:
            w1 = tl.where(col_mask, w1 + 1.0, 0.0)
        dy1 = tl.load(DY1 + row * stride_dy1_row + cols, mask=mask, other=0.0).to(tl.float32)
        wdy += w1 * dy1
    return xhat, dy, dy1, wdy


@triton.jit
def _input_grads(
    ds, row, col0, cols, col_mask, M, N, X0, LAYERSCALE, ROWSCALE, SEEDS, DX, DX1, DRESIDUAL,
    stride_x0_row, stride_dx_row, stride_dx1_row, stride_dres_row, dropout_p,
    BLOCK_N: tl.constexpr, STORE_DRESIDUAL: tl.constexpr, HAS_X1: tl.constexpr, HAS_ROWSCALE: tl.constexpr,
    HAS_LAYERSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Store dresidual, dx1, dx of one row chunk from ds; return dx before layerscale * x0
    (the row's contribution to d(layerscale)), or a zero placeholder."""
    if STORE_DRESIDUAL:
        tl.store(DRESIDUAL + row * stride_dres_row + cols, ds, mask=col_mask)
    if HAS_X1:
        dx1 = ds
        if HAS_DROPOUT:
            keep1 = _keep_mask(SEEDS, M + row, col0, dropout_p, BLOCK_N, ROWS)
            dx1 = tl.where(keep1, ds * (1.0 / (1.0 - dropout_p)), 0.0)
        tl.store(DX1 + row * stride_dx1_row + cols, dx1, mask=col_mask)
    dx = ds
    if HAS_DROPOUT:
        keep = _keep_mask(SEEDS, row, col0, dropout_p, BLOCK_N, ROWS)
        dx = tl.where(keep, dx * (1.0 / (1.0 - dropout_p)), 0.0)
    if HAS_ROWSCALE:
        dx *= tl.load(ROWSCALE + row).to(tl.float32)
    dls = dx
    if HAS_LAYERSCALE:
        x0 = tl.load(X0 + row * stride_x0_row + cols, mask=col_mask, other=0.0).to(tl.float32)
        dls = dx * x0
        dx *= tl.load(LAYERSCALE + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(DX + row * stride_dx_row + cols, dx, mask=col_mask)
    return dls


@triton.jit
def _param_grads(dw, db, dw1, db1, xhat, dy, dy1, HAS_BIAS: tl.constexpr, HAS_W1: tl.constexpr,
                 HAS_B1: tl.constexpr):  # fmt: skip
    """One row's terms added to the partial parameter gradients of a column block."""
    dw += dy * xhat
    if HAS_BIAS:
        db += dy
    if HAS_W1:
        dw1 += dy1 * xhat
        if HAS_B1:
            db1 += dy1
    return dw, db, dw1, db1


@triton.jit
def _block_input_grads(
    xhat, wdy, c1, c2, rstd, row, col0, cols, col_mask, M, N, DRESIDUAL_OUT, X0, LAYERSCALE,
    ROWSCALE, SEEDS, DX, DX1, DRESIDUAL, stride_dres_out_row, stride_x0_row, stride_dx_row,
    stride_dx1_row, stride_dres_row, dropout_p,
    BLOCK_N: tl.constexpr, IS_RMS_NORM: tl.constexpr, HAS_DRESIDUAL_OUT: tl.constexpr,
    STORE_DRESIDUAL: tl.constexpr, HAS_X1: tl.constexpr, HAS_ROWSCALE: tl.constexpr,
    HAS_LAYERSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """ds of one row's column block from its row sums c1, c2, then its input gradients
    (``_input_grads``); returns the block's d(layerscale) terms. With ROWS > 0 the same for a
    tile of rows (``col_mask`` then masks its rows too)."""
    if IS_RMS_NORM:
        ds = (wdy - xhat * c1) * rstd
    else:
        ds = (wdy - (xhat * c1 + c2)) * rstd
    if HAS_DRESIDUAL_OUT:
        ds += tl.load(DRESIDUAL_OUT + row * stride_dres_out_row + cols, mask=col_mask,
                      other=0.0).to(tl.float32)  # fmt: skip
    return _input_grads(
        ds, row, col0, cols, col_mask, M, N, X0, LAYERSCALE, ROWSCALE, SEEDS, DX, DX1,
        DRESIDUAL, stride_x0_row, stride_dx_row, stride_dx1_row, stride_dres_row,
        dropout_p, BLOCK_N, STORE_DRESIDUAL, HAS_X1, HAS_ROWSCALE, HAS_LAYERSCALE,
        HAS_DROPOUT, ROWS,
    )  # fmt: skip


@triton.jit
def _store_partials(PARTS, part, stride_part, cols, col_mask, dw, db, dw1, db1, dls,
                    HAS_BIAS: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr,
                    HAS_LAYERSCALE: tl.constexpr):  # fmt: skip
    """A program's partial parameter gradients of one column block, into row ``part / N`` of
    their slabs of PARTS, one slab (``stride_part`` elements apart) per gradient present, in
    the order dw, db, dw1, db1, dls."""
    slab = tl.cast(stride_part, tl.int64)  # int64 offsets (Triton may pass a 1 as a constant)
    tl.store(PARTS + part + cols, dw, mask=col_mask)
    if HAS_BIAS:
        tl.store(PARTS + slab + part + cols, db, mask=col_mask)
    if HAS_W1:
        tl.store(PARTS + (1 + HAS_BIAS) * slab + part + cols, dw1, mask=col_mask)
        if HAS_B1:
            tl.store(PARTS + (2 + HAS_BIAS) * slab + part + cols, db1, mask=col_mask)
    if HAS_LAYERSCALE:
        tl.store(PARTS + (1 + HAS_BIAS + HAS_W1 + HAS_B1) * slab + part + cols, dls,
                 mask=col_mask)  # fmt: skip


@triton.jit
def _pack_sums(p1, p2):
    """One int64 word holding a column block's partial row sums: p1's fp32 bits low, p2's
    high. The exchange's workspace starts as -1 (all ones); p2's bits are never all ones (that
    NaN becomes the canonical one), so a published word is told apart by its high half."""
    lo = p1.to(tl.uint32, bitcast=True).to(tl.uint64)
    hi = p2.to(tl.uint32, bitcast=True)
    hi = tl.where(hi == 0xFFFFFFFF, 0x7FFFFFFF, hi).to(tl.uint64)
    return (lo | (hi << 32)).to(tl.int64, bitcast=True)


@triton.jit
def _block_sums_word(
    S, DY, DY1, W, W1, MEAN, RSTD, row, cols, col_mask, stride_s_row, stride_dy_row,
    stride_dy1_row, IS_RMS_NORM: tl.constexpr, HAS_W1: tl.constexpr,
    ZERO_CENTERED_WEIGHT: tl.constexpr, JOINT_ROW_SUMS: tl.constexpr,
):  # fmt: skip
    """The packed partial sums (sum(xhat * wdy), sum(wdy)) of one row over one column block."""
    xhat, _dy, _dy1, wdy = _row_grads(
        S, DY, DY1, W, W1, MEAN, RSTD, row, cols, col_mask, col_mask, stride_s_row,
        stride_dy_row, stride_dy1_row, IS_RMS_NORM, HAS_W1, ZERO_CENTERED_WEIGHT,
    )  # fmt: skip
    if JOINT_ROW_SUMS and not IS_RMS_NORM:
        p1, p2 = _pair_sums(xhat * wdy, wdy, 0)
        return _pack_sums(p1, p2)
    p2 = tl.zeros((), dtype=tl.float32)
    if not IS_RMS_NORM:
        p2 = tl.sum(wdy, axis=0)
    return _pack_sums(tl.sum(xhat * wdy, axis=0), p2)


@triton.jit
def _publish_block_sums(
    WS, S, DY, DY1, W, W1, MEAN, RSTD, row, cols, col_mask, col0, stride_s_row, stride_dy_row,
    stride_dy1_row, BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr, IS_RMS_NORM: tl.constexpr,
    HAS_W1: tl.constexpr, ZERO_CENTERED_WEIGHT: tl.constexpr, JOINT_ROW_SUMS: tl.constexpr,
):  # fmt: skip
    """Publish this program's word of ``row`` (its column block from ``col0``) into WS[row, :],
    by compare-and-swap from -1: a word the interpreter's fallback published first stays."""
    word = _block_sums_word(
        S, DY, DY1, W, W1, MEAN, RSTD, row, cols, col_mask, stride_s_row, stride_dy_row,
        stride_dy1_row, IS_RMS_NORM, HAS_W1, ZERO_CENTERED_WEIGHT, JOINT_ROW_SUMS,
    )  # fmt: skip
    tl.atomic_cas(WS + row * NUM_CHUNKS + col0 // BLOCK_N, tl.full((), -1, dtype=tl.int64), word,
                  sem="relaxed")  # fmt: skip


@triton.jit
def _reset_word(WS_NEXT, row, col0, BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    """Set the word that this program publishes for ``row`` to -1 in the next exchanging
    launch's workspace (workspace.py): the owner does it, never the interpreter's fallback."""
    tl.store(WS_NEXT + row * NUM_CHUNKS + col0 // BLOCK_N, tl.full((), -1, dtype=tl.int64))


@triton.jit
def _add_triples(m1, a1, b1, m2, a2, b2):
    return m1 + m2, a1 + a2, b1 + b2


@triton.jit
def _read_words(ptrs, bmask):
    """(words missing, sum of low halves, sum of high halves) of one poll of a row's words, in
    one reduction: each thread's three come from the same loaded copies of the words, so a
    thread that counts none missing sums only published words (which never change), whatever
    other threads' copies held; no barrier and second read are needed (see _fwd_split_row)."""
    bits = tl.load(ptrs, mask=bmask, other=0, volatile=True).to(tl.uint64, bitcast=True)
    absent = (bits >> 32) == 0xFFFFFFFF
    p1 = (bits & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    p2 = (bits >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    return tl.reduce((absent.to(tl.int32), tl.where(absent, 0.0, p1), tl.where(absent, 0.0, p2)),
                     0, _add_triples)  # fmt: skip


@triton.jit
def _exchanged_row_sums(
    WS, S, DY, DY1, W, W1, MEAN, RSTD, row, N, stride_s_row, stride_dy_row, stride_dy1_row,
    max_polls, BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
    IS_RMS_NORM: tl.constexpr, HAS_W1: tl.constexpr, ZERO_CENTERED_WEIGHT: tl.constexpr,
    BOUNDED_WAIT: tl.constexpr, RELOAD: tl.constexpr, JOINT_ROW_SUMS: tl.constexpr,
):  # fmt: skip
    """c1, c2 of ``row`` from the words its NUM_CHUNKS column programs published (WS[row, :]),
    waiting for those not yet there. Each program sums the same words in the same order, so
    all get the same c1, c2. With RELOAD the sums are taken from one more read of the words
    after a barrier instead of from the last poll (a choice of speed, measured:
    config.bwd_exchange_reload). Under the interpreter (BOUNDED_WAIT) the program computes the
    words still missing after ``max_polls`` reads itself, as their owners would, and publishes
    them by compare-and-swap from -1: the first word of a block wins, and every block's word
    is the same whoever computed it."""
    blocks = tl.arange(0, CHUNKS_P2)
    bmask = blocks < NUM_CHUNKS
    ptrs = WS + row * NUM_CHUNKS + blocks
    missing, c1, c2 = _read_words(ptrs, bmask)  # padding reads 0: counts as published
    polls = 0
    while missing > 0:
        if BOUNDED_WAIT and polls == max_polls:
            bits = tl.load(ptrs, mask=bmask, other=0, volatile=True).to(tl.uint64, bitcast=True)
            absent = (bits >> 32) == 0xFFFFFFFF
            for b in range(NUM_CHUNKS):
                if tl.sum((absent & (blocks == b)).to(tl.int32), axis=0) > 0:
                    bcols = b * BLOCK_N + tl.arange(0, BLOCK_N)
                    _publish_block_sums(
                        WS, S, DY, DY1, W, W1, MEAN, RSTD, row, bcols, bcols < N, b * BLOCK_N,
                        stride_s_row, stride_dy_row, stride_dy1_row, BLOCK_N, NUM_CHUNKS,
                        IS_RMS_NORM, HAS_W1, ZERO_CENTERED_WEIGHT, JOINT_ROW_SUMS,
                    )  # fmt: skip
        missing, c1, c2 = _read_words(ptrs, bmask)
        polls += 1
    if RELOAD:
        tl.debug_barrier()
        missing, c1, c2 = _read_words(ptrs, bmask)
    return c1 / N, c2 / N


@triton.jit
def _bwd_row_sums_kernel(
    S, DY, DY1, W, W1, MEAN, RSTD, C12, stride_s_row, stride_dy_row, stride_dy1_row, N,
    BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr, PARTS: tl.constexpr,
    IS_RMS_NORM: tl.constexpr, HAS_W1: tl.constexpr, ZERO_CENTERED_WEIGHT: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    """c1 = sum(xhat * wdy) / N and c2 = sum(wdy) / N of a row (wide rows), in PARTS parts:
    program i sums part i % PARTS of row i // PARTS, its NUM_CHUNKS chunks of BLOCK_N columns,
    into C12[row] (PARTS == 1) or else its shares into C12[row, 0, part] and C12[row, 1,
    part] of a (M, 2, PARTS) buffer, which _row_shares_sum_kernel adds. GDC: the next kernel
    is its programmatic dependent (Hopper's PDL: config.bwd_pdl), which may launch as soon as
    every program of this one has started (PTX griddepcontrol)."""
    if GDC:
        gdc_launch_dependents()
    pid = tl.program_id(0).to(tl.int64)
    row = pid // PARTS
    part = pid % PARTS
    col0 = part * (NUM_CHUNKS * BLOCK_N)
    cols = tl.arange(0, BLOCK_N)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for c in range(NUM_CHUNKS):
        ccols = col0 + c * BLOCK_N + cols
        xhat, _dy, _dy1, wdy = _row_grads(
            S, DY, DY1, W, W1, MEAN, RSTD, row, ccols, ccols < N, ccols < N, stride_s_row,
            stride_dy_row, stride_dy1_row, IS_RMS_NORM, HAS_W1, ZERO_CENTERED_WEIGHT,
        )  # fmt: skip
        acc1 += xhat * wdy
        if not IS_RMS_NORM:
            acc2 += wdy
    out = C12 + 2 * PARTS * row + part
    tl.store(out, tl.sum(acc1, axis=0) / N)
    if not IS_RMS_NORM:
        tl.store(out + PARTS, tl.sum(acc2, axis=0) / N)


@triton.jit(do_not_specialize=["M"])
def _row_shares_sum_kernel(
    SHARES, C12, M, ROWS: tl.constexpr, PARTS: tl.constexpr, IS_RMS_NORM: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    """C12[row] = the sums of the row's PARTS shares (SHARES, (M, 2, PARTS), from
    _bwd_row_sums_kernel), ROWS rows per program; the same order every run. GDC: launched as
    the pre-pass's programmatic dependent, the backward kernel as its own: the backward may
    launch at once, and this waits until the pre-pass has finished and its writes are
    visible."""
    if GDC:
        gdc_launch_dependents()
        gdc_wait()
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = rows < M
    ptrs = SHARES + 2 * PARTS * rows[:, None] + tl.arange(0, PARTS)[None, :]
    tl.store(C12 + 2 * rows, tl.sum(tl.load(ptrs, mask=ok[:, None], other=0.0), axis=1), mask=ok)
    if not IS_RMS_NORM:
        c2 = tl.sum(tl.load(ptrs + PARTS, mask=ok[:, None], other=0.0), axis=1)
        tl.store(C12 + 2 * rows + 1, c2, mask=ok)


@triton.jit
def _bwd_row_tiles(
    S, W, W1, MEAN, RSTD, DY, DY1, DRESIDUAL_OUT, X0, LAYERSCALE, ROWSCALE, SEEDS, DX, DX1,
    DRESIDUAL, row_start, row_end, cols, col_mask, stride_s_row, stride_dy_row, stride_dy1_row,
    stride_dres_out_row, stride_x0_row, stride_dx_row, stride_dx1_row, stride_dres_row, M, N,
    dropout_p, BLOCK_N: tl.constexpr, TILE_ROWS: tl.constexpr, IS_RMS_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr, HAS_X1: tl.constexpr,
    HAS_DRESIDUAL_OUT: tl.constexpr, STORE_DRESIDUAL: tl.constexpr, HAS_ROWSCALE: tl.constexpr,
    HAS_LAYERSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr, ZERO_CENTERED_WEIGHT: tl.constexpr,
    ROW_STAGES: tl.constexpr, JOINT_ROW_SUMS: tl.constexpr,
):  # fmt: skip
    """The backward of a program's narrow one-block rows (NUM_CHUNKS == 1, TAIL_N == 0),
    TILE_ROWS at a time as one (TILE_ROWS, BLOCK_N) tile, so that a tile's loads are all in
    flight before its row sums (config.bwd_tile_rows). Tile rows past the program's last row
    read that row's addresses but are masked: their terms are zero and nothing is stored for
    them. Returns the partial parameter gradients (dw, db, dw1, db1, dls) over the rows."""
    tcols = cols[None, :]
    tcol_mask = col_mask[None, :]
    dw = tl.zeros((TILE_ROWS, BLOCK_N), dtype=tl.float32)
    db = tl.zeros((TILE_ROWS, BLOCK_N), dtype=tl.float32)
    dw1 = tl.zeros((TILE_ROWS, BLOCK_N), dtype=tl.float32)
    db1 = tl.zeros((TILE_ROWS, BLOCK_N), dtype=tl.float32)
    dls = tl.zeros((TILE_ROWS, BLOCK_N), dtype=tl.float32)
    for r0 in tl.range(row_start, row_end, TILE_ROWS, num_stages=ROW_STAGES):
        rows = r0 + tl.arange(0, TILE_ROWS)[:, None]
        row = tl.minimum(rows, row_end - 1)
        mask = (rows < row_end) & tcol_mask
        xhat, dy, dy1, wdy = _row_grads(
            S, DY, DY1, W, W1, MEAN, RSTD, row, tcols, tcol_mask, mask, stride_s_row,
            stride_dy_row, stride_dy1_row, IS_RMS_NORM, HAS_W1, ZERO_CENTERED_WEIGHT,
        )  # fmt: skip
        dw, db, dw1, db1 = _param_grads(dw, db, dw1, db1, xhat, dy, dy1, HAS_BIAS, HAS_W1, HAS_B1)
        if IS_RMS_NORM or not JOINT_ROW_SUMS:
            c1 = tl.sum(xhat * wdy, axis=1)[:, None] / N
            c2 = 0.0
            if not IS_RMS_NORM:
                c2 = tl.sum(wdy, axis=1)[:, None] / N
        else:
            c1, c2 = _pair_sums(xhat * wdy, wdy, 1)
            c1 = c1[:, None] / N
            c2 = c2[:, None] / N
        rstd = tl.load(RSTD + row)
        dls_rows = _block_input_grads(
            xhat, wdy, c1, c2, rstd, row, 0, tcols, mask, M, N, DRESIDUAL_OUT, X0, LAYERSCALE,
            ROWSCALE, SEEDS, DX, DX1, DRESIDUAL, stride_dres_out_row, stride_x0_row,
            stride_dx_row, stride_dx1_row, stride_dres_row, dropout_p, BLOCK_N, IS_RMS_NORM,
            HAS_DRESIDUAL_OUT, STORE_DRESIDUAL, HAS_X1, HAS_ROWSCALE, HAS_LAYERSCALE, HAS_DROPOUT,
            TILE_ROWS,
        )  # fmt: skip
        if HAS_LAYERSCALE:
            dls += dls_rows
    return (tl.sum(dw, axis=0), tl.sum(db, axis=0), tl.sum(dw1, axis=0), tl.sum(db1, axis=0),
            tl.sum(dls, axis=0))  # fmt: skip


# Inline PTX: a register copied as it is; the second operand ($2) is read by nothing but must be
# known first (_held).
_HELD_ASM_16 = tl.constexpr("{ mov.b16 $0, $1; }")
_HELD_ASM_32 = tl.constexpr("{ mov.b32 $0, $1; }")
GPU_BUILD = tl.constexpr(not INTERPRETED)


@triton.jit
def _held(h, after):
    """The loaded values ``h`` (16- or 32-bit, as stored) again, through an opaque copy that
    waits for the scalar ``after``: the compiler can neither merge their conversion to fp32
    with an earlier one nor move it before ``after`` is known, so what stays live until then
    is h itself (_held_again). Inline PTX on a GPU; the interpreter returns h."""
    if not GPU_BUILD:
        return h
    dep = after.to(tl.uint32, bitcast=True) + tl.zeros(h.shape, dtype=tl.uint32)
    if h.dtype.primitive_bitwidth == 16:
        bits = h.to(tl.uint16, bitcast=True)
        copy = tl.inline_asm_elementwise(_HELD_ASM_16, "=h,h,r", [bits, dep], dtype=tl.uint16,
                                         is_pure=True, pack=1)  # fmt: skip
    else:
        bits = h.to(tl.uint32, bitcast=True)
        copy = tl.inline_asm_elementwise(_HELD_ASM_32, "=r,r,r", [bits, dep], dtype=tl.uint32,
                                         is_pure=True, pack=1)  # fmt: skip
    return copy.to(h.dtype, bitcast=True)


@triton.jit
def _held_row_grads(
    S, DY, W, MEAN, RSTD, row, cols, col_mask, stride_s_row, stride_dy_row,
    IS_RMS_NORM: tl.constexpr, ZERO_CENTERED_WEIGHT: tl.constexpr,
):  # fmt: skip
    """_row_grads of a row that holds its loads across its row sums (RECOMPUTE): also the
    loaded s, dy and w (as stored) and the row's mean (0 for RMSNorm), from which
    _held_again does the maths again after the sums."""
    s_h = tl.load(S + row * stride_s_row + cols, mask=col_mask, other=0.0)
    dy_h = tl.load(DY + row * stride_dy_row + cols, mask=col_mask, other=0.0)
    w_h = tl.load(W + cols, mask=col_mask, other=0.0)
    rstd = tl.load(RSTD + row)
    mean = 0.0
    if not IS_RMS_NORM:
        mean = tl.load(MEAN + row)
    xhat = _xhat(s_h.to(tl.float32), mean, rstd, col_mask, IS_RMS_NORM)
    dy = dy_h.to(tl.float32)
    wdy = _weight(w_h, col_mask, ZERO_CENTERED_WEIGHT) * dy
    return s_h, dy_h, w_h, mean, rstd, xhat, dy, wdy


@triton.jit
def _held_again(s_h, dy_h, w_h, mean, rstd, c1, col_mask, IS_RMS_NORM: tl.constexpr,
                ZERO_CENTERED_WEIGHT: tl.constexpr):  # fmt: skip
    """xhat, dy and w*dy of a held row again from its loads, after its row sum ``c1`` is
    known (``_held``): the same operations as _held_row_grads, so the same bits; until then a
    thread holds the 16-bit loads, half the registers of their fp32 maths (bench/NOTES.md
    #118)."""
    xhat = _xhat(_held(s_h, c1).to(tl.float32), mean, rstd, col_mask, IS_RMS_NORM)
    dy = _held(dy_h, c1).to(tl.float32)
    wdy = _weight(_held(w_h, c1), col_mask, ZERO_CENTERED_WEIGHT) * dy
    return xhat, dy, wdy


# M and the two integers that follow from the program count are not specialised on, so that one
# compiled kernel serves every grid: ops asks that kernel how many programs fit on a
# multiprocessor (Launcher.resident) before it sizes the grid.
@triton.jit(do_not_specialize=["stride_part", "M", "rows_per_program"])
def _fused_norm_bwd_kernel(
    S,             # (M, N) the normalised pre-norm sum (residual stream, or x itself)
    W,             # (N,) weight
    W1,            # (N,) second weight (if HAS_W1)
    MEAN,          # (M,) fp32 (if not IS_RMS_NORM)
    RSTD,          # (M,) fp32
    DY,            # (M, N) grad of y
    DY1,           # (M, N) grad of y1 (if HAS_W1)
    DRESIDUAL_OUT, # (M, N) grad of the residual stream output (if HAS_DRESIDUAL_OUT)
    X0,            # (M, N) x, for d(layerscale) (if HAS_LAYERSCALE)
    LAYERSCALE,    # (N,) (if HAS_LAYERSCALE)
    ROWSCALE,      # (M,) (if HAS_ROWSCALE)
    SEEDS,         # (2M,) int64 dropout seeds (if HAS_DROPOUT)
    DX,            # (M, N) grad of x
    DX1,           # (M, N) grad of x1 (if HAS_X1)
    DRESIDUAL,     # (M, N) grad of residual (if STORE_DRESIDUAL)
    PARTS,         # fp32 partial dW, then dB, dW1, dB1, d(layerscale) where present: one
                   # (P, N) slab each, stride_part elements apart; one row per row block
    C12,           # rows wider than a block (NUM_CHUNKS > 1): (M, 2) fp32 c1, c2 of each row
                   # from _bwd_row_sums_kernel, or with EXCHANGE (M, NUM_CHUNKS) int64 words of
                   # the column blocks' partial sums, -1 until published
    WS_NEXT,       # EXCHANGE: the next exchanging launch's workspace, (M, NUM_CHUNKS): each
                   # program sets the words it publishes in C12 to -1 there (workspace.py)
    stride_s_row, stride_dy_row, stride_dy1_row, stride_dres_out_row, stride_x0_row,
    stride_dx_row, stride_dx1_row, stride_dres_row, stride_part,
    M, N,
    dropout_p,
    rows_per_program,  # contiguous rows owned by each row block
    max_polls,  # EXCHANGE with BOUNDED_WAIT: reads of a row's words before computing them
    BLOCK_N: tl.constexpr,
    TAIL_N: tl.constexpr,  # one-block rows: a second column block after BLOCK_N (0: none)
    NUM_CHUNKS: tl.constexpr,
    IS_RMS_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_W1: tl.constexpr,
    HAS_B1: tl.constexpr,
    HAS_X1: tl.constexpr,
    HAS_DRESIDUAL_OUT: tl.constexpr,
    STORE_DRESIDUAL: tl.constexpr,
    HAS_ROWSCALE: tl.constexpr,
    HAS_LAYERSCALE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    ZERO_CENTERED_WEIGHT: tl.constexpr,
    TILE_ROWS: tl.constexpr,  # > 1: narrow one-block rows, that many per tile (_bwd_row_tiles)
    EXCHANGE: tl.constexpr,  # NUM_CHUNKS > 1: row sums exchanged between column programs
    CHUNKS_P2: tl.constexpr,  # EXCHANGE: NUM_CHUNKS rounded up to a power of two
    BOUNDED_WAIT: tl.constexpr,  # EXCHANGE: stop waiting after max_polls (interpreter)
    EXCHANGE_RELOAD: tl.constexpr,  # EXCHANGE: the row sums from one more read (_exchanged_row_sums)
    JOINT_ROW_SUMS: tl.constexpr,  # LayerNorm's c1, c2 (or a block's word of them) in one reduction
    SUM_REPEATS: tl.constexpr,  # one-block rows' separate sums folded first (_fold_repeats)
    GDC: tl.constexpr,  # a programmatic dependent of the pre-pass (or of its shares' sum)
    ROW_STAGES: tl.constexpr,  # rows in flight: the row loop is software-pipelined (1: not)
    RECOMPUTE: tl.constexpr,  # one-block rows hold their loads across the row sums (_held_again)
):  # fmt: skip
    # Program (p, c) owns rows [p * rows_per_program, ...) and columns [c * BLOCK_N, ...),
    # with TAIL_N > 0 (one-block rows only) also [BLOCK_N, BLOCK_N + TAIL_N). With EXCHANGE
    # the grid is one-dimensional, a row block's NUM_CHUNKS programs consecutive.
    #
    # EXCHANGE: before each row a program publishes its block's partial sums of the next row
    # (one word, _pack_sums), then sums the words of this row, which its row block's programs
    # published one row earlier, so the wait is short; then it reads this row's block again,
    # from L2 (it read it one row ago), instead of a pre-pass kernel reading the whole row from
    # memory a second time. Progress: a program only waits for the programs of its own row
    # block, consecutive ids that GPUs start in id order, so with all of them resident at once
    # (the grid holds what fits: ops) or not, some row block always runs whole; under the
    # CPU interpreter, one program after another, the wait is bounded (BOUNDED_WAIT).
    tl.static_assert(
        not RECOMPUTE
        or (NUM_CHUNKS == 1 and TAIL_N == 0 and TILE_ROWS == 1 and ROW_STAGES == 1
            and SUM_REPEATS == 1 and not (EXCHANGE or HAS_W1)),
        "RECOMPUTE: one-block rows without a tail, tile, pipeline, fold, exchange or x1's weight",
    )  # fmt: skip
    if GDC:  # C12 comes from the kernel before (the pre-pass or its shares' sum): wait for it
        gdc_wait()
    if EXCHANGE:
        pid = tl.program_id(0) // NUM_CHUNKS
        col0 = (tl.program_id(0) % NUM_CHUNKS) * BLOCK_N
    else:
        pid = tl.program_id(0)
        col0 = tl.program_id(1) * BLOCK_N
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    cols = col0 + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if TILE_ROWS > 1:
        dw, db, dw1, db1, dls = _bwd_row_tiles(
            S, W, W1, MEAN, RSTD, DY, DY1, DRESIDUAL_OUT, X0, LAYERSCALE, ROWSCALE, SEEDS, DX,
            DX1, DRESIDUAL, row_start, row_end, cols, col_mask, stride_s_row, stride_dy_row,
            stride_dy1_row, stride_dres_out_row, stride_x0_row, stride_dx_row, stride_dx1_row,
            stride_dres_row, M, N, dropout_p, BLOCK_N, TILE_ROWS, IS_RMS_NORM, HAS_BIAS, HAS_W1,
            HAS_B1, HAS_X1, HAS_DRESIDUAL_OUT, STORE_DRESIDUAL, HAS_ROWSCALE, HAS_LAYERSCALE,
            HAS_DROPOUT, ZERO_CENTERED_WEIGHT, ROW_STAGES, JOINT_ROW_SUMS,
        )  # fmt: skip
    else:
        dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
        db = tl.zeros((BLOCK_N,), dtype=tl.float32)
        dw1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        db1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        dls = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if TAIL_N > 0:
            tcols = BLOCK_N + tl.arange(0, TAIL_N)
            tmask = tcols < N
            tdw = tl.zeros((TAIL_N,), dtype=tl.float32)
            tdb = tl.zeros((TAIL_N,), dtype=tl.float32)
            tdw1 = tl.zeros((TAIL_N,), dtype=tl.float32)
            tdb1 = tl.zeros((TAIL_N,), dtype=tl.float32)
            tdls = tl.zeros((TAIL_N,), dtype=tl.float32)
        if EXCHANGE and row_start < row_end:
            _publish_block_sums(
                C12, S, DY, DY1, W, W1, MEAN, RSTD, row_start, cols, col_mask, col0,
                stride_s_row, stride_dy_row, stride_dy1_row, BLOCK_N, NUM_CHUNKS, IS_RMS_NORM,
                HAS_W1, ZERO_CENTERED_WEIGHT, JOINT_ROW_SUMS,
            )  # fmt: skip
            _reset_word(WS_NEXT, row_start, col0, BLOCK_N, NUM_CHUNKS)
        for row in tl.range(row_start, row_end, num_stages=ROW_STAGES):
            if EXCHANGE and row + 1 < row_end:
                _publish_block_sums(
                    C12, S, DY, DY1, W, W1, MEAN, RSTD, row + 1, cols, col_mask, col0,
                    stride_s_row, stride_dy_row, stride_dy1_row, BLOCK_N, NUM_CHUNKS,
                    IS_RMS_NORM, HAS_W1, ZERO_CENTERED_WEIGHT, JOINT_ROW_SUMS,
                )  # fmt: skip
                _reset_word(WS_NEXT, row + 1, col0, BLOCK_N, NUM_CHUNKS)
            if RECOMPUTE:  # the row's loads held across its sums (_held_again)
                s_h, dy_h, w_h, mean, rstd, xhat, dy, wdy = _held_row_grads(
                    S, DY, W, MEAN, RSTD, row, cols, col_mask, stride_s_row, stride_dy_row,
                    IS_RMS_NORM, ZERO_CENTERED_WEIGHT,
                )  # fmt: skip
                dy1 = dy
            else:
                xhat, dy, dy1, wdy = _row_grads(
                    S, DY, DY1, W, W1, MEAN, RSTD, row, cols, col_mask, col_mask, stride_s_row,
                    stride_dy_row, stride_dy1_row, IS_RMS_NORM, HAS_W1, ZERO_CENTERED_WEIGHT,
                )  # fmt: skip
                dw, db, dw1, db1 = _param_grads(
                    dw, db, dw1, db1, xhat, dy, dy1, HAS_BIAS, HAS_W1, HAS_B1
                )
            if TAIL_N > 0:
                txhat, tdy, tdy1, twdy = _row_grads(
                    S, DY, DY1, W, W1, MEAN, RSTD, row, tcols, tmask, tmask, stride_s_row,
                    stride_dy_row, stride_dy1_row, IS_RMS_NORM, HAS_W1, ZERO_CENTERED_WEIGHT,
                )  # fmt: skip
                tdw, tdb, tdw1, tdb1 = _param_grads(
                    tdw, tdb, tdw1, tdb1, txhat, tdy, tdy1, HAS_BIAS, HAS_W1, HAS_B1
                )
            # The row sums: from the block(s) when they hold the whole row, else from C12.
            c2 = 0.0
            if EXCHANGE:  # after this row's loads, which are in flight during the wait
                c1, c2 = _exchanged_row_sums(
                    C12, S, DY, DY1, W, W1, MEAN, RSTD, row, N, stride_s_row, stride_dy_row,
                    stride_dy1_row, max_polls, BLOCK_N, NUM_CHUNKS, CHUNKS_P2, IS_RMS_NORM,
                    HAS_W1, ZERO_CENTERED_WEIGHT, BOUNDED_WAIT, EXCHANGE_RELOAD, JOINT_ROW_SUMS,
                )  # fmt: skip
            elif NUM_CHUNKS > 1:
                c1 = tl.load(C12 + 2 * row)
                if not IS_RMS_NORM:
                    c2 = tl.load(C12 + 2 * row + 1)
            elif IS_RMS_NORM or not JOINT_ROW_SUMS:
                c1 = tl.sum(_fold_repeats(xhat * wdy, BLOCK_N, SUM_REPEATS), axis=0)
                if TAIL_N > 0:
                    c1 += tl.sum(txhat * twdy, axis=0)
                c1 = c1 / N
                if not IS_RMS_NORM:
                    c2 = tl.sum(_fold_repeats(wdy, BLOCK_N, SUM_REPEATS), axis=0)
                    if TAIL_N > 0:
                        c2 += tl.sum(twdy, axis=0)
                    c2 = c2 / N
            else:  # config.bwd_joint_row_sums: one pair of sums per block
                c1, c2 = _pair_sums(xhat * wdy, wdy, 0)
                if TAIL_N > 0:
                    tc1, tc2 = _pair_sums(txhat * twdy, twdy, 0)
                    c1 += tc1
                    c2 += tc2
                c1 = c1 / N
                c2 = c2 / N
            if RECOMPUTE:
                xhat, dy, wdy = _held_again(s_h, dy_h, w_h, mean, rstd, c1, col_mask,
                                            IS_RMS_NORM, ZERO_CENTERED_WEIGHT)  # fmt: skip
                dw, db, dw1, db1 = _param_grads(
                    dw, db, dw1, db1, xhat, dy, dy, HAS_BIAS, False, False
                )
            rstd = tl.load(RSTD + row)
            dls_row = _block_input_grads(
                xhat, wdy, c1, c2, rstd, row, col0, cols, col_mask, M, N, DRESIDUAL_OUT, X0,
                LAYERSCALE, ROWSCALE, SEEDS, DX, DX1, DRESIDUAL, stride_dres_out_row, stride_x0_row,
                stride_dx_row, stride_dx1_row, stride_dres_row, dropout_p, BLOCK_N, IS_RMS_NORM,
                HAS_DRESIDUAL_OUT, STORE_DRESIDUAL, HAS_X1, HAS_ROWSCALE, HAS_LAYERSCALE, HAS_DROPOUT, 0,
            )  # fmt: skip
            if HAS_LAYERSCALE:
                dls += dls_row
            if TAIL_N > 0:
                tdls_row = _block_input_grads(
                    txhat, twdy, c1, c2, rstd, row, BLOCK_N, tcols, tmask, M, N, DRESIDUAL_OUT, X0,
                    LAYERSCALE, ROWSCALE, SEEDS, DX, DX1, DRESIDUAL, stride_dres_out_row,
                    stride_x0_row, stride_dx_row, stride_dx1_row, stride_dres_row, dropout_p, TAIL_N,
                    IS_RMS_NORM, HAS_DRESIDUAL_OUT, STORE_DRESIDUAL, HAS_X1, HAS_ROWSCALE,
                    HAS_LAYERSCALE, HAS_DROPOUT, 0,
                )  # fmt: skip
                if HAS_LAYERSCALE:
                    tdls += tdls_row
    part = pid.to(tl.int64) * N
    _store_partials(PARTS, part, stride_part, cols, col_mask, dw, db, dw1, db1, dls, HAS_BIAS,
                    HAS_W1, HAS_B1, HAS_LAYERSCALE)  # fmt: skip
    if TAIL_N > 0:
        _store_partials(PARTS, part, stride_part, tcols, tmask, tdw, tdb, tdw1, tdb1, tdls,
                        HAS_BIAS, HAS_W1, HAS_B1, HAS_LAYERSCALE)  # fmt: skip


@triton.jit
def _store_gradient(G, j: tl.constexpr, k, cols, total, col_ok, PARTIALS: tl.constexpr):
    """_sum_partials_kernel's store of slab ``k``'s sum into gradient ``j`` (G), if that slab is
    ``j`` (gradients past PARTIALS are None and never stored)."""
    if j < PARTIALS:
        if k == j:
            tl.store(G + cols, total.to(G.dtype.element_ty), mask=col_ok)


# The row blocks' count is not specialised on, so that the kernel a warm-up compiles (before
# the backward's grid is known) is the one the launch takes.
@triton.jit(do_not_specialize=["programs"])
def _sum_partials_kernel(
    PARTS, G0, G1, G2, G3, G4, programs, N,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, PARTIALS: tl.constexpr, STAGES: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    """``Gk[col] = sum over p of PARTS[k, p, col]`` for the ``(PARTIALS, programs, N)`` fp32
    partial parameter gradients of the backward, summed in fp32 in a fixed order and cast to
    Gk's dtype (Gk is None for k >= PARTIALS). Program ``(c, k)``: columns block ``c`` of
    slab ``k``; its loop over the row blocks is pipelined over STAGES tiles. GDC: launched as
    the backward kernel's programmatic dependent: it waits here until the backward has
    finished and its writes are visible."""
    if GDC:
        gdc_wait()
    k = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    slab = PARTS + k.to(tl.int64) * programs * N
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for p0 in tl.range(0, programs, BLOCK_P, num_stages=STAGES):
        p = p0 + tl.arange(0, BLOCK_P)
        offs = p[:, None].to(tl.int64) * N + cols[None, :]
        acc += tl.load(slab + offs, mask=(p < programs)[:, None] & col_ok[None, :], other=0.0)
    total = tl.sum(acc, axis=0)
    _store_gradient(G0, 0, k, cols, total, col_ok, PARTIALS)
    _store_gradient(G1, 1, k, cols, total, col_ok, PARTIALS)
    _store_gradient(G2, 2, k, cols, total, col_ok, PARTIALS)
    _store_gradient(G3, 3, k, cols, total, col_ok, PARTIALS)
    _store_gradient(G4, 4, k, cols, total, col_ok, PARTIALS)

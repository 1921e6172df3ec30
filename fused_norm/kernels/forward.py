"""The forward kernel, ``_fused_norm_fwd_kernel``: dropout + residual add + LayerNorm / RMSNorm
of each row, one kernel specialised by constexpr flags (``HAS_*``: an optional input is present,
``STORE_*``: an optional output is written) and by the row's layout, chosen on the host (one
block, a tile of narrow rows, chunks, split rows). Layouts and why: docs/design.md, 'Forward:
how a row is laid out'; the maths: 'The operation'.
"""

import triton
import triton.language as tl

from .common import (
    JOINT_SUMS,
    NO_EVICT,
    _add_pairs,
    _cancels,
    _keep_mask,
    _prefetch_l2,
    _store_row_seeds,
    _sums,
)

# Chunked rows: the first sweep's loads keep the row in L2 for the second sweep, which then lets
# it go (measured on chunked rows of 4K-32K 16-bit columns: +4 to +8 %).
FIRST_SWEEP_EVICT = tl.constexpr("evict_last")
SECOND_SWEEP_EVICT = tl.constexpr("evict_first")


@triton.jit
def _combine_inputs(
    X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
    row, col0, cols, col_mask, M, N, stride_x_row, stride_res_row, stride_x1_row, dropout_p,
    BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_X1: tl.constexpr,
    HAS_ROWSCALE: tl.constexpr, HAS_LAYERSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    STORE_MASK: tl.constexpr, ROWS: tl.constexpr, EVICT: tl.constexpr,
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
def _load_affine(cols, col_mask, W, B, HAS_BIAS: tl.constexpr, EVICT: tl.constexpr):
    """One row chunk's weight and bias as stored (the weight again where there is no bias)."""
    w = tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy=EVICT)
    b = w
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0, eviction_policy=EVICT)
    return w, b


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
    ZERO_CENTERED_WEIGHT: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """The outputs of one row chunk: y, then y1 from the second weight and bias (HAS_W1), each
    pair loaded just before its output (with the L2 eviction policy EVICT)."""
    w, b = _load_affine(cols, col_mask, W, B, HAS_BIAS, EVICT)
    _affine_store(xhat, cols, col_mask, row, w, b, Y, stride_y_row, HAS_BIAS,
                  ZERO_CENTERED_WEIGHT)  # fmt: skip
    if HAS_W1:
        w1, b1 = _load_affine(cols, col_mask, W1, B1, HAS_B1, EVICT)
        _affine_store(xhat, cols, col_mask, row, w1, b1, Y1, stride_y1_row, HAS_B1,
                      ZERO_CENTERED_WEIGHT)  # fmt: skip


@triton.jit
def _fwd_row(
    X, Y, W, B, RESIDUAL, X1, W1, B1, Y1, RESIDUAL_OUT, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
    MEAN, RSTD, row, cols, stride_x_row, stride_y_row, stride_res_row, stride_x1_row,
    stride_y1_row, stride_res_out_row, M, N, eps, dropout_p,
    BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, IS_RMS_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    HAS_X1: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr,
    HAS_ROWSCALE: tl.constexpr, HAS_LAYERSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    STORE_MASK: tl.constexpr, STORE_RESIDUAL_OUT: tl.constexpr,
    ZERO_CENTERED_WEIGHT: tl.constexpr,
):  # fmt: skip
    """The forward of one row held whole in registers (NUM_CHUNKS == 1): columns
    ``[0, BLOCK_N)`` and, with TAIL_N > 0, ``[BLOCK_N, BLOCK_N + TAIL_N)`` as a second block.
    LayerNorm's statistics: one joint sum, the exact second pass where it cancels."""
    col_mask = cols < N
    s = _combine_inputs(
        X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
        row, 0, cols, col_mask, M, N, stride_x_row, stride_res_row, stride_x1_row,
        dropout_p, BLOCK_N, HAS_RESIDUAL, HAS_X1, HAS_ROWSCALE, HAS_LAYERSCALE,
        HAS_DROPOUT, STORE_MASK, 0, NO_EVICT,
    )  # fmt: skip
    # Both blocks are formed before either is stored: storing the first block's stream before
    # the second block's loads cost 4-5 points of copy with dropout (the loads wait behind it).
    if TAIL_N > 0:
        tcols = BLOCK_N + tl.arange(0, TAIL_N)
        tmask = tcols < N
        t = _combine_inputs(
            X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
            row, BLOCK_N, tcols, tmask, M, N, stride_x_row, stride_res_row, stride_x1_row,
            dropout_p, TAIL_N, HAS_RESIDUAL, HAS_X1, HAS_ROWSCALE, HAS_LAYERSCALE,
            HAS_DROPOUT, STORE_MASK, 0, NO_EVICT,
        )  # fmt: skip
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
        total, squares = _sums(s, 0)
        if TAIL_N > 0:
            t_total, t_squares = _sums(t, 0)
            total += t_total
            squares += t_squares
        mean = total / N
        s = tl.where(col_mask, s - mean, 0.0)
        if TAIL_N > 0:
            t = tl.where(tmask, t - mean, 0.0)
        m2 = squares - total * mean
        if _cancels(squares, m2):
            m2 = tl.sum(s * s, axis=0)
            if TAIL_N > 0:
                m2 += tl.sum(t * t, axis=0)
        tl.store(MEAN + row, mean)
    rstd = 1.0 / tl.sqrt(m2 / N + eps)
    tl.store(RSTD + row, rstd)
    xhat = s * rstd
    _normalize_store(xhat, cols, col_mask, row, W, B, Y, stride_y_row, W1, B1, Y1,
                     stride_y1_row, HAS_BIAS, HAS_W1, HAS_B1, ZERO_CENTERED_WEIGHT,
                     NO_EVICT)  # fmt: skip
    if TAIL_N > 0:
        that = t * rstd
        _normalize_store(that, tcols, tmask, row, W, B, Y, stride_y_row, W1, B1, Y1,
                         stride_y1_row, HAS_BIAS, HAS_W1, HAS_B1,
                         ZERO_CENTERED_WEIGHT, NO_EVICT)  # fmt: skip


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
):  # fmt: skip
    """The forward of ROWS narrow rows from ``row0`` as one (ROWS, BLOCK_N) tile: every load of
    the tile is issued before the first reduction. Tile rows past the last row repeat it, so
    that loads need no row mask; they store what its own tile row stores."""
    rows = tl.minimum(row0 + tl.arange(0, ROWS), M - 1)
    row = rows[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    col_mask = cols < N
    s = _combine_inputs(
        X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
        row, 0, cols, col_mask, M, N, stride_x_row, stride_res_row, stride_x1_row,
        dropout_p, BLOCK_N, HAS_RESIDUAL, HAS_X1, HAS_ROWSCALE, HAS_LAYERSCALE,
        HAS_DROPOUT, STORE_MASK, ROWS, NO_EVICT,
    )  # fmt: skip
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
                     NO_EVICT)  # fmt: skip


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
    way). A copy the compiler cannot prove equal to h is converted anew where it is used."""
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
                        HAS_LAYERSCALE, HAS_DROPOUT, False, 0, NO_EVICT,
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
    FULL_ROW: tl.constexpr, WS_PREFETCH: tl.constexpr, PARAMS_EVICT: tl.constexpr,
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
    partly filled last part, for a reason not found.
    """
    pid = tl.program_id(0).to(tl.int64)
    # This part's word of the next split launch's workspace is zeroed for it (so that no fill
    # kernel runs between launches): first thing for RMSNorm, right after the publish for
    # LayerNorm. Where the store goes moves ptxas's schedule: the other place cost RMSNorm at
    # 256K 9 us (56 -> 70 registers) and LayerNorm at 128K 7 us (same registers).
    if IS_RMS_NORM and WS_NEXT is not None:  # (None: the host fills the workspace instead)
        tl.store(WS_NEXT + pid, tl.zeros((), dtype=tl.int64))
    row = pid // SPLIT
    part = pid % SPLIT
    col0 = part * BLOCK_N
    ccols = col0 + cols
    # FULL_ROW (parts of whole blocks): the mask folds and every part counts BLOCK_N columns;
    # N stays a runtime value (as a constant it took fp16 LayerNorm at 256K from 78 registers
    # to 127 offline).
    col_mask = _col_mask(ccols, cols, N, BLOCK_N, FULL_ROW)
    if WS_PREFETCH:
        # The line of this part's word asked of L2 by its line's first part: a self-clearing
        # workspace's words were last written a launch ago and have left L2, and the atomic's
        # trip to memory sits on every partner's wait (+2-4% on 64K-256K rows).
        word = row * SPLIT + part + tl.zeros((1,), dtype=tl.int64)
        _prefetch_l2(WS + word, (word % 16 == 0).to(tl.int32), False)
    s = _combine_inputs(
        X, RESIDUAL, X1, ROWSCALE, LAYERSCALE, SEEDS, MASK, MASK1,
        row, col0, ccols, col_mask, M, N, stride_x_row, stride_res_row, stride_x1_row,
        dropout_p, BLOCK_N, HAS_RESIDUAL, HAS_X1, HAS_ROWSCALE, HAS_LAYERSCALE,
        HAS_DROPOUT, STORE_MASK, 0, NO_EVICT,
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
    # The weights, read by every row's part of these columns: kept in L2 (PARAMS_EVICT).
    _normalize_store(xhat, ccols, col_mask, row, W, B, Y, stride_y_row, W1, B1, Y1,
                     stride_y1_row, HAS_BIAS, HAS_W1, HAS_B1, ZERO_CENTERED_WEIGHT,
                     PARAMS_EVICT)  # fmt: skip


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


# The maths: docs/design.md, 'The operation'. Split rows merge their parts' (mean_p, m2_p) over
# parts of n_p columns: mean = sum(n_p * mean_p) / N, m2 = sum(m2_p) + sum(n_p * (mean_p - mean)^2)
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
    RESIDUAL_OUT,  # (M, N) pre-norm residual stream s (if STORE_RESIDUAL_OUT)
    ROWSCALE,      # (M,) per-row scale of x (if HAS_ROWSCALE)
    LAYERSCALE,    # (N,) per-column scale of x (if HAS_LAYERSCALE)
    SEEDS,         # (2M,) int64 dropout seeds, x rows then x1 rows (if HAS_DROPOUT)
    SEED_KEY,      # None: SEEDS holds the seeds; else the call's int64 key, SEEDS filled here
    MASK,          # (M, N) bool keep-mask of x, contiguous (if STORE_MASK)
    MASK1,         # (M, N) bool keep-mask of x1, contiguous (if STORE_MASK and HAS_X1)
    MEAN,          # (M,) fp32 mean (if not IS_RMS_NORM)
    RSTD,          # (M,) fp32 1 / std
    WS,            # (M * SPLIT,) int64 zeros: the parts' statistics words (if SPLIT > 1)
    WS_NEXT,       # (M * SPLIT,) int64, the next split launch's workspace: each part zeroes
                   # its word (None: the host fills each workspace itself)
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
    HOLD: tl.constexpr,      # split rows: s equals a 16-bit tensor, held instead (1: widened
                             # by _widen's bit route; 2: fp16, by _convert_copy)
    UNROLL: tl.constexpr,    # chunked rows: unroll factor of the two sweeps (1: none)
    FULL_ROW: tl.constexpr,  # rows that fill their blocks or parts: the width as a constant
    SEEDS_LAST: tl.constexpr = False,  # SEED_KEY: the seeds stored after the row, not before
    WS_PREFETCH: tl.constexpr = False,  # split rows: the exchange words prefetched into L2
    PARAMS_EVICT: tl.constexpr = "",  # split rows: the weights' L2 eviction policy
):  # fmt: skip
    # fp32 whatever the caller typed them (Inductor passes Python floats as fp64, which would
    # promote every element's arithmetic to fp64)
    eps = tl.cast(eps, tl.float32)
    dropout_p = tl.cast(dropout_p, tl.float32)
    if FULL_ROW and SPLIT == 1:  # the width as a constant: the masks fold
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
            SPLIT, SPLIT_P2, SUB_N, BOUNDED_WAIT, HOLD, FULL_ROW, WS_PREFETCH, PARAMS_EVICT,
        )  # fmt: skip
    elif NUM_CHUNKS == 1:
        if ROWS_PER_PROGRAM == 1:  # no loop: the weights' loads stay where they are used
            _fwd_row(
                X, Y, W, B, RESIDUAL, X1, W1, B1, Y1, RESIDUAL_OUT, ROWSCALE, LAYERSCALE, SEEDS,
                MASK, MASK1, MEAN, RSTD, row0, cols, stride_x_row, stride_y_row, stride_res_row,
                stride_x1_row, stride_y1_row, stride_res_out_row, M, N, eps, dropout_p, BLOCK_N,
                TAIL_N, IS_RMS_NORM, HAS_BIAS, HAS_RESIDUAL, HAS_X1, HAS_W1, HAS_B1,
                HAS_ROWSCALE, HAS_LAYERSCALE, HAS_DROPOUT, STORE_MASK, STORE_RESIDUAL_OUT,
                ZERO_CENTERED_WEIGHT,
            )  # fmt: skip
        else:  # narrow rows, several per program as one tile (one block: TAIL_N == 0)
            _fwd_rows(
                X, Y, W, B, RESIDUAL, X1, W1, B1, Y1, RESIDUAL_OUT, ROWSCALE, LAYERSCALE, SEEDS,
                MASK, MASK1, MEAN, RSTD, row0, stride_x_row, stride_y_row, stride_res_row,
                stride_x1_row, stride_y1_row, stride_res_out_row, M, N, eps, dropout_p, BLOCK_N,
                ROWS_PER_PROGRAM, IS_RMS_NORM, HAS_BIAS, HAS_RESIDUAL, HAS_X1, HAS_W1, HAS_B1,
                HAS_ROWSCALE, HAS_LAYERSCALE, HAS_DROPOUT, STORE_MASK, STORE_RESIDUAL_OUT,
                ZERO_CENTERED_WEIGHT,
            )  # fmt: skip
    else:
        row = row0
        # Sweep 1: form s chunk by chunk and store it; add s and s^2 per column lane across the
        # chunks and reduce once at the end (one exchange between warps per row, not two per
        # chunk as a Chan merge of each chunk's (mean, M2) takes).
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
                HAS_LAYERSCALE, HAS_DROPOUT, STORE_MASK, 0, FIRST_SWEEP_EVICT,
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
                HAS_LAYERSCALE, HAS_DROPOUT, STORE_RESIDUAL_OUT, SECOND_SWEEP_EVICT,
            )  # fmt: skip
            if IS_RMS_NORM:
                xhat = s * rstd
            else:
                xhat = (s - mean) * rstd
            _normalize_store(xhat, ccols, col_mask, row, W, B, Y, stride_y_row, W1, B1, Y1,
                             stride_y1_row, HAS_BIAS, HAS_W1, HAS_B1,
                             ZERO_CENTERED_WEIGHT, NO_EVICT)  # fmt: skip
    if SEED_KEY is not None and SEEDS_LAST:
        _store_row_seeds(seeds_out, SEED_KEY, row0, M, SPLIT, ROWS_PER_PROGRAM, HAS_X1)

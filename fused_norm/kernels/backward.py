"""The backward kernels: ``_fused_norm_bwd_kernel`` (a persistent grid of row blocks writing
fp32 partial parameter gradients), ``_bwd_row_sums_kernel`` (the row sums c1, c2 of rows wider
than one block whose column blocks do not exchange them) and ``_sum_partials_kernel`` (the
partials summed in a fixed order and cast to each parameter's dtype). Grid, layouts and why:
docs/design.md, 'Backward'; the maths: 'The operation'.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .common import _keep_mask, _pack_sums, _pair_sums


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
    after a barrier instead of from the last poll (a choice of speed: faster for the x1 path,
    slower for the others). Under the interpreter (BOUNDED_WAIT) the program computes the
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


# The row sums of a row wider than one block (one program per row, NUM_CHUNKS chunks):
#   c1 = sum(xhat * wdy) / N,  c2 = sum(wdy) / N   (RMSNorm: c1 alone)
@triton.jit
def _bwd_row_sums_kernel(
    S,     # (M, N) the normalised pre-norm sum
    DY,    # (M, N) grad of y
    DY1,   # (M, N) grad of y1 (if HAS_W1)
    W,     # (N,) weight
    W1,    # (N,) second weight (if HAS_W1)
    MEAN,  # (M,) fp32 (if not IS_RMS_NORM)
    RSTD,  # (M,) fp32
    C12,   # (M, 2) fp32 out: c1, c2 of each row
    stride_s_row, stride_dy_row, stride_dy1_row, N,
    BLOCK_N: tl.constexpr,     # columns per chunk
    NUM_CHUNKS: tl.constexpr,  # chunks of the row: cdiv(N, BLOCK_N)
    IS_RMS_NORM: tl.constexpr, HAS_W1: tl.constexpr, ZERO_CENTERED_WEIGHT: tl.constexpr,
):  # fmt: skip
    """c1 and c2 of row ``program_id(0)`` into C12[row], its chunks of BLOCK_N columns summed
    per column lane and reduced once."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for c in range(NUM_CHUNKS):
        ccols = c * BLOCK_N + cols
        xhat, _dy, _dy1, wdy = _row_grads(
            S, DY, DY1, W, W1, MEAN, RSTD, row, ccols, ccols < N, ccols < N, stride_s_row,
            stride_dy_row, stride_dy1_row, IS_RMS_NORM, HAS_W1, ZERO_CENTERED_WEIGHT,
        )  # fmt: skip
        acc1 += xhat * wdy
        if not IS_RMS_NORM:
            acc2 += wdy
    out = C12 + 2 * row
    tl.store(out, tl.sum(acc1, axis=0) / N)
    if not IS_RMS_NORM:
        tl.store(out + 1, tl.sum(acc2, axis=0) / N)


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
    flight before its row sums. Tile rows past the program's last row
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


# The maths: docs/design.md, 'The operation' (s, mean and rstd as the forward stored them).
#
# M and the two integers that follow from the program count are not specialised on, so that one
# compiled kernel serves every grid: the host asks that kernel how many programs fit on a
# multiprocessor before it sizes the grid.
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
    M, N,          # rows, columns
    dropout_p,     # drop probability (if HAS_DROPOUT)
    rows_per_program,  # contiguous rows owned by each row block
    max_polls,  # EXCHANGE with BOUNDED_WAIT: reads of a row's words before computing them
    BLOCK_N: tl.constexpr,  # columns per column block (a power of two)
    TAIL_N: tl.constexpr,  # one-block rows: a second column block after BLOCK_N (0: none)
    NUM_CHUNKS: tl.constexpr,  # column blocks per row (1: the row in one block)
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
    ROW_STAGES: tl.constexpr,  # rows in flight: the row loop is software-pipelined (1: not)
):  # fmt: skip
    dropout_p = tl.cast(dropout_p, tl.float32)  # fp32 whatever the caller typed it (Inductor: fp64)
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
    # (the host sizes the grid to what fits) or not, some row block always runs whole; under the
    # CPU interpreter, one program after another, the wait is bounded (BOUNDED_WAIT).
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
                c1 = tl.sum(xhat * wdy, axis=0)
                if TAIL_N > 0:
                    c1 += tl.sum(txhat * twdy, axis=0)
                c1 = c1 / N
                if not IS_RMS_NORM:
                    c2 = tl.sum(wdy, axis=0)
                    if TAIL_N > 0:
                        c2 += tl.sum(twdy, axis=0)
                    c2 = c2 / N
            else:  # JOINT_ROW_SUMS: one pair of sums per block
                c1, c2 = _pair_sums(xhat * wdy, wdy, 0)
                if TAIL_N > 0:
                    tc1, tc2 = _pair_sums(txhat * twdy, twdy, 0)
                    c1 += tc1
                    c2 += tc2
                c1 = c1 / N
                c2 = c2 / N
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
    PARTS,     # (PARTIALS, programs, N) fp32 partial parameter gradients of the backward
    G0,        # (N,) gradient of slab 0 (dW), in its parameter's dtype
    G1, G2, G3, G4,  # (N,) gradients of slabs 1-4 (None past PARTIALS)
    programs,  # row blocks of the backward: rows of each slab
    N,
    BLOCK_N: tl.constexpr,   # columns per program
    BLOCK_P: tl.constexpr,   # row blocks per tile of the loop
    PARTIALS: tl.constexpr,  # slabs (gradients) present
    STAGES: tl.constexpr,    # tiles in flight: the loop is software-pipelined (1: not)
    GDC: tl.constexpr = False,  # launched as the backward's programmatic dependent (PDL)
):  # fmt: skip
    """``Gk[col] = sum over p of PARTS[k, p, col]``, summed in fp32 in a fixed order and cast
    to Gk's dtype. Program ``(c, k)``: columns block ``c`` of slab ``k``; its loop over the
    row blocks is pipelined over STAGES tiles. With GDC its programs may start while the
    backward still runs; they wait here until its writes are visible."""
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

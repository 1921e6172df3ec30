"""The Gluon backward, ``_bwd_smem_kernel``: rows held by one program per multiprocessor, or cut
into slices whose programs exchange their row sums, staged through shared memory. Gluon
(``triton.experimental.gluon``) is Triton's lower-level language, where a kernel allocates and
addresses shared memory itself; it is experimental and its names move between Triton releases
(``thread_barrier`` became ``barrier``, ``async_copy_global_to_shared`` became ``async_load``):
both spellings are resolved here. ``AVAILABLE`` is False where the installed Triton has no Gluon;
the Triton backward (backward.py) then serves every row. Why, and which rows: docs/design.md,
'Backward' (Hopper shared-memory backward); the maths: 'The operation'.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _async_copy
except ImportError:  # a Triton without Gluon: the Triton kernels serve every row
    gluon = None

AVAILABLE = gluon is not None

if AVAILABLE:
    # Names of the Triton versions this was written against (3.6 / 3.9).
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    _async_load = (
        getattr(_async_copy, "async_load", None) or _async_copy.async_copy_global_to_shared
    )
    AVAILABLE = _barrier is not None and _async_load is not None

if AVAILABLE:
    from .common import _keeps, _octet_bits, _pack_sums, _prefetch_l2

    @gluon.jit
    def _stage(PTR, buf, tbuf, slot, r, live, cols, tcols, N, stride_row, TAIL_N: gl.constexpr):
        """Start copying row ``r`` of one tensor (block, then tail) into buffer ``slot``."""
        _async_load(buf.index(slot), PTR + r * stride_row + cols, mask=(cols < N) & live)
        if TAIL_N > 0:
            _async_load(tbuf.index(slot), PTR + r * stride_row + tcols, mask=(tcols < N) & live)

    @gluon.jit
    def _stage_row(S, DY, DRES_OUT, DY1, s_buf, dy_buf, r_buf, y1_buf, ts_buf, tdy_buf, tr_buf,
                   ty1_buf, slot, row, row_end, cols, tcols, N, stride_s_row, stride_dy_row,
                   stride_dres_out_row, stride_dy1_row, TAIL_N: gl.constexpr,
                   HAS_DRESIDUAL_OUT: gl.constexpr, HAS_W1: gl.constexpr):  # fmt: skip
        """Start copying ``row``'s s and dy (and its dresidual_out and dy1, if any) into
        buffer ``slot`` (zeros past N or past the program's last row), as one commit group."""
        r = row.to(gl.int64)
        live = row < row_end
        _stage(S, s_buf, ts_buf, slot, r, live, cols, tcols, N, stride_s_row, TAIL_N)
        _stage(DY, dy_buf, tdy_buf, slot, r, live, cols, tcols, N, stride_dy_row, TAIL_N)
        if HAS_DRESIDUAL_OUT:
            _stage(DRES_OUT, r_buf, tr_buf, slot, r, live, cols, tcols, N, stride_dres_out_row,
                   TAIL_N)  # fmt: skip
        if HAS_W1:  # x1's second output
            _stage(DY1, y1_buf, ty1_buf, slot, r, live, cols, tcols, N, stride_dy1_row, TAIL_N)
        _async_copy.commit_group()

    @gluon.jit
    def _part_terms(s_buf, dy_buf, y1_buf, slot, layout: gl.constexpr, w, w1, mean, rstd,
                    ZERO_CENTERED_WEIGHT: gl.constexpr, HAS_W1: gl.constexpr):  # fmt: skip
        """xhat, dy, dy1 and wdy = w * dy (+ w1 * dy1) of one part (block or tail) of the
        staged row, fp32; ``w`` (``w1``) the part's weight as _part_setup holds it. Columns
        past N read zeros: dy = dy1 = 0 there, so every term they add is zero."""
        s = s_buf.index(slot).load(layout).to(gl.float32)
        dy = dy_buf.index(slot).load(layout).to(gl.float32)
        wf = w.load(layout).to(gl.float32)  # the weight in shared memory, as stored
        if ZERO_CENTERED_WEIGHT:
            wf += 1.0
        xhat = (s - mean) * rstd
        wdy = wf * dy
        dy1 = dy  # placeholder without a second output
        if HAS_W1:  # the second weight in shared memory too
            w1f = w1.load(layout).to(gl.float32)
            if ZERO_CENTERED_WEIGHT:
                w1f += 1.0
            dy1 = y1_buf.index(slot).load(layout).to(gl.float32)
            wdy += w1f * dy1
        return xhat, dy, dy1, wdy

    @gluon.jit
    def _keep(SEEDS, row, col0, dropout_p, PART_N: gl.constexpr, VEC: gl.constexpr,
              NUM_WARPS: gl.constexpr, layout: gl.constexpr):  # fmt: skip
        """The dropout keep-decisions of one part of x's row ``row`` (columns ``col0`` on), as
        common._keep_mask draws them (its _octet_bits and _keeps), in ``layout``. Where a
        thread's VEC contiguous columns are whole octets, its Philox calls serve its own
        columns; where they are half an octet (VEC 4: fp32 rows, whose 16-byte accesses
        keep shared memory free of bank conflicts), a thread draws whole octets and the
        decisions move to ``layout`` through shared memory, one byte each."""
        gl.static_assert(VEC % 8 == 0 or VEC == 4, "a thread's columns: whole or half octets")
        octets: gl.constexpr = gl.BlockedLayout([(VEC + 7) // 8], [32], [NUM_WARPS], [0])
        seed = gl.load(SEEDS + row).to(gl.uint32)
        octet = col0 // 8 + gl.arange(0, PART_N // 8, layout=octets)
        bits = gl.reshape(_octet_bits(seed, octet), [PART_N])
        if VEC % 8 == 0:
            return _keeps(gl.convert_layout(bits, layout), dropout_p)
        return gl.convert_layout(_keeps(bits, dropout_p).to(gl.int8), layout) != 0

    @gluon.jit
    def _part_grads(s_buf, dy_buf, r_buf, y1_buf, slot, layout: gl.constexpr, wf, w1f, mean,
                    rstd, c1, c2, DX, DRES, SEEDS, row, col0, dropout_p, cols, N, stride_dx_row,
                    stride_dres_row, dw_acc, db, dw1, db1, dres, PART_N: gl.constexpr,
                    VEC: gl.constexpr, NUM_WARPS: gl.constexpr, IS_RMS_NORM: gl.constexpr,
                    HAS_BIAS: gl.constexpr, HAS_DRESIDUAL_OUT: gl.constexpr,
                    STORE_DRESIDUAL: gl.constexpr, HAS_DROPOUT: gl.constexpr,
                    ZERO_CENTERED_WEIGHT: gl.constexpr, HAS_W1: gl.constexpr,
                    HAS_B1: gl.constexpr, DRES_REGS: gl.constexpr):  # fmt: skip
        """Store one part's input gradients (dresidual = ds, the gradient of the pre-norm
        sum, with the row's dresidual_out added from its staged row or, with DRES_REGS, from
        ``dres``, and dx: ds through dropout) and add its terms to the partials dW, dB and
        the second output's dW1 and dB1 (registers); returns (dW, dB, dW1, dB1)."""
        xhat, dy, dy1, wdy = _part_terms(s_buf, dy_buf, y1_buf, slot, layout, wf, w1f, mean,
                                         rstd, ZERO_CENTERED_WEIGHT, HAS_W1)  # fmt: skip
        if IS_RMS_NORM:
            ds = (wdy - xhat * c1) * rstd
        else:
            ds = (wdy - (xhat * c1 + c2)) * rstd
        if DRES_REGS:  # the row's dresidual_out, loaded a row ahead into registers
            ds += dres
        elif HAS_DRESIDUAL_OUT:
            ds += r_buf.index(slot).load(layout).to(gl.float32)
        r = row.to(gl.int64)
        if STORE_DRESIDUAL:
            gl.store(DRES + r * stride_dres_row + cols, ds.to(DRES.dtype.element_ty),
                     mask=cols < N)  # fmt: skip
        dx = ds
        if HAS_DROPOUT:
            keep = _keep(SEEDS, row, col0, dropout_p, PART_N, VEC, NUM_WARPS, layout)
            dx = gl.where(keep, ds * (1.0 / (1.0 - dropout_p)), 0.0)
        gl.store(DX + r * stride_dx_row + cols, dx.to(DX.dtype.element_ty), mask=cols < N)
        dw_acc += dy * xhat
        if HAS_BIAS:
            db += dy
        if HAS_W1:
            dw1 += dy1 * xhat
            if HAS_B1:
                db1 += dy1
        return dw_acc, db, dw1, db1

    @gluon.jit
    def _row_regs(PTR, row, row_end, cols, N, stride_row):
        """Row ``row`` of a tensor at ``cols`` into registers as fp32 (zeros past N or past the
        program's last row)."""
        ok = (cols < N) & (row < row_end)
        vals = gl.load(PTR + row.to(gl.int64) * stride_row + cols, mask=ok, other=0.0)
        return vals.to(gl.float32)

    @gluon.jit
    def _part_setup(S, DY, DRES_OUT, DY1, W, W1, col0, PART_N: gl.constexpr,
                    layout: gl.constexpr, N, STAGES: gl.constexpr,
                    HAS_DRESIDUAL_OUT: gl.constexpr, HAS_W1: gl.constexpr):  # fmt: skip
        """One part's columns (``col0`` on), its staging buffers of s, dy, (with
        HAS_DRESIDUAL_OUT) dresidual_out and (with HAS_W1) dy1, s's buffer standing in for
        those absent (never read), its zeroed partials dW and dB (registers) and its weight
        in shared memory as stored (zero past N); with HAS_W1 the second output's zeroed
        partials dW1, dB1 (registers) and weight (shared memory, as the first)."""
        shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        cols = col0 + gl.arange(0, PART_N, layout=layout)
        s_buf = gl.allocate_shared_memory(S.dtype.element_ty, [STAGES, PART_N], shared)
        dy_buf = gl.allocate_shared_memory(DY.dtype.element_ty, [STAGES, PART_N], shared)
        r_buf = s_buf
        if HAS_DRESIDUAL_OUT:
            r_buf = gl.allocate_shared_memory(DRES_OUT.dtype.element_ty, [STAGES, PART_N], shared)
        y1_buf = s_buf
        if HAS_W1:
            y1_buf = gl.allocate_shared_memory(DY1.dtype.element_ty, [STAGES, PART_N], shared)
        dw_acc = gl.zeros([PART_N], gl.float32, layout)
        wf = gl.allocate_shared_memory(
            W.dtype.element_ty, [PART_N], shared, gl.load(W + cols, mask=cols < N, other=0.0)
        )
        db = gl.zeros([PART_N], gl.float32, layout)
        w1f = wf  # placeholder without a second output
        if HAS_W1:
            w1f = gl.allocate_shared_memory(
                W1.dtype.element_ty, [PART_N], shared, gl.load(W1 + cols, mask=cols < N, other=0.0)
            )
        dw1 = gl.zeros([PART_N], gl.float32, layout)
        db1 = gl.zeros([PART_N], gl.float32, layout)
        return cols, s_buf, dy_buf, r_buf, y1_buf, dw_acc, db, dw1, db1, wf, w1f

    @gluon.jit
    def _store_part_partials(part, slab, cols, N, dw_acc, db, dw1, db1, HAS_BIAS: gl.constexpr,
                             HAS_W1: gl.constexpr, HAS_B1: gl.constexpr):  # fmt: skip
        """One part's partial dW, dB, dW1 and dB1 into the program's rows of their slabs, in
        that order (``part``: the program's row of the first; ``slab``: elements apart)."""
        gl.store(part + cols, dw_acc, mask=cols < N)
        if HAS_BIAS:
            gl.store(part + slab + cols, db, mask=cols < N)
        if HAS_W1:
            gl.store(part + (1 + HAS_BIAS) * slab + cols, dw1, mask=cols < N)
            if HAS_B1:
                gl.store(part + (2 + HAS_BIAS) * slab + cols, db1, mask=cols < N)

    @gluon.jit
    def _publish_sums(WS, WS_NEXT, row, p1, p2, part, SPLIT: gl.constexpr):
        """Publish this program's (slice ``part``) partial row sums p1, p2 of ``row`` as one
        word (common._pack_sums) in WS[row, part], and set the same word of the next sliced
        launch's workspace, WS_NEXT, to -1 for it (workspace.py)."""
        gl.atomic_xchg(WS + row * SPLIT + part, _pack_sums(p1, p2), sem="relaxed")
        gl.store(WS_NEXT + row * SPLIT + part, -1)

    @gluon.jit
    def _prefetch_words(WS, first, count, part, SPLIT: gl.constexpr, NUM_WARPS: gl.constexpr):
        """Ask L2 for the 128-byte lines of the ``count`` words at WS + ``first`` (a row
        block's exchange words, last written a launch ago and gone from L2): the block's SPLIT
        programs share the lines (``part`` takes every SPLIT-th), a thread a line, at most
        32 * NUM_WARPS each, kept in L2 at evict-last priority until the block's last row."""
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        line = gl.arange(0, 32 * NUM_WARPS, layout=lanes) * SPLIT + part
        n_lines = (count + 15) // 16
        live = (line < n_lines).to(gl.int32)
        ptrs = WS + first + gl.minimum(line, gl.maximum(n_lines, 1) - 1).to(gl.int64) * 16
        _prefetch_l2(ptrs, live, True)

    @gluon.jit
    def _wait_sums(WS, row, SPLIT: gl.constexpr, SPLIT_P2: gl.constexpr, NUM_WARPS: gl.constexpr):
        """The row sums of ``row`` over its SPLIT slices: read the row's words until all are
        published and add them. Every thread polls and adds its own copy of the words, in
        slice order (no barrier in the loop, and every program of the row gets the same sums,
        bitwise)."""
        words: gl.constexpr = gl.BlockedLayout([SPLIT_P2], [32], [NUM_WARPS], [0])
        parts = gl.arange(0, SPLIT_P2, layout=words)
        ptrs = WS + row * SPLIT + parts
        mask = parts < SPLIT
        bits = gl.load(ptrs, mask=mask, other=0, volatile=True).to(gl.uint64, bitcast=True)
        missing = gl.sum(((bits >> 32) == 0xFFFFFFFF).to(gl.int32), axis=0)
        while missing > 0:
            bits = gl.load(ptrs, mask=mask, other=0, volatile=True).to(gl.uint64, bitcast=True)
            missing = gl.sum(((bits >> 32) == 0xFFFFFFFF).to(gl.int32), axis=0)
        c1 = gl.sum((bits & 0xFFFFFFFF).to(gl.uint32).to(gl.float32, bitcast=True), axis=0)
        c2 = gl.sum((bits >> 32).to(gl.uint32).to(gl.float32, bitcast=True), axis=0)
        return c1, c2

    @gluon.jit
    def _slice_sums(s_buf, dy_buf, y1_buf, slot, layout: gl.constexpr, wf, w1f, mean, rstd,
                    ZERO_CENTERED_WEIGHT: gl.constexpr, IS_RMS_NORM: gl.constexpr,
                    HAS_W1: gl.constexpr):  # fmt: skip
        """A part's partial row sums (sum(xhat * wdy), sum(wdy)) of the staged row in ``slot``
        (a slice, a block or a tail); RMSNorm has no second: the first fills its place
        (unread)."""
        xhat, dy, dy1, wdy = _part_terms(s_buf, dy_buf, y1_buf, slot, layout, wf, w1f, mean,
                                         rstd, ZERO_CENTERED_WEIGHT, HAS_W1)  # fmt: skip
        p1 = gl.sum(xhat * wdy, axis=0)
        p2 = p1
        if not IS_RMS_NORM:
            p2 = gl.sum(wdy, axis=0)
        return p1, p2

    @gluon.jit
    def _row_ahead(S, DY, DRES_OUT, DY1, MEAN, RSTD, s_buf, dy_buf, r_buf, y1_buf, ts_buf,
                   tdy_buf, tr_buf, ty1_buf, i, row, row_end, last, cols, tcols, N, stride_s_row,
                   stride_dy_row, stride_dres_out_row, stride_dy1_row, STAGES: gl.constexpr,
                   TAIL_N: gl.constexpr, HAS_DRESIDUAL_OUT: gl.constexpr,
                   IS_RMS_NORM: gl.constexpr, HAS_W1: gl.constexpr):  # fmt: skip
        """At the top of the loop over the program's ``i``-th row ``row``: start copying the row
        STAGES - 1 ahead into the slot of the row before (done with), and return the next
        row's statistics (rstd, mean), one row ahead (the last row reads its own again)."""
        _stage_row(S, DY, DRES_OUT, DY1, s_buf, dy_buf, r_buf, y1_buf, ts_buf, tdy_buf, tr_buf,
                   ty1_buf, (i + STAGES - 1) % STAGES, row + STAGES - 1, row_end, cols, tcols, N,
                   stride_s_row, stride_dy_row, stride_dres_out_row, stride_dy1_row, TAIL_N,
                   HAS_DRESIDUAL_OUT, HAS_W1)  # fmt: skip
        nxt = gl.minimum(row + 1, last)
        rstd_next = gl.load(RSTD + nxt)
        mean_next = 0.0
        if not IS_RMS_NORM:
            mean_next = gl.load(MEAN + nxt)
        return rstd_next, mean_next

    @gluon.jit
    def _bwd_smem_kernel(
        S,         # (M, N) the normalised pre-norm sum
        W,         # (N,) weight (as stored: 16-bit, or fp32 in slices)
        W1,        # (N,) second weight (if HAS_W1)
        MEAN,      # (M,) fp32 (if not IS_RMS_NORM)
        RSTD,      # (M,) fp32
        DY,        # (M, N) grad of y
        DY1,       # (M, N) grad of y1, the second output (if HAS_W1)
        DRES_OUT,  # (M, N) grad of the pre-norm residual stream (if HAS_DRESIDUAL_OUT)
        SEEDS,     # (M,) int64 dropout seeds of x's rows (if HAS_DROPOUT)
        DX,        # (M, N) grad of x
        DRES,      # (M, N) grad of the residual (if STORE_DRESIDUAL)
        PARTS,     # fp32 partial dW, then dB, dW1, dB1 (those present): one (P, N) slab each, stride_part apart
        WS,        # SPLIT > 1: (M, SPLIT) int64 words of the slices' partial row sums, -1 until published
        WS_NEXT,   # SPLIT > 1: the next sliced launch's workspace: published words set to -1 there
        stride_s_row, stride_dy_row, stride_dy1_row, stride_dres_out_row, stride_dx_row,
        stride_dres_row, stride_part,
        M, N,      # rows, columns
        rows_per_program,  # contiguous rows owned by each row block (its SPLIT programs)
        dropout_p,  # drop probability (if HAS_DROPOUT)
        BLOCK_N: gl.constexpr,       # columns of the first part (a power of two)
        TAIL_N: gl.constexpr,        # columns of a second part after BLOCK_N (0: none)
        IS_RMS_NORM: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        HAS_DRESIDUAL_OUT: gl.constexpr,
        STORE_DRESIDUAL: gl.constexpr,
        HAS_DROPOUT: gl.constexpr,
        ZERO_CENTERED_WEIGHT: gl.constexpr,
        STAGES: gl.constexpr,        # rows staged in shared memory (>= 2)
        VEC: gl.constexpr,           # contiguous elements per thread in the first part
        TAIL_VEC: gl.constexpr,      # and in the tail (1 where there is none)
        NUM_WARPS: gl.constexpr,     # the launch's num_warps
        SPLIT: gl.constexpr = 1,     # programs per row, one slice of BLOCK_N + TAIL_N columns each
        SPLIT_P2: gl.constexpr = 1,  # SPLIT rounded up to a power of two
        LAG: gl.constexpr = False,   # SPLIT > 1: the row sums published a row ahead
        HAS_W1: gl.constexpr = False,  # a second output y1 = xhat * w1 (+ b1): x1's path
        HAS_B1: gl.constexpr = False,
        DRES_REGS: gl.constexpr = False,  # dresidual_out a row ahead in registers, not staged
        WS_PREFETCH: gl.constexpr = False,  # SPLIT > 1: the row block's words asked of L2 first
    ):  # fmt: skip
        # One layout per part for every tensor of it: each thread copies, reads and accumulates
        # the same columns.
        layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NUM_WARPS], [0])
        tail_layout: gl.constexpr = gl.BlockedLayout([TAIL_VEC], [32], [NUM_WARPS], [0])
        # With SPLIT > 1 the SPLIT consecutive programs of a row block take one slice of its
        # rows each and exchange their partial row sums (_publish_sums, _wait_sums); they wait
        # only on each other, and with one program per SM and a grid of at most one per SM
        # (the host's grid), all are resident at once.
        gl.static_assert(not LAG or TAIL_N == 0, "LAG: slices without a tail")
        gl.static_assert(not DRES_REGS or (HAS_DRESIDUAL_OUT and TAIL_N == 0),
                         "DRES_REGS: a residual gradient in, rows without a tail")  # fmt: skip
        STAGE_DRES: gl.constexpr = HAS_DRESIDUAL_OUT and not DRES_REGS
        pid = gl.program_id(0)
        blk = pid // SPLIT
        part = pid % SPLIT
        col0 = part * (BLOCK_N + TAIL_N)  # the slice's first column; its tail's: col0 + BLOCK_N
        row_start = blk.to(gl.int64) * rows_per_program
        row_end = gl.minimum(row_start + rows_per_program, M)
        cols, s_buf, dy_buf, r_buf, y1_buf, dw_acc, db, dw1, db1, wf, w1f = _part_setup(
            S, DY, DRES_OUT, DY1, W, W1, col0, BLOCK_N, layout, N, STAGES, STAGE_DRES, HAS_W1,
        )  # fmt: skip
        if TAIL_N > 0:
            tcols, ts_buf, tdy_buf, tr_buf, ty1_buf, tdw_acc, tdb, tdw1, tdb1, twf, tw1f = _part_setup(
                S, DY, DRES_OUT, DY1, W, W1, col0 + BLOCK_N, TAIL_N, tail_layout, N, STAGES,
                STAGE_DRES, HAS_W1,
            )  # fmt: skip
        else:  # placeholders, never read
            tcols, ts_buf, tdy_buf, tr_buf, ty1_buf = cols, s_buf, dy_buf, r_buf, y1_buf
        for k in gl.static_range(STAGES - 1):
            _stage_row(S, DY, DRES_OUT, DY1, s_buf, dy_buf, r_buf, y1_buf, ts_buf, tdy_buf,
                       tr_buf, ty1_buf, k, row_start + k, row_end, cols, tcols, N, stride_s_row,
                       stride_dy_row, stride_dres_out_row, stride_dy1_row, TAIL_N,
                       STAGE_DRES, HAS_W1)  # fmt: skip
        if WS_PREFETCH:
            _prefetch_words(WS, row_start * SPLIT, (row_end - row_start) * SPLIT, part, SPLIT,
                            NUM_WARPS)  # fmt: skip
        last = gl.maximum(row_end - 1, row_start)
        dres = db  # placeholder without DRES_REGS
        if DRES_REGS:
            dres = _row_regs(DRES_OUT, row_start, row_end, cols, N, stride_dres_out_row)
        rstd = gl.load(RSTD + row_start, mask=row_start < M, other=0.0)
        mean = 0.0
        if not IS_RMS_NORM:
            mean = gl.load(MEAN + row_start, mask=row_start < M, other=0.0)
        if LAG:
            # The slices publish their sums one row ahead: pass 1 of the next row, then pass 2
            # of this one, whose words came a whole row earlier (rows r, r + 1 staged and
            # r + 2.. in flight: STAGES >= 3).
            gl.static_assert(SPLIT > 1 and STAGES >= 3, "LAG: a sliced row, 3 stages or more")
            _async_copy.wait_group(STAGES - 2)  # the first row has landed
            _barrier()
            if row_start < row_end:
                p1, p2 = _slice_sums(s_buf, dy_buf, y1_buf, 0, layout, wf, w1f, mean, rstd,
                                     ZERO_CENTERED_WEIGHT, IS_RMS_NORM, HAS_W1)  # fmt: skip
                _publish_sums(WS, WS_NEXT, row_start, p1, p2, part, SPLIT)
        for row in range(row_start, row_end):
            i = (row - row_start).to(gl.int32)
            rstd_next, mean_next = _row_ahead(
                S, DY, DRES_OUT, DY1, MEAN, RSTD, s_buf, dy_buf, r_buf, y1_buf, ts_buf, tdy_buf,
                tr_buf, ty1_buf, i, row, row_end, last, cols, tcols, N, stride_s_row, stride_dy_row,
                stride_dres_out_row, stride_dy1_row, STAGES, TAIL_N, STAGE_DRES,
                IS_RMS_NORM, HAS_W1,
            )  # fmt: skip
            if LAG:
                _async_copy.wait_group(STAGES - 2)  # the next row's copies have landed
                _barrier()
                if row + 1 < row_end:
                    p1, p2 = _slice_sums(s_buf, dy_buf, y1_buf, (i + 1) % STAGES, layout, wf,
                                         w1f, mean_next, rstd_next, ZERO_CENTERED_WEIGHT,
                                         IS_RMS_NORM, HAS_W1)  # fmt: skip
                    _publish_sums(WS, WS_NEXT, row + 1, p1, p2, part, SPLIT)
                c1, c2 = _wait_sums(WS, row, SPLIT, SPLIT_P2, NUM_WARPS)
                slot = i % STAGES
            else:
                _async_copy.wait_group(STAGES - 1)  # this row's copies have landed
                _barrier()
                slot = i % STAGES
                # Pass 1: the row sums c1 = sum(xhat * wdy) / N, c2 = sum(wdy) / N.
                c1, c2 = _slice_sums(s_buf, dy_buf, y1_buf, slot, layout, wf, w1f, mean, rstd,
                                     ZERO_CENTERED_WEIGHT, IS_RMS_NORM, HAS_W1)  # fmt: skip
                if TAIL_N > 0:
                    t1, t2 = _slice_sums(ts_buf, tdy_buf, ty1_buf, slot, tail_layout, twf, tw1f,
                                         mean, rstd, ZERO_CENTERED_WEIGHT, IS_RMS_NORM,
                                         HAS_W1)  # fmt: skip
                    c1 += t1
                    c2 += t2
                if SPLIT > 1:  # the slices' sums, exchanged
                    _publish_sums(WS, WS_NEXT, row, c1, c2, part, SPLIT)
                    c1, c2 = _wait_sums(WS, row, SPLIT, SPLIT_P2, NUM_WARPS)
            c1 = c1 / N
            c2 = c2 / N
            # Pass 2 reads the staged row again rather than holding pass 1's values across the
            # sums (the barrier keeps the two reads apart): registers, not bandwidth, limit a
            # program of 16384 columns.
            _barrier()
            dw_acc, db, dw1, db1 = _part_grads(
                s_buf, dy_buf, r_buf, y1_buf, slot, layout, wf, w1f, mean, rstd, c1, c2, DX,
                DRES, SEEDS, row, col0, dropout_p, cols, N, stride_dx_row, stride_dres_row,
                dw_acc, db, dw1, db1, dres, BLOCK_N, VEC, NUM_WARPS, IS_RMS_NORM, HAS_BIAS,
                HAS_DRESIDUAL_OUT, STORE_DRESIDUAL, HAS_DROPOUT, ZERO_CENTERED_WEIGHT, HAS_W1,
                HAS_B1, DRES_REGS,
            )  # fmt: skip
            if DRES_REGS:  # the next row's, in flight through the next row's pass 1 and wait
                dres = _row_regs(DRES_OUT, row + 1, row_end, cols, N, stride_dres_out_row)
            if TAIL_N > 0:
                tdw_acc, tdb, tdw1, tdb1 = _part_grads(
                    ts_buf, tdy_buf, tr_buf, ty1_buf, slot, tail_layout, twf, tw1f, mean, rstd,
                    c1, c2, DX, DRES, SEEDS, row, col0 + BLOCK_N, dropout_p, tcols, N,
                    stride_dx_row, stride_dres_row, tdw_acc, tdb, tdw1, tdb1, tdb, TAIL_N,
                    TAIL_VEC, NUM_WARPS, IS_RMS_NORM, HAS_BIAS, HAS_DRESIDUAL_OUT,
                    STORE_DRESIDUAL, HAS_DROPOUT, ZERO_CENTERED_WEIGHT, HAS_W1, HAS_B1, False,
                )  # fmt: skip
            _barrier()  # every thread is done with this slot before it is staged again
            rstd = rstd_next
            mean = mean_next
        _async_copy.wait_group(0)
        dst = PARTS + blk.to(gl.int64) * N
        slab = gl.cast(stride_part, gl.int64)
        _store_part_partials(dst, slab, cols, N, dw_acc, db, dw1, db1, HAS_BIAS, HAS_W1,
                             HAS_B1)  # fmt: skip
        if TAIL_N > 0:
            _store_part_partials(dst, slab, tcols, N, tdw_acc, tdb, tdw1, tdb1, HAS_BIAS, HAS_W1,
                                 HAS_B1)  # fmt: skip

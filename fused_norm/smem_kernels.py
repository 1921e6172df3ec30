"""The backward of one-block rows that keeps a program's partial weight gradient in shared
memory: a Gluon kernel (Triton's lower-level language, where a kernel allocates and addresses
shared memory itself; ``triton.experimental.gluon``).

Why: the Triton backward (kernels.py) holds its fp32 partial dW and dB in registers. A row of
16384 16-bit columns with both (LayerNorm with a bias) then needs 128 KB of registers for the
partials alone, half of an H100/H200 multiprocessor's register file, and the row's own values
the other half: such rows spilled when held in one program, and were split into column blocks
that exchange their row sums (bench/NOTES.md #44-#49, #63, #65), at 62-65% of copy. Here one
program per multiprocessor keeps partial dW in shared memory (64 KB at 16384 columns), partial
dB and the weight in registers, and stages its rows through shared memory with ``cp.async``
(STAGES rows in flight): per row, pass 1 reads the staged row for the row sums c1, c2, pass 2
reads it again for dx and adds the row's terms to the partials. Partials are written as the
Triton kernel writes them (one (programs, N) fp32 slab per gradient), for the same sum kernel.

Gluon is experimental and its names move between Triton releases (``thread_barrier`` became
``barrier``, ``async_copy_global_to_shared`` became ``async_load``); both spellings are
resolved here. There is no Gluon under the CPU interpreter: config.bwd_smem_partials only
chooses this kernel for CUDA devices, and the GPU tests check it against the reference.
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

    @gluon.jit
    def _stage_row(S, DY, s_buf, dy_buf, ts_buf, tdy_buf, slot, row, row_end, cols, tcols, N,
                   stride_s_row, stride_dy_row, TAIL_N: gl.constexpr):  # fmt: skip
        """Start copying ``row``'s s and dy (block, then tail) into buffer ``slot`` (zeros past
        N or past the program's last row), as one commit group."""
        r = row.to(gl.int64)
        live = row < row_end
        _async_load(s_buf.index(slot), S + r * stride_s_row + cols, mask=(cols < N) & live)
        _async_load(dy_buf.index(slot), DY + r * stride_dy_row + cols, mask=(cols < N) & live)
        if TAIL_N > 0:
            _async_load(ts_buf.index(slot), S + r * stride_s_row + tcols,
                        mask=(tcols < N) & live)  # fmt: skip
            _async_load(tdy_buf.index(slot), DY + r * stride_dy_row + tcols,
                        mask=(tcols < N) & live)  # fmt: skip
        _async_copy.commit_group()

    @gluon.jit
    def _part_terms(s_buf, dy_buf, slot, layout: gl.constexpr, wf, mean, rstd):
        """xhat, dy and wdy = w * dy of one part (block or tail) of the staged row, fp32.
        Columns past N read zeros: dy = 0 there, so every term they add is zero."""
        s = s_buf.index(slot).load(layout).to(gl.float32)
        dy = dy_buf.index(slot).load(layout).to(gl.float32)
        return (s - mean) * rstd, dy, wf * dy

    @gluon.jit
    def _part_grads(s_buf, dy_buf, slot, layout: gl.constexpr, wf, mean, rstd, c1, c2, DX, dx_row,
                    cols, N, dw_acc, db, IS_RMS_NORM: gl.constexpr, HAS_BIAS: gl.constexpr):  # fmt: skip
        """Store one part's dx and add its terms to the partials (dW in shared memory, private
        to each thread by the layout; dB in registers); returns dB."""
        xhat, dy, wdy = _part_terms(s_buf, dy_buf, slot, layout, wf, mean, rstd)
        if IS_RMS_NORM:
            dx = (wdy - xhat * c1) * rstd
        else:
            dx = (wdy - (xhat * c1 + c2)) * rstd
        gl.store(DX + dx_row + cols, dx.to(DX.dtype.element_ty), mask=cols < N)
        dw_acc.store(dw_acc.load(layout) + dy * xhat)
        if HAS_BIAS:
            db += dy
        return db

    @gluon.jit
    def _weight(W, cols, N, ZERO_CENTERED_WEIGHT: gl.constexpr):
        """One part's weight, fp32, zero past N."""
        w = gl.load(W + cols, mask=cols < N, other=0.0).to(gl.float32)
        if ZERO_CENTERED_WEIGHT:
            w = gl.where(cols < N, w + 1.0, 0.0)
        return w

    @gluon.jit
    def _part_setup(S, DY, W, col0, PART_N: gl.constexpr, layout: gl.constexpr, N,
                    STAGES: gl.constexpr, ZERO_CENTERED_WEIGHT: gl.constexpr):  # fmt: skip
        """One part's columns (``col0`` on), its staging buffers of s and dy, its zeroed
        partial dW in shared memory, its zeroed partial dB and its weight (fp32)."""
        shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        cols = col0 + gl.arange(0, PART_N, layout=layout)
        s_buf = gl.allocate_shared_memory(S.dtype.element_ty, [STAGES, PART_N], shared)
        dy_buf = gl.allocate_shared_memory(DY.dtype.element_ty, [STAGES, PART_N], shared)
        dw_acc = gl.allocate_shared_memory(
            gl.float32, [PART_N], shared, gl.zeros([PART_N], gl.float32, layout)
        )
        db = gl.zeros([PART_N], gl.float32, layout)
        return cols, s_buf, dy_buf, dw_acc, db, _weight(W, cols, N, ZERO_CENTERED_WEIGHT)

    @gluon.jit
    def _store_part_partials(part, slab, cols, N, dw_acc, db, layout: gl.constexpr,
                             HAS_BIAS: gl.constexpr):  # fmt: skip
        """One part's partial dW (from shared memory) and dB into the program's rows of
        their slabs (``part``: the program's row of the first; ``slab``: elements apart)."""
        gl.store(part + cols, dw_acc.load(layout), mask=cols < N)
        if HAS_BIAS:
            gl.store(part + slab + cols, db, mask=cols < N)

    @gluon.jit
    def _bwd_smem_kernel(
        S,       # (M, N) the normalised pre-norm sum (x itself: rows of a norm of x alone)
        W,       # (N,) weight (16-bit)
        MEAN,    # (M,) fp32 (if not IS_RMS_NORM)
        RSTD,    # (M,) fp32
        DY,      # (M, N) grad of y
        DX,      # (M, N) grad of x
        PARTS,   # fp32 partial dW, then dB (if HAS_BIAS): one (P, N) slab each, stride_part apart
        stride_s_row, stride_dy_row, stride_dx_row, stride_part,
        M, N,
        rows_per_program,
        BLOCK_N: gl.constexpr,       # columns of the first part (a power of two)
        TAIL_N: gl.constexpr,        # columns of a second part after BLOCK_N (0: none)
        IS_RMS_NORM: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        ZERO_CENTERED_WEIGHT: gl.constexpr,
        STAGES: gl.constexpr,        # rows staged in shared memory (>= 2)
        VEC: gl.constexpr,           # contiguous elements per thread in the first part
        TAIL_VEC: gl.constexpr,      # and in the tail (1 where there is none)
        NUM_WARPS: gl.constexpr,     # the launch's num_warps
    ):  # fmt: skip
        # One layout per part for every tensor of it: each thread copies, reads and accumulates
        # the same columns, so the partials in shared memory are private to a thread.
        layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NUM_WARPS], [0])
        tail_layout: gl.constexpr = gl.BlockedLayout([TAIL_VEC], [32], [NUM_WARPS], [0])
        pid = gl.program_id(0)
        row_start = pid.to(gl.int64) * rows_per_program
        row_end = gl.minimum(row_start + rows_per_program, M)
        cols, s_buf, dy_buf, dw_acc, db, wf = _part_setup(
            S, DY, W, 0, BLOCK_N, layout, N, STAGES, ZERO_CENTERED_WEIGHT
        )
        if TAIL_N > 0:
            tcols, ts_buf, tdy_buf, tdw_acc, tdb, twf = _part_setup(
                S, DY, W, BLOCK_N, TAIL_N, tail_layout, N, STAGES, ZERO_CENTERED_WEIGHT
            )
        else:  # placeholders, never read
            tcols, ts_buf, tdy_buf = cols, s_buf, dy_buf
        for k in gl.static_range(STAGES - 1):
            _stage_row(S, DY, s_buf, dy_buf, ts_buf, tdy_buf, k, row_start + k, row_end, cols,
                       tcols, N, stride_s_row, stride_dy_row, TAIL_N)  # fmt: skip
        last = gl.maximum(row_end - 1, row_start)
        rstd = gl.load(RSTD + row_start, mask=row_start < M, other=0.0)
        mean = 0.0
        if not IS_RMS_NORM:
            mean = gl.load(MEAN + row_start, mask=row_start < M, other=0.0)
        for row in range(row_start, row_end):
            i = (row - row_start).to(gl.int32)
            _stage_row(S, DY, s_buf, dy_buf, ts_buf, tdy_buf, (i + STAGES - 1) % STAGES,
                       row + STAGES - 1, row_end, cols, tcols, N, stride_s_row, stride_dy_row,
                       TAIL_N)  # fmt: skip
            # The next row's statistics, one row ahead (the last row reads its own again).
            nxt = gl.minimum(row + 1, last)
            rstd_next = gl.load(RSTD + nxt)
            mean_next = 0.0
            if not IS_RMS_NORM:
                mean_next = gl.load(MEAN + nxt)
            _async_copy.wait_group(STAGES - 1)  # this row's copies have landed
            _barrier()
            slot = i % STAGES
            # Pass 1: the row sums c1 = sum(xhat * wdy) / N, c2 = sum(wdy) / N.
            xhat, dy, wdy = _part_terms(s_buf, dy_buf, slot, layout, wf, mean, rstd)
            c1 = gl.sum(xhat * wdy, axis=0)
            c2 = 0.0
            if not IS_RMS_NORM:
                c2 = gl.sum(wdy, axis=0)
            if TAIL_N > 0:
                xhat, dy, wdy = _part_terms(ts_buf, tdy_buf, slot, tail_layout, twf, mean, rstd)
                c1 += gl.sum(xhat * wdy, axis=0)
                if not IS_RMS_NORM:
                    c2 += gl.sum(wdy, axis=0)
            c1 = c1 / N
            c2 = c2 / N
            # Pass 2 reads the staged row again rather than holding pass 1's values across
            # the sums (the barrier keeps the two reads apart): registers, not bandwidth,
            # limit a program of 16384 columns.
            _barrier()
            dx_row = row.to(gl.int64) * stride_dx_row
            db = _part_grads(s_buf, dy_buf, slot, layout, wf, mean, rstd, c1, c2, DX, dx_row,
                             cols, N, dw_acc, db, IS_RMS_NORM, HAS_BIAS)  # fmt: skip
            if TAIL_N > 0:
                tdb = _part_grads(ts_buf, tdy_buf, slot, tail_layout, twf, mean, rstd, c1, c2,
                                  DX, dx_row, tcols, N, tdw_acc, tdb, IS_RMS_NORM, HAS_BIAS)  # fmt: skip
            _barrier()  # every thread is done with this slot before it is staged again
            rstd = rstd_next
            mean = mean_next
        _async_copy.wait_group(0)
        part = PARTS + pid.to(gl.int64) * N
        slab = gl.cast(stride_part, gl.int64)
        _store_part_partials(part, slab, cols, N, dw_acc, db, layout, HAS_BIAS)
        if TAIL_N > 0:
            _store_part_partials(part, slab, tcols, N, tdw_acc, tdb, tail_layout, HAS_BIAS)

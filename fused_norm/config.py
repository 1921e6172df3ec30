"""Launch heuristics and the few device-specific choices, as small pure functions.

Everything that depends on the kind of device lives here: the block size and warp count for a
row width, the backward's program count, the multiprocessor count, and the device guard.
Thresholds name the measurement behind them (bench/NOTES.md has the runs).

ops keeps what it derives from these settings per configuration (its launch plans), so that a
repeated call does not ask again. Assigning any attribute of this module (a sweep's knob, a
test's monkeypatch) empties those caches (DERIVED_CACHES); a sweep that edits a setting in place
(a dict's entry) calls :func:`settings_changed`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types

import torch

# Caches of values derived from this module's settings, emptied when a setting changes.
DERIVED_CACHES: list = []


def settings_changed() -> None:
    """Empty the caches derived from these settings (done on any assignment to this module)."""
    for cache in DERIVED_CACHES:
        cache.clear()


class _Settings(types.ModuleType):
    """This module's type: assigning an attribute calls settings_changed."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        settings_changed()


sys.modules[__name__].__class__ = _Settings


def _triton_version() -> tuple:
    """(major, minor) of the Triton installed, (0, 0) where its version does not parse."""
    try:
        import triton

        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except (ImportError, ValueError):
        return (0, 0)


# The Triton installed, (major, minor): a few launch choices differ by the compiler that
# compiles the kernels (fwd_full_row, fwd_split_part_i32).
TRITON_VERSION = _triton_version()

# Widest row held whole in registers, in bytes of the widest row tensor read. Beyond it the
# kernels loop over chunks of MAX_BLOCK_BYTES. 64 KB is where register-resident rows stop paying
# on Hopper (flash-attn and Liger cap there too); see bench/NOTES.md.
MAX_BLOCK_BYTES = 65536

# The backward holds more per column (w, s, dy and one fp32 partial per parameter gradient), so
# its registers run out sooner. Sweeps of 2026-11-22 (H200, bf16): with one partial (RMSNorm, no
# bias) 16K columns in one block ran at 92% of copy, 32K at 24% (spills); with two (LayerNorm
# with bias) 16K in one block ran at 40%, as two 8K chunks at 50%. The caps count 16-bit
# columns whatever the dtype (bwd_block_config): registers hold every value as fp32.
BWD_MAX_BLOCK_BYTES = 32768
BWD_MAX_BLOCK_BYTES_MULTI = 16384  # two or more partial-gradient vectors

# Program count used where the device reports no multiprocessors (the CPU interpreter).
FALLBACK_SM_COUNT = 4

# Resident warps per SM that the backward's persistent grid aims for. Each program walks its rows
# one after another, so rows in flight = programs; 32 warps/SM was the best of {1, 2, 4}
# programs/SM x {4..32} warps at N = 1K..16K (bench/NOTES.md, sweep of 2026-11-22, H200).
BWD_WARPS_PER_SM = 32


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints (plain Python: triton.cdiv is slower to call from host code)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def block_config(n_cols: int, elem_bytes: int, max_bytes: int = 0) -> tuple[int, int]:
    """(BLOCK_N, NUM_CHUNKS) for a row of ``n_cols`` elements, ``elem_bytes`` the widest dtype.

    The block is the next power of two (at least 8: dropout draws random numbers for eight
    columns at a time), capped at MAX_BLOCK_BYTES; wider rows are processed in NUM_CHUNKS chunks.
    """
    max_block = max((max_bytes or MAX_BLOCK_BYTES) // elem_bytes, 8)
    block_n = max(min(next_power_of_2(n_cols), max_block), 8)
    return block_n, cdiv(n_cols, block_n)


# One-block rows whose width is not a power of two may be held as two power-of-two blocks,
# BLOCK_N then TAIL_N columns (5120 = 4096 + 1024, 12288 = 8192 + 4096), instead of one block
# padded to the next power of two, whose padding takes registers (fewer rows in flight) and,
# with dropout, random numbers; but every row sum then takes two reductions. Graph-replay
# sweeps of 2026-11-23 (H200, bf16, bench/NOTES.md #27), two blocks vs the padded block, each
# at its best warp count: forward at 2560 / 5120 / 12288 columns, dropout + add + LayerNorm
# 87 -> 99% / 83 -> 99% / 89 -> 94% of copy, LayerNorm 86 -> 88% / 81 -> 94% / 77 -> 90%,
# RMSNorm 100 -> 100% / 93 -> 99% / 92 -> 98%; narrower rows lost (768 columns: dropout + LN
# 76 -> 53%). Backward at 5120: dropout + add + LayerNorm 63 -> 84%, LayerNorm 61 -> 80%, the
# x1 path 59 -> 65%, RMSNorm 77 -> 81%; but at 3072 RMSNorm lost 91 -> 85% and at 12288 84 ->
# 77%. So: TAIL_BLOCKS = "measured" takes two blocks only where the padded block is one of
# FWD_TAIL_BLOCKS / BWD_TAIL_BLOCKS; True wherever two blocks are narrower (the CPU tests),
# False never (the sweep compares them).
TAIL_BLOCKS = "measured"
FWD_TAIL_BLOCKS = (4096, 8192, 16384)
BWD_TAIL_BLOCKS = (8192,)
BWD_TAIL_BLOCKS_LN = (16384,)  # two partials: bwd_block_config
BWD_TAIL_BLOCKS_ONE = (32768,)  # one partial, 16-bit rows, no dropout: bwd_block_config


def block_tail(n_cols: int, block_n: int, num_chunks: int, measured=()) -> tuple[int, int]:
    """(BLOCK_N, TAIL_N) of a row of ``n_cols`` columns in one padded block of ``block_n``:
    the largest power of two below ``n_cols`` and the next power of two of what remains, where
    the two together are narrower than ``block_n`` (and, under TAIL_BLOCKS = "measured",
    ``block_n`` is in ``measured``); else ``(block_n, 0)``. Both are at least 16 and 8 columns
    (dropout draws its random numbers for eight columns at a time)."""
    main = block_n // 2
    if not TAIL_BLOCKS or num_chunks != 1 or main < 16 or n_cols <= main:
        return block_n, 0
    if TAIL_BLOCKS == "measured" and block_n not in measured:
        return block_n, 0
    tail = max(next_power_of_2(n_cols - main), 8)
    return (main, tail) if main + tail < block_n else (block_n, 0)


def fwd_block_tail(n_cols: int, block_n: int, num_chunks: int) -> tuple[int, int]:
    """:func:`block_tail` of the forward."""
    return block_tail(n_cols, block_n, num_chunks, FWD_TAIL_BLOCKS)


def bwd_block_tail(
    n_cols: int,
    block_n: int,
    num_chunks: int,
    partials: int = 1,
    dropout: bool = False,
    plain: bool = False,
    elem_bytes: int = 2,
) -> tuple[int, int]:
    """:func:`block_tail` of the backward (``partials``: its parameter-gradient vectors;
    ``plain``: a norm of x alone; ``elem_bytes``: the widest row element). With dropout, four
    partials (the x1 path) or, in 16-bit rows, RMSNorm of x alone, only a tail of at most a
    quarter of the main block is measured to pay: at 6144 columns (4096 + 2048) dropout + add +
    LayerNorm fell from 75% to 57% of copy and the x1 path from 58% to 51% (bench/NOTES.md #27),
    bf16 RMSNorm was 77.8% against 88.3% padded (#53). add + RMSNorm (one partial, not plain,
    no dropout) of 16-bit rows takes the padded block under its register cap (bwd_maxnreg):
    bf16 5120 columns 72.4 -> 87.1%, fp16 72.5 -> 88.0%, 6144 79.5 -> 93.8% (fp32 rows keep
    two blocks, 90.3 vs 77%; #53). Two partials also at a padded 16384 (bwd_block_config's
    rows of 8K-12K columns, with dropout those of 8K-10K), one partial of 16-bit rows without
    dropout at a padded 32768 (its rows of 16K-20K columns; add + RMSNorm too)."""
    one_partial_16 = partials == 1 and not dropout and elem_bytes <= 2
    measured = (BWD_TAIL_BLOCKS + (BWD_TAIL_BLOCKS_LN if partials == 2 else ())
                + (BWD_TAIL_BLOCKS_ONE if one_partial_16 else ()))  # fmt: skip
    main, tail = block_tail(n_cols, block_n, num_chunks, measured)
    if not tail or TAIL_BLOCKS != "measured":
        return main, tail
    if one_partial_16 and not plain and block_n in BWD_TAIL_BLOCKS:
        return block_n, 0
    if (dropout or partials >= 4 or (one_partial_16 and plain)) and 4 * tail > main:
        return block_n, 0
    return main, tail


# A norm of x alone whose 16-bit row would be one block of the widths below runs as a chunked
# two-sweep row instead (the second sweep re-reads the row from L2, under eviction hints; the
# statistics summed per column lane; eviction hints: FWD_CHUNK_EVICT), as torch.compile's
# looped reductions do: (columns per chunk, warps, whether the two sweeps are unrolled so that
# every chunk's loads can be in flight before the first is used; Triton's loop_unroll_factor).
# Keys are padded widths (a row held as two blocks keeps them: fwd_block_tail) or, where the
# key is not a power of two, that width exactly, also over its two blocks. Small chunks keep
# few registers, so more rows are in flight. Graph-replay sweeps on an H200 (bf16 weights,
# bench/NOTES.md #39-#40), against the one block, two blocks or the held split parts:
# LayerNorm 16K 91.1 -> 95.3% of copy, 32K 87.3 -> 92.3% (32 warps, unrolled: the loop
# 87.7%); RMSNorm 4K 98.0-98.2 -> 101.5%, 8K 97.4-98.2 -> 101.6%, 12288 98.1-98.4 -> 101.2%,
# 16K 97.1 -> 100.9%, 32K 92.5 -> 99.8%; at 20K-24K (one padded 32K block before) RMSNorm
# 73-81 -> 101%, LayerNorm 62-70 -> 91-95%. LayerNorm at 4K and 8K keeps its block (96.7%
# vs 96.4%, 97.7% vs 95.9%), two blocks stay at 2560-10240 (lanes 3-10 points behind) and
# LayerNorm 12288 (97.8% either way). Unrolling lost at 16K (LayerNorm 95.3 -> 84.1% with 4K
# chunks on 16 warps) and elsewhere changed less than a point. At 64K the split parts stay
# ahead (RMSNorm 91% vs 83%, LayerNorm 85% vs 76%: a row in flight per program no longer
# fits L2 beside the others); rows with a stream, dropout or x1 lost in chunks at 16K-32K
# (dropout + add + LayerNorm 97 / 92% -> at best 92 / 79%, the x1 path 98 / 96% -> 99 / 74%).
FWD_LANE_CHUNKS = {
    ("rms", 4096): (2048, 8, False),
    ("ln", 16384): (4096, 16, False),
    ("ln", 32768): (8192, 32, True),
    ("rms", 8192): (4096, 16, False),
    ("rms", 12288): (4096, 16, False),
    ("rms", 16384): (8192, 16, False),
    ("rms", 32768): (8192, 32, False),
    # Rows beside 4-byte weights (fp32 parameters, as autocast passes them), keyed with those
    # bytes and looked up first. Bench-style A/B (H200, bf16 x, 2026-11-26, bench/NOTES.md
    # #100), three rounds each: LayerNorm 16K in 2K chunks 145.9-146.7 -> 142.7-143.1 us
    # (89.0-89.3 -> 91.2-91.3% of copy; torch.compile's looped reduction, 2K on 16 warps too,
    # 140.0-140.3 us); with bf16 weights 2K chunks lose (94.5 -> 90.8%).
    ("ln", 16384, 4): (2048, 16, False),
}


def fwd_lane_chunk(
    n_cols: int, elem_bytes: int, plain: str = "", weight_bytes: int = 2
) -> tuple[int, int, bool] | None:
    """(columns per chunk, warps, unrolled) where a forward row of a norm of x alone (``plain``:
    "ln" / "rms") in 16 bits runs as lane-summed chunks (FWD_LANE_CHUNKS), else None: the entry
    of its own width, or where it is one block (not two: fwd_block_tail), of its padded width;
    at each, the entry for weights of ``weight_bytes`` first."""
    if elem_bytes != 2 or not plain:
        return None
    block_n, num_chunks = block_config(n_cols, elem_bytes)
    if num_chunks != 1:
        return None
    widths = [n_cols]
    rows = fwd_rows_per_program(block_n, num_chunks, plain)
    if rows > 1 or not fwd_block_tail(n_cols, block_n, num_chunks)[1]:
        widths.append(block_n)
    for width in widths:
        for key in ((plain, width, weight_bytes), (plain, width)):
            if key in FWD_LANE_CHUNKS:
                return FWD_LANE_CHUNKS[key]
    return None


def fwd_chunk_unroll(lane: tuple[int, int, bool] | None, num_chunks: int) -> int:
    """Unroll factor of a chunked forward row's two sweeps: all its chunks where its lane-summed
    chunks (fwd_lane_chunk) say so, else 1 (a loop)."""
    return num_chunks if lane and lane[2] else 1


def fwd_block_layout(n_cols: int, elem_bytes: int, plain: str = "", weight_bytes: int = 2) -> tuple:
    """(BLOCK_N, NUM_CHUNKS, TAIL_N, rows per program, lane) of a forward row that is not split:
    the padded block and its chunks (block_config), the tail where that block is held as two
    (fwd_block_tail: its first block is then BLOCK_N // 2; a tile of several rows keeps one
    block) and the rows per program (fwd_rows_per_program), lane None; or the lane-summed
    chunks of a 16-bit norm of x alone, lane their (chunk, warps, unrolled) (fwd_lane_chunk,
    which also asks the weights' bytes)."""
    lane = fwd_lane_chunk(n_cols, elem_bytes, plain, weight_bytes)
    if lane:
        return lane[0], cdiv(n_cols, lane[0]), 0, 1, lane
    block_n, num_chunks = block_config(n_cols, elem_bytes)
    rows = fwd_rows_per_program(block_n, num_chunks, plain)
    tail = fwd_block_tail(n_cols, block_n, num_chunks)[1] if rows == 1 else 0
    return block_n, num_chunks, tail, rows, None


# L2 eviction policies of a chunked forward row's two sweeps (Triton's eviction_policy): the
# first sweep's loads kept for the second ("evict_last"), the second's let go ("evict_first"),
# as torch.compile's looped reductions do.
FWD_CHUNK_EVICT = ("evict_last", "evict_first")


# One-block forward rows that load their weights and biases ahead of the row's statistics,
# beside the row's own loads, instead of after them (kernels._load_params, constexpr
# EARLY_PARAMS): a norm of x alone (``plain``) by its width, which fills its block (no masked
# columns), with 16-bit rows and weights, one row a program. Bench-style A/B (H200,
# 2026-11-26, bench/NOTES.md #100), three rounds in each of two calls: LayerNorm 4096 bf16
# 135.9-137.0 -> 134.2-134.4 us (95.0 -> 96.2-96.9% of copy; 56 -> 80 registers on its 4
# warps), fp16 136.0 -> 132.1 us (94.9 -> 97.7%). Not taken where it did not gain (2048 +0.5
# points, RMSNorm and add + RMSNorm +0.4, the x1 path -0.4) or lost: LayerNorm 4000 (its
# 4096 block partly masked) -1.4 points, 1024 on 2 warps -0.7, 8192 -6 (on 8 warps, fewer
# programs a SM); beside fp32 weights, whose loads held ahead take twice the registers,
# LayerNorm 1024 94.2 -> 84.4% and 4096 96.0 -> 72.4%.
FWD_EARLY_PARAMS = {("ln", 4096)}


def fwd_early_params(plain: str, n_cols: int, fills: bool, tail: int, rows: int,
                     elem_bytes: int, weight_bytes: int) -> bool:  # fmt: skip
    """Whether a forward row of ``n_cols`` columns loads its weights and biases ahead
    (FWD_EARLY_PARAMS): one row a program in one block (no ``tail``) that it ``fills``
    (fwd_fills_block), rows of 16-bit elements (``elem_bytes``, the widest row tensor's) and
    weights."""
    if not fills or tail or rows > 1:
        return False
    return elem_bytes == weight_bytes == 2 and (plain, n_cols) in FWD_EARLY_PARAMS


# One-block forward rows (one row a program, or a tile of narrow rows) whose width fills
# their block(s) exactly take it as a constant (constexpr FULL_ROW), so that the compiler
# folds their column masks away: offline (triton 3.6, sm_90) LayerNorm 1024 / 4096 / 8192
# 376 / 608 / 624 -> 336 / 520 / 536 SASS instructions, dropout + add + LayerNorm 4096 720 ->
# 672, the registers of the plans unchanged (on 1 warp LayerNorm 1024 71 -> 64). Bench-style
# A/B (H200, bf16, 2026-11-26, bench/NOTES.md #101), three rounds: dropout + add + LayerNorm
# 1024 268.3 -> 258.9 us (96.4 -> 99.9% of copy), LayerNorm 1024 / 4096 133.7 / 133.6 ->
# 132.8 / 132.4 us (+0.7 / +0.8 points); even or within a round's spread elsewhere (LayerNorm
# 2048 and with fp32 weights 1024, RMSNorm 1024, add + RMSNorm 4096, the x1 path 1024;
# dropout + add + LayerNorm 4096 -0.5 and LayerNorm 8192 -0.4 points).
FWD_FULL_ROWS = True


def fwd_fills_block(
    n_cols: int, kernel_block: int, tail: int, num_chunks: int, split: int
) -> bool:  # fmt: skip
    """Whether a forward row of ``n_cols`` columns, not split or chunked, fills its one block
    (``kernel_block``, and ``tail`` where held as two) exactly: no masked column. Such rows
    take their width as a constant (fwd_full_row), and FWD_EARLY_PARAMS' rows are such."""
    return split == 1 and num_chunks == 1 and n_cols == kernel_block + tail


# Chunked forward rows (NUM_CHUNKS > 1) whose width is a whole number of their chunks take it
# as a constant too (FULL_ROW; kernels._col_mask folds the chunks' masks): offline (triton
# 3.6, sm_90) LayerNorm 16384 / 32768 bf16 920 -> 784 SASS instructions, no predicated loads
# left, the same registers. Bench-style A/B (H200, 2026-11-26, bench/NOTES.md #102), four
# rounds: LayerNorm bf16 16384 137.8 -> 133.9 us (94.3 -> 97.0% of copy), 32768 142.6 ->
# 135.9 us (91.1 -> 95.6%), fp16 32768 139.1 -> 134.1 us (93.4 -> 96.9%), with fp32 weights
# 16384 142.2 -> 141.0 us; RMSNorm 8192-32768 even to +0.4 points. Split rows keep their
# masks but FWD_FULL_SPLIT_ROWS': folded with N a constant too, they measured -0.7 to -6.7
# points on 16-bit LayerNorm, RMSNorm and the x1 path (LayerNorm 256K bf16 81.9 -> 76.9%, 62
# -> 78 registers offline) and fp32 LayerNorm 32K (-1.9), +0.2 to +2.3 on add + RMSNorm 256K
# (bf16, fp32), dropout + add + LayerNorm 64K (fp32 stream) and LayerNorm 64K with fp32
# weights.
FWD_FULL_CHUNKED_ROWS = True


# One-block rows that fill their block(s) but keep their masks: where the masks measured
# 1 point of copy or more faster than FULL_ROW. Bench-style A/B of every one-block row that
# fills its block in the five benchmark workloads and kinds (H200, 2026-11-26, bench/NOTES.md
# #103, three rounds, 195 rows): most within +-0.5 points, the largest gains LayerNorm 12288
# bf16 +8.2 and dropout + add + LayerNorm 16384 with an fp32 stream +4.1; these lost. Keyed
# (row kind, columns, bytes of the widest row element, of the widest weight): "ln" / "rms" (a
# norm of x alone), "x1" (the x1 path), "dropout" (with a residual, no x1), "add" (a residual
# alone); percent of copy with the masks -> without.
FWD_MASKED_FULL_ROWS = frozenset({
    ("dropout", 12288, 2, 2),  # dropout + add + LayerNorm bf16 97.8 -> 90.5
    ("ln", 8192, 2, 4),  # LayerNorm bf16 beside fp32 weights 90.2 -> 86.2
    ("dropout", 12288, 4, 4),  # fp32 98.3 -> 96.5
    ("dropout", 8192, 2, 2),  # bf16 99.5 -> 97.9
    ("add", 16384, 4, 4),  # add + RMSNorm fp32 99.6 -> 98.2
    ("x1", 2048, 4, 2),  # the x1 path, bf16 with an fp32 stream 100.6 -> 99.4
    ("x1", 12288, 4, 2),  # the same 96.9 -> 95.8
    ("add", 8192, 4, 4),  # add + RMSNorm fp32 99.1 -> 98.0
    ("dropout", 4096, 4, 4),  # fp32 99.3 -> 98.2
    ("dropout", 5120, 2, 2),  # fp16 99.9 -> 98.9 (bf16 -0.2)
    ("x1", 4096, 4, 4),  # fp32 99.3 -> 98.3
})  # fmt: skip


# Split rows of whole parts that fold their parts' masks (FULL_ROW: the mask and the parts'
# counts constant, N a runtime value; kernels._fwd_split_row), where that measured 1 point of
# copy or more faster. Elsewhere split rows keep their masks: folded, they lost up to 6.7
# points (bench/NOTES.md #102). Bench-style A/B (H200, 2026-11-26, bench/NOTES.md #105),
# five rounds, percent of copy masked -> folded (a second call: 74.6 -> 77.0, 93.2 -> 94.0,
# 95.0 -> 96.8, 90.5 -> 92.4); keyed (row kind as in FWD_MASKED_FULL_ROWS, columns, x's
# dtype, bytes of the widest row element, of the widest weight). x's dtype parts bf16 from
# fp16 rows, which differ here; a row kind takes LayerNorm and RMSNorm alike (add +
# LayerNorm and dropout + add + RMSNorm at 256K were not measured).
FWD_FULL_SPLIT_ROWS = frozenset({
    ("ln", 262144, torch.float16, 2, 2),  # LayerNorm fp16 74.7 -> 77.1 (bf16: 82.0 -> 76.8)
    ("add", 262144, torch.float32, 4, 4),  # add + RMSNorm fp32 94.9 -> 97.0
    ("dropout", 262144, torch.bfloat16, 4, 2),  # bf16 x, an fp32 stream 91.0 -> 92.8
    ("add", 262144, torch.bfloat16, 2, 2),  # add + RMSNorm bf16 93.7 -> 94.7
})  # fmt: skip


# On Triton 3.9 and later every split row of whole parts folds its masks (FULL_ROW), but
# those in FWD_FULL_SPLIT_SKIP_39. In Triton 3.9's SASS of a masked part each 16-byte load
# of x has a predicate of its own, and the last loads issue only after the arithmetic on the
# first (LayerNorm bf16 at 256K: 6 of the 8 at once, the other 2 some 190 instructions later;
# 3.6's SASS issues all 8 before that arithmetic, sharing predicates; offline, sm_90). Folded,
# 3.9 issues all 8 together (at 78 registers instead of 62). Bench-style A/B of cubins
# compiled offline by Triton 3.9 and launched on an H200 (2026-11-26, bench/NOTES.md #111,
# three rounds), masked -> folded, with #110's 32-bit index: LayerNorm bf16 64K / 128K / 256K 152.8 / 161.1 / 166.0 -> 141.8 /
# 154.6 / 162.7 us (the device's 3.6: 143.5 / 148.6 / 155.3), fp16 64K 151.0 -> 144.2, fp32
# 64K / 128K / 256K 294.4 / 301.1 / 329.7 -> 276.6 / 281.1 / 306.5, beside fp32 weights 64K /
# 128K / 256K 177.4 / 189.3 / 198.6 -> 163.8 / 177.8 / 184.7; RMSNorm bf16 128K 149.8 -> 139.8,
# fp16 64K / 128K / 256K 157.1 / 161.4 / 160.2 -> 151.0 / 144.5 / 153.9, fp32 256K 301.6 ->
# 292.4; dropout + add + LayerNorm bf16 128K / 256K 288.5 / 295.8 -> 283.5 / 290.3, fp32 64K /
# 256K 544.9 / 596.0 -> 531.0 / 572.5; the x1 path fp16 256K 431.2 -> 407.0; the rest within
# 0.5%. Slower folded, so kept masked (keys as FWD_FULL_SPLIT_ROWS'): dropout + add +
# LayerNorm bf16 beside fp32 weights 64K / 256K 283.2 / 307.6 -> 287.1 / 312.1 (2 bytes
# spilled), fp32 32K 525.7 -> 530.2, RMSNorm bf16 64K 141.1-142.0 -> 142.0-143.3 (two calls),
# the x1 path bf16 256K 418.2-418.8 -> 418.5-421.6.
FWD_FULL_SPLIT_FROM = (3, 9)
FWD_FULL_SPLIT_SKIP_39 = frozenset({
    ("dropout", 65536, torch.bfloat16, 2, 4),
    ("dropout", 262144, torch.bfloat16, 2, 4),
    ("dropout", 32768, torch.float32, 4, 4),
    ("rms", 65536, torch.bfloat16, 2, 2),
    ("x1", 262144, torch.bfloat16, 2, 2),
})  # fmt: skip


def fwd_full_row(row: tuple, kernel_block: int, num_chunks: int, split: int,
                 fills: bool) -> bool:  # fmt: skip
    """Whether a forward row takes its width as a constant (constexpr FULL_ROW). ``row`` is
    the key the forward's row rules share (ops._fwd_plan): (row kind, columns, x's dtype,
    bytes of the widest row element, of the widest weight). A row that ``fills`` its one
    block (fwd_fills_block) unless FWD_MASKED_FULL_ROWS holds it (the key without x's dtype),
    a chunked row of ``num_chunks`` whole chunks (FWD_FULL_CHUNKED_ROWS; chunked rows have no
    tail: block_tail), or a row of ``split`` whole parts that FWD_FULL_SPLIT_ROWS holds, or,
    compiled by Triton FWD_FULL_SPLIT_FROM or later (TRITON_VERSION), that
    FWD_FULL_SPLIT_SKIP_39 does not hold. FWD_FULL_ROWS switches all off."""
    if not FWD_FULL_ROWS:
        return False
    row_kind, n_cols, _, elem_bytes, weight_bytes = row
    if split > 1:
        if n_cols != split * kernel_block:
            return False
        if TRITON_VERSION >= FWD_FULL_SPLIT_FROM:
            return row in FWD_FULL_SPLIT_ROWS or row not in FWD_FULL_SPLIT_SKIP_39
        return row in FWD_FULL_SPLIT_ROWS
    if num_chunks == 1:
        return fills and (row_kind, n_cols, elem_bytes, weight_bytes) not in FWD_MASKED_FULL_ROWS
    return FWD_FULL_CHUNKED_ROWS and n_cols == num_chunks * kernel_block


def fwd_num_warps(
    block_n: int, num_chunks: int = 1, plain: str = "", tail: int = 0, lane=None
) -> int:
    """Warps per forward program (one row each). ``plain`` is "ln" or "rms" for a norm of x
    alone (no residual, x1 or dropout), which moves half the bytes per row and wants fewer;
    ``lane``, its lane-summed chunks (fwd_lane_chunk), carries its own.

    Sweeps of 2026-11-22 (H200, bf16; add+RMSNorm and dropout+add+LayerNorm prenorm): 1 warp at
    N=256 (4 warps: -7 points), 4 at 1K (16 warps: 63% of copy vs 99.8%), 8 at 4K-8K (dropout+LN
    at 8K: 93% vs 80% with 16), 16 at 16K-32K (dropout+LN at 16K: 74% vs 58% with 8, 70% with
    32). Chunked rows (64K, 256K): 32 (dropout+LN 64% / 62% vs 57% / 51% with 16; with 8 warps
    add+RMS gained 2 points at 64K but LayerNorm, RMSNorm and the x1 path lost 5-9). Plain
    norms: 2 warps at 1K (LayerNorm 93% vs 80% with 4, RMSNorm 100% vs 97%), LayerNorm 4 at 4K
    (97% vs 85% with 8; RMSNorm keeps 8: 99.7% vs 97%), 16 at 16K for both.

    Two blocks (``tail`` > 0: block_tail), by the padded width (bench/NOTES.md #27): 4 warps
    at 4096-8192 (dropout + add + LayerNorm at 5120: 99% vs 90% with 8; 2560: 99% vs 78%), 16
    at 16384 (12288: 94% vs 65% with 8; RMSNorm 98% vs 92%), plain LayerNorm 8 there (90% vs
    74% with 16).
    """
    if lane:  # lane-summed chunks of a norm of x alone (fwd_lane_chunk): their own warps
        return lane[1]
    if num_chunks > 1:
        return 32
    if tail:  # two blocks (block_tail), by the padded width: the sweeps of TAIL_BLOCKS
        return 8 if plain == "ln" and block_n == 16384 else {16384: 16}.get(block_n, 4)
    if fwd_rows_per_program(block_n, num_chunks, plain) > 1:  # 1 warp a row (NOTES #14, #26)
        return 1
    warps = (
        max(block_n // 256, 1) if block_n <= 1024 else {2048: 4, 4096: 8, 8192: 8}.get(block_n, 16)
    )
    if (plain == "ln" and 1024 <= block_n <= 4096) or (plain == "rms" and block_n == 1024):
        warps //= 2
    return warps


# Register caps (Triton's ``maxnreg``, ptxas's .maxnreg): how many programs an SM holds is set by
# registers per thread, and a forward with dropout lands just above a step. Sweeps of 2026-11-22
# (H200, bf16, graph replay; bench/NOTES.md #24), dropout + add + LayerNorm forward capped at 64:
# 16K columns (16 warps, 92 registers -> 64, no spills) 74 -> 94% of copy, as one program per
# SM becomes two; split parts at 64K / 256K (4 warps, 80 -> 64) 79 -> 85% / 73 -> 79%. In the
# benchmark that followed: 16K 79 -> 96%, 64K 86 -> 87% (fp16 86 -> 88%); but 4K-8K rows (8
# warps: +1 point in the sweep) lost 3 points in fp16, and the split parts with an fp32 stream
# 2.5, so those keep the compiler's choice, as do the x1 path (the cap spills: x + x1 +
# residual at 8K 97 -> 76%) and 32K-column blocks (they spill at any cap).
FWD_DROPOUT_MAXNREG = 64
# The backward of dropout + LayerNorm at 1K columns (4 warps) capped at 128: one more program
# per SM, 77 -> 84% of copy in the sweep, fwd+bwd 80 -> 90% in the benchmark. A cap at or above
# what the compiler needs is not neutral: ptxas then spends the budget (plain LayerNorm at 1K
# lost 21 points under caps of 96-128, the x1 path with bf16 weights 3), so it stays where
# measured.
BWD_DROPOUT_MAXNREG = 128
# add + RMSNorm's backward in one padded 8192-column block of 16-bit rows (4097-8192 columns,
# bwd_layout), on 16 warps: 105 registers held one program per SM, capped at 64 two fit, with
# no spills (offline, triton 3.6, sm_90; fp32 rows spill 64 bytes, an fp32 stream 112). Graph
# replay, H200, 2026-11-24 (bench/NOTES.md #53), two runs each: bf16 8192 columns 79.6 ->
# 97.1-98.2% of copy, fp16 80.0 -> 98.4%, 7168 75.9 -> 96.5%; fp32 rows lost (94.1 -> 81.9%).
BWD_WIDE_ONE_PARTIAL_MAXNREG = 64


def _nvidia(device: torch.device) -> bool:
    """A CUDA GPU (not ROCm): ptxas's register caps exist only there (other Triton backends
    refuse the ``maxnreg`` option)."""
    return device.type == "cuda" and torch.version.hip is None


def fwd_maxnreg(block_n: int, num_chunks: int, split: int, dropout: bool, x1: bool,
                elem_bytes: int, device: torch.device):  # fmt: skip
    """Register cap of the forward (None: the compiler's choice): FWD_DROPOUT_MAXNREG for
    16-bit rows with dropout and no x1, split or in one block of 8K-16K columns."""
    if not dropout or x1 or elem_bytes != 2 or not _nvidia(device):
        return None
    if split > 1 or (num_chunks == 1 and 8192 < block_n <= 16384):
        return FWD_DROPOUT_MAXNREG
    return None


# One-block forward rows of 16K columns whose widest element is 4 bytes (fp32 rows, or 16-bit x
# with an fp32 residual stream), with dropout or the x1 path: (warps, register cap) by (bytes of
# x, dropout, x1), in place of fwd_num_warps' 16 warps and fwd_maxnreg's choice. Graph replay,
# H200, 2026-11-24 (bench/NOTES.md #57), two runs each: bf16 x with an fp32 stream and dropout
# under the 16-bit rows' cap of 64 (16 warps, 74 -> 64 registers, 2 bytes spilled) 86.0-87.6 ->
# 95.3-96.0% of copy (32 warps 92.7-93.0%); fp32 rows with dropout on 32 warps capped at 80
# 87.2-87.9 -> 95.3-96.1% (16 warps at 80: 92.2-92.6%, at 64 they spill: 81.5-82.0%); bf16 x
# with an fp32 stream and x1 on 32 warps capped at 64 90.8-91.2 -> 95.3-96.2% (uncapped 92.9-93.8%,
# 16 warps at 96: 93.6-95.0%, at 64: 75%).
FWD_WIDE_ELEM_BLOCK = {
    (2, True, False): (16, 64),
    (4, True, False): (32, 80),
    (2, False, True): (32, 64),
}

# The x1 path's one-block forward rows of 16-bit elements whose weights are 4 bytes (fp32
# parameters beside bf16 activations: four weight vectors read again for every row), by
# (padded block, held as two blocks): (warps, register cap). Graph replay (H200, bf16 x, fp32
# weights, 2026-11-24, bench/NOTES.md #59), two runs: 8192 columns 8 -> 16 warps 89.0-89.2 ->
# 97.0-97.1% of copy, 6144 (8192 with a 2048 tail) 4 -> 16 warps 96.6-96.9 -> 99.1-99.8%,
# 16384 16 -> 32 warps 83.7-83.9 -> 85.7%; 12288 keeps 16 (32: 75%), 4096 its 8 (16: +0.5).
# 16384 on 32 warps then capped at 96 (50 -> 64 registers, no spills; #62, two runs): bf16 x
# 85.7-86.1 -> 86.8-87.1%, fp16 x 84.7-85.1 -> 86.8-87.5%, 14336 (the same padded block)
# 84.7-85.0 -> 85.9-86.1%; caps of 80 and 112 compile to the same 64 registers; at 12288 (16
# warps) any cap of 80-112 loses (95.6 -> 73%).
FWD_X1_W4_BLOCK = {(8192, False): (16, None), (8192, True): (16, None), (16384, False): (32, 96)}

# LayerNorm of x alone in one block (no tail) of 16-bit columns with 4-byte weights, by the
# padded block: (warps, register cap). Bench-style A/B (H200, bf16 x, fp32 weights, 2026-11-26,
# bench/NOTES.md #100), three rounds in each of five calls: 1024 columns on 1 warp instead of 2
# 137.6-138.3 -> 135.1-135.8 us (93.3-94.7 -> 95.4-96.4% of copy; torch.compile's persistent
# reduction runs one warp a row too); with bf16 weights even (96.5-96.9 -> 96.5-97.0%).
FWD_LN_W4_BLOCK = {1024: (1, None)}


def fwd_block_choice(block_n: int, num_chunks: int, tail: int, elem_bytes: int, x_bytes: int,
                     weight_bytes: int, dropout: bool, x1: bool,
                     device: torch.device, plain: str = ""):  # fmt: skip
    """(warps, register cap or None) of one-block forward rows that have choices of their own,
    in place of fwd_num_warps and fwd_maxnreg; None elsewhere. A 16K-column row (``block_n``,
    no ``tail``) whose widest element is 4 bytes, with ``dropout`` or ``x1``: from
    FWD_WIDE_ELEM_BLOCK by ``x_bytes``, the bytes of x (on NVIDIA GPUs only). The x1 path's
    16-bit rows with 4-byte weights (``weight_bytes``): FWD_X1_W4_BLOCK by the padded block
    (its register cap on NVIDIA GPUs only, which take caps); a LayerNorm of x alone
    (``plain``) of such rows: FWD_LN_W4_BLOCK, one block without a tail."""
    if num_chunks != 1:
        return None
    if elem_bytes == 4:
        if block_n != 16384 or tail or not _nvidia(device):
            return None
        return FWD_WIDE_ELEM_BLOCK.get((x_bytes, dropout, x1))
    if elem_bytes != 2 or weight_bytes != 4:
        return None
    if plain == "ln" and not tail:
        return FWD_LN_W4_BLOCK.get(block_n)
    if not x1:
        return None
    own = FWD_X1_W4_BLOCK.get((block_n, tail > 0))
    if own is None:
        return None
    return own if _nvidia(device) else (own[0], None)


# A forward row whose fp32 sum s equals a 16-bit tensor (bf16 or fp16: x itself, for a norm of
# x alone; or the residual stream, as stored) may be held in registers as that tensor instead
# of s, from the statistics to the normalisation (kernels._widen): half the registers.
# Graph-replay sweeps of 2026-11-24 (H200, bench/NOTES.md #37), held against fp32: norms of x
# alone in split parts, bf16 RMSNorm 64K / 128K / 256K columns 81 -> 89% / 77 -> 85% / 74 ->
# 83% of copy (98 -> 55 registers, 9 -> 18 parts per SM), LayerNorm 67 -> 73% / 63 -> 69% /
# 62 -> 68% (on 2 warps: fwd_split_warps); fp16 RMSNorm 64K / 256K 85 -> 89% / 80 -> 86%,
# LayerNorm 75 -> 78% / 68 -> 68% (on 4 warps). In one block it did not pay: LayerNorm 16K
# 91 -> 87% with bf16 weights (84 -> 87% with fp32 ones), 12288 91 -> 84%, RMSNorm 8K-32K -1
# to -3; holding the stream lost with dropout (-2 to -5 points at 4K-256K, under its register
# cap) and with x1 at 32K+ (-4), and was even for add + RMSNorm. So FWD_HOLD = "measured"
# holds x in split parts, and the x1 path's fp16 stream in more than 32 parts (fwd_hold);
# True holds the stream there too (the sweep compares them; the one-block variant measured
# above was taken out of the kernel); False holds nothing.
FWD_HOLD = "measured"


def fwd_hold_kind(x_dtype: torch.dtype, stream_dtype, s_is_x: bool) -> str:
    """What the forward could hold in registers as 16 bits instead of the fp32 sum s: "bf16" or
    "fp16" (the sum is x itself, of that dtype: ``s_is_x``, no residual, x1, dropout, rowscale
    or layerscale, and no stream stored), "stream" / "fp16 stream" (``stream_dtype``, the
    dtype of the stored stream, is bf16 / fp16), or "" (nothing)."""
    if stream_dtype is not None:
        return {torch.bfloat16: "stream", torch.float16: "fp16 stream"}.get(stream_dtype, "")
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(x_dtype, "") if s_is_x else ""


# The x1 path's fp16 stream is held in rows of more than this many parts. Graph replay,
# 2026-11-24 (H200, fp16 weights, bench/NOTES.md #55), held against fp32, three runs: 256K
# columns (64 parts) 84.1-85.0 -> 86.6-88.9% of copy (95 -> 76 registers, 5 -> 6 parts per
# SM); 128K 92.5 -> 92.0%, 64K 93.9-94.4 -> 92.0-93.4%; bf16 loses at 128K-256K (93.2 ->
# 92.0%, 92.3 -> 89.9%).
FWD_HOLD_X1_FP16_PARTS = 32

# Split rows of at most this many parts (64K 16-bit columns) take other warps (fwd_split_warps;
# bench/NOTES.md #25, #55, #64).
FWD_SPLIT_FEW_PARTS = 16


def fwd_hold(kind: str, split: int, x1: bool = False) -> bool:
    """Whether the forward holds a split row's parts in 16 bits (FWD_HOLD): ``kind`` from
    fwd_hold_kind, ``split`` the parts of the row (1: not split, never held), ``x1`` whether
    the row has the x1 path."""
    if not kind or not FWD_HOLD or split == 1:
        return False
    if FWD_HOLD is True or kind in ("bf16", "fp16"):
        return True
    return kind == "fp16 stream" and x1 and split > FWD_HOLD_X1_FP16_PARTS


def fwd_hold_route(kind: str, is_rms_norm: bool) -> int:
    """How a held split part widens its 16 bits again (the kernel's HOLD): 1 by
    ``kernels._widen``'s bit route, 2 by ``kernels._convert_copy`` (one conversion of a copy the
    compiler cannot merge with the statistics'), for fp16 LayerNorm rows: x alone, or the x1
    path's stream (fwd_hold). Their parts' registers peaked in the exact M2 (taken where the
    joint form cancels, kernels._cancels), which widened every held column through the bit route
    at once: offline (triton 3.6, sm_90), LayerNorm 64K columns on 2 warps 112 -> 80 registers;
    at 128K-256K 80 against the 64-67 of the part that read s again from memory there instead, a
    read that cost more time than the registers. Graph replay (H200, fp16 weights, two calls,
    bench/NOTES.md #64), bit route or read -> conversion: 64K (4 warps) 75.4-78.0 -> 82.8-85.7%
    of copy, 128K (2 warps) 75.4-78.0 -> 77.0-78.8%, 256K 69.2-71.1 -> 75.3-76.9%; the x1 path
    at 256K (4 warps) 87.2 -> 87.8-89.1%. RMSNorm has no exact M2 to take, and its conversion
    after the wait took more registers than the bit route (256K: 55 -> 68), so it keeps the bit
    route; bf16's route is a shift."""
    return 2 if kind in ("fp16", "fp16 stream") and not is_rms_norm else 1


def fwd_joint_stats(block_n: int, tail: int, elem_bytes: int, dropout: bool, x1: bool) -> bool:
    """Whether a one-block LayerNorm row takes its mean and M2 from one joint sum of (s, s^2)
    (kernels._sums) rather than the mean and then the squares about it. Everywhere but one
    whole block of 16K 16-bit columns without dropout or x1: there the joint sum needs 82
    registers (two 16-warp programs per SM need <= 64) and, capped at 64, measured 85.7% of
    copy against the two-pass 90.0% in the benchmark (bench/NOTES.md #32). Split parts
    (kernels._fwd_split_row) always take it."""
    return not (block_n == 16384 and tail == 0 and elem_bytes == 2 and not dropout and not x1)


# RMSNorm's backward (one partial, no dropout) in one padded 8192-column block on 8 warps
# (4097-8192 columns) of fp16 rows: triton 3.6 compiles it to 193 registers, one program per
# SM, where bf16 rows take 128 (two). Triton 3.9's compile of it takes 128 and ran 263.1 ->
# 233.0 us at 8192 columns (bench/NOTES.md #112). Capped at 128 (offline, triton 3.6, sm_90:
# no spills), bench-style A/B (H200, 2026-11-26, four rounds), uncapped -> capped: backward
# 8192 / 6144 columns 262.1 / 298.8 -> 210.8 / 219.0 us (73.7 -> 91.8% of copy at 8192),
# forward + backward 389.8 / 431.3 -> 338.3 / 350.8; bf16 rows untouched (210.5 / 210.5).
# Since #113 the padded rows (6144 among them), and 8192 on Triton 3.9, take 16 warps
# (BWD_PLAIN_8K_WARPS), so this cap holds for 8192 columns on earlier Tritons.
BWD_FP16_ONE_PARTIAL_MAXNREG = 128


# LayerNorm's backward of x alone (two partials, no dropout) in one 2048-column block
# (1025-2048 columns) on 4 warps, of 16-bit rows with 16-bit weights, compiled by Triton
# BWD_LN_2K_CAP_FROM or later (TRITON_VERSION): capped at 96 registers, five programs per SM
# instead of four (3.9 compiles it to 113-115 registers, 3.6 to 96; capped, 3.9 spills 4).
# Bench-style A/B of triton 3.9's cubins (H200, 2026-11-26, bench/NOTES.md #115), backward
# uncapped -> capped: bf16 2048 240.1 / 240.3 -> 231.6 / 232.4 us (two calls; 3.6: 225.3-225.7),
# 1536 270.8 -> 260.9, fp16 2048 237.0 -> 231.1; with fp32 weights it spills 40 bytes and lost
# (238.4 -> 288.4); at 1024 (2 warps) even (bf16 230.2 -> 227.4, fp16 227.9 -> 229.6).
BWD_LN_2K_MAXNREG = 96
BWD_LN_2K_CAP_FROM = (3, 9)


def bwd_maxnreg(block_n: int, num_chunks: int, dropout: bool, partials: int,
                device: torch.device, tail: int = 0, warps: int = 0,
                elem_bytes: int = 2, fp16: bool = False, plain_ln: bool = False,
                w4: bool = False):  # fmt: skip
    """Register cap of the backward (None: the compiler's choice): BWD_DROPOUT_MAXNREG for
    one-block rows of 1K columns with dropout and two parameter gradients (LayerNorm);
    BWD_WIDE_ONE_PARTIAL_MAXNREG for one padded 8192-column block on 16 warps with one
    partial and no dropout whose row tensors (``elem_bytes``, the widest) are 16-bit: add +
    RMSNorm, whose 105 registers held one program per SM (bwd_layout gives it that block),
    and RMSNorm of x alone where it takes 16 warps (BWD_PLAIN_8K_WARPS); and
    BWD_FP16_ONE_PARTIAL_MAXNREG for that block on 8 warps (RMSNorm of x alone) where the
    rows are ``fp16``; on Triton BWD_LN_2K_CAP_FROM or later, BWD_LN_2K_MAXNREG for LayerNorm
    of x alone (``plain_ln``) in one 2048-column block on 4 warps of 16-bit rows with 16-bit
    weights (not ``w4``)."""
    if not (num_chunks == 1 and _nvidia(device)):
        return None
    if block_n == 1024 and dropout and partials == 2:
        return BWD_DROPOUT_MAXNREG
    if block_n == 8192 and not tail and partials == 1 and not dropout and elem_bytes <= 2:
        if warps == 16:
            return BWD_WIDE_ONE_PARTIAL_MAXNREG
        if warps == 8 and fp16:
            return BWD_FP16_ONE_PARTIAL_MAXNREG
    if (
        block_n == 2048
        and not tail
        and partials == 2
        and plain_ln
        and warps == 4
        and elem_bytes <= 2
        and not w4
        and TRITON_VERSION >= BWD_LN_2K_CAP_FROM
    ):
        return BWD_LN_2K_MAXNREG
    return None


# Forward rows wider than FWD_SPLIT_MIN_BYTES (bytes of the widest row tensor; with dropout or
# the x1 path, rows of that width too: fwd_split) are split across programs of
# FWD_SPLIT_BLOCK_BYTES each, which exchange their partial statistics through global memory
# (kernels.py, _fwd_split_row) instead of one program sweeping the row twice. At most one part
# per SM, so that a row's parts can be resident together. Under the interpreter a part waits at
# most FWD_SPLIT_MAX_POLLS reads of its partners' statistics before computing them itself,
# FWD_SPLIT_SUB_N columns at a time (kernels._fwd_split_row says why GPU builds wait without a
# bound). Sizes: the sweep in bench/NOTES.md #21.
FWD_SPLIT_MIN_BYTES = 65536
# A LayerNorm of x alone in 16 bits with 4-byte weight and bias splits rows wider than this
# (fwd_split's ``ln_w4``).
FWD_SPLIT_LN_W4_MIN_BYTES = 32768
# The launch choices of 16-bit rows with 4-byte weights (fwd_split's ``ln_w4``,
# fwd_split_warps, fwd_block_choice's FWD_X1_W4_BLOCK, bwd_launch_layout's ``heavy_w4``;
# bench/NOTES.md #59, #62).
# ``FUSED_NORM_W4_RULES=0`` turns them off (for A/B sweeps): ops then hands every rule 4-byte
# weights as 16-bit ones (ops._param_bytes), so the rules themselves do not ask.
W4_RULES = os.environ.get("FUSED_NORM_W4_RULES", "1") != "0"
FWD_SPLIT_BLOCK_BYTES = 8192
# ... but a 64 KB row split for its dropout alone (32K 16-bit columns, no x1) takes parts of
# this many bytes, on 2 warps (fwd_split_warps; bench/NOTES.md #57).
FWD_SPLIT_DROPOUT_64K_BYTES = 4096
FWD_SPLIT_WARPS = 4
# ... but these 16-bit rows, by (norm, x's dtype, columns), take parts of their own (bytes of a
# part, warps): fwd_split_wide_parts.
FWD_SPLIT_WIDE_PARTS = {
    ("dropout_ln", torch.bfloat16, 131072): (16384, 8),
    ("ln", torch.float16, 131072): (16384, 4),
}
FWD_SPLIT_MAX_POLLS = 0
FWD_SPLIT_SUB_N = 128
# The split forward's and the exchanging backwards' workspaces reset by the launch before
# (workspace.py) instead of filled by a kernel before each launch (bench/NOTES.md #76).
# ``FUSED_NORM_WS_SELF_CLEARING=0`` turns it off.
WS_SELF_CLEARING = os.environ.get("FUSED_NORM_WS_SELF_CLEARING", "1") != "0"
# Eager dropout calls derive their rows' seeds in the forward kernel from one key drawn on the
# host (ops.dropout_key) instead of a torch.randint kernel drawing them (bench/NOTES.md #80).
# ``FUSED_NORM_DROPOUT_KEY_ON_HOST=0`` turns it off.
DROPOUT_KEY_ON_HOST = os.environ.get("FUSED_NORM_DROPOUT_KEY_ON_HOST", "1") != "0"
# fp32 RMSNorm rows wider than this many columns keep a fresh workspace per split forward
# (fwd_ws_reset).
FWD_WS_RESET_RMS4_MAX_N = 65536


def fwd_ws_reset(is_rms_norm: bool, elem_bytes: int, n_cols: int) -> bool:
    """Whether a split forward's parts zero their words of the next split launch's workspace
    (kernels._fwd_split_row, workspace.py), so that it needs no fill kernel; else every launch
    fills a fresh one. The one store moves ptxas's schedule: for RMSNorm rows of 4-byte
    elements wider than FWD_WS_RESET_RMS4_MAX_N it took 54 -> 68 registers at 131072 columns
    (18 -> 14 programs per SM, offline, triton 3.6) and 274.8 -> 284.0 us (H200, 2026-11-25,
    bench/NOTES.md #76); those rows keep the fill."""
    return not (is_rms_norm and elem_bytes == 4 and n_cols > FWD_WS_RESET_RMS4_MAX_N)


# The exchange words of a launch that clears its own workspace (workspace.py) were last
# written, as the fill value, by the launch before: by the time a program publishes into them
# they have left L2, and the atomic's trip to memory sits on the path of every partner's wait.
# A prefetch into L2 at the program's start (inline PTX ``prefetch.global.L2``, one predicated
# instruction a 128-byte line; not under the interpreter) takes them out of it. Bench-style A/B
# in one process (H200, 2026-11-25, bench/NOTES.md #77), three rounds each:
# - the split forward (``fwd_ws_prefetch``: the first part of each line of a row's words asks
#   for it): LayerNorm bf16 64K / 128K / 256K 86.4 / 82.7 / 79.5 -> 88.7 / 86.0 / 81.4% of
#   copy, fp16 128K 76.1 -> 80.0%, fp32 128K 85.2 -> 90.5%, dropout + add + LayerNorm 32K /
#   64K / 256K 92.8 / 90.7 / 83.7 -> 94.4 / 93.1 / 85.1%, the x1 path 256K 94.7 -> 96.5%,
#   add + RMSNorm 256K 92.3 -> 93.8%, RMSNorm 128K bf16 / fp16 89.0 / 85.9 -> 92.4 / 89.5%;
#   but RMSNorm of x alone in more than FWD_WS_PREFETCH_RMS_MAX_PARTS parts lost or stayed
#   (bf16 256K 88.1-88.2 -> 86.6-86.8%, fp16 256K 83.6 -> 83.7%, fp32 128K 94.3 -> 93.6%),
#   and so did the x1 path in more than FWD_WS_PREFETCH_X1_MAX_PARTS (4-byte streams at 256K:
#   128 parts of 2K columns; bf16 x with an fp32 stream 94.2 -> 89.0%, fp32 95.0 -> 93.9%,
#   against 93.3 -> 95.0% and 96.6 -> 97.0% at 128K);
# - the sliced Gluon backward (BWD_SMEM_WS_PREFETCH, evict-last priority, the lines shared
#   among the row block's slices): LayerNorm bf16 64K / 128K / 256K 74.2-74.3 / 69.4-69.6 /
#   66.1-66.3 -> 75.9-76.0 / 71.7-71.8 / 67.4-67.5%, fp16 128K 65.4-65.7 -> 68.5-68.9%, fp32
#   64K 81.7-82.0 -> 83.5-83.7%, the x1 path 64K 66.4 -> 68.5%, bf16 with an fp32 stream,
#   dropout + add + LayerNorm 16384 76.4-76.5 -> 78.0-78.4%; 32K and fp32 256K even.
FWD_WS_PREFETCH = True
FWD_WS_PREFETCH_RMS_MAX_PARTS = 32
FWD_WS_PREFETCH_X1_MAX_PARTS = 64
BWD_SMEM_WS_PREFETCH = True
# Split rows that measured faster without the prefetch, by fwd_full_row's key (row kind,
# columns, x's dtype, element bytes, weight bytes) and whether the row has a bias: fp16
# LayerNorm 256K with a bias, whose parts fold their masks (FWD_FULL_SPLIT_ROWS). Bench-style
# A/B in one process (H200, 2026-11-26, bench/NOTES.md #108, calls 7-8, five rounds each):
# 163.4 / 163.5 -> 159.8 / 160.1 us (79.0 -> 80.7% of copy). Its neighbours keep it: without a
# bias 156.2 -> 156.8 us, bf16 155.1 -> 157.2 / 157.7, fp16 x beside fp32 weights 201.4 ->
# 212.4, fp16 128K / 64K 154.3 / 145.7 -> 170.5 / 151.3.
FWD_WS_PREFETCH_SKIP = frozenset({("ln", 262144, torch.float16, 2, 2, True)})


def fwd_ws_prefetch(split: int, device: torch.device, row: tuple) -> bool:
    """Whether a split forward's parts prefetch their row's exchange words into L2 (see
    FWD_WS_PREFETCH): on NVIDIA GPUs, but for RMSNorm of x alone in more than
    FWD_WS_PREFETCH_RMS_MAX_PARTS parts, the x1 path in more than FWD_WS_PREFETCH_X1_MAX_PARTS
    and the rows of FWD_WS_PREFETCH_SKIP. ``row``: the key fwd_full_row takes (its row kind
    first: "rms" for RMSNorm of x alone, "x1" for the x1 path), then whether the row has a
    bias."""
    if not FWD_WS_PREFETCH or not _nvidia(device) or row in FWD_WS_PREFETCH_SKIP:
        return False
    if row[0] == "x1":
        return split <= FWD_WS_PREFETCH_X1_MAX_PARTS
    return not (row[0] == "rms" and split > FWD_WS_PREFETCH_RMS_MAX_PARTS)


# A split part loads its columns' weights and biases after the wait, from L2, where every row's
# part of those columns reads them again: with ``evict_last`` they stay there against the rows
# streaming past (Triton's eviction_policy; bench/NOTES.md #106). Bench-style A/B in one process
# (H200, 2026-11-26, calls 2-3, four or five rounds), default -> evict_last: dropout + add +
# LayerNorm bf16 64K / 128K / 256K 279.1 / 286.8 / 297.5 -> 276.5 / 285.2 / 295.1 us, fp16 256K
# 295.1 -> 292.8, LayerNorm bf16 128K / 256K 150.4 / 156.6 -> 149.8 / 155.8, fp16 128K / 256K
# 157.8 / 165.7 -> 155.6 / 164.3, add + RMSNorm bf16 128K 271.5 -> 270.0, fp32 256K 535.5 ->
# 533.1, the x1 path 128K 410.1 -> 408.7; even for RMSNorm bf16 128K-256K, an fp32 stream, fp32
# LayerNorm 256K (304.9 -> 303.7). But 16-bit rows beside 4-byte weights lost (LayerNorm bf16 x,
# fp32 weights, 32K / 64K 153.0 / 161.0 -> 153.8 / 163.5 us): their weights keep the default.
# Loading x evict_first lost 1-19 us everywhere, and streaming stores (.cs) were even.
FWD_SPLIT_PARAMS_EVICT = "evict_last"


def fwd_split_params_evict(elem_bytes: int, weight_bytes: int) -> str:
    """The L2 eviction policy of a split forward part's weight and bias loads:
    FWD_SPLIT_PARAMS_EVICT, but the default ("") where the weights are wider than the row's
    widest element (``weight_bytes`` > ``elem_bytes``: 16-bit rows beside fp32 weights)."""
    return "" if weight_bytes > elem_bytes else FWD_SPLIT_PARAMS_EVICT


# LayerNorm-type split parts (not RMSNorm) compiled by Triton 3.9 or later count their columns
# in 32 bits (kernels._fwd_split_row's PART_I32: the part's index as int32, so its column
# index, weight, bias and output offsets too). With the 64-bit index Triton 3.9 keeps one
# 64-bit offset per 16-byte vector of the part live from the loads to the stores, where 3.6
# and 3.7 fold them into one base and immediates: offline (sm_90) LayerNorm bf16 64K-256K
# columns 62 -> 94 registers (16 -> 10 parts per SM), fp32 64 -> 84, dropout + add + LayerNorm
# fp32 125 -> 146, the x1 path bf16 96 -> 125. Measured on an H200 by launching the cubins
# Triton 3.9 compiles offline through the device's launcher (bench/NOTES.md #110; bench-style,
# three rounds, 2026-11-26), 64-bit -> 32-bit index, both compiled by 3.9: LayerNorm bf16 64K
# / 128K / 256K 176.8 / 204.6 / 212.7 -> 152.8 / 160.7 / 165.9 us (the device's 3.6 compile:
# 143.6 / 148.3 / 155.5), fp16 64K / 128K 171.6 / 180.0 -> 150.2 / 153.5, fp32 64K / 128K /
# 256K 322.6 / 336.9 / 373.2 -> 294.4 / 299.8 / 328.2, dropout + add + LayerNorm fp32 64K /
# 128K / 256K 594.0 / 613.8 / 690.8 -> 546.2 / 558.7 / 602.0, bf16 64K-256K 0.4-1.1% faster,
# the x1 path bf16 32K-256K 455.2-523.5 -> 422.2-455.5 (faster than 3.6's compile), fp16 64K
# 434.3 -> 417.1, fp32 64K / 256K 837.1 / 889.6 -> 823.8 / 879.4. Slower with it, so left out
# (FWD_SPLIT_PART_I32_SKIP, by row kind, columns and x's dtype): fp16 LayerNorm 256K 151.9 ->
# 156.2 us, fp16 dropout + LayerNorm 64K 269.2 -> 272.4, fp32 dropout + LayerNorm 32K 530.3 ->
# 542.5, fp32 LayerNorm 32K 278.9 -> 280.4, the x1 path fp16 256K 497.7 -> 502.3. RMSNorm's
# parts lost with it on 3.9 (bf16 256K 150.6 -> 157.7, add + RMSNorm bf16 256K 270.7 -> 273.9)
# and keep the 64-bit index. On 3.6, the device's, the 32-bit index lost as often as it gained
# (RMSNorm bf16 256K 144.9 -> 152.0, fp32 LayerNorm 256K 303.5 -> 312.6; dropout + LayerNorm
# fp32 64K 548.4 -> 539.5): every row there keeps the 64-bit index and the same SASS. Triton
# 3.8, unmeasured, compiles LayerNorm bf16's parts to 168 registers either way (offline).
FWD_SPLIT_PART_I32_FROM = (3, 9)
FWD_SPLIT_PART_I32_SKIP = frozenset({
    ("ln", 262144, torch.float16),
    ("dropout", 65536, torch.float16),
    ("dropout", 32768, torch.float32),
    ("ln", 32768, torch.float32),
    ("x1", 262144, torch.float16),
})  # fmt: skip


def fwd_split_part_i32(row: tuple, is_rms_norm: bool) -> bool:
    """Whether a split forward part counts its columns in 32 bits (kernels' PART_I32): where
    Triton FWD_SPLIT_PART_I32_FROM or later compiles (TRITON_VERSION), for rows that are not
    RMSNorm, but those in FWD_SPLIT_PART_I32_SKIP by the first three fields of ``row`` (the
    key fwd_full_row takes: row kind, columns, x's dtype)."""
    if is_rms_norm or TRITON_VERSION < FWD_SPLIT_PART_I32_FROM:
        return False
    return row[:3] not in FWD_SPLIT_PART_I32_SKIP


def fwd_split(
    n_cols: int,
    elem_bytes: int,
    device: torch.device,
    dropout: bool = False,
    x1: bool = False,
    ln_w4: bool = False,
) -> tuple[int, int]:
    """(BLOCK_N, SPLIT) of a forward row split over SPLIT programs, or (0, 1) for no split.

    Rows wider than FWD_SPLIT_MIN_BYTES split; heavy rows (with ``dropout`` or the ``x1``
    path: more work per column) from FWD_SPLIT_MIN_BYTES on. At exactly 64 KB (32K 16-bit
    columns, else one block of 16 warps) a graph-replay sweep of 2026-11-23 (H200, bf16,
    bench/NOTES.md #30) measured 8 parts of 4K columns against the one block: dropout + add +
    LayerNorm 73 -> 85% of copy, the x1 path 77 -> 84%; add + RMSNorm 98 -> 96% keeps the block. Norms of x alone in
    bf16 split there too from 2026-11-24 (held parts: RMSNorm 84 -> 91%, LayerNorm 65 -> 72%,
    bench/NOTES.md #37) until lane-summed chunks beat both (FWD_LANE_CHUNKS, NOTES #40). A 64 KB
    row of wider elements (16K fp32 columns) keeps its one block even when heavy: the x1 path
    93 -> 98%, dropout + add + LayerNorm 88% either way (fp32 sweep of 2026-11-23, NOTES #36).

    A 64 KB row heavy by its dropout alone (no x1) splits into parts of
    FWD_SPLIT_DROPOUT_64K_BYTES (16 of 2K columns, on 2 warps: fwd_split_warps): graph replay
    (H200, 2026-11-24, bench/NOTES.md #57), dropout + add + LayerNorm bf16 91.5-91.9 ->
    92.8-93.9% of copy in three runs, fp16 90.6 -> 93.7% (2K parts on 4 warps: 76.9%). Wider
    rows keep 4K-column parts (64K: 90.6-90.7 -> 88.8-90.0% on 2K parts, 256K 84.4-84.6 ->
    83.3-83.4%), as does the x1 path (95.7 -> 96.7% at 32K, but 92.8 -> 90.1% at 256K).

    ``ln_w4``: a LayerNorm of x alone whose weight and bias are 4 bytes wide (fp32 parameters
    beside 16-bit activations, as autocast training has them). Its 16-bit rows wider than
    FWD_SPLIT_LN_W4_MIN_BYTES split into parts of FWD_SPLIT_BLOCK_BYTES instead of running as
    lane-summed chunks (fwd_lane_chunk), which read the whole row's weight and bias again from
    L2 for every row: graph replay (H200, bf16 x, fp32 weights, 2026-11-24, bench/NOTES.md
    #59), two runs, 32768 columns 58.1-58.2 -> 74.2-76.7% of copy, 24576 64.3-64.4 ->
    83.0-83.6% (one block of 16 warps: 64.7% / 59.8%)."""
    row_bytes = n_cols * elem_bytes
    ln_w4 = ln_w4 and elem_bytes == 2 and row_bytes > FWD_SPLIT_LN_W4_MIN_BYTES
    if not ln_w4 and (row_bytes < FWD_SPLIT_MIN_BYTES or (
        row_bytes == FWD_SPLIT_MIN_BYTES and not ((dropout or x1) and elem_bytes <= 2)
    )):  # fmt: skip
        return 0, 1
    if not split_rows_ok(device):
        return 0, 1
    part_bytes = FWD_SPLIT_BLOCK_BYTES
    if row_bytes == FWD_SPLIT_MIN_BYTES and dropout and not x1:
        part_bytes = FWD_SPLIT_DROPOUT_64K_BYTES
    block_n = max(part_bytes // elem_bytes, 8)
    split = cdiv(n_cols, block_n)
    if split > sm_count(device):
        return 0, 1
    return block_n, split


def fwd_split_wide_parts(
    norm: str, x_dtype: torch.dtype, n_cols: int, elem_bytes: int, weight_bytes: int
) -> tuple[int, int] | None:
    """(bytes of a part, warps) of a split forward row that measured faster in parts wider
    than fwd_split's (FWD_SPLIT_WIDE_PARTS), else None. ``norm``: "ln" for a LayerNorm of x
    alone held in 16 bits (fwd_hold), "dropout_ln" for a LayerNorm with dropout and no x1, ""
    otherwise; rows whose every tensor is 16-bit (``elem_bytes``, the widest) with 16-bit
    weights (``weight_bytes``) only, as measured.

    Bench-style A/B in one process (H200, 2026-11-26, bench/NOTES.md #89; L2 flushed, host
    covered, events, median of 30), against 4K-column parts (32 of a 128K-column row), five
    rounds in two calls each: dropout + add + LayerNorm bf16 128K in 16 parts of 8K columns on
    8 warps (64 registers under fwd_maxnreg's cap, 4 parts per SM, as the 4K parts' 8 on 4
    warps) 291.4-293.0 -> 285.2-285.9 us (88.5 -> 90.5% of copy), and fp16 LayerNorm 128K in
    16 parts on 4 warps 161.6-161.9 -> 158.1-158.9 us (80.0 -> 81.8%). Their neighbours keep
    fwd_split's parts: the same parts lost for dropout + add + LayerNorm bf16 at 64K / 96K /
    256K (278.8 -> 284.3, 287.2 -> 288.8, 295.8 -> 328.6 us) and fp16 at 64K / 128K (274.7 ->
    279.6, 284.6 -> 288.5), for LayerNorm bf16 at 64K-256K (146.1 -> 157.6 at 64K on 4 warps)
    and fp16 at 64K / 256K (146.1 -> 149.6, 173.1 -> 174.4)."""
    if elem_bytes != 2 or weight_bytes > 2:
        return None
    return FWD_SPLIT_WIDE_PARTS.get((norm, x_dtype, n_cols))


def fwd_split_warps(
    plain: str, split: int, held: str = "", dropout_2k: bool = False, weight_bytes: int = 2
) -> int:
    """Warps per split part: FWD_SPLIT_WARPS; half that for a norm of x alone (``plain`` is "ln"
    or "rms": half the bytes per column), except LayerNorm in at most 16 parts held in fp32,
    whose two reductions before the exchange went faster on more warps (bench/NOTES.md #25: 64K
    columns in bf16, 2 -> 4 warps, 58 -> 64% of copy on an H200 and 73 -> 77% on an H100; at
    128K-256K within 2 points, and RMSNorm loses 1-5 points with 4). ``held``, the dtype a part
    is held in (fwd_hold: "bf16" or "fp16", "" for fp32): bf16 halves its registers, and
    LayerNorm's 2 warps then beat 4 at every width (64K 69 -> 73%, 128K 63 -> 68%, 256K 61 ->
    66%). fp16 LayerNorm keeps 4 in at most 16 parts and takes 2 beyond: with its conversion
    (fwd_hold_route; 80 registers on 2 warps, 40 on 4) graph replay gave, 4 / 2 warps, 64K
    82.8-85.7 / 81.7-83.4%, 128K 75.4-76.9 / 77.0-78.8%, 256K 72.9-75.5 / 75.3-76.9%
    (bench/NOTES.md #64; before it, 2 warps took 112-119 registers, #37). Held RMSNorm in at
    most 16 parts takes 4 warps (#55, three runs): bf16 64K 92.3-92.8 -> 95.8-96.1%, fp16 89.2
    -> 91.3-92.4%, bf16 48K 94.0 -> 94.7%; with more parts 2 stay ahead (128K 90.9 / 88.5%, 256K
    90.0 / 77.6%). ``dropout_2k``: parts of 2048 columns of a row with dropout and no x1 (rows
    of 4-byte elements, or 64 KB rows: fwd_split) take 2 warps (#57, graph replay): bf16 x with
    an fp32 stream 64K 83.8 -> 90.2%, 128K 84.3 -> 89.2%, 256K 82.7 -> 84.6%; fp32 64K 87.5 ->
    89.0%, 256K 84.8 -> 86.6% (the x1 path's keep 4: with an fp32 stream 256K 89.4 -> 86.8% on
    2); 32K 16-bit columns, fwd_split's figures. With 4-byte weights (``weight_bytes``) held
    RMSNorm stays on 2 warps in few parts too (graph replay, bf16 x, fp32 weights, two runs,
    bench/NOTES.md #59): 64K 84.1-84.2 -> 89.6-89.8%, 48K 88.0-88.1 -> 91.7-91.8%."""
    if dropout_2k:
        return max(FWD_SPLIT_WARPS // 2, 1)
    if plain == "rms":
        few = held and split <= FWD_SPLIT_FEW_PARTS and weight_bytes < 4
        return FWD_SPLIT_WARPS if few else max(FWD_SPLIT_WARPS // 2, 1)
    if plain == "ln" and (held == "bf16" or split > FWD_SPLIT_FEW_PARTS):
        return max(FWD_SPLIT_WARPS // 2, 1)
    return FWD_SPLIT_WARPS


# Whether Triton runs the kernels in its CPU interpreter: it decides when the kernels are
# defined (on import), from this variable.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def split_rows_ok(device: torch.device) -> bool:
    """Whether the forward may split rows on ``device``: CUDA GPUs (ROCm is untested) and the
    CPU interpreter; ``FUSED_NORM_SPLIT_ROWS=0`` turns it off."""
    if os.environ.get("FUSED_NORM_SPLIT_ROWS", "1") == "0":
        return False
    return _nvidia(device) or INTERPRETED


# Rows per forward program for narrow rows (one block of at most 256 columns). Sweep of
# 2026-11-22 (H200, bf16, N = 256): 8 rows per program 80% of copy vs 41% with one (LayerNorm),
# 90% vs 79% (dropout + add + LayerNorm); at 1K-4K more rows per program lost 1-14 points, and
# software-pipelining the row loop (tl.range num_stages=3) lost 10-60 points everywhere.
# Sweep of 2026-11-23 (H200, bf16, bench/NOTES.md #26): 4 rows beat 8 by about a point at N = 256
# for every workload; at N = 512 4 rows with one warp lift the plain norms from 80% to 94%
# (LayerNorm) and 96% (RMSNorm), but cost the workloads with a residual 3 points (they move
# twice the bytes per row and already reach 97-100% with one row per program). Those rows were
# a loop; as one tile (kernels._fwd_rows, bench/NOTES.md #31; same rows and warps) they went,
# in one graph-replay call: N = 256 LayerNorm 81 -> 95%, RMSNorm 87 -> 99%, dropout + add +
# LayerNorm 90 -> 96%, add + RMSNorm 97 -> 100%, the x1 path 96 -> 100%; N = 512 LayerNorm 93
# -> 97%, RMSNorm 96 -> 99%. Tiles of 8 rows or 2-4 warps were within 2 points of these.
FWD_ROWS_PER_PROGRAM = 4
FWD_ROWS_MAX_N = 256  # widest row (columns) that always takes several rows per program
FWD_ROWS_MAX_N_PLAIN = 512  # the same for a norm of x alone


def fwd_rows_per_program(block_n: int, num_chunks: int, plain: str = "") -> int:
    """Rows per forward program: FWD_ROWS_PER_PROGRAM for rows of <= FWD_ROWS_MAX_N columns
    (FWD_ROWS_MAX_N_PLAIN when ``plain``, a norm of x alone), else 1."""
    widest = FWD_ROWS_MAX_N_PLAIN if plain else FWD_ROWS_MAX_N
    return FWD_ROWS_PER_PROGRAM if num_chunks == 1 and block_n <= widest else 1


# add + RMSNorm's backward of 4-byte rows: warps by block (bwd_num_warps; bench/NOTES.md #57).
BWD_WIDE_ELEM_WARPS = {4096: 16, 16384: 8}

# RMSNorm of x alone in one padded 8192-column block of 16-bit rows takes 16 warps (under
# bwd_maxnreg's cap of 64, two programs per SM as on 8) instead of 8 where the row is padded
# (5121-8191 columns), and at 8192 too on Triton BWD_PLAIN_8K_W16_EXACT_FROM or later
# (TRITON_VERSION). Bench-style A/B (H200, 2026-11-26, bench/NOTES.md #113), 8 -> 16 warps,
# backward: triton 3.6, bf16 6144 223.8 -> 216.5-217.7 us (two calls), 7168 211.7 -> 208.0 /
# 212.9 -> 210.0, fp16 6144 218.9-219.4 -> 216.1-217.0, 7168 209.8 -> 208.0 / 212.3 -> 211.1,
# but 8192 even (bf16 210.7 -> 210.1, 213.8 -> 214.0) or behind (fp16 208.7 -> 210.2, 214.6 ->
# 215.2); triton 3.9's cubins (3.9 spills 8 bytes on 16 warps), bf16 6144 / 7168 / 8192 254.9
# / 242.0 / 235.0 -> 226.4 / 218.4 / 218.8, fp16 255.6 / 242.0 / 233.8 -> 227.8 / 218.3 /
# 219.4; 16-bit x with fp32 weights, triton 3.6: bf16 6144 / 7168 226.2 / 217.1 -> 220.2 /
# 210.8, fp16 6144 226.1 -> 216.6; 3.9: bf16 6144 298.3 -> 244.3 (on 8 warps 188 registers,
# one program per SM). Two blocks (4097-5120 columns) keep 8 (16 uncapped: bf16 4608 211.1 ->
# 248.8).
BWD_PLAIN_8K_WARPS = 16
BWD_PLAIN_8K_W16_EXACT_FROM = (3, 9)

# The x1 path's backward with dropout in one 2048-column block (1025-2048 columns) takes 4
# warps instead of 2 (on 2, triton 3.6 spills 48 bytes at 255 registers, 3.9 248). Bench-style
# A/B (H200, 2026-11-26, bench/NOTES.md #114), backward, 2 -> 4 warps, triton 3.6: bf16 2048 /
# 1536 543.6 / 596.1 -> 500.1 / 542.5 us, fp16 530.0 / 593.2 -> 504.4 / 545.2, bf16 x with
# fp32 weights 618.0 / 740.5 -> 496.6 / 593.8, an fp32 stream 718.8 -> 698.0, fp32 1067.6 ->
# 981.0; triton 3.9's cubins bf16 2048 / 1536 635.6 / 702.8 -> 503.9 / 508.2, fp16 640.0 ->
# 504.1, fp32 weights 731.6 -> 497.0, fp32 stream 879.7 -> 699.5. Without dropout 2 stay (fp16
# 2048 430.3 -> 480.9 on 4; bf16 437.6 -> 426.9, but 3.9 446.7 -> 475.0), and at 1024 (485.1
# -> 508.0).
BWD_X1_DROPOUT_2K_WARPS = 4

# ... and without dropout in one 1024-column block (513-1024 columns), 4 warps instead of 2
# where measured faster, which differs by Triton: from BWD_X1_1K_16BIT_FROM (TRITON_VERSION)
# for rows of 16-bit elements, before it for rows whose widest element is 4 bytes (fp32 rows,
# or an fp32 stream). Bench-style A/B (H200, 2026-11-26, bench/NOTES.md #116), backward, 2 ->
# 4 warps: triton 3.9's cubins bf16 1024 / 768 457.8 / 542.4 -> 391.2 / 458.0 us, fp16 462.1
# -> 428.5, bf16 x with fp32 weights 463.2 -> 434.8, but an fp32 stream 620.7 -> 650.7 and
# fp32 647.7 -> 699.7; triton 3.6 fp32 736.8 -> 678.2, an fp32 stream 721.9 -> 670.7, but
# fp16 411.8 -> 450.5, bf16 x with fp32 weights 413.3 -> 443.6, fp16 x with fp32 weights
# 367.7 -> 443.0 (bf16 413.9 -> 404.5 and 768 481.0 -> 470.6, left on 2 with the others).
BWD_X1_1K_WARPS = 4
BWD_X1_1K_16BIT_FROM = (3, 9)


def bwd_num_warps(
    block_n: int,
    partials: int = 1,
    dropout: bool = False,
    tail: int = 0,
    plain: bool = False,
    elem_bytes: int = 2,
    n_cols: int = 0,
) -> int:
    """Warps per backward program, ``partials`` the parameter-gradient vectors it accumulates,
    ``n_cols`` the row's columns (0: ``block_n``, not padded).
    Same sweeps: 4 at N=1K (87% of copy), 8 at 4K (92%), 32 at 16K (91%; LayerNorm with
    dropout spilled registers at 16 warps), 16 for 8K chunks. With four partials (two weights
    and two biases: the x1 path) 2 warps at 1K-2K: 67% / 70% of copy vs 52% / 58% with 4
    (sweep of 2026-11-22, third session; at 4K 2 warps fell to 17%).

    Narrow rows (bench/NOTES.md #26, H200, bf16, 2026-11-23): 1 warp at 256 columns
    (LayerNorm 39 -> 84%, add + RMSNorm 42 -> 94%) and 2 at 512 (61 -> 82%, 66 -> 89%), so
    that 8-16 times more rows are in flight per SM and the row sums stay within a warp; with
    dropout 2 at 256 (35 -> 65%; 1 warp: 41%) and, since its rows go in tiles
    (bwd_tile_rows), 2 at 512 (87% vs 83% with 4); the x1 path 1 at <= 512 (256: 59 -> 64%,
    512: 53 -> 71%).

    Two blocks of a padded 8192 (``tail`` > 0, bench/NOTES.md #27, 5120 columns): 16 warps with
    one partial (RMSNorm 81% vs 68% with 8 then; since #53 RMSNorm of x alone takes 8 and add +
    RMSNorm one padded block), 4 with two (dropout + add + LayerNorm 84% vs 72%
    with 8, LayerNorm 80% vs 64%), 8 with four (the x1 path 65% vs 54% with 4). Two blocks of
    a padded 16384 (two partials: bwd_block_config): 16 (LayerNorm at 12288: 62% vs 47% with
    32; bench/NOTES.md #30).

    ``plain``: no residual gradient in or out, no x1, no dropout (a norm of x alone). Its
    8192-column block with one partial takes 8 warps: RMSNorm 86% of copy vs 73% with 16, in
    two sessions' sweeps (bench/NOTES.md #30); add + RMSNorm prenorm keeps 16 (4: 81%, 16:
    78%, 8: 53%). Its 4096-column block with one partial takes 4 (RMSNorm bf16 85 -> 90%,
    fp16 75 -> 89%: on 8 warps fp16 took 72 registers, past 64; bench/NOTES.md #41), where
    add + RMSNorm keeps 8 (94% vs 85%) and LayerNorm is even (85.6 vs 84.7%). RMSNorm of x
    alone in a padded 8192-column block of 16-bit rows (``n_cols`` < 8192; on Triton 3.9 also
    8192) takes BWD_PLAIN_8K_WARPS (#113). The x1 path with dropout at 2048 takes
    BWD_X1_DROPOUT_2K_WARPS (#114), without dropout at 1024 BWD_X1_1K_WARPS where its
    Triton and element width measured faster (#116).

    Graph-replay sweeps of 2026-11-24 (H200, bench/NOTES.md #53), two runs each: RMSNorm of x
    alone held as two blocks (5120 = 4096 + 1024) on 8 warps instead of 16, bf16 82.3 -> 94.7%,
    fp16 82.9 -> 94.6%, fp32 92.8 -> 96.5%; 1024-column rows of 16-bit elements without
    dropout and with at most two partials on 2 warps instead of 4: LayerNorm bf16 85.4 ->
    91.0%, fp16 86.8 -> 91.5%, RMSNorm 90.4 -> 92.3%, add + RMSNorm 88.4 -> 97.0% (fp32 rows
    keep 4: 97.7 vs 96.0% for LayerNorm; at 2048 columns 2 warps lost, LayerNorm 87.3 ->
    78.9%); 512-column rows without dropout on 1 warp instead of 2, but for RMSNorm of x
    alone: add + RMSNorm bf16 90.4 -> 93.9%, fp32 96.6 -> 97.9%, LayerNorm bf16 88.2 -> 90.1%
    (six runs each; fp32 93.6% either way), RMSNorm bf16 91.8 -> 89.3% (it keeps 2).

    Rows of 4-byte elements (fp32, or an fp32 stream) with one partial, not a norm of x alone
    and without dropout (add + RMSNorm), graph replay (H200, 2026-11-24, #57): at 4096 columns
    16 warps instead of 8, bf16 x with an fp32 stream 83.7-84.2 -> 91.8-91.9% (4: 91.1-91.3%),
    fp32 91.2 -> 101.0% (4: 99.6%); at 16384 8 instead of 32, with an fp32 stream 78.0-78.1 ->
    88.0-88.1% (16: 87.8-88.0%; 32 warps spilled 28 bytes at 64 registers), fp32 98.3 -> 99.7%
    (16: 94.8%)."""
    if tail:  # two blocks of a padded 8192 or 16384, from the sweeps of TAIL_BLOCKS
        if block_n > 8192:
            return 16
        if partials == 1:
            return 8 if plain else 16
        return 8 if partials >= 4 else 4
    if plain and partials == 1 and block_n in (4096, 8192):
        if (
            block_n == 8192
            and elem_bytes == 2
            and (0 < n_cols < block_n or TRITON_VERSION >= BWD_PLAIN_8K_W16_EXACT_FROM)
        ):
            return BWD_PLAIN_8K_WARPS
        return block_n // 1024
    if (
        elem_bytes == 4
        and partials == 1
        and not (dropout or plain)
        and block_n in BWD_WIDE_ELEM_WARPS
    ):
        return BWD_WIDE_ELEM_WARPS[block_n]
    if partials >= 4 and block_n <= 2048:
        if dropout and block_n == 2048:
            return BWD_X1_DROPOUT_2K_WARPS
        measured = 2 if TRITON_VERSION >= BWD_X1_1K_16BIT_FROM else 4  # element bytes
        if not dropout and block_n == 1024 and elem_bytes == measured:
            return BWD_X1_1K_WARPS
        return 1 if block_n <= 512 else 2
    if block_n == 1024 and partials <= 2 and not dropout and elem_bytes <= 2:
        return 2
    if block_n <= 256:
        return 2 if dropout else 1
    if block_n == 512 and partials <= 2 and not dropout and not (plain and partials == 1):
        return 1
    if block_n <= 512:  # with dropout in tiles of rows (bwd_tile_rows): 87% vs 83% with 4
        return 2
    return min(max(block_n // 512, 4), 32)


# Narrow rows with dropout in the backward: a program takes its rows BWD_TILE_ROWS at a time as
# one tile (kernels._bwd_row_tiles) where the row is one block of at most BWD_TILE_ROWS_MAX_N
# columns, so that a tile's loads and its Philox draws are in flight together. Graph-replay
# sweep of 2026-11-23 (H200, bf16, bench/NOTES.md #31), tiles of {2, 4, 8} rows on {1, 2}
# warps against one row at a time: dropout + add + LayerNorm 256 columns 65 -> 83% of copy (4
# rows, 2 warps), 512 columns 66 -> 87% (4 rows, 2 warps; 4 warps 83%); without dropout the
# tiles lost (LayerNorm 256: 84 -> 60-79%, add + RMSNorm 512: 88 -> 61-75%, the x1 path 512:
# 71 -> 50-60%) or were even (RMSNorm 256: 89 -> 91%), and at 1024 columns they were even
# with dropout (84 -> 86%) and lost without.
BWD_TILE_ROWS = 4
BWD_TILE_ROWS_MAX_N = 512


def bwd_tile_rows(block_n: int, num_chunks: int, tail: int = 0, dropout: bool = True) -> int:
    """Rows per tile of the backward: BWD_TILE_ROWS for one-block rows with dropout of at most
    BWD_TILE_ROWS_MAX_N columns, else 1 (one row at a time)."""
    if dropout and num_chunks == 1 and not tail and block_n <= BWD_TILE_ROWS_MAX_N:
        return BWD_TILE_ROWS
    return 1


# Rows in flight per backward program: its row loop is software-pipelined (``tl.range``
# num_stages), the loads of the next rows overlapping the current row's maths, where that maths
# is heavy: dropout masks regenerated, two or more weight gradients on rows of 4K+ columns, or
# the row split into column blocks. Sweeps of 2026-11-22 (H200, bf16, bench/NOTES.md), 1 -> 3
# stages: dropout + add + LayerNorm 56 -> 77% of copy at 1K, 70 -> 81% at 4K, 46 -> 57% at 16K;
# LayerNorm 67 -> 76% at 4K but 79 -> 68% at 1K; add + RMSNorm in one block 93 -> 90% at 4K;
# add + RMSNorm split at 64K 39 -> 45%.
BWD_ROW_STAGES = 3
# Shared memory the pipeline's buffers may take (Hopper allows 227 KB per program).
BWD_STAGE_BYTES = 200 * 1024


def bwd_row_stages(
    block_n: int,
    row_bytes_per_col: int,
    dropout: bool,
    num_chunks: int,
    partials: int,
    plain_full: bool = False,
    tail: int = 0,
) -> int:
    """num_stages of the backward's row loop; ``row_bytes_per_col`` sums the element sizes of
    the per-row tensors it loads (s, dy, dy1, dresidual_out, x), whose buffers hold the row's
    columns (``block_n // 2 + tail`` where a padded 16K or 32K is held as two). ``plain_full``: a
    norm of x alone whose row fills its one block, no padding. RMSNorm's (one partial)
    2048-column rows take 2 stages: graph replay (H200, 2026-11-24, bench/NOTES.md #57), bf16
    91.1-92.4 -> 94.2-94.3% of copy in two runs (3 stages 92.4%), fp16 92.9 -> 94.5%; but
    padded to that block, 1536 columns lost 95.0 -> 85.4%, and at 2048 add + RMSNorm (96.5 ->
    95.8%) and LayerNorm (86.9 -> 78.7%) lost."""
    if plain_full and partials == 1 and block_n == 2048 and num_chunks == 1 and not dropout:
        return 2
    if not (dropout or num_chunks > 1 or (partials >= 2 and block_n >= 4096)):
        return 1
    # Rows held as 8192 (16384) + tail size their buffers by the columns held (bench/NOTES.md
    # #65); narrower two-block rows keep the padded estimate their stages were measured under.
    held = block_n // 2 + tail if tail and block_n > 8192 else block_n
    stages = min(BWD_ROW_STAGES, BWD_STAGE_BYTES // (held * row_bytes_per_col))
    return stages if stages >= 2 else 1


def bwd_pipeline_bytes(
    held: int, tile_rows: int, row_bytes: int, weight_bytes: int, stages: int
) -> int:
    """A lower bound on the shared memory of the backward's row loop pipelined in ``stages``
    (bwd_row_stages): Triton 3.6 keeps stages - 1 buffers of each load in the loop, the
    ``held`` columns of each per-row tensor for each of the tile's rows (``row_bytes`` a
    column) and of the weights once (``weight_bytes``; bwd_row_stages does not count them).
    Offline (sm_90, triton 3.6; bench/NOTES.md #86) the 67 pipelined kernels of the benchmark's
    workloads in bf16, fp16 and fp32, with and without fp32 weights, at 1K-256K columns took
    this plus 56 to 8228 bytes, never less. The x1 path's 16-bit rows with fp32 weights in
    8192-column blocks need 256 KB (3 stages): that kernel cannot load, and the launch runs it
    unpipelined (ops._fitting_stages)."""
    return (stages - 1) * held * (tile_rows * row_bytes + weight_bytes)


def max_shared(index) -> int:
    """Shared memory one program may take on CUDA device ``index`` (Hopper: 227 KB)."""
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", 0)


# Chunk of the backward's row-sums pre-pass (kernels.py), in bytes of the wider of s and dy, and
# its warps. Sweeps of 2026-11-22 (H200, bf16): at N = 16K, 2K-column chunks with 8 warps read
# at 93-101% of copy, one 16K block with 16-32 warps at 67% (LayerNorm); at 64K / 256K, 8K
# chunks at 86-100%, 32K chunks at 31-46%; software-pipelining this loop lost 10-30 points.
BWD_SUMS_BLOCK_BYTES = 4096
BWD_SUMS_WARPS = 8
# Each row's sums are taken in parts of at least BWD_SUMS_PART_BYTES, a program per part, at
# most BWD_SUMS_MAX_PARTS (a power of two) a row; a second small kernel adds each row's shares
# in a fixed order (kernels._row_shares_sum_kernel). With a program per row, 1024 rows of 128K
# bf16 columns ran as 1.55 waves of the 660 programs that fit at once. Bench-style A/B (H200,
# bench/NOTES.md #84), the pre-pass in 8 parts against one: dropout + add + LayerNorm bf16 at
# 128K, forward + backward 790.9 -> 781.7 us; the x1 path bf16 at 256K 980 -> 961 us. But
# with 4-byte weights parts lost (the x1 path fp32 at 256K 1881 -> 1915 us, bf16 with fp32
# weights 1034 -> 1040 us), so those rows keep one part.
BWD_SUMS_PART_BYTES = 32768
BWD_SUMS_MAX_PARTS = 8
# ... but 16-bit rows without the x1 path take up to this many parts (bwd_sums_layout): 16 of
# 32 KB at 256K columns. Bench-style A/B in one process (H200, 2026-11-26, bench/NOTES.md #107,
# calls 3-5), dropout + add + LayerNorm 256K forward + backward, 8 -> 16 parts: bf16 780.4 ->
# 780.1, 776.2 -> 773.8 and 778.4 -> 776.0 us (the backward alone within 3 us either way: 486.0
# -> 483.3, 482.8 -> 483.3), fp16 776.1 -> 772.0 and 779.6 -> 774.6 (the backward 484.2 ->
# 480.2), as in #91 (783.0 -> 776.9, 783.3 -> 779.8); add + LayerNorm with prenorm 682.6 ->
# 681.4. The x1 path lost (bf16 932.1 -> 934.6 us, fp16 939.6 -> 943.0) and keeps 8.
BWD_SUMS_MAX_PARTS_16BIT = 16
BWD_SUMS_ADD_ROWS = 128  # rows per program of the shares' sum, and its warps
BWD_SUMS_ADD_WARPS = 4

# The backward's kernels after its first launched as programmatic dependents of the kernel
# before them (Hopper's programmatic dependent launch, PDL: Triton's launch_pdl option and PTX
# griddepcontrol): the shares' sum and the backward kernel after the row-sums pre-pass, the
# partials' sum after the backward. A dependent's programs start while the kernel before still
# runs (the pre-pass lets them once all its programs have started) and wait in the kernel, not
# in the launch queue, for its writes (bench/NOTES.md #87).
BWD_PDL = os.environ.get("FUSED_NORM_BWD_PDL", "1") != "0"


@functools.cache
def _sm90(index) -> bool:
    """Compute capability 9 or more on CUDA device ``index`` (Hopper): PTX griddepcontrol
    (bwd_pdl), smem_kernels' backward (_smem_ok)."""
    return torch.cuda.get_device_properties(index).major >= 9


def bwd_pdl(device: torch.device) -> bool:
    """Whether the backward's later kernels launch as programmatic dependents (BWD_PDL): on
    CUDA GPUs of compute capability 9 or more, not under the interpreter."""
    return BWD_PDL and not INTERPRETED and _nvidia(device) and _sm90(device.index)


def bwd_sums_layout(n_cols: int, elem_bytes: int, w4: bool, x1: bool) -> tuple[int, int, int]:
    """(BLOCK_N, NUM_CHUNKS, PARTS) of the row-sums pre-pass for rows of ``n_cols`` elements,
    ``elem_bytes`` the wider of s and dy, ``w4``: 4-byte weights (W4_RULES), ``x1``: the x1
    path's second weight: chunks of BLOCK_N columns, NUM_CHUNKS of them per part and PARTS
    parts per row (a power of two, at most BWD_SUMS_MAX_PARTS, BWD_SUMS_MAX_PARTS_16BIT for
    16-bit rows without x1, and 1 with 4-byte weights; the last part may run past the row,
    masked)."""
    block_n, chunks = block_config(n_cols, elem_bytes, BWD_SUMS_BLOCK_BYTES)
    if w4:
        return block_n, chunks, 1
    part_chunks = max(BWD_SUMS_PART_BYTES // (block_n * elem_bytes), 1)
    most = BWD_SUMS_MAX_PARTS_16BIT if elem_bytes == 2 and not x1 else BWD_SUMS_MAX_PARTS
    parts = 1
    while parts * 2 * part_chunks <= chunks and parts < most:
        parts *= 2
    return block_n, cdiv(chunks, parts), parts


# Backward rows wider than one block are split into column blocks of at most this many bytes,
# each its own program (see kernels.py); bench/NOTES.md has the sweep.
BWD_TILE_BYTES = 16384
# ... but the x1 path's (four partials) 16-bit rows with 16-bit weights take blocks of this many
# bytes (4K columns, on 8 warps; bwd_num_warps): bench-style A/B in one process (H200,
# 2026-11-26, bench/NOTES.md #90, two calls), the x1 path at 256K columns (the width where its
# rows take the pre-pass; 2 row blocks of 64 column programs instead of 4 of 32) backward bf16
# 549.5 -> 526.4 us (column kernel 328.5 -> 312.4 us, partials' sum 5.9 -> 2.7), fp16 544.0
# -> 526.3 us. With fp32 weights the 4K blocks lost (256K 587.4 -> 628.1 us, 128K 585.9 ->
# 608.6), as did dropout + add + LayerNorm's two partials (128K 486.0 -> 499.2 us, 256K 488.3
# -> 501.2) and fp32 LayerNorm at 256K (+2.4 us).
BWD_TILE_BYTES_X1 = 8192

# The column programs of a row block exchange their partial row sums (kernels.py, EXCHANGE)
# instead of a pre-pass kernel reading s and dy a second time: on CUDA GPUs and under the CPU
# interpreter (where a program waits at most BWD_EXCHANGE_MAX_POLLS reads of a row's words
# before computing the missing ones itself). ``FUSED_NORM_BWD_EXCHANGE=0`` turns it off.
BWD_EXCHANGE = os.environ.get("FUSED_NORM_BWD_EXCHANGE", "1") != "0"
BWD_EXCHANGE_MAX_POLLS = 0
# Column blocks (bytes of a 16-bit row: 2K columns whatever the dtype, but see bwd_block_config)
# and warps of the exchanging programs.
BWD_EXCHANGE_TILE_BYTES = 4096
BWD_EXCHANGE_WARPS = 4
BWD_EXCHANGE_MAX_CHUNKS_MULTI = 32


def bwd_launch_layout(
    n_cols: int,
    elem_bytes: int,
    partials: int,
    dropout: bool,
    plain: bool,
    device: torch.device,
    w4: bool = False,
    x1: bool = False,
) -> tuple[int, int, int, int, bool]:
    """bwd_layout on ``device``, and whether its column blocks exchange their row sums: where
    the device allows it (bwd_exchange) and the row's blocks fit (bwd_exchange_fits), else the
    layout of the row-sums pre-pass. ``w4``: the weights are 4-byte (also bwd_block_config);
    ``x1``: the row has the x1 path.

    A row with dropout or the x1 path and 4-byte weights (heavy_w4): its 16-bit rows with
    two or more partials take the pre-pass: each exchanging program reads its block of the
    weights twice per row (for the next row's word and for this row), twice the bytes in
    fp32. Graph replay (H200, bf16 x, fp32 weights, 2026-11-24, bench/NOTES.md #59), two runs,
    exchange -> pre-pass: dropout + add + LayerNorm 12288 / 32K / 64K 58.7 / 60.1 / 59.6 ->
    62.6-64.6 / 64.3-64.9 / 63.9-64.1% of copy, the x1 path 32K / 64K 49.4-49.6 / 48.2-49.0
    -> 55.8-55.9 / 55.8-55.9% (12288 even); (with bf16 weights the exchange stays ahead:
    dropout + add + LayerNorm 32K 68.7 vs 65.9%, the x1 path 65.0 vs 56.3%)."""
    heavy_w4 = (dropout or x1) and w4 and elem_bytes == 2 and partials >= 2
    if bwd_exchange(device) and not heavy_w4:
        layout = bwd_layout(n_cols, elem_bytes, partials, dropout, plain, True, w4)
        if layout[1] > 1 and bwd_exchange_fits(layout[1], partials, device):
            return (*layout, True)
    return (*bwd_layout(n_cols, elem_bytes, partials, dropout, plain, w4=w4), False)


# The backward of LayerNorm-type rows with a weight and a bias (two partials), 16-bit rows and
# weights, of BWD_SMEM_MIN_COLS-16384 columns: one program per SM holding the whole row, its
# partial dW in shared memory or registers (smem_kernels, Gluon; bwd_smem_dw_regs), in place of
# column blocks that exchange their row sums (bwd_launch_layout). A norm of x alone since
# 2026-11-25 (bench/NOTES.md #70); with a residual gradient in and out and x's dropout
# (dropout + add + LayerNorm, prenorm) up to BWD_SMEM_RESIDUAL_MAX_COLS, where
# BWD_SMEM_RESIDUAL (#71: 66 -> 85% of copy at 12288; at 14336-16384, where s, dy and
# dresidual_out fit 2 deep only with dW in registers, #72: 66-68 -> 79-84%).
# ``FUSED_NORM_BWD_SMEM=0`` turns it off.
BWD_SMEM_PARTIALS = os.environ.get("FUSED_NORM_BWD_SMEM", "1") != "0"
BWD_SMEM_RESIDUAL = True
# One partial (a norm without a bias, alone or with a residual gradient: dW only) as two do,
# but for 4-byte rows in more than BWD_SMEM_ONE_PARTIAL_MAX_SPLIT_4B slices and RMSNorm's
# whole row of one full block (16384 16-bit columns). Bench-style A/B, H200, 2026-11-26
# (bench/NOTES.md #94), two rounds each, backward kernels.py -> smem_kernels: RMSNorm bf16
# 12288 228.4 -> 208.8 us, 14336 216.9 -> 211.8, 32K 272.6 -> 232.8, 64K 260.3 -> 233.1, 128K
# 266.8 -> 239.6, 256K 264.2 -> 258.8; fp16 12288 230.2 -> 208.3, 32K 270.3 -> 235.5, 64K
# 257.9 -> 233.0; fp32 16384 465.5 -> 426.6, 32K 486.1 -> 423.2, 64K 476.8 -> 445.1; add +
# RMSNorm bf16 12288 287.5 -> 275.6 (14336 even), bf16 x with an fp32 stream 16384 589.6 ->
# 554.5 and 586.9 -> 554.4 (fp32 even); LayerNorm without a bias bf16 12288 334.8 -> 231.8,
# 14336 322.7 -> 210.4, 32K 291.2 -> 243.3, 64K 292.8 -> 253.9, 256K 294.8 -> 271.8, fp32
# 16384 562.2 -> 434.3, 64K 489.6 -> 456.5, add + LayerNorm bf16 12288 539.6 -> 274.2, bf16 x
# with an fp32 stream 16384 703.5 -> 559.6, fp32 605.8 -> 546.4; LayerNorm's whole rows of
# 16384 without a bias, bf16 311.1 -> 214.2, fp16 313.5 -> 213.9, add + LayerNorm 470.5 ->
# 277.2 (14336 497.4 -> 272.9). Not taken, slower: RMSNorm's
# whole rows of 16384 (bf16 212.2 -> 213.5 and 212.9 -> 215.8, fp16 212.4 -> 214.2, add +
# RMSNorm 274.6 -> 278.8), fp32 RMSNorm 128K in 16 slices (463.3 -> 475.9).
BWD_SMEM_ONE_PARTIAL = True
# 16-bit rows beside 4-byte weights (bf16 or fp16 activations with fp32 parameters, as autocast
# training has them) take the kernel too, whole or in slices, wherever 16-bit weights would
# (bwd_smem_layout and bwd_smem_slices size the weight as stored). Bench-style A/B, H200,
# 2026-11-26 (bench/NOTES.md #97), bf16 x with fp32 weights, backward, kernels.py -> this
# kernel: LayerNorm 12288 / 16384 / 32768 306.2 / 306.8 / 296.8 -> 234.2 / 237.7 / 257.2 us,
# without a bias 16384 402.3 -> 235.9, RMSNorm 12288 / 32768 232.4 / 269.5 -> 224.1 / 240.2,
# dropout + add + LayerNorm 12288 / 16384 501.9 / 512.4 -> 404.1 / 448.7, the x1 path 16384
# 586.6 -> 449.6. Beyond 32K columns (the x1 path: 16K) their slices fit 2 rows deep only:
# BWD_SMEM_NOLAG_MAX_SPLIT. ``BWD_SMEM_W4_16BIT = False`` keeps those rows on kernels.py's
# backward.
BWD_SMEM_W4_16BIT = True
BWD_SMEM_ONE_PARTIAL_MAX_SPLIT_4B = 8
BWD_SMEM_RESIDUAL_MAX_COLS = 16384
BWD_SMEM_MIN_COLS = 10241
BWD_SMEM_MAX_COLS = 16384
BWD_SMEM_WARPS = 16
BWD_SMEM_MAX_STAGES = 2
# Shared memory a block may take on Hopper (227 KB), less what the kernel's reductions use.
BWD_SMEM_BYTES = 227 * 1024 - 2048


# Rows that do not fit one such program (16-bit rows wider than BWD_SMEM_MAX_COLS, rows of
# 4-byte elements) are cut into ``split`` slices of a power of two columns, one program each
# (bwd_smem_slices, smem_kernels' SPLIT), which exchange their partial row sums through int64
# words as kernels.py's EXCHANGE does: LayerNorm alone of 16-bit rows at 32K-256K columns
# (16K-column slices) and of fp32 rows at 16K-128K (8K), dropout + add + LayerNorm of 4-byte
# residual streams at 16384 (two 8K slices, BWD_SMEM_RESIDUAL_MAX_SPLIT). From
# BWD_SMEM_LAG_MIN_SPLIT slices on, a program publishes its sums a row ahead (LAG, 3 rows
# staged). Graph replay, H200, 2026-11-25 (bench/NOTES.md #74), backward, % of copy, the
# current path -> slices: LayerNorm bf16 32K 65.1 -> 77.1 (2 slices; with LAG 73.4), 48K 61.9 ->
# 74.1, 64K 64.3 -> 75.6 (without LAG 71.5), 128K 57.8 -> 70.7, 256K 58.5 -> 64.9 (without LAG
# 44.8); fp16 64K 66.2 -> 72.0, 256K 59.5 -> 64.3; fp32 16384 79.3 -> 90.2 (4 contiguous fp32
# per thread, BWD_SMEM_FP32_VEC: 8 gave 68.5), 64K 79.5 -> 82.4; dropout + add + LayerNorm, bf16
# rows with an fp32 stream, 16384 73.8-74.3 -> 75.3-76.3, fp32 rows even (68.8-69.7 -> 67.2-69.5).
# Not taken, measured slower: slices staging under BWD_SMEM_SLICE_MIN_BYTES of a row (16-bit
# 4K / 8K slices, fp32 4K: LayerNorm 20480 63.9 -> 36.9, 32K in 8K slices 60.6, fp32 12288
# 78.1 -> 68.2), more than BWD_SMEM_MAX_SPLIT slices (fp32 256K 59.8 -> 53.2), 16-bit dropout +
# add + LayerNorm (16K slices spill, 68 -> 44; 8K slices with LAG 62-63, 256K 44).
BWD_SMEM_SPLIT = True
BWD_SMEM_SPLIT_MAX_COLS = 262144
BWD_SMEM_SLICE_MAX = 16384
BWD_SMEM_SLICE_MIN_BYTES = 65536
BWD_SMEM_MAX_SPLIT = 16
BWD_SMEM_LAG_MIN_SPLIT = 3
# Rows whose slices fit 2 rows deep but not LAG's 3 take 2 without LAG, in at most
# BWD_SMEM_NOLAG_MAX_SPLIT slices (bwd_smem_slices), where measured: 16-bit rows beside fp32
# weights from 48K columns and the x1 path's from 24K (bwd_smem_partials), with one partial (a
# norm without a bias) in at most BWD_SMEM_NOLAG_ONE_PARTIAL_MAX_SPLIT. Bench-style A/B, H200,
# 2026-11-26 (bench/NOTES.md #99), bf16 x with fp32 weights, backward, kernels.py -> slices:
# LayerNorm 65536 / 131072 (4 / 8 slices of 16K) 310.2 / 343.2 -> 262.0 / 311.4 us, without a
# bias 65536 286.2 -> 255.5, RMSNorm 65536 265.8 -> 251.7, the x1 path 32768 / 65536 (4 / 8
# of 8K) 581.7 / 582.5 -> 462.8 / 537.2; not taken, slower: RMSNorm 131072 in 8 slices 274.2
# -> 291.8.
BWD_SMEM_NOLAG_MAX_SPLIT = 8
BWD_SMEM_NOLAG_ONE_PARTIAL_MAX_SPLIT = 4
BWD_SMEM_RESIDUAL_MAX_SPLIT = 2
# x1's path with its second output (weight1 and bias1 beside weight and bias: four partials;
# dy1 staged; no gradient buffer of x1's own, so no dropout) always in slices (sixteen
# columns a thread of four partials in registers at most: 8K-column slices of 16-bit rows, 4K
# or 8K of 4-byte rows), which may stage BWD_SMEM_X1_SLICE_MIN_BYTES of a row; where no power
# of two serves, two slices of a power of two and a tail (BWD_SMEM_X1_TAILS, staging
# BWD_SMEM_SLICE_MIN_BYTES). Graph replay, H200, 2026-11-25 (bench/NOTES.md #75), backward, %
# of copy, the current path -> slices, two runs each: bf16 with prenorm 16384 64.7-64.8 ->
# 75.6-75.9, 32K 64.1-64.5 -> 71.3, 64K 64.0-64.1 -> 68.7, 128K 57.7-57.8 -> 65.9-66.0; fp16
# 16384 65.4-65.7 -> 77.6-77.7; fp32 16384 68.7-68.9 -> 84.5-84.7, 64K 61.5-61.7 -> 77.9-78.5,
# 12288 66.8-67.5 -> 85.4-85.5; bf16 with an fp32 stream 16384 69.8-70.0 -> 82.6-82.8, 12288
# 69.1-69.2 -> 76.7-76.9, and in 48 KB slices (4K) 32K 68.8 -> 73.1-73.7, 64K 63.1 -> 67.3-67.5,
# with fp32 weights 16384 69.7-69.8 -> 73.9-74.0, 64K 60.7-60.9 -> 65.0-65.2;
# without prenorm (48 KB slices) bf16 16384 60.0 -> 66.9-67.2, 64K 57.9-58.0 -> 58.6-58.7, fp32
# 64K 54.7-54.8 -> 65.9-66.1, bf16 with an fp32 stream 64K 57.0-57.2 -> 77.5-77.7; a tail: bf16
# 20480 (8192 + 2048) 62.9-63.3 -> 68.9. Not taken, measured slower: 16-bit 12288 as 2 x (4096
# + 2048), 48 KB a slice (63.2-63.6 -> 60.9, fp16 64.2-64.3 -> 63.2-63.3) or in 4K slices
# (32 KB, 63.2 -> 55.6), 256K in 32 slices (57.7 -> 40.5). Measured faster and not taken, to keep
# the tail rule simple: bf16 with an fp32 stream without prenorm 12288 as 2 x (4096 + 2048), 48
# KB (66.8 -> 79.6-79.8).
BWD_SMEM_X1 = True
BWD_SMEM_X1_SLICE_MIN_BYTES = 49152
BWD_SMEM_X1_TAILS = True
# Rows in slices with a residual gradient in and x's dropout (dropout + add + LayerNorm with
# prenorm) of 4-byte rows (x and its stream fp32): dresidual_out, read once in pass 2, is
# loaded a row ahead into registers instead of staged (smem_kernels' DRES_REGS), so that the
# shared memory has room to move the dropout decisions to 4-column layouts
# (BWD_SMEM_FP32_DROPOUT_VEC, bwd_smem_fp32_vec), whose 16-byte accesses leave shared memory
# free of the bank conflicts of 8 fp32 columns a thread. Bench-style A/B, H200, 2026-11-26
# (bench/NOTES.md #92), fp32 16384 (two 8K slices), backward: 945.6 -> 925.7 us in registers
# alone, 945.2 -> 761.7 and 940.2 -> 764.2 us with the 4-column layouts (forward + backward
# 1490.4 -> 1308.8 us); a row ahead with 3 stages (LAG at 2 slices) lost, 1016 us. Not taken
# where measured slower: without dropout (already 4 columns a thread) 544.9 -> 572.5 us; bf16
# x with an fp32 stream 662 -> 667 us (its 6 staged bytes a column would fall under
# BWD_SMEM_SLICE_MIN_BYTES besides).
BWD_SMEM_DRES_REGS = True


def bwd_smem_dres_regs(x1: bool, dy_bytes: int, dropout: bool) -> bool:
    """Whether smem_kernels' sliced backward holds dresidual_out in registers, not staged
    (BWD_SMEM_DRES_REGS): rows with x's ``dropout`` whose dy (``dy_bytes``, x's dtype) is
    4-byte, not x1's second output (``x1``)."""
    return BWD_SMEM_DRES_REGS and dropout and not x1 and dy_bytes == 4


# Contiguous elements per thread of 4-byte rows without dropout (with it: 8, whole octets, or
# BWD_SMEM_FP32_DROPOUT_VEC where dresidual_out is held in registers: bwd_smem_fp32_vec).
BWD_SMEM_FP32_VEC = 4
BWD_SMEM_FP32_DROPOUT_VEC = 4


def bwd_smem_fp32_vec(dropout: bool, dres_regs: bool = False, width: int = 0,
                      fixed_bytes: int = 0) -> int:  # fmt: skip
    """Contiguous columns a thread of smem_kernels' backward takes of rows of 4-byte elements:
    BWD_SMEM_FP32_VEC; with dropout 8 (whole octets of keep-decisions), or
    BWD_SMEM_FP32_DROPOUT_VEC in slices of ``width`` columns whose dresidual_out is held in
    registers (``dres_regs``, bwd_smem_dres_regs) where shared memory has room for the
    decisions' move (one byte a column, smem_kernels._keep) beside the ``fixed_bytes`` a
    column the slice stages and holds."""
    if not dropout:
        return BWD_SMEM_FP32_VEC
    if dres_regs and width * (fixed_bytes + 1) <= BWD_SMEM_BYTES:
        return BWD_SMEM_FP32_DROPOUT_VEC
    return 8


def bwd_smem_width(n_cols: int) -> bool:
    """Whether rows of ``n_cols`` columns are of a width bwd_smem_partials may choose (the
    launcher then also asks whether the row tensors are 16-byte aligned)."""
    widest = BWD_SMEM_SPLIT_MAX_COLS if BWD_SMEM_SPLIT else BWD_SMEM_MAX_COLS
    return BWD_SMEM_MIN_COLS <= n_cols <= widest and n_cols % 16 == 0


def bwd_smem_sliced(n_cols: int, elem_bytes: int, kind: str | None = None) -> bool:
    """Whether smem_kernels' backward takes rows of ``n_cols`` columns of ``elem_bytes``-byte
    elements (the widest of the row tensors) in slices (bwd_smem_slices) rather than whole:
    always for x1's second output (``kind``, bwd_smem_partials: four partials)."""
    return n_cols > BWD_SMEM_MAX_COLS or elem_bytes > 2 or kind == "x1"


def bwd_smem_slices(
    n_cols: int, staged_bytes: int, weight_bytes: int, x1: bool = False
) -> tuple[int, int, int, bool] | None:
    """(slice, split, stages, lag) of a sliced row (bwd_smem_sliced): the widest power of two
    of columns, at most BWD_SMEM_SLICE_MAX, that divides the row into ``split`` slices (2 to
    BWD_SMEM_MAX_SPLIT) whose rows, ``staged_bytes`` per column (s, dy and any dresidual_out),
    fit ``stages`` deep beside the slice's weight (``weight_bytes`` per column; partial dW in
    registers): 2 rows, or with ``lag`` (BWD_SMEM_LAG_MIN_SPLIT slices or more: the sums
    published a row ahead, smem_kernels' LAG) 3. A slice stages at least
    BWD_SMEM_SLICE_MIN_BYTES of each row (``x1``, x1's second output:
    BWD_SMEM_X1_SLICE_MIN_BYTES). Where no power of two does that 3 deep with LAG, one that
    does it 2 deep without, in BWD_SMEM_LAG_MIN_SPLIT to BWD_SMEM_NOLAG_MAX_SPLIT slices
    (bwd_smem_partials takes those for 16-bit rows beside 4-byte weights only). Where no power
    of two does all that, x1's row may be two slices of a power of two and a tail of at least a
    quarter of it (BWD_SMEM_X1_TAILS, slice_parts: 20480 as 2 x (8192 + 2048)) that stage
    BWD_SMEM_SLICE_MIN_BYTES of a row. None where no slice does all that."""
    width = BWD_SMEM_SLICE_MAX
    min_bytes = BWD_SMEM_X1_SLICE_MIN_BYTES if x1 else BWD_SMEM_SLICE_MIN_BYTES
    lagless = None  # the widest that fits 2 rows deep where LAG's 3 do not
    while width * staged_bytes >= min_bytes:
        split = n_cols // width
        lag = split >= BWD_SMEM_LAG_MIN_SPLIT
        stages = 3 if lag else 2
        fits = width * (weight_bytes + stages * staged_bytes) <= BWD_SMEM_BYTES
        if n_cols % width == 0 and split >= 2 and fits:
            return (width, split, stages, lag) if split <= BWD_SMEM_MAX_SPLIT else None
        if (lagless is None and lag and n_cols % width == 0 and split <= BWD_SMEM_NOLAG_MAX_SPLIT
                and width * (weight_bytes + 2 * staged_bytes) <= BWD_SMEM_BYTES):  # fmt: skip
            lagless = (width, split, 2, False)
        width //= 2
    if lagless is not None:  # e.g. 16K-column slices of 16-bit rows beside fp32 weights
        return lagless
    # Two slices of a power of two + a tail (whole multiples of 16 columns each), 2 rows deep.
    if not (x1 and BWD_SMEM_X1_TAILS and n_cols >= 32 and n_cols % 32 == 0):
        return None
    width = n_cols // 2
    block, tail = slice_parts(width)
    tailed = block <= BWD_SMEM_SLICE_MAX and 4 * tail >= block and tail & (tail - 1) == 0
    tailed = tailed and width * staged_bytes >= BWD_SMEM_SLICE_MIN_BYTES
    if tailed and width * (weight_bytes + 2 * staged_bytes) <= BWD_SMEM_BYTES:
        return width, 2, 2, False
    return None


def slice_parts(width: int) -> tuple[int, int]:
    """(block, tail) of a slice of ``width`` columns (bwd_smem_slices): the widest power of two
    in it and what is left (0 for a power of two), each held in a layout of its own."""
    block = 1 << (width.bit_length() - 1)
    return block, width - block


def bwd_smem_partials(
    n_cols: int, elem_bytes: int, partials: int, kind: str | None, device: torch.device,
    w4: bool, aligned: bool, staged_bytes: int, rms_norm: bool = False,
) -> bool:  # fmt: skip
    """Whether the backward runs smem_kernels' kernel. ``kind`` is what the kernel must do
    beyond a norm: "plain" (a norm of x alone), "residual" (a residual gradient in and/or out,
    x's dropout: taken where BWD_SMEM_RESIDUAL), "x1" (x1's second output, weight1 and dy1,
    with x1's gradient the same tensor as x's, and a residual as "residual" has it: taken
    where BWD_SMEM_X1) or None (anything the kernel does not do: x1's gradient of its own,
    rowscale, layerscale). Further: two partials (the weight's and the bias's; with "x1" four,
    the second weight's and bias's too), or one ("plain" or "residual": a norm without a bias,
    where BWD_SMEM_ONE_PARTIAL, but for 4-byte rows in more than
    BWD_SMEM_ONE_PARTIAL_MAX_SPLIT_4B slices and, with ``rms_norm``, a whole row of
    BWD_SMEM_MAX_COLS), bwd_smem_width's widths, the rows' tensors 16-byte aligned with row
    strides of multiples of 16 elements (``aligned``: its copies move 16 bytes), on an NVIDIA
    GPU of compute capability 9 or more whose blocks may take Hopper's shared memory; and
    either whole rows of 16-bit elements (``elem_bytes``, the widest row tensor's), with a
    residual up to BWD_SMEM_RESIDUAL_MAX_COLS, or rows in slices (bwd_smem_sliced; where
    bwd_smem_slices has a layout for ``staged_bytes`` per column, the staged rows' s, dy and
    any dresidual_out and dy1, beside weights of ``w4``'s bytes): of x alone, or with a
    residual of 4-byte elements in at most BWD_SMEM_RESIDUAL_MAX_SPLIT slices; x1's path
    always in slices. 16-bit rows beside 4-byte parameters (``w4``) only where
    BWD_SMEM_W4_16BIT; slices without LAG where it would be due (bwd_smem_slices' second
    pass) only for those, and with one partial in at most BWD_SMEM_NOLAG_ONE_PARTIAL_MAX_SPLIT
    of them. The kernel is Gluon's: never under the interpreter."""
    kinds = ((2, "plain"), (2, "residual"), (4, "x1"))
    if BWD_SMEM_ONE_PARTIAL:
        kinds += ((1, "plain"), (1, "residual"))
    if not BWD_SMEM_PARTIALS or (partials, kind) not in kinds:
        return False
    if (kind == "residual" and not BWD_SMEM_RESIDUAL) or (kind == "x1" and not BWD_SMEM_X1):
        return False
    # The cheap tests first: most rows are not of the kernel's widths.
    if not (aligned and bwd_smem_width(n_cols) and _nvidia(device)) or INTERPRETED:
        return False
    if w4 and elem_bytes == 2 and not BWD_SMEM_W4_16BIT:  # 16-bit rows beside 4-byte weights
        return False
    if bwd_smem_sliced(n_cols, elem_bytes, kind):
        x1 = kind == "x1"
        slices = bwd_smem_slices(n_cols, staged_bytes, (4 if w4 else 2) * (1 + x1), x1)
        if not BWD_SMEM_SPLIT or slices is None:
            return False
        if kind == "residual" and (elem_bytes != 4 or slices[1] > BWD_SMEM_RESIDUAL_MAX_SPLIT):
            return False
        if partials == 1 and elem_bytes == 4 and slices[1] > BWD_SMEM_ONE_PARTIAL_MAX_SPLIT_4B:
            return False
        # Slices without LAG where it would take 3 (bwd_smem_slices): as measured, 16-bit rows
        # beside 4-byte weights only, and with one partial in fewer slices.
        if slices[1] >= BWD_SMEM_LAG_MIN_SPLIT and not slices[3]:
            if not (w4 and elem_bytes == 2):
                return False
            if partials == 1 and slices[1] > BWD_SMEM_NOLAG_ONE_PARTIAL_MAX_SPLIT:
                return False
    elif elem_bytes != 2:
        return False
    elif kind == "residual" and n_cols > BWD_SMEM_RESIDUAL_MAX_COLS:
        return False
    elif partials == 1 and rms_norm and n_cols == BWD_SMEM_MAX_COLS:  # kernels.py's is faster
        return False
    from . import smem_kernels

    return smem_kernels.AVAILABLE and _smem_ok(device.index)


# Which rows of smem_kernels' backward keep the partial dW in registers and the weight in
# shared memory (as stored, widened at each of its two reads a row) instead of the other way
# round (bwd_smem_dw_regs): "measured", True (every row) or False (none).
BWD_SMEM_DW_REGS = "measured"


def bwd_smem_dw_regs(dres_out: bool, weight_dtype: torch.dtype, tail: int) -> bool:
    """Whether smem_kernels' backward keeps partial dW in registers and the weight in shared
    memory (BWD_SMEM_DW_REGS): under "measured", rows with dresidual_out staged (the three
    staged rows fit 2 deep at 16384 columns only beside the 16-bit weight, not beside the
    fp32 dW), rows with bf16 weights (``weight_dtype``), and rows held as 8192 + a ``tail``
    (bwd_smem_layout; 0: one block of 16384); so all but fp16 weights of one-block rows.

    Graph replay, H200, 2026-11-25 (bench/NOTES.md #72), two runs each, dW in shared memory
    -> registers: dropout + add + LayerNorm, prenorm, bf16 16384 68.1-68.2% of copy (the
    exchange: the kernel did not fit) -> 82.8-84.2%, 14336 65.6-66.3 -> 79.2-79.6%, 12288
    84.7-84.9 -> 86.3-86.7%, 11264 79.2-79.6 -> 80.8-81.5%, 10256 71.1-71.2 -> 73.8%; fp16
    16384 69.4-69.6 (exchange) -> 82.1-83.3%, 12288 86.3-86.4 -> 89.0-89.1%. LayerNorm alone,
    bf16: 16384 84.2 -> 90.0%, 12288 79.9-80.0 -> 84.6-84.7%, 10256 66.1-66.2 -> 69.9-70.1%;
    fp16 12288 79.4-79.6 -> 86.7-86.8%, 10256 66.3-66.5 -> 72.0-72.1%, but 16384 89.5-89.8 ->
    87.1-87.7% (both 128 registers without spills offline: not a register limit; not
    explained)."""
    if BWD_SMEM_DW_REGS is True or BWD_SMEM_DW_REGS is False:
        return BWD_SMEM_DW_REGS
    return dres_out or weight_dtype == torch.bfloat16 or tail > 0


def bwd_smem_layout(
    n_cols: int, dres_out: bool = False, weight_dtype: torch.dtype = torch.bfloat16
) -> tuple[int, int, int]:
    """(block_n, tail, stages) of smem_kernels' kernel: a power-of-two row is one block;
    another is held as 8192 columns and a power-of-two tail, ``block_n`` then being the padded
    16384 (kernels.py's convention: ``block_n // 2`` then ``tail``); rows of s and dy (and with
    ``dres_out`` of dresidual_out) staged ``stages`` deep, as many as fit beside the fp32
    partial dW (or, where bwd_smem_dw_regs keeps dW in registers, beside the weight as stored,
    ``weight_dtype``) up to BWD_SMEM_MAX_STAGES (2: 3 stages at 12288 columns measured 0.1-0.5
    points behind 2, bench/NOTES.md #70); one beside an fp32 weight where dresidual_out is
    staged at 16384 columns."""
    block_n, tail = next_power_of_2(n_cols), 0
    if block_n > 8192 and block_n != n_cols and next_power_of_2(n_cols - 8192) < 8192:
        tail = next_power_of_2(n_cols - 8192)
    held = block_n // 2 + tail if tail else block_n
    staged = 2 * held * (3 if dres_out else 2)
    # the weight as stored, or the fp32 partial dW
    fixed = (weight_dtype.itemsize if bwd_smem_dw_regs(dres_out, weight_dtype, tail) else 4) * held
    return block_n, tail, min(BWD_SMEM_MAX_STAGES, (BWD_SMEM_BYTES - fixed) // staged)


@functools.cache
def _smem_ok(index) -> bool:
    """Compute capability 9+ (_sm90) and blocks that may take the kernel's shared memory
    (max_shared): Hopper's 227 KB (BWD_SMEM_BYTES and what the kernel's reductions use)."""
    return _sm90(index) and max_shared(index) >= BWD_SMEM_BYTES + 2048


# The backward of LayerNorm sums c1 = sum(xhat * wdy) and c2 = sum(wdy) of a row (or, where
# column blocks exchange row sums, of its block) in one reduction (kernels._pair_sums: one
# exchange between warps instead of two) where that measured faster (bwd_joint_row_sums).
# ``FUSED_NORM_BWD_JOINT=0`` turns it off (for A/B sweeps).
BWD_JOINT_ROW_SUMS = os.environ.get("FUSED_NORM_BWD_JOINT", "1") != "0"


def bwd_joint_row_sums(
    block_n: int, num_chunks: int, tail: int, partials: int, stages: int, dropout: bool
) -> bool:
    """Whether the backward sums LayerNorm's c1 and c2 in one reduction. Graph replay, H200,
    bf16, 2026-11-24 (bench/NOTES.md #48), two sums -> one: one-block rows, two runs each, the
    x1 path at 8192 columns 66 -> 95% of copy (its two sums had spilled at 16 warps),
    LayerNorm at 1K / 2K +1.6 / +0.7 points, dropout + LayerNorm even, but the x1 path at 1K
    columns (2 warps, rows pipelined) 86 -> 76% and LayerNorm at 12288 held as two blocks 62.4
    -> 56.4%: not there. Exchanged blocks' words: LayerNorm 12288 61.2 -> 63.7%, 64K 61.8 ->
    62.9%, the x1 path 16K 62.4 -> 63.9%, but with dropout 16K 67.6 -> 62.4%: not with dropout.

    Rows held as 8192 + a tail of at most 2048 in place of the exchange (bwd_block_config, #65)
    take one pair of sums per block (two reductions instead of four). Graph replay, H200,
    2026-11-25 (bench/NOTES.md #69), two runs each, four sums -> two: LayerNorm 9216 / 10240
    bf16 82.7-84.5 -> 86.1-86.5% of copy, fp16 10240 82.8-83.4 -> 86.6-86.7%, fp32 84.0-88.9
    -> 85.1-90.3%; dropout + add + LayerNorm bf16 67.7-73.9 -> 70.8-74.6%, fp32 72.5-75.4 ->
    79.0-81.4%, bf16 x with an fp32 stream 71.1-71.8 -> 78.6-78.7%; with fp32 weights beside
    bf16 rows LayerNorm even (77.0-77.1 -> 76.9-78.2%), dropout + add + LayerNorm 61.2-61.3 ->
    60.0% (the one cell behind). So do those held as 4096 + 1024 with dropout (dropout + add +
    LayerNorm at 5120; same call, two runs): bf16 87.7-87.9 -> 90.7-90.8%, fp32 89.5-89.7 ->
    91.7%, bf16 x with an fp32 stream 83.2-83.3 -> 90.0-91.7%, with fp32 weights 79.0-79.1 ->
    88.8-89.0%. Without dropout they keep four: LayerNorm at 5120 even (bf16 90.4-91.0 vs
    90.0-90.7%, fp16, fp32 and fp32 weights within a point), at 6144 (4096 + 2048) behind (bf16
    79.9-80.9 -> 79.4-79.5%, fp32 84.6-84.7 -> 76.3-76.4%); the x1 path at 5120 mixed (bf16 94.7
    -> 92.8-95.6%, fp32 stream 81.0 -> 82.7%); 12288 above."""
    if not BWD_JOINT_ROW_SUMS:
        return False
    if tail:
        return bwd_held_row(block_n, tail) or (dropout and partials == 2)
    if num_chunks > 1:
        return not dropout
    return not (partials >= 4 and block_n == 1024 and stages > 1)


# Triton 3.9 adds the values a thread holds of a row sum in a tree (triton-lang/triton#9220;
# 3.6 added them one after another). In RMSNorm's backward of x alone in one 4096-column block
# on 4 warps (2049-4096 columns, 16-bit rows and weights) ptxas then issued three of the row's
# twelve 16-byte loads after the maths on the rest (offline SASS, 127 registers against 3.6's
# 128): each thread's four repeats of the layout are folded in order before the tree
# (kernels._fold_repeats) on Triton BWD_SUM_REPEATS_FROM or later, and the loads are all
# issued first again. Bench-style A/B of triton 3.9's cubins (H200, 2026-11-26, bench/NOTES.md
# #117), tree -> folded: bf16 4096 230.0 -> 216.8 us (3.6: 216.3), fp16 4096 228.5 -> 215.5
# (3.6: 216.1), bf16 3072 251.3 -> 220.6 (3.6: 219.2); on 3.6 the fold was even or behind
# (216.6 -> 216.8, 215.8 -> 216.4, 219.6 -> 220.5), so it is left out there. Offline (3.9) the
# fold did not help the other one-block rows (their repeats counted alike, two each): add +
# RMSNorm at 4096 (8 warps) 74 -> 123 registers, at 5120 (16 warps) 16 -> 64 bytes spilled;
# RMSNorm at 2048 spilled 16 bytes (none unfolded), at 8192 unchanged; LayerNorm at 1024 (its
# joint sums folded) 115 -> 118 registers.
BWD_SUM_REPEATS_FROM = (3, 9)
BWD_SUM_REPEATS_LAYOUTS = ((4096, 4),)  # (block, warps) of the rows above


def bwd_sum_repeats(block_n: int, num_chunks: int, tail: int, tile_rows: int, warps: int,
                    plain_rms: bool, elem_bytes: int, w4: bool,
                    device: torch.device) -> int:  # fmt: skip
    """How many repeats of its layout each thread's values of a backward row sum are folded
    over before the sum (kernels._fold_repeats; 1: not folded): 4 on Triton
    BWD_SUM_REPEATS_FROM or later for RMSNorm of x alone without a bias or a zero-centred
    weight (``plain_rms``), in one block on the warps of BWD_SUM_REPEATS_LAYOUTS, of 16-bit
    rows (``elem_bytes``: the widest row tensor) and weights (not ``w4``), on an NVIDIA GPU
    (measured there; a warp of another width repeats the layout another number of times). A
    thread of a 16-bit row holds 8 columns per 16-byte load, so a block of ``block_n``
    columns on ``warps`` warps of 32 threads repeats block_n / (8 * 32 * warps) times."""
    if (
        TRITON_VERSION >= BWD_SUM_REPEATS_FROM
        and _nvidia(device)
        and (block_n, warps) in BWD_SUM_REPEATS_LAYOUTS
        and num_chunks == 1
        and not tail
        and tile_rows == 1
        and plain_rms
        and elem_bytes <= 2
        and not w4
    ):
        return block_n // (8 * 32 * warps)
    return 1


# One-block backward rows that hold their loaded 16-bit s, dy and w across the row sums, and do
# the row's maths again from them after the sums (kernels._held_row_grads, _held_again;
# constexpr RECOMPUTE), instead of holding its fp32 xhat and w*dy there beside the partial
# gradients: LayerNorm of x alone, compiled by Triton BWD_RECOMPUTE_FROM or later. Offline (sm_90, triton 3.9) its
# 1024-column block on 2 warps took 115 -> 96 registers (8 -> 10 programs per SM, as 3.6's 96
# unheld), its 2048 block on 4 warps, under #115's cap of 96, no spill (16 bytes unheld).
# Bench-style A/B of 3.9's cubins (H200, 2026-11-26, bench/NOTES.md #118), backward, unheld
# -> held: bf16 1024 230.6 -> 220.4 us and 230.7 -> 220.5 (two calls; 3.6 217.1-217.4), 784
# 270.6 -> 256.9 (3.6 249.5), 2048 233.9 -> 228.9 (3.6 227.3), fp16 2048 233.2 -> 230.8 (3.6
# 222.3). Left out: fp16 1024 (113 -> 107 registers, 227.6 -> 227.8), bf16 1536 (the padded
# 2048 block: 262.3 -> 265.6), the 512 block on 1 warp (96 -> 114 registers), and every row
# on triton 3.6: there LayerNorm bf16 512 took 95 -> 79 registers (21 -> 25 programs per SM)
# yet ran 221.1 -> 218.5 us (four rounds; the kernel alone 204.0 -> 207.2), fp16 512 215.8 ->
# 217.4, bf16 384 230.9 -> 239.5, 784 249.5 -> 258.4, 1536 257.9 -> 266.7, 1024 217.4 ->
# 221.3, RMSNorm 1024 211.5 -> 214.5.
# Rows: (block, warps, row kind, x's dtype, only rows that fill the block). Row kind "ln" is a
# LayerNorm of x alone with a bias and a plain weight (no residual, dropout, rowscale,
# layerscale or zero-centred weight); rows and weights 16-bit, of one dtype. Only widths of a
# multiple of 16 columns (BWD_RECOMPUTE_ALIGN): Triton specialises such widths (and strides),
# and the masked loads of others took more registers held than not (3.6, 300 / 500 columns:
# 128 -> 151; 3.9, 600 / 1000: 154 -> 175).
BWD_RECOMPUTE_FROM = (3, 9)
BWD_RECOMPUTE_ROWS = (
    (1024, 2, "ln", "bf16", False),
    (2048, 4, "ln", "bf16", True),
    (2048, 4, "ln", "fp16", True),
)
BWD_RECOMPUTE_ALIGN = 16


def bwd_recompute(block_n: int, num_chunks: int, tail: int, tile_rows: int, stages: int,
                  exchange: bool, warps: int, row_kind: str, dtype: str, w4: bool,
                  n_cols: int, device: torch.device) -> bool:  # fmt: skip
    """Whether a backward row holds its loads across its row sums (kernels' RECOMPUTE): one
    block without a tail, a tile or a pipeline (``stages`` 1), not exchanging, on an NVIDIA GPU
    (the hold is inline PTX), with Triton BWD_RECOMPUTE_FROM or later, where
    BWD_RECOMPUTE_ROWS lists the block, ``warps``, ``row_kind`` ("ln", or "" for a row it
    does not name) and ``dtype`` (of s and dy: "bf16" / "fp16", or "" for others), with
    weights of 16 bits (not ``w4``) and a width ``n_cols`` that BWD_RECOMPUTE_ALIGN divides
    (equal to the block where the row says so)."""
    if not (
        TRITON_VERSION >= BWD_RECOMPUTE_FROM
        and n_cols % BWD_RECOMPUTE_ALIGN == 0
        and num_chunks == 1
        and not tail
        and tile_rows == 1
        and stages == 1
        and not exchange
        and row_kind
        and dtype
        and not w4
        and _nvidia(device)
    ):
        return False
    return any(
        (block, w, kind, dt) == (block_n, warps, row_kind, dtype)
        and (n_cols == block_n or not full)
        for block, w, kind, dt, full in BWD_RECOMPUTE_ROWS
    )


def bwd_exchange_reload(partials: int) -> bool:
    """Whether the exchange's row sums come from one more read of the words after a barrier
    (kernels._exchanged_row_sums): with four partials (the x1 path) that measured faster."""
    return partials >= 4


def bwd_exchange_fits(num_chunks: int, partials: int, device: torch.device) -> bool:
    """Whether rows of ``num_chunks`` column blocks exchange their row sums, with ``partials``
    parameter gradients: a row block's programs wait for each other, so they must fit on the
    device at once even at one program per multiprocessor (kernels.py); and with two or more
    partials at most BWD_EXCHANGE_MAX_CHUNKS_MULTI blocks (where measured to pay). Other rows
    take the row-sums pre-pass. The interpreter's wait is bounded: any count."""
    if INTERPRETED:
        return True
    return num_chunks <= sm_count(device) and (
        partials == 1 or num_chunks <= BWD_EXCHANGE_MAX_CHUNKS_MULTI
    )


def bwd_exchange(device: torch.device) -> bool:
    """Whether the backward of rows wider than one block exchanges row sums on ``device``."""
    return BWD_EXCHANGE and (_nvidia(device) or INTERPRETED)


# A backward row just wider than its block cap is held as that block + a tail of at most
# 1 / BWD_HELD_TAIL_DIV of it in place of column blocks (bwd_block_config; 0: never).
BWD_HELD_TAIL_DIV = 4


def bwd_held_row(block_n: int, tail: int) -> bool:
    """Whether a one-block row of a padded 16384 held as 8192 + ``tail`` is one that
    bwd_block_config holds in the exchange's place (a tail of at most 1 / BWD_HELD_TAIL_DIV of
    the block cap), as opposed to LayerNorm's 12288 = 8192 + 4096 without the exchange."""
    return bool(BWD_HELD_TAIL_DIV) and block_n == 16384 and 0 < tail * BWD_HELD_TAIL_DIV <= 8192


def bwd_block_config(
    n_cols: int,
    elem_bytes: int,
    partials: int,
    dropout: bool = False,
    exchange: bool = False,
    w4: bool = False,
) -> tuple[int, int]:
    """(BLOCK_N, NUM_CHUNKS) of the backward, with ``partials`` parameter-gradient vectors.

    The block caps (BWD_MAX_BLOCK_BYTES*) count columns of 16 bits whatever ``elem_bytes``:
    the registers a column takes (fp32 values and partials) do not depend on the dtype read.
    Graph-replay sweep of 2026-11-23 (H200, fp32 rows, bench/NOTES.md #36), one block instead
    of 4K-column blocks after the row-sums pre-pass: RMSNorm at 16K columns 60 -> 85% of copy,
    add + RMSNorm 68 -> 98%; LayerNorm at 8K 59 -> 93%, dropout + add + LayerNorm 69 -> 90%,
    the x1 path 63 -> 85%.

    16-bit rows with two partials and no dropout (LayerNorm) up to one and a half times the
    block cap (8K-12K columns) stay one block, held as two (bwd_block_tail: 12288 = 8192 +
    4096), instead of column blocks after the row-sums pre-pass, which reads s and dy twice:
    LayerNorm at 12288, 49.5 -> 62.0% of copy (graph replay, H200, 2026-11-23, bench/NOTES.md
    #30); with dropout even (58.5 -> 60.0%), and one padded 16K block lost at 16384 (53.8 ->
    48.4%). Where the column blocks exchange their row sums (``exchange``) those rows take
    the exchange instead: LayerNorm at 12288, 62.4 -> 63.7% (bench/NOTES.md #48).

    But rows with two partials, with or without dropout, whose tail is at most a quarter of the
    block cap (BWD_HELD_TAIL_DIV; 8K-10K columns: 8192 + 2048 at most) stay one block held as
    two, in the exchange's place too, pipelined over the rows their buffers allow (3 of 16-bit
    rows, 2 or 1 of 4-byte: bwd_row_stages) on one wave of programs (bwd_whole_waves); so do
    16-bit rows with one partial and no dropout at 16K-20K columns (16384 + 4096 at most, on 16
    warps, unpipelined; with 4-byte weights (``w4``) 16384 + 2048 at most). Two partials, graph
    replay, H200, bf16, 2026-11-25 (bench/NOTES.md #65), two runs, exchange -> held: LayerNorm
    at 9216 60.5-60.7 -> 82.4-83.1% of copy, at 10240 64.9-65.0 -> 82.5-84.3%, dropout + add +
    LayerNorm at 10240 66.1-66.3 -> 73.7-73.8%; with a 4096-column tail the held row lost
    (11264: 61.8 -> 57.9%, 12288: 65.1-65.2 -> 59.0-59.4%). The rule against the old plans in
    one call, two runs each, 16 cells (9216 and 10240 columns, bf16 and fp16 rows, bf16 and fp32
    weights): every cell ahead in both runs, LayerNorm 60.0-66.2 -> 72.1-84.5%, dropout + add +
    LayerNorm (with fp32 weights the pre-pass before) 51.8-67.1 -> 61.3-73.4%. One partial,
    graph replay, two runs (#65): RMSNorm at 18432 68.0 -> 89.6-89.7%, 20480 67.1-67.2 ->
    73.0-73.1% (24576, an 8K tail, lost: 67.6-67.9 -> 56.2-57.0%), add + RMSNorm 73.1-73.3 ->
    87.7-87.9% and 72.5-72.6 -> 78.5% (24576: 73.2-73.5 -> 45.2-45.5%); on 32 warps 56.7-86.2%,
    pipelined over 2 rows 40.5-56.8%. Against the old plans (16 cells as above, two runs): 18432
    ahead in every cell, RMSNorm 67.8-70.7 -> 87.5-89.5%, add + RMSNorm 72.8-74.1 -> 84.2-87.4%;
    20480 with 16-bit weights RMSNorm 67.4-70.3 -> 72.8-77.7%, add + RMSNorm 72.1-73.6 ->
    78.2-84.7%, but with fp32 weights -1.7 to +1.8 points (fp16 rows' RMSNorm 69.8-70.0 ->
    68.3-68.8%), hence the narrower tail there.
    Rows of 4-byte elements (fp32 rows, bf16 x with an fp32 stream), graph replay, H200,
    2026-11-25 (bench/NOTES.md #68), two runs, exchange -> held: two partials ahead in every
    cell, LayerNorm fp32 at 9216 / 10240 77.5-78.1 -> 84.0-88.9% of copy, dropout + add +
    LayerNorm fp32 66.8-69.2 -> 73.0-75.4%, with an fp32 stream 62.9-66.8 -> 71.2-72.0% (bf16
    weights) and 48.3-52.4 -> 65.3-66.5% (fp32 weights); one partial lost or was even (add +
    RMSNorm at 18432 fp32 83.1-84.2 -> 82.1-82.2%, with an fp32 stream 78.9-82.3 -> 75.2-79.6%,
    at 20480 82.6 -> 72.6%; RMSNorm fp32 81.2-81.9 -> 83.1-83.6%), so it holds 16-bit rows only."""
    cap = BWD_MAX_BLOCK_BYTES if partials <= 1 else BWD_MAX_BLOCK_BYTES_MULTI
    block_n, num_chunks = block_config(n_cols, min(elem_bytes, 2), cap)
    held = BWD_TAIL_BLOCKS_LN if partials == 2 else BWD_TAIL_BLOCKS_ONE
    div = BWD_HELD_TAIL_DIV * (2 if w4 and partials == 1 else 1)
    if (div and num_chunks == 2 and (n_cols - block_n) * div <= block_n
            and (partials == 2 or (partials == 1 and not dropout and elem_bytes == 2))
            and (TAIL_BLOCKS is True or (TAIL_BLOCKS and 2 * block_n in held))):  # fmt: skip
        return 2 * block_n, 1
    if (num_chunks == 2 and partials == 2 and not dropout and elem_bytes == 2 and not exchange
            and 2 * n_cols <= 3 * block_n
            and (TAIL_BLOCKS is True or (TAIL_BLOCKS and 2 * block_n in BWD_TAIL_BLOCKS_LN))):  # fmt: skip
        return 2 * block_n, 1
    if num_chunks > 1:
        if exchange:  # in 16-bit columns (registers per column do not depend on the dtype),
            # but in bytes with four partials (the x1 path: fp32 or fp32-stream rows of 2K
            # columns measured 4-6 points below 1K, bench/NOTES.md #44)
            eb = elem_bytes if partials >= 4 else min(elem_bytes, 2)
            block_n, num_chunks = block_config(n_cols, eb, BWD_EXCHANGE_TILE_BYTES)
        else:  # the row-sums pre-pass's column blocks
            x1_16 = partials >= 4 and elem_bytes == 2 and not w4
            tile = BWD_TILE_BYTES_X1 if x1_16 else BWD_TILE_BYTES
            block_n, num_chunks = block_config(n_cols, elem_bytes, tile)
    return block_n, num_chunks


def bwd_layout(
    n_cols: int,
    elem_bytes: int,
    partials: int,
    dropout: bool,
    plain: bool,
    exchange: bool = False,
    w4: bool = False,
) -> tuple[int, int, int, int]:
    """(BLOCK_N, NUM_CHUNKS, TAIL_N, warps) of the backward: the padded block and its column
    blocks (bwd_block_config; with ``exchange``, those of rows wider than a block exchange
    their row sums: bwd_exchange), the tail where that block is held as two (bwd_block_tail:
    its first block is then BLOCK_N // 2) and the warps (bwd_num_warps)."""
    block_n, num_chunks = bwd_block_config(n_cols, elem_bytes, partials, dropout, exchange, w4)
    tail = bwd_block_tail(n_cols, block_n, num_chunks, partials, dropout, plain, elem_bytes)[1]
    if num_chunks > 1 and exchange:
        return block_n, num_chunks, tail, BWD_EXCHANGE_WARPS
    warps = bwd_num_warps(block_n, partials, dropout, tail, plain, elem_bytes, n_cols)
    return block_n, num_chunks, tail, warps


# The backward's persistent grid holds no more programs than fit on the device at once, as the
# compiled kernel's registers and shared memory allow (ops asks the driver's occupancy
# calculator, Launcher.resident). Launched past that, programs ran in further waves, the last
# often partial: LayerNorm at 2048 columns holds 96 registers per thread, so 5 programs of 4
# warps fit per SM, not the 8 that BWD_WARPS_PER_SM asked for. Graph-replay sweep of
# 2026-11-24 (H200, bf16, bench/NOTES.md #43), one wave against the old grid: LayerNorm 2K
# 74 -> 82% of copy, 5120 81 -> 88%, the x1 path 256 68 -> 85%, 4K 83 -> 91%, RMSNorm 8K 88
# -> 92%; rows wider than a block +0.5 to +2. Where whole waves of the old grid ran faster,
# bwd_whole_waves keeps them.
BWD_RESIDENT_GRID = True


def bwd_whole_waves(
    block_n: int, num_chunks: int, tail: int, partials: int, dropout: bool, plain: bool
) -> bool:
    """Keep the BWD_WARPS_PER_SM grid (whole waves of resident programs) instead of one wave
    (BWD_RESIDENT_GRID), where that measured faster in the same sweep (two runs each): RMSNorm
    of x alone at 4096 columns (89.0 vs 84.0% of copy: 2 waves of 4 programs per SM),
    dropout + add + LayerNorm in one block of 512-2048 columns (512: 88.8 vs 85.8%, 2048: 88.0
    vs 86.0%, 1024 even), LayerNorm at 12288 as 8192 + 4096 (62.5 vs 60.1%); not with a tail of
    at most 2048 columns (LayerNorm at 9216 / 10240: one wave 82.4-84.3%, whole waves 78.0-80.8%,
    #65)."""
    if num_chunks > 1:
        return False
    if dropout and partials == 2 and not tail and 512 <= block_n <= 2048:
        return True
    if plain and partials == 1 and block_n == 4096 and not tail:
        return True
    return tail > 0 and block_n == 16384 and partials == 2 and not bwd_held_row(block_n, tail)


def bwd_num_programs(
    n_rows: int, device: torch.device, num_warps: int, num_chunks: int, resident: int = 0
) -> int:
    """Row blocks of the backward's persistent grid (each has ``num_chunks`` column programs):
    BWD_WARPS_PER_SM worth of programs in all, but no more per SM than ``resident`` (the
    programs that fit on one at once; 0: unknown), at most one row block per row."""
    per_sm = max(BWD_WARPS_PER_SM // num_warps, 1)
    if resident:
        per_sm = min(per_sm, resident)
    return max(min(sm_count(device) * per_sm // num_chunks, n_rows), 1)


# The sum of the backward's partial parameter gradients over its row blocks, cast to each
# parameter's dtype (kernels._sum_partials_kernel, one launch for all of them): a program per
# column block of each partial walks the row blocks in tiles of PARTIALS_SUM_TILE fp32 values,
# pipelined over 3 tiles where it walks 3 or more. Column blocks narrow down from 256 to 16
# columns until the grid has two programs per SM. Graph replay, H200, 2026-11-24 (bench/NOTES.md
# #51), at the backward's partials for 128M bf16 elements: 2.8-5.6 us from 1 to 4 partials of
# 256-256K columns, where torch's sum over the row blocks and a cast per gradient took 4.3-14.8
# us; 32-column blocks took 9.3 us at 256 columns (4224 row blocks, pipelined), and pipelining
# one or two tiles cost 0.3-3.8 us.
PARTIALS_SUM_TILE = 4096
PARTIALS_SUM_WARPS = 4
# Where the backward has fewer row blocks than a 256-column tile holds (16: rows wider than one
# block, whose column programs or slices share the SMs, e.g. 4 row blocks at 256K columns), the
# tile holds just those row blocks and is that much wider, not mostly masked rows. Bench-style,
# H200, 2026-11-26 (bench/NOTES.md #88), four rounds: the sum 9.2 -> 6.8 us (the x1 path 256K),
# 6.1 -> 4.0 (LayerNorm 256K), 6.0 -> 3.9 (the x1 path 128K), forward + backward 0.4-3.1 us
# less; the benchmark's backward rows at 128K-256K 0.7% faster (median; -1.9 to +0.5%).
PARTIALS_SUM_WIDE = True


def partials_sum_layout(
    n_cols: int, partials: int, programs: int, device: torch.device
) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_P, STAGES) of the partials' sum: columns per program, row blocks per tile
    and the tiles in flight, for ``programs`` row blocks (those of an unbounded row count: the
    row count does not choose the kernel)."""
    block_n = 256
    if PARTIALS_SUM_WIDE and programs < PARTIALS_SUM_TILE // block_n:
        block_n = PARTIALS_SUM_TILE // next_power_of_2(programs)  # a tile of all the row blocks
    while block_n > 16 and cdiv(n_cols, block_n) * partials < 2 * sm_count(device):
        block_n //= 2
    block_p = PARTIALS_SUM_TILE // block_n
    return block_n, block_p, 3 if programs >= 3 * block_p else 1


@torch.compiler.assume_constant_result
def sm_count(device: torch.device) -> int:
    """Multiprocessor count of ``device`` (not of ``cuda:0``), or a fallback.

    A constant to torch.compile: it is read once while tracing, not traced into."""
    return _sm_count(device.type, device.index)


@functools.cache
def _sm_count(device_type: str, index) -> int:
    module = getattr(torch, device_type, None)
    get_props = getattr(module, "get_device_properties", None)
    if get_props is None or device_type == "cpu":
        return FALLBACK_SM_COUNT
    props = get_props(index if index is not None else module.current_device())
    # CUDA and ROCm: multi_processor_count; Intel XPU: gpu_subslice_count.
    for name in ("multi_processor_count", "gpu_subslice_count"):
        count = getattr(props, name, None)
        if count:
            return int(count)
    return FALLBACK_SM_COUNT


def device_guard(device: torch.device):
    """Make ``device`` current so Triton launches there, on that device's current stream."""
    module = getattr(torch, device.type, None)
    if device.type == "cpu" or module is None or not hasattr(module, "device"):
        return contextlib.nullcontext()
    return module.device(device)

"""Helpers shared by the forward and backward kernels (and the Gluon backward): the dropout
draws, the paired sums, the packing of a program's partial sums into one 64-bit word. Why:
docs/design.md, 'Dropout' and 'Forward: how a row is laid out'. Like every kernel file, this
imports nothing from the host layers: the interpreter flag is read from the environment, as
Triton reads it.
"""

import os

import triton
import triton.language as tl

# Whether kernels run in Triton's CPU interpreter (as Triton decides: TRITON_INTERPRET set and
# not "0", read when this module is imported).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# LayerNorm's M2 from one joint reduction of (s, s^2) is kept while sum(s^2) <= CANCEL_RATIO *
# M2 (see _cancels).
CANCEL_RATIO = tl.constexpr(8.0)
# Triton's interpreter runs a tl.reduce with a combine function element by element in Python:
# slow, and a sequential sum, less accurate than the tree a GPU (or its numpy tl.sum) adds in.
JOINT_SUMS = tl.constexpr(not INTERPRETED)
# Triton's default L2 eviction policy of a load, passed explicitly to helpers (a constexpr: a
# plain "" argument is not one). Never a parameter default: Inductor copies kernel sources
# without the globals their defaults name (tests/test_traced.py).
NO_EVICT = tl.constexpr("")


# ----------------------------------------------------------------------------------------------
# Dropout
#
#   keep(seed, col) = bits(seed, col) + 0.5 > p * 2**16,  bits: 16 of Philox4x32-10's output
#   dropout(x) = keep ? x / (1 - p) : 0
# ----------------------------------------------------------------------------------------------


@triton.jit
def _keep_mask(SEEDS, seed_row, col0, dropout_p, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """Dropout keep-decisions of columns ``[col0, col0 + BLOCK_N)`` of one row, or with ROWS > 0
    of ROWS rows (``seed_row`` a (ROWS, 1) tensor; the result is (ROWS, BLOCK_N)).

    Each decision takes 16 random bits: one Philox4x32-10 call (``tl.randint4x``) gives four
    32-bit numbers, i.e. eight 16-bit halves, for eight adjacent columns in a fixed interleaving.
    A column is dropped when its 16 bits fall below ``round(p * 2**16)``, so the drop
    probability is p rounded to a multiple of 2**-16 (off by at most 2**-17 ~ 7.6e-6).
    ``col0`` and BLOCK_N are multiples of 8, so the decision depends on (seed, column) alone.
    ``SEEDS`` is the seeds' pointer, or the call's int64 key (the forward's SEED_KEY).
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
    reshaped to ``(..., 8 * octet.shape[-1])`` they are in column order. Shared with hopper.py
    (Gluon calls it on tensors with layouts), so both draw the same mask."""
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


# ----------------------------------------------------------------------------------------------
# Sums
#
#   _sums(s) = (sum(s), sum(s^2));  M2 = sum(s^2) - sum(s) * mean,
#   taken again as sum((s - mean)^2) where sum(s^2) > CANCEL_RATIO * M2 (_cancels)
# ----------------------------------------------------------------------------------------------


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
def _sums(s, axis: tl.constexpr):
    """``(sum(s), sum(s * s))`` along ``axis`` in one reduction (_pair_sums)."""
    return _pair_sums(s, s * s, axis)


@triton.jit
def _cancels(squares, m2):
    """Whether ``m2 = squares - total * mean`` lost too much to cancellation, i.e. the mean is
    large against the spread (|mean| > ~2.6 standard deviations): ``m2`` is then recomputed
    exactly over ``s - mean``. Below that the relative error of m2 is at most 8x that of the
    sum of squares (a few ulps of fp32), and one joint reduction replaces two in a row."""
    return squares > CANCEL_RATIO * m2


@triton.jit
def _pack_sums(p1, p2):
    """One int64 word holding a column block's partial row sums: p1's fp32 bits low, p2's
    high. The exchange's workspace starts as -1 (all ones); p2's bits are never all ones (that
    NaN becomes the canonical one), so a published word is told apart by its high half."""
    lo = p1.to(tl.uint32, bitcast=True).to(tl.uint64)
    hi = p2.to(tl.uint32, bitcast=True)
    hi = tl.where(hi == 0xFFFFFFFF, 0x7FFFFFFF, hi).to(tl.uint64)
    return (lo | (hi << 32)).to(tl.int64, bitcast=True)


# ----------------------------------------------------------------------------------------------
# L2 prefetch (exchange words of split rows and slices)
# ----------------------------------------------------------------------------------------------

# One predicated PTX prefetch into L2 of address $1 where $2 is not 0 ($0: a dummy output); the
# second keeps the line in L2 at evict-last priority.
_PREFETCH_L2_ASM = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.u32 $0, 0; @p prefetch.global.L2 [$1]; }"
)
_PREFETCH_L2_LAST_ASM = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.u32 $0, 0; @p prefetch.global.L2::evict_last [$1]; }"
)


@triton.jit
def _prefetch_l2(ptrs, live, EVICT_LAST: tl.constexpr):
    """A PTX ``prefetch.global.L2`` of each of ``ptrs`` where ``live`` (int32) is not 0 (with
    EVICT_LAST at evict-last priority): the line comes into L2 while the program does other work,
    and no register waits for it (inline PTX: NVIDIA GPU builds only; the host asks for it
    there). Called from the Gluon backward too."""
    if EVICT_LAST:
        tl.inline_asm_elementwise(_PREFETCH_L2_LAST_ASM, "=r,l,r", [ptrs, live],
                                  dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    else:
        tl.inline_asm_elementwise(_PREFETCH_L2_ASM, "=r,l,r", [ptrs, live], dtype=tl.int32,
                                  is_pure=False, pack=1)  # fmt: skip

"""Launch heuristics: pure functions from (device, row) to launch plans.

A plan holds everything a launch needs besides its tensors: the kernel's tuning constexprs,
warps, register cap, grid shape. Plans depend on the row width, the dtypes, the flags and the
device, never on the row count (that only sizes the grid), so ``ops`` makes each once per
call signature. The rules below each carry their reason in a line. Measured per-row choices
that beat the rules by at least 3% live in one generated table per GPU architecture
(``fused_norm/tuned/<arch>.py``, written by ``bench/tune.py``); :func:`tuned` reads it.
Nothing here launches or compiles anything.

Units: ``eb`` is the widest row element in bytes, ``wb`` the widest weight element, a "16-bit
column" a column counted as if 2 bytes wide (register use per column does not depend on the
dtype read, so the backward's block caps count those).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from typing import NamedTuple, Optional

import torch

from .kernels.common import INTERPRETED  # noqa: F401 - the rules read it (tests patch it here)

# ---------------------------------------------------------------------------------------------
# The device: the few properties the rules read, in one place.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Device:
    sms: int  # multiprocessors (the CPU interpreter: 4)
    shared: int  # shared memory one program may take, bytes (0: unknown)
    nvidia: bool  # a CUDA GPU: register caps, split rows, the exchange
    arch: str  # "sm90" etc., names the tuned table; "" where none applies
    hopper: bool  # compute capability >= 9 with Hopper's shared memory: the Gluon backward
    pdl: bool = False  # compute capability >= 9: programmatic dependent launch


FALLBACK_SMS = 4
HOPPER_SMEM = 227 * 1024  # what the Gluon backward plans its staging for


@functools.cache
def device(dev: torch.device) -> Device:
    """The properties of ``dev`` the rules read (asked of that device, not of cuda:0)."""
    if dev.type == "cuda" and not INTERPRETED:
        p = torch.cuda.get_device_properties(dev.index if dev.index is not None else 0)
        nvidia = torch.version.hip is None
        shared = getattr(p, "shared_memory_per_block_optin", 0)
        arch = f"sm{p.major}{p.minor}" if nvidia else ""
        pdl = nvidia and p.major >= 9
        hopper = pdl and shared >= HOPPER_SMEM
        return Device(p.multi_processor_count, shared, nvidia, arch, hopper, pdl)
    module = getattr(torch, dev.type, None)
    props = getattr(module, "get_device_properties", None)
    sms = FALLBACK_SMS
    if props is not None and dev.type != "cpu" and not INTERPRETED:
        sms = getattr(props(dev.index or 0), "gpu_subslice_count", 0) or FALLBACK_SMS  # XPU
    return Device(sms, 0, False, "", False)


# ---------------------------------------------------------------------------------------------
# The tuned table of the device's architecture.
# ---------------------------------------------------------------------------------------------


@functools.cache
def _table(arch: str) -> dict:
    if not arch or os.environ.get("FUSED_NORM_TUNED", "1") == "0":
        return {}
    try:
        return importlib.import_module(f"fused_norm.tuned.{arch}").TABLE
    except ImportError:
        return {}


def tuned(d: Device, direction: str, kinds, tags, widths) -> dict:
    """The table entry for a row: the first key ``(direction, kind, tag, width)`` found, kinds,
    tags and widths each from the most to the least specific; ``{}`` where none."""
    table = _table(d.arch)
    if not table:
        return {}
    for kind in kinds:
        for tag in tags:
            for width in widths:
                hit = table.get((direction, kind, tag, width))
                if hit is not None:
                    return hit
    return {}


_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def dtype_tags(x_dtype, stream_bytes: int, weight_bytes: int) -> tuple:
    """A row's table tags: ``bf16``, ``bf16_res32`` (fp32 residual stream), ``bf16_w32`` (fp32
    weights), then the same by element size (``16``, ``16_res32``, ``16_w32``, ``32``), then
    ``e16`` / ``e32`` (the widest row element alone) and ``any``."""
    x = _NAMES.get(x_dtype, "fp32")
    xb = x_dtype.itemsize
    suffix = "_res32" if stream_bytes > xb else "_w32" if weight_bytes > xb else ""
    size = "32" if xb == 4 else "16"
    widest = max(xb, stream_bytes)
    return (x + suffix, size + suffix, f"e{8 * widest}", "any")


def kinds(base: str, is_rms: bool) -> tuple:
    """A row's table kinds: e.g. ``add_rms`` then ``add``; a norm of x alone ``ln`` / ``rms``."""
    norm = "rms" if is_rms else "ln"
    return (f"{base}_{norm}", base) if base else (norm,)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tail(n: int, block: int) -> int:
    """The second block of a row held as two powers of two (``block // 2`` + tail), or 0 where
    that is not narrower than the padded ``block``. Both at least 8 columns: dropout draws its
    random numbers eight columns at a time."""
    main = block // 2
    if main < 16 or n <= main:
        return 0
    tail = max(next_power_of_2(n - main), 8)
    return tail if main + tail < block else 0


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


class FwdRow(NamedTuple):
    """What the forward plan depends on."""

    n: int
    x_dtype: torch.dtype
    elem_bytes: int  # widest of x, y, residual, x1, residual_out
    stream_bytes: int  # the residual stream's element (x's where there is none)
    weight_bytes: int  # widest weight or bias
    base: str  # "" (a norm of x alone), "add" (residual), "drop" (dropout), "x1", "x1drop"
    is_rms: bool
    scaled: bool  # rowscale or layerscale


class FwdPlan(NamedTuple):
    split: int  # programs a row is spread over (1: not split)
    rows: int  # rows per program
    num_warps: int
    maxnreg: Optional[int]
    constexprs: dict  # the tuning constexprs (features are added by ops)
    ws_reset: bool  # split rows clear the next launch's workspace (workspace.py)
    seeds_from_key: bool  # eager dropout seeds derived from a host key in the kernel

    def grid(self, m: int) -> tuple:
        return (m * self.split,) if self.split > 1 else (cdiv(m, self.rows),)


SPLIT_MIN_BYTES = 65536  # rows wider than this spread over programs (register-resident limit)
SPLIT_PART_BYTES = 8192  # a part of a split row: 4K 16-bit columns
MAX_BLOCK_BYTES = 65536  # widest block one program holds in registers
TAIL_BLOCKS = (4096, 8192, 16384)  # padded blocks held as two where narrower
TAILS = "measured"  # True: any block held as two where narrower; False: never (tests)
FWD_TILE_ROWS = 4  # narrow rows per forward program


def forward_plan(d: Device, r: FwdRow) -> FwdPlan:
    """The forward's launch choices for rows like ``r`` on ``d``."""
    eb, n = r.elem_bytes, r.n
    plain = "" if r.base else ("rms" if r.is_rms else "ln")
    dropout = r.base in ("drop", "x1drop")
    x1 = r.base.startswith("x1")
    tags = dtype_tags(r.x_dtype, r.stream_bytes, r.weight_bytes)
    ks = kinds(r.base, r.is_rms)
    pad = next_power_of_2(max(n, 8))
    # Entries for a padded width serve the rows held in that one block (not those held as two).
    two = _fwd_tailed(pad) and _tail(n, pad) and pad > (512 if plain else 256)
    own = tuned(d, "fwd", ks, tags, (n,) if two else (n, f"pad{pad}"))
    row_bytes = n * eb
    # Rows wider than 64 KB do not fit one program's registers: split over programs that
    # exchange their statistics (heavy 16-bit rows from 64 KB: dropout or x1 need the room).
    heavy = dropout or x1
    wide = row_bytes > SPLIT_MIN_BYTES or (row_bytes == SPLIT_MIN_BYTES and heavy and eb == 2)
    part = own.get("part") or (SPLIT_PART_BYTES // eb if wide else 0)
    split = cdiv(n, part) if part else 1
    # A row's parts wait for each other: all of them must run at once (and on NVIDIA GPUs, the
    # only ones measured; the interpreter bounds its wait).
    splittable = (d.nvidia or INTERPRETED) and os.environ.get("FUSED_NORM_SPLIT_ROWS") != "0"
    if split > 1 and splittable and split <= max(d.sms, FALLBACK_SMS if INTERPRETED else 0):
        return _split_plan(d, r, own, part, split, plain, dropout, x1)
    chunk = own.get("chunk", 0)
    if chunk and n > chunk:  # two sweeps over chunks, sums per column lane (measured: table)
        block, chunks, tail, rows = chunk, cdiv(n, chunk), 0, 1
        warps = own.get("warps", 32)
    else:
        block = min(max(pad, 8), MAX_BLOCK_BYTES // eb)
        chunks = cdiv(n, block)
        # Narrow rows: a tile of 4 rows on one warp keeps more rows in flight.
        rows = FWD_TILE_ROWS if chunks == 1 and block <= (512 if plain else 256) else 1
        tail = _tail(n, block) if chunks == 1 and rows == 1 and _fwd_tailed(block) else 0
        warps = own.get("warps") or _fwd_warps(block, chunks, tail, rows, plain)
    maxnreg = own.get("maxnreg")
    # 16-bit dropout rows land just above 64 registers: capped, two 16-warp programs fit an SM.
    if maxnreg is None and dropout and not x1 and eb == 2 and chunks == 1 and 8192 < block <= 16384:
        maxnreg = 64
    kblock = block // 2 if tail else block  # a row held as two blocks: block // 2, then tail
    fills = n == chunks * kblock + tail
    constexprs = dict(
        BLOCK_N=kblock, TAIL_N=tail, NUM_CHUNKS=chunks, ROWS_PER_PROGRAM=rows, SPLIT=1,
        HOLD=0, UNROLL=chunks if own.get("unroll") else 1,
        # The width as a constant where the row fills its blocks: the masks fold away.
        FULL_ROW=own.get("full_row", fills),
        SEEDS_LAST=False, WS_PREFETCH=False, PARAMS_EVICT="",
    )  # fmt: skip
    # The x1 path draws its seeds on the device on 16 warps or more (not measured with a key).
    seeds_from_key = not x1 or warps < 16
    return FwdPlan(1, rows, warps, maxnreg if d.nvidia else None, constexprs, False,
                   seeds_from_key)  # fmt: skip


def _fwd_tailed(block: int) -> bool:
    return TAILS is True or (TAILS == "measured" and block in TAIL_BLOCKS)


def _fwd_warps(block: int, chunks: int, tail: int, rows: int, plain: str) -> int:
    if chunks > 1:
        return 32  # chunked rows: as many loads in flight as an SM takes
    if tail:  # two blocks: 4 warps at padded 4K-8K, 16 at 16K (plain LayerNorm 8)
        return 8 if plain == "ln" and block == 16384 else (16 if block == 16384 else 4)
    if rows > 1:
        return 1
    warps = max(block // 256, 1) if block <= 1024 else {2048: 4, 4096: 8, 8192: 8}.get(block, 16)
    # A norm of x alone moves half the bytes per column: half the warps at 1K-4K.
    if (plain == "ln" and 1024 <= block <= 4096) or (plain == "rms" and block == 1024):
        warps //= 2
    return warps


def _split_plan(d, r, own, part, split, plain, dropout, x1) -> FwdPlan:
    eb = r.elem_bytes
    # x alone in 16 bits (no scales) is held as 16 bits across the wait: half the registers.
    # fp16 LayerNorm widens by one conversion (its exact M2 peaked the bit route's registers);
    # the conversion reads fp16 bits only.
    held = plain and eb == 2 and not r.scaled
    hold = 0 if not held else 2 if r.x_dtype == torch.float16 and not r.is_rms else 1
    # 4 warps a part; a norm of x alone moves half the bytes: 2.
    warps = own.get("warps") or (2 if plain else 4)
    maxnreg = own.get("maxnreg")
    if maxnreg is None and dropout and not x1 and eb == 2:
        maxnreg = 64  # as one-block dropout rows: two programs' worth of parts per SM
    # The exchange words prefetched into L2 (not for RMSNorm alone past 32 parts, nor the x1
    # path past 64: there it lost 2-6%); the weights, read by every row's part, kept in L2
    # unless wider than the row's elements.
    prefetch = d.nvidia and not (plain == "rms" and split > 32) and not (x1 and split > 64)
    constexprs = dict(
        BLOCK_N=part, TAIL_N=0, NUM_CHUNKS=1, ROWS_PER_PROGRAM=1, SPLIT=split, HOLD=hold,
        UNROLL=1, FULL_ROW=own.get("full_row", False) and r.n == split * part,
        SEEDS_LAST=True,  # the stores after the row: off the parts' critical path
        WS_PREFETCH=own.get("ws_prefetch", prefetch),
        PARAMS_EVICT="evict_last" if r.weight_bytes <= eb else "",
    )  # fmt: skip
    # x1's split rows draw their seeds on the device (a key cost them 16%).
    return FwdPlan(split, 1, warps, maxnreg if d.nvidia else None, constexprs,
                   not own.get("ws_fill", False), not x1)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


class BwdRow(NamedTuple):
    """What the backward plan depends on."""

    n: int
    x_dtype: torch.dtype
    s_bytes: int  # the saved pre-norm sum's element
    dy_bytes: int
    stream_bytes: int
    weight_bytes: int
    partials: int  # parameter gradients accumulated: weight, bias, weight1, bias1, layerscale
    base: str  # as FwdRow's
    is_rms: bool
    dropout: bool
    dres_out: bool  # a gradient of the residual stream comes in (prenorm)
    own_dres: bool  # the residual's gradient differs from x's
    own_dx1: bool  # x1's gradient differs from x's
    has_dy1: bool  # a second output (weight1): its gradient dy1 comes in
    x0_bytes: int  # x's element where it is read again (layerscale's gradient), else 0
    scaled: bool  # rowscale or layerscale
    staged_bytes: int  # bytes a column of the rows the Gluon kernel stages (s, dy, ...)
    aligned: bool  # row tensors 16-byte aligned, row strides multiples of 16 elements


class BwdPlan(NamedTuple):
    hopper: bool  # the Gluon shared-memory kernel (kernels/hopper.py)
    num_warps: int
    maxnreg: Optional[int]
    block: int  # padded block (held as block // 2 + tail where tail > 0)
    chunks: int  # column programs per row block (slices for the Gluon kernel)
    tail: int
    exchange: bool  # column programs exchange their row sums (else a pre-pass, if chunks > 1)
    constexprs: dict  # the tuning constexprs (features are added by ops)
    sums: Optional[dict]  # the row-sums pre-pass's constexprs, or None
    per_sm: int  # row blocks per SM at most (before the resident count caps it)
    ask_resident: bool  # cap the grid at the programs that fit at once (compile to ask)


BWD_WARPS_PER_SM = 32  # programs per SM: 32 warps' worth (16 or 64 lost 5-25 points)
BWD_BLOCK_BYTES = 32768  # 16-bit columns' bytes one block holds with one partial (more spill)
BWD_BLOCK_BYTES_MULTI = 16384  # ... with two or more partial-gradient vectors
BWD_TILE_ROWS = 4  # narrow dropout rows per tile
EXCHANGE = True  # False: rows wider than a block always take the row-sums pre-pass (tests)
EXCHANGE_BLOCK_BYTES = 4096  # an exchanging column program's block (2K 16-bit columns)
EXCHANGE_MAX_MULTI = 32  # blocks beyond which rows with >= 2 partials take the pre-pass
PREPASS_BLOCK_BYTES = 16384  # the pre-pass path's column blocks (8K 16-bit columns)
SUMS_BLOCK_BYTES = 4096  # the row-sums pre-pass reads rows in 2K 16-bit column chunks
STAGE_BYTES = 200 * 1024  # shared memory the row loop's pipeline buffers may take
HOPPER_MIN, HOPPER_MAX, HOPPER_SLICE = 10241, 262144, 16384
HOPPER_BYTES = HOPPER_SMEM - 2048  # what its staging may take (its reductions take the rest)


def _bwd_blocks(d: Device, r: BwdRow, eb: int, w4: bool) -> tuple:
    """``(block, chunks, exchange)``: the backward's column blocks of a row."""
    n, p = r.n, r.partials
    # Block caps in 16-bit columns: the fp32 partials take registers whatever the dtype.
    cap = (BWD_BLOCK_BYTES if p <= 1 else BWD_BLOCK_BYTES_MULTI) // 2
    block = max(min(next_power_of_2(n), cap), 8)
    chunks = cdiv(n, block)
    # Rows just past the cap (a tail of at most a quarter) stay one block held as two.
    div = 8 if w4 and p == 1 else 4
    if (
        chunks == 2
        and (n - block) * div <= block
        and (p == 2 or (p == 1 and not r.dropout and eb == 2))
    ):
        return 2 * block, 1, False
    if chunks == 1:
        return block, chunks, False
    # Column programs exchange their row sums a row ahead (the rows read once), where a row
    # block's programs fit at once; 16-bit rows beside fp32 weights with dropout or x1 read
    # the weights twice per row there: they, and rows of many blocks with several
    # partials, take the row-sums pre-pass instead.
    xb = eb if p >= 4 else min(eb, 2)
    xblock = max(min(next_power_of_2(n), EXCHANGE_BLOCK_BYTES // xb), 8)
    xchunks = cdiv(n, xblock)
    heavy_w4 = (r.dropout or r.has_dy1) and w4 and eb == 2 and p >= 2
    fits = INTERPRETED or (xchunks <= d.sms and (p == 1 or xchunks <= EXCHANGE_MAX_MULTI))
    if EXCHANGE and (d.nvidia or INTERPRETED) and not heavy_w4 and fits:
        return xblock, xchunks, True
    # x1's 16-bit rows beside 16-bit weights: 4K-column blocks (8 KB) measured faster
    tile = PREPASS_BLOCK_BYTES // (2 if p >= 4 and eb == 2 and not w4 else 1)
    block = max(min(next_power_of_2(n), tile // eb), 8)
    return block, cdiv(n, block), False


def _bwd_stages(d: Device, r: BwdRow, block, chunks, tail, tile_rows, exchange) -> int:
    """Pipeline the row loop where its maths is heavy (dropout, column blocks, >= 2 partials
    at 4K+): the next rows' loads overlap this row's maths. Its buffers (stages - 1 of each
    row's load and of the weights') must fit the device's shared memory: else unpipelined."""
    if exchange or not (r.dropout or chunks > 1 or (r.partials >= 2 and block >= 4096)):
        return 1
    row_bytes = r.s_bytes + r.dy_bytes * (2 if r.has_dy1 else 1) + r.x0_bytes + (
        r.stream_bytes if r.dres_out else 0)  # fmt: skip
    held = block // 2 + tail if tail and block > 8192 else block
    stages = min(3, STAGE_BYTES // (held * row_bytes * tile_rows))
    stages = stages if stages >= 2 else 1
    wbytes = r.weight_bytes * (2 if r.has_dy1 else 1)
    if d.shared and pipeline_bytes(stages, held, tile_rows, row_bytes, wbytes) > d.shared:
        return 1
    return stages


def backward_plan(d: Device, r: BwdRow) -> BwdPlan:
    """The backward's launch choices for rows like ``r`` on ``d``."""
    tags = dtype_tags(r.x_dtype, r.stream_bytes, r.weight_bytes)
    # Entries for the Gluon backward: {"gluon": False} keeps rows of that (padded) width on the
    # Triton backward; {"ws_prefetch": False} turns off its sliced rows' prefetch.
    gluon = tuned(d, "bwd", kinds(r.base, r.is_rms), tags, (r.n, f"pad{next_power_of_2(r.n)}"))
    if gluon.get("gluon", True):
        hopper = _hopper_plan(d, r, gluon.get("ws_prefetch", True))
        if hopper is not None:
            return hopper
    n = r.n
    eb = max(r.s_bytes, r.dy_bytes, r.x_dtype.itemsize)
    w4 = r.weight_bytes == 4
    plain = not (r.dres_out or r.own_dres or r.own_dx1 or r.dropout)
    p = r.partials
    block, chunks, exchange = _bwd_blocks(d, r, eb, w4)
    tail = _bwd_tail(n, block, chunks, p, r.dropout, plain, eb)
    # Entries for a padded width serve the rows held in that one block (not those held as two).
    widths = (n,) if tail else (n, f"pad{next_power_of_2(max(n, 8))}")
    own = tuned(d, "bwd", kinds(r.base, r.is_rms), tags, widths)
    warps = (
        4 if exchange else (own.get("warps") or _bwd_warps(block, tail, p, r.dropout, plain, eb))
    )
    tile_rows = BWD_TILE_ROWS if r.dropout and chunks == 1 and not tail and block <= 512 else 1
    stages = _bwd_stages(d, r, block, chunks, tail, tile_rows, exchange)
    joint = _joint_row_sums(block, chunks, tail, p, stages, r.dropout)
    maxnreg = own.get("maxnreg")
    if maxnreg is None and d.nvidia and chunks == 1 and not tail:
        if block == 1024 and r.dropout and p == 2:
            maxnreg = 128  # dropout's masks push LayerNorm's 1K rows past 128 registers
        elif block == 8192 and p == 1 and not r.dropout and eb == 2 and warps == 16:
            maxnreg = 64  # add + RMSNorm's 8K block: two 16-warp programs an SM
    constexprs = dict(
        BLOCK_N=block // 2 if tail else block, TAIL_N=tail, NUM_CHUNKS=chunks, TILE_ROWS=tile_rows,
        EXCHANGE=exchange, EXCHANGE_RELOAD=exchange and p >= 4,  # x1: one more read measured faster
        JOINT_ROW_SUMS=joint, ROW_STAGES=stages,
    )  # fmt: skip
    sums = None
    if chunks > 1 and not exchange:  # c1, c2 first, one read of s and dy in 2K-column chunks
        sblock = max(min(next_power_of_2(n), SUMS_BLOCK_BYTES // max(r.s_bytes, r.dy_bytes)), 8)
        sums = dict(BLOCK_N=sblock, NUM_CHUNKS=cdiv(n, sblock))
    per_sm = max(BWD_WARPS_PER_SM // warps, 1)
    ask = d.nvidia and not own.get("whole_waves", False)
    return BwdPlan(False, warps, maxnreg if d.nvidia else None, block, chunks, tail, exchange,
                   constexprs, sums, per_sm, ask)  # fmt: skip


def pipeline_bytes(stages, held, tile_rows, row_bytes, weight_bytes) -> int:
    """A lower bound on the shared memory of the backward's pipelined row loop: Triton keeps
    stages - 1 buffers of each load in the loop, the held columns of each row tensor for each
    of the tile's rows and of the weights."""
    return (stages - 1) * held * (tile_rows * row_bytes + weight_bytes)


def _bwd_tail(n, block, chunks, partials, dropout, plain, eb) -> int:
    if chunks != 1:
        return 0
    one_16 = partials == 1 and not dropout and eb <= 2
    measured = (8192,) + ((16384,) if partials == 2 else ()) + ((32768,) if one_16 else ())
    if TAILS is True or not TAILS:
        return _tail(n, block) if TAILS else 0
    if block not in measured:
        return 0
    tail = _tail(n, block)
    if not tail:
        return 0
    if one_16 and not plain and block == 8192:
        return 0  # add + RMSNorm: the padded block under its register cap measured faster
    if (dropout or partials >= 4 or (one_16 and plain)) and 4 * tail > block // 2:
        return 0  # only a tail of at most a quarter paid with those
    return tail


def _bwd_warps(block, tail, partials, dropout, plain, eb) -> int:
    if tail:  # two blocks
        if block > 8192:
            return 16
        if partials == 1:
            return 8 if plain else 16
        return 8 if partials >= 4 else 4
    if plain and partials == 1 and block in (4096, 8192):
        return block // 1024  # RMSNorm alone: fewer warps keep it under 64 registers
    if partials >= 4 and block <= 2048:
        return 1 if block <= 512 else 2  # the x1 path's heavy per-row maths: more programs
    if block == 1024 and partials <= 2 and not dropout and eb <= 2:
        return 2
    if block <= 256:
        return 2 if dropout else 1
    if block == 512 and partials <= 2 and not dropout and not (plain and partials == 1):
        return 1
    if block <= 512:
        return 2
    return min(max(block // 512, 4), 32)


def _joint_row_sums(block, chunks, tail, partials, stages, dropout) -> bool:
    """LayerNorm's c1 and c2 in one reduction, where that measured faster."""
    if tail:  # rows held as 8192 + at most 2048, or with dropout and two partials
        return (block == 16384 and 0 < tail * 4 <= 8192) or (dropout and partials == 2)
    if chunks > 1:
        return not dropout  # exchanged words with dropout: two sums were faster
    return not (partials >= 4 and block == 1024 and stages > 1)


def programs(d: Device, plan: BwdPlan, m: int, resident: int = 0) -> int:
    """Row blocks of the persistent backward grid for ``m`` rows: 32 warps' worth of programs
    per SM, no more than fit there at once (``resident``; 0: unknown), one row per block at
    most. The Gluon kernel: one program per SM."""
    per_sm = plan.per_sm if not resident else min(plan.per_sm, resident)
    return max(min(d.sms * per_sm // plan.chunks, m), 1)


def partials_sum_layout(d: Device, n: int, partials: int, programs: int) -> dict:
    """Constexprs of the partials' sum: columns per program (narrower until 2 programs per
    SM), row blocks per tile (4096 values a tile), 3 tiles in flight where there are 3."""
    block = 256
    while block > 16 and cdiv(n, block) * partials < 2 * d.sms:
        block //= 2
    rows = 4096 // block
    return dict(BLOCK_N=block, BLOCK_P=rows, PARTIALS=partials,
                STAGES=3 if programs >= 3 * rows else 1)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The Hopper shared-memory backward (Gluon): whole 16-bit rows of 10K-16K columns, wider rows
# and rows of 4-byte elements in slices that exchange their row sums.
# ---------------------------------------------------------------------------------------------

HOPPER_WARPS = 16


def _hopper_plan(d: Device, r: BwdRow, prefetch: bool) -> Optional[BwdPlan]:
    n, p = r.n, r.partials
    if not (d.hopper and r.aligned and HOPPER_MIN <= n <= HOPPER_MAX and n % 16 == 0):
        return None
    if INTERPRETED or os.environ.get("FUSED_NORM_HOPPER", "1") == "0":
        return None
    if r.own_dx1 or r.scaled:
        return None  # x1's own dropout, rowscale and layerscale: kernels.py's
    plain = not (r.dres_out or r.own_dres or r.dropout)
    kind = "x1" if r.has_dy1 else ("plain" if plain else "residual")
    if (p, kind) not in ((1, "plain"), (1, "residual"), (2, "plain"), (2, "residual"), (4, "x1")):
        return None
    eb = max(r.s_bytes, r.dy_bytes, r.x_dtype.itemsize)
    w4 = r.weight_bytes == 4
    x1 = kind == "x1"
    dres_regs = r.dres_out and r.dropout and not x1 and r.dy_bytes == 4
    staged = r.staged_bytes - (r.stream_bytes if dres_regs else 0)
    if n > HOPPER_SLICE or eb > 2 or x1:  # slices
        s = _slices(n, staged, r.weight_bytes * (2 if x1 else 1), x1)
        if s is None:
            return None
        width, split, stages, lag = s
        if kind == "residual" and (eb != 4 or split > 2):
            return None  # 16-bit residual rows in slices spill; 4-byte ones in at most 2
        if split >= 3 and not lag and not (w4 and eb == 2 and (p > 1 or split <= 4)):
            return None  # 2-deep slices without LAG paid beside fp32 weights only
        block = 1 << (width.bit_length() - 1)
        tail = width - block
        vec = 8
        if eb == 4:  # 4 fp32 a thread; with dropout whole octets of decisions, unless moved
            fixed = r.weight_bytes * (2 if x1 else 1) + stages * staged
            vec = 4 if not r.dropout or (dres_regs and width * (fixed + 1) <= HOPPER_BYTES) else 8
    else:  # whole 16-bit rows
        if kind == "residual" and n > 16384:
            return None
        block, tail = next_power_of_2(n), 0
        if block > 8192 and block != n and next_power_of_2(n - 8192) < 8192:
            tail = next_power_of_2(n - 8192)
        held = block // 2 + tail if tail else block
        staged_row = 2 * held * (3 if r.dres_out else 2)
        stages = min(2, (HOPPER_BYTES - r.weight_bytes * held) // staged_row)
        split, lag, vec, dres_regs = 1, False, 8, False
        block = block // 2 if tail else block
    constexprs = dict(
        BLOCK_N=block, TAIL_N=tail, STAGES=stages, VEC=vec,
        TAIL_VEC=max(tail // (32 * HOPPER_WARPS), 1), NUM_WARPS=HOPPER_WARPS, SPLIT=split,
        SPLIT_P2=next_power_of_2(split), LAG=lag, DRES_REGS=dres_regs,
        # Slices' exchange words asked of L2 first: written a launch ago, they are cold, and
        # each wait's first read went to memory (+1-7% at 32K-256K); a table entry
        # {"ws_prefetch": False} turns it off for a width.
        WS_PREFETCH=split > 1 and prefetch,
    )  # fmt: skip
    return BwdPlan(True, HOPPER_WARPS, None, block, split, tail, split > 1, constexprs, None,
                   1, False)  # fmt: skip


def _slices(n, staged, weight_bytes, x1):
    """(slice, split, stages, lag): the widest power-of-two slice of at most 16K columns that
    divides the row into 2-16 slices staging >= 64 KB of a row each (48 KB for x1), 3 rows deep
    with LAG (the sums published a row ahead) from 3 slices, where that fits; else such a slice
    2 deep without LAG in 3-8 slices; else, for x1, two slices of a power of two + a tail of at
    least a quarter (20480 = 2 x (8192 + 2048)); None where none fits."""
    width, lagless = HOPPER_SLICE, None
    min_bytes = 49152 if x1 else 65536
    while width * staged >= min_bytes:
        split = n // width
        lag = split >= 3
        stages = 3 if lag else 2
        if (
            n % width == 0
            and split >= 2
            and width * (weight_bytes + stages * staged) <= HOPPER_BYTES
        ):
            return (width, split, stages, lag) if split <= 16 else None
        if (lagless is None and lag and n % width == 0 and split <= 8
                and width * (weight_bytes + 2 * staged) <= HOPPER_BYTES):  # fmt: skip
            lagless = (width, split, 2, False)
        width //= 2
    if lagless is not None or not (x1 and n >= 32 and n % 32 == 0):
        return lagless
    width = n // 2
    block = 1 << (width.bit_length() - 1)
    tail = width - block
    if (block <= HOPPER_SLICE and 4 * tail >= block and tail & (tail - 1) == 0
            and width * staged >= 65536 and width * (weight_bytes + 2 * staged) <= HOPPER_BYTES):  # fmt: skip
        return width, 2, 2, False
    return None

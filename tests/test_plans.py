"""Launch plans (fused_norm/heuristics.py) are valid for their input, whatever the rules and
tables decide: invariants, not values.

Each plan is asked of the rules the way a call asks for it: a call signature's
``ops.KernelCall`` is built for tensors of the drawn workload (dtypes, flags, width) and the
rows it hands ``ops.fwd_plan`` / ``ops.bwd_plan`` are recorded; the plans of those rows are then
made for three devices: a pretend H200 (Hopper, the sm90 tuned table), a pretend A100 (no
Gluon backward, no table) and the CPU interpreter of this process. For the GPUs the rules run
as in a process that is not interpreted (``heuristics.INTERPRETED`` off).

What is checked: every plan covers its row (blocks, chunks, tails, split parts, slices), with
block sizes powers of two of at least 8 columns (dropout draws eight columns at a time), warps
a power of two up to 32, register caps only on NVIDIA GPUs and within what ptxas takes, split
rows and exchanging column blocks no more than the device runs at once (their programs wait
for each other), pipelined and staged buffers within the device's shared memory, the Gluon
backward only where it runs (Hopper, aligned rows of its widths), the held 16-bit routes only
on 16-bit tensors of their dtype, the grid and the partials' sum covering their work; plans are
pure and depend on the width, not on the row count. The tuned tables are well-formed, and
every entry is one a plan reads and changes the plan of some row it matches. No test here
knows a tuned value: re-tuning changes a table and no test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Optional

import pytest
import torch
from _helpers import count_example
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fused_norm import functional, heuristics, ops
from fused_norm.heuristics import Device

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
H200 = Device(132, 232448, True, "sm90", True, True)
A100 = Device(108, 166912, True, "sm80", False)
CPU = heuristics.device(torch.device("cpu"))
DEVICES = {"h200": H200, "a100": A100, "cpu": CPU}
# What the Gluon backward plans its staging for (kernels/hopper.py): Hopper's 227 KB.
HOPPER_SHARED = 227 * 1024
EXAMPLES_INVARIANTS = 300
EXAMPLES_PURE = 60


def _power_of_two(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


# ----------------------------------------------------------------------------------------------
# Workloads, and the rows their calls ask plans for
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """One call signature's dtypes and flags (the width is drawn beside it)."""

    dtype: torch.dtype = BF16
    weight_dtype: Optional[torch.dtype] = None  # None: x's
    is_rms: bool = False
    bias: bool = True
    residual: Optional[torch.dtype] = None  # the residual's dtype, None: no residual
    residual_in_fp32: bool = False
    x1: bool = False
    weight1: bool = False
    dropout: bool = False
    rowscale: bool = False
    layerscale: bool = False
    prenorm: bool = False
    out_dtype: Optional[torch.dtype] = None
    aligned: bool = True  # x at a 16-byte aligned address


@st.composite
def workloads(draw):
    dtype = draw(st.sampled_from([FP32, BF16, FP16]))
    residual = draw(st.sampled_from([None, "same", FP32, BF16, FP16]))
    x1 = draw(st.booleans())
    weight1 = x1 and draw(st.booleans())
    kind = draw(st.sampled_from(["plain", "plain", "add", "drop", "x1", "scaled"]))
    return Workload(
        dtype=dtype,
        weight_dtype=draw(st.sampled_from([None, FP32])),
        is_rms=draw(st.booleans()),
        bias=draw(st.booleans()),
        residual=None if kind == "plain" else (dtype if residual == "same" else residual),
        residual_in_fp32=draw(st.booleans()),
        x1=x1 and kind in ("x1", "drop"),
        weight1=weight1 and kind in ("x1", "drop"),
        dropout=kind == "drop" or (kind == "x1" and draw(st.booleans())),
        rowscale=kind == "scaled" and draw(st.booleans()),
        layerscale=kind == "scaled" and draw(st.booleans()),
        prenorm=draw(st.booleans()),
        out_dtype=draw(st.sampled_from([None, None, FP32])),
        aligned=draw(st.sampled_from([True, True, True, False])),
    )


def _table_widths() -> list:
    widths = []
    for _, _, _, width in heuristics._table("sm90"):
        p = int(width[3:]) if isinstance(width, str) else width
        widths += [p] if isinstance(width, int) else [p, p - 1, p // 2 + 1, 3 * p // 4 + 8]
    return sorted(set(widths))


# Widths where the rules change their minds: powers of two and their neighbours, the Gluon
# backward's bounds, multiples of 16 and not, and the tuned table's own widths.
_POW2 = [1 << k for k in range(0, 19)]
SPECIAL_N = sorted(
    {v for p in _POW2 for v in (p - 1, p, p + 1, p + 16, 3 * p // 2) if 1 <= v <= 300000}
    | {10240, 10241, 10256, 12288, 20480, 100003, 262144, 262160, 300000}
    | set(_table_widths())
)
widths = st.one_of(st.sampled_from(SPECIAL_N), st.integers(1, 300000))


def _build_call(w: Workload, n: int, m: int = 1):
    """The ops.KernelCall of ``w`` at width ``n`` over ``m`` rows (tensors uninitialised:
    a plan reads dtypes, shapes and addresses only)."""

    def t(shape, dtype, grad=True):
        return torch.empty(shape, dtype=dtype).requires_grad_(grad)

    x = t((m, n), w.dtype)
    if not w.aligned:  # a view one element in: no 16-byte aligned rows
        x = t((m * n + 1,), w.dtype)[1:].view(m, n)
    wd = w.weight_dtype or w.dtype
    tensors = (
        x, t((n,), wd), t((n,), wd) if w.bias else None,
        t((m, n), w.residual) if w.residual is not None else None,
        t((m, n), w.dtype) if w.x1 else None, t((n,), wd) if w.weight1 else None,
        t((n,), wd) if w.weight1 and w.bias else None,
        t((m,), w.dtype, grad=False) if w.rowscale else None,
        t((n,), wd) if w.layerscale else None, None, None,
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:  # the kernels' call object, also where they
        mp.setattr(functional, "use_kernels", lambda x, value=None: True)  # would not run
        return functional._new_call(tensors, 1e-5, 0.1 if w.dropout else 0.0, w.prenorm,
                                    w.residual_in_fp32, False, w.is_rms, False, w.out_dtype)  # fmt: skip


@contextlib.contextmanager
def _recorded_rows():
    """The rows ops asks plans for while inside (a list of FwdRow / BwdRow)."""
    rows = []
    fwd, bwd = ops.fwd_plan, ops.bwd_plan

    def fwd_plan(dev, row):
        rows.append(row)
        return fwd(dev, row)

    def bwd_plan(dev, row):
        rows.append(row)
        return bwd(dev, row)

    ops.fwd_plan, ops.bwd_plan = fwd_plan, bwd_plan
    try:
        yield rows
    finally:
        ops.fwd_plan, ops.bwd_plan = fwd, bwd


@dataclasses.dataclass
class Rows:
    fwd: heuristics.FwdRow
    bwd: list  # BwdRow with and, with prenorm, without the residual stream's gradient
    held_dtype: torch.dtype  # what a split forward row holds: the stored stream's dtype, or x's


def rows_of(w: Workload, n: int, m: int = 1) -> Rows:
    with _recorded_rows() as rows:
        call = _build_call(w, n, m)
        call._bwd_for(False)
        if w.prenorm:
            call._bwd_for(True)
    fwd = [r for r in rows if isinstance(r, heuristics.FwdRow)]
    bwd = [r for r in rows if isinstance(r, heuristics.BwdRow)]
    assert len(fwd) == 1 and bwd, rows
    held = call.flags.residual_dtype if call.store_res else w.dtype
    return Rows(fwd[0], list(dict.fromkeys(bwd)), held)


@contextlib.contextmanager
def rules_of(d: Device):
    """The rules as they run for ``d``: interpreted for the CPU device, not for the GPUs; the
    environment's switches at their defaults."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("FUSED_NORM_HOPPER", "FUSED_NORM_SPLIT_ROWS", "FUSED_NORM_TUNED"):
            mp.delenv(name, raising=False)
        mp.setattr(heuristics, "INTERPRETED", d is CPU)
        yield


# ----------------------------------------------------------------------------------------------
# Invariants
# ----------------------------------------------------------------------------------------------


def check_launch_options(d: Device, plan) -> None:
    assert plan.num_warps in (1, 2, 4, 8, 16, 32), plan.num_warps
    if plan.maxnreg is not None:
        assert d.nvidia, "a register cap on a device that is not an NVIDIA GPU"
        assert 24 <= plan.maxnreg <= 255, plan.maxnreg


def check_forward(d: Device, r: heuristics.FwdRow, plan, held_dtype) -> None:
    n, c = r.n, plan.constexprs
    check_launch_options(d, plan)
    block, chunks, tail, split = c["BLOCK_N"], c["NUM_CHUNKS"], c["TAIL_N"], c["SPLIT"]
    assert split == plan.split >= 1
    assert _power_of_two(block) and block >= 8, block
    assert tail == 0 or (_power_of_two(tail) and 8 <= tail < block), (block, tail)
    assert _power_of_two(c["ROWS_PER_PROGRAM"]) and c["ROWS_PER_PROGRAM"] == plan.rows
    assert c["UNROLL"] in (1, chunks), c
    assert c["HOLD"] in (0, 1, 2), c
    if split > 1:
        # Parts of one row wait for each other: all of them must be resident at once.
        assert d.nvidia or d is CPU, "split rows on a device whose programs may not meet"
        assert split <= max(d.sms, heuristics.FALLBACK_SMS if d is CPU else 0), (split, d)
        assert chunks == 1 and tail == 0 and plan.rows == 1, c
        assert block * split >= n > block * (split - 1), f"{split} parts of {block} for {n}"
        assert not c["FULL_ROW"] or n == split * block, "FULL_ROW on parts that are not whole"
        assert plan.grid(7) == (7 * split,)
    else:
        assert block * chunks + tail >= n, f"{chunks} x {block} + {tail} columns for {n}"
        assert block * (chunks - 1) < n, "a chunk wholly past the row"
        assert tail == 0 or chunks == 1, c
        assert plan.rows == 1 or (chunks == 1 and tail == 0), c
        assert not c["FULL_ROW"] or n == block * chunks + tail, "FULL_ROW on a row it does not fill"
        assert c["HOLD"] == 0, "a held row outside split rows"
        assert not plan.ws_reset, "a workspace to reset without split rows"
        for m in (1, 7, 1000):
            (g,) = plan.grid(m)
            assert g * plan.rows >= m > (g - 1) * plan.rows
    if c["HOLD"]:  # the row held as the 16-bit tensor its sum equals, widened back exactly
        assert held_dtype in (FP16, BF16), f"HOLD {c['HOLD']} on a {held_dtype} row"
    assert isinstance(plan.seeds_from_key, bool) and isinstance(c["SEEDS_LAST"], bool)
    # The exchange words' L2 prefetch is inline PTX: NVIDIA GPUs' split rows only.
    assert not c.get("WS_PREFETCH") or (d.nvidia and split > 1), c
    assert c.get("PARAMS_EVICT", "") in ("", "evict_last", "evict_first"), c


def check_held_route(r: heuristics.FwdRow, plan, held_dtype) -> None:
    """HOLD 2 (kernels' _convert_copy) converts the held bits as fp16."""
    if plan.constexprs["HOLD"] == 2:
        assert held_dtype == FP16, f"HOLD 2 (fp16's route) on a held {held_dtype} row: {r}"


def _pipeline_bytes(r: heuristics.BwdRow, c: dict) -> int:
    """A lower bound on the shared memory of the backward's row loop pipelined ROW_STAGES deep:
    Triton keeps ROW_STAGES - 1 buffers of each load in the loop, the columns a program holds
    of each per-row tensor (s, dy, dy1, x for layerscale's gradient, dresidual_out) for each
    row of its tile, and of the weights it reads there (weight, weight1)."""
    held = c["BLOCK_N"] + c["TAIL_N"]
    row_bytes = (r.s_bytes + r.dy_bytes * (2 if r.has_dy1 else 1) + r.x0_bytes
                 + (r.stream_bytes if r.dres_out else 0))  # fmt: skip
    weights = r.weight_bytes * (2 if r.has_dy1 else 1)
    return (c["ROW_STAGES"] - 1) * held * (c["TILE_ROWS"] * row_bytes + weights)


def check_backward(d: Device, r: heuristics.BwdRow, plan) -> None:
    n, c = r.n, plan.constexprs
    check_launch_options(d, plan)
    assert plan.per_sm >= 1
    if plan.hopper:
        assert d.hopper and d.nvidia and d is not CPU, "the Gluon backward off Hopper"
        assert r.aligned and 10241 <= n <= 262144 and n % 16 == 0, r
        assert plan.maxnreg is None
        block, tail, split = c["BLOCK_N"], c["TAIL_N"], c["SPLIT"]
        assert _power_of_two(block) and block >= 8 and (tail == 0 or _power_of_two(tail))
        assert split == plan.chunks >= 1 and split * (block + tail) >= n, c
        assert c["STAGES"] >= 1 and c["VEC"] in (4, 8) and c["NUM_WARPS"] == plan.num_warps
        # Staged rows beside the weights held in shared memory, within what Hopper gives.
        staged = r.staged_bytes - (r.stream_bytes if c["DRES_REGS"] else 0)
        weights = r.weight_bytes * (2 if r.has_dy1 else 1)
        need = (block + tail) * (weights + c["STAGES"] * staged)
        assert need <= HOPPER_SHARED, f"{need} bytes staged for {r}"
        assert plan.sums is None
        return
    block, chunks, tail = c["BLOCK_N"], c["NUM_CHUNKS"], c["TAIL_N"]
    assert chunks == plan.chunks >= 1 and tail == plan.tail
    assert _power_of_two(block) and block >= 8, block
    assert plan.block == (2 * block if tail else block), plan
    assert tail == 0 or (chunks == 1 and _power_of_two(tail) and 8 <= tail < block), c
    assert block * chunks + tail >= n > block * (chunks - 1), f"{chunks} x {block} + {tail}"
    assert _power_of_two(c["TILE_ROWS"]) and (c["TILE_ROWS"] == 1 or (chunks == 1 and not tail))
    assert c["EXCHANGE"] == plan.exchange
    assert c["ROW_STAGES"] >= 1
    if plan.exchange:
        # A row's column blocks wait for each other's words: all resident at once.
        assert chunks > 1 and (d.nvidia or d is CPU)
        assert chunks <= d.sms or d is CPU, f"{chunks} exchanging blocks on {d.sms} SMs"
    if chunks > 1 and not plan.exchange:  # the row sums come from the pre-pass
        s = plan.sums
        assert s is not None and _power_of_two(s["BLOCK_N"]) and s["BLOCK_N"] >= 8
        assert s["BLOCK_N"] * s["NUM_CHUNKS"] >= n > s["BLOCK_N"] * (s["NUM_CHUNKS"] - 1), s
    else:
        assert plan.sums is None


def check_pipeline_fits(d: Device, r: heuristics.BwdRow, plan) -> None:
    """The pipelined row loop's buffers fit the device's shared memory (where it is known)."""
    c = plan.constexprs
    if not plan.hopper and d.shared and c["ROW_STAGES"] > 1:
        need = _pipeline_bytes(r, c)
        assert need <= d.shared, f"a {c['ROW_STAGES']}-stage row loop needs {need} bytes: {r}"


def check_grid(d: Device, r: heuristics.BwdRow, plan) -> None:
    for m in (1, 2, 7, 131, 100000):
        for resident in (0, 1, 3, 64):
            p = heuristics.programs(d, plan, m, resident)
            assert 1 <= p <= m, (m, resident, p)
        layout = heuristics.partials_sum_layout(d, r.n, r.partials, p)
        assert _power_of_two(layout["BLOCK_N"]) and _power_of_two(layout["BLOCK_P"])
        assert layout["PARTIALS"] == r.partials and layout["STAGES"] >= 1
        # The sum's grid (cdiv(n, BLOCK_N), partials) covers every column of every slab.
        assert heuristics.cdiv(r.n, layout["BLOCK_N"]) * layout["BLOCK_N"] >= r.n
        # Launched as the backward's programmatic dependent only where it waits for it (GDC).
        red, opts = ops._partials_sum(d, r.n, r.partials, p)
        assert bool(opts.get("launch_pdl")) == red["GDC"] == d.pdl


def check_all(w: Workload, n: int, devices=DEVICES) -> Rows:
    rows = rows_of(w, n)
    for d in devices.values():
        with rules_of(d):
            fplan = heuristics.forward_plan(d, rows.fwd)
            check_forward(d, rows.fwd, fplan, rows.held_dtype)
            check_held_route(rows.fwd, fplan, rows.held_dtype)
            for br in rows.bwd:
                bplan = heuristics.backward_plan(d, br)
                check_backward(d, br, bplan)
                check_pipeline_fits(d, br, bplan)
                check_grid(d, br, bplan)
    return rows


@settings(max_examples=EXAMPLES_INVARIANTS, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads(), n=widths)
@example(w=Workload(dtype=BF16, residual=BF16, dropout=True, prenorm=True), n=131072)
@example(w=Workload(dtype=FP32, residual=FP32, x1=True, weight1=True, prenorm=True), n=262144)
@example(w=Workload(dtype=BF16, weight_dtype=FP32, is_rms=True, bias=False), n=65536)
@example(w=Workload(dtype=FP16), n=12288)
@example(w=Workload(dtype=BF16, out_dtype=FP32), n=1)
def test_plans_are_valid(w, n):
    """Every plan of a drawn call (width 1 to 300000; fp32, bf16, fp16 rows with fp32 or
    16-bit streams and weights; plain norms, residual adds, dropout, x1 and its second output,
    row and layer scales, prenorm) on a pretend H200, a pretend A100 and the CPU interpreter
    is valid for its row (see the module docstring)."""
    count_example("test_plans_are_valid")
    check_all(w, n)


def _violations(check, workloads, ns, devices=DEVICES) -> list:
    """``check``'s failures over every (workload, width, device): (device, message) pairs."""
    bad = []
    for w in workloads:
        for n in ns:
            rows = rows_of(w, n)
            for name, d in devices.items():
                with rules_of(d):
                    try:
                        check(d, rows)
                    except AssertionError as e:
                        bad.append((name, str(e)))
    return bad


def _check_held_route(d, rows) -> None:
    check_held_route(rows.fwd, heuristics.forward_plan(d, rows.fwd), rows.held_dtype)


def _check_pipelines(d, rows) -> None:
    for r in rows.bwd:
        check_pipeline_fits(d, r, heuristics.backward_plan(d, r))


def test_held_route_matches_the_held_dtype():
    """HOLD 2 converts the held bits as fp16 (kernels' _convert_copy): only rows that hold an
    fp16 tensor may take it (HOLD 1, _widen, reads either 16-bit dtype). Rows of 16-bit x
    beside a stream of the other 16-bit dtype, at every special width. (Regression: the sm90
    table's hold entry of the x1 path at 262144 fp16 columns once served fp16 x with a bf16
    residual, whose held bf16 stream it converted as fp16: a wrong y.)"""
    mixed = [
        Workload(dtype=x, residual=res, x1=x1, weight1=x1, prenorm=prenorm, is_rms=rms)
        for x, res in ((FP16, BF16), (BF16, FP16))
        for x1 in (False, True)
        for prenorm in (False, True)
        for rms in (False, True)
    ]
    bad = _violations(_check_held_route, mixed, SPECIAL_N)
    assert not bad, f"{len(bad)} plans, e.g. {bad[:3]}"


def test_pipelined_backward_fits_shared_memory():
    """The backward's software-pipelined row loop (ROW_STAGES > 1) keeps ROW_STAGES - 1
    buffers of each load in the loop: they must fit the device's shared memory, or the kernel
    cannot load. Workloads of every kind at powers of two (and their neighbours) of 1K-256K
    columns on the pretend GPUs. (Regression: the stages were once sized by the per-row
    tensors alone, neither the weights the loop reads nor the device's shared memory counted:
    16-bit rows with fp32 weights in one 16K block on an H200, and many rows on an A100, got
    pipelines that could not load, which ops caught at the first launch after a failed
    compile.)"""
    ns = sorted({v for k in range(10, 19) for v in ((1 << k) - 1, 1 << k, (1 << k) + 16)})
    gpus = {k: v for k, v in DEVICES.items() if v.shared}
    bad = _violations(_check_pipelines, ALL_WORKLOADS[::2], ns, gpus)
    assert not bad, f"{len(bad)} plans, e.g. {bad[:3]}"


@settings(max_examples=EXAMPLES_PURE)
@given(w=workloads(), n=widths, m=st.sampled_from([2, 3, 17]))
def test_plans_are_pure_and_ignore_the_row_count(w, n, m):
    """The same row gives equal plans every time it is asked (the plan functions keep no
    state), and a call over ``m`` rows asks for the same rows, hence plans, as one over one
    row: the row count sizes the grid only."""
    count_example("test_plans_are_pure_and_ignore_the_row_count")
    one, many = rows_of(w, n), rows_of(w, n, m)
    assert one.fwd == many.fwd and one.bwd == many.bwd
    for d in DEVICES.values():
        with rules_of(d):
            assert heuristics.forward_plan(d, one.fwd) == heuristics.forward_plan(d, many.fwd)
            for r in one.bwd:
                assert heuristics.backward_plan(d, r) == heuristics.backward_plan(d, r)


def test_device_properties_of_this_machine():
    """heuristics.device of the CPU: the fallback multiprocessor count, no shared memory
    known, no NVIDIA options, no table, no Gluon."""
    d = heuristics.device(torch.device("cpu"))
    assert d == Device(heuristics.FALLBACK_SMS, 0, False, "", False)


@pytest.mark.gpu
def test_device_properties_of_this_gpu():
    """heuristics.device asks the device itself: its multiprocessor count and shared memory."""
    dev = torch.device("cuda", torch.cuda.current_device())
    d = heuristics.device(dev)
    props = torch.cuda.get_device_properties(dev)
    assert d.sms == props.multi_processor_count >= 1
    assert d.shared == getattr(props, "shared_memory_per_block_optin", 0)
    assert d.nvidia == (torch.version.hip is None)
    assert not d.hopper or (props.major >= 9 and d.shared >= heuristics.HOPPER_SMEM)


# ----------------------------------------------------------------------------------------------
# The tuned tables
# ----------------------------------------------------------------------------------------------

_BASES = ("", "add", "drop", "x1", "x1drop")
KINDS = {k for b in _BASES for rms in (False, True) for k in heuristics.kinds(b, rms)}
TAGS = {
    tag
    for x in (FP32, BF16, FP16)
    for stream in (x.itemsize, 4)
    for wb in (x.itemsize, 4)
    for tag in heuristics.dtype_tags(x, stream, wb)
}


def _tables() -> dict:
    """Every table of fused_norm/tuned, by architecture."""
    import pkgutil

    import fused_norm.tuned as tuned

    return {
        name: heuristics._table(name)
        for _, name, _ in pkgutil.iter_modules(tuned.__path__)
        if re.fullmatch(r"sm\d+", name)
    }


def test_tables_are_well_formed():
    """Keys ``(direction, kind, tag, width)``: a direction, a kind and a dtype tag the lookup
    can ask for, and a width of whole columns or ``pad<P>`` (P a power of two); values
    non-empty dicts."""
    tables = _tables()
    assert tables, "no tuned table found"
    for arch, table in tables.items():
        assert table, f"{arch}: empty table"
        for key, value in table.items():
            assert isinstance(key, tuple) and len(key) == 4, (arch, key)
            direction, kind, tag, width = key
            assert direction in ("fwd", "bwd"), (arch, key)
            assert kind in KINDS, f"{arch}: {key}: no row has kind {kind!r}"
            assert tag in TAGS, f"{arch}: {key}: no row has tag {tag!r}"
            if isinstance(width, str):
                m = re.fullmatch(r"pad(\d+)", width)
                assert m and _power_of_two(int(m.group(1))) and int(m.group(1)) >= 8, (arch, key)
            else:
                assert type(width) is int and width >= 1, (arch, key)
            assert isinstance(value, dict) and value, (arch, key)


class _Reads(dict):
    """An empty table entry that records the overrides a plan function asks it for."""

    def __init__(self, seen: set):
        super().__init__()
        self.seen = seen

    def get(self, key, default=None):
        self.seen.add(key)
        return default

    def __getitem__(self, key):
        self.seen.add(key)
        raise KeyError(key)

    def __contains__(self, key):
        self.seen.add(key)
        return False


# Workloads of every kind a table may name (plain LN / RMS, add, dropout, x1 with and without
# dropout), each in the dtype layouts a tag may name.
_KINDS_OF_CALLS = [
    dict(),
    dict(residual="same", prenorm=True),
    dict(residual="same", dropout=True, prenorm=True),
    dict(residual="same", x1=True, weight1=True, prenorm=True),
    dict(residual="same", x1=True, weight1=True, dropout=True, prenorm=True),
    dict(dropout=True),
    dict(x1=True, weight1=True),
]
_DTYPES_OF_CALLS = [
    dict(dtype=d, weight_dtype=wd, residual_in_fp32=res32, bias=bias, is_rms=rms)
    for d in (BF16, FP16, FP32)
    for wd in (None, FP32)
    for res32 in (False, True)
    for bias in (True, False)
    for rms in (False, True)
    if not (d == FP32 and (wd or res32))
]


def _workload(kind: dict, dtypes: dict) -> Workload:
    spec = dict(kind, **dtypes)
    if spec.get("residual") == "same":
        spec["residual"] = FP32 if spec["residual_in_fp32"] else spec["dtype"]
    return Workload(**spec)


ALL_WORKLOADS = [_workload(k, d) for k in _KINDS_OF_CALLS for d in _DTYPES_OF_CALLS]


def _entry_widths(width) -> list:
    """Widths an entry's width key matches: itself, or rows within its padded block."""
    if not isinstance(width, str):
        return [width]
    p = int(width[3:])
    return sorted({p, p - 1, p - 16, 3 * p // 4, 3 * p // 4 + 16, p // 2 + 16, p // 2 + 1})


def _plan(d: Device, direction: str, row):
    return (heuristics.forward_plan if direction == "fwd" else heuristics.backward_plan)(d, row)


def _rows_by_direction(w: Workload, n: int) -> dict:
    rows = rows_of(w, n)
    return {"fwd": [rows.fwd], "bwd": rows.bwd}


def test_table_overrides_are_read_by_the_plans(monkeypatch):
    """Every override a table names is one the plan functions read for its direction: an
    override under another name (a typo in a generated table) would be ignored silently."""
    seen = {"fwd": set(), "bwd": set()}

    def tuned(d, direction, kinds, tags, widths):
        return _Reads(seen[direction])

    monkeypatch.setattr(heuristics, "tuned", tuned)
    ns = sorted({v for v in SPECIAL_N if v % 3 == 0 or _power_of_two(v)} | {12288, 131072})
    for w in ALL_WORKLOADS[::3]:
        for n in ns:
            for direction, rows in _rows_by_direction(w, n).items():
                for row in rows:
                    with rules_of(H200):
                        _plan(H200, direction, row)
    assert seen["fwd"] and seen["bwd"], seen
    for arch, table in _tables().items():
        for key, overrides in table.items():
            unread = set(overrides) - seen[key[0]]
            assert not unread, f"{arch}: {key}: no plan reads {sorted(unread)} (read: {seen})"


def _device_of(arch: str) -> Device:
    """A pretend device of ``arch`` (its table): H200's properties for sm90."""
    return H200 if arch == "sm90" else dataclasses.replace(A100, arch=arch)


_TUNED = heuristics.tuned  # the lookup itself (tests below patch the module's name)


def _recording(found: list):
    """heuristics.tuned, appending each entry it returns to ``found``."""

    def tuned(*args):
        found.append(_TUNED(*args))
        return found[-1]

    return tuned


def _constant(table: dict):
    return lambda arch: table


def _rows_it_changes(d, table, key, entry, monkeypatch, rows_for):
    """``(n, row, plan with the table, plan without the entry)`` for each row (of some call of
    the entry's kind, dtypes and width) that finds ``entry`` and whose plan it changes."""
    direction, _, _, width = key
    without = {k: v for k, v in table.items() if k != key}
    for n in _entry_widths(width):
        for w in ALL_WORKLOADS:
            for row in rows_for(w, n)[direction]:
                found = []
                with rules_of(d), monkeypatch.context() as mp:
                    mp.setattr(heuristics, "tuned", _recording(found))
                    mp.setattr(heuristics, "_table", _constant(table))
                    plan = _plan(d, direction, row)
                    if not any(f is entry for f in found):
                        continue
                    mp.setattr(heuristics, "_table", _constant(without))
                    rules = _plan(d, direction, row)
                if plan != rules:
                    yield n, row, plan, rules


@pytest.fixture(scope="module")
def rows_for():
    cache = {}

    def rows(w, n):
        if (w, n) not in cache:
            cache[w, n] = _rows_by_direction(w, n)
        return cache[w, n]

    return rows


def test_every_table_entry_changes_some_plan(monkeypatch, rows_for):
    """Each entry changes the plan of at least one row that finds it (a row of some call of
    its kind, dtypes and width): an entry that changes nothing is dead weight that a re-tuning
    would carry on."""
    for arch, table in _tables().items():
        d = _device_of(arch)
        dead = [key for key, entry in table.items()
                if next(_rows_it_changes(d, table, key, entry, monkeypatch, rows_for), None)
                is None]  # fmt: skip
        assert not dead, f"{arch}: entries that change no plan of a row they match: {dead}"


def test_tuner_proposes_every_table_entry(monkeypatch, rows_for):
    """bench/tune.py can derive each entry without the table: for a row the entry changes,
    ``candidates(..., explore=True)`` from the rules' plan alone offers an override that makes
    the entry's plan. An entry it could not propose could not be re-derived on a new GPU
    (docs/tuning.md)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import tune

    def plan_with(d, direction, row, table):
        with rules_of(d), monkeypatch.context() as mp:
            mp.setattr(heuristics, "_table", _constant(table))
            return _plan(d, direction, row)

    for arch, table in _tables().items():
        d = _device_of(arch)
        missing = []
        for key, entry in table.items():
            direction, kind = key[:2]
            without = {k: v for k, v in table.items() if k != key}
            if not any(plan_with(d, direction, row, {**without, key: c}) == plan
                       for n, row, plan, rules in _rows_it_changes(d, table, key, entry,
                                                                   monkeypatch, rows_for)
                       for c in tune.candidates(direction, kind, n, rules, None, True)):  # fmt: skip
                missing.append((key, entry))
        assert not missing, f"{arch}: entries tune.py --explore does not propose: {missing}"


def test_tuner_keeps_the_fastest_override_and_a_still_winning_entry():
    """tune.pick: an override is kept only if it beats the rules by min_gain; the table's
    entry stays where it still does, unless another candidate beats the entry by min_gain too."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from tune import pick

    a, b, entry = {"warps": 8}, {"warps": 16}, {"maxnreg": 128}
    assert pick(100.0, [], None, 0.03) is None
    assert pick(100.0, [(a, 98.0)], None, 0.03) is None  # 2%: below the bar
    assert pick(100.0, [(a, 96.0), (b, 90.0)], None, 0.03) == b  # the fastest
    assert pick(100.0, [(entry, 80.0), (b, 79.5)], entry, 0.03) == entry  # near-equal: no swap
    assert pick(100.0, [(entry, 80.0), (b, 70.0)], entry, 0.03) == b  # beaten by 12.5%
    assert pick(100.0, [(entry, 98.0), (b, 96.0)], entry, 0.03) == b  # the entry no longer wins
    assert pick(100.0, [(entry, 98.0), (b, 99.0)], entry, 0.03) is None


def test_table_lookup_prefers_the_most_specific_entry(monkeypatch):
    """heuristics.tuned: the first key found, kinds, tags and widths each from the most to the
    least specific (a generated table may hold an entry and a more general one)."""
    table = {
        ("fwd", "add", "any", "pad256"): {"warps": 1},
        ("fwd", "add_rms", "any", "pad256"): {"warps": 2},
        ("fwd", "add_rms", "bf16", "pad256"): {"warps": 4},
        ("fwd", "add_rms", "bf16", 200): {"warps": 8},
    }
    monkeypatch.setattr(heuristics, "_table", lambda arch: table)
    d = H200
    kinds = heuristics.kinds("add", True)
    tags = heuristics.dtype_tags(BF16, 2, 2)
    assert heuristics.tuned(d, "fwd", kinds, tags, (200, "pad256")) == {"warps": 8}
    assert heuristics.tuned(d, "fwd", kinds, tags, (201, "pad256")) == {"warps": 4}
    tags16 = heuristics.dtype_tags(FP16, 2, 2)
    assert heuristics.tuned(d, "fwd", kinds, tags16, (201, "pad256")) == {"warps": 2}
    assert heuristics.tuned(d, "fwd", heuristics.kinds("add", False), tags16, (201, "pad256")) == {
        "warps": 1
    }
    assert heuristics.tuned(d, "bwd", kinds, tags, (200, "pad256")) == {}
    monkeypatch.undo()
    assert heuristics.tuned(CPU, "fwd", kinds, tags, (200, "pad256")) == {}, "a table off GPUs"


def test_no_table_without_its_switch(monkeypatch):
    """FUSED_NORM_TUNED=0 leaves every plan to the rules alone."""
    heuristics._table.cache_clear()
    monkeypatch.setenv("FUSED_NORM_TUNED", "0")
    try:
        assert heuristics._table("sm90") == {}
    finally:
        monkeypatch.delenv("FUSED_NORM_TUNED")
        heuristics._table.cache_clear()
    assert heuristics._table("sm90"), "the sm90 table did not load again"

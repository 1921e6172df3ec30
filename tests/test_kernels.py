"""Property tests of the kernels: every output and every gradient against the reference.

Hypothesis draws shapes (N from 1 to 320 with primes and powers of two +-1; 2-D and 3-D
inputs), dtypes and every flag; ``_helpers.check_case`` applies the three-way tolerance rule
(kernel vs fp64 reference <= 2 x plain PyTorch's error + a few ulps, + a first-order bound of
fp32's rounding where the value is a cancellation of larger terms). On CPU the kernels run in
the Triton interpreter, about 0.05 s per row per direction, so the leading shapes stay small
(mostly < 8 rows) to fit about a thousand examples into a few minutes.

The example counts are set per test (``max_examples``), sized so that `make test` stays within
about 15 minutes on a 2-core machine; ``FUSED_NORM_EXAMPLES=4`` multiplies them for a longer run
(with ``HYPOTHESIS_PROFILE=dev`` each run draws new examples). conftest prints the number run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch
import triton
import triton.language as tl
from _helpers import (
    Case,
    assert_bitwise_equal,
    assert_fresh_memory_unread,
    call_fused,
    check_case,
    count_example,
    few_programs,
    make_inputs,
    max_block_bytes,
    one_row_per_program,
    patched_config,
    split_constexprs,
    split_rows,
    tail_blocks,
    tuned_overrides,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fused_norm import ops
from fused_norm.kernels.backward import _sum_partials_kernel
from fused_norm.kernels.forward import _convert_copy, _widen

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Widths where off-by-one and power-of-two edges live: 1, 2, primes, 2**k - 1, 2**k, 2**k + 1.
SPECIAL_N = (1, 2, 3, 5, 7, 8, 13, 15, 16, 17, 31, 32, 33, 61, 63, 64, 65, 97, 127, 128, 129,
             211, 255, 256, 257, 311, 320)  # fmt: skip
# Rows of 2-D inputs: mostly few (interpreter time is linear in rows), a few more up to 24.
ROWS = (1, 2, 3, 4, 1, 2, 3, 5, 7, 11, 24)

_SCALE = float(os.environ.get("FUSED_NORM_EXAMPLES", "1"))


def _examples(n: int) -> int:
    return max(1, round(n * _SCALE))


EXAMPLES_FN = _examples(380)
EXAMPLES_TWO_BLOCKS = _examples(70)
EXAMPLES_CHUNKED = _examples(130)
EXAMPLES_SPLIT = _examples(60)
EXAMPLES_HELD = _examples(25)
EXAMPLES_LANE = _examples(50)
EXAMPLES_FULL_ROWS = _examples(30)
EXAMPLES_FULL_CHUNKED = _examples(20)
EXAMPLES_FULL_SPLIT = _examples(15)
EXAMPLES_LEGACY = _examples(150)
EXAMPLES_PARALLEL = _examples(110)
EXAMPLES_FRESH_MEMORY = _examples(25)


def widths(max_n: int = 320, min_n: int = 1):
    return st.one_of(st.sampled_from([n for n in SPECIAL_N if min_n <= n <= max_n]),
                     st.integers(min_n, max_n))  # fmt: skip


def leading(max_rows: int = 24):
    rows_2d = st.sampled_from([m for m in ROWS if m <= max_rows]).map(lambda m: (m,))
    rows_3d = st.tuples(st.integers(1, 2), st.integers(1, 4)).filter(
        lambda bt: bt[0] * bt[1] <= max_rows
    )
    return st.one_of(rows_2d, rows_3d)


@st.composite
def cases(draw, api="fn", max_n=320, max_rows=24, min_n=1):
    """A Case for ``api`` ("fn", "legacy" or "parallel") with every flag drawn."""
    n = draw(widths(max_n, min_n))
    dtype = draw(st.sampled_from(DTYPES))
    residual = draw(st.sampled_from([None, "same", "fp32"]))
    has_x1 = api == "parallel" or (api == "fn" and draw(st.booleans()))
    has_w1 = api != "legacy" and draw(st.booleans())
    scale = draw(st.sampled_from([1.0, 1e-2, 30.0]))
    return Case(
        shape=draw(leading(max_rows)) + (n,),
        dtype=dtype,
        weight_dtype=draw(st.sampled_from([None, torch.float32])),
        is_rms_norm=draw(st.booleans()),
        has_bias=draw(st.booleans()),
        residual_dtype={None: None, "same": dtype, "fp32": torch.float32}[residual],
        residual_in_fp32=draw(st.booleans()),
        has_x1=has_x1,
        has_w1=has_w1,
        has_b1=has_w1 and draw(st.booleans()),
        rowscale=api != "parallel" and draw(st.booleans()),
        layerscale=api == "legacy" and draw(st.booleans()),
        dropout_p=draw(st.sampled_from([0.0, 0.1, 0.5])),
        prenorm=draw(st.booleans()),
        zero_centered_weight=api == "fn" and draw(st.booleans()),
        out_dtype=draw(st.sampled_from([None, torch.float32])) if api == "fn" else None,
        eps=draw(st.sampled_from([1e-6, 1e-5, 1e-2])),
        scale=scale,
        # A mean offset of several standard deviations exercises LayerNorm's cancellation; it
        # stays within what the dtype resolves (bf16 keeps 8 bits, so 10 sigma leaves ~5).
        # 2.5 sigma keeps the joint statistics with their most cancellation, 3 sigma takes the
        # exact second pass (kernels._cancels).
        offset=scale * draw(st.sampled_from([0.0, 2.5, 3.0, 10.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


LAYOUTS = {
    # Narrow rows (all these widths) in tiles of several rows, a backward program per row here.
    "tiles": contextlib.nullcontext,
    # One row at a time, as wider rows run on a GPU.
    "one-row": one_row_per_program,
    # Tiles with up to three backward programs: each walks several tiles, the last partly full.
    "tiles-few-programs": lambda: few_programs(3),
}


def fwd_plans() -> list:
    """The forward plans made since the plans were last forgotten (ops.clear_plans: every
    _helpers context manager forgets them on entry)."""
    return [plan for key, plan in ops._PLANS.items() if key[0] == "fwd"]


@settings(max_examples=EXAMPLES_FN)
@given(case=cases("fn"), layout=st.sampled_from(list(LAYOUTS)))
def test_fn_matches_reference(case, layout):
    """layer_norm_fn / rms_norm_fn, one block per row: outputs and all grads vs reference."""
    count_example("test_fn_matches_reference")
    with LAYOUTS[layout]():
        check_case(case, "fn")


@settings(max_examples=EXAMPLES_TWO_BLOCKS)
@given(
    case=cases("fn", min_n=17).filter(lambda c: c.shape[-1] & (c.shape[-1] - 1)),
    joint=st.booleans(),
)
def test_fn_two_blocks_match_reference(case, joint):
    """Widths that are not a power of two held as two blocks (heuristics._tail), forced at
    every width where they are narrower than the padded block (on a GPU only measured widths
    take them, none as narrow as these); test_fn_matches_reference covers the padded block.
    LayerNorm's backward sums c1, c2 per block in one reduction or two (``joint``, the
    backward's JOINT_ROW_SUMS: heuristics._joint_row_sums decides it on a GPU)."""
    count_example("test_fn_two_blocks_match_reference")
    with tail_blocks(True), patched_config(_joint_row_sums=lambda *args: joint):
        check_case(case, "fn")


@pytest.mark.parametrize(
    "n, rows, dropout_p, has_x1, is_rms_norm",
    [(100, 7, 0.2, True, False), (256, 5, 0.0, False, True), (256, 1, 0.5, False, False),
     (33, 6, 0.0, True, True)],
)  # fmt: skip
def test_row_tile_matches_one_row_per_program(n, rows, dropout_p, has_x1, is_rms_norm):
    """Narrow rows as one tile of four per program (heuristics.FWD_TILE_ROWS; the last tile
    partly past the last row) against one row per program: the residual stream and the
    dropout masks are bitwise equal (elementwise, and the masks depend on (seed, column)
    alone), the outputs agree to rounding (the reductions run in another order)."""
    from fused_norm import layer_norm_fn

    gen = torch.Generator().manual_seed(n + rows)
    x = torch.randn(rows, n, generator=gen).bfloat16()
    x1 = torch.randn(rows, n, generator=gen).bfloat16() if has_x1 else None
    res = torch.randn(rows, n, generator=gen).bfloat16()
    w, b = torch.randn(n, generator=gen), None if is_rms_norm else torch.randn(n, generator=gen)
    runs = []
    for per_program in (1, 4):
        with patched_config(FWD_TILE_ROWS=per_program), torch.no_grad():
            torch.manual_seed(rows)  # the same dropout seeds
            runs.append(layer_norm_fn(
                x, w, b, residual=res, x1=x1, eps=1e-5, dropout_p=dropout_p, prenorm=True,
                residual_in_fp32=True, is_rms_norm=is_rms_norm, return_dropout_mask=True,
            ))  # fmt: skip
            (plan,) = fwd_plans()
            assert plan.rows == per_program, plan
    names = ("y", "residual_out", "mask", "mask1")
    for name, one, tile in zip(names, *runs):
        if one is None:
            assert tile is None, name
        elif name in ("residual_out", "mask", "mask1"):
            assert torch.equal(one, tile), name
        else:
            torch.testing.assert_close(tile.float(), one.float(), rtol=2**-7, atol=1e-5,
                                       msg=name)  # fmt: skip


@st.composite
def chunked_cases(draw):
    """Cases for the multi-chunk path, with the block cap that forces it: 64 bytes is 16 fp32
    or 32 16-bit columns per chunk, 256 bytes four times that; at most ~8 chunks and 4 rows.
    The backward's column blocks exchange their row sums (heuristics.EXCHANGE) or take them
    from the pre-pass, with a program per row or two programs' rows in all."""
    block_bytes = draw(st.sampled_from([64, 256]))
    case = draw(cases("fn", max_n=128 if block_bytes == 64 else 320, max_rows=4))
    return case, block_bytes, draw(st.booleans()), draw(st.sampled_from([None, 2]))


@settings(max_examples=EXAMPLES_CHUNKED)
@given(arg=chunked_cases())
def test_fn_chunked_matches_reference(arg):
    """The wide-row path (NUM_CHUNKS > 1) forced by a small MAX_BLOCK_BYTES. Exchanging row
    sums under the interpreter, a row block's first program finds its partners' words missing
    and computes them (the bounded wait's fallback); the others find them published."""
    count_example("test_fn_chunked_matches_reference")
    case, block_bytes, exchange, programs = arg
    # restored on exit, also on failure
    with max_block_bytes(block_bytes), patched_config(EXCHANGE=exchange):
        if programs is None:
            check_case(case, "fn")
        else:
            with few_programs(programs):
                check_case(case, "fn")


@st.composite
def split_cases(draw):
    """Cases for split rows, with the part size that forces them: 64 bytes (16 fp32 or 32
    16-bit columns) or 256 bytes; rows wider than one part even in 16-bit, at most 4 rows."""
    block_bytes = draw(st.sampled_from([64, 256]))
    max_n = 128 if block_bytes == 64 else 320
    return draw(cases("fn", max_n=max_n, max_rows=4, min_n=block_bytes // 2 + 1)), block_bytes


@settings(max_examples=EXAMPLES_SPLIT)
@given(arg=split_cases(), api=st.sampled_from(["fn", "fn", "legacy"]))
def test_split_rows_match_reference(arg, api):
    """Forward rows split over several programs (heuristics._split_plan), forced by small parts: 64
    or 256 bytes. Under the interpreter the first part of each row finds its partners'
    statistics missing and computes them (the bounded wait's fallback); the later parts merge
    the published words."""
    count_example("test_split_rows_match_reference")
    case, block_bytes = arg
    if api == "legacy":
        case = dataclasses.replace(case, has_x1=False, has_w1=False, has_b1=False,
                                   zero_centered_weight=False, out_dtype=None,
                                   layerscale=case.seed % 2 == 0)  # fmt: skip
    with split_rows(block_bytes):
        check_case(case, api)


@st.composite
def lane_chunk_cases(draw):
    """Norms of x alone (no residual, x1 or dropout) in 16-bit whose rows pad to 256 columns,
    in chunks of 32 or 64 columns summed per column lane (a tuned table's ``chunk`` entry: the
    two sweeps over chunks that the rules give only rows wider than one block)."""
    case = draw(cases("fn", min_n=129, max_n=256, max_rows=4))
    case = dataclasses.replace(
        case, dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])), residual_dtype=None,
        residual_in_fp32=False, has_x1=False, has_w1=False, has_b1=False, dropout_p=0.0,
        prenorm=False,
    )  # fmt: skip
    return case, draw(st.sampled_from([32, 64]))


@settings(max_examples=EXAMPLES_LANE)
@given(arg=lane_chunk_cases())
def test_lane_chunked_rows_unrolled(arg):
    """Rows in lane-summed chunks (a table's ``chunk`` and ``unroll``) match the reference with
    their two sweeps unrolled, and give bitwise the outputs of the loop."""
    count_example("test_lane_chunked_rows_unrolled")
    case, chunk = arg
    n = case.shape[-1]
    runs = []
    t = make_inputs(case)
    for unroll in (True, False):
        with tuned_overrides(fwd={"chunk": chunk, "unroll": unroll}):
            if unroll:
                outs = check_case(case, "fn", t=t)[0]
            else:
                with torch.no_grad():
                    outs = call_fused(case, t)[0]
            (plan,) = fwd_plans()
            c = plan.constexprs
            assert (c["BLOCK_N"], c["NUM_CHUNKS"]) == (chunk, -(-n // chunk)), "not lane-chunked"
            assert c["UNROLL"] == (c["NUM_CHUNKS"] if unroll else 1)
            runs.append({k: v.detach() for k, v in outs.items()})
    for name in runs[0]:
        assert_bitwise_equal(name, runs[0][name], runs[1][name])


FULL_LAYOUTS = {
    "tiles": contextlib.nullcontext,
    "one-row": one_row_per_program,
    "two-blocks": lambda: tail_blocks(True),
}


@settings(max_examples=EXAMPLES_FULL_ROWS)
@given(case=cases("fn", min_n=2), layout=st.sampled_from(list(FULL_LAYOUTS)))
@example(case=Case(shape=(5, 256), dtype=torch.bfloat16, seed=3), layout="one-row")
@example(case=Case(shape=(3, 320), dtype=torch.float16, residual_dtype=torch.float32, seed=4),
         layout="two-blocks")  # fmt: skip
@example(case=Case(shape=(7, 64), dtype=torch.float32, has_x1=True, seed=5), layout="tiles")
def test_full_rows_match_masked_rows(case, layout):
    """Rows whose width fills their block(s) take it as a constant (the plans' FULL_ROW: the
    column masks fold away) and match the reference, every flag drawn; their outputs are
    bitwise those of the same rows taking the width as a runtime value (a table's
    ``full_row: False``)."""
    count_example("test_full_rows_match_masked_rows")
    _full_rows_match_masked(case, FULL_LAYOUTS[layout], {}, {"full_row": False}, None)


@st.composite
def full_chunked_cases(draw):
    """Rows of a whole number of 64-byte chunks (16 fp32 or 32 16-bit columns: widths of 2 to 8
    times 32 columns), at most 4 rows, every flag drawn."""
    case = draw(cases("fn", max_rows=4))
    return dataclasses.replace(case, shape=(*case.shape[:-1], 32 * draw(st.integers(2, 8))))


def _full_rows_match_masked(case, layout, full, masked, what):
    """``case`` under the layout context ``layout()`` with the forward's table overrides
    ``full``: it matches the reference, and (unless ``what`` is None) the forward took its
    width as a constant (FULL_ROW); with ``masked`` instead the same inputs give bitwise the
    same outputs, the width a runtime value."""
    t = make_inputs(case)
    with layout(), tuned_overrides(fwd=full):
        got = check_case(case, "fn", t=t)[0]
        (plan,) = fwd_plans()
        if what is not None:
            assert plan.constexprs["FULL_ROW"], f"the {what} did not take the width as a constant"
    with layout(), tuned_overrides(fwd=masked), torch.no_grad():
        torch.manual_seed(case.seed)
        want = call_fused(case, t)[0]
        (plan,) = fwd_plans()
        assert not plan.constexprs["FULL_ROW"], "the masked run took the width as a constant"
    for name in want:
        assert_bitwise_equal(name, got[name].detach(), want[name])


@settings(max_examples=EXAMPLES_FULL_CHUNKED)
@given(case=full_chunked_cases())
@example(case=Case(shape=(3, 96), dtype=torch.bfloat16, residual_dtype=torch.float32,
                   dropout_p=0.2, prenorm=True, seed=6))  # fmt: skip
def test_chunked_full_rows_match_masked_rows(case):
    """Chunked rows (a 64-byte block cap) of a whole number of chunks take their width as a
    constant (FULL_ROW, kernels' _col_mask) and match the reference, every flag drawn; their
    outputs are bitwise those of the same rows with their chunks' masks."""
    count_example("test_chunked_full_rows_match_masked_rows")
    _full_rows_match_masked(case, lambda: max_block_bytes(64), {}, {"full_row": False},
                            "chunked forward")  # fmt: skip


@settings(max_examples=EXAMPLES_FULL_SPLIT)
@given(case=full_chunked_cases())
@example(case=Case(shape=(2, 128), dtype=torch.float16, seed=7))
def test_split_full_rows_match_masked_rows(case):
    """Split rows (64-byte parts) of whole parts that fold their parts' masks and counts (a
    table's ``full_row: True``, kernels' _fwd_split_row with FULL_ROW) match the reference,
    every flag drawn, and give bitwise the outputs of the same parts with their masks (the
    rules' default for split rows)."""
    count_example("test_split_full_rows_match_masked_rows")
    _full_rows_match_masked(case, lambda: split_rows(64), {"full_row": True}, {},
                            "split forward")  # fmt: skip


@triton.jit
def widen_kernel(H, OUT, n, N: tl.constexpr, CONVERT: tl.constexpr):
    cols = tl.arange(0, N)
    h = tl.load(H + cols)
    if CONVERT:
        out = _convert_copy(h, n < 0)  # n >= 0: the zero the kernels take from N
    else:
        out = _widen(h)
    tl.store(OUT + cols, out)


@pytest.mark.parametrize(
    "dtype, route",
    [(torch.bfloat16, "widen"), (torch.float16, "widen"), (torch.float16, "convert")],
)
def test_widen_is_exact_for_every_16_bit_pattern(dtype, route, device):
    """The held rows' routes back to fp32 (the split plans' HOLD), kernels/forward.py's _widen
    and, for fp16, _convert_copy, equal ``.to(torch.float32)`` for all 65536 bit patterns:
    zeros, subnormals, infinities (NaNs stay NaN)."""
    h = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).to(device)
    out = torch.empty(h.shape, dtype=torch.float32, device=device)
    widen_kernel[(1,)](h, out, h.numel(), h.numel(), route == "convert")
    ref = h.float()
    nan = ref.isnan()
    assert torch.equal(out[~nan].view(torch.int32), ref[~nan].view(torch.int32))
    assert bool(out[nan].isnan().all())


@st.composite
def held_cases(draw):
    """16-bit cases whose stream is 16-bit too (no residual, or one of x's dtype; no fp32
    stream, no fp32 output: a held row holds a 16-bit tensor), and the split parts' size: 64
    or 256 bytes (only split rows are held)."""
    case = draw(cases("fn", max_n=320, max_rows=4, min_n=17))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    residual = dtype if case.residual_dtype is not None else None
    case = dataclasses.replace(case, dtype=dtype, residual_dtype=residual,
                               residual_in_fp32=False, out_dtype=None)  # fmt: skip
    return case, draw(st.sampled_from([64, 256]))


@settings(max_examples=EXAMPLES_HELD)
@given(arg=held_cases())
# fp16 LayerNorm, whose rule's route is _convert_copy: x alone with the mean 3 standard
# deviations off (the exact M2), without, and the x1 path's stored stream.
@example(arg=(Case(shape=(3, 300), dtype=torch.float16, offset=3.0, seed=7), 256))
@example(arg=(Case(shape=(3, 300), dtype=torch.float16, seed=8), 64))
@example(arg=(Case(shape=(2, 200), dtype=torch.float16, residual_dtype=torch.float16,
                   has_x1=True, prenorm=True, offset=3.0, seed=9), 64))  # fmt: skip
def test_held_rows_match_fp32_rows_bitwise(arg):
    """A split forward row held in registers as the 16-bit tensor its sum equals (the plans'
    HOLD: x itself, or the stored stream) gives bitwise the outputs, stream and masks of the
    row held in fp32 (HOLD 0): the held values widen exactly, by kernels' _widen (HOLD 1,
    either 16-bit dtype) and, for fp16, by _convert_copy (HOLD 2), each forced on every split
    plan (_helpers.split_constexprs)."""
    count_example("test_held_rows_match_fp32_rows_bitwise")
    case, part_bytes = arg
    holds = (0, 1, 2) if case.dtype == torch.float16 else (0, 1)
    runs = []
    for hold in holds:
        t = make_inputs(case)
        torch.manual_seed(case.seed)  # the dropout seeds come from torch's generator
        with split_rows(part_bytes), split_constexprs(HOLD=hold), torch.no_grad():
            runs.append(call_fused(case, t))
            plans = fwd_plans()
            assert all(p.constexprs["HOLD"] == (hold if p.split > 1 else 0) for p in plans)
    outs, masks = runs[0]
    for held, held_masks in runs[1:]:
        assert outs.keys() == held.keys()
        for name in outs:
            assert_bitwise_equal(name, held[name], outs[name])
        for name, a, b in zip(("mask", "mask1"), held_masks, masks):
            if b is not None:
                assert_bitwise_equal(name, a, b)


@settings(max_examples=EXAMPLES_LEGACY)
@given(case=cases("legacy"), chunked=st.sampled_from([None, None, None, 256]))
def test_legacy_matches_reference(case, chunked):
    """dropout_add_layer_norm / dropout_add_rms_norm with rowscale and layerscale; the
    layerscale gradient is checked against the reference on ``x0 * layerscale``."""
    count_example("test_legacy_matches_reference")
    with max_block_bytes(chunked):
        check_case(case, "legacy")


@settings(max_examples=EXAMPLES_PARALLEL)
@given(case=cases("parallel"))
def test_parallel_residual_matches_reference(case):
    """dropout_add_*_parallel_residual: two inputs, one or two outputs."""
    count_example("test_parallel_residual_matches_reference")
    check_case(case, "parallel")


# ----------------------------------------------------------------------------------------------
# Pinned regressions: small explicit cases of what once broke.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        # A 16-bit residual stream is re-read by the backward as stored (rounded), so the
        # forward's statistics must come from the same rounded values; rows whose variance is
        # near eps amplify any mismatch by rstd = 1/sqrt(eps). RMSNorm with N = 1:
        # dx ~ (1 - xhat^2) cancels; LayerNorm with N = 1: xhat must be exactly 0.
        Case(shape=(7, 1), dtype=torch.float16, is_rms_norm=True, residual_dtype=torch.float16,
             scale=0.01, offset=0.1, seed=88),
        Case(shape=(8, 1), dtype=torch.float16, residual_dtype=torch.float16, seed=1),
        Case(shape=(6, 1), dtype=torch.bfloat16, rowscale=True, prenorm=True, seed=2),
    ],
    ids=["rms-n1-fp16-stream", "ln-n1-fp16-stream", "ln-n1-bf16-rowscale"],
)  # fmt: skip
def test_stream_rounding_regressions(case):
    check_case(case, "fn")


@pytest.mark.parametrize(
    "case",
    [
        # RMSNorm with N = 1: ds = r * g * (1 - xhat^2) = r * g * eps / (s^2 + eps); with
        # s ~ 0.01 and eps = 1e-6 the terms r * g cancel to 1 %, and fp32 errs by ulps of the
        # terms. Kernel 7.5e-6 against PyTorch's 9e-7 on a gradient of 0.73 made of terms of
        # ~43 (found by hypothesis, dev profile): the rule needs _helpers.rounding_bounds.
        Case(shape=(1, 1), is_rms_norm=True, has_bias=False, residual_dtype=torch.float32,
             has_x1=True, has_w1=True, rowscale=True, eps=1e-6, scale=0.01, seed=18),
        Case(shape=(2, 1), is_rms_norm=True, has_bias=False, residual_in_fp32=True,
             has_x1=True, has_w1=True, rowscale=True, eps=1e-6, scale=0.01, seed=18),
        # LayerNorm with N = 2: ds is 0 up to eps's share, the terms cancel entirely.
        Case(shape=(2, 2), residual_dtype=torch.float32, has_x1=True, has_w1=True,
             rowscale=True, eps=1e-6, scale=0.01, seed=24),
        # LayerNorm with N = 2 and a mean offset of 10 sigma: s - mean rounds at the scale of
        # s, xhat errs by ~10 ulps; d(weight1) = dy1 * xhat over one row: kernel 9.0e-7,
        # PyTorch 1.4e-7 on 0.61 (hypothesis, dev profile, shrunk).
        Case(shape=(1, 2), has_bias=False, has_w1=True, offset=10.0, seed=2),
    ],
    ids=["rms-n1-x1-fp32-residual", "rms-n1-x1-residual-in-fp32", "ln-n2-x1", "ln-n2-offset-w1"],
)  # fmt: skip
def test_rounding_regressions(case):
    """Small rows where the result is a cancellation of larger terms (see
    _helpers.rounding_bounds)."""
    check_case(case, "fn")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_single_column_layer_norm_is_constant(dtype, device):
    """LayerNorm of one column normalises to exactly 0: y = bias, and every gradient but the
    bias's is exactly 0, whatever the rounding of the (16-bit) residual stream."""
    from fused_norm import layer_norm_fn

    x = torch.randn(16, 1, device=device, dtype=dtype, requires_grad=True)
    residual = torch.randn(16, 1, device=device, dtype=dtype, requires_grad=True)
    weight = torch.ones(1, device=device, dtype=dtype, requires_grad=True)
    bias = torch.full((1,), 0.5, device=device, dtype=dtype, requires_grad=True)
    y = layer_norm_fn(x, weight, bias, residual=residual, eps=1e-5)
    assert bool((y == 0.5).all()), f"y = {y.flatten().tolist()}"
    y.backward(torch.randn_like(y))
    for name, t in (("weight", weight), ("x", x), ("residual", residual)):
        assert not t.grad.any(), f"d({name}) = {t.grad.flatten().tolist()}, expected 0"


@pytest.mark.parametrize("is_rms_norm", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_legacy_rowscale_layerscale(is_rms_norm, dtype, device):
    """Pinned: the legacy API with rowscale, layerscale, dropout and a residual; the
    layerscale gradient against the reference on ``x0 * layerscale``."""
    case = Case(shape=(2, 3, 50), dtype=dtype, weight_dtype=torch.float32,
                is_rms_norm=is_rms_norm, residual_dtype=torch.float32, rowscale=True,
                layerscale=True, dropout_p=0.1, prenorm=True, seed=9)  # fmt: skip
    _, grads, _ = check_case(case, "legacy", device=device)
    assert grads["layerscale"] is not None and grads["layerscale"].shape == (50,)


@pytest.mark.parametrize(
    "partials, programs, n, block_n, block_p, stages",
    [
        (1, 5, 37, 16, 4, 1),
        (2, 17, 16, 16, 8, 3),
        (5, 300, 70, 32, 64, 3),
        (4, 9, 300, 256, 16, 1),
        (4, 3, 2500, 1024, 4, 1),
    ],  # the last: a tile of the few row blocks
)
def test_partials_sum(partials, programs, n, block_n, block_p, stages, device):
    """kernels' _sum_partials_kernel: each slab of the backward's fp32 partials summed over its
    row blocks (a count that is not a multiple of the tile, pipelined or not; widths past the
    last column block) and cast to its own gradient's dtype, as fp64 sums rounded to it are to
    within fp32's summation error."""
    torch.manual_seed(partials)
    dev = torch.device(device)
    parts = torch.randn(partials, programs, n, device=dev) * 4
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16)
    grads = [torch.full((n,), float("nan"), dtype=d, device=dev) for d in dtypes[:partials]]
    _sum_partials_kernel[(-(-n // block_n), partials)](
        parts, *grads, *[None] * (5 - partials), programs, n, BLOCK_N=block_n, BLOCK_P=block_p,
        PARTIALS=partials, STAGES=stages, num_warps=ops.PARTIALS_SUM_WARPS,
    )  # fmt: skip
    for k, g in enumerate(grads):
        want = parts[k].double().sum(0)
        # fp32 summation: at most programs * 2**-24 * sum |x| apart, before the final rounding
        bound = programs * 2.0**-24 * parts[k].double().abs().sum(0) + 1e-30
        ulp = torch.finfo(g.dtype).eps * want.abs()
        assert g.dtype == dtypes[k]
        assert ((g.double() - want).abs() <= bound + ulp).all(), k


# Layouts for the fresh-memory test: LAYOUTS, and rows in column blocks (exchanging their row
# sums, or after the row-sums pre-pass) and split over several forward programs.
FRESH_LAYOUTS = {
    **LAYOUTS,
    "chunked-exchange": lambda: _stacked(max_block_bytes(64), patched_config(EXCHANGE=True)),
    "chunked-prepass": lambda: _stacked(max_block_bytes(64), patched_config(EXCHANGE=False)),
    "chunked-few-programs": lambda: _stacked(max_block_bytes(256), few_programs(2)),
    "split": lambda: split_rows(64),
}


@contextlib.contextmanager
def _stacked(*managers):
    with contextlib.ExitStack() as stack:
        for m in managers:
            stack.enter_context(m)
        yield


@settings(max_examples=EXAMPLES_FRESH_MEMORY)
@given(case=cases("fn", max_rows=7), layout=st.sampled_from(list(FRESH_LAYOUTS)))
# The row-sums pre-pass (16-bit weights, five 64-byte chunks), whose sums the column blocks then
# read from the fresh row-sums buffer.
@example(
    case=Case(shape=(3, 160), dtype=torch.bfloat16, residual_dtype=torch.bfloat16,
              dropout_p=0.1, prenorm=True, seed=1),
    layout="chunked-prepass",
)  # fmt: skip
def test_outputs_independent_of_fresh_memory(case, layout):
    """Every output, mask and gradient is bitwise the same whether the tensors the package
    allocates (outputs, statistics, seeds, partial gradients, row sums) start as zeros or as
    NaN / 0x5A bytes / True: no kernel reads memory that nothing wrote. Fresh memory is often
    zeros, so a read of it can pass every reference test and still go wrong in a long-running
    process whose allocator hands back used blocks."""
    count_example("test_outputs_independent_of_fresh_memory")
    t = make_inputs(case)
    with FRESH_LAYOUTS[layout]():
        assert_fresh_memory_unread(case, t)

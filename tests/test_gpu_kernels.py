"""GPU tests of the kernels: production widths (100 to 262 144 columns), all dtypes, the
persistent backward grid with many rows per program, bitwise determinism, and int64 row
offsets. Same three-way tolerance rule as test_kernels.py, the fp64 truth computed on the GPU.

Every test is marked ``gpu`` (conftest deselects them where CUDA is absent). Runtime is
dominated by Triton compiles, one forward and one backward per (flag set, dtype, block
configuration): about 80 compiles for the matrix below, so the matrix is a deliberate
selection rather than a full product. Its rows were picked to reach every layout the launch
rules have given some row (one block, two blocks, tiles of narrow rows, chunks, split rows,
column blocks exchanging their row sums or after the row-sums pre-pass, the Gluon backward,
register caps); which layout a row takes now is heuristics' business, and the matrix checks
the result whatever it is. Tests that force a layout patch heuristics' constants or give
plan overrides (_helpers.patched_config, split_constexprs); each asks ops' plan cache
which plan ran (``ops._PLANS`` after ``ops.clear_plans()``).
``variant log #n``: row n of the old variant log, in git history
(``git show 0825aa7:bench/NOTES.md``).
"""

from __future__ import annotations

import pytest
import torch
from _helpers import (
    Case,
    assert_bitwise_equal,
    assert_fresh_memory_unread,
    call_fused,
    check_case,
    make_inputs,
    patched_config,
    run_filled,
    split_constexprs,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.gpu

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
ALL_N = (768, 1024, 4096, 8192, 12288, 16384, 32768, 65536, 131072, 262144)

# Flag sets: plain LN / RMS, add + RMS prenorm (the Llama block), dropout + add + LN prenorm
# with an fp32 residual stream (the GPT-2 block), and two inputs with two outputs (parallel
# attention/MLP blocks).
FLAGS = {
    "ln": dict(),
    "rms": dict(is_rms_norm=True, has_bias=False),
    "add_rms_prenorm": dict(is_rms_norm=True, has_bias=False, residual_dtype="same",
                            prenorm=True, weight_dtype=FP32),
    "drop_add_ln_prenorm_fp32res": dict(residual_dtype=FP32, residual_in_fp32=True,
                                        dropout_p=0.1, prenorm=True, weight_dtype=FP32),
    "x1_w1": dict(has_x1=True, has_w1=True, has_b1=True, residual_dtype="same"),
    # A 16-bit stream with dropout: the forward's register caps.
    "drop_add_ln_prenorm": dict(residual_dtype="same", dropout_p=0.1, prenorm=True),
    # An fp32 stream: the 4-byte rows' launch choices.
    "add_rms_prenorm_fp32res": dict(is_rms_norm=True, has_bias=False, residual_dtype=FP32,
                                    prenorm=True),
    "x1_w1_fp32res": dict(has_x1=True, has_w1=True, has_b1=True, residual_dtype=FP32,
                          prenorm=True),
    # 16-bit rows with fp32 weights (autocast training): their own launch choices.
    "ln_w32": dict(weight_dtype=FP32),
    "rms_w32": dict(is_rms_norm=True, has_bias=False, weight_dtype=FP32),
    "x1_w1_w32": dict(has_x1=True, has_w1=True, has_b1=True, residual_dtype="same",
                      weight_dtype=FP32),
    "drop_add_ln_prenorm_w32": dict(residual_dtype="same", dropout_p=0.1, prenorm=True,
                                    weight_dtype=FP32),
    # The x1 path with dropout (x1's own mask), prenorm: its backward's warps at 1025-2048
    # columns.
    "x1_w1_drop": dict(has_x1=True, has_w1=True, has_b1=True, residual_dtype="same",
                       dropout_p=0.1, prenorm=True),
}  # fmt: skip

MATRIX = (
    [("ln", n, d) for n in ALL_N for d in (FP32, BF16)]
    + [("ln", n, FP16) for n in (1024, 16384, 131072)]
    + [("rms", n, FP16) for n in (768, 8192, 32768, 262144)]
    + [("rms", 32768, BF16)]  # lane-summed chunks of 32 warps (LayerNorm unrolled: ALL_N)
    # Lane-summed chunks , the last partly empty at 16000, 8000, 30000,
    # 4000 and 20000; 12288 by its own width, in place of two blocks.
    + [("rms", 16384, BF16), ("ln", 16000, BF16), ("rms", 8000, BF16), ("ln", 30000, BF16)]
    + [("rms", 4000, BF16), ("rms", 12288, BF16), ("ln", 20000, BF16)]
    + [("add_rms_prenorm", n, BF16) for n in (4096, 16384, 65536, 262144)]
    + [("add_rms_prenorm", 12288, FP16)]
    + [("drop_add_ln_prenorm_fp32res", n, BF16) for n in (1024, 8192, 131072)]
    + [("drop_add_ln_prenorm_fp32res", 32768, FP32)]
    + [("x1_w1", n, FP16) for n in (768, 12288, 65536)]
    + [
        ("drop_add_ln_prenorm", n, d)
        for n, d in ((1024, BF16), (12288, FP16), (16384, BF16), (65536, BF16))
    ]
    # Narrow rows: several rows per forward program (the last program partly empty: _rows is
    # odd), 1-2 warps per backward program; plain norms take several rows up to 512 columns.
    + [(f, n, BF16) for f in ("ln", "drop_add_ln_prenorm_fp32res") for n in (100, 256)]
    + [("ln", 400, BF16), ("rms", 512, BF16), ("x1_w1", 512, BF16), ("add_rms_prenorm", 512, BF16)]
    + [("drop_add_ln_prenorm", 512, BF16)]  # the backward's tiles of rows with dropout
    # Widths held as two blocks : forward 2560 = 2048 + 512, 3000 =
    # 2048 + 1024 (the tail partly empty), 5120 = 4096 + 1024, 6144, 12288 (above); backward
    # 5120 and 6144.
    + [("drop_add_ln_prenorm", 5120, BF16), ("rms", 5120, BF16), ("x1_w1", 2560, BF16)]
    + [("ln", 3000, FP32), ("add_rms_prenorm", 6144, BF16)]
    # LayerNorm's backward at 8K-10K 16-bit columns as one program of two blocks, with
    # dropout too and beside fp32 weights (variant log #65); 64
    # KB rows split with dropout or x1 .
    + [("ln", 10240, BF16), ("drop_add_ln_prenorm", 32768, BF16), ("x1_w1", 32768, BF16)]
    # The backward's row-sums pre-pass in parts of a row, whose shares a second kernel adds
    # (16-bit weights; variant log #84).
    + [("drop_add_ln_prenorm", 131072, BF16), ("x1_w1", 262144, BF16)]
    # ... 16 of them for 16-bit rows without x1 at 256K (#107)
    + [("drop_add_ln_prenorm", 262144, FP16)]
    + [("ln", 9216, FP16), ("drop_add_ln_prenorm", 10240, BF16)]
    + [("drop_add_ln_prenorm_w32", 9216, BF16)]
    # ... and of 4-byte elements: fp32 rows, bf16 x with an fp32 stream (#68)
    + [("ln", 10240, FP32), ("drop_add_ln_prenorm", 9216, FP32)]
    + [("drop_add_ln_prenorm_fp32res", 10240, BF16)]
    # ... and one pair of row sums per block, also on 4096 + 1024 with dropout (#69)
    + [("drop_add_ln_prenorm_fp32res", 5120, BF16)]
    # ... and one weight gradient's rows at 16K-20K, 16384 + a tail of at most 4096 (#65)
    + [("rms", 18432, BF16), ("add_rms_prenorm", 20480, FP16)]
    # add + RMSNorm's backward of 16-bit rows in one padded 8192 block under a register cap of
    # 64 (6144 above), and on 2 warps at 1024 columns ;
    # RMSNorm of x alone at 6144 in the padded block .
    + [("add_rms_prenorm", 8192, BF16), ("add_rms_prenorm", 5120, FP16)]
    + [("add_rms_prenorm", 1024, BF16), ("rms", 6144, BF16)]
    # ... and of fp16 rows under a cap of 128 (variant log #112; 8192 above); since #113
    # the padded rows (6144, 7168) on 16 warps under 64, 8192 too on Triton 3.9
    + [("rms", 6144, FP16), ("rms", 7168, FP16), ("rms", 8192, BF16), ("rms_w32", 6144, BF16)]
    # The x1 path with dropout on 4 warps at 1025-2048 columns (#114), 2 at 1024
    + [("x1_w1_drop", n, d) for n, d in ((2048, BF16), (1536, FP16), (1024, BF16))]
    + [("x1_w1_drop", 2048, FP32)]
    # ... and without dropout at 1024 columns: 4-byte rows on 4 warps on Triton 3.6, 16-bit
    # rows on Triton 3.9 (#116)
    + [("x1_w1", 1024, FP32), ("x1_w1_fp32res", 1024, BF16), ("x1_w1", 1024, BF16)]
    # Rows of 4-byte elements (variant log #57): one 16K block with dropout under a cap of
    # 64 (bf16 x, fp32 stream) or on 32 warps under 80 (fp32), x1 with an fp32 stream on 32
    # warps under 64, split rows with dropout on 2 warps; add + RMSNorm's backward on 16
    # warps at 4096 columns, 8 at 16384.
    + [("drop_add_ln_prenorm_fp32res", n, d) for n, d in ((16384, BF16), (16384, FP32))]
    + [("drop_add_ln_prenorm_fp32res", 65536, BF16), ("x1_w1_fp32res", 16384, BF16)]
    + [("add_rms_prenorm_fp32res", n, BF16) for n in (4096, 16384)]
    + [("add_rms_prenorm", 4096, FP32)]
    # 64 KB rows with dropout in 16 parts of 2K columns on 2 warps (bf16
    # above), RMSNorm's backward at 2048 columns on 2 stages .
    + [("drop_add_ln_prenorm", 32768, FP16), ("rms", 2048, BF16)]
    # fp32 weights beside 16-bit rows (variant log #59): plain LayerNorm rows of 24K-32K
    # columns split (held, 2 warps), held RMSNorm in 16 parts on 2 warps, the x1 path's one
    # block on 16 / 32 warps, and the backward of dropout / x1 rows without the exchange.
    + [("ln_w32", n, BF16) for n in (24576, 32768)]
    + [("ln_w32", 32768, FP16)]
    + [("rms_w32", 65536, d) for d in (BF16, FP16)]
    + [("x1_w1_w32", n, BF16) for n in (6144, 8192, 16384, 32768)]
    # ... the x1 path's 16K forward block under a cap of 96 (variant log #62)
    + [("x1_w1_w32", 16384, FP16)]
    + [("drop_add_ln_prenorm_w32", n, BF16) for n in (16384, 65536)]
    # ... LayerNorm's one 1024-column block on 1 warp and 16K rows in 2K lane-summed chunks
    # beside fp32 weights, and its 4096-column row loading weights ahead (variant log
    # #100; 4096 bf16 in ALL_N)
    + [("ln_w32", n, BF16) for n in (1024, 16384, 16000)]
    + [("ln_w32", 1024, FP16)]
    + [("ln", 4096, FP16)]
)


def _rows(n: int) -> int:
    """About 2M elements per tensor (the fp64 reference stays cheap), odd, at least 5 rows."""
    return max(4, (1 << 21) // n) + 1


def _case(flags: str, n: int, dtype: torch.dtype, rows=None, seed=0) -> Case:
    kw = dict(FLAGS[flags])
    if kw.get("residual_dtype") == "same":
        kw["residual_dtype"] = dtype
    return Case(shape=(rows or _rows(n), n), dtype=dtype, seed=seed, **kw)


@pytest.mark.parametrize(
    "flags, n, dtype", MATRIX, ids=[f"{f}-{n}-{str(d)[6:]}" for f, n, d in MATRIX]
)
def test_gpu_matches_reference(flags, n, dtype):
    """Outputs and every gradient vs the fp64 reference (three-way rule) at real widths: rows
    wider than one program's registers take the forward's split or chunked rows and the
    backward's column blocks (or the Gluon backward's slices), whichever the rules give."""
    check_case(_case(flags, n, dtype), "fn", device="cuda")


@pytest.mark.parametrize(
    "n, dtype", [(1024, FP32), (4096, BF16), (12288, BF16), (16384, BF16), (16384, FP32),
                 (65536, FP32), (65536, FP16), (131072, FP16), (262144, BF16)],
)  # fmt: skip
@pytest.mark.parametrize("offset", [2.6, 2.9])
def test_gpu_layer_norm_joint_statistics(n, dtype, offset):
    """LayerNorm's mean and M2 from one joint sum of (s, s^2) (kernels._sums): with the mean
    2.6 standard deviations off zero the joint form is kept with the most cancellation it
    allows (sum(s^2) = 7.8 M2), at 2.9 the kernels recompute M2 over s - mean; one whole
    block, two blocks (12288), chunks and split rows, whichever the rules give."""
    case = Case(shape=(_rows(n), n), dtype=dtype, offset=offset, seed=11)
    check_case(case, "fn", device="cuda")


def test_gpu_persistent_grid_many_rows():
    """M far above the backward's program count (2 x SMs): each program reduces ~60 rows of
    dW/dB partials; checked against the reference."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    rows = 2 * sms * 60 + 7
    case = Case(shape=(rows, 1024), dtype=BF16, weight_dtype=FP32, residual_dtype=FP32,
                has_x1=True, has_w1=True, dropout_p=0.1, prenorm=True, seed=3)  # fmt: skip
    check_case(case, "fn", device="cuda")


@pytest.mark.parametrize("n", [4096, 131072])
def test_gpu_backward_bitwise_deterministic(n):
    """Two seeded forward+backward runs, and two backward passes of one graph, are bitwise
    equal: 16M elements, ~15 rows per backward program at N = 4096, the chunked path at
    N = 131072."""
    rows = (1 << 24) // n + 3
    case = Case(shape=(rows, n), dtype=BF16, weight_dtype=FP32, residual_dtype=FP32,
                has_x1=True, has_w1=True, has_b1=True, dropout_p=0.1, prenorm=True, seed=4)  # fmt: skip
    t = make_inputs(case, "cuda")
    leaves = [v for v in t.values() if v is not None and v.requires_grad]
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        outs, masks = call_fused(case, t)
        gen = torch.Generator(device="cuda").manual_seed(1)
        ups = [
            torch.randn(v.shape, generator=gen, device="cuda").to(v.dtype) for v in outs.values()
        ]
        g1 = torch.autograd.grad(list(outs.values()), leaves, ups, retain_graph=True)
        g2 = torch.autograd.grad(list(outs.values()), leaves, ups)
        for i, (a, b) in enumerate(zip(g1, g2)):
            assert_bitwise_equal(f"grad {i}, same graph", a, b)
        runs.append([*outs.values(), *masks, *g1])
    for i, (a, b) in enumerate(zip(*runs)):
        if a is not None or b is not None:
            assert_bitwise_equal(f"output/grad {i}, two runs", a, b)


# Every forward and backward layout at least once: tiles of narrow rows, one block, two blocks
# (12288), the shared-memory backward (12288, 16384 with two partials), lane-summed chunks,
# column blocks exchanging row sums or after the pre-pass, split forward rows; bf16 and fp32.
FRESH = (
    [(f, n, BF16) for f in ("ln", "drop_add_ln_prenorm", "x1_w1")
     for n in (128, 4096, 12288, 16384, 65536, 262144)]
    + [("add_rms_prenorm", 4096, BF16), ("add_rms_prenorm", 32768, BF16), ("ln", 1000, FP32),
       ("add_rms_prenorm", 128, FP32),  # the example GPT's norm (fp32 runs)
       ("drop_add_ln_prenorm_fp32res", 16384, FP32), ("x1_w1_fp32res", 65536, FP32)]
)  # fmt: skip


@pytest.mark.parametrize(
    "flags, n, dtype", FRESH, ids=[f"{f}-{n}-{str(d)[6:]}" for f, n, d in FRESH]
)
def test_gpu_outputs_independent_of_fresh_memory(flags, n, dtype):
    """As test_kernels' test_outputs_independent_of_fresh_memory, at production widths and
    launch choices: every output, mask and gradient is bitwise the same whether the package's
    fresh tensors start as zeros or as NaN / 0x5A bytes / True. Rows: about 4M elements, 3
    more than a round count, so that the last backward program and the last tile are partly
    full."""
    case = _case(flags, n, dtype, rows=max(24, min(4099, (1 << 22) // n)) + 3, seed=5)
    assert_fresh_memory_unread(case, make_inputs(case, "cuda"))


def test_gpu_dropout_keep_rate():
    """Keep rate within 5 binomial sigmas on 16M elements; x and x1 masks independent."""
    from fused_norm import layer_norm_fn

    p = 0.3
    x = torch.randn(4096, 4096, device="cuda", dtype=BF16)
    w = torch.ones(4096, device="cuda", dtype=BF16)
    _, mask, mask1 = layer_norm_fn(x, w, None, x1=torch.randn_like(x), dropout_p=p,
                                   return_dropout_mask=True)  # fmt: skip
    n = mask.numel()
    sd = (n * p * (1 - p)) ** 0.5
    for m in (mask, mask1):
        assert abs(int(m.sum()) - n * (1 - p)) <= 5 * sd
    agree_sd = (n * 2 * p * (1 - p) * (1 - 2 * p * (1 - p))) ** 0.5
    assert abs(int((mask != mask1).sum()) - n * 2 * p * (1 - p)) <= 5 * agree_sd


def test_gpu_int64_row_offsets():
    """M * N > 2**31 elements: rows past the 2**31-th element are computed, forward and
    backward, like the same rows on their own (int64 pointer arithmetic)."""
    from fused_norm import rms_norm_fn, rms_norm_ref

    n = 16384
    rows = (1 << 31) // n + 3
    free, _ = torch.cuda.mem_get_info()
    if free < 24 * 2**30:
        pytest.skip(f"needs ~24 GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    x = torch.randn(rows, n, device="cuda", dtype=BF16).requires_grad_()
    w = (torch.rand(n, device="cuda") + 0.5).requires_grad_()
    y = rms_norm_fn(x, w, None, eps=1e-6)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, [x], dy)
    tail = slice(rows - 4, rows)
    xt = x.detach()[tail].clone().requires_grad_()
    yt = rms_norm_fn(xt, w, None, eps=1e-6)
    (dxt,) = torch.autograd.grad(yt, [xt], dy[tail])
    # Same per-row arithmetic; a wrapped 32-bit offset would read or write other rows.
    torch.testing.assert_close(y[tail], yt, msg="y of the rows past 2**31 elements")
    torch.testing.assert_close(dx[tail], dxt, msg="dx of the rows past 2**31 elements")
    ref = rms_norm_ref(xt.detach().double(), w.detach().double(), None, eps=1e-6)
    torch.testing.assert_close(yt.double(), ref, rtol=2**-7, atol=2**-7)


# Rows split over several forward programs (rows wider than 64 KB). The
# matrix above already runs 65536-262144 columns through it; these add widths that leave the
# last part partly empty, the remaining flags, an offset mean (the merge of part statistics),
# and a comparison with the single-program chunked sweep.
SPLIT_CASES = {
    "ln_odd_offset": Case(shape=(9, 100003), dtype=BF16, offset=30.0, scale=0.5, seed=5),
    "rms_zcw_rowscale": Case(shape=(7, 70001), dtype=FP16, is_rms_norm=True, has_bias=False,
                             zero_centered_weight=True, rowscale=True, seed=6),
    "drop_x1_w1_fp32res": Case(shape=(5, 98304), dtype=BF16, weight_dtype=FP32,
                               residual_dtype=FP32, has_x1=True, has_w1=True, has_b1=True,
                               dropout_p=0.2, prenorm=True, seed=7),
    "fp32_layerscale": Case(shape=(6, 40000), dtype=FP32, layerscale=True,
                            residual_dtype=FP32, seed=8),
}  # fmt: skip


def _fwd_plans() -> list:
    from fused_norm import ops

    return [plan for key, plan in ops._PLANS.items() if key[0] == "fwd"]


def _bwd_plans() -> list:
    from fused_norm import ops

    return [plan for key, plan in ops._PLANS.items() if key[0] == "bwd"]


def _fresh_plans():
    from fused_norm import ops

    ops.clear_plans()  # the plan caches then hold the next calls' plans only


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_gpu_split_rows_match_reference(name):
    """Split-row forward (and the backward after it) vs the fp64 reference."""
    case = SPLIT_CASES[name]
    _fresh_plans()
    check_case(case, "legacy" if case.layerscale else "fn", device="cuda")
    assert any(p.split > 1 for p in _fwd_plans()), "not split"


def _public_fwd(case):
    """Every forward output and mask of ``case`` on the GPU (no graph), the dropout seeds from
    one generator state."""
    t = make_inputs(case, "cuda")
    torch.manual_seed(case.seed)
    with torch.no_grad():
        outs, masks = call_fused(case, t)
    return {**outs, "mask": masks[0], "mask1": masks[1]}


@pytest.mark.parametrize("name", ["ln_odd_offset", "drop_x1_w1_fp32res"])
def test_gpu_split_rows_match_chunked(name):
    """Same inputs through the split rows and through the chunked two-sweep path (split rows
    off: heuristics.SPLIT_MIN_BYTES past any row): the residual stream and the dropout masks
    are bitwise equal (they do not depend on the statistics), the outputs agree to rounding of
    the merge order."""
    case = SPLIT_CASES[name]
    _fresh_plans()
    split = _public_fwd(case)
    (plan,) = _fwd_plans()
    assert plan.split > 1
    with patched_config(SPLIT_MIN_BYTES=1 << 40):
        chunked = _public_fwd(case)
        (plan_c,) = _fwd_plans()
    assert plan_c.split == 1 and plan_c.constexprs["NUM_CHUNKS"] > 1, plan_c
    same_seeds = plan.seeds_from_key == plan_c.seeds_from_key
    for label, a in split.items():
        b = chunked[label]
        if a is None:
            assert b is None, label
        elif label in ("residual_out", "mask", "mask1"):
            if label == "residual_out" or same_seeds:
                assert_bitwise_equal(label, a, b)
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=2**-7, msg=label)


def test_gpu_split_rows_many_programs():
    """Far more split programs than the GPU holds at once (4097 rows x 4 parts): every row is
    normalised (the ticket order lets each row's parts meet; a lost or repeated ticket would
    leave rows unwritten or wrong)."""
    from fused_norm import rms_norm_fn

    x = torch.randn(4097, 65536, device="cuda", dtype=BF16)
    w = torch.rand(65536, device="cuda", dtype=BF16) + 0.5
    y = rms_norm_fn(x, w, None, eps=1e-6)
    xf = x.float()
    ref = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * w.float()
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=2**-6)


@pytest.mark.parametrize("n, dtype", [(65536, BF16), (100003, BF16), (65536, FP16), (131072, FP16)])
@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("hold", ["rules", 1, 2])
@pytest.mark.parametrize("offset", [2.0, 3.0])
def test_gpu_held_rows_match_fp32_rows_bitwise(n, dtype, is_rms_norm, hold, offset):
    """Split rows held in registers in 16 bits (the plans' HOLD: as the rules give it, which
    hold x in a norm of x alone; or forced on every split plan, also for the stored stream: 1,
    kernels' _widen, and for fp16 2, _convert_copy) give bitwise the outputs of the same parts
    held in fp32 (HOLD 0), for a norm of x alone and with a residual and prenorm; with the
    mean 3 standard deviations off zero LayerNorm's parts take M2 again over s - mean, widened
    from the held values (fp16's _convert_copy, which ptxas must not merge with the first
    conversion). Only HOLD differs between the runs' plans."""
    if hold == 2 and dtype != FP16:
        pytest.skip("HOLD 2 is fp16's route")
    for residual in (None, dtype):
        case = Case(shape=(6, n), dtype=dtype, is_rms_norm=is_rms_norm, offset=offset,
                    residual_dtype=residual, prenorm=residual is not None, seed=n)  # fmt: skip
        runs = []
        for value in (0, hold):
            force = patched_config() if value == "rules" else split_constexprs(HOLD=value)
            with force, torch.no_grad():
                runs.append(call_fused(case, make_inputs(case, "cuda"))[0])
                (plan,) = _fwd_plans()
                assert plan.split > 1, "not split"
                if value != "rules":
                    assert plan.constexprs["HOLD"] == value
        assert runs[0].keys() == runs[1].keys()
        for name in runs[0]:
            assert_bitwise_equal(f"{name} (residual {residual})", runs[1][name], runs[0][name])


@pytest.mark.parametrize("dtype, route", [(BF16, "widen"), (FP16, "widen"), (FP16, "convert")])
def test_gpu_widen_is_exact_for_every_16_bit_pattern(dtype, route):
    """kernels._widen and _convert_copy compiled for the GPU (ptxas may rewrite what the
    interpreter runs as written): exact for all 65536 bit patterns."""
    from test_kernels import test_widen_is_exact_for_every_16_bit_pattern as check

    check(dtype, route, "cuda")


def _smem_plans() -> list:
    """Whether each backward plan made since the plans were forgotten runs the Gluon kernel
    (kernels/hopper.py)."""
    return [plan.hopper for plan in _bwd_plans()]


def _smem_check(case, api="fn"):
    """Check ``case`` on the GPU (check_case) with ops' plan caches emptied first, so that
    they then hold its plans only; skipped where the device has no Gluon backward (Hopper's
    shared memory, and a Triton with Gluon). Returns the backward plans made, each checked
    to be the one the rules give its row on this device."""
    from fused_norm import heuristics, ops

    dev = torch.device("cuda", torch.cuda.current_device())
    if not (heuristics.device(dev).hopper and ops.HOPPER_AVAILABLE):
        pytest.skip("the Gluon backward needs Hopper's shared memory and a Triton with Gluon")
    _fresh_plans()
    check_case(case, api, device="cuda")
    rows = [(key[2], plan) for key, plan in ops._PLANS.items() if key[0] == "bwd"]
    for row, plan in rows:
        assert plan == heuristics.backward_plan(heuristics.device(dev), row), row
    return [plan for _, plan in rows]


# The flags the smem tests of 16-bit rows draw (in this order, after n).
SMEM_FLAGS = dict(
    dtype=st.sampled_from([BF16, FP16]),
    is_rms_norm=st.booleans(),
    zero_centered_weight=st.booleans(),
)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    n=st.sampled_from([10256, 11264, 12288, 14336, 16000, 16384]),
    **SMEM_FLAGS,
    rows=st.sampled_from([1, 7, 133, 401]),
)
@example(n=16384, dtype=FP16, is_rms_norm=False, zero_centered_weight=True, rows=133)
@example(n=12288, dtype=FP16, is_rms_norm=False, zero_centered_weight=False, rows=401)
def test_gpu_smem_backward_matches_reference(n, dtype, is_rms_norm, zero_centered_weight, rows):
    """The Gluon backward (kernels/hopper.py) of a norm of x alone with a weight and a bias,
    16-bit, 10K-16K columns, whole rows (one block padded past N, or a block and a tail):
    every gradient against the fp64 reference, one row to several per program. Fails if these
    rows no longer take the Gluon kernel (pick rows that do)."""
    case = Case(shape=(rows, n), dtype=dtype, is_rms_norm=is_rms_norm,
                zero_centered_weight=zero_centered_weight, seed=n + rows)  # fmt: skip
    plans = _smem_check(case)
    assert [p.hopper for p in plans] == [True], plans
    assert plans[0].chunks == 1, "a whole row expected"


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    n=st.sampled_from([10256, 11264, 12000, 12288, 13008, 14336, 16000, 16384]),
    dtype=st.sampled_from([BF16, FP16]),
    is_rms_norm=st.booleans(),
    zero_centered_weight=st.booleans(),
    rows=st.sampled_from([1, 7, 133, 401]),
    dropout_p=st.sampled_from([0.0, 0.1, 0.37]),
    prenorm=st.booleans(),
)
def test_gpu_smem_backward_residual_dropout_matches_reference(
    n, dtype, is_rms_norm, zero_centered_weight, rows, dropout_p, prenorm
):
    """The Gluon backward with a residual (its gradient out; in, with prenorm) and x's dropout
    (the mask regenerated from the seeds as kernels' _keep_mask draws it), at 10K-16K
    columns, with dresidual_out staged (prenorm) or not: every gradient against the fp64
    reference, which applies the mask the forward returned. Fails if these rows no longer take
    the Gluon kernel."""
    case = Case(shape=(rows, n), dtype=dtype, residual_dtype=dtype, is_rms_norm=is_rms_norm,
                zero_centered_weight=zero_centered_weight, dropout_p=dropout_p,
                prenorm=prenorm, seed=n + rows)  # fmt: skip
    plans = _smem_check(case)
    assert plans and all(p.hopper for p in plans), plans


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    n=st.sampled_from([32768, 49152, 65536, 131072, 262144]),
    **SMEM_FLAGS,
    rows=st.sampled_from([1, 7, 133, 300]),
)
# Two slices (the sums exchanged in the row) and many (published a row ahead: LAG).
@example(n=32768, dtype=BF16, is_rms_norm=False, zero_centered_weight=False, rows=133)
@example(n=262144, dtype=FP16, is_rms_norm=False, zero_centered_weight=True, rows=7)
def test_gpu_smem_sliced_backward_matches_reference(n, dtype, is_rms_norm, zero_centered_weight,
                                                    rows):  # fmt: skip
    """Rows wider than one program of the Gluon backward (16-bit, 32K-256K columns; a norm of
    x alone with a weight and a bias) in slices, one program each, that exchange their partial
    row sums: every gradient against the fp64 reference, one row to several per program.
    Fails if these rows no longer take the sliced kernel."""
    case = Case(shape=(rows, n), dtype=dtype, is_rms_norm=is_rms_norm,
                zero_centered_weight=zero_centered_weight, seed=n + rows)  # fmt: skip
    (plan,) = _smem_check(case)
    assert plan.hopper and plan.chunks > 1, plan


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    n=st.sampled_from([12288, 16384, 65536]),
    residual=st.sampled_from(["none", "fp32", "fp32_stream"]),
    zero_centered_weight=st.booleans(),
    rows=st.sampled_from([1, 7, 133, 300]),
    dropout_p=st.sampled_from([0.0, 0.1]),
)
@example(n=16384, residual="fp32_stream", zero_centered_weight=False, rows=133, dropout_p=0.1)
@example(n=16384, residual="none", zero_centered_weight=False, rows=300, dropout_p=0.0)
# fp32 rows with a residual and dropout: dresidual_out in registers, 4-column layouts.
@example(n=16384, residual="fp32", zero_centered_weight=True, rows=300, dropout_p=0.1)
@example(n=16384, residual="fp32", zero_centered_weight=False, rows=133, dropout_p=0.0)
def test_gpu_smem_sliced_backward_4byte_rows(n, residual, zero_centered_weight, rows, dropout_p):
    """Rows of 4-byte elements where the Gluon backward may take them in slices: fp32
    LayerNorm alone, with dropout, or dropout + add + LayerNorm with prenorm of fp32 rows or
    of bf16 rows with an fp32 residual stream (``fp32_stream``); fp32 rows with a residual and
    dropout may hold dresidual_out in registers (DRES_REGS) and take 4 columns a thread (VEC).
    Every gradient against the fp64 reference, whichever backward the rules give (checked to
    be theirs)."""
    if residual == "none":
        case = Case(shape=(rows, n), dtype=FP32, zero_centered_weight=zero_centered_weight,
                    dropout_p=dropout_p, seed=n + rows)  # fmt: skip
    else:
        case = Case(shape=(rows, n), dtype=FP32 if residual == "fp32" else BF16,
                    residual_dtype=FP32, residual_in_fp32=True, dropout_p=dropout_p,
                    prenorm=True, zero_centered_weight=zero_centered_weight, seed=n + rows)  # fmt: skip
    plans = _smem_check(case)
    for plan in plans:
        if plan.hopper:
            c = plan.constexprs
            assert c["VEC"] in (4, 8) and (not c["DRES_REGS"] or dropout_p > 0), c


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    n=st.sampled_from([12288, 16384, 20480, 24576, 65536, 131072, 262144]),
    **SMEM_FLAGS,
    rows=st.sampled_from([1, 7, 133, 300]),
    prenorm=st.booleans(),
)
@example(n=16384, dtype=BF16, is_rms_norm=False, zero_centered_weight=False, rows=300,
         prenorm=True)  # fmt: skip
@example(n=131072, dtype=FP16, is_rms_norm=False, zero_centered_weight=True, rows=7,
         prenorm=False)  # fmt: skip
@example(n=20480, dtype=BF16, is_rms_norm=False, zero_centered_weight=True, rows=133,
         prenorm=True)  # fmt: skip
def test_gpu_smem_sliced_backward_x1(n, dtype, is_rms_norm, zero_centered_weight, rows, prenorm):
    """x1's path with its second output (x + x1 + residual, weight1 and bias1; no dropout, so
    dx1 is dx) where the Gluon backward takes it in slices: dy1 staged beside s, dy and
    (prenorm) dresidual_out, partial dW1 and dB1 in registers, the second weight in shared
    memory; slices of a power of two, or (20480 with prenorm) of a block and a tail. Every
    gradient against the fp64 reference, whichever backward the rules give."""
    case = Case(shape=(rows, n), dtype=dtype, residual_dtype=dtype, has_x1=True, has_w1=True,
                has_b1=True, is_rms_norm=is_rms_norm, zero_centered_weight=zero_centered_weight,
                prenorm=prenorm, seed=n + rows)  # fmt: skip
    for plan in _smem_check(case):
        assert not plan.hopper or plan.chunks > 1 or n <= 16384, plan


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    n=st.sampled_from([16384, 32768, 65536]),
    stream=st.sampled_from(["fp32", "fp32_stream", "fp32_stream_w32"]),
    zero_centered_weight=st.booleans(),
    rows=st.sampled_from([1, 7, 133, 300]),
    prenorm=st.booleans(),
)
@example(n=65536, stream="fp32", zero_centered_weight=False, rows=133, prenorm=True)
@example(n=16384, stream="fp32_stream", zero_centered_weight=True, rows=300, prenorm=True)
@example(n=16384, stream="fp32_stream_w32", zero_centered_weight=False, rows=7, prenorm=False)
def test_gpu_smem_sliced_backward_x1_4byte_rows(n, stream, zero_centered_weight, rows, prenorm):
    """x1's path with its second output for rows of 4-byte elements: fp32 rows and weights,
    or bf16 x and x1 with an fp32 residual stream (``fp32_stream``: dresidual then has a
    buffer of its own) and bf16 or (``_w32``) fp32 weights, in the Gluon backward's slices
    where the rules give them (the widest power of two whose staged rows fit beside both
    weights). Every gradient against the fp64 reference, whichever backward runs."""
    dtype = FP32 if stream == "fp32" else BF16
    case = Case(shape=(rows, n), dtype=dtype, residual_dtype=FP32, residual_in_fp32=True,
                weight_dtype=FP32 if stream != "fp32_stream" else None, has_x1=True,
                has_w1=True, has_b1=True, prenorm=prenorm,
                zero_centered_weight=zero_centered_weight, seed=n + rows)  # fmt: skip
    plans = _smem_check(case)
    if stream == "fp32":  # fp32 rows of x1 at these widths: slices measured to fit
        assert all(p.hopper and p.chunks > 1 for p in plans), plans


# A norm without a bias (one partial) in the Gluon backward: (columns, x's dtype, residual:
# None, "same" (x's dtype) or "fp32" (an fp32 stream)).
SMEM_ONE_PARTIAL = [
    (12288, BF16, None), (14336, FP16, None), (16384, BF16, None), (32768, FP16, None),
    (131072, BF16, None), (12288, BF16, "same"), (16384, FP16, "same"), (32768, BF16, "same"),
    (16384, FP32, None), (65536, FP32, None), (131072, FP32, None), (16384, FP32, "fp32"),
    (16384, BF16, "fp32"), (12288, BF16, "fp32"), (32768, FP32, "fp32"),
]  # fmt: skip

# What the tests of a table of layouts draw beside the layout (in this order, after it).
SMEM_LAYOUT_DRAWS = dict(
    is_rms_norm=st.booleans(),
    zero_centered_weight=st.booleans(),
    rows=st.sampled_from([1, 7, 133, 300]),
    dropout_p=st.sampled_from([0.0, 0.1]),
)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(layout=st.sampled_from(SMEM_ONE_PARTIAL), **SMEM_LAYOUT_DRAWS)
# Bf16 x with an fp32 stream at 16384 (the benchmark's add + RMSNorm row), fp32 rows in 8
# slices, a padded whole row with dropout, LayerNorm's whole 16384.
@example(layout=(16384, BF16, "fp32"), is_rms_norm=True, zero_centered_weight=False,
         rows=300, dropout_p=0.0)  # fmt: skip
@example(layout=(65536, FP32, None), is_rms_norm=True, zero_centered_weight=True, rows=133,
         dropout_p=0.0)  # fmt: skip
@example(layout=(14336, BF16, "same"), is_rms_norm=False, zero_centered_weight=False,
         rows=133, dropout_p=0.1)  # fmt: skip
@example(layout=(16384, BF16, None), is_rms_norm=False, zero_centered_weight=False,
         rows=133, dropout_p=0.0)  # fmt: skip
def test_gpu_smem_backward_one_partial(layout, is_rms_norm, zero_centered_weight, rows,
                                       dropout_p):  # fmt: skip
    """A norm without a bias (partial dW only), alone or with a residual (add + norm with
    prenorm, x's dropout where there is a residual), at widths and dtypes where the Gluon
    backward may take one partial (whole 16-bit rows, 16-bit rows of x alone in slices, 4-byte
    rows in slices). Every gradient against the fp64 reference, whichever backward the rules
    give (checked to be theirs)."""
    n, dtype, residual = layout
    if residual is None:
        case = Case(shape=(rows, n), dtype=dtype, is_rms_norm=is_rms_norm, has_bias=False,
                    zero_centered_weight=zero_centered_weight, seed=n + rows)  # fmt: skip
    else:
        case = Case(shape=(rows, n), dtype=dtype, is_rms_norm=is_rms_norm, has_bias=False,
                    residual_dtype=FP32 if residual == "fp32" else dtype,
                    residual_in_fp32=residual == "fp32", prenorm=True, dropout_p=dropout_p,
                    zero_centered_weight=zero_centered_weight, seed=n + rows)  # fmt: skip
    _smem_check(case)


# 16-bit rows beside fp32 weights (autocast's parameters) where the Gluon backward may take
# them: (columns, x's dtype, what the call adds to the norm). "plain": a weight and a bias;
# "nobias": the weight alone (one partial); "residual": add + norm with prenorm, x's dropout
# drawn; "x1": x1's second output.
SMEM_W4 = [
    (12288, BF16, "plain"), (16384, FP16, "plain"), (14336, BF16, "nobias"),
    (16384, BF16, "nobias"), (16384, BF16, "residual"), (12288, FP16, "residual"),
    (32768, BF16, "plain"), (32768, FP16, "nobias"), (65536, BF16, "plain"),
    (131072, BF16, "plain"), (65536, FP16, "nobias"), (131072, BF16, "nobias"),
    (262144, BF16, "plain"), (16384, BF16, "x1"), (32768, BF16, "x1"), (12288, BF16, "x1"),
]  # fmt: skip


@settings(max_examples=12, deadline=None, derandomize=True)
@given(layout=st.sampled_from(SMEM_W4), **SMEM_LAYOUT_DRAWS)
# The fp32 weight in shared memory beside one staged row (16384 with dresidual_out), x1's
# second weight, and many slices.
@example(layout=(16384, BF16, "residual"), is_rms_norm=False, zero_centered_weight=True,
         rows=300, dropout_p=0.1)  # fmt: skip
@example(layout=(16384, FP16, "plain"), is_rms_norm=False, zero_centered_weight=False,
         rows=133, dropout_p=0.0)  # fmt: skip
@example(layout=(16384, BF16, "x1"), is_rms_norm=False, zero_centered_weight=False,
         rows=133, dropout_p=0.0)  # fmt: skip
@example(layout=(131072, BF16, "plain"), is_rms_norm=False, zero_centered_weight=False,
         rows=7, dropout_p=0.0)  # fmt: skip
@example(layout=(32768, BF16, "x1"), is_rms_norm=False, zero_centered_weight=True,
         rows=300, dropout_p=0.0)  # fmt: skip
def test_gpu_smem_backward_fp32_weights(layout, is_rms_norm, zero_centered_weight, rows,
                                        dropout_p):  # fmt: skip
    """16-bit rows with fp32 weights (and biases), whole or in slices, in the Gluon backward
    where the rules give it (the weight staged in shared memory as fp32 beside the staged
    rows). Every gradient against the fp64 reference, whichever backward runs (checked to be
    the rules')."""
    n, dtype, kind = layout
    extra = {}
    if kind == "nobias":
        extra = dict(has_bias=False)
    elif kind == "residual":
        extra = dict(residual_dtype=dtype, prenorm=True, dropout_p=dropout_p)
    elif kind == "x1":
        extra = dict(residual_dtype=dtype, has_x1=True, has_w1=True, has_b1=True, prenorm=True)
    case = Case(shape=(rows, n), dtype=dtype, weight_dtype=FP32, is_rms_norm=is_rms_norm,
                zero_centered_weight=zero_centered_weight, seed=n + rows, **extra)  # fmt: skip
    _smem_check(case)


SMEM_LACKS = {
    "rowscale": Case(shape=(37, 12288), dtype=BF16, rowscale=True, seed=3),
    "rowscale_dropout": Case(shape=(37, 16384), dtype=BF16, residual_dtype=BF16, rowscale=True,
                             dropout_p=0.1, prenorm=True, seed=4),
    "layerscale": Case(shape=(37, 12288), dtype=BF16, has_bias=False, layerscale=True, seed=5),
    "x1_dropout": Case(shape=(37, 12288), dtype=BF16, residual_dtype=BF16, has_x1=True,
                       dropout_p=0.1, prenorm=True, seed=6),
    "x1_w1_no_bias": Case(shape=(37, 16384), dtype=FP16, has_x1=True, has_w1=True,
                          has_bias=False, seed=7),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SMEM_LACKS))
def test_gpu_smem_backward_leaves_what_it_lacks(name):
    """Calls of the Gluon kernel's widths and dtypes with what it does not do (rowscale,
    layerscale, x1's gradient of its own (dropout), x1's second output without biases) take
    the Triton backward, and match the fp64 reference (a Gluon kernel that ignored them would
    give dx without the row's scale, or no dlayerscale)."""
    case = SMEM_LACKS[name]
    plans = _smem_check(case, "legacy" if case.layerscale else "fn")
    assert plans and not any(p.hopper for p in plans), plans


def test_gpu_smem_backward_misaligned_rows_take_triton():
    """Rows whose address is not 16-byte aligned (a view one element in) cannot take the Gluon
    kernel's 16-byte copies: the plan falls back to the Triton backward, still correct; the
    aligned rows of the same shape take the Gluon kernel. Gradients bitwise reproducible."""
    from fused_norm import heuristics

    if not heuristics.device(torch.device("cuda", torch.cuda.current_device())).hopper:
        pytest.skip("the Gluon backward needs Hopper's shared memory")
    import fused_norm

    n, rows = 12288, 37
    torch.manual_seed(0)
    buf = torch.randn(rows * n + 1, device="cuda", dtype=BF16)
    w = torch.randn(n, device="cuda", dtype=BF16, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn(rows, n, device="cuda", dtype=BF16)
    grads = {}
    for name, flat in (("aligned", buf[:-1]), ("misaligned", buf[1:])):
        _fresh_plans()
        x = flat.view(rows, n).detach().requires_grad_()
        runs = []
        for _ in range(2):
            y = fused_norm.layer_norm_fn(x, w, b)
            runs.append(torch.autograd.grad(y, (x, w, b), dy))
        assert _smem_plans() == [name == "aligned"]
        for a, c in zip(*runs):
            assert torch.equal(a, c), name
        grads[name] = runs[0]
    # Against the fp64 reference.
    ref_x = buf[1:].view(rows, n).double().requires_grad_()
    ref_w, ref_b = (t.detach().double().requires_grad_() for t in (w, b))
    y = torch.nn.functional.layer_norm(ref_x, (n,), ref_w, ref_b, eps=1e-6)
    want = torch.autograd.grad(y, (ref_x, ref_w, ref_b), dy.double())
    for got, ref in zip(grads["misaligned"], want):
        err = (got.double() - ref).abs().max() / ref.abs().max()
        assert err < 2e-2, err


# (flags, N, dtype) rows the Gluon backward takes, each against the Triton backward.
SMEM_VS_TRITON = [("ln", 12288, BF16), ("ln", 65536, FP16), ("drop_add_ln_prenorm", 16384, BF16),
                  ("x1_w1", 65536, BF16), ("rms", 16384, FP32)]  # fmt: skip


@pytest.mark.parametrize(
    "flags, n, dtype", SMEM_VS_TRITON, ids=[f"{f}-{n}-{str(d)[6:]}" for f, n, d in SMEM_VS_TRITON]
)
def test_gpu_smem_backward_matches_triton_backward(flags, n, dtype, monkeypatch):
    """The same call with the Gluon backward and with the Triton backward
    (FUSED_NORM_HOPPER=0, read when a plan is made): both match the fp64 reference (three-way
    rule), their forwards are bitwise equal, and their gradients agree to about an ulp of the
    dtype (the row sums are added in another order)."""
    case = _case(flags, n, dtype, rows=257, seed=9)
    t = make_inputs(case, "cuda")
    runs = {}
    for hopper in ("1", "0"):
        monkeypatch.setenv("FUSED_NORM_HOPPER", hopper)
        plans = _smem_check(case) if hopper == "1" else None
        if hopper == "0":
            _fresh_plans()
            check_case(case, "fn", device="cuda", t=t)
            plans = _bwd_plans()
            assert plans and not any(p.hopper for p in plans), plans
        else:
            assert any(p.hopper for p in plans), f"the rules give this row no Gluon: {plans}"
        runs[hopper] = run_filled(case, t, poison=False)
    _fresh_plans()
    for k in runs["1"]:
        a, b = runs["1"][k], runs["0"][k]
        if not k.startswith("grad"):
            assert_bitwise_equal(k, a, b)
        else:
            # a few ulps of a 16-bit gradient; fp32 sums over the rows in another order
            tol = {BF16: 2**-7, FP16: 2**-9, FP32: 1e-4}[a.dtype]
            scale = b.double().abs().max().item()
            torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol * scale, msg=k)


# The backward of wide rows in several kernels (the row-sums pre-pass or exchanging column
# blocks, the column kernel, the partials' sum) at the benchmark's scale (2^27 elements), and a
# one-block and a Gluon backward: every output, mask and gradient bitwise the same whether the
# package's fresh tensors start as zeros or poisoned (a kernel reading what the kernel before
# it had not yet written, or not at all, would read NaN).
BIG_CASES = [("drop_add_ln_prenorm", 131072), ("x1_w1", 262144), ("ln", 4096),
             ("drop_add_ln_prenorm", 16384)]  # fmt: skip


@pytest.mark.parametrize("flags, n", BIG_CASES, ids=[f"{f}-{n}" for f, n in BIG_CASES])
def test_gpu_backward_kernels_at_scale_read_only_what_they_wrote(flags, n):
    case = _case(flags, n, BF16, rows=(1 << 27) // n, seed=7)
    t = make_inputs(case, "cuda")
    _fresh_plans()
    zeros = run_filled(case, t, poison=False)
    poisoned = run_filled(case, t, poison=True)
    assert zeros.keys() == poisoned.keys()
    for k in zeros:
        assert_bitwise_equal(k, zeros[k], poisoned[k])
    if n >= 131072:  # wider than any one block: column blocks or slices
        assert all(p.chunks > 1 for p in _bwd_plans()), _bwd_plans()


# Rows whose backward row loop is pipelined (ROW_STAGES > 1) on a GPU: dropout, column blocks,
# several partials in wide blocks; 16-bit, 4-byte and fp32-weight rows.
PIPELINED = [("drop_add_ln_prenorm", 4096, BF16), ("drop_add_ln_prenorm", 1024, FP32),
             ("x1_w1_drop", 2048, BF16), ("drop_add_ln_prenorm_w32", 4096, BF16),
             ("x1_w1", 8192, BF16), ("ln", 65536, FP32)]  # fmt: skip


@pytest.mark.parametrize(
    "flags, n, dtype", PIPELINED, ids=[f"{f}-{n}-{str(d)[6:]}" for f, n, d in PIPELINED]
)
def test_gpu_pipeline_bytes_bound_the_compiled_kernel(flags, n, dtype, monkeypatch):
    """test_plans' lower bound on the shared memory of the backward's pipelined row loop
    (``_pipeline_bytes``: ROW_STAGES - 1 buffers of each load in the loop) is a lower bound of
    the kernel as this Triton compiles it: the plan-level check of test_plans stands for the
    kernel. Each row's Triton backward (FUSED_NORM_HOPPER=0), compiled for its launch."""
    from test_plans import _pipeline_bytes

    from fused_norm import functional, launch

    if not launch.DIRECT:
        pytest.skip("the direct launch is off here: no compiled kernel kept to ask")
    monkeypatch.setenv("FUSED_NORM_HOPPER", "0")
    case = _case(flags, n, dtype, rows=64, seed=3)
    _fresh_plans()
    for _ in range(2):  # the second launch keeps the compiled kernel
        check_case(case, "fn", device="cuda")
    checked = 0
    for call in functional._CALLS.values():
        for launches in getattr(call, "_bwd", {}).values():
            if launches.launches is None or launches.plan.hopper:
                continue
            bwd = launches.launches[1]
            c = bwd.constexprs
            if c["ROW_STAGES"] <= 1 or bwd.compiled is None:
                continue
            row = [k[2] for k, p in _bwd_row_plans() if p is launches.plan][0]
            need = _pipeline_bytes(row, c)
            assert bwd.compiled.shared >= need, f"{bwd.compiled.shared} bytes < the bound {need}"
            checked += 1
    _fresh_plans()
    if not checked:
        pytest.skip("no pipelined backward launched for this row on this device")


def _bwd_row_plans() -> list:
    from fused_norm import ops

    return [(key, plan) for key, plan in ops._PLANS.items() if key[0] == "bwd"]

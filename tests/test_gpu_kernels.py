"""GPU tests of the kernels: production widths (100 to 262 144 columns), all dtypes, the
persistent backward grid with many rows per program, bitwise determinism, and int64 row
offsets. Same three-way tolerance rule as test_kernels.py, the fp64 truth computed on the GPU.

Every test is marked ``gpu`` (conftest skips them with a reason where CUDA is absent). Runtime is
dominated by Triton compiles, one forward and one backward per (flag set, dtype, block
configuration): about 80 compiles for the matrix below, so the matrix is a deliberate
selection rather than a full product.
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
    run_filled,
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
    # A 16-bit stream with dropout: the forward's register cap (config.fwd_maxnreg) applies.
    "drop_add_ln_prenorm": dict(residual_dtype="same", dropout_p=0.1, prenorm=True),
    # An fp32 stream: the 4-byte rows' launch choices (config.fwd_block_choice, bwd_num_warps).
    "add_rms_prenorm_fp32res": dict(is_rms_norm=True, has_bias=False, residual_dtype=FP32,
                                    prenorm=True),
    "x1_w1_fp32res": dict(has_x1=True, has_w1=True, has_b1=True, residual_dtype=FP32,
                          prenorm=True),
    # 16-bit rows with fp32 weights (autocast training): their own launch choices
    # (config.fwd_split's ln_w4, fwd_split_warps, fwd_block_choice, bwd_launch_layout).
    "ln_w32": dict(weight_dtype=FP32),
    "rms_w32": dict(is_rms_norm=True, has_bias=False, weight_dtype=FP32),
    "x1_w1_w32": dict(has_x1=True, has_w1=True, has_b1=True, residual_dtype="same",
                      weight_dtype=FP32),
    "drop_add_ln_prenorm_w32": dict(residual_dtype="same", dropout_p=0.1, prenorm=True,
                                    weight_dtype=FP32),
    # The x1 path with dropout (x1's own mask), prenorm: its backward's warps at 1025-2048
    # columns (config.bwd_num_warps).
    "x1_w1_drop": dict(has_x1=True, has_w1=True, has_b1=True, residual_dtype="same",
                       dropout_p=0.1, prenorm=True),
}  # fmt: skip

MATRIX = (
    [("ln", n, d) for n in ALL_N for d in (FP32, BF16)]
    + [("ln", n, FP16) for n in (1024, 16384, 131072)]
    + [("rms", n, FP16) for n in (768, 8192, 32768, 262144)]
    + [("rms", 32768, BF16)]  # lane-summed chunks of 32 warps (LayerNorm unrolled: ALL_N)
    # Lane-summed chunks (config.fwd_block_layout), the last partly empty at 16000, 8000, 30000,
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
    # Widths held as two blocks (config.block_tail): forward 2560 = 2048 + 512, 3000 =
    # 2048 + 1024 (the tail partly empty), 5120 = 4096 + 1024, 6144, 12288 (above); backward
    # 5120 and 6144.
    + [("drop_add_ln_prenorm", 5120, BF16), ("rms", 5120, BF16), ("x1_w1", 2560, BF16)]
    + [("ln", 3000, FP32), ("add_rms_prenorm", 6144, BF16)]
    # LayerNorm's backward at 8K-10K 16-bit columns as one program of two blocks, with
    # dropout too and beside fp32 weights (config.bwd_block_config, bench/NOTES.md #65); 64
    # KB rows split with dropout or x1 (config.fwd_split).
    + [("ln", 10240, BF16), ("drop_add_ln_prenorm", 32768, BF16), ("x1_w1", 32768, BF16)]
    # The backward's row-sums pre-pass in parts of a row, whose shares a second kernel adds
    # (16-bit weights; config.bwd_sums_layout, bench/NOTES.md #84).
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
    # 64 (config.bwd_maxnreg; 6144 above), and on 2 warps at 1024 columns (bwd_num_warps);
    # RMSNorm of x alone at 6144 in the padded block (config.bwd_layout).
    + [("add_rms_prenorm", 8192, BF16), ("add_rms_prenorm", 5120, FP16)]
    + [("add_rms_prenorm", 1024, BF16), ("rms", 6144, BF16)]
    # ... and of fp16 rows under a cap of 128 (bench/NOTES.md #112; 8192 above); since #113
    # the padded rows (6144, 7168) on 16 warps under 64, 8192 too on Triton 3.9
    + [("rms", 6144, FP16), ("rms", 7168, FP16), ("rms", 8192, BF16), ("rms_w32", 6144, BF16)]
    # The x1 path with dropout on 4 warps at 1025-2048 columns (#114), 2 at 1024
    + [("x1_w1_drop", n, d) for n, d in ((2048, BF16), (1536, FP16), (1024, BF16))]
    + [("x1_w1_drop", 2048, FP32)]
    # ... and without dropout at 1024 columns: 4-byte rows on 4 warps on Triton 3.6, 16-bit
    # rows on Triton 3.9 (#116)
    + [("x1_w1", 1024, FP32), ("x1_w1_fp32res", 1024, BF16), ("x1_w1", 1024, BF16)]
    # Rows of 4-byte elements (bench/NOTES.md #57): one 16K block with dropout under a cap of
    # 64 (bf16 x, fp32 stream) or on 32 warps under 80 (fp32), x1 with an fp32 stream on 32
    # warps under 64, split rows with dropout on 2 warps; add + RMSNorm's backward on 16
    # warps at 4096 columns, 8 at 16384.
    + [("drop_add_ln_prenorm_fp32res", n, d) for n, d in ((16384, BF16), (16384, FP32))]
    + [("drop_add_ln_prenorm_fp32res", 65536, BF16), ("x1_w1_fp32res", 16384, BF16)]
    + [("add_rms_prenorm_fp32res", n, BF16) for n in (4096, 16384)]
    + [("add_rms_prenorm", 4096, FP32)]
    # 64 KB rows with dropout in 16 parts of 2K columns on 2 warps (config.fwd_split; bf16
    # above), RMSNorm's backward at 2048 columns on 2 stages (config.bwd_row_stages).
    + [("drop_add_ln_prenorm", 32768, FP16), ("rms", 2048, BF16)]
    # fp32 weights beside 16-bit rows (bench/NOTES.md #59): plain LayerNorm rows of 24K-32K
    # columns split (held, 2 warps), held RMSNorm in 16 parts on 2 warps, the x1 path's one
    # block on 16 / 32 warps, and the backward of dropout / x1 rows without the exchange.
    + [("ln_w32", n, BF16) for n in (24576, 32768)]
    + [("ln_w32", 32768, FP16)]
    + [("rms_w32", 65536, d) for d in (BF16, FP16)]
    + [("x1_w1_w32", n, BF16) for n in (6144, 8192, 16384, 32768)]
    # ... the x1 path's 16K forward block under a cap of 96 (bench/NOTES.md #62)
    + [("x1_w1_w32", 16384, FP16)]
    + [("drop_add_ln_prenorm_w32", n, BF16) for n in (16384, 65536)]
    # ... LayerNorm's one 1024-column block on 1 warp and 16K rows in 2K lane-summed chunks
    # beside fp32 weights, and its 4096-column row loading weights ahead (bench/NOTES.md
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
    """Outputs and every gradient vs the fp64 reference (three-way rule) at real widths.
    Rows wider than config.MAX_BLOCK_BYTES (64 KB: 16K fp32 / 32K 16-bit columns) take the
    forward's chunked path, wider than BWD_MAX_BLOCK_BYTES of 16-bit columns (16K; 8K with two
    or more parameter gradients, whatever the dtype) the backward's column blocks with its
    row-sums pre-pass."""
    check_case(_case(flags, n, dtype), "fn", device="cuda")


@pytest.mark.parametrize("n, dtype", [(4096, BF16), (4096, FP16), (3072, BF16)])
def test_gpu_folded_row_sums_match_reference(n, dtype, monkeypatch):
    """RMSNorm of x alone at 3072-4096 columns with its backward's row sum folded over the
    layout's four repeats (kernels._fold_repeats), as on Triton 3.9 (config.bwd_sum_repeats,
    bench/NOTES.md #117), forced on the device's Triton: matches the fp64 reference."""
    from fused_norm import config

    monkeypatch.setattr(config, "BWD_SUM_REPEATS_FROM", (0,))
    rule = config.bwd_sum_repeats
    answers = []

    def recorded(*args):
        answers.append(rule(*args))
        return answers[-1]

    monkeypatch.setattr(config, "bwd_sum_repeats", recorded)
    check_case(_case("rms", n, dtype), "fn", device="cuda")
    assert 4 in answers, answers


def _force_held_rows(monkeypatch):
    """config.bwd_recompute answering yes for every backward row it may serve (one block, no
    tail, tile, pipeline or exchange); returns the list of its answers."""
    from fused_norm import config

    answers = []

    def held(block_n, num_chunks, tail, tile_rows, stages, exchange, *args):
        answers.append(num_chunks == 1 and not tail and tile_rows == 1 and stages == 1
                       and not exchange)  # fmt: skip
        return answers[-1]

    monkeypatch.setattr(config, "bwd_recompute", held)
    return answers


HELD_ROWS = [("ln", 512, BF16), ("ln", 512, FP16), ("ln", 1024, BF16), ("ln", 300, BF16),
             ("rms", 1024, BF16), ("ln_w32", 512, BF16), ("add_rms_prenorm", 512, FP16),
             ("add_rms_prenorm_fp32res", 1024, BF16), ("ln", 512, FP32)]  # fmt: skip


@pytest.mark.parametrize(
    "flags, n, dtype", HELD_ROWS, ids=[f"{f}-{n}-{str(d)[6:]}" for f, n, d in HELD_ROWS]
)
def test_gpu_held_backward_rows_match_reference(flags, n, dtype, monkeypatch):
    """The backward of one-block rows holding each row's loads across its row sums
    (kernels._held_row_grads, _held_again: the inline PTX copy of _held), forced where it may
    serve, beyond the rows config.BWD_RECOMPUTE_ROWS gives it (LayerNorm at 1024 / 2048 with
    Triton 3.9, bench/NOTES.md #118): 16-bit and fp32 rows and weights, a residual stream of either; matches
    the fp64 reference."""
    answers = _force_held_rows(monkeypatch)
    check_case(_case(flags, n, dtype), "fn", device="cuda")
    assert True in answers, answers


@pytest.mark.parametrize("n, dtype", [(512, BF16), (1024, BF16), (2048, FP16)])
def test_gpu_held_backward_rows_same_gradients(n, dtype, monkeypatch):
    """LayerNorm's held backward rows (#118), forced on the device's Triton, give the same dx,
    bit for bit, as the rows that hold their fp32 maths: the same operations on the same
    values. dW and dB agree to rounding: their partials are summed over the programs that
    fit, which the registers change."""
    from fused_norm import config, layer_norm_fn

    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(4099, n, device="cuda", dtype=dtype, generator=gen)
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(dtype)
    b = (0.1 * torch.randn(n, device="cuda", generator=gen)).to(dtype)
    dy = torch.randn(4099, n, device="cuda", dtype=dtype, generator=gen)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        return torch.autograd.grad(layer_norm_fn(*leaves, eps=1e-5), leaves, dy)

    monkeypatch.setattr(config, "bwd_recompute", lambda *args: False)  # (plans rebuilt)
    plain = grads()
    answers = _force_held_rows(monkeypatch)
    held = grads()
    assert True in answers, answers
    assert torch.equal(held[0], plain[0])
    for got, want in zip(held[1:], plain[1:]):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "n, dtype", [(1024, FP32), (4096, BF16), (12288, BF16), (16384, BF16), (16384, FP32),
                 (65536, FP32), (65536, FP16), (131072, FP16), (262144, BF16)],
)  # fmt: skip
@pytest.mark.parametrize("offset", [2.6, 2.9])
def test_gpu_layer_norm_joint_statistics(n, dtype, offset):
    """LayerNorm's mean and M2 from one joint sum of (s, s^2) (kernels._sums): with the mean
    2.6 standard deviations off zero the joint form is kept with the most cancellation it
    allows (sum(s^2) = 7.8 M2), at 2.9 the kernels recompute M2 over s - mean; one whole
    block, two blocks (12288), split rows, and the 16K 16-bit block, which keeps the two-pass
    statistics (config.fwd_joint_stats); 4096 loads its weights ahead (FWD_EARLY_PARAMS)."""
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


# Rows split over several forward programs (config.fwd_split: rows wider than 64 KB). The
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


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_gpu_split_rows_match_reference(name):
    """Split-row forward (and the backward after it) vs the fp64 reference."""
    from fused_norm import config

    case = SPLIT_CASES[name]
    eb = 4 if case.dtype == FP32 or case.residual_dtype == FP32 else 2
    assert config.fwd_split(case.shape[-1], eb, torch.device("cuda"))[1] > 1, "not split"
    check_case(case, "legacy" if case.layerscale else "fn", device="cuda")


def _split_fwd_args(case):
    """ops.fused_norm_fwd's arguments for ``case`` on the GPU (the masks stored; rowscale and
    layerscale left out), with random seeds where it drops out."""
    t = make_inputs(case, "cuda")
    seeds = torch.randint(0, 2**31, (2 * case.shape[0],), device="cuda")
    x2 = {k: (v.detach() if v is not None else None) for k, v in t.items()}
    return (x2["x"], x2["weight"], x2["bias"], x2["residual"], x2["x1"], x2["weight1"],
            x2["bias1"], None, None, seeds if case.dropout_p else None, case.eps,
            case.dropout_p, case.is_rms_norm, False, case.dtype, case.stream_dtype, True, True)  # fmt: skip


@pytest.mark.parametrize("name", ["ln_odd_offset", "drop_x1_w1_fp32res"])
def test_gpu_split_rows_match_chunked(name, monkeypatch):
    """Same inputs through the split rows and through the chunked two-sweep path: the residual
    stream and the dropout masks are bitwise equal (they do not depend on the statistics), the
    statistics and outputs agree to fp32 rounding of the merge order."""
    from fused_norm import config, ops

    case = SPLIT_CASES[name]
    args = _split_fwd_args(case)
    split = ops.fused_norm_fwd(*args)
    monkeypatch.setattr(config, "FWD_SPLIT_MIN_BYTES", 1 << 40)
    chunked = ops.fused_norm_fwd(*args)
    names = ("y", "y1", "residual_out", "mean", "rstd", "mask", "mask1")
    for label, a, b in zip(names, split, chunked):
        if a is None:
            assert b is None, label
        elif label in ("residual_out", "mask", "mask1"):
            assert_bitwise_equal(label, a, b)
        elif label in ("mean", "rstd"):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=label)
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=2**-7, msg=label)


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_gpu_split_rows_with_32_bit_index(name, monkeypatch):
    """Split rows whose parts count their columns in 32 bits (kernels' PART_I32, the rule on
    Triton 3.9 and later: config.fwd_split_part_i32) match the fp64 reference, and their
    forward gives bitwise the outputs of the 64-bit index."""
    from fused_norm import config, ops

    case = SPLIT_CASES[name]
    asked = []

    def always(*args, **kwargs):
        asked.append(args)
        return True

    monkeypatch.setattr(config, "fwd_split_part_i32", always)
    check_case(case, "legacy" if case.layerscale else "fn", device="cuda")
    assert asked, "no split forward asked for its index width"
    args = _split_fwd_args(case)
    narrow = ops.fused_norm_fwd(*args)
    monkeypatch.setattr(config, "fwd_split_part_i32", lambda *args, **kwargs: False)
    wide = ops.fused_norm_fwd(*args)
    names = ("y", "y1", "residual_out", "mean", "rstd", "mask", "mask1")
    for label, a, b in zip(names, narrow, wide):
        if a is None:
            assert b is None, label
        else:
            assert_bitwise_equal(label, a, b)


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
@pytest.mark.parametrize("hold", ["measured", True])
@pytest.mark.parametrize("offset", [2.0, 3.0])
def test_gpu_held_rows_match_fp32_rows_bitwise(n, dtype, is_rms_norm, hold, offset, monkeypatch):
    """Rows held in registers in 16 bits (config.FWD_HOLD: "measured" holds x in split parts,
    True also the stored stream) give bitwise the outputs of rows held in fp32, for a norm of
    x alone and with a residual and prenorm; with the mean 3 standard deviations off zero
    LayerNorm's parts take M2 again over s - mean, widened from the held values (fp16:
    kernels._convert_copy, which ptxas must not merge with the first conversion). (At 32K
    columns holding also changes the layout, one block to split parts: the matrix checks those
    rows against the reference.)"""
    from fused_norm import config

    # The same parts either way: holding alone also moves LayerNorm's 16 parts to 2 warps.
    monkeypatch.setattr(config, "fwd_split_warps", lambda *args: 2)
    for residual in (None, dtype):
        case = Case(shape=(6, n), dtype=dtype, is_rms_norm=is_rms_norm, offset=offset,
                    residual_dtype=residual, prenorm=residual is not None, seed=n)  # fmt: skip
        runs = []
        for value in (False, hold):
            monkeypatch.setattr(config, "FWD_HOLD", value)
            with torch.no_grad():
                runs.append(call_fused(case, make_inputs(case, "cuda"))[0])
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
    """Whether each backward plan made since the caches were emptied runs smem_kernels'
    kernel (ops._BwdPlan.layout's ``smem``)."""
    from fused_norm import ops

    return [plan.layout[3] for plan in ops._BWD_PLANS.values()]


def _fresh_plans():
    from fused_norm import config

    config.settings_changed()  # empties ops' plan caches


def _smem_check(case, api="fn"):
    """Check ``case`` on the GPU (check_case) with ops' plan caches emptied first, so that
    they then hold its plans only; skipped below compute capability 9 (smem_kernels)."""
    if not torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("smem_kernels needs compute capability 9+ (Hopper's shared memory)")
    _fresh_plans()
    check_case(case, api, device="cuda")


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
# Both places of partial dW (config.bwd_smem_dw_regs): fp16 weights keep it in shared memory on
# one-block rows, in registers on 8192 + a tail.
@example(n=16384, dtype=FP16, is_rms_norm=False, zero_centered_weight=True, rows=133)
@example(n=12288, dtype=FP16, is_rms_norm=False, zero_centered_weight=False, rows=401)
def test_gpu_smem_backward_matches_reference(n, dtype, is_rms_norm, zero_centered_weight, rows):
    """The backward that keeps partial dW in shared memory (smem_kernels, chosen by
    config.bwd_smem_partials for a norm of x alone with a weight and a bias, 16-bit, 10K-16K
    columns): every gradient against the fp64 reference, one row to several per program, the
    row held as one block (14336-16384, padded past N) or 8192 + a tail (10256-12288). The
    test fails if the plan did not take that kernel."""
    case = Case(shape=(rows, n), dtype=dtype, is_rms_norm=is_rms_norm,
                zero_centered_weight=zero_centered_weight, seed=n + rows)  # fmt: skip
    _smem_check(case)
    assert _smem_plans() == [True]
    if dtype == FP16 and n in (12288, 16384):
        from fused_norm import ops

        (plan,) = ops._BWD_PLANS.values()
        assert plan.kplan[0]["DW_REGS"] == (n == 12288)


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
    """smem_kernels' kernel with a residual (its gradient out; in, with prenorm) and x's
    dropout (the mask regenerated from the seeds as kernels._keep_mask draws it), at the
    widths it takes them (10K-12K: 8192 + a tail of 4096; 13K-16K: one block, padded past N),
    with dresidual_out staged (prenorm: partial dW in registers, the weight in shared memory,
    config.bwd_smem_dw_regs) or not: every gradient against the fp64 reference, which applies
    the mask the forward returned. The test fails if the plan did not take that kernel."""
    case = Case(shape=(rows, n), dtype=dtype, residual_dtype=dtype, is_rms_norm=is_rms_norm,
                zero_centered_weight=zero_centered_weight, dropout_p=dropout_p,
                prenorm=prenorm, seed=n + rows)  # fmt: skip
    _smem_check(case)
    assert _smem_plans() == [True]


def _smem_split() -> list:
    """The slices per row (smem_kernels' SPLIT) of each backward plan made since the caches
    were emptied; 0 for a plan of kernels.py's backward."""
    from fused_norm import ops

    return [plan.kplan[0]["SPLIT"] if plan.layout[3] else 0 for plan in ops._BWD_PLANS.values()]


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
    """Rows wider than one program of smem_kernels' backward (16-bit, 16K-256K columns; a
    norm of x alone with a weight and a bias) in slices, one program each, that exchange their
    partial row sums (config.bwd_smem_slices: 16K-column slices, 2 to 16 of them, with LAG
    from 3): every gradient against the fp64 reference, one row to several per program.
    The test fails if the plan did not take the sliced kernel."""
    case = Case(shape=(rows, n), dtype=dtype, is_rms_norm=is_rms_norm,
                zero_centered_weight=zero_centered_weight, seed=n + rows)  # fmt: skip
    _smem_check(case)
    (split,) = _smem_split()
    assert split > 1


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
    """Rows of 4-byte elements in smem_kernels' sliced backward (config.bwd_smem_slices):
    fp32 LayerNorm alone (16K-128K, 8K-column slices), and with dropout, or dropout + add +
    LayerNorm with prenorm of fp32 rows or of bf16 rows with an fp32 residual stream
    (``fp32_stream``), in two slices (16384); other widths take kernels.py's backward. fp32
    rows with a residual and dropout hold dresidual_out in registers (DRES_REGS) and take 4
    columns a thread (VEC; config.bwd_smem_fp32_vec); the rest 4 without dropout, 8 with.
    Every gradient against the fp64 reference; the test fails if the plan is not the one the
    rules give."""
    if residual == "none":
        case = Case(shape=(rows, n), dtype=FP32, zero_centered_weight=zero_centered_weight,
                    dropout_p=dropout_p, seed=n + rows)  # fmt: skip
    else:
        case = Case(shape=(rows, n), dtype=FP32 if residual == "fp32" else BF16,
                    residual_dtype=FP32, residual_in_fp32=True, dropout_p=dropout_p,
                    prenorm=True, zero_centered_weight=zero_centered_weight, seed=n + rows)  # fmt: skip
    # LayerNorm alone in 8K-column slices (12288 has none); with dropout or a residual in two
    # slices only.
    sliced = n == 16384 if residual != "none" or dropout_p > 0.0 else n != 12288
    _smem_check(case)
    (split,) = _smem_split()
    assert (split > 1) == sliced, split
    if sliced:
        from fused_norm import ops

        (flags,) = [plan.kplan[0] for plan in ops._BWD_PLANS.values()]
        dres_regs = residual == "fp32" and dropout_p > 0.0
        assert flags["DRES_REGS"] == dres_regs, flags
        assert flags["VEC"] == (4 if dres_regs or dropout_p == 0.0 else 8), flags


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
    dx1 is dx) in smem_kernels' sliced backward: dy1 staged beside s, dy and (prenorm)
    dresidual_out, partial dW1 and dB1 in registers, the second weight in shared memory,
    8K-column slices of 16-bit rows (16K-128K; 12288 has none, 256K would need 32), 20480
    with prenorm as two slices of 8192 + a 2048 tail (without it they would stage 60 KB of a
    row). Every gradient against the fp64 reference; the test fails if the plan is not the one
    the rule gives."""
    case = Case(shape=(rows, n), dtype=dtype, residual_dtype=dtype, has_x1=True, has_w1=True,
                has_b1=True, is_rms_norm=is_rms_norm, zero_centered_weight=zero_centered_weight,
                prenorm=prenorm, seed=n + rows)  # fmt: skip
    _smem_check(case)
    (split,) = _smem_split()
    if n == 20480:
        assert split == (2 if prenorm else 0), split
    else:
        assert split == (0 if n in (12288, 262144) else n // 8192), split


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
    """x1's path with its second output in smem_kernels' sliced backward for rows of 4-byte
    elements: fp32 rows and weights, or bf16 x and x1 with an fp32 residual stream
    (``fp32_stream``: dresidual then has a buffer of its own) and bf16 or (``_w32``) fp32
    weights. The slices (config.bwd_smem_slices: the widest power of two whose staged rows, s,
    dy, dy1 and with prenorm dresidual_out, fit beside both weights, 2 deep for two slices and 3
    for more, staging at least 48 KB of a row for x1): fp32 rows 4K columns; the fp32 stream
    with bf16 weights 8K, but 4K with prenorm in more than two slices; with fp32 weights 4K
    with prenorm, 8K in two slices without (wider rows: none, kernels.py). Every gradient
    against the fp64 reference; the test fails if the plan is not that one."""
    dtype = FP32 if stream == "fp32" else BF16
    case = Case(shape=(rows, n), dtype=dtype, residual_dtype=FP32, residual_in_fp32=True,
                weight_dtype=FP32 if stream != "fp32_stream" else None, has_x1=True,
                has_w1=True, has_b1=True, prenorm=prenorm,
                zero_centered_weight=zero_centered_weight, seed=n + rows)  # fmt: skip
    if stream == "fp32" or (prenorm and (n > 16384 or stream == "fp32_stream_w32")):
        split = n // 4096
    elif stream == "fp32_stream" or n == 16384:
        split = n // 8192
    else:
        split = 0
    _smem_check(case)
    assert _smem_split() == [split]


# A norm without a bias (one partial) in smem_kernels' backward (config.BWD_SMEM_ONE_PARTIAL):
# (columns, x's dtype, residual: None, "same" (x's dtype) or "fp32" (an fp32 stream), the
# slices the rule gives RMSNorm: 0 for kernels.py's backward, 1 for a whole row; LayerNorm
# takes a whole row of 16384 16-bit columns too).
SMEM_ONE_PARTIAL = [
    (12288, BF16, None, 1), (14336, FP16, None, 1), (16384, BF16, None, 0),
    (32768, FP16, None, 2), (131072, BF16, None, 8), (12288, BF16, "same", 1),
    (16384, FP16, "same", 0), (32768, BF16, "same", 0), (16384, FP32, None, 2),
    (65536, FP32, None, 8), (131072, FP32, None, 0), (16384, FP32, "fp32", 2),
    (16384, BF16, "fp32", 2), (12288, BF16, "fp32", 0), (32768, FP32, "fp32", 0),
]  # fmt: skip

# What the tests of a table of layouts draw beside the layout (in this order, after it).
SMEM_LAYOUT_DRAWS = dict(
    is_rms_norm=st.booleans(),
    zero_centered_weight=st.booleans(),
    rows=st.sampled_from([1, 7, 133, 300]),
    dropout_p=st.sampled_from([0.0, 0.1]),
)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    layout=st.sampled_from(SMEM_ONE_PARTIAL),
    **SMEM_LAYOUT_DRAWS,
)
# Bf16 x with an fp32 stream at 16384 (the benchmark's add + RMSNorm row), fp32 rows in 8
# slices (LAG), a padded whole row with dropout, LayerNorm's whole 16384.
@example(layout=(16384, BF16, "fp32", 2), is_rms_norm=True, zero_centered_weight=False,
         rows=300, dropout_p=0.0)  # fmt: skip
@example(layout=(65536, FP32, None, 8), is_rms_norm=True, zero_centered_weight=True, rows=133,
         dropout_p=0.0)  # fmt: skip
@example(layout=(14336, BF16, "same", 1), is_rms_norm=False, zero_centered_weight=False,
         rows=133, dropout_p=0.1)  # fmt: skip
@example(layout=(16384, BF16, None, 0), is_rms_norm=False, zero_centered_weight=False,
         rows=133, dropout_p=0.0)  # fmt: skip
def test_gpu_smem_backward_one_partial(layout, is_rms_norm, zero_centered_weight, rows,
                                       dropout_p):  # fmt: skip
    """A norm without a bias (partial dW only), alone or with a residual (add + norm with
    prenorm, x's dropout where there is a residual), in smem_kernels' backward where
    config.bwd_smem_partials takes one partial: whole 16-bit rows (but RMSNorm's full 16384),
    16-bit rows of x alone in 16K-column slices, 4-byte rows in at most 8 slices (with a
    residual: 2). Every gradient against the fp64 reference; the test fails if the plan is
    not the one the rule gives."""
    n, dtype, residual, split = layout
    if not is_rms_norm and n == 16384 and dtype != FP32 and residual != "fp32":
        split = 1  # LayerNorm's whole row
    if residual is None:
        case = Case(shape=(rows, n), dtype=dtype, is_rms_norm=is_rms_norm, has_bias=False,
                    zero_centered_weight=zero_centered_weight, seed=n + rows)  # fmt: skip
    else:
        case = Case(shape=(rows, n), dtype=dtype, is_rms_norm=is_rms_norm, has_bias=False,
                    residual_dtype=FP32 if residual == "fp32" else dtype,
                    residual_in_fp32=residual == "fp32", prenorm=True, dropout_p=dropout_p,
                    zero_centered_weight=zero_centered_weight, seed=n + rows)  # fmt: skip
    _smem_check(case)
    assert _smem_split() == [split]


# 16-bit rows beside fp32 weights (autocast's parameters) in smem_kernels' backward
# (config.BWD_SMEM_W4_16BIT): (columns, x's dtype, what the call adds to the norm, the slices
# the rule gives: 0 for kernels.py's backward, 1 for a whole row). "plain": a weight and a
# bias; "nobias": the weight alone (one partial; RMSNorm's whole 16384 keeps kernels.py's);
# "residual": add + norm with prenorm, x's dropout drawn; "x1": x1's second output. From 48K
# columns (the x1 path: from 24K) the slices fit 2 rows deep without LAG, not 3 with it
# (config.BWD_SMEM_NOLAG_MAX_SPLIT; one partial in at most 4 of them).
SMEM_W4 = [
    (12288, BF16, "plain", 1), (16384, FP16, "plain", 1), (14336, BF16, "nobias", 1),
    (16384, BF16, "nobias", 1), (16384, BF16, "residual", 1), (12288, FP16, "residual", 1),
    (32768, BF16, "plain", 2), (32768, FP16, "nobias", 2), (65536, BF16, "plain", 4),
    (131072, BF16, "plain", 8), (65536, FP16, "nobias", 4), (131072, BF16, "nobias", 0),
    (262144, BF16, "plain", 0), (16384, BF16, "x1", 2), (32768, BF16, "x1", 4),
    (12288, BF16, "x1", 0),
]  # fmt: skip


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    layout=st.sampled_from(SMEM_W4),
    **SMEM_LAYOUT_DRAWS,
)
# The fp32 weight in shared memory beside one staged row (16384 with dresidual_out), in
# registers beside the fp32 partial dW in shared memory (one block), x1's second weight, and
# slices without LAG.
@example(layout=(16384, BF16, "residual", 1), is_rms_norm=False, zero_centered_weight=True,
         rows=300, dropout_p=0.1)  # fmt: skip
@example(layout=(16384, FP16, "plain", 1), is_rms_norm=False, zero_centered_weight=False,
         rows=133, dropout_p=0.0)  # fmt: skip
@example(layout=(16384, BF16, "x1", 2), is_rms_norm=False, zero_centered_weight=False,
         rows=133, dropout_p=0.0)  # fmt: skip
@example(layout=(131072, BF16, "plain", 8), is_rms_norm=False, zero_centered_weight=False,
         rows=7, dropout_p=0.0)  # fmt: skip
@example(layout=(32768, BF16, "x1", 4), is_rms_norm=False, zero_centered_weight=True,
         rows=300, dropout_p=0.0)  # fmt: skip
def test_gpu_smem_backward_fp32_weights(layout, is_rms_norm, zero_centered_weight, rows,
                                        dropout_p):  # fmt: skip
    """16-bit rows with fp32 weights (and biases) in smem_kernels' backward, whole or in
    slices, where config.bwd_smem_partials takes them as it takes 16-bit weights (and in up to
    8 slices without LAG where LAG's 3 staged rows do not fit beside the fp32 weight): the
    weight staged in shared memory as fp32 where partial dW is in registers, held in registers
    where dW is in shared memory. Every gradient against the fp64 reference; the test fails if
    the plan is not the one the rule gives."""
    n, dtype, kind, split = layout
    if kind == "nobias" and is_rms_norm and n == 16384:
        split = 0  # RMSNorm's whole 16384 (config.bwd_smem_partials)
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
    assert _smem_split() == [split]


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
    """Calls of the kernel's widths and dtypes with what smem_kernels' kernel does not do
    (rowscale, layerscale, x1's gradient of its own (dropout), x1's second output without
    biases) take kernels.py's backward, and
    match the fp64 reference. Before config.bwd_smem_partials asked for them, rowscale and
    layerscale took the Gluon kernel, which ignored them (dx without the row's scale; no
    dlayerscale)."""
    case = SMEM_LACKS[name]
    _smem_check(case, "legacy" if case.layerscale else "fn")
    assert _smem_plans() == [False]


def test_gpu_smem_backward_misaligned_rows_take_triton():
    """Rows whose address is not 16-byte aligned (a view one element in) cannot take the
    kernel's 16-byte copies: the plan falls back to kernels.py's backward, still correct;
    the aligned rows of the same shape take smem_kernels'. Gradients bitwise reproducible."""
    if not torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("smem_kernels needs compute capability 9+ (Hopper's shared memory)")
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
    # Against the fp64 reference through the shared check for each layout.
    ref_x = buf[1:].view(rows, n).double().requires_grad_()
    ref_w, ref_b = (t.detach().double().requires_grad_() for t in (w, b))
    y = torch.nn.functional.layer_norm(ref_x, (n,), ref_w, ref_b, eps=1e-6)
    want = torch.autograd.grad(y, (ref_x, ref_w, ref_b), dy.double())
    for got, ref in zip(grads["misaligned"], want):
        err = (got.double() - ref).abs().max() / ref.abs().max()
        assert err < 2e-2, err


# The backward's later kernels launch as programmatic dependents (config.bwd_pdl): the pre-pass
# path's shares' sum and column kernel (16-bit dropout + add + LayerNorm at 128K, in parts; the
# x1 path at 256K), and the partials' sum after every backward kernel (one-block rows, the
# shared-memory kernel at 16K). Rows as the benchmark's (2^27 elements), so that the kernels
# after the pre-pass start while it still runs.
PDL_CASES = [("drop_add_ln_prenorm", 131072), ("x1_w1", 262144), ("ln", 4096),
             ("drop_add_ln_prenorm", 16384)]  # fmt: skip


@pytest.mark.parametrize("flags, n", PDL_CASES, ids=[f"{f}-{n}" for f, n in PDL_CASES])
def test_gpu_dependent_launches_match_serial_launches(flags, n, monkeypatch):
    """Every output, mask and gradient bitwise the same with the backward's kernels launched
    as programmatic dependents (their fresh memory poisoned: a kernel that read the kernel
    before it too early would read NaN) as with plain launches; and the dependents did launch
    so (their plans' GDC, Triton's launch_pdl where its launcher says)."""
    from fused_norm import config, ops

    case = _case(flags, n, BF16, rows=(1 << 27) // n, seed=7)
    t = make_inputs(case, "cuda")
    monkeypatch.setattr(config, "BWD_PDL", False)
    serial = run_filled(case, t, poison=False)
    monkeypatch.setattr(config, "BWD_PDL", True)
    dependent = run_filled(case, t, poison=True)
    assert serial.keys() == dependent.keys()
    for k in serial:
        assert_bitwise_equal(k, serial[k], dependent[k])
    (plan,) = ops._BWD_PLANS.values()
    flags_, _, _, sums, red = plan.kplan
    assert red["GDC"], red
    if n >= 131072:  # the pre-pass path: all four kernels in a dependent chain
        assert sums is not None and sums["GDC"] and flags_["GDC"], (sums, flags_)
    for launcher in (ops._BWD, ops._ADD, ops._RED):
        for key, (run, _, _) in launcher.cache.items():
            gdc = dict(zip(launcher.constexpr_names, key[3])).get("GDC")
            if gdc is not None and hasattr(run, "launch_pdl"):  # (Triton 3.6's CudaLauncher)
                assert bool(run.launch_pdl) == bool(gdc), (launcher.kernel, key)

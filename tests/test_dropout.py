"""Dropout: keep rate, reproducibility under torch.manual_seed, the backward's mask, the
independence of the x and x1 masks, and the 1 / (1 - p) scaling of kept values.

The masks come from ``return_dropout_mask=True`` (True = kept). Each test runs through the
kernels (the interpreter on CPU) and, where the property is part of the contract rather than of
the kernels, also through the PyTorch backend.
"""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import Case, check_case, max_block_bytes, patched_config, split_rows, tail_blocks

from fused_norm import layer_norm_fn, rms_norm_fn

BACKENDS = ["auto", "torch"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FUSED_NORM_BACKEND", request.param)
    return request.param


def _call(x, x1=None, p=0.5, seed=0, **kw):
    """layer_norm_fn with masks; returns (y, residual_out, mask, mask1) (prenorm on)."""
    n = x.shape[-1]
    w = torch.ones(n, device=x.device, dtype=x.dtype)
    torch.manual_seed(seed)
    return layer_norm_fn(
        x, w, None, x1=x1, dropout_p=p, prenorm=True, residual_in_fp32=True,
        return_dropout_mask=True, **kw,
    )  # fmt: skip


def _within_sigmas(count: int, total: int, prob: float, sigmas: float = 5.0) -> bool:
    sd = math.sqrt(total * prob * (1.0 - prob))
    return abs(count - total * prob) <= sigmas * sd


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_kept_fraction(p, device, backend):
    """The keep rate of both masks lies within 5 binomial sigmas of 1 - p (65 536 elements)."""
    x = torch.randn(64, 1024, device=device)
    x1 = torch.randn(64, 1024, device=device)
    _, _, mask, mask1 = _call(x, x1, p)
    for name, m in (("mask", mask), ("mask1", mask1)):
        kept = int(m.sum())
        assert _within_sigmas(kept, m.numel(), 1.0 - p), (
            f"{name}: kept {kept} of {m.numel()} with p={p}; expected "
            f"{m.numel() * (1 - p):.0f} +- 5 sigma"
        )


def test_rows_and_columns_get_fresh_randomness(device):
    """Per-row seeds: no two rows share a mask, and no column is constant across rows."""
    x = torch.randn(64, 256, device=device)
    _, _, mask, _ = _call(x, p=0.5)
    assert torch.unique(mask, dim=0).shape[0] == 64, "two rows got the same dropout mask"
    col_kept = mask.float().mean(0)
    assert bool(((col_kept > 0) & (col_kept < 1)).all()), "a column is kept or dropped in every row"


def test_same_seed_same_mask(device, backend):
    """Same torch.manual_seed -> identical masks and outputs; another seed -> other masks."""
    x = torch.randn(3, 5, 96, device=device)
    x1 = torch.randn(3, 5, 96, device=device)
    a = _call(x, x1, 0.3, seed=1234)
    b = _call(x, x1, 0.3, seed=1234)
    c = _call(x, x1, 0.3, seed=4321)
    for name, u, v in zip(("y", "residual_out", "mask", "mask1"), a, b):
        assert torch.equal(u, v), f"{name} differs under the same seed"
    assert not torch.equal(a[2], c[2]), "another seed gave the same mask"
    assert not torch.equal(a[3], c[3]), "another seed gave the same mask1"


def test_x_and_x1_masks_differ(device, backend):
    """The two inputs are dropped independently: they disagree on ~2p(1-p) of the elements."""
    p = 0.5
    x = torch.randn(64, 1024, device=device)
    _, _, mask, mask1 = _call(x, torch.randn_like(x), p)
    disagree = int((mask != mask1).sum())
    assert _within_sigmas(disagree, mask.numel(), 2 * p * (1 - p)), (
        f"x and x1 masks disagree on {disagree} of {mask.numel()} elements"
    )


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kept_values_scaled(p, device, backend):
    """residual_out (fp32 stream) = rowscale * x * mask / (1 - p) + x1 * mask1 / (1 - p)."""
    x = torch.randn(6, 200, device=device)
    x1 = torch.randn(6, 200, device=device)
    rowscale = torch.rand(6, device=device) + 0.5
    _, res, mask, mask1 = _call(x, x1, p, rowscale=rowscale)
    x64, x164 = x.double() * rowscale.double()[:, None], x1.double()
    expected = (x64 * mask + x164 * mask1) / (1.0 - p)
    assert res.dtype == torch.float32
    torch.testing.assert_close(res.double(), expected, rtol=1e-6, atol=1e-5)
    # Without x1 the dropped elements of the stream are exactly zero.
    _, res, mask, _ = _call(x, None, p)
    assert bool((res[~mask] == 0).all()), "a dropped element reached the residual stream"
    torch.testing.assert_close(res[mask].double(), x.double()[mask] / (1.0 - p), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "block_bytes, tail", [(None, False), (None, True), (64, False)],
    ids=["one-block", "two-blocks", "chunked"],
)  # fmt: skip
@pytest.mark.parametrize("is_rms_norm", [False, True], ids=["ln", "rms"])
def test_backward_uses_forward_mask(block_bytes, tail, is_rms_norm, device):
    """d(x) is exactly 0 where x was dropped (likewise x1) and matches the reference run with
    the forward's masks; with dropout the stored mask is regenerated in the backward from the
    row seeds, block by block (80 columns as 64 + 16), or chunk by chunk in the wide-row
    path."""
    case = Case(shape=(2, 3, 80), dtype=torch.float32, is_rms_norm=is_rms_norm,
                residual_dtype=torch.float32, has_x1=True, has_w1=True, dropout_p=0.5,
                prenorm=True, seed=7)  # fmt: skip
    with max_block_bytes(block_bytes), tail_blocks(tail):
        _, grads, (mask, mask1) = check_case(case, "fn", device=device)
    for name, g, m in (("x", grads["x"], mask), ("x1", grads["x1"], mask1)):
        assert bool((g[~m] == 0).all()), f"grad of {name} is nonzero where {name} was dropped"
        assert float((g[m] != 0).float().mean()) > 0.99, f"grad of {name} vanishes where kept"


def test_mask_same_in_two_blocks_and_padded(device):
    """A row held as two blocks (80 columns as 64 + 16) draws the same masks as the same row in
    one padded block of 128: the decisions depend on (seed, column) alone. The outputs agree
    to rounding (the row sums are added in another order)."""
    x, x1 = torch.randn(5, 80, device=device), torch.randn(5, 80, device=device)
    runs = []
    for tail in (True, False):
        with tail_blocks(tail):
            runs.append(_call(x, x1, p=0.3, seed=11))
    (y, res, mask, mask1), (y_pad, res_pad, mask_pad, mask1_pad) = runs
    assert torch.equal(mask, mask_pad) and torch.equal(mask1, mask1_pad)
    assert torch.equal(res, res_pad), "the residual stream is elementwise: it must be equal"
    torch.testing.assert_close(y, y_pad, rtol=1e-5, atol=1e-5)


def test_dropout_zero_is_identity(device):
    """dropout_p = 0 returns no masks and the same result as the plain norm."""
    x = torch.randn(4, 33, device=device)
    w = torch.randn(33, device=device)
    y, m, m1 = rms_norm_fn(x, w, None, dropout_p=0.0, return_dropout_mask=True)
    assert m is None and m1 is None
    torch.testing.assert_close(y, rms_norm_fn(x, w, None))


def test_mask_independent_of_memory_layout(device, backend):
    """A transposed view and its contiguous copy get the same mask under one seed: the mask
    belongs to x's logical elements, not to its memory layout."""
    base = torch.randn(40, 6, device=device)
    results = []
    for x in (base.t(), base.t().contiguous()):
        _, _, mask, _ = _call(x, p=0.3, seed=5)
        results.append(mask)
    assert torch.equal(results[0], results[1]), "the dropout mask depends on x's strides"


def test_drop_probability_has_16_bit_resolution(device):
    """The kernels compare 16 random bits per element with round(p * 2**16) (README): p values
    in the same 2**-16 step draw the same mask, the next steps another, and p < 2**-17 drops
    nothing."""
    x = torch.randn(32, 2048, device=device)
    half = _call(x, p=0.5)[2]
    assert torch.equal(half, _call(x, p=0.5 + 2**-18)[2]), (
        "p within one 2**-16 step changed the mask"
    )
    moved = _call(x, p=0.5 + 2**-12)[2]  # 16 steps: ~16/65536 of the elements flip, ~16 here
    assert not torch.equal(half, moved), "p 16 steps higher drew the same mask"
    assert bool((half | ~moved).all()), "raising p must only drop more elements"
    assert bool(_call(x, p=2**-18)[2].all()), "p below 2**-17 dropped an element"


def _rng_state(device):
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


def _set_rng_state(device, state):
    (torch.cuda.set_rng_state if device == "cuda" else torch.set_rng_state)(state)


def test_fresh_masks_each_call_replayed_from_the_rng_state(device):
    """Each call draws a new key from torch's generator (the device's: ops.dropout_key), so
    two calls in a row drop differently; restoring the generator's state first (as activation
    checkpointing does) draws the same masks again."""
    x, x1 = torch.randn(8, 96, device=device), torch.randn(8, 96, device=device)
    w = torch.ones(96, device=device)

    def masks():
        out = layer_norm_fn(x, w, None, x1=x1, dropout_p=0.5, return_dropout_mask=True)
        return out[1], out[2]

    state = _rng_state(device)
    first = masks()
    second = masks()
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[1], second[1])
    _set_rng_state(device, state)
    again = masks()
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


LAYOUTS = {  # forward layouts: (n, rows, x1, rules patch)
    "tile": (100, 7, True, lambda: patched_config(FWD_TILE_ROWS=4)),
    "one-row": (80, 5, True, lambda: tail_blocks(True)),
    "chunked": (200, 3, False, lambda: max_block_bytes(64)),
    "split": (200, 3, False, lambda: split_rows(64)),
    "split-x1": (200, 3, True, lambda: split_rows(64)),
}


def _saved_seeds(y) -> torch.Tensor:
    """The per-row seeds an eager forward saved for its backward (ops.KernelCall.forward saves
    ``(s, weight, bias, weight1, bias1, rowscale, layerscale, seeds, ...)``)."""
    seeds = y.grad_fn.saved_tensors[7]
    assert seeds.dtype == torch.int64, "not the seeds"
    return seeds.detach().clone()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_seeds_derived_from_key_are_the_seeds_stored(layout, device, monkeypatch):
    """Given the call's key (an eager call's: ops.dropout_key) the forward derives seed ``i``
    (x's rows, then x1's) as the key's low word plus ``i`` mod 2**32 and stores it; a forward
    that reads those stored seeds (as under CUDA graph capture, where ops.draw_seeds fills
    them) and the traced forward (torch.ops.fused_norm.fwd, which reads them too) give
    bitwise the same outputs and masks; then the backward, which reads them, drops what the
    forward dropped. The key's low word wraps mid-call here. Rows as tiles of four, one per
    program, chunked, and split over programs; where a plan takes no key (seeds_from_key, e.g.
    the x1 path's split rows) the seeds are drawn on the device, as under capture."""
    from fused_norm import ops

    n, rows, has_x1, patch = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(n + rows)
    x, x1, res = (torch.randn(rows, n, generator=gen).to(device) for _ in range(3))
    x1 = x1 if has_x1 else None
    w = torch.randn(n, generator=gen).to(device)
    key = 2**40 + 2**32 - 3  # low word 2**32 - 3: seeds 2**32 - 3, 2**32 - 2, 2**32 - 1, 0, ...
    count = 2 * rows if has_x1 else rows
    expected = (key + torch.arange(count, dtype=torch.int64)) & 0xFFFFFFFF
    monkeypatch.setattr(ops, "dropout_key", lambda dev: key)  # the call's key, as drawn

    def run(xr, x1r=x1):
        y, s, mask, mask1 = layer_norm_fn(
            xr, w, None, residual=res, x1=x1r, eps=1e-5, dropout_p=0.4, prenorm=True,
            return_dropout_mask=True,
        )  # fmt: skip
        return y, s, mask, mask1

    with patch():
        leaves = [x.clone().requires_grad_()] + (
            [] if x1 is None else [x1.clone().requires_grad_()]
        )
        y, s, mask, mask1 = run(*leaves)
        seeds = _saved_seeds(y)
        (row_plan,) = [p for k, p in ops._PLANS.items() if k[0] == "fwd"]
        if row_plan.seeds_from_key:
            assert torch.equal(seeds.cpu(), expected), "the forward stored other seeds"
        else:  # drawn by torch.randint on the device
            assert not torch.equal(seeds.cpu(), expected)
            assert bool(((seeds >= 0) & (seeds < 2**31)).all())
        # The same call with its seeds read, not derived (as under capture).
        monkeypatch.setattr(ops, "dropout_key", lambda dev: None)
        monkeypatch.setattr(ops, "draw_seeds", lambda count, dev, out=None: out.copy_(seeds))
        again = run(x.clone().requires_grad_())
        assert torch.equal(_saved_seeds(again[0]), seeds)
        # The traced forward reads them too.
        traced = torch.ops.fused_norm.fwd(
            x, w, None, res, x1, None, None, None, None, seeds, 1e-5, 0.4, False, False, True,
            True, torch.float32, torch.float32,
        )  # fmt: skip
        # [y, residual_out, mean, rstd, mask, mask1 (with x1)]
        traced = dict(zip(("y", "residual_out", "mean", "rstd", "mask", "mask1"), traced))
        for name, a, b in zip(("y", "residual_out", "mask", "mask1"), (y, s, mask, mask1), again):
            assert (a is None and b is None) or torch.equal(a, b), f"{name} differs"
            if a is not None:
                assert torch.equal(a, traced[name]), f"{name} differs from the traced forward"
        assert 0.4 < float(mask.float().mean()) < 0.8  # masks of p = 0.4
        dy = torch.randn(rows, n, generator=gen).to(device)
        grads = torch.autograd.grad(y, leaves, dy)
    for g, m in zip(grads, (mask, mask1)):
        assert bool((g[~m] == 0).all() and (g[m] != 0).all())


def test_dropout_key_values():
    """ops.dropout_key's keys lie in [KEY_LOW, KEY_HIGH) (one int64 type to Triton whatever
    the value), those mixed from one seed's successive offsets are distinct, the CPU's comes
    from torch's generator (torch.manual_seed repeats it), and a device with no generator the
    launcher reads has none (the seeds are drawn on the device)."""
    from fused_norm import ops

    keys = {ops._mix(seed, offset) for seed in (0, 42, 2**63 + 5) for offset in range(0, 40000, 4)}
    assert len(keys) == 30000
    assert all(ops.KEY_LOW <= k < ops.KEY_HIGH for k in keys)
    cpu = torch.device("cpu")
    torch.manual_seed(3)
    first = ops.dropout_key(cpu)
    assert ops.KEY_LOW <= first < ops.KEY_HIGH and ops.dropout_key(cpu) != first
    torch.manual_seed(3)
    assert ops.dropout_key(cpu) == first
    assert ops.dropout_key(torch.device("meta")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_dropout_key_from_the_cuda_generator():
    """On a GPU an eager call's key comes from the CUDA generator without a kernel: its draw
    advances the generator's offset by 4 (torch's unit); the same (seed, offset) gives the
    same key (torch.cuda.manual_seed, set_rng_state); under CUDA graph capture there is none
    (a key baked into the graph would repeat every replay: the seeds are drawn on the device)."""
    from fused_norm import ops

    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.cuda.default_generators[dev.index]
    torch.cuda.manual_seed(123)
    offset = gen.get_offset()
    first = ops.dropout_key(dev)
    assert type(first) is int and gen.get_offset() == offset + 4
    state = torch.cuda.get_rng_state()
    second = ops.dropout_key(dev)
    assert second != first
    torch.cuda.set_rng_state(state)
    assert ops.dropout_key(dev) == second
    torch.cuda.manual_seed(123)
    assert ops.dropout_key(dev) == first
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = ops.dropout_key(dev)
    assert captured is None

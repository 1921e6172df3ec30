"""Shared test machinery: the three-way tolerance rule, input builders and the case runner.

The tolerance rule (flash-attn's, made explicit). For every output and every gradient:

    truth  = the reference on fp64 copies of the inputs (same dropout masks as the kernel)
    base   = the reference on the inputs in their own dtypes, ``upcast=False`` (plain PyTorch at
             working precision, gradients by autograd in that precision)
    assert max|kernel - truth| <= 2 * max|base - truth| + atol,
    atol   = ATOL_ULPS * eps(dtype) * max(1, max|truth|)

``eps(dtype)`` is ``torch.finfo(dtype).eps`` (the spacing of floats at 1.0) of the working
precision: the coarsest of the tensor's own dtype and the dtypes it was computed from (x, the
residual stream, the weights). The kernels compute in fp32 and round each stored value once,
at most half an ulp, i.e. ``eps / 2`` relative to the largest value; ATOL_ULPS = 4 leaves 8x
headroom for that rounding plus the fp32 arithmetic before it. The working precision, not the
tensor's dtype, because an fp32 weight gradient of an fp16 model is a sum of products of
fp16-rounded activations: its noise floor is fp16's. Measured against fp32's eps, two equally
accurate computations of a 7-column dW differed by more than 2x (fp16 x, x1 and residual,
N = 7, found by hypothesis).

One exception to the factor 2: the Triton interpreter (``TRITON_INTERPRET=1``, the CPU run)
converts fp32 to bf16 by truncation (``triton/runtime/interpreter.py``, ``cast_impl`` passes no
rounding mode), an error of up to one ulp with a bias, twice the bound of the round-to-nearest
that GPUs and PyTorch use. Every bf16 value the kernels store there is rounded twice as
coarsely as the baseline's, so for cases that store bf16 under the interpreter the factor is 4.

Tests import this module by name (pytest's default "prepend" import mode puts ``tests/`` on
``sys.path``). Hypothesis tests call :func:`count_example` once per example, and conftest's
terminal summary prints the totals.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import torch

import fused_norm
from fused_norm import (
    dropout_add_layer_norm,
    dropout_add_layer_norm_parallel_residual,
    dropout_add_rms_norm,
    dropout_add_rms_norm_parallel_residual,
    layer_norm_fn,
    layer_norm_ref,
    rms_norm_fn,
    rms_norm_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL_ULPS = 4.0
INTERPRETED = fused_norm.autograd.KERNELS_INTERPRETED
# Names of the differentiable inputs, in the order the runner reports them.
GRAD_NAMES = ("x", "weight", "bias", "residual", "x1", "weight1", "bias1", "layerscale")

EXAMPLE_COUNTS: collections.Counter = collections.Counter()


def count_example(test_name: str) -> None:
    """Record one hypothesis example of ``test_name`` (printed in the terminal summary)."""
    EXAMPLE_COUNTS[test_name] += 1


# ----------------------------------------------------------------------------------------------
# Comparisons
# ----------------------------------------------------------------------------------------------


def _index(flat: int, shape) -> tuple:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(shape)))


def assert_three_way(
    name: str, kernel, truth, base, factor: float = 2.0, atol_ulps: float = ATOL_ULPS,
    working_dtypes=(),
) -> None:  # fmt: skip
    """``max|kernel - truth| <= factor * max|base - truth| + atol`` (see the module docstring).

    ``truth`` is fp64; ``base`` may have another dtype than ``kernel`` (compared in fp64).
    ``working_dtypes``: the dtypes ``kernel`` was computed from; the coarsest of them and of
    kernel's own dtype sets the eps of atol. On failure the message gives the worst element's
    index and its kernel, truth and base values.
    """
    assert kernel is not None, f"{name}: the kernel returned no tensor"
    assert truth is not None and base is not None, f"{name}: missing reference tensor"
    assert kernel.shape == truth.shape, (
        f"{name}: shape {tuple(kernel.shape)} != {tuple(truth.shape)}"
    )
    k, t, b = (v.detach().to(kernel.device, torch.float64) for v in (kernel, truth, base))
    if k.numel() == 0:
        return
    diff = (k - t).abs()
    err_kernel = diff.max().item()
    err_base = (b - t).abs().max().item()
    eps = max(torch.finfo(d).eps for d in (kernel.dtype, *working_dtypes) if d is not None)
    atol = atol_ulps * eps * max(1.0, t.abs().max().item())
    bound = factor * err_base + atol
    if not err_kernel <= bound:  # written so that NaN fails
        flat = int(torch.nan_to_num(diff, nan=float("inf")).argmax())
        idx = _index(flat, k.shape)
        raise AssertionError(
            f"{name} ({kernel.dtype}): max|kernel - truth| = {err_kernel:.3e} > "
            f"{factor:g} * max|base - truth| + atol = {factor:g} * {err_base:.3e} + {atol:.3e}; "
            "worst element "
            f"{idx}: kernel {k[idx].item():.8g}, truth {t[idx].item():.8g}, "
            f"base {b[idx].item():.8g}"
        )


def assert_bitwise_equal(name: str, a, b) -> None:
    """Same dtype, shape and values bit for bit (first differing element on failure)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{name}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    )
    if not torch.equal(a, b):
        ne = (a != b).reshape(-1)
        flat = int(ne.nonzero()[0])
        idx = _index(flat, a.shape)
        raise AssertionError(f"{name}: not bitwise equal, first at {idx}: {a[idx]} vs {b[idx]}")


# ----------------------------------------------------------------------------------------------
# Cases: a description of one call, the inputs it needs, and the run against the references
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of the fused op: shapes, dtypes, flags and input statistics."""

    shape: tuple  # (..., N)
    dtype: torch.dtype = torch.float32
    weight_dtype: Optional[torch.dtype] = None  # None: same as x
    is_rms_norm: bool = False
    has_bias: bool = True
    residual_dtype: Optional[torch.dtype] = None  # None: no residual
    residual_in_fp32: bool = False
    has_x1: bool = False
    has_w1: bool = False
    has_b1: bool = False
    rowscale: bool = False
    layerscale: bool = False  # legacy API only
    dropout_p: float = 0.0
    prenorm: bool = False
    zero_centered_weight: bool = False
    out_dtype: Optional[torch.dtype] = None
    eps: float = 1e-5
    scale: float = 1.0  # inputs ~ offset + scale * N(0, 1)
    offset: float = 0.0
    seed: int = 0

    @property
    def wdtype(self) -> torch.dtype:
        return self.weight_dtype or self.dtype

    @property
    def stream_dtype(self) -> torch.dtype:
        """dtype of residual_out by API.md's rule."""
        if self.residual_dtype is not None:
            return self.residual_dtype
        return torch.float32 if self.residual_in_fp32 else self.dtype


def make_inputs(case: Case, device=DEVICE) -> dict:
    """Leaf tensors for ``case`` (differentiable ones with requires_grad); absent ones are None."""
    gen = torch.Generator().manual_seed(case.seed)
    n = case.shape[-1]

    def randn(shape, dtype, scale=1.0, offset=0.0, grad=True):
        t = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + offset).to(dtype)
        return t.to(device).requires_grad_(grad)

    def param(offset):
        # Around 1 (scales) or 0 (shifts, zero-centred scales), with a spread so that every
        # column's gradient is distinct.
        return randn((n,), case.wdtype, 0.2, offset)

    w_center = 0.0 if case.zero_centered_weight else 1.0
    t = {
        "x": randn(case.shape, case.dtype, case.scale, case.offset),
        "weight": param(w_center),
        "bias": param(0.0) if case.has_bias else None,
        "residual": (
            randn(case.shape, case.residual_dtype, case.scale)
            if case.residual_dtype is not None else None
        ),
        "x1": randn(case.shape, case.dtype, case.scale) if case.has_x1 else None,
        "weight1": param(w_center) if case.has_w1 else None,
        "bias1": param(0.0) if case.has_w1 and case.has_b1 else None,
        "rowscale": (
            randn(case.shape[:-1], torch.float32, 0.5, 1.0, grad=False) if case.rowscale else None
        ),
        "layerscale": randn((n,), case.wdtype, 0.2, 1.0) if case.layerscale else None,
    }  # fmt: skip
    return t


def call_fused(case: Case, t: dict, api: str = "fn", **extra):
    """Call the fused op for ``case`` with ``return_dropout_mask=True`` and unpack the result.

    api: "fn" (layer_norm_fn / rms_norm_fn), "legacy" (dropout_add_*), "parallel"
    (dropout_add_*_parallel_residual). Returns ``(outs, masks)``: outs maps "y", "y1",
    "residual_out" to tensors (absent ones missing), masks is ``(mask, mask1)``.
    """
    if api == "fn":
        fn = rms_norm_fn if case.is_rms_norm else layer_norm_fn
        kw = {} if case.is_rms_norm else {"is_rms_norm": False}
        res = fn(
            t["x"], t["weight"], t["bias"], residual=t["residual"], x1=t["x1"],
            weight1=t["weight1"], bias1=t["bias1"], eps=case.eps, dropout_p=case.dropout_p,
            rowscale=t["rowscale"], prenorm=case.prenorm, residual_in_fp32=case.residual_in_fp32,
            zero_centered_weight=case.zero_centered_weight, return_dropout_mask=True,
            out_dtype=case.out_dtype, **kw, **extra,
        )  # fmt: skip
        res = list(res)
        outs = {"y": res.pop(0)}
        if case.has_w1:
            outs["y1"] = res.pop(0)
        if case.prenorm:
            outs["residual_out"] = res.pop(0)
        assert len(res) == 2, f"expected (mask, mask1) at the end, got {len(res)} more items"
        return outs, tuple(res)
    if api == "legacy":
        fn = dropout_add_rms_norm if case.is_rms_norm else dropout_add_layer_norm
        res = fn(
            t["x"], t["residual"], t["weight"], t["bias"], case.dropout_p, case.eps,
            rowscale=t["rowscale"], layerscale=t["layerscale"], prenorm=case.prenorm,
            residual_in_fp32=case.residual_in_fp32, return_dropout_mask=True,
        )  # fmt: skip
        res = list(res)
        outs = {"y": res.pop(0)}
        if case.prenorm:
            outs["residual_out"] = res.pop(0)
        assert len(res) == 1, f"legacy API: expected one mask at the end, got {len(res)} items"
        return outs, (res[0], None)
    if api == "parallel":
        fn = (
            dropout_add_rms_norm_parallel_residual
            if case.is_rms_norm else dropout_add_layer_norm_parallel_residual
        )  # fmt: skip
        res = fn(
            t["x"], t["x1"], t["residual"], t["weight"], t["bias"], t["weight1"], t["bias1"],
            case.dropout_p, case.eps, prenorm=case.prenorm,
            residual_in_fp32=case.residual_in_fp32, return_dropout_mask=True,
        )  # fmt: skip
        res = list(res)
        outs = {"y": res.pop(0), "y1": res.pop(0)}
        if case.prenorm:
            outs["residual_out"] = res.pop(0)
        assert len(res) == 2, f"parallel API: expected (mask0, mask1), got {len(res)} items"
        if not case.has_w1:
            assert outs["y1"] is None, "y1 must be None without weight1"
            del outs["y1"]
        return outs, tuple(res)
    raise ValueError(api)


def reference(case: Case, t: dict, masks, copy):
    """The reference on ``copy(tensor)`` of every input; returns the outs dict like call_fused."""
    c = {k: (copy(v) if v is not None else None) for k, v in t.items()}
    x = c["x"]
    if c["layerscale"] is not None:
        # In x0's dtype, as a 16-bit model would hold it; the fused op's stream is in x0's dtype.
        x = (x * c["layerscale"]).to(x.dtype)
    ref = rms_norm_ref if case.is_rms_norm else layer_norm_ref
    mask, mask1 = masks
    res = ref(
        x, c["weight"], c["bias"], residual=c["residual"], x1=c["x1"], weight1=c["weight1"],
        bias1=c["bias1"], eps=case.eps, dropout_p=case.dropout_p, rowscale=c["rowscale"],
        prenorm=True, zero_centered_weight=case.zero_centered_weight, dropout_mask=mask,
        dropout_mask1=mask1, upcast=False,
    )  # fmt: skip
    outs = {"y": res[0]}
    if case.has_w1:
        outs["y1"] = res[1]
    if case.prenorm:
        outs["residual_out"] = res[-1]
    return c, outs


def _grads(outs: dict, upstream: dict, leaves: dict) -> dict:
    names = [k for k in GRAD_NAMES if leaves.get(k) is not None]
    keys = list(outs)
    got = torch.autograd.grad(
        [outs[k] for k in keys],
        [leaves[k] for k in names],
        [upstream[k].to(outs[k].dtype) for k in keys],
        allow_unused=True,
    )
    return dict(zip(names, got))


def factor_for(case: Case, kernels: bool = True) -> float:
    """The multiplier of the baseline's error for ``case`` (module docstring)."""
    dtypes = (case.dtype, case.wdtype, case.residual_dtype, case.out_dtype)
    return 4.0 if kernels and INTERPRETED and torch.bfloat16 in dtypes else 2.0


def check_case(
    case: Case, api: str = "fn", device=DEVICE, t: Optional[dict] = None,
    used=("y", "y1", "residual_out"), kernels: bool = True,
):  # fmt: skip
    """Run ``case`` through the fused op and check every output and gradient (three-way rule).

    ``used``: the outputs that enter the loss (each with a random upstream gradient); the
    others are left unused. ``kernels=False`` when the call takes the PyTorch backend (no
    interpreter rounding). Also checks output dtypes and the masks' presence, dtype and shape.
    Returns ``(outs, grads, masks)`` of the fused op.
    """
    t = make_inputs(case, device) if t is None else t
    torch.manual_seed(case.seed)
    outs, masks = call_fused(case, t, api)
    mask, mask1 = masks
    if case.dropout_p == 0.0:
        assert mask is None and mask1 is None, "masks must be None when dropout_p == 0"
    else:
        assert mask is not None and mask.dtype == torch.bool and mask.shape == t["x"].shape
        if case.has_x1:
            assert mask1 is not None and mask1.dtype == torch.bool and mask1.shape == t["x"].shape
        else:
            assert mask1 is None, "mask1 must be None without x1"
    y_dtype = case.out_dtype or case.dtype
    for k in ("y", "y1"):
        if k in outs:
            assert outs[k].dtype == y_dtype, f"{k}: dtype {outs[k].dtype}, expected {y_dtype}"
            assert outs[k].shape == t["x"].shape
    if "residual_out" in outs:
        r = outs["residual_out"]
        assert r.dtype == case.stream_dtype, (
            f"residual_out: {r.dtype}, expected {case.stream_dtype}"
        )
        assert r.shape == t["x"].shape

    # Random upstream gradients, in x's dtype so that every precision sees the same values.
    gen = torch.Generator().manual_seed(case.seed + 1)
    upstream = {
        k: torch.randn(v.shape, generator=gen).to(case.dtype).to(device) for k, v in outs.items()
    }
    loss_outs = {k: v for k, v in outs.items() if k in used}
    kgrads = _grads(loss_outs, upstream, t)

    def fp64(v):
        return v.detach().double().requires_grad_(v.requires_grad)

    def same(v):
        return v.detach().clone().requires_grad_(v.requires_grad)

    t64, truth = reference(case, t, masks, fp64)
    tb, base = reference(case, t, masks, same)
    truth_used = {k: v for k, v in truth.items() if k in used}
    base_used = {k: v for k, v in base.items() if k in used}
    tgrads, bgrads = _grads(truth_used, upstream, t64), _grads(base_used, upstream, tb)
    factor = factor_for(case, kernels)
    working = (case.dtype, case.wdtype, case.residual_dtype)
    for k in outs:
        assert_three_way(k, outs[k], truth[k], base[k], factor, working_dtypes=working)
    for k, g in tgrads.items():
        if g is None:  # the input takes no part in the used outputs
            assert kgrads[k] is None or not kgrads[k].any(), f"grad of {k} should be zero"
            continue
        assert kgrads[k] is not None, f"grad of {k} is missing"
        assert kgrads[k].dtype == t[k].dtype, f"grad of {k}: {kgrads[k].dtype} != {t[k].dtype}"
        assert_three_way(f"grad {k}", kgrads[k], g, bgrads[k], factor, working_dtypes=working)
    return outs, kgrads, masks


class max_block_bytes:
    """Context manager: cap the forward's and the backward's block at ``value`` bytes
    (``fused_norm.config.MAX_BLOCK_BYTES``, ``BWD_MAX_BLOCK_BYTES*``, ``BWD_TILE_BYTES``),
    forcing the chunked forward, the backward's column blocks and its row-sums pre-pass; None
    leaves them alone. Restored on exit, also on failure."""

    NAMES = ("MAX_BLOCK_BYTES", "BWD_MAX_BLOCK_BYTES", "BWD_MAX_BLOCK_BYTES_MULTI",
             "BWD_TILE_BYTES")

    def __init__(self, value: Optional[int]):
        self.value = value

    def __enter__(self):
        cfg = fused_norm.config
        self.saved = {k: getattr(cfg, k) for k in self.NAMES}
        if self.value is not None:
            for k in self.saved:
                setattr(cfg, k, self.value)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(fused_norm.config, k, v)


class split_rows:
    """Context manager: split every forward row wider than ``value`` bytes into parts of
    ``value`` bytes (``fused_norm.config.FWD_SPLIT_*``), with up to 64 parts per row whatever
    the device's SM count. Restored on exit, also on failure."""

    def __init__(self, value: int):
        self.value = value

    def __enter__(self):
        cfg = fused_norm.config
        self.saved = {k: getattr(cfg, k) for k in
                      ("FWD_SPLIT_MIN_BYTES", "FWD_SPLIT_BLOCK_BYTES", "sm_count")}  # fmt: skip
        cfg.FWD_SPLIT_MIN_BYTES = cfg.FWD_SPLIT_BLOCK_BYTES = self.value
        cfg.sm_count = lambda device: 64

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(fused_norm.config, k, v)

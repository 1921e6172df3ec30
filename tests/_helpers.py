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

Where a value is a difference of much larger terms, the maximum over a few elements of the
baseline's error is no bound: PyTorch's rounding errors may happen to cancel where the kernel's
do not (small N, few rows). The norm's input gradient ``ds = r * (g - c2 - xhat * c1)`` is such
a difference (RMSNorm with N = 1: ``1 - xhat^2``), and so is LayerNorm's ``xhat`` under a mean
offset. For those (y, y1 and the gradients of x, residual, x1, layerscale, weight, weight1) the
bound gets one more term per element, ``|kernel - truth| <= 2 * max|base - truth| + atol +
roundoff``: twice a first-order bound of fp32's rounding error, a few ulps of the terms rather
than of the result (:func:`rounding_bounds` derives it).

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
import math
from typing import Optional

import torch

from fused_norm import (
    dropout_add_layer_norm,
    dropout_add_layer_norm_parallel_residual,
    dropout_add_rms_norm,
    dropout_add_rms_norm_parallel_residual,
    heuristics,
    layer_norm_fn,
    layer_norm_ref,
    rms_norm_fn,
    rms_norm_ref,
)
from fused_norm.kernels.common import CANCEL_RATIO as CANCEL_RATIO_CONSTEXPR

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL_ULPS = 4.0
INTERPRETED = heuristics.INTERPRETED  # the kernels run in Triton's CPU interpreter
CANCEL_RATIO = CANCEL_RATIO_CONSTEXPR.value  # LayerNorm's joint statistics (kernels.common)
# Names of the differentiable inputs, in the order the runner reports them.
GRAD_NAMES = ("x", "weight", "bias", "residual", "x1", "weight1", "bias1", "layerscale")

EXAMPLE_COUNTS: collections.Counter = collections.Counter()


def perturb_params(module, names=("",), scale: float = 0.1) -> None:
    """Move the parameters whose qualified name contains one of ``names`` (default: all) off
    their initial ones and zeros, where a swapped or ignored weight or bias would not show."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if any(k in name for k in names):
                p.add_(scale * torch.randn_like(p))


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
    working_dtypes=(), roundoff=None,
) -> None:  # fmt: skip
    """``|kernel - truth| <= factor * max|base - truth| + atol + roundoff`` elementwise (see
    the module docstring).

    ``truth`` is fp64; ``base`` may have another dtype than ``kernel`` (compared in fp64).
    ``working_dtypes``: the dtypes ``kernel`` was computed from; the coarsest of them and of
    kernel's own dtype sets the eps of atol. ``roundoff``: None, or a tensor of truth's shape,
    the per-element rounding-error bound of a value computed by cancellation
    (:func:`rounding_bounds`). On failure the message gives the worst element's index
    (the one furthest over its bound) and its kernel, truth and base values.
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
    if roundoff is None:
        if err_kernel <= bound:  # written so that NaN fails
            return
        flat = int(torch.nan_to_num(diff, nan=float("inf")).argmax())
    else:
        r = roundoff.detach().to(k.device, torch.float64).expand_as(k)
        excess = diff - r
        if bool((excess <= bound).all()):  # written so that NaN fails
            return
        flat = int(torch.nan_to_num(excess, nan=float("inf")).argmax())
    idx = _index(flat, k.shape)
    if roundoff is None:
        head = f"max|kernel - truth| = {err_kernel:.3e} > "
        rule = f"{factor:g} * max|base - truth| + atol = {factor:g} * {err_base:.3e} + {atol:.3e}"
    else:
        head = f"|kernel - truth| = {diff[idx].item():.3e} (max {err_kernel:.3e}) > "
        rule = (
            f"{factor:g} * max|base - truth| + atol + roundoff = {factor:g} * {err_base:.3e} "
            f"+ {atol:.3e} + {r[idx].item():.3e}"
        )
    raise AssertionError(
        f"{name} ({kernel.dtype}): {head}{rule}; worst element "
        f"{idx}: kernel {k[idx].item():.8g}, truth {t[idx].item():.8g}, "
        f"base {b[idx].item():.8g}"
    )


def assert_bitwise_equal(name: str, a, b) -> None:
    """Same dtype, shape and bytes (first differing element on failure): bit for bit, so
    -0.0 differs from 0.0 and a NaN equals the same NaN, unlike ``torch.equal``."""
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{name}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    )
    ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
    bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(ab, bb):
        flat = int((ab != bb).nonzero()[0]) // a.element_size()
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


def reference(case: Case, t: dict, masks, copy, with_stream: bool = False):
    """The reference on ``copy(tensor)`` of every input; returns ``(copies, outs)``, outs a dict
    like call_fused's, and with ``with_stream`` also the pre-norm residual stream."""
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
    return (c, outs, res[-1]) if with_stream else (c, outs)


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


# rounding_bounds' margin over its first-order bounds (second-order terms, the order in which a
# kernel happens to sum).
ROUNDOFF_SAFETY = 2.0
# Up to this many elements (rows * N * N), rounding_bounds propagates the stream's rounding
# through the exact Jacobians; wider rows take a triangle-inequality bound of them (O(N) a row).
JACOBIAN_MAX_ELEMENTS = 2**22


def rounding_bounds(case: Case, t64: dict, masks, stream, upstream: dict, used):
    """Per-element bounds of the fp32 rounding error of what depends on the normalised stream
    ``xhat``, for ``assert_three_way``'s ``roundoff``: ``(outs, grads)``, dicts keyed like
    check_case's outputs (y, y1) and inputs (x, residual, x1, layerscale, weight, weight1).

    Why. Per row, with ``d = s`` (RMSNorm) or ``s - mean(s)`` (LayerNorm) for the stream ``s``,
    ``r = 1 / sqrt(mean(d^2) + eps)``, ``xhat = d * r``, ``g = w * dy + w1 * dy1`` (zero-centred:
    ``1 + w``), ``c1 = mean(xhat * g)`` and ``c2 = mean(g)`` (LayerNorm; 0 for RMSNorm),

        ds_j = r * (g_j - c2 - xhat_j * c1)

    is a difference of terms of size ``r * |g|`` whose result can be far smaller: RMSNorm with
    N = 1 has ``ds = r * g * (1 - xhat^2) = r * g * eps / (s^2 + eps)``, and with s ~ 0.01,
    eps = 1e-6 the terms cancel to 1 %; LayerNorm with N = 2 cancels to eps's share. Any fp32
    evaluation (the kernel's, PyTorch's) then errs by ulps of the terms, not of the result, and
    2 x PyTorch's error is no bound where few elements are compared (small N, few rows) and
    PyTorch's rounding errors happen to cancel: hypothesis found N = 1 RMSNorm at 7.5e-6
    against PyTorch's 9e-7, on a gradient of 0.73 that is the difference of terms of ~43.
    Likewise ``xhat`` (so y and the weight gradients ``sum(dy * xhat)``): LayerNorm's
    ``s - mean`` rounds at the scale of ``s``, so a mean offset of k standard deviations of the row costs about k ulps of xhat;
    with N = 2 and one row (offset 10) the kernel's d(weight1) erred by 15 ulps, PyTorch's by 2.

    Bounds: first-order error analysis, each fp32 operation a relative error <= u = 2**-24,
    errors added in absolute value, every quantity at the fp64 truth; L = ceil(log2 N) for a
    tree sum over the row (tl.sum), ``q = g - c2 - 3 * xhat * c1`` (``= r * d ds / d r``).

    (A) The stream's own rounding: ``s_k`` is off by <= 4 u |s|_abs_k (the products by rowscale
        and 1 / (1 - p), the sums; ``|s|_abs`` is the stream summed from the absolute values of
        its terms). It propagates through the exact Jacobians
            d xhat_j / d s_k = r ([j == k] - c - xhat_j xhat_k / N)
            d ds_j / d s_k   = -r^2 c1 [j == k] - (r^2 / N) (q_j xhat_k + xhat_j g'_k - c c1 N)
        (LayerNorm: c = 1 / N and g' = g - c2, the centring; RMSNorm: c = 0, g' = g) as
        sum_k |J_jk| 4 u |s|_abs_k. Exactly, not term by term: for N = 1 RMSNorm
        d ds / d s = -3 r xhat ds shrinks with ds, where bounding r's and xhat's errors apart
        would charge every rounding of s with the full cancellation.
    (B) The arithmetic on that s:
        r                 relative e_r = ((L + 2) u var + u (var + eps)) / (2 (var + eps)) + 3 u
                          (squares, tree sum, / N, + eps, sqrt and division with room for GPU
                          approximations): |xhat_j| e_r on xhat, r |q_j| e_r on ds
        LayerNorm's mean  (L + 1) u mean|s|, shifting every d_k: r on xhat,
                          r^2 |c1 + xhat_j c2| on ds
        LayerNorm's d     u (|s_k| + |mean|) on each d_k, in whatever order it is formed:
                          sum_k |J_jk| times it (the Jacobians above with c = 0, g' = g)
        xhat = d * r      u |xhat_k|: u |xhat_j| on xhat, r u |xhat_j| (|c1| + mean(|xhat| G))
                          on ds
        g (ds only)       3 u G_k, G = |w * dy| + |w1 * dy1| (1 + w, two products, a sum):
                          3 u r (G_j + mean(G) (LayerNorm) + |xhat_j| mean(|xhat| G))
        c1's, c2's sums   (L + 2) u r |xhat_j| mean(|xhat| G), (L + 1) u r mean(G)
        the product xhat_j c1, two subtractions and the product with r:
                          u r (|xhat_j c1| + 2 (G_j + |xhat_j c1| + |c2|)) + u |ds_j|
    From xhat's bound e_xhat: y gets |w| e_xhat (y1 |w1| e_xhat), d(weight) sum over rows of
    |dy| e_xhat (d(weight1) with dy1); their own last roundings (the product with w, + b, the
    sum over rows) are ulps of the result or of a sum that does not cancel here: atol's share.
    Input gradients are ``ds`` times the stream's linear coefficients (rowscale, dropout's
    1/(1-p), layerscale; a row sum for layerscale's own gradient): the bound follows them
    through autograd of the reference's stream on absolute values. Biases get none.

    Each allowance is ROUNDOFF_SAFETY = 2 times (A) + (B). Measured with the CPU interpreter on
    fp32 streams and values, prenorm aside (its upstream add is atol's), over 700 hypothesis
    examples (300 fp32 cases with N <= 4, scale 0.01 and eps <= 1e-5, i.e. heavy cancellation;
    250 drawn as test_fn_matches_reference draws them; 150 with chunked rows): the kernel's
    errors in y, ds and d(weight) stayed below 0.25 of (A) + (B), PyTorch's (fp32 throughout)
    below 0.85. Beside cancelling terms the bounds are a few ulps of ``r * |g|`` (of ``|w|``
    for y), so a wrong formula, whose error is of the order of those scales themselves, stays
    visible; outside cancellation they are a few times atol (fp32: some 1e-5 of the value).

    Precision: fp32's, the kernels' (and PyTorch's baseline on fp32 inputs). A 16-bit stream is
    a perturbation of the inputs that kernel and baseline share (the kernel normalises the stream
    as stored, PyTorch rounds it the same way), so the factor on the baseline's error covers it;
    a 16-bit output's rounding on store is one ulp of the result, atol's share, as is the
    prenorm upstream ``d residual_out`` added after the cancellation. Charging the 16-bit eps here
    would let statistics of a 16-bit stream taken from the unrounded sum pass
    (``test_stream_rounding_regressions``).
    """
    u = 2.0**-24
    n = stream.shape[-1]
    big_l = math.ceil(math.log2(n)) if n > 1 else 0
    layer_norm = not case.is_rms_norm

    def mean(v):
        return v.mean(-1, keepdim=True)

    def total(v):
        return v.sum(-1, keepdim=True)

    # The stream on absolute values, differentiable for the propagation to the leaves below.
    def absolute(v):
        return v.detach().double().abs().requires_grad_(v.requires_grad)

    tabs, _, s_abs = reference(case, t64, masks, absolute, with_stream=True)
    s = stream.detach().double()
    dys, weights = {}, {}
    g = torch.zeros_like(s)
    g_abs = torch.zeros_like(s)
    for out, wname in (("y", "weight"), ("y1", "weight1")):
        if t64.get(wname) is None:
            continue
        w = t64[wname].detach().double() + (1.0 if case.zero_centered_weight else 0.0)
        weights[out] = w
        if out in used and out in upstream:
            dys[wname] = upstream[out].to(s.device, torch.float64)
            g, g_abs = g + w * dys[wname], g_abs + (w * dys[wname]).abs()

    c2 = mean(g) if layer_norm else torch.zeros_like(mean(g))
    d = s - mean(s) if layer_norm else s
    var = mean(d * d)
    r = torch.rsqrt(var + case.eps)
    xhat = d * r
    x_abs = xhat.abs()
    c1 = mean(xhat * g)
    q = g - c2 - 3 * xhat * c1
    ds = r * (g - c2 - xhat * c1)
    exact = s.numel() * n <= JACOBIAN_MAX_ELEMENTS

    def times_abs(diag, rows, cols, const, delta):
        """sum_k |J_jk| delta_k for J = diag(diag) + sum_i rows_i[j] cols_i[k] + const."""
        if exact:
            jac = const[..., None] + torch.diag_embed(diag.expand_as(s))
            for a, b in zip(rows, cols):
                jac = jac + a[..., :, None] * b[..., None, :]
            return (jac.abs() @ delta[..., None])[..., 0]
        full = diag + const + sum(a * b for a, b in zip(rows, cols))  # J_jj, exact
        off = const.abs() * (total(delta) - delta)
        for a, b in zip(rows, cols):
            off = off + a.abs() * (total(b.abs() * delta) - b.abs() * delta)
        return full.abs() * delta + off

    zero = torch.zeros_like(c1)

    def xhat_times(delta, centred):  # sum_k |d xhat_j / d s_k| delta_k (or / d d_k)
        c = 1.0 / n if centred else 0.0
        return times_abs(r.expand_as(s), [-r * xhat / n], [xhat], -r * c + zero, delta)

    def ds_times(delta, centred):  # sum_k |d ds_j / d s_k| delta_k (or / d d_k)
        r2n = r * r / n
        gk = g - c2 if centred else g
        const = r2n * c1 if centred else zero
        return times_abs(-r * r * c1, [-r2n * q, -r2n * xhat], [xhat, gk], const, delta)

    err_s = 4 * u * s_abs.detach()
    err_var = (big_l + 2) * u * var
    if layer_norm:
        # The kernels take LayerNorm's M2 as sum(s^2) - sum(s) * mean (one joint sum) where
        # sum(s^2) <= CANCEL_RATIO * M2 over the columns they hold (kernels._cancels), else as
        # sum((s - mean)^2): the joint form errs by (L + 2) u mean(s^2) (squares, tree sum,
        # the subtraction) + (2 L + 3) u |mean| mean|s| (the sum, / N, its product), at most
        # CANCEL_RATIO (3 L + 5) u var where it is taken (|mean| mean|s| <= mean(s^2)).
        joint = (big_l + 2) * u * mean(s * s)
        joint = joint + (2 * big_l + 3) * u * mean(s).abs() * mean(s.abs())
        err_var = err_var + torch.minimum(joint, CANCEL_RATIO * (3 * big_l + 5) * u * var)
    err_r = (err_var + u * (var + case.eps)) / (2 * (var + case.eps)) + 3 * u
    err_x = xhat_times(err_s, layer_norm) + x_abs * (err_r + u)  # (A), r, xhat = d * r
    err_ds = ds_times(err_s, layer_norm) + err_r * r * q.abs()
    if layer_norm:
        err_mu = (big_l + 1) * u * mean(s.abs())
        err_d = u * (s.abs() + mean(s).abs())
        err_x = err_x + r * err_mu + xhat_times(err_d, False)
        err_ds = err_ds + r * r * (c1 + xhat * c2).abs() * err_mu + ds_times(err_d, False)
    m_xg = mean(x_abs * g_abs)
    err_ds = err_ds + r * u * x_abs * (c1.abs() + m_xg)
    err_ds = err_ds + 3 * u * r * (g_abs + (mean(g_abs) if layer_norm else 0.0) + x_abs * m_xg)
    err_ds = err_ds + (big_l + 2) * u * r * x_abs * m_xg
    if layer_norm:
        err_ds = err_ds + (big_l + 1) * u * r * mean(g_abs)
    xc1 = (xhat * c1).abs()
    err_ds = err_ds + u * r * (xc1 + 2 * (g_abs + xc1 + c2.abs())) + u * ds.abs()

    outs = {k: ROUNDOFF_SAFETY * w.abs() * err_x for k, w in weights.items()}
    grads = {k: ROUNDOFF_SAFETY * (dy.abs() * err_x).reshape(-1, n).sum(0)
             for k, dy in dys.items()}  # fmt: skip
    # ds through the stream's linear map to its leaves: autograd of the stream on absolute
    # values (same masks) gives sum |coefficient| * bound per leaf.
    names = [k for k in ("x", "residual", "x1", "layerscale") if tabs.get(k) is not None
             and tabs[k].requires_grad]  # fmt: skip
    got = torch.autograd.grad(s_abs, [tabs[k] for k in names], ROUNDOFF_SAFETY * err_ds,
                              allow_unused=True)  # fmt: skip
    grads.update({k: v for k, v in zip(names, got) if v is not None})
    return outs, grads


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

    t64, truth, stream = reference(case, t, masks, fp64, with_stream=True)
    tb, base = reference(case, t, masks, same)
    truth_used = {k: v for k, v in truth.items() if k in used}
    base_used = {k: v for k, v in base.items() if k in used}
    tgrads, bgrads = _grads(truth_used, upstream, t64), _grads(base_used, upstream, tb)
    out_roundoff, grad_roundoff = rounding_bounds(case, t64, masks, stream, upstream, used)
    factor = factor_for(case, kernels)
    working = (case.dtype, case.wdtype, case.residual_dtype)
    for k in outs:
        assert_three_way(k, outs[k], truth[k], base[k], factor, working_dtypes=working,
                         roundoff=out_roundoff.get(k))  # fmt: skip
    for k, g in tgrads.items():
        if g is None:  # the input takes no part in the used outputs
            assert kgrads[k] is None or not kgrads[k].any(), f"grad of {k} should be zero"
            continue
        assert kgrads[k] is not None, f"grad of {k} is missing"
        assert kgrads[k].dtype == t[k].dtype, f"grad of {k}: {kgrads[k].dtype} != {t[k].dtype}"
        assert_three_way(f"grad {k}", kgrads[k], g, bgrads[k], factor, working_dtypes=working,
                         roundoff=grad_roundoff.get(k))  # fmt: skip
    return outs, kgrads, masks


class patched:
    """Context manager: set attributes of ``module`` (keyword arguments; default
    ``fused_norm.heuristics``, the launch rules) and restore them on exit, also on failure. The
    plans and call signatures made so far are forgotten on entry and on exit
    (``ops.clear_plans``), so that the calls inside are planned under the patched rules and
    those after under the restored ones."""

    def __init__(self, module=None, **values):
        self.module = heuristics if module is None else module
        self.values = values

    def __enter__(self):
        self.saved = {k: getattr(self.module, k) for k in self.values}
        for k, v in self.values.items():
            setattr(self.module, k, v)
        _clear_plans()
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(self.module, k, v)
        _clear_plans()


def _clear_plans() -> None:
    from fused_norm import ops

    ops.clear_plans()


def patched_config(**values) -> patched:
    """``patched`` on ``fused_norm.heuristics`` (the launch rules' constants and functions)."""
    return patched(heuristics, **values)


def max_block_bytes(value: Optional[int]) -> patched:
    """Cap the forward's block at ``value`` bytes (``heuristics.MAX_BLOCK_BYTES``: chunked
    rows), and the backward's at ``value`` bytes of 16-bit columns (``BWD_BLOCK_BYTES``,
    ``BWD_BLOCK_BYTES_MULTI``: column blocks), the exchanging column blocks', the pre-pass
    path's column blocks and the row-sums pre-pass's chunks likewise (``EXCHANGE_BLOCK_BYTES``,
    ``PREPASS_BLOCK_BYTES``, ``SUMS_BLOCK_BYTES``). Whether wide backward rows exchange their
    row sums or take the pre-pass is ``heuristics.EXCHANGE``'s (patch it beside). None leaves
    the rules alone."""
    names = ("MAX_BLOCK_BYTES", "BWD_BLOCK_BYTES", "BWD_BLOCK_BYTES_MULTI",
             "EXCHANGE_BLOCK_BYTES", "PREPASS_BLOCK_BYTES", "SUMS_BLOCK_BYTES")  # fmt: skip
    return patched_config(**({} if value is None else dict.fromkeys(names, value)))


def split_rows(value: int) -> patched:
    """Split every forward row wider than ``value`` bytes into parts of ``value`` bytes
    (``heuristics.SPLIT_MIN_BYTES``, ``SPLIT_PART_BYTES``), with up to 64 parts per row
    whatever the device's SM count (``FALLBACK_SMS``, the interpreter's bound on the parts)."""
    return patched_config(SPLIT_MIN_BYTES=value, SPLIT_PART_BYTES=value, FALLBACK_SMS=64)


def few_programs(count: int) -> patched:
    """At most ``count`` backward programs (``heuristics.programs``), so that each owns several
    rows: on the CPU the fallback SM count gives a program per row to the few rows the tests
    draw."""
    return patched_config(programs=lambda d, plan, m, resident=0: max(min(count, m), 1))


def one_row_per_program() -> patched:
    """No tiles of narrow rows (``FWD_TILE_ROWS``, ``BWD_TILE_ROWS``): the forward and
    backward take one row at a time, as they do for rows wider than the tiles' widths."""
    return patched_config(FWD_TILE_ROWS=1, BWD_TILE_ROWS=1)


def tail_blocks(value) -> patched:
    """Set ``heuristics.TAILS`` (one-block rows whose width is not a power of two held as two
    blocks: True wherever that is narrower than the padded block, False never, "measured"
    where measured to pay). With True the forward also takes one row per program: a tile of
    several narrow rows keeps one block, and these widths are all narrow."""
    if value is True:
        return patched_config(TAILS=True, FWD_TILE_ROWS=1)
    return patched_config(TAILS=value)


def tuned_overrides(fwd=None, bwd=None) -> patched:
    """Every plan made inside takes these entries as if the device's tuned table held them for
    its row (``heuristics.tuned``): ``fwd`` / ``bwd`` a dict of overrides (e.g. ``{"warps": 4}``,
    ``{"full_row": False}``), or a callable ``(kinds, tags, widths) -> dict``, merged over the
    table's own entry. A way to force the kernels' code paths that the rules leave to the
    tables."""
    original = heuristics.tuned
    extra = {"fwd": fwd, "bwd": bwd}

    def tuned(d, direction, kinds, tags, widths):
        own = dict(original(d, direction, kinds, tags, widths))
        more = extra[direction]
        if callable(more):
            more = more(kinds, tags, widths)
        own.update(more or {})
        return own

    return patched_config(tuned=tuned)


def split_constexprs(**values) -> patched:
    """Every split forward plan (rows over several programs) made inside takes these
    constexprs (e.g. ``HOLD=1``) over the rules' own: a way to force a code path of the split
    rows whatever the rules and tables choose. The caller keeps them valid for its rows."""
    original = heuristics.forward_plan

    def forward_plan(d, row):
        plan = original(d, row)
        if plan.split > 1:
            plan = plan._replace(constexprs=dict(plan.constexprs, **values))
        return plan

    return patched_config(forward_plan=forward_plan)


# ----------------------------------------------------------------------------------------------
# Fresh memory: a kernel must never read what it (or the host) did not write
# ----------------------------------------------------------------------------------------------

# What poisoned_allocations writes into a fresh tensor, by kind: NaN in floats (it reaches any
# output it touches), a byte pattern in integers (seeds, exchange words), True in bools (masks).
_POISON_INT_BYTE = 0x5A


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    # 0x5A in every byte: positive in every integer dtype
    return t.fill_(int.from_bytes(bytes([_POISON_INT_BYTE]) * t.element_size(), "little"))


class poisoned_allocations:
    """Context manager: every tensor from ``torch.empty`` / ``torch.empty_like`` (the package's
    own allocations: outputs, statistics, seeds, partial gradients, row sums) comes filled,
    with zeros (``poison=False``) or with NaN / 0x5A bytes / True (``poison=True``). Outputs
    that differ between the two reveal a read of memory nobody wrote, which fresh memory (often
    zeros) would hide. Restored on exit, also on failure."""

    def __init__(self, poison: bool):
        self.poison = poison

    def __enter__(self):
        self.saved = torch.empty, torch.empty_like
        empty, empty_like = self.saved
        fill = _poison if self.poison else (lambda t: t.zero_())

        def poisoned_empty(*args, **kwargs):
            return fill(empty(*args, **kwargs))

        def poisoned_empty_like(*args, **kwargs):
            return fill(empty_like(*args, **kwargs))

        torch.empty, torch.empty_like = poisoned_empty, poisoned_empty_like
        return self

    def __exit__(self, *exc):
        torch.empty, torch.empty_like = self.saved


def run_filled(case: Case, t: dict, poison: bool, api: str = "fn") -> dict:
    """Forward and backward of ``case`` on inputs ``t`` with fresh allocations filled
    (poisoned_allocations); returns every output, mask and gradient by name. The dropout
    masks come from ``case.seed`` (the same in every run)."""
    leaves = {k: v for k, v in t.items() if k in GRAD_NAMES and v is not None}
    with poisoned_allocations(poison):
        torch.manual_seed(case.seed)
        outs, masks = call_fused(case, t, api)
        gen = torch.Generator().manual_seed(case.seed + 1)
        upstream = {
            k: torch.randn(v.shape, generator=gen).to(v.dtype).to(v.device) for k, v in outs.items()
        }
        grads = _grads(outs, upstream, leaves)
    got = {k: v.detach() for k, v in outs.items()}
    got.update({f"mask{i}": m for i, m in enumerate(masks) if m is not None})
    got.update({f"grad {k}": g for k, g in grads.items() if g is not None})
    return got


def assert_fresh_memory_unread(case: Case, t: dict, api: str = "fn") -> None:
    """run_filled twice, fresh allocations zeroed then poisoned: every output, mask and
    gradient bitwise the same (no kernel read memory that nothing wrote)."""
    zeros = run_filled(case, t, poison=False, api=api)
    poisoned = run_filled(case, t, poison=True, api=api)
    assert zeros.keys() == poisoned.keys()
    for k in zeros:
        assert_bitwise_equal(k, zeros[k], poisoned[k])

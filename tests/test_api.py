"""The functional API's contract (API.md): return conventions of the new and legacy entry points,
caller buffers, empty and non-contiguous inputs, unused outputs, determinism, bad inputs and
backend selection.

Numerics are the business of test_kernels.py; here the shapes are small and explicit.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from _helpers import (
    DEVICE,
    Case,
    call_fused,
    check_case,
    few_programs,
    make_inputs,
    max_block_bytes,
)

import fused_norm
from fused_norm import (
    dropout_add_layer_norm,
    dropout_add_layer_norm_parallel_residual,
    dropout_add_rms_norm,
    dropout_add_rms_norm_parallel_residual,
    layer_norm_fn,
    layer_norm_ref,
    rms_norm_fn,
)


@pytest.fixture(params=["auto", "torch"])
def backend(request, monkeypatch):
    """Both backends: "auto" runs the kernels (interpreted on CPU), "torch" the PyTorch path."""
    monkeypatch.setenv("FUSED_NORM_BACKEND", request.param)
    return request.param


def _inputs(shape=(2, 3, 16), dtype=torch.float32, device=DEVICE, grad=False):
    n = shape[-1]

    def r(*s):
        return torch.randn(*s, device=device, dtype=dtype).requires_grad_(grad)

    return dict(x=r(*shape), weight=r(n), bias=r(n), residual=r(*shape), x1=r(*shape),
                weight1=r(n), bias1=r(n))  # fmt: skip


def _flat(out):
    return out if isinstance(out, tuple) else (out,)


# ----------------------------------------------------------------------------------------------
# Return conventions
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [layer_norm_fn, rms_norm_fn], ids=["layer_norm_fn", "rms_norm_fn"])
def test_return_structure(fn, backend, device):
    """y, y1 (with weight1), residual_out (with prenorm), then (mask, mask1) with
    return_dropout_mask; a single y bare. Masks: bool, shaped like x, None when p == 0, mask1
    None without x1."""
    t = _inputs(device=device)
    shape = t["x"].shape
    for has_w1, prenorm, ret_mask, p, has_x1 in itertools.product([False, True], repeat=5):
        p = 0.25 if p else 0.0
        out = fn(
            t["x"], t["weight"], t["bias"], residual=t["residual"],
            x1=t["x1"] if has_x1 else None, weight1=t["weight1"] if has_w1 else None,
            dropout_p=p, prenorm=prenorm, return_dropout_mask=ret_mask,
        )  # fmt: skip
        what = (
            f"weight1={has_w1} prenorm={prenorm} return_dropout_mask={ret_mask} p={p} x1={has_x1}"
        )
        n_out = 1 + has_w1 + prenorm + 2 * ret_mask
        if n_out == 1:
            assert isinstance(out, torch.Tensor), f"{what}: expected a bare tensor"
        else:
            assert isinstance(out, tuple) and len(out) == n_out, f"{what}: got {type(out)}"
        out = list(_flat(out))
        for _ in range(1 + has_w1):  # y, y1
            y = out.pop(0)
            assert isinstance(y, torch.Tensor) and y.shape == shape and y.dtype == t["x"].dtype
        if prenorm:
            r = out.pop(0)
            assert isinstance(r, torch.Tensor) and r.shape == shape, what
        if ret_mask:
            mask, mask1 = out
            if p == 0.0:
                assert mask is None and mask1 is None, f"{what}: masks must be None when p == 0"
            else:
                assert mask.dtype == torch.bool and mask.shape == shape, what
                if has_x1:
                    assert mask1.dtype == torch.bool and mask1.shape == shape, what
                else:
                    assert mask1 is None, f"{what}: mask1 must be None without x1"


@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_legacy_return_structure(rms, backend, device):
    """dropout_add_*: out, (out, residual_out) with prenorm, then the mask with
    return_dropout_mask; the parallel variants return (out0, out1[, residual_out][, m0, m1])."""
    t = _inputs(device=device)
    shape = t["x"].shape
    fn = dropout_add_rms_norm if rms else dropout_add_layer_norm
    par = (
        dropout_add_rms_norm_parallel_residual if rms else dropout_add_layer_norm_parallel_residual
    )
    for prenorm, ret_mask, p in itertools.product([False, True], [False, True], [0.0, 0.2]):
        out = fn(t["x"], t["residual"], t["weight"], t["bias"], p, 1e-5, prenorm=prenorm,
                 return_dropout_mask=ret_mask)  # fmt: skip
        out = _flat(out)
        assert len(out) == 1 + prenorm + ret_mask
        assert all(o.shape == shape for o in out[: 1 + prenorm])
        if ret_mask:
            assert (out[-1] is None) == (p == 0.0)
            if p:
                assert out[-1].dtype == torch.bool and out[-1].shape == shape
        for w1 in (t["weight1"], None):
            b1 = t["bias1"] if w1 is not None else None
            out = par(t["x"], t["x1"], t["residual"], t["weight"], t["bias"], w1, b1, p, 1e-5,
                      prenorm=prenorm, return_dropout_mask=ret_mask)  # fmt: skip
            assert isinstance(out, tuple) and len(out) == 2 + prenorm + 2 * ret_mask
            assert out[0].shape == shape
            assert (out[1] is None) == (w1 is None), "out1 is None exactly when weight1 is None"
            if ret_mask:
                for m in out[-2:]:
                    assert (m is None) == (p == 0.0)


def test_rms_norm_fn_is_layer_norm_fn_with_is_rms_norm(device):
    t = _inputs(device=device)
    a = rms_norm_fn(t["x"], t["weight"], t["bias"], residual=t["residual"], prenorm=True)
    b = layer_norm_fn(t["x"], t["weight"], t["bias"], residual=t["residual"], prenorm=True,
                      is_rms_norm=True)  # fmt: skip
    for u, v in zip(a, b):
        assert torch.equal(u, v)


# ----------------------------------------------------------------------------------------------
# Caller buffers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_out_buffers_written_and_returned(out_dtype, backend, device):
    """out= and residual_out= are written and returned as the same objects, with the values of
    a call without buffers; row-strided views into wider tensors leave the rest untouched."""
    dtype = torch.float16
    t = _inputs((5, 24), dtype=dtype, device=device)
    kw = dict(residual=t["residual"], prenorm=True, residual_in_fp32=True, out_dtype=out_dtype)
    y_ref, r_ref = layer_norm_fn(t["x"], t["weight"], t["bias"], **kw)
    out_big = torch.full((5, 40), 7.0, device=device, dtype=out_dtype or dtype)
    res_big = torch.full((5, 40), 7.0, device=device, dtype=torch.float16)
    out, res_out = out_big[:, 8:32], res_big[:, :24]  # the residual's dtype beats fp32
    y, r = layer_norm_fn(t["x"], t["weight"], t["bias"], out=out, residual_out=res_out, **kw)
    assert y is out and r is res_out
    assert torch.equal(y, y_ref) and torch.equal(r, r_ref)
    assert bool((out_big[:, :8] == 7).all() and (out_big[:, 32:] == 7).all()), "wrote outside out"
    assert bool((res_big[:, 24:] == 7).all()), "wrote outside residual_out"


def test_out_buffers_with_autograd(backend, device):
    """Gradients through a call that writes into caller buffers equal those without."""
    t = _inputs((2, 3, 16), device=device, grad=True)
    kw = dict(residual=t["residual"], prenorm=True)
    dy, dr = torch.randn(2, 3, 16, device=device), torch.randn(2, 3, 16, device=device)
    leaves = [t["x"], t["weight"], t["bias"], t["residual"]]

    def grads(**bufs):
        y, r = layer_norm_fn(t["x"], t["weight"], t["bias"], **kw, **bufs)
        return torch.autograd.grad([y, r], leaves, [dy, dr])

    out, res = torch.empty(2, 3, 16, device=device), torch.empty(2, 3, 16, device=device)
    for a, b in zip(grads(), grads(out=out, residual_out=res)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# Empty, non-contiguous, unused outputs, determinism
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16)], ids=["0xN", "2x0xN"])
def test_zero_rows(shape, backend, device):
    """0 rows: empty outputs of the right shapes and dtypes, zero parameter gradients."""
    t = _inputs(shape, device=device, grad=True)
    y, y1, r, m, m1 = layer_norm_fn(
        t["x"], t["weight"], t["bias"], residual=t["residual"], x1=t["x1"],
        weight1=t["weight1"], bias1=t["bias1"], dropout_p=0.1, prenorm=True,
        residual_in_fp32=True, return_dropout_mask=True,
    )  # fmt: skip
    for o in (y, y1, r, m, m1):
        assert o.shape == shape
    (y.sum() + y1.sum() + r.sum()).backward()
    for k in ("weight", "bias", "weight1", "bias1"):
        g = t[k].grad
        assert g is not None and g.shape == (16,) and not g.any(), f"grad of {k}: {g}"
    for k in ("x", "residual", "x1"):
        assert t[k].grad is not None and t[k].grad.shape == shape


def _strided(kind, device):
    """A non-contiguous (6, 40) tensor (or (2, 3, 40) for "3d-permuted")."""
    m, n = 6, 40
    if kind == "transposed":
        t = torch.randn(n, m, device=device).t()
    elif kind == "col-stride-2":
        t = torch.randn(m, 2 * n, device=device)[:, ::2]
    elif kind == "row-slice":
        t = torch.randn(m, n + 13, device=device)[:, 5 : 5 + n]
    elif kind == "3d-permuted":
        t = torch.randn(3, 2, n, device=device).transpose(0, 1)
    else:
        raise ValueError(kind)
    assert not t.is_contiguous()
    return t


@pytest.mark.parametrize("kind", ["transposed", "col-stride-2", "row-slice", "3d-permuted"])
def test_non_contiguous_inputs(kind, backend, device):
    """Strided x, residual, x1 and upstream grads give the results of contiguous copies."""
    strided = [_strided(kind, device) for _ in range(3)]
    n = strided[0].shape[-1]
    w, b = torch.randn(n, device=device), torch.randn(n, device=device)
    dy = torch.randn(n, device=device).expand(strided[0].shape)  # stride-0 rows
    dres = _strided(kind, device)
    results = []
    for contiguous in (False, True):
        x, r, x1 = (v.contiguous() if contiguous else v for v in strided)
        leaves = [v.detach().requires_grad_() for v in (x, r, x1, w, b)]
        if not contiguous:  # detach() keeps the strides
            assert not leaves[0].is_contiguous()
        torch.manual_seed(3)
        # Dropout too on the kernels (per-row seeds); the PyTorch path's masks follow the
        # memory layout (test_dropout.py::test_mask_independent_of_memory_layout).
        p = 0.2 if backend == "auto" else 0.0
        y, res = layer_norm_fn(leaves[0], leaves[3], leaves[4], residual=leaves[1], x1=leaves[2],
                               dropout_p=p, prenorm=True)  # fmt: skip
        ups = [dy.contiguous(), dres.contiguous()] if contiguous else [dy, dres]
        results.append((y, res, *torch.autograd.grad([y, res], leaves, ups)))
    for name, a, c in zip(("y", "res", "dx", "dres", "dx1", "dw", "db"), *results):
        if backend == "torch":  # PyTorch's own kernels may reduce strided inputs in another order
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=name)
        else:  # the launchers copy or index by stride; the row arithmetic is the same
            assert torch.equal(a, c), f"{name}: strided and contiguous inputs differ"


@pytest.mark.parametrize("which", ["weight", "bias", "weight1", "bias1"])
@pytest.mark.parametrize("kind", ["stride-2", "expanded"])
def test_non_contiguous_parameters(which, kind, backend, device):
    """A strided (N,) parameter (a slice, or a scalar expanded to N) is used by value."""
    t = _inputs((3, 16), device=device)
    base = t[which]
    t[which] = (
        torch.stack([base, torch.full_like(base, 99.0)], 1).reshape(-1)[::2]
        if kind == "stride-2" else base[:1].expand(16)
    )  # fmt: skip
    assert not t[which].is_contiguous()
    dense = {k: v.contiguous() if v is not None else None for k, v in t.items()}
    args = ("x", "weight", "bias")
    kw = dict(residual=t["residual"], x1=t["x1"], prenorm=True)
    a = layer_norm_fn(*(t[k] for k in args), weight1=t["weight1"], bias1=t["bias1"], **kw)
    c = layer_norm_fn(*(dense[k] for k in args), weight1=dense["weight1"], bias1=dense["bias1"],
                      **kw)  # fmt: skip
    for name, u, v in zip(("y", "y1", "residual_out"), a, c):
        assert torch.equal(u, v), f"{name} differs with a non-contiguous {which} ({kind})"


@pytest.mark.parametrize("used", [("y",), ("residual_out",), ("y1",)])
def test_unused_outputs(used, device):
    """Gradients when only some outputs enter the loss (prenorm=True, weight1 given)."""
    case = Case(shape=(5, 24), residual_dtype=torch.float32, has_x1=True, has_w1=True,
                has_b1=True, dropout_p=0.1, prenorm=True, seed=11)  # fmt: skip
    check_case(case, "fn", device=device, used=used)


@pytest.mark.parametrize("block_bytes", [None, 64], ids=["one-block", "chunked"])
def test_backward_deterministic(block_bytes, device):
    """Two backward passes (and two full runs under one seed) are bitwise equal; three
    backward programs for 37 rows, so each program reduces several rows."""
    case = Case(shape=(37, 48), residual_dtype=torch.float32, has_x1=True, has_w1=True,
                has_b1=True, rowscale=True, dropout_p=0.1, prenorm=True, seed=5)  # fmt: skip
    t = make_inputs(case, device)
    leaves = [v for k, v in t.items() if v is not None and v.requires_grad]
    with max_block_bytes(block_bytes), few_programs(3):
        runs = []
        for _ in range(2):
            torch.manual_seed(0)
            outs, masks = call_fused(case, t)
            ups = [torch.ones_like(v).normal_() for v in outs.values()]
            g1 = torch.autograd.grad(list(outs.values()), leaves, ups, retain_graph=True)
            g2 = torch.autograd.grad(list(outs.values()), leaves, ups)
            for a, b in zip(g1, g2):
                assert torch.equal(a, b), "two backward passes of one graph differ"
            runs.append((*outs.values(), *masks, *g1))
        for a, b in zip(*runs):
            assert (a is None and b is None) or torch.equal(a, b), "two seeded runs differ"


@pytest.mark.parametrize("second", ["residual", "x1"])
def test_gradient_accumulation(second, backend, device):
    """Two backward passes into the same leaves accumulate to twice one pass's gradients
    (micro-batching); x's and the residual's (or x1's) gradients are numerically equal here,
    which must not make their .grad tensors share storage."""
    t = _inputs((4, 16), device=device, grad=True)
    dy = torch.randn(4, 16, device=device)
    leaves = (t["x"], t[second], t["weight"], t["bias"])

    def step():
        y = layer_norm_fn(t["x"], t["weight"], t["bias"], **{second: t[second]})
        y.backward(dy)

    step()
    once = [v.grad.clone() for v in leaves]
    step()
    for name, v, g in zip(("x", second, "weight", "bias"), leaves, once):
        torch.testing.assert_close(v.grad, 2 * g, msg=f"accumulated grad of {name}")


def test_grads_of_x_and_residual_are_separate_tensors(device):
    """Where d(residual) equals d(x) numerically the two .grad tensors must still not alias:
    an in-place update of one must leave the other alone."""
    t = _inputs((4, 16), device=device, grad=True)
    y = layer_norm_fn(t["x"], t["weight"], t["bias"], residual=t["residual"], x1=t["x1"])
    y.backward(torch.randn_like(y))
    gx = t["x"].grad.clone()
    t["residual"].grad.zero_()
    t["x1"].grad.mul_(2)
    assert torch.equal(t["x"].grad, gx), "x.grad aliases residual.grad or x1.grad"


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(residual=True, prenorm=True, residual_in_fp32=True),
     dict(residual=True, dropout_p=0.2, return_dropout_mask=True),
     dict(x1=True, weight1=True, dropout_p=0.1, prenorm=True, rowscale=True),
     dict(residual=True, is_rms_norm=True, zero_centered_weight=True)],
    ids=["plain", "prenorm-fp32-stream", "dropout-masks", "x1-w1-rowscale", "rms-zcw"],
)  # fmt: skip
@pytest.mark.parametrize("how", ["no_grad", "no_requires_grad"])
def test_no_graph_forward_matches_autograd_forward(kw, how, device, monkeypatch):
    """Without an autograd graph to record (torch.no_grad, or no input requiring grad) the
    kernels run without the autograd Function: same outputs bitwise (same dropout masks from
    the same seed), since reentrant activation checkpointing runs one and then the other."""
    from fused_norm import functional

    t = _inputs((3, 5, 40), dtype=torch.bfloat16, device=device, grad=True)
    rowscale = torch.rand(3, 5, device=device) + 0.5

    def call(grad_inputs):
        args = {k: v if grad_inputs else v.detach() for k, v in t.items()}
        extra = {k: v for k, v in kw.items() if k not in ("residual", "x1", "weight1", "rowscale")}
        torch.manual_seed(3)
        return _flat(layer_norm_fn(
            args["x"], args["weight"], args["bias"],
            residual=args["residual"] if kw.get("residual") else None,
            x1=args["x1"] if kw.get("x1") else None,
            weight1=args["weight1"] if kw.get("weight1") else None,
            rowscale=rowscale if kw.get("rowscale") else None, **extra,
        ))  # fmt: skip

    want = call(True)
    assert want[0].grad_fn is not None
    monkeypatch.setattr(functional._FusedNorm, "apply", None)  # the Function must not be used
    if how == "no_grad":
        with torch.no_grad():
            got = call(True)
    else:
        got = call(False)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if b is None:  # mask1 without x1
            assert a is None
            continue
        assert a.grad_fn is None and not a.requires_grad
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b.detach()), "the no-graph forward differs from the autograd one"


# ----------------------------------------------------------------------------------------------
# Errors: every bad input of API.md gives a TypeError/ValueError naming the argument, and
# nothing is written.
# ----------------------------------------------------------------------------------------------

N = 8


def _good(device):
    g = _inputs((3, 4, N), device=device)
    g.update(rowscale=torch.rand(3, 4, device=device) + 0.5, eps=1e-5, dropout_p=0.1,
             prenorm=True, out_dtype=None,
             out=torch.full((3, 4, N), 7.0, device=device),
             residual_out=torch.full((3, 4, N), 7.0, device=device))  # fmt: skip
    return g


def _bad(**kw):
    return kw


BAD_INPUTS = [
    ("x", TypeError, _bad(x=[[1.0] * N])),
    ("x", TypeError, _bad(x=lambda d: torch.ones(3, 4, N, dtype=torch.int32, device=d))),
    ("x", TypeError, _bad(x=lambda d: torch.ones(3, 4, N, dtype=torch.bool, device=d))),
    ("x", ValueError, _bad(x=lambda d: torch.ones(3, 4, 0, device=d))),  # N = 0
    ("x", ValueError, _bad(x=lambda d: torch.tensor(1.0, device=d))),
    ("weight", TypeError, _bad(weight=None)),
    ("weight", ValueError, _bad(weight=lambda d: torch.ones(N + 1, device=d))),
    ("weight", ValueError, _bad(weight=lambda d: torch.ones(1, N, device=d))),
    ("weight", TypeError, _bad(weight=lambda d: torch.ones(N, dtype=torch.int64, device=d))),
    ("bias", ValueError, _bad(bias=lambda d: torch.ones(N - 1, device=d))),
    ("residual", ValueError, _bad(residual=lambda d: torch.ones(3, 4, N + 1, device=d))),
    ("residual", ValueError, _bad(residual=lambda d: torch.ones(4, 3, N, device=d))),
    ("residual", TypeError, _bad(residual=lambda d: torch.ones(3, 4, N, dtype=torch.int32, device=d))),
    ("x1", ValueError, _bad(x1=lambda d: torch.ones(12, N, device=d))),
    ("weight1", ValueError, _bad(weight1=lambda d: torch.ones(2 * N, device=d))),
    ("bias1", ValueError, _bad(bias1=lambda d: torch.ones(N + 2, device=d))),
    ("bias1", ValueError, _bad(weight1=None)),  # bias1 without weight1
    ("rowscale", ValueError, _bad(rowscale=lambda d: torch.ones(3, 4, N, device=d))),
    ("rowscale", ValueError, _bad(rowscale=lambda d: torch.ones(4, device=d))),
    ("dropout_p", ValueError, _bad(dropout_p=-0.1)),
    ("dropout_p", ValueError, _bad(dropout_p=1.0)),
    ("dropout_p", ValueError, _bad(dropout_p=1.5)),
    ("dropout_p", ValueError, _bad(dropout_p=float("nan"))),
    ("dropout_p", TypeError, _bad(dropout_p="0.1")),
    ("dropout_p", TypeError, _bad(dropout_p=None)),
    ("eps", ValueError, _bad(eps=-1e-5)),
    ("eps", ValueError, _bad(eps=float("nan"))),
    ("eps", ValueError, _bad(eps=float("inf"))),
    ("eps", TypeError, _bad(eps="1e-5")),
    ("eps", TypeError, _bad(eps=None)),
    ("out_dtype", TypeError, _bad(out_dtype=torch.int32)),
    ("out_dtype", TypeError, _bad(out_dtype="float16")),
    ("out", ValueError, _bad(out=lambda d: torch.full((3, 4, N + 1), 7.0, device=d))),
    ("out", TypeError, _bad(out=lambda d: torch.full((3, 4, N), 7.0, device=d).half())),
    ("out", ValueError, _bad(out=lambda d: torch.full((3, 4, 2 * N), 7.0, device=d)[..., ::2])),
    ("residual_out", ValueError, _bad(residual_out=lambda d: torch.full((12, N + 1), 7.0, device=d))),
    ("residual_out", TypeError, _bad(residual_out=lambda d: torch.full((3, 4, N), 7.0, device=d).bfloat16())),
] + [
    (name, ValueError, _bad(**{name: "meta"}))
    for name in ("weight", "bias", "residual", "x1", "weight1", "bias1", "rowscale", "out",
                 "residual_out")
]  # fmt: skip


def _materialise(bad, good, device):
    args = dict(good)
    for k, v in bad.items():
        if v == "meta":  # the same tensor on another device
            v = good[k].to("meta")
        elif callable(v):
            v = v(device)
        args[k] = v
    return args


@pytest.mark.parametrize(
    "name, exc, bad", BAD_INPUTS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_INPUTS)]
)
def test_bad_input(name, exc, bad, backend, device):
    good = _good(device)
    args = _materialise(bad, good, device)
    snapshot = {k: v.clone() for k, v in good.items() if isinstance(v, torch.Tensor)}
    x = args.pop("x")
    with pytest.raises(exc) as info:
        layer_norm_fn(x, args.pop("weight"), args.pop("bias"), **args)
    assert re.search(rf"\b{name}\b", str(info.value)), (
        f"the {exc.__name__} does not name {name!r}: {info.value}"
    )
    for k, v in snapshot.items():  # nothing written, not even partially
        assert torch.equal(good[k], v), f"{k} was modified by a failing call"
    # And the good call still works afterwards.
    layer_norm_fn(good["x"], good["weight"], good["bias"], residual=good["residual"])


def test_bad_layerscale(backend, device):
    x = torch.randn(3, N, device=device)
    w = torch.ones(N, device=device)
    with pytest.raises(ValueError, match=r"\blayerscale\b"):
        dropout_add_layer_norm(
            x, None, w, None, 0.0, 1e-5, layerscale=torch.ones(N + 1, device=device)
        )


def test_legacy_bad_epsilon(backend, device):
    """The legacy API calls it epsilon; the message may say eps or epsilon."""
    x = torch.randn(3, N, device=device)
    with pytest.raises(ValueError, match=r"\beps(ilon)?\b"):
        dropout_add_rms_norm(x, None, torch.ones(N, device=device), None, 0.0, -1.0)


def test_fp64_refused_on_kernel_path_accepted_on_torch(monkeypatch, device):
    """fp64 is a TypeError naming x on the kernels, and the fp64 reference on the torch path."""
    x = torch.randn(3, N, device=device, dtype=torch.float64)
    w, b = torch.randn(N, device=device, dtype=torch.float64), torch.zeros(N, device=device,
                                                                              dtype=torch.float64)  # fmt: skip
    monkeypatch.setenv("FUSED_NORM_BACKEND", "auto")
    with pytest.raises(TypeError, match=r"\bx\b"):
        layer_norm_fn(x, w, b)
    with pytest.raises(TypeError, match=r"\bout_dtype\b"):
        layer_norm_fn(x.float(), w.float(), b.float(), out_dtype=torch.float64)
    monkeypatch.setenv("FUSED_NORM_BACKEND", "torch")
    y = layer_norm_fn(x, w, b, eps=1e-5)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, layer_norm_ref(x, w, b, eps=1e-5), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        Case(shape=(5, 40)),
        Case(shape=(2, 3, 33), dtype=torch.float16, is_rms_norm=True,
             residual_dtype=torch.float32, prenorm=True, zero_centered_weight=True, seed=1),
        Case(shape=(4, 64), dtype=torch.bfloat16, weight_dtype=torch.float32, has_x1=True,
             has_w1=True, has_b1=True, rowscale=True, dropout_p=0.2, prenorm=True,
             residual_in_fp32=True, out_dtype=torch.float32, offset=3.0, seed=2),
    ],
    ids=["ln-fp32", "rms-fp16-prenorm", "ln-bf16-everything"],
)  # fmt: skip
def test_torch_backend_matches_reference(case, monkeypatch, device):
    """FUSED_NORM_BACKEND=torch: same return structure (checked by call_fused) and the same
    tolerance rule as the kernels."""
    monkeypatch.setenv("FUSED_NORM_BACKEND", "torch")
    check_case(case, "fn", device=device, kernels=False)
    legacy = Case(shape=(3, 24), residual_dtype=torch.float32, rowscale=True, layerscale=True,
                  dropout_p=0.1, prenorm=True, seed=3)  # fmt: skip
    check_case(legacy, "legacy", device=device, kernels=False)


def test_invalid_backend(monkeypatch, device):
    monkeypatch.setenv("FUSED_NORM_BACKEND", "cuda")
    x = torch.randn(2, N, device=device)
    with pytest.raises(ValueError, match="FUSED_NORM_BACKEND"):
        layer_norm_fn(x, torch.ones(N, device=device), None)


def test_autocast_transparent(device):
    """Under autocast the op does not cast its inputs: y keeps x's dtype and values."""
    t = _inputs((3, 16), device=device)
    ref = layer_norm_fn(t["x"], t["weight"], t["bias"], residual=t["residual"])
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        y = layer_norm_fn(t["x"], t["weight"], t["bias"], residual=t["residual"])
    assert y.dtype == torch.float32
    assert torch.equal(y, ref)


_NO_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import fused_norm
    from fused_norm import layer_norm_fn, layer_norm_ref
    assert not torch.cuda.is_available()
    x, w = torch.randn(2, 8), torch.ones(8)
    os.environ["FUSED_NORM_BACKEND"] = "auto"  # no interpreter: the PyTorch path
    torch.testing.assert_close(layer_norm_fn(x, w, None), layer_norm_ref(x, w, None))
    os.environ["FUSED_NORM_BACKEND"] = "triton"
    try:
        layer_norm_fn(x, w, None)
    except RuntimeError as e:
        assert "triton" in str(e).lower() and "cpu" in str(e).lower(), str(e)
        print("RAISED:", e)
    else:
        raise SystemExit("FUSED_NORM_BACKEND=triton on a CPU tensor did not raise")
    """
)


def test_triton_backend_without_interpreter_raises():
    """FUSED_NORM_BACKEND=triton on a CPU tensor, no interpreter, no CUDA -> RuntimeError;
    "auto" there falls back to the PyTorch path. Runs in a subprocess because Triton fixes
    interpretation at import time."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FUSED_NORM_BACKEND")
    }
    env["CUDA_VISIBLE_DEVICES"] = ""
    root = os.path.dirname(os.path.dirname(os.path.abspath(fused_norm.__file__)))
    proc = subprocess.run([sys.executable, "-c", _NO_INTERPRETER_SCRIPT], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RAISED:" in proc.stdout


def test_backward_falls_back_when_pipeline_does_not_fit(monkeypatch):
    """If the pipelined backward does not fit a device's shared memory (Triton raises
    OutOfResources while compiling), the launcher reruns it unpipelined, gets the same gradients,
    and does not try the pipelined variant again for that call signature."""
    from triton.runtime.errors import OutOfResources

    from fused_norm import functional, ops

    if not functional.use_kernels(torch.empty(1, device=DEVICE)):
        pytest.skip("the Triton kernels do not run here (no GPU, no TRITON_INTERPRET)")
    real = ops._fused_norm_bwd_kernel
    refused = []

    class Refusing:
        """The backward kernel, refusing every launch of a pipelined row loop."""

        def __getattr__(self, name):  # its params etc., for the launch machinery
            return getattr(real, name)

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                if kwargs["ROW_STAGES"] > 1:
                    refused.append(kwargs["ROW_STAGES"])
                    raise OutOfResources(300000, 232448, "shared memory")
                return real[grid](*args, **kwargs)

            return run

    x = torch.randn(6, 64, device=DEVICE, requires_grad=True)
    w = torch.randn(64, device=DEVICE, requires_grad=True)

    def grads():
        torch.manual_seed(7)
        y = layer_norm_fn(x, w, None, dropout_p=0.2)  # dropout: a pipelined row loop
        return torch.autograd.grad(y.sum(), (x, w))

    want = grads()
    monkeypatch.setattr(ops, "_fused_norm_bwd_kernel", Refusing())
    ops.clear_plans()  # forget the call signature (and its pipelined launch) made above
    try:
        got, again = grads(), grads()
    finally:
        monkeypatch.undo()
        ops.clear_plans()
    assert len(refused) == 1 and refused[0] > 1, f"expected one refused pipelined launch: {refused}"
    for a, b, c in zip(want, got, again):
        assert torch.equal(a, b) and torch.equal(a, c)

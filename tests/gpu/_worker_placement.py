"""Device-placement checks on ``cuda:1`` while ``cuda:0`` is the current device, run in a
process of their own (a kernel launched on the wrong device could poison the CUDA context of
the test process). Writes one JSON line per check to the file given as argv[1].

    python3 tests/gpu/_worker_placement.py RESULTS.jsonl
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's fused_norm

import torch  # noqa: E402

from fused_norm import (  # noqa: E402
    DropoutAddLayerNorm,
    LayerNorm,
    RMSNorm,
    layer_norm_fn,
    layer_norm_ref,
    rms_norm_ref,
)

D1 = torch.device("cuda", 1)
M, N, P, EPS = 96, 384, 0.2, 1e-5
TOL = {"atol": 1e-4, "rtol": 1e-4}  # fp32 kernel vs fp32 reference (see _common.TOL)


def _close(name, actual, expected):
    if actual.device != expected.device:
        raise AssertionError(f"{name}: on {actual.device}, expected {expected.device}")
    if not torch.allclose(actual, expected.to(actual.dtype), **TOL):
        err = (actual.double() - expected.double()).abs().max().item()
        raise AssertionError(f"{name}: max |diff| {err:.3e} beyond {TOL}")


def _inputs(device, requires_grad=True):
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0, shift=0.0):
        t = torch.randn(*shape, device=device, generator=g) * scale + shift
        return t.requires_grad_(requires_grad)

    return randn(M, N), randn(M, N), randn(N, scale=0.1, shift=1.0), randn(N, scale=0.1)


def _reference(x, residual, w, b, mask, gy, gs):
    leaves = [t.detach().clone().requires_grad_() for t in (x, residual, w, b)]
    lx, lres, lw, lb = leaves
    y, s = layer_norm_ref(
        lx, lw, lb, residual=lres, eps=EPS, dropout_p=P, prenorm=True, dropout_mask=mask,
        upcast=True,
    )  # fmt: skip
    return y, s, torch.autograd.grad((y, s), leaves, (gy, gs))


def check_functional_on_cuda1():
    """Outputs and grads on cuda:1, correct, nothing allocated on cuda:0, cuda:0 stays current."""
    x, residual, w, b = _inputs(D1)
    before = torch.cuda.memory_allocated(0)
    y, s, mask, _ = layer_norm_fn(
        x, w, b, residual=residual, eps=EPS, dropout_p=P, prenorm=True, return_dropout_mask=True
    )
    gy, gs = torch.randn_like(y), torch.randn_like(s)
    grads = torch.autograd.grad((y, s), (x, residual, w, b), (gy, gs))
    torch.cuda.synchronize(D1)
    assert torch.cuda.current_device() == 0, "the call changed the current device"
    after = torch.cuda.memory_allocated(0)
    assert after == before, f"{after - before} bytes were allocated on cuda:0"
    for name, t in [("y", y), ("residual_out", s), ("mask", mask)]:
        assert t.device == D1, f"{name} on {t.device}"
    y_ref, s_ref, grads_ref = _reference(x, residual, w, b, mask, gy, gs)
    _close("y", y, y_ref)
    _close("residual_out", s, s_ref)
    for name, g, g_ref in zip(("x", "residual", "weight", "bias"), grads, grads_ref):
        _close(f"grad {name}", g, g_ref)


def check_modules_on_cuda1():
    """Modules built on / moved to cuda:1 train there; eval mode matches the reference."""
    x = torch.randn(4, 24, N, device=D1, requires_grad=True)
    residual = torch.randn(4, 24, N, device=D1)
    mods = [
        LayerNorm(N, dropout_p=P, device=D1),
        RMSNorm(N, dropout_p=P).to(D1),
        DropoutAddLayerNorm(N, prenorm=True, p=P).to(D1),
    ]
    before = torch.cuda.memory_allocated(0)
    for mod in mods:
        for training in (True, False):
            mod.train(training)
            if isinstance(mod, DropoutAddLayerNorm):
                y, s = mod(x, residual)
            else:
                y, s = mod(x, residual, prenorm=True)
            assert y.device == D1 and s.device == D1, f"{type(mod).__name__}: output off cuda:1"
            grads = torch.autograd.grad(y.sum() + s.sum(), [x, *mod.parameters()])
            assert all(g.device == D1 for g in grads), f"{type(mod).__name__}: grad off cuda:1"
            if not training:
                bias = mod.bias.detach() if mod.bias is not None else None
                ref_fn = rms_norm_ref if isinstance(mod, RMSNorm) else layer_norm_ref
                y_ref = ref_fn(x.detach(), mod.weight.detach(), bias, residual=residual,
                               eps=mod.eps, upcast=True)  # fmt: skip
                _close(f"{type(mod).__name__} eval y", y.detach(), y_ref.detach())
    torch.cuda.synchronize(D1)
    assert torch.cuda.current_device() == 0, "a module call changed the current device"
    after = torch.cuda.memory_allocated(0)
    assert after == before, f"{after - before} bytes were allocated on cuda:0"


def check_current_stream_of_cuda1():
    """Forward and backward run on the current stream of cuda:1: the inputs are written on a
    side stream behind a ~50 ms sleep, so work launched on any other stream reads stale zeros."""
    x0, r0, w, b = _inputs(D1, requires_grad=False)
    gy0, gs0 = torch.randn(M, N, device=D1), torch.randn(M, N, device=D1)
    x = torch.zeros(M, N, device=D1, requires_grad=True)
    residual = torch.zeros(M, N, device=D1, requires_grad=True)
    gy, gs = torch.zeros(M, N, device=D1), torch.zeros(M, N, device=D1)
    w.requires_grad_()
    b.requires_grad_()
    torch.cuda.synchronize(D1)
    side = torch.cuda.Stream(device=D1)
    with torch.cuda.device(D1), torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        with torch.no_grad():
            x.copy_(x0)
            residual.copy_(r0)
        y, s, mask, _ = layer_norm_fn(
            x, w, b, residual=residual, eps=EPS, dropout_p=P, prenorm=True,
            return_dropout_mask=True,
        )  # fmt: skip
        torch.cuda._sleep(100_000_000)
        gy.copy_(gy0)
        gs.copy_(gs0)
        grads = torch.autograd.grad((y, s), (x, residual, w, b), (gy, gs))
    side.synchronize()
    y_ref, s_ref, grads_ref = _reference(x0, r0, w, b, mask, gy0, gs0)
    _close("y", y, y_ref)
    _close("residual_out", s, s_ref)
    for name, g, g_ref in zip(("x", "residual", "weight", "bias"), grads, grads_ref):
        _close(f"grad {name}", g, g_ref)


def _expect_error(name, call, arg):
    try:
        call()
    except (ValueError, TypeError) as e:
        if arg not in str(e):
            raise AssertionError(f"{name}: error does not name {arg!r}: {e}") from e
        return
    raise AssertionError(f"{name}: no ValueError/TypeError for mixed devices")


def check_mixed_device_errors():
    """Tensors split over cuda:0 and cuda:1 get a ValueError/TypeError naming the argument."""
    d0 = torch.device("cuda", 0)
    x0 = torch.randn(M, N, device=d0)
    x1 = torch.randn(M, N, device=D1)
    w0, w1 = torch.ones(N, device=d0), torch.ones(N, device=D1)
    _expect_error("x cuda:0, weight cuda:1", lambda: layer_norm_fn(x0, w1, None), "weight")
    _expect_error("x cuda:1, weight cuda:0", lambda: layer_norm_fn(x1, w0, None), "weight")
    _expect_error(
        "x cuda:1, bias cuda:0", lambda: layer_norm_fn(x1, w1, torch.zeros(N, device=d0)), "bias"
    )
    _expect_error(
        "x cuda:0, residual cuda:1",
        lambda: layer_norm_fn(x0, w0, None, residual=torch.randn(M, N, device=D1)),
        "residual",
    )
    module = LayerNorm(N, device=d0)
    _expect_error("module on cuda:0, x on cuda:1", lambda: module(x1), "weight")


CHECKS = [
    check_functional_on_cuda1,
    check_modules_on_cuda1,
    check_current_stream_of_cuda1,
    check_mixed_device_errors,  # last: it is the only one that touches cuda:0
]


def main(out_path: str) -> int:
    torch.cuda.set_device(0)
    with open(out_path, "w") as out:
        for check in CHECKS:
            try:
                check()
                record = {"check": check.__name__, "ok": True, "detail": ""}
            except Exception:
                record = {"check": check.__name__, "ok": False, "detail": traceback.format_exc()}
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(("PASS " if record["ok"] else "FAIL ") + check.__name__, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

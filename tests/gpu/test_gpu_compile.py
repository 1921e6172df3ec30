"""torch.compile: a pre-norm block of our modules and functional API compiles with
``fullgraph=True`` (no graph break), forward and backward match eager, and batch/sequence sizes
marked dynamic compile once instead of once per shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _common import assert_close, assert_close_dtype, requires_gpu
from torch import nn

from fused_norm import (
    DropoutAddRMSNorm,
    LayerNorm,
    RMSNorm,
    layer_norm_fn,
    layer_norm_ref,
    rms_norm_fn,
)

pytestmark = requires_gpu

D = 256
# (batch, seq) sizes: all >= 2 so that no size is specialised as 0/1 by dynamo; the row counts
# B*T (32 ... 384) fall on both sides of 2 x the SM count of an H100/H200 (264), where the
# backward's grid stops growing with M.
SHAPES = [(2, 16), (3, 24), (5, 8), (4, 96)]


class PreNormBlock(nn.Module):
    """Two pre-norm sublayers and a final norm: a module LayerNorm opening the residual stream,
    the legacy DropoutAddRMSNorm in the middle, and the functional rms_norm_fn at the end."""

    def __init__(self, d: int, p: float):
        super().__init__()
        self.norm1 = LayerNorm(d, dropout_p=p)
        self.mixer = nn.Linear(d, d)
        self.norm2 = DropoutAddRMSNorm(d, prenorm=True, p=p)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.norm_f = RMSNorm(d)

    def forward(self, x):
        h, residual = self.norm1(x, None, prenorm=True, residual_in_fp32=True)
        h, residual = self.norm2(self.mixer(h), residual)
        h = self.fc2(F.gelu(self.fc1(h)))
        return rms_norm_fn(h, self.norm_f.weight, None, residual=residual, eps=self.norm_f.eps)


def _counter():
    # Counts dynamo frames compiled (each recompile is one more) and still compiles with
    # inductor; present in torch 2.x including 2.11 and 2.13.
    from torch._dynamo.testing import CompileCounterWithBackend

    return CompileCounterWithBackend("inductor")


def test_compile_block_fullgraph_matches_eager_without_recompiles():
    torch.compiler.reset()
    torch.manual_seed(0)
    model = PreNormBlock(D, p=0.0).cuda()
    params = list(model.parameters())
    counter = _counter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for b, t in SHAPES:
        x = torch.randn(b, t, D, device="cuda", requires_grad=True)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(x, 1)
        gy = torch.randn(b, t, D, device="cuda")
        y_c = compiled(x)
        grads_c = torch.autograd.grad(y_c, [x, *params], gy)
        y_e = model(x)
        grads_e = torch.autograd.grad(y_e, [x, *params], gy)
        assert_close_dtype(y_c, y_e, f"y {b}x{t}", torch.float32)
        names = ["x"] + [n for n, _ in model.named_parameters()]
        for name, gc, ge in zip(names, grads_c, grads_e):
            assert_close_dtype(gc, ge, f"grad {name} {b}x{t}", torch.float32)
    assert counter.frame_count == 1, (
        f"compiled {counter.frame_count} times for {len(SHAPES)} (batch, seq) shapes marked "
        "dynamic; expected one compilation"
    )


def test_compile_functional_dropout_fullgraph():
    """Compiled dropout: outputs and grads match the reference given the returned mask, two
    calls draw different masks, and dynamic row counts compile once."""
    torch.compiler.reset()
    torch.manual_seed(0)
    p, eps, n = 0.25, 1e-5, 384

    def step(x, w, b, r):
        return layer_norm_fn(
            x, w, b, residual=r, eps=eps, dropout_p=p, prenorm=True, return_dropout_mask=True
        )

    counter = _counter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    w = (1 + 0.1 * torch.randn(n, device="cuda")).requires_grad_()
    b = (0.1 * torch.randn(n, device="cuda")).requires_grad_()
    masks = []
    for m in (64, 96, 130):
        x = torch.randn(m, n, device="cuda", requires_grad=True)
        r = torch.randn(m, n, device="cuda", requires_grad=True)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(r, 0)
        y, s, mask, mask1 = compiled(x, w, b, r)
        assert mask1 is None and mask.dtype == torch.bool and mask.shape == x.shape
        masks.append(mask)
        gy, gs = torch.randn_like(y), torch.randn_like(s)
        grads = torch.autograd.grad((y, s), (x, w, b, r), (gy, gs))

        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b, r)]
        y_ref, s_ref = layer_norm_ref(
            leaves[0], leaves[1], leaves[2], residual=leaves[3], eps=eps, dropout_p=p,
            prenorm=True, dropout_mask=mask, upcast=True,
        )  # fmt: skip
        grads_ref = torch.autograd.grad((y_ref, s_ref), leaves, (gy, gs))
        assert_close_dtype(y, y_ref, f"y m={m}", torch.float32)
        assert_close_dtype(s, s_ref, f"residual_out m={m}", torch.float32)
        for name, g, g_ref in zip(("x", "weight", "bias", "residual"), grads, grads_ref):
            assert_close_dtype(g, g_ref, f"grad {name} m={m}", torch.float32)
        keep = mask.float().mean().item()
        assert abs(keep - (1 - p)) < 0.02, f"kept fraction {keep:.4f}, expected {1 - p}"

    # Same requires_grad as above: a change would be a legitimate recompile (a new guard).
    x = torch.randn(64, n, device="cuda", requires_grad=True)
    r = torch.randn(64, n, device="cuda", requires_grad=True)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(r, 0)
    mask_a = compiled(x, w, b, r)[2]
    mask_b = compiled(x, w, b, r)[2]
    assert not torch.equal(mask_a, mask_b), "two compiled calls drew the same dropout mask"
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times, expected once"


def test_compile_bf16_activations_fp32_params():
    """The mixed-precision layout of real stacks (bf16 activations, fp32 norm parameters)
    compiles in one graph and matches eager."""
    torch.compiler.reset()
    torch.manual_seed(0)
    norm = LayerNorm(D).cuda()
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn_like(norm.weight))
        norm.bias.add_(0.1 * torch.randn_like(norm.bias))

    def fn(x, residual):
        return norm(x, residual, prenorm=True)

    counter = _counter()
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    x = torch.randn(4, 32, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    residual = torch.randn(4, 32, D, device="cuda", dtype=torch.float32, requires_grad=True)
    y_c, res_c = compiled(x, residual)
    y_e, res_e = fn(x, residual)
    assert y_c.dtype == torch.bfloat16 and res_c.dtype == torch.float32
    gy = torch.randn_like(y_e)
    inputs = (x, residual, norm.weight, norm.bias)
    grads_c = torch.autograd.grad((y_c, res_c), inputs, (gy, torch.ones_like(res_e)))
    grads_e = torch.autograd.grad((y_e, res_e), inputs, (gy, torch.ones_like(res_e)))
    assert_close_dtype(y_c, y_e, "y", torch.bfloat16)
    assert_close_dtype(res_c, res_e, "residual_out", torch.float32)
    for name, gc, ge in zip(("x", "residual", "weight", "bias"), grads_c, grads_e):
        assert gc.dtype == ge.dtype, f"grad {name}: dtype {gc.dtype} vs eager {ge.dtype}"
        assert_close_dtype(gc, ge, f"grad {name}", gc.dtype)
    assert counter.frame_count == 1


def test_ops_registered_with_torch_library():
    """The kernel launches are torch.library custom ops whose fake implementations pass
    torch.library.opcheck (schema, fake tensor, AOT dispatch with dynamic shapes)."""
    namespace = getattr(torch.ops, "fused_norm", None)
    fwd = getattr(namespace, "fwd", None)
    if fwd is None:
        pytest.fail("torch.ops.fused_norm.fwd is not registered (expected from fused_norm.ops)")
    op = fwd.default
    m, n = 48, 256
    x = torch.randn(m, n, device="cuda")
    # Build the call by argument name from the registered schema, so a reordering of the
    # launcher's parameters does not silently feed the wrong tensors.
    values = {
        "x": x,
        "weight": torch.randn(n, device="cuda"),
        "bias": torch.randn(n, device="cuda"),
        "y": torch.empty(m, n, device="cuda"),
        "mean": torch.empty(m, device="cuda"),
        "rstd": torch.empty(m, device="cuda"),
        "eps": 1e-5,
        "dropout_p": 0.0,
        "is_rms_norm": False,
        "zero_centered_weight": False,
    }
    kwargs = {}
    for arg in op._schema.arguments:
        if arg.name in values:
            kwargs[arg.name] = values[arg.name]
        elif isinstance(arg.type, torch.OptionalType):
            kwargs[arg.name] = None
        else:
            pytest.fail(f"fused_norm::fwd has an argument this test does not know: {arg}")
    torch.library.opcheck(op, (), kwargs)
    mean = x.mean(-1)
    rstd = torch.rsqrt(x.var(-1, unbiased=False) + 1e-5)
    y_ref = (x - mean[:, None]) * rstd[:, None] * values["weight"] + values["bias"]
    op(**kwargs)
    assert_close(values["y"], y_ref, "y through torch.ops.fused_norm.fwd", atol=1e-4, rtol=1e-4)

"""torch.compile: a pre-norm block of our modules and functional API compiles with
``fullgraph=True`` (no graph break), forward and backward match eager, and batch/sequence sizes
marked dynamic compile once instead of once per shape; the compiled graphs launch the fused
kernels from Inductor's generated code (the launches are ``torch.library.triton_op``s), and
``mode="reduce-overhead"`` (CUDA graphs) trains a model of the modules."""

from __future__ import annotations

import copy
import re

import torch
import torch.nn.functional as F
from _common import assert_close_dtype, requires_gpu
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


class TwoLayerPreNorm(nn.Module):
    """Two pre-norm layers of the modules: DropoutAddRMSNorm (prenorm) opening each layer's
    residual add, an MLP, and a final RMSNorm over the last sum."""

    def __init__(self, d: int, p: float):
        super().__init__()
        self.norms = nn.ModuleList(DropoutAddRMSNorm(d, prenorm=True, p=p) for _ in range(2))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(),
                                                nn.Linear(2 * d, d)) for _ in range(2))  # fmt: skip
        self.norm_f = RMSNorm(d)

    def forward(self, x):
        h, residual = x, None
        for norm, mlp in zip(self.norms, self.mlps):
            h, residual = norm(h, residual)
            h = mlp(h)
        return self.norm_f(h, residual)


# A call of the op itself in generated code (Python dispatch), as opposed to the kernels that
# Inductor launches from its own code.
_OP_CALL = re.compile(r"torch\.ops\.fused_norm\.(fwd|bwd)(\.default)?\(")


def test_compiled_modules_launch_the_kernels_from_generated_code():
    """A two-layer pre-norm model of the modules under torch.compile(fullgraph=True) matches
    eager in outputs and every gradient, and Inductor's generated code (forward and backward)
    launches the fused kernels itself: the Triton kernels' names are in it, and no call of
    torch.ops.fused_norm.* (which would run the op's Python body, dispatch included)."""
    from torch._inductor.utils import run_and_get_code

    torch.compiler.reset()
    torch.manual_seed(0)
    model = TwoLayerPreNorm(D, p=0.0).cuda()
    with torch.no_grad():
        for prm in model.parameters():
            prm.add_(0.05 * torch.randn_like(prm))
    params = list(model.parameters())
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(4, 32, D, device="cuda", requires_grad=True)
    gy = torch.randn(4, 32, D, device="cuda")

    def step(fn):
        y = fn(x)
        return y, torch.autograd.grad(y, [x, *params], gy)

    (y_c, grads_c), codes = run_and_get_code(step, compiled)
    y_e, grads_e = step(model)
    assert_close_dtype(y_c, y_e, "y", torch.float32)
    names = ["x"] + [n for n, _ in model.named_parameters()]
    for name, gc, ge in zip(names, grads_c, grads_e):
        assert_close_dtype(gc, ge, f"grad {name}", torch.float32)
    code = "\n".join(codes)
    assert len(codes) >= 2, f"expected a forward and a backward graph, got {len(codes)}"
    for kernel in ("_fused_norm_fwd_kernel", "_fused_norm_bwd_kernel", "_sum_partials_kernel"):
        assert kernel in code, f"{kernel} is not launched from the generated code"
    calls = _OP_CALL.findall(code)
    assert not calls, f"the generated code calls the ops through dispatch: {calls}"


def _steps(model, opt, batches, mark=False):
    """Train ``model`` on ``batches`` (x, target); the losses, as floats."""
    losses = []
    for x, target in batches:
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_reduce_overhead_trains_like_eager():
    """torch.compile(mode="reduce-overhead") (CUDA graphs) of the two-layer model trains three
    steps (forward, backward, SGD) with the losses and parameters of the same steps in eager
    (dropout 0: the same computation, up to fp32 rounding of the compiled MLP)."""
    torch.compiler.reset()
    torch.manual_seed(0)
    eager = TwoLayerPreNorm(D, p=0.0).cuda()
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, mode="reduce-overhead", fullgraph=True)
    batches = [(torch.randn(8, 16, D, device="cuda"), torch.randn(8, 16, D, device="cuda"))
               for _ in range(3)]  # fmt: skip
    lr = 0.05
    want = _steps(eager, torch.optim.SGD(eager.parameters(), lr=lr), batches)
    got = _steps(compiled, torch.optim.SGD(twin.parameters(), lr=lr), batches, mark=True)
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-4 * abs(b) + 1e-6, f"step {i}: loss {a} compiled, {b} eager"
    for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
        assert_close_dtype(q, p, f"{name} after 3 steps", torch.float32)


def test_reduce_overhead_with_dropout_draws_fresh_masks():
    """Under CUDA graphs with dropout > 0: the model trains three steps (finite losses), and
    the compiled functional call draws other masks at every replay (the seeds are drawn on the
    device, not baked into the graph), keeping 1 - p of the elements."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = TwoLayerPreNorm(D, p=0.1).cuda().train()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    batches = [(torch.randn(8, 16, D, device="cuda"), torch.randn(8, 16, D, device="cuda"))
               for _ in range(3)]  # fmt: skip
    losses = _steps(compiled, torch.optim.SGD(model.parameters(), lr=0.05), batches, mark=True)
    assert all(torch.isfinite(torch.tensor(losses))), losses

    p = 0.3
    w = torch.ones(D, device="cuda", requires_grad=True)

    def fn(x):
        y, mask, _ = layer_norm_fn(x, w, None, dropout_p=p, return_dropout_mask=True)
        return y, mask

    step = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(64, D, device="cuda", requires_grad=True)
    masks = []
    for _ in range(3):
        # (.grad of a replay's output would be overwritten by the next replay: start afresh)
        x.grad = w.grad = None
        torch.compiler.cudagraph_mark_step_begin()
        y, mask = step(x)
        y.sum().backward()
        masks.append(mask.clone())
        keep = mask.float().mean().item()
        assert abs(keep - (1 - p)) < 0.05, f"kept fraction {keep:.3f}, expected {1 - p}"
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2]), (
        "two steps under CUDA graphs drew the same dropout masks"
    )

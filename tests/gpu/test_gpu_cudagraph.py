"""CUDA graphs: a forward + backward step with dropout captures and replays. Dropout seeds are
drawn on the device, so capture needs no host synchronisation and each replay draws fresh masks.
"""

from __future__ import annotations

import torch
from _common import assert_bitwise, assert_close_dtype, requires_gpu
from torch import nn

from fused_norm import LayerNorm, RMSNorm, layer_norm_fn, layer_norm_ref

pytestmark = requires_gpu

M, N, P, EPS = 128, 512, 0.2, 1e-5


def _capture(step, leaves, warmup=3):
    """Capture ``step()`` (forward + backward) into a CUDA graph, the recipe of the PyTorch
    docs: warm up on a side stream, drop the grads so that the captured backward allocates them
    from the graph's pool, capture. Returns the graph and the static outputs of the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
            for t in leaves:
                t.grad = None
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    return graph, static_out


def test_cuda_graph_functional_step_replays_fresh_masks():
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(M, N, device=dev, requires_grad=True)
    residual = torch.randn(M, N, device=dev, requires_grad=True)
    w = (1 + 0.1 * torch.randn(N, device=dev)).requires_grad_()
    b = (0.1 * torch.randn(N, device=dev)).requires_grad_()
    gy = torch.randn(M, N, device=dev)
    gs = torch.randn(M, N, device=dev)
    leaves = (x, residual, w, b)

    def step():
        y, s, mask, _ = layer_norm_fn(
            x, w, b, residual=residual, eps=EPS, dropout_p=P, prenorm=True,
            return_dropout_mask=True,
        )  # fmt: skip
        ((y * gy).sum() + (s * gs).sum()).backward()
        return y, s, mask

    graph, (y, s, mask) = _capture(step, leaves)

    replays = []
    for i in range(2):
        with torch.no_grad():  # new data in the static inputs, as a training loop would
            x.copy_(torch.randn_like(x))
            residual.copy_(torch.randn_like(residual))
        graph.replay()
        torch.cuda.synchronize()
        snap = {
            "x": x.detach().clone(), "residual": residual.detach().clone(),
            "y": y.detach().clone(), "s": s.detach().clone(), "mask": mask.clone(),
            "grads": [t.grad.detach().clone() for t in leaves],
        }  # fmt: skip
        keep = snap["mask"].float().mean().item()
        assert abs(keep - (1 - P)) < 0.02, f"replay {i}: kept fraction {keep:.4f}, expected {1 - P}"
        replays.append(snap)

    assert not torch.equal(replays[0]["mask"], replays[1]["mask"]), (
        "two replays drew the same dropout mask: the seed was baked into the graph"
    )
    for i, snap in enumerate(replays):
        ref_leaves = [
            t.detach().clone().requires_grad_()
            for t in (snap["x"], snap["residual"], w, b)
        ]  # fmt: skip
        lx, lres, lw, lb = ref_leaves
        y_ref, s_ref = layer_norm_ref(
            lx, lw, lb, residual=lres, eps=EPS, dropout_p=P, prenorm=True,
            dropout_mask=snap["mask"], upcast=True,
        )  # fmt: skip
        grads_ref = torch.autograd.grad((y_ref, s_ref), ref_leaves, (gy, gs))
        assert_close_dtype(snap["y"], y_ref, f"replay {i}: y", torch.float32)
        assert_close_dtype(snap["s"], s_ref, f"replay {i}: residual_out", torch.float32)
        for name, g, g_ref in zip(("x", "residual", "weight", "bias"), snap["grads"], grads_ref):
            assert_close_dtype(g, g_ref, f"replay {i}: grad {name}", torch.float32)


def test_cuda_graph_replays_a_multi_kernel_backward():
    """The x1 path of 16-bit rows of 256K columns: its backward is several kernels (column
    blocks of the row, their row sums exchanged or from a pre-pass, then the partials' sum),
    each reading what the one before wrote, and its forward splits the rows over programs that
    exchange their statistics through workspaces (fresh ones under capture). Captured with the
    forward and replayed on new inputs, every output and gradient is bitwise the eager call's
    on those inputs (no dropout: the same kernels, the same order of sums)."""
    from fused_norm import ops

    torch.manual_seed(0)
    m, n, dt = 8, 262144, torch.bfloat16
    x, residual, x1 = (torch.randn(m, n, device="cuda", dtype=dt, requires_grad=True)
                       for _ in range(3))  # fmt: skip
    w, w1 = ((1 + 0.1 * torch.randn(n, device="cuda")).to(dt).requires_grad_() for _ in range(2))
    b, b1 = ((0.1 * torch.randn(n, device="cuda")).to(dt).requires_grad_() for _ in range(2))
    leaves = (x, residual, x1, w, b, w1, b1)
    upstream = [torch.randn(m, n, device="cuda", dtype=dt) for _ in range(3)]

    def outputs(*t):
        return layer_norm_fn(t[0], t[3], t[4], residual=t[1], x1=t[2], weight1=t[5], bias1=t[6],
                             eps=EPS, prenorm=True)  # fmt: skip

    def step():
        outs = outputs(*leaves)
        sum((o * u).sum() for o, u in zip(outs, upstream)).backward()
        return outs

    ops.clear_plans()
    graph, outs = _capture(step, leaves)
    bwd = [p for key, p in ops._PLANS.items() if key[0] == "bwd" and key[2].n == n]
    assert bwd and all(p.chunks > 1 for p in bwd), f"not a multi-kernel backward: {bwd}"
    for _ in range(2):
        with torch.no_grad():
            for t in (x, residual, x1):
                t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        fresh = [t.detach().clone().requires_grad_() for t in leaves]
        want = outputs(*fresh)
        want_grads = torch.autograd.grad(want, fresh, upstream)
        for name, got, exp in zip(("y", "y1", "residual_out"), outs, want):
            assert_bitwise(got.detach(), exp.detach(), name)
        names = ("x", "residual", "x1", "weight", "bias", "weight1", "bias1")
        for name, t, g in zip(names, leaves, want_grads):
            assert_bitwise(t.grad, g, f"grad {name}")


class _SmallNet(nn.Module):
    def __init__(self, d: int, p: float):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.norm1 = LayerNorm(d, dropout_p=p)
        self.fc2 = nn.Linear(d, d)
        self.norm2 = RMSNorm(d, dropout_p=p)

    def forward(self, x):
        h, residual = self.norm1(self.fc1(x), x, prenorm=True)
        return self.norm2(self.fc2(h), residual)


def test_cuda_graph_module_training_step():
    """Whole fwd + bwd of a small net of our modules in training mode: the replay runs, its
    grads are finite, and two replays on the same input differ (fresh masks every replay)."""
    torch.manual_seed(0)
    net = _SmallNet(N, P).cuda().train()
    x = torch.randn(4, 32, N, device="cuda")
    target = torch.randn(4, 32, N, device="cuda")
    params = list(net.parameters())

    def step():
        loss = nn.functional.mse_loss(net(x), target)
        loss.backward()
        return loss

    graph, loss = _capture(step, params)
    grads = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(loss).item()
        grads.append([p.grad.detach().clone() for p in params])
        assert all(torch.isfinite(g).all() for g in grads[-1])
    assert not torch.equal(grads[0][0], grads[1][0]), (
        "two replays on the same input gave identical grads: dropout did not draw fresh masks"
    )


def test_step_has_no_host_sync():
    """After warm-up, a training step through the functional API and the modules runs with
    torch's sync debug mode set to raise on any synchronising call (e.g. ``.item()``)."""
    torch.manual_seed(0)
    net = _SmallNet(N, P).cuda().train()
    x = torch.randn(4, 32, N, device="cuda", requires_grad=True)
    w = torch.ones(N, device="cuda", requires_grad=True)

    def step():
        h = layer_norm_fn(x, w, None, dropout_p=P, eps=EPS, is_rms_norm=True)
        net(h).square().mean().backward()

    step()  # compiles the kernels (Triton's compile and autotuning may synchronise)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

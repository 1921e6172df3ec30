"""The C++ fast path (fused_norm/fast_path.py, csrc/fast_path.cpp) against the Python path.

Each case runs the same calls twice in one process, from the same generator state: once with
the fast path off, once on. A signature's first calls take the Python path (the first compiles,
a later one is recorded); from then on the C++ node serves it, and its outputs, dropout masks
and every gradient must equal the Python path's bit for bit. Signatures the fast path declines
(caller buffers, returned masks, graph capture with dropout) must still be right.
"""

from __future__ import annotations

import pytest
import torch
from _common import requires_gpu

from fused_norm import fast_path, functional, layer_norm_fn, ops, rms_norm_fn

pytestmark = requires_gpu

CALLS = 5  # the first compiles, the second is recorded, the rest go through C++


@pytest.fixture(autouse=True)
def _built(monkeypatch):
    """The extension on for these tests, whatever FUSED_NORM_FAST_PATH says."""
    mod = ops._FAST
    if mod is None:
        monkeypatch.setattr(fast_path, "_STATE", {"loaded": False, "module": None, "why": None})
        monkeypatch.setenv(fast_path.ENV, "1")
        mod = fast_path.module()
    if mod is None:
        pytest.fail(f"the C++ fast path is not loaded ({fast_path.why()}): `make gpu-test` "
                    "builds it first (python -m fused_norm.build)")  # fmt: skip
    monkeypatch.setattr(ops, "_FAST", mod)
    ops.clear_plans()
    yield
    ops.clear_plans()


CASES = {
    "rms": dict(rms=True),
    "ln": dict(bias=True),
    "add_rms_prenorm": dict(rms=True, residual=True, prenorm=True),
    "drop_add_ln_prenorm": dict(bias=True, residual=True, prenorm=True, p=0.1),
    "x1_parallel": dict(bias=True, residual=True, x1=True, w1=True, p=0.1),
    "rowscale_fp32_stream": dict(
        rms=True, rowscale=True, residual=True, fp32_stream=True, prenorm=True
    ),  # fmt: skip
    "zero_centered_out_fp32": dict(bias=True, zcw=True, out_fp32=True),
}


def _inputs(case, m, n, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, dt=dtype, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(dt)

    leaves = {"x": rnd(m, n).requires_grad_()}
    kw = dict(weight=(1 + rnd(n, scale=0.1)).requires_grad_(), bias=None)
    if case.get("bias"):
        kw["bias"] = rnd(n, scale=0.1).requires_grad_()
    if case.get("residual"):
        kw["residual"] = rnd(m, n).requires_grad_()
    if case.get("x1"):
        kw["x1"] = rnd(m, n).requires_grad_()
    if case.get("w1"):
        kw["weight1"] = (1 + rnd(n, scale=0.1)).requires_grad_()
        kw["bias1"] = rnd(n, scale=0.1).requires_grad_() if case.get("bias") else None
    if case.get("rowscale"):
        kw["rowscale"] = rnd(m, scale=0.5) + 1
    for k, v in kw.items():
        if isinstance(v, torch.Tensor) and v.requires_grad:
            leaves[k] = v
    return leaves["x"], kw, leaves


def _call(case, x, kw):
    fn = rms_norm_fn if case.get("rms") else layer_norm_fn
    extra = dict(dropout_p=case.get("p", 0.0), prenorm=case.get("prenorm", False),
                 residual_in_fp32=case.get("fp32_stream", False),
                 zero_centered_weight=case.get("zcw", False),
                 out_dtype=torch.float32 if case.get("out_fp32") else None,
                 return_dropout_mask=case.get("masks", False))  # fmt: skip
    out = fn(x, **kw, **extra)
    return list(out) if isinstance(out, tuple) else [out]


def _run(case, fast, m=66, n=1024, dtype=torch.bfloat16, grad_mode="all", no_grad=False):
    """``CALLS`` calls of one signature: per call its outputs and gradients, and how it ran."""
    saved = ops._FAST
    ops._FAST = saved if fast else None
    ops.clear_plans()
    try:
        runs = []
        for i in range(CALLS):
            torch.cuda.manual_seed(100 + i)
            x, kw, leaves = _inputs(case, m, n, dtype, seed=i)
            if no_grad:
                with torch.no_grad():
                    outs = _call(case, x, kw)
                runs.append((outs, [], None))
                continue
            outs = _call(case, x, kw)
            diff = [o for o in outs if o is not None and o.requires_grad]
            g = torch.Generator(device="cuda").manual_seed(1000 + i)
            ups = [torch.randn(o.shape, generator=g, device="cuda").to(o.dtype) for o in diff]
            if grad_mode == "stream_unused":  # the prenorm stream's gradient never comes in
                diff, ups = diff[:1], ups[:1]
            elif grad_mode == "y_unused":  # only the stream's: y's gradient is None
                diff, ups = diff[-1:], ups[-1:]
            elif grad_mode == "strided":  # an incoming gradient that is not contiguous
                ups = [u.t().contiguous().t() if u.dim() == 2 else u for u in ups]
            grads = torch.autograd.grad(diff, list(leaves.values()), ups, allow_unused=True)
            node = outs[0].grad_fn.name() if outs[0].grad_fn is not None else None
            runs.append((outs, list(grads), node))
        calls = [c for c in functional._CALLS.values() if isinstance(c, ops.KernelCall)]
        return runs, calls
    finally:
        ops._FAST = saved


def _same(a, b, what):
    for i, (ra, rb) in enumerate(zip(a, b)):
        for j, (ta, tb) in enumerate(zip(ra[0] + ra[1], rb[0] + rb[1])):
            assert (ta is None) == (tb is None), f"{what}, call {i}, tensor {j}"
            if ta is not None:
                assert ta.dtype == tb.dtype and ta.shape == tb.shape, f"{what}, call {i}"
                assert torch.equal(ta.detach(), tb.detach()), (
                    f"{what}, call {i}, tensor {j}: the C++ path differs from the Python path"
                )


def _served(runs, calls):
    assert len(calls) == 1
    assert calls[0].fast is not None, f"not replayed: {calls[0].not_fast}"
    assert all(node == "FusedNormBackward" for _, _, node in runs[2:]), [r[2] for r in runs]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_fast_path_equals_python_path(name, dtype):
    case = CASES[name]
    slow, _ = _run(case, fast=False, dtype=dtype)
    fast, calls = _run(case, fast=True, dtype=dtype)
    _served(fast, calls)
    _same(slow, fast, name)


@pytest.mark.parametrize("n", [256, 5120, 16384, 65536, 262144])
def test_gpu_fast_path_widths(n):
    """Tiled narrow rows, two-block rows, wide rows with a row-sums pre-pass or the Hopper
    backward, and rows split over programs that exchange statistics through self-clearing
    workspaces (three replays: each buffer of a pair used, cleaned and used again)."""
    case = CASES["drop_add_ln_prenorm"]
    slow, _ = _run(case, fast=False, n=n, m=40)
    fast, calls = _run(case, fast=True, n=n, m=40)
    _served(fast, calls)
    _same(slow, fast, f"N={n}")


def test_gpu_fast_path_workspaces_across_streams_and_capture():
    """A signature with exchange workspaces (split rows), served on its first stream, another
    stream, the first again, and inside a captured CUDA graph: each time the Python path's
    outputs and gradients (the C++ pairs belong to the first stream; elsewhere a call takes
    freshly filled buffers)."""
    m, n = 8, 131072
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(m, n, generator=g, device="cuda", requires_grad=True)
    w = torch.randn(n, generator=g, device="cuda", requires_grad=True)
    dy = torch.randn(m, n, generator=g, device="cuda")

    def step():
        y = rms_norm_fn(x, w, None)
        return [y.detach(), *torch.autograd.grad(y, [x, w], dy)]

    saved = ops._FAST
    ops._FAST = None
    try:
        want = step()
    finally:
        ops._FAST = saved
    ops.clear_plans()
    side = torch.cuda.Stream()
    for where in ["main"] * CALLS + ["side"] * 3 + ["main"] * 3:
        stream = side if where == "side" else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            got = step()
        torch.cuda.current_stream().wait_stream(stream)
        for a, b in zip(want, got):
            assert torch.equal(a, b), f"{where}: the C++ path differs from the Python path"
    call = next(c for c in functional._CALLS.values() if isinstance(c, ops.KernelCall))
    assert call.fast is not None, call.not_fast
    xs = x.detach().clone()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compiled, recorded, replayed: the capture replays in C++
            rms_norm_fn(xs, w.detach(), None)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gy = rms_norm_fn(xs, w.detach(), None)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gy, want[0]), "a captured replay differs"


@pytest.mark.parametrize("mode", ["stream_unused", "y_unused", "strided"])
def test_gpu_fast_path_incoming_gradients(mode):
    """An unused stream (the backward without its gradient), a None dy (zeros), and a strided
    dy (copied to contiguous rows) give the Python path's gradients."""
    case = CASES["add_rms_prenorm"]
    slow, _ = _run(case, fast=False, grad_mode=mode)
    fast, calls = _run(case, fast=True, grad_mode=mode)
    _served(fast, calls)
    _same(slow, fast, mode)


def test_gpu_fast_path_no_grad():
    case = CASES["drop_add_ln_prenorm"]
    slow, _ = _run(case, fast=False, no_grad=True)
    fast, calls = _run(case, fast=True, no_grad=True)
    assert calls[0].fast is not None, calls[0].not_fast
    _same(slow, fast, "no_grad")


def test_gpu_fast_path_declines_what_it_cannot_replay():
    """Returned dropout masks stay on the Python path."""
    case = dict(CASES["drop_add_ln_prenorm"], masks=True)
    slow, _ = _run(case, fast=False, m=8)
    fast, calls = _run(case, fast=True, m=8)
    assert calls[0].fast is None and calls[0].not_fast, "replayed a call it cannot"
    _same(slow, fast, "declined")


def test_gpu_fast_path_key_matches_python():
    """Both paths take the same dropout keys from the same generator state."""
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.manual_seed(7)
    keys_py = [ops.dropout_key(dev) for _ in range(3)]
    torch.cuda.manual_seed(7)
    keys_cpp = [ops._FAST.dropout_key(dev.index) for _ in range(3)]
    assert keys_py == keys_cpp and len(set(keys_py)) == 3


def test_gpu_fast_path_under_graph_capture():
    """A replayed signature captured into a CUDA graph: without dropout its launches are
    captured and each replay recomputes from the inputs' current values; with dropout the C++
    path declines (a key baked into the graph would repeat) and the Python path draws seeds on
    the device, so replays draw fresh masks."""
    m, n = 64, 1024
    x = torch.randn(m, n, device="cuda")
    w = torch.randn(n, device="cuda")
    res = torch.randn(m, n, device="cuda")
    for _ in range(CALLS):
        rms_norm_fn(x, w, None, residual=res, prenorm=True)
        layer_norm_fn(x, w, None, residual=res, dropout_p=0.3)
    calls = [c for c in functional._CALLS.values() if isinstance(c, ops.KernelCall)]
    assert all(c.fast is not None for c in calls), [c.not_fast for c in calls]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rms_norm_fn(x, w, None, residual=res, prenorm=True)
        layer_norm_fn(x, w, None, residual=res, dropout_p=0.3)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gy, gs = rms_norm_fn(x, w, None, residual=res, prenorm=True)
        gd = layer_norm_fn(x, w, None, residual=res, dropout_p=0.3)
    for k in range(3):
        x.copy_(torch.randn(m, n, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        ey, es = rms_norm_fn(x, w, None, residual=res, prenorm=True)
        assert torch.equal(gy, ey) and torch.equal(gs, es), f"replay {k}"
    graph.replay()  # the same inputs twice: fresh masks give different outputs
    first = gd.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(first, gd), "two replays drew the same dropout masks"

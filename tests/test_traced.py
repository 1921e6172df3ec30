"""The torch.compile route (fused_norm/traced.py): its ops pass torch.library.opcheck (schema,
fake tensors, AOT dispatch with dynamic shapes) and compute the reference's values, and a
model compiled with dynamic shapes matches eager. On the GPU the ops are triton_ops that
Inductor launches; under the interpreter (CPU) they are opaque custom ops run eagerly, through
the same planning code."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _helpers import DEVICE, INTERPRETED

import fused_norm.traced  # noqa: F401  (registers torch.ops.fused_norm.fwd / bwd)
from fused_norm import RMSNorm

if DEVICE == "cpu" and not INTERPRETED:
    pytest.skip("the ops run on a GPU or in the Triton interpreter", allow_module_level=True)
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def _by_schema(op, values: dict) -> dict:
    """The op's arguments by name from its registered schema (None for optional ones not
    given), so that a reordering of its parameters cannot silently feed the wrong values."""
    kwargs = {}
    for arg in op._schema.arguments:
        if arg.name in values:
            kwargs[arg.name] = values[arg.name]
        elif isinstance(arg.type, torch.OptionalType):
            kwargs[arg.name] = None
        else:
            pytest.fail(f"{op} has an argument this test does not know: {arg}")
    return kwargs


def test_ops_pass_opcheck_and_match_the_reference():
    torch.manual_seed(0)
    m, n, eps = 24, 96, 1e-5
    x = torch.randn(m, n, device=DEVICE)
    w, b = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    fwd = torch.ops.fused_norm.fwd.default
    kwargs = _by_schema(fwd, dict(x=x, weight=w, bias=b, eps=eps, dropout_p=0.0,
                                  is_rms_norm=False, zero_centered_weight=False,
                                  store_residual_out=False, store_mask=False,
                                  out_dtype=torch.float32, residual_dtype=torch.float32))  # fmt: skip
    torch.library.opcheck(fwd, (), kwargs)
    y, mean, rstd = fwd(**kwargs)  # no y1, stream or masks here
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y_ref = F.layer_norm(xr, (n,), wr, br, eps=eps)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mean, x.mean(-1), atol=1e-5, rtol=1e-5)
    dy = torch.randn(m, n, device=DEVICE)
    bwd = torch.ops.fused_norm.bwd.default
    kwargs = _by_schema(bwd, dict(s=x, weight=w, bias=b, mean=mean, rstd=rstd, dy=dy,
                                  dropout_p=0.0, is_rms_norm=False, zero_centered_weight=False,
                                  x_dtype=torch.float32))  # fmt: skip
    torch.library.opcheck(bwd, (), kwargs)
    got = bwd(**kwargs)  # dx, then the gradients of weight and bias
    for g, want in zip(got, torch.autograd.grad(y_ref, (xr, wr, br), dy)):
        torch.testing.assert_close(g, want, atol=1e-4, rtol=1e-4)


def test_dynamic_shapes_compile_matches_eager():
    """A symbolic row count or width: the plan is chosen for the concrete width, and a second
    batch size reuses the graph."""
    torch.manual_seed(0)
    norm = RMSNorm(64, device=DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    compiled = torch.compile(norm, backend="aot_eager", dynamic=True, fullgraph=True)
    for m in (6, 11):
        x = torch.randn(m, 64, device=DEVICE, requires_grad=True)
        dy = torch.randn(m, 64, device=DEVICE)
        y_c = compiled(x)
        got = torch.autograd.grad(y_c, (x, norm.weight), dy)
        y_e = norm(x)
        want = torch.autograd.grad(y_e, (x, norm.weight), dy)
        torch.testing.assert_close(y_c, y_e, atol=1e-5, rtol=1e-5)
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_kernel_parameter_defaults_are_literals():
    """Inductor copies a kernel's source (and its helpers') into its own module and then the
    globals their bodies use, so a parameter default naming a global raises NameError there
    (as ``EVICT = NO_EVICT`` did on the GPU): every default must be a literal."""
    import ast
    import inspect

    import triton

    from fused_norm import kernels

    found = []
    for module in (kernels.common, kernels.forward, kernels.backward):
        for name, fn in vars(module).items():
            # (a JITFunction, or the interpreter's InterpretedFunction: both wrap .fn)
            inner = getattr(fn, "fn", None)
            if isinstance(fn, triton.runtime.jit.KernelInterface) and (
                getattr(inner, "__module__", None) == module.__name__
            ):
                found.append(name)
                tree = ast.parse(inspect.getsource(inner).lstrip())
                args = tree.body[0].args
                for default in args.defaults + [d for d in args.kw_defaults if d is not None]:
                    assert isinstance(default, ast.Constant), (
                        f"{module.__name__}.{name}: default {ast.unparse(default)!r} is not a literal"
                    )
    assert "_fused_norm_fwd_kernel" in found and "_fused_norm_bwd_kernel" in found


_PTX_SCRIPT = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fused_norm import heuristics, traced

# The launches traced.py would hand Inductor on an H200 (its plans, with the sm90 table, and
# its constexprs), recorded instead of launched.
heuristics.device = lambda dev: heuristics.Device(132, 232448, True, "sm90", True)
launches = []

class Recorder:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **constexprs: launches.append((self.kernel, args, constexprs))

traced._traced_kernel = lambda kernel, num_warps, maxnreg: (Recorder(kernel), {})
TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int64: "i64", torch.bool: "i1"}

def ptx_f64(kernel, args, constexprs):
    # Compiled as Inductor types the launch: Python floats as fp64.
    sig, const = {}, dict(constexprs)
    runtime = [p for p in kernel.params if not p.is_constexpr]
    for p, a in zip(runtime, args):
        if a is None:
            sig[p.name], const[p.name] = "constexpr", None
        elif isinstance(a, torch.Tensor):
            sig[p.name] = "*" + TYPES[a.dtype]
        else:
            sig[p.name] = "fp64" if isinstance(a, float) else "i32"
    sig.update((name, "constexpr") for name in constexprs)
    ptx = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    # allowed: the parameters themselves and their conversion to fp32
    return [ln.strip() for ln in ptx.splitlines() if ".f64" in ln
            and not ln.strip().startswith((".param", "ld.param", "cvt.rn.f32.f64"))]

bf16, m = torch.bfloat16, 64
# dropout + add + RMSNorm, prenorm, in one block; plain LayerNorm 4096 (sm90: chunked sweeps)
for n, rms, p in ((768, True, 0.1), (4096, False, 0.0)):
    x, dy = torch.randn(m, n, dtype=bf16), torch.randn(m, n, dtype=bf16)
    res, seeds = (torch.randn(m, n, dtype=bf16), torch.arange(m)) if p else (None, None)
    w, b = torch.ones(n, dtype=bf16), None if rms else torch.zeros(n, dtype=bf16)
    outs = traced._fwd_impl(x, w, b, res, None, None, None, None, None, seeds, 1e-5, p, rms,
                            False, p > 0, False, bf16, bf16)
    s = outs[1] if p else x
    mean, rstd = (None, outs[-1]) if rms else outs[-2:]
    traced._bwd_impl(s, w, b, None, None, mean, rstd, dy, None, dy if p else None, None, None,
                     None, seeds, p, rms, False, bf16, bf16 if p else None, None)
found = {}
for kernel, args, constexprs in launches:
    n = args[[q.name for q in kernel.params].index("N")]
    chunks = constexprs.get("NUM_CHUNKS", 1)
    found[f"{kernel.fn.__name__} N={n} chunks={chunks}"] = ptx_f64(kernel, args, constexprs)
json.dump(found, sys.stdout)
"""


@pytest.mark.slow
def test_kernels_compute_in_fp32_when_inductor_types_floats_fp64():
    """Inductor types a graph's Python floats (eps, dropout_p) as fp64, where Triton's own
    launcher says fp32; the kernels cast them, or every element's arithmetic is promoted to
    fp64 (it was: compiled forwards 1.5x, backwards 1.25x slower). The launches traced.py plans
    for an H200 are compiled for sm_90 on any machine (Triton brings ptxas), outside the
    interpreter, with their floats typed as Inductor types them."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout)
    assert any("fwd" in k for k in found) and any("bwd" in k for k in found), found
    assert found == {k: [] for k in found}, found

"""What the fast path caches (fused_norm/functional.py: ``_CALLS``, one call object per call
signature; ops: ``_PLANS``): a call that changes any property of the signature after a first
call gets the result a fresh call gets, bit for bit, and a bad call the error a fresh process
gives, word for word; a repeated signature builds nothing new; the cache is bounded.

"Fresh" here is the state after ``ops.clear_plans()`` (no plan, no call object), and for the
errors a fresh Python process. The kernels run in the Triton interpreter on CPU, where the
properties of a signature are the same as on a GPU but the device (tests marked ``gpu`` /
``multigpu`` cover devices, CUDA graph capture and a second GPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _helpers import DEVICE, assert_bitwise_equal
from hypothesis import given, settings
from hypothesis import strategies as st

import fused_norm
from fused_norm import functional, layer_norm_fn, layer_norm_ref, ops

N = 32


@pytest.fixture(autouse=True)
def _fresh():
    """Each test starts and ends with no cached plan or call object."""
    ops.clear_plans()
    yield
    ops.clear_plans()


@pytest.fixture
def constructions(monkeypatch):
    """The number of ops.KernelCall and functional._TorchCall objects built so far: a list
    whose length grows by one per construction."""
    built = []
    for cls in (ops.KernelCall, functional._TorchCall):
        init = cls.__init__

        def counted(self, *args, _init=init, **kwargs):
            built.append(type(self).__name__)
            _init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counted)
    return built


# ----------------------------------------------------------------------------------------------
# A call described by a few properties, run on data drawn from a seed
# ----------------------------------------------------------------------------------------------

BASE = dict(
    shape=(4, N), dtype=torch.float32, wdtype=None, layout="contiguous", grad="all",
    mode="grad", backend="auto", eps=1e-5, p=0.0, prenorm=False, residual=True,
    residual_in_fp32=False, x1=False, weight1=False, rowscale=False, rms=False, zcw=False,
    out_dtype=None, out=False, residual_out=False, bias=True,
)  # fmt: skip


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in another memory layout (the same logical tensor)."""
    if layout == "contiguous":
        return t
    if layout == "transposed":  # rows with a column stride: the last dim not contiguous
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "row-slice":  # rows further apart than their width
        wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 7, dtype=t.dtype, device=t.device)
        wide[..., 3 : 3 + t.shape[-1]] = t
        return wide[..., 3 : 3 + t.shape[-1]]
    if layout == "offset1":  # a view one element in: not 16-byte aligned
        flat = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
        flat[1:] = t.reshape(-1)
        return flat[1:].view(t.shape)
    if layout == "col-stride-2":
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        wide[..., ::2] = t
        return wide[..., ::2]
    raise ValueError(layout)


def _autocast(device):
    return lambda: torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


@contextlib.contextmanager
def _deterministic():
    """torch.use_deterministic_algorithms(True) inside."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def run(spec: dict, seed: int, device=DEVICE) -> list:
    """One call of ``spec`` (BASE with changes) on data from ``seed``: every output and mask,
    then (where a graph is recorded) every gradient, for a fixed upstream gradient."""
    s = dict(BASE, **spec)
    gen = torch.Generator().manual_seed(seed)
    n = s["shape"][-1]
    wdt = s["wdtype"] or s["dtype"]

    def act(dtype=s["dtype"]):
        return _layout(torch.randn(s["shape"], generator=gen).to(device, dtype), s["layout"])

    def param(center):
        return (center + 0.2 * torch.randn(n, generator=gen)).to(device, wdt)

    t = dict(x=act(), weight=param(1.0), bias=param(0.0) if s["bias"] else None,
             residual=act() if s["residual"] else None, x1=act() if s["x1"] else None,
             weight1=param(1.0) if s["weight1"] else None)  # fmt: skip
    rowscale = (torch.rand(s["shape"][:-1], generator=gen) + 0.5).to(device, s["dtype"])
    grad = s["grad"]
    for k, v in t.items():
        if v is not None and (grad == "all" or grad == k):
            v.requires_grad_()
    leaves = [v for v in t.values() if v is not None and v.requires_grad]
    bufs = {}
    if s["out"]:
        bufs["out"] = torch.full(s["shape"], 7.0, dtype=s["out_dtype"] or s["dtype"],
                                 device=device)  # fmt: skip
    if s["residual_out"] and s["prenorm"]:
        stream = t["residual"].dtype if s["residual"] else (
            torch.float32 if s["residual_in_fp32"] else s["dtype"])  # fmt: skip
        bufs["residual_out"] = torch.full(s["shape"], 7.0, dtype=stream, device=device)
    torch.manual_seed(seed)  # the dropout masks
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSED_NORM_BACKEND", s["backend"])
        ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad,
               "inference": torch.inference_mode, "autocast": _autocast(device),
               "deterministic": _deterministic}[s["mode"]]  # fmt: skip
        with ctx():
            outs = layer_norm_fn(
                t["x"], t["weight"], t["bias"], residual=t["residual"], x1=t["x1"],
                weight1=t["weight1"], eps=s["eps"], dropout_p=s["p"],
                rowscale=rowscale if s["rowscale"] else None, prenorm=s["prenorm"],
                residual_in_fp32=s["residual_in_fp32"], zero_centered_weight=s["zcw"],
                is_rms_norm=s["rms"], return_dropout_mask=True, out_dtype=s["out_dtype"],
                **bufs,
            )  # fmt: skip
    for name, buf in bufs.items():
        assert any(o is buf for o in outs), f"{name}: the caller's buffer was not returned"
    result = list(outs)
    if leaves and s["mode"] in ("grad", "autocast", "deterministic"):
        ys = [o for o in outs[: len(outs) - 2] if o is not None]
        ups = [torch.randn(y.shape, generator=gen).to(device, y.dtype) for y in ys]
        result += list(torch.autograd.grad(ys, leaves, ups, allow_unused=True))
    else:
        assert all(o is None or not o.requires_grad for o in result), "a graph was recorded"
    return result


def _y_reference(spec: dict, seed: int, outs: list) -> torch.Tensor:
    """y of ``spec``'s call on ``seed``'s data (run's, drawn again) by the fp64 reference,
    with the masks the call returned (``outs``: run's result)."""
    s = dict(BASE, **spec)
    gen = torch.Generator().manual_seed(seed)
    n, shape = s["shape"][-1], s["shape"]
    dt, wdt = s["dtype"], s["wdtype"] or s["dtype"]

    def r(v, dtype):  # the values as the call saw them: rounded to their dtype, then fp64
        return None if v is None else v.to(dtype).double()

    x = r(torch.randn(shape, generator=gen), dt)
    w = r(1.0 + 0.2 * torch.randn(n, generator=gen), wdt)
    b = r(0.2 * torch.randn(n, generator=gen), wdt) if s["bias"] else None
    res = r(torch.randn(shape, generator=gen), dt) if s["residual"] else None
    x1 = r(torch.randn(shape, generator=gen), dt) if s["x1"] else None
    if s["weight1"]:
        torch.randn(n, generator=gen)
    rowscale = r(torch.rand(shape[:-1], generator=gen) + 0.5, dt) if s["rowscale"] else None
    k = 1 + s["weight1"] + s["prenorm"]  # y, y1, residual_out, then the masks
    mask, mask1 = outs[k], outs[k + 1]
    fn = fused_norm.rms_norm_ref if s["rms"] else layer_norm_ref
    return fn(x, w, b, residual=res, x1=x1, eps=s["eps"], dropout_p=s["p"], rowscale=rowscale,
              zero_centered_weight=s["zcw"], dropout_mask=mask, dropout_mask1=mask1)  # fmt: skip


def _assert_same(a: list, b: list, what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} results against {len(b)}"
    for i, (u, v) in enumerate(zip(a, b)):
        if u is None or v is None:
            assert u is None and v is None, f"{what}: result {i}"
            continue
        assert_bitwise_equal(f"{what}: result {i}", u, v)


# (name, first call's changes, second call's changes): the second differs from the first in
# one property of the signature (or in its data alone: "same-signature").
CHANGES = [
    ("same-signature", {}, {}),
    ("dtype", {}, dict(dtype=torch.bfloat16)),
    ("weight-dtype", dict(dtype=torch.bfloat16), dict(dtype=torch.bfloat16, wdtype=torch.float32)),
    ("rows", {}, dict(shape=(7, N))),
    ("leading-dims", dict(shape=(6, N)), dict(shape=(2, 3, N))),
    ("width", {}, dict(shape=(4, N + 9))),
    ("transposed", {}, dict(layout="transposed")),
    ("row-slice", {}, dict(layout="row-slice")),
    ("col-stride-2", {}, dict(layout="col-stride-2")),
    ("offset-1", {}, dict(layout="offset1")),
    ("offset-1-back", dict(layout="offset1"), {}),
    ("no-grad", {}, dict(mode="no_grad")),
    ("grad-after-no-grad", dict(mode="no_grad"), {}),
    ("inference-mode", {}, dict(mode="inference")),
    ("autocast", {}, dict(mode="autocast")),
    ("deterministic-algorithms", {}, dict(mode="deterministic")),
    ("requires-grad-off", {}, dict(grad="none")),
    ("requires-grad-weight-only", {}, dict(grad="weight")),
    ("backend-torch", {}, dict(backend="torch")),
    ("backend-auto-after-torch", dict(backend="torch"), {}),
    ("eps", {}, dict(eps=1e-2)),
    ("dropout", {}, dict(p=0.3)),
    ("dropout-p", dict(p=0.3), dict(p=0.5)),
    ("prenorm", {}, dict(prenorm=True)),
    ("residual-in-fp32", dict(residual=False, prenorm=True),
     dict(residual=False, prenorm=True, residual_in_fp32=True)),
    ("no-residual", {}, dict(residual=False)),
    ("x1", {}, dict(x1=True, weight1=True)),
    ("rowscale", {}, dict(rowscale=True)),
    ("rms", {}, dict(rms=True, bias=False)),
    ("zero-centered", {}, dict(zcw=True)),
    ("out-dtype", dict(dtype=torch.bfloat16), dict(dtype=torch.bfloat16, out_dtype=torch.float32)),
    ("out-buffers", dict(prenorm=True), dict(prenorm=True, out=True, residual_out=True)),
    ("new-out-buffers", dict(prenorm=True, out=True, residual_out=True),
     dict(prenorm=True, out=True, residual_out=True)),
    ("no-out-buffers", dict(prenorm=True, out=True, residual_out=True), dict(prenorm=True)),
]  # fmt: skip


@pytest.mark.parametrize("first, second", [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES])
def test_changed_property_gets_the_fresh_result(first, second, constructions):
    """After a first call, a call that changes one property of the signature (or only its
    data) returns, bit for bit, what the same call returns with nothing cached: outputs,
    masks and gradients; its y matches the fp64 reference (with the masks it returned)."""
    run(first, seed=1)
    built = len(constructions)
    got = run(second, seed=2)
    if first == second:
        assert len(constructions) == built, "a repeated signature built a new call object"
    ops.clear_plans()
    want = run(second, seed=2)
    _assert_same(got, want, "cached vs fresh")
    ref = _y_reference(second, 2, got)
    y = got[0]
    # a 16-bit stream is normalised as stored (rounded): 16-bit tolerances then
    tol = 1e-5 if dict(BASE, **second)["dtype"] == torch.float32 else 2**-6
    torch.testing.assert_close(y.double(), ref.to(y.device), rtol=tol, atol=tol)


def test_repeated_call_builds_nothing_new(constructions):
    """A signature's first call builds one call object; its later calls, forward and
    backward, with new data, build none (and plan nothing new)."""
    spec = dict(p=0.2, prenorm=True, x1=True, weight1=True)
    run(spec, seed=1)
    assert constructions == ["KernelCall"], constructions
    plans = dict(ops._PLANS)
    for seed in (2, 3, 4):
        run(spec, seed)
    assert constructions == ["KernelCall"], constructions
    assert ops._PLANS == plans, "a repeated signature planned again"
    run(dict(spec, backend="torch"), seed=5)
    run(dict(spec, backend="torch"), seed=6)
    assert constructions == ["KernelCall", "_TorchCall"], constructions


def test_same_signature_different_data_is_not_stale():
    """A cached call computes on each call's own tensors: the second call's outputs are those
    of its data, not the first's."""
    a = run({}, seed=1)
    b = run({}, seed=2)
    assert not torch.equal(a[0], b[0])
    ops.clear_plans()
    _assert_same(run({}, seed=2), b, "second call vs fresh")


def test_call_cache_is_bounded(monkeypatch, constructions):
    """functional._MAX_CALLS bounds the signatures kept: past it the cache starts again (the
    oldest signatures are built anew, the latest found), and every call is right."""
    monkeypatch.setattr(functional, "_MAX_CALLS", 4)
    x = torch.randn(2, N, device=DEVICE)
    w = torch.ones(N, device=DEVICE)
    epss = [1e-5 * (i + 1) for i in range(11)]  # a signature each
    for eps in epss:
        y = layer_norm_fn(x, w, None, eps=eps)
        assert len(functional._CALLS) <= 4, len(functional._CALLS)
        torch.testing.assert_close(y, layer_norm_ref(x, w, None, eps=eps), rtol=1e-5, atol=1e-5)
    assert len(constructions) == len(epss)
    layer_norm_fn(x, w, None, eps=epss[-1])  # the latest is kept
    assert len(constructions) == len(epss)
    layer_norm_fn(x, w, None, eps=epss[0])  # the first was let go
    assert len(constructions) == len(epss) + 1


def test_default_bound_is_generous():
    assert functional._MAX_CALLS >= 256


# ----------------------------------------------------------------------------------------------
# Bad calls after good ones: the error of a fresh process
# ----------------------------------------------------------------------------------------------


class T(str):
    """A tensor argument of a call, by the name of its builder in _materialise."""


# (name, good call's kwargs, bad call's kwargs) for layer_norm_fn(x, weight, None, **kwargs);
# x and weight default to a (3, 8) fp32 tensor and ones of 8.
BAD_AFTER_GOOD = [
    ("x-int", {}, dict(x=T("int"))),
    ("x-fp64", {}, dict(x=T("fp64"))),
    ("x-0-d", {}, dict(x=T("scalar"))),
    ("x-list", {}, dict(x=[[1.0] * 8] * 3)),
    ("weight-shape", {}, dict(weight=T("wide-vector"))),
    ("weight-none", {}, dict(weight=None)),
    ("weight-other-device", {}, dict(weight=T("meta-vector"))),
    ("residual-shape", dict(residual=T("rows")), dict(residual=T("wide-rows"))),
    ("residual-int", dict(residual=T("rows")), dict(residual=T("int"))),
    ("bias1-without-weight1", {}, dict(bias1=T("vector"))),
    ("rowscale-shape", dict(rowscale=T("scales")), dict(rowscale=T("rows"))),
    ("dropout-p-1", dict(dropout_p=0.5), dict(dropout_p=1.0)),
    ("dropout-p-nan", dict(dropout_p=0.5), dict(dropout_p=float("nan"))),
    ("dropout-p-str", dict(dropout_p=0.5), dict(dropout_p="0.5")),
    ("eps-negative", dict(eps=1e-5), dict(eps=-1e-5)),
    ("eps-inf", dict(eps=1e-5), dict(eps=float("inf"))),
    ("eps-list", dict(eps=1e-5), dict(eps=[1e-5])),
    ("out-dtype", dict(out_dtype=torch.float32), dict(out_dtype=torch.int32)),
    ("out-shape", dict(out=T("rows")), dict(out=T("wide-rows"))),
    ("out-dtype-buffer", dict(out=T("rows")), dict(out=T("fp16"))),
    ("out-col-stride", dict(out=T("rows")), dict(out=T("col-stride-2"))),
    ("residual-out-dtype", dict(prenorm=True, residual_out=T("rows")),
     dict(prenorm=True, residual_out=T("fp16"))),
    ("backend", {}, dict(backend="cuda")),
    # A scalar of a refused type that equals (and hashes as) a good value of the good call.
    ("dropout-p-false", dict(dropout_p=0.0), dict(dropout_p=False)),
    ("eps-true", dict(eps=1.0), dict(eps=True)),
]  # fmt: skip
_IDS = [getattr(c, "values", c)[0] for c in BAD_AFTER_GOOD]


def _materialise(kwargs: dict, device):
    """(x, weight, kwargs) of a call: T(...) values built, others as they are."""
    n = 8
    build = {
        "rows": lambda: torch.randn(3, n, device=device),
        "wide-rows": lambda: torch.ones(3, n + 1, device=device),
        "int": lambda: torch.ones(3, n, dtype=torch.int32, device=device),
        "fp64": lambda: torch.ones(3, n, dtype=torch.float64, device=device),
        "fp16": lambda: torch.ones(3, n, dtype=torch.float16, device=device),
        "col-stride-2": lambda: torch.ones(3, 2 * n, device=device)[:, ::2],
        "scalar": lambda: torch.tensor(1.0, device=device),
        "vector": lambda: torch.ones(n, device=device),
        "wide-vector": lambda: torch.ones(n + 1, device=device),
        "meta-vector": lambda: torch.ones(n, device="meta"),
        "scales": lambda: torch.rand(3, device=device) + 0.5,
    }
    kw = {k: build[v]() if isinstance(v, T) else v for k, v in kwargs.items()}
    x = kw.pop("x", None) if "x" in kw else build["rows"]()
    weight = kw.pop("weight") if "weight" in kw else build["vector"]()
    return x, weight, kw


def _call(kwargs: dict, device):
    """layer_norm_fn(x, weight, None, **kwargs) with FUSED_NORM_BACKEND as kwargs say (as
    the environment has it by default: unset)."""
    kwargs = dict(kwargs)
    backend = kwargs.pop("backend", None)
    x, weight, kw = _materialise(kwargs, device)
    old = os.environ.pop("FUSED_NORM_BACKEND", None)
    if backend is not None:
        os.environ["FUSED_NORM_BACKEND"] = backend
    try:
        return layer_norm_fn(x, weight, None, **kw)
    finally:
        os.environ.pop("FUSED_NORM_BACKEND", None)
        if old is not None:
            os.environ["FUSED_NORM_BACKEND"] = old


def _error(kwargs: dict, device) -> tuple:
    """(exception type name, message) of the call, or (None, None) where it succeeds."""
    try:
        _call(kwargs, device)
    except (TypeError, ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return None, None


_FRESH_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import test_fast_path as t
    out = {}
    for case in t.BAD_AFTER_GOOD:
        name, good, bad = getattr(case, "values", case)
        out[name] = t._error(bad, t.DEVICE)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def fresh_errors():
    """Each bad call's (exception type, message) in a fresh Python process (no call made
    before it succeeded, so nothing cached)."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(os.path.abspath(fused_norm.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, here, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _FRESH_SCRIPT, here], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {k: tuple(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("name, good, bad", BAD_AFTER_GOOD, ids=_IDS)
def test_bad_call_after_good_one_raises_as_in_a_fresh_process(name, good, bad, fresh_errors):
    """A bad call made right after a good call of a like signature raises the exception, with
    the message, that it raises in a fresh process; and the good call still works after it."""
    _call(good, DEVICE)
    got = _error(bad, DEVICE)
    want = fresh_errors[name]
    assert want[0] is not None, f"{name}: the fresh process raised nothing"
    assert got == want, f"{name}: after a good call {got}, in a fresh process {want}"
    _call(good, DEVICE)


# ----------------------------------------------------------------------------------------------
# The launches a signature keeps (fused_norm/launch.py)
# ----------------------------------------------------------------------------------------------

try:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
except ImportError:  # another Triton layout
    native_specialize_impl = None

_BUF = {d: torch.zeros(4096, dtype=d) for d in (torch.float32, torch.bfloat16, torch.float16)}


@st.composite
def views(draw):
    """A 2-D or 3-D view into a buffer: any dtype, offset, shape and row stride."""
    dtype = draw(st.sampled_from(list(_BUF)))
    n = draw(st.sampled_from([1, 2, 8, 16, 17, 32, 48]))
    rows = draw(st.integers(1, 9))
    pad = draw(st.sampled_from([0, 0, 1, 8, 16]))
    offset = draw(st.integers(0, 40))
    t = _BUF[dtype][offset : offset + rows * (n + pad)].view(rows, n + pad)[:, :n]
    if draw(st.booleans()) and rows % 3 == 0:
        t = t.view(3, rows // 3, n)
    return t


def _triton_specs(t) -> tuple:
    """Triton's specialisation of what a launch derives from ``t``: its address, its row
    stride, its row count and width."""
    from fused_norm.checks import row_stride

    n = t.shape[-1]
    values = (t, row_stride(t) or n, t.numel() // n, n)
    return tuple(native_specialize_impl(BaseBackend, v, False, True, True) for v in values)


@pytest.mark.skipif(native_specialize_impl is None, reason="Triton's specialiser not importable")
@settings(max_examples=200, deadline=None)
@given(st.lists(views(), min_size=2, max_size=30))
def test_signature_at_least_as_fine_as_tritons_specialisation(tensors):
    """A signature's launches call the kernel compiled at its first call (launch.Compiled):
    tensors of one signature (functional._spec) must get one Triton specialisation of every
    argument the launch derives from them (16-byte alignment of the address, strides and sizes
    divisible by 16 or equal to 1)."""
    seen = {}
    for t in tensors:
        key = functional._spec(t)
        spec = _triton_specs(t)
        if key in seen:
            assert seen[key][1] == spec, f"{seen[key][0].stride()} and {t.stride()} share {key}"
        else:
            seen[key] = (t, spec)


def test_launch_options_ask_for_fp_fusion():
    """Every launch asks for floating-point fusion (FMA contraction) by name, the default the
    kernels were measured with, whatever Triton's default; a register cap only where given."""
    from fused_norm import launch

    assert launch.options(4) == {"num_warps": 4, "enable_fp_fusion": True}
    assert launch.options(8, 64) == {"num_warps": 8, "enable_fp_fusion": True, "maxnreg": 64}


def test_a_forked_child_forgets_the_parents_compiles():
    """A forked child has none of its parent's threads: launch's fork hook drops the pool of
    background compiles, which the child would otherwise wait on for ever."""
    from fused_norm import launch

    pool = launch._pool()
    assert launch._pool() is pool
    if not (hasattr(os, "fork") and sys.platform == "linux"):
        pytest.skip("no fork here")
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the fork hook ran
        os._exit(0 if launch._POOL is None else 1)
    assert os.waitpid(pid, 0)[1] == 0, "the fork hook did not forget the pool"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 37])
def test_gpu_direct_launch_equals_jit_launch(monkeypatch, rows):
    """Outputs and gradients bitwise equal through the direct launch (launch.Compiled: second
    and later calls of a signature) and through ``kernel[grid]`` (launch.DIRECT off), also on
    misaligned inputs, which are a signature of their own with a kernel of their own."""
    from fused_norm import launch

    n = 1000
    torch.manual_seed(0)
    buf = torch.randn(rows * n + 1, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", requires_grad=True)
    b = torch.randn(n, device="cuda", requires_grad=True)
    dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)

    def step(x, res):
        y, r = layer_norm_fn(x, w, b, residual=res, prenorm=True, dropout_p=0.1)
        return (y, r) + torch.autograd.grad((y, r), (x, w, b, res), (dy, dy))

    results = {}
    for name, x0 in (("aligned", buf[:-1]), ("misaligned", buf[1:])):
        x = x0.view(rows, n).detach().requires_grad_()
        res = (x0.view(rows, n) * 0.5).detach().requires_grad_()
        for direct in (True, False):
            ops.clear_plans()
            monkeypatch.setattr(launch, "DIRECT", direct and launch.DIRECT)
            outs = []
            for _ in range(3):  # the first call of a signature goes through kernel[grid]
                torch.manual_seed(1)
                outs.append(step(x, res))
            results[name, direct] = outs
    monkeypatch.undo()
    ops.clear_plans()
    if not launch.DIRECT:
        pytest.skip("the direct launch is off here (FUSED_NORM_FAST_LAUNCH or Triton)")
    for name in ("aligned", "misaligned"):
        ref = results[name, False][0]
        for outs in results[name, True] + results[name, False]:
            for a, c in zip(ref, outs):
                assert torch.equal(a, c), name


@pytest.mark.gpu
def test_gpu_launch_hooks_see_every_launch():
    """With a launch hook set (a profiler's), every call goes through ``kernel[grid]``, where
    Triton calls the hook: later calls of a signature too, not only its first."""
    from triton import knobs

    x = torch.randn(8, 256, device="cuda")
    w = torch.ones(256, device="cuda")
    layer_norm_fn(x, w, None)  # the signature's first call
    seen = []

    def hook(*args, **kwargs):
        seen.append(1)

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # Triton's HookChain
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        for _ in range(3):
            layer_norm_fn(x, w, None)
        torch.cuda.synchronize()
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert len(seen) >= 3, f"the hook saw {len(seen)} launches of 3 calls"


# ----------------------------------------------------------------------------------------------
# Devices, CUDA graph capture
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_cpu_call_then_cuda_call():
    """The same signature on the CPU (the PyTorch path, or the interpreter) and then on a GPU:
    the device is part of the signature, each call's outputs are on its own device and right."""
    cpu = run({}, seed=1, device="cpu")
    gpu = run({}, seed=1, device="cuda")
    assert all(t is None or t.device.type == "cuda" for t in gpu)
    for a, b in zip(cpu, gpu):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_capture_after_eager_call_of_the_signature():
    """A signature called eagerly, then captured into a CUDA graph, then called eagerly again:
    under capture the dropout seeds come from the device (ops.dropout_key gives no key there),
    so each replay draws fresh masks; every replay matches the reference given its masks, and
    the eager calls around the capture are right too."""
    torch.manual_seed(0)
    m, n, p = 64, 512, 0.3
    x = torch.randn(m, n, device="cuda")
    w = (1 + 0.1 * torch.randn(n, device="cuda")).requires_grad_()
    res = torch.randn(m, n, device="cuda")

    def call():
        return layer_norm_fn(x, w, None, residual=res, dropout_p=p, prenorm=True,
                             return_dropout_mask=True)  # fmt: skip

    def check(y, s, mask, what):
        ref_y, ref_s = layer_norm_ref(x, w.detach(), None, residual=res, dropout_p=p,
                                      prenorm=True, dropout_mask=mask, upcast=True)  # fmt: skip
        torch.testing.assert_close(y, ref_y, rtol=1e-4, atol=1e-4, msg=what)
        torch.testing.assert_close(s, ref_s, rtol=1e-5, atol=1e-5, msg=what)

    y, s, mask, _ = call()  # eager: the signature's call object and its kernels
    check(y.detach(), s, mask, "eager before capture")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gy, gs, gmask, _ = call()
    masks = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        masks.append(gmask.clone())
        check(gy.detach(), gs, gmask, "replay")
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2]), (
        "two replays drew the same masks: a seed was baked into the graph"
    )
    y2, s2, mask2, _ = call()
    check(y2.detach(), s2, mask2, "eager after capture")
    assert not torch.equal(mask2, mask)


@pytest.mark.multigpu
def test_gpu_same_signature_on_a_second_gpu():
    """The same shapes and flags on cuda:0 and then on cuda:1 (and back): each call runs on its
    tensors' device, with that device's plan, and gives the result of the same call alone."""
    runs = {}
    for dev in ("cuda:0", "cuda:1", "cuda:0"):
        runs.setdefault(dev, []).append(run(dict(p=0.0, x1=True, weight1=True), 3, device=dev))
    for outs in runs["cuda:1"]:
        assert all(t is None or t.device == torch.device("cuda:1") for t in outs)
    _assert_same(runs["cuda:0"][0], runs["cuda:0"][1], "cuda:0 before and after cuda:1")
    _assert_same(
        runs["cuda:0"][0],
        [t if t is None else t.to("cuda:0") for t in runs["cuda:1"][0]],
        "cuda:0 vs cuda:1",
    )

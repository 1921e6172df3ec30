"""The direct launch path (fused_norm/launch.py).

It reuses a compiled kernel for every call whose key matches, so the key must separate every
pair of calls that Triton itself would compile differently: checked here against Triton's own
argument specialiser (CPU), and on the GPU by comparing the direct path with ``kernel[grid]``
on inputs that change the specialisation (misaligned pointers, a single row).
"""

from __future__ import annotations

import itertools
import sys

import pytest
import torch
from _helpers import DEVICE, max_block_bytes, patched_config
from hypothesis import given, settings
from hypothesis import strategies as st

import fused_norm
from fused_norm import config, launch, ops

try:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
except ImportError:  # another Triton layout: the direct path is then off (launch.FAST_LAUNCH)
    native_specialize_impl = None

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool)
_BUF = {d: torch.zeros(64, dtype=d) for d in DTYPES}

# Integers around every boundary Triton cares about (1, multiples of 16, the i32/i64/u64 ranges).
_EDGES = [0, 1, 2, 15, 16, 17, 48, 4096, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**32,
          2**63 - 16, 2**63, 2**63 + 16, 2**64 - 16]  # fmt: skip
ints = st.one_of(st.sampled_from(_EDGES), st.integers(0, 2**64 - 1), st.integers(-(2**40), -1))
tensors = st.builds(lambda d, off: _BUF[d][off:], st.sampled_from(DTYPES), st.integers(0, 31))
args = st.one_of(ints, tensors, st.floats(allow_nan=False), st.none(), st.booleans())


def _triton_spec(a, loose=False):
    """Triton's specialisation of ``a``; ``loose``: of a ``do_not_specialize`` parameter."""
    return native_specialize_impl(BaseBackend, a, False, not loose, True)


@pytest.mark.skipif(native_specialize_impl is None, reason="Triton's specialiser not importable")
@pytest.mark.parametrize("loose", [False, True], ids=["specialised", "do_not_specialize"])
@settings(max_examples=300, deadline=None)
@given(st.lists(args, min_size=2, max_size=40))
def test_key_at_least_as_fine_as_tritons(loose, values):
    """Arguments with one launch key also have one Triton specialisation (type and hints), also
    for parameters the kernel does not specialise on (Triton keeps only an integer's type, a
    pointer's dtype)."""
    seen = {}
    for a in values:
        key = launch.arg_key([a], (loose,))
        spec = _triton_spec(a, loose)
        if key in seen:
            assert seen[key][1] == spec, f"{seen[key][0]!r} and {a!r} share key {key}"
        else:
            seen[key] = (a, spec)


def test_key_separates_alignment_and_unit_values():
    x = torch.zeros(64, dtype=torch.bfloat16)
    assert launch.arg_key([x]) != launch.arg_key([x[1:]])  # 2 bytes off 16-byte alignment
    assert launch.arg_key([x]) == launch.arg_key([x[8:]])  # 16 bytes on: same
    assert launch.arg_key([1]) != launch.arg_key([17]) == launch.arg_key([33])
    assert launch.arg_key([16]) != launch.arg_key([2**31 + 16])


def test_launch_arguments_pass_tensors_as_their_addresses():
    """The direct path hands Triton's launcher each tensor's address (an int it takes as the
    pointer), every other argument as it is, and the same key as arg_key."""
    x = torch.zeros(64, dtype=torch.bfloat16)
    args = [x, x[3:], None, 7, 2.5, True]
    key, launch_args = launch.key_and_pointers(args)
    assert key == launch.arg_key(args)
    assert launch_args == [x.data_ptr(), x.data_ptr() + 6, None, 7, 2.5, True]
    assert all(type(a) is int for a in launch_args[:2])


def _step(x, w, b, res, dy):
    y, r = fused_norm.layer_norm_fn(x, w, b, residual=res, prenorm=True, dropout_p=0.1)
    return (y, r) + torch.autograd.grad((y, r), (x, w, b, res), (dy, dy))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 37])
def test_direct_launch_equals_jit_launch(monkeypatch, rows):
    """Outputs and gradients bitwise equal through the direct path (second and later calls)
    and through ``kernel[grid]``, also on misaligned inputs, which need their own kernel."""
    n = 1000
    torch.manual_seed(0)
    buf = torch.randn(rows * n + 1, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(n, device=DEVICE, requires_grad=True)
    b = torch.randn(n, device=DEVICE, requires_grad=True)
    dy = torch.randn(rows, n, device=DEVICE, dtype=torch.bfloat16)
    results = {}
    for name, x0 in (("aligned", buf[:-1]), ("misaligned", buf[1:])):
        x = x0.view(rows, n).detach().requires_grad_()
        res = (x0.view(rows, n) * 0.5).detach().requires_grad_()
        for fast in (True, False):
            outs = []
            for _ in range(3):  # the first call of a key goes through kernel[grid] anyway
                with monkeypatch.context() as mp:
                    for lau in ops.launchers():
                        mp.setattr(lau, "fast", fast and lau.fast)
                    torch.manual_seed(1)
                    outs.append(_step(x, w, b, res, dy))
            results[name, fast] = outs
    if not ops._FWD.fast:
        pytest.skip("the direct launch path is off here (FUSED_NORM_FAST_LAUNCH or Triton)")
    for name in ("aligned", "misaligned"):
        ref = results[name, False][0]
        for outs in results[name, True] + results[name, False]:
            for a, b_ in zip(ref, outs):
                assert torch.equal(a, b_), name
    keys = [k for k in ops._FWD.cache if k[3][0] == 1024]
    aligned = {k[4][0][1] for k in keys}  # X's alignment residue
    assert {0, 2} <= aligned, "the misaligned x did not get its own compiled kernel"


@pytest.mark.gpu
def test_backward_compiles_during_first_forward(monkeypatch):
    """The first forward of a configuration starts compiling its backward in the background
    (with the outputs standing in for their gradients); the backward then launches exactly
    that kernel, and its gradients equal those of a run without the warm-up."""
    if not ops._FWD.fast:
        pytest.skip("the direct launch path is off here (FUSED_NORM_FAST_LAUNCH or Triton)")
    n, rows = 3000, 19  # a width no other test uses
    torch.manual_seed(0)
    x = torch.randn(rows, n, device=DEVICE, dtype=torch.float16, requires_grad=True)
    res = torch.randn(rows, n, device=DEVICE, dtype=torch.float32, requires_grad=True)
    w = torch.randn(n, device=DEVICE, dtype=torch.float16, requires_grad=True)
    dy = torch.randn(rows, n, device=DEVICE, dtype=torch.float16)
    dres = torch.randn(rows, n, device=DEVICE, dtype=torch.float32)

    def run():
        y, r = fused_norm.rms_norm_fn(x, w, None, residual=res, prenorm=True, dropout_p=0.2,
                                      zero_centered_weight=True)  # fmt: skip
        return (y, r) + torch.autograd.grad((y, r), (x, w, res), (dy, dres))

    for lau in ops.launchers():
        monkeypatch.setattr(lau, "cache", {})
        monkeypatch.setattr(lau, "pending", {})
    torch.manual_seed(1)
    y, r = fused_norm.rms_norm_fn(x, w, None, residual=res, prenorm=True, dropout_p=0.2,
                                  zero_centered_weight=True)  # fmt: skip
    # (one compile: its key, and its fallback's where the pipelined kernel may not fit)
    assert len(set(ops._BWD.pending.values())) == 1, "the first forward did not start it"
    got = (y, r) + torch.autograd.grad((y, r), (x, w, res), (dy, dres))
    assert not ops._BWD.pending, "the backward launched a kernel other than the one warmed up"
    assert len(ops._BWD.cache) == 1
    for lau in ops.launchers():
        monkeypatch.setattr(lau, "fast", False)
    torch.manual_seed(1)
    want = run()
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def _compiled_nothing(monkeypatch):
    """Empty fused_norm's and Triton's in-memory caches of compiled kernels (and fused_norm's
    plans), as in a process that has compiled nothing; skip where the direct path is off."""
    from collections import defaultdict

    if not ops._FWD.fast:
        pytest.skip("the direct launch path is off here (FUSED_NORM_FAST_LAUNCH or Triton)")
    for lau in ops.launchers():
        monkeypatch.setattr(lau, "cache", {})
        monkeypatch.setattr(lau, "pending", {})
        monkeypatch.setattr(lau, "warm_error", None)
        if hasattr(lau.kernel, "device_caches"):  # Triton's in-memory kernel cache
            monkeypatch.setattr(lau.kernel, "device_caches", defaultdict(lau.kernel.create_binder))
    for name in ("_FWD_PLANS", "_BWD_PLANS", "_RESIDENT", "_STAGES_THAT_FIT", "_OP_KPLANS"):
        monkeypatch.setattr(ops, name, {})


def _first_forward(call, xd, wd, n, rows=8):
    """(outputs, leaves) of a forward that needs gradients: "all" is LayerNorm with residual,
    x1, weight1 and bias1, dropout, rowscale, prenorm and zero-centred weights; "drop_add"
    dropout + add + LayerNorm, prenorm."""
    torch.manual_seed(0)

    def act(dtype):
        return torch.randn(rows, n, device=DEVICE, dtype=dtype, requires_grad=True)

    x, res = act(xd), act(xd)
    w, b = (torch.randn(n, device=DEVICE, dtype=wd, requires_grad=True) for _ in range(2))
    if call == "all":
        x1 = act(xd)
        w1, b1 = (torch.randn(n, device=DEVICE, dtype=wd, requires_grad=True) for _ in range(2))
        rowscale = torch.rand(rows, device=DEVICE) + 0.5
        outs = fused_norm.layer_norm_fn(
            x, w, b, residual=res, x1=x1, weight1=w1, bias1=b1, dropout_p=0.1, rowscale=rowscale,
            prenorm=True, zero_centered_weight=True,
        )  # fmt: skip
        return outs, (x, res, x1, w, b, w1, b1)
    outs = fused_norm.layer_norm_fn(x, w, b, residual=res, dropout_p=0.1, prenorm=True)
    return outs, (x, res, w, b)


# (call, x dtype, weight dtype, N): the backward's kernel with its partials' sum (16384: the sum
# unpipelined, unlike the warm-up's bound on the grid), with the row-sums pre-pass and its
# shares' sum (262144), its unpipelined variant (fp32 weights: 3 stages do not fit), and
# smem_kernels' backward (12288).
_FIRST_BACKWARDS = [
    ("all", torch.bfloat16, torch.bfloat16, 16384),
    ("all", torch.bfloat16, torch.bfloat16, 262144),
    ("all", torch.bfloat16, torch.float32, 16384),
    ("drop_add", torch.float16, torch.float16, 12288),
]


# solo (scripts/gpu_test.sh): it watches a process's first compiles. Beside seven other workers
# compiling on the same card it failed once in four parallel runs (the backward compiled the
# smem kernel at 12288 again) and it passed alone, 2026-11-28. Launcher.warm_error now keeps
# a warm-up's failure, and the assertion prints it.
@pytest.mark.gpu
@pytest.mark.solo
@pytest.mark.parametrize("call,xd,wd,n", _FIRST_BACKWARDS)
def test_first_backward_compiles_nothing_the_warm_up_did_not(monkeypatch, call, xd, wd, n):
    """In a process that has compiled nothing, the first forward's warm-up compiles every
    kernel its backward then launches: the backward itself calls Triton's compiler for none of
    them (its launch keys, its grid query and its fallback for kernels that do not fit all find
    the warm-up's). Each kernel compiled again there had cost a first call 0.3-1.2 s
    (bench/first_call.py, bench/NOTES.md #85). (The launchers the warm-up also builds go to
    Triton's on-disk cache, which this test leaves as it is: not counted here.)"""
    from triton import knobs

    _compiled_nothing(monkeypatch)
    compiled = []
    monkeypatch.setattr(knobs.compilation, "listener",
                        lambda **kw: compiled.append(getattr(getattr(kw["src"], "fn", None),
                                                             "__name__", "?")))  # fmt: skip
    outs, leaves = _first_forward(call, xd, wd, n)
    assert compiled, "the forward compiled nothing: the caches were not emptied"
    for lau in ops.launchers():
        for future in list(lau.pending.values()):
            future.result()
    compiled.clear()
    grads = torch.autograd.grad(outs, leaves, [torch.randn_like(o) for o in outs])
    errors = [lau.warm_error for lau in ops.launchers() if lau.warm_error]
    assert compiled == [], f"the backward compiled {compiled}; warm-up failures: {errors}"
    assert all(torch.isfinite(g).all() for g in grads)


# Pipelined backward kernels of kernels.py (call, x dtype, weight dtype, N): the x1 path's
# 16-bit rows with fp32 weights (256 KB: cannot load), with bf16 weights (192 KB; at 12288-16384
# columns smem_kernels' backward takes those), fp32 rows in two stages.
_PIPELINED = [
    ("all", torch.bfloat16, torch.float32, 16384),
    ("all", torch.bfloat16, torch.bfloat16, 8192),
    ("drop_add", torch.float32, torch.float32, 8192),
    ("drop_add", torch.bfloat16, torch.float32, 4096),
]


@pytest.mark.gpu
@pytest.mark.parametrize("call,xd,wd,n", _PIPELINED)
def test_pipeline_bytes_bound_the_compiled_kernel(monkeypatch, call, xd, wd, n):
    """config.bwd_pipeline_bytes is a lower bound on the shared memory of the pipelined
    backward kernel as this Triton compiles it: where it exceeds the device's limit, the
    warm-up compiles the launch's unpipelined fallback as its own job beside the pipelined
    kernel (ops._overflows), which must then truly not fit; elsewhere the fallback is left to
    the warm-up's check after the compile (launch._fits)."""
    from fused_norm import config

    _compiled_nothing(monkeypatch)
    warms, checks = [], []
    warm, overflows = ops._BWD.warm, ops._overflows

    def spy_warm(*args, **kwargs):
        warms.append((args, kwargs))
        return warm(*args, **kwargs)

    def spy_overflows(dev, flags, *tensors):
        checks.append((flags, ops._pipeline_bytes(flags, *tensors)))
        return overflows(dev, flags, *tensors)

    monkeypatch.setattr(ops._BWD, "warm", spy_warm)
    monkeypatch.setattr(ops, "_overflows", spy_overflows)
    _first_forward(call, xd, wd, n)
    assert len(checks) == 1, checks
    flags, need = checks[0]
    assert flags["ROW_STAGES"] > 1 and need > 0, flags
    pipelined = [w for w in warms if w[0][3]["ROW_STAGES"] > 1]
    assert len(pipelined) == 1, warms
    (grid, dev, args, _, warps), kwargs = pipelined[0]
    options = launch._options(warps, None, kwargs.get("maxnreg"))
    compiled = ops._BWD._warmup(grid, args, flags, options)
    shared = compiled.metadata.shared
    assert shared >= need, f"{shared} bytes compiled, below the bound {need}"
    limit = config.max_shared(dev.index)
    if need > limit:  # the fallback compiles as its own job, beside the pipelined kernel
        assert [w[0][3]["ROW_STAGES"] for w in warms] == [1, flags["ROW_STAGES"]], warms
        assert shared > limit
    else:
        assert len(warms) == 1 and warms[0][1].get("fallback") is not None, warms
    for future in list(ops._BWD.pending.values()):
        future.result()


# The child of test_first_call_does_triton_start_up_and_each_launcher_build_once: a first
# forward + backward in a fresh process, with counters on Triton's start-up and C builds.
_FIRST_CALL_CHILD = """
import hashlib, importlib, json, threading
import torch, triton.runtime.build as build, triton.runtime.cache as cache
import fused_norm
from fused_norm import launch
drivers = importlib.import_module("triton.runtime.driver")  # (triton.runtime.driver: an object)
drivers_made, builds = [], []
_create, _build = drivers._create_driver, build._build
def create():
    drivers_made.append(threading.current_thread().name)
    return _create()
def compile_c(name, src, *args, **kwargs):
    with open(src, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    builds.append((name, threading.current_thread().name, digest))
    return _build(name, src, *args, **kwargs)
drivers._create_driver, build._build = create, compile_c
n, rows = 16384, 8
def act(dtype=torch.bfloat16, shape=(rows, n)):
    return torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
x, res, x1, w, b, w1, b1 = act(), act(), act(), act(shape=n), act(shape=n), act(shape=n), act(shape=n)
outs = fused_norm.layer_norm_fn(x, w, b, residual=res, x1=x1, weight1=w1, bias1=b1,
                                dropout_p=0.1, prenorm=True)
grads = torch.autograd.grad(outs, (x, res, x1, w, b, w1, b1), [torch.ones_like(o) for o in outs])
torch.cuda.synchronize()
print(json.dumps({"key_misses": cache.triton_key.cache_info().misses, "drivers": drivers_made,
                  "builds": builds, "per_signature": launch._builds_launchers()}))
"""


@pytest.mark.gpu
def test_first_call_does_triton_start_up_and_each_launcher_build_once(tmp_path):
    """In a fresh process with an empty Triton cache, the first forward + backward creates
    Triton's driver once and hashes Triton's files (triton_key) once (launch._start_up), where
    each thread that compiled at once had done both itself; and each kernel's C launcher is
    built once, in a builds' thread beside its compile (Launcher._prebuild), never again by a
    launch. bench/NOTES.md #86: 0.5-1.4 s of a first forward."""
    import json
    import os
    import subprocess

    if not ops._FWD.fast:
        pytest.skip("the direct launch path is off here (FUSED_NORM_FAST_LAUNCH or Triton)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(fused_norm.__file__)))
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-P", "-c", _FIRST_CALL_CHILD], env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["key_misses"] == 1, got
    assert len(got["drivers"]) == 1, got["drivers"]
    launchers = [b for b in got["builds"] if b[0] == "__triton_launcher"]
    if got["per_signature"]:
        assert launchers, "no launcher was built: the cache was not cold"
    assert all(t.startswith("fused_norm-build") for _, t, _ in launchers), launchers
    sources = [d for _, _, d in launchers]
    assert len(sources) == len(set(sources)), f"a launcher was built twice: {launchers}"


def test_a_forked_child_forgets_the_parents_compiles():
    """A forked child has none of its parent's threads: launch._forget_pools (run after a fork)
    drops the pools, Triton's start-up jobs, the launcher builds and every Launcher's pending
    compiles, which the child would otherwise wait on for ever."""
    import concurrent.futures
    import os

    never = concurrent.futures.Future()  # a compile the parent had under way
    lau = launch.Launcher(ops._fused_norm_fwd_kernel)
    lau.pending["key"] = never
    launch._LAUNCHERS_BUILT[("*fp32",)] = never
    saved = launch._WARM_POOL, launch._BUILD_POOL, launch._START_UP, launch._POOL_LOCK
    try:
        launch._forget_pools()
        assert lau.pending == {} and launch._LAUNCHERS_BUILT == {}
        assert launch._WARM_POOL is launch._BUILD_POOL is launch._START_UP is None
    finally:
        launch._WARM_POOL, launch._BUILD_POOL, launch._START_UP, launch._POOL_LOCK = saved
    if hasattr(os, "fork") and sys.platform == "linux":
        lau.pending["key"] = never
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the fork hook ran
            os._exit(0 if not lau.pending else 1)
        assert os.waitpid(pid, 0)[1] == 0, "the fork hook did not forget the pending compile"


def test_joint_statistics_rule():
    """LayerNorm's one-block rows take the joint sum of (s, s^2) except one whole 16K 16-bit
    block without dropout or x1 (config.fwd_joint_stats, bench/NOTES.md #32)."""
    from fused_norm import config

    assert not config.fwd_joint_stats(16384, 0, 2, False, False)
    for args in ((16384, 4096, 2, False, False), (16384, 0, 4, False, False),
                 (16384, 0, 2, True, False), (16384, 0, 2, False, True),
                 (8192, 0, 2, False, False), (32768, 0, 2, False, False)):  # fmt: skip
        assert config.fwd_joint_stats(*args), args


def test_hold_rule():
    """Forward rows are held in 16 bits (config.FWD_HOLD, bench/NOTES.md #37) where their sum
    is x itself in bf16 or fp16 and the row is split; the stream is held only under
    FWD_HOLD = True, and rows that are not split never. 64 KB rows split only with dropout or
    x1 in 16 bits; norms of x alone there, and at 8K-16K columns, run as lane-summed chunks
    (config.FWD_LANE_CHUNKS, NOTES #39-#40)."""
    from fused_norm import config

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert config.fwd_hold_kind(bf16, None, True) == "bf16"
    assert config.fwd_hold_kind(fp16, None, True) == "fp16"
    assert config.fwd_hold_kind(fp32, bf16, False) == "stream"
    assert config.fwd_hold_kind(fp32, fp16, False) == "fp16 stream"
    for args in ((bf16, None, False), (bf16, fp32, False), (fp32, None, True)):
        assert config.fwd_hold_kind(*args) == "", args
    assert config.fwd_hold("bf16", 8) and config.fwd_hold("fp16", 8)
    assert not config.fwd_hold("bf16", 1) and not config.fwd_hold("fp16", 1)
    assert not config.fwd_hold("stream", 8) and not config.fwd_hold("", 8)
    # The x1 path's fp16 stream, in more than 32 parts only (NOTES #55).
    assert config.fwd_hold("fp16 stream", 64, x1=True)
    assert not config.fwd_hold("fp16 stream", 32, x1=True)
    assert not config.fwd_hold("fp16 stream", 64, x1=False)
    assert not config.fwd_hold("stream", 64, x1=True)
    gpu = torch.device("cuda")
    old = (config.split_rows_ok, config.sm_count)
    config.split_rows_ok, config.sm_count = (lambda d: True), (lambda d: 132)
    try:
        assert config.fwd_split(32768, 2, gpu, x1=True) == (4096, 8)
        # 64 KB rows heavy by dropout alone: 2K-column parts (bench/NOTES.md #57)
        assert config.fwd_split(32768, 2, gpu, dropout=True) == (2048, 16)
        assert config.fwd_split(65536, 2, gpu, dropout=True) == (4096, 16)
        assert config.fwd_split(32768, 2, gpu, False) == (0, 1)
        assert config.fwd_split(16384, 4, gpu, x1=True) == (0, 1)
        assert config.fwd_split(65536, 2, gpu, False) == (4096, 16)
        assert config.fwd_split_warps("ln", 8, "bf16") == 2
        assert config.fwd_split_warps("ln", 16, "") == 4
        assert config.fwd_split_warps("ln", 64, "fp16") == 2
        assert config.fwd_split_warps("ln", 16, "fp16") == 4
        # fp16 LayerNorm widens by a conversion, the rest by the bit route (NOTES #64).
        assert (
            config.fwd_hold_route("fp16", False) == config.fwd_hold_route("fp16 stream", False) == 2
        )
        assert config.fwd_hold_route("fp16", True) == config.fwd_hold_route("bf16", False) == 1
        assert config.fwd_hold_route("stream", False) == 1
        assert config.fwd_split_warps("ln", 64, "") == 2
        assert config.fwd_split_warps("rms", 64, "fp16") == 2
        # Held RMSNorm in at most 16 parts on 4 warps; held in fp32, 2 (NOTES #55).
        assert config.fwd_split_warps("rms", 16, "bf16") == 4
        assert config.fwd_split_warps("rms", 12, "fp16") == 4
        assert config.fwd_split_warps("rms", 16, "") == 2
        saved = config.FWD_HOLD
        try:
            config.FWD_HOLD = True
            assert config.fwd_hold("stream", 8) and not config.fwd_hold("bf16", 1)
            config.FWD_HOLD = False
            assert not config.fwd_hold("bf16", 8)
        finally:
            config.FWD_HOLD = saved
    finally:
        config.split_rows_ok, config.sm_count = old

    # Lane-summed chunks: (BLOCK_N, NUM_CHUNKS, TAIL_N, rows), warps, unroll factor.
    def lane_launch(n, plain, elem_bytes=2):
        block_n, chunks, tail, rows, lane = config.fwd_block_layout(n, elem_bytes, plain)
        warps = config.fwd_num_warps(block_n, chunks, plain, tail, lane)
        return (block_n, chunks, tail, rows), warps, config.fwd_chunk_unroll(lane, chunks)

    assert lane_launch(32768, "ln") == ((8192, 4, 0, 1), 32, 4)
    assert lane_launch(32768, "rms") == ((8192, 4, 0, 1), 32, 1)
    assert lane_launch(16000, "ln") == ((4096, 4, 0, 1), 16, 1)
    assert lane_launch(20480, "ln") == ((8192, 3, 0, 1), 32, 3)
    assert lane_launch(4096, "rms") == ((2048, 2, 0, 1), 8, 1)
    assert lane_launch(12288, "rms") == ((4096, 3, 0, 1), 16, 1)  # its own width, over two blocks
    assert lane_launch(10240, "rms")[0][2] > 0  # two blocks
    assert lane_launch(12288, "ln")[0][2] > 0
    assert lane_launch(32768, "rms", 4)[0][:2] == (16384, 2)  # fp32: no lane chunks
    assert lane_launch(32768, "")[0][0] == 32768  # a stream: no lane chunks
    assert config.fwd_lane_chunk(32768, 2, "") is None
    assert config.fwd_num_warps(16384, 4, "") == 32  # the fallback chunked rows: 32, a loop
    assert config.fwd_chunk_unroll(None, 4) == 1


def test_register_caps_only_where_measured():
    """config's register caps (Triton's maxnreg) go to NVIDIA GPUs only (other backends refuse
    the option) and only to the configurations the sweeps chose (bench/NOTES.md #24): a cap
    is not neutral elsewhere, ptxas spends it."""
    from fused_norm import config

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    # (block_n, num_chunks, split, dropout, x1, elem_bytes)
    capped = [(16384, 1, 1, True, False, 2), (4096, 1, 16, True, False, 2)]
    kept = [(16384, 1, 1, False, False, 2), (16384, 1, 1, True, True, 2),
            (16384, 1, 1, True, False, 4), (8192, 1, 1, True, False, 2),
            (32768, 1, 1, True, False, 2), (2048, 1, 32, True, False, 4)]  # fmt: skip
    expected = 64 if torch.version.hip is None else None
    for args in capped:
        assert config.fwd_maxnreg(*args, gpu) == expected, args
        assert config.fwd_maxnreg(*args, cpu) is None, args
    for args in kept:
        assert config.fwd_maxnreg(*args, gpu) is None, args
    assert config.bwd_maxnreg(1024, 1, True, 2, gpu) == (128 if expected else None)
    for args in ((1024, 1, True, 2, cpu), (1024, 1, True, 4, gpu), (1024, 1, False, 2, gpu),
                 (4096, 1, True, 2, gpu), (512, 1, True, 2, gpu)):  # fmt: skip
        assert config.bwd_maxnreg(*args) is None, args
    # add + RMSNorm's padded 8192-column block on 16 warps, 16-bit rows (bench/NOTES.md #53):
    # (block_n, num_chunks, dropout, partials, device, tail, warps, elem_bytes)
    assert config.bwd_maxnreg(8192, 1, False, 1, gpu, 0, 16, 2) == (64 if expected else None)
    for args in ((8192, 1, False, 1, cpu, 0, 16, 2), (8192, 1, False, 1, gpu, 0, 16, 4),
                 (8192, 1, False, 1, gpu, 0, 8, 2), (8192, 1, True, 1, gpu, 0, 16, 2),
                 (8192, 1, False, 2, gpu, 0, 16, 2), (8192, 1, False, 1, gpu, 1024, 16, 2),
                 (8192, 2, False, 1, gpu, 0, 16, 2), (16384, 1, False, 1, gpu, 0, 32, 2)):  # fmt: skip
        assert config.bwd_maxnreg(*args) is None, args
    # RMSNorm's padded 8192-column block on 8 warps, fp16 rows only (bench/NOTES.md #112)
    assert config.bwd_maxnreg(8192, 1, False, 1, gpu, 0, 8, 2, True) == (128 if expected else None)
    for args in ((8192, 1, False, 1, gpu, 0, 8, 2, False), (8192, 1, False, 1, cpu, 0, 8, 2, True),
                 (8192, 1, True, 1, gpu, 0, 8, 2, True), (8192, 1, False, 2, gpu, 0, 8, 2, True),
                 (4096, 1, False, 1, gpu, 0, 4, 2, True), (8192, 1, False, 1, gpu, 0, 8, 4, True),
                 (8192, 1, False, 1, gpu, 1024, 8, 2, True)):  # fmt: skip
        assert config.bwd_maxnreg(*args) is None, args


def test_backward_warps_of_a_plain_rmsnorm():
    """RMSNorm of x alone (one partial) takes 4 warps at 4096 columns and 8 at 8192; add +
    RMSNorm keeps 8 at 4096, LayerNorm (two partials) too (bench/NOTES.md #30, #41). RMSNorm's
    padded 8192 block of 16-bit rows takes 16 (#113), and so does 8192 itself on Triton 3.9."""
    from fused_norm import config

    with patched_config(TRITON_VERSION=(3, 6)):
        assert config.bwd_num_warps(4096, 1, plain=True) == 4
        assert config.bwd_num_warps(8192, 1, plain=True) == 8
        assert config.bwd_num_warps(8192, 1, plain=True, n_cols=8192) == 8
        assert config.bwd_num_warps(4096, 1) == 8
        assert config.bwd_num_warps(4096, 2, plain=True) == 8
        for n in (5121, 6144, 7168, 8191):
            assert config.bwd_num_warps(8192, 1, plain=True, n_cols=n) == 16, n
        assert config.bwd_num_warps(8192, 1, plain=True, elem_bytes=4, n_cols=6144) == 8
        assert config.bwd_num_warps(8192, 2, plain=True, n_cols=6144) == 16  # LayerNorm's
        assert config.bwd_num_warps(8192, 1, plain=True, tail=1024, n_cols=5120) == 8
        assert config.bwd_num_warps(4096, 1, plain=True, n_cols=3072) == 4
    with patched_config(TRITON_VERSION=(3, 9)):
        assert config.bwd_num_warps(8192, 1, plain=True) == 16
        assert config.bwd_num_warps(8192, 1, plain=True, elem_bytes=4) == 8
        assert config.bwd_num_warps(8192, 1, plain=True, tail=1024, n_cols=5120) == 8
        assert config.bwd_num_warps(4096, 1, plain=True) == 4
    # through the layout, with the register cap that two 16-warp programs per SM need
    gpu = torch.device("cuda", 0)
    with patched_config(TRITON_VERSION=(3, 6), _nvidia=lambda device: True):
        assert config.bwd_layout(6144, 2, 1, False, True) == (8192, 1, 0, 16)
        assert config.bwd_layout(8192, 2, 1, False, True) == (8192, 1, 0, 8)
        assert config.bwd_maxnreg(8192, 1, False, 1, gpu, 0, 16, 2, True) == 64


def test_backward_sum_repeats_only_where_measured():
    """config.bwd_sum_repeats (bench/NOTES.md #117): RMSNorm of x alone in one 4096-column
    block on 4 warps, 16-bit rows and weights, folds its row sum over the layout's four
    repeats on Triton 3.9 on an NVIDIA GPU; any other block, warps, chunks, tail, tile, row
    kind or width, another device, and Triton 3.6, do not."""
    from fused_norm import config

    # (block_n, num_chunks, tail, tile_rows, warps, plain_rms, elem_bytes, w4, device)
    base = (4096, 1, 0, 1, 4, True, 2, False, torch.device("cuda", 0))
    changes = ((0, 2048), (0, 8192), (1, 2), (2, 1024), (3, 2), (4, 8), (5, False), (6, 4),
               (7, True), (8, torch.device("cpu")))  # fmt: skip

    def nvidia(device):
        return device.type == "cuda"

    with patched_config(TRITON_VERSION=(3, 9), _nvidia=nvidia):
        assert config.bwd_sum_repeats(*base) == 4
        for i, value in changes:
            args = base[:i] + (value,) + base[i + 1 :]
            assert config.bwd_sum_repeats(*args) == 1, args
    with patched_config(TRITON_VERSION=(3, 6), _nvidia=nvidia):
        assert config.bwd_sum_repeats(*base) == 1


def test_backward_recompute_only_where_measured():
    """config.bwd_recompute (bench/NOTES.md #118): with Triton 3.9 on an NVIDIA GPU, LayerNorm
    of x alone with a bias holds its backward rows' loads across the row sums in one
    1024-column block on 2 warps in bf16, and in one 2048-column block on 4 warps in bf16 or
    fp16 where the row fills it, with 16-bit weights, at widths of a multiple of 16 columns;
    any other block, warps, chunks, tail, tile, pipeline, exchange, row kind, dtype, weights,
    width or device, and Triton 3.6, do not."""
    from fused_norm import config

    gpu = torch.device("cuda", 0)
    # (block_n, num_chunks, tail, tile_rows, stages, exchange, warps, row_kind, dtype, w4,
    # n_cols, device)
    held = [(1024, 1, 0, 1, 1, False, 2, "ln", "bf16", False, 784, gpu),
            (1024, 1, 0, 1, 1, False, 2, "ln", "bf16", False, 1024, gpu),
            (2048, 1, 0, 1, 1, False, 4, "ln", "bf16", False, 2048, gpu),
            (2048, 1, 0, 1, 1, False, 4, "ln", "fp16", False, 2048, gpu)]  # fmt: skip
    changes = ((0, 4096), (1, 2), (2, 256), (3, 2), (4, 2), (5, True), (6, 8), (7, ""),
               (8, ""), (9, True), (10, 1000), (11, torch.device("cpu")))  # fmt: skip

    def nvidia(device):
        return device.type == "cuda"

    with patched_config(TRITON_VERSION=(3, 9), _nvidia=nvidia):
        for row in held:
            assert config.bwd_recompute(*row), row
            for i, value in changes:
                args = row[:i] + (value,) + row[i + 1 :]
                assert not config.bwd_recompute(*args), args
        for args in ((1024, 1, 0, 1, 1, False, 2, "ln", "fp16", False, 1024, gpu),
                     (2048, 1, 0, 1, 1, False, 4, "ln", "bf16", False, 1536, gpu),
                     (512, 1, 0, 1, 1, False, 1, "ln", "bf16", False, 512, gpu)):  # fmt: skip
            assert not config.bwd_recompute(*args), args
    with patched_config(TRITON_VERSION=(3, 6), _nvidia=nvidia):
        for row in held:
            assert not config.bwd_recompute(*row), row


def test_backward_layout_of_one_partial_rows_of_4k_to_8k_columns():
    """bench/NOTES.md #53: add + RMSNorm (one partial, not a norm of x alone) of 16-bit rows of
    4097-8192 columns takes the padded 8192 block on 16 warps (under the register cap of
    bwd_maxnreg) instead of two blocks; fp32 rows and dropout keep two blocks where they had
    them. RMSNorm of x alone holds its two blocks on 8 warps, where the second is at most a
    quarter of the first."""

    from fused_norm import config

    # bwd_layout(n_cols, elem_bytes, partials, dropout, plain) -> (block, chunks, tail, warps)
    for n in (5120, 6144, 8192):
        assert config.bwd_layout(n, 2, 1, False, False) == (8192, 1, 0, 16), n
    assert config.bwd_layout(5120, 4, 1, False, False) == (8192, 1, 1024, 16)  # fp32
    assert config.bwd_layout(5120, 2, 1, True, False)[2] == 1024  # dropout: two blocks
    assert config.bwd_layout(5120, 2, 1, False, True) == (8192, 1, 1024, 8)  # plain RMSNorm
    assert config.bwd_layout(6144, 2, 1, False, True)[:3] == (8192, 1, 0)  # its tail > 1/4
    assert config.bwd_layout(6144, 4, 1, False, True)[2] == 2048  # fp32: not measured
    assert config.bwd_layout(5120, 2, 2, False, True)[2] == 1024  # LayerNorm unchanged
    with patched_config(TAIL_BLOCKS=True):  # forced two blocks (sweeps) stay two blocks
        assert config.bwd_layout(5120, 2, 1, False, False)[2] == 1024


def test_backward_warps_of_512_and_1k_rows():
    """bench/NOTES.md #53: rows of 1024 16-bit columns without dropout and with at most two
    partials take 2 warps; fp32 rows, dropout and the x1 path keep theirs. At 512 columns
    the same rows take 1 warp, but for RMSNorm of x alone."""
    from fused_norm import config

    for partials in (1, 2):
        for plain in (True, False):
            assert config.bwd_num_warps(1024, partials, plain=plain) == 2
        assert config.bwd_num_warps(1024, partials, elem_bytes=4) == 4
        assert config.bwd_num_warps(1024, partials, dropout=True) == 4
    with patched_config(TRITON_VERSION=(3, 6)):
        assert config.bwd_num_warps(1024, 4) == 2  # the x1 path, as before
    # ... but with dropout at 2048 on 4 (bench/NOTES.md #114), whatever the dtype
    for elem_bytes in (2, 4):
        assert config.bwd_num_warps(2048, 4, dropout=True, elem_bytes=elem_bytes) == 4
    assert config.bwd_num_warps(2048, 4) == 2
    assert config.bwd_num_warps(1024, 4, dropout=True) == 2
    assert config.bwd_layout(1536, 2, 4, True, False) == (2048, 1, 0, 4)
    assert config.bwd_layout(2048, 2, 4, False, False) == (2048, 1, 0, 2)
    # ... and without dropout at 1024 (#116): 16-bit rows on Triton 3.9, 4-byte before
    for version, four in (((3, 6), 4), ((3, 9), 2)):
        with patched_config(TRITON_VERSION=version):
            assert config.bwd_num_warps(1024, 4, elem_bytes=four) == 4, version
            assert config.bwd_num_warps(1024, 4, elem_bytes=6 - four) == 2, version
            assert config.bwd_num_warps(1024, 4, dropout=True, elem_bytes=four) == 2
            assert config.bwd_num_warps(512, 4, elem_bytes=four) == 1
            assert config.bwd_layout(768, four, 4, False, False) == (1024, 1, 0, 4)
    assert config.bwd_num_warps(2048, 2) == 4
    # 512 columns without dropout: 1 warp, but RMSNorm of x alone keeps 2
    assert config.bwd_num_warps(512, 2, plain=True) == 1
    assert config.bwd_num_warps(512, 1) == 1
    assert config.bwd_num_warps(512, 1, plain=True) == 2
    assert config.bwd_num_warps(512, 2, dropout=True) == 2


def test_backward_register_cap_reaches_the_launch(monkeypatch):
    """ops hands bwd_maxnreg the warps, the widest row tensor of the configuration and whether
    its rows are fp16: add + RMSNorm's 8192-column backward of bf16 rows is capped on an
    NVIDIA GPU, of fp32 rows not; RMSNorm's on 8 warps of fp16 rows, of bf16 rows not."""
    from fused_norm import config
    from fused_norm.launch import Stand

    monkeypatch.setattr(config, "_nvidia", lambda device: True)
    gpu = torch.device("cuda")

    def maxnreg(dtype):
        t = Stand(dtype, (1, 8192))
        return ops._bwd_plan(gpu, t, t, None, t, None, None, None, None, None, None, None,
                             False, False, 0.0, True, False, 8192, 1, 0, 1, 16)[2]  # fmt: skip

    assert maxnreg(torch.bfloat16) == 64
    assert maxnreg(torch.float32) is None

    def rms_maxnreg(dtype):  # RMSNorm of x alone: 8 warps, no stream gradient
        t = Stand(dtype, (1, 8192))
        return ops._bwd_plan(gpu, t, t, None, None, None, None, None, None, None, None, None,
                             False, False, 0.0, True, False, 8192, 1, 0, 1, 8)[2]  # fmt: skip

    assert rms_maxnreg(torch.float16) == 128
    assert rms_maxnreg(torch.bfloat16) is None


def test_backward_warps_reach_the_launch(monkeypatch):
    """What fused_norm_bwd launches on a (stand-in) NVIDIA GPU with the device's Triton:
    RMSNorm of x alone at 6144 columns (the padded 8192 block) on 16 warps under the cap of
    64, at 8192 on 8 (fp16 under 128), and at 8192 on 16 with Triton 3.9 (bench/NOTES.md
    #113); the x1 path with dropout at 1536 / 2048 on 4 warps, without dropout on 2 (#114);
    LayerNorm of x alone at 1536 / 2048 capped at 96 with Triton 3.9, but with fp32 weights,
    a residual gradient or a bias on RMSNorm (#115); RMSNorm of x alone at 3072 / 4096 with
    its row sum folded over four repeats with Triton 3.9 (#117); LayerNorm of x alone holding
    its rows' loads across the row sums at 1024 / 2048 with Triton 3.9 (#118)."""
    monkeypatch.setattr(config, "_nvidia", lambda device: True)
    monkeypatch.setattr(config, "_sm90", lambda index: True)
    monkeypatch.setattr(config, "_smem_ok", lambda index: False)
    monkeypatch.setattr(config, "INTERPRETED", False)
    monkeypatch.setattr(config, "sm_count", lambda device: 132)
    launched, folds, held = [], [], []

    class Recorder:
        def __call__(self, grid, device, args, constexprs, num_warps, num_stages=None,
                     on_miss=None, maxnreg=None):  # fmt: skip
            launched.append((constexprs["BLOCK_N"], num_warps, maxnreg))
            folds.append(constexprs["SUM_REPEATS"])
            held.append(constexprs["RECOMPUTE"])

        def warm(self, *args, **kwargs):
            pass

    monkeypatch.setattr(ops, "_BWD", Recorder())
    monkeypatch.setattr(ops, "_RED", lambda *args, **kwargs: None)

    def bwd(n, dtype, x1=False, dropout_p=0.0, ln=False, wdtype=None, rms_bias=False, res=False,
            zcw=False, nobias=False):  # fmt: skip
        m = 4
        dy, s = torch.randn(m, n, dtype=dtype), torch.randn(m, n, dtype=dtype)
        w = torch.randn(n, dtype=wdtype or dtype)
        kw = dict(mean=torch.zeros(m), rstd=torch.ones(m), is_rms_norm=not (x1 or ln),
                  zero_centered_weight=zcw)  # fmt: skip
        if x1:
            kw.update(dy1=dy, x1_dtype=dtype)
        if x1 or res:
            kw.update(residual_dtype=dtype, dresidual_out=dy)
        if dropout_p:
            kw.update(seeds=torch.zeros(2 * m, dtype=torch.int64), dropout_p=dropout_p)
        config.settings_changed()
        launched.clear()
        bias = w if (x1 or ln or rms_bias) and not nobias else None
        w1 = w if x1 else None
        ops.fused_norm_bwd(dy, s, w, bias, w1, w1, **kw)
        return launched[0]

    for version, exact in (((3, 6), 8), ((3, 9), 16)):
        monkeypatch.setattr(config, "TRITON_VERSION", version)
        assert bwd(6144, torch.bfloat16) == (8192, 16, 64)
        assert bwd(6144, torch.float16) == (8192, 16, 64)
        assert bwd(8192, torch.bfloat16) == (8192, exact, 64 if exact == 16 else None)
        assert bwd(8192, torch.float16) == (8192, exact, 64 if exact == 16 else 128)
        assert bwd(5120, torch.bfloat16)[1] == 8  # two blocks, 4096 + 1024
        assert bwd(6144, torch.float32)[1] != 16
        for n in (1536, 2048):
            assert bwd(n, torch.bfloat16, x1=True, dropout_p=0.1) == (2048, 4, None)
            assert bwd(n, torch.bfloat16, x1=True) == (2048, 2, None)
        assert bwd(1024, torch.bfloat16, x1=True, dropout_p=0.1)[1] == 2
        sixteen = 4 if version >= (3, 9) else 2  # #116
        assert bwd(1024, torch.bfloat16, x1=True)[1] == sixteen
        assert bwd(768, torch.float16, x1=True)[1] == sixteen
        assert bwd(1024, torch.float32, x1=True)[1] == 6 - sixteen
        ln_cap = 96 if version >= (3, 9) else None
        for n, dtype in ((2048, torch.bfloat16), (1536, torch.float16)):
            assert bwd(n, dtype, ln=True) == (2048, 4, ln_cap), (n, dtype)
            assert bwd(n, dtype, ln=True, wdtype=torch.float32)[2] is None
            assert bwd(n, dtype, ln=True, res=True)[2] is None
            assert bwd(n, dtype, rms_bias=True)[2] is None
        assert bwd(2048, torch.float32, ln=True)[2] is None
        assert bwd(1024, torch.bfloat16, ln=True)[2] is None
        assert bwd(4096, torch.bfloat16, ln=True)[2] is None
        # RMSNorm of x alone in the 4096 block on 4 warps folds its row sum with Triton 3.9
        # (#117); with a bias, a zero-centred weight, fp32 weights or rows, a residual's
        # gradient, LayerNorm or other blocks it does not
        fold = 4 if version >= (3, 9) else 1
        for n, dtype in ((4096, torch.bfloat16), (3072, torch.bfloat16), (4096, torch.float16)):
            assert bwd(n, dtype) == (4096, 4, None) and folds[-1] == fold, (n, dtype)
        for kw in (dict(rms_bias=True), dict(zcw=True), dict(wdtype=torch.float32),
                   dict(res=True), dict(ln=True)):  # fmt: skip
            bwd(4096, torch.bfloat16, **kw)
            assert folds[-1] == 1, kw
        for n, dtype in ((4096, torch.float32), (2048, torch.bfloat16), (8192, torch.bfloat16),
                         (5120, torch.bfloat16)):  # fmt: skip
            bwd(n, dtype)
            assert folds[-1] == 1, (n, dtype)
        # LayerNorm of x alone with a bias holds its rows' loads across the row sums with
        # Triton 3.9 (#118): in bf16 at 513-1024 columns (multiples of 16), in bf16 and fp16 at
        # 2048; not before 3.9
        late = version >= (3, 9)
        for n, dtype, expect in ((1024, torch.bfloat16, late), (784, torch.bfloat16, late),
                                 (1000, torch.bfloat16, False), (1024, torch.float16, False),
                                 (2048, torch.bfloat16, late), (2048, torch.float16, late),
                                 (1536, torch.bfloat16, False), (512, torch.bfloat16, False),
                                 (1024, torch.float32, False)):  # fmt: skip
            bwd(n, dtype, ln=True)
            assert held[-1] == expect, (version, n, dtype)
        for kw in (dict(), dict(rms_bias=True), dict(ln=True, wdtype=torch.float32),
                   dict(ln=True, res=True), dict(ln=True, zcw=True), dict(ln=True, nobias=True),
                   dict(x1=True)):  # fmt: skip
            for n in (1024, 2048):
                bwd(n, torch.bfloat16, **kw)
                assert not held[-1], (version, n, kw)
    config.settings_changed()


@pytest.fixture
def gpu_rules(monkeypatch):
    """config's launch rules as on a 132-SM NVIDIA GPU, on a machine without one, with the
    device's Triton (3.6): a few rules differ from Triton 3.9 (config.TRITON_VERSION)."""
    monkeypatch.setattr(config, "TRITON_VERSION", (3, 6))
    monkeypatch.setattr(config, "_nvidia", lambda device: device.type == "cuda")
    monkeypatch.setattr(config, "INTERPRETED", False)
    monkeypatch.setattr(config, "sm_count", lambda device: 132)
    monkeypatch.setattr(config, "split_rows_ok", lambda device: True)


def _gpu_fwd_plan(n, x, stream=None, dropout=False, rms=False, x1=False, wb=2, rowscale=False):
    """ops._fwd_plan on a CUDA device: x and y of dtype ``x``, a residual stream of dtype
    ``stream`` in and out (None: none), x1 with weight1 and bias1 where ``x1``, a bias unless
    ``rms``, weights of ``wb`` bytes."""
    return ops._fwd_plan(torch.device("cuda"), n, x, x, stream, x if x1 else None, stream,
                         not rms, x1, x1, rowscale, False, False, dropout, rms, False, wb)  # fmt: skip


def test_launch_of_rows_of_4_byte_elements(monkeypatch):
    """bench/NOTES.md #57: fp32 rows and rows with an fp32 stream. A one-block 16K-column
    forward with dropout or x1 takes FWD_WIDE_ELEM_BLOCK's warps and cap (through ops' plan,
    on NVIDIA GPUs only); their split rows with dropout take 2 warps; add + RMSNorm's
    backward takes 16 warps at 4096 columns and 8 at 16384."""
    from fused_norm import config

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(config, "_nvidia", lambda device: device.type == "cuda")

    def choice(block_n, chunks, tail, elem_bytes, x_bytes, dropout, x1, device):
        return config.fwd_block_choice(block_n, chunks, tail, elem_bytes, x_bytes, 2, dropout,
                                       x1, device)  # fmt: skip

    # (block_n, num_chunks, tail, elem_bytes, x_bytes, dropout, x1, device)
    assert choice(16384, 1, 0, 4, 2, True, False, gpu) == (16, 64)
    assert choice(16384, 1, 0, 4, 4, True, False, gpu) == (32, 80)
    assert choice(16384, 1, 0, 4, 2, False, True, gpu) == (32, 64)
    for args in ((16384, 1, 0, 4, 2, True, False, cpu), (16384, 1, 0, 2, 2, True, False, gpu),
                 (16384, 1, 4096, 4, 2, True, False, gpu), (8192, 1, 0, 4, 2, True, False, gpu),
                 (16384, 2, 0, 4, 2, True, False, gpu), (16384, 1, 0, 4, 4, False, True, gpu),
                 (16384, 1, 0, 4, 2, True, True, gpu), (16384, 1, 0, 4, 2, False, False, gpu)):  # fmt: skip
        assert choice(*args) is None, args
    assert config.fwd_split_warps("", 32, "", dropout_2k=True) == 2
    assert config.fwd_split_warps("", 32, "") == 4
    # ops' plan: (split, rows, num_warps, maxnreg, constexprs)
    monkeypatch.setattr(config, "sm_count", lambda device: 132)
    monkeypatch.setattr(config, "split_rows_ok", lambda device: True)
    bf16, fp32 = torch.bfloat16, torch.float32

    def plan(n, x, stream, dropout, x1=False):
        return _gpu_fwd_plan(n, x, stream, dropout, x1=x1)[:4]

    assert plan(16384, bf16, fp32, True) == (1, 1, 16, 64)
    assert plan(16384, fp32, fp32, True) == (1, 1, 32, 80)
    assert plan(16384, bf16, fp32, False, x1=True) == (1, 1, 32, 64)
    assert plan(16384, bf16, bf16, True) == (1, 1, 16, 64)  # 16-bit rows: fwd_maxnreg, as before
    assert plan(16384, bf16, fp32, False)[2:] == (16, None)  # add + RMSNorm: unchanged
    assert plan(65536, bf16, fp32, True)[::2] == (32, 2)  # split, 2 warps
    assert plan(65536, bf16, fp32, False, x1=True)[::2] == (32, 4)
    # 32K 16-bit columns with dropout: 16 parts of 2K columns on 2 warps under the cap of 64
    assert plan(32768, bf16, bf16, True) == (16, 1, 2, 64)
    assert plan(32768, bf16, bf16, False, x1=True)[::2] == (8, 4)  # the x1 path: 4K parts
    assert plan(65536, bf16, bf16, True)[::2] == (16, 4)
    # backward warps: (block_n, partials, dropout, tail, plain, elem_bytes)
    assert config.bwd_num_warps(4096, 1, elem_bytes=4) == 16
    assert config.bwd_num_warps(16384, 1, elem_bytes=4) == 8
    assert config.bwd_num_warps(16384, 1) == 32  # 16-bit rows keep 32
    assert config.bwd_num_warps(4096, 1, plain=True, elem_bytes=4) == 4  # RMSNorm of x alone
    assert config.bwd_num_warps(16384, 1, plain=True, elem_bytes=4) == 32
    assert config.bwd_num_warps(4096, 1, dropout=True, elem_bytes=4) == 8
    assert config.bwd_num_warps(4096, 2, elem_bytes=4) == 8


def test_fp32_weights_launch_rules(monkeypatch, gpu_rules):
    """16-bit rows whose weights are 4 bytes take their own choices (bench/NOTES.md #59);
    weights as wide as the rows keep the others."""
    gpu = torch.device("cuda")
    bf16, fp32 = torch.bfloat16, torch.float32

    def plan(n, x, wb, rms=False, x1=False, stream=None):
        return _gpu_fwd_plan(n, x, stream, rms=rms, x1=x1, wb=wb)

    # LayerNorm of x alone: 24K-32K columns split into held 4K-column parts on 2 warps
    assert plan(32768, bf16, 4)[:3] == (8, 1, 2) and plan(32768, bf16, 4)[4]["HOLD"] == 1
    assert plan(24576, bf16, 4)[:3] == (6, 1, 2)
    assert plan(32768, bf16, 2)[0] == 1  # 16-bit weights: lane-summed chunks
    assert plan(16384, bf16, 4)[0] == 1  # 16K: lane-summed chunks either way
    # ... of 2K columns beside 4-byte weights, 4K beside 16-bit ones (bench/NOTES.md #100);
    # 16000 by its padded width
    for n in (16384, 16000):
        for wb, chunk in ((4, 2048), (2, 4096)):
            p = plan(n, bf16, wb)
            assert (p.constexprs["BLOCK_N"], p.num_warps) == (chunk, 16), (n, wb)
            assert p.constexprs["NUM_CHUNKS"] == -(-n // chunk)
    assert config.fwd_lane_chunk(16384, 2, "rms", 4) == config.fwd_lane_chunk(16384, 2, "rms")
    # LayerNorm of x alone at 1024 columns: 1 warp beside 4-byte weights, 2 beside 16-bit ones
    assert plan(1024, bf16, 4)[1:4] == (1, 1, None)
    assert plan(1024, torch.float16, 4)[1:4] == (1, 1, None)
    assert plan(1024, bf16, 2)[1:4] == (1, 2, None)
    assert plan(1024, bf16, 4, rms=True)[2] == plan(1024, bf16, 2, rms=True)[2] == 2
    assert plan(2048, bf16, 4)[2] == plan(2048, bf16, 2)[2] == 2
    assert plan(1024, fp32, 4)[2] == 2  # fp32 rows: unchanged
    assert plan(16384, fp32, 4)[0] == 1  # fp32 rows (4-byte weights as always): unchanged
    # held RMSNorm in 16 parts: 2 warps with 4-byte weights, 4 with 16-bit ones
    assert plan(65536, bf16, 4, rms=True)[:4:2] == (16, 2)
    assert plan(65536, bf16, 2, rms=True)[:4:2] == (16, 4)
    # the x1 path's one block: 16 warps at 6144-8192 columns, 32 at 16384 capped at 96
    for n, old, new, cap in ((6144, 4, 16, None), (8192, 8, 16, None), (16384, 16, 32, 96),
                             (12288, 16, 16, None)):  # fmt: skip
        assert plan(n, bf16, 2, x1=True, stream=bf16)[2:4] == (old, None), n
        assert plan(n, bf16, 4, x1=True, stream=bf16)[2:4] == (new, cap), n
    assert plan(16384, torch.float16, 4, x1=True, stream=torch.float16)[2:4] == (32, 96)
    assert plan(8192, fp32, 4, x1=True, stream=fp32)[2] == 8  # fp32 rows: unchanged
    # ... and the cap only where the compiler takes caps
    monkeypatch.setattr(config, "_nvidia", lambda device: False)
    assert plan(16384, bf16, 4, x1=True, stream=bf16)[2:4] == (32, None)
    monkeypatch.setattr(config, "_nvidia", lambda device: device.type == "cuda")
    # backward: dropout or x1 with 4-byte weights take the pre-pass; RMSNorm keeps the exchange
    assert config.bwd_launch_layout(32768, 2, 2, True, False, gpu)[-1] is True
    assert config.bwd_launch_layout(32768, 2, 2, True, False, gpu, w4=True)[-1] is False
    assert config.bwd_launch_layout(32768, 2, 4, False, False, gpu, w4=True, x1=True)[-1] is False
    assert config.bwd_launch_layout(32768, 2, 1, False, False, gpu, w4=True)[-1] is True
    assert config.bwd_launch_layout(32768, 4, 2, True, False, gpu, w4=True)[-1] is True


def test_early_params_rule(gpu_rules):
    """One-block forward rows that load their weights and biases ahead of the statistics
    (config.FWD_EARLY_PARAMS, bench/NOTES.md #100): LayerNorm of x alone of 4096 16-bit
    columns beside 16-bit weights; not beside 4-byte weights, nor RMSNorm, rows with a
    stream, a partly masked block (4000), two blocks, other widths or fp32 rows."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32

    def early(*args, **kwargs):
        return _gpu_fwd_plan(*args, **kwargs).constexprs["EARLY_PARAMS"]

    assert early(4096, bf16) and early(4096, fp16)
    assert not early(4000, bf16)  # its 4096 block partly masked
    assert not early(4096, bf16, wb=4)
    assert not early(4096, bf16, rms=True)
    assert not early(4096, bf16, bf16) and not early(4096, bf16, bf16, dropout=True)
    assert not early(4096, bf16, bf16, x1=True)
    assert not early(3072, bf16)  # two blocks: 2048 + 1024
    for n in (512, 1024, 2048, 8192, 16384, 65536):
        assert not early(n, bf16), n
    assert not early(2048, fp32)  # fp32 rows of 4096 * 2 bytes: the 2048 block
    assert not early(4096, fp32)


def test_full_row_rule(gpu_rules):
    """Forward rows that fill their block(s) exactly take the width as a constant
    (config.fwd_full_row, FWD_FULL_ROWS, bench/NOTES.md #101-#103, #105): one block, two blocks (5120
    = 4096 + 1024), a tile of narrow rows, and chunked rows of whole chunks (LayerNorm 16K and
    32K, RMSNorm 12K), and the split rows measured faster so; not a partly masked block or
    chunk, other split rows, the rows measured faster masked, or with the switches off
    (FWD_FULL_CHUNKED_ROWS: chunked rows only)."""
    bf16 = torch.bfloat16

    def full(*args, **kwargs):
        plan = _gpu_fwd_plan(*args, **kwargs)
        return plan.constexprs["FULL_ROW"], plan.constexprs["NUM_CHUNKS"], plan.split

    for n in (256, 1024, 4096, 5120, 8192):
        assert full(n, bf16) == (True, 1, 1), n
    for n in (256, 1024, 4096):
        assert full(n, bf16, bf16, dropout=True)[0], n
    # rows that fill their block but measured faster with their masks (FWD_MASKED_FULL_ROWS,
    # #103): dropout + add + LayerNorm 12288 in bf16, not with an fp32 stream; LayerNorm 8192
    # beside fp32 weights, not beside bf16 ones
    assert full(12288, bf16, bf16, dropout=True) == (False, 1, 1)
    assert full(12288, bf16, torch.float32, dropout=True)[0]
    assert full(8192, bf16, wb=4) == (False, 1, 1)
    with patched_config(FWD_MASKED_FULL_ROWS=frozenset()):
        assert full(12288, bf16, bf16, dropout=True)[0] and full(8192, bf16, wb=4)[0]
    assert full(1024, torch.float32, x1=True)[0]
    for n in (16384, 32768):
        assert full(n, bf16) == (True, 4, 1), n
    assert full(12288, bf16, rms=True) == (True, 3, 1)
    for n in (1000, 4000, 3000):
        assert full(n, bf16) == (False, 1, 1), n  # a masked block
    assert full(16000, bf16) == (False, 4, 1)  # a masked last chunk
    for n, args in ((65536, (bf16,)), (262144, (bf16,)), (65536, (bf16, torch.float32))):
        assert full(n, *args)[0] is False and full(n, *args)[2] > 1, (n, args)  # split
    # split rows that measured faster with their parts' masks folded (FWD_FULL_SPLIT_ROWS,
    # #105): LayerNorm 256K in fp16 (not bf16, not 128K), add + RMSNorm 256K in bf16 and fp32
    fp16, fp32 = torch.float16, torch.float32
    assert full(262144, fp16)[0] and full(262144, fp16)[2] > 1
    assert not full(131072, fp16)[0] and full(131072, fp16)[2] > 1
    assert full(262144, bf16, bf16, rms=True)[0] and full(262144, fp32, fp32, rms=True, wb=4)[0]
    assert full(262144, bf16, fp32, dropout=True)[0]
    assert not full(262144, bf16, bf16, dropout=True)[0]
    with patched_config(FWD_FULL_SPLIT_ROWS=frozenset()):
        assert not full(262144, fp16)[0]
    # compiled by Triton 3.9 or later, every split row of whole parts folds (bench/NOTES.md
    # #111), but those measured slower so (FWD_FULL_SPLIT_SKIP_39); rows of a partly masked
    # last part and one-block rows as before
    with patched_config(TRITON_VERSION=(3, 9)):
        for args, kwargs in (
            ((65536, bf16), {}), ((262144, bf16), {}), ((131072, fp16), {}),
            ((262144, fp32), {"wb": 4}), ((262144, bf16), {"rms": True}),
            ((131072, bf16, bf16), {"dropout": True}), ((65536, bf16, bf16), {"x1": True}),
            ((65536, bf16), {"wb": 4}), ((262144, fp16), {}),
        ):  # fmt: skip
            assert full(*args, **kwargs)[0] and full(*args, **kwargs)[2] > 1, (args, kwargs)
        for args, kwargs in (
            ((65536, bf16, bf16), {"dropout": True, "wb": 4}), ((65536, bf16), {"rms": True}),
            ((32768, fp32, fp32), {"dropout": True, "wb": 4}),
            ((262144, bf16, bf16), {"x1": True}), ((20000, fp32), {"wb": 4}),
        ):  # fmt: skip
            assert not full(*args, **kwargs)[0] and full(*args, **kwargs)[2] > 1, (args, kwargs)
        assert full(12288, bf16, bf16, dropout=True) == (False, 1, 1)
        assert full(16000, bf16) == (False, 4, 1)
        with patched_config(FWD_FULL_ROWS=False):
            assert not full(65536, bf16)[0]
    with patched_config(FWD_FULL_CHUNKED_ROWS=False):
        assert full(16384, bf16)[0] is False and full(1024, bf16)[0]
    with patched_config(FWD_FULL_ROWS=False):
        assert not full(1024, bf16)[0] and not full(16384, bf16)[0]


def test_split_rows_measured_in_wider_parts(gpu_rules):
    """Split forward rows that measured faster in wider parts take them (config.FWD_SPLIT_WIDE_PARTS,
    bench/NOTES.md #89): dropout + add + LayerNorm bf16 and LayerNorm fp16 at 128K columns in
    16 parts of 8K; their neighbours (other widths and dtypes, RMSNorm, the x1 path, 4-byte
    weights or streams) keep fwd_split's 4K-column parts and fwd_split_warps' warps."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32

    def plan(*args, **kwargs):
        p = _gpu_fwd_plan(*args, **kwargs)
        return p.split, p.num_warps, p.maxnreg, p.constexprs["BLOCK_N"], p.constexprs["HOLD"]

    cap = 64 if torch.version.hip is None else None
    # (split, warps, register cap, block, held)
    assert plan(131072, bf16, bf16, dropout=True) == (16, 8, cap, 8192, 0)
    assert plan(131072, bf16, dropout=True) == (16, 8, cap, 8192, 0)  # no residual
    assert plan(131072, fp16) == (16, 4, None, 8192, 2)  # held, widened by a conversion
    kept = [
        (plan(65536, bf16, bf16, dropout=True), (16, 4, cap, 4096, 0)),
        (plan(98304, bf16, bf16, dropout=True), (24, 4, cap, 4096, 0)),
        (plan(262144, bf16, bf16, dropout=True), (64, 4, cap, 4096, 0)),
        (plan(131072, fp16, fp16, dropout=True), (32, 4, cap, 4096, 0)),
        (plan(131072, bf16, bf16, dropout=True, wb=4), (32, 4, cap, 4096, 0)),
        (plan(131072, bf16, bf16, dropout=True, x1=True), (32, 4, None, 4096, 0)),
        (plan(131072, bf16, fp32, dropout=True)[:2], (64, 2)),  # 2K parts of a 4-byte stream
        (plan(131072, bf16), (32, 2, None, 4096, 1)),
        (plan(65536, fp16), (16, 4, None, 4096, 2)),
        (plan(262144, fp16), (64, 2, None, 4096, 2)),
        (plan(131072, fp16, rms=True), (32, 2, None, 4096, 1)),
        (plan(131072, fp16, bf16), (32, 4, None, 4096, 0)),  # add + LayerNorm: a stream
        (plan(131072, fp16, rowscale=True), (32, 2, None, 4096, 0)),  # not held: in fp32
    ]
    for got, want in kept:
        assert got == want
    assert plan(65536, bf16, fp32, dropout=True)[:2] == (32, 2)  # 4-byte stream, 256 KB rows
    assert config.fwd_split_wide_parts("ln", fp16, 131072, 2, 4) is None
    assert config.fwd_split_wide_parts("ln", fp16, 131072, 4, 2) is None
    assert config.fwd_split_wide_parts("", bf16, 131072, 2, 2) is None


def test_split_params_evict_rule(gpu_rules):
    """Split forward parts load their weights and biases evict_last (config.FWD_SPLIT_PARAMS_EVICT,
    bench/NOTES.md #106), but beside weights wider than the row's elements (16-bit rows with
    fp32 weights); rows that are not split load them with the default policy."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32

    def evict(*args, **kwargs):
        p = _gpu_fwd_plan(*args, **kwargs)
        return p.constexprs["PARAMS_EVICT"], p.split > 1

    for args, kwargs in (
        ((262144, bf16), {}), ((65536, bf16, bf16), {"dropout": True}), ((131072, fp16), {}),
        ((262144, bf16, bf16), {"rms": True}), ((131072, bf16, bf16), {"x1": True}),
        ((262144, fp32), {"wb": 4}), ((262144, bf16, fp32), {"dropout": True}),
    ):  # fmt: skip
        assert evict(*args, **kwargs) == ("evict_last", True), (args, kwargs)
    assert evict(65536, bf16, wb=4) == ("", True)  # 16-bit rows beside fp32 weights
    assert evict(262144, bf16, bf16, dropout=True, wb=4) == ("", True)
    assert evict(4096, bf16) == ("", False) and evict(16384, bf16) == ("", False)
    assert config.fwd_split_params_evict(2, 2) == "evict_last"
    assert config.fwd_split_params_evict(4, 2) == "evict_last"  # an fp32 stream, bf16 weights
    assert config.fwd_split_params_evict(2, 4) == ""
    with patched_config(FWD_SPLIT_PARAMS_EVICT=""):
        assert evict(262144, bf16) == ("", True)


def test_split_part_i32_rule(gpu_rules, monkeypatch):
    """Split forward parts count their columns in 32 bits (kernels' PART_I32,
    config.fwd_split_part_i32, bench/NOTES.md #110) where Triton 3.9 or later compiles them and
    the row is not RMSNorm, but the rows in FWD_SPLIT_PART_I32_SKIP (measured slower with it);
    on 3.6 and 3.7 never; rows that are not split never."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32

    def i32(*args, **kwargs):
        p = _gpu_fwd_plan(*args, **kwargs)
        return p.constexprs["PART_I32"], p.split > 1

    for version, later in (((3, 6), False), ((3, 7), False), ((3, 9), True), ((4, 0), True)):
        monkeypatch.setattr(config, "TRITON_VERSION", version)
        for args, kwargs in (
            ((65536, bf16), {}), ((262144, bf16), {}), ((131072, fp16), {}), ((262144, fp32), {}),
            ((262144, bf16, bf16), {"dropout": True}), ((131072, fp32, fp32), {"dropout": True}),
            ((131072, bf16, bf16), {"x1": True}), ((65536, fp16, fp16), {"x1": True}),
        ):  # fmt: skip
            assert i32(*args, **kwargs) == (later, True), (version, args, kwargs)
        for args, kwargs in (
            ((262144, bf16), {"rms": True}), ((262144, bf16, bf16), {"rms": True}),
            ((65536, fp16), {"rms": True}),
            ((262144, fp16), {}), ((65536, fp16, fp16), {"dropout": True}),  # skipped
            ((32768, fp32, fp32), {"dropout": True}), ((32768, fp32), {}),
            ((262144, fp16, fp16), {"x1": True}),
        ):  # fmt: skip
            assert i32(*args, **kwargs) == (False, True), (version, args, kwargs)
        assert i32(16384, bf16) == (False, False) and i32(4096, fp32) == (False, False)
    with patched_config(TRITON_VERSION=(3, 9)):
        assert config.fwd_split_part_i32(("ln", 262144, bf16, 2, 2), False)
        assert not config.fwd_split_part_i32(("rms", 262144, bf16, 2, 2), True)
    with patched_config(TRITON_VERSION=(3, 8)):
        assert not config.fwd_split_part_i32(("ln", 262144, bf16, 2, 2), False)


def test_launch_options_ask_for_fp_fusion():
    """Every launch asks for floating-point fusion (FMA contraction) by name
    (launch._options), what the kernels were measured with: Triton 3.9 warns at a compile that
    leaves it to the default, which turns it off from 3.10. Where Triton has the 3.9 rule
    (knobs.language.fp_fusion_enabled), the option asked for resolves to fusion on, with no
    warning."""
    import warnings

    import triton

    for pdl in (False, True):
        options = launch._options(4, None, 64, pdl)
        assert options["enable_fp_fusion"] is True, options
    language = getattr(getattr(triton, "knobs", None), "language", None)
    if hasattr(language, "fp_fusion_enabled"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert language.fp_fusion_enabled(options["enable_fp_fusion"]) is True
        assert not [w for w in seen if "FP_FUSION" in str(w.message)], seen


def test_x1_pre_pass_column_blocks():
    """The x1 path's 16-bit rows with 16-bit weights take 4K-column blocks after the row-sums
    pre-pass (config.BWD_TILE_BYTES_X1, bench/NOTES.md #90); with 4-byte weights, 4-byte rows
    or two partials the blocks stay BWD_TILE_BYTES (8K 16-bit columns)."""
    from fused_norm import config

    # (n_cols, elem_bytes, partials, dropout, exchange, w4) -> (BLOCK_N, NUM_CHUNKS)
    assert config.bwd_block_config(262144, 2, 4) == (4096, 64)
    assert config.bwd_block_config(262144, 2, 4, dropout=True) == (4096, 64)
    assert config.bwd_block_config(262144, 2, 4, w4=True) == (8192, 32)
    assert config.bwd_block_config(262144, 4, 4) == (4096, 64)  # 16 KB of 4-byte columns
    assert config.bwd_block_config(262144, 2, 2, dropout=True) == (8192, 32)
    assert config.bwd_block_config(131072, 2, 2) == (8192, 16)
    # the exchange's blocks are its own
    assert config.bwd_block_config(32768, 2, 4, exchange=True) == (2048, 16)


def test_backward_stages_of_a_plain_rmsnorm_at_2048():
    """bench/NOTES.md #57: RMSNorm of x alone whose 2048-column row fills its block pipelines
    its row loop over 2 stages; padded rows (1536), add + RMSNorm and LayerNorm keep 1."""
    from fused_norm import config
    from fused_norm.launch import Stand

    assert config.bwd_row_stages(2048, 4, False, 1, 1, plain_full=True) == 2
    assert config.bwd_row_stages(2048, 4, False, 1, 1) == 1
    assert config.bwd_row_stages(2048, 4, False, 1, 2, plain_full=True) == 1
    assert config.bwd_row_stages(4096, 4, False, 1, 1, plain_full=True) == 1
    cpu = torch.device("cpu")

    def stages(n, residual=False, rms=True):
        t = Stand(torch.bfloat16, (1, n))
        r = t if residual else None
        flags = ops._bwd_plan(cpu, t, t, None, r, None, None, None, None, None, None, None,
                              not rms, False, 0.0, rms, False, 2048, 1, 0, 1 if rms else 2,
                              4)[0]  # fmt: skip
        return flags["ROW_STAGES"]

    assert stages(2048) == 2
    assert stages(1536) == 1
    assert stages(2048, residual=True) == 1
    assert stages(2048, rms=False) == 1


def test_backward_exchange_layout(monkeypatch):
    """Rows wider than one backward block exchange their row sums in 2K-column blocks of 4
    warps (16-bit columns whatever the dtype, but bytes with four partials), where a row
    block fits on the device even at one program per SM and, with two or more partials, has
    at most BWD_EXCHANGE_MAX_CHUNKS_MULTI blocks (bench/NOTES.md #44); else 8K-column blocks
    after the row-sums pre-pass."""
    from fused_norm import config

    assert config.bwd_layout(65536, 2, 2, False, True, exchange=True) == (2048, 32, 0, 4)
    assert config.bwd_layout(65536, 4, 1, False, True, exchange=True) == (2048, 32, 0, 4)
    assert config.bwd_layout(65536, 4, 4, False, False, exchange=True)[:2] == (1024, 64)
    assert config.bwd_layout(65536, 2, 2, False, True)[:2] == (8192, 8)
    assert config.bwd_layout(8192, 2, 1, False, True, exchange=True)[1] == 1  # one block
    monkeypatch.setattr(config, "INTERPRETED", False)
    monkeypatch.setattr(config, "sm_count", lambda device: 132)
    gpu = torch.device("cuda")
    assert config.bwd_exchange_fits(128, 1, gpu) and config.bwd_exchange_fits(32, 2, gpu)
    assert not config.bwd_exchange_fits(64, 2, gpu) and not config.bwd_exchange_fits(256, 1, gpu)
    monkeypatch.setattr(config, "_nvidia", lambda device: True)
    assert config.bwd_launch_layout(65536, 2, 2, False, True, gpu) == (2048, 32, 0, 4, True)
    assert config.bwd_launch_layout(262144, 2, 2, False, True, gpu)[1:] == (32, 0, 16, False)
    assert config.bwd_launch_layout(262144, 2, 1, False, True, gpu)[-1] is True
    # LayerNorm at 12288: one block held as 8K + 4K without the exchange, six exchanging
    # 2K blocks with it (bench/NOTES.md #48)
    assert config.bwd_layout(12288, 2, 2, False, True)[:3] == (16384, 1, 4096)
    assert config.bwd_launch_layout(12288, 2, 2, False, True, gpu) == (2048, 6, 0, 4, True)
    # ... but at 8K-10K, with or without dropout, held as 8K + a tail of at most 2K with the
    # exchange too (bench/NOTES.md #65), rows of 4-byte elements too (#68); 11264 (a 4K
    # tail) exchanges
    for n, tail in ((9216, 1024), (10240, 2048)):
        for dropout, elem in itertools.product((False, True), (2, 4)):
            layout = (16384, 1, tail, 16, False)
            assert config.bwd_launch_layout(n, elem, 2, dropout, not dropout, gpu) == layout
    assert config.bwd_launch_layout(11264, 2, 2, False, True, gpu) == (2048, 6, 0, 4, True)
    assert config.bwd_launch_layout(11264, 4, 2, False, True, gpu)[1:] == (6, 0, 4, True)
    # one partial without dropout (RMSNorm, add + RMSNorm) at 16K-20K: 16384 + at most 4096,
    # on 16 warps, unpipelined; an 8K tail, dropout or fp32 rows exchange
    for n, tail in ((18432, 2048), (20480, 4096)):
        for plain in (True, False):
            layout = (32768, 1, tail, 16, False)
            assert config.bwd_launch_layout(n, 2, 1, False, plain, gpu) == layout
    assert config.bwd_row_stages(32768, 4, False, 1, 1, tail=2048) == 1
    assert config.bwd_launch_layout(24576, 2, 1, False, True, gpu)[-1] is True
    assert config.bwd_launch_layout(18432, 2, 1, True, False, gpu)[-1] is True
    assert config.bwd_launch_layout(18432, 4, 1, False, False, gpu)[-1] is True
    # ... with 4-byte weights (w4) up to 16384 + 2048 only; LayerNorm's rule holds with them
    w4_layout = config.bwd_launch_layout(18432, 2, 1, False, True, gpu, w4=True)
    assert w4_layout[:3] == (32768, 1, 2048)
    assert config.bwd_launch_layout(20480, 2, 1, False, True, gpu, w4=True)[-1] is True
    assert config.bwd_launch_layout(10240, 2, 2, False, True, gpu, w4=True)[2] == 2048
    assert config.bwd_launch_layout(10240, 2, 4, False, False, gpu)[1] > 1  # the x1 path
    # its pipeline's buffers sized by the 10240 columns held: 3 rows of s, dy, dresidual_out
    assert config.bwd_row_stages(16384, 6, True, 1, 2, tail=2048) == 3
    assert config.bwd_row_stages(16384, 6, True, 1, 2) == 2
    assert config.bwd_row_stages(8192, 12, True, 1, 2, tail=1024) == 2  # padded below 16K
    # held rows of 4-byte elements: 2 rows of fp32 s, dy; 1 with dropout's dresidual_out
    assert config.bwd_row_stages(16384, 8, False, 1, 2, tail=2048) == 2
    assert config.bwd_row_stages(16384, 12, True, 1, 2, tail=2048) == 1


def test_backward_joint_row_sums_rule():
    """LayerNorm's c1, c2 in one reduction (kernels._pair_sums) where measured to pay
    (bench/NOTES.md #48): one-block rows except the x1 path's pipelined 1K rows and rows held
    as two blocks; exchanged blocks' words except with dropout."""
    from fused_norm import config

    assert config.bwd_joint_row_sums(8192, 1, 0, 4, 3, False)  # the x1 path at 8K
    assert config.bwd_joint_row_sums(1024, 1, 0, 2, 1, False)  # LayerNorm at 1K
    assert not config.bwd_joint_row_sums(1024, 1, 0, 4, 3, False)  # the x1 path at 1K
    assert not config.bwd_joint_row_sums(8192, 1, 4096, 2, 1, False)  # two blocks
    assert not config.bwd_joint_row_sums(16384, 1, 4096, 2, 1, False)  # 12288 held
    for tail, dropout in itertools.product((1024, 2048), (False, True)):  # held (#65, #69)
        assert config.bwd_joint_row_sums(16384, 1, tail, 2, 3, dropout)
    assert config.bwd_joint_row_sums(8192, 1, 1024, 2, 3, True)  # dropout + LayerNorm 5120
    assert not config.bwd_joint_row_sums(8192, 1, 1024, 2, 3, False)  # LayerNorm 5120
    assert not config.bwd_joint_row_sums(8192, 1, 1024, 4, 3, False)  # the x1 path 5120
    assert config.bwd_joint_row_sums(2048, 32, 0, 2, 1, False)  # exchanged words
    assert not config.bwd_joint_row_sums(2048, 8, 0, 2, 1, True)  # ... with dropout


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 1 << 19), elem=st.sampled_from([2, 4]), w4=st.booleans(), x1=st.booleans())
def test_backward_row_sums_parts_cover_the_row(n, elem, w4, x1):
    """The pre-pass's parts (config.bwd_sums_layout): a power of two, at most
    BWD_SUMS_MAX_PARTS (BWD_SUMS_MAX_PARTS_16BIT for 16-bit rows without x1), each at least
    BWD_SUMS_PART_BYTES of the row unless the row has fewer chunks than two parts need;
    together they cover the row and only the last may run past it; one part with 4-byte
    weights (bench/NOTES.md #84, #107)."""
    block_n, chunks, parts = config.bwd_sums_layout(n, elem, w4, x1)
    most = config.BWD_SUMS_MAX_PARTS_16BIT if elem == 2 and not x1 else config.BWD_SUMS_MAX_PARTS
    assert block_n * elem <= max(config.BWD_SUMS_BLOCK_BYTES, 8 * elem)
    assert parts & (parts - 1) == 0 and 1 <= parts <= most
    assert (parts - 1) * chunks * block_n < n <= parts * chunks * block_n
    if parts > 1:
        assert chunks >= max(config.BWD_SUMS_PART_BYTES // (block_n * elem), 1)
        assert not w4
    if w4:
        assert parts == 1


def test_backward_row_sums_parts_rule():
    """Where the pre-pass takes parts (bench/NOTES.md #84, #107): rows with 16-bit weights at
    128K-256K in 8 parts of 32 KB each for 16-bit rows at 128K; at 256K 16 parts of 32 KB, but
    8 of 64 KB for the x1 path; fp32 rows with fp32 weights and bf16 rows with fp32 weights in
    one; a 32 KB row in one, 64 KB in two."""
    assert config.bwd_sums_layout(131072, 2, False, False) == (2048, 8, 8)
    assert config.bwd_sums_layout(131072, 2, False, True) == (2048, 8, 8)
    assert config.bwd_sums_layout(262144, 2, False, False) == (2048, 8, 16)
    assert config.bwd_sums_layout(262144, 2, False, True) == (2048, 16, 8)
    # an fp32 stream beside bf16 weights: 8 parts, with or without x1
    assert config.bwd_sums_layout(131072, 4, False, False) == (1024, 16, 8)
    assert config.bwd_sums_layout(262144, 4, False, False) == (1024, 32, 8)
    assert config.bwd_sums_layout(262144, 4, True, False) == (1024, 256, 1)
    assert config.bwd_sums_layout(262144, 2, True, False) == (2048, 128, 1)
    assert config.bwd_sums_layout(16384, 2, False, False) == (2048, 8, 1)
    assert config.bwd_sums_layout(32768, 2, False, False) == (2048, 8, 2)


def test_backward_row_sums_parts_through_the_backward(monkeypatch):
    """The backward asks bwd_sums_layout whether the row has x1's second weight (#107): in a
    16-bit row with dropout the pre-pass takes BWD_SUMS_MAX_PARTS_16BIT parts, in the x1 path's
    BWD_SUMS_MAX_PARTS (here 4 and 2: 64-byte chunks, parts of two, 512 columns); the
    gradients of either count of parts match those of one part."""
    if not fused_norm.autograd.use_kernels(torch.empty(1, device=DEVICE)):
        pytest.skip("the Triton kernels do not run here (no GPU, no TRITON_INTERPRET)")
    seen = []
    layout = config.bwd_sums_layout

    def spy(n_cols, elem_bytes, w4, x1):
        got = layout(n_cols, elem_bytes, w4, x1)
        seen.append((x1, got[2]))
        return got

    monkeypatch.setattr(config, "bwd_sums_layout", spy)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    n, bf16 = 512, torch.bfloat16

    def grads(x1):
        x, res, x1t = (torch.randn(3, n, generator=gen, device=DEVICE).to(bf16) for _ in range(3))
        w, b, w1, b1 = (torch.randn(n, generator=gen, device=DEVICE).to(bf16) for _ in range(4))
        leaves = [t.requires_grad_() for t in (x, res, w, b)]
        kw = dict(x1=x1t, weight1=w1, bias1=b1) if x1 else dict(dropout_p=0.25)
        runs = []
        for most in (4, 1):
            with patched_config(BWD_SUMS_MAX_PARTS=min(most, 2), BWD_SUMS_MAX_PARTS_16BIT=most):
                torch.manual_seed(5)
                outs = fused_norm.layer_norm_fn(x, w, b, residual=res, prenorm=True, **kw)
                gy = [torch.ones_like(o) for o in outs]
                runs.append(torch.autograd.grad(outs, leaves, gy))
        for a, c in zip(*runs):
            torch.testing.assert_close(a.float(), c.float(), rtol=2e-2, atol=2e-2)

    with max_block_bytes(64), patched_config(BWD_EXCHANGE=False):
        grads(x1=False)
        assert seen[0] == (False, 4), seen
        seen.clear()
        grads(x1=True)
        assert seen[0] == (True, 2), seen


def test_backward_grid_holds_what_fits():
    """The backward's persistent grid takes no more programs per SM than fit at once
    (config.BWD_RESIDENT_GRID, the count from Launcher.resident), except where whole waves
    of the BWD_WARPS_PER_SM grid measured faster (config.bwd_whole_waves)."""
    from fused_norm import config

    dev = torch.device("cpu")
    sms = config.sm_count(dev)
    assert config.bwd_num_programs(10**6, dev, 4, 1) == sms * 8  # 32 warps per SM
    assert config.bwd_num_programs(10**6, dev, 4, 1, resident=5) == sms * 5
    assert config.bwd_num_programs(10**6, dev, 4, 1, resident=12) == sms * 8
    assert config.bwd_num_programs(10**6, dev, 16, 2, resident=1) == max(sms // 2, 1)
    assert config.bwd_num_programs(3, dev, 4, 1, resident=5) == 3  # at most a row each
    assert config.bwd_whole_waves(4096, 1, 0, 1, False, True)  # RMSNorm of x alone, 4K
    assert not config.bwd_whole_waves(4096, 1, 0, 2, False, True)  # LayerNorm, 4K
    assert config.bwd_whole_waves(1024, 1, 0, 2, True, False)  # dropout + add + LayerNorm
    assert not config.bwd_whole_waves(4096, 1, 0, 2, True, False)
    assert config.bwd_whole_waves(16384, 1, 4096, 2, False, True)  # LayerNorm 12288
    assert not config.bwd_whole_waves(16384, 1, 2048, 2, False, True)  # ... 10240 (#65)
    assert not config.bwd_whole_waves(8192, 2, 0, 2, True, False)  # column blocks


def test_loose_integers_share_a_key():
    """Integer parameters the kernel does not specialise on (the backward's M, row count per
    program and slab stride, which follow from the grid) enter the launch key by their range
    only, so one compiled kernel serves every grid; the others keep Triton's classes."""
    from fused_norm.launch import key_and_pointers

    loose = (True, False)
    assert key_and_pointers((16, 16), loose)[0] == key_and_pointers((17, 16), loose)[0]
    assert key_and_pointers((1, 16), loose)[0] == key_and_pointers((33, 16), loose)[0]
    assert key_and_pointers((16, 16), loose)[0] != key_and_pointers((16, 17), loose)[0]
    assert key_and_pointers((16, 16), loose)[0] != key_and_pointers((2**40, 16), loose)[0]
    if ops._BWD.loose:  # compiled kernels (not the interpreter) name their parameters
        names = [p.name for p in ops._BWD.kernel.params if not p.is_constexpr]
        assert {n for n, lo in zip(names, ops._BWD.loose) if lo} == {
            "stride_part",
            "M",
            "rows_per_program",
        }


def test_launch_plans_are_kept_per_configuration_until_a_setting_changes(monkeypatch):
    """ops makes its launch choices once per configuration (device, width, dtypes, flags) and
    keeps them: another row count reuses them, another width or flag makes its own, and
    assigning any setting of config empties them, so that a sweep's or a test's setting is
    never met by a plan made before it."""
    from fused_norm import config

    if not fused_norm.autograd.use_kernels(torch.empty(1, device=DEVICE)):
        pytest.skip("the Triton kernels do not run here (no GPU, no TRITON_INTERPRET)")
    w = torch.randn(48, device=DEVICE, requires_grad=True)

    def step(rows, n=48, dropout_p=0.0):
        x = torch.randn(rows, n, device=DEVICE, requires_grad=True)
        y = fused_norm.rms_norm_fn(x, w[:n], None, dropout_p=dropout_p)
        y.sum().backward()

    config.settings_changed()
    assert not ops._FWD_PLANS and not ops._BWD_PLANS
    step(3)
    fwd, bwd = dict(ops._FWD_PLANS), dict(ops._BWD_PLANS)
    assert len(fwd) == 1 and len(bwd) == 1
    step(5)  # another row count: the same plans
    assert ops._FWD_PLANS == fwd and ops._BWD_PLANS == bwd
    step(3, dropout_p=0.1)  # another configuration: plans of its own
    assert len(ops._FWD_PLANS) == 2 and len(ops._BWD_PLANS) == 2
    monkeypatch.setattr(config, "BWD_TILE_BYTES", config.BWD_TILE_BYTES)
    assert not ops._FWD_PLANS and not ops._BWD_PLANS and not ops._RESIDENT
    step(3)
    assert len(ops._FWD_PLANS) == 1 and len(ops._BWD_PLANS) == 1


def test_launch_plan_follows_a_setting_changed_between_calls():
    """A setting changed between two calls of one configuration takes effect on the second
    (here the forward's rows per program, which the kernel receives as a constexpr)."""

    from fused_norm import config

    if not fused_norm.autograd.use_kernels(torch.empty(1, device=DEVICE)):
        pytest.skip("the Triton kernels do not run here (no GPU, no TRITON_INTERPRET)")
    x = torch.randn(6, 64, device=DEVICE)
    w = torch.randn(64, device=DEVICE)
    fused_norm.layer_norm_fn(x, w, None)
    (plan,) = ops._FWD_PLANS.values()
    assert plan[1] == config.fwd_rows_per_program(64, 1, "ln") > 1
    with patched_config(FWD_ROWS_PER_PROGRAM=1):
        fused_norm.layer_norm_fn(x, w, None)
        (plan,) = ops._FWD_PLANS.values()
        assert plan[1] == 1 and plan[4]["ROWS_PER_PROGRAM"] == 1


def test_custom_op_body_keeps_its_kernel_plan(monkeypatch):
    """Under torch.compile the backward runs as the custom op fused_norm::bwd, whose body gets
    no saved plan: it keeps _bwd_kernel_plan's answer by the op's arguments (ops._OP_KPLANS),
    made once per configuration and emptied with the other plans when a setting changes; the
    gradients equal those of the eager path."""
    from fused_norm import config

    if not fused_norm.autograd.use_kernels(torch.empty(1, device=DEVICE)):
        pytest.skip("the Triton kernels do not run here (no GPU, no TRITON_INTERPRET)")
    torch.manual_seed(0)
    x = torch.randn(5, 48, device=DEVICE)
    w = torch.randn(48, device=DEVICE)
    b = torch.randn(48, device=DEVICE)
    y, _, _, mean, rstd, _, _ = ops.fused_norm_fwd(
        x, w, b, None, None, None, None, None, None, None, 1e-5, 0.0, False, False, x.dtype,
        x.dtype, store_residual_out=False,
    )  # fmt: skip
    dy = torch.randn_like(y)

    def bwd():
        return ops.fused_norm_bwd(dy, x, w, b, None, None, mean, rstd)

    eager = bwd()
    made = []  # plans the op's body made (fused_norm_bwd makes its own while tracing)
    plan = ops._bwd_kernel_plan

    def counted(*args):
        made.append(sys._getframe(1).f_code.co_name == "_bwd_run")
        return plan(*args)

    monkeypatch.setattr(ops, "_bwd_kernel_plan", counted)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    config.settings_changed()
    first, second = bwd(), bwd()
    assert sum(made) == 1 and len(ops._OP_KPLANS) == 1
    for a, e in ((first, eager), (second, eager)):
        for t, u in zip(a, e):
            assert (t is None) == (u is None)
            if t is not None:
                torch.testing.assert_close(t, u, rtol=0, atol=0)
    config.settings_changed()
    assert not ops._OP_KPLANS


def test_bwd_smem_rule_and_layout(monkeypatch):
    """config.bwd_smem_partials: only LayerNorm-type rows (a norm of x alone, or with a residual
    gradient in and out and x's dropout where BWD_SMEM_RESIDUAL) with two partials (or one, a
    norm without a bias, where BWD_SMEM_ONE_PARTIAL), 16-bit rows beside 16-bit weights (or
    4-byte ones, where BWD_SMEM_W4_16BIT), 10K-16K columns (multiples of 16), aligned rows,
    on an NVIDIA GPU that fits
    the kernel, never under the interpreter; bwd_smem_layout holds a power-of-two row whole
    and another as 8192 + a power-of-two tail, staged as deep as shared memory allows beside
    the partial dW or, where bwd_smem_dw_regs keeps dW in registers, the weight."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(config, "_smem_ok", lambda index: True)
    monkeypatch.setattr(config, "INTERPRETED", False)
    from fused_norm import smem_kernels

    if not smem_kernels.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    ok = dict(n_cols=12288, elem_bytes=2, partials=2, kind="plain", device=gpu, w4=False,
              aligned=True, staged_bytes=4)  # fmt: skip
    assert config.bwd_smem_partials(**ok)
    assert config.bwd_smem_partials(**{**ok, "kind": "residual"})
    for change in (dict(n_cols=10240), dict(n_cols=16400), dict(n_cols=12296),
                   dict(elem_bytes=4, staged_bytes=8), dict(partials=4), dict(kind=None),
                   dict(aligned=False), dict(device=torch.device("cpu")),
                   dict(kind="residual", n_cols=16400)):  # fmt: skip
        assert not config.bwd_smem_partials(**{**ok, **change}), change
    assert config.bwd_smem_partials(**{**ok, "n_cols": 16384})
    assert config.bwd_smem_partials(**{**ok, "kind": "residual", "n_cols": 16384})
    # 16-bit rows beside 4-byte weights (BWD_SMEM_W4_16BIT), whole or in slices, as beside
    # 16-bit ones; without BWD_SMEM_W4_16BIT kernels.py's backward.
    w4_cases = (dict(w4=True), dict(w4=True, kind="residual", n_cols=16384),
                dict(w4=True, partials=1, n_cols=14336), dict(w4=True, n_cols=32768),
                dict(w4=True, n_cols=16384, partials=4, kind="x1", staged_bytes=8))  # fmt: skip
    for change in w4_cases:
        assert config.bwd_smem_partials(**{**ok, **change}), change
    # Beyond 32K their 16K slices fit 2 rows deep, not LAG's 3: taken without LAG in up to 8
    # slices (BWD_SMEM_NOLAG_MAX_SPLIT), with one partial in up to 4; no other rows take
    # slices without LAG where LAG would be due (bf16 x with an fp32 stream of its own).
    assert config.bwd_smem_slices(65536, 4, 4) == (16384, 4, 2, False)
    assert config.bwd_smem_slices(131072, 4, 4) == (16384, 8, 2, False)
    assert config.bwd_smem_slices(262144, 4, 4) is None
    assert config.bwd_smem_slices(32768, 8, 8, True) == (8192, 4, 2, False)
    for change in (dict(n_cols=65536), dict(n_cols=131072), dict(n_cols=65536, partials=1),
                   dict(n_cols=32768, partials=4, kind="x1", staged_bytes=8),
                   dict(n_cols=65536, partials=4, kind="x1", staged_bytes=8)):  # fmt: skip
        assert config.bwd_smem_partials(**{**ok, "w4": True, **change}), change
    for change in (dict(n_cols=262144), dict(n_cols=131072, partials=1),
                   dict(n_cols=131072, partials=4, kind="x1", staged_bytes=8),
                   dict(w4=False, elem_bytes=4, staged_bytes=6, n_cols=65536)):  # fmt: skip
        assert not config.bwd_smem_partials(**{**ok, "w4": True, **change}), change
    assert config.bwd_smem_slices(65536, 6, 2) == (16384, 4, 2, False)
    fp32_rows = dict(w4=True, elem_bytes=4, staged_bytes=8, n_cols=16384)  # 4-byte rows: slices
    with monkeypatch.context() as mp:
        mp.setattr(config, "BWD_SMEM_W4_16BIT", False)
        for change in w4_cases:
            assert not config.bwd_smem_partials(**{**ok, **change}), change
        assert config.bwd_smem_partials(**ok)
        assert config.bwd_smem_partials(**{**ok, **fp32_rows})
    # One partial (a norm without a bias): as two, but not 4-byte rows in more than 8 slices,
    # nor RMSNorm's whole block of 16384 columns.
    one = dict(ok, partials=1)
    for change in ({}, dict(kind="residual"), dict(n_cols=14336), dict(n_cols=32768),
                   dict(n_cols=262144), dict(n_cols=16384), dict(n_cols=16384, kind="residual"),
                   dict(n_cols=12288, rms_norm=True), dict(n_cols=32768, rms_norm=True),
                   dict(n_cols=65536, elem_bytes=4, w4=True, staged_bytes=8),
                   dict(n_cols=16384, elem_bytes=4, kind="residual", staged_bytes=10,
                        rms_norm=True)):  # fmt: skip
        assert config.bwd_smem_partials(**{**one, **change}), change
    for change in (dict(n_cols=16384, rms_norm=True),
                   dict(n_cols=16384, kind="residual", rms_norm=True),
                   dict(n_cols=32768, kind="residual"),
                   dict(n_cols=131072, elem_bytes=4, w4=True, staged_bytes=8),
                   dict(n_cols=32768, elem_bytes=4, kind="residual", staged_bytes=12)):  # fmt: skip
        assert not config.bwd_smem_partials(**{**one, **change}), change
    with monkeypatch.context() as mp:
        mp.setattr(config, "BWD_SMEM_ONE_PARTIAL", False)
        assert not config.bwd_smem_partials(**one)
        assert config.bwd_smem_partials(**ok)
    with monkeypatch.context() as mp:
        mp.setattr(config, "BWD_SMEM_RESIDUAL_MAX_COLS", 12288)
        assert not config.bwd_smem_partials(**{**ok, "kind": "residual", "n_cols": 12304})
        assert config.bwd_smem_partials(**{**ok, "n_cols": 12304})
    # Rows in slices that exchange their row sums: LayerNorm alone of 16-bit rows in
    # 16K-column slices (2 to 16), of 4-byte rows in 8K-column slices; with a residual only
    # 4-byte rows in two slices; no slice staging less than 64 KB of a row, none but whole.
    sliced = dict(ok, n_cols=32768)
    fp32 = dict(elem_bytes=4, w4=True, staged_bytes=8)
    for change in ({}, dict(n_cols=49152), dict(n_cols=262144), dict(fp32, n_cols=16384),
                   dict(fp32, n_cols=131072),
                   dict(n_cols=16384, elem_bytes=4, kind="residual", staged_bytes=12, w4=True),
                   dict(n_cols=16384, elem_bytes=4, kind="residual", staged_bytes=10)):  # fmt: skip
        assert config.bwd_smem_partials(**{**sliced, **change}), change
    for change in (dict(n_cols=20480), dict(n_cols=524288), dict(w4=True, n_cols=262144),
                   dict(kind="residual", staged_bytes=6),
                   dict(n_cols=12288, elem_bytes=4, staged_bytes=8),
                   dict(n_cols=262144, elem_bytes=4, staged_bytes=8),
                   dict(n_cols=65536, elem_bytes=4, kind="residual", staged_bytes=12),
                   dict(aligned=False)):  # fmt: skip
        assert not config.bwd_smem_partials(**{**sliced, **change}), change
    # x1's path with its second output (four partials, dy1 staged; x1's slices may stage 48 KB
    # of a row): 16-bit rows in 8K-column slices with dresidual_out staged (prenorm) or not,
    # 4-byte rows in 4K or 8K, 16-bit parameters beside 16-bit rows.
    x1 = dict(ok, n_cols=16384, partials=4, kind="x1", staged_bytes=8)
    fp32_x1 = dict(elem_bytes=4, w4=True, staged_bytes=16)
    for change in ({}, dict(n_cols=24576), dict(n_cols=131072), dict(staged_bytes=6),
                   dict(fp32_x1), dict(fp32_x1, n_cols=65536), dict(fp32_x1, staged_bytes=12),
                   dict(elem_bytes=4, staged_bytes=12), dict(elem_bytes=4, staged_bytes=8)):  # fmt: skip
        assert config.bwd_smem_partials(**{**x1, **change}), change
    for change in (dict(n_cols=12288), dict(n_cols=262144), dict(fp32_x1, n_cols=131072),
                   dict(partials=2), dict(w4=True, n_cols=131072), dict(kind="plain"),
                   dict(aligned=False)):  # fmt: skip
        assert not config.bwd_smem_partials(**{**x1, **change}), change
    assert not config.bwd_smem_partials(**{**ok, "partials": 4})
    assert config.bwd_smem_sliced(16384, 2, "x1") and not config.bwd_smem_sliced(16384, 2)
    assert config.bwd_smem_slices(16384, 8, 4, True) == (8192, 2, 2, False)
    assert config.bwd_smem_slices(16384, 6, 4, True) == (8192, 2, 2, False)
    assert config.bwd_smem_slices(16384, 6, 4) is None  # 48 KB: x1's slices only
    assert config.bwd_smem_slices(65536, 16, 8, True) == (4096, 16, 3, True)
    assert config.bwd_smem_slices(32768, 12, 4, True) == (4096, 8, 3, True)
    # Two slices of a power of two + a tail, x1's only, staging at least 64 KB of a row.
    assert config.bwd_smem_slices(20480, 8, 4, True) == (10240, 2, 2, False)
    assert config.slice_parts(10240) == (8192, 2048) and config.slice_parts(8192) == (8192, 0)
    assert config.bwd_smem_slices(20480, 8, 4) is None
    assert config.bwd_smem_slices(20480, 6, 4, True) is None  # 60 KB
    assert config.bwd_smem_slices(12288, 8, 4, True) is None  # 48 KB
    assert config.bwd_smem_partials(**{**x1, "n_cols": 20480})
    # Any width asks (bwd_smem_partials asks before it checks the width): no slices, no error.
    for n, x1_path in itertools.product(range(0, 70), (False, True)):
        assert config.bwd_smem_slices(n, 8, 4, x1_path) is None
        case = {**x1, "n_cols": n} if x1_path else {**ok, **fp32, "n_cols": n}
        assert not config.bwd_smem_partials(**case)
    with monkeypatch.context() as mp:
        mp.setattr(config, "BWD_SMEM_X1_TAILS", False)
        assert config.bwd_smem_slices(20480, 8, 4, True) is None
        mp.setattr(config, "BWD_SMEM_X1", False)
        assert not config.bwd_smem_partials(**x1)
    assert config.bwd_smem_slices(32768, 4, 2) == (16384, 2, 2, False)
    assert config.bwd_smem_slices(49152, 4, 2) == (16384, 3, 3, True)
    assert config.bwd_smem_slices(262144, 4, 2) == (16384, 16, 3, True)
    assert config.bwd_smem_slices(16384, 8, 4) == (8192, 2, 2, False)
    assert config.bwd_smem_slices(16384, 12, 4) == (8192, 2, 2, False)
    assert config.bwd_smem_slices(131072, 8, 4) == (8192, 16, 3, True)
    for n, staged, weight, x1 in itertools.product(
        range(16384, 262145, 8192), (4, 6, 8, 10, 12, 16), (2, 4, 8), (False, True)
    ):
        slices = config.bwd_smem_slices(n, staged, weight, x1)
        if slices is not None:
            width, split, stages, lag = slices
            assert width * split == n and 2 <= split <= config.BWD_SMEM_MAX_SPLIT
            least = config.BWD_SMEM_X1_SLICE_MIN_BYTES if x1 else config.BWD_SMEM_SLICE_MIN_BYTES
            assert width * staged >= least
            block, tail = config.slice_parts(width)
            if tail:
                assert x1 and split == 2 and block >= tail >= block // 4 and tail % 512 == 0
                assert width * staged >= config.BWD_SMEM_SLICE_MIN_BYTES
            assert width * (weight + stages * staged) <= config.BWD_SMEM_BYTES
            assert stages == 2 + lag and (not lag or split >= config.BWD_SMEM_LAG_MIN_SPLIT)
            if not lag and split >= config.BWD_SMEM_LAG_MIN_SPLIT:  # LAG's 3 rows do not fit
                assert split <= config.BWD_SMEM_NOLAG_MAX_SPLIT
                assert width * (weight + 3 * staged) > config.BWD_SMEM_BYTES
    monkeypatch.setattr(config, "BWD_SMEM_RESIDUAL", False)
    assert not config.bwd_smem_partials(**{**ok, "kind": "residual"})
    assert config.bwd_smem_partials(**ok)
    monkeypatch.setattr(config, "BWD_SMEM_SPLIT", False)
    assert not config.bwd_smem_partials(**sliced)
    monkeypatch.setattr(config, "INTERPRETED", True)
    assert not config.bwd_smem_partials(**ok)
    assert config.bwd_smem_layout(16384) == (16384, 0, 2)
    assert config.bwd_smem_layout(12288) == (16384, 4096, 2)
    assert config.bwd_smem_layout(10256) == (16384, 4096, 2)
    assert config.bwd_smem_layout(14336) == (16384, 0, 2)  # a tail of 8192: the padded block
    assert config.bwd_smem_layout(12288, True) == (16384, 4096, 2)
    assert config.bwd_smem_layout(16384, True) == (16384, 0, 2)
    # dW in registers, the weight in shared memory: with dresidual_out, or bf16 weights
    assert config.bwd_smem_dw_regs(True, torch.float16, 0)
    assert config.bwd_smem_dw_regs(False, torch.bfloat16, 0)
    assert not config.bwd_smem_dw_regs(False, torch.float16, 0)  # one block, fp16 weights
    assert config.bwd_smem_dw_regs(False, torch.float16, 4096)  # 8192 + a tail
    assert config.bwd_smem_layout(16384, False, torch.float16) == (16384, 0, 2)
    # fp32 weights: dW in shared memory on one block (the weight in registers), in registers on
    # 8192 + a tail or with dresidual_out staged, the fp32 weight then in shared memory beside
    # one staged row at 16384 columns.
    assert not config.bwd_smem_dw_regs(False, torch.float32, 0)
    assert config.bwd_smem_layout(16384, False, torch.float32) == (16384, 0, 2)
    assert config.bwd_smem_layout(12288, False, torch.float32) == (16384, 4096, 2)
    assert config.bwd_smem_layout(12288, True, torch.float32) == (16384, 4096, 2)
    assert config.bwd_smem_layout(16384, True, torch.float32) == (16384, 0, 1)
    # Where the rule takes dresidual_out (up to BWD_SMEM_RESIDUAL_MAX_COLS) it is staged too,
    # beside the weight (16-bit) where dW is in registers, else beside the fp32 partial dW.
    for n, dres_out, wdt in itertools.product(
        range(config.BWD_SMEM_MIN_COLS + 15, config.BWD_SMEM_MAX_COLS + 1, 16), (False, True),
        (torch.bfloat16, torch.float16, torch.float32),
    ):  # fmt: skip
        if dres_out and n > config.BWD_SMEM_RESIDUAL_MAX_COLS:
            continue
        block, tail, stages = config.bwd_smem_layout(n, dres_out, wdt)
        held = block // 2 + tail if tail else block
        assert held >= n and stages >= (1 if wdt == torch.float32 else 2)
        fixed = wdt.itemsize if config.bwd_smem_dw_regs(dres_out, wdt, tail) else 4
        assert held * (fixed + 2 * stages * (3 if dres_out else 2)) <= config.BWD_SMEM_BYTES


def test_bwd_smem_fp32_dropout_rows_hold_dresidual_out_in_registers():
    """Dropout + add + LayerNorm of fp32 rows in slices (config.bwd_smem_dres_regs): the
    smem backward loads dresidual_out into registers instead of staging it (ops._staged_bytes
    leaves it out, so the slices' layout is sized for s and dy) and takes 4 columns a thread
    (config.bwd_smem_fp32_vec), where the decisions' move fits beside what the slice stages;
    not without dropout, not for bf16 x with an fp32 stream, not for x1's second output, and
    rows of 16-bit elements keep 8 columns a thread."""
    from fused_norm import ops
    from fused_norm.launch import Stand

    f32, bf16 = torch.float32, torch.bfloat16
    n = 16384
    row = lambda dt: Stand(dt, (1, n))  # noqa: E731
    assert ops._staged_bytes(row(f32), row(f32), row(f32), None, True) == 8
    assert ops._staged_bytes(row(f32), row(f32), row(f32), None, False) == 12
    assert ops._staged_bytes(row(f32), row(bf16), row(f32), None, True) == 10
    assert ops._staged_bytes(row(f32), row(f32), row(f32), row(f32), True) == 16

    def flags(dropout, dy=f32, weight=f32, x1=None):
        """smem_flags of an fp32 stream with dy of ``dy``, staged as the launch stages it."""
        staged = ops._staged_bytes(row(f32), row(dy), row(f32), x1 and row(x1), dropout)
        return ops.smem_flags(n, 4, False, True, False, True, True, dropout, weight, staged, x1,
                              x1 is not None, dy.itemsize)  # fmt: skip

    f = flags(True)
    assert (f["DRES_REGS"], f["VEC"], f["BLOCK_N"], f["SPLIT"]) == (True, 4, 8192, 2)
    assert f["STAGES"] == 2 and not f["LAG"]
    f = flags(False)
    assert (f["DRES_REGS"], f["VEC"], f["BLOCK_N"], f["SPLIT"]) == (False, 4, 8192, 2)
    f = flags(True, dy=bf16, weight=bf16)
    assert (f["DRES_REGS"], f["VEC"], f["BLOCK_N"], f["SPLIT"]) == (False, 8, 8192, 2)
    assert not flags(True, x1=f32)["DRES_REGS"]
    assert not ops.smem_flags(n, 2, False, True, False, True, True, True)["DRES_REGS"]
    with_dropout = dict(dropout=True, dres_regs=True, width=8192)
    assert config.bwd_smem_fp32_vec(**with_dropout, fixed_bytes=20) == 4  # 2 stages of s, dy
    assert config.bwd_smem_fp32_vec(**with_dropout, fixed_bytes=28) == 8  # 3: no room to move
    assert config.bwd_smem_fp32_vec(True) == 8 and config.bwd_smem_fp32_vec(False) == 4
    assert not config.bwd_smem_dres_regs(False, 4, False)
    assert not config.bwd_smem_dres_regs(True, 4, True)
    assert config.bwd_smem_dres_regs(False, 4, True)


def test_bwd_smem_plan_covers_only_what_the_kernel_does(monkeypatch):
    """What fused_norm_bwd launches at 12288 and 16384 columns on a (stand-in) Hopper GPU:
    smem_kernels' kernel for LayerNorm with a bias alone, with a residual (prenorm or not) and
    x's dropout, and (at 16384, in slices) x1's second output with a second bias, and for a
    norm without a bias (but RMSNorm's whole 16384 columns); kernels.py's for what the Gluon
    kernel does not do (rowscale, layerscale, x1's dropout, x1's second output without
    biases). Before this rule, rowscale and layerscale took the
    Gluon kernel, which ignored them."""
    from fused_norm import smem_kernels

    if not smem_kernels.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(config, "_nvidia", lambda device: True)
    monkeypatch.setattr(config, "_smem_ok", lambda index: True)
    monkeypatch.setattr(config, "_sm90", lambda index: True)
    monkeypatch.setattr(config, "INTERPRETED", False)
    monkeypatch.setattr(config, "split_rows_ok", lambda device: True)
    monkeypatch.setattr(config, "sm_count", lambda device: 132)
    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __call__(self, *args, **kwargs):
            launched.append(self.name)

        def warm(self, *args, **kwargs):
            pass

        def resident(self, *args, **kwargs):
            return 0

    for name in ("_BWD", "_SUMS", "_ADD", "_RED", "_SMEM"):
        monkeypatch.setattr(ops, name, Recorder(name), raising=False)
    for n in (12288, 16384):
        _smem_plan_cases(n, launched)


def _smem_plan_cases(n, launched):
    m, bf16 = 4, torch.bfloat16
    s, dy, dres_out = (torch.randn(m, n, dtype=bf16) for _ in range(3))
    w, b = torch.randn(n, dtype=bf16), torch.randn(n, dtype=bf16)
    seeds = torch.zeros(2 * m, dtype=torch.int64)
    stats = dict(mean=torch.zeros(m), rstd=torch.ones(m))
    drop = dict(seeds=seeds, dropout_p=0.1, residual_dtype=bf16)
    x1 = dict(weight1=w, bias1=b, dy1=dy, x1_dtype=bf16)  # x1's second output, its biases
    cases = {
        "ln": (True, dict()),
        "rms_bias": (True, dict(is_rms_norm=True)),
        "residual": (True, dict(residual_dtype=bf16)),
        "prenorm": (True, dict(residual_dtype=bf16, dresidual_out=dres_out)),
        "dropout_prenorm": (True, dict(drop, dresidual_out=dres_out)),
        "dropout": (True, drop),
        "rowscale": (False, dict(rowscale=torch.ones(m, dtype=bf16))),
        "rowscale_dropout": (False, dict(drop, rowscale=torch.ones(m, dtype=bf16))),
        "layerscale": (False, dict(bias=None, layerscale=torch.ones(n, dtype=bf16), x0=s)),
        "x1_dropout": (False, dict(drop, x1_dtype=bf16)),
        "x1_w1": (False, dict(weight1=w, bias=None, dy1=dy, x1_dtype=bf16)),
        "x1_w1_b1": (n == 16384, dict(x1, residual_dtype=bf16)),
        "x1_w1_b1_prenorm": (n == 16384, dict(x1, residual_dtype=bf16, dresidual_out=dres_out)),
        "no_bias": (True, dict(bias=None)),
        "rms_no_bias": (n != 16384, dict(bias=None, is_rms_norm=True)),
    }
    for name, (gluon, extra) in cases.items():
        config.settings_changed()
        launched.clear()
        kwargs = {"bias": b, **stats, **extra}
        ops.fused_norm_bwd(dy, s, w, kwargs.pop("bias"), kwargs.pop("weight1", None),
                           kwargs.pop("bias1", None), **kwargs)  # fmt: skip
        assert launched[0] == ("_SMEM" if gluon else "_BWD"), (n, name, launched)
    config.settings_changed()


def test_smem_kernel_compiles_for_sm90():
    """The Gluon kernel compiles for an H100/H200 (sm_90) with this Triton, offline
    (scripts/compile_smem.py, in a process without the interpreter: there is no Gluon under
    it, so this is what CI can check of the kernel), for LayerNorm with a bias alone (dW in
    registers; fp16 at 16384: in shared memory) and for dropout + add + LayerNorm with prenorm at
    both layouts (a whole 16384 row; 8192 + a 4096 tail), both also with bf16 rows beside fp32
    weights (one staged row beside the fp32 weight at 16384 with prenorm), and for rows in
    slices (4-byte rows
    at 16384, 16-bit and fp32 rows at 65536, x1's path at 16384 and 65536), and for RMSNorm
    without a bias where the rule takes it, within the shared memory a Hopper block may
    take."""
    import os
    import re
    import subprocess

    from fused_norm import smem_kernels

    if not smem_kernels.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "compile_smem.py"), "12288", "16384",
         "20480", "65536"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    for n, dtype, residual in itertools.product(
        (12288, 16384), ("bf16", "fp16", "bf16_w32"), (False, True)
    ):
        if dtype == "fp16" and residual:
            continue
        w = {"bf16": torch.bfloat16, "fp16": torch.float16, "bf16_w32": torch.float32}[dtype]
        block, tail, stages = config.bwd_smem_layout(n, residual, w)
        line = re.search(rf"(?m)^dtype={dtype} n={n} residual={residual} x1=False .*",
                         out.stdout).group(0)  # fmt: skip
        shared = int(re.search(r"shared=(\d+)", line).group(1))
        held = block // 2 + tail if tail else block
        dw_regs = config.bwd_smem_dw_regs(residual, w, tail)  # the weight, or dW (fp32), beside
        assert f"dw_regs={dw_regs}" in line
        assert dw_regs == (residual or dtype == "bf16" or n == 12288)
        staged = held * ((w.itemsize if dw_regs else 4) + 2 * stages * (3 if residual else 2))
        assert staged <= shared <= 227 * 1024, out.stdout
    # Rows in slices (config.bwd_smem_slices): 4-byte rows at 16384 (fp32 rows' dresidual_out
    # in registers, not staged: config.bwd_smem_dres_regs), 16-bit rows at 65536, x1's
    # path (s, dy, dresidual_out and dy1 staged beside two weights) at 16384 and 65536, of
    # 4-byte rows at 16384, and at 20480 in two slices of 8192 + a 2048 tail.
    for n, dtype, residual, x1, staged, weight in ((16384, "fp32", False, False, 8, 4),
                                                   (16384, "fp32", True, False, 8, 4),
                                                   (16384, "bf16_res32", True, False, 10, 2),
                                                   (65536, "bf16", False, False, 4, 2),
                                                   (65536, "fp32", False, False, 8, 4),
                                                   (16384, "bf16", False, True, 8, 4),
                                                   (16384, "fp16", False, True, 8, 4),
                                                   (65536, "bf16", False, True, 8, 4),
                                                   (16384, "fp32", False, True, 16, 8),
                                                   (16384, "bf16_res32", False, True, 12, 4),
                                                   (20480, "bf16", False, True, 8, 4)):  # fmt: skip
        width, split, stages, _ = config.bwd_smem_slices(n, staged, weight, x1)
        block, tail = config.slice_parts(width)
        line = re.search(rf"(?m)^dtype={dtype} n={n} residual={residual} x1={x1} .*",
                         out.stdout).group(0)  # fmt: skip
        assert f"block,tail,stages,split={(block, tail, stages, split)}" in line, line
        shared = int(re.search(r"shared=(\d+)", line).group(1))
        assert width * (weight + stages * staged) <= shared <= 227 * 1024, line
    # RMSNorm without a bias (one partial, config.BWD_SMEM_ONE_PARTIAL): 8192 + a tail at
    # 12288 (alone, and with a residual and dropout), slices at 65536 (16-bit, fp32) and 16384
    # (fp32; bf16 x with an fp32 stream with a residual); not a whole 16384 of 16-bit rows.
    for n, dtype, residual, layout in ((12288, "bf16", False, (8192, 4096, 2, 1)),
                                       (12288, "bf16", True, (8192, 4096, 2, 1)),
                                       (65536, "bf16", False, (16384, 0, 3, 4)),
                                       (65536, "fp32", False, (8192, 0, 3, 8)),
                                       (16384, "fp32", False, (8192, 0, 2, 2)),
                                       (16384, "bf16_res32", True, (8192, 0, 2, 2))):  # fmt: skip
        line = re.search(rf"(?m)^rms dtype={dtype} n={n} residual={residual} x1=False .*",
                         out.stdout).group(0)  # fmt: skip
        assert f"block,tail,stages,split={layout}" in line and "stack=0" in line, line
        assert int(re.search(r"shared=(\d+)", line).group(1)) <= 227 * 1024, line
    assert not re.search(r"(?m)^rms dtype=bf16 n=16384 ", out.stdout), out.stdout


def test_only_dependent_kernels_launch_as_programmatic_dependents(monkeypatch):
    """Triton's launch_pdl goes with the constexpr GDC (which makes the kernel wait for the
    kernel before it) and only for the kernels launched after another of the backward's: the
    shares' sum, the backward kernel and the partials' sum; the forward and the row-sums
    pre-pass, which follow other code's kernels, never. config.bwd_pdl: only on sm_90+ GPUs."""
    from fused_norm import config, ops

    for launcher, dependent in ((ops._FWD, False), (ops._SUMS, False), (ops._ADD, True),
                                (ops._BWD, True), (ops._RED, True)):  # fmt: skip
        assert launcher.dependent == dependent, launcher.kernel
        for gdc in (False, True):
            options = launcher._options({"A": 1, "GDC": gdc}, 4, None, None)
            assert options.get("launch_pdl", False) == (dependent and gdc), (launcher, options)
    assert "launch_pdl" not in ops._RED._options({"STAGES": 2}, 4, 2, 64)
    monkeypatch.setattr(config, "INTERPRETED", False)
    monkeypatch.setattr(config, "_nvidia", lambda device: device.type == "cuda")
    gpu = torch.device("cuda", 0)
    for capable in (False, True):
        monkeypatch.setattr(config, "_sm90", lambda index, capable=capable: capable)
        assert config.bwd_pdl(gpu) == capable
        assert not config.bwd_pdl(torch.device("cpu"))
    monkeypatch.setattr(config, "BWD_PDL", False)
    assert not config.bwd_pdl(gpu)


@pytest.mark.parametrize(
    "n, partials, programs",
    [(262144, 2, 4), (262144, 4, 4), (131072, 2, 8), (65536, 2, 16), (4096, 2, 264), (300, 5, 3)],
)
def test_partials_sum_tile_holds_the_few_row_blocks(n, partials, programs, monkeypatch):
    """config.partials_sum_layout: with fewer row blocks than a 256-column tile holds, the tile
    holds the power of two that holds them (not 16 rows, most of them masked) and is wider,
    unless the grid would then have fewer than two programs per SM; a tile is always
    PARTIALS_SUM_TILE values; with many row blocks the 256-column tile as before."""
    from fused_norm import config

    monkeypatch.setattr(config, "sm_count", lambda device: 132)
    block_n, block_p, stages = config.partials_sum_layout(n, partials, programs, None)
    assert block_n * block_p == config.PARTIALS_SUM_TILE
    two_per_sm = config.cdiv(n, block_n) * partials >= 2 * 132
    if programs < 16:
        assert block_p == config.next_power_of_2(programs) or not two_per_sm, (block_n, block_p)
        assert stages == 1
    else:
        assert block_n <= 256
    assert two_per_sm or block_n == 16  # narrowed until two programs per SM, or to 16 columns

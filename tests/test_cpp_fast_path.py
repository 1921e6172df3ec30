"""The C++ fast path's host side (fused_norm/fast_path.py), on CPU: how a recorded call becomes a
recipe (kernel parameters packed as Triton's launcher packs them, each tensor argument mapped
to the slot that holds it, a call that cannot be replayed refused), what ops records of a real
call, and that the extension compiles against this torch. Its launches and autograd node run
on a GPU only: tests/gpu/test_gpu_fast_path.py compares them with the Python path bit for bit.
"""

from __future__ import annotations

import os
import shutil
import struct
import sys
import warnings
import weakref
from types import SimpleNamespace

import pytest
import torch
from _helpers import DEVICE

from fused_norm import fast_path, functional, layer_norm_fn, ops


@pytest.fixture(autouse=True)
def _fresh():
    ops.clear_plans()
    yield
    ops.clear_plans()


@pytest.mark.parametrize(
    "ty,value,expected",
    [
        ("i32", 7, 7),
        ("i32", -1, 0xFFFFFFFF),
        ("i64", -2, 2**64 - 2),
        ("i64", 2**40 + 3, 2**40 + 3),
        ("u64", 2**63 + 5, 2**63 + 5),
        ("i1", True, 1),
        ("fp32", 1.5, struct.unpack("<I", struct.pack("<f", 1.5))[0]),
        ("fp32", 1e-6, struct.unpack("<I", struct.pack("<f", 1e-6))[0]),
        ("fp64", -0.25, struct.unpack("<Q", struct.pack("<d", -0.25))[0]),
    ],
)
def test_scalar_parameters_pack_as_tritons_launcher_does(ty, value, expected):
    assert fast_path.pack(ty, value) == expected


def test_unknown_parameter_type_is_refused():
    with pytest.raises(fast_path.Unservable):
        fast_path.pack("bf16", 1.0)


def _compiled(signature, num_warps=4, shared=1024, **md):
    """A stand-in for launch.Compiled: a kernel with a signature and metadata."""
    meta = SimpleNamespace(num_warps=num_warps, shared=shared, num_ctas=1, **md)
    kernel = SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=meta)
    return SimpleNamespace(kernel=kernel, function=0xABC, grid=(5, 2, 1), shared=shared)


SIG = {"X": "*bf16", "Y": "*bf16", "B": "constexpr", "stride": "i32", "eps": "fp32",
       "SEED_KEY": "i64", "M": "i64", "BLOCK_N": "constexpr"}  # fmt: skip


def test_a_recorded_launch_becomes_cells_pointers_and_the_key():
    x, y = torch.zeros(2, 4), torch.zeros(2, 4)
    rec = fast_path.Recording()
    rec.allocs.append(y)
    # runtime arguments in the kernel's order, then the constexpr values
    rec.launches.append((_compiled(SIG), (x, y, None, 4, 1e-5, 2**40, 2**33), (1024,)))
    allocs, launches, workspaces, results = fast_path.stage(rec, [x], [y])
    assert workspaces == []
    assert allocs == [([2, 4], torch.float32, None)]
    assert results == [1]
    function, grid, threads, shared, cells, ptrs, key, pdl = launches[0]
    assert pdl == 0
    assert (function, grid, threads, shared) == (0xABC, [5, 2, 1], 128, 1024)
    # X, Y, stride, eps, SEED_KEY, M, and Triton's two scratch pointers; constexprs dropped
    assert len(cells) == 8 and cells[-2:] == [0, 0]
    assert ptrs == [(0, 0), (1, 1)]
    assert key == 4 and cells[4] == 0
    assert cells[2] == 4 and cells[3] == fast_path.pack("fp32", 1e-5) and cells[5] == 2**33


def test_a_programmatic_dependent_launch_keeps_its_flag():
    """A kernel compiled with launch_pdl (the partials' sum on Hopper) is replayed as one."""
    x = torch.zeros(2, 4)
    rec = fast_path.Recording()
    rec.launches.append((_compiled({"X": "*fp32"}, launch_pdl=True), (x,), ()))
    rec.launches.append((_compiled({"X": "*fp32"}), (x,), ()))
    _, launches, _, _ = fast_path.stage(rec, [x], [])
    assert [launch[7] for launch in launches] == [1, 0]


def test_the_same_view_through_another_object_finds_its_slot():
    x = torch.zeros(3, 4)
    rec = fast_path.Recording()
    alias = x.view(3, 4)
    rec.launches.append((_compiled({"X": "*fp32"}), (alias,), ()))
    _, launches, _, _ = fast_path.stage(rec, [x], [])
    assert launches[0][5] == [(0, 0)]


def test_workspaces_take_two_slots_after_the_allocations():
    """A launch's exchange workspace and the buffer it cleans: slots after the allocations, in
    the order taken, with their words and fill value."""
    x, y = torch.zeros(2, 4), torch.zeros(2, 4)
    ws, ws_next = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    rec = fast_path.Recording()
    rec.allocs.append(y)
    rec.workspaces.append((ws, ws_next, 6, -1))
    sig = {"X": "*fp32", "Y": "*fp32", "WS": "*i64", "WS_NEXT": "*i64"}
    rec.launches.append((_compiled(sig), (x, y, ws, ws_next), ()))
    _, launches, workspaces, results = fast_path.stage(rec, [x], [y])
    assert workspaces == [(6, -1)] and results == [1]
    assert launches[0][5] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    with pytest.raises(fast_path.Unservable):  # a workspace is never an output
        fast_path.stage(rec, [x], [ws])


@pytest.mark.parametrize(
    "why",
    ["copy", "signature", "scratch", "clusters", "refused"],
)
def test_what_cannot_be_replayed_is_refused(why):
    x = torch.zeros(2, 4)
    rec = fast_path.Recording()
    sig, md, arg = {"X": "*fp32"}, {}, x
    if why == "copy":
        arg = x.clone()  # a tensor no slot holds
    elif why == "signature":
        sig = {"X": "*fp32", "n": "i32"}  # one argument for two parameters
    elif why == "scratch":
        md = {"global_scratch_size": 64}
    elif why == "clusters":
        md = {"num_ctas": 2}
    else:
        rec.refuse("dropout seeds drawn by torch")
    compiled = _compiled(sig)
    compiled.kernel.metadata.__dict__.update(md)
    rec.launches.append((compiled, (arg,), ()))
    with pytest.raises(fast_path.Unservable):
        fast_path.stage(rec, [x], [])


def test_ops_records_allocations_saved_tensors_and_outputs():
    """A real call under a Recording: its outputs are allocations, what it saves is given or
    allocated, and a launch that does not go direct (the first, or the interpreter's) refuses
    the recording."""
    m, n = 6, 32
    x = torch.randn(m, n, device=DEVICE, requires_grad=True)
    w = torch.randn(n, device=DEVICE, requires_grad=True)
    res = torch.randn(m, n, device=DEVICE)
    with fast_path.Recording() as rec:
        y, s = layer_norm_fn(x, w, None, residual=res, prenorm=True, dropout_p=0.2)
    assert fast_path.current() is None
    call = next(iter(functional._CALLS.values()))
    if not isinstance(call, ops.KernelCall):
        pytest.skip("the PyTorch path served this call (FUSED_NORM_BACKEND)")
    assert rec.bad  # interpreter / first compile: launched through kernel[grid]
    assert [id(t) for t in rec.outputs] == [id(y), id(s)]
    assert all(any(t is a for a in rec.allocs) for t in rec.outputs)
    given = [x, w, res]
    for t in rec.saved:
        assert t is None or any(t is g for g in given + rec.allocs)
    assert call.fast is None and call.tries == 0  # nothing is recorded without the extension


def test_extension_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv(fast_path.ENV, raising=False)
    assert fast_path.enabled()
    monkeypatch.setenv(fast_path.ENV, "0")
    assert not fast_path.enabled()


def test_a_missing_build_is_said_once_and_never_built_on_a_call(monkeypatch, tmp_path):
    """On, but not built for this torch: no module, the reason, one warning; the process does
    not compile anything."""
    monkeypatch.delenv(fast_path.ENV, raising=False)
    monkeypatch.setenv("FUSED_NORM_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(fast_path, "_STATE", {"loaded": False, "module": None, "why": None})
    monkeypatch.setattr(fast_path, "build", lambda *a, **k: pytest.fail("built on a call"))
    assert fast_path.module() is None and fast_path.why().startswith("not built")
    with pytest.warns(UserWarning, match="python -m fused_norm.build"):
        fast_path.warn_if_missing()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast_path.warn_if_missing()  # once only
    assert not any(tmp_path.iterdir())


class _Owner:
    """Stands for the ops.KernelCall that owns a recipe: its Python backward, counted."""

    def __init__(self):
        self.calls = []

    def fast_backward(self, saved, grads):
        self.calls.append((saved, grads))
        dy = grads[0] if grads[0] is not None else torch.zeros(3, 4)
        return [2 * dy, None]  # the gradients of the given tensors (x, w)


def _plumbing(mod):
    """A recipe without launches on CPU tensors: the C++ autograd node's wiring (slots,
    saved tensors, outputs, the Python backward where no stage is recorded, a recorded stage's
    results, zeros for a gradient that never came in, no graph without grad)."""
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    owner = _Owner()
    f32 = torch.float32
    # slots: x 0, w 1, y 2, s 3, rstd 4; outputs y and the stream s; saved x, rstd and s (an
    # output: saved without a reference cycle, unpacked with this node as its grad_fn)
    allocs = [([3, 4], f32, None), ([3, 4], f32, None), ([3], f32, 7)]  # rstd filled with 7
    recipe = mod.Recipe(torch.device("cpu"), True, 2, allocs,
                        [], [], [2, 3], [0, 4, 3], [([3, 4], f32), ([3, 4], f32)], 1,
                        weakref.ref(owner))  # fmt: skip
    y, s = mod.call(recipe, [x, w])
    assert y.shape == (3, 4) and y.requires_grad and y.grad_fn.name() == "FusedNormBackward"
    g = torch.randn(3, 4)
    (gx,) = torch.autograd.grad(y, [x], g, retain_graph=True)  # variant 0: no stream gradient
    assert len(owner.calls) == 1
    saved, grads = owner.calls[0]
    assert torch.equal(saved[0], x) and torch.equal(saved[1], torch.full((3,), 7.0))
    assert saved[2] is not None and saved[2].data_ptr() == s.data_ptr()
    assert torch.equal(grads[0], g) and grads[1] is None
    assert torch.equal(gx, 2 * g)
    # a recorded stage: backward slots saved 0-2, dy 3, ds 4, then one allocation 5
    recipe.set_backward(1, [([4], f32, None)], [], [], [4, 5])
    assert recipe.has_backward(1) and not recipe.has_backward(0)
    gs = torch.randn(3, 4)
    gx, gw = torch.autograd.grad((y, s), [x, w], (g, gs), retain_graph=True)
    assert len(owner.calls) == 1, "a recorded stage called Python"
    assert torch.equal(gx, gs) and gw.shape == (4,)
    (gx,) = torch.autograd.grad(s, [x], gs)  # dy never came in: zeros in its slot
    assert torch.equal(gx, gs) and len(owner.calls) == 1
    with pytest.raises(RuntimeError, match="second time"):  # its saved tensors were freed
        torch.autograd.grad((y, s), [x], (g, gs))
    with torch.no_grad():
        plain = mod.Recipe(torch.device("cpu"), False, 2, [([3, 4], f32, None)], [], [], [2], [], [],
                           -1, weakref.ref(owner))  # fmt: skip
        (y2,) = mod.call(plain, [x, w])
    assert y2.grad_fn is None and y2.shape == (3, 4)
    with pytest.raises(RuntimeError, match="slot out of range"):
        recipe.set_backward(0, [], [], [], [9])
    with pytest.raises(RuntimeError, match="result slot out of range"):  # a workspace's slot
        recipe.set_backward(0, [], [], [(4, -1)], [5])
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        mod.Recipe(torch.device("cpu"), False, 1, [], [(0, [1, 1, 1], 32, 0, [0, 0], [], -1, 0)],
                   [], [], [], [], -1, weakref.ref(owner))  # fmt: skip


@pytest.mark.slow
def test_extension_builds_and_its_autograd_wiring_works(tmp_path, monkeypatch):
    """The C++ source builds against this torch (about a minute; CPU torch has the same
    headers), loads, and its autograd node wires slots as the recipes say."""
    if shutil.which("ninja") is None and not os.path.exists(
        os.path.join(os.path.dirname(sys.executable), "ninja")
    ):
        pytest.skip("ninja is not installed (torch.utils.cpp_extension needs it)")
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("FUSED_NORM_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    mod = fast_path.build()
    assert fast_path.library_path().exists()
    _plumbing(mod)
    _signatures_key_as_specs_do(mod)


def _signatures_key_as_specs_do(mod):
    """The C++ signature (functional's key where the extension is loaded) tells two calls
    apart exactly when functional._spec's tuples do."""
    base = torch.arange(64, dtype=torch.bfloat16).reshape(8, 8)
    w = torch.ones(8)
    variants = [
        base, base.clone(), base.float(), base.reshape(4, 16), base.reshape(2, 4, 8),
        base.t(), base[:, 1:], base[:, :4], base.clone().requires_grad_(),
        torch.nn.Parameter(base.clone()), torch.empty(8, 8, dtype=torch.bfloat16, device="meta"),
    ]  # fmt: skip
    calls = [(x, w, None) for x in variants] + [(base, None, w), (base, w, w), (base, None, None)]
    for a in calls:
        for b in calls:
            same_spec = tuple(map(functional._spec, a)) == tuple(map(functional._spec, b))
            assert (mod.signature(a) == mod.signature(b)) == same_spec, (a, b)

    class Sub(torch.Tensor):
        pass

    assert mod.signature((base.as_subclass(Sub), w)) is None  # keyed in Python
    assert mod.signature((base, 1.0)) is None

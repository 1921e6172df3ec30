"""The C++ fast path of eager calls: its build, its loading, and recipes from recorded calls.

``csrc/fast_path.cpp`` replays a call signature in C++: the allocations and direct launches that
``ops`` logged while a :class:`Recording` was active, and a C++ autograd node whose backward runs
without Python (docs/design.md, "The C++ fast path"). Built ahead by ``python -m fused_norm.build``
into ``$FUSED_NORM_BUILD_DIR`` (default ``~/.cache/fused_norm``) under a name hashing its source
and the torch version; a process only loads it. ``FUSED_NORM_FAST_PATH=0``, set before import,
keeps every call on the Python path.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import struct
import sys
import threading
import warnings
import weakref
from pathlib import Path

import torch

ENV = "FUSED_NORM_FAST_PATH"
SOURCE = Path(__file__).resolve().parent / "csrc" / "fast_path.cpp"

# ------------------------------------------------------------------------------ build and load


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def module_name() -> str:
    """The extension's name: its source and the torch it is built against, hashed."""
    digest = hashlib.sha1(SOURCE.read_bytes())
    digest.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    return f"fused_norm_fast_{digest.hexdigest()[:12]}"


def build_dir() -> Path:
    root = os.environ.get("FUSED_NORM_BUILD_DIR")
    if root:
        return Path(root)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "fused_norm"


def library_path() -> Path:
    name = module_name()
    return build_dir() / name / f"{name}.so"


def build(verbose: bool = False):
    """Compile the extension (about a minute) and return it."""
    from torch.utils import cpp_extension

    name = module_name()
    out = build_dir() / name
    out.mkdir(parents=True, exist_ok=True)
    mod = cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(out),
                             extra_cflags=["-O2"], extra_ldflags=["-ldl"], verbose=verbose)  # fmt: skip
    _STATE["loaded"] = False  # (this process may have looked for it before it was built)
    return mod


_STATE = {"loaded": False, "module": None, "why": None}
_LOAD_LOCK = threading.Lock()


def module():
    """The built extension, or None (``why()`` says why)."""
    if _STATE["loaded"]:
        return _STATE["module"]
    with _LOAD_LOCK:
        if not _STATE["loaded"]:
            _STATE["module"], _STATE["why"] = _load()
            _STATE["loaded"] = True
    return _STATE["module"]


def why() -> str:
    module()
    return _STATE["why"] or "loaded"


def warn_if_missing() -> None:
    """Once per process, where the extension is on but not built: say so (a CUDA call is about
    to take the Python path)."""
    if module() is None and _STATE["why"].startswith("not built") and not _STATE.get("warned"):
        _STATE["warned"] = True
        warnings.warn(f"fused_norm: the C++ fast path is {_STATE['why']}; eager CUDA calls take "
                      "the slower Python path. `python -m fused_norm.build` builds it (about a "
                      f"minute); {ENV}=0 silences this.", stacklevel=3)  # fmt: skip


def _load():
    if not enabled():
        return None, f"off ({ENV}=0)"
    if torch.version.hip:
        return None, "ROCm: the extension launches through the CUDA driver only"
    path = library_path()
    if not path.exists():
        return None, f"not built for this torch ({path} missing)"
    try:
        name = path.stem
        spec = importlib.util.spec_from_file_location(
            name, path, loader=importlib.machinery.ExtensionFileLoader(name, str(path))
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod, None
    except Exception as exc:  # noqa: BLE001 - a stale or broken build: the Python path serves
        return None, f"cannot load {path}: {exc}"


# ------------------------------------------------------------------------------ recording


class _Local(threading.local):
    rec = None  # the recording active in this thread


_LOCAL = _Local()


class Unservable(Exception):
    """A recorded call that the C++ path cannot replay."""


class Recording:
    """What one Python-path call allocated (``ops._empty``), took from the exchange workspaces
    (``workspace.take``: the buffer, the one its launch cleans, words and fill value) and
    launched (``ops._Launch``)."""

    __slots__ = ("allocs", "fills", "workspaces", "launches", "bad", "saved", "outputs")

    def __init__(self):
        self.allocs, self.workspaces, self.launches = [], [], []
        self.fills = {}  # allocation index: the value it was filled with
        self.bad = self.saved = self.outputs = None

    def refuse(self, why: str) -> None:
        if self.bad is None:
            self.bad = why

    def __enter__(self):
        _LOCAL.rec = self
        return self

    def __exit__(self, *exc):
        _LOCAL.rec = None


def current():
    """The recording active in this thread, or None."""
    return _LOCAL.rec


def _slot(t, slots) -> int:
    for i, s in enumerate(slots):
        if s is t:
            return i
    for i, s in enumerate(slots):  # the same view through another tensor object
        if (isinstance(s, torch.Tensor) and s.data_ptr() == t.data_ptr() and s.dtype == t.dtype
                and s.shape == t.shape and s.stride() == t.stride()):  # fmt: skip
            return i
    raise Unservable("a tensor that is neither given nor allocated (a copy)")


_INT_BYTES = {"i1": 1, "i8": 1, "u1": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4,
              "i64": 8, "u64": 8}  # fmt: skip


def pack(ty: str, value) -> int:
    """A scalar kernel parameter as the little-endian bytes of one 8-byte cell, as Triton's
    launcher passes it."""
    if ty in _INT_BYTES:
        return int(value) & ((1 << (8 * _INT_BYTES[ty])) - 1)
    if ty in ("fp32", "f32"):
        return struct.unpack("<I", struct.pack("<f", float(value)))[0]
    if ty == "fp64":
        return struct.unpack("<Q", struct.pack("<d", float(value)))[0]
    raise Unservable(f"a kernel parameter of type {ty}")


def _launch(compiled, args, values, slots) -> tuple:
    """One launch for the C++ recipe: (function, grid, threads, shared bytes, parameter cells,
    (parameter, slot) pairs, the dropout key's parameter or -1, 1 for a programmatic dependent
    launch (PDL) else 0)."""
    kernel = compiled.kernel
    md = kernel.metadata
    if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False)
            or getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0)):  # fmt: skip
        raise Unservable("a launch with clusters, a cooperative grid or scratch memory")
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    full = (*args, *values)
    if not isinstance(signature, dict) or len(signature) != len(full):
        raise Unservable("a kernel whose signature is unknown")
    cells, ptrs, key = [], [], -1
    for (name, ty), value in zip(signature.items(), full):
        if ty == "constexpr":
            continue
        if not isinstance(ty, str):
            raise Unservable("a tuple parameter")
        if ty.startswith("*"):
            if not isinstance(value, torch.Tensor):
                raise Unservable(f"pointer parameter {name} without a tensor")
            ptrs.append((len(cells), _slot(value, slots)))
            cells.append(0)
        elif name == "SEED_KEY":
            key = len(cells)
            cells.append(0)
        else:
            cells.append(pack(ty, value))
    cells += [0, 0]  # Triton's global and profile scratch pointers: none (checked above)
    return (compiled.function, list(compiled.grid), 32 * md.num_warps, compiled.shared, cells,
            ptrs, key, int(bool(getattr(md, "launch_pdl", False))))  # fmt: skip


def stage(rec: Recording, known: list, results) -> tuple:
    """``(allocations, launches, workspaces, result slots)`` of a recorded call whose first
    slots are ``known``, then its allocations, then two per workspace; raises Unservable."""
    if rec.bad is not None:
        raise Unservable(rec.bad)
    slots = list(known) + rec.allocs
    for ws, ws_next, _, _ in rec.workspaces:
        slots += [ws, ws_next]
    allocs = [(list(t.shape), t.dtype, rec.fills.get(i)) for i, t in enumerate(rec.allocs)]
    launches = [_launch(c, args, values, slots) for c, args, values in rec.launches]
    workspaces = [(words, fill) for _, _, words, fill in rec.workspaces]
    out = [-1 if t is None else _slot(t, slots[: len(known) + len(rec.allocs)]) for t in results]
    return allocs, launches, workspaces, out


def forward_recipe(mod, rec: Recording, given: list, dev, graph: bool, stream_output: int,
                   owner):  # fmt: skip
    """The C++ recipe (``mod.Recipe``) of a recorded forward of the tensors ``given``; its
    backward, where it needs Python, calls ``owner.fast_backward``. Raises Unservable."""
    if rec.outputs is None:
        raise Unservable("no outputs recorded")
    allocs, launches, workspaces, outputs = stage(rec, given, rec.outputs)
    slots = list(given) + rec.allocs
    saved = [-1 if t is None else _slot(t, slots) for t in rec.saved or ()]
    out_info = [(list(t.shape), t.dtype) for t in rec.outputs]
    return mod.Recipe(dev, graph, len(given), allocs, launches, workspaces, outputs, saved,
                      out_info, stream_output, weakref.ref(owner))  # fmt: skip

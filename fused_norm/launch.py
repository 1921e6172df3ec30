"""Compiling and launching Triton kernels with little host time.

``kernel[grid](...)`` binds and specialises every argument on each call (~20 µs of host time);
``ops`` launches that way once per call signature, keeps the compiled kernel (:class:`Compiled`)
and afterwards calls its C launcher directly with the arguments' addresses (~3-5 µs); the
signature covers all Triton specialises on, so the kernel kept is the one it would pick. Launch
hooks, Triton's debug mode and the interpreter always go through ``kernel[grid]``. :func:`warm`
compiles ahead in a background thread, with :class:`Stand`-ins for tensors not yet made.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import inspect
import os
import threading

import torch
import triton
from triton.runtime import driver

from .kernels.common import INTERPRETED

try:
    from triton import knobs  # Triton >= 3.4
except ImportError:  # pragma: no cover - older Triton: every launch through kernel[grid]
    knobs = None

_CHECKED = ((3, 6), (3, 7), (3, 8), (3, 9))  # versions whose CompiledKernel.run was read
try:
    _VERSION = tuple(int(v) for v in triton.__version__.split(".")[:2])
except ValueError:  # pragma: no cover
    _VERSION = ()
DIRECT = (
    not INTERPRETED
    and knobs is not None
    and _VERSION in _CHECKED
    and os.environ.get("FUSED_NORM_FAST_LAUNCH", "1") != "0"
)


class Stand:
    """A tensor stand-in for compiling ahead of a launch: a dtype, a shape, an aligned address
    (fresh allocations are), contiguous rows."""

    def __init__(self, dtype: torch.dtype, shape: tuple):
        self.dtype, self.shape = dtype, tuple(shape)

    def data_ptr(self) -> int:
        return 0

    def stride(self, dim: int) -> int:
        return self.shape[-1] if dim == 0 and len(self.shape) == 2 else 1

    def element_size(self) -> int:
        return self.dtype.itemsize


def options(num_warps: int, maxnreg=None) -> dict:
    """Triton's launch options. Floating-point fusion is asked for by name: every kernel was
    measured with it (Triton's default until 3.10)."""
    opts = {"num_warps": num_warps, "enable_fp_fusion": True}
    if maxnreg is not None:
        opts["maxnreg"] = maxnreg
    return opts


def device_guard(dev: torch.device):
    """Make ``dev`` current, so that Triton compiles and launches there."""
    if dev.type == "cuda":
        return torch.cuda.device(dev)
    return contextlib.nullcontext()


def hooked() -> bool:
    """Launch hooks or Triton's debug mode are on: they act only inside ``kernel[grid]``."""
    if knobs is None:
        return True
    rt = knobs.runtime
    enter, exit_ = rt.launch_enter_hook, rt.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(exit_, "calls", exit_) or rt.debug)


class Compiled:
    """A compiled kernel and how to call its C launcher: ``(*grid, *args)`` where ``args`` are
    the runtime arguments (tensors as addresses) followed by the constexpr values."""

    __slots__ = ("kernel", "run", "function", "metadata", "shared", "grid")

    def __init__(self, kernel, grid):
        self.kernel, self.run, self.function = kernel, kernel.run, kernel.function
        self.metadata = kernel.packed_metadata
        self.shared = getattr(kernel.metadata, "shared", 0)
        self.grid = (*grid, 1, 1)[:3]

    def __call__(self, stream, args):
        g = self.grid
        self.run(g[0], g[1], g[2], stream, self.function, self.metadata, None, None, None, *args)


def launch(kernel, grid, dev, args, constexprs, opts):
    """``kernel[grid](*args, **constexprs, **opts)`` on ``dev``: the compiled kernel (None under
    the interpreter)."""
    with device_guard(dev):
        return kernel[grid](*args, **constexprs, **opts)


def constexpr_names(kernel) -> list:
    """The kernel's constexpr parameters in order (they follow its runtime parameters): from a
    JITFunction's params, or under the interpreter from the function's annotations."""
    params = getattr(kernel, "params", None)
    if params:
        return [p.name for p in params if p.is_constexpr]
    fn = getattr(kernel, "fn", kernel)
    sig = inspect.signature(fn)
    return [
        n
        for n, p in sig.parameters.items()
        if p.annotation in (triton.language.constexpr, "tl.constexpr")
    ]


# ---------------------------------------------------------------------------------------------
# Compiling ahead, in background threads.
# ---------------------------------------------------------------------------------------------

_POOL = None
_POOL_LOCK = threading.Lock()
WARM_THREADS = 4  # a backward takes up to three kernels; their compiles overlap each other


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(WARM_THREADS, "fused_norm-warm")
        return _POOL


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def warm(kernel, grid, dev, args, constexprs, opts):
    """Start compiling ``kernel`` for these arguments (tensors or Stand-ins) in a background
    thread, and build its C launcher; a future of the compiled kernel (or its exception)."""
    if INTERPRETED or dev.type != "cuda":
        return None

    def job():
        with device_guard(dev):
            compiled = kernel.warmup(*args, grid=grid, **constexprs, **opts)
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
            launcher_cls = getattr(driver.active, "launcher_cls", None)
            if launcher_cls is not None and hasattr(compiled, "src"):
                launcher_cls(compiled.src, compiled.metadata)  # into Triton's cache
            return compiled

    return _pool().submit(job)


@functools.cache
def _libcuda():
    try:
        return None if torch.version.hip else ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def resident(kernel, dev, args, constexprs, opts) -> int:
    """Programs of ``kernel`` (compiled for these arguments) that fit on one multiprocessor at
    once, from the driver's occupancy calculator; 0 where that is unknown. Compiles the kernel
    if need be (raises Triton's OutOfResources where it cannot run at all)."""
    lib = _libcuda()
    if lib is None or dev.type != "cuda" or INTERPRETED:
        return 0
    with device_guard(dev):
        compiled = kernel.warmup(*args, grid=(1,), **constexprs, **opts)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        compiled.run  # noqa: B018 - loads the kernel (OutOfResources if it does not fit)
        blocks = ctypes.c_int(0)
        err = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(blocks), ctypes.c_void_p(compiled.function),
            ctypes.c_int(32 * opts["num_warps"]), ctypes.c_size_t(compiled.metadata.shared),
        )  # fmt: skip
    return blocks.value if err == 0 else 0

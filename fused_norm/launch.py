"""Kernel launches with less host time than ``kernel[grid](...)``.

Triton's JIT launch binds and specialises every argument on each call before it finds the
compiled kernel in its cache: about 20 µs of host time per launch on the device VMs' CPUs
(H200 hosts, triton 3.6), against ~5 µs for calling the compiled kernel's launcher directly.
With two or three launches per forward + backward that decided whether small batches (a few
rows, where the GPU work takes microseconds) ran at Python speed or faster.

:class:`Launcher` keeps, per kernel, the compiled kernels Triton returned, keyed by everything
Triton specialises a compiled kernel on: the constexpr values, launch options, the device, and
per argument its kind, dtype, 16-byte alignment (pointers) or value class (integers: equal to
1, divisible by 16, 32-bit range). The key is at least as fine as Triton's own (a CPU test checks
that against Triton's specialiser), so a hit reuses exactly the kernel Triton would have chosen.
A miss, or anything unusual (the interpreter, a launch hook such as a profiler's, TRITON_DEBUG,
a Triton outside the versions whose launcher convention was checked), goes through the ordinary
``kernel[grid](...)``, which also compiles. ``FUSED_NORM_FAST_LAUNCH=0`` (read at import) turns
the direct path off.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import inspect
import os
import threading
import types
import weakref

import torch
import triton
from triton.runtime import cache as triton_cache
from triton.runtime import driver

try:
    from triton import knobs  # Triton >= 3.4
except ImportError:  # older Triton: only kernel[grid] launches (FAST_LAUNCH is off below)
    knobs = None

from .config import device_guard, max_shared

# Triton versions whose CompiledKernel.run convention (grid, stream, function, packed metadata,
# launch metadata, enter/exit hooks, then every parameter in order) was read in their source.
_CHECKED_VERSIONS = ((3, 6), (3, 7), (3, 8), (3, 9))


def _version() -> tuple:
    try:
        return tuple(int(v) for v in triton.__version__.split(".")[:2])
    except ValueError:
        return ()


FAST_LAUNCH = (
    os.environ.get("FUSED_NORM_FAST_LAUNCH", "1").strip() != "0"
    and _version() in _CHECKED_VERSIONS
    and knobs is not None
)


def arg_key(args, loose=()) -> tuple:
    """What Triton specialises a compiled kernel on, per runtime argument (finer where cheap)."""
    return key_and_pointers(args, loose)[0]


def key_and_pointers(args, loose=()) -> tuple:
    """(arg_key, the arguments with each tensor replaced by its address): Triton's launcher
    takes an int as a pointer as it is, where for a tensor it calls ``data_ptr()`` and asks
    the driver whether the address is a device pointer (check_args has put every tensor on
    the launch's device). ``loose[i]`` is true for an integer parameter the kernel does not
    specialise on (``do_not_specialize``): only its range (the type) enters the key."""
    key, launch_args = [], []
    for i, a in enumerate(args):
        if a is None:
            key.append(None)
        elif type(a) is int:
            # Triton: == 1 becomes a constant, % 16 == 0 a divisibility hint, range the type
            # (i32, i64 or u64: for a loose integer, such as the dropout key, only that).
            if i < len(loose) and loose[i]:
                key.append(("n", (a + 0x80000000) >> 32 == 0, a >> 63 == 1))
            else:
                key.append((a == 1, a & 15, a >> 31))
        elif type(a) is float:
            key.append("f")  # not 0.0: that would equal the key False of a bool
        elif type(a) is bool:
            key.append(("b", a))
        else:  # a tensor: its dtype and whether the pointer is 16-byte aligned
            ptr = a.data_ptr()
            key.append((a.dtype, ptr & 15))
            a = ptr
        launch_args.append(a)
    return tuple(key), launch_args


class Stand:
    """A tensor stand-in for compiling ahead of a launch: what Triton specialises a kernel on
    (dtype; a pointer taken as 16-byte aligned, as fresh allocations are), and a shape."""

    def __init__(self, dtype: torch.dtype, shape: tuple):
        self.dtype, self.shape = dtype, tuple(shape)

    def data_ptr(self) -> int:
        return 0

    def stride(self, dim: int) -> int:
        # Only row strides (dim 0) of contiguous 2-D tensors are asked for.
        return self.shape[-1] if dim == 0 and len(self.shape) == 2 else 1

    def element_size(self) -> int:
        return self.dtype.itemsize


_WARM_POOL = None
_BUILD_POOL = None
_START_UP = None
_POOL_LOCK = threading.Lock()

# Threads compiling ahead of launches (Launcher.warm): a backward takes up to four kernels,
# whose compiles overlap one another and the forward's (Triton's passes, ptxas and the C build
# of each launcher run outside the GIL; Triton's own AsyncCompileMode builds kernels in threads).
# One thread compiled them one after another, and the first backward waited for the last of
# them (bench/NOTES.md #85).
WARM_THREADS = 4
# Threads for the work beside the compiles: Triton's start-up (_start_up) and the kernels' C
# launchers (_prebuild); they wait on subprocesses and file reads, mostly outside the GIL.
BUILD_THREADS = 4


def _pools() -> tuple:
    """(the compiles' pool, the builds' pool), made at the first use."""
    global _WARM_POOL, _BUILD_POOL
    with _POOL_LOCK:
        if _WARM_POOL is None:
            _WARM_POOL = concurrent.futures.ThreadPoolExecutor(WARM_THREADS, "fused_norm-warm")
            _BUILD_POOL = concurrent.futures.ThreadPoolExecutor(BUILD_THREADS, "fused_norm-build")
        return _WARM_POOL, _BUILD_POOL


def _forget_pools() -> None:
    """In a forked child: the parent's threads are not there, so neither are its pools' workers
    nor the jobs they ran (a launch would wait for ever on a compile the parent had under way);
    start again."""
    global _WARM_POOL, _BUILD_POOL, _START_UP, _POOL_LOCK
    _WARM_POOL = _BUILD_POOL = _START_UP = None
    _POOL_LOCK = threading.Lock()
    _LAUNCHERS_BUILT.clear()
    for launcher in list(_LAUNCHERS):
        launcher.pending.clear()


# Every Launcher (for _forget_pools).
_LAUNCHERS: weakref.WeakSet = weakref.WeakSet()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def _warm_pool() -> concurrent.futures.ThreadPoolExecutor:
    return _pools()[0]


def _triton_key() -> None:
    key = getattr(triton_cache, "triton_key", None)  # Triton's hash of its own files
    if key is not None:
        key()


def _start_up() -> tuple:
    """Futures of the start-up work of Triton's first compile in a process, begun at the first
    miss: the driver's creation (its C utilities built, with a cold cache) and triton_key (a
    hash of Triton's own files, its 400 MB library among them), side by side. Left to the
    compiles, every thread that compiled at once did both itself: in a first forward + backward
    three threads took 0.5 s each for the driver and 0.85 s each for the hash, which take
    0.35 s alone (H200 host, bench/NOTES.md #86); every compile and launcher build here waits
    for these instead (_wait_start_up)."""
    global _START_UP
    pool = _pools()[1]
    with _POOL_LOCK:
        if _START_UP is None:
            _START_UP = (pool.submit(lambda: driver.active), pool.submit(_triton_key))
        return _START_UP


def _wait_start_up(driver_only=False) -> None:
    """Wait for _start_up's work (or only the driver's); a failure there is left for the
    compile, which meets it again and reports it."""
    jobs = _start_up()
    concurrent.futures.wait(jobs[:1] if driver_only else jobs)


# What a launcher's construction reads of a compiled kernel's metadata besides its signature
# (Triton 3.6's CudaLauncher): the C module is built from the signature before these are read.
_PREBUILD_METADATA = types.SimpleNamespace(
    tensordesc_meta=None, num_ctas=1, global_scratch_size=0, global_scratch_align=1,
    profile_scratch_size=0, profile_scratch_align=1, launch_cooperative_grid=False,
    launch_pdl=False,
)  # fmt: skip


# The signatures (their types) whose launcher _prebuild has built or is building -> an Event set
# when that is done.
_LAUNCHERS_BUILT: dict = {}


def _builds_launchers() -> bool:
    """Whether the driver compiles a C launcher per kernel signature (Triton before 3.9; 3.9's
    launches every kernel through one prebuilt function)."""
    module = inspect.getmodule(driver.active.launcher_cls)
    return hasattr(module, "make_launcher")


def _fits(compiled, device) -> bool:
    """Whether a compiled kernel's shared memory fits the device (else loading it raises
    Triton's OutOfResources), asked of the device's properties (config.max_shared, the limit
    Triton's loader checks), not by loading it."""
    shared = getattr(compiled.metadata, "shared", 0) or 0
    return shared <= max_shared(device.index)


def _build_launcher(compiled) -> None:
    """Build the C launcher of a compiled kernel into Triton's cache, as its first launch would
    (0.2-0.4 s of a C compile per kernel signature with a cold cache): the launch then finds it
    there. The kernel is not loaded here (no CUDA call from this thread: a stream capture may be
    under way in another), so the launch still loads it."""
    launcher_cls = getattr(driver.active, "launcher_cls", None)
    if launcher_cls is not None and hasattr(compiled, "src"):
        launcher_cls(compiled.src, compiled.metadata)


def _options(num_warps, num_stages, maxnreg, pdl=False) -> dict:
    """Triton's launch options (num_stages and maxnreg only where given; ``pdl``: launched
    as a programmatic dependent of the kernel before it, Triton's launch_pdl).

    Floating-point fusion (a * b + c as one FMA) is asked for by name: it is what every
    kernel was measured with, Triton's default up to 3.9, whose compiles warn that the
    default turns to off in 3.10 where a launch does not say."""
    options = {"num_warps": num_warps, "enable_fp_fusion": True}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    if pdl:
        options["launch_pdl"] = True
    return options


def _hooked() -> bool:
    """Launch hooks (e.g. a profiler's) or Triton's debug mode are on: they act only inside
    ``kernel[grid]``, so the launch must go through it."""
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool(
        getattr(enter, "calls", enter) or getattr(exit_, "calls", exit_) or knobs.runtime.debug
    )


def _key(device, num_warps, num_stages, constexpr_values, args, maxnreg, loose=()) -> tuple:
    """The cache key of one compiled kernel: a launch and a warm-up that will use the same
    binary must build the same key (the tests read its entries by position)."""
    key, _ = _key_and_pointers(
        device, num_warps, num_stages, constexpr_values, args, maxnreg, loose
    )
    return key


def _key_and_pointers(device, num_warps, num_stages, constexpr_values, args, maxnreg, loose=()):
    """(_key, the launch arguments with tensors as addresses: key_and_pointers)."""
    akey, launch_args = key_and_pointers(args, loose)
    return (device.index, num_warps, num_stages, constexpr_values, akey, maxnreg), launch_args


@functools.cache
def _libcuda():
    """The CUDA driver library, or None (ROCm, or none installed)."""
    try:
        return None if torch.version.hip else ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def max_active_blocks(function: int, threads: int, shared: int) -> int:
    """Blocks of a loaded CUDA kernel (``function``: its CUfunction handle) of ``threads``
    threads and ``shared`` bytes of dynamic shared memory that fit on one multiprocessor at
    once, from the driver's occupancy calculator; 0 where it cannot say (no libcuda: ROCm)."""
    lib = _libcuda()
    if lib is None:
        return 0
    blocks = ctypes.c_int(0)
    err = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(function), ctypes.c_int(threads),
        ctypes.c_size_t(shared),
    )  # fmt: skip
    return blocks.value if err == 0 else 0


def _constexpr_names(kernel, params) -> list:
    """The kernel's constexpr parameters in order: from a compiled JITFunction's params, or
    under the interpreter from the Python function's annotations."""
    if params:
        return [p.name for p in params if p.is_constexpr]
    fn = getattr(kernel, "fn", None)
    if fn is None:
        return []
    sig = inspect.signature(fn)
    return [n for n, p in sig.parameters.items() if p.annotation is triton.language.constexpr]


class Launcher:
    """``launcher(grid, device, args, constexprs, num_warps, num_stages, maxnreg)`` launches
    ``kernel`` (``maxnreg``: a cap on registers per thread, or None).

    ``args`` are the kernel's runtime parameters in order, ``constexprs`` a dict of the
    constexpr parameters in their order (they follow the runtime ones in our kernels). A
    ``dependent`` kernel launches as a programmatic dependent of the kernel before it (Triton's
    launch_pdl) where its constexpr GDC is true, GDC saying that the kernel waits for it.
    """

    def __init__(self, kernel, dependent=False):
        self.kernel = kernel
        self.dependent = dependent
        params = getattr(kernel, "params", None)
        self.fast = FAST_LAUNCH and params is not None and hasattr(kernel, "device_caches")
        self.constexpr_names = _constexpr_names(kernel, params)
        # Integer parameters the kernel does not specialise on (do_not_specialize), in order.
        self.loose = tuple(p.do_not_specialize for p in params or () if not p.is_constexpr)
        self.cache: dict = {}
        self.pending: dict = {}  # key -> future of a compile started by warm()
        self.warm_error = None  # the last warm-up compile's failure (a str), kept for diagnosis
        _LAUNCHERS.add(self)

    def __call__(
        self, grid, device, args, constexprs, num_warps, num_stages=None, on_miss=None, maxnreg=None
    ):
        """Launch; ``on_miss`` is called before the compile when this configuration has not
        been launched yet, e.g. to start compiling the backward meanwhile."""
        if not (self.fast and device.type == "cuda") or _hooked():
            if list(constexprs) != self.constexpr_names:  # as below (the CPU tests see it too)
                raise AssertionError(f"constexprs out of order: {list(constexprs)}")
            options = self._options(constexprs, num_warps, num_stages, maxnreg)
            return self._jit(grid, device, args, constexprs, options)
        values = tuple(constexprs.values())
        key, pointers = _key_and_pointers(
            device, num_warps, num_stages, values, args, maxnreg, self.loose
        )
        hit = self.cache.get(key)
        if hit is None:
            options = self._options(constexprs, num_warps, num_stages, maxnreg)
            # Unless a warm-up is compiling it, this kernel compiles here: its C launcher is
            # built beside the compile (first in the builds' queue), not after it.
            build = None
            if key not in self.pending:
                build = self._prebuild(device, args, constexprs, options)
            if on_miss is not None:
                on_miss()
            pending = self.pending.pop(key, None)
            if pending is not None:
                pending.result()  # a compile of this very kernel is under way: wait for it
                for k, f in list(self.pending.items()):
                    if f is pending:  # its fallback's key: compiled by then, or not needed
                        self.pending.pop(k, None)
            if build is not None:
                _wait_start_up()
                with device_guard(device):
                    self._warmup(grid, args, constexprs, options)
                concurrent.futures.wait([build])
            compiled = self._jit(grid, device, args, constexprs, options)
            if hasattr(compiled, "result"):  # an asynchronous compile
                compiled = compiled.result()
            if list(constexprs) != self.constexpr_names:
                raise AssertionError(f"constexprs out of order: {list(constexprs)}")
            hit = (compiled.run, compiled.function, compiled.packed_metadata)
            self.cache[key] = hit
            return
        run, function, metadata = hit
        g = (*grid, 1, 1)[:3]
        current = driver.active.get_current_device()
        if device.index == current:
            stream = driver.active.get_current_stream(current)
            run(*g, stream, function, metadata, None, None, None, *pointers, *values)
        else:
            with torch.cuda.device(device):
                stream = driver.active.get_current_stream(device.index)
                run(*g, stream, function, metadata, None, None, None, *pointers, *values)

    def warm(
        self, grid, device, args, constexprs, num_warps, num_stages=None, maxnreg=None,
        fallback=None,
    ):  # fmt: skip
        """Start compiling, in a background thread, the kernel that a launch with these
        arguments (tensors or :class:`Stand`-ins) will use, and its launcher; the launch waits
        for it. ``fallback``: the constexprs a launch takes instead where that kernel's shared
        memory does not fit the device (ops._fitting_stages); compiled then too."""
        if not (self.fast and device.type == "cuda"):
            return
        keys = [_key(device, num_warps, num_stages, tuple(c.values()), args, maxnreg, self.loose)
                for c in (constexprs, fallback) if c is not None]  # fmt: skip
        if keys[0] in self.cache or keys[0] in self.pending:
            return
        options = self._options(constexprs, num_warps, num_stages, maxnreg)
        build = self._prebuild(device, args, constexprs, options)
        future = _warm_pool().submit(
            self._warm, grid, device, args, constexprs, options, fallback, build
        )
        for key in keys:
            self.pending.setdefault(key, future)

    def resident(self, device, args, constexprs, num_warps, num_stages=None, maxnreg=None) -> int:
        """Programs of the kernel these arguments (tensors or :class:`Stand`-ins) select that
        fit on one multiprocessor at once (its registers, shared memory and warps), compiling
        it if need be; 0 where that is unknown (not a CUDA device, the interpreter, no
        occupancy calculator). Raises Triton's OutOfResources where it does not fit at all.
        Not cached here: its caller (ops._bwd_resident) keeps the answers."""
        if device.type != "cuda" or not hasattr(self.kernel, "warmup"):
            return 0
        for pending in list(self.pending.values()):  # a warm-up compile may be this kernel
            pending.result()
        options = self._options(constexprs, num_warps, num_stages, maxnreg)
        with device_guard(device):
            compiled = self._warmup((1,), args, constexprs, options)
            compiled.run  # noqa: B018 - loads the kernel (OutOfResources if it cannot run)
            return max_active_blocks(compiled.function, 32 * num_warps, compiled.metadata.shared)

    def _options(self, constexprs, num_warps, num_stages, maxnreg) -> dict:
        """Triton's options of a launch of these constexprs (_options)."""
        pdl = self.dependent and bool(constexprs.get("GDC"))
        return _options(num_warps, num_stages, maxnreg, pdl)

    def _warm(self, grid, device, args, constexprs, options, fallback=None, build=None):
        try:
            _wait_start_up()
            with device_guard(device):
                compiled = self._warmup(grid, args, constexprs, options)
                if fallback is not None and not _fits(compiled, device):
                    compiled = self._warmup(grid, args, fallback, options)
                if build is None or not build.result():  # (its prebuild did not build it)
                    _build_launcher(compiled)
        except Exception as e:  # noqa: BLE001 - the launch itself compiles again and reports it
            self.warm_error = f"{getattr(self.kernel, '__name__', '?')}: {e!r}"

    def _prebuild(self, device, args, constexprs, options):
        """Start building, beside the compile, the C launcher of the kernel these arguments
        select into Triton's cache (its source depends only on the kernel's signature): the
        compile's own build of it, after ptxas, then finds it there. A future. (The start-up
        jobs it waits for are queued first: a pool of builds waiting on jobs queued behind
        them would wait for ever.)"""
        _start_up()
        return _pools()[1].submit(self._build, device, args, constexprs, options)

    def _build(self, device, args, constexprs, options) -> bool:
        """_prebuild's job: True once the launcher is in Triton's cache (built here or by
        another job), or where Triton builds none per kernel; False where this failed."""
        try:
            _wait_start_up(driver_only=True)
            if not _builds_launchers():
                return True
            kernel = self.kernel
            kwargs = {**constexprs, **options}
            with device_guard(device):
                _, _, _, backend, binder = kernel.device_caches[device.index]
                bound, spec, opts = binder(*args, **kwargs)
                _, signature, values, attrs = kernel._pack_args(backend, kwargs, bound, spec, opts)
                # Triton 3.6's launcher source is made of the signature's types alone: kernels
                # (or variants) that share them share one build.
                types_key = tuple(signature.values())
                with _POOL_LOCK:
                    done = _LAUNCHERS_BUILT.get(types_key)
                    if done is None:
                        mine = _LAUNCHERS_BUILT[types_key] = threading.Event()
                if done is not None:
                    done.wait()
                    return True
                try:
                    src = kernel.ASTSource(kernel, signature, values, attrs)
                    driver.active.launcher_cls(src, _PREBUILD_METADATA)
                finally:
                    mine.set()
                return True
        except Exception:  # noqa: BLE001 - Triton's internals differ: the launch builds it
            return False

    def _warmup(self, grid, args, constexprs, options):
        compiled = self.kernel.warmup(*args, grid=grid, **constexprs, **options)
        return compiled.result() if hasattr(compiled, "result") else compiled  # (asynchronous)

    def _jit(self, grid, device, args, constexprs, options):
        with device_guard(device):
            return self.kernel[grid](*args, **constexprs, **options)

#!/usr/bin/env python3
"""Benchmark fused_norm against its peers on the workloads of a transformer block.

One script, one provider registry (fused_norm, torch eager, torch.compile, Liger-Kernel and
flash-attn when importable), three modes (fwd, bwd, fwd+bwd), five workloads, N from 256 to
262144, several dtypes. Every row reports GB/s computed from bytes counted explicitly per
workload (`bytes_moved`), the percentage of a device-to-device copy measured in the same run,
the ratio to the best other provider, the first-call seconds and the peak extra memory.
`report.py` turns the rows into results.csv, results.md (with pass/fail against the targets),
PNG plots and the README table.

    python3 -u bench/bench.py --quick --out bench/results/auto   # <= 5 min on one H100
    python3 -u bench/bench.py --full --out bench/results/auto
    python3 bench/bench.py --smoke --out /tmp/bench-smoke        # CPU, Triton interpreter
    python3 bench/bench.py --bytes-table                         # bytes per row, per workload

Timing: each timed call is bracketed by CUDA events after a 256 MiB write that evicts L2, and
the median over the calls is reported. `bwd` runs the forward outside the timed region and
times `torch.autograd.grad` only; every mode takes gradients with `torch.autograd.grad`, so no
provider pays for accumulating into an existing `.grad`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

# The Triton interpreter is chosen when @triton.jit runs, i.e. when fused_norm is imported, so
# the CPU smoke run must set it before anything imports triton.
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
# Benchmark the checkout this script lives in, not whatever fused_norm is installed.
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(BENCH_DIR))

import report  # noqa: E402  (bench/report.py, found through the path set just above)

EPS = 1e-5
MODES = ("fwd", "bwd", "fwd+bwd")
L2_FLUSH_BYTES = 256 * 2**20  # > 5x the 50 MB L2 of an H100


# ----------------------------------------------------------------------------- workloads


@dataclasses.dataclass(frozen=True)
class Workload:
    """One flag set of the fused op: which inputs take part and which outputs come back."""

    name: str
    title: str
    rms: bool  # RMSNorm (weight only) rather than LayerNorm (weight and bias)
    residual: bool  # add a residual and return residual_out (prenorm)
    x1: bool = False  # second input path x1 and second output y1 (weight1, bias1)
    dropout_p: float = 0.0


WORKLOADS = {
    w.name: w
    for w in [
        Workload("ln", "LayerNorm", rms=False, residual=False),
        Workload("rms", "RMSNorm", rms=True, residual=False),
        Workload("add_rms", "add + RMSNorm, prenorm", rms=True, residual=True),
        Workload(
            "drop_add_ln",
            "dropout(0.1) + add + LayerNorm, prenorm",
            rms=False,
            residual=True,
            dropout_p=0.1,
        ),
        Workload(
            "parallel_ln",
            "parallel: x + x1 + residual, two LayerNorms (weight, weight1), prenorm",
            rms=False,
            residual=True,
            x1=True,
        ),
    ]
}

# name -> (dtype of x, x1, y and dx; of the residual stream; of the weights and biases)
DTYPES = {
    "bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16, torch.float16),
    "fp32": (torch.float32, torch.float32, torch.float32),
    "bf16_res32": (torch.bfloat16, torch.float32, torch.bfloat16),  # fp32 residual stream
    # bf16 activations beside fp32 weights and biases: what autocast training passes in (the
    # parameters stay fp32). Not a dtype the issue sets targets for: report.py keeps its checks
    # apart.
    "bf16_w32": (torch.bfloat16, torch.bfloat16, torch.float32),
}


def dtype_applies(wl: Workload, dt: str) -> bool:
    """An fp32 residual stream only means something for workloads that have a residual."""
    return wl.residual or DTYPES[dt][0] == DTYPES[dt][1]


def bytes_moved(wl: Workload, dt: str, M: int, N: int, mode: str) -> int:
    """Minimal bytes the maths moves: each tensor it needs read once, each result written once.

    The count is the same for every provider, so GB/s compare like with like. Per row, with
    e = bytes of x's dtype and r = bytes of the residual stream's dtype (the weights, read and
    written once per call, count with their own dtype's bytes):
      forward reads x (and x1), the residual, the weights; writes y (and y1), residual_out,
      and the fp32 statistics (rstd, plus mean for LayerNorm: 4 bytes each per row).
      backward reads dy (and dy1), d residual_out, the saved pre-norm sum (x when there is no
      residual), the weights and the statistics; writes dx, the weight gradients, and dx1 /
      dresidual only where they differ from dx: with dropout (other masks) or a residual stream
      of another dtype. Without dropout all three are the same tensor ds, so writing it once is
      enough (flash-attn, Liger and torch's autograd all alias it).
    The dropout mask costs nothing: it is regenerated from a seed in the backward. Partial
    weight-gradient buffers of a persistent grid are an implementation detail, not counted.
    """
    xd, rd, wd = DTYPES[dt]
    e = torch.finfo(xd).bits // 8
    r = torch.finfo(rd).bits // 8 if wl.residual else e
    p = torch.finfo(wd).bits // 8
    n_in = 2 if wl.x1 else 1  # x, x1
    n_out = 2 if wl.x1 else 1  # y, y1 (and weight, weight1)
    n_param = n_out * (1 if wl.rms else 2)  # weight(s), plus bias(es) for LayerNorm
    stats = 4 * (1 if wl.rms else 2)
    fwd = (
        M * N * (e * n_in + r * wl.residual + e * n_out + r * wl.residual)
        + M * stats
        + N * p * n_param
    )
    grad_writes = e  # dx
    if wl.x1 and wl.dropout_p > 0:
        grad_writes += e  # dx1 has its own mask
    if wl.residual and (wl.dropout_p > 0 or r != e):
        grad_writes += r  # dresidual differs from dx
    saved = r if wl.residual else e
    bwd = (
        M * N * (e * n_out + r * wl.residual + saved + grad_writes)
        + M * stats
        + N * p * (n_out + n_param)
    )
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def bytes_per_element(wl: Workload, dt: str, mode: str) -> int:
    """bytes_moved per element of the M·N problem (the rows' share, without the statistics'
    bytes per row and the weights' per column)."""
    b = lambda m, n: bytes_moved(wl, dt, m, n, mode)  # noqa: E731
    return b(2, 2) - b(2, 1) - b(1, 2) + b(1, 1)  # bytes = a*M*N + s*M + c*N (+ 0): a


def bytes_table() -> str:
    """Markdown table of bytes per row (large M) for every workload and dtype."""
    lines = [
        "| workload | dtype | fwd bytes/row | bwd bytes/row | fwd+bwd bytes/row |",
        "|---|---|---|---|---|",
    ]
    for wl in WORKLOADS.values():
        for dt in DTYPES:
            if not dtype_applies(wl, dt):
                continue
            cells = []
            for mode in ("fwd", "bwd", "fwd+bwd"):
                # bytes = a*M*N + s*M + c*N: the per-row cost is a*N + s (c*N is the weights)
                a = bytes_per_element(wl, dt, mode)
                s = bytes_moved(wl, dt, 2, 1, mode) - bytes_moved(wl, dt, 1, 1, mode) - a
                cells.append(f"{a}·N + {s}")
            lines.append(f"| {wl.name} | {dt} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- providers

# Every provider's forward takes (x, weight, bias, residual, x1, weight1, bias1), absent ones
# None, and returns a tuple: (y, [y1], [residual_out]).


def _flash_style_forward(mod, wl: Workload):
    """fused_norm and flash-attn share the flash-attn Triton functional API (API.md)."""
    fn = mod.rms_norm_fn if wl.rms else mod.layer_norm_fn

    def forward(x, w, b, r, x1, w1, b1):
        kw = {"eps": EPS}
        if wl.residual:
            # residual_in_fp32 only matters when no residual is given; pass it for clarity
            kw.update(residual=r, prenorm=True, residual_in_fp32=r.dtype == torch.float32)
        if wl.dropout_p:
            kw["dropout_p"] = wl.dropout_p
        if wl.x1:
            kw.update(x1=x1, weight1=w1, bias1=b1)
        out = fn(x, w, b, **kw)
        return out if isinstance(out, tuple) else (out,)

    return forward


def eager_forward(wl: Workload):
    """The composition a user writes by hand, in the input dtype, as Mamba/HF blocks do:
    the pre-norm sum is kept in the residual's dtype and cast to the activations' dtype to
    norm; the norm's output keeps that dtype whatever the weights' (as fused_norm's does)."""

    def norm(h, w, b):
        shape = (h.shape[-1],)
        # Weights of another dtype (fp32 beside bf16 rows): the norm in the weights' dtype, as
        # autocast runs it, cast back to the rows' (torch's CUDA layer_norm takes no mix).
        # Both casts are no-ops where the dtypes agree.
        g = h.to(w.dtype)
        y = F.rms_norm(g, shape, w, EPS) if wl.rms else F.layer_norm(g, shape, w, b, EPS)
        return y.to(h.dtype)

    def forward(x, w, b, r, x1, w1, b1):
        h = F.dropout(x, wl.dropout_p) if wl.dropout_p else x
        if x1 is not None:
            h = h + (F.dropout(x1, wl.dropout_p) if wl.dropout_p else x1)
        if r is None:
            return (norm(h, w, b),)
        s = h + r  # type promotion keeps an fp32 residual stream in fp32
        h = s.to(x.dtype)
        if x1 is not None:
            return norm(h, w, b), norm(h, w1, b1), s
        return norm(h, w, b), s

    return forward


def _compile_forward(_mod, wl: Workload):
    # A fresh compile per shape: stale graphs or automatic dynamic shapes would otherwise
    # turn later shapes into a different (dynamic) kernel than a user with one shape gets.
    torch._dynamo.reset()
    return torch.compile(eager_forward(wl))


def _liger_forward(mod, wl: Workload):
    # Defaults as Liger's nn.Modules use them (LigerRMSNorm in_place=True, the fused add one
    # in_place=False, casting_mode "llama").
    if wl.name == "ln":
        return lambda x, w, b, *_: (mod.LigerLayerNormFunction.apply(x, w, b, EPS),)
    if wl.name == "rms":
        return lambda x, w, *_: (mod.LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", True),)
    if wl.name == "add_rms":
        return lambda x, w, b, r, *_: tuple(
            mod.LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama", False)
        )
    raise ValueError(f"Liger has no kernel for workload {wl.name!r}")


def _import(name: str):
    import importlib

    return importlib.import_module(name)


@dataclasses.dataclass
class Provider:
    name: str
    load: Callable[[], object]  # imports the provider's module; raises when absent
    build: Callable[[object, Workload], Callable]  # (module, workload) -> forward
    supports: Callable[[Workload, str], bool] = lambda wl, dt: True
    per_shape: bool = False  # build anew for every shape (torch.compile), costly
    module: object = None


PROVIDERS = {
    p.name: p
    for p in [
        Provider("fused_norm", lambda: _import("fused_norm"), _flash_style_forward),
        Provider("torch", lambda: torch, lambda _m, wl: eager_forward(wl)),
        Provider("compile", lambda: torch, _compile_forward, per_shape=True),
        Provider(
            "liger",
            lambda: _import("liger_kernel.ops"),
            _liger_forward,
            supports=lambda wl, dt: (
                wl.name in ("ln", "rms", "add_rms") and DTYPES[dt][0] == DTYPES[dt][1]
            ),
        ),
        Provider(
            "flash_attn", lambda: _import("flash_attn.ops.triton.layer_norm"), _flash_style_forward
        ),
    ]
}
PEERS = tuple(n for n in PROVIDERS if n != "fused_norm")


def load_providers(names):
    """Import each requested provider; return (available, {name: reason it is unavailable})."""
    ok, missing = [], {}
    for name in names:
        prov = PROVIDERS[name]
        try:
            prov.module = prov.load()
            ok.append(prov)
        except Exception as exc:  # ImportError, or a peer whose import itself breaks
            missing[name] = f"{type(exc).__name__}: {exc}"[:300]
    return ok, missing


# ----------------------------------------------------------------------------- inputs


def make_inputs(wl: Workload, dt: str, M: int, N: int, device):
    """(x, weight, bias, residual, x1, weight1, bias1) with requires_grad, and the leaves."""
    xd, rd, wd = DTYPES[dt]

    def act(dtype):
        return torch.randn(M, N, device=device, dtype=dtype).requires_grad_()

    def param(center):
        return (center + 0.1 * torch.randn(N, device=device)).to(wd).requires_grad_()

    x = act(xd)
    w = param(1.0)
    b = None if wl.rms else param(0.0)
    r = act(rd) if wl.residual else None
    x1 = act(xd) if wl.x1 else None
    w1 = param(1.0) if wl.x1 else None
    b1 = param(0.0) if wl.x1 and not wl.rms else None
    args = (x, w, b, r, x1, w1, b1)
    return args, [t for t in args if t is not None]


def make_grads(wl: Workload, dt: str, M: int, N: int, device):
    """Upstream gradients for (y, [y1], [residual_out]): fresh per provider, because Liger's
    in-place RMSNorm backward overwrites dy."""
    xd, rd, _ = DTYPES[dt]
    dtypes = [xd] * (2 if wl.x1 else 1) + ([rd] if wl.residual else [])
    return [torch.randn(M, N, device=device, dtype=d) for d in dtypes]


# ----------------------------------------------------------------------------- timing


HOST_COVER_CYCLES = 4_000_000  # about 2 ms at H100/H200 clocks


class Clock:
    """Times calls on one device: CUDA events around each call on a GPU, wall time on a CPU."""

    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.flush = (
            torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device) if self.cuda else None
        )

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def once(self, step, setup=None) -> float:
        """Seconds of one call, host-synchronised: what a user waits for (JIT included)."""
        state = setup() if setup else None
        self.sync()
        t = time.perf_counter()
        out = step(state)
        self.sync()
        dt = time.perf_counter() - t
        del out, state
        return dt

    def median(self, step, setup, iters: int) -> float:
        """Median seconds of `step` over `iters` calls, L2 evicted before each, setup untimed."""
        times = []
        if not self.cuda:
            for _ in range(iters):
                times.append(self.once(step, setup))
            return statistics.median(times)
        events = []
        for _ in range(iters):
            state = setup() if setup else None
            self.flush.zero_()
            # Keep the GPU busy while the host enqueues the call, so the event pair times the
            # device work, not the host's Python (the small-batch rows measure that, as wall
            # time). ~2 ms covers the slowest provider's host time seen on the device VMs.
            torch.cuda._sleep(HOST_COVER_CYCLES)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = step(state)
            end.record()
            events.append((start, end))
            del out, state
        self.sync()
        return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3

    def wall_per_call(self, step, calls: int, repeats: int = 5) -> float:
        """Seconds per call of back-to-back calls (launch-bound regime: host time counts)."""
        times = []
        for _ in range(repeats):
            self.sync()
            t = time.perf_counter()
            for _ in range(calls):
                out = step(None)
            del out
            self.sync()
            times.append((time.perf_counter() - t) / calls)
        return statistics.median(times)

    def peak_extra_mb(self, step, setup=None) -> float:
        """Peak memory allocated during one call beyond what was live before it, in MiB."""
        if not self.cuda:
            return math.nan
        state = setup() if setup else None
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        out = step(state)
        self.sync()
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del out, state
        return peak / 2**20


def steps_for(mode: str, forward, args, leaves, grads):
    """(setup, step) for a mode; setup's result is handed to step and is not timed."""

    def fwd(_):
        return forward(*args)

    def fwd_bwd(_):
        return torch.autograd.grad(forward(*args), leaves, grads)

    def bwd(outs):
        return torch.autograd.grad(outs, leaves, grads)

    if mode == "fwd":
        return None, fwd
    if mode == "fwd+bwd":
        return None, fwd_bwd
    return (lambda: forward(*args)), bwd


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def copy_ceiling(clock: Clock, nbytes: int, iters: int) -> dict:
    """Device-to-device copy of `nbytes`, counting read + write: the bandwidth ceiling."""
    src = torch.randn(nbytes // 2, device=clock.device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)

    def step(_):
        return dst.copy_(src)

    clock.once(step)
    t = clock.median(step, None, iters)  # src and dst are freed when this returns
    gbps = 2 * src.nbytes / t / 1e9
    return {
        "kind": "copy",
        "provider": "copy",
        "bytes": 2 * nbytes,
        "time_us": t * 1e6,
        "gbps": gbps,
        "copy_gbps": gbps,
    }


# ----------------------------------------------------------------------------- the runs


@dataclasses.dataclass
class Plan:
    """What one run measures. The defaults are the quick mode: <= 5 minutes on one H100."""

    Ns: tuple = (1024, 4096, 16384, 65536, 262144)
    dtypes: tuple = ("bf16",)
    modes: tuple = ("fwd", "fwd+bwd")
    elements: int = 2**27  # M*N of the bandwidth rows: 256 MiB per bf16 tensor, 5x L2
    target_s: float = 0.15  # timed seconds per row, within [min_iters, max_iters] calls
    min_iters: int = 5
    max_iters: int = 40
    small_M: tuple = (1, 16, 256)
    small_N: int = 4096
    small_calls: int = 100  # back-to-back calls per wall-time sample
    small_skip: tuple = ("compile",)  # a compile per small shape costs seconds each
    first_call: tuple = ("drop_add_ln:4096", "drop_add_ln:262144")  # workload:N
    first_call_providers: tuple = ("fused_norm",)
    budget_s: Optional[float] = 240.0  # past this, per-shape providers (compile) are skipped
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cuda"))
    providers: list = dataclasses.field(default_factory=list)
    workloads: list = dataclasses.field(default_factory=lambda: list(WORKLOADS.values()))
    t0: float = dataclasses.field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def iters(self, est_s: float) -> int:
        return int(min(self.max_iters, max(self.min_iters, self.target_s / max(est_s, 1e-7))))


FULL = dict(
    Ns=(256, 512, 1024, 2048, 4096, 5120, 8192, 12288, 16384, 32768, 65536, 131072, 262144),
    dtypes=tuple(DTYPES), modes=MODES, target_s=0.3, min_iters=10, max_iters=60,
    small_calls=200, small_skip=(), budget_s=None,
    first_call=tuple(f"{w}:{n}" for w in WORKLOADS for n in (256, 4096, 65536, 262144)),
    first_call_providers=("fused_norm", "liger"),
)  # fmt: skip
SMOKE = dict(
    Ns=(256, 1000), dtypes=("fp32", "bf16_res32"), modes=MODES, elements=2**14, target_s=0.0,
    min_iters=2, max_iters=2, small_M=(1, 4), small_N=256, small_calls=2, small_skip=(),
    first_call=("drop_add_ln:256",), first_call_providers=("fused_norm", "torch"), budget_s=None,
    device=torch.device("cpu"),
)  # fmt: skip


def log(plan: Plan, msg: str):
    print(f"[{plan.elapsed():7.1f}s] {msg}", flush=True)


def short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:240]


@dataclasses.dataclass
class Shape:
    """One problem: inputs allocated once and shared by every provider."""

    kind: str  # "bw" (bandwidth sweep) or "small" (small batches)
    wl: Workload
    dt: str
    M: int
    N: int
    args: tuple = ()
    leaves: list = dataclasses.field(default_factory=list)
    ref: Optional[tuple] = None  # torch eager's outputs, to check each provider against

    def key(self) -> dict:
        return {"kind": self.kind, "workload": self.wl.name, "dtype": self.dt, "N": self.N,
                "M": self.M}  # fmt: skip

    def name(self) -> str:
        return f"{self.dt} {self.wl.name} N={self.N} M={self.M}"


def run_shapes(plan: Plan, clock: Clock, rows: list, shapes, providers, modes, copy_gbps):
    """Every provider and mode on every shape; inputs are freed between shapes."""
    for shape in shapes:
        try:
            shape.args, shape.leaves = make_inputs(shape.wl, shape.dt, shape.M, shape.N,
                                                   plan.device)  # fmt: skip
        except Exception as exc:
            log(plan, f"{shape.name()}: inputs failed: {short_error(exc)}")
            rows += [{**shape.key(), "provider": p.name, "mode": m, "error": short_error(exc)}
                     for p in providers for m in modes]  # fmt: skip
        else:
            for prov in providers:
                if prov.supports(shape.wl, shape.dt):
                    run_provider(plan, clock, rows, prov, shape, modes, copy_gbps)
        shape.args, shape.leaves, shape.ref = (), [], None
        free_memory(plan.device)


def run_provider(plan, clock, rows, prov, shape: Shape, modes, copy_gbps):
    """Every mode of one provider on one shape; a failure is recorded and the run goes on."""
    base = {**shape.key(), "provider": prov.name, "copy_gbps": copy_gbps}
    if prov.per_shape and plan.budget_s is not None and plan.elapsed() > plan.budget_s:
        skip = f"skipped: past the time budget --budget-s {plan.budget_s:g}"
        rows += [{**base, "mode": m, "error": skip} for m in modes]
        return
    try:
        forward = prov.build(prov.module, shape.wl)
        grads = make_grads(shape.wl, shape.dt, shape.M, shape.N, plan.device)
    except Exception as exc:
        rows += [{**base, "mode": m, "error": short_error(exc)} for m in modes]
        free_memory(plan.device)
        return
    for mode in modes:
        row = {**base, "mode": mode}
        row["bytes"] = bytes_moved(shape.wl, shape.dt, shape.M, shape.N, mode)
        try:
            setup, step = steps_for(mode, forward, shape.args, shape.leaves, grads)
            row["first_call_s"] = clock.once(step, setup)
            n = plan.iters(clock.once(step, setup))
            t = clock.median(step, setup, n)
            row.update(time_us=t * 1e6, gbps=row["bytes"] / t / 1e9, iters=n)
            row["peak_extra_mb"] = clock.peak_extra_mb(step, setup)
            msg = (f"{row['gbps']:8.1f} GB/s ({100 * row['gbps'] / copy_gbps:5.1f}% copy) "
                   f"{t * 1e6:9.1f} us, first {row['first_call_s']:.2f}s")  # fmt: skip
            if shape.kind == "small":
                one = lambda _, step=step, setup=setup: step(setup() if setup else None)
                row["wall_us"] = clock.wall_per_call(one, plan.small_calls) * 1e6
                msg += f", wall {row['wall_us']:.1f} us"
        except Exception as exc:
            row["error"] = short_error(exc)
            msg = f"ERROR {row['error']}"
            free_memory(plan.device)
        log(plan, f"{shape.name()} {prov.name:10s} {mode:7s} {msg}")
        rows.append(row)
    del grads
    if not shape.wl.dropout_p and prov.name != "torch":
        note = output_check(forward, shape)
        for row in rows[-len(modes) :]:
            row["note"] = note
    free_memory(plan.device)


def output_check(forward, shape: Shape) -> str:
    """Max |difference| of each output from torch eager's: a guard against benchmarking a
    provider that computes something else (wrong argument order, wrong output order)."""
    try:
        if shape.ref is None:
            shape.ref = tuple(o.detach() for o in eager_forward(shape.wl)(*shape.args))
        outs = [o.detach() for o in forward(*shape.args)]
        if len(outs) != len(shape.ref):
            return f"check: {len(outs)} outputs, torch has {len(shape.ref)}"
        diffs = [(o.float() - r.float()).abs().max().item() for o, r in zip(outs, shape.ref)]
        return "max|Δ| vs torch: " + ", ".join(f"{d:.3g}" for d in diffs)
    except Exception as exc:
        return f"check failed: {short_error(exc)}"


def run_cold(cmd: list) -> dict:
    """Run ``cmd`` (a child printing one JSON object as its last line) in a fresh process with
    empty Triton and Inductor caches; its object, or ``{"error": ...}``."""
    stderr = ""
    with tempfile.TemporaryDirectory(prefix="fused_norm_bench_cache_") as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache, "triton"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))  # fmt: skip
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            stderr = proc.stderr
            return json.loads(proc.stdout.strip().splitlines()[-1])
        except Exception as exc:
            tail = stderr.strip().splitlines()[-1:]
            return {"error": " ".join([short_error(exc)] + tail)[:240]}


def run_first_calls(plan: Plan, rows: list):
    """First fwd+bwd call in a fresh process with an empty Triton/Inductor cache (cold start)."""
    dt = "bf16" if plan.device.type == "cuda" else plan.dtypes[0]
    for prov in [p for p in plan.providers if p.name in plan.first_call_providers]:
        for wl_name, N in plan.first_call:
            if not prov.supports(WORKLOADS[wl_name], dt):
                continue
            spec = {"provider": prov.name, "workload": wl_name, "dtype": dt, "N": N,
                    "M": max(1, plan.elements // N)}  # fmt: skip
            row = {"kind": "first_call", "mode": "fwd+bwd", **spec}
            cmd = [sys.executable, str(Path(__file__).resolve()), "--first-call-child",
                   json.dumps({**spec, "device": str(plan.device)})]  # fmt: skip
            if "--smoke" in sys.argv:
                cmd.append("--smoke")
            row.update(run_cold(cmd))
            rows.append(row)
            msg = row.get("error") or f"{row['first_call_s']:.2f}s ({row.get('note', '')})"
            log(plan, f"first call {prov.name} {wl_name} N={N}: {msg}")


def first_call_child(spec: dict):
    """Runs in a fresh process: import, then time the first forward and backward."""
    device = torch.device(spec["device"])
    wl, dt, M, N = WORKLOADS[spec["workload"]], spec["dtype"], spec["M"], spec["N"]
    prov = PROVIDERS[spec["provider"]]
    out = {}
    try:
        t = time.perf_counter()
        prov.module = prov.load()
        forward = prov.build(prov.module, wl)
        import_s = time.perf_counter() - t
        args, leaves = make_inputs(wl, dt, M, N, device)
        grads = make_grads(wl, dt, M, N, device)
        clock = Clock(device)
        clock.sync()
        t = time.perf_counter()
        outs = forward(*args)
        clock.sync()
        fwd_s = time.perf_counter() - t
        torch.autograd.grad(outs, leaves, grads)
        clock.sync()
        total = time.perf_counter() - t
        out = {
            "first_call_s": total,
            "note": f"import {import_s:.2f}s, fwd {fwd_s:.2f}s, bwd {total - fwd_s:.2f}s, "
            "cold Triton/Inductor cache",
        }
    except Exception as exc:
        out = {"error": short_error(exc)}
    print(json.dumps(out), flush=True)


# ----------------------------------------------------------------------------- environment


def environment(device, args, missing: dict) -> dict:
    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host_cpu": platform.processor() or platform.machine(),
        "mode": "smoke" if args.smoke else ("full" if args.full else "quick"),
        "elements": args.elements,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "providers_unavailable": missing,
        "workloads": {w.name: w.title for w in WORKLOADS.values()},
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(
            sm_count=p.multi_processor_count,
            memory_gb=round(p.total_memory / 1e9, 1),
            capability=f"{p.major}.{p.minor}",
        )
    from importlib import metadata

    for name in ("fused_norm", "liger_kernel", "flash_attn"):
        try:
            version = getattr(_import(name), "__version__", None)
        except Exception:
            continue
        try:  # Liger sets no __version__: its distribution's metadata has it
            version = version or metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
        env[f"{name}_version"] = version or "?"
    try:
        env["git_commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except Exception:
        pass
    gpu = re.sub(r"[^A-Za-z0-9.]+", "-", env["gpu"].replace("NVIDIA", "")).strip("-")
    env["dirname"] = (
        f"{env['date'][:10]}_{gpu}_torch{torch.__version__.split('+')[0]}"
        f"_triton{triton.__version__}_{env['mode']}"
    )
    return env


# ----------------------------------------------------------------------------- CLI


def csv_list(text: str):
    return [s for s in text.split(",") if s]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help="bf16, fwd and fwd+bwd, 5 sizes of N, small batches, 2 first-call "
        "checks; <= 5 min on one H100 (the default)",
    )
    size.add_argument(
        "--full",
        action="store_true",
        help="every dtype, mode and N from 256 to 262144 (long: split it with "
        "--dtypes/--workloads and --append)",
    )
    size.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny sizes, Triton interpreter: checks the script, not speed",
    )
    p.add_argument(
        "--out",
        default="bench/results/auto",
        help="results directory; 'auto' as last component names it after the GPU, "
        "torch/triton versions and date",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="merge with results.csv already in --out (rows of the same key replaced)",
    )
    p.add_argument("--providers", type=csv_list, help=f"of {','.join(PROVIDERS)}")
    p.add_argument("--workloads", type=csv_list, help=f"of {','.join(WORKLOADS)}")
    p.add_argument("--dtypes", type=csv_list, help=f"of {','.join(DTYPES)}")
    p.add_argument("--modes", type=csv_list, help=f"of {','.join(MODES)}")
    p.add_argument("--Ns", type=lambda s: [int(v) for v in csv_list(s)], help="hidden sizes")
    p.add_argument(
        "--elements",
        type=int,
        help="M*N of the bandwidth rows (default 2**27 = 128M, tensors >> L2)",
    )
    p.add_argument(
        "--small-M",
        type=lambda s: [int(v) for v in csv_list(s)],
        help="row counts of the small-batch rows (default 1,16,256; empty: none)",
    )
    p.add_argument("--small-N", type=int, default=None, help="N of the small-batch rows (4096)")
    p.add_argument(
        "--first-call",
        type=csv_list,
        help="workload:N pairs checked in a fresh process (empty string: none)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        help="after this many seconds skip torch.compile rows (quick: 240)",
    )
    p.add_argument("--bytes-table", action="store_true", help="print bytes per row and exit")
    p.add_argument("--first-call-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not (args.full or args.smoke):
        args.quick = True
    return args


def make_plan(args) -> tuple[Plan, dict]:
    """The preset of the chosen mode, with the command line's overrides; providers imported."""
    plan = Plan(**(SMOKE if args.smoke else FULL if args.full else {}))
    for name in ("Ns", "dtypes", "modes", "elements", "small_M", "small_N", "first_call",
                 "budget_s"):  # fmt: skip
        if getattr(args, name) is not None:
            setattr(plan, name, getattr(args, name))
    if plan.device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench.py: no CUDA device; use --smoke for a CPU check of the script")
    names = args.providers or list(PROVIDERS)
    first_wls = [s.split(":")[0] for s in plan.first_call]
    choices = [("provider", names, PROVIDERS), ("workload", args.workloads or [], WORKLOADS),
               ("dtype", plan.dtypes, DTYPES), ("mode", plan.modes, MODES),
               ("--first-call workload", first_wls, WORKLOADS)]  # fmt: skip
    for label, chosen, known in choices:
        bad = [c for c in chosen if c not in known]
        if bad:
            sys.exit(f"bench.py: unknown {label} {bad}; choose from {list(known)}")
    plan.providers, missing = load_providers(names)
    if args.workloads:
        plan.workloads = [WORKLOADS[w] for w in args.workloads]
    plan.modes = [m for m in MODES if m in plan.modes]
    plan.first_call = [(s.split(":")[0], int(s.split(":")[1])) for s in plan.first_call]
    args.elements = plan.elements
    return plan, missing


def main(argv=None):
    args = parse_args(argv)
    if args.bytes_table:
        print(bytes_table())
        return
    if args.first_call_child:
        first_call_child(json.loads(args.first_call_child))
        return
    torch.manual_seed(0)
    plan, missing = make_plan(args)
    env = environment(plan.device, args, missing)
    out = Path(args.out)
    if out.name == "auto":
        out = out.parent / env["dirname"]
    out.mkdir(parents=True, exist_ok=True)
    log(plan, f"{env['gpu']} torch {env['torch']} triton {env['triton']} -> {out}")
    if missing:
        log(plan, f"providers unavailable: {missing}")
    clock = Clock(plan.device)
    rows: list = []

    copy_iters = 2 if args.smoke else 30
    copy_bytes = plan.elements * 2
    first = copy_ceiling(clock, copy_bytes, copy_iters)
    log(plan, f"copy ceiling {first['gbps']:.1f} GB/s ({copy_bytes / 2**20:.0f} MiB)")
    if plan.first_call:
        run_first_calls(plan, rows)
    bw = [Shape("bw", wl, dt, max(1, plan.elements // N), N) for dt in plan.dtypes
          for wl in plan.workloads if dtype_applies(wl, dt) for N in plan.Ns]  # fmt: skip
    run_shapes(plan, clock, rows, bw, plan.providers, plan.modes, first["gbps"])
    # Small batches: launch-bound, so host wall time per call is reported too.
    small_dt = "bf16" if plan.device.type == "cuda" else plan.dtypes[0]
    small = [Shape("small", wl, small_dt, M, plan.small_N) for wl in plan.workloads
             for M in plan.small_M]  # fmt: skip
    small_modes = [m for m in ("fwd", "fwd+bwd") if m in plan.modes] or ["fwd"]
    small_providers = [p for p in plan.providers if p.name not in plan.small_skip]
    run_shapes(plan, clock, rows, small, small_providers, small_modes, first["gbps"])
    last = copy_ceiling(clock, copy_bytes, copy_iters)
    log(plan, f"copy ceiling again {last['gbps']:.1f} GB/s")
    # One ceiling for the run: the better of the two copies, so "% of copy" is not flattered
    # by a slow first measurement.
    ceiling = max(first["gbps"], last["gbps"])
    for r in rows:
        if r.get("kind") in ("bw", "small"):
            r["copy_gbps"] = ceiling
    rows += [first, last]
    env["plan"] = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)
                   if f.name not in ("t0", "device", "providers", "workloads")}  # fmt: skip
    env["plan"].update(providers=[p.name for p in plan.providers],
                       workloads=[w.name for w in plan.workloads])  # fmt: skip
    env.update(
        copy_gbps=ceiling,
        copy_gbps_first=first["gbps"],
        copy_gbps_last=last["gbps"],
        copy_bytes=copy_bytes,
        wall_s=round(plan.elapsed(), 1),
    )

    if args.append and (out / "results.csv").exists():
        rows = report.merge(report.read_csv(out / "results.csv"), rows)
        old_env = json.loads((out / "env.json").read_text())
        env["earlier_runs"] = old_env.pop("earlier_runs", []) + [old_env]
    report.write_all(out, rows, env)
    log(
        plan,
        f"wrote {out}/results.csv, results.md, readme_table.md, env.json and plots; "
        f"commit it as bench/results/{env['dirname']}",
    )


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Host cost per call, and where a call stops being host-bound.

Three measurements, one process, one GPU:

1. ``small``: wall time per call of back-to-back calls (one synchronize at the end), at
   M = 1, 16, 256 rows and at the LLM-like M = 16384, N = 4096, bf16: fused_norm, the torch
   eager code it replaces (bench.py's ``eager_forward``) and Liger-Kernel where installed.
   Where the GPU work is tiny this is the host time a user pays per call.
2. ``device``: at M·N = 2**27 elements (the bandwidth benchmark's size), every width of
   ``make bench``: a back-to-back forward + backward's wall time against the device time of
   its kernels, measured in the same run by the profiler (sum of kernel times per call).
3. ``crossover``: the same ratio over M·N from 2**14 to 2**27 at N = 4096, per workload:
   the smallest size whose wall time is within 1.1x of its kernels' time.

    python3 -u bench/host_cost.py --out bench/results/auto     # about a minute on an H200
    python3 bench/host_cost.py --smoke --out /tmp/hc           # CPU, the interpreter

Writes host_cost.csv, host_cost.md and host_cost.png in --out.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(1, str(BENCH))

import bench as B  # noqa: E402  (bench/bench.py: workloads, inputs, providers)

RATIO_TARGET = 1.1


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def wall_per_call(step, dev, calls, repeats=5) -> float:
    """Median over ``repeats`` of (wall time of ``calls`` back-to-back calls) / calls, s."""
    step()
    sync(dev)
    times = []
    for _ in range(repeats):
        sync(dev)
        t = time.perf_counter()
        for _ in range(calls):
            step()
        sync(dev)
        times.append((time.perf_counter() - t) / calls)
    return statistics.median(times)


def kernel_time_per_call(step, dev, calls) -> float:
    """Device time of the kernels one call launches (s): the profiler's sum of kernel times."""
    from torch.profiler import ProfilerActivity, profile

    step()
    sync(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        sync(dev)
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / calls / 1e6


def make_step(prov, wl, dt, m, n, dev, mode):
    forward = prov.build(prov.module, wl)
    args, leaves = B.make_inputs(wl, dt, m, n, dev)
    grads = B.make_grads(wl, dt, m, n, dev)
    if mode == "fwd":
        return lambda: forward(*args)
    return lambda: torch.autograd.grad(forward(*args), leaves, grads)


def run_small(plan, rows, providers, dev, log):
    for m in plan["small_M"] + [plan["llm_M"]]:
        for wl in B.WORKLOADS.values():
            for mode in ("fwd", "fwd+bwd"):
                for prov in providers:
                    if not prov.supports(wl, "bf16"):
                        continue
                    try:
                        step = make_step(prov, wl, plan["dt"], m, plan["N"], dev, mode)
                        t = wall_per_call(step, dev, plan["calls"] if m < 4096 else 20)
                        row = dict(kind="small", workload=wl.name, mode=mode, provider=prov.name,
                                   M=m, N=plan["N"], wall_us=round(t * 1e6, 2))  # fmt: skip
                    except Exception as exc:  # a peer lacking a feature: recorded, not fatal
                        row = dict(kind="small", workload=wl.name, mode=mode, provider=prov.name,
                                   M=m, N=plan["N"], error=B.short_error(exc))  # fmt: skip
                    rows.append(row)
                    log(row)


def run_ratio(kind, sizes, rows, fused, dev, log, calls):
    for wl_name, m, n in sizes:
        wl = B.WORKLOADS[wl_name]
        step = make_step(fused, wl, "bf16" if dev.type == "cuda" else "fp32", m, n, dev, "fwd+bwd")
        wall = wall_per_call(step, dev, calls)
        kern = kernel_time_per_call(step, dev, calls) if dev.type == "cuda" else float("nan")
        row = dict(kind=kind, workload=wl_name, mode="fwd+bwd", provider="fused_norm", M=m, N=n,
                   wall_us=round(wall * 1e6, 2), kernel_us=round(kern * 1e6, 2),
                   ratio=round(wall / kern, 3) if kern == kern and kern > 0 else None)  # fmt: skip
        rows.append(row)
        log(row)
        del step


def report(out: Path, rows, env):
    keys = ["kind", "workload", "mode", "provider", "M", "N", "wall_us", "kernel_us", "ratio",
            "error"]  # fmt: skip
    with open(out / "host_cost.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in keys})
    lines = [f"# Host cost per call: {env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
             f"{env['date']}", "", f"Command: `{env['command']}`", ""]  # fmt: skip
    small = [r for r in rows if r["kind"] == "small" and "error" not in r]
    provs = sorted({r["provider"] for r in small}, key=lambda p: (p != "fused_norm", p))
    lines += ["## Wall time per call (µs, back-to-back calls, bf16)", "",
              "| workload | M × N | mode | " + " | ".join(provs) + " | fused / torch |",
              "|---|---|---|" + "---|" * (len(provs) + 1)]  # fmt: skip
    for key in sorted({(r["workload"], r["M"], r["N"], r["mode"]) for r in small},
                      key=lambda k: (k[1], list(B.WORKLOADS).index(k[0]), k[3])):  # fmt: skip
        got = {r["provider"]: r["wall_us"] for r in small
               if (r["workload"], r["M"], r["N"], r["mode"]) == key}  # fmt: skip
        ratio = got.get("fused_norm", 0) / got["torch"] if got.get("torch") else float("nan")
        cells = " | ".join(f"{got[p]:.1f}" if p in got else "–" for p in provs)
        lines.append(f"| {key[0]} | {key[1]} × {key[2]} | {key[3]} | {cells} | {ratio:.2f} |")
    for kind, title in (("device", "Wall vs kernel time at M·N = 2**27, forward + backward"),
                        ("crossover", "Where calls stop being host-bound (N = 4096)")):  # fmt: skip
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            continue
        lines += ["", f"## {title}", "", "| workload | M × N | wall µs | kernels µs | wall / kernels |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r in sel:
            lines.append(f"| {r['workload']} | {r['M']} × {r['N']} | {r['wall_us']} | "
                         f"{r['kernel_us']} | {r['ratio']} |")  # fmt: skip
        if kind == "crossover":
            lines.append("")
            for wl in dict.fromkeys(r["workload"] for r in sel):
                ok = [r["M"] * r["N"] for r in sel if r["workload"] == wl and r["ratio"]
                      and r["ratio"] <= RATIO_TARGET]  # fmt: skip
                lines.append(f"- {wl}: within {RATIO_TARGET}x of its kernels from M·N = "
                             f"{min(ok) if ok else 'never in the range'}")  # fmt: skip
    (out / "host_cost.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
            for wl in B.WORKLOADS:
                for prov, style in (("fused_norm", "-o"), ("torch", "--x")):
                    pts = sorted((r["M"], r["wall_us"]) for r in small
                                 if r["workload"] == wl and r["mode"] == mode
                                 and r["provider"] == prov)  # fmt: skip
                    if pts:
                        ax.plot(*zip(*pts), style, label=f"{wl} {prov}")
            ax.set(xscale="log", yscale="log", xlabel="rows M (N = 4096)",
                   ylabel="wall µs per call", title=mode)  # fmt: skip
        axes[1].legend(fontsize=6, ncol=2)
        fig.suptitle(f"host cost per call, {env['gpu']}, {env['date']}")
        fig.tight_layout()
        fig.savefig(out / "host_cost.png", dpi=120)
    except Exception as exc:  # matplotlib missing: the CSV and markdown stand
        print(f"no plot: {exc}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/auto")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, the interpreter")
    ap.add_argument("--providers", default="fused_norm,torch,liger")
    args = ap.parse_args()
    import triton

    dev = torch.device("cpu" if args.smoke else "cuda")
    env = dict(
        gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        torch=torch.__version__, triton=triton.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=" ".join(["python3"] + sys.argv),
    )  # fmt: skip
    out = Path(args.out)
    if out.name == "auto":
        gpu = env["gpu"].replace("NVIDIA ", "").replace(" ", "-")
        out = (
            out.parent
            / f"{env['date'][:10]}_{gpu}_torch{torch.__version__.split('+')[0]}_triton{triton.__version__}_host"
        )
    out.mkdir(parents=True, exist_ok=True)
    providers, missing = B.load_providers(args.providers.split(","))
    t0 = time.perf_counter()

    def log(row):
        print(f"[{time.perf_counter() - t0:6.1f}s] {row}", flush=True)

    if missing:
        print(f"providers unavailable: {missing}")
    if args.smoke:
        plan = dict(small_M=[1, 4], llm_M=8, N=256, dt="fp32", calls=2)
        device_sizes = [("rms", 64, 256)]
        crossover = [("rms", 16, 256)]
        calls = 2
    else:
        plan = dict(small_M=[1, 16, 256], llm_M=16384, N=4096, dt="bf16", calls=200)
        device_sizes = [(wl, 2**27 // n, n) for wl in B.WORKLOADS
                        for n in (1024, 4096, 16384, 65536, 262144)]  # fmt: skip
        crossover = [(wl, 2**k // 4096, 4096) for wl in B.WORKLOADS for k in range(14, 28, 2)]
        # 17-50 ms of back-to-back work: the first launch and the last sync weigh little.
        calls = 50
    rows: list = []
    torch.manual_seed(0)
    run_small(plan, rows, providers, dev, log)
    fused = next(p for p in providers if p.name == "fused_norm")
    run_ratio("device", device_sizes, rows, fused, dev, log, calls)
    run_ratio("crossover", crossover, rows, fused, dev, log, calls)
    report(out, rows, env)
    print(f"wrote {out}/host_cost.csv, host_cost.md, host_cost.png")


if __name__ == "__main__":
    main()

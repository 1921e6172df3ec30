"""Where a training step of the example GPT spends its time: wall vs kernel time per variant.

    python3 -u bench/profile_gpt.py --out DIR [--preset medium] [--rounds 5]

Builds the example GPT (``examples/gpt_model.py``) with ``--norm torch`` and ``--norm fused``,
eager (``eager``), compiled per block as ``examples/train_gpt.py --compile`` does (``compile``)
and compiled as one model (``whole``); bf16 autocast, AdamW, random tokens. Step wall times are
taken in interleaved rounds (each round runs every variant), so fused / torch is a per-round
ratio of two variants timed moments apart in one process (compiled runs differ by 10-20%
between processes). Host time per step: one step enqueued while a sleep kernel holds
the GPU, so the host never waits for it. Then the profiler records a few steps of each: GPU
kernel time per step, kernels per step, the kernels that took the most time and the host events.
Writes ``DIR/profile_gpt.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))

from gpt_model import GPT, GPTConfig  # noqa: E402
from train_gpt import PRESETS  # noqa: E402


def make(preset: str, norm: str, mode: str, dropout: float, dev):
    p = PRESETS[preset]
    torch.manual_seed(0)
    model = GPT(GPTConfig(**p["model"], dropout=dropout, norm=norm)).to(dev)
    if mode == "compile":
        for block in model.blocks:
            block.compile()
    elif mode == "whole":
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    t = p["model"]["block_size"]
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randint(0, 256, (p["batch_size"], t + 1), device=dev, generator=g)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, p["batch_size"] * t


def timed(step, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def host_time(step) -> float:
    """Seconds the host takes to enqueue one step while the GPU is held busy (a ~150 ms sleep
    kernel queued first), so that no launch waits for the GPU."""
    torch.cuda.synchronize()
    torch.cuda._sleep(300_000_000)
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    torch.cuda.synchronize()
    return seconds


def _profiled(step, n: int, activity: str):
    """The profiler's record of ``n`` steps, with the ``activity`` ("CPU" or "CUDA") on."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[getattr(ProfilerActivity, activity)]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    return prof


def kernels(step, n: int):
    """GPU kernel µs per step by name, and kernels per step."""
    per_name, count = defaultdict(float), 0
    for e in _profiled(step, n, "CUDA").events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name] += e.device_time_total / n  # µs per step
            count += 1
    return per_name, count / n


def host(step, n: int):
    """Host-side events per step by name: (self CPU µs, calls)."""
    return {e.key: (e.self_cpu_time_total / n, e.count / n)
            for e in _profiled(step, n, "CPU").key_averages()}  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--variants", default="torch:eager,fused:eager,torch:compile,fused:compile,"
                    "torch:whole,fused:whole", help="norm:mode, mode eager, compile (each block) "
                    "or whole (the model)")  # fmt: skip
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args(argv)
    from torch._inductor import config as inductor_config

    dev = torch.device("cuda")
    variants = [v.split(":") for v in a.variants.split(",")]
    steps, walls, enqueue = {}, defaultdict(list), defaultdict(list)
    for norm, mode in variants:
        step, tokens = make(a.preset, norm, mode, a.dropout, dev)
        for _ in range(a.warmup):
            step()
        steps[(norm, mode)] = step
    for _ in range(a.rounds):
        for v, step in steps.items():
            walls[v].append(timed(step, a.steps))
            enqueue[v].append(host_time(step))
    lines = [
        f"# Example GPT step profile: {a.preset}, dropout {a.dropout}",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton "
        f"{__import__('triton').__version__} · {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"Command: `python3 -u bench/profile_gpt.py {' '.join(argv or sys.argv[1:])}`. Wall: "
        f"median over {a.rounds} interleaved rounds of {a.steps} steps; fused / torch: median of "
        "the rounds' ratios. Host: one step enqueued behind a sleep kernel. Kernel: the "
        "profiler's sum of GPU kernel times per step (another few steps); compile = each block, "
        "whole = the model. Inductor's static launcher for "
        "user-defined Triton kernels: "
        f"{getattr(inductor_config, 'static_launch_user_defined_triton_kernels', 'n/a')}.",
        "",
        "| norm | mode | wall ms | tok/s | fused / torch (rounds won) | host ms | kernel ms "
        "| kernels / step | GPU idle ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    tops, hosts = [], []
    for v, step in steps.items():
        wall = statistics.median(walls[v]) * 1e3
        per_name, count = kernels(step, 3)
        busy = sum(per_name.values()) / 1e3
        ratio = ""
        if v[0] == "fused" and ("torch", v[1]) in steps:
            rs = [t / f for t, f in zip(walls[("torch", v[1])], walls[v])]
            ratio = f"{statistics.median(rs):.3f}× ({sum(r > 1 for r in rs)}/{len(rs)})"
        host_ms = statistics.median(enqueue[v]) * 1e3
        lines.append(f"| {v[0]} | {v[1]} | {wall:.2f} | {tokens / wall * 1e3:,.0f} | {ratio} "
                     f"| {host_ms:.2f} | {busy:.2f} | {count:.0f} | {wall - busy:.2f} |")  # fmt: skip
        tops.append((v, per_name))
        hosts.append((v, host(step, 3)))
        print(lines[-1], flush=True)
    for v, per_name in tops:
        lines += ["", f"## {v[0]} {v[1]}: top kernels, µs per step", "", "| µs | kernel |",
                  "|---:|---|"]  # fmt: skip
        for name, us in sorted(per_name.items(), key=lambda kv: -kv[1])[: a.top]:
            lines.append(f"| {us:.0f} | `{name[:110]}` |")
    for v, per_name in hosts:
        total = sum(us for us, _ in per_name.values()) / 1e3
        lines += ["", f"## {v[0]} {v[1]}: host events by self time, per step (profiler on: "
                  f"{total:.2f} ms in all)", "", "| µs | calls | event |", "|---:|---:|---|"]  # fmt: skip
        for name, (us, calls) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[: 2 * a.top]:
            lines.append(f"| {us:.0f} | {calls:.0f} | `{name[:110]}` |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_gpt.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Training throughput of the example GPT: fused_norm vs the unfused torch norm, eager and compiled.

    python examples/bench_gpt.py runs/bench_gpt.md    # small, medium, llm (about 9 min, H200)
    python examples/bench_gpt.py out.md --presets small --no-compile   # a quicker subset
    python examples/bench_gpt.py out.md --compile-only --compile blocks --repeats 3

Each cell is one ``train_gpt.py --bench`` run in its own process (so compile caches and allocator
state do not leak between cells): tokens/s over the steps after ``--timing-warmup``, which keeps
compilation and allocator warm-up out of the number; bf16 autocast on CUDA (the script's
default), dropout 0.1 so the dropout path is part of what is timed. Compiled cells come two
ways (``--compile``): ``blocks``, torch.compile of each block (regional, as torchtitan does), and
``model``, the whole model as one graph (``torch.compile(model)``: fewer calls per step).
The two norms run back to back for each (preset, compile) pair so slow drift hits both alike;
with ``--repeats R`` each pair runs R times, alternating which norm goes first, and a cell
reports the median run and the spread of all R (compiled runs vary more between processes
than eager ones).
Writes a markdown table to the given path and the raw numbers to the same path with ``.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMPILES = ("no", "blocks", "model")  # the cells' compile column, in table order


def run_cell(preset, norm, compile_, args, workdir) -> dict:
    """One ``train_gpt.py --bench`` run; ``compile_``: "no", "blocks" or "model"."""
    out = Path(workdir) / f"{preset}-{norm}-{compile_}"
    cmd = [
        sys.executable,
        str(HERE / "train_gpt.py"),
        "--bench",
        "--preset",
        preset,
        "--norm",
        norm,
        "--device",
        args.device,
        "--steps",
        str(args.steps),
        "--timing-warmup",
        str(args.timing_warmup),
        "--dropout",
        str(args.dropout),
        "--out",
        str(out),
    ]
    if compile_ != "no":
        cmd += ["--compile", compile_]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    wall = time.perf_counter() - t0
    summary_path = out / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return {"error": f"exit {proc.returncode}: {tail[0][:200]}", "wall_s": wall}
    summary = json.loads(summary_path.read_text())
    summary["wall_s"] = wall
    return summary


def environment(device) -> dict:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    if device != "cpu" and torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = f"cpu ({platform.machine()})"
    return env


def fmt_rate(cell):
    if not cell.get("tokens_per_s"):
        return "error"
    runs = cell.get("runs") or []
    spread = f" ({min(runs):,.0f}-{max(runs):,.0f})" if len(runs) > 1 else ""
    return f"{cell['tokens_per_s']:,.0f}{spread}"


def median_run(runs: list) -> dict:
    """The run with the median tokens/s (the lower middle one of an even count), with every
    run's tokens/s under ``runs``; the first error where no run succeeded."""
    ok = sorted((r for r in runs if r.get("tokens_per_s")), key=lambda r: r["tokens_per_s"])
    if not ok:
        return runs[0]
    cell = dict(ok[(len(ok) - 1) // 2])
    cell["runs"] = [r["tokens_per_s"] for r in ok]
    return cell


def markdown(rows, env, args, date) -> str:
    precisions = {
        c["precision"] for cells in rows.values() for c in cells.values() if "precision" in c
    }
    precision = ", ".join(sorted(precisions)) or "-"
    # which of fused_norm's backends the fused cells ran (train_gpt.py's summary.json "backend")
    backends = {
        c["backend"] for cells in rows.values() for n, c in cells.items()
        if n == "fused" and c.get("backend")
    }  # fmt: skip
    backend = ", ".join(sorted(backends)) or "-"
    lines = [
        "### Example GPT training throughput: `--norm fused` vs `--norm torch`",
        "",
        f"{env['device']} · torch {env['torch']} · triton {env['triton']}"
        + (f" · CUDA {env['cuda']}" if "cuda" in env else "")
        + f" · Python {env['python']} · {date}",
        "",
        f"tokens/s over steps {args.timing_warmup + 1}-{args.steps} of "
        + (
            "one run per cell "
            if args.repeats == 1
            else f"the median of {args.repeats} runs per cell (their range in brackets) "
        )  # fmt: skip
        + f"(compilation excluded), precision {precision}, AdamW, dropout {args.dropout}. "
        "`torch` = nn.Dropout + add + nn.RMSNorm; "
        f"`fused` = fused_norm.DropoutAddRMSNorm (backend: {backend}); "
        "compile: `blocks` = torch.compile of each block, `model` = of the whole model.",
        "",
        "| preset | params | tokens/step | compile | torch tok/s | fused tok/s | fused / torch "
        "| peak GiB torch / fused |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for (preset, compile_), cells in sorted(
        rows.items(), key=lambda kv: (args.presets.index(kv[0][0]), COMPILES.index(kv[0][1]))
    ):
        t, f = cells.get("torch", {}), cells.get("fused", {})
        ref = t if "params" in t else f
        ratio = (
            f"{f['tokens_per_s'] / t['tokens_per_s']:.2f}x"
            if t.get("tokens_per_s") and f.get("tokens_per_s")
            else "-"
        )
        mem = " / ".join(f"{c['peak_mem_gib']:.1f}" if "peak_mem_gib" in c else "-" for c in (t, f))
        params = f"{ref['params'] / 1e6:.1f}M" if "params" in ref else "-"
        tps = ref.get("tokens_per_step", "-")
        lines.append(
            f"| {preset} | {params} | {tps} | {compile_} | "
            f"{fmt_rate(t)} | {fmt_rate(f)} | {ratio} | {mem} |"
        )
    errors = [
        f"- {p} compile={c} {n}: {cell['error']}"
        for (p, c), cells in rows.items()
        for n, cell in cells.items()
        if "error" in cell
    ]
    if errors:
        lines += ["", "Failed cells:", *errors]
    cmd = "python examples/bench_gpt.py " + " ".join(sys.argv[1:])
    lines += ["", f"Command: `{cmd}`", ""]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("output", help="markdown file to write (the CSV goes next to it)")
    p.add_argument("--presets", nargs="+", default=["small", "medium", "llm"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--timing-warmup", type=int, default=10)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile cells")
    p.add_argument(
        "--compile",
        default="blocks,model",
        help="the compiled cells: blocks (each block), model (the whole model)",
    )
    p.add_argument("--timeout", type=int, default=240, help="seconds allowed per run")
    p.add_argument("--repeats", type=int, default=1, help="runs per cell (median reported)")
    p.add_argument("--compile-only", action="store_true", help="skip the eager cells")
    args = p.parse_args(argv)

    env = environment(args.device)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Eager cells first: if the compiled ones overrun a time limit, the table still has those.
    compiled = [c.strip() for c in args.compile.split(",") if c.strip()]
    for c in compiled:
        if c not in COMPILES[1:]:
            p.error(f"--compile: {c!r} is not one of {', '.join(COMPILES[1:])}")
    modes = ["no"] if args.no_compile else compiled if args.compile_only else ["no", *compiled]
    order = [(p, c) for c in modes for p in args.presets]
    rows, records = {}, []
    with tempfile.TemporaryDirectory() as workdir:
        for preset, compile_ in order:
            cells = rows.setdefault((preset, compile_), {})
            runs = {"torch": [], "fused": []}
            for r in range(args.repeats):
                for norm in ("torch", "fused") if r % 2 == 0 else ("fused", "torch"):
                    cell = run_cell(preset, norm, compile_, args, workdir)
                    runs[norm].append(cell)
                    rate = cell.get("error") or f"{fmt_rate(cell)} tok/s"
                    ran = f", backend {cell['backend']}" if cell.get("backend") else ""
                    print(f"{preset:7s} compile={compile_:6s} {norm:5s} {rate} "
                          f"({cell.get('wall_s', 0):.0f} s{ran})", flush=True)  # fmt: skip
                    records.append({
                        "preset": preset, "compile": compile_, "norm": norm, "run": r,
                        **{k: cell.get(k) for k in ("backend", "tokens_per_s", "peak_mem_gib",
                                                    "params", "tokens_per_step", "final_loss",
                                                    "error")},
                        **env, "date": date,
                    })  # fmt: skip
            for norm in ("torch", "fused"):
                cells[norm] = median_run(runs[norm])
            # Rewrite after every pair so an interrupted sweep still leaves its results.
            write_results(out, markdown(rows, env, args, date), records)
    print(out.read_text())


def write_results(out: Path, text: str, records: list):
    out.write_text(text)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


if __name__ == "__main__":
    main()

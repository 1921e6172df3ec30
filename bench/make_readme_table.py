#!/usr/bin/env python3
"""Turn a committed results directory into the README's performance table.

    python3 bench/make_readme_table.py bench/results/<dir>                  # print it
    python3 bench/make_readme_table.py bench/results/<dir> --readme README.md

With --readme, the text between the lines `<!-- bench:begin -->` and `<!-- bench:end -->` is
replaced. Needs only the standard library (no torch, no GPU): it reads results.csv and
env.json, whose derived columns (% of copy, ratio to the best peer, pass/fail) bench.py wrote.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
OURS = "fused_norm"
WORKLOAD_ORDER = ["ln", "rms", "add_rms", "drop_add_ln", "parallel_ln"]


def _num(v):
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _ours(rows, **match):
    for r in rows:
        if r.get("provider") == OURS and all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _cell(r):
    if r is None:
        return "–"
    if r.get("error") or not _num(r.get("pct_copy")):
        return "err"
    text = f"{r['pct_copy']:.0f}%"
    if _num(r.get("vs_best_peer")):
        text += f" · {r['vs_best_peer']:.2f}×"
    if str(r.get("result", "")).startswith("FAIL"):
        text += " ✗"
    return text


def render(rows, env, dtype="bf16", source=None, extras=True) -> str:
    """Markdown: % of copy and ratio to the best peer per workload, mode and N; with
    ``extras``, small batches, first call and peak memory too. `rows` are typed dicts as
    report.read_csv returns them."""
    titles = env.get("workloads", {})
    dtypes = [r["dtype"] for r in rows if r.get("kind") == "bw"]
    if dtype not in dtypes and dtypes:
        dtype = dtypes[0]  # e.g. a CPU smoke run, which has no bf16 rows
    bw = [r for r in rows if r.get("kind") == "bw" and r.get("dtype") == dtype]
    Ns = sorted({r["N"] for r in bw})
    where = f" (`{source}`)" if source else ""
    ceilings = sorted({round(r["copy_gbps"]) for r in bw if r.get("copy_gbps")}) or [
        round(env.get("copy_gbps", 0))
    ]
    if len(ceilings) == 1:
        copy = f"device-to-device copy ceiling {ceilings[0]} GB/s, measured in the same run"
    else:  # rows merged from several runs (--append)
        copy = (f"device-to-device copy ceiling {ceilings[0]}-{ceilings[-1]} GB/s, each row "
                f"against the copy measured in its own run")  # fmt: skip
    # Rows merged from several runs (--append) may span days: the first and last run's dates.
    days = sorted({r.get("date", "")[:10] for r in env.get("earlier_runs", [])}
                  | {env.get("date", "")[:10]} - {""})  # fmt: skip
    when = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}" if days else ""
    out = [
        f"Measured on {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, "
        f"{when}{where}; {dtype}, M·N = {env.get('elements')} elements; "
        f"{copy}. Each cell: fused_norm's bandwidth as % of that copy · its ratio to the "
        f"fastest peer (torch eager, torch.compile, Liger where it supports the shape); "
        f"✗ marks a missed target (see `results.md` there).",
        "",
    ]
    header = ["workload", "mode"] + [f"N={n}" for n in Ns]
    body = []
    for wl in [w for w in WORKLOAD_ORDER if any(r["workload"] == w for r in bw)]:
        for mode in ("fwd", "bwd", "fwd+bwd"):
            if any(r["workload"] == wl and r["mode"] == mode for r in bw):
                body.append(
                    [titles.get(wl, wl), mode]
                    + [_cell(_ours(bw, workload=wl, mode=mode, N=n)) for n in Ns]
                )
    out.append(_table(header, body))
    if not extras:
        return "\n".join(out)

    small = [r for r in rows if r.get("kind") == "small"]
    if small:
        Ms = sorted({r["M"] for r in small})
        N = small[0]["N"]
        out += [
            "",
            f"Small batches at N={N}, µs per call (host wall time of back-to-back calls), "
            "fused_norm / torch eager:",
            "",
        ]
        body = []
        for wl in [w for w in WORKLOAD_ORDER if any(r["workload"] == w for r in small)]:
            for mode in ("fwd", "fwd+bwd"):
                cells = []
                for m in Ms:
                    sel = {
                        r["provider"]: r
                        for r in small
                        if r["workload"] == wl and r["mode"] == mode and r["M"] == m
                    }
                    ours, eager = sel.get(OURS, {}), sel.get("torch", {})
                    if _num(ours.get("wall_us")) and _num(eager.get("wall_us")):
                        mark = " ✗" if str(ours.get("result", "")).startswith("FAIL") else ""
                        cells.append(f"{ours['wall_us']:.0f} / {eager['wall_us']:.0f}{mark}")
                    else:
                        cells.append("–")
                if any(c != "–" for c in cells):
                    body.append([titles.get(wl, wl), mode] + cells)
        out.append(_table(["workload", "mode"] + [f"M={m}" for m in Ms], body))

    first = [r for r in rows if r.get("kind") == "first_call" and r.get("provider") == OURS]
    if first:
        times = [r["first_call_s"] for r in first if _num(r.get("first_call_s"))]
        worst = max(first, key=lambda r: r.get("first_call_s") or math.inf)
        text = (
            f"{max(times):.2f} s"
            if len(times) == len(first)
            else f"error in {len(first) - len(times)} case(s)"
        )
        out += [
            "",
            f"First forward + backward in a fresh process with cold Triton cache: "
            f"worst {text} over {len(first)} cases (worst: {worst['workload']}, "
            f"N={worst['N']}; target ≤ 3 s).",
        ]

    mem = [r for r in bw if r.get("mode") == "fwd+bwd" and _num(r.get("peak_extra_mb"))]
    if mem:
        n = min({r["N"] for r in mem}, key=lambda v: abs(v - 4096))
        provs = [
            p
            for p in [OURS, "torch", "compile", "liger", "flash_attn"]
            if any(r["provider"] == p for r in mem)
        ]
        out += ["", f"Peak extra memory of one fwd+bwd step at N={n} (MiB):", ""]
        body = []
        for wl in [w for w in WORKLOAD_ORDER if any(r["workload"] == w for r in mem)]:
            sel = {r["provider"]: r for r in mem if r["workload"] == wl and r["N"] == n}
            body.append(
                [titles.get(wl, wl)]
                + [f"{sel[p]['peak_extra_mb']:.0f}" if p in sel else "–" for p in provs]
            )
        out.append(_table(["workload"] + provs, body))
    return "\n".join(out)


def _table(header, body):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """Put `block` between the BEGIN and END marker lines of `text`."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"markers {BEGIN} and {END} not found")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def main(argv=None):
    import json

    import report  # bench/report.py: the CSV reader with typed columns

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a results directory written by bench.py")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--readme", type=Path, help="rewrite the marked block of this file")
    p.add_argument("--bandwidth-only", action="store_true",
                   help="the bandwidth table alone (no small batches, first call, memory)")  # fmt: skip
    args = p.parse_args(argv)
    rows = report.read_csv(args.results / "results.csv")
    env = json.loads((args.results / "env.json").read_text())
    try:
        source = args.results.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        source = args.results
    table = render(rows, env, args.dtype, source=source.as_posix(),
                   extras=not args.bandwidth_only)  # fmt: skip
    if args.readme:
        args.readme.write_text(replace_block(args.readme.read_text(), table))
        print(f"updated {args.readme}", file=sys.stderr)
    else:
        print(table)


if __name__ == "__main__":
    main()

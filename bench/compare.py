#!/usr/bin/env python3
"""fused_norm's bandwidth rows of one run against another: the change in points of copy per row
(workload, mode, dtype, N) that both measured, the median change, and the rows that fell more
than ``--bar`` points (the speed-kept check of a redesign: no row more than 3 points below,
the median within 1).

    python3 bench/compare.py NEW/results.csv OLD/results.csv [--bar 3] [--out compare.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402  (bench/report.py: the results CSV's reader)


def _rows(path) -> dict:
    return {
        (r["workload"], r["mode"], r["dtype"], r["N"]): r["pct_copy"]
        for r in report.read_csv(path)
        if r["kind"] == "bw" and r["provider"] == "fused_norm" and "pct_copy" in r
    }


def compare(new_csv, old_csv, bar: float) -> str:
    new, old = _rows(new_csv), _rows(old_csv)
    keys = sorted(k for k in new if k in old)
    if not keys:
        raise SystemExit("no fused_norm bandwidth row is in both runs")
    diffs = {k: new[k] - old[k] for k in keys}
    below = [k for k in keys if diffs[k] < -bar]
    lines = [
        f"# fused_norm % of copy: `{new_csv}` against `{old_csv}`",
        "",
        f"{len(keys)} rows in both; median change {statistics.median(diffs.values()):+.2f} "
        f"points; {len(below)} more than {bar:g} points below.",
        "",
        "| workload | mode | dtype | N | old % copy | new % copy | change |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in keys:
        mark = " ✗" if k in below else ""
        lines.append(f"| {' | '.join(map(str, k))} | {old[k]:.1f} | {new[k]:.1f} | "
                     f"{diffs[k]:+.1f}{mark} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("new")
    ap.add_argument("old")
    ap.add_argument("--bar", type=float, default=3.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    text = compare(args.new, args.old, args.bar)
    if args.out:
        Path(args.out).write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()

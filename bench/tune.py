#!/usr/bin/env python3
"""Re-derive the tuned launch table of the GPU at hand (``fused_norm/tuned/<arch>.py``).

For each row (direction, kind, dtype tag, width) the script times the plan of the rules alone
(``heuristics``, with no table) against candidate overrides: the current table's entry, the
rule's warps halved and doubled, and with ``--explore`` more (register caps, the full-row
flag, chunked forward rows of plain norms). A candidate enters the new table only where it beats
the rules' plan by at least ``--min-gain`` (3%); the table's entry stays where it still does,
unless another candidate beats the entry by that much too (no churn between near-equal
overrides). Timing: the kernels of one direction alone,
M·N = ``--elements``, L2 flushed, the host covered, median of CUDA-event times (bench.py's).

    python3 -u bench/tune.py                     # the current table's rows (~2 min, H200)
    python3 -u bench/tune.py --rows quick --explore --out /tmp/sm90.py   # make bench's rows
    python3 bench/tune.py --smoke                # CPU: checks the script, writes nothing

The table is written with a header naming the GPU, versions, date and command; review its diff
(docs/tuning.md) before committing it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(1, str(BENCH))

import bench as B  # noqa: E402
from fused_norm import heuristics as H  # noqa: E402
from fused_norm import ops  # noqa: E402

# A table kind -> the bench workload that exercises it.
KIND_WORKLOAD = {
    "ln": "ln", "rms": "rms", "add_rms": "add_rms", "add": "add_rms", "add_ln": "add_rms",
    "drop_ln": "drop_add_ln", "drop": "drop_add_ln", "drop_rms": "drop_add_ln",
    "x1_ln": "parallel_ln", "x1": "parallel_ln", "x1drop": "x1drop_ln", "x1drop_ln": "x1drop_ln",
}  # fmt: skip
TAG_DTYPE = {
    "bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "bf16_res32": "bf16_res32",
    "bf16_w32": "bf16_w32", "16": "bf16", "16_res32": "bf16_res32", "16_w32": "bf16_w32",
    "32": "fp32", "e16": "bf16", "e32": "fp32", "any": "bf16",
}  # fmt: skip
B.WORKLOADS["x1drop_ln"] = B.Workload("x1drop_ln", "dropout(0.1) on x and x1 + add + two LNs",
                                      rms=False, residual=True, x1=True, dropout_p=0.1)  # fmt: skip
QUICK_N = (1024, 4096, 16384, 65536, 262144)


def width_of(w) -> int:
    return int(w[3:]) if isinstance(w, str) else int(w)


def plan_of(direction, kind, tag, width, n, dev):
    """The plan the package makes for this row now (what a call would launch)."""
    wl, dt = B.WORKLOADS[KIND_WORKLOAD[kind]], TAG_DTYPE[tag]
    ops.clear_plans()
    args, leaves = B.make_inputs(wl, dt, 2, n, dev)
    fwd = B.PROVIDERS["fused_norm"].build(B.PROVIDERS["fused_norm"].module, wl)
    outs = fwd(*args)
    from fused_norm import functional

    call = next(iter(functional._CALLS.values()))
    if direction == "fwd":
        return call.fplan
    torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])
    return next(iter(call._bwd.values())).plan


def time_direction(direction, kind, tag, n, elements, clock, iters) -> float:
    """Median seconds of one direction's kernels for the row, with the plans as they are."""
    wl, dt = B.WORKLOADS[KIND_WORKLOAD[kind]], TAG_DTYPE[tag]
    ops.clear_plans()
    m = max(1, elements // n)
    args, leaves = B.make_inputs(wl, dt, m, n, clock.device)
    grads = B.make_grads(wl, dt, m, n, clock.device)
    fwd = B.PROVIDERS["fused_norm"].build(B.PROVIDERS["fused_norm"].module, wl)
    if direction == "fwd":
        detached = [None if a is None else a.detach() for a in args]

        def step(_):
            return fwd(*detached)

        setup = None
    else:
        setup = lambda: fwd(*args)  # noqa: E731

        def step(outs):
            return torch.autograd.grad(outs, leaves, grads)

    clock.once(step, setup)  # compiles
    return clock.median(step, setup, iters)


def candidates(direction, kind, n, plan, entry, explore):
    """Override dicts to time against the rules' plan (no override) of a row of ``kind`` and
    ``n`` columns. Without ``explore``: the table's entry and the rule's warps halved and
    doubled. With it, every kind of override the tables hold, so that a GPU without a table
    can derive one: register caps (alone and with those warps), the full-row flag, whole waves
    (backward), and in the forward chunked sweeps of plain 16-bit norms, split parts, a filled
    workspace and the exchange words' prefetch toggled for split rows. The Gluon backward's rows
    get only their two: the Triton backward instead, and the prefetch toggled for sliced rows."""
    out = [entry] if entry else []
    if direction == "bwd" and plan.hopper:  # the Gluon kernel takes no warps nor register cap
        if explore:
            out.append({"gluon": False})
            if plan.constexprs["SPLIT"] > 1:  # sliced rows: their prefetch the other way round
                out.append({"ws_prefetch": not plan.constexprs["WS_PREFETCH"]})
        return _unique(out)
    w = plan.num_warps
    warps = [v for v in (w // 2, w * 2) if 1 <= v <= 32]
    out += [{"warps": v} for v in warps]
    if explore:
        for r in (64, 128):
            if plan.maxnreg != r:
                # A block's registers come from one SM's 64K: larger products cannot launch.
                out += [{"maxnreg": r, **({"warps": v} if v != w else {})}
                        for v in (w, *warps) if r * v * 32 <= 65536]  # fmt: skip
        if direction == "bwd":
            out.append({"whole_waves": True})
        else:
            c = plan.constexprs
            out.append({"full_row": not c["FULL_ROW"]})
            pad = H.next_power_of_2(n)
            if kind in ("ln", "rms") and plan.split == 1 and pad >= 4096:
                for chunk in (pad // 2, pad // 4):  # two sweeps over chunks, 256 columns a warp
                    cw = min(chunk // 256, 32)
                    out.append({"chunk": chunk, "warps": cw})
                    if kind == "ln":
                        out.append({"chunk": chunk, "unroll": True, "warps": cw})
            if n >= 16384:
                out += [{"part": p} for p in (2048, 4096, 8192) if p < n and p != c["BLOCK_N"]]
            if plan.split > 1 and plan.ws_reset:
                out.append({"ws_fill": True})
            if plan.split > 1:  # the exchange words' L2 prefetch, the other way round
                out.append({"ws_prefetch": not c["WS_PREFETCH"]})
    return _unique(out)


def _unique(cands) -> list:
    uniq = []
    for cand in cands:
        if cand and cand not in uniq:
            uniq.append(cand)
    return uniq


def pick(base: float, timed: list, entry, min_gain: float):
    """The override to keep from ``timed`` ((candidate, seconds) pairs) against the rules'
    ``base`` seconds: the fastest, if it beats ``base`` by ``min_gain``; but the table's
    ``entry``, where it beats ``base`` by that much too, unless the fastest also beats the
    entry by ``min_gain`` (near-equal overrides do not swap between runs). None: keep none."""
    if not timed:
        return None
    best, best_t = min(timed, key=lambda ct: ct[1])
    entry_t = next((t for c, t in timed if entry is not None and c == entry), None)
    keep = 1 - min_gain
    if entry_t is not None and entry_t <= base * keep and best_t > entry_t * keep:
        return entry
    return best if best_t <= base * keep else None


def quick_rows() -> list:
    """The rows of ``make bench``: five workloads, both directions, bf16, five widths."""
    return [(direction, kind, "bf16", n) for kind in ("ln", "rms", "add_rms", "drop_ln", "x1_ln")
            for direction in ("fwd", "bwd") for n in QUICK_N]  # fmt: skip


def known_rows() -> list:
    """Every row a committed table of any architecture names, then ``make bench``'s rows: where
    a GPU without a table looks first."""
    import pkgutil

    import fused_norm.tuned as tuned

    rows = []
    for _, name, _ in sorted(pkgutil.iter_modules(tuned.__path__)):
        rows += [k for k in H._table(name) if k not in rows]
    return rows + [k for k in quick_rows() if k not in rows]


def rows_to_tune(args, table):
    named = {"table": lambda: [tuple(k) for k in table], "quick": quick_rows, "known": known_rows}
    if args.rows in named:
        return named[args.rows]()
    rows = []
    for text in args.rows.split(","):
        direction, kind, tag, width = text.split(":")
        if direction not in ("fwd", "bwd") or kind not in KIND_WORKLOAD or tag not in TAG_DTYPE:
            raise SystemExit(
                f"--rows {text}: want DIRECTION:KIND:TAG:WIDTH, e.g. fwd:rms:bf16:4096"
            )
        rows.append((direction, kind, tag, width if width.startswith("pad") else int(width)))
    return rows


def _literal(table: dict) -> str:
    """The table as Python source in the repository's format (ruff's): one entry a line."""

    def lit(v):
        if isinstance(v, str):
            return f'"{v}"'
        if isinstance(v, tuple):
            return "(" + ", ".join(map(lit, v)) + ")"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{lit(k)}: {lit(x)}" for k, x in sorted(v.items())) + "}"
        return repr(v)

    rows = [f"    {lit(k)}: {lit(v)},\n" for k, v in sorted(table.items(), key=str)]
    return "{\n" + "".join(rows) + "}" if rows else "{}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="table",
                    help="table: this GPU's table's rows; quick: make bench's; known: every "
                    "committed table's rows and make bench's (a GPU without a table); or "
                    "rows as DIRECTION:KIND:TAG:WIDTH, comma-separated (fwd:rms:bf16:16384)")  # fmt: skip
    ap.add_argument("--explore", action="store_true")
    ap.add_argument("--elements", type=int, default=2**27)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--min-gain", type=float, default=0.03)
    ap.add_argument("--out", help="table file to write (default fused_norm/tuned/<arch>.py)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    import triton

    dev = torch.device("cpu" if args.smoke else "cuda")
    d = H.device(dev)
    arch = d.arch or "cpu"
    table = dict(H._table(d.arch))
    if args.smoke:
        table = {("fwd", "rms", "fp32", 256): {"warps": 2}}
        args.elements, args.iters = 2**10, 1
    B.PROVIDERS["fused_norm"].module = B.PROVIDERS["fused_norm"].load()
    clock = B.Clock(dev)
    new: dict = {}
    lines = []
    live = H._table(d.arch)  # the table the plans read (the module's, cached)
    original = dict(live) if not args.smoke else dict(table)
    t0 = time.perf_counter()
    try:
        for key in rows_to_tune(args, table):
            direction, kind, tag, width = key
            n = width_of(width)
            live.clear()
            live.update(original)
            entry = live.pop(key, None)  # the rules alone for this row
            rule_plan = plan_of(direction, kind, tag, width, n, dev)
            base = time_direction(direction, kind, tag, n, args.elements, clock, args.iters)
            timed = []
            for cand in candidates(direction, kind, n, rule_plan, entry, args.explore):
                live[key] = cand
                try:
                    if plan_of(direction, kind, tag, width, n, dev) == rule_plan:
                        continue  # the override changes nothing here
                    t = time_direction(direction, kind, tag, n, args.elements, clock, args.iters)
                except Exception as exc:  # a candidate that does not compile or fit
                    lines.append(f"{key} {cand}: {B.short_error(exc)}")
                    continue
                lines.append(f"{key} {cand}: {t * 1e6:.1f} us vs rules {base * 1e6:.1f} us")
                print(f"[{time.perf_counter() - t0:6.1f}s] {lines[-1]}", flush=True)
                timed.append((cand, t))
            best = pick(base, timed, entry, args.min_gain)
            if best is not None:
                new[key] = best
                t = next(v for c, v in timed if c == best)
                print(f"  keep {key}: {best} ({base / t - 1:+.1%})", flush=True)
    finally:
        live.clear()
        live.update(original if not args.smoke else {})
        ops.clear_plans()
    commands = []
    if args.rows != "table":  # untouched entries of rows not re-timed stay, with their commands
        for k, v in table.items():
            new.setdefault(k, v)
        source = BENCH.parent / "fused_norm" / "tuned" / f"{arch}.py"
        if source.exists():
            commands = [line for line in source.read_text().splitlines()
                        if line.startswith("# Command:")]  # fmt: skip
    env = (f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}, torch "
           f"{torch.__version__}, triton {triton.__version__}, "
           f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")  # fmt: skip
    text = (
        "# Generated by bench/tune.py -- do not edit by hand (docs/tuning.md).\n"
        f"# {env}\n"
        + "".join(f"{c}\n" for c in commands)
        + f"# Command: python3 {' '.join(sys.argv)}\n"
        f"# Kept: overrides that beat the rules by >= {args.min_gain:.0%} on their row.\n\n"
        f"TABLE = {_literal(new)}\n"
    )
    if args.smoke:
        print(text)
        return
    out = Path(args.out or BENCH.parent / "fused_norm" / "tuned" / f"{arch}.py")
    out.write_text(text)
    (out.with_suffix(".log")).write_text("\n".join(lines) + "\n")
    print(f"wrote {out} ({len(new)} entries) and {out.with_suffix('.log')}")


if __name__ == "__main__":
    main()

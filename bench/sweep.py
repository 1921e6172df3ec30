"""Launch-configuration sweep for fused_norm's own kernels (the measurements behind config.py).

For each row width N it times the forward and the backward of two workloads (add + RMSNorm
prenorm, dropout + add + LayerNorm prenorm) under several launch choices, and reports GB/s and
the ratio to a device-to-device copy measured in the same run. Each timed region is replayed
from a CUDA graph, so host overhead (Python, autograd) is out of these numbers: this tunes the
kernels; bench/bench.py measures what users see.

Usage: python bench/sweep.py [--out DIR] [--ns ...] [--fwd-warps 8,16] [--bwd-warps ...]
       [--bwd-warps-per-sm 16,32] [--bwd-max-bytes 16384,65536]
       [--bwd-tile-bytes 8192,16384] [--bwd-stages 1,3] [--bwd-rows 1,4] [--fwd-rows 1,8]
       [--dtype bf16|fp16|fp32|bf16_res32] [--workloads ln,...]
       [--fwd-split auto,off,16384,32768]  (forward split rows: off, or parts of that many bytes,
       splitting every row wider than one part) [--tail auto,on,off]  (widths that are not a
       power of two as two blocks where measured, wherever narrower, or never: TAIL_BLOCKS)
       [--fwd-hold auto,all,off]  (split forward rows held in 16 bits where measured, also
       the stream, or never: FWD_HOLD)
       [--bwd-exchange auto,on,off]  (rows wider than a backward block: column programs
       exchange their row sums, or take them from the pre-pass: BWD_EXCHANGE)
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's fused_norm
import bench as bench_counts  # noqa: E402  (bench/bench.py, beside this file: bytes_moved)
import fused_norm  # noqa: E402
from fused_norm import config, ops  # noqa: E402
from fused_norm.launch import Launcher  # noqa: E402

ELEMS = 128 * 2**20  # M * N per problem: 256 MB per bf16 tensor, several times the L2


def bench(fn):
    return do_bench_cudagraph(fn, rep=100, return_mode="median")


def copy_gbps(device):
    src = torch.empty(ELEMS * 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


WEIGHT_DTYPE = [torch.float32]  # --weight-dtype
RES_DTYPE = [None]  # --dtype bf16_res32: the residual stream's dtype (None: x's)


# run()'s workloads (the names bench/bench.py gives them, but the x1 path's "parallel").
WORKLOADS = ("add_rms", "ln", "rms", "parallel", "drop_add_ln")


def run(workload, n, dtype, device, mode):
    m = ELEMS // n
    rdt = RES_DTYPE[0] or dtype
    x = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
    res = torch.randn(m, n, device=device, dtype=rdt, requires_grad=True)
    w = torch.randn(n, device=device, dtype=WEIGHT_DTYPE[0], requires_grad=True)
    b = torch.randn(n, device=device, dtype=WEIGHT_DTYPE[0], requires_grad=True)
    if workload == "add_rms":

        def f():
            return fused_norm.rms_norm_fn(x, w, None, res, prenorm=True)
    elif workload == "ln":

        def f():
            return fused_norm.layer_norm_fn(x, w, b)
    elif workload == "rms":

        def f():
            return fused_norm.rms_norm_fn(x, w, None)
    elif workload == "parallel":
        x1 = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
        w1, b1 = torch.randn_like(w), torch.randn_like(b)

        def f():
            return fused_norm.layer_norm_fn(x, w, b, res, x1=x1, weight1=w1, bias1=b1,
                                            prenorm=True)  # fmt: skip
    else:

        def f():
            return fused_norm.layer_norm_fn(x, w, b, res, dropout_p=0.1, prenorm=True)

    if mode == "fwd":
        with torch.no_grad():
            ms = bench(f)
    elif workload == "parallel":
        dy, dy1 = (torch.randn(m, n, device=device, dtype=dtype) for _ in range(2))
        dr = torch.randn(m, n, device=device, dtype=rdt)
        _, _, s, mean, rstd, _, _ = ops.fused_norm_fwd(
            x, w, b, res, x1, w1, b1, None, None, None, 1e-6, 0.0, False, False, dtype, rdt,
            True)  # fmt: skip
        ms = bench(lambda: ops.fused_norm_bwd(
            dy, s, w, b, w1, b1, mean, rstd, dy1=dy1, dresidual_out=dr, x_dtype=dtype,
            residual_dtype=rdt, x1_dtype=dtype))  # fmt: skip
    elif workload in ("ln", "rms"):
        rms, bias = workload == "rms", (None if workload == "rms" else b)
        dy = torch.randn(m, n, device=device, dtype=dtype)
        _, _, _, mean, rstd, _, _ = ops.fused_norm_fwd(
            x, w, bias, None, None, None, None, None, None, None, 1e-6, 0.0, rms, False, dtype,
            None, False)  # fmt: skip
        ms = bench(lambda: ops.fused_norm_bwd(dy, x, w, bias, None, None, mean, rstd,
                                              is_rms_norm=rms, x_dtype=dtype))  # fmt: skip
    else:
        p = 0.0 if workload == "add_rms" else 0.1
        dy = torch.randn(m, n, device=device, dtype=dtype)
        dr = torch.randn(m, n, device=device, dtype=rdt)
        seeds = torch.randint(0, 2**31 - 1, (m,), device=device) if p else None
        _, _, s, mean, rstd, _, _ = ops.fused_norm_fwd(
            x, w, b if p else None, res, None, None, None, None, None, seeds, 1e-6, p,
            workload == "add_rms", False, dtype, rdt, True)  # fmt: skip
        ms = bench(lambda: ops.fused_norm_bwd(
            dy, s, w, b if p else None, None, None, mean, rstd, dresidual_out=dr, seeds=seeds,
            dropout_p=p, is_rms_norm=workload == "add_rms", x_dtype=dtype,
            residual_dtype=rdt))  # fmt: skip
    # bench.py's count per element; its dtype names by (x's dtype, the stream's)
    dt = next(k for k, v in bench_counts.DTYPES.items() if v[:2] == (dtype, rdt))
    wl = bench_counts.WORKLOADS["parallel_ln" if workload == "parallel" else workload]
    gbps = bench_counts.bytes_per_element(wl, dt, mode) * m * n / ms / 1e6
    return ms, gbps


RNG_VARIANTS = {
    "philox1": """    seed = tl.load(SEEDS + seed_row).to(tl.uint32)
    return tl.rand(seed, col0 + tl.arange(0, BLOCK_N)) > dropout_p
""",
    "philox4": """    seed = tl.load(SEEDS + seed_row).to(tl.uint32)
    quad = col0 // 4 + tl.arange(0, BLOCK_N // 4)
    r0, r1, r2, r3 = tl.randint4x(seed, quad)
    u = tl.join(
        tl.join(tl.random.uint_to_uniform_float(r0), tl.random.uint_to_uniform_float(r1)),
        tl.join(tl.random.uint_to_uniform_float(r2), tl.random.uint_to_uniform_float(r3)),
    )
    return tl.reshape(u, (BLOCK_N,)) > dropout_p
""",
    "none": """    return (tl.arange(0, BLOCK_N) % 10) != 0
""",
    "hash": """    seed = tl.load(SEEDS + seed_row).to(tl.uint32)
    h = (col0 + tl.arange(0, BLOCK_N)).to(tl.uint32) * 0x9E3779B1 + seed
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return tl.random.uint_to_uniform_float(h) > dropout_p
""",
}


def use_rng_variant(name, out_dir):
    """Swap the forward kernel for one whose _keep_mask body is RNG_VARIANTS[name]."""
    import importlib.util

    src = open(os.path.join(os.path.dirname(fused_norm.__file__), "kernels.py")).read()
    head, rest = src.split("def _keep_mask(", 1)
    sig, rest = rest.split('    """', 1)
    _doc, rest = rest.split('"""\n', 1)
    body_end = rest.index("\n\n\n")
    src = head + "def _keep_mask(" + sig + RNG_VARIANTS[name] + rest[body_end:]
    path = os.path.join(out_dir, f"kernels_{name}.py")
    with open(path, "w") as fh:
        fh.write(src)
    spec = importlib.util.spec_from_file_location(f"kernels_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ops._FWD = Launcher(mod._fused_norm_fwd_kernel)


def print_regs():
    """Registers, spills and shared memory of every compiled forward / backward kernel."""
    from fused_norm import kernels

    for kern in (kernels._fused_norm_fwd_kernel, kernels._fused_norm_bwd_kernel):
        for caches in getattr(kern, "device_caches", {}).values():
            for ck in caches[0].values():
                c = ck.result() if hasattr(ck, "result") else ck
                print(
                    f"{kern.fn.__name__}: regs={getattr(c, 'n_regs', '?')} "
                    f"spills={getattr(c, 'n_spills', '?')} shared={c.metadata.shared} "
                    f"warps={c.metadata.num_warps} maxnreg={c.metadata.maxnreg}"
                )


def plan_desc(mode: str, evict: str) -> str:
    """The launch choices of the variant just run, as ops planned and kept them: its plan
    caches (``ops._FWD_PLANS`` / ``_BWD_PLANS``) were emptied before the variant
    (config.settings_changed), so they hold its plans only. What ran, not a re-derivation of
    config's rules."""
    if mode == "fwd":
        plans = list(ops._FWD_PLANS.values())
        if len(plans) != 1:
            return f"fwd plans={len(plans)}"
        p = plans[0]
        c = p.constexprs
        block = 2 * c["BLOCK_N"] if c["TAIL_N"] else c["BLOCK_N"]  # a padded block as two
        return (f"warps={p.num_warps} rows={p.rows} split={block}x{p.split} "
                f"chunks={c['NUM_CHUNKS']} maxnreg={p.maxnreg} tail={c['TAIL_N']} "
                f"hold={c['HOLD'] > 0} evict={evict} unroll={c['UNROLL']} "
                f"ws_reset={p.ws_reset}")  # fmt: skip
    plans = list(ops._BWD_PLANS.values())
    if len(plans) != 1:
        return f"bwd plans={len(plans)}"
    block, chunks, tail, smem, warps = plans[0].layout
    flags, _, maxnreg, _, _ = plans[0].kplan
    if smem:
        return (f"smem warps={warps} block={block} tail={tail} stages={flags['STAGES']} "
                f"split={flags['SPLIT']}")  # fmt: skip
    return (f"warps={warps} rows={flags['TILE_ROWS']} wps={config.BWD_WARPS_PER_SM} "
            f"block={block}x{chunks} stages={flags['ROW_STAGES']} maxnreg={maxnreg} "
            f"tail={tail} exchange={flags['EXCHANGE']}")  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep-out")
    ap.add_argument("--ns", default="1024,4096,16384,65536,262144")
    ap.add_argument("--workloads", default="add_rms,drop_add_ln")
    ap.add_argument("--modes", default="fwd,bwd")
    ap.add_argument("--fwd-warps", default="auto")
    ap.add_argument("--fwd-rows", default="auto", help="rows per forward program (one block)")
    ap.add_argument("--fwd-split", default="auto", help="auto, off, or bytes per split part")
    ap.add_argument(
        "--fwd-block-bytes", default="auto", help="forward block cap (config.MAX_BLOCK_BYTES)"
    )
    ap.add_argument(
        "--fwd-evict",
        default="auto",
        help="auto, none (comma-separated): config.FWD_CHUNK_EVICT as set, or no hints",
    )
    ap.add_argument(
        "--fwd-lane-chunk",
        default="auto",
        help="auto, off, or columns per chunk (comma-separated): norms of x alone (ln, rms) as "
        "lane-summed chunks of that size (config.FWD_LANE_CHUNKS; warps: --fwd-warps, else 16)",
    )
    ap.add_argument(
        "--fwd-unroll",
        default="auto",
        help="auto, on, off (comma-separated): lane-summed chunks given by --fwd-lane-chunk "
        "unrolled or not (auto: on)",
    )
    ap.add_argument("--weight-dtype", default="fp32", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--bwd-warps", default="auto")
    ap.add_argument("--bwd-warps-per-sm", default=str(config.BWD_WARPS_PER_SM))
    ap.add_argument("--bwd-max-bytes", default="auto")
    ap.add_argument("--bwd-stages", default="auto")
    ap.add_argument("--bwd-rows", default="auto", help="rows per backward tile (narrow rows)")
    ap.add_argument("--bwd-tile-bytes", default="auto",
                    help="column blocks of rows wider than a block (BWD_TILE_BYTES, and "
                    "BWD_EXCHANGE_TILE_BYTES where they exchange row sums)")  # fmt: skip
    ap.add_argument("--regs", action="store_true", help="print compiled kernels' registers")
    ap.add_argument("--bwd-maxnreg", default="auto", help="register caps of the backward")
    ap.add_argument("--fwd-maxnreg", default="auto", help="register caps of the forward")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32", "bf16_res32"),
                    help="dtype of every row tensor (bf16_res32: bf16, the residual stream "
                    "fp32; weights: --weight-dtype)")  # fmt: skip
    ap.add_argument(
        "--tail",
        default="auto",
        help="auto, on, off (comma-separated): config.TAIL_BLOCKS measured/True/False",
    )
    ap.add_argument(
        "--fwd-hold",
        default="auto",
        help="auto, all, off (comma-separated): config.FWD_HOLD measured/True/False",
    )
    ap.add_argument(
        "--bwd-exchange", default="auto",
        help="auto, on, off (comma-separated): config.BWD_EXCHANGE as set, on or off",
    )  # fmt: skip
    ap.add_argument("--rng", default="", help="forward RNG variant: " + ",".join(RNG_VARIANTS))
    args = ap.parse_args()
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:  # run() would time dropout + add + LayerNorm under that name
        ap.error(f"--workloads: unknown {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    os.makedirs(args.out, exist_ok=True)
    if args.rng:
        use_rng_variant(args.rng, args.out)
    device = torch.device("cuda")
    WEIGHT_DTYPE[0] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.weight_dtype
    ]
    res32 = args.dtype == "bf16_res32"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
             "bf16_res32": torch.bfloat16}[args.dtype]  # fmt: skip
    RES_DTYPE[0] = torch.float32 if res32 else None
    props = torch.cuda.get_device_properties(device)
    ceiling = copy_gbps(device)
    env = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
           "copy_gbps": ceiling}  # fmt: skip
    print(json.dumps(env))

    def ints(v):
        return [None if t == "auto" else int(t) for t in v.split(",")]

    orig = (config.fwd_num_warps, config.bwd_num_warps, config.bwd_row_stages,
            config.BWD_WARPS_PER_SM, config.BWD_MAX_BLOCK_BYTES, config.BWD_MAX_BLOCK_BYTES_MULTI,
            config.BWD_TILE_BYTES, config.FWD_ROWS_PER_PROGRAM, config.FWD_ROWS_MAX_N,
            config.FWD_ROWS_MAX_N_PLAIN, config.FWD_SPLIT_MIN_BYTES,
            config.FWD_SPLIT_BLOCK_BYTES, config.fwd_split_warps, config.fwd_maxnreg,
            config.bwd_maxnreg, config.bwd_tile_rows, config.MAX_BLOCK_BYTES)  # fmt: skip
    splits = [{"auto": None, "off": -1}[t] if t in ("auto", "off") else int(t)
              for t in args.fwd_split.split(",")]  # fmt: skip
    rows = []
    evict = config.FWD_CHUNK_EVICT
    lane_chunks = dict(config.FWD_LANE_CHUNKS)
    exchange = config.BWD_EXCHANGE
    block_choice = config.fwd_block_choice
    dropout_64k_bytes = config.FWD_SPLIT_DROPOUT_64K_BYTES
    exchange_layout = config.BWD_EXCHANGE_TILE_BYTES, config.BWD_EXCHANGE_WARPS
    for n, workload, mode, tail, hold, ev, lchunk, unroll, exch in itertools.product(
        ints(args.ns),
        args.workloads.split(","),
        args.modes.split(","),
        args.tail.split(","),
        args.fwd_hold.split(","),
        args.fwd_evict.split(","),
        [{"auto": None, "off": -1}.get(t, t) for t in args.fwd_lane_chunk.split(",")],
        args.fwd_unroll.split(","),
        args.bwd_exchange.split(",") if "bwd" in args.modes else ["auto"],
    ):
        if mode == "fwd":
            variants = [
                (fw, None, None, fb, fr, sp, mr, None)
                for fw, fr, sp, mr, fb in itertools.product(
                    ints(args.fwd_warps),
                    ints(args.fwd_rows),
                    splits,
                    ints(args.fwd_maxnreg),
                    ints(args.fwd_block_bytes),
                )
            ]
        else:
            variants = list(itertools.product([None], ints(args.bwd_warps),
                                              ints(args.bwd_warps_per_sm),
                                              ints(args.bwd_max_bytes),
                                              ints(args.bwd_tile_bytes),
                                              ints(args.bwd_stages),
                                              ints(args.bwd_maxnreg),
                                              ints(args.bwd_rows)))  # fmt: skip
        for fw, bw, wps, maxb, gb, st, mr, br in variants:
            config.TAIL_BLOCKS = {"auto": "measured", "on": True, "off": False}[tail]
            config.FWD_HOLD = {"auto": "measured", "all": True, "off": False}[hold]
            config.FWD_CHUNK_EVICT = evict if ev == "auto" else ("", "")
            config.BWD_EXCHANGE = {"auto": exchange, "on": True, "off": False}[exch]
            # An explicit chunk size is keyed by the width itself, which wins over two blocks
            # and over the padded width's entry (config.fwd_block_layout); "off" drops both.
            lchunk = int(lchunk) if lchunk is not None else None
            if lchunk:  # the entries for 4-byte weights too (looked up first)
                for width in (n, config.next_power_of_2(n)):
                    config.FWD_LANE_CHUNKS.pop((workload, width, 4), None)
            if lchunk == -1:
                config.FWD_LANE_CHUNKS.pop((workload, n), None)
                config.FWD_LANE_CHUNKS.pop((workload, config.next_power_of_2(n)), None)
            elif lchunk and workload in ("ln", "rms"):
                config.FWD_LANE_CHUNKS[(workload, n)] = (lchunk, fw or 16, unroll != "off")
            config.settings_changed()  # the edits in place above: ops' plans must go
            if fw:  # explicit warps replace the one-block rows' own choices (cap too)
                config.fwd_block_choice = lambda *a: None
                config.fwd_num_warps = lambda *a, _w=fw: _w
                config.fwd_split_warps = lambda *a, _w=fw: _w
            elif mr and mode == "fwd":  # an explicit cap keeps their own warps

                def capped(*a, _r=mr):
                    own = block_choice(*a)
                    return own and (own[0], _r)

                config.fwd_block_choice = capped
            if mr and mode == "fwd":
                config.fwd_maxnreg = lambda *a, _r=mr: _r
            elif mr:
                config.bwd_maxnreg = lambda *a, _r=mr: _r
            if bw:
                config.bwd_num_warps = lambda *a, _w=bw: _w
                config.BWD_EXCHANGE_WARPS = bw
            if br:  # an explicit tile applies to every one-block width, with or without dropout
                config.bwd_tile_rows = lambda bn, nc, tail=0, drop=True, _r=br: (
                    _r if nc == 1 and not tail else 1
                )
            if wps:
                config.BWD_WARPS_PER_SM = wps
            if maxb and mode == "fwd":
                config.MAX_BLOCK_BYTES = maxb
            elif maxb:
                config.BWD_MAX_BLOCK_BYTES = config.BWD_MAX_BLOCK_BYTES_MULTI = maxb
            if mode == "fwd":
                if gb:  # an explicit row count applies to every row width in one block
                    config.FWD_ROWS_PER_PROGRAM = gb
                    config.FWD_ROWS_MAX_N = config.FWD_ROWS_MAX_N_PLAIN = 1 << 30
            elif gb:
                config.BWD_TILE_BYTES = config.BWD_EXCHANGE_TILE_BYTES = gb
            if mode == "fwd" and st:
                config.FWD_SPLIT_MIN_BYTES = 1 << 40 if st == -1 else st
                if st != -1:  # parts of st bytes, the 64 KB rows with dropout too
                    config.FWD_SPLIT_BLOCK_BYTES = config.FWD_SPLIT_DROPOUT_64K_BYTES = st
            elif st:
                config.bwd_row_stages = lambda *a, _s=st: _s
            try:
                ms, gbps = run(workload, n, dtype, device, mode)
                err = ""
            except Exception as e:  # noqa: BLE001 - record and go on
                ms, gbps, err = float("nan"), float("nan"), repr(e)[:200]
            finally:
                desc = plan_desc(mode, ev)
                (config.fwd_num_warps, config.bwd_num_warps, config.bwd_row_stages,
                 config.BWD_WARPS_PER_SM, config.BWD_MAX_BLOCK_BYTES,
                 config.BWD_MAX_BLOCK_BYTES_MULTI, config.BWD_TILE_BYTES,
                 config.FWD_ROWS_PER_PROGRAM, config.FWD_ROWS_MAX_N,
                 config.FWD_ROWS_MAX_N_PLAIN, config.FWD_SPLIT_MIN_BYTES,
                 config.FWD_SPLIT_BLOCK_BYTES, config.fwd_split_warps,
                 config.fwd_maxnreg, config.bwd_maxnreg, config.bwd_tile_rows,
                 config.MAX_BLOCK_BYTES) = orig  # fmt: skip
                config.TAIL_BLOCKS = "measured"
                config.FWD_HOLD = "measured"
                config.BWD_EXCHANGE = exchange
                config.BWD_EXCHANGE_TILE_BYTES, config.BWD_EXCHANGE_WARPS = exchange_layout
                config.FWD_CHUNK_EVICT = evict
                config.fwd_block_choice = block_choice
                config.FWD_SPLIT_DROPOUT_64K_BYTES = dropout_64k_bytes
                config.FWD_LANE_CHUNKS.clear()
                config.FWD_LANE_CHUNKS.update(lane_chunks)
                # ops' plans and resident grids of a variant (stages, caps) are its own
                config.settings_changed()
            rows.append({"N": n, "workload": workload, "mode": mode, "config": desc, "ms": ms,
                         "GBps": gbps, "pct_copy": 100 * gbps / ceiling, "error": err})  # fmt: skip
            print(f"{n:>7} {workload:>12} {mode:>4} {desc:<34} {ms:8.3f} ms {gbps:7.0f} GB/s "
                  f"{100 * gbps / ceiling:5.1f}% {err}", flush=True)  # fmt: skip
            torch.cuda.empty_cache()
    if args.regs:
        print_regs()
    with open(os.path.join(args.out, "sweep.csv"), "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    with open(os.path.join(args.out, "env.json"), "w") as fh:
        json.dump(env, fh)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Training throughput of a Hugging Face ``LlamaForCausalLM``: transformers as is, Liger-Kernel's
RMSNorm, ``fused_norm.replace_norms`` and ``replace_norms(fuse_residual=True)``, side by side.

    python3 -u bench/bench_hf.py --out bench/results/hf       # one GPU, about 5 min on an H200
    python3 bench/bench_hf.py --smoke --out /tmp/bench-hf     # CPU, tiny model, 2 steps

Model: random-initialised, bf16 weights and AdamW states, sdpa attention, vocabulary 32000;
``--configs`` takes ``HIDDENxLAYERSxTOKENS`` (default ``2048x4x8192,4096x2x4096``: the two shapes
of issue 66; sequence 1024, batch = tokens / 1024; intermediate size about 2.7 x hidden, 128 per
head). A step is forward with labels (transformers' loss), backward, AdamW, zero_grad.

Variants: ``transformers``; ``liger`` (Liger-Kernel's RMSNorm patched on the instance with
``apply_liger_kernel_to_llama(rms_norm=True, everything else False, model=...)``, skipped with a
note when liger_kernel is not importable); ``fused_norm``; ``fused_norm+res``. Each in ``eager``
and ``compile`` (torch.compile of each decoder layer, default mode, as torchtitan compiles
blocks; embedding, final norm, head and loss stay eager). Every cell is its own model instance.

Timing: each cell first runs ``--warmup`` steps (compilation, autotuning, allocator). Then
``--rounds`` rounds, each timing ``--steps`` steps of every cell in turn (the order rotated
each round), so that drift (clocks, temperature) hits all cells alike; a cell's figure is the
median of its rounds' tokens/s, its ratio to a peer the median of the per-round ratios. The
peak memory is the largest allocation above what the cell's model and optimizer hold, i.e. the
step's activations and temporaries.

Writes ``hf.csv`` (one row per cell) and ``hf.md`` (the table, with the GPU, versions and date,
and each cell's ratio to transformers and to Liger in the same mode) under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmark this checkout, not an installed fused_norm

VARIANTS = ("transformers", "liger", "fused_norm", "fused_norm+res")
MODES = ("eager", "compile")
SEQ = 1024


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configs", default="2048x4x8192,4096x2x4096",
                   help="comma-separated HIDDENxLAYERSxTOKENS")  # fmt: skip
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per cell")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=8, help="timed steps per cell and round")
    p.add_argument("--out", default="bench/results/hf")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of the script: tiny model, 2 steps, compile with aot_eager")  # fmt: skip
    args = p.parse_args(argv)
    if args.smoke:
        args.configs, args.vocab = "64x2x256", 128
        args.warmup, args.rounds, args.steps = 1, 1, 2
    return args


def parse_config(text: str) -> dict:
    hidden, layers, tokens = (int(v) for v in text.lower().split("x"))
    seq = min(SEQ, tokens)
    if tokens % seq:
        raise SystemExit(f"--configs {text}: tokens must be a multiple of {seq}")
    heads = max(1, hidden // 128)
    # Llama's MLP width: 2/3 of 4 x hidden, rounded up to a multiple of 256 (5632 for 2048).
    inter = -(-int(8 * hidden / 3) // 256) * 256
    return dict(name=text, hidden=hidden, layers=layers, tokens=tokens, seq=seq,
                batch=tokens // seq, heads=heads, intermediate=inter)  # fmt: skip


def build(cfg: dict, vocab: int, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["heads"], vocab_size=vocab, max_position_embeddings=cfg["seq"],
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).train()


def allow_layer_recompiles(limit: int = 256) -> None:
    """Each decoder layer compiles once (dynamo specialises on its integer ``layer_idx``), and
    every cell's layers share one code object's cache: dynamo's default limit of 8 entries
    would silently leave later cells eager. Identical graphs hit Inductor's FX graph cache."""
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))


def apply_liger(model) -> None:
    """Liger-Kernel's RMSNorm on this instance only (its apply function also rebinds
    ``modeling_llama.LlamaRMSNorm`` for models built later: undone here)."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaRMSNorm
    try:
        apply_liger_kernel_to_llama(rope=False, cross_entropy=False,
                                    fused_linear_cross_entropy=False, rms_norm=True,
                                    swiglu=False, model=model)  # fmt: skip
    finally:
        modeling_llama.LlamaRMSNorm = original


def liger_version():
    try:
        import liger_kernel  # noqa: F401
    except Exception as e:  # ImportError, or a Triton/GPU check failing inside its import
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:120]
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("liger-kernel"), None
    except PackageNotFoundError:
        return "unknown", None


class Cell:
    """One (variant, mode): its own model, optimizer and fixed batch."""

    def __init__(self, variant, mode, cfg, args, device, dtype, compile_backend):
        from fused_norm.hf import replace_norms

        self.variant, self.mode, self.device = variant, mode, device
        self.model = build(cfg, args.vocab, device, dtype)
        if variant == "liger":
            apply_liger(self.model)
        elif variant.startswith("fused_norm"):
            replace_norms(self.model, fuse_residual=variant.endswith("+res"))
        if mode == "compile":
            for layer in self.model.model.layers:
                layer.compile(backend=compile_backend)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(3, args.vocab, (cfg["batch"], cfg["seq"]), generator=g).to(device)
        self.tokens_per_step = cfg["batch"] * cfg["seq"]
        self.rates, self.peak_extra = [], 0

    def step(self):
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def run(self, steps: int, timed: bool):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            resident = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        if cuda:
            torch.cuda.synchronize(self.device)
            extra = torch.cuda.max_memory_allocated(self.device) - resident
            self.peak_extra = max(self.peak_extra, extra)
        if timed:
            self.rates.append(steps * self.tokens_per_step / (time.perf_counter() - t0))

    def free(self):
        del self.model, self.opt


def bench_config(cfg, args, device, dtype, variants, modes, compile_backend) -> list:
    cells, rows = [], []

    def row(variant, mode, **values):
        r = dict(config=cfg["name"], hidden=cfg["hidden"], layers=cfg["layers"],
                 tokens_per_step=cfg["tokens"], variant=variant, mode=mode, tokens_per_s=None,
                 rounds="", step_peak_gib=None, note="")  # fmt: skip
        r.update(values)
        return r

    for variant in variants:
        for mode in modes:
            t0 = time.perf_counter()
            try:
                cell = Cell(variant, mode, cfg, args, device, dtype, compile_backend)
                cell.run(args.warmup, timed=False)
            except Exception as e:  # a peer that fails to compile costs its cell, not the run
                # One line: dynamo's messages start with "from user code:" and the frames.
                note = f"failed: {type(e).__name__}: {' '.join(str(e).split())[:160]}".replace(
                    "|", "/"
                )
                print(f"  {cfg['name']} {variant:15s} {mode:8s} {note}", flush=True)
                rows.append(row(variant, mode, note=note))
                continue
            print(f"  {cfg['name']} {variant:15s} {mode:8s} ready in "
                  f"{time.perf_counter() - t0:5.1f} s", flush=True)  # fmt: skip
            cells.append(cell)
    for r in range(args.rounds):
        k = r % len(cells)
        for cell in cells[k:] + cells[:k]:
            cell.run(args.steps, timed=True)
    for cell in cells:
        rows.append(row(
            cell.variant, cell.mode, tokens_per_s=statistics.median(cell.rates),
            rounds=" ".join(f"{v:.0f}" for v in cell.rates), _rates=cell.rates,
            step_peak_gib=cell.peak_extra / 2**30,
        ))  # fmt: skip
        cell.free()
    cells.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def add_ratios(rows):
    """Each cell against transformers and Liger in the same mode: the median over rounds of the
    ratio of the two cells' rates in that round (both ran within seconds of each other, so drift
    cancels), and in how many rounds the cell was the faster."""
    by = {(r["config"], r["variant"], r["mode"]): r for r in rows}
    order = {(v, m): i for i, (v, m) in enumerate((v, m) for v in VARIANTS for m in MODES)}
    rows.sort(key=lambda r: (r["config"], order[(r["variant"], r["mode"])]))
    for r in rows:
        for peer in ("transformers", "liger"):
            base = by.get((r["config"], peer, r["mode"])) if peer != r["variant"] else None
            ratios = [a / b for a, b in zip(r.get("_rates", []), (base or {}).get("_rates", []))]
            r[f"vs_{peer}"] = statistics.median(ratios) if ratios else None
            r[f"wins_vs_{peer}"] = f"{sum(x > 1 for x in ratios)}/{len(ratios)}" if ratios else ""
    for r in rows:
        r.pop("_rates", None)


def environment(device, dtype, liger, liger_note, args) -> dict:
    import transformers
    import triton

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "liger_kernel": liger or f"not available ({liger_note})",
        "dtype": str(dtype).replace("torch.", ""),
        "python": platform.python_version(),
        "command": " ".join(["python3"] + sys.argv),
    }


def markdown(rows, env, args) -> str:
    def ratio(v, wins):
        return f"{v:.3f}x ({wins})" if v else "-"

    lines = [
        "### Hugging Face Llama training throughput: transformers, Liger-Kernel, fused_norm",
        "",
        f"{env['gpu']} · torch {env['torch']} · triton {env['triton']} · transformers "
        f"{env['transformers']} · Liger-Kernel {env['liger_kernel']} · {env['date']}",
        "",
        f"tokens/s, median of {args.rounds} interleaved rounds of {args.steps} steps after "
        f"{args.warmup} warm-up steps; {env['dtype']} weights, AdamW, vocabulary {args.vocab}, "
        f"sequence {SEQ} (or the tokens per step, if fewer). compile = torch.compile of each "
        "decoder layer. vs X: the median over rounds of the cell's rate / X's in the same round "
        "(in brackets: the rounds in which the cell was the faster). Step peak = memory "
        "allocated above the model and optimizer state.",
        "",
        "| config | variant | mode | tokens/s | vs transformers | vs Liger | step peak GiB |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["tokens_per_s"] is None:
            lines.append(f"| {r['config']} | {r['variant']} | {r['mode']} | {r['note']} | | | |")
            continue
        lines.append(
            f"| {r['config']} | {r['variant']} | {r['mode']} | {r['tokens_per_s']:,.0f} | "
            f"{ratio(r['vs_transformers'], r['wins_vs_transformers'])} | "
            f"{ratio(r['vs_liger'], r['wins_vs_liger'])} | "
            f"{r['step_peak_gib']:.2f} |"
        )
    lines += ["", f"Command: `{env['command']}`", ""]
    return "\n".join(lines)


def main(argv=None) -> list:
    args = parse_args(argv)
    if args.smoke:
        device, dtype, compile_backend = torch.device("cpu"), torch.float32, "aot_eager"
        os.environ.setdefault("FUSED_NORM_BACKEND", "torch")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_hf.py needs a GPU (or --smoke on CPU)")
        device, dtype, compile_backend = torch.device("cuda"), torch.bfloat16, "inductor"
        torch.backends.cuda.matmul.allow_tf32 = True
    allow_layer_recompiles()
    variants = [v for v in args.variants.split(",") if v]
    modes = [m for m in args.modes.split(",") if m]
    bad = (set(variants) - set(VARIANTS)) | (set(modes) - set(MODES))
    if bad:
        raise SystemExit(f"unknown variants/modes {sorted(bad)}; choose from {VARIANTS}, {MODES}")
    liger, liger_note = liger_version()
    if "liger" in variants and (liger is None or device.type != "cuda"):
        note = liger_note or "its kernels need a GPU"
        print(f"Liger-Kernel skipped: {note}")
        variants.remove("liger")
        liger_note = liger_note or note
    env = environment(device, dtype, liger if device.type == "cuda" else None, liger_note, args)
    print(" · ".join(f"{k} {v}" for k, v in env.items() if k != "command"), flush=True)

    t0 = time.perf_counter()
    rows = []
    for text in args.configs.split(","):
        cfg = parse_config(text)
        rows += bench_config(cfg, args, device, dtype, variants, modes, compile_backend)
    add_ratios(rows)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "hf.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = markdown(rows, env, args)
    (out / "hf.md").write_text(text)
    print(text)
    print(f"wrote {out / 'hf.csv'} and {out / 'hf.md'} in {time.perf_counter() - t0:.0f} s")
    return rows


if __name__ == "__main__":
    main()

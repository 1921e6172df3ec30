"""Train a random Hugging Face ``LlamaForCausalLM`` with and without ``fused_norm.replace_norms``.

    python examples/hf_llama.py --preset tiny --steps 20               # CPU, well under a minute
    python examples/hf_llama.py --preset 1b --steps 300 --out runs/hf_llama.json     # one GPU

The same model (same seed, so the same initial weights) is trained once per variant on the same
batches in the same order: ``transformers`` as is, ``fused`` (every RMSNorm through fused_norm),
and ``fused_residual`` (also the attention branch's residual add fused into the next norm). It
prints, per variant, tokens/s over the steps after the first few (compilation and allocator
warm-up excluded), the peak memory, and how far its loss curve strays from the unpatched one
(max |loss difference| over the steps, and the final losses). The variants compute the same
function with different rounding, so in fp32 the curves agree to rounding level and in bf16 to
bf16's noise (which training amplifies a little over the steps).

Data: the byte-level corpus of the GPT example (examples/train_gpt.py: the Python standard
library's sources; ``--data FILE`` for another), vocabulary 256, the batch of step ``s`` a pure
function of ``(seed, s)``.

Presets: ``tiny`` (hidden 128, 2 layers; fp32) for a CPU; ``1b`` (hidden 2048, intermediate
5632, 16 heads, 4 layers: the width of a ~1B Llama with few layers; bf16 weights and AdamW
states) for one GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import load_corpus, mix_seed  # noqa: E402  (the GPT example's corpus)

# fmt: off
PRESETS = {
    "tiny": dict(model=dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2),
                 batch=8, seq=128, lr=2e-3, dtype="fp32", warmup=3),
    "1b": dict(model=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                          num_attention_heads=16, num_key_value_heads=16),
               batch=8, seq=1024, lr=3e-4, dtype="bf16", warmup=10),
}
# fmt: on
VARIANTS = ("transformers", "fused", "fused_residual")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="default: 1b on a GPU, tiny on CPU")  # fmt: skip
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {VARIANTS}")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: preset's")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="train on this file's bytes instead")
    p.add_argument("--out", default=None, help="write a JSON summary (with the loss curves)")
    return p.parse_args(argv)


def build_model(preset: dict, dtype, device, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, max_position_embeddings=preset["seq"], rms_norm_eps=1e-5,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        **preset["model"],
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def batch_at(data: torch.Tensor, step: int, seed: int, batch: int, seq: int, device):
    """Inputs and labels of step ``step``: ``batch`` random windows of ``seq`` bytes."""
    g = torch.Generator().manual_seed(mix_seed(seed, "hf_llama", step))
    ix = torch.randint(len(data) - seq, (batch,), generator=g)
    ids = torch.stack([data[i : i + seq] for i in ix.tolist()]).long()
    return ids.to(device, non_blocking=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(variant: str, base, data, args, preset, device) -> dict:
    """Train a copy of ``base`` as ``variant``; returns its losses, speed and memory."""
    from fused_norm.hf import replace_norms

    model = copy.deepcopy(base)
    replaced = []
    if variant != "transformers":
        replaced = replace_norms(model, fuse_residual=variant == "fused_residual")
    if args.compile:
        # Dynamo specialises each layer on its integer layer_idx, and all variants' layers share
        # one code object's cache: raise its limit of 8 entries, past which it runs eager.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
        for layer in model.model.layers:
            layer.compile()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=preset["lr"], betas=(0.9, 0.95),
                            weight_decay=0.1)  # fmt: skip
    warmup = min(preset["warmup"], max(args.steps - 1, 0))
    losses = []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = None
    for step in range(args.steps):
        if step == warmup:
            sync(device)
            t0 = time.perf_counter()
        ids = batch_at(data, step, args.seed, preset["batch"], preset["seq"], device)
        # A short linear warm-up of the learning rate keeps the random model's first steps calm.
        for group in opt.param_groups:
            group["lr"] = preset["lr"] * min(1.0, (step + 1) / 20)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # kept on the device: no host sync per step
    sync(device)
    seconds = time.perf_counter() - t0 if t0 is not None else float("nan")
    timed = args.steps - warmup
    tokens = timed * preset["batch"] * preset["seq"]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    losses = torch.stack(losses).float().cpu().tolist()
    del model, opt
    return {
        "variant": variant,
        "replaced": len(replaced),
        "tokens_per_s": tokens / seconds if timed > 0 else None,
        "timed_steps": timed,
        "peak_gib": peak,
        "final_loss": losses[-1],
        "losses": losses,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    preset_name = args.preset or ("1b" if device.type == "cuda" else "tiny")
    preset = PRESETS[preset_name]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or preset["dtype"]]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown or not variants:
        raise SystemExit(f"--variants: choose from {VARIANTS}, got {args.variants!r}")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # what a user training in bf16 runs

    data, _ = load_corpus(args.data)
    base = build_model(preset, dtype, device, args.seed)
    n_params = sum(p.numel() for p in base.parameters())
    tokens_per_step = preset["batch"] * preset["seq"]
    print(f"{preset_name}: LlamaForCausalLM {n_params / 1e6:.1f}M parameters, {dtype}, "
          f"{device}, {tokens_per_step} tokens/step, {args.steps} steps"
          f"{', compiled layers' if args.compile else ''}")  # fmt: skip

    results = []
    for variant in variants:
        r = train(variant, base, data, args, preset, device)
        results.append(r)
        rate = f"{r['tokens_per_s']:,.0f} tok/s" if r["tokens_per_s"] else "n/a"
        peak = f", peak {r['peak_gib']:.2f} GiB" if r["peak_gib"] is not None else ""
        print(f"  {variant:15s} {rate}{peak}, final loss {r['final_loss']:.4f}"
              f" ({r['replaced']} modules replaced)")  # fmt: skip

    ref = next((r for r in results if r["variant"] == "transformers"), None)
    if ref is not None:
        for r in results:
            if r is ref:
                continue
            diffs = [abs(a - b) for a, b in zip(r["losses"], ref["losses"])]
            worst = max(range(len(diffs)), key=diffs.__getitem__)
            r["max_abs_loss_diff"], r["max_diff_step"] = diffs[worst], worst
            speed = (r["tokens_per_s"] / ref["tokens_per_s"]) if ref["tokens_per_s"] else None
            r["speed_vs_transformers"] = speed
            print(f"  {r['variant']} vs transformers: max |Δloss| {diffs[worst]:.3g} at step "
                  f"{worst}, final {r['final_loss']:.4f} vs {ref['final_loss']:.4f}"
                  + (f", speed {speed:.3f}x" if speed else ""))  # fmt: skip

    summary = {
        "preset": preset_name,
        "model": preset["model"],
        "parameters": n_params,
        "dtype": str(dtype).replace("torch.", ""),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tokens_per_step": tokens_per_step,
        "steps": args.steps,
        "compile": args.compile,
        "seed": args.seed,
        "versions": _versions(),
        "results": results,
    }
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=1))
        print(f"wrote {out}")
    return summary


def _versions() -> dict:
    import transformers
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}  # fmt: skip


if __name__ == "__main__":
    main()

"""Train a small byte-level GPT whose pre-norm blocks use ``fused_norm.DropoutAddRMSNorm``.

    python examples/train_gpt.py --preset tiny --steps 200 --out runs/demo
    python examples/train_gpt.py --preset small --norm torch --compile      # the unfused baseline
    torchrun --nproc_per_node=2 examples/train_gpt.py --preset small        # DDP (NCCL or gloo)

Data: by default the Python standard library's own source files (found through ``sysconfig``),
so there is always a few MB of real text and nothing to download; ``--data FILE`` trains on any
file. The vocabulary is the 256 byte values; the last 10% of the bytes is the validation split.

Reproducibility is by construction rather than by saved state: the batch and the dropout seed of
step ``s`` on rank ``r`` are functions of ``(seed, s, r)`` only. That is what makes ``--resume``
replay exactly the trajectory of an uninterrupted run, on any number of processes.

Outputs in ``--out``: ``summary.json``, ``loss.png``, ``sample.txt`` and the checkpoint ``ckpt.pt``
(written atomically every ``--ckpt-every`` steps, at the end, and on Ctrl-C / SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import signal
import sys
import sysconfig
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt_model import GPT, GPTConfig  # noqa: E402

# Model shape and training defaults per preset. tiny is sized for a 2-core CPU (about 0.2 s a
# step); small is nanoGPT's character-level Shakespeare model; medium is GPT-2 small's shape.
PRESETS = {
    "tiny": dict(
        model=dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
        batch_size=16, lr=2e-3, steps=200, eval_every=50, eval_iters=8, ckpt_every=100,
    ),
    "small": dict(
        model=dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
        batch_size=64, lr=1e-3, steps=2000, eval_every=250, eval_iters=20, ckpt_every=500,
    ),
    "medium": dict(
        model=dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
        batch_size=16, lr=6e-4, steps=5000, eval_every=500, eval_iters=20, ckpt_every=1000,
    ),
}
VAL_FRACTION = 0.1
CKPT_NAME = "ckpt.pt"


@dataclass
class RunConfig:
    """Everything that determines the loss trajectory; stored in the checkpoint."""

    preset: str
    model: GPTConfig
    steps: int
    batch_size: int  # global: split evenly across processes
    lr: float
    eval_every: int
    eval_iters: int
    ckpt_every: int
    seed: int
    data: str | None
    precision: str  # "fp32" | "bf16"
    lr_warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: preset's)")
    p.add_argument("--norm", choices=["fused", "torch"], default="fused",
                   help="fused: fused_norm.DropoutAddRMSNorm; torch: nn.Dropout + add + nn.RMSNorm")
    p.add_argument("--dropout", type=float, default=0.0, help="residual-branch dropout probability")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (regional compilation)")
    p.add_argument("--out", default="runs/gpt", help="output directory")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/ckpt.pt with its stored configuration; only --steps, "
                        "--device, --compile and the output options may change")
    p.add_argument("--data", default=None, help="train on this file instead of the stdlib sources")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: preset's)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: preset's)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: bf16 autocast on CUDA, fp32 on CPU")
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--eval-iters", type=int, default=None)
    p.add_argument("--ckpt-every", type=int, default=None)
    p.add_argument("--log-every", type=int, default=10,
                   help="steps between host syncs for logging (losses are kept for every step)")
    p.add_argument("--timing-warmup", type=int, default=10,
                   help="steps excluded from tokens/s (compilation, allocator warm-up)")
    p.add_argument("--sample-len", type=int, default=400, help="bytes to generate at the end")
    p.add_argument("--bench", action="store_true",
                   help="throughput only: no evaluation, checkpoints, plot or sample")
    return p.parse_args(argv)


def run_config_from_args(args) -> RunConfig:
    preset = PRESETS[args.preset]

    def pick(name):
        value = getattr(args, name)
        return preset[name] if value is None else value

    return RunConfig(
        preset=args.preset,
        model=GPTConfig(**preset["model"], dropout=args.dropout, norm=args.norm),
        steps=pick("steps"),
        batch_size=pick("batch_size"),
        lr=pick("lr"),
        eval_every=pick("eval_every"),
        eval_iters=pick("eval_iters"),
        ckpt_every=pick("ckpt_every"),
        seed=args.seed,
        data=args.data,
        precision=args.precision,
    )


# ----------------------------------------------------------------------------------------------
# Data


def stdlib_sources() -> list[Path]:
    """The standard library's top-level ``*.py`` files, sorted by name (about 5 MB)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(
            f"no Python sources under {root} (a stripped Python install?); pass --data FILE"
        )
    return files


def load_corpus(path: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of ``path`` (or of the stdlib sources) as uint8, split into (train, val)."""
    if path is None:
        raw = b"".join(f.read_bytes() for f in stdlib_sources())
    else:
        raw = Path(path).read_bytes()
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n_val = int(len(data) * VAL_FRACTION)
    return data[: len(data) - n_val], data[len(data) - n_val :]


def mix_seed(*keys) -> int:
    """A 63-bit seed that is a pure function of ``keys`` (stable across runs and processes)."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def get_batch(data, batch_size, block_size, key, rank, world, device):
    """This rank's shard of the global batch named by ``key``: inputs and targets, (B/world, T).

    The global batch depends on ``key`` only, so one process with batch B and ``world`` processes
    with B/world each see the same bytes.
    """
    g = torch.Generator().manual_seed(mix_seed(*key))
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=g)
    ix = ix.view(world, -1)[rank]
    if device.type == "cuda":
        ix = ix.pin_memory().to(device, non_blocking=True)  # no host sync per step
    chunk = data[ix[:, None] + torch.arange(block_size + 1, device=device)].long()
    return chunk[:, :-1], chunk[:, 1:]


# ----------------------------------------------------------------------------------------------
# Process setup, timing, checkpoints


@dataclass
class Env:
    rank: int
    world: int
    device: torch.device
    distributed: bool

    @property
    def is_main(self):
        return self.rank == 0


def setup_env(device_arg: str) -> Env:
    """Single process, or one process per rank under torchrun (NCCL on GPUs, gloo on CPU)."""
    if device_arg == "auto":
        device_arg = "cuda" if torch.cuda.is_available() else "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Env(0, 1, torch.device(device_arg), False)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if device_arg == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return Env(rank, world, device, True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Accumulates wall time of training steps only (not evaluation or checkpointing)."""

    def __init__(self, device):
        self.device, self.seconds, self.steps, self._t0 = device, 0.0, 0, None

    def start(self):
        sync(self.device)
        self._t0 = time.perf_counter()

    def pause(self):
        if self._t0 is not None:
            sync(self.device)
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None

    @property
    def running(self):
        return self._t0 is not None


class StopRequest:
    """First Ctrl-C / SIGTERM asks the loop to checkpoint and stop at the next step boundary
    (never mid-update); a second Ctrl-C interrupts at once."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def _handler(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\nreceived {signal.Signals(signum).name}: checkpointing at the next step "
              "(Ctrl-C again to abort)", file=sys.stderr, flush=True)

    def __enter__(self):
        # Signal handlers can only be installed from the main thread.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def save_checkpoint(path: Path, state: dict):
    """Write to a temporary file, then rename: a crash never leaves a truncated checkpoint."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def lr_at(step: int, rc: RunConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at ``rc.steps``."""
    if step < rc.lr_warmup:
        return rc.lr * (step + 1) / rc.lr_warmup
    progress = min(1.0, (step - rc.lr_warmup) / max(1, rc.steps - rc.lr_warmup))
    return rc.lr * (rc.min_lr_ratio + (1 - rc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, rc: RunConfig, device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norm weights
    groups = [{"params": decay, "weight_decay": rc.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=rc.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


# ----------------------------------------------------------------------------------------------
# Training


@torch.no_grad()
def evaluate(model, val, rc, env, autocast):
    """Mean loss over ``eval_iters`` fixed validation batches (the same ones at every call)."""
    model.eval()
    total = torch.zeros((), device=env.device)
    for i in range(rc.eval_iters):
        x, y = get_batch(val, rc.batch_size, rc.model.block_size, (rc.seed, "val", i),
                         env.rank, env.world, env.device)
        with autocast():
            total += model(x, y)[1].float()
    if env.distributed:
        dist.all_reduce(total)
        total /= env.world
    model.train()
    return total.item() / rc.eval_iters


def train(args, stop_at: int | None = None) -> dict:
    """Run training as configured by ``args`` (from ``parse_args``); returns the summary dict.

    ``stop_at`` stops after that step exactly as Ctrl-C would (checkpoint, ``interrupted``), which
    lets tests exercise resumption at a chosen step.
    """
    env = setup_env(args.device)
    try:
        return _train(args, env, stop_at)
    finally:
        if env.distributed:
            dist.destroy_process_group()


def _train(args, env: Env, stop_at: int | None) -> dict:
    out = Path(args.out)
    ckpt_path = out / CKPT_NAME
    ckpt = None
    if args.resume:
        if not ckpt_path.exists():
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        rc = RunConfig(**{**ckpt["config"], "model": GPTConfig(**ckpt["config"]["model"])})
        if args.steps is not None:
            rc.steps = args.steps
    else:
        rc = run_config_from_args(args)
    if rc.batch_size % env.world:
        raise ValueError(f"batch size {rc.batch_size} is not divisible by {env.world} processes")
    precision = rc.precision
    if precision == "auto":
        precision = "bf16" if env.device.type == "cuda" else "fp32"
    if env.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # only affects fp32 matmuls
        torch.backends.cudnn.allow_tf32 = True

    def autocast():
        if precision == "bf16":
            return torch.autocast(env.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    train_data, val_data = load_corpus(rc.data)
    train_data, val_data = train_data.to(env.device), val_data.to(env.device)

    torch.manual_seed(rc.seed)  # same initial weights on every rank and for both norms
    raw_model = GPT(rc.model).to(env.device)
    optimizer = make_optimizer(raw_model, rc, env.device)
    history = {"train": [], "val": []}  # train: loss per step; val: [step, loss]
    start = 0
    if ckpt is not None:
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        history, start = ckpt["history"], ckpt["step"]
        del ckpt
    if args.compile:
        for block in raw_model.blocks:
            block.compile()  # regional: one graph reused by every block, short compile times
    if env.distributed:
        model = DDP(raw_model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    else:
        model = raw_model

    tokens_per_step = rc.batch_size * rc.model.block_size
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        print(f"{rc.preset} GPT, {raw_model.num_params() / 1e6:.2f}M parameters, norm={rc.model.norm}"
              f", device={env.device} x{env.world}, precision={precision}, compile={args.compile}"
              f", {len(train_data) / 1e6:.1f}M train bytes, steps {start}->{rc.steps}", flush=True)

    def state(step):
        return {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step, "history": history, "config": asdict(rc)}

    bar = tqdm(total=rc.steps, initial=start, disable=True if not env.is_main else None,
               dynamic_ncols=True, desc="train")
    watch = Stopwatch(env.device)
    timing_start = start + min(args.timing_warmup, (rc.steps - start) // 2)
    pending = []  # per-step loss tensors not yet copied to the host
    last_log = (start, time.perf_counter())
    interrupted = False

    def flush(stop_flag: bool) -> bool:
        """Move pending losses to the host (one sync); returns whether any rank wants to stop."""
        nonlocal last_log
        if not pending and not env.distributed:
            return stop_flag
        packed = torch.stack(pending + [torch.tensor(float(stop_flag), device=env.device)])
        if env.distributed:
            dist.all_reduce(packed)  # sum: average the losses, OR the stop flags
            packed[:-1] /= env.world
        values = packed.tolist()
        history["train"].extend(values[:-1])
        pending.clear()
        step, now = len(history["train"]), time.perf_counter()
        tok_s = (step - last_log[0]) * tokens_per_step / max(now - last_log[1], 1e-9)
        last_log = (step, now)
        if env.is_main and values[:-1]:
            bar.set_postfix(loss=f"{values[-2]:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            bar.update(step - bar.n)
            if bar.disable:
                print(f"step {step}/{rc.steps} loss {values[-2]:.4f} tok/s {tok_s:,.0f}", flush=True)
        return values[-1] > 0

    def log_val(step):
        watch.pause()
        loss = evaluate(model, val_data, rc, env, autocast)
        history["val"].append([step, loss])
        if env.is_main:
            bar.write(f"step {step}: val loss {loss:.4f}")
        return loss

    def checkpoint(step):
        watch.pause()
        if env.is_main:
            save_checkpoint(ckpt_path, state(step))
        if env.distributed:
            dist.barrier()

    model.train()
    with StopRequest() as stop:
        for step in range(start, rc.steps):
            if step >= timing_start and not watch.running:
                watch.start()
            torch.manual_seed(mix_seed(rc.seed, "dropout", step, env.rank))
            x, y = get_batch(train_data, rc.batch_size, rc.model.block_size, (rc.seed, "train", step),
                             env.rank, env.world, env.device)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, rc)
            with autocast():
                _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), rc.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pending.append(loss.detach().float())
            if watch.running:
                watch.steps += 1
            done = step + 1
            wants_stop = stop.requested or (stop_at is not None and done >= stop_at)
            at_log = done % args.log_every == 0 or done == rc.steps
            # A single process stops at once; ranks must agree, so they decide at log points.
            if at_log or (wants_stop and not env.distributed):
                if flush(wants_stop) and done < rc.steps:
                    watch.pause()
                    checkpoint(done)
                    interrupted = True
                    break
            if args.bench or done == rc.steps:
                continue
            if done % rc.eval_every == 0:
                log_val(done)
            if done % rc.ckpt_every == 0:
                flush(False)
                checkpoint(done)
    watch.pause()
    bar.close()
    flush(False)
    step = len(history["train"])

    summary = {
        "preset": rc.preset, "norm": rc.model.norm, "compile": args.compile,
        "device": describe_device(env.device), "world_size": env.world, "precision": precision,
        "steps": step, "params": raw_model.num_params(), "tokens_per_step": tokens_per_step,
        "dropout": rc.model.dropout, "seed": rc.seed,
        "first_loss": history["train"][0] if history["train"] else None,
        "final_loss": history["train"][-1] if history["train"] else None,
        "val_loss": None,
        "tokens_per_s": watch.steps * tokens_per_step / watch.seconds if watch.seconds else None,
        "timed_steps": watch.steps, "interrupted": interrupted,
        "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if env.device.type == "cuda":
        summary["peak_mem_gib"] = torch.cuda.max_memory_allocated(env.device) / 2**30
    if rc.model.norm == "fused":
        import triton

        summary["triton"] = triton.__version__
    if env.distributed:
        summary["replicas_in_sync"] = replicas_in_sync(raw_model)
    if interrupted:
        if env.is_main:
            print(f"stopped after step {step}; checkpoint {ckpt_path}; continue with --resume",
                  file=sys.stderr)
        return summary
    if not args.bench:
        summary["val_loss"] = log_val(step)
        checkpoint(step)
    if env.is_main:
        finish_outputs(out, summary, history, raw_model, args, env, rc)
    summary["history"] = history
    return summary


def finish_outputs(out, summary, history, raw_model, args, env, rc):
    """summary.json, loss.png and the generated sample (main process only)."""
    if not args.bench:
        plot_losses(history, out / "loss.png", f"{rc.preset} GPT, norm={rc.model.norm}")
        if args.sample_len > 0:
            raw_model.eval()
            prompt = torch.tensor([list(b"def ")], device=env.device)
            g = torch.Generator(device=env.device).manual_seed(rc.seed)
            text = bytes(raw_model.generate(prompt, args.sample_len, generator=g)[0].tolist())
            sample = text.decode("utf-8", errors="replace")
            (out / "sample.txt").write_text(sample)
            print(f"---- sample ----\n{sample}\n----------------")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "history.json").write_text(json.dumps(history) + "\n")
    print(json.dumps(summary, indent=2))


def describe_device(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def replicas_in_sync(model) -> bool:
    """Whether every rank holds bitwise the same parameters (DDP should guarantee it)."""
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()])
    lo, hi = sums.clone(), sums.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


def plot_losses(history, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = history["train"]
    ax.plot(range(1, len(train) + 1), train, lw=0.8, alpha=0.6, label="train (per step)")
    if history["val"]:
        steps, losses = zip(*history["val"])
        ax.plot(steps, losses, "o-", label="validation")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    summary = train(parse_args(argv))
    if summary["interrupted"]:
        sys.exit(130)


if __name__ == "__main__":
    main()

"""Train a small byte-level GPT whose pre-norm blocks use ``fused_norm.DropoutAddRMSNorm``.

    python examples/train_gpt.py --preset tiny --steps 200 --out runs/demo
    python examples/train_gpt.py --preset small --norm torch --compile      # the unfused baseline
    python examples/train_gpt.py --preset small --compile model             # one graph, whole model
    torchrun --nproc_per_node=2 examples/train_gpt.py --preset small        # DDP (NCCL or gloo)

Data: by default the Python standard library's own source files (found through ``sysconfig``),
so there is always a few MB of real text and nothing to download; ``--data FILE`` trains on any
file. The vocabulary is the 256 byte values; the last 10% of the bytes is the validation split.

Reproducibility is by construction rather than by saved state: the batch and the dropout seed of
step ``s`` on rank ``r`` are functions of ``(seed, s, r)`` only. That is what makes ``--resume``
replay exactly the trajectory of an uninterrupted run.

Outputs in ``--out``: ``summary.json``, ``history.json`` (every step's loss), ``loss.png``,
``sample.txt`` and the checkpoint ``ckpt.pt``, written atomically every ``--ckpt-every`` steps,
at the end, and on Ctrl-C / SIGTERM.
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

# Model shape and training defaults per preset. tiny is sized for a 2-core CPU (about 0.1 s a
# step); small is nanoGPT's character-level Shakespeare model; medium is GPT-2 small's shape;
# llm has the hidden size and tokens per step of a current LLM's training, with few layers.
# tiny's lr: at 2e-3 some seeds spike in loss just after warm-up, which turns rounding-level
# differences into 1e-3-level ones (see tests/test_train_gpt.py); at 1e-3 training is smooth.
# fmt: off
PRESETS = {
    "tiny": dict(model=dict(n_layer=4, n_head=4, n_embd=128, block_size=128), batch_size=16,
                 lr=1e-3, steps=200, eval_every=50, eval_iters=8, ckpt_every=100),
    "small": dict(model=dict(n_layer=6, n_head=6, n_embd=384, block_size=256), batch_size=64,
                  lr=1e-3, steps=2000, eval_every=250, eval_iters=20, ckpt_every=500),
    "medium": dict(model=dict(n_layer=12, n_head=12, n_embd=768, block_size=1024), batch_size=16,
                   lr=6e-4, steps=5000, eval_every=500, eval_iters=20, ckpt_every=1000),
    # A block shaped like a current LLM's (hidden 2048, a few layers, 8K tokens per step).
    "llm": dict(model=dict(n_layer=4, n_head=16, n_embd=2048, block_size=2048), batch_size=4,
                lr=3e-4, steps=500, eval_every=100, eval_iters=4, ckpt_every=250),
}
# fmt: on
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
    precision: str  # "auto" | "fp32" | "bf16"
    lr_warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add = p.add_argument
    add("--preset", choices=sorted(PRESETS), default="tiny")
    add("--device", choices=["auto", "cpu", "cuda"], default="auto")
    add("--steps", type=int, help="optimizer steps (default: the preset's)")
    add("--norm", choices=["fused", "torch"], default="fused", help="torch: the unfused baseline")
    add("--dropout", type=float, default=0.0, help="residual-branch dropout probability")
    add("--seed", type=int, default=0)
    add("--compile", nargs="?", const="blocks", choices=["blocks", "model"],
        help="torch.compile each block (blocks, the default: regional, quick to compile) or the "
             "whole model as one graph (model: less host time per step)")  # fmt: skip
    add("--out", default="runs/gpt", help="output directory")
    add("--resume", action="store_true", help="continue from OUT/ckpt.pt and its configuration")
    add("--data", help="train on this file instead of the stdlib sources")
    add("--batch-size", type=int, help="global batch (default: the preset's)")
    add("--lr", type=float, help="peak learning rate (default: the preset's)")
    add("--precision", choices=["auto", "fp32", "bf16"], default="auto",
        help="auto: bf16 autocast on CUDA, fp32 on CPU")  # fmt: skip
    add("--eval-every", type=int)
    add("--eval-iters", type=int)
    add("--ckpt-every", type=int)
    add("--log-every", type=int, default=10, help="steps between host syncs for logging")
    add("--timing-warmup", type=int, default=10, help="first steps left out of tokens/s")
    add("--sample-len", type=int, default=400, help="bytes to generate at the end")
    add("--bench", action="store_true", help="throughput only: no eval, checkpoint, plot, sample")
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
# Processes and data


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
    """One process, or one per rank under torchrun (NCCL on GPUs, gloo on CPU)."""
    if device_arg == "auto":
        device_arg = "cuda" if torch.cuda.is_available() else "cpu"
    if device_arg == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch.cuda.is_available() is False")
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


def stdlib_sources() -> list[Path]:
    """The standard library's top-level ``*.py`` files, sorted by name (about 5 MB)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no Python sources under {root}; pass --data FILE")
    return files


def load_corpus(path: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of ``path`` (or of the stdlib sources) as uint8, split into (train, val)."""
    raw = Path(path).read_bytes() if path else b"".join(f.read_bytes() for f in stdlib_sources())
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n_val = int(len(data) * VAL_FRACTION)
    return data[: len(data) - n_val], data[len(data) - n_val :]


def mix_seed(*keys) -> int:
    """A 63-bit seed that is a pure function of ``keys`` (stable across runs and processes)."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def get_batch(data, key, rc: RunConfig, env: Env):
    """This rank's shard of the global batch named by ``key``: inputs, targets (B/world, T).

    The global batch depends on ``key`` only, so one process with batch B and ``world``
    processes with B/world each train on the same bytes.
    """
    t = rc.model.block_size
    g = torch.Generator().manual_seed(mix_seed(*key))
    ix = torch.randint(len(data) - t - 1, (rc.batch_size,), generator=g)
    ix = ix.view(env.world, -1)[env.rank]
    if env.device.type == "cuda":
        ix = ix.pin_memory().to(env.device, non_blocking=True)  # no host sync per step
    chunk = data[ix[:, None] + torch.arange(t + 1, device=env.device)].long()
    return chunk[:, :-1], chunk[:, 1:]


# ----------------------------------------------------------------------------------------------
# Bookkeeping: timing, logging, stopping, checkpoints


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Wall time of the timed training steps only (paused for evaluation and checkpoints)."""

    def __init__(self, device):
        self.device, self.seconds, self.steps, self._t0 = device, 0.0, 0, None

    @property
    def running(self):
        return self._t0 is not None

    def start(self):
        sync(self.device)
        self._t0 = time.perf_counter()

    def pause(self):
        if self.running:
            sync(self.device)
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None


class LossLog:
    """Every step's training loss. Losses stay on the device until ``flush`` copies them to the
    host in one sync (every ``--log-every`` steps), averaged over ranks; the progress bar and
    its tokens/s are updated at the same time."""

    def __init__(self, history, total, tokens_per_step, env: Env):
        self.history, self.tokens_per_step, self.env = history, tokens_per_step, env
        self.pending = []
        # disable=None: tqdm switches itself off when stderr is not a terminal.
        self.bar = tqdm(total=total, initial=self.steps, desc="train", dynamic_ncols=True,
                        disable=True if not env.is_main else None)  # fmt: skip
        self.reset_clock()

    @property
    def steps(self):
        return len(self.history["train"]) + len(self.pending)

    def append(self, loss):
        self.pending.append(loss.detach().float())

    def reset_clock(self):
        """Start the progress bar's tokens/s afresh (after evaluation or a checkpoint)."""
        self._mark = (self.steps, time.perf_counter())

    def flush(self, stop: bool = False) -> bool:
        """Copy pending losses to the host; returns whether any rank asked to ``stop``.

        Under DDP every rank must call this at the same steps: it is a collective.
        """
        flag = torch.tensor(float(stop), device=self.env.device)
        packed = torch.stack([*self.pending, flag])
        if self.env.distributed:
            dist.all_reduce(packed)  # summed: mean loss after dividing, OR of the stop flags
            packed[:-1] /= self.env.world
        *losses, flag = packed.tolist()
        self.history["train"].extend(losses)
        self.pending.clear()
        if losses and self.env.is_main:
            step, now = self.steps, time.perf_counter()
            tok_s = (step - self._mark[0]) * self.tokens_per_step / max(now - self._mark[1], 1e-9)
            self._mark = (step, now)
            self.bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            self.bar.update(step - self.bar.n)
            if self.bar.disable:
                print(f"step {step}/{self.bar.total} loss {losses[-1]:.4f} tok/s {tok_s:,.0f}",
                      flush=True)  # fmt: skip
        return flag > 0

    def write(self, message):
        if self.env.is_main:
            self.bar.write(message)


class StopRequest:
    """The first Ctrl-C or SIGTERM asks the loop to checkpoint and stop at a step boundary
    (never in the middle of an update); a second Ctrl-C interrupts at once."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def _handler(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: checkpointing at the end of this step "
              "(Ctrl-C again to abort)", file=sys.stderr, flush=True)  # fmt: skip

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # else signal() refuses
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


# ----------------------------------------------------------------------------------------------
# Model, optimizer, schedule


def build(args, env: Env):
    """The run's config, model, optimizer, loss history and first step: fresh, or restored
    from ``OUT/ckpt.pt`` with ``--resume`` (whose stored config wins except ``--steps``)."""
    ckpt = None
    if args.resume:
        path = Path(args.out) / CKPT_NAME
        if not path.exists():
            raise FileNotFoundError(f"--resume: no checkpoint at {path}")
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        rc = RunConfig(**{**ckpt["config"], "model": GPTConfig(**ckpt["config"]["model"])})
        rc.steps = args.steps or rc.steps
    else:
        rc = run_config_from_args(args)
    if rc.batch_size % env.world:
        raise ValueError(f"batch size {rc.batch_size} is not divisible by {env.world} processes")

    torch.manual_seed(rc.seed)  # the same initial weights on every rank and for both norms
    model = GPT(rc.model).to(env.device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norm weights
    groups = [{"params": decay, "weight_decay": rc.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]  # fmt: skip
    optimizer = torch.optim.AdamW(groups, lr=rc.lr, betas=(0.9, 0.95),
                                  fused=env.device.type == "cuda")  # fmt: skip
    if ckpt is None:
        return rc, model, optimizer, {"train": [], "val": []}, 0
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    return rc, model, optimizer, ckpt["history"], ckpt["step"]


def lr_at(step: int, rc: RunConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at ``rc.steps``."""
    if step < rc.lr_warmup:
        return rc.lr * (step + 1) / rc.lr_warmup
    progress = min(1.0, (step - rc.lr_warmup) / max(1, rc.steps - rc.lr_warmup))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return rc.lr * (rc.min_lr_ratio + (1 - rc.min_lr_ratio) * cosine)


@torch.no_grad()
def evaluate(model, val, rc: RunConfig, env: Env, autocast):
    """Mean loss over ``eval_iters`` fixed validation batches (the same ones at every call)."""
    model.eval()
    total = torch.zeros((), device=env.device)
    for i in range(rc.eval_iters):
        x, y = get_batch(val, (rc.seed, "val", i), rc, env)
        with autocast():
            total += model(x, y)[1].float()
    if env.distributed:
        dist.all_reduce(total)
        total /= env.world
    model.train()
    return total.item() / rc.eval_iters


# ----------------------------------------------------------------------------------------------
# Training


def train(args, stop_at: int | None = None) -> dict:
    """Train as configured by ``args`` (from ``parse_args``); returns the summary, with the
    loss ``history`` added.

    ``stop_at`` ends the run after that step exactly as Ctrl-C would (checkpoint, summary with
    ``interrupted``), so tests can resume from a chosen step.
    """
    env = setup_env(args.device)
    try:
        return _train(args, env, stop_at)
    finally:
        if env.distributed:
            dist.destroy_process_group()


def _train(args, env: Env, stop_at: int | None) -> dict:
    out = Path(args.out)
    rc, raw_model, optimizer, history, start = build(args, env)
    precision = rc.precision
    if precision == "auto":
        precision = "bf16" if env.device.type == "cuda" else "fp32"

    def autocast():
        if precision == "bf16":
            return torch.autocast(env.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    train_data, val_data = (t.to(env.device) for t in load_corpus(rc.data))
    if len(val_data) <= rc.model.block_size + 1:
        raise ValueError(f"the corpus is too small: its validation split ({len(val_data)} bytes) "
                         f"must exceed block_size + 1 = {rc.model.block_size + 1}")  # fmt: skip
    if args.compile == "blocks":
        for block in raw_model.blocks:
            block.compile()  # regional: every block reuses one graph, so compiling is quick
    elif args.compile == "model":
        raw_model.compile()  # one graph: fewer guards and calls per step, a longer compile
    model = raw_model
    if env.distributed:
        model = DDP(raw_model, device_ids=[env.device.index] if env.device.type == "cuda" else None)

    tokens_per_step = rc.batch_size * rc.model.block_size
    backend, backend_text = norm_backend(rc.model.norm, env.device)
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        print(f"{rc.preset} GPT {raw_model.num_params() / 1e6:.2f}M params, "
              f"norm={rc.model.norm} ({backend_text}), "
              f"{env.device} x{env.world}, {precision}, compile={args.compile or 'no'}, "
              f"{len(train_data):,} train bytes, steps {start}->{rc.steps}",
              flush=True)  # fmt: skip

    log = LossLog(history, rc.steps, tokens_per_step, env)
    watch = Stopwatch(env.device)
    timing_start = start + min(args.timing_warmup, (rc.steps - start) // 2)

    def validate(step):
        watch.pause()
        loss = evaluate(model, val_data, rc, env, autocast)
        history["val"].append([step, loss])
        log.write(f"step {step}: val loss {loss:.4f}")
        log.reset_clock()
        return loss

    def checkpoint(step):
        watch.pause()
        if env.is_main:
            save_checkpoint(out / CKPT_NAME, {
                "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step, "history": history, "config": asdict(rc),
            })  # fmt: skip
        if env.distributed:
            dist.barrier()
        log.reset_clock()

    interrupted = False
    model.train()
    with StopRequest() as stop:
        for step in range(start, rc.steps):
            if step >= timing_start and not watch.running:
                watch.start()
            torch.manual_seed(mix_seed(rc.seed, "dropout", step, env.rank))
            x, y = get_batch(train_data, (rc.seed, "train", step), rc, env)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, rc)
            with autocast():
                _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), rc.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log.append(loss)
            if watch.running:
                watch.steps += 1
            done = step + 1
            if done == rc.steps:
                break
            # One process stops at once; DDP ranks must agree, which they do at log steps.
            wants_stop = stop.requested or (stop_at is not None and done >= stop_at)
            if done % args.log_every == 0 or (wants_stop and not env.distributed):
                if log.flush(stop=wants_stop):
                    checkpoint(done)
                    interrupted = True
                    break
            if args.bench:
                continue
            if done % rc.eval_every == 0:
                validate(done)
            if done % rc.ckpt_every == 0:
                log.flush()
                checkpoint(done)
    watch.pause()
    log.flush()
    log.bar.close()

    summary = make_summary(args, rc, env, raw_model, history, watch, precision, backend)
    summary["interrupted"] = interrupted
    if interrupted:
        if env.is_main:
            print(f"stopped after step {log.steps}: {out / CKPT_NAME}; continue with --resume",
                  file=sys.stderr)  # fmt: skip
    else:
        if not args.bench:
            summary["val_loss"] = validate(log.steps)
            checkpoint(log.steps)
        if env.is_main:
            write_outputs(out, summary, history, raw_model, args, env, rc)
    return {**summary, "history": history}


# ----------------------------------------------------------------------------------------------
# Results


def make_summary(args, rc, env, model, history, watch, precision, backend=None) -> dict:
    train = history["train"]
    summary = {
        "preset": rc.preset, "norm": rc.model.norm, "backend": backend, "compile": args.compile or "no",
        "device": describe_device(env.device), "world_size": env.world, "precision": precision,
        "steps": len(train), "params": model.num_params(),
        "tokens_per_step": rc.batch_size * rc.model.block_size, "dropout": rc.model.dropout,
        "seed": rc.seed, "first_loss": train[0] if train else None,
        "final_loss": train[-1] if train else None, "val_loss": None,
        "tokens_per_s": (watch.steps * rc.batch_size * rc.model.block_size / watch.seconds
                         if watch.seconds else None),
        "timed_steps": watch.steps, "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }  # fmt: skip
    if env.device.type == "cuda":
        summary["cuda"] = torch.version.cuda
        summary["peak_mem_gib"] = torch.cuda.max_memory_allocated(env.device) / 2**30
    if rc.model.norm == "fused":
        try:
            import triton

            summary["triton"] = triton.__version__
        except ImportError:  # no Triton wheel for this platform: the norm runs its torch path
            summary["triton"] = None
    if env.distributed:
        summary["replicas_in_sync"] = replicas_in_sync(model)
    return summary


def norm_backend(norm: str, device: torch.device) -> tuple:
    """Which implementation computes the norm on ``device``: ``(value for summary.json, text for
    the banner)``. ``None`` for ``--norm torch``; otherwise "triton" (the kernels on a GPU),
    "triton-interpreter" (the kernels in Triton's CPU interpreter) or "torch" (the package's
    pure-PyTorch path), by the package's public rule: ``FUSED_NORM_BACKEND`` (auto | triton |
    torch), then the device, then ``TRITON_INTERPRET`` (README, "Backends"). With "triton" where
    the kernels cannot run, the first forward raises and says so."""
    if norm != "fused":
        return None, "torch.nn modules, no fused_norm"
    choice = (os.environ.get("FUSED_NORM_BACKEND") or "auto").strip().lower()
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    kernels = choice == "triton" or (choice == "auto" and (device.type == "cuda" or interpreted))
    where = "CPU" if device.type == "cpu" else str(device)
    if device.type == "cuda" and device.index is None:
        where = f"cuda:{torch.cuda.current_device()}"
    if not kernels:
        why = f"FUSED_NORM_BACKEND={choice}" if choice == "torch" else "no Triton kernels"
        return "torch", f"backend: torch, {where}: {why}"
    if device.type == "cpu":
        if not interpreted:
            return "triton", "backend: triton, CPU: needs TRITON_INTERPRET=1"
        return "triton-interpreter", "backend: triton, CPU: Triton interpreter"
    return "triton", f"backend: triton, {where}"


def describe_device(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def replicas_in_sync(model) -> bool:
    """Whether every rank holds the same parameters (DDP should keep them bitwise equal)."""
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()])
    lo, hi = sums.clone(), sums.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


def write_outputs(out, summary, history, model, args, env, rc):
    """summary.json, history.json, loss.png and a generated sample (main process only)."""
    if not args.bench:
        plot_losses(history, out / "loss.png", f"{rc.preset} GPT, norm={rc.model.norm}")
        if args.sample_len > 0:
            model.eval()
            prompt = torch.tensor([list(b"def ")], device=env.device)
            g = torch.Generator(device=env.device).manual_seed(rc.seed)
            text = bytes(model.generate(prompt, args.sample_len, generator=g)[0].tolist())
            sample = text.decode("utf-8", errors="replace")
            (out / "sample.txt").write_text(sample)
            print(f"---- sample ----\n{sample}\n----------------")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "history.json").write_text(json.dumps(history) + "\n")
    print(json.dumps(summary, indent=2))


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

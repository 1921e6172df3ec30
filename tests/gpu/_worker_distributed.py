"""DDP and FSDP2 on two GPUs: one training step of a small pre-norm model built from our
modules, compared with the same step on one GPU over the whole batch. Rank 0 writes, for every
parameter, the largest gradient and updated-parameter error and its tolerance, as JSON.

    python3 tests/gpu/_worker_distributed.py PORT OUT.json
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
from pathlib import Path

# NCCL's NVLink multicast (NVLS) and symmetric-memory multicast are unavailable on the GPU
# machines this suite runs on; both must be off before torch.distributed starts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's fused_norm

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

try:  # torch >= 2.6
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._composable.fsdp import fully_shard

from fused_norm import DropoutAddLayerNorm, LayerNorm, RMSNorm  # noqa: E402

WORLD = 2
D, T, B_PER_RANK, LAYERS, LR = 128, 16, 4, 2, 0.1
ROWS = WORLD * B_PER_RANK * T  # rows summed into every weight gradient
# Tolerance, relative to the largest |value| of each tensor: the two-GPU and one-GPU runs sum
# the same fp32 terms in different orders (per-rank halves, then the all-reduce); the error bound
# of an n-term fp32 sum is about n * eps * sum|terms|. n = ROWS, and a safety factor of 8 for
# the layers an error passes through on its way back.
REL_TOL = 8 * ROWS * torch.finfo(torch.float32).eps


class Block(nn.Module):
    """Pre-norm block: LayerNorm -> mixer, RMSNorm -> MLP, the residual stream in between."""

    def __init__(self, d: int):
        super().__init__()
        self.norm1 = LayerNorm(d)
        self.mixer = nn.Linear(d, d)
        self.norm2 = RMSNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, h, residual):
        h, residual = self.norm1(h, residual, prenorm=True)
        h, residual = self.norm2(self.mixer(h), residual, prenorm=True)
        return self.fc2(F.gelu(self.fc1(h))), residual


class Model(nn.Module):
    def __init__(self, d: int, layers: int):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm_f = DropoutAddLayerNorm(d, prenorm=False, p=0.0)
        self.head = nn.Linear(d, d)

    def forward(self, x):
        h, residual = self.inp(x), None
        for block in self.blocks:
            h, residual = block(h, residual)
        return self.head(self.norm_f(h, residual))


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2 shard) gathered whole; a plain tensor as is."""
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def _step(model: nn.Module, named: nn.Module, x, target):
    """One SGD step; returns ({name: grad}, {name: updated param}) gathered whole."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    F.mse_loss(model(x), target).backward()
    grads = {n: _full(p.grad) for n, p in named.named_parameters()}
    opt.step()
    params = {n: _full(p) for n, p in named.named_parameters()}
    return grads, params


def _compare(got: dict, ref: dict) -> dict:
    out = {}
    for name, r in ref.items():
        g = got[name].to(r.device)
        scale = max(r.abs().max().item(), 1e-12)
        out[name] = {"err": (g - r).abs().max().item(), "tol": REL_TOL * scale}
    return out


def _run(rank: int, port: int, out_path: str) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=120), device_id=device,
    )  # fmt: skip
    try:
        torch.set_float32_matmul_precision("highest")  # no TF32: fp32 maths on both sides
        torch.manual_seed(0)
        base = Model(D, LAYERS).to(device)
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(WORLD * B_PER_RANK, T, D, device=device, generator=g)
        target = torch.randn(WORLD * B_PER_RANK, T, D, device=device, generator=g)
        mine = slice(rank * B_PER_RANK, (rank + 1) * B_PER_RANK)

        ref = copy.deepcopy(base)
        ref_grads, ref_params = _step(ref, ref, x, target)

        results = {}
        inner = copy.deepcopy(base)
        ddp = DDP(inner, device_ids=[rank])
        grads, params = _step(ddp, inner, x[mine], target[mine])
        results["ddp"] = {"grad": _compare(grads, ref_grads), "param": _compare(params, ref_params)}

        sharded = copy.deepcopy(base)
        for block in sharded.blocks:
            fully_shard(block)
        fully_shard(sharded)
        grads, params = _step(sharded, sharded, x[mine], target[mine])
        results["fsdp2"] = {
            "grad": _compare(grads, ref_grads), "param": _compare(params, ref_params),
        }  # fmt: skip
        # Each rank's own shard was compared after gathering; rank 0 reports.
        if rank == 0:
            Path(out_path).write_text(json.dumps(results, indent=1))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(port: int, out_path: str) -> int:
    if torch.cuda.device_count() < WORLD:
        print(f"needs {WORLD} GPUs", file=sys.stderr)
        return 2
    mp.spawn(_run, args=(port, out_path), nprocs=WORLD, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2]))

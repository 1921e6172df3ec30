"""A small decoder-only GPT whose pre-norm blocks carry the residual stream through
``fused_norm.DropoutAddRMSNorm(prenorm=True)``.

The residual stream is threaded the way flash-attention's GPT does it: a block receives
``(hidden, residual)``, where ``hidden`` is the previous sub-layer's output, and the norm computes
``residual = dropout(hidden) + residual`` and ``normed = rms_norm(residual)`` in one pass. So each
block reads and writes the residual stream once per sub-layer instead of three times (dropout,
add, norm), and the final norm closes the stream the same way.

``GPTConfig.norm = "torch"`` builds the same model out of ``nn.Dropout`` + add +
``torch.nn.RMSNorm`` (``TorchDropoutAddRMSNorm``). Neither norm draws from the random number
generator when it is built and both initialise ``weight`` to ones under the same parameter name, so
for a given seed the two models are identical parameter for parameter and their state dicts are
interchangeable.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 128  # context length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0  # residual-branch dropout, applied inside the norms
    norm: str = "fused"  # "fused": fused_norm.DropoutAddRMSNorm; "torch": the unfused baseline
    eps: float = 1e-5


class TorchDropoutAddRMSNorm(nn.RMSNorm):
    """The unfused baseline: ``nn.Dropout`` + add + ``torch.nn.RMSNorm``.

    Same constructor and ``forward(x0, residual=None)`` as ``fused_norm.DropoutAddRMSNorm`` and the
    same parameter (``weight``, ones), so it computes the same function and loads the same
    state dict. The residual stream keeps type promotion's dtype (fp32 when the residual is fp32).
    """

    def __init__(self, hidden_size, prenorm=False, p=0.0, eps=1e-5, device=None, dtype=None):
        super().__init__(hidden_size, eps=eps, device=device, dtype=dtype)
        self.prenorm = prenorm
        self.dropout = nn.Dropout(p)

    def forward(self, x0, residual=None):
        x = self.dropout(x0)
        residual = x if residual is None else x + residual
        y = super().forward(residual)
        return (y, residual) if self.prenorm else y


def _import_fused_norm():
    try:
        import fused_norm
    except ImportError:
        # Let the example run from a source checkout that has not been pip-installed.
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        import fused_norm
    return fused_norm


def make_norm(cfg: GPTConfig, prenorm: bool) -> nn.Module:
    """The dropout + add + RMSNorm layer selected by ``cfg.norm``."""
    if cfg.norm == "fused":
        fused_norm = _import_fused_norm()
        return fused_norm.DropoutAddRMSNorm(cfg.n_embd, prenorm=prenorm, p=cfg.dropout, eps=cfg.eps)
    if cfg.norm == "torch":
        return TorchDropoutAddRMSNorm(cfg.n_embd, prenorm=prenorm, p=cfg.dropout, eps=cfg.eps)
    raise ValueError(f"norm must be 'fused' or 'torch', got {cfg.norm!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):  # x: (B, T, C)
        qkv = self.c_attn(x)
        q, k, v = rearrange(qkv, "b t (three h d) -> three b h t d", three=3, h=self.n_head)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(rearrange(y, "b h t d -> b t (h d)"))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block on the ``(hidden, residual)`` stream."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = make_norm(cfg, prenorm=True)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = make_norm(cfg, prenorm=True)
        self.mlp = MLP(cfg)

    def forward(self, hidden, residual=None):
        # residual <- dropout(hidden) + residual; h <- rms_norm(residual) * weight
        h, residual = self.norm1(hidden, residual)
        hidden = self.attn(h)
        h, residual = self.norm2(hidden, residual)
        return self.mlp(h), residual


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.norm_f = make_norm(cfg, prenorm=False)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameter count (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None):
        """``idx``: (B, T) int64 bytes. Returns ``(logits (B, T, V), loss or None)``."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        hidden = self.wte(idx) + self.wpe(pos)
        # The first block's norm sees residual=None, so its dropout is the embedding dropout.
        residual = None
        for block in self.blocks:
            hidden, residual = block(hidden, residual)
        logits = self.lm_head(self.norm_f(hidden, residual))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=0.8, generator=None):
        """Sample ``max_new_tokens`` bytes after the prompt ``idx`` (B, T); returns (B, T + new).

        No KV cache: each step re-reads the last ``block_size`` bytes, which is plenty for a demo.
        """
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.block_size :])
            probs = F.softmax(logits[:, -1, :].float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

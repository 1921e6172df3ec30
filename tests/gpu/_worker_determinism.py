"""A seeded forward + backward over a few configurations, for the determinism tests: imported
by test_gpu_determinism.py, and run as a script to produce the same tensors in a fresh process.

    python3 tests/gpu/_worker_determinism.py SEED OUT.pt
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's fused_norm

import torch  # noqa: E402

from fused_norm import layer_norm_fn  # noqa: E402

# Sizes chosen so that the backward's persistent grid gives each program several rows (M is
# many times the SM count of any current GPU), N is not a power of two, and one configuration
# is wider than a register-resident row (the chunked path).
CONFIGS = {
    # name: (leading shape, N, dtype of x, dtype of params, kwargs of layer_norm_fn)
    "ln_bf16_residual_dropout": ((3, 1367), 1000, torch.bfloat16, torch.float32,
                                 {"dropout_p": 0.1, "prenorm": True, "residual": "x"}),
    "rms_fp32_parallel_dropout": ((4099,), 768, torch.float32, torch.float32,
                                  {"dropout_p": 0.2, "is_rms_norm": True, "x1": True,
                                   "prenorm": True, "residual_in_fp32": True}),
    "ln_fp16_wide_rowscale": ((300,), 20000, torch.float16, torch.float32,
                              {"dropout_p": 0.05, "rowscale": True, "residual": "fp32"}),
}  # fmt: skip


def run_config(name: str, seed: int, device="cuda") -> dict:
    """Forward + backward of one configuration; every output, mask and gradient by name."""
    lead, n, dtype, pdtype, spec = CONFIGS[name]
    torch.manual_seed(seed)
    shape = (*lead, n)
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(n, device=device, dtype=pdtype)).requires_grad_()
    b = (0.1 * torch.randn(n, device=device, dtype=pdtype)).requires_grad_()
    kwargs = dict(spec)
    leaves = {"x": x, "weight": w, "bias": b}
    if kwargs.get("residual") is not None:
        rdtype = torch.float32 if kwargs["residual"] == "fp32" else dtype
        kwargs["residual"] = torch.randn(shape, device=device, dtype=rdtype, requires_grad=True)
        leaves["residual"] = kwargs["residual"]
    if kwargs.pop("x1", False):
        kwargs["x1"] = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
        kwargs["weight1"] = (1 + 0.1 * torch.randn(n, device=device, dtype=pdtype)).requires_grad_()
        leaves["x1"], leaves["weight1"] = kwargs["x1"], kwargs["weight1"]
    if kwargs.pop("rowscale", False):
        kwargs["rowscale"] = torch.rand(lead, device=device, dtype=dtype) + 0.5
    outs = layer_norm_fn(x, w, b, eps=1e-5, return_dropout_mask=True, **kwargs)
    masks = outs[-2:]
    outs = outs[:-2]
    result = {f"out{i}": o.detach() for i, o in enumerate(outs)}
    result.update({f"mask{i}": m for i, m in enumerate(masks) if m is not None})
    grad_outs = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(outs, list(leaves.values()), grad_outs)
    result.update({f"grad_{k}": g for k, g in zip(leaves, grads)})
    return result


def run_all(seed: int, device="cuda") -> dict:
    """{config name: {tensor name: tensor}} for every configuration, on the host."""
    return {
        name: {k: v.cpu() for k, v in run_config(name, seed, device).items()} for name in CONFIGS
    }


if __name__ == "__main__":
    torch.save(run_all(int(sys.argv[1])), sys.argv[2])

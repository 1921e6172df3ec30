"""Compile smem_kernels' backward kernel for an H100/H200 (sm_90) on a machine without a GPU
(Triton's compiler and the ptxas in its wheel need none), as the launcher would for LayerNorm
with a bias, and print its layout (block, tail, stages, slices), registers, spills and shared
memory per width, for a norm of x alone, for dropout + add + LayerNorm with prenorm (a
residual gradient in and out, x's dropout) and for x1's path (x + x1 + residual, prenorm, a
second output with weight1 and bias1, no dropout); and (lines starting ``rms``) RMSNorm
without a bias (one partial), alone and in dropout + add + RMSNorm:

    python scripts/compile_smem.py 12288 16384 65536

Rows of bf16, fp16 (a norm of x alone), fp32, bf16 with an fp32 residual stream
(``bf16_res32``) and bf16 with fp32 weights (``bf16_w32``), each where the launcher takes the
kernel (config.bwd_smem_partials on a Hopper GPU): whole rows of 16-bit elements to 16384
columns, and rows in slices beyond that or of 4-byte elements (config.bwd_smem_slices).

Run without TRITON_INTERPRET: under the interpreter Triton's own library functions (``sum``)
are interpreted, and Gluon's compiler refuses them. tests/test_launch.py runs this.
"""

import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from fused_norm import config, ops, smem_kernels  # noqa: E402
from fused_norm.launch import Stand  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
# Row dtypes: (s and the residual's tensors, x's tensors, the weights).
DTYPES = {
    "bf16": ("bf16", "bf16", "bf16"),
    "fp16": ("fp16", "fp16", "fp16"),
    "fp32": ("fp32", "fp32", "fp32"),
    "bf16_res32": ("fp32", "bf16", "bf16"),  # bf16 x and weight, an fp32 residual stream
    "bf16_w32": ("bf16", "bf16", "fp32"),  # bf16 rows, fp32 weights (autocast's parameters)
}
TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _variant(dtype: str, residual: bool, x1: bool):
    """(s's bytes, x's bytes, staged bytes per column, dres_out, store_dres, dropout) of rows of
    ``dtype``: a norm of x alone, (``residual``) dropout + add + LayerNorm with prenorm, or
    (``x1``) x1's path with prenorm, its residual of x's dtype and no dropout (dx, dx1 and
    dresidual one tensor)."""
    stream, xw, _ = DTYPES[dtype]
    s_bytes, x_bytes = TORCH[stream].itemsize, TORCH[xw].itemsize
    dres_out = residual or x1
    s, x = Stand(TORCH[stream], (1, 1)), Stand(TORCH[xw], (1, 1))  # s, dresidual_out; dy, dy1
    staged = ops._staged_bytes(s, x, s if dres_out else None, x if x1 else None, residual)
    store_dres = residual or (x1 and s_bytes != x_bytes)  # dresidual unlike dx: its own buffer
    return s_bytes, x_bytes, staged, dres_out, store_dres, residual


def flags(
    n: int, dtype: str = "bf16", residual: bool = False, x1: bool = False, rms: bool = False
) -> dict:
    """The constexprs the launcher passes for rows of ``n`` columns of ``dtype`` (DTYPES), for a
    norm of x alone, (``residual``) dropout + add + LayerNorm with prenorm or (``x1``) x1's
    path (_variant); with ``rms`` RMSNorm without a bias (one partial) in place of LayerNorm."""
    s_bytes, x_bytes, staged, dres_out, store_dres, dropout = _variant(dtype, residual, x1)
    kind = "x1" if x1 else None
    sliced = config.bwd_smem_sliced(n, max(s_bytes, x_bytes), kind)
    w = TORCH[DTYPES[dtype][2]]
    return ops.smem_flags(
        n, s_bytes, rms, not rms, False, dres_out, store_dres, dropout, w,
        staged if sliced else 0, w if x1 else None, x1, x_bytes,
    )  # fmt: skip


def takes(
    n: int, dtype: str = "bf16", residual: bool = False, x1: bool = False, rms: bool = False
) -> bool:
    """Whether the launcher takes smem_kernels' backward for such rows (config.bwd_smem_partials)
    on a Hopper GPU that fits it."""
    s_bytes, x_bytes, staged, _, _, _ = _variant(dtype, residual, x1)
    config._nvidia = lambda device: True  # as on an H100 / H200
    config._smem_ok = lambda index: True
    kind = "x1" if x1 else "residual" if residual else "plain"
    return config.bwd_smem_partials(
        n, max(s_bytes, x_bytes), 4 if x1 else 1 if rms else 2, kind, torch.device("cuda"),
        TORCH[DTYPES[dtype][2]].itemsize == 4, True, staged, rms,
    )  # fmt: skip


def compile_width(
    n: int, dtype: str = "bf16", residual: bool = False, x1: bool = False, rms: bool = False
):
    """(registers, stack bytes, shared bytes, PTX) of the kernel the launcher picks at ``n``
    for rows and weights of ``dtype`` (DTYPES; where partial dW is kept depends on it,
    config.bwd_smem_dw_regs), for a norm of x alone, (``residual``) dropout + add +
    LayerNorm with prenorm or (``x1``) x1's path (_variant); ``rms``: RMSNorm without a bias
    (no mean)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    stream, xw, wt = DTYPES[dtype]
    constexprs = flags(n, dtype, residual, x1, rms)
    warps = constexprs["NUM_WARPS"]
    names = ("S W W1 MEAN RSTD DY DY1 DRES_OUT SEEDS DX DRES PARTS WS WS_NEXT stride_s_row "
             "stride_dy_row stride_dy1_row stride_dres_out_row stride_dx_row stride_dres_row "
             "stride_part M N rows_per_program dropout_p").split()  # fmt: skip
    absent = "constexpr"  # absent tensors are None (constexprs)
    present = {
        "MEAN": not rms,
        "W1": constexprs["HAS_W1"],
        "DY1": constexprs["HAS_W1"],
        "DRES_OUT": constexprs["HAS_DRESIDUAL_OUT"],
        "SEEDS": constexprs["HAS_DROPOUT"],
        "DRES": constexprs["STORE_DRESIDUAL"],
        "WS": constexprs["SPLIT"] > 1,
        "WS_NEXT": constexprs["SPLIT"] > 1,
    }
    types = {"S": stream, "W": wt, "W1": wt, "MEAN": "fp32", "RSTD": "fp32", "DY": xw,
             "DY1": xw, "DRES_OUT": stream, "SEEDS": "i64", "DX": xw, "DRES": stream,
             "PARTS": "fp32", "WS": "i64", "WS_NEXT": "i64"}  # fmt: skip
    sig = {name: f"*{dt}" if present.get(name, True) else absent for name, dt in types.items()}
    sig.update({name: "i32" for name in names[len(types) : -1]})
    sig.update(dropout_p="fp32")
    sig.update({k: "constexpr" for k in constexprs})
    given = dict(constexprs)
    given.update({name: None for name, there in present.items() if not there})
    for name, stride in (("DY1", "stride_dy1_row"), ("DRES_OUT", "stride_dres_out_row"),
                         ("DRES", "stride_dres_row")):  # fmt: skip
        if not present[name]:
            sig[stride] = absent
            given[stride] = 0
    # As Triton's JIT specialises them: 16-byte aligned pointers, strides and N % 16 == 0.
    aligned = [i for i, name in enumerate(names) if sig[name] not in ("constexpr", "fp32")
               and name not in ("M", "rows_per_program")]  # fmt: skip
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = GluonASTSource(fn=smem_kernels._bwd_smem_kernel, signature=sig, attrs=attrs,
                         constexprs=given)  # fmt: skip
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True,
                               text=True).stdout  # fmt: skip
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    return regs, stack, compiled.metadata.shared, compiled.asm["ptx"]


if __name__ == "__main__":
    if not smem_kernels.AVAILABLE:
        sys.exit("this Triton has no Gluon")
    for arg in sys.argv[1:] or ["12288", "16384"]:
        n = int(arg)
        for dtype, residual, x1, rms in (
            ("bf16", False, False, False), ("bf16", True, False, False),
            ("fp16", False, False, False), ("fp32", False, False, False),
            ("fp32", True, False, False), ("bf16_res32", True, False, False),
            ("bf16", False, True, False), ("fp16", False, True, False),
            ("fp32", False, True, False), ("bf16_res32", False, True, False),
            ("bf16", False, False, True), ("bf16", True, False, True),
            ("fp32", False, False, True), ("bf16_res32", True, False, True),
            ("bf16_w32", False, False, False), ("bf16_w32", True, False, False),
            ("bf16_w32", False, True, False), ("bf16_w32", False, False, True),
        ):  # fmt: skip
            if not takes(n, dtype, residual, x1, rms):
                continue
            f = flags(n, dtype, residual, x1, rms)
            regs, stack, shared, _ptx = compile_width(n, dtype, residual, x1, rms)
            layout = (f["BLOCK_N"], f["TAIL_N"], f["STAGES"], f["SPLIT"])
            print(f"{'rms ' if rms else ''}dtype={dtype} n={arg} residual={residual} x1={x1} "
                  f"block,tail,stages,split={layout} dw_regs={f['DW_REGS']} regs={regs} "
                  f"stack={stack} shared={shared}")  # fmt: skip

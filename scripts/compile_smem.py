"""Compile smem_kernels' backward kernel for an H100/H200 (sm_90) on a machine without a GPU
(Triton's compiler and the ptxas in its wheel need none), as the launcher would for LayerNorm
with a bias of 16-bit rows, and print its registers, spills and shared memory per width, for
a norm of x alone and for dropout + add + LayerNorm with prenorm (a residual gradient in and
out, x's dropout):

    python scripts/compile_smem.py 12288 16384

(bf16 and, for a norm of x alone, fp16 rows and weights: fp16 weights of one-block rows keep
partial dW in shared memory; dropout + add + LayerNorm only up to
config.BWD_SMEM_RESIDUAL_MAX_COLS, where it is chosen.)

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

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compile_width(n: int, dtype: str = "bf16", residual: bool = False):
    """(registers, stack bytes, shared bytes) of the kernel the launcher picks at ``n`` for rows
    and weights of ``dtype`` ("bf16" or "fp16": where partial dW is kept depends on it,
    config.bwd_smem_dw_regs), for a norm of x alone or (``residual``) dropout + add +
    LayerNorm with prenorm."""
    from triton.experimental.gluon._runtime import GluonASTSource

    # What the launcher passes.
    constexprs = ops.smem_flags(
        n, 2, False, True, False, residual, residual, residual, DTYPES[dtype]
    )
    warps = constexprs["NUM_WARPS"]
    names = ("S W MEAN RSTD DY DRES_OUT SEEDS DX DRES PARTS stride_s_row stride_dy_row "
             "stride_dres_out_row stride_dx_row stride_dres_row stride_part M N "
             "rows_per_program dropout_p").split()  # fmt: skip
    row = f"*{dtype}" if residual else "constexpr"  # absent tensors are None (constexprs)
    types = [f"*{dtype}", f"*{dtype}", "*fp32", "*fp32", f"*{dtype}", row,
             "*i64" if residual else "constexpr", f"*{dtype}", row, "*fp32"]  # fmt: skip
    sig = dict(zip(names, types + ["i32"] * 9 + ["fp32"]))
    sig.update({k: "constexpr" for k in constexprs})
    given = dict(constexprs)
    if not residual:
        given.update(DRES_OUT=None, SEEDS=None, DRES=None)
        sig.update(stride_dres_out_row="constexpr", stride_dres_row="constexpr")
        given.update(stride_dres_out_row=0, stride_dres_row=0)
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
    return regs, stack, compiled.metadata.shared


if __name__ == "__main__":
    if not smem_kernels.AVAILABLE:
        sys.exit("this Triton has no Gluon")
    for arg in sys.argv[1:] or ["12288", "16384"]:
        for dtype, residual in (("bf16", False), ("bf16", True), ("fp16", False)):
            if residual and int(arg) > config.BWD_SMEM_RESIDUAL_MAX_COLS:
                continue
            regs, stack, shared = compile_width(int(arg), dtype, residual)
            layout = config.bwd_smem_layout(int(arg), residual, DTYPES[dtype])
            dw_regs = config.bwd_smem_dw_regs(residual, DTYPES[dtype], layout[1])
            print(f"dtype={dtype} n={arg} residual={residual} layout={layout} "
                  f"dw_regs={dw_regs} regs={regs} stack={stack} shared={shared}")  # fmt: skip

"""Registers per thread of fused_norm's kernels for an H100/H200 (sm_90), compiled on a machine
without a GPU: Triton's compiler and the ptxas / cuobjdump shipped in its wheel need none.

    python scripts/offline_regs.py fwd ln 65536 [bf16|fp16|fp32] [--res32]
    python scripts/offline_regs.py bwd parallel 8192
    python scripts/offline_regs.py fwd drop_add_ln 4096 --seeds

Workloads: ln, rms, add_rms, drop_add_ln, parallel (as in bench/sweep.py). It runs
``ops.fused_norm_fwd`` / ``fused_norm_bwd`` on small CPU tensors with the launchers replaced by
a compiler, and config told the device is a 132-SM NVIDIA GPU, so the launch choices are the
GPU's; for each kernel it would launch it prints warps, registers, stack (spills), shared
memory, the programs per SM that registers, shared memory and warps allow, and the grid. The
rows (8448, untouched CPU memory) give every backward program more than one, as on the device:
with one row each, Triton compiled the row loop for a count of 1 and reported fewer registers
(LayerNorm at 2048 columns: 64 instead of the device's 96). Registers differ between Triton versions (their ptxas too): read them
with the device's version (bench/NOTES.md #37 used triton 3.6 and 3.9). With
``OFFLINE_REGS_CUBIN=path`` the last kernel's cubin is kept there: ``nvdisasm -plr`` (in the
same bin directory as cuobjdump) shows the live registers at each instruction (#45). A
dropout forward derives its seeds from a key, as an eager call's does; ``--seeds`` reads them
instead, as under CUDA graph capture or torch.compile (#80). The shared-memory backward
(smem_kernels) is not compiled: where the GPU takes it, the Triton kernel it replaces is shown.
"""

import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from fused_norm import config, ops  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

config._nvidia = lambda device: True
config.split_rows_ok = lambda device: True
config.sm_count = lambda device: 132
# smem_kernels' backward (Gluon) is not compiled here: its check asks the CUDA runtime for the
# device's shared memory, which a machine without a GPU cannot answer. Backward rows that take
# it on an H100/H200 (16-bit, bwd_smem_layout's widths) show the Triton kernel they replace.
config._smem_ok = lambda index: False
config._sm90 = lambda index: True  # an H100 / H200 (sm_90)


class OfflineCompile:
    """Stands in for a launch.Launcher: compiles what it would launch, with its options (its
    dependent kernels' launch_pdl too), and prints its resources."""

    def __init__(self, launcher):
        self.launcher = launcher
        self.kernel = kernel = launcher.kernel
        self.binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)

    def warm(self, *args, **kwargs):
        pass

    def __call__(self, grid, device, args, constexprs, num_warps, num_stages=None,
                 on_miss=None, maxnreg=None):  # fmt: skip
        opts = self.launcher._options(constexprs, num_warps, num_stages, maxnreg)
        bound, spec, options = self.binder(*args, **constexprs, **opts)
        options, signature, cexprs, attrs = self.kernel._pack_args(
            BACKEND, {**constexprs, **opts}, bound, spec, options
        )
        compiled = triton.compile(
            ASTSource(self.kernel, signature, cexprs, attrs), target=TARGET,
            options=options.__dict__,
        )  # fmt: skip
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            if os.environ.get("OFFLINE_REGS_CUBIN"):  # kept for nvdisasm -plr (live registers)
                with open(os.environ["OFFLINE_REGS_CUBIN"], "wb") as out:
                    out.write(compiled.asm["cubin"])
            usage = subprocess.run(
                [CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True
            ).stdout
        regs = int(re.search(r"REG:(\d+)", usage).group(1))
        stack = int(re.search(r"STACK:(\d+)", usage).group(1))
        alloc = -(-regs // 8) * 8  # registers are allocated in steps of 8 per thread
        shared = compiled.metadata.shared
        per_sm = min(
            65536 // (alloc * 32 * num_warps), 32, 64 // num_warps, 233472 // (shared + 1024)
        )  # 228 KB per SM, 1 KB reserved per block
        shown = {k: v for k, v in constexprs.items()
                 if k in ("BLOCK_N", "TAIL_N", "NUM_CHUNKS", "SPLIT", "ROWS_PER_PROGRAM",
                          "ROW_STAGES", "TILE_ROWS", "HOLD", "JOINT_ROW_SUMS", "PARTS")}  # fmt: skip
        print(f"{self.kernel.fn.__name__}: warps={num_warps} maxnreg={maxnreg} regs={regs} "
              f"stack={stack} shared={shared} programs/SM={per_sm} grid={grid} "
              f"{shown}")  # fmt: skip


ops._FWD = OfflineCompile(ops._FWD)
ops._BWD = OfflineCompile(ops._BWD)
ops._SUMS = OfflineCompile(ops._SUMS)
ops._ADD = OfflineCompile(ops._ADD)
ops._RED = OfflineCompile(ops._RED)


def run(direction, workload, n, dtype="bf16", res32=False, m=8448):
    d = DTYPES[dtype]
    x = torch.empty(m, n, dtype=d)
    w = torch.randn(n, dtype=d)
    b = torch.randn(n, dtype=d) if workload in ("ln", "drop_add_ln", "parallel") else None
    res = None
    if workload not in ("ln", "rms"):
        res = torch.empty(m, n, dtype=torch.float32 if res32 else d)
    x1 = w1 = b1 = None
    if workload == "parallel":
        x1, w1, b1 = torch.empty(m, n, dtype=d), torch.randn(n, dtype=d), torch.randn(n, dtype=d)
    p = 0.1 if workload in ("drop_add_ln", "parallel") else 0.0
    rms = workload in ("rms", "add_rms")
    stream = res.dtype if res is not None else d
    seeds = torch.zeros(2 * m, dtype=torch.int64) if p else None
    if direction == "fwd":
        # the seeds filled as an eager call's forward does (--seeds: read instead)
        fill = bool(p) and "--seeds" not in sys.argv
        ops.fused_norm_fwd(x, w, b, res, x1, w1, b1, None, None, seeds, 1e-6, p, rms, False, d,
                           stream, store_residual_out=res is not None, fill_seeds=fill)  # fmt: skip
    else:
        s = torch.empty(m, n, dtype=stream)
        dres = torch.empty(m, n, dtype=stream) if res is not None else None
        ops.fused_norm_bwd(x, s, w, b, w1, b1, torch.zeros(m), torch.ones(m),
                           dy1=x if x1 is not None else None, dresidual_out=dres, seeds=seeds,
                           dropout_p=p, is_rms_norm=rms, x_dtype=d,
                           residual_dtype=res.dtype if res is not None else None,
                           x1_dtype=d if x1 is not None else None)  # fmt: skip


if __name__ == "__main__":
    words = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(words) < 3 or words[0] not in ("fwd", "bwd"):
        sys.exit(__doc__)
    run(words[0], words[1], int(words[2]), words[3] if len(words) > 3 else "bf16",
        "--res32" in sys.argv)  # fmt: skip

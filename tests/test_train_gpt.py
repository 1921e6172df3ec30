"""The example GPT training script (examples/train_gpt.py): it trains, the fused norm trains the
same model as the torch norm, resumption is exact, and it runs under DDP.

Speed: on CPU the suite sets TRITON_INTERPRET=1, where the fused modules would run the (slow)
Triton interpreter, so the training tests set ``FUSED_NORM_BACKEND=torch``: they exercise the
``DropoutAddRMSNorm`` module and the script with the package's PyTorch path.
``test_parity_through_triton_interpreter`` runs the kernels themselves for a few steps of a
micro model.

Parity tolerance. fused and torch compute the same function, but two correct fp32 RMSNorms
round differently (reduction order, rsqrt vs 1/sqrt) by an ulp or so, and training amplifies
that. We measured the amplification with the torch model alone: tiny preset, dropout 0, 50
steps, ``nn.RMSNorm`` against two formulations that are exact in real arithmetic
(``rsqrt(sum(x*x) / N + eps)``, and fp64 rounded to fp32). Over 20 seeds x 2 the largest
per-step |loss difference| was 1.3e-5; 36 of the 40 runs stayed within 1e-6 (a few ulp of the
loss). ``PARITY_ATOL = 1e-4`` is 7.7x that worst case, and more than 100x below the subtlest bug
we injected into the torch norm (mean square over N-1: 1.3e-2; norm weight frozen: 1.9e-2;
dropout 0.1 left on: 4.7e-2; residual gradient dropped: 0.42; eps 1e-2: 0.48). The preset's lr
matters: at lr 2e-3 some seeds spike in loss after warm-up and the same measurement gave up to
4.6e-3, which is why the tiny preset uses 1e-3. The 2-process DDP run is held to the same bound:
it differs from one process only in the order of the gradient sums.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_gpt.py"
sys.path.insert(0, str(SCRIPT.parent))

import train_gpt  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402

PARITY_ATOL = 1e-4  # fp32; derivation in the module docstring
PARITY_ATOL_BF16 = 3e-2  # bf16 autocast (GPU); derivation in test_parity_cuda

# A model small enough for the Triton interpreter (well under a second a step).
MICRO = dict(
    model=dict(n_layer=1, n_head=2, n_embd=32, block_size=16),
    batch_size=4, lr=2e-3, steps=4, eval_every=100, eval_iters=1, ckpt_every=100,
)  # fmt: skip


def run(tmp_path, *flags, stop_at=None):
    """Train in this process; returns the summary (with ``history``)."""
    args = train_gpt.parse_args(["--out", str(tmp_path), "--device", "cpu", *flags])
    return train_gpt.train(args, stop_at=stop_at)


def max_abs_diff(a, b):
    assert len(a) == len(b), (len(a), len(b))
    diffs = [abs(x - y) for x, y in zip(a, b)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return diffs[worst], worst


def subprocess_env(**extra):
    env = {**os.environ, "FUSED_NORM_BACKEND": "torch", "PYTHONPATH": str(ROOT), **extra}
    env.pop("TRITON_INTERPRET", None)  # not needed with the torch backend; faster import
    return env


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("FUSED_NORM_BACKEND", "torch")


def test_models_identical_at_init():
    """Same seed -> the fused and torch models hold identical parameters under the same names."""
    sds = []
    for norm in ("fused", "torch"):
        torch.manual_seed(0)
        sds.append(GPT(GPTConfig(norm=norm)).state_dict())
    assert sds[0].keys() == sds[1].keys()
    for name in sds[0]:
        assert torch.equal(sds[0][name], sds[1][name]), name


def test_tiny_preset_trains_on_cpu(tmp_path, torch_backend):
    """60 steps of the tiny preset: loss falls, under 2 minutes, all outputs written."""
    t0 = time.perf_counter()
    summary = run(tmp_path, "--preset", "tiny", "--steps", "60", "--sample-len", "100")
    elapsed = time.perf_counter() - t0
    assert elapsed < 120, f"60 tiny steps took {elapsed:.0f} s"
    losses = summary["history"]["train"]
    assert len(losses) == 60
    first10, last10 = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last10 < first10 - 1.0, (first10, last10)
    assert summary["val_loss"] < summary["first_loss"] - 1.5
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    for key in ("first_loss", "final_loss", "val_loss", "tokens_per_s", "steps", "device", "norm"):
        assert on_disk[key] is not None, key
    assert on_disk["steps"] == 60 and on_disk["norm"] == "fused"
    for name in ("loss.png", "sample.txt", "ckpt.pt", "history.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert not (tmp_path / "ckpt.pt.tmp").exists()


def test_parity_fused_vs_torch(tmp_path, torch_backend):
    """dropout 0, one seed: fused and torch norms give the same 50-step loss trajectory."""
    fused = run(tmp_path / "f", "--norm", "fused", "--steps", "50", "--bench")
    ref = run(tmp_path / "t", "--norm", "torch", "--steps", "50", "--bench")
    diff, step = max_abs_diff(fused["history"]["train"], ref["history"]["train"])
    assert diff <= PARITY_ATOL, f"step {step}: |fused - torch| = {diff:.3g} > {PARITY_ATOL}"


def test_parity_through_triton_interpreter(tmp_path, monkeypatch):
    """The Triton kernels themselves (interpreted on CPU) inside the model, a few steps."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 is not set (on a GPU, test_parity_cuda runs the kernels)")
    monkeypatch.setitem(train_gpt.PRESETS, "micro", MICRO)
    monkeypatch.setenv("FUSED_NORM_BACKEND", "triton")
    fused = run(tmp_path / "f", "--preset", "micro", "--norm", "fused", "--bench")
    ref = run(tmp_path / "t", "--preset", "micro", "--norm", "torch", "--bench")
    diff, step = max_abs_diff(fused["history"]["train"], ref["history"]["train"])
    assert diff <= PARITY_ATOL, f"step {step}: |fused - torch| = {diff:.3g}"


def test_resume_equals_uninterrupted(tmp_path, torch_backend):
    """Stop at step 11 (as Ctrl-C would), resume: the trajectory is bitwise that of one run.

    Dropout is on, so this also checks that the random stream is replayed exactly.
    """
    flags = ["--steps", "20", "--dropout", "0.1", "--ckpt-every", "10", "--eval-every", "15",
             "--sample-len", "0"]  # fmt: skip
    whole = run(tmp_path / "whole", *flags)
    part = run(tmp_path / "part", *flags, stop_at=11)
    assert part["interrupted"] and part["steps"] == 11
    assert torch.load(tmp_path / "part" / "ckpt.pt", weights_only=True)["step"] == 11
    resumed = run(tmp_path / "part", *flags, "--resume")
    assert resumed["history"]["train"] == whole["history"]["train"]
    assert resumed["history"]["val"] == whole["history"]["val"]
    assert resumed["val_loss"] == whole["val_loss"]


@pytest.mark.slow
def test_ctrl_c_checkpoints_then_resumes(tmp_path):
    """A real SIGINT mid-run: checkpoint written, exit 130, --resume reproduces the full run."""
    flags = ["--device", "cpu", "--steps", "20", "--dropout", "0.1", "--log-every", "1",
             "--sample-len", "0", "--eval-every", "10"]  # fmt: skip
    env = subprocess_env()

    def script(out, *extra):
        return [sys.executable, str(SCRIPT), "--out", str(out), *flags, *extra]

    whole = subprocess.run(script(tmp_path / "whole"), env=env, capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr[-2000:]

    proc = subprocess.Popen(script(tmp_path / "part"), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    for line in proc.stdout:
        if line.startswith("step 5/"):
            proc.send_signal(signal.SIGINT)
            break
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    stopped_at = torch.load(tmp_path / "part" / "ckpt.pt", weights_only=True)["step"]
    assert 5 <= stopped_at < 20
    resumed = subprocess.run(script(tmp_path / "part", "--resume"), env=env, capture_output=True,
                             text=True)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = json.loads((tmp_path / "whole" / "history.json").read_text())
    b = json.loads((tmp_path / "part" / "history.json").read_text())
    assert b == a


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_ddp_matches_one_process(tmp_path, device, extra_env):
    """torchrun with 2 processes: replicas stay in sync, and since each rank takes its half of
    the same global batch, the trajectory matches one process within PARITY_ATOL."""
    flags = ["--device", device, "--precision", "fp32", "--steps", "20", "--eval-every", "10",
             "--sample-len", "0"]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(SCRIPT),
           "--out", str(tmp_path / "ddp"), *flags]  # fmt: skip
    proc = subprocess.run(cmd, env=subprocess_env(**extra_env), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert ddp["world_size"] == 2 and ddp["replicas_in_sync"] is True
    ddp_hist = json.loads((tmp_path / "ddp" / "history.json").read_text())

    single = run(tmp_path / "single", *flags)
    diff, step = max_abs_diff(ddp_hist["train"], single["history"]["train"])
    assert diff <= PARITY_ATOL, f"step {step}: |ddp - single| = {diff:.3g}"
    assert ddp_hist["train"][-1] < ddp_hist["train"][0] - 1.0


@pytest.mark.slow
def test_ddp_two_cpu_processes_gloo(tmp_path, torch_backend):
    """DDP over gloo on CPU, the way CI can run it."""
    extra = {"OMP_NUM_THREADS": "1"}  # two processes on two cores
    if sys.platform.startswith("linux"):
        extra["GLOO_SOCKET_IFNAME"] = "lo"  # hosts whose hostname does not resolve
    check_ddp_matches_one_process(tmp_path, "cpu", extra)


@pytest.mark.multigpu
def test_ddp_two_gpus_nccl(tmp_path):
    """DDP over NCCL, the fused norm on its Triton kernels (fp32 so the bound is the sharp one)."""
    check_ddp_matches_one_process(tmp_path, "cuda", {"FUSED_NORM_BACKEND": "auto"})


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_parity_cuda(tmp_path, precision):
    """On the GPU the fused norm runs its Triton kernels: 50 steps, dropout 0, against torch.

    fp32 is held to the CPU bound. Under bf16 autocast the normed activations are rounded to bf16
    before the next matmul, so an ulp of fp32 difference now and then flips a bf16 rounding
    (2^-8 relative). The same measurement as for PARITY_ATOL, run with CPU bf16 autocast (8 seeds
    x 2 formulations), gave at most 5.8e-3; PARITY_ATOL_BF16 is 5x that. The GPU amplifies more:
    on an H200 (torch 2.11, 2026-11-25) seed 0, the one run here, puts two correct torch
    formulations (nn.RMSNorm, and rsqrt of the mean square in fp32) 1.83e-2 apart at step 44 and
    fused 1.78e-2 from nn.RMSNorm but 5e-4 from the other; seeds 1-3 stay within 1.1e-3
    (variant log #82: git show 0825aa7:bench/NOTES.md). It catches gross errors only (the
    subtlest injected bug moves the loss by 1.3e-2): the fp32 run is the sharp check.
    """
    tol = PARITY_ATOL if precision == "fp32" else PARITY_ATOL_BF16
    flags = ["--device", "cuda", "--steps", "50", "--bench", "--precision", precision]
    fused = run(tmp_path / "f", *flags, "--norm", "fused")
    ref = run(tmp_path / "t", *flags, "--norm", "torch")
    diff, step = max_abs_diff(fused["history"]["train"], ref["history"]["train"])
    print(f"cuda {precision}: max |fused - torch| over 50 steps = {diff:.3g} at step {step}")
    if diff > tol:  # a failure: say what it depends on (it has failed once, not reproduced)
        why = diagnose_parity(tmp_path, flags, fused["history"]["train"], ref["history"]["train"])
        pytest.fail(f"step {step}: |fused - torch| = {diff:.3g} > {tol}\n{why}")


def diagnose_parity(tmp_path, flags, fused, ref) -> str:
    """Runs that tell a failed parity check's cause apart: the fused and torch runs again in
    this process, the fused run again with every plan and compiled-kernel cache of fused_norm
    emptied, and the fused run in a fresh process. Each run is bitwise reproducible on the GPU
    (variant log #82), so whichever of them differs from the first points at the cause."""
    from collections import defaultdict

    from fused_norm import ops

    lines = []

    def note(name, hist):
        d_self, s_self = max_abs_diff(hist, fused if "fused" in name else ref)
        d_ref, s_ref = max_abs_diff(hist, ref)
        lines.append(f"{name}: vs the first run of its norm {d_self:.3g} (step {s_self}), "
                     f"vs the first torch run {d_ref:.3g} (step {s_ref})")  # fmt: skip

    note("fused again", run(tmp_path / "f2", *flags, "--norm", "fused")["history"]["train"])
    note("torch again", run(tmp_path / "t2", *flags, "--norm", "torch")["history"]["train"])
    with pytest.MonkeyPatch.context() as mp:
        ops.clear_plans()  # every plan and call signature
        for name in ("_fused_norm_fwd_kernel", "_fused_norm_bwd_kernel", "_bwd_row_sums_kernel",
                     "_sum_partials_kernel", "_bwd_smem_kernel"):  # fmt: skip
            kernel = getattr(ops, name, None)
            if hasattr(kernel, "device_caches"):  # Triton's in-memory cache of compiled kernels
                mp.setattr(kernel, "device_caches", defaultdict(kernel.create_binder))
        hist = run(tmp_path / "f3", *flags, "--norm", "fused")["history"]["train"]
    note("fused, caches emptied", hist)
    out = tmp_path / "f4"
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), *flags, "--norm", "fused"]
    proc = subprocess.run(cmd, env=subprocess_env(FUSED_NORM_BACKEND="auto"), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    if proc.returncode == 0:
        note("fused, fresh process", json.loads((out / "history.json").read_text())["train"])
    else:
        lines.append(f"fused, fresh process: exit {proc.returncode}: {proc.stderr[-500:]}")
    return "\n".join(lines)


@pytest.mark.gpu
@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compile_smoke_cuda(tmp_path, scope):
    """--compile blocks / model with the fused norm (dropout on): trains, and the loss falls."""
    summary = run(tmp_path, "--device", "cuda", "--steps", "30", "--compile", scope, "--dropout",
                  "0.1", "--bench")  # fmt: skip
    assert summary["compile"] == scope
    losses = summary["history"]["train"]
    assert torch.isfinite(torch.tensor(losses)).all()
    assert losses[-1] < losses[0] - 1.0


def test_bench_gpt_table_orders_cells_and_rejects_unknown_scopes(tmp_path, monkeypatch, capsys):
    """bench_gpt.py: the table lists each preset's eager, blocks and model cells in that order
    whatever order they ran in, with fused / torch per cell; an unknown --compile scope is an
    error naming the option, before any run starts."""
    import bench_gpt

    def cell(rate, backend=None):
        return {"tokens_per_s": rate, "params": 10_800_000, "tokens_per_step": 16384,
                "precision": "bf16", "backend": backend, "peak_mem_gib": 1.5}  # fmt: skip

    rows = {(p, c): {"torch": cell(100.0), "fused": cell(rate, "triton")}
            for p, c, rate in [("small", "model", 103.0), ("small", "no", 101.0),
                               ("small", "blocks", 104.0)]}  # fmt: skip
    args = bench_gpt.argparse.Namespace(presets=["small"], timing_warmup=10, steps=60,
                                        repeats=1, dropout=0.1)  # fmt: skip
    env = {"device": "cpu", "torch": "t", "triton": "tr", "python": "3"}
    lines = [ln for ln in bench_gpt.markdown(rows, env, args, "today").splitlines()
             if ln.startswith("| small")]  # fmt: skip
    assert [ln.split("|")[4].strip() for ln in lines] == ["no", "blocks", "model"]
    assert [ln.split("|")[7].strip() for ln in lines] == ["1.01x", "1.04x", "1.03x"]

    ran = []
    monkeypatch.setattr(bench_gpt, "run_cell", lambda *a: ran.append(a) or {})
    with pytest.raises(SystemExit):
        bench_gpt.main([str(tmp_path / "out.md"), "--compile", "blocks,whole"])
    assert ran == []
    assert "--compile: 'whole'" in capsys.readouterr().err

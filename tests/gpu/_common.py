"""Shared pieces of the GPU integration tests: skip marks, tolerances, comparisons, workers.

The test files import this module by name; pytest's default ("prepend") import mode puts
``tests/gpu`` on ``sys.path`` because the folder has no ``__init__.py``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GPU_DIR = Path(__file__).resolve().parent
REPO_ROOT = GPU_DIR.parents[1]

HAS_CUDA = torch.cuda.is_available()
N_GPUS = torch.cuda.device_count() if HAS_CUDA else 0

# Every test here carries `gpu`; the lead's conftest skips `gpu` without CUDA, and the skipif
# below says so again so that these files also skip cleanly on their own.
requires_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]
requires_2gpus = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(N_GPUS < 2, reason=f"needs 2 CUDA GPUs, found {N_GPUS}"),
]

# Kernel (fp32 statistics, one rounding to the storage dtype) against the fp32 reference.
# bf16/fp16: a few units in the last place of the stored value (bf16 ulp = 2**-7 relative,
# fp16 ulp = 2**-10) plus an absolute floor for values near zero. fp32: the kernel and the
# reference sum rows and columns in different orders; for the sizes used here (N <= 1024
# columns, M <= a few hundred rows in a weight gradient) that is far below 1e-4.
TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 3e-2},
}


def _worst(actual: torch.Tensor, expected: torch.Tensor) -> str:
    diff = (actual.double() - expected.double()).abs()
    flat = int(diff.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    return (
        f"worst |diff| = {diff.max().item():.3e} at index {idx}: "
        f"actual {actual[idx].item():.6g}, expected {expected[idx].item():.6g}"
    )


def assert_close(actual, expected, name: str, atol: float, rtol: float) -> None:
    """|actual - expected| <= atol + rtol * |expected| elementwise; names the worst element."""
    assert actual is not None and expected is not None, f"{name}: missing tensor"
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    a, e = actual.detach().double(), expected.detach().double()
    ok = (a - e).abs() <= atol + rtol * e.abs()
    if not bool(ok.all()):
        raise AssertionError(
            f"{name}: {int((~ok).sum())} of {ok.numel()} elements outside "
            f"atol={atol:g}, rtol={rtol:g}; {_worst(a, e)}"
        )


def assert_close_dtype(actual, expected, name: str, dtype: torch.dtype) -> None:
    """assert_close with the TOL entry of ``dtype`` (the storage dtype of ``actual``)."""
    assert_close(actual, expected, name, **TOL[dtype])


def assert_bitwise(actual, expected, name: str) -> None:
    """Same shape, dtype and bits (NaNs compared by bits too)."""
    assert actual is not None and expected is not None, f"{name}: missing tensor"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    if actual.dtype == torch.bool:
        same = actual == expected
    else:
        # Compare the bit patterns, so -0.0 vs 0.0 and NaN payloads count as differences.
        int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        view = int_dtype[actual.element_size()]
        same = actual.contiguous().view(view) == expected.contiguous().view(view)
    if not bool(same.all()):
        raise AssertionError(
            f"{name}: {int((~same).sum())} of {same.numel()} elements differ bitwise; "
            f"{_worst(actual.float(), expected.float())}"
        )


def worker_env(**extra: str) -> dict:
    """Environment for a worker subprocess: the checkout importable, NCCL settings of the
    GPU machines (NVLink multicast off), plus ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.update(extra)
    return env


def worker_cmd(script: str, *args: str) -> list[str]:
    """Command line running ``tests/gpu/<script>`` with this interpreter."""
    return [sys.executable, str(GPU_DIR / script), *map(str, args)]


def run_worker(script: str, *args: str, timeout: float = 240.0) -> subprocess.CompletedProcess:
    """Run a worker script to completion; a non-zero exit fails the test with its output."""
    proc = subprocess.run(
        worker_cmd(script, *args), env=worker_env(), cwd=str(REPO_ROOT), timeout=timeout,
        capture_output=True, text=True,
    )  # fmt: skip
    return proc


def describe(proc) -> str:
    """The tail of a finished worker's output, for assertion messages."""
    return (
        f"exit code {proc.returncode}\n--- stdout (tail) ---\n{proc.stdout[-4000:]}"
        f"\n--- stderr (tail) ---\n{proc.stderr[-6000:]}"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process-group rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

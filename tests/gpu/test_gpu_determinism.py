"""Determinism: forward and backward (outputs, masks, every gradient, dW/dB included) are
bitwise identical across repeated runs in one process and across processes with the same seed.
"""

from __future__ import annotations

import importlib.util
import subprocess
from types import SimpleNamespace

import torch
from _common import (
    GPU_DIR,
    REPO_ROOT,
    assert_bitwise,
    describe,
    requires_gpu,
    worker_cmd,
    worker_env,
)

pytestmark = requires_gpu


def _load_worker():
    spec = importlib.util.spec_from_file_location(
        "_worker_determinism", GPU_DIR / "_worker_determinism.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker()


def _assert_same(a: dict, b: dict, what: str) -> None:
    for config in worker.CONFIGS:
        assert a[config].keys() == b[config].keys(), f"{what} {config}: different outputs"
        for name in a[config]:
            assert_bitwise(a[config][name], b[config][name], f"{what} {config}/{name}")


def test_repeated_runs_are_bitwise_identical():
    first = worker.run_all(seed=7)
    second = worker.run_all(seed=7)
    _assert_same(first, second, "run 1 vs run 2:")
    other = worker.run_config("ln_bf16_residual_dropout", seed=8)
    assert not torch.equal(other["mask0"].cpu(), first["ln_bf16_residual_dropout"]["mask0"]), (
        "a different seed drew the same dropout mask"
    )


def test_processes_with_same_seed_are_bitwise_identical(tmp_path):
    paths = [tmp_path / f"run{i}.pt" for i in range(2)]
    # Both processes at once: their kernels and allocations interleave on the GPU, which must
    # not matter either.
    procs = [
        subprocess.Popen(
            worker_cmd("_worker_determinism.py", "7", str(p)),
            env=worker_env(),
            cwd=str(REPO_ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for p in paths
    ]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=240)
        done = SimpleNamespace(returncode=proc.returncode, stdout=stdout, stderr=stderr)
        assert proc.returncode == 0, describe(done)
    runs = [torch.load(p) for p in paths]
    _assert_same(runs[0], runs[1], "process 1 vs process 2:")
    _assert_same(runs[0], worker.run_all(seed=7), "process 1 vs this process:")

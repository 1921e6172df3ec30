"""Data/model parallel: a small pre-norm model of our modules trains one step under DDP and
FSDP2 (``fully_shard``) on two GPUs, with gradients and updated parameters equal to the same
step on one GPU over the whole batch, within fp32 reduction-order tolerance."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from _common import REPO_ROOT, describe, free_port, requires_2gpus, worker_cmd, worker_env

# One worker under pytest-xdist: the module's fixture starts one two-process run for both modes.
pytestmark = [*requires_2gpus, pytest.mark.xdist_group("distributed")]


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    """Both modes in one two-process run (one process-group start-up); rank 0's JSON report."""
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    out = tmp_path_factory.mktemp("distributed") / "results.json"
    proc = subprocess.run(
        worker_cmd("_worker_distributed.py", str(free_port()), str(out)), env=worker_env(),
        cwd=str(REPO_ROOT), timeout=300, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"distributed worker failed\n{describe(proc)}", pytrace=False)
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_gpu_step_matches_single_gpu(mode, distributed_results):
    report = distributed_results[mode]
    bad = [
        f"{kind} {name}: error {r['err']:.3e} > tolerance {r['tol']:.3e}"
        for kind in ("grad", "param")
        for name, r in report[kind].items()
        if not r["err"] <= r["tol"]
    ]
    assert report["grad"], "no parameters were compared"
    assert not bad, f"{mode} vs one GPU:\n" + "\n".join(bad)

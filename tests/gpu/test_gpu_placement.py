"""Device placement: tensors on ``cuda:1`` are computed on ``cuda:1`` (device guard, outputs and
scratch on the input's device, the device's current stream), and tensors on different devices
get a ValueError/TypeError naming the argument."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from _common import N_GPUS, describe, requires_gpu, worker_cmd, worker_env

from fused_norm import LayerNorm, layer_norm_fn, rms_norm_fn

# One worker under pytest-xdist: the module's fixture starts one worker process for all tests.
pytestmark = [*requires_gpu, pytest.mark.xdist_group("placement")]

M, N = 32, 256


@pytest.mark.parametrize(
    "arg", ["weight", "bias", "residual", "x1", "weight1"], ids=lambda a: f"{a}_on_cpu"
)
def test_cpu_tensor_with_cuda_input_is_refused(arg):
    x = torch.randn(M, N, device="cuda")
    kwargs = {
        "weight": torch.ones(N, device="cuda"),
        "bias": torch.zeros(N, device="cuda"),
        "residual": torch.randn(M, N, device="cuda"),
        "x1": torch.randn(M, N, device="cuda"),
        "weight1": torch.ones(N, device="cuda"),
    }
    kwargs[arg] = kwargs[arg].cpu()
    with pytest.raises((ValueError, TypeError), match=arg):
        layer_norm_fn(x, **kwargs)
    torch.cuda.synchronize()  # nothing was launched with a host pointer


def test_cpu_module_with_cuda_input_is_refused():
    with pytest.raises((ValueError, TypeError), match="weight"):
        LayerNorm(N)(torch.randn(M, N, device="cuda"))
    with pytest.raises((ValueError, TypeError), match="x"):
        rms_norm_fn(torch.randn(M, N), torch.ones(N, device="cuda"), None)


# ----------------------------------------------------------------------------- two GPUs

_CHECKS = [
    "check_functional_on_cuda1",
    "check_modules_on_cuda1",
    "check_current_stream_of_cuda1",
    "check_mixed_device_errors",
]


@pytest.fixture(scope="module")
def placement_results(tmp_path_factory):
    """Run every two-GPU check once, in a process of its own; {check name: record}."""
    out = tmp_path_factory.mktemp("placement") / "results.jsonl"
    proc = subprocess.run(
        worker_cmd("_worker_placement.py", str(out)), env=worker_env(), timeout=240,
        capture_output=True, text=True,
    )  # fmt: skip
    records = {}
    if out.exists():
        for line in out.read_text().splitlines():
            rec = json.loads(line)
            records[rec["check"]] = rec
    return records, proc


@pytest.mark.multigpu
@pytest.mark.skipif(N_GPUS < 2, reason=f"needs 2 CUDA GPUs, found {N_GPUS}")
@pytest.mark.parametrize("check", _CHECKS)
def test_two_gpu_placement(check, placement_results):
    records, proc = placement_results
    if check not in records:
        pytest.fail(f"{check} did not report (worker crashed before it?)\n{describe(proc)}")
    rec = records[check]
    assert rec["ok"], f"{check} failed in the worker:\n{rec['detail']}"

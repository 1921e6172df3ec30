"""Test setup. Without a GPU the kernels run in the Triton interpreter on CPU tensors; that
needs TRITON_INTERPRET=1 before Triton decorates them, i.e. before fused_norm is imported."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# Kernel tests run on the GPU when there is one, else on CPU tensors through the interpreter.
DEVICE = "cuda" if HAS_CUDA else "cpu"

settings.register_profile("ci", deadline=None, print_blob=True, derandomize=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    n_gpus = torch.cuda.device_count() if HAS_CUDA else 0
    skip_multi = pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {n_gpus}")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        elif "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same torch RNG state."""
    torch.manual_seed(0)
    yield


@pytest.fixture
def device():
    return DEVICE


def pytest_terminal_summary(terminalreporter):
    """Print how many hypothesis examples each property test ran (counted by the tests)."""
    import sys

    helpers = sys.modules.get("_helpers")
    counts = getattr(helpers, "EXAMPLE_COUNTS", None)
    if not counts:
        return
    terminalreporter.section("hypothesis examples run")
    for name, n in sorted(counts.items()):
        terminalreporter.write_line(f"{name}: {n}")
    terminalreporter.write_line(f"total: {sum(counts.values())}")

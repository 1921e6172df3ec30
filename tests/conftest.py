"""Test setup. Without a GPU the kernels run in the Triton interpreter on CPU tensors; that
needs TRITON_INTERPRET=1 before Triton decorates them, i.e. before fused_norm is imported."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist workers share the cores: each takes its share of CPU threads (it and the scripts
# it starts), unless OMP_NUM_THREADS says otherwise. On a 2-core machine, two workers of two
# threads each ran two training tests 2.5x and 3.5x slower than with one thread each.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from hypothesis import settings  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# Kernel tests run on the GPU when there is one, else on CPU tensors through the interpreter.
DEVICE = "cuda" if HAS_CUDA else "cpu"

settings.register_profile("ci", deadline=None, print_blob=True, derandomize=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


N_GPUS = torch.cuda.device_count() if HAS_CUDA else 0
# Why tests marked `gpu` / `multigpu` are left out on this machine (None: they run). They are
# deselected, not skipped: a CPU run would otherwise open with hundreds of `s`.
_GPU_WHY = None if HAS_CUDA else "no CUDA device (run `make gpu-test` on a GPU machine)"
_MULTI_WHY = None if N_GPUS >= 2 else f"only {N_GPUS} CUDA device, they need 2"
# marker -> how many of its tests this process deselected; under pytest-xdist each worker
# deselects the same ones and hands its counts to the controller (pytest_testnodedown).
_DESELECTED: dict = {}


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        needs_gpu = any(item.get_closest_marker(m) for m in ("gpu", "multigpu"))
        if _GPU_WHY and needs_gpu:
            marker = "gpu"  # without CUDA, the multi-GPU tests are counted here too
        elif _MULTI_WHY and item.get_closest_marker("multigpu"):
            marker = "multigpu"
        else:
            keep.append(item)
            continue
        drop.append(item)
        _DESELECTED[marker] = _DESELECTED.get(marker, 0) + 1
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same torch RNG state."""
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _cuda_memory(request):
    """On a GPU: each test's peak allocation goes into the junit report (`cuda_peak_gib`), and
    under pytest-xdist, whose workers share the card (scripts/gpu_test.sh), the blocks torch's
    allocator cached for a test are released after it: kept, they made the workers' idle caches
    add up until a test ran out of memory (8 workers on an 80 GB H100 held 79 GiB, 2026-11-28)."""
    if HAS_CUDA and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    yield
    if HAS_CUDA and torch.cuda.is_initialized():
        peak = torch.cuda.max_memory_allocated() / 2**30
        request.node.user_properties.append(("cuda_peak_gib", round(peak, 2)))
        if os.environ.get("PYTEST_XDIST_WORKER"):
            torch.cuda.empty_cache()


@pytest.fixture
def device():
    return DEVICE


def _example_counts() -> dict:
    """This process's hypothesis example counts (tests/_helpers.py counts them)."""
    import sys

    return dict(getattr(sys.modules.get("_helpers"), "EXAMPLE_COUNTS", None) or {})


# Under pytest-xdist (`make test`) the tests run in worker processes: each hands its counts to
# the controller when it finishes, which prints their sum.
_WORKER_COUNTS: dict = {}


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)  # set on xdist workers only
    if workeroutput is not None:
        workeroutput["example_counts"] = _example_counts()
        workeroutput["deselected"] = dict(_DESELECTED)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    output = getattr(node, "workeroutput", {})
    for name, n in output.get("example_counts", {}).items():
        _WORKER_COUNTS[name] = _WORKER_COUNTS.get(name, 0) + n
    for marker, n in output.get("deselected", {}).items():  # the same on every worker
        _DESELECTED[marker] = max(_DESELECTED.get(marker, 0), n)


def pytest_terminal_summary(terminalreporter):
    """Print how many GPU tests were deselected and why, and how many hypothesis examples each
    property test ran (counted by the tests)."""
    for marker, why, what in (("gpu", _GPU_WHY, "GPU"), ("multigpu", _MULTI_WHY, "multi-GPU")):
        if _DESELECTED.get(marker):
            terminalreporter.write_line(
                f"fused_norm: {_DESELECTED[marker]} {what} tests deselected: {why}"
            )
    counts = _example_counts()
    for name, n in _WORKER_COUNTS.items():
        counts[name] = counts.get(name, 0) + n
    if not counts:
        return
    terminalreporter.section("hypothesis examples run")
    for name, n in sorted(counts.items()):
        terminalreporter.write_line(f"{name}: {n}")
    terminalreporter.write_line(f"total: {sum(counts.values())}")

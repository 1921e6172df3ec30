"""Launch heuristics and the few device-specific choices, as small pure functions.

Everything that depends on the kind of device lives here: the block size and warp count for a
row width, the backward's program count, the multiprocessor count, and the device guard.
Thresholds name the measurement behind them (bench/NOTES.md has the runs).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton

# Widest row held whole in registers, in bytes of the widest row tensor read. Beyond it the
# kernels loop over chunks of MAX_BLOCK_BYTES. 64 KB is where register-resident rows stop paying
# on Hopper (flash-attn and Liger cap there too); see bench/NOTES.md.
MAX_BLOCK_BYTES = 65536

# Programs per multiprocessor in the backward's persistent grid.
BWD_PROGRAMS_PER_SM = 2

# Program count used where the device reports no multiprocessors (the CPU interpreter).
FALLBACK_SM_COUNT = 4


def block_config(n_cols: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_N, NUM_CHUNKS, num_warps) for a row of ``n_cols`` elements of ``elem_bytes``.

    The block is the next power of two, capped at MAX_BLOCK_BYTES; warps grow with the block.
    """
    max_block = max(MAX_BLOCK_BYTES // elem_bytes, 1)
    block_n = min(triton.next_power_of_2(max(n_cols, 1)), max_block)
    num_chunks = triton.cdiv(n_cols, block_n)
    # About 8 elements per thread per row tensor at 256 threads per 2K columns; capped at 16
    # warps (a Hopper SM runs 64, so several rows stay in flight).
    num_warps = min(max(block_n // 256, 1), 16)
    return block_n, num_chunks, num_warps


def bwd_num_programs(n_rows: int, device: torch.device) -> int:
    """Size of the backward's persistent grid: a small multiple of the SM count, at most M."""
    return max(min(sm_count(device) * BWD_PROGRAMS_PER_SM, n_rows), 1)


def sm_count(device: torch.device) -> int:
    """Multiprocessor count of ``device`` (not of ``cuda:0``), or a fallback."""
    return _sm_count(device.type, device.index)


@functools.lru_cache(maxsize=None)
def _sm_count(device_type: str, index) -> int:
    module = getattr(torch, device_type, None)
    get_props = getattr(module, "get_device_properties", None)
    if get_props is None or device_type == "cpu":
        return FALLBACK_SM_COUNT
    props = get_props(index if index is not None else module.current_device())
    # CUDA and ROCm: multi_processor_count; Intel XPU: gpu_subslice_count.
    for name in ("multi_processor_count", "gpu_subslice_count"):
        count = getattr(props, name, None)
        if count:
            return int(count)
    return FALLBACK_SM_COUNT


def device_guard(device: torch.device):
    """Make ``device`` current so Triton launches there, on that device's current stream."""
    module = getattr(torch, device.type, None)
    if device.type == "cpu" or module is None or not hasattr(module, "device"):
        return contextlib.nullcontext()
    return module.device(device)

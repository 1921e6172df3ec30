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

# The backward holds more per column (w, s, dy and one fp32 partial per parameter gradient), so
# its registers run out sooner. Sweeps of 2026-11-22 (H200, bf16): with one partial (RMSNorm, no
# bias) 16K columns in one block ran at 92% of copy, 32K at 24% (spills); with two (LayerNorm
# with bias) 16K in one block ran at 40%, as two 8K chunks at 50%.
BWD_MAX_BLOCK_BYTES = 32768
BWD_MAX_BLOCK_BYTES_MULTI = 16384  # two or more partial-gradient vectors

# Program count used where the device reports no multiprocessors (the CPU interpreter).
FALLBACK_SM_COUNT = 4

# Resident warps per SM that the backward's persistent grid aims for. Each program walks its rows
# one after another, so rows in flight = programs; 32 warps/SM was the best of {1, 2, 4}
# programs/SM x {4..32} warps at N = 1K..16K (bench/NOTES.md, sweep of 2026-11-22, H200).
BWD_WARPS_PER_SM = 32


def block_config(n_cols: int, elem_bytes: int, max_bytes: int = 0) -> tuple[int, int]:
    """(BLOCK_N, NUM_CHUNKS) for a row of ``n_cols`` elements, ``elem_bytes`` the widest dtype.

    The block is the next power of two (at least 4: dropout draws random numbers four columns at
    a time), capped at MAX_BLOCK_BYTES; wider rows are processed in NUM_CHUNKS chunks.
    """
    max_block = max((max_bytes or MAX_BLOCK_BYTES) // elem_bytes, 4)
    block_n = max(min(triton.next_power_of_2(max(n_cols, 1)), max_block), 4)
    return block_n, triton.cdiv(n_cols, block_n)


def fwd_num_warps(block_n: int, num_chunks: int = 1) -> int:
    """Warps per forward program (one row each).

    Sweeps of 2026-11-22 (H200, bf16; add+RMSNorm and dropout+add+LayerNorm prenorm): 1 warp at
    N=256 (4 warps: -7 points), 4 at 1K (16 warps: 63% of copy vs 99.8%), 8 at 4K-8K (dropout+LN
    at 8K: 93% vs 80% with 16), 16 at 16K-32K (67% vs 64% with 32), 32 for chunked rows.
    """
    if num_chunks > 1:
        return 32
    if block_n <= 1024:
        return max(block_n // 256, 1)
    return {2048: 4, 4096: 8, 8192: 8}.get(block_n, 16)


def bwd_num_warps(block_n: int) -> int:
    """Warps per backward program. Same sweeps: 4 at N=1K (87% of copy), 8 at 4K (92%), 32 at
    16K (91%; LayerNorm with dropout spilled registers at 16 warps), 16 for 8K chunks."""
    return min(max(block_n // 512, 4), 32)


# Wide-row backward: bytes of (s, dy) per program that one row group may span. Groups small
# enough for their rows to be re-read from L2 (256 KB per program) measured 10-30% slower than
# one group of all the program's rows at N = 16K..256K (the partials' read-modify-write costs
# more than the re-read saves), so by default a group is all of them.
BWD_GROUP_BYTES = 2**40


def bwd_row_group(n_cols: int, elem_bytes: int) -> int:
    """Rows per group of the wide-row backward (>= 1); see BWD_GROUP_BYTES."""
    return max(BWD_GROUP_BYTES // (2 * n_cols * elem_bytes), 1)


def bwd_num_programs(n_rows: int, device: torch.device, num_warps: int) -> int:
    """Size of the backward's persistent grid: BWD_WARPS_PER_SM worth of programs, at most M."""
    per_sm = max(BWD_WARPS_PER_SM // num_warps, 1)
    return max(min(sm_count(device) * per_sm, n_rows), 1)


@torch.compiler.assume_constant_result
def sm_count(device: torch.device) -> int:
    """Multiprocessor count of ``device`` (not of ``cuda:0``), or a fallback.

    A constant to torch.compile: it is read once while tracing, not traced into."""
    return _sm_count(device.type, device.index)


@functools.cache
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

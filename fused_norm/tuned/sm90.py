# The table bench/tune.py writes: regenerate it rather than edit it (docs/tuning.md).
# Seed entries: the per-row choices measured on an NVIDIA H200 (torch 2.11.0+cu130, triton 3.6.0,
# 2026-11-22..26) that beat the rules by >= 3% there, carried over from the pre-redesign tuning
# log (git show 0825aa7:bench/NOTES.md); not yet re-derived by bench/tune.py on this code.
# Keys: (direction, kind, dtype tag, width: exact columns or "pad<P>" for rows in one padded
# block of P columns). Values override the rule's plan (heuristics.forward_plan/backward_plan).

TABLE = {
    # Norms of x alone: two sweeps over chunks, sums per column lane (+3.5-7.9%)
    ("fwd", "ln", "e16", "pad16384"): {"chunk": 4096, "warps": 16},
    ("fwd", "ln", "e16", "pad32768"): {"chunk": 8192, "warps": 32, "unroll": True},
    ("fwd", "rms", "e16", "pad4096"): {"chunk": 2048, "warps": 8},
    ("fwd", "rms", "e16", "pad8192"): {"chunk": 4096, "warps": 16},
    ("fwd", "rms", "e16", 12288): {"chunk": 4096, "warps": 16},
    ("fwd", "rms", "e16", "pad16384"): {"chunk": 8192, "warps": 16},
    ("fwd", "rms", "e16", "pad32768"): {"chunk": 8192, "warps": 32},
    # Rows whose masks measured faster than the constant width (+4.9-7.9%)
    ("fwd", "drop_ln", "bf16", 12288): {"full_row": False},
    ("fwd", "ln", "bf16_w32", 8192): {"full_row": False},
    # Split rows that fold their width (+3.2%)
    ("fwd", "ln", "fp16", 262144): {"full_row": True},
    # One 16K block of 4-byte elements with dropout or x1 (+5-10%)
    ("fwd", "drop", "16_res32", "pad16384"): {"warps": 16, "maxnreg": 64},
    ("fwd", "drop", "fp32", "pad16384"): {"warps": 32, "maxnreg": 80},
    ("fwd", "x1", "16_res32", "pad16384"): {"warps": 32, "maxnreg": 64},
    # The x1 path's 16-bit rows beside fp32 weights (+3.8-8.9%)
    ("fwd", "x1", "16_w32", "pad8192"): {"warps": 16},
    ("fwd", "x1", "16_w32", "pad16384"): {"warps": 32, "maxnreg": 96},
    # The x1 path's fp16 stream held in 16 bits across the wait, 64 parts (+3.8%)
    ("fwd", "x1", "fp16", 262144): {"hold": True},
    # LayerNorm of 16-bit x beside fp32 weights splits from 32 KB (+29-30%)
    ("fwd", "ln", "16_w32", "pad32768"): {"part": 4096},
    # fp32 LayerNorm in at most 16 parts: 4 warps (+10.7%)
    ("fwd", "ln", "fp32", "pad32768"): {"warps": 4},
    # RMSNorm of 16-bit x in 16 parts: 4 warps (+3.0-3.7%)
    ("fwd", "rms", "16", 65536): {"warps": 4},
    # Dropout parts of 2K fp32-stream columns: 2 warps (+5.8-7.6%)
    ("fwd", "drop", "16_res32", 65536): {"warps": 2},
    ("fwd", "drop", "16_res32", 131072): {"warps": 2},
    # fp32 RMSNorm split rows keep a filled workspace (+3.3%)
    ("fwd", "rms", "fp32", "pad131072"): {"ws_fill": True},
    ("fwd", "rms", "fp32", "pad262144"): {"ws_fill": True},
    # Backward: add + RMSNorm of 4-byte rows (+8-16%)
    ("bwd", "add_rms", "e32", "pad4096"): {"warps": 16},
    ("bwd", "add_rms", "e32", "pad16384"): {"warps": 8},
    # The x1 path with dropout at 2K, without it in 4-byte rows at 1K: 4 warps
    ("bwd", "x1drop", "any", "pad2048"): {"warps": 4},
    ("bwd", "x1", "e32", "pad1024"): {"warps": 4},
    # fp16 RMSNorm's 8K block capped at 128 registers: two programs an SM (+24-36%)
    ("bwd", "rms", "fp16", "pad8192"): {"maxnreg": 128},
    # Whole waves of resident programs instead of one (+3.5-5.6%)
    ("bwd", "rms", "any", "pad4096"): {"whole_waves": True},
    ("bwd", "drop_ln", "any", "pad512"): {"whole_waves": True},
}

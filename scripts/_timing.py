"""Host time of back-to-back calls, shared by scripts/profile_overhead.py and host_floor.py."""

import time

import torch


def per_call(fn, calls=300, reps=7):
    """Median over reps of the mean host time per call of `calls` back-to-back calls (us)."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return sorted(times)[reps // 2]

"""Device time of one call, from CUDA events: what the benches' per-call figures are."""

from __future__ import annotations

import torch


def median_call_ms(fn, repeats: int, warmup: int = 0) -> float:
    """The median over `repeats` calls of `fn` of the device time between an event recorded before
    the call and one after it, in ms; `warmup` untimed calls first (kernels load on first use)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]

"""Timing helpers shared by ``bench_gemv.py`` and ``bench_attention.py``.

* :func:`graph_per_call_us` - per-call GPU time of ``reps`` calls captured in one CUDA graph
  (calls rotate over ``copies`` independent operands, so a graph streams more than L2
  holds), the median of 15 replays timed with CUDA events.
* :func:`copy_tbps` - the device-to-device copy ceiling (1 GiB each way), measured in the
  calling run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_per_call_us(fn: Callable[[int], None], copies: int = 1, reps: int = 20) -> float:
    """Median time per call of ``fn(i % copies)`` for ``i < reps``, captured in one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i % copies)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    times.sort()
    return times[len(times) // 2]


def copy_tbps() -> float:
    """Device-to-device copy bandwidth (TB/s, bytes read + written) of 1 GiB."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        b.copy_(a)
    e1.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (e0.elapsed_time(e1) * 1e-3) / 1e12

"""Helpers the benchmark scripts share: host wall-clock medians, PyTorch-with-CUDA detection and timing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall-clock seconds of `repeats` calls of `fn`."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cuda_torch() -> Any:
    """The `torch` module when PyTorch is installed and sees a CUDA device, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def torch_time_us(torch: Any, fn: Callable[[], object], reps: int, warmup: int = 5) -> float:
    """Median microseconds of `fn` on the GPU, timed by CUDA events, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)

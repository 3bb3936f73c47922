"""Helpers the benchmark scripts share: host wall-clock medians, GPU time per call through a replayed command
graph or the device profiler's timestamps, PyTorch-with-CUDA detection and timing."""

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


def replay_us(dev: Any, run: Callable[[], object], reps: int, per_graph: int = 100) -> float:
    """Median GPU microseconds per call of `run`, free of host cost: `per_graph` calls are captured into one
    command graph (with the barriers their buffers need, as in a decode step), which is replayed `reps` times
    with a wait each; the submit and wait (tens of microseconds) are shared by all `per_graph` calls."""
    graph = capture_graph(dev, run, per_graph)
    try:
        return replay_many_us(dev, {0: graph}, reps, per_graph)[0]
    finally:
        graph.destroy()


def capture_graph(dev: Any, run: Callable[[], object], per_graph: int = 100) -> Any:
    """`per_graph` calls of `run` captured into one command graph, after three uncaptured calls that compile and
    warm up; the caller destroys it."""
    for _ in range(3):
        run()
    dev.synchronize()
    q = dev.queue
    q.begin_capture()
    try:
        for _ in range(per_graph):
            run()
    except BaseException:
        q.abort_capture()
        raise
    graph = q.end_capture()
    dev.synchronize()
    return graph


def replay_many_us(dev: Any, graphs: dict, rounds: int, per_graph: int = 100) -> dict:
    """Median microseconds per call of each graph of `per_graph` calls (capture_graph), by key: the graphs are
    replayed in turn, a wait each, `rounds` times after a round of warm-up, so that drift of the clocks between
    them falls on all alike."""
    q = dev.queue
    times: dict = {key: [] for key in graphs}
    for _ in range(rounds + 1):
        for key, graph in graphs.items():
            t = time.perf_counter()
            q.wait(graph.replay())
            times[key].append(time.perf_counter() - t)
    return {key: statistics.median(ts[1:]) / per_graph * 1e6 for key, ts in times.items()}


def device_events(dev: Any, run: Callable[[], object], reps: int, warmup: int = 10) -> list[tuple[str, float, float]]:
    """The device profiler's (kernel name, start ns, end ns) of `reps` consecutive calls of `run`, after `warmup`
    untimed ones; empty where the device takes no timestamps. The process must set VKGRAPH_PROFILE=1 before the
    device starts. The profiler is left empty, so that no table prints at exit."""
    for _ in range(warmup):
        run()
    dev.synchronize()
    prof = dev.queue.profiler
    prof.events.clear()
    for _ in range(reps):
        run()
    dev.synchronize()
    ev = list(prof.events)
    prof.events.clear()
    return ev


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


def raise_clocks(seconds: float = 1.5) -> None:
    """Keep the GPU busy with float16 4096^3 products for about `seconds`: an idle H200 sits at 345 MHz and
    needs sustained load before its clocks reach what a timed run should see (short bursts measured 4x slow).
    Nothing on a CPU device (lavapipe), where one such product takes minutes."""
    import numpy as np

    from vkgraph.dtype import dtypes
    from vkgraph.runtime import get_device
    from vkgraph.tensor import Tensor

    dev = get_device()
    if dev.info.device_type == "cpu":
        return
    w = Tensor(np.random.default_rng(0).standard_normal((4096, 4096), dtype=np.float32)).cast(dtypes.float16)
    w = w.realize()
    _keep_busy(lambda: (w @ w).realize(), dev.synchronize, seconds)


def raise_torch_clocks(torch: Any, seconds: float = 1.5) -> None:
    """`raise_clocks` for a PyTorch reference: float16 4096^3 products on the CUDA device for about `seconds`."""
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    _keep_busy(lambda: w @ w, torch.cuda.synchronize, seconds)


def _keep_busy(product: Callable[[], object], sync: Callable[[], object], seconds: float) -> None:
    """Call `product` in bursts of 20, each waited for by `sync`, for about `seconds`."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            product()
        sync()

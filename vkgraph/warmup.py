"""`vkgraph.warmup(fn, *args)`: run a function once so that every program it needs is compiled and on disk.

A first run compiles each kernel (GLSL to SPIR-V, then a pipeline for the device); the SPIR-V goes to the disk
cache as it is made and the driver's pipeline cache is written when the device closes. warmup() runs `fn` to the
end (every Tensor it returns realized, the GPU waited for) and writes the pipeline cache at once, so a later
process (or this one, timed) starts warm. `python -m vkgraph.generate --warmup` does this for a model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .flags import flag
from .runtime import get_device


@dataclass(frozen=True)
class Warmup:
    """What a warm-up did: `seconds` in all, of which `compile_seconds` compiling; `pipelines` created and
    `spirv_compiled` programs compiled from GLSL (the rest came from the disk cache: `spirv_from_disk`)."""

    seconds: float
    compile_seconds: float
    pipelines: int
    spirv_compiled: int
    spirv_from_disk: int
    cache_dir: str | None  # where the caches are (None: VKGRAPH_DISK_CACHE=0, nothing kept)
    result: Any


def warmup(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Warmup:
    """Call fn(*args, **kwargs) once, realize every Tensor in its result (nested in lists, tuples, dicts), wait
    for the GPU and write the device's pipeline cache to disk (VKGRAPH_CACHE_DIR, unless VKGRAPH_DISK_CACHE=0).
    Returns what it compiled and how long that took; `result` is fn's return value."""
    from .jit import _tensors_in
    from .tensor import realize_all

    dev = get_device()
    clock, pipes, stats = dev.pipelines.clock, dev.pipelines, dev.compiler.stats
    c0, p0, m0, d0 = clock.seconds, pipes.built, stats.misses, stats.disk_hits
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    realize_all(*_tensors_in(result))
    dev.synchronize()
    pipes.save_cache()
    return Warmup(time.perf_counter() - t0, clock.seconds - c0, pipes.built - p0, stats.misses - m0,
                  stats.disk_hits - d0, flag("VKGRAPH_CACHE_DIR") if flag("VKGRAPH_DISK_CACHE") else None, result)

"""vkgraph: a lazy tensor compiler for Vulkan.

    from vkgraph import Tensor
    y = (Tensor([1.0, 2.0]) * 3).exp().sum()   # lazy: a graph of nodes
    print(y.item())                             # fused into one kernel, compiled, run, read back
"""

from typing import Any

from . import caches
from .autograd import enable_grad, no_grad
from .dtype import DType, dtypes
from .einsum import einsum
from .graph import Variable
from .jit import jit
from .runtime import (
    CaptureError,
    CompileError,
    DeviceError,
    OutOfDeviceMemory,
    VkgraphError,
    current_device,
    get_device,
)
from .tensor import Tensor, cat, custom, manual_seed, realize_all, stack, where
from .warmup import Warmup, warmup

__all__ = [
    "CaptureError", "CompileError", "DType", "DeviceError", "OutOfDeviceMemory", "Tensor", "Variable",
    "VkgraphError", "cat", "custom", "dtypes", "get_device", "jit", "manual_seed", "realize_all", "stack", "where",
    "clear_caches", "stats", "einsum", "enable_grad", "no_grad", "Warmup", "warmup",
]


def stats() -> dict[str, Any]:
    """What vkgraph holds and how well it reuses it: every cache by name (size, capacity, hits, misses, evictions;
    docs/architecture.md lists them) and, if a device is open, its counters (queue, Vulkan objects, buffer pool,
    shader compiles)."""
    out: dict[str, Any] = {"caches": caches.stats()}
    dev = current_device()
    if dev is not None:
        out["device"] = dev.stats()
    return out


def clear_caches() -> None:
    """Empty every cache (compiled programs are compiled again on next use; the disk caches stay)."""
    caches.clear()

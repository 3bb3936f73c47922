"""Checks and launch arithmetic shared by the template ops."""

from __future__ import annotations

import weakref
from typing import Any

from ..flags import flag
from ..runtime import Device


def check_buffer(name: str, buf: Any, nbytes: int) -> None:
    """Raise ValueError unless `buf` is a Buffer/BufferView of at least `nbytes` bytes."""
    size = getattr(buf, "size", None)
    if size is None or not hasattr(buf, "alloc"):
        raise TypeError(f"{name}: expected a runtime Buffer or BufferView, got {type(buf).__name__}")
    if size < nbytes:
        raise ValueError(f"{name}: buffer of {size} bytes is smaller than the {nbytes} bytes required")


def check_binding_range(dev: Device, name: str, nbytes: int) -> None:
    """Raise ValueError if a binding of `nbytes` exceeds what the device can bind as one storage buffer."""
    limit = dev.info.max_storage_buffer_range
    if nbytes > limit:
        raise ValueError(f"{name}: {nbytes} bytes exceed the device's maxStorageBufferRange of {limit}")


def product_output(dev: Device, name: str, nbytes: int, out: Any | None, residual: Any | None) -> Any:
    """The output buffer of a product of `nbytes` (`out`, or a new one) once the binding fits the device and the
    residual (if any) and `out` hold `nbytes`; `name` says which output in the range error."""
    check_binding_range(dev, name, nbytes)
    if residual is not None:
        check_buffer("residual", residual, nbytes)
    if out is None:
        out = dev.alloc(nbytes)
    check_buffer("out", out, nbytes)
    return out


def grid_2d(dev: Device, groups: int) -> tuple[int, int, int]:
    """Spread `groups` workgroups over x and y within the device's per-axis limit (x * y >= groups)."""
    max_x = dev.info.max_workgroup_count[0]
    if groups <= max_x:
        return (max(groups, 1), 1, 1)
    gy = -(-groups // max_x)
    return (-(-groups // gy), gy, 1)


def pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def pow2_ceil(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


def decode_fusion() -> bool:
    """Whether model code may use the fused templates (rmsnorm_q8, kv_write from the q/k/v rows with RoPE):
    VKGRAPH_DECODE_FUSION, read when a graph is built."""
    return bool(flag("VKGRAPH_DECODE_FUSION"))


_ARRIVALS: weakref.WeakKeyDictionary[Device, Any] = weakref.WeakKeyDictionary()


def arrival_counters(dev: Device, count: int) -> Any:
    """`dev`'s arrival counters (at least `count` uints), by which a kernel's last workgroup to finish finds itself:
    zero between dispatches, as each dispatch's last workgroup sets its counter back. One buffer for every call,
    kept for the device's life: a pooled temporary could be handed to another kernel inside a captured graph and
    come back to a replay holding that kernel's bytes. Every kernel that binds it writes it, so the queue orders
    them one after another. A larger need replaces it with a larger one (zeroed here, outside any graph: the upload
    is never logged), which graphs captured before keep through the Buffer they hold."""
    buf = _ARRIVALS.get(dev)
    if buf is None or buf.size < count * 4:
        buf = dev.alloc(max(count, 1024) * 4)
        dev.upload(buf, bytes(buf.size))
        _ARRIVALS[dev] = buf
    return buf

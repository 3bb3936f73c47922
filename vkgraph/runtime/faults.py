"""Fault injection for tests: make the next Vulkan call at a named point fail with a chosen VkResult.

Points: "allocate" (vkAllocateMemory), "submit" (vkQueueSubmit), "wait" (vkWaitForFences). Real drivers
rarely fail on demand; this lets the tests show that every failure path leaves the runtime consistent.
"""

from __future__ import annotations

import threading

from .vk import vk

POINTS = ("allocate", "submit", "wait")
_armed: dict[str, list[int]] = {}
_lock = threading.Lock()


def inject(point: str, result: int = vk.VK_ERROR_DEVICE_LOST, count: int = 1) -> None:
    """The next `count` calls at `point` return `result` instead of calling Vulkan."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; expected one of {POINTS}")
    with _lock:
        _armed.setdefault(point, []).extend([result] * count)


def take(point: str) -> int | None:  # called from critical sections only (it takes a lock)
    """The injected result for this call at `point`, if one is armed."""
    if not _armed:
        return None
    with _lock:
        queue = _armed.get(point)
        if not queue:
            return None
        result = queue.pop(0)
        if not queue:
            del _armed[point]
        return result


def clear() -> None:
    with _lock:
        _armed.clear()

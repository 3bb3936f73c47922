"""Hazard tracking: when a command needs a barrier first.

Hazards are tracked per VkBuffer since the last barrier: reading something written, or writing something read
or written, needs a barrier first; anything else shares the barrier interval. One global memory barrier covers
every buffer, so a chain of independent dispatches runs without any. The queue applies the rule to its stream
(inline on the dispatch path); a captured graph applies it to its own commands when it prepares them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .memory import Allocation


def track_hazards(allocs: list[Allocation], writes: tuple[bool, ...], written: set[int], read: set[int]) -> bool:
    """Whether a command using `allocs` needs a barrier first (it reads something written, or writes something
    read or written, since the last barrier); updates the sets as if it was recorded."""
    hazard = any(a.handle in written or (w and a.handle in read) for a, w in zip(allocs, writes))
    if hazard:
        written.clear()
        read.clear()
    for a, w in zip(allocs, writes):
        (written if w else read).add(a.handle)
    return hazard

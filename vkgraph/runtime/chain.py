"""Chained dispatches: a kernel that waits inside itself for the dispatch before it, in place of a barrier.

A barrier between two dependent dispatches drains the first and only then launches the second, so the second
pays its launch and its first loads' latency after the first's last workgroup (on an H200 a 4096-row batch-1
matvec takes 7.0 us after a barrier and 3.6 us overlapped with the one before; benchmarks/RESULTS.md). A chained
kernel (one that declares the `ChainFlags` binding and the push fields `chain_wait` and `chain_signal`, from
templates/glsl/chain.glsl) instead
- signals: each workgroup counts itself done in slot `chain_signal` once its writes are made visible, and the
  last one sets the slot's flag;
- waits: before it reads anything another kernel wrote, one invocation per workgroup spins until the flag of slot
  `chain_wait` is set, and the kernel reads those inputs as coherent (not through a stale L1 line).
When a chained dispatch depends on the dispatch just before it, and that one signalled and began its own barrier
interval (so it finishing means everything before it finished), the queue records no barrier: the second
dispatch's workgroups launch while the first runs, load what depends on nothing (their weights) and wait.

Slots are used once between resets: the queue's own flags buffer runs through SLOTS slots and is zeroed by a
small kernel when they run out; a capture gets a buffer of its own, zeroed by that kernel at the start of the
graph, so every replay starts from clear flags. Slot numbers are only ever compared within one buffer.

This relies on the device launching a dispatch's workgroups only after every workgroup of the dispatches before
it was launched (else waiting workgroups could hold every multiprocessor while the one they wait for waits for a
place). NVIDIA's hardware does, and lavapipe runs dispatches one after another; elsewhere chaining stays off
unless VKGRAPH_CHAIN=1 (see `enabled`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..flags import flag

if TYPE_CHECKING:
    from .device import Device
    from .memory import Buffer

NONE = 0xFFFFFFFF  # no slot: the kernel neither waits nor signals
SLOTS = 1024       # slots per flags buffer between resets (a 32-layer decode step uses about 200)
WORDS = 2          # per slot: the count of finished workgroups, the flag
BINDING = "ChainFlags"
NVIDIA = 0x10DE

RESET = """#version 450
// zeroes the chained dispatches' flags (runtime/chain.py)
layout(local_size_x = 256) in;
layout(set = 0, binding = 0) writeonly buffer Flags { uint flags[]; };
layout(push_constant) uniform Push { uint words; } pc;
void main() {
    if (gl_GlobalInvocationID.x < pc.words) flags[gl_GlobalInvocationID.x] = 0u;
}
"""


def enabled(dev: Device) -> bool:
    """Whether `dev` chains dispatches: VKGRAPH_CHAIN=1 or 0 decides; auto where the device is known to launch
    dispatches in order (NVIDIA GPUs, and CPU drivers, which run one dispatch at a time)."""
    mode = flag("VKGRAPH_CHAIN")
    if mode in ("0", "1"):
        return mode == "1"
    if mode != "auto":
        raise ValueError(f"VKGRAPH_CHAIN must be auto, 0 or 1, got {mode!r}")
    return dev.info.vendor_id == NVIDIA or dev.info.device_type == "cpu"


class ChainFlags:
    """A queue's flags buffers and the next free slot; `link` hands a chained dispatch its slots (the queue calls
    it under its lock, right before recording the dispatch)."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._eager: Buffer | None = None
        self._eager_next = SLOTS  # reset before the first use: a new buffer's bytes are not known to be zero
        self.buffer: Buffer | None = None
        self.next = SLOTS
        self._capture: Any = None  # the capture the current buffer belongs to (None: the eager one)
        self._reset_pipe: Any = None

    def idle_buffer(self) -> Buffer:
        """A buffer to bind where a kernel neither waits nor signals."""
        self._follow_capture()
        return self._current()

    def link(self, last_signal: int | None) -> tuple[Buffer, int, int]:
        """(flags buffer, wait slot, signal slot) for the next chained dispatch: it waits for `last_signal` (the
        slot the dispatch recorded just before signalled, if it did; NONE otherwise) and signals a fresh slot."""
        if self._follow_capture():
            last_signal = None
        buf = self._current()
        if self.next >= SLOTS:
            self._reset(buf)
            last_signal = None
        slot = self.next
        self.next += 1
        return buf, NONE if last_signal is None else last_signal, slot

    def _follow_capture(self) -> bool:
        """Switch buffers when a capture opened or closed since the last call; True if it switched."""
        capture = self.device.queue.capture
        if capture is self._capture:
            return False
        if self._capture is None:  # a capture opened: park the eager buffer, give the graph its own
            self._eager, self._eager_next = self.buffer, self.next
            self.buffer, self.next = None, SLOTS
        else:  # it closed (the graph keeps its buffer through its bindings) or another one opened
            self.buffer, self.next = (self._eager, self._eager_next) if capture is None else (None, SLOTS)
        self._capture = capture
        self.device.queue.last_signal = None
        return True

    def _current(self) -> Buffer:
        if self.buffer is None:
            self.buffer = self.device.alloc(SLOTS * WORDS * 4)
            self.next = SLOTS
        return self.buffer

    def _reset(self, buf: Buffer) -> None:
        dev = self.device
        if self._reset_pipe is None:
            self._reset_pipe = dev.pipeline(RESET, name="chain_reset")
        words = SLOTS * WORDS
        dev.queue.dispatch(self._reset_pipe, [buf], (-(-words // 256), 1, 1), {"words": words})
        self.next = 0

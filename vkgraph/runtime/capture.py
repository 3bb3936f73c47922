"""Capture a sequence of dispatches once; replay it later with one submit.

While a capture is open the queue runs every dispatch as usual and also logs it; closing the capture prepares
the log (descriptor sets, packed push constants, barriers). A replay submits a command buffer recorded from it,
kept, not recycled: one of a small ring (RING), so that a replay never waits on the host for the graph's
previous submission; a command buffer is recorded again (a loop of raw calls, no lookups) only when a live value
(`LiveValue`, e.g. a `vkgraph.Variable`) used in push constants or the inputs bound in place differ from what it
was recorded with. The graph owns every allocation it touches that no live Buffer holds (the intermediates it
released back to the pool during capture), so nothing outside can reuse that memory while the graph lives; those
intermediates already shared memory inside the graph wherever their lifetimes did not overlap, because the pool
handed a released allocation to the next request.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..interrupts import critical
from . import faults
from .errors import DeviceClosed, DeviceError
from .hazards import track_hazards
from .memory import BoundRange
from .submission import Submission
from .vk import NULL, check, ffi, lib, vk

if TYPE_CHECKING:
    from .memory import Allocation
    from .queue import Queue

_COMPUTE = vk.VK_PIPELINE_BIND_POINT_COMPUTE
_STAGE_COMPUTE = vk.VK_SHADER_STAGE_COMPUTE_BIT
_STAGES = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT


@runtime_checkable
class LiveValue(Protocol):
    """A push-constant value read again at each replay (`vkgraph.Variable` is one): packed through `__index__`,
    compared through `value` to know when the graph must be recorded again."""

    value: int

    def __index__(self) -> int: ...


class CaptureLog:
    """What the queue logs while a capture is open."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()  # the capturing thread: work from others would be captured too
        # ("dispatch", pipe, buffers, groups, push) or ("copy", src, src_offset, dst, dst_offset, nbytes)
        self.entries: list[tuple] = []
        # the Buffer objects used: a graph keeps the live ones from returning to the pool while it exists
        self.keep: list[Any] = []


RING = 2  # command buffers per graph: a replay never waits for the one before it (its own submission in flight)


class _Binding:
    """What a command buffer reads in place of input slots: `pairs` ((slot, caller's allocation), ...), the
    prepared entries over them, the descriptor sets pinned for them, the callers' handles (read by the graph)
    and the last submission that used them."""

    def __init__(self, pairs: tuple, prepared: list[tuple], sets: list[list], read: set[int]) -> None:
        self.pairs = pairs
        self.prepared = prepared
        self.sets = sets
        self.read = read
        self.last_seq = 0


class _Slot:
    """One of a graph's command buffers (with its fence), and what it was last recorded with."""

    def __init__(self, queue: Queue) -> None:
        self.sub = Submission(queue)
        self.sub.persistent = True
        self.sub.begin_info.flags = 0  # submitted many times
        self.binding: _Binding | None = None  # recorded over these inputs (None: not recorded yet)
        self.values: tuple = ()  # and with these live values


class CommandGraph:
    """A replayable command buffer. Build it with `queue.begin_capture()` / `queue.end_capture()`.

    It keeps up to RING command buffers (`_Slot`), made and recorded lazily: a replay takes one that is not in
    flight, recorded with the same live values and bound inputs if there is one, else records one again; only
    when every one is in flight does it wait, for the oldest. So a replay submitted while the previous one runs
    (a decode step ahead of the one being read) starts without waiting on the host. Each command buffer begins
    with a full barrier against everything submitted before it, so replays in flight together still run in
    order, each seeing the one before it complete."""

    def __init__(self, queue: Queue, log: CaptureLog) -> None:
        self.queue = queue
        self.entries = log.entries
        self.keep = [b for b in log.keep if not getattr(b, "released", False)]
        self.kernels = sum(1 for e in self.entries if e[0] == "dispatch")
        self.slots: list[_Slot] = []  # made at the first replays
        self.allocs: list[Allocation] = []
        seen: set[int] = set()
        written: set[int] = set()
        self.variables: list[LiveValue] = []
        for e in self.entries:
            bufs = e[2] if e[0] == "dispatch" else (e[1], e[3])
            writes = e[1].writes if e[0] == "dispatch" else (False, True)
            for b, w in zip(bufs, writes):
                a = b.alloc
                if a.handle not in seen:
                    seen.add(a.handle)
                    self.allocs.append(a)
                if w:
                    written.add(a.handle)
            if e[0] == "dispatch":
                self.variables += [v for v in _push_values(e[4]) if isinstance(v, LiveValue)
                                   and v not in self.variables]
        self.written = written
        # what it only reads (its input slots): a copy into one after a replay must wait for that replay
        self.read = {a.handle for a in self.allocs} - written
        self.owned = queue.device.memory.pool.adopt(self.allocs)
        self._home = _Binding((), self._prepare(), [], set())  # as captured, over its own input slots
        self._bindings: list[_Binding] = []  # those with pinned sets, while a command buffer is recorded with one
        self.destroyed = False
        self._pair = ffi.new("VkCommandBuffer[2]")
        self._pair_info = ffi.new("VkSubmitInfo*", {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                                                    "commandBufferCount": 2, "pCommandBuffers": self._pair})

    def _prepare(self) -> list[tuple]:
        """Everything each entry needs for recording, resolved once: descriptor sets, packers, barriers."""
        q = self.queue
        written: set[int] = set()
        read: set[int] = set()
        prepared = []
        for e in self.entries:
            if e[0] == "dispatch":
                _, pipe, bufs, groups, push = e
                allocs = [b.alloc for b in bufs]
                writes = pipe.writes
            else:
                _, src, so, dst, do, n = e
                allocs = [src.alloc, dst.alloc]
                writes = (False, True)
            hazard = track_hazards(allocs, writes, written, read)
            if e[0] == "dispatch":
                key = (pipe.layout_id, tuple(b.key for b in bufs))  # as Queue.dispatch keys it
                sets = q.descriptors
                entry = sets.get(pipe, list(bufs), allocs, key, q.completed)
                sets.pin(entry)  # never evicted while the graph lives
                dynamic = any(isinstance(v, LiveValue) for v in _push_values(push))
                prepared.append(("dispatch", hazard, pipe, entry, groups, push, dynamic,
                                 pipe.pack_push(push) if pipe.push_names else b""))
            else:
                region = ffi.new("VkBufferCopy*", {"srcOffset": src.offset + so, "dstOffset": dst.offset + do,
                                                   "size": n})
                prepared.append(("copy", hazard, src.alloc.buffer, dst.alloc.buffer, region))
        return prepared

    @critical
    def _record(self, slot: _Slot, binding: _Binding, values: tuple) -> None:
        """Record `slot`'s command buffer (not in flight) over `binding`'s inputs, with the live values now."""
        q = self.queue
        cmd = slot.sub.cmd
        slot.binding = None  # until the recording is whole
        check(lib.vkResetCommandBuffer(cmd, 0), "vkResetCommandBuffer")
        check(lib.vkBeginCommandBuffer(cmd, slot.sub.begin_info), "vkBeginCommandBuffer")
        barrier = q.barrier
        # everything submitted before the replay (an earlier replay in flight included) is complete-and-visible
        # to its first command
        lib.vkCmdPipelineBarrier(cmd, _STAGES, _STAGES, 0, 1, barrier, 0, NULL, 0, NULL)
        bound = None
        for p in binding.prepared:
            if p[1]:
                lib.vkCmdPipelineBarrier(cmd, _STAGES, _STAGES, 0, 1, barrier, 0, NULL, 0, NULL)
            if p[0] == "dispatch":
                _, _, pipe, entry, (gx, gy, gz), push, dynamic, data = p
                ds = entry[0]
                if bound is not pipe.handle:
                    lib.vkCmdBindPipeline(cmd, _COMPUTE, pipe.handle)
                    bound = pipe.handle
                lib.vkCmdBindDescriptorSets(cmd, _COMPUTE, pipe.layout, 0, 1, ds, 0, NULL)
                if dynamic:
                    data = pipe.pack_push(push)
                if data:
                    lib.vkCmdPushConstants(cmd, pipe.layout, _STAGE_COMPUTE, 0, len(data), data)
                lib.vkCmdDispatch(cmd, gx, gy, gz)
            else:
                lib.vkCmdCopyBuffer(cmd, p[2], p[3], 1, p[4])
        lib.vkCmdPipelineBarrier(cmd, _STAGES, vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, q.host_barrier, 0, NULL, 0, NULL)
        check(lib.vkEndCommandBuffer(cmd), "vkEndCommandBuffer")
        slot.binding, slot.values = binding, values

    def _binding(self, pairs: tuple) -> _Binding:
        """The binding of `pairs`: the captured slots for none, one a command buffer is recorded with, or a new
        one (descriptor sets for the new ranges, from the cache, pinned while a command buffer uses them)."""
        if not pairs:
            return self._home
        for _, caller in pairs:
            if caller.freed:
                raise DeviceClosed("replay: an input buffer is gone (released, or of a closed device)")
        for b in self._bindings:
            if len(pairs) == len(b.pairs) and all(a is c and x is y for (a, x), (c, y) in zip(pairs, b.pairs)):
                return b
        swap = {}
        for slot, caller in pairs:
            if slot.handle in self.written:
                raise ValueError("a graph's input slot that it writes cannot be bound to a caller's buffer")
            swap[slot.handle] = caller
        q = self.queue
        sets = q.descriptors
        binding = _Binding(pairs, [], [], {c.handle for _, c in pairs})
        self._bindings.append(binding)  # before any pin: _release_unused unpins it if no recording follows
        for e, p in zip(self.entries, self._home.prepared):
            if p[0] == "dispatch" and any(b.alloc.handle in swap for b in e[2]):
                pipe = p[2]
                bufs = [BoundRange(swap.get(b.alloc.handle, b.alloc), b.offset, b.size) for b in e[2]]
                key = (pipe.layout_id, tuple(b.key for b in bufs))
                entry = sets.get(pipe, bufs, [b.alloc for b in bufs], key, q.completed)
                sets.pin(entry)
                binding.sets.append(entry)
                p = (*p[:3], entry, *p[4:])
            elif p[0] == "copy" and e[1].alloc.handle in swap:
                p = (p[0], p[1], swap[e[1].alloc.handle].buffer, *p[3:])
            binding.prepared.append(p)
        return binding

    def _release_unused(self) -> None:
        """Unpin the descriptor sets of bindings no command buffer is recorded with any more."""
        used = [s.binding for s in self.slots]
        keep = []
        for b in self._bindings:
            if any(b is u for u in used):
                keep.append(b)
            else:
                for entry in b.sets:
                    self.queue.descriptors.unpin(entry, b.last_seq)
        self._bindings = keep

    def _slot(self, binding: _Binding, values: tuple) -> _Slot:
        """A command buffer not in flight, recorded with `binding` and `values` where one is; else a new one while
        there are fewer than RING (inputs that alternate keep one recording each), the idle one submitted least
        recently, or, when every one is in flight, the oldest once it completed."""
        q = self.queue
        idle = [s for s in self.slots if s.sub not in q.in_flight]
        for s in idle:
            if s.binding is binding and s.values == values:
                return s
        if len(self.slots) < RING:
            self.slots.append(_Slot(q))
            return self.slots[-1]
        oldest = min(idle or self.slots, key=lambda s: s.sub.seq)
        if idle:
            return oldest
        q.wait(oldest.sub.seq)
        return oldest

    @critical
    def replay(self, inputs: tuple = ()) -> int:
        """Submit the graph once, after all work already recorded, in a single vkQueueSubmit together with
        that work (e.g. the copies of new inputs); returns its sequence number. `inputs`: (slot allocation,
        caller's allocation) pairs to read in place of slots the graph does not write (no copy). The previous
        replay may still be in flight: this one is ordered after it on the device, not waited for on the host."""
        q = self.queue
        with q.lock:
            q.admit()
            if self.destroyed:
                raise DeviceClosed("this command graph was destroyed (or its device closed)")
            kept = len(self._bindings)
            recorded = False
            try:
                binding = self._binding(inputs)
                values = tuple(v.value for v in self.variables)
                slot = self._slot(binding, values)
                if slot.binding is not binding or slot.values != values:
                    recorded = True
                    self._record(slot, binding, values)
            finally:
                # a binding falls out of use only where a command buffer was recorded again or a new one was made:
                # otherwise every kept binding is still some command buffer's, as after the last replay
                if recorded or len(self._bindings) != kept:
                    self._release_unused()
            sub = slot.sub
            pending = q.take_recording()
            if pending is not None:  # one submit, one fence: the graph takes the pending work's number, so a wait
                sub.seq = pending.seq  # for what that work used (an input copy's source) waits for this submit
            else:
                sub.seq = q.next_seq
                q.next_seq += 1
            info = sub.submit_info
            if pending is not None:
                # the pending work's command buffer goes first in the same submit; our fence covers both
                self._pair[0], self._pair[1] = pending.cmd, sub.cmd
                info = self._pair_info
                sub.chained.append(pending)
            res = faults.take("submit") or lib.vkQueueSubmit(q.device.vk_queue, 1, info, sub.fence)
            try:
                check(res, "vkQueueSubmit")
            except DeviceError:
                if pending is not None:
                    sub.chained.remove(pending)
                    q.recycle(pending)
                if res == vk.VK_ERROR_DEVICE_LOST:
                    q.device.lost = True
                raise
            q.in_flight.append(sub)
            q.stats["submits"] += 1
            seq = sub.seq
            binding.last_seq = seq
            for a in self.allocs:
                a.last_use = seq
            for _, a in binding.pairs:
                a.last_use = seq
            q.written |= self.written  # later work must wait for the graph's writes
            q.read |= self.read  # and writes to what it reads for its reads
            q.read |= binding.read
            return seq

    @critical
    def destroy(self) -> None:
        """Free the command buffers and give the graph's own allocations back to the pool."""
        if self.destroyed:
            return
        q = self.queue
        if q.device.closed:
            self.destroyed = True
            return
        with q.lock:
            last = max((s.sub.seq for s in self.slots if s.sub in q.in_flight), default=0)
            if last:
                q.wait(last)
            self.destroyed = True
            for p in self._home.prepared:
                if p[0] == "dispatch":
                    q.descriptors.unpin(p[3], q.completed)  # evictable again
            for b in self._bindings:
                for entry in b.sets:
                    q.descriptors.unpin(entry, q.completed)
            self._bindings = []
            for s in self.slots:
                lib.vkFreeCommandBuffers(q.device.device, q.command_pool, 1, s.sub.cmd_array)
                lib.vkDestroyFence(q.device.device, s.sub.fence, NULL)
        q.device.memory.pool.release_adopted(self.owned)
        self._forget()

    def _forget(self) -> None:
        self.owned = []
        self._home = _Binding((), [], [], set())
        self._bindings, self.slots, self.entries, self.keep = [], [], [], []

    def release_on_close(self) -> None:
        """The device is closing (the GPU is idle): destroy our fences; the pool frees the command buffers."""
        if not self.destroyed:
            self.destroyed = True
            for s in self.slots:
                lib.vkDestroyFence(self.queue.device.device, s.sub.fence, NULL)
            self._forget()

    def abandon(self) -> None:
        """The device is given up with work running: forget everything, destroy nothing."""
        self.destroyed = True
        self._forget()

    @critical  # what a finalizer raises is lost
    def __del__(self) -> None:
        try:
            self.destroy()
        except Exception:  # noqa: BLE001 (finalizers must not raise)
            pass


def _push_values(push: Any) -> list[Any]:
    if push is None:
        return []
    if isinstance(push, dict):
        return list(push.values())
    return list(push)


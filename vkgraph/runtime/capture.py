"""Capture a sequence of dispatches once; replay it later with one submit.

While a capture is open the queue runs every dispatch as usual and also logs it. Closing the capture records
the log into a command buffer that is kept, not recycled. A replay submits that command buffer again; only
when a live value (`LiveValue`, e.g. a `vkgraph.Variable`) used in push constants changed value is it recorded
again first (a loop of raw calls, no lookups). The graph owns every allocation it touches that no live Buffer
holds (the intermediates it released back to the pool during capture), so nothing outside can reuse that memory
while the graph lives; those intermediates already shared memory inside the graph wherever their lifetimes did
not overlap, because the pool handed a released allocation to the next request.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..interrupts import critical
from . import faults
from .descriptors import PINNED
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


class CommandGraph:
    """A replayable command buffer. Build it with `queue.begin_capture()` / `queue.end_capture()`."""

    def __init__(self, queue: Queue, log: CaptureLog) -> None:
        self.queue = queue
        self.entries = log.entries
        self.keep = [b for b in log.keep if not getattr(b, "released", False)]
        self.kernels = sum(1 for e in self.entries if e[0] == "dispatch")
        self.sub = Submission(queue)
        self.sub.persistent = True
        self.sub.begin_info.flags = 0  # submitted many times
        self.allocs: list[Allocation] = []
        seen: set[int] = set()
        written: set[int] = set()
        self.variables: list[LiveValue] = []
        self._prepared: list[tuple] = []
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
        self._prepare()
        self._home = self._prepared  # as captured, over its own input slots
        self.bound: tuple = ()  # (slot, caller's allocation) pairs the recorded command buffer binds instead
        self._bound_sets: list[list] = []  # descriptor sets pinned for them
        self._bound_read: set[int] = set()
        self.recorded_values: tuple | None = None
        self.destroyed = False
        self._pair = ffi.new("VkCommandBuffer[2]")
        self._pair_info = ffi.new("VkSubmitInfo*", {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                                                    "commandBufferCount": 2, "pCommandBuffers": self._pair})

    def _prepare(self) -> None:
        """Everything each entry needs for recording, resolved once: descriptor sets, packers, barriers."""
        q = self.queue
        written: set[int] = set()
        read: set[int] = set()
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
                self._prepared.append(("dispatch", hazard, pipe, entry, groups, push, dynamic,
                                       pipe.pack_push(push) if pipe.push_names else b""))
            else:
                region = ffi.new("VkBufferCopy*", {"srcOffset": src.offset + so, "dstOffset": dst.offset + do,
                                                   "size": n})
                self._prepared.append(("copy", hazard, src.alloc.buffer, dst.alloc.buffer, region))

    @critical
    def _record(self) -> None:
        q = self.queue
        cmd = self.sub.cmd
        check(lib.vkResetCommandBuffer(cmd, 0), "vkResetCommandBuffer")
        check(lib.vkBeginCommandBuffer(cmd, self.sub.begin_info), "vkBeginCommandBuffer")
        barrier = q.barrier
        # everything submitted before the replay is complete-and-visible to its first command
        lib.vkCmdPipelineBarrier(cmd, _STAGES, _STAGES, 0, 1, barrier, 0, NULL, 0, NULL)
        bound = None
        for p in self._prepared:
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
        self.recorded_values = tuple(v.value for v in self.variables)

    def _bind(self, subs: tuple) -> None:
        """Make the recorded command buffer read each pair's caller allocation wherever it read the slot (one
        the graph never writes): descriptor sets for the new ranges (from the cache, pinned while bound), then
        recorded again. The same pairs as last time cost nothing."""
        if len(subs) == len(self.bound) and all(a is b and c is d for (a, c), (b, d) in zip(subs, self.bound)):
            return
        q = self.queue
        sets = q.descriptors
        for entry in self._bound_sets:
            sets.unpin(entry, q.completed)
        self._bound_sets = []
        swap = {}
        for slot, caller in subs:
            if caller.freed:
                raise DeviceClosed("replay: an input buffer is gone (released, or of a closed device)")
            if slot.handle in self.written:
                raise ValueError("a graph's input slot that it writes cannot be bound to a caller's buffer")
            swap[slot.handle] = caller
        prepared = []
        for e, p in zip(self.entries, self._home):
            if p[0] == "dispatch" and any(b.alloc.handle in swap for b in e[2]):
                pipe = p[2]
                bufs = [BoundRange(swap.get(b.alloc.handle, b.alloc), b.offset, b.size) for b in e[2]]
                key = (pipe.layout_id, tuple(b.key for b in bufs))
                entry = sets.get(pipe, bufs, [b.alloc for b in bufs], key, q.completed)
                if entry[2] != PINNED:
                    sets.pin(entry)
                    self._bound_sets.append(entry)
                p = (*p[:3], entry, *p[4:])
            elif p[0] == "copy" and e[1].alloc.handle in swap:
                p = (p[0], p[1], swap[e[1].alloc.handle].buffer, *p[3:])
            prepared.append(p)
        self._prepared = prepared
        self.bound = subs
        self._bound_read = {c.handle for _, c in subs}
        self.recorded_values = None  # recorded again before this submit

    @critical
    def replay(self, inputs: tuple = ()) -> int:
        """Submit the graph once, after all work already recorded, in a single vkQueueSubmit together with
        that work (e.g. the copies of new inputs); returns its sequence number. `inputs`: (slot allocation,
        caller's allocation) pairs to read in place of slots the graph does not write (no copy)."""
        q = self.queue
        with q.lock:
            q.admit()
            if self.destroyed:
                raise DeviceClosed("this command graph was destroyed (or its device closed)")
            sub = self.sub
            if sub in q.in_flight:
                q.wait(sub.seq)
            if inputs or self.bound:
                self._bind(inputs)
            if self.recorded_values is None or self.recorded_values != tuple(v.value for v in self.variables):
                self._record()
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
            for a in self.allocs:
                a.last_use = seq
            for _, a in self.bound:
                a.last_use = seq
            q.written |= self.written  # later work must wait for the graph's writes
            q.read |= self.read  # and writes to what it reads for its reads
            q.read |= self._bound_read
            return seq

    @critical
    def destroy(self) -> None:
        """Free the command buffer and give the graph's own allocations back to the pool."""
        if self.destroyed:
            return
        q = self.queue
        if q.device.closed:
            self.destroyed = True
            return
        with q.lock:
            if self.sub in q.in_flight:
                q.wait(self.sub.seq)
            self.destroyed = True
            for p in self._home:
                if p[0] == "dispatch":
                    q.descriptors.unpin(p[3], q.completed)  # evictable again
            for entry in self._bound_sets:
                q.descriptors.unpin(entry, q.completed)
            lib.vkFreeCommandBuffers(q.device.device, q.command_pool, 1, self.sub.cmd_array)
            lib.vkDestroyFence(q.device.device, self.sub.fence, NULL)
        q.device.memory.pool.release_adopted(self.owned)
        self.owned = []
        self._prepared = self._home = []
        self.entries = []
        self.keep = []

    def release_on_close(self) -> None:
        """The device is closing (the GPU is idle): destroy our fence; the pool frees the command buffer."""
        if not self.destroyed:
            self.destroyed = True
            lib.vkDestroyFence(self.queue.device.device, self.sub.fence, NULL)
            self._prepared, self._home, self.entries, self.keep, self.owned = [], [], [], [], []

    def abandon(self) -> None:
        """The device is given up with work running: forget everything, destroy nothing."""
        self.destroyed = True
        self._prepared, self._home, self.entries, self.keep, self.owned = [], [], [], [], []

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


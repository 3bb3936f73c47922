"""The dispatch queue: records dispatches and copies into command buffers (`submission.Submission`) with the
barriers their buffers' read/write sets require (`hazards`), binds cached descriptor sets (`descriptors`),
submits with fences and recycles command buffers.

The queue's hazard sets cover its whole stream: submissions on one queue execute in order, and a barrier's
first scope covers earlier submissions too, so the sets carry over between submits.
"""

from __future__ import annotations

import struct
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from ..flags import flag
from ..interrupts import critical, interruptible
from . import faults
from .capture import CaptureLog, CommandGraph
from .descriptors import DescriptorSets, foreign_buffer
from .errors import CaptureError, DeviceClosed, DeviceError, DeviceLost, KernelInterfaceError, VkgraphError
from .hazards import track_hazards
from .memory import Allocation, BoundRange, Buffer
from .profile import Profiler
from .submission import Submission
from .vk import NULL, Keep, check, check_wait, ffi, lib, vk

if TYPE_CHECKING:
    from .device import Device
    from .pipeline import Pipeline

_COMPUTE = vk.VK_PIPELINE_BIND_POINT_COMPUTE
_STAGE_COMPUTE = vk.VK_SHADER_STAGE_COMPUTE_BIT
_STAGES = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
_WRITE = vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT
_ACCESS = (vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_READ_BIT
           | vk.VK_ACCESS_TRANSFER_WRITE_BIT)
MAX_IN_FLIGHT = 8
_SLICE_S = 0.05  # fence waits in slices, so that Ctrl-C is handled during a long one


class Queue:
    def __init__(self, device: Device) -> None:
        self.device = device
        self.lock = threading.RLock()
        self.capture_done = threading.Condition(self.lock)
        k = Keep()
        pci = k.struct("VkCommandPoolCreateInfo", flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
                       queueFamilyIndex=device.queue_family)
        out = ffi.new("VkCommandPool*")
        check(lib.vkCreateCommandPool(device.device, pci, NULL, out), "vkCreateCommandPool")
        self.command_pool = out[0]
        self.free: list[Submission] = []
        self.all_submissions: list[Submission] = []
        self.in_flight: deque[Submission] = deque()
        self.recording: Submission | None = None
        self.next_seq = 1
        self.completed = 0
        self.written: set[int] = set()
        self.read: set[int] = set()
        self.bound_pipeline: Any = None
        self.max_recorded = flag("VKGRAPH_MAX_RECORDED")
        self.timeout_s = flag("VKGRAPH_TIMEOUT_S")
        self.stalled = 0  # a submission that outlasted a wait and has not completed since
        self.barrier = ffi.new("VkMemoryBarrier*", {"sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                                    "srcAccessMask": _WRITE, "dstAccessMask": _ACCESS})
        self.host_barrier = ffi.new("VkMemoryBarrier*", {"sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                                         "srcAccessMask": _WRITE,
                                                         "dstAccessMask": vk.VK_ACCESS_HOST_READ_BIT})
        self.copy_region = ffi.new("VkBufferCopy*")
        self.descriptors = DescriptorSets(device)
        self.profiler = Profiler(device) if flag("VKGRAPH_PROFILE") else None
        self.stats = {"submits": 0, "barriers": 0, "copies": 0}
        self.dispatch_count = 0
        self.max_groups = device.info.max_workgroup_count
        self.capture: CaptureLog | None = None
        self.graphs: weakref.WeakSet[CommandGraph] = weakref.WeakSet()  # live command graphs, freed at close

    # ---- recording ------------------------------------------------------------------------------------------
    @critical
    def _begin(self) -> Submission:
        rec = self.recording
        if rec is not None:
            return rec
        self._retire(block=len(self.in_flight) >= MAX_IN_FLIGHT)
        sub = self.free.pop() if self.free else self._new_submission()
        check(lib.vkBeginCommandBuffer(sub.cmd, sub.begin_info), "vkBeginCommandBuffer")
        sub.seq = self.next_seq
        self.next_seq += 1
        sub.dispatches = 0
        self.bound_pipeline = None
        if self.profiler is not None:
            self.profiler.begin(sub)
        self.recording = sub
        return sub

    def _new_submission(self) -> Submission:
        sub = Submission(self)
        self.all_submissions.append(sub)
        return sub

    @critical
    def await_capture(self) -> None:
        """Wait while another thread captures on this queue."""
        with self.lock:
            self._await_capture()

    @critical  # Condition.wait is not safe against KeyboardInterrupt (it could return without the lock)
    def _await_capture(self) -> None:
        """Wait while another thread captures (the caller holds the lock): a capture holds its own thread's work
        only, and while it is open only that thread records, allocates or submits on this device."""
        me = threading.get_ident()
        deadline = time.monotonic() + self.timeout_s
        while self.capture is not None and self.capture.thread != me:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CaptureError(f"another thread has been capturing on this device for {self.timeout_s:g} s "
                                   "(VKGRAPH_TIMEOUT_S); does the capturing thread wait for this one?")
            self.capture_done.wait(min(left, _SLICE_S))

    def admit(self) -> None:
        """Before recording (the caller holds the lock): raise if the device is closed or lost; wait while
        another thread captures."""
        if self.device.closed or self.device.lost:
            self.device.check_usable()
        if self.capture is not None and self.capture.thread != threading.get_ident():
            self._await_capture()

    @critical
    def dispatch(self, pipe: Pipeline, buffers: list[Any], groups: Any, push: Any = None) -> None:
        # The hot path: one pass over the bindings, cached descriptor sets, raw cffi calls.
        if len(buffers) != pipe.num_bindings:
            raise KernelInterfaceError(f"kernel {pipe.name} declares {pipe.num_bindings} buffers, got "
                                       f"{len(buffers)}")
        if type(groups) is tuple and len(groups) == 3:
            gx, gy, gz = groups
        else:
            gx, gy, gz = _groups(groups)
        limits = self.max_groups
        if gx > limits[0] or gy > limits[1] or gz > limits[2] or gx < 0 or gy < 0 or gz < 0:
            raise KernelInterfaceError(f"kernel {pipe.name}: {gx, gy, gz} workgroups are outside the device's "
                                       f"limit {limits}")
        if type(push) is tuple:
            try:
                data = pipe.push_pack(*push)
            except struct.error:
                data = pipe.pack_push(push)  # raises with a message naming the fields
        elif type(push) is dict and push and len(push) == len(pipe.push_names):
            try:
                data = pipe.push_from_dict(push)
            except (KeyError, struct.error):
                data = pipe.pack_push(push)  # raises with a message naming the fields
        else:
            data = pipe.pack_push(push) if (push or pipe.push_names) else b""
        if gx == 0 or gy == 0 or gz == 0:
            return
        with self.lock:
            if self.device.closed or self.device.lost:
                self.device.check_usable()
            if self.capture is not None and self.capture.thread != threading.get_ident():
                self._await_capture()
            rec = self.recording or self._begin()
            written, read = self.written, self.read
            allocs = []
            hazard = False
            try:
                for b, w in zip(buffers, pipe.writes):
                    a = b.alloc
                    if a.freed:
                        raise stale_buffer(f"kernel {pipe.name}", a)
                    allocs.append(a)
                    if a.handle in written or (w and a.handle in read):
                        hazard = True
                key = (pipe.layout_id, tuple([b.key for b in buffers]))
            except AttributeError:
                raise KernelInterfaceError(f"kernel {pipe.name}: buffers must be Buffer or BufferView, got "
                                           f"{[type(b).__name__ for b in buffers]}") from None
            seq = rec.seq
            entry = self.descriptors.sets.get(key)
            if entry is None:
                entry = self.descriptors.create(pipe, buffers, allocs, key, self.completed)
            entry[2] = seq
            cmd = rec.cmd
            if hazard:
                lib.vkCmdPipelineBarrier(cmd, _STAGES, _STAGES, 0, 1, self.barrier, 0, NULL, 0, NULL)
                written.clear()
                read.clear()
                self.stats["barriers"] += 1
            for a, w in zip(allocs, pipe.writes):
                (written if w else read).add(a.handle)
                a.last_use = seq
            if self.bound_pipeline is not pipe.handle:
                lib.vkCmdBindPipeline(cmd, _COMPUTE, pipe.handle)
                self.bound_pipeline = pipe.handle
            lib.vkCmdBindDescriptorSets(cmd, _COMPUTE, pipe.layout, 0, 1, entry[0], 0, NULL)
            if data:
                lib.vkCmdPushConstants(cmd, pipe.layout, _STAGE_COMPUTE, 0, len(data), data)
            if self.profiler is not None:
                self.profiler.before(rec, pipe.name)
            lib.vkCmdDispatch(cmd, gx, gy, gz)
            if self.profiler is not None:
                self.profiler.after(rec)
            if self.capture is not None:
                self.capture.keep += buffers
                self.capture.entries.append(("dispatch", pipe, tuple(
                    BoundRange(a, b.offset, b.size) for a, b in zip(allocs, buffers)), (gx, gy, gz), push))
            rec.dispatches += 1
            self.dispatch_count += 1
            if rec.dispatches >= self.max_recorded or (self.profiler is not None and self.profiler.full(rec)):
                self.flush()

    def _hazards(self, allocs: list[Allocation], writes: tuple[bool, ...], rec: Submission) -> None:
        """Barrier tracking for recorded copies (dispatch inlines the same rule on its hot path)."""
        if track_hazards(allocs, writes, self.written, self.read):
            lib.vkCmdPipelineBarrier(rec.cmd, _STAGES, _STAGES, 0, 1, self.barrier, 0, NULL, 0, NULL)
            self.stats["barriers"] += 1
        for a in allocs:
            a.last_use = rec.seq

    @critical
    def forget_buffer(self, handle: int) -> None:
        """A VkBuffer is being destroyed (after its last use completed): drop descriptor sets naming it."""
        with self.lock:
            self.descriptors.forget_buffer(handle)
            self.written.discard(handle)
            self.read.discard(handle)

    @critical
    def copy(self, src: Any, src_offset: int, dst: Any, dst_offset: int, nbytes: int, log: bool = True) -> None:
        """Record a buffer-to-buffer copy, ordered by the same hazard rules as dispatches. With `log=False` an
        open capture does not log it (host uploads run once at capture, as constants)."""
        with self.lock:
            rec = self._begin_copy(src, dst)
            region = self.copy_region  # read during the call only: one struct serves every copy
            region.srcOffset, region.dstOffset, region.size = src.offset + src_offset, dst.offset + dst_offset, nbytes
            lib.vkCmdCopyBuffer(rec.cmd, src.alloc.buffer, dst.alloc.buffer, 1, region)
            self._log_copy(src, dst, [(src_offset, dst_offset, nbytes)], log)

    @critical
    def copy_regions(self, src: Any, dst: Any, regions: np.ndarray, log: bool = True) -> None:
        """Record one copy of many regions from `src` to `dst`: `regions` is (n, 3) integers, each row (source
        offset, destination offset, bytes) within the two buffers (or views). The caller keeps them in bounds
        and the destination regions apart (as Vulkan requires)."""
        r = np.asarray(regions)
        if r.ndim != 2 or r.shape[1] != 3 or r.dtype.kind not in "iu" or (r.size and r.min() < 0):
            raise ValueError(f"regions must be (n, 3) non-negative integers, got {r.dtype} {r.shape}")
        if not len(r):
            return
        cdata = np.array(r, np.uint64)  # VkBufferCopy is three VkDeviceSize: rows of uint64 are its array
        cdata[:, 0] += src.offset
        cdata[:, 1] += dst.offset
        with self.lock:
            rec = self._begin_copy(src, dst)
            lib.vkCmdCopyBuffer(rec.cmd, src.alloc.buffer, dst.alloc.buffer, len(cdata),
                                ffi.cast("VkBufferCopy *", ffi.from_buffer(cdata)))
            self._log_copy(src, dst, r.tolist() if self.capture is not None else [], log)

    def _begin_copy(self, src: Any, dst: Any) -> Submission:
        """Checks and hazards of a copy from src to dst (under the lock): the submission to record it in."""
        sa, da = src.alloc, dst.alloc
        self.admit()
        if sa.freed or da.freed:
            raise stale_buffer("copy", sa if sa.freed else da)
        if sa.owner is not self.device.memory or da.owner is not self.device.memory:
            raise foreign_buffer("copy", sa if sa.owner is not self.device.memory else da, self.device)
        rec = self._begin()
        self._hazards([sa, da], (False, True), rec)
        self.stats["copies"] += 1
        return rec

    def _log_copy(self, src: Any, dst: Any, regions: list, log: bool) -> None:
        """An open capture logs a recorded copy, one entry per region."""
        if self.capture is None or not log:
            return
        self.capture.keep += [src, dst]
        for src_offset, dst_offset, nbytes in regions:
            self.capture.entries.append(("copy", BoundRange(src.alloc, src.offset, src.size), int(src_offset),
                                         BoundRange(dst.alloc, dst.offset, dst.size), int(dst_offset), int(nbytes)))

    # ---- capture ------------------------------------------------------------------------------------------
    @critical
    def begin_capture(self) -> None:
        """Log every dispatch and copy from now on (they still run) for a CommandGraph."""
        with self.lock:
            self.admit()  # waits for another thread's capture
            if self.capture is not None:
                raise VkgraphError("a capture is already open on this queue")
            self.capture = CaptureLog()
            self.device.memory.pool.keep_all += 1

    @critical
    def end_capture(self) -> CommandGraph:
        """Close the capture and build the replayable graph of what it logged."""
        with self.lock:
            log = self.abort_capture()
            graph = CommandGraph(self, log)
            self.graphs.add(graph)
            return graph

    @critical
    def abort_capture(self) -> CaptureLog:
        """Close the capture without building a graph (e.g. after an exception); returns the log."""
        with self.lock:
            log, self.capture = self.capture, None
            if log is None:
                raise VkgraphError("no capture is open")
            self.device.memory.pool.keep_all -= 1
            self.capture_done.notify_all()
            return log

    @critical
    def hold(self, obj: Any) -> None:
        """Keep `obj` alive until the recorded work completes (Buffers are released then)."""
        with self.lock:
            self.admit()
            self._begin().held.append(obj)

    # ---- submission and waiting --------------------------------------------------------------------------------
    @critical
    def flush(self) -> None:
        with self.lock:
            rec = self.recording
            if rec is None:
                return
            self.recording = None
            lib.vkCmdPipelineBarrier(rec.cmd, _STAGES, vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, self.host_barrier,
                                     0, NULL, 0, NULL)
            check(lib.vkEndCommandBuffer(rec.cmd), "vkEndCommandBuffer")
            try:
                res = faults.take("submit") or lib.vkQueueSubmit(self.device.vk_queue, 1, rec.submit_info, rec.fence)
                check(res, "vkQueueSubmit")
            except DeviceLost:
                self.device.lost = True
                raise
            except DeviceError:
                self.recycle(rec)
                raise
            self.in_flight.append(rec)
            self.stats["submits"] += 1

    @critical
    def synchronize(self) -> None:
        with self.lock:
            self.flush()
            self.wait(self.next_seq - 1)

    @critical  # (a KeyboardInterrupt just after a lock is taken leaves it taken: the slices below take none)
    def wait(self, seq: int) -> None:
        """Block until submission `seq` (and all before it) completed."""
        with self.lock:
            if self.device.closed or self.device.lost:
                self.device.check_usable()
            if self.recording is not None and self.recording.seq <= seq:
                self.flush()
            while self.in_flight and self.in_flight[0].seq <= seq:
                sub = self.in_flight[0]
                res = faults.take("wait")
                if res is None:
                    res = self._wait_fence(sub, time.monotonic() + self.timeout_s)
                if res == vk.VK_TIMEOUT:
                    self.stalled = max(self.stalled, sub.seq)
                try:
                    check_wait(res, f"waiting for submission {sub.seq}", self.timeout_s)
                except DeviceLost:
                    self.device.lost = True
                    raise
                self._complete_first()
            self.device.memory.collect()

    @interruptible
    def _wait_fence(self, sub: Submission, deadline: float) -> int:
        """vkWaitForFences until `deadline`, in slices (Ctrl-C is handled between them); the last VkResult."""
        while True:
            left = deadline - time.monotonic()
            res = lib.vkWaitForFences(self.device.device, 1, sub.fence_array, vk.VK_TRUE,
                                      int(max(0.0, min(left, _SLICE_S)) * 1e9))
            if res != vk.VK_TIMEOUT or left <= 0:
                return res

    @critical
    def drain(self, timeout_s: float) -> bool:
        """Submit what is recorded and wait up to `timeout_s` for all submitted work; whether it all completed
        (on a lost device nothing more will: that counts as done)."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            if self.recording is not None:
                self.flush()
            while self.in_flight:
                res = self._wait_fence(self.in_flight[0], deadline)
                if res == vk.VK_TIMEOUT:
                    return False
                if res != vk.VK_SUCCESS:
                    return True
                self._complete_first()
            return True

    def wait_for(self, alloc: Allocation) -> None:
        """Block until every submission that used `alloc` completed."""
        if alloc.last_use > self.completed:
            self.wait(alloc.last_use)

    def _retire(self, block: bool) -> None:
        """Complete finished submissions; with `block`, wait for the oldest first."""
        if block and self.in_flight:
            self.wait(self.in_flight[0].seq)
        while self.in_flight and lib.vkGetFenceStatus(self.device.device, self.in_flight[0].fence) == vk.VK_SUCCESS:
            self._complete_first()

    @critical
    def _complete_first(self) -> None:
        """The oldest submission in flight has completed: retire it."""
        sub = self.in_flight.popleft()
        self.completed = max(self.completed, sub.seq)
        if self.stalled and self.completed >= self.stalled:
            self.stalled = 0
        chained, sub.chained = sub.chained, []
        for s in [*chained, sub]:
            if self.profiler is not None:
                self.profiler.collect(s)
            self.recycle(s)

    @critical
    def take_recording(self) -> Submission | None:
        """End the open recording without submitting it, for a caller that submits it with its own work."""
        with self.lock:
            rec = self.recording
            if rec is None:
                return None
            self.recording = None
            check(lib.vkEndCommandBuffer(rec.cmd), "vkEndCommandBuffer")
            return rec

    @critical
    def recycle(self, sub: Submission) -> None:
        """A completed (or never submitted) submission: reset its fence; unless a graph keeps it, its command
        buffer goes back to the free list and what it held is released."""
        check(lib.vkResetFences(self.device.device, 1, sub.fence_array), "vkResetFences")
        if sub.persistent:
            return
        check(lib.vkResetCommandBuffer(sub.cmd, 0), "vkResetCommandBuffer")
        held, sub.held = sub.held, []
        for obj in held:
            if isinstance(obj, Buffer):
                obj.release()
        self.free.append(sub)

    def object_counts(self) -> dict[str, int]:
        """Live Vulkan objects the queue owns (for leak checks)."""
        return {"command_buffers": len(self.all_submissions), **self.descriptors.counts(),
                "in_flight": len(self.in_flight)}

    def abandon(self) -> None:
        """The device is given up with work still running: forget every object, destroy none (the GPU may still
        use them; the process's exit frees them)."""
        for graph in list(self.graphs):
            graph.abandon()
        self.descriptors.abandon()
        self.in_flight.clear()
        self.free.clear()
        self.recording = None

    def destroy(self) -> None:
        dev = self.device.device
        if self.profiler is not None:
            self.profiler.report()
            self.profiler.destroy()
        for graph in list(self.graphs):
            graph.release_on_close()
        self.descriptors.destroy()
        for sub in self.all_submissions:
            lib.vkDestroyFence(dev, sub.fence, NULL)
        lib.vkDestroyCommandPool(dev, self.command_pool, NULL)
        self.in_flight.clear()
        self.recording = None


def stale_buffer(what: str, alloc: Any) -> VkgraphError:
    """The error for using an allocation that is gone: its device closed, or its Buffer released."""
    owner = getattr(alloc, "owner", None)
    if owner is not None and owner.destroyed:
        return DeviceClosed(f"{what}: a buffer belongs to a device that was closed (or replaced by reset_device()); "
                            "make it again on the current device")
    return KernelInterfaceError(f"{what}: a buffer was released before use")


def _groups(groups: Any) -> tuple[int, int, int]:
    if isinstance(groups, int):
        return groups, 1, 1
    g = tuple(int(x) for x in groups)
    if not 1 <= len(g) <= 3 or any(x < 0 for x in g):
        raise KernelInterfaceError(f"workgroup counts must be 1 to 3 non-negative ints, got {groups!r}")
    return (g + (1, 1))[:3]

"""Device buffers, the buffer pool, and host transfers (direct where memory is host-visible, else staged).

A Buffer is what a caller holds: a size (what was asked; bounds every access) over an Allocation (a VkBuffer
and its memory, with a capacity). Releasing a Buffer returns its Allocation to the pool, bucketed by size
class; idle allocations over the budget or the per-bucket cap are freed once the GPU is done with them.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..flags import flag
from ..interrupts import critical
from . import faults
from .errors import DeviceError, OutOfDeviceMemory, UnsupportedFeature
from .vk import NULL, Keep, check, ffi, handle_int, lib, vk

if TYPE_CHECKING:
    from .device import Device

_USAGE = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
          | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
_HOST = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
_DEVICE_LOCAL = vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT
_CACHED = vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT


def size_class(nbytes: int) -> int:
    """Capacity for a request: up to 64 KiB round up to 256 B, above that to the next power of two."""
    if nbytes <= 0:
        return 256
    if nbytes <= 64 << 10:
        return (nbytes + 255) // 256 * 256
    return 1 << (nbytes - 1).bit_length()


class Allocation:
    """One VkBuffer bound to its own VkDeviceMemory; mapped when host-visible."""

    __slots__ = ("buffer", "memory", "capacity", "kind", "host", "handle", "last_use", "freed", "owner", "keep",
                 "__weakref__")

    def __init__(self, buffer: Any, memory: Any, capacity: int, kind: str, host: np.ndarray | None,
                 owner: MemoryManager | None = None) -> None:
        self.buffer = buffer
        self.memory = memory
        self.capacity = capacity
        self.kind = kind
        self.host = host  # uint8 view over the mapping, or None
        self.handle = handle_int(buffer)
        self.last_use = 0  # sequence number of the last submission that used it
        self.freed = False
        self.owner = owner  # the MemoryManager that made it (tells a closed device's buffer from a released one)
        self.keep: Any = None  # imported host memory: held until the VkDeviceMemory over it is freed


def _handle(alloc: Allocation) -> int:
    return alloc.handle


class _Released:
    """Stands in for the allocation of a released Buffer, so any later use is caught cheaply."""

    freed = True
    owner = None
    capacity = 0
    host = None
    handle = 0
    last_use = 0


RELEASED = _Released()


class Buffer:
    """A device buffer of `size` bytes. Release it (or drop it) to return its memory to the pool."""

    __slots__ = ("alloc", "size", "pool", "key", "_finalizer", "__weakref__")

    def __init__(self, alloc: Allocation, size: int, pool: BufferPool) -> None:
        self.alloc = alloc
        self.size = size
        self.pool = pool
        self.key = (alloc.handle, 0, size)  # what a descriptor binds: (VkBuffer, offset, range)
        self._finalizer = weakref.finalize(self, outside_books, pool.books, pool._put, alloc)

    @property
    def capacity(self) -> int:
        return self.alloc.capacity

    offset = 0  # a whole Buffer starts at byte 0; BufferView carries its own

    def view(self, offset: int, nbytes: int) -> BufferView:
        """Bytes [offset, offset + nbytes) of this buffer, to bind or transfer."""
        return BufferView(self, offset, nbytes)

    @critical
    def release(self) -> None:
        """Return the memory to the pool now. The GPU may still be using it: the queue orders reuse after it."""
        self._finalizer()
        self.alloc = RELEASED

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def __repr__(self) -> str:
        return f"Buffer(size={self.size}, capacity={self.capacity}{', released' if self.released else ''})"


class BufferView:
    """A byte range of a Buffer (keeps the Buffer alive)."""

    __slots__ = ("base", "offset", "size", "key")

    def __init__(self, base: Buffer, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > base.size:
            raise ValueError(f"view [{offset}, {offset + nbytes}) is outside a buffer of {base.size} bytes")
        self.base = base
        self.offset = offset
        self.size = nbytes
        self.key = (base.alloc.handle, offset, nbytes)

    @property
    def alloc(self) -> Allocation:
        return self.base.alloc

    def view(self, offset: int, nbytes: int) -> BufferView:
        return BufferView(self.base, self.offset + offset, nbytes)


class BoundRange:
    """A byte range of an allocation as a capture logged it (the Buffer may be released since)."""

    __slots__ = ("alloc", "offset", "size", "key")

    def __init__(self, alloc: Allocation, offset: int, size: int) -> None:
        self.alloc = alloc
        self.offset = offset
        self.size = size
        self.key = (alloc.handle, offset, size)


# Finalizers reach the memory books (a dropped Buffer returns its allocation, a dropped command graph its adopted
# ones and collects), and a garbage collection runs finalizers at any allocation of Python objects, also inside a
# section that holds one of the books' locks (a Buffer in a reference cycle, as an exception's traceback makes, is
# freed by the collector): there a finalizer would wait forever for the lock its own thread holds. So what a
# finalizer brings goes through outside_books, and waits in a queue for a pool's next allocation or the next
# collect wherever a lock it needs is taken.
_later: deque[tuple[tuple[Any, ...], Callable[..., None], tuple[Any, ...]]] = deque()


@critical
def outside_books(locks: tuple[Any, ...], fn: Callable[..., None], *args: Any) -> None:
    """fn(*args) now if every one of `locks` (the books' locks fn takes) is free, else queued: taken by this thread
    fn would never get it, and taken by another, a later point serves as well."""
    for lk in locks:
        if not lk.acquire(blocking=False):
            _later.append((locks, fn, args))
            return
        lk.release()
    fn(*args)


@critical  # an interrupt between taking an item and running it would lose a returned allocation
def _run_later() -> None:
    """Run what finalizers queued (any thread's), each where its locks are free (else it stays queued)."""
    for _ in range(len(_later)):
        try:
            locks, fn, args = _later.popleft()
        except IndexError:  # another thread took the last one
            return
        outside_books(locks, fn, *args)


@dataclass
class PoolStats:
    live_bytes: int = 0
    idle_bytes: int = 0
    live_buffers: int = 0
    idle_buffers: int = 0
    hits: int = 0
    misses: int = 0
    freed: int = 0
    budget_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class BufferPool:
    """Size-classed reuse of allocations of one memory kind, with a per-bucket cap and an idle-byte budget."""

    def __init__(self, memory: MemoryManager, kind: str) -> None:
        self.memory = memory
        self.kind = kind
        # by capacity, in handle order: an allocation takes the idle one of highest handle, so which buffers a repeated
        # sequence of allocations and releases gets depends on which are idle, not on the order they came back (a
        # prefill realized layer by layer binds the same buffers at every layer, and finds its descriptor sets cached)
        self.idle: dict[int, list[Allocation]] = defaultdict(list)
        self.lru: OrderedDict[int, Allocation] = OrderedDict()  # every idle allocation, least recently returned first
        self.stats = PoolStats(budget_bytes=flag("VKGRAPH_POOL_BUDGET_MB") << 20)
        self.bucket_cap = flag("VKGRAPH_POOL_BUCKET_CAP")
        self.lock = threading.Lock()
        self.books = (self.lock, memory.lock)  # what a return takes
        self.closed = False
        self.keep_all = 0  # while > 0 (a capture is open) released allocations are kept, never freed
        self.adopted_bytes = 0

    @critical
    def alloc(self, nbytes: int) -> Buffer:
        if not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise ValueError(f"buffer size must be a non-negative int, got {nbytes!r}")
        nbytes = int(nbytes)
        info = self.memory.device.info
        if nbytes > info.max_buffer_size:
            raise OutOfDeviceMemory(f"{nbytes} bytes asked for one buffer; the device's maxBufferSize is "
                                    f"{info.max_buffer_size}", nbytes, self.stats.as_dict())
        if nbytes > info.max_allocation_size:  # each buffer has its own allocation
            raise OutOfDeviceMemory(f"{nbytes} bytes asked for one buffer; the device's maxMemoryAllocationSize "
                                    f"is {info.max_allocation_size}: split the data", nbytes, self.stats.as_dict())
        cap = size_class(nbytes)
        if cap > info.max_allocation_size or cap > info.max_buffer_size:
            cap = max(nbytes, 256)
        with self.lock:
            bucket = self.idle.get(cap)
            if bucket:
                alloc = bucket.pop()
                del self.lru[alloc.handle]
                self.stats.hits += 1
                self.stats.idle_bytes -= cap
                self.stats.idle_buffers -= 1
            else:
                alloc = None
                self.stats.misses += 1
        if alloc is None:
            alloc = self._allocate(cap, nbytes)
        with self.lock:
            self.stats.live_bytes += cap
            self.stats.live_buffers += 1
        if _later:  # returns a collection inside this call's sections queued (outside_books)
            _run_later()
        return Buffer(alloc, nbytes, self)

    def _allocate(self, cap: int, nbytes: int) -> Allocation:
        try:
            return self.memory.allocate(cap, self.kind)
        except OutOfDeviceMemory:
            self.trim(0)
            self.memory._collect()  # waiting for the books if another thread holds them: the retry needs it done
            try:
                return self.memory.allocate(cap, self.kind)
            except OutOfDeviceMemory as e:
                raise OutOfDeviceMemory(
                    f"out of {self.kind} memory allocating {nbytes} bytes (capacity {cap}) after releasing idle "
                    f"buffers; pool: {self.stats.as_dict()}", nbytes, self.stats.as_dict()) from e

    @critical
    def _put(self, alloc: Allocation) -> None:
        """Keep a returned allocation idle, making room by freeing the least recently returned ones (within
        its bucket for the cap, anywhere for the budget); free it instead if it alone exceeds the budget."""
        victims = []
        with self.lock:
            self.stats.live_bytes -= alloc.capacity
            self.stats.live_buffers -= 1
            cap = alloc.capacity
            keep = not self.closed and (self.keep_all > 0 or cap <= self.stats.budget_bytes)
            if keep and not self.keep_all:
                bucket = self.idle[cap]
                if len(bucket) >= self.bucket_cap:  # its least recently returned one
                    victims.append(self._take(next(a for a in self.lru.values() if a.capacity == cap)))
                while self.stats.idle_bytes + cap > self.stats.budget_bytes and self.lru:
                    victims.append(self._take(next(iter(self.lru.values()))))
            if keep:
                bisect.insort(self.idle[cap], alloc, key=_handle)
                self.lru[alloc.handle] = alloc
                self.stats.idle_bytes += cap
                self.stats.idle_buffers += 1
            else:
                victims.append(alloc)
            self.stats.freed += len(victims)
        for a in victims:
            self.memory.free_later(a)

    @critical
    def _take(self, alloc: Allocation) -> Allocation:
        """Remove an idle allocation from the books (the caller holds the lock)."""
        self.idle[alloc.capacity].remove(alloc)
        del self.lru[alloc.handle]
        self.stats.idle_bytes -= alloc.capacity
        self.stats.idle_buffers -= 1
        return alloc

    @critical
    def adopt(self, allocs: list[Allocation]) -> list[Allocation]:
        """Take the idle ones among `allocs` out of the pool for a command graph's exclusive use."""
        taken = []
        with self.lock:
            for a in allocs:
                if a.handle in self.lru:
                    self._take(a)
                    self.adopted_bytes += a.capacity
                    taken.append(a)
        return taken

    def release_adopted(self, allocs: list[Allocation]) -> None:
        """Give a destroyed command graph's allocations back, as idle (or freed over the budget); from the graph's
        finalizer too, so through outside_books."""
        outside_books(self.books, self._release_adopted, allocs)

    @critical
    def _release_adopted(self, allocs: list[Allocation]) -> None:
        for a in allocs:
            with self.lock:
                self.adopted_bytes -= a.capacity
                self.stats.live_bytes += a.capacity  # _put counts it as leaving live use
                self.stats.live_buffers += 1
            self._put(a)

    @critical
    def trim(self, keep_bytes: int) -> None:
        """Free idle allocations, largest first, until at most `keep_bytes` stay idle."""
        victims = []
        with self.lock:
            for cap in sorted(self.idle, reverse=True):
                bucket = self.idle[cap]
                while bucket and self.stats.idle_bytes > keep_bytes:
                    victims.append(self._take(bucket[0]))
                    self.stats.freed += 1
        for a in victims:
            self.memory.free_later(a)


class _Unpooled:
    """Where a Buffer over imported memory goes when released: destroyed after its last use, never reused."""

    def __init__(self, memory: MemoryManager) -> None:
        self.memory = memory
        self.books = (memory.lock,)  # what a return takes

    def _put(self, alloc: Allocation) -> None:
        self.memory.free_later(alloc)


class MemoryManager:
    """Memory types, raw allocation, deferred frees, the device and staging pools, and host transfers."""

    def __init__(self, device: Device) -> None:
        self.device = device
        k = Keep()
        props = k.new("VkPhysicalDeviceMemoryProperties*")
        lib.vkGetPhysicalDeviceMemoryProperties(device.physical, props)
        self.types = [(props.memoryTypes[i].propertyFlags, props.memoryTypes[i].heapIndex)
                      for i in range(props.memoryTypeCount)]
        self.heap_sizes = [props.memoryHeaps[i].size for i in range(props.memoryHeapCount)]
        self.unified = device.info.unified_memory
        self.pending_free: list[Allocation] = []
        self.lock = threading.Lock()
        self.pool = BufferPool(self, "device")
        self.staging = BufferPool(self, "upload")
        self.readback = BufferPool(self, "download")
        self.allocated_bytes = 0
        self.allocation_count = 0
        self.live: dict[int, Allocation] = {}
        self.destroyed = False

    # ---- allocation ---------------------------------------------------------------------------------------
    def _memory_type(self, type_bits: int, kind: str) -> int:
        if kind == "device":
            prefs = [_DEVICE_LOCAL | _HOST, _DEVICE_LOCAL] if self.unified else [_DEVICE_LOCAL, 0]
            avoid = 0 if self.unified else vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
        elif kind == "download":
            prefs, avoid = [_HOST | _CACHED, _HOST], 0
        else:
            prefs, avoid = [_HOST], _DEVICE_LOCAL
        for want in prefs:
            for strict in (True, False):
                for i, (flags, _) in enumerate(self.types):
                    if (type_bits >> i) & 1 and (flags & want) == want and (not strict or not flags & avoid):
                        return i
        raise DeviceError(f"no memory type for {kind} buffers (type bits {type_bits:#x})")

    @critical
    def allocate(self, capacity: int, kind: str) -> Allocation:
        dev = self.device.device
        k = Keep()
        ci = k.struct("VkBufferCreateInfo", size=capacity, usage=_USAGE, sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE)
        out = ffi.new("VkBuffer*")
        check(lib.vkCreateBuffer(dev, ci, NULL, out), f"vkCreateBuffer({capacity} bytes)")
        buffer = out[0]
        req = k.new("VkMemoryRequirements*")
        lib.vkGetBufferMemoryRequirements(dev, buffer, req)
        type_index = self._memory_type(req.memoryTypeBits, kind)
        heap = self.types[type_index][1]
        if req.size > self.heap_sizes[heap]:
            lib.vkDestroyBuffer(dev, buffer, NULL)
            raise OutOfDeviceMemory(f"{capacity} bytes asked for; the memory heap holds {self.heap_sizes[heap]}",
                                    capacity)
        ai = k.struct("VkMemoryAllocateInfo", allocationSize=req.size, memoryTypeIndex=type_index)
        mem = ffi.new("VkDeviceMemory*")
        res = faults.take("allocate") or lib.vkAllocateMemory(dev, ai, NULL, mem)
        if res < 0:
            lib.vkDestroyBuffer(dev, buffer, NULL)
            if res in (vk.VK_ERROR_OUT_OF_DEVICE_MEMORY, vk.VK_ERROR_OUT_OF_HOST_MEMORY):
                raise OutOfDeviceMemory(f"vkAllocateMemory({req.size} bytes) failed", capacity)
            check(res, "vkAllocateMemory")
        try:
            check(lib.vkBindBufferMemory(dev, buffer, mem[0], 0), "vkBindBufferMemory")
            host = None
            if (self.types[type_index][0] & _HOST) == _HOST:
                ptr = ffi.new("void**")
                check(lib.vkMapMemory(dev, mem[0], 0, capacity, 0, ptr), "vkMapMemory")
                host = np.frombuffer(ffi.buffer(ptr[0], capacity), dtype=np.uint8)
        except BaseException:
            lib.vkFreeMemory(dev, mem[0], NULL)
            lib.vkDestroyBuffer(dev, buffer, NULL)
            raise
        return self._track(Allocation(buffer, mem[0], capacity, kind, host, self))

    def _track(self, alloc: Allocation) -> Allocation:
        """Count a new allocation as live (until _destroy)."""
        with self.lock:
            self.allocated_bytes += alloc.capacity
            self.allocation_count += 1
            self.live[alloc.handle] = alloc
        return alloc

    @critical
    def import_host(self, host: np.ndarray) -> Buffer:
        """A buffer over host memory the caller owns (VK_EXT_external_memory_host): the GPU reads and writes `host`
        (uint8, its address and length multiples of the device's import alignment, `info.host_import_alignment`)
        in place, and several devices may import the same memory. Not pooled: a release destroys the buffer after
        its last use; the caller keeps `host` alive longer than every buffer over it."""
        info = self.device.info
        align = info.host_import_alignment
        if not align:
            raise UnsupportedFeature(f"{info.name} cannot import host memory (VK_EXT_external_memory_host)")
        if host.dtype != np.uint8 or host.ndim != 1 or host.ctypes.data % align or host.nbytes % align:
            raise ValueError(f"host memory to import must be 1-D uint8 at an address and of a length that are "
                             f"multiples of {align}")
        dev = self.device.device
        k = Keep()
        handle_type = vk.VK_EXTERNAL_MEMORY_HANDLE_TYPE_HOST_ALLOCATION_BIT_EXT
        ext = k.struct("VkExternalMemoryBufferCreateInfo", handleTypes=handle_type)
        ci = k.struct("VkBufferCreateInfo", pNext=ext, size=host.nbytes, usage=_USAGE,
                      sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE)
        out = ffi.new("VkBuffer*")
        check(lib.vkCreateBuffer(dev, ci, NULL, out), f"vkCreateBuffer({host.nbytes} bytes, host memory)")
        buffer = out[0]
        try:
            ptr = ffi.cast("void*", host.ctypes.data)
            props = k.struct("VkMemoryHostPointerPropertiesEXT")
            fn = ffi.cast("PFN_vkGetMemoryHostPointerPropertiesEXT",
                          lib.vkGetDeviceProcAddr(dev, k.cstr("vkGetMemoryHostPointerPropertiesEXT")))
            check(fn(dev, handle_type, ptr, props), "vkGetMemoryHostPointerPropertiesEXT")
            req = k.new("VkMemoryRequirements*")
            lib.vkGetBufferMemoryRequirements(dev, buffer, req)
            type_index = self._memory_type(props.memoryTypeBits & req.memoryTypeBits, "upload")
            imp = k.struct("VkImportMemoryHostPointerInfoEXT", handleType=handle_type, pHostPointer=ptr)
            ai = k.struct("VkMemoryAllocateInfo", pNext=imp, allocationSize=host.nbytes, memoryTypeIndex=type_index)
            mem = ffi.new("VkDeviceMemory*")
            check(lib.vkAllocateMemory(dev, ai, NULL, mem), "vkAllocateMemory (host memory)")
        except BaseException:
            lib.vkDestroyBuffer(dev, buffer, NULL)
            raise
        try:
            check(lib.vkBindBufferMemory(dev, buffer, mem[0], 0), "vkBindBufferMemory")
        except BaseException:
            lib.vkFreeMemory(dev, mem[0], NULL)
            lib.vkDestroyBuffer(dev, buffer, NULL)
            raise
        alloc = Allocation(buffer, mem[0], host.nbytes, "imported", None, self)
        alloc.keep = host  # the memory must outlive the VkDeviceMemory over it (freed after the GPU's last use)
        return Buffer(self._track(alloc), host.nbytes, _Unpooled(self))

    @critical
    def free_later(self, alloc: Allocation) -> None:
        """Destroy once the GPU has finished every submission that used it."""
        if self.destroyed:
            return
        with self.lock:
            self.pending_free.append(alloc)
        self.collect()

    def collect(self) -> None:
        """Destroy pending allocations whose last use has completed (from a queue's wait, which a command graph's
        finalizer makes, too: so through outside_books)."""
        if _later:
            _run_later()
        outside_books((self.lock,), self._collect)

    @critical
    def _collect(self) -> None:
        queue = getattr(self.device, "queue", None)
        done = queue.completed if queue is not None else float("inf")
        with self.lock:
            ready = [a for a in self.pending_free if a.last_use <= done]
            self.pending_free = [a for a in self.pending_free if a.last_use > done]
        for a in ready:
            self._destroy(a)

    @critical
    def _destroy(self, alloc: Allocation) -> None:
        with self.lock:
            if alloc.freed:
                return
            alloc.freed = True
            self.live.pop(alloc.handle, None)
        queue = getattr(self.device, "queue", None)
        if queue is not None:
            queue.forget_buffer(alloc.handle)
        dev = self.device.device
        if alloc.host is not None:
            alloc.host = None
            lib.vkUnmapMemory(dev, alloc.memory)
        lib.vkDestroyBuffer(dev, alloc.buffer, NULL)
        lib.vkFreeMemory(dev, alloc.memory, NULL)
        alloc.keep = None
        with self.lock:
            self.allocated_bytes -= alloc.capacity
            self.allocation_count -= 1

    def abandon(self) -> None:
        """The device is given up with work running: every allocation counts as freed (a later use raises
        DeviceClosed), none is destroyed (the GPU may still use it; the process's exit frees it)."""
        for pool in (self.pool, self.staging, self.readback):
            pool.closed = True
        with self.lock:
            for a in self.live.values():
                a.freed = True
                a.host = None
            self.live.clear()
            self.pending_free = []
        self.destroyed = True

    def destroy(self) -> None:
        for pool in (self.pool, self.staging, self.readback):
            pool.closed = True
            pool.trim(0)
        with self.lock:
            everything = list(self.live.values())
            self.pending_free = []
        for a in everything:
            self._destroy(a)
        self.destroyed = True

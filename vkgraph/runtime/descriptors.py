"""Descriptor sets, cached by (set layout, (VkBuffer, offset, range) per binding) and never updated after
creation. A set is freed when a VkBuffer it names is destroyed (only after its last use completed), or evicted,
least recently used first, among those the GPU is done with. Eviction runs before a new set is inserted: a new
set's last use is not yet recorded, so it would look idle and be freed before its own bind (NVIDIA's driver
answered that with a segfault). The queue and captured graphs both take their sets from here; a graph pins the
sets its recorded command buffers bind (a count: one set may serve several graphs, or several of one graph's
command buffers), and a pinned set is never evicted whatever its last use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import KernelInterfaceError
from .vk import NULL, Keep, check, ffi, lib, vk

if TYPE_CHECKING:
    from .device import Device
    from .memory import Allocation
    from .pipeline import Pipeline

CAPACITY = 8192
SETS_PER_POOL = 1024


def foreign_buffer(what: str, alloc: Any, device: Any) -> KernelInterfaceError:
    """The error for binding a buffer of one device in another device's work."""
    owner = getattr(alloc, "owner", None)
    where = f"another device ({owner.device.info.name})" if owner is not None else "no device"
    return KernelInterfaceError(f"{what}: a buffer belongs to {where}, not to the device recording this work "
                                f"({device.info.name}); move its values through the host")


class DescriptorSets:
    """The cache: `sets` maps a key to [VkDescriptorSet array, its pool, sequence number of its last use, pins]."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.sets: dict[tuple, list] = {}
        self.by_buffer: dict[int, set[tuple]] = {}  # VkBuffer handle -> keys of the sets naming it
        self.pools: list[Any] = []

    def get(self, pipe: Pipeline, buffers: list[Any], allocs: list[Allocation], key: tuple, completed: int) -> list:
        """The cached set for `key`, or a new one (`create`). The queue's dispatch inlines the lookup."""
        entry = self.sets.get(key)
        return entry if entry is not None else self.create(pipe, buffers, allocs, key, completed)

    def create(self, pipe: Pipeline, buffers: list[Any], allocs: list[Allocation], key: tuple,
               completed: int) -> list:
        """A new set for (the pipeline's layout, bound ranges), cached; `completed`: the last finished submission
        (sets whose last use it passed may be evicted to make room)."""
        info = self.device.info
        k = Keep()
        n = len(buffers)
        infos = k.new("VkDescriptorBufferInfo[]", max(n, 1))
        for i, (a, b) in enumerate(zip(allocs, buffers)):
            if a.owner is not self.device.memory:  # checked here, once per new set, not on the hot path
                raise foreign_buffer(f"kernel {pipe.name} binding {i}", a, self.device)
            if b.offset % info.min_storage_offset_alignment:
                raise KernelInterfaceError(f"kernel {pipe.name} binding {i}: offset {b.offset} is not a multiple "
                                           f"of minStorageBufferOffsetAlignment ({info.min_storage_offset_alignment})")
            rng = min(max(b.size, 4), a.capacity - b.offset)
            if rng > info.max_storage_buffer_range:
                raise KernelInterfaceError(
                    f"kernel {pipe.name} binding {i}: {b.size} bytes bound, over the device's "
                    f"maxStorageBufferRange ({info.max_storage_buffer_range}); bind it in views")
            infos[i].buffer, infos[i].offset, infos[i].range = a.buffer, b.offset, rng
        pool, ds = self._allocate_set(pipe.set_layout)
        if n:
            writes = k.new("VkWriteDescriptorSet[]", n)
            for i in range(n):
                w = writes[i]
                w.sType = vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET
                w.dstSet, w.dstBinding, w.descriptorCount = ds[0], i, 1
                w.descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
                w.pBufferInfo = infos + i
            lib.vkUpdateDescriptorSets(self.device.device, n, writes, 0, NULL)
        # evict before inserting: the new set's last use is not yet recorded, so it would look idle
        if len(self.sets) >= CAPACITY:
            self._evict(completed)
        entry = [ds, pool, 0, 0]
        self.sets[key] = entry
        for a in allocs:
            self.by_buffer.setdefault(a.handle, set()).add(key)
        return entry

    def _allocate_set(self, set_layout: Any) -> tuple[Any, Any]:
        k = Keep()
        layouts = k.new("VkDescriptorSetLayout[1]", [set_layout])
        ds = ffi.new("VkDescriptorSet[1]")
        for pool in reversed(self.pools[-1:]):
            ai = k.struct("VkDescriptorSetAllocateInfo", descriptorPool=pool, descriptorSetCount=1,
                          pSetLayouts=layouts)
            if lib.vkAllocateDescriptorSets(self.device.device, ai, ds) == vk.VK_SUCCESS:
                return pool, ds
        pool = self._new_descriptor_pool()
        ai = k.struct("VkDescriptorSetAllocateInfo", descriptorPool=pool, descriptorSetCount=1, pSetLayouts=layouts)
        check(lib.vkAllocateDescriptorSets(self.device.device, ai, ds), "vkAllocateDescriptorSets")
        return pool, ds

    def _new_descriptor_pool(self) -> Any:
        k = Keep()
        size = k.new("VkDescriptorPoolSize*")
        size.type, size.descriptorCount = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, SETS_PER_POOL * 8
        ci = k.struct("VkDescriptorPoolCreateInfo", flags=vk.VK_DESCRIPTOR_POOL_CREATE_FREE_DESCRIPTOR_SET_BIT,
                      maxSets=SETS_PER_POOL, poolSizeCount=1, pPoolSizes=size)
        out = ffi.new("VkDescriptorPool*")
        check(lib.vkCreateDescriptorPool(self.device.device, ci, NULL, out), "vkCreateDescriptorPool")
        self.pools.append(out[0])
        return out[0]

    def _evict(self, completed: int) -> None:
        # least recently used first, among those the GPU is done with
        over = len(self.sets) - CAPACITY // 2
        idle = sorted((key for key, e in self.sets.items() if e[2] <= completed and not e[3]),
                      key=lambda key: self.sets[key][2])
        for key in idle[:max(over, 0)]:
            self._free(key)

    def _free(self, key: tuple) -> None:
        entry = self.sets.pop(key, None)
        if entry is None:
            return
        for h, _, _ in key[1]:
            keys = self.by_buffer.get(h)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.by_buffer[h]
        lib.vkFreeDescriptorSets(self.device.device, entry[1], 1, entry[0])

    def forget_buffer(self, handle: int) -> None:
        """A VkBuffer is being destroyed (after its last use completed): free the sets naming it."""
        for key in list(self.by_buffer.get(handle, ())):
            self._free(key)

    @staticmethod
    def pin(entry: list) -> None:
        """Never evicted until unpinned as many times (a set a captured graph's command buffer binds)."""
        entry[3] += 1

    @staticmethod
    def unpin(entry: list, last_use: int) -> None:
        """One pin less; `last_use`: the last submission of the pinning command buffer (evictable once done)."""
        entry[3] -= 1
        entry[2] = max(entry[2], last_use)

    def counts(self) -> dict[str, int]:
        return {"descriptor_sets": len(self.sets), "descriptor_pools": len(self.pools)}

    def abandon(self) -> None:
        """Forget every set, free none (the device is given up with work still running)."""
        self.sets.clear()
        self.by_buffer.clear()

    def destroy(self) -> None:
        for pool in self.pools:
            lib.vkDestroyDescriptorPool(self.device.device, pool, NULL)
        self.pools.clear()
        self.sets.clear()
        self.by_buffer.clear()

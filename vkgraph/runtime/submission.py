"""A command buffer with its fence: what the queue records into and submits, and what a captured graph keeps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .vk import NULL, Keep, check, ffi, lib, vk

if TYPE_CHECKING:
    from .queue import Queue


class Submission:
    """A command buffer with its fence, and what must stay alive until the GPU is done with it."""

    def __init__(self, queue: Queue) -> None:
        dev = queue.device.device
        k = Keep()
        ai = k.struct("VkCommandBufferAllocateInfo", commandPool=queue.command_pool,
                      level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1)
        cmd = ffi.new("VkCommandBuffer[1]")
        check(lib.vkAllocateCommandBuffers(dev, ai, cmd), "vkAllocateCommandBuffers")
        self.cmd_array = cmd
        self.cmd = cmd[0]
        fci = k.struct("VkFenceCreateInfo")
        fence = ffi.new("VkFence[1]")
        check(lib.vkCreateFence(dev, fci, NULL, fence), "vkCreateFence")
        self.fence_array = fence
        self.fence = fence[0]
        self.submit_info = ffi.new("VkSubmitInfo*", {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                                                     "commandBufferCount": 1, "pCommandBuffers": cmd})
        self.begin_info = ffi.new("VkCommandBufferBeginInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
            "flags": vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT})
        self.seq = 0
        self.persistent = False  # a command graph's buffer: submitted again, never recycled
        self.held: list[Any] = []
        self.dispatches = 0
        self.profile: list[tuple[str, int]] = []  # (name, first query index)
        self.chained: list[Submission] = []  # submitted in the same vkQueueSubmit, completed by our fence

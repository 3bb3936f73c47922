"""One hierarchy for every failure vkgraph reports."""

from __future__ import annotations


class VkgraphError(RuntimeError):
    """Base of every vkgraph error."""


class DeviceError(VkgraphError):
    """A Vulkan call failed, or the device lacks what was asked for."""

    def __init__(self, message: str, result: int | None = None):
        super().__init__(message)
        self.result = result


class DeviceLost(DeviceError):
    """The device was lost (driver reset, hang or removal). Create a new runtime to continue."""


class DeviceClosed(DeviceError):
    """The device was closed (or replaced by reset_device()): its buffers, kernels and captures cannot be used."""


class DeviceTimeout(DeviceError):
    """Waiting for the GPU took longer than VKGRAPH_TIMEOUT_S."""


class UnsupportedFeature(DeviceError):
    """The device lacks a feature (a dtype, a subgroup operation, a limit) that the work needs."""


class OutOfDeviceMemory(DeviceError):
    """An allocation failed even after the pool released its idle buffers."""

    def __init__(self, message: str, nbytes: int, pool_stats: dict | None = None):
        super().__init__(message)
        self.nbytes = nbytes
        self.pool_stats = pool_stats or {}


class CompileError(VkgraphError):
    """GLSL failed to compile; the message holds the compiler's log and the numbered offending lines."""

    def __init__(self, message: str, log: str = "", source: str = ""):
        super().__init__(message)
        self.log = log
        self.source = source


class KernelInterfaceError(VkgraphError):
    """A kernel was dispatched with buffers, push constants or sizes that do not match its declaration."""


class CaptureError(VkgraphError):
    """Something was done inside a capture (or a jit-compiled function) that a replay cannot repeat."""

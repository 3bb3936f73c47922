"""The Vulkan runtime: device, buffer pool, compiler, pipelines, dispatch queue. Knows nothing of tensors."""

from .capture import CommandGraph, LiveValue
from .device import Device, DeviceInfo, current_device, get_device, open_device, reset_device, use_device
from .errors import (
    CaptureError,
    CompileError,
    DeviceClosed,
    DeviceError,
    DeviceLost,
    DeviceTimeout,
    KernelInterfaceError,
    OutOfDeviceMemory,
    UnsupportedFeature,
    VkgraphError,
)
from .memory import Buffer, BufferView, size_class
from .pipeline import Pipeline
from .transfer import HostCopy

__all__ = [
    "Buffer", "BufferView", "CaptureError", "CommandGraph", "CompileError", "Device", "DeviceClosed", "DeviceError",
    "DeviceInfo", "DeviceLost", "DeviceTimeout", "HostCopy", "KernelInterfaceError", "LiveValue", "OutOfDeviceMemory",
    "Pipeline", "UnsupportedFeature", "VkgraphError", "current_device", "get_device", "open_device", "reset_device",
    "size_class", "use_device",
]

"""vkgraph: a lazy tensor compiler for Vulkan.

    from vkgraph import Tensor
    y = (Tensor([1.0, 2.0]) * 3).exp().sum()   # lazy: a graph of nodes
    print(y.item())                             # fused into one kernel, compiled, run, read back
"""

from .dtype import DType, dtypes
from .graph import Variable
from .jit import jit
from .runtime import CaptureError, CompileError, DeviceError, OutOfDeviceMemory, VkgraphError, get_device
from .tensor import Tensor, cat, custom, manual_seed, realize_all, stack, where

__all__ = [
    "CaptureError", "CompileError", "DType", "DeviceError", "OutOfDeviceMemory", "Tensor", "Variable",
    "VkgraphError", "cat", "custom", "dtypes", "get_device", "jit", "manual_seed", "realize_all", "stack", "where",
]

"""Thin helpers over the `vulkan` package's cffi handles.

We build every struct with `ffi.new` and keep every nested allocation alive in a `Keep` list until the call
returns: the package's own wrappers free nested structs early (NVIDIA then fails pipeline creation). Hot paths
call `lib.vk*` directly; the wrappers cost several microseconds a call.
"""

from __future__ import annotations

from typing import Any

import vulkan as _vulkan

from .errors import DeviceError, DeviceLost, DeviceTimeout, OutOfDeviceMemory

ffi = _vulkan.ffi
lib = _vulkan.lib
NULL = ffi.NULL
vk = _vulkan

_RESULT_NAMES = {
    v: k for k, v in vars(_vulkan).items() if k.startswith("VK_ERROR_") or k in ("VK_TIMEOUT", "VK_NOT_READY")
}


def result_name(result: int) -> str:
    return _RESULT_NAMES.get(result, f"VkResult({result})")


def check(result: int, what: str) -> int:
    """Turn a negative VkResult into the matching vkgraph error; return non-negative results unchanged."""
    if result >= 0:
        return result
    name = result_name(result)
    if result == vk.VK_ERROR_DEVICE_LOST:
        raise DeviceLost(f"{what}: device lost ({name}); create a new runtime with vkgraph.runtime.reset_device()",
                         result)
    if result in (vk.VK_ERROR_OUT_OF_DEVICE_MEMORY, vk.VK_ERROR_OUT_OF_HOST_MEMORY):
        raise OutOfDeviceMemory(f"{what}: {name}", 0)
    raise DeviceError(f"{what} failed: {name}", result)


def check_wait(result: int, what: str, timeout_s: float) -> None:
    if result == vk.VK_TIMEOUT:
        raise DeviceTimeout(f"{what}: the GPU did not finish within {timeout_s:g} s (VKGRAPH_TIMEOUT_S); running "
                            "work cannot be cancelled: wait again, or abandon the device with "
                            "vkgraph.runtime.reset_device() (the process exits either way)", result)
    check(result, what)


class Keep(list):
    """Owns cffi allocations for the duration of one Vulkan call."""

    def new(self, ctype: str, init: Any = None) -> Any:
        obj = ffi.new(ctype, init)
        self.append(obj)
        return obj

    def cstr(self, s: str) -> Any:
        return self.new("char[]", s.encode())

    def cstr_array(self, items: list[str]) -> Any:
        ptrs = [self.cstr(s) for s in items]
        return self.new("char*[]", ptrs) if ptrs else NULL

    def struct(self, ctype: str, **fields: Any) -> Any:
        """A `ctype*` with sType filled in from the type name when the struct has one."""
        obj = self.new(ctype + "*")
        stype = _stype_of(ctype)
        if stype is not None:
            obj.sType = stype
        for k, v in fields.items():
            setattr(obj, k, v)
        return obj



# "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_8BIT_STORAGE_FEATURES" is found as "PHYSICALDEVICE8BITSTORAGEFEATURES",
# the struct's name without "Vk", upper-cased.
_STYPES = {
    k[len("VK_STRUCTURE_TYPE_"):].replace("_", ""): v
    for k, v in vars(_vulkan).items()
    if k.startswith("VK_STRUCTURE_TYPE_") and isinstance(v, int)
}


def _stype_of(ctype: str) -> int | None:
    try:
        fields = dict(ffi.typeof(ctype).fields)
    except (ffi.error, TypeError, KeyError):
        return None
    if "sType" not in fields:
        return None
    key = ctype[2:].upper()
    if key not in _STYPES:
        raise DeviceError(f"no VkStructureType known for {ctype}")
    return _STYPES[key]


def handle_int(handle: Any) -> int:
    return int(ffi.cast("uintptr_t", handle))

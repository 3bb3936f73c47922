"""Compute pipelines: compiled, keyed by (SPIR-V hash, specialization constants), with a disk pipeline cache.

A Pipeline (a kernel's program compiled for the device) carries everything the queue needs on the hot path,
prepared once: the VkPipeline and layout handles,
which bindings it writes, and the push-constant packer.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..caches import LRU
from ..flags import flag
from ..interrupts import critical
from .errors import KernelInterfaceError, UnsupportedFeature
from .interface import SCALAR_TYPES, KernelInterface, expand_includes, parse_interface
from .vk import NULL, Keep, check, ffi, lib, vk

if TYPE_CHECKING:
    from .device import Device

# pipelines and prepared sources each device keeps cached (caches.LRU)
PIPELINES = 1024
SOURCES = 1024


class Pipeline:
    """A kernel's program compiled for the device, ready to dispatch: `handle` is the VkPipeline."""

    def __init__(self, name: str, iface: KernelInterface, spec: dict[str, Any], local_size: tuple[int, int, int],
                 handle: Any, layout: Any, set_layout: Any, key: tuple) -> None:
        self.name = name
        self.interface = iface
        self.spec = spec
        self.local_size = local_size
        self.handle = handle
        self.layout = layout
        self.set_layout = set_layout
        self.layout_id = int(ffi.cast("uintptr_t", set_layout))
        self.key = key
        self.num_bindings = len(iface.bindings)
        self.writes = tuple(b.written for b in iface.bindings)
        self.push_names = tuple(f.name for f in iface.push_fields)
        self.push_size = iface.push_size
        self._push = iface.push_struct()
        self.push_pack = self._push.pack
        self.push_from_dict = _dict_packer(self.push_names, self.push_pack)
        self._push_types = tuple(f.type for f in iface.push_fields)

    def pack_push(self, push: Any) -> bytes:
        """Pack push constants given as a dict by name or a sequence in declaration order."""
        if not self.push_names:
            if push:
                raise KernelInterfaceError(f"kernel {self.name} declares no push constants, got {push!r}")
            return b""
        if isinstance(push, dict):
            missing = [n for n in self.push_names if n not in push]
            extra = [n for n in push if n not in self.push_names]
            if missing or extra:
                raise KernelInterfaceError(f"kernel {self.name} push constants {list(self.push_names)}: "
                                           f"missing {missing}, unknown {extra}")
            values = [push[n] for n in self.push_names]
        else:
            values = list(push or ())
            if len(values) != len(self.push_names):
                raise KernelInterfaceError(f"kernel {self.name} takes {len(self.push_names)} push constants "
                                           f"{list(self.push_names)}, got {len(values)}")
        try:
            return self._push.pack(*values)
        except struct.error as e:
            raise KernelInterfaceError(f"kernel {self.name}: push constants {dict(zip(self.push_names, values))} "
                                       f"do not fit types {self._push_types}: {e}") from e

    def __repr__(self) -> str:
        return f"Pipeline({self.name}, local_size={self.local_size}, bindings={self.num_bindings})"


def _dict_packer(names: tuple[str, ...], pack: Callable[..., bytes]) -> Callable[[dict], bytes]:
    """Packs a dict holding exactly `names` (the caller checks its length) in declaration order, prepared once
    per kernel; a missing name raises KeyError, a value of the wrong type struct.error."""
    if len(names) <= 1:  # itemgetter of one name returns the value, not a 1-tuple; of none, fails
        return lambda push: pack(*[push[name] for name in names])
    get = itemgetter(*names)
    return lambda push: pack(*get(push))


class CompileClock:
    """Wall time during which at least one program was being compiled (GLSL to SPIR-V, or a pipeline created),
    and how many pipelines were created: what speed figures leave out (generate) and warmup() reports. Compiles
    on several threads at once count their overlap once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._total = 0.0

    def __enter__(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._total += time.perf_counter() - self._since

    @property
    def seconds(self) -> float:
        """Seconds spent compiling so far (an ongoing compile counts up to now)."""
        with self._lock:
            return self._total + (time.perf_counter() - self._since if self._active else 0.0)


class PipelineManager:
    """The device's pipelines, bounded: the most recently used `PIPELINES` stay cached; an evicted one lives on
    while anything (a cached schedule, a captured graph, a template's launcher) still holds its Pipeline, is found
    again by its key meanwhile, and is destroyed once its Pipeline is gone and the GPU is past its last possible use.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.cached: LRU[tuple, Pipeline] = LRU("pipelines", PIPELINES)
        self.live: weakref.WeakValueDictionary[tuple, Pipeline] = weakref.WeakValueDictionary()
        self.retired: list[tuple[Any, int]] = []  # (VkPipeline, queue sequence number it waits for)
        self.built = 0  # pipelines created
        self.clock = CompileClock()
        # prepared sources, keyed by their GLSL text
        self.sources: LRU[tuple, tuple[str, KernelInterface, bytes]] = LRU("glsl sources", SOURCES)
        self.layouts: dict[tuple, tuple[Any, Any]] = {}  # by (bindings, push bytes): a handful per process
        self.destroyed = False
        self.lock = threading.RLock()
        self.building = 0  # pipelines being created outside the lock
        self.idle = threading.Condition(self.lock)  # notified when `building` comes back to 0
        info = device.info
        self.cache_path = (Path(flag("VKGRAPH_CACHE_DIR")) / "pipelines"
                           / f"{info.vendor_id:04x}-{info.device_id:04x}-{info.driver_version:x}-"
                             f"{info.pipeline_cache_uuid}.bin")
        self.pipeline_cache = self._create_pipeline_cache()

    def _create_pipeline_cache(self) -> Any:
        k = Keep()
        data = b""
        if flag("VKGRAPH_DISK_CACHE"):
            try:
                data = self.cache_path.read_bytes()
            except OSError:
                data = b""
        blob = k.new("char[]", data) if data else NULL
        ci = k.struct("VkPipelineCacheCreateInfo", initialDataSize=len(data), pInitialData=blob)
        out = ffi.new("VkPipelineCache*")
        if lib.vkCreatePipelineCache(self.device.device, ci, NULL, out) < 0:
            # a stale or corrupt cache file is rejected by the driver: start empty
            ci.initialDataSize, ci.pInitialData = 0, NULL
            check(lib.vkCreatePipelineCache(self.device.device, ci, NULL, out), "vkCreatePipelineCache")
        return out[0]

    @critical  # a pipeline built but not yet in the books would leak; its locks (see interrupts.py)
    def get(self, source: str, *, spec: dict[str, Any] | None, defines: dict[str, Any] | None, name: str | None,
               include_dirs: list[Any] | None, subgroup_size: int | None) -> Pipeline:
        if self.device.closed or self.device.lost:
            self.device.check_usable()
        spec = dict(spec or {})
        src_key = (source, tuple(sorted((defines or {}).items())), tuple(map(str, include_dirs or ())))
        with self.lock:
            prepared = self.sources.get(src_key)
        if prepared is None:
            from .compiler import with_defines

            dirs = [Path(d) for d in (include_dirs or [])]
            with self.clock:
                expanded = expand_includes(source, dirs)
                iface = parse_interface(with_defines(expanded, defines))
                spirv = self.device.compiler.compile(expanded, defines, target=_target(self.device))
            prepared = (hashlib.sha256(spirv).hexdigest(), iface, spirv)
            with self.lock:
                self.sources.put(src_key, prepared)
        spirv_hash, iface, spirv = prepared
        unknown = [n for n in spec if n not in iface.spec_constants]
        if unknown:
            raise KernelInterfaceError(f"specialization constants {unknown} not declared; the kernel declares "
                                       f"{sorted(iface.spec_constants)}")
        key = (spirv_hash, tuple(sorted(spec.items())), subgroup_size)
        with self.lock:
            if self.destroyed:  # the device closed while this thread compiled
                self.device.check_usable()
            k = self.cached.get(key)  # a hit is now the most recently used
            if k is not None:
                return k
            k = self.live.get(key)  # evicted, but still held somewhere: cached again
            if k is not None:
                self.cached.put(key, k)
                return k
            self.sweep()
            self.building += 1  # close() waits for it to come back to 0
        # created outside the lock, so threads compiling a new plan's programs create their pipelines at once
        # (a driver compiles the shader here; the pipeline cache is internally synchronized)
        try:
            with self.clock:
                k = self._build(name or _guess_name(source), iface, spirv, spirv_hash, spec, subgroup_size, key)
        except BaseException:
            with self.lock:
                self._built_one()
            raise
        with self.lock:
            self._built_one()
            other = self.live.get(key)
            if other is not None:  # another thread created the same pipeline meanwhile: keep that one
                lib.vkDestroyPipeline(self.device.device, k.handle, NULL)
                k = other
            else:
                self.live[key] = k
                # not at interpreter exit: the device's close destroys what is still live then; the manager
                # weakly, so a Pipeline kept in some cache does not keep a closed device alive
                weakref.finalize(k, _retire, weakref.ref(self), k.handle).atexit = False
            self.cached.put(key, k)
        return k

    def _built_one(self) -> None:
        """A creation outside the lock has ended (the caller holds the lock)."""
        self.building -= 1
        if not self.building:
            self.idle.notify_all()

    def sweep(self) -> None:
        """Destroy the retired pipelines the GPU is done with."""
        if not self.retired:
            return
        done = self.device.queue.completed
        keep = []
        for pipeline, seq in self.retired:
            if seq <= done:
                lib.vkDestroyPipeline(self.device.device, pipeline, NULL)
            else:
                keep.append((pipeline, seq))
        self.retired = keep

    def _build(self, name: str, iface: KernelInterface, spirv: bytes, spirv_hash: str, spec: dict[str, Any],
               subgroup_size: int | None, key: tuple) -> Pipeline:
        info = self.device.info
        if iface.push_size > info.max_push_constants_size:
            raise KernelInterfaceError(f"kernel {name}: push constants take {iface.push_size} bytes; the device "
                                       f"allows {info.max_push_constants_size}")
        if len(iface.bindings) > info.max_storage_buffers:
            raise KernelInterfaceError(f"kernel {name}: {len(iface.bindings)} storage buffers; the device allows "
                                       f"{info.max_storage_buffers} per kernel")
        local = []
        for v in iface.local_size:
            if isinstance(v, str):
                c = iface.spec_constants[v]
                v = int(spec.get(v, _parse_default(c.default, c.type)))
            local.append(int(v))
        # a local size set by a specialization constant is always specialized, default or not: lavapipe runs
        # the shader's literal LocalSize (1) when no value is passed
        spec = {**{v: local[i] for i, v in enumerate(iface.local_size) if isinstance(v, str)}, **spec}
        invocations = local[0] * local[1] * local[2]
        if invocations > info.max_workgroup_invocations or any(
                a > b for a, b in zip(local, info.max_workgroup_size, strict=True)):
            raise KernelInterfaceError(f"kernel {name}: local size {tuple(local)} exceeds the device's limits "
                                       f"({info.max_workgroup_size}, {info.max_workgroup_invocations} invocations)")
        dev = self.device.device
        k = Keep()
        with self.lock:
            set_layout, layout = self._layout(len(iface.bindings), iface.push_size)
        # the module is needed only while the pipeline is created (Vulkan allows destroying it right after)
        words = k.new("uint32_t[]", len(spirv) // 4)
        ffi.memmove(words, spirv, len(spirv))
        mci = k.struct("VkShaderModuleCreateInfo", codeSize=len(spirv), pCode=words)
        mod = ffi.new("VkShaderModule*")
        check(lib.vkCreateShaderModule(dev, mci, NULL, mod), f"vkCreateShaderModule({name})")
        module = mod[0]
        spec_info = NULL
        if spec:
            entries = k.new("VkSpecializationMapEntry[]", len(spec))
            data = b""
            for i, (sname, value) in enumerate(sorted(spec.items())):
                c = iface.spec_constants[sname]
                code = SCALAR_TYPES[c.type][0]
                entries[i].constantID, entries[i].offset, entries[i].size = c.id, len(data), 4
                data += struct.pack("<" + code, bool(value) if c.type == "bool" else value)
            blob = k.new("char[]", data)
            spec_info = k.struct("VkSpecializationInfo", mapEntryCount=len(spec), pMapEntries=entries,
                                 dataSize=len(data), pData=blob)
        stage_next = NULL
        stage_flags = 0
        if subgroup_size is not None:
            if not info.subgroup_size_control or not info.min_subgroup_size <= subgroup_size <= info.max_subgroup_size:
                raise UnsupportedFeature(f"kernel {name}: subgroup size {subgroup_size} cannot be required on "
                                         f"{info.name} (range {info.min_subgroup_size}-{info.max_subgroup_size})")
            stage_next = k.struct("VkPipelineShaderStageRequiredSubgroupSizeCreateInfo",
                                  requiredSubgroupSize=subgroup_size)
        stage = k.struct("VkPipelineShaderStageCreateInfo", pNext=stage_next, flags=stage_flags,
                         stage=vk.VK_SHADER_STAGE_COMPUTE_BIT, module=module, pName=k.cstr("main"),
                         pSpecializationInfo=spec_info)
        pci = k.new("VkComputePipelineCreateInfo[1]")
        pci[0].sType = vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO
        pci[0].stage = stage[0]
        pci[0].layout = layout
        if self.device.capture_statistics:  # Device.kernel_statistics
            pci[0].flags = vk.VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR
        out = ffi.new("VkPipeline*")
        try:
            check(lib.vkCreateComputePipelines(dev, self.pipeline_cache, 1, pci, NULL, out),
                  f"vkCreateComputePipelines({name})")
        finally:
            lib.vkDestroyShaderModule(dev, module, NULL)
        with self.lock:
            self.built += 1
        return Pipeline(name, iface, spec, (local[0], local[1], local[2]), out[0], layout, set_layout, key)

    def _layout(self, num_bindings: int, push_size: int) -> tuple[Any, Any]:
        key = (num_bindings, push_size)
        got = self.layouts.get(key)
        if got is not None:
            return got
        dev = self.device.device
        k = Keep()
        binds = k.new("VkDescriptorSetLayoutBinding[]", max(num_bindings, 1))
        for i in range(num_bindings):
            binds[i].binding, binds[i].descriptorType = i, vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
            binds[i].descriptorCount, binds[i].stageFlags = 1, vk.VK_SHADER_STAGE_COMPUTE_BIT
        lci = k.struct("VkDescriptorSetLayoutCreateInfo", bindingCount=num_bindings,
                       pBindings=binds if num_bindings else NULL)
        sl = ffi.new("VkDescriptorSetLayout*")
        check(lib.vkCreateDescriptorSetLayout(dev, lci, NULL, sl), "vkCreateDescriptorSetLayout")
        rng = k.new("VkPushConstantRange*")
        rng.stageFlags, rng.offset, rng.size = vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, push_size
        sets = k.new("VkDescriptorSetLayout[1]", [sl[0]])
        pl = k.struct("VkPipelineLayoutCreateInfo", setLayoutCount=1, pSetLayouts=sets,
                      pushConstantRangeCount=1 if push_size else 0, pPushConstantRanges=rng if push_size else NULL)
        out = ffi.new("VkPipelineLayout*")
        check(lib.vkCreatePipelineLayout(dev, pl, NULL, out), "vkCreatePipelineLayout")
        self.layouts[key] = (sl[0], out[0])
        return self.layouts[key]

    def save_cache(self) -> None:
        if not flag("VKGRAPH_DISK_CACHE"):
            return
        size = ffi.new("size_t*")
        if lib.vkGetPipelineCacheData(self.device.device, self.pipeline_cache, size, NULL) < 0 or size[0] == 0:
            return
        data = ffi.new("char[]", size[0])
        if lib.vkGetPipelineCacheData(self.device.device, self.pipeline_cache, size, data) < 0:
            return
        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.cache_path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(ffi.buffer(data, size[0]))
            os.replace(tmp, self.cache_path)
        except OSError:
            pass  # the cache only saves time

    @critical
    def destroy(self) -> None:
        """The GPU is idle: destroy every pipeline, cached, still held or retired."""
        with self.lock:  # no thread builds a pipeline meanwhile (get() checks `destroyed` under it)
            while self.building:  # creations under way finish (one pipeline each) and enter the books first
                self.idle.wait()
            self._destroy()

    def _destroy(self) -> None:
        dev = self.device.device
        self.save_cache()
        self.destroyed = True
        for k in list(self.live.values()):
            lib.vkDestroyPipeline(dev, k.handle, NULL)
        for pipeline, _ in self.retired:
            lib.vkDestroyPipeline(dev, pipeline, NULL)
        for sl, pl in self.layouts.values():
            lib.vkDestroyPipelineLayout(dev, pl, NULL)
            lib.vkDestroyDescriptorSetLayout(dev, sl, NULL)
        lib.vkDestroyPipelineCache(dev, self.pipeline_cache, NULL)
        self.cached.clear()
        self.sources.clear()
        self.live.clear()
        self.retired = []
        self.layouts.clear()


def _retire(manager: weakref.ref[PipelineManager], pipeline: Any) -> None:
    """A Pipeline died (no cache or holder keeps it): its pipeline waits for every submission numbered so far, the
    command buffer being recorded included (a finalizer makes no Vulkan call; `PipelineManager.sweep` does)."""
    m = manager()
    if m is not None and not m.destroyed:
        m.retired.append((pipeline, m.device.queue.next_seq - 1))


def _target(device: Device) -> str:
    return "vulkan1.3" if device.info.api_version >= (1, 3, 0) else "vulkan1.2"


def _parse_default(text: str, typ: str) -> Any:
    text = text.strip().rstrip("uUfF")
    if typ == "float":
        return float(text)
    if typ == "bool":
        return text == "true"
    return int(text, 0)


def _guess_name(source: str) -> str:
    for line in source.splitlines():
        s = line.strip()
        if s.startswith("// kernel:"):
            return s.split(":", 1)[1].strip()
    return "kernel-" + hashlib.sha256(source.encode()).hexdigest()[:8]

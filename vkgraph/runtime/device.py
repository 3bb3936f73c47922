"""Instance, physical-device choice, features and limits, logical device; the Device facade.

The Device ties the runtime together: its pool, compiler, pipelines and queue. Layers above call
`get_device()` and use `alloc / upload / download / kernel / dispatch / flush / synchronize`.
"""

from __future__ import annotations

import atexit
import contextvars
import ctypes
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import interrupts
from ..flags import flag, warn_unknown
from .compiler import Compiler
from .errors import DeviceClosed, DeviceError, DeviceLost, UnsupportedFeature
from .memory import Buffer, BufferView, MemoryManager
from .pipeline import Pipeline, PipelineManager
from .queue import Queue
from .transfer import HostCopy, Transfers
from .vk import NULL, Keep, check, ffi, lib, vk

_TYPE_NAMES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
_TYPE_PREFERENCE = {"discrete": 0, "integrated": 1, "virtual": 2, "cpu": 3, "other": 4}
_SUBGROUP_OPS = {
    vk.VK_SUBGROUP_FEATURE_BASIC_BIT: "basic", vk.VK_SUBGROUP_FEATURE_VOTE_BIT: "vote",
    vk.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT: "arithmetic", vk.VK_SUBGROUP_FEATURE_BALLOT_BIT: "ballot",
    vk.VK_SUBGROUP_FEATURE_SHUFFLE_BIT: "shuffle", vk.VK_SUBGROUP_FEATURE_SHUFFLE_RELATIVE_BIT: "shuffle_relative",
    vk.VK_SUBGROUP_FEATURE_CLUSTERED_BIT: "clustered", vk.VK_SUBGROUP_FEATURE_QUAD_BIT: "quad",
}
VALIDATION_LAYER = "VK_LAYER_KHRONOS_validation"
COOP_EXT = "VK_KHR_cooperative_matrix"
BF16_EXT = "VK_KHR_shader_bfloat16"
# workgroup-scope cooperative matrices of flexible dimensions (the driver tiles one product over a workgroup)
COOP2_EXT = "VK_NV_cooperative_matrix2"
# matrix-vector products of a vector per invocation by a matrix in memory (benchmarks/probe_coop_vector.py)
COOPVEC_EXT = "VK_NV_cooperative_vector"
HOST_MEMORY_EXT = "VK_EXT_external_memory_host"  # buffers over host memory several devices share (memory.py)
STATS_EXT = "VK_KHR_pipeline_executable_properties"  # the compiled kernels' statistics (kernel_statistics)
# VK_KHR_shader_bfloat16 postdates the `vulkan` package: its struct type and component type by value
_STYPE_BF16_FEATURES = 1000141000
# so does VK_NV_cooperative_matrix2: its features, flexible-dimension properties and properties by value
_STYPE_COOP2_FEATURES, _STYPE_COOP_FLEXIBLE, _STYPE_COOP2_PROPERTIES = 1000593000, 1000593001, 1000593002
# and VK_NV_cooperative_vector: features, properties, one supported combination of types
_STYPE_COOPVEC_FEATURES, _STYPE_COOPVEC_PROPERTIES, _STYPE_COOPVEC_COMBINATION = 1000491000, 1000491001, 1000491002
_COMPONENT_NAMES = {
    vk.VK_COMPONENT_TYPE_FLOAT16_KHR: "float16", vk.VK_COMPONENT_TYPE_FLOAT32_KHR: "float32",
    vk.VK_COMPONENT_TYPE_FLOAT64_KHR: "float64", vk.VK_COMPONENT_TYPE_SINT8_KHR: "int8",
    vk.VK_COMPONENT_TYPE_SINT16_KHR: "int16", vk.VK_COMPONENT_TYPE_SINT32_KHR: "int32",
    vk.VK_COMPONENT_TYPE_SINT64_KHR: "int64", vk.VK_COMPONENT_TYPE_UINT8_KHR: "uint8",
    vk.VK_COMPONENT_TYPE_UINT16_KHR: "uint16", vk.VK_COMPONENT_TYPE_UINT32_KHR: "uint32",
    vk.VK_COMPONENT_TYPE_UINT64_KHR: "uint64", 1000141000: "bfloat16",
    1000491000: "int8_packed", 1000491001: "uint8_packed", 1000491002: "float_e4m3", 1000491003: "float_e5m2",
}
# the Vulkan headers that introduced VK_KHR_cooperative_matrix (1.3.255) and VK_KHR_shader_bfloat16 (1.4.311)
_COOP_LAYER_VERSION = vk.VK_MAKE_VERSION(1, 3, 255)
_COOP2_LAYER_VERSION = vk.VK_MAKE_VERSION(1, 3, 300)  # VK_NV_cooperative_matrix2 and VK_NV_cooperative_vector
_BF16_LAYER_VERSION = vk.VK_MAKE_VERSION(1, 4, 311)
_SCOPE_NAMES = {1: "device", 2: "workgroup", 3: "subgroup", 5: "queue_family"}


@dataclass(frozen=True)
class CoopShape:
    """One cooperative-matrix configuration the device supports: result (M x N) += A (M x K) * B (K x N)."""

    m: int
    n: int
    k: int
    a: str  # component type names, as vkgraph's dtypes spell them
    b: str
    c: str
    result: str
    scope: str
    saturating: bool = False

    def __str__(self) -> str:
        sat = " saturating" if self.saturating else ""
        return f"{self.m}x{self.n}x{self.k} {self.a}*{self.b}+{self.c}->{self.result} {self.scope}{sat}"


@dataclass(frozen=True)
class CoopFlexShape:
    """A workgroup-scope cooperative-matrix configuration of VK_NV_cooperative_matrix2: result (M x N) += A (M x K)
    * B (K x N) for any M, N, K that are multiples of the granularities (up to the device's maximum dimension), in
    a workgroup of exactly `invocations` invocations."""

    m: int  # granularities
    n: int
    k: int
    a: str
    b: str
    c: str
    result: str
    invocations: int
    saturating: bool = False

    def __str__(self) -> str:
        sat = " saturating" if self.saturating else ""
        return f"{self.m}x{self.n}x{self.k}-multiples {self.a}*{self.b}+{self.c}->{self.result} " \
               f"workgroup of {self.invocations}{sat}"


@dataclass(frozen=True)
class CoopVecTypes:
    """One combination of types VK_NV_cooperative_vector multiplies: an `input` vector read as `interpretation`,
    times a matrix of `matrix` components (plus a bias of `bias` components), giving a `result` vector."""

    input: str
    interpretation: str
    matrix: str
    bias: str
    result: str
    transpose: bool

    def __str__(self) -> str:
        return (f"{self.input} as {self.interpretation} x {self.matrix} + {self.bias} -> {self.result}"
                + (" transposable" if self.transpose else ""))


@dataclass
class DeviceInfo:
    """Features and limits of the chosen physical device, as the layers above need them."""

    name: str
    vendor_id: int
    device_id: int
    device_type: str
    api_version: tuple[int, int, int]
    driver_version: int
    pipeline_cache_uuid: str
    subgroup_size: int
    subgroup_ops: frozenset[str]
    subgroup_size_control: bool
    min_subgroup_size: int
    max_subgroup_size: int
    float16: bool
    float64: bool
    int8: bool
    int16: bool
    int64: bool
    storage_8bit: bool
    storage_16bit: bool
    subgroup_extended_types: bool
    integer_dot_product: bool
    integer_dot_product_accelerated: bool
    max_workgroup_invocations: int
    max_workgroup_size: tuple[int, int, int]
    max_workgroup_count: tuple[int, int, int]
    max_shared_memory: int
    max_storage_buffer_range: int
    max_allocation_size: int
    max_buffer_size: int
    max_push_constants_size: int
    max_storage_buffers: int
    min_storage_offset_alignment: int
    timestamp_period: float
    timestamps: bool
    unified_memory: bool
    heaps: list[tuple[int, bool]] = field(default_factory=list)
    # VK_KHR_cooperative_matrix: the configurations the driver lists (empty where the extension is absent),
    # and whether bfloat16 may be an operand type of them (VK_KHR_shader_bfloat16)
    cooperative_matrix: tuple[CoopShape, ...] = ()
    bfloat16_cooperative_matrix: bool = False
    # VK_NV_cooperative_matrix2 with workgroup scope and flexible dimensions (empty where absent), the largest
    # dimension a flexible matrix may have, and the shared memory the driver keeps for itself in such a kernel
    cooperative_matrix_flexible: tuple[CoopFlexShape, ...] = ()
    cooperative_matrix_max_dimension: int = 0
    cooperative_matrix_reserved_shared: int = 0
    # ... and whether its matrices may be loaded through tensor layouts (cooperativeMatrixTensorAddressing)
    cooperative_matrix_tensor_addressing: bool = False
    # VK_NV_cooperative_vector: the type combinations of its matrix-vector products (empty where absent) and the
    # longest vector
    cooperative_vector: tuple[CoopVecTypes, ...] = ()
    cooperative_vector_max_components: int = 0
    # float controls the device honours for 32-bit floats (VkPhysicalDeviceVulkan12Properties):
    # "signed_zero_inf_nan_preserve", "denorm_preserve"
    float_controls: frozenset[str] = frozenset()
    # VK_EXT_external_memory_host: the alignment of host memory a buffer may be made over (0: not supported)
    host_import_alignment: int = 0
    # VK_KHR_pipeline_executable_properties: the driver can report what it compiled (registers, shared memory, ...
    # as it names them); captured for kernels built while VKGRAPH_PIPELINE_STATS=1 (Device.kernel_statistics)
    pipeline_statistics: bool = False

    def require_scalar(self, name: str) -> None:
        """Raise UnsupportedFeature if buffers of this scalar type (as numpy names it: "int64", "float16",
        "bfloat16", ...) cannot be stored or computed with on this device. bfloat16 is computed in float32, so it
        needs 16-bit storage only."""
        if name == "int64" and not self.int64:
            raise UnsupportedFeature(f"int64 tensors need shaderInt64, which {self.name} lacks; use int32")
        storage = _STORAGE_FEATURE.get(_SCALAR_BYTES.get(name, 4))
        if storage and not getattr(self, storage):
            raise UnsupportedFeature(f"{name} tensors need {storage}, which {self.name} lacks")
        arith = _ARITH_FEATURE.get(name)
        if arith and not getattr(self, arith):
            raise UnsupportedFeature(f"{name} tensors need the shader feature {arith}, which {self.name} lacks")

    def rows(self) -> list[tuple[str, str]]:
        out = []
        for k, v in self.__dict__.items():
            if isinstance(v, frozenset):
                v = ", ".join(sorted(v))
            elif k in ("cooperative_matrix", "cooperative_matrix_flexible", "cooperative_vector"):
                v = "; ".join(map(str, v)) if v else "none"
            elif k == "heaps":
                v = "; ".join(f"{s / 2**30:.1f} GiB{' device-local' if d else ''}" for s, d in v)
            elif isinstance(v, int) and not isinstance(v, bool) and v >= 1 << 20:
                v = f"{v} ({v / 2**20:.0f} MiB)"
            out.append((k, str(v)))
        return out


_SCALAR_BYTES = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2}
_STORAGE_FEATURE = {1: "storage_8bit", 2: "storage_16bit"}
# arithmetic in the type itself
_ARITH_FEATURE = {"float16": "float16", "int8": "int8", "uint8": "int8", "int16": "int16", "uint16": "int16"}


class Device:
    """A Vulkan device and everything vkgraph keeps per device. The layers above use the facade (alloc,
    upload, download, pipeline, dispatch, flush, synchronize) and `info`; the parts are its units."""

    info: DeviceInfo
    compiler: Compiler  # GLSL -> SPIR-V
    memory: MemoryManager  # allocations and the buffer pools
    pipelines: PipelineManager  # compiled programs
    queue: Queue  # recording, hazards, submission
    transfers: Transfers  # host uploads and downloads

    def __init__(self, selector: str | None = None) -> None:
        warn_unknown()
        self._lock = threading.RLock()
        self.closed = False
        self.lost = False
        self.abandoned = False  # closed with work still running: its objects were left to the process's exit
        self.validation_messages: list[str] = []
        self.validation_version: int | None = None  # the validation layer's header version, when it is on
        self._create_instance()
        try:
            chosen = selector if selector is not None else flag("VKGRAPH_DEVICE")
            self.physical, self.info = self._choose_physical(chosen)
            self._within_validation()
            # the driver keeps what it compiled for kernel_statistics only when asked at device creation
            self.capture_statistics = bool(flag("VKGRAPH_PIPELINE_STATS")) and self.info.pipeline_statistics
            self._create_device()
            self.compiler = Compiler()
            self.memory = MemoryManager(self)
            self.pipelines = PipelineManager(self)
            self.queue = Queue(self)
            self.transfers = Transfers(self)
        except BaseException:
            self._destroy_partial()
            raise
        interrupts.install()

    # ---- instance and physical device ------------------------------------------------------------------------
    def _create_instance(self) -> None:
        k = Keep()
        validate, layers = self._validation()
        exts = ["VK_EXT_debug_utils"] if validate else []
        app = k.struct("VkApplicationInfo", pApplicationName=k.cstr("vkgraph"), applicationVersion=1,
                       pEngineName=k.cstr("vkgraph"), engineVersion=1, apiVersion=vk.VK_MAKE_VERSION(1, 3, 0))
        ci = k.struct("VkInstanceCreateInfo", pApplicationInfo=app, enabledLayerCount=len(layers),
                      ppEnabledLayerNames=k.cstr_array(layers), enabledExtensionCount=len(exts),
                      ppEnabledExtensionNames=k.cstr_array(exts))
        out = ffi.new("VkInstance*")
        res = lib.vkCreateInstance(ci, NULL, out)
        if res == vk.VK_ERROR_INCOMPATIBLE_DRIVER:
            raise DeviceError("no Vulkan driver found (install mesa-vulkan-drivers for the CPU driver lavapipe)", res)
        check(res, "vkCreateInstance")
        self.instance = out[0]
        self.messenger = None
        if validate:
            self._install_messenger()

    def _validation(self) -> tuple[bool, list[str]]:
        """Whether validation is on, and the layers we must enable ourselves (the loader enables those in
        VK_INSTANCE_LAYERS); with validation on, a debug messenger collects every message."""
        env_layers = os.environ.get("VK_INSTANCE_LAYERS", "")
        want = flag("VKGRAPH_VALIDATION") or VALIDATION_LAYER in env_layers
        if not want:
            return False, []
        count = ffi.new("uint32_t*")
        lib.vkEnumerateInstanceLayerProperties(count, NULL)
        props = ffi.new("VkLayerProperties[]", count[0])
        lib.vkEnumerateInstanceLayerProperties(count, props)
        names = {ffi.string(props[i].layerName).decode(): props[i].specVersion for i in range(count[0])}
        if VALIDATION_LAYER not in names:
            raise DeviceError(f"validation asked for but {VALIDATION_LAYER} is not installed "
                              "(Debian: vulkan-validationlayers)")
        self.validation_version = names[VALIDATION_LAYER]
        return True, [] if VALIDATION_LAYER in env_layers else [VALIDATION_LAYER]

    def _within_validation(self) -> None:
        """Leave off the extensions an older validation layer does not know: it reports their structures as
        errors (VUID-VkDeviceCreateInfo-pNext-pNext) and cannot check their use, so a validated run tests the
        paths it can check; cooperative matrices then read as absent. (The hand-laid NVIDIA extensions are not
        even queried then: layer_knows_hand_laid.)"""
        v = self.validation_version
        if v is None:
            return
        if v < _COOP_LAYER_VERSION:
            self.info.cooperative_matrix, self.info.bfloat16_cooperative_matrix = (), False
        elif v < _BF16_LAYER_VERSION and self.info.bfloat16_cooperative_matrix:
            self.info.cooperative_matrix = tuple(c for c in self.info.cooperative_matrix
                                                 if "bfloat16" not in (c.a, c.b))
            self.info.bfloat16_cooperative_matrix = False
            self.info.cooperative_matrix_flexible = tuple(c for c in self.info.cooperative_matrix_flexible
                                                          if "bfloat16" not in (c.a, c.b))

    def _install_messenger(self) -> None:
        messages = self.validation_messages
        echo = flag("VKGRAPH_VALIDATION") >= 2

        def callback(severity, types, data, user):  # noqa: ARG001 (the signature is Vulkan's)
            text = ffi.string(data.pMessage).decode(errors="replace")
            messages.append(text)
            if echo:  # before any crash the message may explain
                print(f"vulkan validation: {text}", file=sys.stderr, flush=True)
            return 0

        create = vk.vkGetInstanceProcAddr(self.instance, "vkCreateDebugUtilsMessengerEXT")
        sev = vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT | vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT
        typ = (vk.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT
               | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_PERFORMANCE_BIT_EXT)
        info = vk.VkDebugUtilsMessengerCreateInfoEXT(messageSeverity=sev, messageType=typ, pfnUserCallback=callback)
        self._callback = callback
        self._messenger_info = info
        self.messenger = create(self.instance, info, None)

    def _physical_devices(self) -> list[tuple[Any, DeviceInfo]]:
        count = ffi.new("uint32_t*")
        check(lib.vkEnumeratePhysicalDevices(self.instance, count, NULL), "vkEnumeratePhysicalDevices")
        if count[0] == 0:
            raise DeviceError("Vulkan found no physical device (install mesa-vulkan-drivers for lavapipe)")
        handles = ffi.new("VkPhysicalDevice[]", count[0])
        check(lib.vkEnumeratePhysicalDevices(self.instance, count, handles), "vkEnumeratePhysicalDevices")
        hand_laid = layer_knows_hand_laid(self.validation_version)
        return [(handles[i], _query_info(handles[i], self.instance, hand_laid)) for i in range(count[0])]

    def physical_devices(self) -> list[tuple[str, bool]]:
        """Every physical device Vulkan lists, in its order (what VKGRAPH_DEVICE's index counts): (name, whether it
        is the one this Device runs on)."""
        return [(info.name, h == self.physical) for h, info in self._physical_devices()]

    def _choose_physical(self, selector: str) -> tuple[Any, DeviceInfo]:
        found = self._physical_devices()
        if selector != "":
            if selector.isdigit():
                idx = int(selector)
                if idx >= len(found):
                    raise DeviceError(f"VKGRAPH_DEVICE={selector}: only {len(found)} devices: "
                                      + ", ".join(f"{i}: {f[1].name}" for i, f in enumerate(found)))
                return found[idx]
            match = [f for f in found if selector.lower() in f[1].name.lower()]
            if not match:
                raise DeviceError(f"VKGRAPH_DEVICE={selector!r} matches none of: "
                                  + ", ".join(f[1].name for f in found))
            return match[0]
        return min(found, key=lambda f: _TYPE_PREFERENCE[f[1].device_type])

    # ---- logical device -------------------------------------------------------------------------------------
    def _create_device(self) -> None:
        k = Keep()
        count = ffi.new("uint32_t*")
        lib.vkGetPhysicalDeviceQueueFamilyProperties(self.physical, count, NULL)
        fams = ffi.new("VkQueueFamilyProperties[]", count[0])
        lib.vkGetPhysicalDeviceQueueFamilyProperties(self.physical, count, fams)
        compute = [i for i in range(count[0]) if fams[i].queueFlags & vk.VK_QUEUE_COMPUTE_BIT]
        if not compute:
            raise DeviceError(f"{self.info.name} has no compute queue")
        # The first compute family is the universal one on every driver we know; it has timestamps.
        self.queue_family = compute[0]
        self.info.timestamps = fams[self.queue_family].timestampValidBits > 0
        prio = k.new("float[1]", [1.0])
        qci = k.struct("VkDeviceQueueCreateInfo", queueFamilyIndex=self.queue_family, queueCount=1,
                       pQueuePriorities=prio)
        f11, f12, f13, f2 = _feature_chain(k)
        lib.vkGetPhysicalDeviceFeatures2(self.physical, f2)
        # Enable only what vkgraph uses, and only where present.
        e11, e12, e13, e2 = _feature_chain(k)
        for name in ("shaderInt64", "shaderInt16", "shaderFloat64"):
            setattr(e2.features, name, getattr(f2.features, name))
        for name in ("storageBuffer16BitAccess", "uniformAndStorageBuffer16BitAccess", "storagePushConstant16"):
            setattr(e11, name, getattr(f11, name))
        for name in ("shaderFloat16", "shaderInt8", "storageBuffer8BitAccess", "uniformAndStorageBuffer8BitAccess",
                     "storagePushConstant8", "shaderSubgroupExtendedTypes", "hostQueryReset", "vulkanMemoryModel",
                     "vulkanMemoryModelDeviceScope", "shaderBufferInt64Atomics", "scalarBlockLayout"):
            setattr(e12, name, getattr(f12, name))
        if self.info.api_version >= (1, 3, 0):
            for name in ("subgroupSizeControl", "computeFullSubgroups", "shaderIntegerDotProduct", "maintenance4",
                         "synchronization2"):
                setattr(e13, name, getattr(f13, name))
        else:
            e12.pNext = NULL
        exts = []
        tail = e13 if self.info.api_version >= (1, 3, 0) else e12
        if self.info.cooperative_matrix:  # listed only where the extension and its feature are present
            exts.append(COOP_EXT)
            coop = k.struct("VkPhysicalDeviceCooperativeMatrixFeaturesKHR", cooperativeMatrix=1)
            tail.pNext = coop
            tail = coop
        if self.info.bfloat16_cooperative_matrix:
            exts.append(BF16_EXT)
            bf16 = _bf16_features(k, enable=True)
            tail.pNext = bf16
            tail = ffi.cast("VkBaseOutStructure*", bf16)
        before_nv = tail  # the NVIDIA extensions below are laid out by hand: see the retry at vkCreateDevice
        if self.info.cooperative_matrix_flexible:
            exts.append(COOP2_EXT)
            coop2 = _coop2_features(k, enable=True, tensor_addressing=self.info.cooperative_matrix_tensor_addressing)
            tail.pNext = coop2
            tail = ffi.cast("VkBaseOutStructure*", coop2)
        if self.info.cooperative_vector:
            exts.append(COOPVEC_EXT)
            tail.pNext = _coopvec_features(k, enable=True)
        if self.info.host_import_alignment:
            exts.append(HOST_MEMORY_EXT)
        if self.capture_statistics:
            exts.append(STATS_EXT)
            stats = k.struct("VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR", pipelineExecutableInfo=1)
            stats.pNext = e2.pNext
            e2.pNext = stats
        out = ffi.new("VkDevice*")

        def create(names: list[str]) -> int:
            ci = k.struct("VkDeviceCreateInfo", pNext=e2, queueCreateInfoCount=1, pQueueCreateInfos=qci,
                          enabledExtensionCount=len(names), ppEnabledExtensionNames=k.cstr_array(names))
            return lib.vkCreateDevice(self.physical, ci, NULL, out)

        result = create(exts)
        nv = {COOP2_EXT, COOPVEC_EXT} & set(exts)
        if result < 0 and nv:  # a driver that refuses the hand-laid NVIDIA structures: a device without them
            before_nv.pNext = NULL
            _leave_off_nvidia(self.info)
            result = create([e for e in exts if e not in nv])
        check(result, "vkCreateDevice")
        self.device = out[0]
        q = ffi.new("VkQueue*")
        lib.vkGetDeviceQueue(self.device, self.queue_family, 0, q)
        self.vk_queue = q[0]

    # ---- the facade the layers above use ---------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Buffer:
        """A pooled device buffer of `nbytes` (its size; its capacity may be larger)."""
        if self.lost or self.closed:
            self.check_usable()
        q = self.queue
        if q.capture is not None and q.capture.thread != threading.get_ident():
            q.await_capture()  # a capture's intermediates are handed only to its own thread
        return self.memory.pool.alloc(nbytes)

    def import_host(self, host: np.ndarray) -> Buffer:
        """A buffer over the caller's host memory, which other devices may import too (MemoryManager.import_host)."""
        if self.lost or self.closed:
            self.check_usable()
        return self.memory.import_host(host)

    def upload(self, buf: Buffer | BufferView, array: np.ndarray | bytes | memoryview, offset: int = 0) -> None:
        """Copy host bytes into `buf` at byte `offset`, ordered after work already recorded."""
        if self.lost or self.closed:
            self.check_usable()
        self.transfers.upload(buf, array, offset)

    def download(self, buf: Buffer | BufferView, dtype: Any = np.uint8, shape: tuple[int, ...] | int | None = None,
                 offset: int = 0) -> np.ndarray:
        """A new numpy array holding `buf`'s bytes from `offset`, once every recorded writer has finished."""
        if self.lost or self.closed:
            self.check_usable()
        return self.transfers.download(buf, dtype, shape, offset)

    def download_async(self, buf: Buffer | BufferView, dtype: Any, shape: tuple[int, ...]) -> HostCopy:
        """Start a download of `buf`'s first bytes as an array of `shape`; see Transfers.download_async."""
        if self.lost or self.closed:
            self.check_usable()
        return self.transfers.download_async(buf, dtype, shape)

    def pipeline(self, source: str, *, spec: dict[str, Any] | None = None, defines: dict[str, Any] | None = None,
               name: str | None = None, include_dirs: list[str | Path] | None = None,
               subgroup_size: int | None = None) -> Pipeline:
        """GLSL `source` compiled for this device, cached (see docs/runtime.md); `pipelines.get` checks first
        that the device is usable."""
        return self.pipelines.get(source, spec=spec, defines=defines, name=name, include_dirs=include_dirs,
                                     subgroup_size=subgroup_size)

    def dispatch(self, pipeline: Pipeline, buffers: list[Buffer | BufferView], groups: tuple[int, ...] | int,
                 push: dict[str, Any] | tuple | list | None = None) -> None:
        """Record one dispatch; barriers follow from which bindings the kernel writes."""
        self.queue.dispatch(pipeline, buffers, groups, push)

    def kernel_statistics(self, pipeline: Pipeline) -> dict[str, dict[str, int | float | bool]]:
        """What the driver reports of a compiled kernel (VK_KHR_pipeline_executable_properties), per executable:
        statistic name -> value, in the driver's own names (on NVIDIA e.g. registers per invocation and shared
        memory). Needs a device made with VKGRAPH_PIPELINE_STATS=1 where the driver offers the extension."""
        if not self.capture_statistics:
            why = ("the driver does not offer VK_KHR_pipeline_executable_properties" if not
                   self.info.pipeline_statistics else "this device was made without VKGRAPH_PIPELINE_STATS=1")
            raise UnsupportedFeature(f"kernel statistics on {self.info.name}: {why}")
        k = Keep()
        props_fn = ffi.cast("PFN_vkGetPipelineExecutablePropertiesKHR",
                            lib.vkGetDeviceProcAddr(self.device, k.cstr("vkGetPipelineExecutablePropertiesKHR")))
        stats_fn = ffi.cast("PFN_vkGetPipelineExecutableStatisticsKHR",
                            lib.vkGetDeviceProcAddr(self.device, k.cstr("vkGetPipelineExecutableStatisticsKHR")))
        info = k.struct("VkPipelineInfoKHR", pipeline=pipeline.handle)
        count = ffi.new("uint32_t*")
        check(props_fn(self.device, info, count, NULL), "vkGetPipelineExecutablePropertiesKHR")
        props = ffi.new("VkPipelineExecutablePropertiesKHR[]", count[0])
        for i in range(count[0]):
            props[i].sType = vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_PROPERTIES_KHR
        check(props_fn(self.device, info, count, props), "vkGetPipelineExecutablePropertiesKHR")
        out: dict[str, dict[str, int | float | bool]] = {}
        for i in range(count[0]):
            exe = k.struct("VkPipelineExecutableInfoKHR", pipeline=pipeline.handle, executableIndex=i)
            n = ffi.new("uint32_t*")
            check(stats_fn(self.device, exe, n, NULL), "vkGetPipelineExecutableStatisticsKHR")
            stats = ffi.new("VkPipelineExecutableStatisticKHR[]", n[0])
            for j in range(n[0]):
                stats[j].sType = vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_STATISTIC_KHR
            check(stats_fn(self.device, exe, n, stats), "vkGetPipelineExecutableStatisticsKHR")
            out[ffi.string(props[i].name).decode() or f"executable {i}"] = {
                ffi.string(stats[j].name).decode(): _statistic_value(stats[j]) for j in range(n[0])}
        return out

    def flush(self) -> None:
        """Submit the recorded work without waiting."""
        self.queue.flush()

    def synchronize(self) -> None:
        """Submit the recorded work and wait for all submitted work."""
        self.queue.synchronize()

    def check_usable(self) -> None:
        """Raise if this device can no longer run work (closed, or lost)."""
        if self.lost:
            raise DeviceLost(f"{self.info.name} was lost; create a new runtime with vkgraph.runtime.reset_device()")
        if self.closed:
            raise DeviceClosed(f"{self.info.name}: this device was closed (or replaced by reset_device()); "
                               "vkgraph.runtime.get_device() gives the current one")

    def require(self, feature: str, what: str) -> None:
        """Raise UnsupportedFeature unless `info.<feature>` is true."""
        if not getattr(self.info, feature):
            raise UnsupportedFeature(f"{what} needs {feature}, which {self.info.name} does not support")

    # ---- teardown ---------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, dict[str, int]]:
        """This device's counters: submissions, barriers and copies; the Vulkan objects the queue holds; the
        buffer pool; shader compiles (memory and disk cache hits, misses)."""
        return {"queue": dict(self.queue.stats), "objects": self.queue.object_counts(),
                "pool": self.memory.pool.stats.as_dict(), "compiles": asdict(self.compiler.stats)}

    @interrupts.critical
    def close(self, wait_s: float | None = None) -> None:
        """Wait for the GPU (up to `wait_s`, by default VKGRAPH_TIMEOUT_S, or not at all after a wait timed out),
        then destroy every Vulkan object this device made. Work that is still running then cannot be cancelled:
        the device is abandoned instead (nothing destroyed, every later use raises DeviceClosed) and the
        process's exit frees it."""
        with self._lock:
            if self.closed:
                return
            if wait_s is None:
                wait_s = 0.0 if self.queue.stalled else self.queue.timeout_s
            try:
                idle = self.queue.drain(wait_s)
            except DeviceError:
                idle = True  # lost: nothing more will complete
            self.closed = True
            if not idle:
                self.abandoned = True
                _skip_driver_teardown_at_exit()
                self.queue.abandon()
                self.memory.abandon()
                self.pipelines.save_cache()
                return
            try:
                lib.vkDeviceWaitIdle(self.device)  # a lost device returns an error here; we tear down anyway
            finally:
                self.queue.destroy()
                self.pipelines.destroy()
                self.memory.destroy()
                lib.vkDestroyDevice(self.device, NULL)
                self._destroy_instance()

    def _destroy_partial(self) -> None:
        if getattr(self, "device", None) is not None:
            lib.vkDestroyDevice(self.device, NULL)
        self._destroy_instance()

    def _destroy_instance(self) -> None:
        if self.messenger is not None:
            destroy = vk.vkGetInstanceProcAddr(self.instance, "vkDestroyDebugUtilsMessengerEXT")
            destroy(self.instance, self.messenger, None)
            self.messenger = None
        lib.vkDestroyInstance(self.instance, NULL)


def _statistic_value(stat: Any) -> int | float | bool:
    """A VkPipelineExecutableStatisticKHR's value in its declared format."""
    fmt, v = stat.format, stat.value
    if fmt == vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR:
        return bool(v.b32)
    if fmt == vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_INT64_KHR:
        return int(v.i64)
    if fmt == vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR:
        return int(v.u64)
    return float(v.f64)


def _feature_chain(k: Keep) -> tuple[Any, Any, Any, Any]:
    f13 = k.struct("VkPhysicalDeviceVulkan13Features")
    f12 = k.struct("VkPhysicalDeviceVulkan12Features", pNext=f13)
    f11 = k.struct("VkPhysicalDeviceVulkan11Features", pNext=f12)
    f2 = k.struct("VkPhysicalDeviceFeatures2", pNext=f11)
    return f11, f12, f13, f2


def _bf16_features(k: Keep, enable: bool = False) -> Any:
    """VkPhysicalDeviceShaderBfloat16FeaturesKHR laid out by hand: sType, pNext, then three VkBool32
    (shaderBFloat16Type, shaderBFloat16DotProduct, shaderBFloat16CooperativeMatrix)."""
    raw = k.new("uint32_t[8]")
    raw[0] = _STYPE_BF16_FEATURES
    if enable:
        raw[4] = raw[6] = 1
    return ffi.cast("void*", raw)


def layer_knows_hand_laid(validation_version: int | None) -> bool:
    """Whether the NVIDIA extensions laid out by hand may be queried and enabled: no validation layer, or one that
    knows their structures (an older one reports each query of their properties as an error)."""
    return validation_version is None or validation_version >= _COOP2_LAYER_VERSION


def _leave_off_nvidia(info: DeviceInfo) -> None:
    """Clear what the NVIDIA extensions laid out by hand (cooperative_matrix2, cooperative_vector) put on info."""
    info.cooperative_matrix_flexible, info.cooperative_matrix_tensor_addressing = (), False
    info.cooperative_vector, info.cooperative_vector_max_components = (), 0


def _features(physical: Any, k: Keep, feats: Any) -> Any:
    """A feature structure laid out by hand (sType set), filled by the driver: its 32-bit words."""
    lib.vkGetPhysicalDeviceFeatures2(physical, k.struct("VkPhysicalDeviceFeatures2", pNext=feats))
    return ffi.cast("uint32_t*", feats)


def _properties(physical: Any, k: Keep, stype: int, words: int) -> list[int]:
    """The `words` 32-bit fields after sType and pNext of a property structure laid out by hand."""
    raw = k.new("uint32_t[]", 4 + words + words % 2)  # the structure's size: whole 8-byte words (its pNext)
    raw[0] = stype
    lib.vkGetPhysicalDeviceProperties2(physical, k.struct("VkPhysicalDeviceProperties2", pNext=ffi.cast("void*", raw)))
    return [int(raw[4 + i]) for i in range(words)]


def _enumerate(physical: Any, instance: Any, k: Keep, what: str, stype: int, words: int) -> list[list[int]] | None:
    """The entries of a list of structures laid out by hand (sType, pNext, then `words` 32-bit fields each) that
    the physical-device query `what` fills, or None where the loader lacks the function."""
    addr = lib.vkGetInstanceProcAddr(instance, k.cstr(what))
    if addr == NULL:
        return None
    fn = ffi.cast("VkResult(*)(VkPhysicalDevice, uint32_t*, void*)", addr)
    count = ffi.new("uint32_t*")
    check(fn(physical, count, NULL), what)
    stride = 4 + words + words % 2  # each structure whole 8-byte words (its pNext)
    raw = ffi.new("uint32_t[]", max(1, count[0]) * stride)
    for i in range(count[0]):
        raw[i * stride] = stype
    check(fn(physical, count, raw), what)
    return [[int(raw[i * stride + 4 + j]) for j in range(words)] for i in range(count[0])]


def _coop2_features(k: Keep, enable: bool = False, tensor_addressing: bool = False) -> Any:
    """VkPhysicalDeviceCooperativeMatrix2FeaturesNV laid out by hand: sType, pNext, then seven VkBool32, of which
    vkgraph enables cooperativeMatrixWorkgroupScope, cooperativeMatrixFlexibleDimensions (the first two) and,
    where the device has it, cooperativeMatrixTensorAddressing (the sixth)."""
    raw = k.new("uint32_t[12]")
    raw[0] = _STYPE_COOP2_FEATURES
    if enable:
        raw[4] = raw[5] = 1
        raw[9] = int(tensor_addressing)
    return ffi.cast("void*", raw)


def _coop_flexible(physical: Any, instance: Any, exts: frozenset[str], bf16_ok: bool
                   ) -> tuple[tuple[CoopFlexShape, ...], int, int, bool]:
    """The workgroup-scope flexible configurations of VK_NV_cooperative_matrix2, the maximum dimension, the
    reserved shared memory and whether tensor-addressed loads are offered, or ((), 0, 0, False) where the
    extension or either feature vkgraph needs (workgroup scope, flexible dimensions) is absent."""
    none: tuple[tuple[CoopFlexShape, ...], int, int, bool] = ((), 0, 0, False)
    if COOP2_EXT not in exts:
        return none
    k = Keep()
    feats = _features(physical, k, _coop2_features(k))
    if not (feats[4] and feats[5]):
        return none
    # workgroup-scope max invocations, max dimension, reserved shared memory
    props = _properties(physical, k, _STYPE_COOP2_PROPERTIES, 3)
    entries = _enumerate(physical, instance, k, "vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV",
                         _STYPE_COOP_FLEXIBLE, 10)
    if entries is None:
        return none
    shapes = []
    # M/N/K granularity, A/B/C/result types, saturating, scope, invocations
    for m, n, kk, ta, tb, tc, tr, sat, scope, inv in entries:
        types = [_COMPONENT_NAMES.get(t, f"type{t}") for t in (ta, tb, tc, tr)]
        if _SCOPE_NAMES.get(scope) != "workgroup" or ("bfloat16" in types[:2] and not bf16_ok):
            continue
        shapes.append(CoopFlexShape(m, n, kk, *types, invocations=inv, saturating=bool(sat)))
    return tuple(shapes), props[1], props[2], bool(feats[9])


def _coopvec_features(k: Keep, enable: bool = False) -> Any:
    """VkPhysicalDeviceCooperativeVectorFeaturesNV laid out by hand: sType, pNext, cooperativeVector (enabled) and
    cooperativeVectorTraining (not)."""
    raw = k.new("uint32_t[6]")
    raw[0] = _STYPE_COOPVEC_FEATURES
    raw[4] = int(enable)
    return ffi.cast("void*", raw)


def _cooperative_vector(physical: Any, instance: Any, exts: frozenset[str]) -> tuple[tuple[CoopVecTypes, ...], int]:
    """VK_NV_cooperative_vector's type combinations and its longest vector, or ((), 0) where it is absent."""
    if COOPVEC_EXT not in exts:
        return (), 0
    k = Keep()
    if not _features(physical, k, _coopvec_features(k))[4]:
        return (), 0
    # stages, two training flags, maxCooperativeVectorComponents
    stages, _, _, longest = _properties(physical, k, _STYPE_COOPVEC_PROPERTIES, 4)
    entries = _enumerate(physical, instance, k, "vkGetPhysicalDeviceCooperativeVectorPropertiesNV",
                         _STYPE_COOPVEC_COMBINATION, 6) if stages & vk.VK_SHADER_STAGE_COMPUTE_BIT else None
    if entries is None:
        return (), 0
    # input, interpretation, matrix, bias and result types, transpose
    combos = tuple(CoopVecTypes(*(_COMPONENT_NAMES.get(t, f"type{t}") for t in c[:5]), transpose=bool(c[5]))
                   for c in entries)
    return (combos, longest) if combos else ((), 0)


def _device_extensions(physical: Any) -> frozenset[str]:
    count = ffi.new("uint32_t*")
    what = "vkEnumerateDeviceExtensionProperties"
    check(lib.vkEnumerateDeviceExtensionProperties(physical, NULL, count, NULL), what)
    props = ffi.new("VkExtensionProperties[]", count[0])
    check(lib.vkEnumerateDeviceExtensionProperties(physical, NULL, count, props), what)
    return frozenset(ffi.string(props[i].extensionName).decode() for i in range(count[0]))


def _cooperative_matrix(physical: Any, instance: Any, exts: frozenset[str]) -> tuple[tuple[CoopShape, ...], bool]:
    """The driver's cooperative-matrix configurations and whether bfloat16 operands are usable, or ((), False)."""
    if COOP_EXT not in exts:
        return (), False
    k = Keep()
    coop = k.struct("VkPhysicalDeviceCooperativeMatrixFeaturesKHR")
    bf16 = _bf16_features(k) if BF16_EXT in exts else NULL
    coop.pNext = bf16
    f2 = k.struct("VkPhysicalDeviceFeatures2", pNext=coop)
    lib.vkGetPhysicalDeviceFeatures2(physical, f2)
    if not coop.cooperativeMatrix:
        return (), False
    bf16_ok = bf16 != NULL and bool(ffi.cast("uint32_t*", bf16)[6]) and bool(ffi.cast("uint32_t*", bf16)[4])
    name = k.cstr("vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
    addr = lib.vkGetInstanceProcAddr(instance, name)
    if addr == NULL:
        return (), False
    fn = ffi.cast("PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR", addr)
    count = ffi.new("uint32_t*")
    check(fn(physical, count, NULL), "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
    props = ffi.new("VkCooperativeMatrixPropertiesKHR[]", count[0])
    for i in range(count[0]):
        props[i].sType = vk.VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR
    check(fn(physical, count, props), "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
    shapes = []
    for i in range(count[0]):
        p = props[i]
        types = [_COMPONENT_NAMES.get(t, f"type{t}") for t in (p.AType, p.BType, p.CType, p.ResultType)]
        if "bfloat16" in types[:2] and not bf16_ok:
            continue
        shapes.append(CoopShape(p.MSize, p.NSize, p.KSize, *types, _SCOPE_NAMES.get(p.scope, f"scope{p.scope}"),
                                bool(p.saturatingAccumulation)))
    return tuple(shapes), bf16_ok


def _query_info(physical: Any, instance: Any, hand_laid: bool) -> DeviceInfo:
    """What vkgraph needs to know of a physical device. `hand_laid`: also query the NVIDIA extensions whose
    structures vkgraph lays out by hand (cooperative_matrix2, cooperative_vector); a validation layer older than
    them reports their property structures as errors, so a validated run leaves them unqueried."""
    k = Keep()
    base = k.new("VkPhysicalDeviceProperties*")
    lib.vkGetPhysicalDeviceProperties(physical, base)
    api = base.apiVersion
    api_version = (vk.VK_VERSION_MAJOR(api), vk.VK_VERSION_MINOR(api), vk.VK_VERSION_PATCH(api))
    if api_version < (1, 2, 0):
        raise DeviceError(f"{ffi.string(base.deviceName).decode()}: Vulkan {api_version} found, 1.2 or newer needed")
    has13 = api_version >= (1, 3, 0)
    p13 = k.struct("VkPhysicalDeviceVulkan13Properties")
    dot = k.struct("VkPhysicalDeviceShaderIntegerDotProductProperties", pNext=p13 if has13 else NULL)
    p12 = k.struct("VkPhysicalDeviceVulkan12Properties", pNext=dot if has13 else NULL)
    p11 = k.struct("VkPhysicalDeviceVulkan11Properties", pNext=p12)
    m4 = k.struct("VkPhysicalDeviceMaintenance4Properties", pNext=p11)
    p2 = k.struct("VkPhysicalDeviceProperties2", pNext=m4 if has13 else p11)
    lib.vkGetPhysicalDeviceProperties2(physical, p2)
    f11, f12, f13, f2 = _feature_chain(k)
    if not has13:
        f12.pNext = NULL
    lib.vkGetPhysicalDeviceFeatures2(physical, f2)
    mem = k.new("VkPhysicalDeviceMemoryProperties*")
    lib.vkGetPhysicalDeviceMemoryProperties(physical, mem)
    lim = p2.properties.limits
    heaps = [(mem.memoryHeaps[i].size, bool(mem.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT))
             for i in range(mem.memoryHeapCount)]
    host_visible = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
    device_local_types = [mem.memoryTypes[i].propertyFlags for i in range(mem.memoryTypeCount)
                          if mem.memoryTypes[i].propertyFlags & vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT]
    unified = bool(device_local_types) and all((f & host_visible) == host_visible for f in device_local_types)
    ops = frozenset(n for bit, n in _SUBGROUP_OPS.items() if p11.subgroupSupportedOperations & bit)
    dot_accel = has13 and bool(dot.integerDotProduct4x8BitPackedSignedAccelerated)
    exts = _device_extensions(physical)
    coop, bf16_coop = _cooperative_matrix(physical, instance, exts)
    coopvec, coopvec_max = _cooperative_vector(physical, instance, exts) if hand_laid else ((), 0)
    flexible, max_dim, reserved, tensor_addressing = (_coop_flexible(physical, instance, exts, bf16_coop)
                                                      if coop and hand_laid else ((), 0, 0, False))
    stats = False
    if STATS_EXT in exts:
        sf = k.struct("VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR")
        lib.vkGetPhysicalDeviceFeatures2(physical, k.struct("VkPhysicalDeviceFeatures2", pNext=sf))
        stats = bool(sf.pipelineExecutableInfo)
    host_align = 0
    if HOST_MEMORY_EXT in exts:
        hp = k.struct("VkPhysicalDeviceExternalMemoryHostPropertiesEXT")
        lib.vkGetPhysicalDeviceProperties2(physical, k.struct("VkPhysicalDeviceProperties2", pNext=hp))
        host_align = int(hp.minImportedHostPointerAlignment)
    return DeviceInfo(
        name=ffi.string(base.deviceName).decode(),
        vendor_id=base.vendorID, device_id=base.deviceID,
        device_type=_TYPE_NAMES.get(base.deviceType, "other"),
        api_version=api_version, driver_version=base.driverVersion,
        pipeline_cache_uuid=bytes(ffi.buffer(base.pipelineCacheUUID, 16)).hex(),
        subgroup_size=p11.subgroupSize, subgroup_ops=ops,
        subgroup_size_control=has13 and bool(f13.subgroupSizeControl),
        min_subgroup_size=p13.minSubgroupSize if has13 else p11.subgroupSize,
        max_subgroup_size=p13.maxSubgroupSize if has13 else p11.subgroupSize,
        float16=bool(f12.shaderFloat16), float64=bool(f2.features.shaderFloat64), int8=bool(f12.shaderInt8),
        int16=bool(f2.features.shaderInt16), int64=bool(f2.features.shaderInt64),
        storage_8bit=bool(f12.storageBuffer8BitAccess), storage_16bit=bool(f11.storageBuffer16BitAccess),
        subgroup_extended_types=bool(f12.shaderSubgroupExtendedTypes),
        integer_dot_product=has13 and bool(f13.shaderIntegerDotProduct),
        integer_dot_product_accelerated=dot_accel,
        max_workgroup_invocations=lim.maxComputeWorkGroupInvocations,
        max_workgroup_size=tuple(lim.maxComputeWorkGroupSize),
        max_workgroup_count=tuple(lim.maxComputeWorkGroupCount),
        max_shared_memory=lim.maxComputeSharedMemorySize,
        max_storage_buffer_range=lim.maxStorageBufferRange,
        max_allocation_size=p11.maxMemoryAllocationSize,
        max_buffer_size=m4.maxBufferSize if has13 else p11.maxMemoryAllocationSize,
        max_push_constants_size=lim.maxPushConstantsSize,
        max_storage_buffers=min(lim.maxPerStageDescriptorStorageBuffers, lim.maxDescriptorSetStorageBuffers,
                                lim.maxPerStageResources),
        min_storage_offset_alignment=lim.minStorageBufferOffsetAlignment,
        timestamp_period=lim.timestampPeriod, timestamps=bool(lim.timestampComputeAndGraphics),
        unified_memory=unified, heaps=heaps, cooperative_matrix=coop, bfloat16_cooperative_matrix=bf16_coop,
        cooperative_matrix_flexible=flexible, cooperative_matrix_max_dimension=max_dim,
        cooperative_matrix_reserved_shared=reserved, cooperative_matrix_tensor_addressing=tensor_addressing,
        cooperative_vector=coopvec, cooperative_vector_max_components=coopvec_max,
        float_controls=frozenset(name for name, bit in (
            ("signed_zero_inf_nan_preserve", p12.shaderSignedZeroInfNanPreserveFloat32),
            ("denorm_preserve", p12.shaderDenormPreserveFloat32)) if bit),
        host_import_alignment=host_align,
        pipeline_statistics=stats,
    )


_DEVICE: Device | None = None
_DEVICE_LOCK = threading.Lock()
_LIVE: weakref.WeakSet[Device] = weakref.WeakSet()
# the device `use_device` routes this context's work to (a thread starts with none: the default device)
_SCOPED: contextvars.ContextVar[Device | None] = contextvars.ContextVar("vkgraph_device", default=None)


@interrupts.critical
def get_device() -> Device:
    """The device work goes to: the one `use_device` chose for this thread (context), else the process-wide
    default Device, created on first use."""
    global _DEVICE
    scoped = _SCOPED.get()
    if scoped is not None:
        if scoped.closed or scoped.lost:
            scoped.check_usable()
        return scoped
    dev = _DEVICE
    if dev is not None and not dev.closed:
        return dev
    with _DEVICE_LOCK:
        if _DEVICE is None or _DEVICE.closed:
            _DEVICE = Device()
            _LIVE.add(_DEVICE)
        return _DEVICE


def current_device() -> Device | None:
    """The device `use_device` chose for this thread, else the default Device if one is open, without creating
    one."""
    dev = _SCOPED.get() or _DEVICE
    return dev if dev is not None and not dev.closed else None


def open_device(selector: str | None = None) -> Device:
    """A new Device besides the default one (closed at exit like it): on the physical device `selector` names (an
    index or a name, as VKGRAPH_DEVICE), by default the one the default device uses. Two Devices on one physical
    device are two logical devices (each its own VkDevice, queue, memory and caches)."""
    dev = Device(selector)
    _LIVE.add(dev)
    return dev


@contextmanager
def use_device(dev: Device) -> Iterator[Device]:
    """Route this thread's work inside the block to `dev`: every `get_device()` (realize, uploads, templates,
    jit captures) returns it. Tensors whose buffers live on another device cannot be mixed into its work
    (KernelInterfaceError); move values through the host (`.numpy()`, then `Tensor(...)` inside the block)."""
    dev.check_usable()
    token = _SCOPED.set(dev)
    try:
        yield dev
    finally:
        _SCOPED.reset(token)


@interrupts.critical
def reset_device() -> Device:
    """Close the default device (if any) and create a fresh one, e.g. after DeviceLost."""
    global _DEVICE
    with _DEVICE_LOCK:
        old, _DEVICE = _DEVICE, None
    if old is not None:
        try:
            old.close()
        except DeviceError:
            pass  # a lost device may fail its teardown; the new one does not depend on it
    return get_device()


_TEARDOWN_SKIPPED = False


def _skip_driver_teardown_at_exit() -> None:
    """Make the C-level exit end with `_exit(status)` before the driver's own teardown runs.

    A driver's library destructors may wait for the GPU to go idle, and work on an abandoned device may run for
    hours: the interpreter would finish but the process would never end. glibc's `on_exit` hands the handler
    the exit status, so `_exit` itself can be the handler and the status is kept. Handlers run last-in first-out,
    so those registered before this one (the driver's, loaded at instance creation) are the ones skipped; Python's
    own finalization (atexit, stream flushes) has already run by then. Elsewhere than glibc this does nothing."""
    global _TEARDOWN_SKIPPED
    if _TEARDOWN_SKIPPED:
        return
    try:
        libc = ctypes.CDLL(None)
        on_exit, exit_now = libc["on_exit"], libc["_exit"]
    except (OSError, AttributeError):
        return
    on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    on_exit(ctypes.cast(exit_now, ctypes.c_void_p), None)
    _TEARDOWN_SKIPPED = True


EXIT_WAIT_S = 1.0  # at exit, work not waited for is abandoned after this long: its results can no longer be read


@atexit.register
def _close_all() -> None:
    for dev in list(_LIVE):
        try:
            dev.close(wait_s=min(EXIT_WAIT_S, dev.queue.timeout_s))
        except BaseException:  # noqa: BLE001 (interpreter exit, Ctrl-C included: never raise here)
            pass

"""Execute schedules on the runtime: compile each program once, allocate, dispatch, release early.

Also the one place that remembers which graph nodes are already realized (so a lazy subgraph that was computed
once is loaded, not recomputed) and counts dispatched kernels (`count_kernels`, used by the fusion tests).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .codegen import Limits, lower
from .dtype import DType, dtypes
from .flags import flag
from .graph import BufferRef, Node, Op, argkey
from .runtime import UnsupportedFeature, get_device
from .schedule import CustomCall, Schedule, create_schedule
from .view import ShapeTracker


class _Realized:
    """Which graph nodes already sit in a buffer, so a subgraph computed once is loaded, not recomputed.

    Keyed by the node's structure with weak references to its sources (an equal node built later, over the
    same live sources, finds the entry even after the original node object is gone) and holding the buffer
    weakly (the entry lives as long as a realized tensor does). Entries whose buffer was since written in
    place (setitem) are stale and ignored.
    """

    def __init__(self) -> None:
        self._map: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._version: dict[tuple, int] = {}

    @staticmethod
    def _key(n: Node) -> tuple:
        return (n.op, n.dtype, argkey(n.arg), n.shape, tuple(weakref.ref(s) for s in n.srcs))

    def get(self, n: Node) -> BufferRef | None:
        if n.op is Op.BUFFER:
            return None
        key = self._key(n)
        ref = self._map.get(key)
        if ref is None or ref.version != self._version.get(key):
            return None
        return ref

    def __contains__(self, n: object) -> bool:
        return isinstance(n, Node) and self.get(n) is not None

    def __getitem__(self, n: Node) -> BufferRef:
        ref = self.get(n)
        if ref is None:
            raise KeyError(n)
        return ref

    def add(self, n: Node, ref: BufferRef) -> None:
        if n.op is Op.BUFFER:
            return
        key = self._key(n)
        self._map[key] = ref
        self._version[key] = ref.version
        if len(self._version) > 2 * len(self._map) + 64:  # forget versions of entries that died
            self._version = {k: v for k, v in self._version.items() if k in self._map}


REALIZED = _Realized()


@dataclass
class KernelCount:
    """Kernels dispatched while a `count_kernels()` block was open, with their names."""

    count: int = 0
    names: list[str] = field(default_factory=list)


_counters: list[KernelCount] = []
# per device (a device made by reset_device() after a loss starts with empty caches)
_compiled: weakref.WeakKeyDictionary[object, dict[str, object]] = weakref.WeakKeyDictionary()
_limits: weakref.WeakKeyDictionary[object, Limits] = weakref.WeakKeyDictionary()


@contextmanager
def count_kernels() -> Iterator[KernelCount]:
    """Count the GPU programs dispatched inside the block (custom ops count as one)."""
    c = KernelCount()
    _counters.append(c)
    try:
        yield c
    finally:
        _counters.remove(c)


def _count(name: str) -> None:
    for c in _counters:
        c.count += 1
        c.names.append(name)


def limits() -> Limits:
    dev = get_device()
    lim = _limits.get(dev)
    if lim is None:
        lim = _limits[dev] = Limits.from_info(dev.info)
    return lim


_FEATURE = {1: "storage_8bit", 2: "storage_16bit"}
# arithmetic in the dtype itself (bfloat16 is computed in float32, so it needs storage only)
_ARITH = {"float16": "float16", "int8": "int8", "uint8": "int8", "int16": "int16", "uint16": "int16"}


def _max_inputs() -> int:
    # half the device's bindings: the output, and inputs bound in pieces over maxStorageBufferRange, need room
    return max(4, limits().max_buffers // 2)


def require_dtype(dtype: DType) -> None:
    """Raise UnsupportedFeature if this device cannot store or compute `dtype`."""
    info = get_device().info
    if dtype is dtypes.int64 and not info.int64:
        raise UnsupportedFeature(f"int64 tensors need shaderInt64, which {info.name} lacks; use int32")
    feat = _FEATURE.get(dtype.itemsize)
    if feat and not getattr(info, feat):
        raise UnsupportedFeature(f"{dtype} tensors need {feat}, which {info.name} lacks")
    arith = _ARITH.get(dtype.name)
    if arith and not getattr(info, arith):
        raise UnsupportedFeature(f"{dtype} tensors need the shader feature {arith}, which {info.name} lacks")


def _ensure(dev, ref: BufferRef) -> None:
    if ref.buf is None:
        ref.buf = dev.alloc(max(ref.nbytes, 4))


def _release(ref: BufferRef) -> None:
    if ref.buf is not None:
        ref.buf.release()
        ref.buf = None


def run(sched: Schedule) -> None:
    dev = get_device()
    debug = flag("VKGRAPH_DEBUG")
    if debug >= 1 and sched.items:
        print(f"schedule: {len(sched.items)} item(s)\n{sched.describe()}")
    for item, frees in zip(sched.items, sched.frees, strict=True):
        if isinstance(item, CustomCall):
            for ref in [item.out, *item.inputs]:
                _ensure(dev, ref)
            item.node.arg.fn(dev, item.out.buf, [r.buf for r in item.inputs])
            _count(item.node.arg.name)
        else:
            lowered = lower(item, limits())
            for prog in lowered.programs:
                if debug >= 3:
                    print(f"--- {prog.name} groups={prog.groups} push={prog.push}\n{prog.src}")
                for ref, _, _ in prog.bindings:  # memory first: out-of-memory is the error to report
                    _ensure(dev, ref)
                compiled = _compiled.setdefault(dev, {})
                kern = compiled.get(prog.src)
                if kern is None:
                    kern = compiled[prog.src] = dev.kernel(prog.src, name=prog.name)
                bufs = [ref.buf if n is None else ref.buf.view(off, n) for ref, off, n in prog.bindings]
                dev.dispatch(kern, bufs, groups=prog.groups, push=prog.push or None)
                _count(prog.name)
            for ref in lowered.scratch:
                _release(ref)
        for ref in frees:
            _release(ref)
    dev.flush()


def realize(nodes: list[Node]) -> list[BufferRef]:
    """Compute nodes into buffers (reusing what is already realized); returns one buffer per node."""
    sched = create_schedule(nodes, REALIZED, max_inputs=_max_inputs())
    run(sched)
    for n, ref in zip(nodes, sched.outputs, strict=True):
        REALIZED.add(n, ref)
    return sched.outputs


def assign(dest: BufferRef, st: ShapeTracker, value: Node) -> None:
    """Write value into dest through the view st (setitem), then bump dest's version."""
    run(create_schedule([value], REALIZED, dests=[(dest, st)], max_inputs=_max_inputs()))
    dest.version += 1


def upload(array: np.ndarray, dtype: DType) -> BufferRef:
    require_dtype(dtype)
    arr = np.ascontiguousarray(array, dtype=dtype.np)
    ref = BufferRef(dtype, arr.size)
    if arr.size:
        dev = get_device()
        _ensure(dev, ref)
        dev.upload(ref.buf, arr.reshape(-1).view(np.uint8))
    return ref


def allocate(dtype: DType, numel: int) -> BufferRef:
    """A buffer of numel elements with whatever the pool's memory held."""
    ref = BufferRef(dtype, numel)
    if numel:
        _ensure(get_device(), ref)
    return ref


def download(ref: BufferRef, shape: tuple[int, ...]) -> np.ndarray:
    if ref.numel == 0:
        return np.zeros(shape, ref.dtype.np)
    return get_device().download(ref.buf, ref.dtype.np, shape)

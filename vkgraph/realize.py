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
from .graph import BufferRef, Node
from .runtime import UnsupportedFeature, get_device
from .schedule import CustomCall, Schedule, create_schedule
from .view import ShapeTracker


class _Realized:
    """node -> (buffer, version it was computed at); entries whose buffer was since written in place are stale."""

    def __init__(self) -> None:
        self._map: weakref.WeakKeyDictionary[Node, tuple[BufferRef, int]] = weakref.WeakKeyDictionary()

    def __contains__(self, n: object) -> bool:
        e = self._map.get(n)  # type: ignore[arg-type]
        return e is not None and e[0].version == e[1]

    def __getitem__(self, n: Node) -> BufferRef:
        return self._map[n][0]

    def add(self, n: Node, ref: BufferRef) -> None:
        self._map[n] = (ref, ref.version)


REALIZED = _Realized()


@dataclass
class KernelCount:
    """Kernels dispatched while a `count_kernels()` block was open, with their names."""

    count: int = 0
    names: list[str] = field(default_factory=list)


_counters: list[KernelCount] = []
_compiled: dict[str, object] = {}
_limits: Limits | None = None


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
    global _limits
    if _limits is None:
        _limits = Limits.from_info(get_device().info)
    return _limits


_FEATURE = {1: "storage_8bit", 2: "storage_16bit"}


def require_dtype(dtype: DType) -> None:
    """Raise UnsupportedFeature if this device cannot store or compute `dtype`."""
    info = get_device().info
    if dtype is dtypes.int64 and not info.int64:
        raise UnsupportedFeature(f"int64 tensors need shaderInt64, which {info.name} lacks; use int32")
    feat = _FEATURE.get(dtype.itemsize)
    if feat and not getattr(info, feat):
        raise UnsupportedFeature(f"{dtype} tensors need {feat}, which {info.name} lacks")


def _ensure(dev, ref: BufferRef) -> None:
    if ref.buf is None:
        ref.buf = dev.alloc(max(ref.nbytes, 4))


def _release(ref: BufferRef) -> None:
    if ref.buf is not None:
        ref.buf.release()
        ref.buf = None


def _check_range(dev, ref: BufferRef) -> None:
    limit = dev.info.max_storage_buffer_range
    if ref.nbytes > limit:
        raise UnsupportedFeature(f"a {ref.nbytes}-byte buffer exceeds maxStorageBufferRange ({limit} bytes) of "
                                 f"{dev.info.name}; binding it in pieces is not supported yet")


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
                kern = _compiled.get(prog.src)
                if kern is None:
                    kern = _compiled[prog.src] = dev.kernel(prog.src, name=prog.name)
                for ref in prog.bindings:
                    _check_range(dev, ref)
                    _ensure(dev, ref)
                dev.dispatch(kern, [ref.buf for ref in prog.bindings], groups=prog.groups, push=prog.push or None)
                _count(prog.name)
            for ref in lowered.scratch:
                _release(ref)
        for ref in frees:
            _release(ref)
    dev.flush()


def realize(nodes: list[Node]) -> list[BufferRef]:
    """Compute nodes into buffers (reusing what is already realized); returns one buffer per node."""
    sched = create_schedule(nodes, REALIZED)
    run(sched)
    for n, ref in zip(nodes, sched.outputs, strict=True):
        REALIZED.add(n, ref)
    return sched.outputs


def assign(dest: BufferRef, st: ShapeTracker, value: Node) -> None:
    """Write value into dest through the view st (setitem), then bump dest's version."""
    run(create_schedule([value], REALIZED, dests=[(dest, st)]))
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

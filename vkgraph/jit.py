"""`@vkgraph.jit`: run a function of Tensors once eagerly, capture it on the second call, replay it after.

    @vkgraph.jit
    def step(x, pos):
        return model(x, pos)

Calls are keyed by the shapes and dtypes of the Tensor arguments and the values of all other arguments; each
key captures separately (a bounded cache, least recently used out). A replay copies each Tensor argument into
the graph's own input buffer (on the GPU), then submits that copy and the whole captured step in one
`vkQueueSubmit`. `Variable` arguments (from `vkgraph.Variable`) are not frozen: kernels that take them as push
constants see their value at each call.

What is frozen at capture, and what is not (docs/jit.md says more):
- Python control flow and Python scalars inside the function run only at capture: a branch on a value is
  taken the way it went then. Non-Tensor arguments are part of the key, so a new value captures anew.
- `.numpy()`, `.item()`, `.tolist()` inside the function raise `CaptureError` during capture.
- Outputs live in the graph's buffers: the next call overwrites them. Take `.numpy()` or `.clone()` of an
  output you want to keep.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .caches import LRU
from .graph import BufferRef, Variable
from .runtime import CaptureError, CommandGraph, get_device
from .tensor import Tensor, realize_all

_CAPTURE_DEPTH = 0


class _Captured:
    """One captured call: the graph, the input slots it reads, the outputs it writes."""

    def __init__(self, graph: CommandGraph, slots: list[BufferRef], outputs: Any, out_refs: list[BufferRef]) -> None:
        self.graph = graph
        self.slots = slots
        self.outputs = outputs
        self.out_refs = out_refs


class Jit:
    """A jit-compiled function (see the module doc)."""

    def __init__(self, fn: Callable[..., Any], max_entries: int = 8) -> None:
        self.fn = fn
        self.max_entries = max_entries
        # keys called once (the next call captures); bounded like the captures, an evicted key runs eagerly again
        self.seen: LRU[tuple, bool] = LRU("jit keys", 8 * max_entries)
        self.cache: LRU[tuple, _Captured] = LRU("jit captures", max_entries, on_evict=_destroy)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _CAPTURE_DEPTH:  # a jit function called inside another's capture is part of that capture
            return self.fn(*args, **kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        key = _key(args, kwargs)
        hit = self.cache.get(key)
        if hit is not None:
            return self._replay(hit, tensors)
        if self.seen.get(key) is None:
            self.seen.put(key, True)
            out = self.fn(*args, **kwargs)
            realize_all(*_tensors_in(out))
            return out
        return self._capture(key, args, kwargs, tensors)

    def _capture(self, key: tuple, args: tuple, kwargs: dict, tensors: list[Tensor]) -> Any:
        global _CAPTURE_DEPTH
        realize_all(*tensors)
        dev = get_device()
        # the graph reads private copies of the inputs, so a replay never writes a caller's tensor
        slots = [_private_copy(dev, t) for t in tensors]
        swap = {id(t): s for t, s in zip(tensors, slots)}
        args = tuple(swap.get(id(a), a) for a in args)
        kwargs = {k: swap.get(id(v), v) for k, v in kwargs.items()}
        dev.queue.begin_capture()
        _CAPTURE_DEPTH += 1
        try:
            out = self.fn(*args, **kwargs)
            outs = _tensors_in(out)
            realize_all(*outs)
        except BaseException:
            dev.queue.abort_capture()
            raise
        finally:
            _CAPTURE_DEPTH -= 1
        graph = dev.queue.end_capture()
        entry = _Captured(graph, [s.node.arg[0] for s in slots], out, [t.node.arg[0] for t in outs])
        self.cache.put(key, entry)  # the least recently used capture beyond max_entries is destroyed
        return out

    def _replay(self, entry: _Captured, tensors: list[Tensor]) -> Any:
        dev = get_device()
        realize_all(*tensors)
        for t, slot in zip(tensors, entry.slots):
            ref = t.node.arg[0]
            if ref is not slot and ref.nbytes:
                dev.queue.copy(ref.buf, 0, slot.buf, 0, slot.nbytes)
        entry.graph.replay()
        for ref in entry.out_refs:
            ref.version += 1  # lazy graphs built on the previous values must not reuse them
        return _rebuild(entry.outputs)

    def reset(self) -> None:
        """Drop every capture (frees their command buffers and memory)."""
        self.cache.clear()
        self.seen.clear()


def _destroy(key: tuple, entry: _Captured) -> None:
    entry.graph.destroy()


def jit(fn: Callable[..., Any] | None = None, *, max_entries: int = 8) -> Any:
    """Decorator: capture `fn` on its second call per input signature and replay it after (module doc)."""
    if fn is None:
        return lambda f: Jit(f, max_entries)
    return Jit(fn, max_entries)


def _key(args: tuple, kwargs: dict) -> tuple:
    def one(a: Any) -> Any:
        if isinstance(a, Tensor):
            return ("T", a.shape, a.dtype.name)
        if isinstance(a, Variable):
            return ("V", id(a))  # the capture reads this very object (it stays alive in the graph)
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, *map(one, a))
        try:
            hash(a)
        except TypeError:
            raise CaptureError(f"jit: argument of type {type(a).__name__} is neither a Tensor nor hashable") from None
        return ("C", a)

    return tuple(map(one, args)) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def _tensors_in(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors_in(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors_in(o)]
    return []


def _rebuild(out: Any) -> Any:
    """Fresh Tensors over the graph's output buffers, at their new version, in the structure fn returned."""
    from . import graph as g

    if isinstance(out, Tensor):
        ref = out.node.arg[0]
        return Tensor(g.buffer(ref, ref.version, out.dtype, out.shape))
    if isinstance(out, (list, tuple)):
        return type(out)(_rebuild(o) for o in out)
    if isinstance(out, dict):
        return {k: _rebuild(v) for k, v in out.items()}
    return out


def _private_copy(dev: Any, t: Tensor) -> Tensor:
    """A new realized Tensor with t's values in a buffer of its own (a GPU copy, recorded, not waited on)."""
    from . import graph as g
    from .realize import allocate

    src = t.node.arg[0]
    ref = allocate(t.dtype, src.numel)
    if src.nbytes:
        dev.queue.copy(src.buf, 0, ref.buf, 0, src.nbytes)
    return Tensor(g.buffer(ref, ref.version, t.dtype, t.shape))

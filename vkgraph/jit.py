"""`@vkgraph.jit`: run a function of Tensors once eagerly, capture it on the second call, replay it after.

    @vkgraph.jit
    def step(x, pos):
        return model(x, pos)

Calls are keyed by the shapes and dtypes of the Tensor arguments and the values of all other arguments; each
key captures separately (a bounded cache, least recently used out). A replay copies each Tensor argument into
the graph's own input buffer (on the GPU) or, for inputs of 64 KiB and more, binds the argument's buffer in place
of it (no copy), then submits the copies and the whole captured step in one `vkQueueSubmit`. `Variable`
arguments (from `vkgraph.Variable`) are not frozen: kernels that take them as push constants see their value at
each call.

What is frozen at capture, and what is not (docs/jit.md says more):
- Python control flow and Python scalars inside the function run only at capture: a branch on a value is
  taken the way it went then. Non-Tensor arguments are part of the key, so a new value captures anew.
- `.numpy()`, `.item()`, `.tolist()` inside the function raise `CaptureError` during capture.
- Outputs live in the graph's buffers: the next call overwrites them. Take `.numpy()` or `.clone()` of an
  output you want to keep, or ask for `jit(fn, fresh_outputs=True)`: each call's outputs are then GPU copies
  in buffers of their own (one copy per output, recorded after the graph and submitted with the next work).

Each thread has its own captures of a jit function (a replay's outputs are the graph's buffers, which another
thread's replay would overwrite). Captures belong to the device they were made on (the one `get_device()`
gives: a thread that works on several devices through `runtime.use_device` keeps captures for each): after
`reset_device()` (or `close()`) the next call starts afresh (eager, then capture).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .caches import LRU
from .graph import BufferRef, Variable
from .interrupts import critical
from .runtime import CaptureError, CommandGraph, get_device
from .tensor import Tensor, realize_all

_capturing = threading.local()  # .depth: captures open in this thread (a jit call inside one is part of it)


class _Captured:
    """One captured call: the graph, the input slots it reads, the outputs it writes."""

    def __init__(self, graph: CommandGraph, slots: list[BufferRef], outputs: Any, out_refs: list[BufferRef]) -> None:
        self.graph = graph
        self.slots = slots
        self.outputs = outputs
        self.out_refs = out_refs


class _State:
    """One thread's calls of a jit function on one device: the keys called once, and the captures."""

    def __init__(self, device: Any, max_entries: int) -> None:
        self.device = device
        # keys called once (the next call captures); bounded like the captures, an evicted key runs eagerly again
        self.seen: LRU[tuple, bool] = LRU("jit keys", 8 * max_entries)
        self.cache: LRU[tuple, _Captured] = LRU("jit captures", max_entries, on_evict=_destroy)

    def clear(self) -> None:
        self.cache.clear()
        self.seen.clear()


class Jit:
    """A jit-compiled function (see the module doc)."""

    def __init__(self, fn: Callable[..., Any], max_entries: int = 8, fresh_outputs: bool = False) -> None:
        self.fn = fn
        self.max_entries = max_entries
        self.fresh_outputs = fresh_outputs
        self._local = threading.local()
        self._states: weakref.WeakSet[_State] = weakref.WeakSet()  # every thread's, for reset()
        functools.update_wrapper(self, fn)

    def _state(self) -> _State:
        dev = get_device()
        states = getattr(self._local, "states", None)
        if states is None:
            states = self._local.states = {}
        st = states.get(id(dev))  # a state holds its device: the id is not reused while the state is here
        if st is None:  # first call on this device in this thread
            for key, old in list(states.items()):  # captures of closed devices (reset_device) are dropped
                if old.device.closed:
                    old.clear()
                    del states[key]
            st = states[id(dev)] = _State(dev, self.max_entries)
            self._states.add(st)
        return st

    @property
    def cache(self) -> LRU[tuple, _Captured]:
        """This thread's captures, by call key."""
        return self._state().cache

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(_capturing, "depth", 0):  # a jit function called inside another's capture is part of it
            return self.fn(*args, **kwargs)
        st = self._state()
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        key = _key(args, kwargs)
        hit = st.cache.get(key)
        if hit is not None:
            realize_all(*tensors)
            out = _rebuild(_submit(hit, tensors))
            return _copied(st.device, out) if self.fresh_outputs else out
        if st.seen.get(key) is None:
            st.seen.put(key, True)
            out = self.fn(*args, **kwargs)
            realize_all(*_tensors_in(out))
            return out
        return self._capture(st, key, args, kwargs, tensors)

    def _capture(self, st: _State, key: tuple, args: tuple, kwargs: dict, tensors: list[Tensor]) -> Any:
        realize_all(*tensors)
        dev = st.device
        # the graph reads private copies of the inputs, so a replay never writes a caller's tensor
        slots = [_private_copy(dev, t) for t in tensors]
        swap = {id(t): s for t, s in zip(tensors, slots)}
        args = tuple(swap.get(id(a), a) for a in args)
        kwargs = {k: swap.get(id(v), v) for k, v in kwargs.items()}
        cap = _Capture(dev.queue)
        try:  # opened and closed inside the try: an exception landing between the steps still aborts it
            cap.open()
            out = self.fn(*args, **kwargs)
            outs = _tensors_in(out)
            realize_all(*outs)
            graph = cap.close()
        except BaseException:
            cap.abort()
            raise
        entry = _Captured(graph, [s.node.arg[0] for s in slots], out, [t.node.arg[0] for t in outs])
        st.cache.put(key, entry)  # the least recently used capture beyond max_entries is destroyed
        return _copied(dev, out) if self.fresh_outputs else out

    def reset(self) -> None:
        """Drop every capture, of every thread (frees their command buffers and memory)."""
        for st in list(self._states):
            st.clear()


class _Capture:
    """The capture of one call, opened, then closed or aborted (on any exception, Ctrl-C included); each step is
    critical, and `opened` tells abort whether there is anything to undo."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue
        self.opened = False

    @critical
    def open(self) -> None:
        self.queue.begin_capture()
        _capturing.depth = getattr(_capturing, "depth", 0) + 1
        self.opened = True

    @critical
    def close(self) -> CommandGraph:
        _capturing.depth -= 1
        self.opened = False
        return self.queue.end_capture()

    @critical
    def abort(self) -> None:
        if self.opened:
            _capturing.depth -= 1
            self.opened = False
            self.queue.abort_capture()


BIND_BYTES = 64 << 10  # inputs at least this large are read in place; smaller ones are copied into their slot


@critical
def _submit(entry: _Captured, tensors: list[Tensor]) -> Any:
    """Give the graph its inputs, submit it, and mark its outputs rewritten: all or nothing. A large input is read
    where it lies (the graph is recorded again for new input buffers, which costs less than the eager call; a
    loop over fresh tensors of one size meets the same pooled buffers again); a small one, or one the graph
    writes, is copied into the graph's own slot (a copy costs less than recording again)."""
    graph = entry.graph
    queue = graph.queue
    bound = []
    for t, slot in zip(tensors, entry.slots):
        ref = t.node.arg[0]
        if ref is slot or not ref.nbytes:
            continue
        home = slot.buf.alloc
        written = graph.written  # a slot the graph writes, or an input it writes (its own output passed back)
        if (ref.nbytes >= BIND_BYTES and ref.buf.offset == 0 and home.handle not in written
                and ref.buf.alloc.handle not in written):
            bound.append((home, ref.buf.alloc))
        else:
            queue.copy(ref.buf, 0, slot.buf, 0, slot.nbytes)
    graph.replay(tuple(bound))
    for ref in entry.out_refs:
        ref.version += 1  # lazy graphs built on the previous values must not reuse them
    return entry.outputs


def _destroy(key: tuple, entry: _Captured) -> None:
    entry.graph.destroy()


def jit(fn: Callable[..., Any] | None = None, *, max_entries: int = 8, fresh_outputs: bool = False) -> Any:
    """Decorator: capture `fn` on its second call per input signature and replay it after (module doc).
    fresh_outputs: return copies of the graph's outputs that later calls do not overwrite."""
    if fn is None:
        return lambda f: Jit(f, max_entries, fresh_outputs)
    return Jit(fn, max_entries, fresh_outputs)


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


def _map_tensors(out: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """out (a structure fn returned: Tensors in lists, tuples and dicts) with fn applied to each Tensor."""
    if isinstance(out, Tensor):
        return fn(out)
    if isinstance(out, (list, tuple)):
        return type(out)(_map_tensors(o, fn) for o in out)
    if isinstance(out, dict):
        return {k: _map_tensors(v, fn) for k, v in out.items()}
    return out


def _rebuild(out: Any) -> Any:
    """Fresh Tensors over the graph's output buffers, at their new version, in the structure fn returned."""
    from . import graph as g

    def one(t: Tensor) -> Tensor:
        ref = t.node.arg[0]
        return Tensor(g.buffer(ref, ref.version, t.dtype, t.shape))

    return _map_tensors(out, one)


def _copied(dev: Any, out: Any) -> Any:
    """out (a structure fn returned, over the graph's output buffers) with each Tensor a GPU copy of its own."""
    return _map_tensors(out, lambda t: _private_copy(dev, t))


def _private_copy(dev: Any, t: Tensor) -> Tensor:
    """A new realized Tensor with t's values in a buffer of its own (a GPU copy, recorded, not waited on)."""
    from . import graph as g
    from .realize import allocate

    src = t.node.arg[0]
    ref = allocate(t.dtype, src.numel)
    if src.nbytes:
        dev.queue.copy(src.buf, 0, ref.buf, 0, src.nbytes)
    return Tensor(g.buffer(ref, ref.version, t.dtype, t.shape))

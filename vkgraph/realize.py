"""Execute schedules on the runtime: compile each program once, allocate, dispatch, release early.

Also the one place that remembers which graph nodes are already realized (so a lazy subgraph that was computed
once is loaded, not recomputed) and counts dispatched kernels (`count_kernels`, used by the fusion tests).

Schedules are remembered by the graph's structure (`schedule.structure`: nodes with buffers numbered as slots):
a graph whose structure was scheduled before (the same model step over new inputs) skips scheduling and
lowering, and runs the remembered plan (programs, buffer lifetimes) with its own buffers bound to the slots.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .caches import LRU
from .codegen import Limits, Program, lower, tune
from .dtype import DType
from .flags import flag
from .graph import BufferRef, KeyedRef, Node, Op, argkey, forgetter, runtime_values
from .interrupts import critical
from .runtime import HostCopy, UnsupportedFeature, get_device
from .schedule import CustomCall, Schedule, create_schedule, structure
from .view import ShapeTracker


class _RealizedRef(KeyedRef):
    """A weak reference to a realized node's buffer, with its key in the table and the buffer's version when it
    was stored."""

    __slots__ = ("version",)


class _Realized:
    """Which graph nodes already sit in a buffer, so a subgraph computed once is loaded, not recomputed.

    Keyed by the node's structure with weak references to its sources (an equal node built later, over the
    same live sources, finds the entry even after the original node object is gone) and holding the buffer
    weakly (the entry lives as long as a realized tensor does). Entries whose buffer was since written in
    place (setitem) are stale and ignored. A plain dict of keyed weak references (a WeakValueDictionary's get
    and set run in Python, and every realize sets one entry and looks up every node of its graph).
    """

    def __init__(self) -> None:
        self._map: dict[tuple, _RealizedRef] = {}
        # id of the first source of every live entry -> a weak reference to that source (None: entries without
        # sources), a cheap filter before the key is built: ids of dead nodes are reused by new ones, so the
        # reference tells a live source from a newcomer at its address. It may hold entries that died (a wasted
        # lookup), never lack a live one.
        self._first: dict[int, weakref.ref | None] = {}
        self._lock = threading.Lock()  # add() rebuilds _first; readers only look up single keys
        self._forget = forgetter(self._map)

    @staticmethod
    def _key(n: Node) -> tuple:
        return (n.op, n.dtype, n.akey, n.shape, tuple([weakref.ref(s) for s in n.srcs]))

    def get(self, n: Node) -> BufferRef | None:
        # the first-source filter inline: the scheduler asks for every node of every graph it keys
        if n.srcs:
            src = n.srcs[0]
            first = self._first.get(id(src))
            if first is None or first() is not src:
                return None
        elif n.op is Op.BUFFER or 0 not in self._first:
            return None
        r = self._map.get(self._key(n))
        if r is None:
            return None
        ref = r()
        if ref is None or ref.version != r.version:
            return None
        if ref.buf is not None and ref.buf.alloc.owner is not get_device().memory:
            return None  # computed on another device (runtime.use_device): compute it again on this one
        return ref

    def __contains__(self, n: object) -> bool:
        return isinstance(n, Node) and self.get(n) is not None

    def __getitem__(self, n: Node) -> BufferRef:
        ref = self.get(n)
        if ref is None:
            raise KeyError(n)
        return ref

    @critical
    def add(self, n: Node, ref: BufferRef) -> None:
        if n.op is Op.BUFFER:
            return
        with self._lock:
            self._add(n, ref)

    def _add(self, n: Node, ref: BufferRef) -> None:
        key = self._key(n)
        r = _RealizedRef(ref, self._forget)
        r.key, r.version = key, ref.version
        self._map[key] = r
        if n.srcs:
            self._first[id(n.srcs[0])] = key[4][0]
        else:
            self._first[0] = None
        if len(self._first) > 2 * len(self._map) + 64:
            self._first = self._live_first()

    def _live_first(self) -> dict[int, weakref.ref | None]:
        first: dict[int, weakref.ref | None] = {}
        for k in list(self._map):
            if not k[4]:
                first[0] = None
            elif (src := k[4][0]()) is not None:
                first[id(src)] = k[4][0]
        return first


REALIZED = _Realized()


@dataclass
class KernelCount:
    """Kernels dispatched while a `count_kernels()` block was open, with their names."""

    count: int = 0
    names: list[str] = field(default_factory=list)


_counters: list[KernelCount] = []
# compiled programs by GLSL text, per device (a device made by reset_device() after a loss starts empty)
_compiled: weakref.WeakKeyDictionary[object, LRU[str, object]] = weakref.WeakKeyDictionary()
PROGRAMS = 1024
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


def _with_matmul_settings(lim: Limits) -> Limits:
    """lim with the matmul settings that come from flags and the cache folder: 16-bit compute for float32
    products where asked, and the device's measured tile configurations (codegen.tune)."""
    f32 = flag("VKGRAPH_MATMUL_F32_COMPUTE")
    if f32 not in ("", "float16", "bfloat16"):
        raise ValueError(f"VKGRAPH_MATMUL_F32_COMPUTE={f32!r}: expected float16, bfloat16 or empty")
    use = lim.coop and flag("VKGRAPH_MATMUL_TUNE")
    tuned = tune.load(tune.path(flag("VKGRAPH_CACHE_DIR"), lim.device)) if use else ()
    return dataclasses.replace(lim, f32_compute=f32, tuned=tuned)


def forget_limits() -> None:
    """Read the device's limits again at the next use (after tile configurations were measured)."""
    _limits.clear()


def limits() -> Limits:
    dev = get_device()
    lim = _limits.get(dev)
    if lim is None:
        lim = _limits[dev] = _with_matmul_settings(Limits.from_info(dev.info))
    return lim


def _max_inputs(lim: Limits | None = None) -> int:
    # half the device's bindings: the output, and inputs bound in pieces over maxStorageBufferRange, need room
    return max(4, (lim or limits()).max_buffers // 2)


def has_dtype(dtype: DType) -> bool:
    """Whether this device can store and compute `dtype`."""
    try:
        require_dtype(dtype)
    except UnsupportedFeature:
        return False
    return True


def require_dtype(dtype: DType) -> None:
    """Raise UnsupportedFeature if this device cannot store or compute `dtype`."""
    get_device().info.require_scalar(dtype.name)


def _ensure(dev, ref: BufferRef) -> None:
    if ref.buf is None:
        ref.buf = dev.alloc(max(ref.nbytes, 4))


@critical
def _release(ref: BufferRef) -> None:
    if ref.buf is not None:
        ref.buf.release()
        ref.buf = None


class Dispatch(NamedTuple):
    """One GLSL program of a kernel step, over buffer slots."""

    src: str
    name: str
    bindings: tuple[tuple[int, int, int | None], ...]  # per binding: (slot, byte offset, bytes or None: all)
    groups: tuple[int, int, int]
    fields: tuple[str, ...]  # push-constant names, in declaration order
    push: tuple  # their values, packed by position
    fill: tuple[tuple[int, int], ...]  # (position in push, position in the graph's runtime values), set per run


class KernelStep(NamedTuple):
    """A generated kernel: its programs (two for a split reduction), their scratch slots, and the slots whose
    last reader it is."""

    programs: tuple[Dispatch, ...]
    scratch: tuple[int, ...]
    frees: tuple[int, ...]


class CustomStep(NamedTuple):
    """A custom node (a template): its position among the graph's custom nodes, output and input slots."""

    custom: int
    out: int
    inputs: tuple[int, ...]
    frees: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """A schedule lowered to programs, with every buffer a slot: inputs (numbered as in `Structure`), then the
    schedule's own buffers, then lowering scratch (both made afresh at each run: a plan is shared by every thread
    that runs a graph of its structure, so it holds no buffer). baked: (position, value) of runtime values the
    programs hold as literals (over the push budget); a graph whose values differ there cannot use this plan."""

    n_in: int
    temps: tuple[tuple[DType, int], ...]
    steps: tuple[KernelStep | CustomStep, ...]
    outputs: tuple[int, ...]
    baked: tuple[tuple[int, object], ...]

    def describe(self, customs: list[Node]) -> str:
        """The steps, as VKGRAPH_DEBUG prints them (buffers as slots: inputs first, then the plan's own)."""
        lines = []
        for i, step in enumerate(self.steps):
            if type(step) is CustomStep:
                name = customs[step.custom].arg.name
                line = f"{i:3d} custom {name} -> slot {step.out} from slots {list(step.inputs)}"
            else:
                progs = ", ".join(f"{p.name} groups={p.groups} binds {len(p.bindings)}" for p in step.programs)
                line = f"{i:3d} kernel {progs}"
            lines.append(line + (f" frees {len(step.frees)}" if step.frees else ""))
        return "\n".join(lines)


class _Uncacheable(Exception):
    pass


def _params(sched: Schedule) -> tuple[list, dict[int, int]]:
    """The runtime values of sched's kernels, and where each leaf's first value is (as Structure numbers them for
    a cached plan; any numbering serves a plan run once)."""
    values: list = []
    slot: dict[int, int] = {}
    for item in sched.items:
        if isinstance(item, CustomCall):
            continue
        for n in item.root.toposort():
            if id(n) not in slot and not n.srcs and (v := runtime_values(n)):
                slot[id(n)] = len(values)
                values.extend(v)
    return values, slot


def _plan(sched: Schedule, inputs: list[BufferRef], customs: list[Node],
          param_slot: dict[int, int]) -> tuple[Plan, list[BufferRef]]:
    """sched as a plan over slots, and the buffers of this schedule in slot order (lowering scratch as fresh
    BufferRefs: the lowering cache hands the same scratch refs to every kernel of its shape, in any thread)."""
    slots = {id(r): i for i, r in enumerate(inputs)}
    for t in sched.temps:
        if id(t) not in slots:
            slots[id(t)] = len(slots)
    n_in = len(inputs)
    refs = list(inputs) + sched.temps
    scratch_specs: list[tuple[DType, int]] = []
    custom_pos = {id(n): i for i, n in enumerate(customs)}
    lim = limits()

    def slot(ref: BufferRef, scratch: bool = False) -> int:
        i = slots.get(id(ref))
        if i is None:
            if not scratch:
                raise _Uncacheable
            i = slots[id(ref)] = len(refs)
            refs.append(BufferRef(ref.dtype, ref.numel))
            scratch_specs.append((ref.dtype, ref.numel))
        return i

    def value_slot(n: Node) -> int:
        i = param_slot.get(id(n))
        if i is None:
            raise _Uncacheable
        return i

    steps: list[KernelStep | CustomStep] = []
    baked: list[tuple] = []
    for item, frees in zip(sched.items, sched.frees, strict=True):
        fr = tuple(slot(r) for r in frees)
        if isinstance(item, CustomCall):
            pos = custom_pos.get(id(item.node))
            if pos is None:
                raise _Uncacheable
            steps.append(CustomStep(pos, slot(item.out), tuple(slot(r) for r in item.inputs), fr))
            continue
        lowered = lower(item, lim)
        scratch = {id(r) for r in lowered.scratch}
        leaves = [value_slot(n) for n in lowered.leaves]
        baked += [(value_slot(n), argkey(n.arg)) for n in lowered.baked]
        progs = tuple(Dispatch(p.src, p.name,
                               tuple((slot(ref, id(ref) in scratch), off, n) for ref, off, n in p.bindings),
                               p.groups, *_push_fields(p, leaves)) for p in lowered.programs)
        steps.append(KernelStep(progs, tuple(slot(r, True) for r in lowered.scratch), fr))
    outputs = tuple(slot(r) for r in sched.outputs)
    temps = tuple([(t.dtype, t.numel) for t in sched.temps] + scratch_specs)
    return Plan(n_in, temps, tuple(steps), outputs, tuple(baked)), refs


def _push_fields(p: Program, leaves: list[int]) -> tuple[tuple[str, ...], tuple, tuple[tuple[int, int], ...]]:
    """p's push constants as (names, values, fill): values in declaration order (what dispatch packs without
    looking up names), fill as (position in values, position in the graph's runtime values) to set at each run."""
    names = tuple(p.push)
    pos = {name: j for j, name in enumerate(names)}
    return names, tuple(p.push.values()), tuple((pos[name], leaves[i] + part) for name, i, part in p.params)


# (a weak reference to a device, its programs) of the last call: every realize asks, and a WeakKeyDictionary's get
# runs in Python
_last_programs: tuple[weakref.ref, LRU[str, object]] | None = None


def _programs(dev) -> LRU[str, object]:
    global _last_programs
    last = _last_programs
    if last is not None and last[0]() is dev:
        return last[1]
    compiled = _compiled.get(dev)
    if compiled is None:
        compiled = _compiled.setdefault(dev, LRU("programs", PROGRAMS))
    _last_programs = (weakref.ref(dev), compiled)
    return compiled


COMPILE_THREADS = 8  # at most, and at most the machine's cores
PROGRESS_MIN = 8  # a new plan compiling this many programs shows a progress bar on a terminal


def _compile(dev, src: str, name: str, fields: tuple[str, ...]) -> object:
    """The pipeline of one program, checked to declare the push fields the plan packs (by position)."""
    kern = dev.pipeline(src, name=name)
    if kern.push_names != fields:
        raise AssertionError(f"{name}: push fields {fields} are declared as {kern.push_names}")
    return kern


def _compile_ahead(plan: Plan) -> None:
    """Compile a new plan's programs that this device lacks, several at once (glslang runs on threads; its C
    calls release the GIL), with a progress bar on a terminal when they are many. A first run of a model meets
    dozens of programs at once; compiled one by one, in the order of dispatch, they took most of its time."""
    from concurrent.futures import ThreadPoolExecutor

    dev = get_device()
    compiled = _programs(dev)
    todo: dict[str, tuple[str, tuple]] = {}
    for step in plan.steps:
        if type(step) is not CustomStep:
            for src, name, _, _, fields, _, _ in step.programs:
                if src not in todo and src not in compiled:
                    todo[src] = (name, fields)
    if len(todo) < 2:
        return  # _execute compiles the one there is
    from tqdm import tqdm

    bar = tqdm(total=len(todo), desc=f"compiling {len(todo)} kernels", unit="kernel", leave=False,
               disable=len(todo) < PROGRESS_MIN or not sys.stderr.isatty())

    def one(item: tuple[str, tuple[str, tuple]]) -> tuple[str, object]:
        src, (name, fields) = item
        return src, _compile(dev, src, name, fields)

    pool = ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1, COMPILE_THREADS), "vkgraph-compile")
    try:
        for src, kern in pool.map(one, todo.items()):
            compiled.put(src, kern)
            bar.update()
    finally:
        pool.shutdown(cancel_futures=True)  # on an error or Ctrl-C, what has not started is dropped
        bar.close()


def _execute(plan: Plan, refs: list[BufferRef], customs: list[Node], params: list, debug: int) -> None:
    dev = get_device()
    compiled = _programs(dev)
    dispatch = dev.dispatch
    counting = bool(_counters)
    if debug >= 1 and plan.steps:
        print(f"schedule: {len(plan.steps)} item(s)\n{plan.describe(customs)}")
    for step in plan.steps:
        if type(step) is CustomStep:
            node = customs[step.custom]
            out_ref, in_refs = refs[step.out], [refs[i] for i in step.inputs]
            for ref in [out_ref, *in_refs]:
                _ensure(dev, ref)
            node.arg.fn(dev, out_ref.buf, [r.buf for r in in_refs])
            _count(node.arg.name)
        else:
            for src, name, bindings, groups, fields, push, fill in step.programs:
                if fill:  # this graph's RNG counters, Variables and float constants
                    push = list(push)
                    for j, i in fill:
                        push[j] = params[i]
                    push = tuple(push)
                if debug >= 3:
                    print(f"--- {name} groups={groups} push={dict(zip(fields, push))}\n{src}")
                brefs = [refs[b[0]] for b in bindings]
                for ref in brefs:  # memory first: out-of-memory is the error to report
                    if ref.buf is None:
                        ref.buf = dev.alloc(max(ref.nbytes, 4))
                kern = compiled.get(src)
                if kern is None:
                    kern = _compile(dev, src, name, fields)
                    compiled.put(src, kern)
                bufs = [ref.buf if b[2] is None else ref.buf.view(b[1], b[2]) for ref, b in zip(brefs, bindings)]
                dispatch(kern, bufs, groups=groups, push=push)
                if counting:
                    _count(name)
            for i in step.scratch:
                _release(refs[i])
        for i in step.frees:
            _release(refs[i])
    dev.flush()


def run(sched: Schedule) -> None:
    """Run a schedule once, without remembering its plan (a graph whose structure cannot key a plan)."""
    customs = [item.node for item in sched.items if isinstance(item, CustomCall)]
    inputs: list[BufferRef] = []
    seen: set[int] = {id(t) for t in sched.temps}
    for item in [*sched.items, None]:  # every buffer the schedule did not make is an input slot
        if item is None:
            refs = sched.outputs
        elif isinstance(item, CustomCall):
            refs = [item.out, *item.inputs]
        else:
            refs = [item.out] + [m.arg[0] for m in item.root.toposort() if m.op is Op.BUFFER]
        for r in refs:
            if id(r) not in seen:
                seen.add(id(r))
                inputs.append(r)
    params, param_slot = _params(sched)
    plan, refs = _plan(sched, inputs, customs, param_slot)
    _compile_ahead(plan)
    _execute(plan, refs, customs, params, flag("VKGRAPH_DEBUG"))


# plans by graph structure (schedule.Structure): a graph scheduled before reuses its kernels and lifetimes
_PLANS: LRU[tuple, Plan] = LRU("plans", 128)


def _schedule_and_run(nodes: list[Node], dests: list | None = None) -> list[BufferRef]:
    """Schedule and run nodes (stored through dests where given); returns one buffer per node. VKGRAPH_DEBUG
    prints along the same path (the plan's schedule; with 3, each program's GLSL)."""
    lim = limits()
    max_inputs = _max_inputs(lim)
    debug = flag("VKGRAPH_DEBUG")
    st = structure(nodes, REALIZED, dests, (lim, max_inputs))
    plan = _PLANS.get(st.key) if st.key is not None else None
    if st.key is None:
        _PLANS.misses += 1  # a graph the cache cannot key counts as a miss
    elif plan is not None and any(argkey(st.params[i]) != v for i, v in plan.baked):
        plan = None  # it compiled in other values of float constants (more than push constants hold): a miss
        _PLANS.hits -= 1
        _PLANS.misses += 1
    if plan is not None:
        refs = st.inputs + [BufferRef(d, n) for d, n in plan.temps]
    else:
        sched = create_schedule(nodes, st.realized, dests=dests, max_inputs=max_inputs)
        try:
            plan, refs = _plan(sched, st.inputs, st.customs, st.param_slot)
        except _Uncacheable:
            run(sched)
            return sched.outputs
        if st.key is not None:
            _PLANS.put(st.key, plan)
        _compile_ahead(plan)
    _execute(plan, refs, st.customs, st.params, debug)
    return [refs[i] for i in plan.outputs]


def realize(nodes: list[Node]) -> list[BufferRef]:
    """Compute nodes into buffers (reusing what is already realized); returns one buffer per node."""
    outputs = _schedule_and_run(nodes)
    for n, ref in zip(nodes, outputs, strict=True):
        REALIZED.add(n, ref)
    return outputs


def assign(dest: BufferRef, st: ShapeTracker, value: Node) -> None:
    """Write value into dest through the view st (setitem), then bump dest's version."""
    _schedule_and_run([value], [(dest, st)])
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


def download_async(ref: BufferRef, shape: tuple[int, ...]) -> HostCopy:
    """Start copying a realized buffer to the host (Device.download_async)."""
    if ref.numel == 0:
        return HostCopy.empty(ref.dtype.np, shape)
    return get_device().download_async(ref.buf, ref.dtype.np, shape)


def download(ref: BufferRef, shape: tuple[int, ...]) -> np.ndarray:
    if ref.numel == 0:
        return np.zeros(shape, ref.dtype.np)
    return get_device().download(ref.buf, ref.dtype.np, shape)

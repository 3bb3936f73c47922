"""Cut the graph into kernels: each kernel is a fusion group between forced boundaries.

Nodes that must be stored (outputs, custom ops and their inputs) are realized; everything between them is
recomputed inside the kernel that needs it, with a few rules for the heavy ops:

- A reduction joins the kernel of its consumer when the consumer either reads it at the reduction's own
  output coordinates (through elementwise ops and plain reshapes: ``x.sum(1) * 2``) or broadcasts it back
  over the reduced axes (``x - x.max(1, keepdim=True)``), in which case the kernel runs each reduced row in
  one place and walks the row again after the reduction. All reductions of one kernel share the shape and
  axes of their input, so softmax and layer_norm are single kernels.
- A matmul joins its consumer when the consumer is elementwise on the matmul's output (bias, activation).
- Anything else (a reduction seen through a permute, a reduce of a reduce, one reduction feeding two
  kernels) makes the heavy node a boundary of its own.

The result is an ordered list of kernels (and custom calls), each naming its output buffer, with the
intermediate buffers to release after the last kernel that reads them. `structure` gives the key on which
that result depends (the graph with buffers as slots and runtime values left out), so realize.py can reuse it
for an equal graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .graph import BufferRef, Node, Op, buffer, runtime_values, substitute
from .view import ShapeTracker, View, prod, strides_for


@dataclass
class Kernel:
    root: Node  # the value to store; realized inputs appear as BUFFER nodes
    out: BufferRef
    st: ShapeTracker  # where each element of root goes in `out` (a view for setitem)


@dataclass
class CustomCall:
    node: Node
    out: BufferRef
    inputs: list[BufferRef]


@dataclass
class Schedule:
    items: list[Kernel | CustomCall] = field(default_factory=list)
    frees: list[list[BufferRef]] = field(default_factory=list)  # per item: buffers whose last reader it is
    outputs: list[BufferRef] = field(default_factory=list)  # one per target
    temps: list[BufferRef] = field(default_factory=list)  # the buffers this schedule made (outputs among them)


def is_input(n: Node, realized: Mapping[Node, BufferRef]) -> bool:
    return n.op is Op.BUFFER or n in realized


class _Memo(Mapping):
    """realized, with each node looked up once per schedule (lookups hash the node's structure). `structure` fills
    it as it walks: the realized nodes it met in `memo`, and every node it asked about in `asked` (so the
    scheduler, after it, finds the same answers without asking again)."""

    def __init__(self, inner: Mapping[Node, BufferRef]):
        self.inner, self.memo = inner, {}
        self.asked: set[Node] = set()  # nodes hash by identity; held, so their ids in memo stay theirs

    def get(self, n: Node, default=None):
        e = self.memo.get(id(n))
        if e is None:
            ref = None if n.op is Op.BUFFER or n in self.asked else self.inner.get(n)
            e = self.memo[id(n)] = (n, ref)
        ref = e[1]
        return default if ref is None else ref

    def __contains__(self, n: object) -> bool:
        return self.get(n) is not None

    def __getitem__(self, n: Node) -> BufferRef:
        ref = self.get(n)
        if ref is None:
            raise KeyError(n)
        return ref

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


_STALE = ("this lazy tensor reads a buffer that was written in place (setitem) after it was built; realize() it "
          "before assigning into its inputs")


class Structure:
    """A graph's structure with buffers abstracted to slots: what `create_schedule` depends on, as a hashable key.

    Nodes are listed in the scheduler's own walk order (sources first, stopping at buffers and realized nodes);
    each entry is (op, dtype, argument, shape, source positions), and an input (a BUFFER leaf or a realized node)
    is its buffer's slot (numbered by first use), dtype and size. A leaf with runtime values (graph.runtime_values:
    RNG seeds and counters, Variables, most float constants) enters as a placeholder and its values go to `params`
    (`param_slot`: where a node's first value is there). Two graphs with equal keys get the same kernels, the same
    lowering and the same buffer lifetimes; only the buffers bound to the slots and the push constants taken from
    `params` differ. `key` is None when the graph holds something the key cannot describe (the schedule is then
    not reused).
    """

    __slots__ = ("key", "inputs", "customs", "realized", "params", "param_slot")

    def __init__(self, key: tuple | None, inputs: list[BufferRef], customs: list[Node], realized: _Memo,
                 params: list, param_slot: dict[int, int]):
        self.key, self.inputs, self.customs, self.realized = key, inputs, customs, realized
        self.params, self.param_slot = params, param_slot


def structure(targets: list[Node], realized: Mapping[Node, BufferRef],
              dests: list[tuple[BufferRef, ShapeTracker] | None] | None = None, extra: tuple = ()) -> Structure:
    """The structural key of scheduling `targets` (see `Structure`); raises on stale buffers as create_schedule."""
    memo = realized if isinstance(realized, _Memo) else _Memo(realized)
    # a fresh memo is filled here, each node asked about once: the answer kept where it is a buffer (most are not)
    fresh = not memo.memo and not memo.asked
    remember, inner_get = memo.memo.__setitem__, memo.inner.get
    slots: dict[int, int] = {}
    inputs: list[BufferRef] = []
    customs: list[Node] = []
    index: dict[Node, int] = {}  # nodes hash by identity
    entries: list[tuple] = []
    params: list = []
    param_slot: dict[int, int] = {}
    ok = True

    def slot(ref: BufferRef) -> int:
        i = slots.get(id(ref))
        if i is None:
            i = slots[id(ref)] = len(inputs)
            inputs.append(ref)
        return i

    BUF, CUSTOM, CONT = Op.BUFFER, Op.CUSTOM, Op.CONTIGUOUS
    seen: set[Node] = set()
    at = index.__getitem__
    for t in targets:
        # the walk of Node.toposort (sources first), stopping at buffers and realized nodes, in one pass: each
        # node is looked up in `realized` once and entered as it completes
        stack: list[tuple[Node, bool]] = [(t, False)]
        pop, push = stack.pop, stack.append
        while stack:
            n, done = pop()
            if done:
                index[n] = len(entries)
                if n.op is CUSTOM:  # the kernel is the node's own (called at run time); its arg keys nothing here
                    entries.append((CUSTOM, n.dtype, ("custom", len(customs)), n.shape,
                                    tuple(map(at, n.srcs))))
                    customs.append(n)
                else:
                    entries.append((n.op, n.dtype, n.akey, n.shape, tuple(map(at, n.srcs))))
                continue
            if n in seen:
                continue
            seen.add(n)
            op = n.op
            if op is BUF:
                ref = n.arg[0]
                if n.arg[1] != ref.version:
                    raise RuntimeError(_STALE)
                index[n] = len(entries)
                entries.append((op, n.dtype, ("buf", slot(ref), ref.dtype, ref.numel), n.shape))
                continue
            if fresh:
                ref = inner_get(n)
                if ref is not None:
                    remember(id(n), (n, ref))
            else:
                ref = memo.get(n)
            if ref is not None:
                if op is CUSTOM or op is CONT:  # the scheduler looks below these even when realized
                    ok = False
                index[n] = len(entries)
                entries.append((op, n.dtype, ("realized", slot(ref), ref.dtype, ref.numel), n.shape))
            elif not n.srcs and op is not CUSTOM:
                index[n] = len(entries)
                if values := runtime_values(n):
                    param_slot[id(n)] = len(params)
                    params.extend(values)
                    entries.append((op, n.dtype, "param", n.shape))
                else:
                    entries.append((op, n.dtype, n.akey, n.shape, ()))
            else:
                push((n, True))
                for s in reversed(n.srcs):
                    if s not in seen:
                        push((s, False))
    if fresh:
        memo.asked = seen  # the nodes asked about (BUFFER leaves too: never realized entries)
    dkey = tuple(None if d is None else (slot(d[0]), d[0].dtype, d[0].numel, d[1]) for d in (dests or ()))
    key = (tuple(entries), tuple(index[t] for t in targets), dkey, extra) if ok else None
    return Structure(key, inputs, customs, memo, params, param_slot)


def _row_expand(st: ShapeTracker, full: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """st broadcasts a reduce output (size 1 on the reduced axes) back over the full shape."""
    if len(st.views) != 1:
        return False
    v = st.views[0]
    return v.shape == full and v.offset == 0 and v.mask is None and v.strides == strides


def _walk_reduce(r: Node, full: tuple[int, ...], axes: tuple[int, ...], boundary) -> tuple[set[Node], list[Node]]:
    """Violations and fused reductions if r's kernel iterates over `full` reducing `axes`."""
    out_shape = tuple(1 if i in axes else s for i, s in enumerate(full))
    rows = prod(out_shape)
    expand = View.make(full, strides_for(out_shape)).strides
    if r.numel == rows:
        ctx0 = "row"
    elif r.shape == full:
        ctx0 = "elem"
    else:
        ctx0 = "free"
    viol: set[Node] = set()
    fused: list[Node] = []
    seen: set[tuple[int, str]] = set()
    stack = [(r, ctx0)]
    while stack:
        n, ctx = stack.pop()
        if (id(n), ctx) in seen or boundary(n):
            continue
        seen.add((id(n), ctx))
        if n.op in (Op.REDUCE, Op.MATMUL):
            if ctx == "row" and n.op is Op.REDUCE and n.srcs[0].shape == full and n.arg[1] == axes:
                if n not in fused:
                    fused.append(n)
                stack.append((n.srcs[0], "elem"))
            else:
                viol.add(n)
        elif n.op is Op.VIEW:
            src = n.srcs[0]
            if ctx == "row" and n.arg.is_contiguous:
                stack.append((src, "row"))
            elif ctx == "elem" and src.numel == rows and _row_expand(n.arg, full, expand):
                stack.append((src, "row"))
            else:
                stack.append((src, "free"))
        elif n.op is Op.GATHER:
            stack.extend((s, "free") for s in n.srcs)
        else:
            stack.extend((s, ctx) for s in n.srcs)
    return viol, fused


def _walk_matmul(r: Node, boundary) -> tuple[set[Node], list[Node]]:
    """Violations and the fused matmul if r's kernel is a matmul with an elementwise epilogue."""
    mm = None
    frontier = [r]
    while frontier and mm is None:
        n = frontier.pop(0)
        if boundary(n):
            continue
        if n.op is Op.MATMUL:
            mm = n
        elif n.op not in (Op.VIEW, Op.GATHER, Op.REDUCE):
            frontier.extend(n.srcs)
    viol: set[Node] = set()
    seen: set[tuple[int, str]] = set()
    stack = [(r, "epi")]
    while stack:
        n, ctx = stack.pop()
        if (id(n), ctx) in seen or boundary(n):
            continue
        seen.add((id(n), ctx))
        if n is mm and ctx == "epi":
            stack.extend((s, "free") for s in n.srcs)
        elif n.op in (Op.REDUCE, Op.MATMUL):
            viol.add(n)
        elif n.op in (Op.VIEW, Op.GATHER) or ctx == "free":
            stack.extend((s, "free") for s in n.srcs)
        else:
            stack.extend((s, "epi") for s in n.srcs)
    return viol, ([mm] if mm is not None and mm not in viol else [])


def _analyze(r: Node, realize: set[Node], realized: Mapping[Node, BufferRef],
             max_inputs: int, region: set[int] | None = None) -> tuple[set[Node], list[Node]]:
    """Violations and fused heavy nodes of r's kernel; `region` receives the ids of every node the walk reached."""
    get, BUF = realized.get, Op.BUFFER

    def boundary(n: Node) -> bool:  # an input (a buffer or realized node) or a node this schedule realizes
        return n is not r and (n in realize or n.op is BUF or get(n) is not None)

    inner = r.toposort(stop=boundary)
    if region is not None:
        region.update(map(id, inner))
    bound = [n for n in inner if boundary(n)]
    inputs = sum(1 for n in bound if n.op is not Op.CONST)
    if inputs > max_inputs:
        # too many buffers for one kernel: cut out the source subgraph that reads the most of them
        bit = {id(n): (0 if n.op is Op.CONST else 1 << i) for i, n in enumerate(bound)}  # the inputs as bits
        reads: dict[int, int] = {}
        for n in inner:  # sources first
            b = bit.get(id(n))
            if b is None:
                b = 0
                for s in n.srcs:
                    b |= reads[id(s)]
            reads[id(n)] = b
        cands = [n for n in inner if n is not r and id(n) not in bit and n.op is not Op.VIEW]
        # never a node past a broadcast (a product's [rows, out, in] before its reduction): materializing it
        # writes the broadcast out in full; the operand side of the broadcast reads nearly as many buffers
        broad: set[int] = set()
        for n in inner:  # sources first; a reduction's result is no broadcast
            if n.op is not Op.REDUCE and any(id(s) in broad or (s.op is Op.VIEW and s.numel > s.srcs[0].numel)
                                             for s in n.srcs):
                broad.add(id(n))
        cands = [n for n in cands if id(n) not in broad] or cands
        return {max(cands, key=lambda n: reads[id(n)].bit_count())}, []
    heavy = [n for n in reversed(inner) if not boundary(n) and n.op in (Op.REDUCE, Op.MATMUL)]
    if not heavy:
        return set(), []
    if r.op is Op.REDUCE:  # a reduction's kernel iterates its own space; only its inputs can violate it
        return _walk_reduce(r, r.srcs[0].shape, r.arg[1], boundary)
    if any(n.op is Op.MATMUL for n in heavy):
        return _walk_matmul(r, boundary)
    best: tuple[set[Node], list[Node]] | None = None
    for cand in heavy:
        result = _walk_reduce(r, cand.srcs[0].shape, cand.arg[1], boundary)
        if not result[0]:
            return result
        if best is None:
            best = result
    assert best is not None
    return best


def _choose_boundaries(order: list[Node], realize: set[Node], realized: Mapping[Node, BufferRef],
                       max_inputs: int) -> None:
    """Grow `realize` until every kernel is a valid fusion group and no heavy node is computed twice.

    Consumers are analysed before their sources (reverse topological order), so a node a consumer's analysis
    marks for realization is analysed later in the same pass; passes repeat only while something changes."""
    # An analysis depends only on which nodes of its region (the nodes its walk reached) are realized, so it is
    # kept until a node of that region joins `realize` (nodes only ever join): later passes redo few analyses.
    added: list[Node] = []  # nodes that joined `realize`, in order
    memo: dict[int, tuple[int, set[int], tuple[set[Node], list[Node]]]] = {}

    def analyze(r: Node) -> tuple[set[Node], list[Node]]:
        e = memo.get(id(r))
        if e is not None:
            since, region, result = e
            if not any(id(n) in region for n in added[since:]):
                memo[id(r)] = (len(added), region, result)
                return result
        region: set[int] = set()
        result = _analyze(r, realize, realized, max_inputs, region)
        memo[id(r)] = (len(added), region, result)
        return result

    while True:
        users: dict[Node, list[Node]] = {}
        grown = False
        for r in reversed(order):
            if r not in realize:
                continue
            viol, fused = analyze(r)
            if viol:
                new = viol - realize
                if not new:
                    raise RuntimeError(f"scheduler: no split makes the kernel of {r.op.name} {r.shape} valid")
                realize |= new
                added.extend(new)
                grown = True
                continue
            for f in fused:
                users.setdefault(f, []).append(r)
        if grown:
            continue
        shared = {f for f, rs in users.items() if len(rs) > 1}
        if not shared:
            return
        realize |= shared
        added.extend(shared)


def create_schedule(targets: list[Node], realized: Mapping[Node, BufferRef],
                    dests: list[tuple[BufferRef, ShapeTracker] | None] | None = None, max_inputs: int = 16) -> Schedule:
    """Kernels computing `targets`; a target with a dest (buffer, view) is stored through that view instead."""
    dests = dests or [None] * len(targets)
    if not isinstance(realized, _Memo):
        realized = _Memo(realized)

    def stop(n: Node) -> bool:
        return is_input(n, realized)

    order: list[Node] = []
    seen: set[int] = set()
    for t in targets:
        for n in t.toposort(stop):
            if id(n) not in seen:
                seen.add(id(n))
                order.append(n)
    for n in order:
        if n.op is Op.BUFFER and n.arg[1] != n.arg[0].version:
            raise RuntimeError(_STALE)

    realize: set[Node] = {t for t in targets if not is_input(t, realized)}
    for n in order:
        if n.op is Op.CONTIGUOUS:
            realize.add(n)
        if n.op is Op.CUSTOM:
            realize.add(n)
            realize.update(s for s in n.srcs if not is_input(s, realized))
    _choose_boundaries(order, realize, realized, max_inputs)

    refs: dict[Node, BufferRef] = {}
    mapping: dict[Node, Node] = {}

    def ref_of(n: Node) -> BufferRef:
        if n.op is Op.BUFFER:
            return n.arg[0]
        return realized[n] if n in realized else refs[n]

    for n in order:
        if n in realized:
            ref = realized[n]
            mapping[n] = buffer(ref, ref.version, n.dtype, n.shape)

    sched = Schedule()
    reads: list[list[BufferRef]] = []

    def add_kernel(root: Node, out: BufferRef, st: ShapeTracker) -> None:
        leaves = [m.arg[0] for m in root.toposort() if m.op is Op.BUFFER]
        sched.items.append(Kernel(root, out, st))
        reads.append(leaves)

    dest_of = {id(t): d for t, d in zip(targets, dests, strict=True) if d is not None}
    stored: set[int] = set()
    temps: list[BufferRef] = []

    def reads_ref(root: Node, ref: BufferRef) -> bool:
        return any(m.op is Op.BUFFER and m.arg[0] is ref for m in root.toposort())

    for n in order:
        if n not in realize:
            continue
        src = n.srcs[0] if n.srcs else None
        if id(n) in dest_of:
            ref, st = dest_of[id(n)]
            root = substitute(n.srcs[0] if n.op is Op.CONTIGUOUS else n,
                              {k: v for k, v in mapping.items() if k is not n})
            if not reads_ref(root, ref):  # store straight through the destination view
                if n.numel:
                    add_kernel(root, ref, st)
                stored.add(id(n))
                continue
        if n.op is Op.VIEW and src is not None and (is_input(src, realized) or src in refs) and n.arg.is_contiguous:
            refs[n] = ref_of(src)  # a plain reshape of a realized buffer (an input, or stored above) needs no copy
        elif n.op is Op.CUSTOM:
            refs[n] = BufferRef(n.dtype, n.numel)
            temps.append(refs[n])
            ins = [ref_of(s) for s in n.srcs]
            sched.items.append(CustomCall(n, refs[n], ins))
            reads.append(ins)
        else:
            refs[n] = BufferRef(n.dtype, n.numel)
            temps.append(refs[n])
            if n.numel:
                body = n.srcs[0] if n.op is Op.CONTIGUOUS else n
                add_kernel(substitute(body, {k: v for k, v in mapping.items() if k is not n}), refs[n],
                           ShapeTracker.contiguous(n.shape))
        mapping[n] = buffer(refs[n], refs[n].version, n.dtype, n.shape)

    for t in targets:
        d = dest_of.get(id(t))
        if d is None:
            sched.outputs.append(ref_of(t))
            continue
        ref, st = d
        sched.outputs.append(ref)
        if id(t) in stored or not t.numel:
            continue
        root = mapping.get(t, t)
        if reads_ref(root, ref):  # x[a] = f(x[b]): go through a copy so no element is read after it is written
            tmp = BufferRef(t.dtype, t.numel)
            temps.append(tmp)
            add_kernel(root, tmp, ShapeTracker.contiguous(t.shape))
            root = buffer(tmp, 0, t.dtype, t.shape)
        add_kernel(root, ref, st)

    out_ids = {id(r) for r in sched.outputs}
    last: dict[int, tuple[int, BufferRef]] = {}
    for i, leaves in enumerate(reads):
        for ref in leaves:
            last[id(ref)] = (i, ref)
    sched.temps = temps
    sched.frees = [[] for _ in sched.items]
    inter = {id(t) for t in temps} - out_ids
    for i, ref in last.values():
        if id(ref) in inter:
            sched.frees[i].append(ref)
    return sched

"""Reverse-mode autograd on the lazy graph.

Gradients are derived from the op graph itself, not from a tape of Tensor calls: every Tensor method ends in
graph nodes (elementwise ops, reductions, views, matmul, gather, casts), so a rule per node op covers every
method built from them, and the gradients are graph nodes too, scheduled and fused like any other work (and
captured by `vkgraph.jit` with the rest of a training step).

- A leaf is a Tensor marked with `requires_grad_()`; it is realized then, so graphs refer to its buffer node.
- When a tensor whose graph reaches a leaf is realized, its buffer node remembers the graph it came from
  (`_HISTORY`), so `loss.item()` before `loss.backward()`, or a realized activation, does not cut the path.
- `detach()` wraps a node in an identity BITCAST, an op with no gradient; codegen renders it as nothing.
- `no_grad()` stops that remembering and makes `backward`/`grad` refuse; lazy values built inside it still
  carry their graph (detach them to use them as constants).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import graph as g
from .dtype import dtypes
from .graph import Node, Op, ReduceOp
from .view import ShapeTracker, View

if TYPE_CHECKING:
    from .tensor import Tensor



class _ByIdentity:
    """A weak-keyed map by object identity (Tensor's == is elementwise, so weakref's own containers, which
    compare keys with ==, cannot hold tensors)."""

    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref, Any]] = {}

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: Any) -> bool:
        return id(key) in self._d

    def get(self, key: Any, default: Any = None) -> Any:
        hit = self._d.get(id(key))
        return default if hit is None else hit[1]

    def __setitem__(self, key: Any, value: Any) -> None:
        i = id(key)
        self._d[i] = (weakref.ref(key, lambda _, i=i, d=self._d: d.pop(i, None)), value)

    def pop(self, key: Any, default: Any = None) -> Any:
        hit = self._d.pop(id(key), None)
        return default if hit is None else hit[1]

    def keys(self) -> list[Any]:
        return [k for k in (r() for r, _ in list(self._d.values())) if k is not None]


_LEAVES = _ByIdentity()  # tensors with requires_grad set by the user
_GRADS = _ByIdentity()  # leaf tensor -> its .grad
_HISTORY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # realized buffer node -> the node it was
_REACH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # node -> whether it reaches a leaf
_reach_for: frozenset[int] = frozenset()  # ids of the leaf nodes _REACH's answers are about
_state = threading.local()


def is_grad_enabled() -> bool:
    return getattr(_state, "enabled", True)


def set_grad_enabled(mode: bool) -> None:
    _state.enabled = bool(mode)


class no_grad(contextlib.ContextDecorator):
    """Within it (or a function it decorates) realized values keep no graph and gradients cannot be taken."""

    def __enter__(self) -> no_grad:
        self.prev = is_grad_enabled()
        set_grad_enabled(False)
        return self

    def __exit__(self, *exc: Any) -> None:
        set_grad_enabled(self.prev)


class enable_grad(no_grad):
    def __enter__(self) -> enable_grad:
        self.prev = is_grad_enabled()
        set_grad_enabled(True)
        return self


# ---- the Tensor-facing state ----------------------------------------------------------------------------------


def _leaf_nodes() -> set[Node]:
    """The leaves' nodes, with _REACH emptied if they are not the ones its answers are about (a leaf added,
    turned off or dropped). An id reused by a new leaf node after the old one died cannot mislead it: nodes
    built before the new leaf cannot reach it."""
    global _reach_for
    leaves = {t.node for t in _LEAVES.keys()}
    ids = frozenset(map(id, leaves))
    if ids != _reach_for:
        _REACH.clear()
        _reach_for = ids
    return leaves


def requires_grad(t: Tensor) -> bool:
    if t in _LEAVES:
        return True
    if not _LEAVES or not is_grad_enabled():
        return False
    return _reaches(t.node, _leaf_nodes())


def set_requires_grad(t: Tensor, flag: bool) -> None:
    if not flag:
        _LEAVES.pop(t)
        return
    if not t.dtype.is_float:
        raise TypeError(f"only floating-point tensors can require gradients, not {t.dtype}")
    if t.node.op is not Op.BUFFER:
        if requires_grad(t):
            raise RuntimeError("requires_grad_ on a tensor computed from others that require grad; use detach()")
        t.realize()
    _LEAVES[t] = True


def is_leaf(t: Tensor) -> bool:
    return t in _LEAVES or not requires_grad(t)


def get_grad(t: Tensor) -> Tensor | None:
    return _GRADS.get(t)


def set_grad(t: Tensor, value: Tensor | None) -> None:
    if value is None:
        _GRADS.pop(t, None)
    else:
        if tuple(value.shape) != tuple(t.shape):
            raise ValueError(f"assigned grad of shape {value.shape} to a tensor of shape {t.shape}")
        _GRADS[t] = value


def detach(t: Tensor) -> Tensor:
    from .tensor import Tensor
    if not _LEAVES or not t.dtype.is_float:
        return Tensor(t.node)
    return Tensor(g.alu(Op.BITCAST, t.dtype, t.node))


def on_realize(pairs: Sequence[tuple[Node, Node]]) -> None:
    """Called by realize_all as tensors' nodes become buffers, with (old node, buffer node) pairs: keep each
    graph that leads to a leaf."""
    if not _LEAVES or not is_grad_enabled():
        return
    leaves = _leaf_nodes()  # once for all of them
    for old, new in pairs:
        if old.op is not Op.BUFFER and _reaches(old, leaves):
            _HISTORY[new] = old


def _sources(n: Node) -> tuple[Node, ...]:
    if n.op is Op.BUFFER:
        h = _HISTORY.get(n)
        return (h,) if h is not None else ()
    if n.op is Op.BITCAST:  # detach, and reinterpretation: no gradient
        return ()
    return n.srcs


def _reaches(root: Node, targets: set[Node]) -> bool:
    """Whether root's graph (through remembered histories) contains one of targets."""
    if not targets:
        return False
    memo = _REACH
    stack = [(root, False)]
    while stack:
        n, done = stack.pop()
        if n in memo:
            continue
        srcs = _sources(n)
        if done or not srcs or n in targets:
            memo[n] = n in targets or any(memo.get(s, False) for s in srcs)
            continue
        stack.append((n, True))
        stack.extend((s, False) for s in srcs if s not in memo)
    return memo[root]


# ---- the walk -------------------------------------------------------------------------------------------------


def _order(roots: Sequence[Node]) -> list[Node]:
    seen: set[Node] = set()
    out: list[Node] = []
    for root in roots:
        stack = [(root, False)]
        while stack:
            n, done = stack.pop()
            if done:
                out.append(n)
                continue
            if n in seen:
                continue
            seen.add(n)
            stack.append((n, True))
            stack.extend((s, False) for s in reversed(_sources(n)) if s not in seen)
    return out


def gradients(outputs: Sequence[Tensor], grad_outputs: Sequence[Tensor], targets: Sequence[Node]
              ) -> dict[Node, Tensor]:
    """d(sum of outputs * grad_outputs)/d(target) for each target node reached; lazy Tensors."""
    from .tensor import Tensor
    order = _order([o.node for o in outputs])
    wanted = set(targets)
    needed: set[Node] = set()
    for n in order:  # sources first: a node is needed if it is a target or leads to one
        if n in wanted or any(s in needed for s in _sources(n)):
            needed.add(n)
    acc: dict[Node, Tensor] = {}
    for o, go in zip(outputs, grad_outputs, strict=True):
        if o.node in needed:
            acc[o.node] = acc[o.node] + go if o.node in acc else go
    for n in reversed(order):
        gn = acc.get(n)
        if gn is None or n in wanted and not _sources(n):
            continue
        srcs = _sources(n)
        if not any(s in needed for s in srcs):
            continue
        if n.op is Op.BUFFER:  # a remembered history: the same value
            parts: tuple[Tensor | None, ...] = (gn,)
        else:
            rule = _RULES.get(n.op)
            if rule is None:
                raise NotImplementedError(f"no gradient for {n.op.name} nodes")
            parts = rule(n, gn, [Tensor(s) for s in srcs])
        for s, p in zip(srcs, parts, strict=True):
            if p is None or s not in needed or not s.dtype.is_float:
                continue
            p = p.cast(s.dtype)
            if p.shape != s.shape:
                raise AssertionError(f"gradient of shape {p.shape} for a node of shape {s.shape}")
            acc[s] = acc[s] + p if s in acc else p
    return {n: acc[n] for n in targets if n in acc}


def _check_enabled() -> None:
    if not is_grad_enabled():
        raise RuntimeError("gradients are off here (inside no_grad)")


def grad(outputs: Tensor | Sequence[Tensor], inputs: Tensor | Sequence[Tensor],
         grad_outputs: Tensor | Sequence[Tensor] | None = None, allow_unused: bool = False) -> list[Tensor | None]:
    """The gradients of outputs with respect to inputs, as lazy Tensors (they can be differentiated again)."""
    from .tensor import Tensor
    _check_enabled()
    outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    ins = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    gos = _grad_outputs(outs, grad_outputs)
    found = gradients(outs, gos, [t.node for t in ins])
    result: list[Tensor | None] = []
    for t in ins:
        gt = found.get(t.node)
        if gt is None and not allow_unused:
            raise RuntimeError(f"an input of shape {t.shape} is not used in the outputs' graph "
                               "(pass allow_unused=True to get None)")
        result.append(gt)
    return result


def _grad_outputs(outs: list[Tensor], grad_outputs: Any) -> list[Tensor]:
    from .tensor import Tensor
    if grad_outputs is None:
        for o in outs:
            if o.numel() != 1:
                raise RuntimeError(f"grad can be implicitly created only for one-element outputs, not {o.shape}")
        return [Tensor.full(o.shape, 1.0, o.dtype) for o in outs]
    gos = [grad_outputs] if isinstance(grad_outputs, Tensor) else list(grad_outputs)
    for o, go in zip(outs, gos, strict=True):
        if tuple(go.shape) != tuple(o.shape):
            raise ValueError(f"grad_output of shape {go.shape} for an output of shape {o.shape}")
    return [go.cast(o.dtype) for o, go in zip(outs, gos, strict=True)]


def backward(t: Tensor, gradient: Tensor | None = None) -> None:
    """Accumulate d(t)/d(leaf) into the .grad of every leaf t's graph reaches; realized with t in one schedule."""
    from .tensor import realize_all
    _check_enabled()
    if not t.dtype.is_float:
        raise RuntimeError(f"backward of a {t.dtype} tensor")
    gos = _grad_outputs([t], gradient)
    leaves: dict[Node, list[Tensor]] = {}
    for leaf in _LEAVES.keys():
        leaves.setdefault(leaf.node, []).append(leaf)
    found = gradients([t], gos, list(leaves))
    if not found and t not in _LEAVES:
        raise RuntimeError("backward: the tensor does not require grad (no leaf with requires_grad in its graph)")
    new = []
    for n, gt in found.items():
        for leaf in leaves[n]:
            old = _GRADS.get(leaf)
            _GRADS[leaf] = gt if old is None else old + gt
            new.append(_GRADS.get(leaf))
    with no_grad():  # gradients are values, not graphs to differentiate again
        realize_all(t, *new)


# ---- rules: node, its gradient, its sources as Tensors -> one gradient (or None) per source -------------------


def _rule(*ops: Op) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        for op in ops:
            _RULES[op] = fn
        return fn
    return deco


_RULES: dict[Op, Callable[[Node, Tensor, list[Tensor]], tuple[Tensor | None, ...]]] = {}
_LN2 = math.log(2.0)


def _out(n: Node) -> Tensor:
    from .tensor import Tensor
    return Tensor(n)


@_rule(Op.CAST, Op.CONTIGUOUS)
def _identity(n, gr, s):
    return (gr,)


@_rule(Op.NEG)
def _neg(n, gr, s):
    return (-gr,)


@_rule(Op.EXP)
def _exp(n, gr, s):
    return (gr * _out(n),)


@_rule(Op.EXP2)
def _exp2(n, gr, s):
    return (gr * _out(n) * _LN2,)


@_rule(Op.LOG)
def _log(n, gr, s):
    return (gr / s[0],)


@_rule(Op.LOG2)
def _log2(n, gr, s):
    return (gr / (s[0] * _LN2),)


@_rule(Op.SIN)
def _sin(n, gr, s):
    return (gr * s[0].cos(),)


@_rule(Op.COS)
def _cos(n, gr, s):
    return (-gr * s[0].sin(),)


@_rule(Op.TANH)
def _tanh(n, gr, s):
    y = _out(n)
    return (gr * (1.0 - y * y),)


@_rule(Op.SQRT)
def _sqrt(n, gr, s):
    return (gr * 0.5 / _out(n),)


@_rule(Op.RSQRT)
def _rsqrt(n, gr, s):
    y = _out(n)
    return (gr * -0.5 * y * y * y,)


@_rule(Op.RECIP)
def _recip(n, gr, s):
    y = _out(n)
    return (-gr * y * y,)


@_rule(Op.ABS)
def _abs(n, gr, s):
    return (gr * s[0].sign(),)


@_rule(Op.ERF)
def _erf(n, gr, s):
    x = s[0]
    return (gr * (2 / math.sqrt(math.pi)) * (-(x * x)).exp(),)


@_rule(Op.SIGN, Op.FLOOR, Op.CEIL, Op.ROUND, Op.TRUNC, Op.IDIV)
def _flat(n, gr, s):
    return tuple(gr * 0.0 for _ in s)


@_rule(Op.ADD)
def _add(n, gr, s):
    return gr, gr


@_rule(Op.SUB)
def _sub(n, gr, s):
    return gr, -gr


@_rule(Op.MUL)
def _mul(n, gr, s):
    return gr * s[1], gr * s[0]


@_rule(Op.DIV)
def _div(n, gr, s):
    a, b = s
    return gr / b, -gr * a / (b * b)


@_rule(Op.MOD)
def _mod(n, gr, s):
    a, b = s
    return gr, -gr * (a / b).floor()


@_rule(Op.MAX, Op.MIN)
def _minmax(n, gr, s):
    a, b = s
    win = (a > b) if n.op is Op.MAX else (a < b)
    tie = a == b
    ga = win.where(gr, tie.where(gr * 0.5, 0.0))
    return ga, gr - ga


@_rule(Op.POW)
def _pow(n, gr, s):
    a, b = s
    ga = (b == 0).where(0.0, gr * b * a.pow(b - 1.0))
    gb = (a == 0).where(0.0, gr * _out(n) * a.log())
    return ga, gb


@_rule(Op.WHERE)
def _where(n, gr, s):
    c = s[0]
    return None, c.where(gr, 0.0), c.where(0.0, gr)


@_rule(Op.REDUCE)
def _reduce(n, gr, s):
    rop, axes = n.arg
    x = s[0]
    if rop is ReduceOp.SUM:
        return (gr.expand(x.shape),)
    if rop in (ReduceOp.MAX, ReduceOp.MIN):
        hit = (x == _out(n).cast(x.dtype).expand(x.shape)).cast(gr.dtype)
        count = hit.sum(axes, keepdim=True)
        return (hit * (gr / count).expand(x.shape),)
    if rop is ReduceOp.PROD:
        zero = x == 0
        nonzero = zero.where(1.0, x).prod(axes, keepdim=True).expand(x.shape)
        zeros = zero.cast(dtypes.int32).sum(axes, keepdim=True).expand(x.shape)
        y = _out(n).cast(x.dtype).expand(x.shape)
        local = (zeros == 0).where(y / zero.where(1.0, x), (zeros == 1).logical_and(zero).where(nonzero, 0.0))
        return (gr.expand(x.shape) * local,)
    return (None,)  # argmax/argmin: integer results


@_rule(Op.MATMUL)
def _matmul(n, gr, s):
    a, b = s
    return gr @ b.transpose(-1, -2), a.transpose(-1, -2) @ gr


@_rule(Op.GATHER)
def _gather(n, gr, s):
    x, idx = s
    axis = n.arg
    size = x.shape[axis]
    pre, post = x.shape[:axis], x.shape[axis + 1:]
    k = idx.numel()
    pos = idx.reshape(k).cast(dtypes.int32)
    pos = (pos < 0).where(pos + size, pos)
    hot = (pos.reshape(k, 1) == _arange(size).reshape(1, size)).cast(gr.dtype)
    pn, qn = math.prod(pre), math.prod(post)
    # the transpose of a gather is a scatter-add: a one-hot matmul (size, k) @ (k, post), so a large one takes
    # the tiled matmul path
    out = hot.transpose(0, 1).reshape(1, size, k) @ gr.reshape(pn, k, qn)
    return out.reshape(x.shape), None


def _arange(n: int) -> Tensor:
    from .tensor import Tensor
    return Tensor(g.iota(n))


@_rule(Op.VIEW)
def _view(n, gr, s):
    return (view_adjoint(gr, n.arg, s[0].shape),)


# ---- the adjoint of a view ------------------------------------------------------------------------------------


def view_adjoint(gr: Tensor, st: ShapeTracker, src_shape: tuple[int, ...]) -> Tensor:
    """The transpose of reading through st: each source element gets the sum of the gradients of the elements
    that read it (expanded and overlapping windows sum; padding and masked-out elements drop)."""
    for k in range(len(st.views) - 1, -1, -1):
        below = st.views[k - 1].shape if k else tuple(src_shape)
        gr = _adjoint_one(gr, st.views[k], math.prod(below)).reshape(below)
    return gr


def _adjoint_one(gr: Tensor, v: View, n: int) -> Tensor:
    from .tensor import Tensor
    shape, strides, off = list(v.shape), list(v.strides), v.offset
    if n == 0 or 0 in shape or (v.mask and any(lo >= hi for lo, hi in v.mask)):
        return Tensor.full((n,), 0, gr.dtype)
    if v.mask:
        gr = gr.shrink(v.mask)
        off += sum(lo * st for (lo, _), st in zip(v.mask, strides, strict=True))
        shape = [hi - lo for lo, hi in v.mask]
    spread = tuple(i for i, (d, st) in enumerate(zip(shape, strides, strict=True)) if st == 0 and d > 1)
    if spread:
        gr = gr.sum(spread, keepdim=True)
    keep = [i for i, (d, st) in enumerate(zip(shape, strides, strict=True)) if d > 1 and st != 0]
    shape, strides = [shape[i] for i in keep], [strides[i] for i in keep]
    gr = gr.reshape(shape)
    neg = tuple(j for j, st in enumerate(strides) if st < 0)
    if neg:
        gr = gr.flip(neg)
        for j in neg:
            off += (shape[j] - 1) * strides[j]
            strides[j] = -strides[j]
    order = sorted(range(len(shape)), key=lambda j: -strides[j])
    gr = gr.permute(order) if order else gr
    shape, strides = [shape[j] for j in order], [strides[j] for j in order]
    cur, span = gr.reshape(*shape, 1), 1
    for j in reversed(range(len(shape))):
        a, st, lead = shape[j], strides[j], shape[:j]
        total = (a - 1) * st + span
        if st >= span:
            cur = _place(cur, lead, a, st, span)
        else:  # windows overlap: sum r interleaved placements, each without overlap
            r = -(-span // st)
            acc = None
            for c in range(min(r, a)):
                part = cur.shrink([None] * j + [(c, a), None])
                if r > 1:
                    part = part._move(functools.partial(_step, steps=(1,) * j + (r, 1)))
                b = len(range(c, a, r))
                placed = _place(part, lead, b, r * st, span)
                used = (b - 1) * r * st + span
                placed = placed.pad([(0, 0)] * j + [(c * st, total - c * st - used)])
                acc = placed if acc is None else acc + placed
            cur = acc
        span = total
    return cur.reshape(span).pad([(off, n - off - span)])


def _step(st: ShapeTracker, steps: tuple[int, ...]) -> ShapeTracker:
    return st.step(steps)


def _place(cur: Tensor, lead: list[int], a: int, st: int, span: int) -> Tensor:
    """cur of shape lead + [a, span] laid out with stride st along a: lead + [(a - 1) * st + span]."""
    if st > span:
        cur = cur.pad([(0, 0)] * len(lead) + [(0, 0), (0, st - span)])
    cur = cur.reshape(*lead, a * st)
    return cur.shrink([None] * len(lead) + [(0, (a - 1) * st + span)])


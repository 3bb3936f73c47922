"""The op graph: hash-consed nodes with constant folding.

A `Node` is (op, dtype, sources, argument, shape). `node(...)` interns them: building the same
subgraph twice returns the same object, so common subexpressions are shared for free and nodes can key
caches. Identity rules and constant folding run as nodes are built, so the scheduler and codegen never
see ``x * 1`` or ``2 + 3``.
"""

from __future__ import annotations

import math
import struct
import weakref
from _weakref import _remove_dead_weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import numpy as np

from .dtype import DType, check_fits, dtypes
from .interrupts import critical
from .view import Shape, ShapeTracker


class Op(Enum):
    # leaves
    BUFFER = auto()  # arg: (BufferRef, version) — realized data, contiguous in `shape`
    CONST = auto()  # arg: the value, broadcast over `shape`
    RAND = auto()  # arg: (seed, counter) — uniform float32 in [0, 1), counter-based
    IOTA = auto()  # int32 0, 1, ..., n-1 along its one axis
    VAR = auto()  # arg: a Variable — an int32 scalar read from a push constant at each dispatch
    # movement: arg is a ShapeTracker over the source's shape
    VIEW = auto()
    # unary
    NEG = auto(); NOT = auto(); EXP = auto(); EXP2 = auto(); LOG = auto(); LOG2 = auto()  # noqa: E702
    SIN = auto(); COS = auto(); TANH = auto(); SQRT = auto(); RSQRT = auto(); RECIP = auto()  # noqa: E702
    ABS = auto(); SIGN = auto(); FLOOR = auto(); CEIL = auto(); ROUND = auto(); TRUNC = auto()  # noqa: E702
    ERF = auto(); ISNAN = auto()  # noqa: E702
    CAST = auto()  # to `dtype`
    BITCAST = auto()  # reinterpret bits as `dtype` (same item size)
    # binary
    ADD = auto(); SUB = auto(); MUL = auto(); DIV = auto(); IDIV = auto(); MOD = auto()  # noqa: E702
    MAX = auto(); MIN = auto(); POW = auto()  # noqa: E702
    CMPLT = auto(); CMPLE = auto(); CMPEQ = auto(); CMPNE = auto()  # noqa: E702
    AND = auto(); OR = auto(); XOR = auto(); SHL = auto(); SHR = auto()  # noqa: E702
    # ternary
    WHERE = auto()
    # with a shape of their own
    REDUCE = auto()  # arg: (ReduceOp, axes); keeps reduced axes as size 1
    MATMUL = auto()  # sources (a, b): (..., M, K) @ (..., K, N), equal batch shapes
    GATHER = auto()  # sources (x, idx), arg: axis — x.take(idx, axis)
    CUSTOM = auto()  # arg: CustomOp — a hand-written kernel (see docs/tensor.md)
    CONTIGUOUS = auto()  # its source, stored in a buffer of its own (a forced kernel boundary)

    # members are singletons: hashing by identity is C-fast (Enum's own hashes the name, in Python), and every
    # node key and schedule key hashes ops
    __hash__ = object.__hash__


class ReduceOp(Enum):
    SUM = auto()
    PROD = auto()
    MAX = auto()
    MIN = auto()
    ARGMAX = auto()
    ARGMIN = auto()

    __hash__ = object.__hash__  # as Op's


# members read as module globals on the hot paths below: on Python 3.11 `Op.ADD` goes through the slot hook of
# EnumType.__getattr__ (about 80 ns a read against 20 for a global), and building one node read a dozen of them
_CONST, _CAST, _BITCAST, _WHERE, _VIEW, _BUFFER = Op.CONST, Op.CAST, Op.BITCAST, Op.WHERE, Op.VIEW, Op.BUFFER
_ADD, _SUB, _MUL, _DIV, _IDIV, _RAND, _VAR = Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.IDIV, Op.RAND, Op.VAR

UNARY = {Op.NEG, Op.NOT, Op.EXP, Op.EXP2, Op.LOG, Op.LOG2, Op.SIN, Op.COS, Op.TANH, Op.SQRT, Op.RSQRT, Op.RECIP,
         Op.ABS, Op.SIGN, Op.FLOOR, Op.CEIL, Op.ROUND, Op.TRUNC, Op.ERF, Op.ISNAN, Op.CAST, Op.BITCAST}
BINARY = {Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.IDIV, Op.MOD, Op.MAX, Op.MIN, Op.POW, Op.CMPLT, Op.CMPLE, Op.CMPEQ,
          Op.CMPNE, Op.AND, Op.OR, Op.XOR, Op.SHL, Op.SHR}
COMPARE = {Op.CMPLT, Op.CMPLE, Op.CMPEQ, Op.CMPNE, Op.ISNAN}
ELEMENTWISE = UNARY | BINARY | {Op.WHERE}
LEAVES = {Op.BUFFER, Op.CONST, Op.RAND, Op.IOTA, Op.VAR}


@dataclass(frozen=True, eq=False)
class CustomOp:
    """A hand-written kernel as a graph op.

    ``fn(dev, out, inputs)`` is called at execution with the runtime device, the output `Buffer` (contiguous,
    ``shape`` and ``dtype`` of the node) and one contiguous `Buffer` per source, in order; it records its
    dispatches with ``dev.dispatch`` and must not wait. ``key`` identifies the computation (name and
    parameters) so that equal custom ops are shared by the graph.
    """

    fn: Callable[[Any, Any, list[Any]], None]
    key: tuple = field(default=())
    name: str = "custom"

    def __hash__(self) -> int:
        return hash((self.fn, self.key))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CustomOp) and self.fn is other.fn and self.key == other.key


class BufferRef:
    """Storage of a realized node: dtype and element count; `buf` is the runtime Buffer once allocated.

    `version` counts in-place writes (setitem), so a lazy graph built before a write can be told apart.
    """

    __slots__ = ("dtype", "numel", "buf", "version", "__weakref__")

    def __init__(self, dtype: DType, numel: int, buf: Any = None):
        self.dtype, self.numel, self.buf, self.version = dtype, numel, buf, 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"<buffer {self.dtype.name}[{self.numel}] at {id(self):#x}>"


class Node:
    """One op of the graph. Build with `node()` (or the helpers below), never directly."""

    # akey: argkey(arg), made once here since node keys, realized-node keys and schedule keys all use it
    __slots__ = ("op", "dtype", "srcs", "arg", "shape", "akey", "__weakref__")

    def __init__(self, op: Op, dtype: DType, srcs: tuple[Node, ...], arg: Any, shape: Shape, akey: Any):
        self.op, self.dtype, self.srcs, self.arg, self.shape, self.akey = op, dtype, srcs, arg, shape, akey

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        arg = "" if self.op in (Op.BUFFER,) else f", {self.arg!r}"
        return f"<{self.op.name} {self.dtype.name}{list(self.shape)}{arg}>"

    def toposort(self, stop: Callable[[Node], bool] = lambda n: False) -> list[Node]:
        """Nodes under (and including) this one, sources first; does not descend below `stop` nodes."""
        seen: set[Node] = set()  # nodes hash and compare by identity
        order: list[Node] = []
        stack: list[tuple[Node, bool]] = [(self, False)]
        pop, push, add = stack.pop, stack.append, seen.add
        while stack:
            n, done = pop()
            if done:
                order.append(n)
                continue
            if n in seen:
                continue
            add(n)
            push((n, True))
            if n.srcs and not stop(n):
                stack.extend([(s, False) for s in reversed(n.srcs) if s not in seen])
        return order


class KeyedRef(weakref.ref):
    """A weak reference that knows its key in a plain dict of them (weakref.KeyedRef, but made without
    Python-level __new__ and __init__: every node built makes one). A plain dict, as a WeakValueDictionary's get
    and set run in Python; `forgetter(table)` is the references' callback."""

    __slots__ = ("key",)


def forgetter(table: dict) -> Callable[[KeyedRef], None]:
    """The callback for KeyedRefs stored in table: drops a dead reference's entry."""

    @critical  # a KeyboardInterrupt raised in a weakref callback is printed and lost: defer it past
    def forget(ref: KeyedRef, _remove: Callable = _remove_dead_weakref, _table: dict = table) -> None:
        # bound as defaults, so references dying at interpreter exit still find them; removes the entry only if
        # it is still this dead reference, not one stored since
        _remove(_table, ref.key)

    return forget


# node key -> weak reference to the node
_interned: dict[tuple, KeyedRef] = {}
_forget = forgetter(_interned)


_PLAIN = frozenset({type(None), int, bool, str, ShapeTracker})  # args that key as themselves (the common ones)


def argkey(arg: Any) -> Any:
    # floats key by their bits so 0.0 and -0.0 stay apart and nan equals nan
    t = type(arg)
    if t in _PLAIN:
        return arg
    if isinstance(arg, float):
        return ("f", _pack_double(arg))
    if isinstance(arg, tuple):
        return tuple([argkey(a) for a in arg])
    return arg


_pack_double = struct.Struct("<d").pack
_pack_f32, _unpack_f32 = struct.Struct("<f").pack, struct.Struct("<f").unpack
_MIN_NORMAL = 2.0**-126  # the smallest normal float32


def runtime_values(n: Node) -> tuple:
    """The scalars a leaf contributes to its kernel at dispatch time (push constants), or () if none.

    Kernels take these as data, not as compiled-in literals, so a new RNG counter or a new float constant runs
    the kernel compiled before: RAND's (seed, counter), a Variable, and float constants. A float constant that is
    zero, infinite, NaN or subnormal is none of these: its value is part of the kernel's key, and codegen hides it
    from the shader compiler (which folds literal arithmetic with such values against IEEE: ``x * 0.0`` gave 0 for
    an infinite x; see codegen.render.Renderer.special_float). Integer constants stay literals: they take part in
    index arithmetic and integer division, which the compiler simplifies.
    """
    op = n.op
    if op is _RAND:
        return (n.arg[0] & 0xFFFFFFFF, n.arg[1] & 0xFFFFFFFF)
    if op is _VAR:
        return (n.arg,)
    if op is _CONST and n.dtype.is_float and math.isfinite(n.arg) and abs(n.arg) >= _MIN_NORMAL:
        return (n.arg,)
    return ()


_UNKEYED = object()


@critical  # an interrupt between making the reference and setting its key broke every later _forget
def _make(op: Op, dtype: DType, srcs: tuple[Node, ...], arg: Any, shape: Shape, akey: Any = _UNKEYED) -> Node:
    """The node (op, dtype, srcs, arg, shape), made once while it lives. akey: argkey(arg) where the caller
    knows it. The key holds the sources themselves (nodes hash and compare by identity, in C): an entry lives
    only as long as its node, which holds them anyway."""
    if akey is _UNKEYED:
        akey = argkey(arg)
    key = (op, dtype, srcs, akey, shape)
    ref = _interned.get(key)
    if ref is not None:
        n = ref()
        if n is not None:
            return n
    n = Node(op, dtype, srcs, arg, shape, akey)
    ref = _interned[key] = KeyedRef(n, _forget)
    ref.key = key
    return n


class Variable:
    """A named integer that changes between calls without changing the graph (a position, a context length).

    Symbolic: a graph node (`Op.VAR`) stands for it, kernels read its value as a push constant at each dispatch,
    and a captured command graph reads it again at each replay (it is a `runtime.capture.LiveValue`)."""

    __slots__ = ("name", "value")

    def __init__(self, name: str, value: int = 0) -> None:
        self.name = name
        self.value = int(value)

    def __index__(self) -> int:
        return self.value

    def __int__(self) -> int:
        return self.value

    def __float__(self) -> float:
        return float(self.value)

    def __repr__(self) -> str:
        return f"Variable({self.name}={self.value})"


# ---------------------------------------------------------------------------------------------------------------
# builders


def var(variable: Variable) -> Node:
    """A scalar int32 whose value is the Variable's at each dispatch (and at each replay of a capture)."""
    return _make(_VAR, dtypes.int32, (), variable, ())


def const(value: Any, dtype: DType, shape: Shape = ()) -> Node:
    return _make(_CONST, dtype, (), _normalize(value, dtype), tuple(shape))


def buffer(ref: Any, version: int, dtype: DType, shape: Shape) -> Node:
    arg = (ref, version)  # a BufferRef and an int: argkey's own key
    return _make(_BUFFER, dtype, (), arg, tuple(shape), arg)


def rand(seed: int, counter: int, shape: Shape) -> Node:
    return _make(_RAND, dtypes.float32, (), (seed, counter), tuple(shape))


def iota(n: int) -> Node:
    return _make(Op.IOTA, dtypes.int32, (), None, (int(n),))


def contiguous(src: Node) -> Node:
    return src if src.op in (_BUFFER, Op.CONTIGUOUS) else _make(Op.CONTIGUOUS, src.dtype, (src,), None, src.shape)


def view(src: Node, st: ShapeTracker) -> Node:
    """src seen through st; a view of a view folds into one tracker; a plain view of a constant is a constant."""
    if st.shape == src.shape and st.is_contiguous:
        return src
    if src.op is _CONST and all(v.mask is None for v in st.views):
        return const(src.arg, src.dtype, st.shape)
    return _make(_VIEW, src.dtype, (src,), st, st.shape, st)


def movement(src: Node, fn: Callable[[ShapeTracker], ShapeTracker]) -> Node:
    """Apply a movement (a function on trackers) to src, extending the view src already is."""
    if src.op is _VIEW:
        return view(src.srcs[0], fn(src.arg))
    return view(src, fn(ShapeTracker.contiguous(src.shape)))


def reduce(src: Node, rop: ReduceOp, axes: tuple[int, ...], dtype: DType | None = None) -> Node:
    axes = tuple(sorted({int(a) for a in axes}))
    shape = tuple([1 if i in axes else s for i, s in enumerate(src.shape)])
    arg = (rop, axes)  # an enum member and ints: argkey's own key
    return _make(Op.REDUCE, dtype or src.dtype, (src,), arg, shape, arg)


def matmul(a: Node, b: Node, dtype: DType) -> Node:
    return _make(Op.MATMUL, dtype, (a, b), None, a.shape[:-1] + b.shape[-1:])


def gather(x: Node, idx: Node, axis: int) -> Node:
    shape = x.shape[:axis] + idx.shape + x.shape[axis + 1:]
    return _make(Op.GATHER, x.dtype, (x, idx), axis, shape)


def custom(op: CustomOp, srcs: tuple[Node, ...], dtype: DType, shape: Shape) -> Node:
    return _make(Op.CUSTOM, dtype, tuple(srcs), op, tuple(shape))


def alu(op: Op, dtype: DType, *srcs: Node) -> Node:
    """An elementwise node, folded when its sources are constants or the op is an identity."""
    shape = srcs[0].shape
    n_const = 0
    for s in srcs:
        if s.shape != shape:
            raise ValueError(f"{op.name}: sources of shapes {[s.shape for s in srcs]} (broadcast them first)")
        if s.op is _CONST:
            n_const += 1
    if n_const or op is _CAST:  # every folding rule needs a constant source, except a no-op cast
        folded = _fold(op, dtype, srcs, n_const)
        if folded is not None:
            return folded
    return _make(op, dtype, srcs, None, shape, None)


# ---------------------------------------------------------------------------------------------------------------
# constant folding: numpy evaluates the op on the constants in the op's own dtype


def _normalize(value: Any, dtype: DType) -> Any:
    if dtype.kind == "b":
        return bool(value)
    if dtype.is_int:
        if isinstance(value, (int, np.integer)):  # an integer constant must be one of the dtype's values
            check_fits(int(value), dtype)
            return int(value)
        return int(np.array(value).astype(dtype.np))
    if dtype is dtypes.float32:
        if type(value) is float:
            try:  # C's double -> float conversion, as numpy's, without making a numpy scalar
                return _unpack_f32(_pack_f32(value))[0]
            except OverflowError:  # finite past float32's range: numpy's infinity
                pass
        return float(np.float32(value))
    return float(np.array(value, np.float32).astype(dtype.np).astype(np.float32))


def _is_const(n: Node, value: Any) -> bool:
    return n.op is _CONST and n.arg == value and not (isinstance(n.arg, float) and math.isnan(n.arg))


def _zero_keeps(op: Op, zero: Node) -> bool:
    """Adding (op ADD) or subtracting (SUB) the constant zero leaves every value of its dtype as it was."""
    return not zero.dtype.is_float or math.copysign(1.0, zero.arg) == (-1.0 if op is _ADD else 1.0)


def _fold(op: Op, dtype: DType, srcs: tuple[Node, ...], n_const: int) -> Node | None:
    """The folded node, or None. Called by alu where a rule can apply: n_const of srcs are constants (at least
    one, unless op is a cast)."""
    if n_const == len(srcs) and op is not _BITCAST:
        with np.errstate(all="ignore"):
            value = NUMPY_OPS[op](*[np.array(s.arg, s.dtype.np if not s.dtype.is_float else np.float32)
                                    for s in srcs], dtype)
        return const(value.item() if hasattr(value, "item") else value, dtype, srcs[0].shape)
    if op is _WHERE and srcs[0].op is _CONST:
        return srcs[1] if srcs[0].arg else srcs[2]
    if op is _CAST and srcs[0].dtype is dtype:
        return srcs[0]
    if len(srcs) == 2:
        a, b = srcs
        same = a.dtype is dtype
        # IEEE: x + -0.0 and x - 0.0 are x for every x, but -0.0 + 0.0 is 0.0; x // 1 is floor(x) (nan for inf)
        if op in (_ADD, _SUB) and _is_const(b, 0) and same and _zero_keeps(op, b):
            return a
        if op is _ADD and _is_const(a, 0) and b.dtype is dtype and _zero_keeps(op, a):
            return b
        if (op in (_MUL, _DIV) or op is _IDIV and not dtype.is_float) and _is_const(b, 1) and same \
                and dtype.kind != "b":
            return a
        if op is _MUL and _is_const(a, 1) and b.dtype is dtype and dtype.kind != "b":
            return b
        if op is _MUL and dtype.is_int and (_is_const(a, 0) or _is_const(b, 0)):
            return const(0, dtype, a.shape)
    return None


def _floor_div(a, b):
    if np.issubdtype(a.dtype, np.floating):
        return np.floor(a / b)
    return np.where(b == 0, 0, np.floor_divide(a, np.where(b == 0, 1, b)))


def _mod(a, b):
    if np.issubdtype(a.dtype, np.floating):
        return np.mod(a, b)
    return np.where(b == 0, 0, np.mod(a, np.where(b == 0, 1, b)))


def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _cast(x, dtype: DType):
    if dtype.kind == "b":
        return x != 0
    return x.astype(dtype.np)


NUMPY_OPS: dict[Op, Callable[..., Any]] = {
    Op.NEG: lambda x, d: _cast(-x, d), Op.NOT: lambda x, d: ~x if x.dtype != np.bool_ else np.logical_not(x),
    Op.EXP: lambda x, d: np.exp(x), Op.EXP2: lambda x, d: np.exp2(x), Op.LOG: lambda x, d: np.log(x),
    Op.LOG2: lambda x, d: np.log2(x), Op.SIN: lambda x, d: np.sin(x), Op.COS: lambda x, d: np.cos(x),
    Op.TANH: lambda x, d: np.tanh(x), Op.SQRT: lambda x, d: np.sqrt(x), Op.RSQRT: lambda x, d: 1 / np.sqrt(x),
    Op.RECIP: lambda x, d: 1 / x, Op.ABS: lambda x, d: np.abs(x), Op.SIGN: lambda x, d: np.sign(x),
    Op.FLOOR: lambda x, d: np.floor(x), Op.CEIL: lambda x, d: np.ceil(x), Op.ROUND: lambda x, d: np.round(x),
    Op.TRUNC: lambda x, d: np.trunc(x), Op.ERF: lambda x, d: _erf(x), Op.ISNAN: lambda x, d: np.isnan(x),
    Op.CAST: lambda x, d: _cast(x, d),
    Op.ADD: lambda a, b, d: _cast(a + b if a.dtype != np.bool_ else a | b, d),
    Op.SUB: lambda a, b, d: _cast(a - b, d), Op.MUL: lambda a, b, d: _cast(a * b if a.dtype != np.bool_ else a & b, d),
    Op.DIV: lambda a, b, d: a / b, Op.IDIV: lambda a, b, d: _cast(_floor_div(a, b), d),
    Op.MOD: lambda a, b, d: _cast(_mod(a, b), d), Op.MAX: lambda a, b, d: np.maximum(a, b),
    Op.MIN: lambda a, b, d: np.minimum(a, b), Op.POW: lambda a, b, d: _cast(np.power(a, b), d),
    Op.CMPLT: lambda a, b, d: a < b, Op.CMPLE: lambda a, b, d: a <= b, Op.CMPEQ: lambda a, b, d: a == b,
    Op.CMPNE: lambda a, b, d: a != b, Op.AND: lambda a, b, d: a & b, Op.OR: lambda a, b, d: a | b,
    Op.XOR: lambda a, b, d: a ^ b, Op.SHL: lambda a, b, d: _cast(a << b, d), Op.SHR: lambda a, b, d: a >> b,
    Op.WHERE: lambda c, a, b, d: np.where(c, a, b),
}


def substitute(root: Node, mapping: dict[Node, Node]) -> Node:
    """root rebuilt with nodes in `mapping` replaced (through the builders, so folding applies again)."""
    out: dict[int, Node] = {}
    for n in root.toposort(stop=lambda n: n in mapping):
        if n in mapping:
            out[id(n)] = mapping[n]
            continue
        srcs = tuple(out[id(s)] for s in n.srcs)
        if srcs == n.srcs:
            out[id(n)] = n
        elif n.op is Op.VIEW:
            out[id(n)] = view(srcs[0], n.arg)
        elif n.op in ELEMENTWISE:
            out[id(n)] = alu(n.op, n.dtype, *srcs)
        else:
            out[id(n)] = _make(n.op, n.dtype, srcs, n.arg, n.shape)
    return out[id(root)]

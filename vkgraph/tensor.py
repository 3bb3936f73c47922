"""Tensor: a lazy n-dimensional array on the GPU.

Every operation builds graph nodes; nothing runs until `realize()`, `numpy()`, `item()` or `tolist()` (or
`np.asarray(t)`). Then the scheduler fuses what it can and the runtime dispatches the kernels. Names follow
PyTorch and tinygrad: reductions take `axis` (or `dim`) and `keepdim`. Shapes, axes, dtypes and integer
indices are checked as the graph is built, so bad input raises before any GPU work.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import autograd
from . import graph as g
from .dtype import (
    DType,
    check_fits,
    dtypes,
    fits,
    int_dtype,
    least_float,
    promote,
    promote_scalar,
    result_type,
    to_dtype,
)
from .graph import Node, Op, ReduceOp, Variable
from .realize import allocate, assign, download, download_async, has_dtype, realize, require_dtype, upload
from .tensor_index import TensorIndexing, needs_advanced
from .tensor_math import TensorMath
from .view import ShapeTracker

if TYPE_CHECKING:
    from .runtime import HostCopy

Scalar = int | float | bool
_PY_SCALARS = (int, float, bool)  # exact types (numpy scalars take the general path)
_rng = {"seed": 0, "counter": 0}


def manual_seed(seed: int) -> None:
    """Make rand/randn/randint reproducible: the same seed gives the same numbers in the same order."""
    _rng["seed"], _rng["counter"] = int(seed) & 0xFFFFFFFF, 0


def _take_counter(n: int) -> tuple[int, int]:
    seed, ctr = _rng["seed"], _rng["counter"]
    if ctr + n >= 2**32:  # a fresh stream once the 32-bit counter would wrap
        seed, ctr = (seed * 0x9E3779B1 + 1) & 0xFFFFFFFF, 0
        _rng["seed"] = seed
    _rng["counter"] = ctr + n
    return seed, ctr


def _shape_arg(shape: tuple) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    out = tuple(int(s) for s in shape)
    if any(s < 0 for s in out):
        raise ValueError(f"negative dimension in shape {out}")
    return out


def _axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < max(ndim, 1):
        raise IndexError(f"axis {axis} is out of range for a tensor of {ndim} dimensions")
    return axis % ndim if ndim else 0


def _reduce_axes(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """The axes a reduction runs over. A 0-d tensor takes axis 0 or -1 (or a tuple of them) as numpy's sum and
    PyTorch's reductions do: the scalar reduced over no axis."""
    if ndim == 0 and axis is not None:
        for a in ((axis,) if isinstance(axis, int) else axis):
            if a not in (0, -1):
                raise IndexError(f"axis {a} is out of range for a tensor of 0 dimensions")
        return ()
    return _axes(axis, ndim)


def _axes(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if type(axis) is int and -ndim <= axis < ndim:  # the common case, without the general checks
        return (axis % ndim,)
    axes = tuple([_axis(a, ndim) for a in ((axis,) if isinstance(axis, int) else axis)])
    if len(axes) > 1 and len(set(axes)) != len(axes):
        raise ValueError(f"repeated axis in {axis}")
    return axes


def broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    if all(s == shapes[0] for s in shapes):
        return tuple(shapes[0])
    nd = max(len(s) for s in shapes)
    out = [1] * nd
    for s in shapes:
        for i, d in enumerate(s, nd - len(s)):
            if d != 1 and d != out[i]:
                if out[i] != 1:
                    raise ValueError(f"shapes {' and '.join(str(tuple(s)) for s in shapes)} do not broadcast")
                out[i] = d
    return tuple(out)


def _infer_dtype(arr: np.ndarray, data: Any, int_bounds: tuple[int | None, int | None] | None) -> DType:
    """The dtype of data made into arr; int_bounds are its least and greatest where data holds Python ints."""
    if isinstance(data, np.ndarray | np.generic):
        return to_dtype(arr.dtype)
    if arr.dtype.kind == "b":
        return dtypes.bool
    if int_bounds is not None:
        lo, hi = int_bounds  # Python ints: int32, or int64 where a value needs it
        return dtypes.default_int if lo is None else promote(int_dtype(lo), int_dtype(hi))
    if arr.dtype.kind == "f" or arr.size == 0:
        return dtypes.default_float
    raise TypeError(f"cannot make a tensor from {type(data).__name__} of {arr.dtype}")


def _all_ints(arr: np.ndarray) -> bool:
    return all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in arr.flat)


def _int_bounds(arr: np.ndarray) -> tuple[int | None, int | None]:
    """The least and greatest of an array of integers (Python ints of any size in an object array)."""
    if not arr.size:
        return None, None
    return int(arr.min()), int(arr.max())


class Tensor(TensorMath, TensorIndexing):
    """A lazy GPU array. Build from a numpy array, a (nested) list or a scalar; see the module doc."""

    __slots__ = ("node", "__weakref__")
    __hash__ = object.__hash__  # == is elementwise

    def __init__(self, data: Any, dtype: DType | str | None = None, requires_grad: bool = False):
        if isinstance(data, Node):  # the hot path: every op's result
            self.node = data
        else:
            self._from_data(data, dtype)
        if requires_grad:
            self.requires_grad_()

    def _from_data(self, data: Any, dtype: DType | str | None) -> None:
        want = to_dtype(dtype) if dtype is not None else None
        if isinstance(data, Variable):
            self.node = g.var(data)
            if want is not None and want is not dtypes.int32:
                self.node = Tensor(self.node).cast(want).node
            return
        if isinstance(data, Tensor):
            self.node = data.node if want is None else data.cast(want).node
            return
        if isinstance(data, (bool, int, float, np.bool_, np.integer, np.floating)) and not isinstance(data, np.ndarray):
            d = want or result_type(data)
            _check(d)
            self.node = g.const(data, d, ())
            return
        arr = np.asarray(data)
        ints = not isinstance(data, np.ndarray | np.generic) and (
            arr.dtype.kind in "iu" or arr.dtype.kind == "O" and arr.size and _all_ints(arr))
        bounds = _int_bounds(arr) if ints and (want is None or want.is_int) else None  # one pass, read twice
        d = want or _infer_dtype(arr, data, bounds)
        if ints:
            if d.is_int:  # Python ints must be values of the dtype (numpy 2's OverflowError), never wrapped
                for v in bounds:
                    if v is not None:
                        check_fits(v, d)
            if arr.dtype.kind in "uO":  # uint64 or ints past it, each in range of d now
                arr = np.array(arr.tolist(), dtype=d.np)
        if arr.dtype.kind not in "biuf" and arr.dtype != dtypes.bfloat16.np:
            raise TypeError(f"cannot make a tensor of numpy dtype {arr.dtype}")
        ref = upload(arr.astype(d.np, copy=False), d)
        self.node = g.buffer(ref, ref.version, d, arr.shape)

    # ---- properties ---------------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.node.shape

    @property
    def dtype(self) -> DType:
        return self.node.dtype

    @property
    def ndim(self) -> int:
        return len(self.node.shape)

    def numel(self) -> int:
        return self.node.numel

    def size(self, dim: int | None = None) -> int | tuple[int, ...]:
        return self.shape if dim is None else self.shape[_axis(dim, self.ndim)]

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        state = "realized" if self.node.op is Op.BUFFER else "lazy"
        return f"<Tensor {list(self.shape)} {self.dtype.name} {state}>"

    # ---- realization --------------------------------------------------------------------------------------------
    def realize(self) -> Tensor:
        """Compute this tensor now (kernels are recorded and submitted; this does not wait)."""
        realize_all(self)
        return self

    def ends_kernel(self) -> bool:
        """Whether this tensor sits in a buffer of its own in any schedule (realized already, or a template's output:
        a custom node), so that realizing it now adds and changes no kernel of the graphs that read it."""
        return self.node.op is Op.BUFFER or self.node.op is Op.CUSTOM

    def numpy(self) -> np.ndarray:
        """The values as a new numpy array (bfloat16 comes back as ml_dtypes.bfloat16)."""
        self.realize()
        return download(self.node.arg[0], self.shape)

    def copy_to_host_async(self) -> HostCopy:
        """Start copying the values to the host without waiting: `.result()` on what this returns gives the numpy
        array, waiting only for the work recorded up to now, not for work submitted after this call. A loop can
        so submit its next step before reading this one's output. Empty and bfloat16 tensors included."""
        self.realize()
        return download_async(self.node.arg[0], self.shape)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def item(self) -> Scalar:
        if self.numel() != 1:
            raise ValueError(f"item() needs exactly one element, this tensor has {self.numel()}")
        return self.numpy().reshape(()).item()

    def tolist(self) -> Any:
        return self.numpy().tolist()

    def __bool__(self) -> bool:
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def contiguous(self) -> Tensor:
        """The same values in a buffer of their own when realized (a kernel boundary in the graph)."""
        return Tensor(g.contiguous(self.node))

    # ---- autograd (vkgraph/autograd.py) -------------------------------------------------------------------------
    def detach(self) -> Tensor:
        """The same values, cut from the graph: no gradient flows through the result."""
        return autograd.detach(self)

    @property
    def requires_grad(self) -> bool:
        return autograd.requires_grad(self)

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        autograd.set_requires_grad(self, flag)

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        """Make this tensor a leaf whose gradient `backward()` accumulates in `.grad` (it is realized now)."""
        autograd.set_requires_grad(self, requires_grad)
        return self

    @property
    def is_leaf(self) -> bool:
        return autograd.is_leaf(self)

    @property
    def grad(self) -> Tensor | None:
        return autograd.get_grad(self)

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        autograd.set_grad(self, value)

    def backward(self, gradient: Tensor | None = None) -> None:
        """Accumulate the gradient of this tensor into the .grad of each leaf its graph reaches."""
        autograd.backward(self, gradient)

    # ---- creation -----------------------------------------------------------------------------------------------
    @staticmethod
    def full(shape: Sequence[int] | int, value: Scalar, dtype: DType | str | None = None) -> Tensor:
        shape = _shape_arg((shape,) if isinstance(shape, int) else tuple(shape))
        d = to_dtype(dtype) if dtype is not None else result_type(value)
        _check(d)
        return Tensor(g.const(value, d, shape))

    @staticmethod
    def zeros(*shape: Any, dtype: DType | str = dtypes.float32) -> Tensor:
        return Tensor.full(_shape_arg(shape), 0, dtype)

    @staticmethod
    def ones(*shape: Any, dtype: DType | str = dtypes.float32) -> Tensor:
        return Tensor.full(_shape_arg(shape), 1, dtype)

    @staticmethod
    def empty(*shape: Any, dtype: DType | str = dtypes.float32) -> Tensor:
        """Uninitialized memory of the given shape (whatever the pool's buffer held)."""
        d, shape = to_dtype(dtype), _shape_arg(shape)
        _check(d)
        ref = allocate(d, math.prod(shape))
        return Tensor(g.buffer(ref, ref.version, d, shape))

    @staticmethod
    def arange(start: Scalar, stop: Scalar | None = None, step: Scalar = 1,
               dtype: DType | str | None = None) -> Tensor:
        if stop is None:
            start, stop = 0, start
        if step == 0:
            raise ValueError("arange: step must not be zero")
        ints = all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
                   for v in (start, stop, step))
        n = max(0, -((start - stop) // step) if ints else math.ceil((stop - start) / step))
        last = start + (n - 1) * step if n else start
        if dtype is not None:
            d = to_dtype(dtype)
        else:  # integers: int32, or int64 where the values need it
            d = promote(int_dtype(int(start)), int_dtype(int(last))) if ints else result_type(start, stop, step)
        if d.kind == "b":
            raise TypeError("arange of bool")
        if ints and d.is_int:
            check_fits(int(start), d)
            check_fits(int(last), d)
        if n == 1:
            return Tensor.full((1,), start, d)
        i = Tensor(g.iota(n))
        if d.is_float:
            return (i.cast(dtypes.float32) * float(step) + float(start)).cast(d)
        return (i.cast(d) * int(step) + int(start)) if (step, start) != (1, 0) else i.cast(d)

    @staticmethod
    def linspace(start: float, stop: float, steps: int, dtype: DType | str = dtypes.float32) -> Tensor:
        if steps < 0:
            raise ValueError("linspace: steps must be non-negative")
        if steps == 1:
            return Tensor.full((1,), start, dtype)
        delta = (stop - start) / max(steps - 1, 1)
        return (Tensor(g.iota(steps)).cast(dtypes.float32) * delta + start).cast(dtype)

    @staticmethod
    def eye(n: int, m: int | None = None, dtype: DType | str = dtypes.float32) -> Tensor:
        m = n if m is None else m
        rows = Tensor(g.iota(n)).reshape(n, 1).expand(n, m)
        cols = Tensor(g.iota(m)).reshape(1, m).expand(n, m)
        return (rows == cols).cast(dtype)

    @staticmethod
    def rand(*shape: Any, dtype: DType | str = dtypes.float32) -> Tensor:
        """Uniform in [0, 1), from a counter-based generator on the GPU (see manual_seed)."""
        shape = _shape_arg(shape)
        n = math.prod(shape)
        seed, ctr = _take_counter(n)
        return Tensor(g.rand(seed, ctr, (n,))).reshape(shape).cast(dtype)

    @staticmethod
    def randn(*shape: Any, dtype: DType | str = dtypes.float32) -> Tensor:
        """Standard normal (Box-Muller over two uniform streams)."""
        shape = _shape_arg(shape)
        u = Tensor.rand(2, *shape)
        r = ((1.0 - u[0]).log() * -2.0).sqrt()
        return (r * (u[1] * (2 * math.pi)).cos()).cast(dtype)

    @staticmethod
    def randint(low: int, high: int | None = None, shape: Sequence[int] = (), dtype: DType | str | None = None
                ) -> Tensor:
        """Integers uniform in [low, high): int32, or int64 where the bounds need it, unless dtype says."""
        if high is None:
            low, high = 0, low
        if high <= low:
            raise ValueError(f"randint: empty range [{low}, {high})")
        wide = promote(int_dtype(int(low)), int_dtype(int(high) - 1))
        d = to_dtype(dtype) if dtype is not None else wide
        check_fits(int(low), d)
        check_fits(int(high) - 1, d)
        u = Tensor.rand(*_shape_arg(tuple(shape)))
        return ((u * float(high - low)).floor().cast(wide) + int(low)).cast(d)

    def zeros_like(self, dtype: DType | str | None = None) -> Tensor:
        return Tensor.full(self.shape, 0, dtype or self.dtype)

    def ones_like(self, dtype: DType | str | None = None) -> Tensor:
        return Tensor.full(self.shape, 1, dtype or self.dtype)

    def full_like(self, value: Scalar, dtype: DType | str | None = None) -> Tensor:
        return Tensor.full(self.shape, value, dtype or self.dtype)

    def rand_like(self, dtype: DType | str | None = None) -> Tensor:
        return Tensor.rand(*self.shape, dtype=dtype or least_float(self.dtype))

    def randn_like(self, dtype: DType | str | None = None) -> Tensor:
        return Tensor.randn(*self.shape, dtype=dtype or least_float(self.dtype))

    # ---- casts --------------------------------------------------------------------------------------------------
    def cast(self, dtype: DType | str) -> Tensor:
        if dtype is self.node.dtype:  # the common case inside binary ops: no node, no check
            return self
        d = to_dtype(dtype)
        if d is self.dtype:
            return self
        _check(d)
        return Tensor(g.alu(Op.CAST, d, self.node))

    to = cast

    def float(self) -> Tensor:
        return self.cast(dtypes.float32)

    def half(self) -> Tensor:
        return self.cast(dtypes.float16)

    def int(self) -> Tensor:
        return self.cast(dtypes.int32)

    def bool(self) -> Tensor:
        return self.cast(dtypes.bool)

    def bitcast(self, dtype: DType | str) -> Tensor:
        """Reinterpret the bits as another dtype of the same size."""
        d = to_dtype(dtype)
        if d.itemsize != self.dtype.itemsize or dtypes.int64 in (d, self.dtype) and d is not self.dtype:
            raise TypeError(f"bitcast from {self.dtype} to {d}: item sizes differ or int64 is involved")
        _check(d)
        return Tensor(g.alu(Op.BITCAST, d, self.node))

    # ---- elementwise --------------------------------------------------------------------------------------------
    def _un(self, op: Op, float_only: bool = True) -> Tensor:
        x = self.cast(least_float(self.dtype)) if float_only else self
        return Tensor(g.alu(op, x.dtype, x.node))

    def exp(self) -> Tensor:
        return self._un(Op.EXP)

    def exp2(self) -> Tensor:
        return self._un(Op.EXP2)

    def log(self) -> Tensor:
        return self._un(Op.LOG)

    def log2(self) -> Tensor:
        return self._un(Op.LOG2)

    def sin(self) -> Tensor:
        return self._un(Op.SIN)

    def cos(self) -> Tensor:
        return self._un(Op.COS)

    def tanh(self) -> Tensor:
        return self._un(Op.TANH)

    def sqrt(self) -> Tensor:
        return self._un(Op.SQRT)

    def rsqrt(self) -> Tensor:
        return self._un(Op.RSQRT)

    def reciprocal(self) -> Tensor:
        return self._un(Op.RECIP)

    def erf(self) -> Tensor:
        return self._un(Op.ERF)

    def floor(self) -> Tensor:
        return self._un(Op.FLOOR, False)

    def ceil(self) -> Tensor:
        return self._un(Op.CEIL, False)

    def round(self) -> Tensor:
        """Round half to even, as numpy does."""
        return self._un(Op.ROUND, False)

    def trunc(self) -> Tensor:
        return self._un(Op.TRUNC, False)

    def abs(self) -> Tensor:
        return self._un(Op.ABS, False)

    def sign(self) -> Tensor:
        return self._un(Op.SIGN, False)

    def isnan(self) -> Tensor:
        return Tensor(g.alu(Op.ISNAN, dtypes.bool, self.node))

    def square(self) -> Tensor:
        return self * self

    def sigmoid(self) -> Tensor:
        x = self.cast(least_float(self.dtype))
        return 1.0 / (1.0 + (-x).exp())

    def relu(self) -> Tensor:
        return self.maximum(0)

    def silu(self) -> Tensor:
        return self * self.sigmoid()

    def gelu(self, approximate: str = "none") -> Tensor:
        """GELU: exact (erf) by default, or the tanh approximation with approximate='tanh'."""
        x = self.cast(least_float(self.dtype))
        if approximate == "tanh":
            return 0.5 * x * (1.0 + (math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)).tanh())
        if approximate != "none":
            raise ValueError(f"gelu: approximate must be 'none' or 'tanh', not {approximate!r}")
        return 0.5 * x * (1.0 + (x * (1 / math.sqrt(2))).erf())

    def clip(self, min_: Scalar | Tensor | None = None, max_: Scalar | Tensor | None = None) -> Tensor:
        if min_ is None and max_ is None:
            raise ValueError("clip needs a min or a max")
        out = self
        if min_ is not None:
            out = out.maximum(min_)
        if max_ is not None:
            out = out.minimum(max_)
        return out

    clamp = clip

    def where(self, x: Tensor | Scalar, y: Tensor | Scalar) -> Tensor:
        """self ? x : y, elementwise with broadcasting (self is the condition)."""
        return where(self, x, y)

    def _bin(self, other: Tensor | Scalar, op: Op, reverse: bool = False, out: DType | None = None,
             kinds: str = "biuf", compute: Callable[[DType], DType] | None = None) -> Tensor:
        d = self.node.dtype
        if isinstance(other, Tensor) and other.node.dtype is d and (compute is None or compute(d) is d):
            a, b = self, other  # two tensors of the operation's own dtype (the common case): no promotion
        else:
            if type(other) is int and out is dtypes.bool and d.is_int and not fits(other, d):
                return self._compare_out_of_range(other, op, reverse)
            if type(other) in _PY_SCALARS:
                d = promote_scalar(d, other)
                if compute is None or compute(d) is d:
                    return self._bin_scalar(other, d, op, reverse, out, kinds)
            a, b = _operands(self, other)
            weak = 0 if isinstance(other, Variable) else other  # a Variable promotes like a Python int
            d = result_type(a.dtype, b.dtype) if isinstance(other, Tensor) else result_type(self.dtype, weak)
            if compute is not None:
                d = compute(d)
        if d.kind not in kinds:
            raise TypeError(f"{op.name.lower()} is not defined for {d} operands")
        _check(d)
        a, b = a.cast(d), b.cast(d)  # no-ops in the common case
        if reverse:
            a, b = b, a
        an, bn = a.node, b.node
        if an.shape != bn.shape:
            shape = broadcast_shape(an.shape, bn.shape)
            an, bn = a._expand_to(shape).node, b._expand_to(shape).node
        return Tensor(g.alu(op, out or d, an, bn))

    def _compare_out_of_range(self, value: int, op: Op, reverse: bool) -> Tensor:
        """A comparison with a Python int no value of self's dtype equals: known without looking (numpy 2 answers
        these too, where arithmetic with such an int raises OverflowError)."""
        above = value > 0  # past the dtype's maximum (else below its minimum)
        known = {Op.CMPEQ: False, Op.CMPNE: True}.get(op, above != reverse)  # x < v, x <= v; v < x, v <= x
        return Tensor.full(self.shape, known, dtypes.bool)

    def _bin_scalar(self, value: Scalar, d: DType, op: Op, reverse: bool, out: DType | None, kinds: str) -> Tensor:
        """_bin with a Python scalar whose dtype d is the operation's: the constant is made at self's shape at once
        (the same node the general path reaches through a 0-d constant and its broadcast)."""
        _check(d)
        if d.kind not in kinds:
            raise TypeError(f"{op.name.lower()} is not defined for {d} operands")
        x = self.cast(d).node
        k = g.const(value, d, x.shape)
        return Tensor(g.alu(op, out or d, *((k, x) if reverse else (x, k))))

    def add(self, o: Tensor | Scalar) -> Tensor:
        return self._bin(o, Op.ADD)

    def sub(self, o: Tensor | Scalar) -> Tensor:
        return self._bin(o, Op.SUB, kinds="iuf")

    def mul(self, o: Tensor | Scalar) -> Tensor:
        return self._bin(o, Op.MUL)

    def div(self, o: Tensor | Scalar, rounding_mode: str | None = None) -> Tensor:
        """True division (integers divide as float32), or rounded: rounding_mode 'trunc' or 'floor'."""
        if rounding_mode is not None:
            return self._div_rounded(o, rounding_mode)
        return self._bin(o, Op.DIV, compute=least_float)

    def floordiv(self, o: Tensor | Scalar) -> Tensor:
        return self._bin(o, Op.IDIV, kinds="iuf")

    def mod(self, o: Tensor | Scalar) -> Tensor:
        """Remainder with the sign of the divisor (numpy's % and Python's)."""
        return self._bin(o, Op.MOD, kinds="iuf")

    def pow(self, o: Tensor | Scalar) -> Tensor:
        """self ** o with C's (numpy's) special values for floats. Integers to a negative power raise ValueError
        as in numpy where the exponent is known as the graph is built (a Python int or a constant); inside an
        integer tensor a negative exponent gives 1 / base^-o truncated (1 for 1, +-1 for -1, else 0)."""
        if isinstance(o, (int, float)) and not isinstance(o, bool) and o == 2:
            return self * self
        out = self._bin(o, Op.POW, kinds="iuf")
        _check_int_exponent(out, out.node.srcs[1] if out.node.op is Op.POW else None)
        return out

    def __rpow__(self, o: Scalar) -> Tensor:
        out = self._bin(o, Op.POW, True, kinds="iuf")
        _check_int_exponent(out, out.node.srcs[1] if out.node.op is Op.POW else None)
        return out

    def maximum(self, o: Tensor | Scalar) -> Tensor:
        return self._bin(o, Op.MAX)

    def minimum(self, o: Tensor | Scalar) -> Tensor:
        return self._bin(o, Op.MIN)

    def logical_and(self, o: Tensor | Scalar) -> Tensor:
        return self.bool()._bin(o if isinstance(o, Tensor) and o.dtype is dtypes.bool else _as_bool(o), Op.AND)

    def logical_or(self, o: Tensor | Scalar) -> Tensor:
        return self.bool()._bin(o if isinstance(o, Tensor) and o.dtype is dtypes.bool else _as_bool(o), Op.OR)

    def logical_xor(self, o: Tensor | Scalar) -> Tensor:
        return self.bool()._bin(o if isinstance(o, Tensor) and o.dtype is dtypes.bool else _as_bool(o), Op.XOR)

    def logical_not(self) -> Tensor:
        return Tensor(g.alu(Op.NOT, dtypes.bool, self.bool().node))

    def __add__(self, o): return self.add(o)  # noqa: E704
    def __radd__(self, o): return self._bin(o, Op.ADD, True)  # noqa: E704
    def __sub__(self, o): return self.sub(o)  # noqa: E704
    def __rsub__(self, o): return self._bin(o, Op.SUB, True, kinds="iuf")  # noqa: E704
    def __mul__(self, o): return self.mul(o)  # noqa: E704
    def __rmul__(self, o): return self._bin(o, Op.MUL, True)  # noqa: E704
    def __truediv__(self, o): return self.div(o)  # noqa: E704
    def __rtruediv__(self, o): return self._bin(o, Op.DIV, True, compute=least_float)  # noqa: E704
    def __floordiv__(self, o): return self.floordiv(o)  # noqa: E704
    def __rfloordiv__(self, o): return self._bin(o, Op.IDIV, True, kinds="iuf")  # noqa: E704
    def __mod__(self, o): return self.mod(o)  # noqa: E704
    def __rmod__(self, o): return self._bin(o, Op.MOD, True, kinds="iuf")  # noqa: E704
    def __pow__(self, o): return self.pow(o)  # noqa: E704
    def __matmul__(self, o): return self.matmul(o)  # noqa: E704
    def __rmatmul__(self, o): return _as_tensor(o, self).matmul(self)  # noqa: E704
    def __and__(self, o): return self._bin(o, Op.AND, kinds="biu")  # noqa: E704
    def __rand__(self, o): return self._bin(o, Op.AND, True, kinds="biu")  # noqa: E704
    def __or__(self, o): return self._bin(o, Op.OR, kinds="biu")  # noqa: E704
    def __ror__(self, o): return self._bin(o, Op.OR, True, kinds="biu")  # noqa: E704
    def __xor__(self, o): return self._bin(o, Op.XOR, kinds="biu")  # noqa: E704
    def __rxor__(self, o): return self._bin(o, Op.XOR, True, kinds="biu")  # noqa: E704
    def __lshift__(self, o): return self._bin(o, Op.SHL, kinds="iu")  # noqa: E704
    def __rshift__(self, o): return self._bin(o, Op.SHR, kinds="iu")  # noqa: E704
    def __lt__(self, o): return self._bin(o, Op.CMPLT, out=dtypes.bool)  # noqa: E704
    def __le__(self, o): return self._bin(o, Op.CMPLE, out=dtypes.bool)  # noqa: E704
    def __gt__(self, o): return self._bin(o, Op.CMPLT, True, out=dtypes.bool)  # noqa: E704
    def __ge__(self, o): return self._bin(o, Op.CMPLE, True, out=dtypes.bool)  # noqa: E704
    def __eq__(self, o): return self._bin(o, Op.CMPEQ, out=dtypes.bool)  # noqa: E704
    def __ne__(self, o): return self._bin(o, Op.CMPNE, out=dtypes.bool)  # noqa: E704

    def __neg__(self) -> Tensor:
        if self.dtype.kind == "b":
            raise TypeError("negation of a bool tensor; use logical_not() or ~")
        return Tensor(g.alu(Op.NEG, self.dtype, self.node))

    def __invert__(self) -> Tensor:
        if self.dtype.is_float:
            raise TypeError(f"~ is not defined for {self.dtype}")
        return Tensor(g.alu(Op.NOT, self.dtype, self.node))

    def __abs__(self) -> Tensor:
        return self.abs()

    lt, le, gt, ge, eq, ne = __lt__, __le__, __gt__, __ge__, __eq__, __ne__

    # ---- reductions ---------------------------------------------------------------------------------------------
    def _reduce(self, rop: ReduceOp, axis: Any, keepdim: bool, dtype: DType | None = None,
                empty: Scalar | None = None) -> Tensor:
        """One reduction node; `empty` fills the result where a reduced axis has no elements (None: raise, as
        numpy's max and min do)."""
        axes = _reduce_axes(axis, self.ndim)
        x = self if dtype is None else self.cast(dtype)
        if x.dtype in (dtypes.float16, dtypes.bfloat16):  # accumulate and combine in float32
            return x.float()._reduce(rop, axes, keepdim, empty=empty).cast(x.dtype)
        shape = x.node.shape
        kept = tuple([1 if i in axes else s for i, s in enumerate(shape)])
        out_shape = kept if keepdim else tuple([s for i, s in enumerate(shape) if i not in axes])
        sizes = [shape[a] for a in axes]
        if 0 in sizes:
            if empty is None:
                raise ValueError(f"zero-size array to reduction operation {rop.name.lower()} which has no identity")
            return Tensor.full(out_shape, empty, x.dtype)
        real = tuple([a for a, n in zip(axes, sizes, strict=True) if n != 1])
        if not real:
            return x.reshape(out_shape)
        node = g.reduce(x.node, rop, real)
        return Tensor(node).reshape(out_shape) if out_shape != kept else Tensor(node)

    def sum(self, axis: Any = None, keepdim: bool = False, dim: Any = None, dtype: DType | str | None = None
            ) -> Tensor:
        """Sum; bool and integers accumulate in int64 as numpy's do, where the device has int64 (see
        `_sum_dtype`)."""
        axis = dim if dim is not None else axis
        d = to_dtype(dtype) if dtype is not None else _sum_dtype(self.dtype)
        return self._reduce(ReduceOp.SUM, axis, keepdim, d, empty=0)

    def prod(self, axis: Any = None, keepdim: bool = False, dim: Any = None, dtype: DType | str | None = None
             ) -> Tensor:
        """Product; integers accumulate as in `sum`. A float product holding an infinity is the true product's:
        NaN where a NaN or a zero is present too, else an infinity with the sign of the count of negative factors.
        (A tree of partial products, as the device multiplies, would make NaN of an underflowed partial times an
        infinity, where numpy's sequential product and the true one are infinite.)"""
        axis = dim if dim is not None else axis
        d = to_dtype(dtype) if dtype is not None else _sum_dtype(self.dtype)
        x = self.cast(d)
        p = x._reduce(ReduceOp.PROD, axis, keepdim, empty=1)
        if not d.is_float:
            return p
        f = x.cast(dtypes.float32)
        any_inf = (f.abs() == float("inf")).any(axis, keepdim)
        zero_or_nan = ((f == 0.0) | f.isnan()).any(axis, keepdim)
        negative = f.bitcast(dtypes.int32) < 0  # the sign bit
        sign = negative.where(-1.0, 1.0)._reduce(ReduceOp.PROD, axis, keepdim, empty=1)  # exact: +-1 only
        infinite = zero_or_nan.where(float("nan"), (sign < 0).where(float("-inf"), float("inf")))
        return any_inf.where(infinite.cast(d), p)

    def max(self, axis: Any = None, keepdim: bool = False, dim: Any = None) -> Tensor:
        return self._reduce(ReduceOp.MAX, dim if dim is not None else axis, keepdim)

    def min(self, axis: Any = None, keepdim: bool = False, dim: Any = None) -> Tensor:
        return self._reduce(ReduceOp.MIN, dim if dim is not None else axis, keepdim)

    def any(self, axis: Any = None, keepdim: bool = False, dim: Any = None) -> Tensor:
        return self.bool()._reduce(ReduceOp.MAX, dim if dim is not None else axis, keepdim, empty=False)

    def all(self, axis: Any = None, keepdim: bool = False, dim: Any = None) -> Tensor:
        return self.bool()._reduce(ReduceOp.MIN, dim if dim is not None else axis, keepdim, empty=True)

    def mean(self, axis: Any = None, keepdim: bool = False, dim: Any = None) -> Tensor:
        """Mean (NaN over an empty axis, as numpy's)."""
        axis = dim if dim is not None else axis
        n = math.prod(self.shape[a] for a in _reduce_axes(axis, self.ndim))
        out_d = least_float(self.dtype)
        s = self.cast(dtypes.float32)._reduce(ReduceOp.SUM, axis, keepdim, empty=0)
        return (s * (1.0 / n if n else float("nan"))).cast(out_d)

    def var(self, axis: Any = None, keepdim: bool = False, correction: int = 1, dim: Any = None) -> Tensor:
        """Variance with Bessel's correction by default (as PyTorch; numpy's default is correction=0). Where
        n <= correction the sum of squares is divided by zero, as in numpy and PyTorch: inf, or NaN where the
        sum is 0 (one element, say) or NaN."""
        axis = dim if dim is not None else axis
        n = math.prod(self.shape[a] for a in _reduce_axes(axis, self.ndim))
        x = self.cast(dtypes.float32)
        dev = x - x.mean(axis, keepdim=True)
        s = (dev * dev)._reduce(ReduceOp.SUM, axis, keepdim, empty=0)
        if n - correction > 0:
            out = s * (1.0 / (n - correction))
        else:
            out = (s > 0.0).where(float("inf"), float("nan"))
        return out.cast(least_float(self.dtype))

    def std(self, axis: Any = None, keepdim: bool = False, correction: int = 1, dim: Any = None) -> Tensor:
        return self.var(axis, keepdim, correction, dim).sqrt()

    def _arg(self, rop: ReduceOp, axis: int | None, keepdim: bool) -> Tensor:
        if axis is None:
            out = self.reshape(-1)._arg(rop, 0, False)
            return out.reshape((1,) * self.ndim) if keepdim else out
        if self.ndim == 0:
            _reduce_axes(axis, 0)  # checks the axis
            return self.reshape(1)._arg(rop, 0, False).reshape(())
        a = _axis(axis, self.ndim)
        if self.shape[a] == 0:
            raise ValueError(f"attempt to get {rop.name.lower()} of an empty sequence")
        x = self.float() if self.dtype in (dtypes.float16, dtypes.bfloat16) else self
        node = g.reduce(x.node, rop, (a,), dtypes.int32)
        out = Tensor(node)
        return out if keepdim else out.squeeze(a)

    def argmax(self, axis: int | None = None, keepdim: bool = False, dim: int | None = None) -> Tensor:
        """Index (int32) of the first largest value; NaN counts as the largest, as in numpy."""
        return self._arg(ReduceOp.ARGMAX, dim if dim is not None else axis, keepdim)

    def argmin(self, axis: int | None = None, keepdim: bool = False, dim: int | None = None) -> Tensor:
        return self._arg(ReduceOp.ARGMIN, dim if dim is not None else axis, keepdim)

    def logsumexp(self, axis: Any = None, keepdim: bool = False, dim: Any = None) -> Tensor:
        """log(sum(exp(x))), -inf over an empty axis (as scipy's and PyTorch's)."""
        axis = dim if dim is not None else axis
        axes = _reduce_axes(axis, self.ndim)
        out_d = least_float(self.dtype)
        if any(self.shape[a] == 0 for a in axes):
            return self.cast(out_d)._reduce(ReduceOp.MAX, axes, keepdim, empty=float("-inf"))
        x = self.cast(dtypes.float32)
        m = x.max(axes, keepdim=True)
        m = (m.abs() == float("inf")).where(0.0, m)  # all -inf (or inf) rows: avoid inf - inf
        out = (x - m).exp().sum(axes, keepdim=True).log() + m
        if not keepdim:
            out = out.reshape(tuple(s for i, s in enumerate(self.shape) if i not in axes))
        return out.cast(out_d)

    def cumsum(self, axis: int = 0, dim: int | None = None, dtype: DType | str | None = None) -> Tensor:
        """Inclusive prefix sum along an axis: bool and integers accumulate as in `sum` (or in `dtype`), 16-bit
        floats in float32 (rounded once at the end). Work is linear in the axis's length (see `_scan`). A 0-d
        tensor gives one element of shape (1,), as numpy's does."""
        axis = dim if dim is not None else axis
        if self.ndim == 0:
            _reduce_axes(axis, 0)  # checks the axis
            return self.reshape(1).cumsum(0, dtype=dtype)
        a = _axis(axis, self.ndim)
        acc = to_dtype(dtype) if dtype is not None else _sum_dtype(self.dtype)
        x = self.cast(dtypes.float32 if acc in (dtypes.float16, dtypes.bfloat16) else acc)
        if self.shape[a] == 0:
            return self.cast(acc)
        return _scan(x, a).cast(acc)

    # ---- movement -----------------------------------------------------------------------------------------------
    def _move(self, fn: Callable[[ShapeTracker], ShapeTracker]) -> Tensor:
        return Tensor(g.movement(self.node, fn))

    def reshape(self, *shape: Any) -> Tensor:
        """The same elements in a new shape, given as sizes or one tuple/list of them (PyTorch's forms); one size
        may be -1, inferred from the others."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        shape = _sizes(shape, "reshape")
        if any(s < -1 for s in shape):
            raise ValueError(f"reshape {shape}: invalid size {min(shape)} (sizes are >= 0, or -1 for one inferred)")
        if shape.count(-1) > 1:
            raise ValueError(f"reshape {shape}: only one size can be inferred (-1)")
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            if known == 0:
                raise ValueError(f"cannot reshape {self.shape} ({self.numel()} elements) to {shape}: the -1 could "
                                 "be any size")
            if self.numel() % known:
                raise ValueError(f"cannot reshape {self.shape} ({self.numel()} elements) to {shape}")
            shape = tuple(self.numel() // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.numel():
            raise ValueError(f"cannot reshape {self.shape} ({self.numel()} elements) to {shape}")
        if shape == self.shape:
            return self
        return self._move(lambda st: st.reshape(shape))

    view = reshape

    def permute(self, *order: Any) -> Tensor:
        order = tuple(order[0]) if len(order) == 1 and isinstance(order[0], (tuple, list)) else order
        order = tuple(_axis(int(o), self.ndim) for o in order)
        if sorted(order) != list(range(self.ndim)):
            raise ValueError(f"permute {order} is not a permutation of {self.ndim} axes")
        if order == tuple(range(self.ndim)):
            return self
        return self._move(lambda st: st.permute(order))

    def transpose(self, dim0: int = -2, dim1: int = -1) -> Tensor:
        order = list(range(self.ndim))
        a, b = _axis(dim0, self.ndim), _axis(dim1, self.ndim)
        order[a], order[b] = order[b], order[a]
        return self.permute(order)

    @property
    def T(self) -> Tensor:
        return self.permute(tuple(reversed(range(self.ndim))))

    def expand(self, *shape: Any) -> Tensor:
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        if len(shape) < self.ndim:
            raise ValueError(f"cannot expand {self.shape} to fewer dimensions {shape}")
        old = (1,) * (len(shape) - self.ndim) + self.shape
        new = tuple(o if s == -1 else int(s) for s, o in zip(shape, old, strict=True))
        for o, n in zip(old, new, strict=True):
            if o != n and o != 1:
                raise ValueError(f"cannot expand {self.shape} to {tuple(shape)}")
        return self._expand_to(new)

    def broadcast_to(self, shape: Sequence[int]) -> Tensor:
        return self.expand(tuple(shape))

    def _expand_to(self, shape: tuple[int, ...]) -> Tensor:
        if self.shape == shape:
            return self
        if self.node.op is Op.CONST:  # a constant of any shape is the same value everywhere
            return Tensor(g.const(self.node.arg, self.dtype, shape))
        x = self.reshape((1,) * (len(shape) - self.ndim) + self.shape) if self.ndim < len(shape) else self
        if x.shape == shape:
            return x
        return x._move(lambda st: st.expand(shape))

    def squeeze(self, dim: int | Sequence[int] | None = None) -> Tensor:
        if dim is None:
            return self.reshape(tuple(s for s in self.shape if s != 1))
        dims = _axes(dim, self.ndim)
        return self.reshape(tuple(s for i, s in enumerate(self.shape) if i not in dims or s != 1))

    def unsqueeze(self, dim: int) -> Tensor:
        d = _axis(dim, self.ndim + 1)
        return self.reshape(self.shape[:d] + (1,) + self.shape[d:])

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor:
        if self.ndim == 0:
            return self.reshape(1)
        s, e = _axis(start_dim, self.ndim), _axis(end_dim, self.ndim)
        return self.reshape(self.shape[:s] + (math.prod(self.shape[s:e + 1]),) + self.shape[e + 1:])

    def shrink(self, bounds: Sequence[tuple[int, int] | None]) -> Tensor:
        b = tuple((0, s) if x is None else (int(x[0]), int(x[1])) for x, s in zip(bounds, self.shape, strict=True))
        for (lo, hi), s in zip(b, self.shape, strict=True):
            if not 0 <= lo <= hi <= s:
                raise IndexError(f"shrink {b} out of range for shape {self.shape}")
        if all(lo == 0 and hi == s for (lo, hi), s in zip(b, self.shape, strict=True)):
            return self
        return self._move(lambda st: st.shrink(b))

    def pad(self, padding: Sequence[Any], value: Scalar = 0) -> Tensor:
        """Pad with `value`: either one (before, after) pair per axis from the first, or PyTorch's flat
        (last_before, last_after, prev_before, ...) form."""
        if padding and all(isinstance(p, int) for p in padding):
            if len(padding) % 2 or len(padding) // 2 > self.ndim:
                raise ValueError(f"pad {padding}: need an even count, at most two per axis")
            pairs = [(0, 0)] * self.ndim
            for i in range(len(padding) // 2):
                pairs[self.ndim - 1 - i] = (padding[2 * i], padding[2 * i + 1])
        else:
            pairs = [(0, 0) if p is None else tuple(p) for p in padding]
            if len(pairs) != self.ndim:
                raise ValueError(f"pad needs {self.ndim} (before, after) pairs, got {len(pairs)}")
        if any(a < 0 or b < 0 for a, b in pairs):
            neg = [(-min(a, 0), s - (-min(b, 0))) for (a, b), s in zip(pairs, self.shape, strict=True)]
            return self.shrink(neg).pad([(max(a, 0), max(b, 0)) for a, b in pairs], value)
        pairs = tuple((int(a), int(b)) for a, b in pairs)
        if all(p == (0, 0) for p in pairs):
            return self
        out = self._move(lambda st: st.pad(pairs))
        if value != 0:
            inside = Tensor.full(self.shape, True, dtypes.bool)._move(lambda st: st.pad(pairs))
            out = inside.where(out, Tensor.full(out.shape, value, self.dtype))
        return out

    def flip(self, dims: int | Sequence[int]) -> Tensor:
        axes = _axes(dims, self.ndim)
        return self._move(lambda st: st.flip(axes)) if axes else self

    def repeat(self, *repeats: Any) -> Tensor:
        """Tile the tensor repeats[i] times along axis i (PyTorch's repeat)."""
        reps = tuple(repeats[0]) if len(repeats) == 1 and isinstance(repeats[0], (tuple, list)) else repeats
        if len(reps) < self.ndim:
            raise ValueError(f"repeat needs at least {self.ndim} counts")
        x = self.reshape((1,) * (len(reps) - self.ndim) + self.shape)
        inter = sum(((1, s) for s in x.shape), ())
        big = sum(((r, s) for r, s in zip(reps, x.shape, strict=True)), ())
        return x.reshape(inter).expand(big).reshape(tuple(r * s for r, s in zip(reps, x.shape, strict=True)))

    def split(self, sizes: int | Sequence[int], dim: int = 0) -> list[Tensor]:
        d = _axis(dim, self.ndim)
        n = self.shape[d]
        if isinstance(sizes, int):
            if sizes <= 0:
                raise ValueError("split size must be positive")
            sizes = [min(sizes, n - i) for i in range(0, n, sizes)] or [0]
        if sum(sizes) != n:
            raise ValueError(f"split sizes {list(sizes)} do not add up to {n}")
        out, start = [], 0
        for s in sizes:
            out.append(self.shrink([(start, start + s) if i == d else None for i in range(self.ndim)]))
            start += s
        return out

    def chunk(self, chunks: int, dim: int = 0) -> list[Tensor]:
        n = self.shape[_axis(dim, self.ndim)]
        return self.split(max(1, math.ceil(n / chunks)), dim)

    def cat(self, *others: Any, dim: int = 0) -> Tensor:
        """x.cat(y, z, dim=d), or Tensor.cat((x, y, z), d) as PyTorch's torch.cat."""
        return cat(*_seq_and_dim(self, others, dim, "cat"))

    def stack(self, *others: Any, dim: int = 0) -> Tensor:
        """x.stack(y, z, dim=d), or Tensor.stack((x, y, z), d) as PyTorch's torch.stack."""
        return stack(*_seq_and_dim(self, others, dim, "stack"))

    # ---- indexing -----------------------------------------------------------------------------------------------
    def __getitem__(self, idx: Any) -> Tensor:
        if needs_advanced(idx):  # boolean masks, several integer arrays: vkgraph/tensor_index.py
            return self._advanced_read(idx)
        x, tensor_dims = _basic_index(self, idx)
        if not tensor_dims:
            return x
        axis, index = tensor_dims[0]
        return x.take(index, axis)

    def take(self, index: Tensor | Sequence[int] | np.ndarray, axis: int = 0) -> Tensor:
        """Elements at integer positions along axis (numpy's take; negative positions count from the end)."""
        a = _axis(axis, self.ndim)
        if not isinstance(index, Tensor):
            arr = np.asarray(index)
            if arr.dtype.kind not in "iu":
                raise IndexError(f"index arrays must be integers, not {arr.dtype}")
            if arr.size and (arr.max() >= self.shape[a] or arr.min() < -self.shape[a]):
                raise IndexError(f"index out of range for axis {a} of size {self.shape[a]}")
            index = Tensor(arr.astype(np.int32))
        if not index.dtype.is_int:
            raise IndexError(f"index tensors must be integers, not {index.dtype}")
        return Tensor(g.gather(self.node, index.node, a))

    def __setitem__(self, idx: Any, value: Tensor | Scalar | np.ndarray) -> None:
        """Write in place into what ints, slices (positive steps), Ellipsis, integer arrays and boolean masks select
        (through arrays and masks the whole tensor is rewritten: vkgraph/tensor_index.py)."""
        if not isinstance(value, Tensor):
            value = Tensor(value, self.dtype) if not isinstance(value, (int, float, bool)) else \
                Tensor.full((), value, self.dtype)
        self.realize()
        advanced = needs_advanced(idx)
        region, tensor_dims = (None, None) if advanced else _basic_index(Tensor(self.node), idx, for_store=True)
        if advanced or tensor_dims:  # through integer arrays or masks: the whole tensor, rewritten
            value, region = self._write_indexed(idx, value), Tensor(self.node)
        ref = self.node.arg[0]
        st = region.node.arg if region.node.op is Op.VIEW else ShapeTracker.contiguous(region.shape)
        value = value.cast(self.dtype)
        try:
            fits = broadcast_shape(value.shape, region.shape) == region.shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"cannot assign a value of shape {value.shape} to a region of shape {region.shape}")
        assign(ref, st, value._expand_to(region.shape).node)
        self.node = g.buffer(ref, ref.version, self.dtype, self.shape)

    def assign(self, value: Tensor | Scalar | np.ndarray) -> Tensor:
        """Overwrite every element in place."""
        self[...] = value
        return self

    # ---- linear algebra and nn ----------------------------------------------------------------------------------
    def matmul(self, other: Tensor, dtype: DType | str | None = None) -> Tensor:
        """Matrix product with numpy's rules for 1-D operands and broadcasting of batch dimensions. dtype, as
        numpy's: both operands are cast to it and the product is computed in it (int8 @ int8 wraps in int8 as
        numpy's does; `a.matmul(b, dtype=dtypes.int32)` sums int8 products in int32, which the int8 cooperative
        matrices run where the device has them)."""
        other = _as_tensor(other, self)
        if self.ndim == 0 or other.ndim == 0:
            raise ValueError("matmul of a 0-d tensor; use *")
        a = self.unsqueeze(0) if self.ndim == 1 else self
        b = other.unsqueeze(-1) if other.ndim == 1 else other
        if a.shape[-1] != b.shape[-2]:
            raise ValueError(f"matmul: {self.shape} @ {other.shape}: inner dimensions "
                             f"{a.shape[-1]} and {b.shape[-2]} differ")
        d = result_type(a.dtype, b.dtype) if dtype is None else to_dtype(dtype)
        if d.kind == "b":
            raise TypeError("matmul of bool tensors")
        batch = broadcast_shape(a.shape[:-2], b.shape[:-2])
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        # broadcast, then cast: an operand's cast over its own buffer's view lets the product read the view directly
        a = a._expand_to(batch + (m, k)).cast(d)
        b = b._expand_to(batch + (k, n)).cast(d)
        if k == 0:
            out = Tensor.full(batch + (m, n), 0, d)
        elif m * n < 4096 or m < 16 or n < 16:  # thin products: a row reduction beats 64x64 tiles
            acc = dtypes.float32 if d.is_float else d
            prod = a.cast(acc).unsqueeze(-2) * b.cast(acc).transpose(-1, -2).unsqueeze(-3)
            out = prod.sum(-1, dtype=acc).cast(d)
        else:
            out = Tensor(g.matmul(a.node, b.node, d))
        if self.ndim == 1:
            out = out.squeeze(-2)
        if other.ndim == 1:
            out = out.squeeze(-1)
        return out

    dot = matmul

    def linear(self, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """self @ weight.T + bias, with weight of shape (out_features, in_features) as in PyTorch."""
        out = self.matmul(weight.T)
        return out + bias if bias is not None else out

    def softmax(self, axis: int = -1, dim: int | None = None) -> Tensor:
        axis = dim if dim is not None else axis
        _reduce_axes(axis, self.ndim)  # checks the axis
        if self.numel() == 0:
            return self.cast(least_float(self.dtype))
        x = self.cast(dtypes.float32)
        e = (x - x.max(axis, keepdim=True)).exp()
        return (e / e.sum(axis, keepdim=True)).cast(least_float(self.dtype))

    def log_softmax(self, axis: int = -1, dim: int | None = None) -> Tensor:
        axis = dim if dim is not None else axis
        _reduce_axes(axis, self.ndim)  # checks the axis
        if self.numel() == 0:
            return self.cast(least_float(self.dtype))
        x = self.cast(dtypes.float32)
        m = x - x.max(axis, keepdim=True)
        return (m - m.exp().sum(axis, keepdim=True).log()).cast(least_float(self.dtype))

    def layer_norm(self, normalized_shape: int | Sequence[int] | None = None, weight: Tensor | None = None,
                   bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
        """Normalize over the trailing axes of normalized_shape (the last axis by default)."""
        ns = (self.shape[-1],) if normalized_shape is None else (
            (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape))
        if tuple(self.shape[self.ndim - len(ns):]) != ns:
            raise ValueError(f"layer_norm: normalized_shape {ns} does not match the end of {self.shape}")
        axes = tuple(range(self.ndim - len(ns), self.ndim))
        x = self.cast(dtypes.float32)
        c = x - x.mean(axes, keepdim=True)
        out = c * ((c * c).mean(axes, keepdim=True) + eps).rsqrt()
        if weight is not None:
            out = out * weight.float()
        if bias is not None:
            out = out + bias.float()
        return out.cast(least_float(self.dtype))

    def rms_norm(self, weight: Tensor | None = None, eps: float = 1e-6, axis: int = -1) -> Tensor:
        x = self.cast(dtypes.float32)
        out = x * ((x * x).mean(axis, keepdim=True) + eps).rsqrt()
        if weight is not None:
            out = out * weight.float()
        return out.cast(least_float(self.dtype))

    def scaled_dot_product_attention(self, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                     is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False
                                     ) -> Tensor:
        """softmax(q @ k^T * scale + mask) @ v for q = self of shape (..., L, D); a bool mask keeps True. With
        enable_gqa, key and value heads (axis -3) are shared by groups of query heads."""
        q = self
        if enable_gqa and q.ndim >= 3 and key.ndim >= 3 and key.shape[-3] != q.shape[-3]:
            hq, hk = q.shape[-3], key.shape[-3]
            if hk == 0 or hq % hk or value.shape[-3] != hk:
                raise ValueError(f"attention: {hq} query heads cannot share {hk} key/value heads")
            key, value = (t.unsqueeze(-3).expand(*t.shape[:-2], hq // hk, *t.shape[-2:]).reshape(
                *t.shape[:-3], hq, *t.shape[-2:]) for t in (key, value))
        if q.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
            raise ValueError(f"attention: q {q.shape}, k {key.shape}, v {value.shape} do not fit")
        scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        s = (q @ key.transpose(-1, -2)).float() * scale
        lq, lk = q.shape[-2], key.shape[-2]
        if is_causal:
            i = Tensor(g.iota(lq)).reshape(lq, 1).expand(lq, lk)
            j = Tensor(g.iota(lk)).reshape(1, lk).expand(lq, lk)
            s = (j <= i).where(s, float("-inf"))
        if attn_mask is not None:
            s = attn_mask.where(s, float("-inf")) if attn_mask.dtype is dtypes.bool else s + attn_mask.float()
        return s.softmax(-1).cast(value.dtype) @ value


# ---- functions over several tensors -------------------------------------------------------------------------------


def realize_all(*tensors: Tensor) -> None:
    """Realize several tensors in one schedule (shared subgraphs are computed once)."""
    todo = [t for t in tensors if t.node.op is not Op.BUFFER]
    if not todo:
        return
    refs = realize([t.node for t in todo])
    pairs = [(t.node, g.buffer(ref, ref.version, t.dtype, t.shape)) for t, ref in zip(todo, refs, strict=True)]
    for t, (_, node) in zip(todo, pairs, strict=True):
        t.node = node
    autograd.on_realize(pairs)


def where(cond: Tensor, x: Tensor | Scalar, y: Tensor | Scalar) -> Tensor:
    """x where cond is true, else y; x and y promote like a binary op."""
    if not isinstance(cond, Tensor):
        raise TypeError("where: the condition must be a Tensor")
    like = x if isinstance(x, Tensor) else (y if isinstance(y, Tensor) else None)
    if like is None:
        d = result_type(x, y)
    elif isinstance(x, Tensor) and isinstance(y, Tensor):
        d = result_type(x.dtype, y.dtype)
    else:
        d = result_type(like.dtype, y if like is x else x)
    xt, yt = _as_tensor(x, cond, d), _as_tensor(y, cond, d)
    shape = broadcast_shape(cond.shape, xt.shape, yt.shape)
    c = cond.bool()._expand_to(shape)
    return Tensor(g.alu(Op.WHERE, d, c.node, xt.cast(d)._expand_to(shape).node, yt.cast(d)._expand_to(shape).node))


def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Concatenate along dim: each input padded into place, joined in one fused kernel (integers summed; floats
    selected by where each input lies, since -0.0 plus the padding's 0.0 would be +0.0)."""
    tensors = _tensor_list(tensors, "cat")
    ref = tensors[0]
    d = _axis(dim, ref.ndim)
    for t in tensors:
        if t.ndim != ref.ndim or any(a != b for i, (a, b) in enumerate(zip(t.shape, ref.shape, strict=True))
                                     if i != d):
            raise ValueError(f"cat: shapes {[t.shape for t in tensors]} differ outside axis {d}")
    dt = result_type(*[t.dtype for t in tensors])
    total = sum(t.shape[d] for t in tensors)
    out, start = None, 0
    for t in tensors:
        pads = [(0, 0)] * ref.ndim
        pads[d] = (start, total - start - t.shape[d])
        start += t.shape[d]
        p = t.cast(dt).pad(pads)
        if out is None:
            out = p
        elif dt.is_float:
            inside = Tensor.full(t.shape, True, dtypes.bool).pad(pads)
            out = Tensor(g.alu(Op.WHERE, dt, inside.node, p.node, out.node))
        else:
            out = Tensor(g.alu(Op.ADD, dt, out.node, p.node))
    return out


def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Join tensors of one shape along a new axis dim."""
    tensors = _tensor_list(tensors, "stack")
    d = _axis(dim, tensors[0].ndim + 1)
    if any(t.shape != tensors[0].shape for t in tensors):
        raise ValueError(f"stack: shapes {[t.shape for t in tensors]} differ")
    return cat([t.unsqueeze(d) for t in tensors], d)


def embedding(indices: Tensor, weight: Tensor) -> Tensor:
    """Rows of weight (num_embeddings, dim) at indices: shape indices.shape + (dim,)."""
    return weight.take(indices, 0)


def custom(fn: Callable[[Any, Any, list[Any]], None], inputs: Sequence[Tensor], shape: Sequence[int],
           dtype: DType | str, key: tuple = (), name: str = "custom") -> Tensor:
    """A tensor computed by a hand-written kernel: see graph.CustomOp and docs/tensor.md."""
    d = to_dtype(dtype)
    return Tensor(g.custom(g.CustomOp(fn, tuple(key), name), tuple(t.node for t in inputs), d, tuple(shape)))


# ---- helpers ------------------------------------------------------------------------------------------------------


def _check(d: DType) -> None:
    if d.itemsize != 4:
        require_dtype(d)


def _sum_dtype(d: DType) -> DType:
    """The accumulator of sum, prod and cumsum: numpy's int64 for bool and every integer (unsigned ones too,
    where numpy has uint64 and vkgraph has not: equal values below 2^63) where the device has int64; else
    int32 (uint32 for unsigned), which wraps past 2^31 (2^32)."""
    if d.kind == "b" or d.is_int:
        if has_dtype(dtypes.int64):
            return dtypes.int64
        return dtypes.int32 if d.kind != "u" else dtypes.uint32
    return d


SCAN_CHUNK = 16  # elements each output sums directly in `_scan`; also the fan-in of each level


def _scan(x: Tensor, a: int) -> Tensor:
    """Inclusive prefix sum along axis a, as graph ops the scheduler fuses: a multi-level scan.

    The axis is cut into chunks of SCAN_CHUNK; each output sums its own chunk up to itself (a masked row sum of
    SCAN_CHUNK elements), and adds the sum of all earlier chunks: the exclusive scan of the chunk totals, which
    is the same problem SCAN_CHUNK times shorter. So the work is about n * SCAN_CHUNK, not n * n, in about two
    kernels per level (the chunk totals, then the chunk scans with their fix-up add), log_SCAN_CHUNK(n) levels.
    Integer sums are exact (addition wraps, so its order does not matter); float sums round like a blocked sum,
    which errs less than numpy's sequential one."""
    n = x.shape[a]
    c = min(SCAN_CHUNK, n)
    pre, post = x.shape[:a], x.shape[a + 1:]
    m = -(-n // c)
    chunks = x.pad([(0, 0)] * len(pre) + [(0, m * c - n)] + [(0, 0)] * len(post)).reshape(pre + (m, c) + post)
    # element (i, j) of (n, c): the j-th element of i's chunk, counted when it is not past i
    own = chunks.unsqueeze(a + 1).expand(pre + (m, c, c) + post).reshape(pre + (m * c, c) + post)
    own = own.shrink([None] * len(pre) + [(0, n), None] + [None] * len(post))
    i, j = Tensor(g.iota(c)).reshape(c, 1), Tensor(g.iota(c)).reshape(1, c)
    tri = (j <= i).reshape(1, c, c).expand(m, c, c).reshape(m * c, c).shrink([(0, n), None])
    tri = tri.reshape((1,) * len(pre) + (n, c) + (1,) * len(post))
    local = tri.where(own, 0).sum(a + 1, dtype=x.dtype)
    if m == 1:
        return local
    # the inclusive scan of the chunk totals, (pre, m, post), in a buffer of its own: the scheduler then fuses
    # this level's chunk scans with the add below instead of storing them apart
    before = _scan(chunks.sum(a + 1, dtype=x.dtype), a).contiguous()
    before = before.pad([(0, 0)] * len(pre) + [(1, -1)] + [(0, 0)] * len(post))  # shifted: exclusive
    spread = before.unsqueeze(a + 1).expand(pre + (m, c) + post).reshape(pre + (m * c,) + post)
    return local + spread.shrink([None] * len(pre) + [(0, n)] + [None] * len(post))


def _sizes(shape: tuple, what: str) -> tuple[int, ...]:
    """Sizes as ints: Python and numpy integers only (a float, a bool or None is a TypeError, as in PyTorch)."""
    out = []
    for s in shape:
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"{what}: sizes must be integers, got {s!r} in {shape}")
        out.append(int(s))
    return tuple(out)


def _tensor_list(tensors: Any, what: str) -> list[Tensor]:
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{what} takes a sequence (list or tuple) of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{what} of no tensors")
    bad = [type(t).__name__ for t in tensors if not isinstance(t, Tensor)]
    if bad:
        raise TypeError(f"{what} takes tensors, got {', '.join(bad)}")
    return tensors


def _seq_and_dim(first: Any, others: tuple, dim: int, what: str) -> tuple[list[Tensor], int]:
    """The tensors and axis of Tensor.cat/stack called on a tensor (x.stack(y, z)) or on a sequence, as
    PyTorch's functions are (Tensor.stack((x, y), 1))."""
    if isinstance(first, Tensor):
        return [first, *others], dim
    if len(others) > 1 or (others and not isinstance(others[0], (int, np.integer))):
        raise TypeError(f"Tensor.{what}(tensors, dim): takes one sequence of tensors and an axis")
    return first, int(others[0]) if others else dim


def _check_int_exponent(out: Tensor, exponent: Node | None) -> None:
    if out.dtype.is_int and exponent is not None and exponent.op is Op.CONST and exponent.arg < 0:
        raise ValueError("Integers to negative integer powers are not allowed.")


def _as_bool(x: Any) -> Any:
    return bool(x) if not isinstance(x, Tensor) else x.bool()


def _as_tensor(x: Any, like: Tensor, dtype: DType | None = None) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, Variable):  # weak, like a Python int
        return Tensor(x).cast(dtype or result_type(like.dtype, 0))
    if isinstance(x, (bool, int, float, np.bool_, np.integer, np.floating)):
        return Tensor.full((), x, dtype or result_type(like.dtype, x))
    return Tensor(x)


def _operands(a: Tensor, b: Any) -> tuple[Tensor, Tensor]:
    if isinstance(b, Tensor):
        return a, b
    if isinstance(b, Variable):  # weak, like a Python int
        return a, Tensor(b).cast(result_type(a.dtype, 0))
    if isinstance(b, (bool, int, float, np.bool_, np.integer, np.floating)):
        d = result_type(a.dtype, b)
        return a, Tensor.full((), b, d)
    return a, Tensor(b)


def _basic_index(x: Tensor, idx: Any, for_store: bool = False) -> tuple[Tensor, list[tuple[int, Tensor]]]:
    """Apply ints, slices, None and Ellipsis; return the view and (output axis, index tensor) pairs."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if sum(1 for i in idx if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis")
    consumed = sum(1 for i in idx if i is not None and i is not Ellipsis)
    if consumed > x.ndim:
        raise IndexError(f"too many indices ({consumed}) for a tensor of {x.ndim} dimensions")
    if Ellipsis in [i if i is Ellipsis else None for i in idx]:
        e = next(k for k, i in enumerate(idx) if i is Ellipsis)
        idx = idx[:e] + (slice(None),) * (x.ndim - consumed) + idx[e + 1:]
    else:
        idx = idx + (slice(None),) * (x.ndim - consumed)
    bounds, flips, steps, final, tensors = [], [], [], [], []
    dim = 0
    for i in idx:
        if i is None:
            final.append(1)
            continue
        size = x.shape[dim]
        if isinstance(i, (bool, np.bool_)):
            raise IndexError("boolean indices are not supported")
        if isinstance(i, (int, np.integer)):
            if not -size <= i < size:
                raise IndexError(f"index {i} is out of range for axis {dim} of size {size}")
            i = int(i) % size
            bounds.append((i, i + 1))
            flips.append(False)
            steps.append(1)
        elif isinstance(i, slice):
            start, stop, step = i.indices(size)
            n = len(range(start, stop, step))
            if step < 0 and for_store:
                raise IndexError("assignment through a negative step")
            if step > 0:
                bounds.append((start, start + (n - 1) * step + 1) if n else (0, 0))
            else:
                first = size - 1 - start
                bounds.append((first, first + (n - 1) * -step + 1) if n else (0, 0))
            flips.append(step < 0)
            steps.append(abs(step))
            final.append(n)
        elif isinstance(i, (Tensor, list, np.ndarray)):
            bounds.append((0, size))
            flips.append(False)
            steps.append(1)
            tensors.append((len(final), i))
            final.append(size)
        else:
            raise IndexError(f"unsupported index {i!r}")
        dim += 1
    out = x
    if any(flips):
        out = out.flip(tuple(k for k, f in enumerate(flips) if f))
    out = out.shrink(bounds)
    if any(s != 1 for s in steps):
        out = out._move(lambda st: st.step(tuple(steps)))
    out = out.reshape(tuple(final))
    return out, tensors

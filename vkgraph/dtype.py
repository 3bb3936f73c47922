"""Data types: names, sizes, numpy and GLSL types, and the promotion rules.

Values are stored in buffers with their own width (``float16_t``, ``int8_t``, bfloat16 as ``uint16_t`` bits)
and computed in 32-bit GLSL types (``float``, ``int``, ``uint``), or ``int64_t`` for int64. Narrow integer
results are wrapped back to their width after each operation, so overflow matches numpy.

Promotion (``result_type``) follows numpy where numpy has a type for the answer:

- bool < integers < floats; within a kind the wider type wins.
- signed with unsigned: the smallest signed type that holds both (uint8+int8 -> int16, uint32+int32 -> int64).
- an integer with a float gives the float if it holds the integer exactly (int8 + float16 is float16),
  else float32 (int16 + float16 is float32 as in numpy; int32 + float32 is float32 where numpy, having
  float64, would widen).
- float16 with bfloat16 gives float32.
- Python scalars are weak: ``t + 1`` keeps t's dtype, ``int_tensor * 0.5`` gives float32, ``bool_tensor + 1``
  gives int32. Python floats default to float32, ints to int32, or int64 where the value needs it. As in
  numpy 2, a Python int that does not fit an integer tensor's dtype raises OverflowError (``int32_t + 2**31``),
  except in comparisons, whose answer is then known (``int32_t < 2**40`` is all True).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True, eq=False)
class DType:
    name: str
    itemsize: int
    kind: str  # "b" bool, "i" signed integer, "u" unsigned integer, "f" float
    np_name: str  # the numpy dtype's name (`np` resolves it on first use)
    store: str  # GLSL type of a buffer element
    glsl: str  # GLSL type values are computed in

    def __repr__(self) -> str:
        return f"dtypes.{self.name}"

    def __reduce__(self):  # pickles by name so identity survives
        return (_by_name, (self.name,))

    @cached_property
    def np(self) -> np.dtype:
        """The numpy dtype; bfloat16's comes from ml_dtypes, imported here on first use rather than with vkgraph
        (it takes most of a second)."""
        if self.np_name == "bfloat16":
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(self.np_name)

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def is_int(self) -> bool:
        return self.kind in "iu"

    @property
    def bits(self) -> int:
        return self.itemsize * 8


class dtypes:
    """The dtypes vkgraph knows, as attributes: ``dtypes.float32`` and so on."""

    bool = DType("bool", 1, "b", "bool", "uint8_t", "bool")
    int8 = DType("int8", 1, "i", "int8", "int8_t", "int")
    uint8 = DType("uint8", 1, "u", "uint8", "uint8_t", "uint")
    int16 = DType("int16", 2, "i", "int16", "int16_t", "int")
    uint16 = DType("uint16", 2, "u", "uint16", "uint16_t", "uint")
    int32 = DType("int32", 4, "i", "int32", "int", "int")
    uint32 = DType("uint32", 4, "u", "uint32", "uint", "uint")
    int64 = DType("int64", 8, "i", "int64", "int64_t", "int64_t")
    float16 = DType("float16", 2, "f", "float16", "float16_t", "float")
    bfloat16 = DType("bfloat16", 2, "f", "bfloat16", "uint16_t", "float")
    float32 = DType("float32", 4, "f", "float32", "float", "float")

    default_float = float32
    default_int = int32

    @staticmethod
    def all() -> list[DType]:
        return list(ALL)


ALL: tuple[DType, ...] = (dtypes.bool, dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16, dtypes.int32,
                          dtypes.uint32, dtypes.int64, dtypes.float16, dtypes.bfloat16, dtypes.float32)
_NAMES = {d.name: d for d in ALL} | {"half": dtypes.float16, "float": dtypes.float32, "int": dtypes.int32,
                                     "long": dtypes.int64, "bf16": dtypes.bfloat16}
_NP = {d.np_name: d for d in ALL}  # by name: building numpy dtypes here would import ml_dtypes


def _by_name(name: str) -> DType:
    return _NAMES[name]


def to_dtype(x: DType | str | np.dtype | type) -> DType:
    """A DType from a DType, a name ("float16"), a numpy dtype or a numpy/Python scalar type."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str) and x in _NAMES:
        return _NAMES[x]
    if x is float:
        return dtypes.default_float
    if x is int:
        return dtypes.default_int
    if x is bool:
        return dtypes.bool
    try:
        npd = np.dtype(x)
    except TypeError as e:
        raise TypeError(f"unknown dtype {x!r}; known: {', '.join(d.name for d in ALL)}") from e
    if npd == np.float64:
        return dtypes.float32
    d = _NP.get(npd.name)
    if d is not None and npd == d.np:
        return d
    raise TypeError(f"numpy dtype {npd} has no vkgraph equivalent; known: {', '.join(d.name for d in ALL)}")


def from_numpy(npd: np.dtype) -> DType:
    """The dtype a numpy array becomes: float64 narrows to float32, uint64 is refused."""
    return to_dtype(npd)


def _promote_ints(a: DType, b: DType) -> DType:
    if a.kind == b.kind:
        return a if a.itemsize >= b.itemsize else b
    s, u = (a, b) if a.kind == "i" else (b, a)
    if s.itemsize > u.itemsize:
        return s
    wider = {1: dtypes.int16, 2: dtypes.int32, 4: dtypes.int64}.get(u.itemsize)
    if wider is None:
        raise TypeError(f"no integer type holds both {a} and {b}")
    return wider


def promote(a: DType, b: DType) -> DType:
    """The result type of a binary operation between two tensors of dtypes a and b."""
    if a is b:
        return a
    if a.is_float and b.is_float:
        if {a, b} == {dtypes.float16, dtypes.bfloat16}:
            return dtypes.float32
        return a if a.itemsize >= b.itemsize else b
    if a.is_float or b.is_float:
        f, i = (a, b) if a.is_float else (b, a)
        return f if f.itemsize > i.itemsize or f is dtypes.float32 else dtypes.float32
    if a.kind == "b" or b.kind == "b":
        return b if a.kind == "b" else a
    return _promote_ints(a, b)


def fits(value: int, d: DType) -> bool:
    """Whether the integer value is one of d's (d an integer or bool dtype)."""
    lo, hi = _BOUNDS[d]
    return lo <= value <= hi


def int_dtype(value: int) -> DType:
    """The dtype a Python int takes on its own: int32, int64 where it needs it (numpy 2 takes int64 for every
    int; vkgraph keeps 32 bits where they hold the value, as GPUs compute them faster)."""
    if fits(value, dtypes.int32):
        return dtypes.int32
    if fits(value, dtypes.int64):
        return dtypes.int64
    raise OverflowError(f"Python integer {value} does not fit int64, the widest integer vkgraph has")


def check_fits(value: int, d: DType) -> None:
    """OverflowError, as numpy 2's, where a Python int is not a value of the integer dtype d."""
    if d.is_int and not fits(value, d):
        raise OverflowError(f"Python integer {value} out of bounds for {d.name}")


def scalar_dtype(value: object) -> DType:
    """The dtype a Python scalar takes on its own."""
    if isinstance(value, (bool, np.bool_)):
        return dtypes.bool
    if isinstance(value, (int, np.integer)):
        return to_dtype(value.dtype) if isinstance(value, np.integer) else int_dtype(value)
    if isinstance(value, (float, np.floating)):
        return to_dtype(value.dtype) if isinstance(value, np.floating) else dtypes.default_float
    raise TypeError(f"{type(value).__name__} is not a number")


def promote_scalar(t: DType, value: object) -> DType:
    """The result type of an operation between a tensor of dtype t and a weak Python scalar."""
    if isinstance(value, (bool, np.bool_)):
        return t
    if isinstance(value, (int, np.integer)):
        if t.kind == "b":
            return int_dtype(int(value))
        check_fits(int(value), t)
        return t
    if isinstance(value, (float, np.floating)):
        return t if t.is_float else dtypes.default_float
    raise TypeError(f"cannot combine a tensor with {type(value).__name__}")


def result_type(*args: DType | object) -> DType:
    """Promote any mix of dtypes (strong) and Python scalars (weak)."""
    strong = [a for a in args if isinstance(a, DType)]
    if not strong:  # scalars alone: each takes its own dtype (a Python int the one that holds it)
        out = scalar_dtype(args[0])
        for a in args[1:]:
            out = promote(out, scalar_dtype(a))
        return out
    out = strong[0]
    for d in strong[1:]:
        out = promote(out, d)
    for a in args:
        if not isinstance(a, DType):
            out = promote_scalar(out, a)
    return out


def least_float(d: DType) -> DType:
    """The float type an operation such as exp or mean gives for input dtype d."""
    return d if d.is_float else dtypes.default_float


def _bounds(d: DType) -> tuple[int | float | bool, int | float | bool]:
    if d.is_float:
        return -float("inf"), float("inf")
    if d.kind == "b":
        return False, True
    info = np.iinfo(d.np_name)
    return int(info.min), int(info.max)


# looked up, not recomputed: `fits` runs on every op between an integer tensor and a Python int
_BOUNDS: dict[DType, tuple[int | float | bool, int | float | bool]] = {d: _bounds(d) for d in ALL}


def min_value(d: DType) -> int | float | bool:
    return _BOUNDS[d][0]


def max_value(d: DType) -> int | float | bool:
    return _BOUNDS[d][1]

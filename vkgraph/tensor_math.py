"""Math functions of Tensor composed of its primitive ops (a mixin of `Tensor`): inverse trigonometry, hyperbolic
functions, expm1/log1p with their small-argument accuracy, lerp, hypot, atan2, division rounding modes, and the
elementwise helpers PyTorch has on tensors (tril/triu, isclose, ...). Composed ops fuse and differentiate like
the rest of the graph."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tensor import Tensor

_PI = math.pi


class TensorMath:
    __slots__ = ()

    def _f(self: Tensor) -> Tensor:
        from .dtype import dtypes, least_float
        d = least_float(self.dtype)
        return self.cast(dtypes.float32) if d in (dtypes.float16, dtypes.bfloat16) else self.cast(d)

    def _back(self: Tensor, out: Tensor) -> Tensor:
        from .dtype import least_float
        return out.cast(least_float(self.dtype))

    def tan(self: Tensor) -> Tensor:
        x = self._f()
        return self._back(x.sin() / x.cos())

    def atan(self: Tensor) -> Tensor:
        """Cephes' atanf: reduce to |x| <= tan(pi/8), then an odd polynomial (about 1 ulp in float32)."""
        x = self._f()
        a = x.abs()
        big = a > 2.414213562373095  # tan(3 pi / 8)
        mid = (a > 0.4142135623730950).logical_and(big.logical_not())
        r = big.where(-1.0 / a.maximum(1e-30), mid.where((a - 1.0) / (a + 1.0), a))
        base = big.where(_PI / 2, mid.where(_PI / 4, 0.0))
        z = r * r
        p = (((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z - 3.33329491539e-1) * z * r + r
        return self._back(x.sign() * (base + p))

    def atan2(self: Tensor, other: Any) -> Tensor:
        """The angle of (other, self) in (-pi, pi], numpy's arctan2 (signed zeros aside)."""
        from .tensor import _as_tensor, where
        y = self._f()
        x = _as_tensor(other, y)._f()
        base = (y / x).atan()
        quad = where(x < 0, where(y < 0, -_PI, _PI), 0.0)
        on_axis = where(y > 0, _PI / 2, where(y < 0, -_PI / 2, 0.0))
        return self._back(where(x == 0, on_axis, base + quad))

    arctan2 = atan2

    def asin(self: Tensor) -> Tensor:
        x = self._f()
        return self._back((x / (1.0 - x * x).sqrt()).atan().where_nan(x.abs() > 1))

    def acos(self: Tensor) -> Tensor:
        x = self._f()
        return self._back((((1.0 - x) / (1.0 + x)).sqrt().atan() * 2.0).where_nan(x.abs() > 1))

    def where_nan(self: Tensor, cond: Tensor) -> Tensor:
        """NaN where cond holds (outside a function's domain), self elsewhere."""
        return cond.where(float("nan"), self)

    def sinh(self: Tensor) -> Tensor:
        x = self._f()
        return self._back((x.expm1() - (-x).expm1()) * 0.5)

    def cosh(self: Tensor) -> Tensor:
        x = self._f()
        return self._back((x.exp() + (-x).exp()) * 0.5)

    def asinh(self: Tensor) -> Tensor:
        x = self._f()
        a = x.abs()
        # log1p(a + a^2 / (1 + sqrt(1 + a^2))) keeps small arguments exact; large ones use log(2a)
        small = (a + a * a / (1.0 + (1.0 + a * a).sqrt())).log1p()
        return self._back(x.sign() * (a > 1e18).where(a.log() + math.log(2), small))

    def acosh(self: Tensor) -> Tensor:
        x = self._f()
        t = x - 1.0
        return self._back((t + (t * t + 2.0 * t).sqrt()).log1p().where_nan(x < 1))

    def atanh(self: Tensor) -> Tensor:
        x = self._f()
        return self._back(((2.0 * x) / (1.0 - x)).log1p() * 0.5)

    def expm1(self: Tensor) -> Tensor:
        """exp(x) - 1, accurate near 0: a Taylor polynomial for |x| < 0.5 (its tail is under 1e-11), exp(x) - 1
        beyond. (Compensated forms like Kahan's rely on exact rounding that shader compilers may simplify away.)"""
        x = self._f()
        p: Any = 1 / math.factorial(11)
        for k in range(10, 0, -1):
            p = p * x + 1 / math.factorial(k)
        return self._back((x.abs() < 0.5).where(p * x, x.exp() - 1.0))

    def log1p(self: Tensor) -> Tensor:
        """log(1 + x), accurate near 0: 2 atanh(s) with s = x / (2 + x) as an odd series for |x| < 0.5 (|s| <= 1/3,
        terms to s^23), log(1 + x) beyond."""
        x = self._f()
        s = x / (x + 2.0)
        z = s * s
        p: Any = 1 / 23
        for k in range(21, 0, -2):
            p = p * z + 1 / k
        return self._back((x.abs() < 0.5).where(2.0 * s * p, (x + 1.0).log()))

    def lerp(self: Tensor, end: Any, weight: Any) -> Tensor:
        return self + (end - self) * weight

    def hypot(self: Tensor, other: Any) -> Tensor:
        """sqrt(x^2 + y^2) scaled by the larger magnitude, so it neither overflows nor underflows early."""
        from .tensor import _as_tensor
        a, b = self._f().abs(), _as_tensor(other, self)._f().abs()
        hi, lo = a.maximum(b), a.minimum(b)
        r = lo / (hi == 0).where(1.0, hi)
        return self._back((hi == float("inf")).where(hi, hi * (1.0 + r * r).sqrt()))

    def _div_rounded(self: Tensor, other: Any, rounding_mode: str) -> Tensor:
        """Division with PyTorch's rounding_mode 'trunc' or 'floor'."""
        if rounding_mode not in ("trunc", "floor"):
            raise ValueError(f"rounding_mode must be None, 'trunc' or 'floor', not {rounding_mode!r}")
        if rounding_mode == "floor":
            return self // other
        from .tensor import _as_tensor
        o = _as_tensor(other, self)
        if self.dtype.is_float or o.dtype.is_float:
            return (self / other).trunc()
        out = self // other  # integers: floor division, moved toward zero where the signs differ and it is inexact
        fix = (out * o != self).logical_and((self < 0).logical_xor(o < 0))
        return fix.where(out + 1, out)

    # ---- elementwise helpers ----------------------------------------------------------------------------------

    def tril(self: Tensor, diagonal: int = 0) -> Tensor:
        return self._triangle(diagonal, lower=True)

    def triu(self: Tensor, diagonal: int = 0) -> Tensor:
        return self._triangle(diagonal, lower=False)

    def _triangle(self: Tensor, diagonal: int, lower: bool) -> Tensor:
        from .tensor import Tensor
        if self.ndim < 2:
            raise ValueError(f"tril/triu need at least 2 dimensions, got {self.shape}")
        n, m = self.shape[-2:]
        i = Tensor.arange(n).reshape(n, 1)
        j = Tensor.arange(m).reshape(1, m)
        keep = (j - i <= diagonal) if lower else (j - i >= diagonal)
        return keep.where(self, Tensor.full((), 0, self.dtype))

    def isclose(self: Tensor, other: Any, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False
                ) -> Tensor:
        from .tensor import _as_tensor
        o = _as_tensor(other, self)
        a, b = self._f(), o._f()
        close = (a == b).logical_or((a - b).abs() <= atol + rtol * b.abs())
        if equal_nan:
            close = close.logical_or(a.isnan().logical_and(b.isnan()))
        return close

    def allclose(self: Tensor, other: Any, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> bool:
        return bool(self.isclose(other, rtol, atol, equal_nan).all().item())

    def clone(self: Tensor) -> Tensor:
        """A copy in a buffer of its own (the graph keeps the value; writes to the source do not reach it)."""
        from . import graph as g
        from .graph import Op
        from .tensor import Tensor
        if self.node.op is Op.BUFFER:
            return Tensor(g.alu(Op.BITCAST, self.dtype, self.node)).contiguous()
        return self.contiguous()

    def outer(self: Tensor, other: Tensor) -> Tensor:
        if self.ndim != 1 or other.ndim != 1:
            raise ValueError("outer takes two 1-D tensors")
        return self.reshape(-1, 1) * other.reshape(1, -1)

    ger = outer

    def diff(self: Tensor, n: int = 1, dim: int = -1, prepend: Tensor | None = None, append: Tensor | None = None
             ) -> Tensor:
        from .tensor import _axis, cat
        a = _axis(dim, self.ndim)
        x = cat([t for t in (prepend, self, append) if t is not None], a) if prepend is not None or \
            append is not None else self
        for _ in range(n):
            length = x.shape[a]
            if length == 0:
                break
            hi = x.shrink([(1, length) if i == a else None for i in range(x.ndim)])
            lo = x.shrink([(0, length - 1) if i == a else None for i in range(x.ndim)])
            x = hi.logical_xor(lo) if x.dtype.kind == "b" else hi - lo
        return x

    def cross(self: Tensor, other: Tensor, dim: int = -1) -> Tensor:
        from .tensor import _axis, broadcast_shape, stack
        shape = broadcast_shape(self.shape, other.shape)
        a, b = self.expand(shape), other.expand(shape)
        d = _axis(dim, len(shape))
        if shape[d] != 3:
            raise ValueError(f"cross: axis {d} has size {shape[d]}, not 3")

        def c(t, i):
            return t.shrink([(i, i + 1) if k == d else None for k in range(len(shape))]).squeeze(d)
        a0, a1, a2 = (c(a, i) for i in range(3))
        b0, b1, b2 = (c(b, i) for i in range(3))
        return stack([a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0], d)

    def roll(self: Tensor, shifts: int | tuple[int, ...], dims: int | tuple[int, ...] | None = None) -> Tensor:
        from .tensor import _axis, cat
        if dims is None:
            return self.reshape(-1).roll(shifts, 0).reshape(self.shape)
        sh = (shifts,) if isinstance(shifts, int) else tuple(shifts)
        ds = (dims,) if isinstance(dims, int) else tuple(dims)
        if len(sh) != len(ds):
            raise ValueError("roll: shifts and dims differ in length")
        x = self
        for s, dd in zip(sh, ds, strict=True):
            a = _axis(dd, x.ndim)
            n = x.shape[a]
            if n == 0 or s % n == 0:
                continue
            k = s % n
            tail = x.shrink([(n - k, n) if i == a else None for i in range(x.ndim)])
            head = x.shrink([(0, n - k) if i == a else None for i in range(x.ndim)])
            x = cat([tail, head], a)
        return x

    def cumprod(self: Tensor, dim: int = 0) -> Tensor:
        """Inclusive running product (a masked product per output: n^2 work along the axis)."""
        return self._running(dim, "prod")[0]

    def cummax(self: Tensor, dim: int = 0) -> tuple[Tensor, Tensor]:
        """Running maximum and the index where it was last reached (as PyTorch)."""
        return self._running(dim, "max")

    def cummin(self: Tensor, dim: int = 0) -> tuple[Tensor, Tensor]:
        return self._running(dim, "min")

    def _running(self: Tensor, dim: int, kind: str) -> tuple[Tensor, Tensor | None]:
        from .dtype import dtypes, max_value, min_value
        from .tensor import Tensor, _axis, _sum_dtype
        a = _axis(dim, self.ndim) if self.ndim else 0
        x = self if self.ndim else self.reshape(1)
        n = x.shape[a]
        if n == 0:
            return (x.cast(_sum_dtype(x.dtype)) if kind == "prod" else x), (None if kind == "prod" else
                                                                             x.cast(dtypes.int32))
        i = Tensor.arange(n).reshape(n, 1)
        j = Tensor.arange(n).reshape(1, n)
        tri = (j <= i).reshape((n, n) + (1,) * (x.ndim - a - 1))  # (i, j) over the axis
        xe = x.unsqueeze(a)  # (..., 1, n, ...): element j for every output i
        if kind == "prod":
            xp = xe.cast(_sum_dtype(x.dtype))
            out = tri.where(xp, Tensor.full((), 1, xp.dtype)).prod(a + 1)
            return (out if self.ndim else out.reshape(())), None
        fill = min_value(x.dtype) if kind == "max" else max_value(x.dtype)  # the identities, unsigned types included
        masked = tri.where(xe, Tensor.full((), fill, x.dtype))
        vals = masked.max(a + 1) if kind == "max" else masked.min(a + 1)
        hit = tri.logical_and((xe == vals.unsqueeze(a + 1)).logical_or(xe.isnan() if x.dtype.is_float else False))
        jj = Tensor.arange(n).reshape((1, n) + (1,) * (x.ndim - a - 1))
        idx = hit.where(jj, -1).max(a + 1)
        if not self.ndim:
            return vals.reshape(()), idx.reshape(())
        return vals, idx

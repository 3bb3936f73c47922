"""Integer index expressions with bounds, simplified as they are built.

Codegen turns views into index arithmetic over thread and loop variables. Each expression knows its range
[lo, hi], which lets ``(x // 4) % 8`` vanish when x < 4, and the rebuild of a flat index from its
unflattened coordinates (``(y % b) * k + (y // b) * (k * b)``) collapse back to ``y * k``, so a contiguous
load through a reshape renders as ``gid``. Everything renders to GLSL integer arithmetic on non-negative
operands (truncating division equals floor division there): ``int`` where the bounds of an expression and of
everything under it fit in 32 bits, ``int64_t`` where they do not (a node whose own value fits is cast back to
``int``), so index spaces past 2^31 elements are exact and small kernels keep 32-bit arithmetic. The GLSL type of
a `Var` must follow the same rule (`itype`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

NARROW = 1 << 31  # values in [-NARROW, NARROW) are GLSL ints; tests lower it to reach the 64-bit paths cheaply


def narrow(lo: int, hi: int) -> bool:
    return -NARROW <= lo and hi < NARROW


def itype(lo: int, hi: int) -> str:
    """The GLSL type of an integer variable over [lo, hi]."""
    return "int" if narrow(lo, hi) else "int64_t"


def lit(v: int, wide: bool = False) -> str:
    """An integer literal: int64 where it does not fit an int (or where `wide` asks)."""
    s = f"{v}l" if wide or not narrow(v, v) else str(v)
    return s if v >= 0 else f"({s})"


class Expr:
    lo: int
    hi: int

    @cached_property
    def is_narrow(self) -> bool:
        return narrow(self.lo, self.hi)

    @cached_property
    def wide_calc(self) -> bool:
        """Whether computing this needs 64-bit arithmetic (a value under it, or itself, past 32 bits)."""
        return not self.is_narrow

    def render(self) -> str:
        """GLSL of type int when is_narrow, else int64_t."""
        if not self.wide_calc:
            return self._render(False)
        s = self._render(True)
        return f"int({s})" if self.is_narrow else s

    def render64(self) -> str:
        """GLSL of type int64_t."""
        return self._render(True) if self.wide_calc else f"int64_t({self.render()})"

    def _render(self, wide: bool) -> str:
        raise NotImplementedError

    def __add__(self, other: Expr | int) -> Expr:
        return add(self, num(other) if isinstance(other, int) else other)

    __radd__ = __add__

    def __mul__(self, c: int) -> Expr:
        return mul(self, c)

    __rmul__ = __mul__

    def __floordiv__(self, c: int) -> Expr:
        return div(self, c)

    def __mod__(self, c: int) -> Expr:
        return mod(self, c)



@dataclass(frozen=True)
class Num(Expr):
    v: int

    @property
    def lo(self) -> int:
        return self.v

    @property
    def hi(self) -> int:
        return self.v

    def _render(self, wide: bool) -> str:
        return lit(self.v, wide)

    def render64(self) -> str:
        return lit(self.v, True)


@dataclass(frozen=True)
class Var(Expr):
    """A GLSL integer expression treated as opaque, known to lie in [lo, hi]: an int where those bounds fit, an
    int64_t where they do not or where `wide` says it is one anyway (a loop counter that passes 2^31 on its last
    step)."""

    name: str
    lo: int = field(compare=False)
    hi: int = field(compare=False)
    wide: bool = field(default=False, compare=False)

    @cached_property
    def is_narrow(self) -> bool:
        return narrow(self.lo, self.hi) and not self.wide

    def render(self) -> str:
        return self.name

    def render64(self) -> str:
        return self.name if not self.is_narrow else f"int64_t({self.name})"


@dataclass(frozen=True)
class Mul(Expr):
    x: Expr
    c: int

    @cached_property
    def lo(self) -> int:
        return min(self.x.lo * self.c, self.x.hi * self.c)

    @cached_property
    def hi(self) -> int:
        return max(self.x.lo * self.c, self.x.hi * self.c)

    @cached_property
    def wide_calc(self) -> bool:
        return not (self.is_narrow and self.x.is_narrow and narrow(self.c, self.c))

    def _render(self, wide: bool) -> str:
        return f"({self.x.render64() if wide else self.x.render()}*{lit(self.c, wide)})"


@dataclass(frozen=True)
class Div(Expr):
    x: Expr
    c: int

    @cached_property
    def lo(self) -> int:
        return self.x.lo // self.c

    @cached_property
    def hi(self) -> int:
        return self.x.hi // self.c

    @cached_property
    def wide_calc(self) -> bool:
        return not (self.x.is_narrow and narrow(self.c, self.c))

    def _render(self, wide: bool) -> str:
        return f"({self.x.render64() if wide else self.x.render()}/{lit(self.c, wide)})"


@dataclass(frozen=True)
class Mod(Expr):
    x: Expr
    c: int

    @cached_property
    def lo(self) -> int:
        return 0 if self.x.lo >= 0 else -(self.c - 1)

    @cached_property
    def hi(self) -> int:
        return min(self.c - 1, self.x.hi) if self.x.lo >= 0 else self.c - 1

    @cached_property
    def wide_calc(self) -> bool:
        return not (self.x.is_narrow and narrow(self.c, self.c))

    def _render(self, wide: bool) -> str:
        return f"({self.x.render64() if wide else self.x.render()}%{lit(self.c, wide)})"


@dataclass(frozen=True)
class Sum(Expr):
    terms: tuple[tuple[Expr, int], ...]  # (base, coefficient), sorted by rendering
    const: int

    @cached_property
    def lo(self) -> int:
        return self.const + sum(min(b.lo * k, b.hi * k) for b, k in self.terms)

    @cached_property
    def hi(self) -> int:
        return self.const + sum(max(b.lo * k, b.hi * k) for b, k in self.terms)

    @cached_property
    def wide_calc(self) -> bool:
        # every partial sum stays within the sum of the terms' magnitudes
        span = abs(self.const) + sum(max(abs(b.lo * k), abs(b.hi * k)) for b, k in self.terms)
        return span >= NARROW or any(not b.is_narrow for b, _ in self.terms)

    def _render(self, wide: bool) -> str:
        if wide:
            parts = [b.render64() if k == 1 else Mul(b, k)._render(True) for b, k in self.terms]
        else:
            parts = [b.render() if k == 1 else Mul(b, k).render() for b, k in self.terms]
        if self.const:
            parts.append(lit(self.const, wide))
        return "(" + " + ".join(parts) + ")"


def num(v: int) -> Num:
    return Num(int(v))


def _terms(e: Expr, k: int, acc: dict[Expr, int]) -> int:
    """Add k*e into acc as (base -> coefficient); returns the constant part."""
    if isinstance(e, Num):
        return e.v * k
    if isinstance(e, Mul):
        return _terms(e.x, k * e.c, acc)
    if isinstance(e, Sum):
        c = e.const * k
        for b, kk in e.terms:
            c += _terms(b, kk * k, acc)
        return c
    acc[e] = acc.get(e, 0) + k
    return 0


def _recombine(acc: dict[Expr, int]) -> int:
    """(y % b) * k + (y // b) * (k * b) -> y * k, where y // b is written Div(x, a*b) when y = x // a."""
    const = 0
    changed = True
    while changed:
        changed = False
        for t, k in list(acc.items()):
            if not isinstance(t, Mod) or k == 0:
                continue
            y, b = t.x, t.c
            x, a = (y.x, y.c) if isinstance(y, Div) else (y, 1)
            partner = Div(x, a * b)
            if acc.get(partner) == k * b:
                del acc[t], acc[partner]
                const += _terms(y, k, acc)
                changed = True
                break
    return const


def _build_sum(acc: dict[Expr, int], const: int) -> Expr:
    terms = tuple(sorted(((b, k) for b, k in acc.items() if k != 0), key=lambda t: t[0].render()))
    if not terms:
        return Num(const)
    if len(terms) == 1 and const == 0:
        b, k = terms[0]
        return b if k == 1 else Mul(b, k)
    return Sum(terms, const)


def add(a: Expr, b: Expr) -> Expr:
    acc: dict[Expr, int] = {}
    const = _terms(a, 1, acc) + _terms(b, 1, acc)
    const += _recombine(acc)
    return _build_sum(acc, const)


def mul(a: Expr, c: int) -> Expr:
    if c == 0:
        return Num(0)
    if c == 1:
        return a
    acc: dict[Expr, int] = {}
    const = _terms(a, c, acc)
    return _build_sum(acc, const)


def div(a: Expr, c: int) -> Expr:
    if c == 1:
        return a
    if isinstance(a, Num):
        return Num(a.v // c)
    if a.lo >= 0 and a.hi < c:
        return Num(0)
    if isinstance(a, Div):
        return div(a.x, a.c * c)
    acc: dict[Expr, int] = {}
    const = _terms(a, 1, acc)
    whole = {b: k // c for b, k in acc.items() if k % c == 0}
    rest_expr = _build_sum({b: k for b, k in acc.items() if k % c != 0}, const % c)
    if (whole or const // c) and rest_expr.lo >= 0:
        return add(_build_sum(whole, const // c), div(rest_expr, c))
    return Div(a, c)


def mod(a: Expr, c: int) -> Expr:
    if c == 1:
        return Num(0)
    if isinstance(a, Num):
        return Num(a.v % c)
    if a.lo >= 0 and a.hi < c:
        return a
    if isinstance(a, Mod) and a.c % c == 0:
        return mod(a.x, c)
    acc: dict[Expr, int] = {}
    const = _terms(a, 1, acc)
    rest = {b: k for b, k in acc.items() if k % c != 0}
    if len(rest) != len(acc) or const % c != const:  # drop whole multiples of c
        rest_expr = _build_sum(rest, const % c)
        if rest_expr.lo >= 0:
            return mod(rest_expr, c)
    return Mod(a, c)


def unravel(flat: Expr, shape: tuple[int, ...]) -> tuple[Expr, ...]:
    """Row-major coordinates of a flat index over shape."""
    out: list[Expr] = []
    stride = 1
    for s in reversed(shape):
        out.append(Num(0) if s == 1 else mod(div(flat, stride), s))
        stride *= s
    return tuple(reversed(out))


def ravel(coords: tuple[Expr, ...], shape: tuple[int, ...]) -> Expr:
    out: Expr = Num(0)
    stride = 1
    for c, s in zip(reversed(coords), reversed(shape), strict=True):
        if s != 1:
            out = add(out, mul(c, stride))
        stride *= s
    return out


def in_range(e: Expr, lo: int, hi: int) -> list[str]:
    """GLSL conditions for lo <= e < hi, without the ones the bounds already prove; ['false'] if never."""
    if e.hi < lo or e.lo >= hi:
        return ["false"]
    out = []
    if e.lo < lo:
        out.append(f"{e.render()} >= {lit(lo, not e.is_narrow)}")
    if e.hi >= hi:
        out.append(f"{e.render()} < {lit(hi, not e.is_narrow)}")
    return out

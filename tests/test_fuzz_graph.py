"""Random expression graphs against numpy: float graphs (elementwise, reductions, scans, matmuls, movement, casts)
by normalised error; graphs over special values (inf, NaN, -0.0, subnormals, huge and tiny magnitudes) bit for bit
where numpy's result is exact; integer graphs at each dtype's extremes bit for bit.

The default run checks 500 float graphs, 40 with special values and 40 integer ones; `pytest -m slow
tests/test_fuzz_graph.py` runs a longer search (VKGRAPH_FUZZ_EXAMPLES graphs of each kind, 10,000 by default).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numerics import flush, flushed, may_flush_subnormals

from vkgraph.flags import flag
from vkgraph.tensor import Tensor, cat, realize_all

ERR = 3e-6  # the error bound: this much of the magnitudes that went into a value (Item.scale)
# Vulkan bounds sin's error absolutely (2^-11 on [-pi, pi]), not relatively: its results carry that much more
# "magnitude" into the bound
SIN_ABS_ERROR = 2.0**-11 / ERR

UNARY = {
    "sin": (lambda t: t.sin(), np.sin, 1.0), "tanh": (lambda t: t.tanh(), np.tanh, 1.0),
    "abs": (lambda t: t.abs(), np.abs, 1.0), "neg": (lambda t: -t, np.negative, 1.0),
    "sqrtabs": (lambda t: t.abs().sqrt(), lambda x: np.sqrt(np.abs(x)), 1.0),
    "exptanh": (lambda t: t.tanh().exp(), lambda x: np.exp(np.tanh(x)), 3.0),
    "relu": (lambda t: t.relu(), lambda x: np.maximum(x, 0), 1.0),
    "sigmoid": (lambda t: t.sigmoid(), lambda x: 1 / (1 + np.exp(-x)), 1.0),
    "half": (lambda t: t.half().float(), lambda x: x.astype(np.float16).astype(np.float64), 1.0),
}
BINARY = {
    "add": (lambda a, b: a + b, np.add), "sub": (lambda a, b: a - b, np.subtract),
    "mul": (lambda a, b: a * b, np.multiply), "max": (lambda a, b: a.maximum(b), np.maximum),
    "where": (lambda a, b: (a > b).where(a, b * 2), lambda a, b: np.where(a > b, a, b * 2)),
}
REDUCE = {"sum": (np.sum, True), "max": (np.max, False), "min": (np.min, False), "mean": (np.mean, False)}


class Item:
    """A tensor, the same value in numpy (float64), a bound on the magnitudes that went into it, and how it
    was built (shown when an example fails)."""

    def __init__(self, t: Tensor, x: np.ndarray, scale: float, desc: str, ambiguous: bool = False):
        self.t, self.x, self.scale, self.desc = t, x, scale, desc
        self.ambiguous = ambiguous  # built on a comparison that may go either way: only shape and NaN checked

    def __repr__(self) -> str:
        return f"{self.desc} {self.x.shape}"


@st.composite
def graphs(draw, max_ops: int = 6):
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([1, 2, 3, 5, 7, 130])) if i == nd - 1 else draw(st.integers(1, 6))
                  for i in range(nd))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    pool = []
    for _ in range(draw(st.integers(1, 3))):
        x = rng.standard_normal(shape).astype(np.float32)
        pool.append(Item(Tensor(x), x.astype(np.float64), float(np.abs(x).max(initial=1.0)), f"in{len(pool)}"))
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(["unary", "binary", "binary", "reduce", "move", "move", "scan", "gram"]))
        a = pool[draw(st.integers(0, len(pool) - 1))]
        if kind == "unary":
            name = draw(st.sampled_from(sorted(UNARY)))
            f, g, s = UNARY[name]
            extra = SIN_ABS_ERROR if name == "sin" else 0.0
            pool.append(Item(f(a.t), g(a.x), a.scale * s + 1 + extra, f"{name}({a.desc})", a.ambiguous))
        elif kind == "binary":
            same = [p for p in pool if _broadcasts(p.x.shape, a.x.shape)]
            b = same[draw(st.integers(0, len(same) - 1))]
            name = draw(st.sampled_from(sorted(BINARY)))
            f, g = BINARY[name]
            scale = a.scale * b.scale + a.scale + b.scale if name == "mul" else 2 * (a.scale + b.scale)
            ambiguous = a.ambiguous or b.ambiguous or (name == "where" and _near_tie(a, b))
            pool.append(Item(f(a.t, b.t), g(a.x, b.x), scale, f"{name}({a.desc}, {b.desc})", ambiguous))
        elif kind == "reduce" and a.x.ndim:
            name = draw(st.sampled_from(sorted(REDUCE)))
            axis = draw(st.integers(0, a.x.ndim - 1))
            keep = draw(st.booleans())
            fn, grows = REDUCE[name]
            t = getattr(a.t, name)(axis, keepdim=keep)
            pool.append(Item(t, fn(a.x, axis=axis, keepdims=keep), a.scale * (a.x.shape[axis] if grows else 1),
                             f"{name}({a.desc}, {axis}, {keep})", a.ambiguous))
        elif kind == "scan" and a.x.ndim:
            axis = draw(st.integers(0, a.x.ndim - 1))
            pool.append(Item(a.t.cumsum(axis), np.cumsum(a.x, axis), a.scale * a.x.shape[axis],
                             f"cumsum({a.desc}, {axis})", a.ambiguous))
        elif kind == "gram" and a.x.ndim:  # a @ its own transpose over the last axis (a dot product when 1-D)
            at = a.t.transpose(-1, -2) if a.x.ndim > 1 else a.t
            ax = np.swapaxes(a.x, -1, -2) if a.x.ndim > 1 else a.x
            pool.append(Item(a.t @ at, a.x @ ax, a.scale * a.scale * a.x.shape[-1], f"gram({a.desc})",
                             a.ambiguous))
        elif kind == "move" and a.x.ndim:
            moved = _move(draw, a)
            moved.ambiguous = a.ambiguous
            pool.append(moved)
    return pool[-1], pool[draw(st.integers(0, len(pool) - 1))]


def _near_tie(a: Item, b: Item) -> bool:
    """Whether `a > b` may go either way somewhere: a and b equal within their own error bounds (b = tanh(a)
    near 0, say). Values built on such a comparison have no single right answer to compare with."""
    return bool((np.abs(a.x - b.x) <= ERR * (a.scale + b.scale)).any())


def _broadcasts(s1, s2) -> bool:
    try:
        np.broadcast_shapes(s1, s2)
        return True
    except ValueError:
        return False


def _move(draw, a: Item) -> Item:
    x, t = a.x, a.t
    kind = draw(st.sampled_from(["permute", "flip", "slice", "pad", "reshape", "expand", "index", "unsqueeze",
                                 "cat", "refactor"]))
    if kind == "permute":
        order = tuple(draw(st.permutations(range(x.ndim))))
        return Item(t.permute(order), x.transpose(order), a.scale, f"permute({a.desc}, {order})")
    if kind == "flip":
        ax = draw(st.integers(0, x.ndim - 1))
        return Item(t.flip(ax), np.flip(x, ax), a.scale, f"flip({a.desc}, {ax})")
    if kind == "slice":
        ax = draw(st.integers(0, x.ndim - 1))
        n = x.shape[ax]
        start = draw(st.integers(0, max(n - 1, 0)))
        step = draw(st.sampled_from([1, 1, 2, -1]))
        idx = tuple(slice(start, None, step) if i == ax else slice(None) for i in range(x.ndim))
        return Item(t[idx], x[idx], a.scale, f"{a.desc}[{idx}]")
    if kind == "pad":
        ax = draw(st.integers(0, x.ndim - 1))
        p = tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) if i == ax else (0, 0) for i in range(x.ndim))
        return Item(t.pad(p), np.pad(x, p), a.scale, f"pad({a.desc}, {p})")
    if kind == "reshape":
        return Item(t.reshape(-1), x.reshape(-1), a.scale, f"flat({a.desc})")
    if kind == "index":  # an int index drops the axis (a scalar from a 1-D value)
        i = draw(st.integers(-x.shape[0], x.shape[0] - 1))
        return Item(t[i], x[i], a.scale, f"{a.desc}[{i}]")
    if kind == "unsqueeze":
        ax = draw(st.integers(0, x.ndim))
        return Item(t.unsqueeze(ax), np.expand_dims(x, ax), a.scale, f"unsqueeze({a.desc}, {ax})")
    if kind == "cat":  # with its own flip along the axis: two views of one value side by side
        ax = draw(st.integers(0, x.ndim - 1))
        return Item(cat([t, t.flip(ax)], ax), np.concatenate([x, np.flip(x, ax)], ax), a.scale,
                    f"cat({a.desc}, flip, {ax})")
    if kind == "refactor":  # the same elements under another factorisation of their count (up to 3 axes)
        shape = _factorisation(draw, x.size)
        return Item(t.reshape(shape), x.reshape(shape), a.scale, f"reshape({a.desc}, {shape})")
    shape = tuple(draw(st.integers(1, 3)) if s == 1 else s for s in x.shape)
    return Item(t.expand(shape), np.broadcast_to(x, shape), a.scale, f"expand({a.desc}, {shape})")


def _factorisation(draw, n: int) -> tuple[int, ...]:
    dims = []
    while n > 1 and len(dims) < 2:
        d = draw(st.sampled_from([d for d in range(2, n + 1) if n % d == 0]))
        dims.append(d)
        n //= d
    if n > 1:
        dims.append(n)
    if draw(st.booleans()):
        dims.insert(draw(st.integers(0, len(dims))), 1)
    return tuple(dims)


def _check(item: Item) -> None:
    got = item.t.numpy().astype(np.float64)
    assert got.shape == item.x.shape
    assert not np.isnan(got).any(), "NaN"
    if got.size and not item.ambiguous:
        # values past float16's range overflow alike on both sides: the infinities must match exactly
        inf = np.isinf(item.x)
        assert np.array_equal(got[inf], np.asarray(item.x)[inf]), "infinities differ"
        if inf.all():
            return
        err = np.abs(got - item.x)[~inf].max()
        bound = ERR * max(item.scale, np.abs(item.x)[~inf].max(), 1.0)
        if item.t.dtype.name == "float16":
            bound *= 1000
        elif "half(" in item.desc:
            # a float16 round trip of a float32 value can land one float16 ulp (2^-11 relative) away from the
            # float64 reference's rounding (double rounding through float32)
            bound += 2.0**-10 * max(item.scale, np.abs(item.x).max(), 1.0)
        assert err <= bound, f"{item!r}: error {err:.3g} > {bound:.3g}"


def _run(pair) -> None:
    last, other = pair
    realize_all(last.t, other.t)  # two outputs of one graph in one schedule
    _check(last)
    _check(other)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(graphs())
def test_random_graphs_match_numpy(pair):
    _run(pair)


@pytest.mark.slow
@settings(max_examples=flag("VKGRAPH_FUZZ_EXAMPLES"), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs(max_ops=12))
def test_random_graphs_match_numpy_long(pair):
    _run(pair)


# ---- special values -------------------------------------------------------------------------------------------
# Graphs over inputs holding inf, -inf, NaN, -0.0, subnormals, huge and tiny magnitudes, against numpy's float32
# (the semantics vkgraph follows: float32 overflows where float64 would not). Chains of IEEE-exact operations
# (add, sub, mul, neg, abs, max/min, where, floor/ceil/trunc/round, float16 rounding, movements, max/min
# reductions) must equal numpy bit for bit (NaN at the same places, zeros with the same sign); one inexact
# operation may end a chain (exp, log, sqrt, reciprocal, div, pow, tanh, sum, mean), compared by normalised
# error, with NaN and infinities matched exactly.

F32_MAX = float(np.finfo(np.float32).max)
SPECIAL_VALUES = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, 1e-40, -3e-42, 1.4e-45, 3e38, -2e38, 1e30, -1e-30,
                           1.0, -1.0, 2.0, 0.5, 65504.0, 65520.0, 7.0, -3.0], np.float32)

EXACT_UNARY = {
    "neg": (lambda t: -t, np.negative), "abs": (lambda t: t.abs(), np.abs),
    "relu": (lambda t: t.relu(), lambda x: np.maximum(x, np.float32(0))),
    "floor": (lambda t: t.floor(), np.floor), "ceil": (lambda t: t.ceil(), np.ceil),
    "trunc": (lambda t: t.trunc(), np.trunc), "round": (lambda t: t.round(), np.round),
    "half": (lambda t: t.half().float(), lambda x: x.astype(np.float16).astype(np.float32)),
}
EXACT_BINARY = {
    "add": (lambda a, b: a + b, np.add), "sub": (lambda a, b: a - b, np.subtract),
    "mul": (lambda a, b: a * b, np.multiply), "max": (lambda a, b: a.maximum(b), np.maximum),
    "min": (lambda a, b: a.minimum(b), np.minimum),
    "where": (lambda a, b: (a > b).where(a, b), lambda a, b: np.where(a > b, a, b)),
}
# inexact: (vkgraph, numpy float32, relative error bound; "log" bounds by max(|ref|, 1): Vulkan bounds log's
# error absolutely near 1)
INEXACT_UNARY = {
    "exp": (lambda t: t.exp(), np.exp, 2e-5), "log": (lambda t: t.log(), np.log, 1e-5),
    "sqrt": (lambda t: t.sqrt(), np.sqrt, 1e-6), "recip": (lambda t: t.reciprocal(), np.reciprocal, 1e-6),
    "tanh": (lambda t: t.tanh(), np.tanh, 1e-5),
}
# pow is exp2(b * log2(a)) (Vulkan defines its precision so): log2's error (absolute near 1, relative elsewhere)
# times |b|, plus the rounding of b * log2(a), moves the result by that much of an octave: its relative error is
# bounded by POW_PER_OCTAVE * (1 + |b| + |log2 of the result|) (tol -1 marks it)
INEXACT_BINARY = {"div": (lambda a, b: a / b, np.divide, 1e-6), "pow": (lambda a, b: a ** b, np.power, -1.0)}
POW_PER_OCTAVE = 2.0**-20


class Special:
    """A tensor, numpy's float32 value of it, the same computed as a device that flushes subnormals does (inputs
    and result of each arithmetic op flushed; see numerics.flushed), and how it was built."""

    def __init__(self, t: Tensor, x: np.ndarray, desc: str, xf: np.ndarray | None = None):
        self.t, self.x, self.desc = t, x, desc
        self.xf = x if xf is None else xf

    def __repr__(self) -> str:
        return f"{self.desc} {self.x.shape}"


def _moved_both(m: Item, x: np.ndarray, xf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The movement that took codes 1..n (0 where padded) to m.x, applied to x and to xf."""
    code = np.asarray(m.x).astype(np.int64)

    def pick(v):
        return np.where(code == 0, np.float32(0), np.asarray(v, np.float32).ravel()[np.maximum(code - 1, 0)])

    return pick(x).astype(np.float32), pick(xf).astype(np.float32)


def _special_input(draw, rng, shape) -> np.ndarray:
    x = (rng.standard_normal(shape) * 10 ** draw(st.integers(-3, 3))).astype(np.float32)
    mask = rng.random(shape) < draw(st.sampled_from([0.1, 0.3, 0.7]))
    x[mask] = rng.choice(SPECIAL_VALUES, size=int(mask.sum()))
    return x


@st.composite
def special_graphs(draw, max_ops: int = 6):
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([1, 2, 3, 5, 7, 130])) if i == nd - 1 else draw(st.integers(1, 5))
                  for i in range(nd))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    pool = []
    for _ in range(draw(st.integers(1, 3))):
        x = _special_input(draw, rng, shape)
        pool.append(Special(Tensor(x), x, f"in{len(pool)}", flush(x)))
    with np.errstate(all="ignore"):
        for _ in range(draw(st.integers(1, max_ops))):
            kind = draw(st.sampled_from(["unary", "binary", "binary", "reduce", "move"]))
            a = pool[draw(st.integers(0, len(pool) - 1))]
            if kind == "unary":
                name = draw(st.sampled_from(sorted(EXACT_UNARY)))
                f, g = EXACT_UNARY[name]
                pool.append(Special(f(a.t), g(a.x), f"{name}({a.desc})", flushed(g, a.xf)))
            elif kind == "binary":
                same = [p for p in pool if _broadcasts(p.x.shape, a.x.shape)]
                b = same[draw(st.integers(0, len(same) - 1))]
                name = draw(st.sampled_from(sorted(EXACT_BINARY)))
                f, g = EXACT_BINARY[name]
                pool.append(Special(f(a.t, b.t), g(a.x, b.x).astype(np.float32), f"{name}({a.desc}, {b.desc})",
                                    flushed(g, a.xf, b.xf)))
            elif kind == "reduce" and a.x.ndim:
                name = draw(st.sampled_from(["max", "min"]))
                axis = draw(st.integers(0, a.x.ndim - 1))
                # + 0.0 makes a zero +0.0: which of +0.0 and -0.0 a reduction returns depends on its order
                red = getattr(np, name)
                pool.append(Special(getattr(a.t, name)(axis) + 0.0, red(a.x, axis=axis) + np.float32(0),
                                    f"{name}({a.desc}, {axis})", flushed(red, a.xf, axis) + np.float32(0)))
            elif kind == "move" and a.x.ndim:
                codes = np.arange(1, a.x.size + 1, dtype=np.float64).reshape(a.x.shape)
                m = _move(draw, Item(a.t, codes, 1.0, a.desc))
                x, xf = _moved_both(m, a.x, a.xf)
                pool.append(Special(m.t, x, m.desc, xf))
        last = pool[-1]
        end = draw(st.sampled_from(["none", "unary", "binary", "sum", "mean"]))
        if end == "unary":
            name = draw(st.sampled_from(sorted(INEXACT_UNARY)))
            f, g, tol = INEXACT_UNARY[name]
            return (Special(f(last.t), g(last.x), f"{name}({last.desc})", flushed(g, last.xf)), tol, name == "log",
                    None, None)
        if end == "binary":
            same = [p for p in pool if _broadcasts(p.x.shape, last.x.shape)]
            b = same[draw(st.integers(0, len(same) - 1))]
            name = draw(st.sampled_from(sorted(INEXACT_BINARY)))
            f, g, tol = INEXACT_BINARY[name]
            out = Special(f(last.t, b.t), g(last.x, b.x), f"{name}({last.desc}, {b.desc})", flushed(g, last.xf, b.xf))
            return out, tol, False, None, np.broadcast_to(np.abs(b.x.astype(np.float64)), out.x.shape)
        if end in ("sum", "mean") and last.x.ndim:
            axis = draw(st.integers(0, last.x.ndim - 1))
            # the error scales with the result's terms; overflow of the partial sums (whose infinities and NaN
            # depend on the order) with the sum of their magnitudes, also where the result is a mean
            partial = np.abs(last.x.astype(np.float64)).sum(axis)
            terms = partial if end == "sum" else np.abs(last.x.astype(np.float64)).mean(axis)
            red = getattr(np, end)
            out = Special(getattr(last.t, end)(axis), red(last.x, axis=axis, dtype=np.float32),
                          f"{end}({last.desc}, {axis})", flush(red(flush(last.xf), axis=axis, dtype=np.float32)))
            return out, 2e-6, False, terms, None, partial
    return last, 0.0, False, None, None


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


def _check_special(item: Special, tol: float, floor_one: bool, terms: np.ndarray | None,
                   exponent: np.ndarray | None, partial: np.ndarray | None = None) -> None:
    """numpy's value must hold; where the device may flush subnormals, each place may hold the flushed value
    instead (numerics.may_flush_subnormals). `terms`: a sum's or mean's scale of error (the magnitude of its
    result's terms); `partial`: how large its partial sums may grow (the sum of the terms' magnitudes)."""
    got = item.t.numpy()
    assert got.shape == np.shape(item.x), (item, got.shape, np.shape(item.x))
    got = got.astype(np.float32)
    bad, why = _special_bad(item, got, np.asarray(item.x, np.float32), tol, floor_one, terms, exponent, partial)
    if bad.any() and may_flush_subnormals():
        xf = np.asarray(item.xf, np.float32)
        bad_f, _ = _special_bad(item, got, xf, tol, floor_one, terms, exponent, partial)
        # flushing may touch inputs and not the output: min(-3e-42, 1e-45) compares two zeros and may return the
        # second operand's own bits, so where the flushed result is zero a subnormal of the inputs may stand
        bad &= bad_f & ~((xf == 0) & (np.abs(got) < np.float32(2.0**-126)))
    assert not bad.any(), why(bad)


def _special_bad(item: Special, got: np.ndarray, ref: np.ndarray, tol: float, floor_one: bool,
                 terms: np.ndarray | None, exponent: np.ndarray | None, partial: np.ndarray | None = None):
    """The places where got is not ref under the rules of _check_special, and a message for a mask of them."""
    nan_g, nan_r = np.isnan(got), np.isnan(ref)
    ambiguous = np.zeros(ref.shape, bool)
    if terms is not None:  # a sum whose partial sums may overflow: its infinities and NaN depend on the order
        partial = terms if partial is None else partial
        ambiguous = ~np.isfinite(partial) & ~np.isnan(ref) | (partial >= F32_MAX / 2)
    elif tol:  # an inexact op whose true result lies at float32's overflow threshold may round either way
        near_max = np.isfinite(got) & (np.abs(got) >= F32_MAX * (1 - 1e-3)) & (np.sign(got) == np.sign(ref))
        ambiguous = np.isfinite(ref) & (np.abs(ref) >= F32_MAX * (1 - 1e-3)) | np.isinf(ref) & near_max
    nan_bad = (nan_g != nan_r) & ~ambiguous

    def why(bad: np.ndarray) -> str:
        at = np.argwhere(bad)[:5].tolist()
        return f"{item!r}: differs at {at}: {got[bad][:5]} vs {ref[bad][:5]} (flushed {np.asarray(item.xf)[bad][:5]})"

    if tol == 0.0:  # IEEE-exact all the way: bit for bit
        return nan_bad | (_bits(got) != _bits(ref)) & ~nan_r, why
    inf_r = np.isinf(ref) & ~ambiguous
    inf_bad = inf_r & (got != ref)  # infinities must match exactly
    fin = np.isfinite(ref) & ~ambiguous
    scale = np.maximum(np.abs(ref.astype(np.float64)), 1.0 if floor_one else 0.0)
    if tol < 0:  # pow: see POW_PER_OCTAVE
        with np.errstate(all="ignore"):
            octaves = np.where(ref != 0, np.abs(np.log2(np.abs(ref.astype(np.float64)))), 0.0)
        tol, scale = POW_PER_OCTAVE, scale * (1.0 + octaves + np.where(np.isfinite(exponent), exponent, 0.0))
    if terms is not None:
        scale = np.maximum(scale, np.where(np.isfinite(terms), terms, 0.0))
    # results in the subnormal range: drivers may flush them (Vulkan's default float controls)
    bound = tol * scale + 2.0**-126
    with np.errstate(invalid="ignore"):
        err = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    return nan_bad | inf_bad | fin & ~(err <= bound), why


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(special_graphs())
def test_special_value_graphs_match_numpy(case):
    _check_special(*case)


@pytest.mark.slow
@settings(max_examples=flag("VKGRAPH_FUZZ_EXAMPLES"), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(special_graphs(max_ops=10))
def test_special_value_graphs_match_numpy_long(case):
    _check_special(*case)


# ---- integer edge values --------------------------------------------------------------------------------------
# Integer graphs in one dtype, inputs holding the dtype's extremes, -1, 0, 1 and powers of two, against numpy bit
# for bit: wrapping arithmetic, floor division and modulo (by zero too: 0, as numpy's), shifts by any count,
# casts, and reductions with numpy's int64 accumulators.

INT_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64]
INT_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "floordiv": np.floor_divide, "mod": np.mod,
    "max": np.maximum, "min": np.minimum, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
    "shl": np.left_shift, "shr": np.right_shift,
}
INT_TENSOR_BINARY = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "floordiv": lambda a, b: a // b,
    "mod": lambda a, b: a % b, "max": lambda a, b: a.maximum(b), "min": lambda a, b: a.minimum(b),
    "and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b, "shl": lambda a, b: a << b,
    "shr": lambda a, b: a >> b,
}

INT_UNARY = {
    "neg": lambda t, x: (-t, np.negative(x)), "abs": lambda t, x: (t.abs(), np.abs(x)),
    "invert": lambda t, x: (~t, np.invert(x)), "lt": lambda t, x: ((t < 3).cast(t.dtype), (x < 3).astype(x.dtype)),
    "where": lambda t, x: ((t > 0).where(t, t * 2), np.where(x > 0, x, x * 2)),
}


def _int_input(rng, shape, dt) -> np.ndarray:
    info = np.iinfo(dt)
    x = rng.integers(-100, 100, size=shape).astype(np.int64)
    edges = np.array([info.min, info.max, info.min + 1, info.max - 1, -1, 0, 1, 2, 7, info.bits, 1 << 15],
                     np.int64)
    mask = rng.random(shape) < 0.4
    x[mask] = rng.choice(edges, size=int(mask.sum()))
    return x.astype(dt)  # wraps what the dtype cannot hold


@st.composite
def int_graphs(draw, max_ops: int = 6):
    dt = draw(st.sampled_from(INT_DTYPES))
    nd = draw(st.integers(1, 2))
    shape = tuple(draw(st.sampled_from([1, 3, 7, 130])) if i == nd - 1 else draw(st.integers(1, 4))
                  for i in range(nd))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    pool = [Special(Tensor(x), x, f"in{i}") for i, x in enumerate(_int_input(rng, shape, dt) for _ in range(2))]
    with np.errstate(all="ignore"):
        for _ in range(draw(st.integers(1, max_ops))):
            ints = [p for p in pool if p.x.dtype.kind in "iu"]  # float32 casts only end a chain
            a = ints[draw(st.integers(0, len(ints) - 1))]
            kind = draw(st.sampled_from(["binary", "binary", "binary", "unary", "cast", "reduce", "move"]))
            if kind == "binary":
                same = [p for p in pool if _broadcasts(p.x.shape, a.x.shape) and p.x.dtype == a.x.dtype]
                b = same[draw(st.integers(0, len(same) - 1))]
                name = draw(st.sampled_from(sorted(INT_BINARY)))
                pool.append(Special(INT_TENSOR_BINARY[name](a.t, b.t), INT_BINARY[name](a.x, b.x),
                                    f"{name}({a.desc}, {b.desc})"))
            elif kind == "unary":
                name = draw(st.sampled_from(sorted(INT_UNARY)))
                t, x = INT_UNARY[name](a.t, a.x)
                pool.append(Special(t, x, f"{name}({a.desc})"))
            elif kind == "cast":
                to = draw(st.sampled_from(INT_DTYPES + [np.float32]))
                pool.append(Special(a.t.cast(np.dtype(to)), a.x.astype(to), f"cast({a.desc}, {np.dtype(to)})"))
            elif kind == "reduce" and a.x.dtype.kind in "iu" and a.x.ndim:
                name = draw(st.sampled_from(["sum", "prod", "max", "min", "cumsum"]))
                axis = draw(st.integers(0, a.x.ndim - 1))
                ref = getattr(np, name)(a.x, axis=axis)
                if name in ("sum", "prod", "cumsum"):
                    ref = ref.astype(np.int64)  # numpy's accumulator (uint64 for unsigned: vkgraph's is int64)
                pool.append(Special(getattr(a.t, name)(axis), ref, f"{name}({a.desc}, {axis})"))
            elif kind == "move" and a.x.ndim:
                m = _move(draw, Item(a.t, a.x, 1.0, a.desc))
                pool.append(Special(m.t, m.x, m.desc))
    return pool[-1]


def _check_int(item: Special) -> None:
    got = item.t.numpy()
    ref = np.asarray(item.x)
    assert got.dtype == ref.dtype and got.shape == ref.shape, (item, got.dtype, ref.dtype, got.shape, ref.shape)
    if ref.dtype.kind == "f":
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), f"{item!r}: {got} vs {ref}"
    else:
        assert np.array_equal(got, ref), f"{item!r}: differs at {np.argwhere(got != ref)[:5].tolist()}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(int_graphs())
def test_integer_edge_value_graphs_match_numpy(item):
    _check_int(item)


@pytest.mark.slow
@settings(max_examples=flag("VKGRAPH_FUZZ_EXAMPLES"), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(int_graphs(max_ops=10))
def test_integer_edge_value_graphs_match_numpy_long(item):
    _check_int(item)

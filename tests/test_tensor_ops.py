"""Every Tensor operation against numpy: dtypes, broadcasting, non-contiguous views, zero-size and size-1 axes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from vkgraph.dtype import dtypes
from vkgraph.tensor import Tensor, cat, stack, where

rng = np.random.default_rng(0)
F16_TOL = {np.dtype(np.float32): 1e-6, np.dtype(np.float16): 2e-3, np.dtype(ml_dtypes.bfloat16): 1.6e-2}


def check(out, ref, tol: float | None = None, dtype=None, terms: float | None = None) -> None:
    """Shape, dtype and values by normalised error; NaN only where the reference has NaN. `terms`: the magnitude
    of what was summed into the values (e.g. sum of |x|), when that is larger than the values themselves (see
    tests/numerics.py)."""
    got = out.numpy() if isinstance(out, Tensor) else np.asarray(out)
    ref = np.asarray(ref)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if dtype is not None:
        assert got.dtype == np.dtype(dtype), (got.dtype, dtype)
    if ref.size == 0:
        return
    g64, r64 = got.astype(np.float64), ref.astype(np.float64)
    assert np.array_equal(np.isnan(g64), np.isnan(r64)), "NaN pattern differs"
    fin = ~np.isnan(r64)
    assert np.array_equal(np.isinf(g64[fin]), np.isinf(r64[fin])) and np.array_equal(
        g64[np.isinf(r64)], r64[np.isinf(r64)]), "inf pattern differs"
    ok = fin & ~np.isinf(r64)
    if not ok.any():
        return
    err = np.abs(g64[ok] - r64[ok]).max() / max(np.abs(r64[ok]).max(), terms or 0.0, 1e-30)
    tol = F16_TOL.get(got.dtype, 1e-6) if tol is None else tol
    assert err <= tol, f"normalised error {err:.3g} > {tol:.3g}"


def randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# ---- creation ----------------------------------------------------------------------------------------------------

def test_creation():
    check(Tensor.zeros(2, 3), np.zeros((2, 3), np.float32), 0, np.float32)
    check(Tensor.ones((4,), dtype="int8"), np.ones(4, np.int8), 0, np.int8)
    check(Tensor.full((2, 2), 7.5, dtypes.float16), np.full((2, 2), 7.5, np.float16), 0)
    check(Tensor.arange(10), np.arange(10, dtype=np.int32), 0, np.int32)
    check(Tensor.arange(2, 11, 3), np.arange(2, 11, 3, dtype=np.int32), 0)
    check(Tensor.arange(1.0, 0.0, -0.25), np.arange(1.0, 0.0, -0.25, dtype=np.float32))
    check(Tensor.linspace(-1, 1, 9), np.linspace(-1, 1, 9, dtype=np.float32))
    check(Tensor.eye(3, 5), np.eye(3, 5, dtype=np.float32), 0)
    x = Tensor(randn(3, 4))
    check(x.zeros_like(), np.zeros((3, 4), np.float32), 0)
    check(x.ones_like(dtype="bool"), np.ones((3, 4), bool), 0, bool)
    check(Tensor([[1, 2], [3, 4]]), np.array([[1, 2], [3, 4]], np.int32), 0, np.int32)
    check(Tensor([1.5, 2]), np.array([1.5, 2], np.float32), 0, np.float32)
    check(Tensor(3.0) + 1, np.float32(4.0), 0)
    assert Tensor.empty(5, 2).shape == (5, 2)
    assert np.asarray(Tensor(np.arange(3, dtype=np.int16))).dtype == np.int16


def test_random_numbers_are_reproducible_and_well_spread():
    import vkgraph.tensor as vt
    vt.manual_seed(1234)
    a, n, k = Tensor.rand(20000).numpy(), Tensor.randn(20000).numpy(), Tensor.randint(3, 9, (20000,)).numpy()
    vt.manual_seed(1234)
    assert np.array_equal(a, Tensor.rand(20000).numpy())
    assert not np.array_equal(a, Tensor.rand(20000).numpy())  # the counter moved on
    assert 0 <= a.min() and a.max() < 1 and abs(a.mean() - 0.5) < 0.01 and abs(a.var() - 1 / 12) < 0.005
    assert abs(n.mean()) < 0.03 and abs(n.std() - 1) < 0.03 and np.isfinite(n).all()
    assert k.dtype == np.int32 and k.min() == 3 and k.max() == 8
    assert np.histogram(a, bins=10, range=(0, 1))[0].min() > 1800


# ---- elementwise ----------------------------------------------------------------------------------------------------

FLOATS = [np.float32, np.float16, ml_dtypes.bfloat16]
UNARY = {
    "exp": (np.exp, 1), "exp2": (np.exp2, 1), "log": (np.log, 2), "log2": (np.log2, 2), "sin": (np.sin, 1),
    "cos": (np.cos, 1), "tanh": (np.tanh, 1), "sqrt": (np.sqrt, 2), "rsqrt": (lambda x: 1 / np.sqrt(x), 2),
    "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), 1), "relu": (lambda x: np.maximum(x, 0), 1),
    "silu": (lambda x: x / (1 + np.exp(-x)), 1), "abs": (np.abs, 1), "sign": (np.sign, 1),
    "floor": (np.floor, 1), "ceil": (np.ceil, 1), "round": (np.round, 1), "trunc": (np.trunc, 1),
    "square": (np.square, 1), "reciprocal": (lambda x: 1 / x, 2), "neg": (np.negative, 1),
    "gelu": (lambda x: 0.5 * x * (1 + np.vectorize(__import__("math").erf)(x / np.sqrt(2))), 1),
    "gelu_tanh": (lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))), 1),
}


@pytest.mark.parametrize("name", list(UNARY))
@pytest.mark.parametrize("dt", FLOATS, ids=lambda d: np.dtype(d).name)
def test_unary(name, dt):
    fn, domain = UNARY[name]
    x = randn(7, 33) * 3
    if domain == 2:
        x = np.abs(x) + 0.1
    x = x.astype(dt)
    t = Tensor(x)
    if name == "neg":
        out = -t
    elif name == "gelu_tanh":
        out = t.gelu("tanh")
    else:
        out = getattr(t, name)()
    ref = fn(x.astype(np.float32)).astype(dt)
    tol = {np.float32: 2e-6, np.float16: 2e-3, ml_dtypes.bfloat16: 1.6e-2}[dt]
    check(out, ref, tol, dt)


BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide, "maximum": np.maximum,
          "minimum": np.minimum, "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
          "eq": np.equal, "ne": np.not_equal}


@pytest.mark.parametrize("name", list(BINARY))
@pytest.mark.parametrize("da,db", [(np.float32, np.float32), (np.float16, np.float32), (np.int32, np.float32),
                                   (np.int8, np.int16), (np.uint8, np.int8), (np.bool_, np.int32)])
def test_binary_with_broadcasting(name, da, db):
    a = (randn(4, 1, 5) * 5).astype(da)
    b = (randn(3, 1) * 5 + 0.5).astype(db)
    if name == "div":
        b[b == 0] = 1
    out = getattr(Tensor(a), name)(Tensor(b)) if name in ("maximum", "minimum") else \
        getattr(Tensor(a), f"__{name if name != 'div' else 'truediv'}__")(Tensor(b))
    ref = BINARY[name](a, b)
    if ref.dtype == np.float64:
        ref = ref.astype(np.float32)
    check(out, ref)


@pytest.mark.parametrize("dt", [np.int8, np.uint8, np.int16, np.int32, np.uint32, np.int64])
def test_integer_ops_wrap_like_numpy(dt):
    info = np.iinfo(dt)
    lo = max(info.min, -1000)
    a = rng.integers(lo, min(info.max, 1000), (50,)).astype(dt)
    b = rng.integers(1 if info.min == 0 else -20, 20, (50,)).astype(dt)
    b[b == 0] = 3
    ta, tb = Tensor(a), Tensor(b)
    check(ta + tb, a + b, 0, dt)
    check(ta * tb, a * b, 0, dt)
    check(ta - tb, a - b, 0, dt)
    check(ta // tb, a // b, 0, dt)
    check(ta % tb, a % b, 0, dt)
    check(ta & tb, a & b, 0, dt)
    check(ta | tb, a | b, 0, dt)
    check(ta ^ tb, a ^ b, 0, dt)
    check(~ta, ~a, 0, dt)
    sh = (np.abs(b) % 4).astype(dt)
    check(ta << Tensor(sh), a << sh, 0, dt)
    check(ta >> Tensor(sh), a >> sh, 0, dt)
    check(ta.maximum(tb), np.maximum(a, b), 0, dt)
    check(ta.abs(), np.abs(a), 0, dt)
    check(ta.cast(dtypes.float32), a.astype(np.float32))


def test_scalars_are_weak_and_reflected_ops():
    x = randn(3, 4).astype(np.float16)
    t = Tensor(x)
    check(t * 2.5, x * np.float16(2.5), dtype=np.float16)
    check(2.5 - t, np.float16(2.5) - x, dtype=np.float16)
    check(1 / (t.abs() + 1), (1 / (np.abs(x) + 1)).astype(np.float16))
    i = Tensor(np.arange(6, dtype=np.int8))
    check(i * 3, np.arange(6, dtype=np.int8) * 3, 0, np.int8)
    check(i / 4, np.arange(6, dtype=np.float32) / 4, dtype=np.float32)
    check(2 ** Tensor(np.arange(5, dtype=np.int32)), 2 ** np.arange(5, dtype=np.int32), 0, np.int32)
    p = np.abs(randn(6)) + 0.5
    check(Tensor(p) ** 1.7, p ** np.float32(1.7))
    check(Tensor(-p) ** 3.0, (-p) ** np.float32(3))


def test_pow_mod_floor_on_floats_and_special_values():
    a = np.array([-3.5, -1.0, 0.0, 2.0, 7.25, np.inf, -np.inf], np.float32)
    b = np.array([2.0, 3.0, 1.5, -2.0, 2.5, 1.0, 2.0], np.float32)
    check(Tensor(a) % Tensor(b), np.mod(a, b))
    check(Tensor(a) // Tensor(b), np.floor_divide(a, b))
    check(Tensor(a).isnan(), np.isnan(a), 0, bool)
    check(Tensor(np.array([np.nan, 1.0], np.float32)) + 1, np.array([np.nan, 2.0], np.float32))


def test_a_view_of_padding_alone_reads_a_zero_the_arithmetic_after_it_keeps():
    # the special-value fuzzer's case: pad(x)[5:] is all border; lavapipe made `x / 0.0` of that zero garbage
    x = np.array([1e30, -0.132, 0.64], np.float32)
    border = np.pad(x, ((1, 2),))[5:]
    with np.errstate(all="ignore"):
        check(Tensor(x) / Tensor(x).pad(((1, 2),))[5:], x / border)
        check(Tensor(x).abs() / Tensor(x).pad(((1, 2),))[5:], np.abs(x) / border)
        check(Tensor(x).pad(((1, 2),))[5:] / Tensor(x).pad(((1, 2),))[5:], border / border)
        check(Tensor(np.full(3, np.inf, np.float32)) * Tensor(x).pad(((0, 5),))[5:], np.full(3, np.nan, np.float32))


def test_where_clip_casts_bitcast():
    c = rng.random((4, 5)) > 0.5
    x, y = randn(4, 5), randn(5)
    check(where(Tensor(c), Tensor(x), Tensor(y)), np.where(c, x, y))
    check(Tensor(c).where(1.0, Tensor(y)), np.where(c, 1.0, y).astype(np.float32))
    check(Tensor(x).clip(-0.5, 0.5), np.clip(x, -0.5, 0.5))
    check(Tensor(x).cast("int32"), x.astype(np.int32), 0, np.int32)
    check(Tensor(x * 300).cast("int8").cast("int32"), (x * 300).astype(np.int32).astype(np.int8), 0)
    check(Tensor(x).half(), x.astype(np.float16), 0, np.float16)
    check(Tensor(x).cast("bfloat16"), x.astype(ml_dtypes.bfloat16), 0, ml_dtypes.bfloat16)
    check(Tensor(x).bool(), x != 0, 0, bool)
    check(Tensor(x).bitcast("int32"), x.view(np.int32), 0, np.int32)
    check(Tensor(x.astype(np.float16)).bitcast("int16"), x.astype(np.float16).view(np.int16), 0, np.int16)
    check(Tensor(x.astype(ml_dtypes.bfloat16)).bitcast("uint16"), x.astype(ml_dtypes.bfloat16).view(np.uint16), 0)
    check(Tensor(c).logical_and(Tensor(~c)), np.zeros_like(c), 0, bool)
    check(Tensor(c).logical_not(), ~c, 0, bool)


# ---- reductions -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["sum", "prod", "max", "min", "mean", "var", "std", "any", "all", "logsumexp"])
@pytest.mark.parametrize("axis", [None, 0, 1, (0, 2), -1])
@pytest.mark.parametrize("keepdim", [False, True])
def test_reductions(op, axis, keepdim):
    x = randn(3, 37, 5)
    if op == "prod":
        x = 1 + x * 0.1
    if op in ("any", "all"):
        x = (x > 1.2).astype(np.float32) if op == "any" else (x > -2).astype(np.float32)
    t = Tensor(x)
    out = getattr(t, op)(axis, keepdim)
    kw = {"axis": axis, "keepdims": keepdim}
    if op in ("var", "std"):
        ref = getattr(np, op)(x.astype(np.float64), ddof=1, **kw)
    elif op == "logsumexp":
        ref = np.log(np.exp(x.astype(np.float64)).sum(**kw))
    else:
        ref = getattr(np, op)(x.astype(np.float64) if op not in ("any", "all") else x, **kw)
    ref = np.asarray(ref).astype(out.dtype.np)
    # signed terms can cancel to near 0 (a mean of 555 normals): bound sums and means by their terms' magnitude
    terms = getattr(np, op)(np.abs(x.astype(np.float64)), **kw).max() if op in ("sum", "mean") else None
    check(out, ref, 1e-5 if op == "prod" else 2e-6, terms=terms)  # a product's rounding grows with its length


@pytest.mark.parametrize("dt", [np.float16, ml_dtypes.bfloat16, np.int8, np.int32, np.uint8, np.bool_])
def test_reductions_over_dtypes(dt):
    x = (randn(6, 50) * 4).astype(dt)
    t = Tensor(x)
    acc = np.int32 if np.dtype(dt).kind in "biu" else np.float64
    want_sum = x.astype(acc).sum(1)
    if np.dtype(dt) == np.uint8:
        want_sum = x.astype(np.uint32).sum(1)
    check(t.sum(1), want_sum.astype(t.sum(1).dtype.np), 2e-3 if np.dtype(dt).kind == "f" else 0)
    check(t.max(1), x.max(1), 0, dt)
    check(t.min(0), x.min(0), 0, dt)
    check(t.argmax(1), x.astype(np.float32).argmax(1), 0, np.int32)
    check(t.argmin(0), x.astype(np.float32).argmin(0), 0, np.int32)


def test_arg_reductions_ties_nan_and_flat():
    x = np.array([[1, 5, 5, 2], [7, 7, 0, 7], [np.nan, 1, np.nan, 3]], np.float32)
    check(Tensor(x).argmax(1), np.argmax(x, 1), 0)
    check(Tensor(x[:2]).argmin(1), np.argmin(x[:2], 1), 0)
    check(Tensor(x[:2]).argmax(), np.argmax(x[:2]), 0)
    big = randn(3, 5000)
    check(Tensor(big).argmax(1, keepdim=True), big.argmax(1)[:, None], 0)


def test_long_reduction_splits_into_two_kernels():
    from vkgraph.realize import count_kernels
    x = randn(300_000)
    with count_kernels() as c:
        out = Tensor(x).sum().numpy()
    assert c.count == 2, c.names
    check(out, x.astype(np.float64).sum().astype(np.float32), 1e-5, terms=np.abs(x).sum())
    check(Tensor(x).max(), x.max(), 0)
    check(Tensor(x.reshape(2, -1)).mean(1), x.reshape(2, -1).mean(1), 1e-5, terms=np.abs(x).mean())


def test_cumsum_and_zero_size():
    x = randn(4, 9)
    check(Tensor(x).cumsum(1), np.cumsum(x, 1), 2e-6)
    check(Tensor(x).cumsum(0), np.cumsum(x, 0), 2e-6)
    check(Tensor(np.arange(10, dtype=np.int8)).cumsum(0), np.cumsum(np.arange(10, dtype=np.int8)), 0, np.int64)
    check(Tensor(np.zeros((3, 0), np.int16)).cumsum(1), np.zeros((3, 0), np.int64), 0, np.int64)
    z = np.zeros((0, 3), np.float32)
    check(Tensor(z).sum(0), z.sum(0), 0)
    check(Tensor(z).sum(1), z.sum(1), 0)
    check(Tensor(z) + 1, z + 1, 0)
    check(Tensor(z).reshape(3, 0).T, z.reshape(3, 0).T, 0)
    with pytest.raises(ValueError, match="identity"):
        Tensor(z).max(0)


@pytest.mark.parametrize("shape,axis", [((33,), 0), ((1000,), 0), ((1 << 20,), 0), ((2, 70_000), -1),
                                        ((5000, 3), 0), ((3, 1000, 5), 1), ((257, 2, 3), 0)])
def test_cumsum_long_and_inner_axes(shape, axis):
    x = randn(*shape)
    # against a float64 reference: numpy's own float32 cumsum is sequential and less accurate than ours
    check(Tensor(x).cumsum(axis), np.cumsum(x.astype(np.float64), axis), 1e-6)
    check((Tensor(x) * 2 + 1).cumsum(dim=axis), np.cumsum(x.astype(np.float64) * 2 + 1, axis), 1e-6)


def test_cumsum_dtypes_exact():
    wide = rng.integers(-2**31, 2**31, size=(3, 40_000), dtype=np.int64).astype(np.int32)
    check(Tensor(wide).cumsum(1), np.cumsum(wide, 1), 0, np.int64)  # numpy's int64 accumulator
    check(Tensor(wide).cumsum(1, dtype='int32'), np.cumsum(wide, 1, dtype=np.int32), 0, np.int32)  # wraps alike
    small = rng.integers(0, 256, size=(20_000, 2), dtype=np.uint8)
    check(Tensor(small).cumsum(0), np.cumsum(small, 0).astype(np.int64), 0, np.int64)  # numpy: uint64
    b = rng.random(5000) < 0.5
    check(Tensor(b).cumsum(0), np.cumsum(b), 0, np.int64)
    h = randn(3000, dtype=np.float16)
    check(Tensor(h).cumsum(0), np.cumsum(h.astype(np.float64)), 2e-3, np.float16)
    special = np.array([1, -0.0, np.inf, 2, -np.inf, 3] + [1] * 40 + [np.nan, 1], np.float32)
    check(Tensor(special).cumsum(0), np.cumsum(special), 0)


def test_cumsum_work_is_linear():
    """A 1<<20-long cumsum: the reductions it schedules read O(n) elements (a quadratic scan reads n * n), it
    takes a few small kernels, and it runs in well under a second on lavapipe."""
    import time

    from vkgraph.realize import REALIZED, count_kernels
    from vkgraph.schedule import Kernel, create_schedule
    from vkgraph.tensor import SCAN_CHUNK

    n = 1 << 20
    x = randn(n)
    t = Tensor(x)
    out = t.cumsum(0)
    sched = create_schedule([out.node], REALIZED)
    reads = sum(r.srcs[0].numel for k in sched.items if isinstance(k, Kernel)
                for r in k.root.toposort() if r.op.name == "REDUCE")
    assert reads <= 1.2 * (SCAN_CHUNK + 1) * n, reads
    with count_kernels() as c:
        out.realize()
    assert c.count <= 12, c.names
    check(out, np.cumsum(x.astype(np.float64)), 1e-6)
    t0 = time.perf_counter()
    t.cumsum(0).numpy()  # compiled now: the scan itself
    assert time.perf_counter() - t0 < 2.0


# ---- movement and indexing ------------------------------------------------------------------------------------------

def test_movement_ops_on_non_contiguous_views():
    x = randn(4, 6, 5)
    t = Tensor(x)
    check(t.permute(2, 0, 1).reshape(5, 24), x.transpose(2, 0, 1).reshape(5, 24), 0)
    check(t.transpose(0, 2)[1:, ::2].reshape(-1), x.transpose(2, 1, 0)[1:, ::2].reshape(-1), 0)
    check(t[:, None, 2:5].expand(4, 3, 3, 5), np.broadcast_to(x[:, None, 2:5], (4, 3, 3, 5)), 0)
    check(t.flip((0, 2)).pad(((1, 0), (0, 0), (2, 1))), np.pad(x[::-1, :, ::-1], ((1, 0), (0, 0), (2, 1))), 0)
    check(t.pad((1, 1), value=-3.0), np.pad(x, ((0, 0), (0, 0), (1, 1)), constant_values=-3), 0)
    check(t.pad(((-1, 0), (0, -2), (0, 0))), x[1:, :-2], 0)
    v = np.array([[0.3, -0.7]], np.float32)  # padding only, down to a scalar (found by the long fuzz run)
    check(Tensor(v).max(0).pad(((1, 2),))[4:].max(0), np.pad(v.max(0), (1, 2))[4:].max(0), 0)
    check(Tensor(v).max(0).pad(((1, 2),))[4], np.float32(0), 0)
    check(t.squeeze(), x, 0)
    check(t[:, :1].squeeze(1), x[:, 0], 0)
    check(t.unsqueeze(-1).shape and t.unsqueeze(-1), x[..., None], 0)
    check(t.flatten(1), x.reshape(4, 30), 0)
    check(t.T, x.T, 0)
    check(t.repeat(2, 1, 3), np.tile(x, (2, 1, 3)), 0)
    a, b, c = t.split([1, 2, 3], dim=1)
    check(b, x[:, 1:3], 0)
    check(t.chunk(3, 2)[2], np.array_split(x, 3, 2)[2], 0)
    check(cat([t, t * 2, t[:, :1]], dim=1), np.concatenate([x, x * 2, x[:, :1]], 1), 0)
    check(stack([t[0], t[1]], dim=2), np.stack([x[0], x[1]], 2), 0)
    check(cat([Tensor(x > 0), Tensor(x < 0)], 0), np.concatenate([x > 0, x < 0]), 0, bool)
    check(t.reshape(2, 3, 4, 5).permute(3, 1, 0, 2).reshape(15, 8) + 1,
          x.reshape(2, 3, 4, 5).transpose(3, 1, 0, 2).reshape(15, 8) + 1, 0)


@pytest.mark.parametrize("idx", [
    1, -1, (slice(None), 2), (Ellipsis, 1), (None, 0, slice(1, None, 2)), (slice(None, None, -1),),
    (slice(3, 0, -2), Ellipsis, None), (0, -1, 2), (slice(10, 20),), (Ellipsis,),
])
def test_getitem_basic(idx):
    x = randn(5, 6, 3)
    check(Tensor(x)[idx], x[idx], 0)


def test_getitem_with_integer_tensors_and_embedding():
    from vkgraph.tensor import embedding
    x = randn(6, 4)
    idx = np.array([[0, 5], [-1, 2]])
    check(Tensor(x)[idx], x[idx], 0)
    check(Tensor(x)[:, [3, 0]], x[:, [3, 0]], 0)
    check(Tensor(x)[Tensor(np.array([2, 2, 1], np.int32))], x[[2, 2, 1]], 0)
    check(embedding(Tensor(np.array([1, 0, 5], np.int32)), Tensor(x)), x[[1, 0, 5]], 0)
    check(Tensor(x.T)[:, Tensor(np.array([4, 1], np.int32))] * 2, x.T[:, [4, 1]] * 2, 0)


def test_setitem_writes_in_place():
    x = np.zeros((4, 6), np.float32)
    t = Tensor(x)
    t[1] = 3.0
    x[1] = 3.0
    t[:, 4:6] = Tensor(np.ones((4, 2), np.float32) * 2)
    x[:, 4:6] = 2
    t[2:, ::2] = Tensor(np.arange(3, dtype=np.int32))
    x[2:, ::2] = np.arange(3)
    t[0, 1:3] = t[3, 0:2] + 10  # reads the tensor it writes
    x[0, 1:3] = x[3, 0:2] + 10
    check(t, x, 0)
    t[...] = 0
    check(t, np.zeros((4, 6)), 0)


def test_setitem_into_a_kv_cache_slice_reuses_the_kernel():
    from vkgraph.realize import count_kernels
    cache = Tensor.zeros(2, 8, 4).realize()
    ref = np.zeros((2, 8, 4), np.float32)
    with count_kernels() as c:
        for pos in range(3):
            new = randn(2, 1, 4)
            cache[:, pos:pos + 1] = Tensor(new)
            ref[:, pos:pos + 1] = new
    check(cache, ref, 0)
    assert c.count == 3 and len(set(c.names)) == 1


def test_stale_lazy_reader_of_an_assigned_buffer_is_refused():
    t = Tensor(np.zeros(4, np.float32))
    lazy = t + 1
    t[0] = 5.0
    with pytest.raises(RuntimeError, match="written in place"):
        lazy.numpy()


# ---- linear algebra and nn ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sa,sb", [((70, 90), (90, 130)), ((3, 65, 17), (17, 64)), ((2, 1, 5, 80), (3, 80, 66)),
                                   ((9,), (9, 70)), ((64, 33), (33,)), ((1, 64), (64, 96)), ((5, 0), (0, 4))])
def test_matmul_shapes(sa, sb):
    a, b = randn(*sa), randn(*sb)
    check(Tensor(a) @ Tensor(b), a @ b, 5e-6)


def test_matmul_float16_accumulates_in_float32_and_fuses_epilogue():
    from vkgraph.realize import count_kernels
    a, b, bias = randn(96, 200).astype(np.float16), randn(200, 80).astype(np.float16), randn(80)
    with count_kernels() as c:
        out = ((Tensor(a) @ Tensor(b)).float() + Tensor(bias)).relu().numpy()
    ref = np.maximum(a.astype(np.float32) @ b.astype(np.float32) + bias, 0)
    check(out, ref, 5e-4)
    assert c.count == 1
    check(Tensor(a).linear(Tensor(b.T)), (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16), 5e-4)
    check(Tensor(a.T).T @ Tensor(b), (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16), 5e-4)


def _softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def test_nn_functional():
    x = randn(6, 40) * 3
    w, b = randn(40), randn(40)
    check(Tensor(x).softmax(), _softmax(x), 2e-6)
    check(Tensor(x).softmax(0), _softmax(x, 0), 2e-6)
    check(Tensor(x).log_softmax(), np.log(_softmax(x.astype(np.float64))), 2e-6)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    check(Tensor(x).layer_norm(40, Tensor(w), Tensor(b)), (x - mu) / np.sqrt(var + 1e-5) * w + b, 2e-6)
    check(Tensor(x).rms_norm(Tensor(w)), x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w, 2e-6)
    check(Tensor(x.astype(np.float16)).softmax(), _softmax(x.astype(np.float16).astype(np.float32)), 2e-3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_scaled_dot_product_attention(causal, mask):
    q, k, v = randn(2, 3, 20, 16), randn(2, 3, 24, 16), randn(2, 3, 24, 8)
    s = q @ k.transpose(0, 1, 3, 2) / 4
    m = None
    if causal:
        s = np.where(np.tril(np.ones((20, 24), bool)), s, -np.inf)
    if mask == "bool":
        mnp = rng.random((20, 24)) > 0.3
        mnp[:, 0] = True
        s, m = np.where(mnp, s, -np.inf), Tensor(mnp)
    elif mask == "float":
        mnp = randn(20, 24)
        s, m = s + mnp, Tensor(mnp)
    out = Tensor(q).scaled_dot_product_attention(Tensor(k), Tensor(v), attn_mask=m, is_causal=causal)
    check(out, _softmax(s) @ v, 5e-4)


def test_item_tolist_len_repr():
    t = Tensor(np.array([[1.5, 2.5]], np.float32))
    assert t.sum().item() == 4.0
    assert t.tolist() == [[1.5, 2.5]]
    assert len(t) == 1 and "lazy" in repr(t + 1)
    with pytest.raises(ValueError, match="exactly one"):
        t.item()


@pytest.mark.slow
def test_tensors_over_128_mib():
    n = 36 * 1024 * 1024 + 4  # float32: 144 MiB, over lavapipe's maxStorageBufferRange
    x = rng.standard_normal(n, dtype=np.float32)
    t = Tensor(x)
    y = (t * 2 + 1).realize()
    check(y[-7:], x[-7:] * 2 + 1)
    check(y[: n // 2].reshape(-1, 2)[5:9], (x[: n // 2] * 2 + 1).reshape(-1, 2)[5:9])
    check(t.sum(), x.astype(np.float64).sum().astype(np.float32), 1e-4, terms=np.abs(x).sum(dtype=np.float64))
    check(t.max(), x.max(), 0)
    y[n - 2:] = 0.5
    got = y.numpy()
    assert got[-1] == 0.5 and got[-3] == x[-3] * 2 + 1


def test_float16_rounding_is_bit_exact_including_subnormals():
    mags = np.float32(10) ** rng.integers(-9, 6, 20000).astype(np.float32)
    x = np.concatenate([rng.standard_normal(20000).astype(np.float32) * mags,
                        np.array([65519, 65520, 65504, 1e-8, 3e-8, -2.98e-8, 6.1e-5, np.inf, -np.inf], np.float32)])
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16)
    assert np.array_equal(Tensor(x).half().numpy().view(np.uint16), ref.view(np.uint16))
    assert np.array_equal(Tensor(x).cast("bfloat16").numpy().view(np.uint16),
                          x.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_fused_reductions_over_a_long_row_match_numpy():
    """Sampling's shape: several dependent reductions over a vocabulary-sized row, in one wide workgroup."""
    x = randn(2, 40000)
    t = Tensor(x)
    p = (t - t.max(-1, keepdim=True)).exp()
    p = p / p.sum(-1, keepdim=True)
    got_arg, got_max = p.argmax(-1).numpy(), p.max(-1).numpy()
    e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    ref = e / e.sum(-1, keepdims=True)
    np.testing.assert_array_equal(got_arg, ref.argmax(-1))
    np.testing.assert_allclose(got_max, ref.max(-1), rtol=1e-5)


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_matmul_of_transposed_operands(ta, tb):
    """Transposed (column-major) operands are tiled along their contiguous axis; results are the same."""
    from vkgraph.codegen.lower import _column_major

    rng = np.random.default_rng(5)
    a = rng.standard_normal((70, 45)).astype(np.float32)
    b = rng.standard_normal((45, 130)).astype(np.float32)
    x = Tensor(np.ascontiguousarray(a.T)).T if ta else Tensor(a)
    y = Tensor(np.ascontiguousarray(b.T)).T if tb else Tensor(b)
    assert _column_major(x.node) == ta and _column_major(y.node) == tb
    check(x @ y, a.astype(np.float64) @ b.astype(np.float64), 1e-5)

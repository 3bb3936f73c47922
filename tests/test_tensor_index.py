"""Indexing (gather, scatter family, advanced reads and writes, masks), sorting, einsum and grouped-query attention
against numpy, on hypothesis-drawn small shapes with size-1 and empty axes; their gradients where they have one."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gradcheck import check_grad
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vkgraph
from vkgraph import Tensor
from vkgraph.nn import functional as F

FAST = settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
shape3 = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


@FAST
@given(shape=shape3, seed=st.integers(0, 2**16), data=st.data())
def test_gather_and_take_along(shape, seed, data):
    rng = np.random.default_rng(seed)
    dim = data.draw(st.integers(0, len(shape) - 1))
    x = rng.standard_normal(shape).astype(np.float32)
    ishape = tuple(data.draw(st.integers(0, s)) if d != dim else data.draw(st.integers(0, 5))
                   for d, s in enumerate(shape))
    idx = rng.integers(-shape[dim], shape[dim], ishape)
    want = np.take_along_axis(x[tuple(slice(0, i) if d != dim else slice(None) for d, i in enumerate(ishape))],
                              np.where(idx < 0, idx + shape[dim], idx), dim)
    np.testing.assert_array_equal(Tensor(x).gather(dim, Tensor(idx.astype(np.int32))).numpy(), want)


def _ref_scatter(x, dim, idx, src, mode, include_self=True):
    out = x.copy().astype(np.float64)
    hit = np.zeros(x.shape, bool)
    acc: dict = {}
    for pos in np.ndindex(idx.shape):
        tgt = list(pos)
        tgt[dim] = idx[pos]
        tgt = tuple(tgt)
        acc.setdefault(tgt, []).append(src[pos])
    for tgt, vals in acc.items():
        base = [x[tgt]] if include_self and mode != "replace" else []
        allv = base + vals
        out[tgt] = {"replace": vals[-1], "sum": sum(allv), "prod": math.prod(allv), "amax": max(allv),
                    "amin": min(allv), "mean": sum(allv) / len(allv)}[mode]
        hit[tgt] = True
    return out


@pytest.mark.parametrize("mode", ["replace", "sum", "prod", "amax", "amin", "mean"])
@FAST
@given(shape=shape3, seed=st.integers(0, 2**16), include=st.booleans(), data=st.data())
def test_scatter_family(mode, shape, seed, include, data):
    rng = np.random.default_rng(seed)
    dim = data.draw(st.integers(0, len(shape) - 1))
    x = rng.standard_normal(shape).astype(np.float32)
    ishape = tuple(data.draw(st.integers(0, s)) if d != dim else data.draw(st.integers(0, 4))
                   for d, s in enumerate(shape))
    idx = rng.integers(0, shape[dim], ishape)
    src = rng.standard_normal(ishape).astype(np.float32)
    want = _ref_scatter(x, dim, idx, src, mode, include)
    t, ti, ts = Tensor(x), Tensor(idx.astype(np.int32)), Tensor(src)
    if mode == "replace":
        got = t.scatter(dim, ti, ts)
    elif mode == "sum" and include:
        got = t.scatter_add(dim, ti, ts)
    else:
        got = t.scatter_reduce(dim, ti, ts, mode, include_self=include)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_scatter_value_and_grads():
    x = np.zeros((3, 4), np.float32)
    got = Tensor(x).scatter(1, Tensor(np.array([[0], [3], [1]], np.int32)), value=2.5)
    np.testing.assert_array_equal(got.numpy(), [[2.5, 0, 0, 0], [0, 0, 0, 2.5], [0, 2.5, 0, 0]])
    rng = np.random.default_rng(1)
    idx = np.array([[0, 2, 2], [1, 0, 1]])
    src = rng.standard_normal((2, 3))
    base = rng.standard_normal((3, 3))

    def ref_add(b, s):
        out = b.copy()
        np.add.at(out, (idx, np.arange(3)[None, :].repeat(2, 0)), s)
        return out
    check_grad(lambda b, s: b.scatter_add(0, Tensor(idx.astype(np.int32)), s), ref_add, [base, src])
    check_grad(lambda b: b.gather(1, Tensor(idx.astype(np.int32))), lambda b: b[np.arange(2)[:, None], idx], [base])


def test_index_select_masked_fill_one_hot():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    np.testing.assert_array_equal(Tensor(x).index_select(1, Tensor(np.array([4, 0, 0], np.int32))).numpy(),
                                  x[:, [4, 0, 0]])
    m = x > 0
    np.testing.assert_array_equal(Tensor(x).masked_fill(Tensor(m), -1.0).numpy(), np.where(m, -1, x))
    np.testing.assert_array_equal(Tensor(x).masked_fill(Tensor(m[0]), 0.0).numpy(), np.where(m[0], 0, x))
    c = np.array([[0, 3], [2, 2]], np.int32)
    np.testing.assert_array_equal(F.one_hot(Tensor(c), 5).numpy(), np.eye(5, dtype=np.int32)[c])
    np.testing.assert_array_equal(Tensor(c).one_hot().numpy(), np.eye(4, dtype=np.int32)[c])
    np.testing.assert_array_equal(Tensor(x).masked_select(Tensor(m)).numpy(), x[m])
    np.testing.assert_array_equal(Tensor(x).nonzero().numpy(), np.argwhere(x))


INDEXES = [
    lambda a: (np.array([[0, 2], [1, 1]]), slice(None), np.array([3, 4])),
    lambda a: (slice(None), np.array([0, -1]), np.array([1, 2])),
    lambda a: (0, slice(None), np.array([4, 1, 1])),
    lambda a: (a > 0.2,),
    lambda a: (slice(1, 3), (a[0] > 0)),
    lambda a: (np.array([True, False, True]), slice(None), [0, 2]),
    lambda a: (Ellipsis, [1, 0], [0, 0]),
    lambda a: (np.zeros((0,), np.int64), slice(None)),
    lambda a: ([[1], [2]], [[0, 1, 2]], 3),
]


@pytest.mark.parametrize("k", range(len(INDEXES)))
def test_advanced_read_and_write(k):
    rng = np.random.default_rng(k)
    a = rng.standard_normal((3, 4, 5)).astype(np.float32)
    idx = INDEXES[k](a)
    tidx = tuple(Tensor(i) if isinstance(i, np.ndarray) and i.dtype == bool and k % 2 else i for i in idx)
    want = a[idx]
    got = Tensor(a)[tidx]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.numpy(), want)
    b = a.copy()
    b[idx] = np.arange(want.size, dtype=np.float32).reshape(want.shape)
    t = Tensor(a.copy())
    t[tidx] = Tensor(np.arange(want.size, dtype=np.float32).reshape(want.shape))
    np.testing.assert_array_equal(t.numpy(), b)
    b[idx] = 7
    t[tidx] = 7.0
    np.testing.assert_array_equal(t.numpy(), b)


def test_index_put_accumulate_and_duplicates():
    x = np.zeros(5, np.float32)
    idx = np.array([1, 3, 1, 1])
    v = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    acc = Tensor(x).index_put((Tensor(idx.astype(np.int32)),), Tensor(v), accumulate=True)
    want = x.copy()
    np.add.at(want, idx, v)
    np.testing.assert_array_equal(acc.numpy(), want)
    last = Tensor(x).index_put((Tensor(idx.astype(np.int32)),), Tensor(v))
    np.testing.assert_array_equal(last.numpy(), [0, 4, 0, 2, 0])  # the last write wins, as numpy's x[idx] = v
    rng = np.random.default_rng(3)
    check_grad(lambda t: t[Tensor(np.array([[0, 2], [1, 1]], np.int32)), 1:],
               lambda t: t[np.array([[0, 2], [1, 1]]), 1:], [rng.standard_normal((3, 4))])


@FAST
@given(shape=st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple), seed=st.integers(0, 2**16),
       descending=st.booleans(), ties=st.booleans(), nans=st.booleans(), data=st.data())
def test_sort(shape, seed, descending, ties, nans, data):
    rng = np.random.default_rng(seed)
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = rng.standard_normal(shape).astype(np.float32)
    if ties:
        x = np.round(x)
    if nans and x.size:
        x.flat[rng.integers(0, x.size)] = np.nan
    nan = np.isnan(x)
    filled = np.where(nan, 0, x).astype(np.float64)
    # stable, NaN as the largest: last ascending, first descending
    primary, secondary = (~nan, -filled) if descending else (nan, filled)
    moved = [np.moveaxis(v, dim, -1) for v in (secondary, primary)]
    order = np.zeros(moved[0].shape, np.int64)
    for pos in np.ndindex(moved[0].shape[:-1]):
        order[pos] = np.lexsort((moved[0][pos], moved[1][pos]))
    order = np.moveaxis(order, -1, dim)
    vals, idx = Tensor(x).sort(dim, descending=descending)
    np.testing.assert_array_equal(idx.numpy(), order)
    np.testing.assert_array_equal(vals.numpy(), np.take_along_axis(x, order, dim))
    np.testing.assert_array_equal(Tensor(x).argsort(dim, descending).numpy(), order)


def test_topk_kthvalue_median_and_grads():
    rng = np.random.default_rng(4)
    x = rng.permutation(24).reshape(4, 6).astype(np.float32)
    v, i = Tensor(x).topk(3)
    np.testing.assert_array_equal(v.numpy(), -np.sort(-x, -1)[:, :3])
    np.testing.assert_array_equal(i.numpy(), np.argsort(-x, -1)[:, :3])
    v, i = Tensor(x).topk(2, dim=0, largest=False)
    np.testing.assert_array_equal(v.numpy(), np.sort(x, 0)[:2])
    v, i = Tensor(x).kthvalue(2, 1, keepdim=True)
    np.testing.assert_array_equal(v.numpy(), np.sort(x, 1)[:, 1:2])
    np.testing.assert_array_equal(i.numpy(), np.argsort(x, 1)[:, 1:2])
    v, i = Tensor(x).median(0)
    np.testing.assert_array_equal(v.numpy(), np.sort(x, 0)[1])  # the lower of the two middles
    np.testing.assert_array_equal(i.numpy(), np.argsort(x, 0)[1])
    assert Tensor(x).median().item() == np.sort(x.ravel())[11]
    y = x.copy()
    y[2, 3] = np.nan
    assert math.isnan(Tensor(y).median().item())
    assert np.isnan(Tensor(y).median(1)[0].numpy()[2])
    with pytest.raises(ValueError):
        Tensor(x).topk(7)
    xs = rng.permutation(12).reshape(3, 4) / 5.0
    check_grad(lambda t: t.sort(-1)[0] * Tensor(np.arange(4, dtype=np.float32)),
               lambda t: np.sort(t, -1) * np.arange(4), [xs])
    check_grad(lambda t: t.topk(2, 0)[0], lambda t: -np.sort(-t, 0)[:2], [xs])


EQUATIONS = [
    ("ij,jk->ik", [(3, 4), (4, 5)]), ("ij,jk", [(3, 4), (4, 5)]), ("ii->i", [(4, 4)]), ("ii", [(4, 4)]),
    ("bij,jk->bik", [(2, 3, 4), (4, 5)]), ("...ij,jk->...ik", [(5, 1, 3, 4), (4, 2)]), ("ij->", [(3, 4)]),
    ("ij->ji", [(3, 4)]), ("i,i->", [(4,), (4,)]), ("i,j->ij", [(3,), (5,)]), ("bij,bkj->bik", [(2, 3, 4), (2, 5, 4)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]), ("...j,j", [(2, 3, 4), (4,)]), ("iij->j", [(3, 3, 2)]),
    ("ab...,b...->a...", [(2, 3, 4), (1, 3, 4)]), ("ijk,ikl->jl", [(2, 0, 3), (2, 3, 4)]), ("i->", [(0,)]),
    ("bhqd,bhkd->bhqk", [(1, 2, 17, 16), (1, 2, 20, 16)]), ("ji,ij->", [(3, 3), (3, 3)]),
]


@pytest.mark.parametrize("k", range(len(EQUATIONS)))
def test_einsum(k):
    eq, shapes = EQUATIONS[k]
    rng = np.random.default_rng(k)
    ops = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    want = np.einsum(eq, *[o.astype(np.float64) for o in ops])
    got = vkgraph.einsum(eq, *[Tensor(o) for o in ops]).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_einsum_errors_and_grad():
    with pytest.raises(ValueError):
        vkgraph.einsum("ij,jk->ik", Tensor(np.ones((2, 3), np.float32)), Tensor(np.ones((4, 2), np.float32)))
    with pytest.raises(ValueError):
        vkgraph.einsum("ij->k", Tensor(np.ones((2, 3), np.float32)))
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((2, 3, 3)), rng.standard_normal((3, 4))
    check_grad(lambda a, b: vkgraph.einsum("bii,ij->bj", a, b), lambda a, b: np.einsum("bii,ij->bj", a, b), [a, b])


def test_sdpa_enable_gqa():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 4, 3, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    got = F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), enable_gqa=True).numpy()
    kk, vv = np.repeat(k, 2, 1), np.repeat(v, 2, 1)
    s = q @ kk.transpose(0, 1, 3, 2) / math.sqrt(8)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(got, p / p.sum(-1, keepdims=True) @ vv, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        F.scaled_dot_product_attention(Tensor(q[:, :3]), Tensor(k), Tensor(v), enable_gqa=True)


def test_running_and_scattered_extremes_of_unsigned_and_int_min_values():
    """The masked-out fill is the identity of max (the dtype's minimum), not -max: unsigned types and INT_MIN."""
    u = np.array([3, 1, 5, 2], np.uint8)
    vals, idx = Tensor(u).cummax(0)
    np.testing.assert_array_equal(vals.numpy(), np.maximum.accumulate(u))
    np.testing.assert_array_equal(idx.numpy(), [0, 0, 2, 2])
    lo = np.iinfo(np.int32).min
    m = np.array([lo, lo, 4], np.int32)
    np.testing.assert_array_equal(Tensor(m).cummax(0)[0].numpy(), np.maximum.accumulate(m))
    got = Tensor(np.zeros(2, np.uint8)).scatter_reduce(0, Tensor(np.array([1, 1], np.int32)),
                                                       Tensor(np.array([7, 9], np.uint8)), "amax", include_self=False)
    np.testing.assert_array_equal(got.numpy(), [0, 9])

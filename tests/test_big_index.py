"""Index spaces past 2^31 and 2^32 elements (issue 13): built from broadcasts and constants, so no huge buffer is
needed. Reductions along axes where nothing changes fold; what must be walked indexes in 64 bits where 32 do not
reach, which the tests below also reach at small sizes by lowering the 32-bit bound (symbolic.NARROW)."""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest
from numerics import assert_close_to_terms

import vkgraph
import vkgraph.realize as realize_mod
from vkgraph.codegen import symbolic
from vkgraph.realize import count_kernels, limits
from vkgraph.runtime import get_device
from vkgraph.schedule import create_schedule
from vkgraph.tensor import Tensor

lower_mod = importlib.import_module("vkgraph.codegen.lower")  # the package exports the function under its name
BIG = (2**31 + 8, 2**32 + 8)
X = np.array([1.5, -2.0, 0.25, 3.0, -0.5], np.float32)


@pytest.mark.parametrize("n", BIG)
def test_sum_mean_max_of_constants_past_2_31(n):
    assert np.isclose(Tensor.ones(n).sum().numpy(), n, rtol=1e-6)
    assert Tensor.ones(n).mean().numpy() == 1.0
    assert Tensor.full(n, -2.5).max().numpy() == -2.5
    assert Tensor.full(n, 0.75).min().numpy() == 0.75
    assert Tensor.ones(n, dtype="int32").sum().numpy() == np.ones(1, np.int32).sum() * n


def test_constant_reductions_walk_nothing():
    """10^12 virtual elements: the issue's glslang failure (`numeric literal too big`) and no GPU loop at all."""
    assert Tensor.zeros(10**12).sum().numpy() == 0.0
    assert np.isclose(Tensor.ones(10**12).sum().numpy(), 1e12, rtol=1e-6)
    assert Tensor.ones(10**12).mean().numpy() == 1.0
    assert np.isclose(Tensor.full((10**6, 10**6), 3.0).sum().numpy(), 3e12, rtol=1e-6)


@pytest.mark.parametrize("n", BIG)
def test_broadcasts_of_two_vectors_past_2_31(n):
    """A small vector along one axis, a constant or a second broadcast vector along a huge one."""
    x = Tensor(X.reshape(-1, 1))
    y = Tensor(np.ones((1, 1), np.float32)).expand(1, n)
    s = (x + y).sum(1).numpy()
    np.testing.assert_allclose(s, (X + 1) * np.float64(n), rtol=1e-6)
    np.testing.assert_allclose((x * y).max(1).numpy(), X)
    np.testing.assert_allclose((x + y).sum().numpy(), (X + 1).sum() * np.float64(n), rtol=1e-6)
    np.testing.assert_allclose((x * y).mean().numpy(), X.mean(), rtol=1e-6)


@pytest.mark.parametrize("n", BIG)
def test_elementwise_then_reduce_past_2_31(n):
    x = Tensor(X.reshape(-1, 1)).expand(5, n)
    np.testing.assert_allclose(((x * 2 + 1).exp() * 0.5).sum(1).numpy(),
                               np.exp(X * 2 + 1) * 0.5 * np.float64(n), rtol=2e-6)
    np.testing.assert_allclose((x.abs() - 1).max().numpy(), (np.abs(X) - 1).max())
    with count_kernels() as c:
        assert np.isclose(x.sum().numpy(), X.sum() * np.float64(n), rtol=1e-6)
    assert c.count == 1


def test_products_over_constant_axes_past_2_31():
    """A product along an axis where nothing changes is the value to the power of its length (by squaring)."""
    n = 2**31 + 8
    x = np.array([1, -1, 0.5, 2, np.nan, -0.0, 1.0000001], np.float32)
    with np.errstate(over="ignore"):
        want = np.array([1, 1, 0, np.inf, np.nan, 0, np.float32(1.0000001) ** np.float64(n)], np.float32)
    np.testing.assert_equal((Tensor(x.reshape(-1, 1)) * Tensor.ones(1, n)).prod(1).numpy(), want)
    assert Tensor.full(10**12, -1.0).prod().numpy() == 1.0 and Tensor.full(10**12 + 1, -1.0).prod().numpy() == -1.0
    p = Tensor.full(n, 3, dtype="int32").prod()
    assert int(p.numpy()) == int(np.uint64(pow(3, n, 2**64)).astype(p.dtype.np))  # wraps as numpy's would
    np.testing.assert_allclose(Tensor.full(1000, 1.01).prod().numpy(), np.full(1000, 1.01, np.float32).prod(),
                               rtol=2e-5)


def test_argmax_past_2_31_raises_before_gpu_work():
    with count_kernels() as c, pytest.raises(OverflowError, match="argmax/argmin"):
        Tensor.ones(2**31 + 8).argmax().numpy()
    assert c.count == 0


@pytest.mark.slow
def test_the_issues_broadcast_sum_of_two_vectors():
    """50000 x 50000 = 2.5e9 elements walked (about 5 s on lavapipe alone)."""
    a = Tensor(np.ones((50000, 1), np.float32))
    b = Tensor(np.ones((1, 50000), np.float32))
    assert (a + b).sum().numpy() == 5e9


@pytest.mark.slow
def test_dependent_reductions_past_2_32(monkeypatch):
    """65537^2 > 2^32 elements, every one computed: a sum and a max (each a minute or more on a busy lavapipe)."""
    q = get_device().queue
    monkeypatch.setattr(q, "timeout_s", 900.0)
    rng = np.random.default_rng(0)
    u = rng.uniform(0.5, 1.5, 65537).astype(np.float32)
    v = rng.uniform(0.5, 1.5, 65537).astype(np.float32)
    a, b = Tensor(u.reshape(-1, 1)), Tensor(v.reshape(1, -1))
    np.testing.assert_allclose((a * b).sum().numpy(), np.float64(u.sum()) * np.float64(v.sum()), rtol=1e-5)
    assert (a * b).max().numpy() == np.float32(u.max()) * np.float32(v.max())


@pytest.mark.slow
def test_outputs_past_2_31_elements():
    """A materialized 50000 x 50000 uint8 result (2.5e9 elements, bound in pieces, written by 64-bit element
    indices), then read back through slices and reductions. Needs a device that allocates 2.5 GB at once (the
    H200; lavapipe's limit is 2 GiB)."""
    info = get_device().info
    n = 50000
    if min(info.max_allocation_size, info.max_buffer_size) < n * n:
        pytest.skip(f"{info.name} allocates at most {info.max_allocation_size} bytes at once")
    u = (np.arange(n) % 7).astype(np.uint8)
    v = (np.arange(n) % 5).astype(np.uint8)
    y = (Tensor(u.reshape(-1, 1)) + Tensor(v.reshape(1, -1))).realize()
    np.testing.assert_equal(y[n - 1].numpy(), u[-1] + v)
    np.testing.assert_equal(y[:, n - 3].numpy(), u + v[-3])
    np.testing.assert_equal(y[40000:40003, 49990:].numpy(), u[40000:40003, None] + v[None, 49990:])
    assert y.max().numpy() == 10
    want = int(u.astype(np.int64).sum()) * n + int(v.astype(np.int64).sum()) * n
    assert int(y.cast("int64").sum().numpy()) == want


# ---- the 64-bit paths at small sizes ---------------------------------------------------------------------------


@pytest.fixture
def narrow_4096(monkeypatch):
    """Index values past 4095 count as 64-bit: every path that sizes past 2^31 take runs on a few thousand
    elements. The lowering and schedule caches are emptied around the test, as the bound is not part of their
    keys."""
    vkgraph.clear_caches()
    monkeypatch.setattr(symbolic, "NARROW", 1 << 12)
    yield
    monkeypatch.undo()
    vkgraph.clear_caches()


def _glsl(t: Tensor) -> str:
    sched = create_schedule([t.node], realize_mod.REALIZED)
    return "\n".join(p.src for item in sched.items for p in lower_mod.lower(item, limits()).programs)


def test_wide_paths_render_64_bit_arithmetic(narrow_4096):
    rng = np.random.default_rng(1)
    a = Tensor(rng.standard_normal((90, 1)).astype(np.float32))
    b = Tensor(rng.standard_normal((1, 70)).astype(np.float32))
    assert "int64_t" in _glsl((a + b) * 2)
    assert "int64_t" in _glsl(Tensor(rng.standard_normal(9000).astype(np.float32)).sum())


def test_wide_elementwise_views_and_pieces_match_numpy(narrow_4096):
    rng = np.random.default_rng(2)
    u = rng.standard_normal((90, 1)).astype(np.float32)
    v = rng.standard_normal((1, 70)).astype(np.float32)
    m = rng.standard_normal((75, 80)).astype(np.float32)
    a, b, t = Tensor(u), Tensor(v), Tensor(m)
    np.testing.assert_allclose(((a + b) * 2).numpy(), (u + v) * 2, rtol=1e-6)
    np.testing.assert_allclose((t.T * 3 - 1).numpy(), m.T * 3 - 1, rtol=1e-6)
    np.testing.assert_allclose(t[5:70:3, ::-2].numpy(), m[5:70:3, ::-2])
    np.testing.assert_allclose(t.pad(((2, 3), (1, 0))).numpy(), np.pad(m, ((2, 3), (1, 0))))
    np.testing.assert_allclose(t.reshape(80, 75).T.numpy(), m.reshape(80, 75).T)
    np.testing.assert_allclose((t @ t.T).numpy(), m @ m.T, rtol=1e-4, atol=1e-4)
    h = m.astype(np.float16)
    np.testing.assert_allclose((Tensor(h) + 1).numpy(), h + np.float16(1))


def test_wide_reductions_match_numpy(narrow_4096):
    rng = np.random.default_rng(3)
    u = rng.standard_normal((120, 1)).astype(np.float32)
    v = rng.standard_normal((1, 110)).astype(np.float32)
    m = rng.standard_normal((60, 300)).astype(np.float32)
    a, b, t = Tensor(u), Tensor(v), Tensor(m)
    assert_close_to_terms((a + b).sum().numpy(), (u + v).sum(), np.abs(u + v).sum(), 1e-6)
    np.testing.assert_allclose((a * b).max(0).numpy(), (u * v).max(0))
    np.testing.assert_allclose((a - b).exp().sum(1).numpy(), np.exp(u - v).sum(1), rtol=1e-5)
    assert_close_to_terms(t.sum(0).numpy(), m.sum(0), np.abs(m).sum(0), 1e-6)
    np.testing.assert_allclose(t.softmax(-1).numpy(), np.exp(m) / np.exp(m).sum(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_equal(t.argmax(1).numpy(), m.argmax(1))
    np.testing.assert_equal(t.reshape(-1).argmin().numpy(), m.reshape(-1).argmin())


def test_split_reductions_split_again(narrow_4096, monkeypatch):
    """With one value per invocation and chunk (SERIAL = 1) and rows of 256 splitting, 300 x 300 leaves 352
    partials, which split again; every index is 64-bit past 4095."""
    monkeypatch.setattr(lower_mod, "SERIAL", 1)
    monkeypatch.setattr(lower_mod, "SPLIT_ROW", 256)
    rng = np.random.default_rng(4)
    u = rng.uniform(0.5, 1.5, (300, 1)).astype(np.float32)
    v = rng.uniform(0.5, 1.5, (1, 300)).astype(np.float32)
    a, b = Tensor(u), Tensor(v)
    with count_kernels() as c:
        got = (a * b).sum().numpy()
    assert c.count >= 3
    np.testing.assert_allclose(got, u.astype(np.float64).sum() * v.astype(np.float64).sum(), rtol=1e-5)
    assert (a - b).max().numpy() == (u - v).max()


@pytest.mark.parametrize("wide", [False, True])
def test_split_argmax_and_argmin_match_numpy(monkeypatch, request, wide):
    """Few long rows split their argmax/argmin into chunks (value and index each), then pick the chunk with the
    first best value: the first index of the maximum, a NaN counting as the largest, as numpy; ties and NaNs
    are placed across chunk boundaries (SPLIT_ROW lowered so that small rows split into many chunks); `wide`:
    indices past 4095 are 64-bit (narrow_4096)."""
    if wide:
        request.getfixturevalue("narrow_4096")
    monkeypatch.setattr(lower_mod, "SERIAL", 4)
    monkeypatch.setattr(lower_mod, "SPLIT_ROW", 256)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 5000)).astype(np.float32)
    x[0, [17, 2100, 4999]] = 9.0  # a tie in three chunks: the first wins
    x[1, 3333] = np.nan  # NaN beats everything, then the first NaN
    x[1, 4000] = np.nan
    x[2, :] = -1.0  # all equal: index 0
    t = Tensor(x)
    with count_kernels() as c:
        got = t.argmax(1).numpy()
    assert c.count >= 2  # split: partials, then their reduction
    np.testing.assert_array_equal(got, x.argmax(1))
    np.testing.assert_array_equal(t.argmin(1).numpy(), x.argmin(1))
    np.testing.assert_array_equal((t * -2.0 + 1.0).argmax(1, keepdim=True).numpy(),
                                  (x * -2.0 + 1.0).argmax(1)[:, None])
    np.testing.assert_array_equal((t.argmax(1) + 1).numpy(), x.argmax(1) + 1)
    np.testing.assert_array_equal(t.reshape(-1).argmax().numpy(), x.reshape(-1).argmax())
    h = x.astype(np.float16)
    np.testing.assert_array_equal(Tensor(h).argmax(1).numpy(), h.argmax(1))
    ints = rng.integers(-5, 5, (2, 3000)).astype(np.int32)
    np.testing.assert_array_equal(Tensor(ints).argmin(1).numpy(), ints.argmin(1))
    flags = np.zeros((2, 3000), bool)
    flags[0, 2999] = flags[1, 700] = flags[1, 701] = True
    np.testing.assert_array_equal(Tensor(flags).argmax(1).numpy(), flags.argmax(1))


def test_vocabulary_argmax_splits_at_the_default_thresholds():
    x = np.random.default_rng(6).standard_normal((2, 128256)).astype(np.float32)
    x[1, 128255] = 50.0
    with count_kernels() as c:
        got = Tensor(x).argmax(-1).numpy()
    assert c.count == 2
    np.testing.assert_array_equal(got, x.argmax(-1))


def test_a_device_without_int64_raises_before_gpu_work(narrow_4096, monkeypatch):
    lim = dataclasses.replace(limits(), int64=False)
    monkeypatch.setattr(realize_mod, "limits", lambda: lim)
    a, b = Tensor(np.ones((90, 1), np.float32)), Tensor(np.ones((1, 70), np.float32))
    with count_kernels() as c, pytest.raises(OverflowError, match="shaderInt64"):
        (a + b).sum().numpy()
    assert c.count == 0

"""numpy's semantics at the corners: IEEE special values in pow, shifts past the width, products with
infinities, empty and 0-d reductions, variance with n <= correction, Python ints past int32, integer
accumulators, and the argument forms of stack and reshape."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from numerics import flushed, may_flush_subnormals

from vkgraph import dtypes
from vkgraph.realize import count_kernels
from vkgraph.runtime import UnsupportedFeature, get_device
from vkgraph.tensor import Tensor, stack

SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 3.0, -3.0, 0.3, -0.3, np.inf, -np.inf, np.nan,
                    1e-45, -1e-45, 1e-38, 1e30, -1e30, 2.5, -2.5, 16777217.0, -16777215.0], np.float32)


def same_bits_or_close(got: np.ndarray, ref: np.ndarray, rtol: float) -> np.ndarray:
    """Where got equals ref: NaN at the same places, equal values with equal signs (so -0.0 is not 0.0), and
    finite non-zero values within rtol (pow's exp2/log2 round)."""
    nan = np.isnan(got) & np.isnan(ref)
    exact = (got == ref) & (np.signbit(got) == np.signbit(ref))
    with np.errstate(all="ignore"):
        near = np.isfinite(ref) & (ref != 0) & (np.abs(got - ref) <= rtol * np.abs(ref))
    return nan | exact | near


def test_pow_special_values_match_numpy():
    a, b = (x.ravel() for x in np.meshgrid(SPECIAL, SPECIAL, indexing="ij"))
    got = (Tensor(a) ** Tensor(b)).numpy()
    with np.errstate(all="ignore"):
        ref = np.power(a, b)
    ok = same_bits_or_close(got, ref, 1e-5)
    if may_flush_subnormals():  # a device without DenormPreserve: subnormal bases, exponents and results are 0
        ok |= same_bits_or_close(got, flushed(np.power, a, b), 1e-5)
    assert ok.all(), list(zip(a[~ok], b[~ok], got[~ok], ref[~ok], strict=True))[:10]
    with np.errstate(all="ignore"):
        for e in (0.3, -0.3, 3, -3, 0.0, float("inf"), float("-inf"), float("nan")):
            got = (Tensor(SPECIAL) ** e).numpy()
            ok = same_bits_or_close(got, np.power(SPECIAL, np.float32(e)), 1e-5)
            if may_flush_subnormals():
                ok |= same_bits_or_close(got, flushed(np.power, SPECIAL, np.float32(e)), 1e-5)
            assert ok.all(), (e, got)
        h = SPECIAL.astype(np.float16)  # float16: the same rules, rounded to float16
        got = (Tensor(h) ** Tensor(np.float16(-0.3))).numpy()
        assert same_bits_or_close(got, np.power(h, np.float16(-0.3)), 2e-3).all()
    assert (Tensor([-np.inf]) ** 0.3).item() == np.inf and (Tensor([-np.inf]) ** -0.3).item() == 0.0


def test_integer_pow_to_a_negative_power():
    x = Tensor(np.array([2, 3], np.int32))
    for exponent in (-2, Tensor(-1), np.int32(-3)):
        with pytest.raises(ValueError, match="negative integer powers"):
            x ** exponent
    with pytest.raises(ValueError, match="negative integer powers"):
        2 ** Tensor(np.int32(-2))
    # exponents inside a tensor are seen only on the device: 1 / base^-e truncated, as integer division would
    base = np.array([1, -1, -1, 2, -2, 0, 5, -3], np.int32)
    exp = np.array([-3, -3, -2, -1, -5, -1, 2, 3], np.int32)
    np.testing.assert_array_equal((Tensor(base) ** Tensor(exp)).numpy(), [1, -1, 1, 0, 0, 0, 25, -27])
    np.testing.assert_array_equal((Tensor(base.astype(np.int8)) ** 5).numpy(), base.astype(np.int8) ** 5)


@pytest.mark.parametrize("dt", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64])
def test_shifts_past_the_width_and_negative_counts(dt):
    info = np.iinfo(dt)
    x = np.array([1, 5, 100, info.max, info.min], dt)
    counts = [0, 1, info.bits - 1, info.bits, info.bits + 8, 40, 70] + ([-1, -40] if info.min < 0 else [])
    xs, cs = (v.ravel() for v in np.meshgrid(x, np.array(counts, dt), indexing="ij"))
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal((Tensor(xs) << Tensor(cs)).numpy(), np.left_shift(xs, cs))
        np.testing.assert_array_equal((Tensor(xs) >> Tensor(cs)).numpy(), np.right_shift(xs, cs))


def test_int32_shifted_by_a_python_int_past_32():
    x = Tensor(np.array([1, -8, 7], np.int32))
    np.testing.assert_array_equal((x << 32).numpy(), [0, 0, 0])
    np.testing.assert_array_equal((x << 40).numpy(), [0, 0, 0])
    np.testing.assert_array_equal((x >> 40).numpy(), [0, -1, 0])


def test_product_with_both_infinities_is_an_infinity():
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, 1000).astype(np.float32)  # partial products underflow to 0 in any tree order
    x[10], x[500] = np.inf, -np.inf
    assert Tensor(x).prod().item() == np.prod(x) == -np.inf
    rows = np.stack([x, -x, np.where(np.arange(1000) == 3, 0, x), np.where(np.arange(1000) == 3, np.nan, x)])
    with np.errstate(all="ignore"):
        ref = np.array([-np.inf, -np.inf, np.nan, np.nan], np.float32)  # (-x) holds an even count of negatives
        ref[1] = np.inf if (np.signbit(-x).sum() % 2 == 0) else -np.inf
    np.testing.assert_array_equal(Tensor(rows).prod(1).numpy(), ref)
    signed_zero = np.array([[-0.0, 2.0, -3.0], [-0.0, 2.0, 3.0], [1e-30, 1e-30, 5.0]], np.float32)
    got = Tensor(signed_zero).prod(1).numpy()
    np.testing.assert_array_equal(np.signbit(got), np.signbit(np.prod(signed_zero, 1)))
    np.testing.assert_array_equal(got, np.prod(signed_zero, 1))
    h = x[:40].astype(np.float16)
    assert Tensor(h).prod().item() == np.prod(h)
    assert Tensor(x).prod().dtype is dtypes.float32


def test_prod_of_a_float_is_still_one_kernel():
    x = Tensor(np.random.default_rng(1).uniform(0.5, 1.5, (4, 300)).astype(np.float32)).realize()
    with count_kernels() as c:
        x.prod(1).realize()
    assert c.count == 1, c.names


def test_var_and_std_with_n_at_most_the_correction():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x, corr in [([1.0], 1), ([1.0, 2.0], 3), ([1.0, 1.0], 3), ([1.0, 2.0], 2), ([np.nan, 1.0], 2),
                        ([np.inf, 1.0], 2)]:
            a = np.array(x, np.float32)
            for op in ("var", "std"):
                got = getattr(Tensor(a), op)(correction=corr).item()
                ref = getattr(np, op)(a, ddof=corr)
                assert (np.isnan(got) and np.isnan(ref)) or got == ref, (op, x, corr, got, ref)
    assert np.isnan(Tensor(np.zeros(0, np.float32)).var().item())


def test_empty_axes():
    z = np.zeros((0, 3), np.float32)
    t = Tensor(z)
    np.testing.assert_array_equal(t.any(0).numpy(), z.any(0))
    np.testing.assert_array_equal(t.all(0).numpy(), z.all(0))
    assert t.any().item() is False and t.all().item() is True
    np.testing.assert_array_equal(t.sum(0).numpy(), z.sum(0))
    np.testing.assert_array_equal(t.prod(0).numpy(), z.prod(0))
    assert t.max(1).shape == (0,) and t.any(1).shape == (0,)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        np.testing.assert_array_equal(t.mean(0).numpy(), z.mean(0))
    for op in ("max", "min"):
        with pytest.raises(ValueError, match="zero-size array"):
            getattr(t, op)(0)
    with pytest.raises(ValueError, match="empty sequence"):
        t.argmax(0)
    np.testing.assert_array_equal(t.logsumexp(0).numpy(), np.full(3, -np.inf, np.float32))
    assert t.softmax(0).shape == (0, 3) and t.log_softmax(0).shape == (0, 3)
    assert t.cumsum(0).shape == (0, 3)


@pytest.mark.parametrize("op", ["sum", "prod", "max", "min", "mean", "any", "all", "logsumexp", "softmax",
                                "log_softmax", "argmax", "argmin", "var", "std"])
def test_reductions_of_a_0d_tensor_over_axis_0_and_minus_1(op):
    t = Tensor(np.float32(3.0))
    full = getattr(t, op)().numpy() if op not in ("softmax", "log_softmax") else None
    for axis in (0, -1, (0,), (-1,)):
        if op in ("argmax", "argmin", "softmax", "log_softmax") and isinstance(axis, tuple):
            continue
        out = getattr(t, op)(axis)
        assert out.shape == (), (op, axis)
        if full is not None:
            np.testing.assert_array_equal(out.numpy(), full)
    with pytest.raises(IndexError, match="out of range"):
        getattr(t, op)(1)


def test_cumsum_of_a_0d_tensor_is_one_element_as_numpy():
    assert Tensor(np.float32(3.0)).cumsum(0).tolist() == [3.0]
    assert Tensor(np.int32(3)).cumsum(-1).tolist() == [3]


def test_integer_sums_accumulate_in_int64():
    big = np.full(10, 2**30, np.int32)
    for t, ref in [(Tensor(big).sum(), big.sum()), (Tensor(big).cumsum(0), big.cumsum(0)),
                   (Tensor(big[:3]).prod(), big[:3].prod()), (Tensor(np.full(300, 100, np.int8)).sum(), 30000),
                   (Tensor(np.ones(5, bool)).sum(), 5)]:
        assert t.dtype is dtypes.int64
        np.testing.assert_array_equal(t.numpy(), ref)
    u = np.full(4, 2**31 + 7, np.uint32)
    assert Tensor(u).sum().item() == u.sum()  # numpy: uint64; vkgraph: int64, equal values below 2^63
    assert Tensor(big).sum(dtype="int32").item() == big.sum(dtype=np.int32)  # asked for: wraps as numpy's


def test_without_int64_integer_sums_stay_32_bit_and_big_ints_raise(monkeypatch):
    monkeypatch.setattr(get_device().info, "int64", False)
    x = np.array([1, 2, 3], np.int16)
    assert Tensor(x).sum().dtype is dtypes.int32 and Tensor(x.astype(np.uint8)).sum().dtype is dtypes.uint32
    assert Tensor(x).sum().item() == 6
    for make in (lambda: Tensor([2**31]), lambda: Tensor(2**40), lambda: Tensor.arange(2**31, 2**31 + 2),
                 lambda: Tensor([True]) + 2**40):
        with count_kernels() as c, pytest.raises(UnsupportedFeature, match="int64"):
            make().numpy()
        assert c.count == 0


def test_python_ints_past_int32():
    cases = [(Tensor([2**31]), [2**31]), (Tensor([[1], [-2**40]]), [[1], [-2**40]]), (Tensor(2**31), 2**31),
             (Tensor.full((2,), 2**40), [2**40] * 2), (Tensor.arange(2**31, 2**31 + 3), np.arange(2**31, 2**31 + 3)),
             (Tensor([True]) + 2**40, [2**40 + 1]), (Tensor(np.array([2**40])) + 2**40, [2**41])]
    for t, ref in cases:
        assert t.dtype is dtypes.int64
        np.testing.assert_array_equal(t.numpy(), ref)
    assert Tensor([-2**31, 2**31 - 1]).dtype is dtypes.int32 and Tensor.arange(0, 2**31, 2**30).dtype is dtypes.int32
    r = Tensor.randint(2**40, 2**40 + 5, (64,))
    assert r.dtype is dtypes.int64 and set(r.tolist()) <= set(range(2**40, 2**40 + 5))
    assert Tensor.randint(0, 9, (4,)).dtype is dtypes.int32
    with pytest.raises(OverflowError, match="299 out of bounds for int8"):
        Tensor.randint(0, 300, (2,), dtype="int8")
    for bad, match in [(lambda: Tensor([2**63]), "does not fit int64"), (lambda: Tensor(2**70), "does not fit int64"),
                       (lambda: Tensor([2**31], dtype="int32"), "out of bounds for int32"),
                       (lambda: Tensor([-1], dtype="uint8"), "out of bounds for uint8"),
                       (lambda: Tensor.full((2,), 2**40, "int32"), "out of bounds for int32"),
                       (lambda: Tensor.arange(2**31 - 2, 2**31 + 1, dtype="int32"), "out of bounds for int32")]:
        with pytest.raises(OverflowError, match=match):
            bad()


def test_python_int_out_of_an_integer_tensors_range():
    x = Tensor(np.array([1, -5], np.int32))
    u = Tensor(np.array([1, 200], np.uint8))
    for bad in (lambda: x + 2**31, lambda: 2**31 + x, lambda: x * (-2**31 - 1), lambda: u + -1, lambda: u.maximum(-1),
                lambda: x << 2**40, lambda: u - 256):
        with pytest.raises(OverflowError, match="out of bounds"):
            bad()
    # comparisons have an answer (numpy 2 gives it too)
    xn, un = np.array([1, -5], np.int32), np.array([1, 200], np.uint8)
    for v in (2**40, -2**40, 2**31):
        for fn in (lambda a, b: a < b, lambda a, b: a <= b, lambda a, b: a > b, lambda a, b: a >= b,
                   lambda a, b: a == b, lambda a, b: a != b, lambda a, b: b < a, lambda a, b: b >= a):
            np.testing.assert_array_equal(fn(x, v).numpy(), fn(xn, v))
    for fn in (lambda a: a == -1, lambda a: a > -1, lambda a: a < 256, lambda a: -1 < a):
        np.testing.assert_array_equal(fn(u).numpy(), fn(un))
    np.testing.assert_array_equal((u - 1).numpy(), un - 1)  # in range: wraps as numpy's


def test_stack_and_cat_take_a_sequence_as_pytorch():
    x, y = Tensor([1.0, 2.0]), Tensor([3.0, 4.0])
    np.testing.assert_array_equal(Tensor.stack((x, y)).numpy(), [[1, 2], [3, 4]])
    np.testing.assert_array_equal(Tensor.stack([x, y], 1).numpy(), [[1, 3], [2, 4]])
    np.testing.assert_array_equal(Tensor.stack((x, y), dim=-1).numpy(), [[1, 3], [2, 4]])
    np.testing.assert_array_equal(x.stack(y, dim=1).numpy(), [[1, 3], [2, 4]])
    np.testing.assert_array_equal(Tensor.cat((x, y)).numpy(), [1, 2, 3, 4])
    np.testing.assert_array_equal(stack((x, y)).numpy(), [[1, 2], [3, 4]])
    for bad, err in [(lambda: stack(x), TypeError), (lambda: stack([x, 1.0]), TypeError),
                     (lambda: stack([]), ValueError), (lambda: Tensor.stack((x, y), 1, 2), TypeError),
                     (lambda: stack(t for t in (x, y)), TypeError)]:
        with pytest.raises(err):
            bad()


def test_reshape_forms():
    t = Tensor(np.arange(6, dtype=np.float32))
    for args, shape in [((-1,), (6,)), (((2, -1),), (2, 3)), ((2, -1), (2, 3)), (([3, -1],), (3, 2)),
                        ((np.int64(2), 3), (2, 3)), ((-1, 1, 2), (3, 1, 2))]:
        assert t.reshape(*args).shape == shape
        np.testing.assert_array_equal(t.reshape(*args).numpy(), np.arange(6).reshape(shape))
    assert Tensor(np.zeros((0, 3), np.float32)).reshape(-1).shape == (0,)
    assert Tensor([1.0]).reshape(()).shape == ()
    for args, err, match in [((2.0, 3), TypeError, "integers"), ((None, 3), TypeError, "integers"),
                             ((True, 6), TypeError, "integers"), ((-1, -1), ValueError, "only one"),
                             ((-2, 3), ValueError, "invalid size"), ((0, -1), ValueError, "any size"),
                             ((4, -1), ValueError, "cannot reshape"), ((7,), ValueError, "cannot reshape")]:
        with pytest.raises(err, match=match):
            t.reshape(*args)


@pytest.mark.parametrize("dt", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32])
def test_floor_division_and_modulo_at_the_extremes(dt):
    info = np.iinfo(dt)
    v = np.array([info.min, info.max, info.min + 1, -1 if info.min else 1, 0, 1, 7, 95, 2], np.int64).astype(dt)
    a, b = (x.ravel() for x in np.meshgrid(v, v, indexing="ij"))
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal((Tensor(a) // Tensor(b)).numpy(), a // b)  # INT_MIN // 95 among them
        np.testing.assert_array_equal((Tensor(a) % Tensor(b)).numpy(), a % b)


@pytest.mark.parametrize("dt", [np.int8, np.uint8, np.int32, np.uint32])
def test_integers_widened_to_int64_compare_and_shift(dt):
    info = np.iinfo(dt)
    x = np.array([2, 3, 5, info.max, info.min], dt)
    w = Tensor(x).cast("int64")
    x64 = x.astype(np.int64)
    np.testing.assert_array_equal((w < 64).numpy(), x64 < 64)
    np.testing.assert_array_equal((w >= 0).numpy(), x64 >= 0)
    np.testing.assert_array_equal((w[:3] << w[:3]).numpy(), x64[:3] << x64[:3])

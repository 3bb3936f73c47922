"""Dtype table and promotion rules (no GPU needed)."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from vkgraph.dtype import ALL, dtypes, promote, result_type, to_dtype


def test_names_and_numpy_round_trip():
    for d in ALL:
        assert to_dtype(d.name) is d
        assert to_dtype(d.np) is d
        assert d.np.itemsize == d.itemsize
    assert to_dtype(np.float64) is dtypes.float32
    assert to_dtype(ml_dtypes.bfloat16) is dtypes.bfloat16
    assert to_dtype(float) is dtypes.float32 and to_dtype(int) is dtypes.int32 and to_dtype(bool) is dtypes.bool


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(TypeError, match="no vkgraph equivalent"):
        to_dtype(np.uint64)
    with pytest.raises(TypeError, match="unknown dtype"):
        to_dtype("float128x")


NUMPY_KNOWN = [dtypes.bool, dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16, dtypes.int32, dtypes.uint32,
               dtypes.int64, dtypes.float16, dtypes.float32]


@pytest.mark.parametrize("a,b", list(itertools.product(NUMPY_KNOWN, NUMPY_KNOWN)))
def test_promotion_matches_numpy_where_numpy_has_the_answer(a, b):
    want = np.promote_types(a.np, b.np)
    got = promote(a, b)
    if want == np.float64:  # no float64 here: float32 stands in (documented)
        assert got is dtypes.float32
    else:
        assert got.np == want, (a, b, got, want)
    assert promote(a, b) is promote(b, a)


def test_promotion_of_16_bit_floats_and_weak_scalars():
    assert promote(dtypes.float16, dtypes.bfloat16) is dtypes.float32
    assert promote(dtypes.bfloat16, dtypes.int8) is dtypes.bfloat16
    assert promote(dtypes.bfloat16, dtypes.int32) is dtypes.float32
    assert result_type(dtypes.float16, 2.5) is dtypes.float16
    assert result_type(dtypes.int8, 100) is dtypes.int8
    with pytest.raises(OverflowError, match="1000 out of bounds for int8"):  # numpy 2's rule
        result_type(dtypes.int8, 1000)
    assert result_type(dtypes.bool, 2**31) is dtypes.int64  # a Python int takes int64 where it needs it
    assert result_type(1, 2**40) is dtypes.int64
    assert result_type(dtypes.int8, 0.5) is dtypes.float32
    assert result_type(dtypes.bool, 1) is dtypes.int32
    assert result_type(dtypes.uint8, True) is dtypes.uint8
    assert result_type(1, 2.0) is dtypes.float32
    assert result_type(True) is dtypes.bool

"""The test helpers of numerics.py that accept a flushed-subnormal result only where the device may flush."""

from __future__ import annotations

import types

import numpy as np
import pytest
from numerics import flush, flushed, ieee_matches, may_flush_subnormals

import vkgraph.runtime as runtime


def fake_device(monkeypatch, float_controls: frozenset[str]) -> None:
    dev = types.SimpleNamespace(info=types.SimpleNamespace(float_controls=float_controls))
    monkeypatch.setattr(runtime, "get_device", lambda: dev)


def test_flush_keeps_the_sign_and_normal_values():
    x = np.array([1e-40, -3e-42, 1.4e-45, -0.0, 0.0, 1.2e-38, -1.0, np.inf, np.nan], np.float32)
    f = flush(x)
    zeros = np.array([0.0, -0.0, 0.0, -0.0, 0.0], np.float32)
    np.testing.assert_array_equal(f.view(np.uint32)[:5], zeros.view(np.uint32))
    np.testing.assert_array_equal(f[5:8], x[5:8])
    assert np.isnan(f[8])


def test_flushed_flushes_inputs_and_results():
    sub = np.float32(1e-40)
    with np.errstate(all="ignore"):
        assert np.isnan(flushed(np.multiply, np.float32(np.inf), sub))  # inf * 0
        assert flushed(np.log, sub) == -np.inf
        assert flushed(np.multiply, np.float32(1e-20), np.float32(1e-20)) == 0  # a subnormal result
        assert np.signbit(flushed(np.add, np.float32(-1e-40), np.float32(-0.0)))


@pytest.mark.parametrize("controls", [frozenset(), frozenset({"signed_zero_inf_nan_preserve"})])
def test_a_flushing_device_may_give_the_flushed_result(monkeypatch, controls):
    fake_device(monkeypatch, controls)
    assert may_flush_subnormals()
    x = np.array([1e-40, -3e-42, 1.0, np.inf], np.float32)
    assert ieee_matches(x + np.float32(0), np.add, x, np.float32(0)).all()  # numpy's
    assert ieee_matches(np.array([0.0, 0.0, 1.0, np.inf], np.float32), np.add, x, np.float32(0)).all()  # flushed
    with np.errstate(all="ignore"):
        assert ieee_matches(np.array([np.nan, np.nan], np.float32), np.multiply, np.float32(np.inf), x[:2]).all()
    # a wrong result is wrong either way: the other sign of zero, a different value, NaN where neither is NaN
    assert not ieee_matches(np.array([-0.0], np.float32), np.add, x[:1], np.float32(0)).any()
    assert not ieee_matches(np.array([2e-40], np.float32), np.add, x[:1], np.float32(0)).any()
    assert not ieee_matches(np.array([np.nan], np.float32), np.add, x[:1], np.float32(0)).any()
    assert not ieee_matches(np.array([1.0000001], np.float32), np.add, x[2:3], np.float32(0)).any()


def test_a_preserving_device_must_give_numpys_result(monkeypatch):
    fake_device(monkeypatch, frozenset({"signed_zero_inf_nan_preserve", "denorm_preserve"}))
    assert not may_flush_subnormals()
    x = np.array([1e-40, -3e-42], np.float32)
    assert ieee_matches(x.copy(), np.add, x, np.float32(0)).all()
    assert not ieee_matches(np.array([0.0, -0.0], np.float32), np.add, x, np.float32(0)).any()
    with np.errstate(all="ignore"):
        assert not ieee_matches(np.array([np.nan], np.float32), np.multiply, np.float32(np.inf), x[:1]).any()


def test_the_special_graph_check_takes_the_flushed_chain_only_on_a_flushing_device(monkeypatch):
    from test_fuzz_graph import Special, _check_special

    x = np.array([3e-42, -1e-40, 2.0], np.float32)
    with np.errstate(all="ignore"):
        ref, ref_f = np.log(np.abs(x)), flushed(np.log, flushed(np.abs, flush(x)))
    device_result = types.SimpleNamespace(numpy=lambda: ref_f.copy())  # what a flushing device computes
    item = Special(device_result, ref, "log(abs(in0))", ref_f)
    fake_device(monkeypatch, frozenset({"signed_zero_inf_nan_preserve"}))
    _check_special(item, 1e-5, True, None, None)
    wrong = types.SimpleNamespace(numpy=lambda: np.array([-np.inf, -np.inf, 0.5], np.float32))
    with pytest.raises(AssertionError):
        _check_special(Special(wrong, ref, "log(abs(in0))", ref_f), 1e-5, True, None, None)
    fake_device(monkeypatch, frozenset({"signed_zero_inf_nan_preserve", "denorm_preserve"}))
    with pytest.raises(AssertionError):
        _check_special(item, 1e-5, True, None, None)

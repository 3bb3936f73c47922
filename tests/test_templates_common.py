"""Shared by the template tests: the numpy comparison, and the record of which templates it has checked.

`check` compares a result with a float64 numpy reference by normalised error (||got - ref|| / ||ref||) and
marks every template dispatched since `snapshot()` as checked; test_templates_zz_coverage.py then asserts
that every template in vkgraph/templates/glsl/ was registered, dispatched and checked.
"""

from collections import Counter

import numpy as np
import pytest

from vkgraph import quant, templates

CHECKED: set[str] = set()
TOL = 5e-4


def device():
    from vkgraph.runtime import get_device

    return get_device()


def snapshot() -> Counter:
    return Counter(templates.DISPATCHES)


def normalised_error(got: np.ndarray, ref: np.ndarray) -> float:
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if not np.isfinite(got).all():
        return float("inf")  # NaN never passes
    scale = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / (scale if scale > 0 else 1.0))


def check(got: np.ndarray, ref: np.ndarray, since: Counter, tol: float = TOL) -> None:
    used = set(templates.DISPATCHES - since)
    assert used, "nothing was dispatched"
    err = normalised_error(got, ref)
    assert err <= tol, f"normalised error {err:.3g} > {tol} (templates {sorted(used)})"
    CHECKED.update(used)


def upload(dev, array: np.ndarray):
    buf = dev.alloc(max(array.nbytes, 4))
    dev.upload(buf, np.ascontiguousarray(array))
    return buf


def test_normalised_error_rejects_nan_and_scales():
    ref = np.ones(4)
    assert normalised_error(ref, ref) == 0
    assert normalised_error(np.array([1, 1, 1, np.nan]), ref) == float("inf")
    assert normalised_error(ref * 1.001, ref) == pytest.approx(1e-3)


def weights(x: np.ndarray, fmt: str, seed: int = 0) -> quant.QuantizedTensor:
    """x quantized to fmt, or for a format without a quantizer random valid blocks of x's shape."""
    if fmt in quant.QUANTIZERS:
        return quant.quantize(x, fmt)
    return quant.random_blocks(np.random.default_rng(seed), fmt, *x.shape)


def quantize_q8_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy model of the int8 activation blocks (quantize_q8.comp, q8_store.glsl, q8_lanes.glsl) in float32:
    int8 values of x's shape and scales per block of 32."""
    xb = x.astype(np.float32).reshape(-1, 32)
    d = (np.abs(xb).max(1) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint(xb * inv[:, None]), -127, 127).astype(np.int8)
    return q.reshape(x.shape), d

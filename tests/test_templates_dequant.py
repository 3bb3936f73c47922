"""dequant_f16 against numpy: bit-exact to quant.dequantize(...).astype(float16), for every format."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_templates_common import check, device, snapshot, upload, weights

from vkgraph import quant
from vkgraph.templates import common
from vkgraph.templates import dequant as dq
from vkgraph.templates import matvec as mv

FORMATS = sorted(mv.TEMPLATE)


def _k_for(fmt: str, blocks: int) -> int:
    f = quant.FORMATS[fmt]
    return blocks * (f.block_size if f.block_size > 1 else 8)


def _weights(fmt: str, n: int, k: int, seed: int, random_bits: bool) -> quant.QuantizedTensor:
    """Quantized normal values, or random bytes (NaN, infinite, subnormal scales and values included)."""
    rng = np.random.default_rng(seed)
    f = quant.FORMATS[fmt]
    if random_bits:
        return quant.QuantizedTensor(rng.integers(0, 256, (n, f.row_bytes(k)), dtype=np.uint8), f, (n, k))
    return weights((rng.standard_normal((n, k)) * 4).astype(np.float32), fmt, seed)


def _run(qt: quant.QuantizedTensor) -> None:
    dev = device()
    n, k = qt.shape
    dw = mv.upload_weights(dev, qt)
    since = snapshot()
    got = dev.download(dq.dequantize_f16(dev, dw), np.float16, (n, k))
    with np.errstate(all="ignore"):
        ref = qt.dequantize().astype(np.float16)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan)  # NaN payloads are not compared
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], ref.view(np.uint16)[~nan])
    finite = np.isfinite(ref)
    check(got[finite], ref[finite], since)


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 300), blocks=st.integers(1, 40), random_bits=st.booleans(), seed=st.integers(0, 1000))
def test_dequant_fuzz(fmt, n, blocks, random_bits, seed):
    """Rows and units per row that are rarely multiples of the workgroup (rows straddle workgroups)."""
    if quant.FORMATS[fmt].block_size == 256:
        blocks = 1 + blocks % 5
    _run(_weights(fmt, n, _k_for(fmt, blocks), seed, random_bits))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequant_long_rows(fmt):
    """More units in a row than invocations in a workgroup."""
    _run(_weights(fmt, 5, 4352 if quant.FORMATS[fmt].block_size == 256 else 8224, 1, False))


def test_dequant_many_rows():
    """Row indices past 16 bits."""
    _run(_weights("Q4_0", 70001, 32, 2, True))


@pytest.mark.parametrize("fmt", ["Q6_K", "F16"])
def test_dequant_2d_grid(fmt, monkeypatch):
    """Workgroups folded into y (as past 65535 on a real device, which needs more than lavapipe can bind)."""
    few = SimpleNamespace(info=SimpleNamespace(max_workgroup_count=(3, 65535, 65535)))
    monkeypatch.setattr(dq, "grid_2d", lambda dev, groups: common.grid_2d(few, groups))
    _run(_weights(fmt, 333, _k_for(fmt, 3), 3, True))


def test_dequant_into_out_and_bad_input():
    dev = device()
    qt = _weights("Q8_0", 8, 64, 4, False)
    dw = mv.upload_weights(dev, qt)
    out = upload(dev, np.zeros(8 * 64 + 16, np.float16))
    since = snapshot()
    assert dq.dequantize_f16(dev, dw, out=out) is out
    got = dev.download(out, np.float16, (8 * 64 + 16,))
    ref = qt.dequantize().astype(np.float16)
    np.testing.assert_array_equal(got[:8 * 64].reshape(8, 64), ref)
    check(got[:8 * 64].reshape(8, 64), ref, since)
    assert not got[8 * 64:].any()  # nothing written past the matrix
    with pytest.raises(TypeError, match="DeviceWeights"):
        dq.dequantize_f16(dev, qt)
    with pytest.raises(ValueError, match="smaller than"):
        dq.dequantize_f16(dev, dw, out=upload(dev, np.zeros(8 * 63, np.float16)))
    with pytest.raises(ValueError, match="maxStorageBufferRange"):
        dq.dequantize_f16(dev, dataclasses.replace(dw, shape=(1 << 20, 4096)))
    with pytest.raises(ValueError, match="scales"):
        dq.dequantize_f16(dev, dataclasses.replace(dw, scales=None))
    with pytest.raises(ValueError, match="K % 16"):
        dq.dequantize_f16(dev, dataclasses.replace(dw, shape=(8, 40)))
    with pytest.raises(ValueError, match="strides"):
        dq.dequantize_f16(dev, dataclasses.replace(dw, shape=(8, 128)))
    with pytest.raises(ValueError, match="smaller than"):
        dq.dequantize_f16(dev, dataclasses.replace(dw, shape=(9, 64)))
    with pytest.raises(ValueError, match="empty"):
        dq.dequantize_f16(dev, dataclasses.replace(dw, shape=(0, 64)))

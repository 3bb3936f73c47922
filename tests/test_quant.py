"""GGUF block formats against the `gguf` package's own quantize/dequantize, bit for bit."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gq
from hypothesis import given, settings
from hypothesis import strategies as st

from vkgraph import quant

ALL = sorted(quant.FORMATS)
# gguf implements quantization only for these; the K-quants and IQ formats it can only dequantize
GGUF_QUANTIZES = ["BF16", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
# worst error of an element relative to its block's largest magnitude: half a quantization step plus the
# rounding of the float16 scales (Q4_0's asymmetric range clips the opposite extreme by one full step)
# (Q4_1/Q5_1: half a step of a range up to twice the largest magnitude, plus float16 rounding of d and the minimum)
ROUNDTRIP_TOL = {"F16": 2 ** -11, "BF16": 2 ** -8, "Q8_0": 0.5 / 127 + 2 ** -10, "Q4_0": 1 / 8 + 2 ** -10,
                 "Q4_1": 1 / 15 + 2 ** -6, "Q5_0": 1 / 16 + 2 ** -10, "Q5_1": 1 / 31 + 2 ** -6, "Q4_K": 0.11,
                 "Q6_K": 0.06}
# float16 scales and values go subnormal below 2**-14: their absolute spacing 2**-24 times the largest level
ROUNDTRIP_ATOL = {"F16": 2 ** -25, "BF16": 0.0, "Q8_0": 128 * 2 ** -24, "Q4_0": 16 * 2 ** -24,
                  "Q4_1": 32 * 2 ** -24, "Q5_0": 32 * 2 ** -24, "Q5_1": 64 * 2 ** -24,
                  "Q4_K": 64 * 16 * 2 ** -24, "Q6_K": 128 * 32 * 2 ** -24}


def _ggml(name: str) -> GGMLQuantizationType:
    return getattr(GGMLQuantizationType, name)


def _cols(fmt: quant.QuantFormat, draw_blocks: int) -> int:
    return fmt.block_size * draw_blocks if fmt.block_size > 1 else draw_blocks


@st.composite
def matrices(draw, fmt_name):
    fmt = quant.FORMATS[fmt_name]
    rows = draw(st.integers(1, 5))
    cols = _cols(fmt, draw(st.integers(1, 4 if fmt.block_size == 256 else 40)))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([1e-3, 1.0, 300.0]))
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    # blocks of zeros and blocks with a single outlier are the edge cases of every scale search
    if draw(st.booleans()):
        x[:, : min(cols, fmt.block_size)] = 0
    if draw(st.booleans()):
        x[0, draw(st.integers(0, cols - 1))] = scale * 40
    return x


@pytest.mark.parametrize("name", GGUF_QUANTIZES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_quantize_matches_gguf(name, data):
    x = data.draw(matrices(name))
    ours = quant.quantize(x, name)
    ref = gq.quantize(x, _ggml(name)).view(np.uint8).reshape(ours.data.shape)
    np.testing.assert_array_equal(ours.data, ref)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_dequantize_matches_gguf_on_random_bits(name, data):
    fmt = quant.FORMATS[name]
    rows = data.draw(st.integers(1, 4))
    cols = _cols(fmt, data.draw(st.integers(1, 3 if fmt.block_size == 256 else 24)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    raw = rng.integers(0, 256, (rows, fmt.row_bytes(cols)), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        ours = quant.QuantizedTensor(raw, fmt, (rows, cols)).dequantize()
        ref = gq.dequantize(raw, _ggml(name)).reshape(rows, cols)
    np.testing.assert_array_equal(ours.view(np.uint32), np.asarray(ref, np.float32).view(np.uint32))


@pytest.mark.parametrize("name", quant.QUANTIZERS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_roundtrip_error(name, data):
    x = data.draw(matrices(name))
    qt = quant.quantize(x, name)
    assert qt.data.shape == (x.shape[0], qt.format.row_bytes(x.shape[1]))
    y = qt.dequantize()
    assert np.isfinite(y).all()
    bs = qt.format.block_size
    xb, yb = x.reshape(-1, bs), y.reshape(-1, bs)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    assert np.all(np.abs(yb - xb) <= ROUNDTRIP_TOL[name] * amax + ROUNDTRIP_ATOL[name])
    if name not in ("Q4_K", "Q4_1", "Q5_1"):  # these have an offset (a minimum), so zero need not decode to zero
        assert np.all(y[x == 0] == 0)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_k_quants_requantize_stable(name):
    """Quantizing what a block decodes to must give back values no worse than the first pass."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 1024)).astype(np.float32)
    y = quant.quantize(x, name).dequantize()
    z = quant.quantize(y, name).dequantize()
    assert np.linalg.norm(z - y) <= 0.5 * np.linalg.norm(y - x)


@pytest.mark.parametrize("name", ALL)
def test_kernel_layout_roundtrip(name):
    fmt = quant.FORMATS[name]
    cols = fmt.block_size * 3 if fmt.block_size > 1 else 13
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (5, fmt.row_bytes(cols)), dtype=np.uint8)
    qt = quant.QuantizedTensor(raw, fmt, (5, cols))
    body, scales = quant.kernel_layout(qt)
    assert body.shape[1] % 16 == 0, "every row of the kernel layout starts on a 16-byte boundary"
    back = quant.from_kernel_layout(body, scales, fmt, qt.shape)
    np.testing.assert_array_equal(back.data, raw)


def test_from_raw_and_errors():
    x = np.ones((2, 64), np.float32)
    qt = quant.quantize(x, "q8_0")
    again = quant.QuantizedTensor.from_raw(qt.data.tobytes(), "Q8_0", (2, 64))
    np.testing.assert_array_equal(again.data, qt.data)
    with pytest.raises(ValueError, match="block size"):
        quant.quantize(np.ones((2, 48), np.float32), "Q4_0")
    with pytest.raises(ValueError, match="unknown weight format"):
        quant.quantize(x, "Q5_9")
    with pytest.raises(ValueError, match="no quantizer for IQ4_XS"):
        quant.quantize(np.ones((1, 256), np.float32), "IQ4_XS")
    with pytest.raises(ValueError, match="2-D"):
        quant.quantize(np.ones(64, np.float32), "Q8_0")
    with pytest.raises(ValueError, match="expected"):
        quant.QuantizedTensor.from_raw(qt.data.tobytes()[:-1], "Q8_0", (2, 64))


@pytest.mark.parametrize("name", [n for n in ALL if n not in ("F16", "BF16")])
def test_random_blocks_are_finite_and_exact_to_gguf(name):
    """random_blocks (tests and benchmarks of formats without a quantizer) gives finite values gguf agrees on."""
    qt = quant.random_blocks(np.random.default_rng(3), name, 3, quant.FORMATS[name].block_size * 2)
    y = qt.dequantize()
    assert np.isfinite(y).all() and 0.01 < np.abs(y).mean() < 100
    ref = gq.dequantize(qt.data, _ggml(name)).reshape(qt.shape)
    np.testing.assert_array_equal(y, ref)

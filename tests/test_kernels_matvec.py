"""Matvec templates against float64 numpy on the dequantized weights, for every format."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kernels_common import check, device, snapshot, upload

from vkgraph import quant
from vkgraph.ops import matvec as mv

FORMATS = sorted(mv.TEMPLATE)


def _k_for(fmt: str, blocks: int) -> int:
    f = quant.FORMATS[fmt]
    return blocks * (f.block_size if f.block_size > 1 else 8)


def _run(fmt, n, k, batch, act, bias, residual, config=None, seed=0):
    dev = device()
    rng = np.random.default_rng(seed)
    qt = quant.quantize(rng.standard_normal((n, k)).astype(np.float32), fmt)
    w = qt.dequantize().astype(np.float64)
    x = rng.standard_normal((batch, k)).astype(mv.ACT_DTYPES[act])
    ref = x.astype(np.float64) @ w.T
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    r = rng.standard_normal((batch, n)).astype(np.float32) if residual else None
    ref += (b if bias else 0) + (r if residual else 0)
    dw = mv.upload_weights(dev, qt)
    since = snapshot()
    y = mv.matvec(dev, dw, upload(dev, x), batch, act_dtype=act, bias=None if b is None else upload(dev, b),
                  residual=None if r is None else upload(dev, r), config=config)
    check(dev.download(y, np.float32, (batch, n)), ref, since)


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 70), blocks=st.integers(1, 40), batch=st.integers(1, 8),
       act=st.sampled_from(["f32", "f16"]), bias=st.booleans(), residual=st.booleans(), seed=st.integers(0, 1000))
def test_matvec_fuzz(fmt, n, blocks, batch, act, bias, residual, seed):
    if quant.FORMATS[fmt].block_size == 256:
        blocks = 1 + blocks % 5
    _run(fmt, n, _k_for(fmt, blocks), batch, act, bias, residual, seed=seed)


@pytest.mark.parametrize("fmt", FORMATS)
def test_matvec_long_rows(fmt):
    """K >= 4096 and a row count that is not a multiple of the rows per workgroup."""
    _run(fmt, 67, 4352 if fmt in ("Q4_K", "Q6_K") else 4128, 3, "f32", True, False)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", [mv.MatvecConfig(32, 3, False), mv.MatvecConfig(64, 1, True),
                                    mv.MatvecConfig(16, 4, True)])
def test_matvec_launch_configs(fmt, config):
    """Both reductions (subgroupAdd and shared memory), odd rows per workgroup, a workgroup wider than K."""
    if config.use_subgroup and "arithmetic" not in device().info.subgroup_ops:
        pytest.skip("no subgroup arithmetic on this device")
    _run(fmt, 29, _k_for(fmt, 3), 2, "f32", False, True, config=config)


def test_matvec_residual_in_place():
    dev = device()
    rng = np.random.default_rng(5)
    qt = quant.quantize(rng.standard_normal((40, 256)).astype(np.float32), "Q8_0")
    x = rng.standard_normal((2, 256)).astype(np.float32)
    r = rng.standard_normal((2, 40)).astype(np.float32)
    rbuf = upload(dev, r)
    since = snapshot()
    mv.matvec(dev, mv.upload_weights(dev, qt), upload(dev, x), 2, out=rbuf, residual=rbuf)
    check(dev.download(rbuf, np.float32, (2, 40)), x.astype(np.float64) @ qt.dequantize().T + r, since)


def test_matvec_bad_input():
    dev = device()
    qt = quant.quantize(np.ones((8, 64), np.float32), "Q8_0")
    dw = mv.upload_weights(dev, qt)
    x = upload(dev, np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match="smaller than"):
        mv.matvec(dev, dw, x, 3)
    with pytest.raises(ValueError, match="batch must be"):
        mv.matvec(dev, dw, x, 9)
    with pytest.raises(ValueError, match="act_dtype"):
        mv.matvec(dev, dw, x, 1, act_dtype="bf16")
    with pytest.raises(TypeError, match="Buffer"):
        mv.matvec(dev, dw, np.ones(64, np.float32), 1)
    with pytest.raises(ValueError, match="bias"):
        mv.matvec(dev, dw, x, 1, bias=upload(dev, np.ones(4, np.float32)))
    with pytest.raises(ValueError, match="K % 8"):
        mv.upload_weights(dev, quant.quantize(np.ones((2, 12), np.float32), "F16"))

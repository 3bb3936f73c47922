"""Products over Q8_0 / Q4_0 / Q4_K / Q6_K weights on cooperative matrices (templates.matmul_quant): which
products take them (decided from device limits, tested with made-up limits on any device), that every program
compiles, and, on a device that has them, that results match numpy in float64 over drawn shapes, tiles and
residuals. The staging of W's slices (the formats' decoders) runs alone on every device (stage_source)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_matmul_coop import compiles, fake_limits, needs_f16

import vkgraph.realize as realize_mod
from vkgraph.codegen import matmul_coop
from vkgraph.graph import Op
from vkgraph.nn import template_ops
from vkgraph.nn.template_ops import QuantLinear
from vkgraph.quant import dequantize, random_blocks
from vkgraph.realize import count_kernels
from vkgraph.runtime import get_device
from vkgraph.templates import matmul_quant as mq
from vkgraph.templates.matvec import upload_weights
from vkgraph.tensor import Tensor


def test_config_follows_the_device():
    lim = fake_limits()
    cfg = mq.config(lim, 512, 4096, 4096)
    assert cfg is not None and cfg.bk % mq.BLOCK == 0 and cfg.fits((16, 16, 16), lim)
    assert mq.config(fake_limits(coop=()), 512, 4096, 4096) is None
    assert mq.config(fake_limits(min_subgroup=32, max_subgroup=64), 512, 4096, 4096) is None
    assert mq.config(lim, 512, 4096, 48) is None  # K not whole blocks
    # a tuned tile whose slices are not whole blocks (BK 16) gives way to the default
    cls = matmul_coop.shape_class(512, 4096, 4096, 1, template_ops.dtypes.float16)
    tuned = dataclasses.replace(lim, tuned=((cls, (128, 256, 16, 2, 4, 2)),))
    assert mq.config(tuned, 512, 4096, 4096).bk == 32
    deep = dataclasses.replace(lim, tuned=((cls, (128, 128, 64, 2, 4, 1)),))
    assert mq.config(deep, 512, 4096, 4096) == matmul_coop.Config(128, 128, 64, 2, 4, 1)
    assert mq.config(deep, 512, 4096, 4096 + 32).bk == 32  # K not a whole number of 64-deep slices
    # a tile measured for the format's own products comes first
    own = dataclasses.replace(deep, tuned=deep.tuned + ((mq.shape_class("Q4_0", 512, 4096, 4096),
                                                         (64, 128, 32, 2, 4, 2)),))
    assert mq.config(own, 512, 4096, 4096, "Q4_0") == matmul_coop.Config(64, 128, 32, 2, 4, 2)
    assert mq.config(own, 512, 4096, 4096, "Q8_0") == matmul_coop.Config(128, 128, 64, 2, 4, 1)


@pytest.mark.parametrize("fmt,cfg,residual", [("Q8_0", matmul_coop.Config(128, 128, 32, 2, 4), False),
                                              ("Q4_0", matmul_coop.Config(128, 128, 64, 2, 4, 1), True),
                                              ("Q4_K", matmul_coop.Config(64, 128, 32, 2, 4), True),
                                              ("Q6_K", matmul_coop.Config(128, 256, 32, 2, 4, 1), False)])
def test_programs_compile(fmt, cfg, residual):
    n, k = 200, 512
    weights = mq_weights(fmt, n, k)
    src = mq.source(fmt, n, k, weights.w_stride, weights.s_stride, cfg, (16, 16, 16), 32, residual)
    assert "coopMatMulAdd" in src and ("res[" in src) == residual
    compiles(src)


def mq_weights(fmt: str, n: int, k: int):
    from vkgraph.templates.matvec import weight_words

    return weight_words(random_blocks(np.random.default_rng(0), fmt, n, k))[0]


@pytest.mark.parametrize("fmt", mq.FORMATS)
@pytest.mark.parametrize("bn,bk,nt", [(128, 32, 256), (64, 64, 128)])
def test_staging_matches_numpy(fmt, bn, bk, nt):
    """The product's staging of W (load_q, then decode_q into shared memory), run alone on any device over rows
    that are not a whole number of tiles: every value equals numpy's dequantization rounded to float16, within the
    rounding mode of packHalf2x16 (one unit in the last place)."""
    n, k = 200, 512
    qt = random_blocks(np.random.default_rng(1), fmt, n, k)
    dev = get_device()
    weights = upload_weights(dev, qt)
    out = dev.alloc(n * k * 2)
    src = mq.stage_source(fmt, n, k, weights.w_stride, weights.s_stride, bn, bk, nt)
    kern = dev.pipeline(src, name=f"stage_{fmt}")
    scales = weights.scales if weights.scales is not None else weights.body
    dev.dispatch(kern, [weights.body, scales, out], (-(-n // bn), k // bk, 1))
    got = dev.download(out, np.float16, (n, k)).astype(np.float64)
    want = dequantize(qt).astype(np.float64)
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    assert np.all(np.abs(got - want) <= np.maximum(np.abs(want) * 2.0**-10, 2.0**-24))


def _graph_names(t: Tensor) -> set[str]:
    seen, stack, names = set(), [t.node], set()
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n.op is Op.CUSTOM:
            names.add(n.arg.name)
        stack.extend(n.srcs)
    return names


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q5_K"])
def test_quant_linear_takes_the_kernel_where_the_device_has_cooperative_matrices(fmt, monkeypatch):
    monkeypatch.setattr(template_ops, "limits", lambda: fake_limits())
    monkeypatch.setattr(template_ops, "has_dtype", lambda d: True)
    lin = QuantLinear(random_blocks(np.random.default_rng(0), fmt, 96, 256))
    x = Tensor(np.zeros((template_ops.DEQUANT_ROWS, 256), np.float32))
    names = _graph_names(lin(x, residual=Tensor(np.zeros((template_ops.DEQUANT_ROWS, 96), np.float32))))
    want = f"matmul_quant_{fmt}" if fmt in mq.FORMATS else f"dequant_f16_{fmt}"
    assert names == {want}
    assert _graph_names(lin(Tensor(np.zeros((template_ops.DEQUANT_ROWS - 1, 256), np.float32)))) == {f"matvec_{fmt}"}
    monkeypatch.setenv("VKGRAPH_QUANT_COOP", "0")
    assert _graph_names(lin(x)) == {f"dequant_f16_{fmt}"}


# ---- on a device with cooperative matrices ---------------------------------------------------------------------


def _check(got: np.ndarray, x16: np.ndarray, w: np.ndarray, extra: np.ndarray | float = 0.0) -> None:
    """|got - x @ W.T| within float32 accumulation over |x| @ |W|.T plus one float16 rounding of each weight (the
    kernel rounds dequantized values with packHalf2x16, whose rounding mode is the device's); NaN never passes."""
    x64, w64 = x16.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64.T + extra
    mag = np.abs(x64) @ np.abs(w64).T + np.abs(extra)
    tol = mag * (x16.shape[1] * 2.0**-23 + 2.0**-10) + 2.0**-24
    assert not np.isnan(got).any()
    bad = np.abs(got.astype(np.float64) - ref) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} off; worst {np.max(np.abs(got - ref) / tol)} x tolerance"


_DEEP = [c for c in matmul_coop.CONFIGS if c.bk % mq.BLOCK == 0]


@needs_f16
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(mq.FORMATS), m=st.integers(1, 300), n=st.integers(1, 300), kb=st.integers(1, 8),
       cfg=st.sampled_from(_DEEP), residual=st.booleans(), seed=st.integers(0, 2**16))
def test_products_match_numpy(fmt, m, n, kb, cfg, residual, seed):
    k = cfg.bk * kb if fmt in ("Q8_0", "Q4_0") else 256 * (1 + kb % 3)  # whole slices (K-quants: super-blocks)
    lim = realize_mod.limits()
    if not cfg.fits(matmul_coop.fragment(lim, "float16"), lim):
        cfg = mq.config(lim, m, n, k)
    rng = np.random.default_rng(seed)
    qt = random_blocks(rng, fmt, n, k)
    x = rng.standard_normal((m, k)).astype(np.float16)
    r = rng.standard_normal((m, n)).astype(np.float32)
    dev = get_device()
    weights = upload_weights(dev, qt)
    xb, rb = dev.alloc(x.nbytes), dev.alloc(r.nbytes)
    dev.upload(xb, x)
    dev.upload(rb, r)
    out = mq.matmul_quant(dev, lim, weights, xb, m, cfg, residual=rb if residual else None)
    got = dev.download(out, np.float32, (m, n))
    _check(got, x, dequantize(qt).astype(np.float16), r if residual else 0.0)


@needs_f16
@pytest.mark.parametrize("fmt", mq.FORMATS)
def test_quant_linear_prefill_shape(fmt):
    """A prefill-like product through QuantLinear (rows cast to float16, the residual added in the kernel)."""
    rng = np.random.default_rng(3)
    qt = random_blocks(rng, fmt, 1000, 1024)
    lin = QuantLinear(qt)
    x = rng.standard_normal((2, 150, 1024)).astype(np.float32)
    r = rng.standard_normal((2, 150, 1000)).astype(np.float32)
    with count_kernels() as c:
        got = lin(Tensor(x), residual=Tensor(r)).numpy()
    assert f"matmul_quant_{fmt}" in c.names and not any(n.startswith("dequant") for n in c.names)
    w16 = dequantize(qt).astype(np.float16)
    _check(got.reshape(300, 1000), x.reshape(300, 1024).astype(np.float16), w16, r.reshape(300, 1000))

"""Products over Q8_0 / Q4_0 / Q4_K / Q6_K weights on cooperative matrices (templates.matmul_quant): which
products take them (decided from device limits, tested with made-up limits on any device), that every program
compiles, and, on a device that has them, that results match numpy in float64 over drawn shapes, tiles and
residuals. The staging of W's slices (the formats' decoders) runs alone on every device (stage_source)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_matmul_coop import _has, compiles, emulate_coop, fake_limits, needs_f16

import vkgraph.realize as realize_mod
from vkgraph.codegen import matmul_coop
from vkgraph.graph import Op
from vkgraph.nn import template_ops
from vkgraph.nn.template_ops import QuantLinear
from vkgraph.quant import dequantize, random_blocks
from vkgraph.realize import count_kernels
from vkgraph.runtime import get_device
from vkgraph.templates import matmul_quant as mq
from vkgraph.templates import matvec as mv
from vkgraph.templates.matvec import upload_weights
from vkgraph.tensor import Tensor


def test_config_follows_the_device():
    lim = fake_limits()
    few = mq.DEFAULT_FEW
    # 512 rows: the wide tile for the 8B layer's gate_up (448 of its tiles) and 14336 columns (224); qkv, o and down
    # (96, 64, 64 tiles), fewer rows than its 256, or outputs of fewer tiles: the smaller tile, twice the workgroups
    assert mq.config(lim, 512, 28672, 4096) == mq.config(lim, 512, 14336, 4096) == mq.DEFAULT
    assert mq.config(lim, 4096, 4096, 4096) == mq.DEFAULT
    assert mq.config(lim, 512, 4096, 4096) == mq.config(lim, 512, 6144, 4096) == mq.config(lim, 512, 4096, 14336) == few
    assert mq.config(lim, 200, 14336, 4096) == mq.config(lim, 128, 4096, 4096) == mq.config(lim, 512, 2048, 4096) == few
    assert mq.DEFAULT.bk % mq.CHUNK == 0 and few.bk % mq.CHUNK == 0
    assert mq.config(fake_limits(coop=()), 512, 4096, 4096) is None
    assert mq.config(fake_limits(min_subgroup=32, max_subgroup=64), 512, 4096, 4096) is None
    assert mq.config(lim, 512, 4096, 48) is None  # K not whole blocks
    assert mq.config(fake_limits(max_shared=32768), 512, 4096, 4096) == mq.Prefill(64, 64, 32, 2, 2)
    # the float16 product's measured tiles (another staging) are not taken, nor its default
    f16 = matmul_coop.shape_class(128, 4096, 4096, 1, template_ops.dtypes.float16)
    assert mq.config(dataclasses.replace(lim, tuned=((f16, (128, 128, 32, 2, 4, 1)),)), 128, 4096, 4096) == few
    assert matmul_coop.default_config(128, 4096, 4096, 1, lim, (16, 16, 16)) != few
    # a tile measured for the format's own products is taken where its slices are whole blocks dividing K
    q4 = mq.shape_class("Q4_0", 128, 4096, 4096)
    own = dataclasses.replace(lim, tuned=((q4, (64, 128, 32, 2, 4, 2)),))
    assert mq.config(own, 128, 4096, 4096, "Q4_0") == mq.Prefill(64, 128, 32, 2, 4, 2)
    assert mq.config(own, 128, 4096, 4096, "Q8_0") == few
    shallow = dataclasses.replace(lim, tuned=((q4, (128, 256, 16, 2, 4, 2)),))
    assert mq.config(shallow, 128, 4096, 4096, "Q4_0").bk == 16  # half blocks: W's chunks
    shallow = dataclasses.replace(lim, tuned=((q4, (128, 256, 8, 2, 4, 2)),))
    assert mq.config(shallow, 128, 4096, 4096, "Q4_0") == few  # BK 8: not whole chunks
    deep = dataclasses.replace(lim, tuned=((mq.shape_class("Q4_0", 128, 4096, 4096 + 64), (128, 128, 64, 2, 4, 1)),))
    assert mq.config(deep, 128, 4096, 4096 + 64, "Q4_0").bk == 64
    deep = dataclasses.replace(lim, tuned=((mq.shape_class("Q4_0", 128, 4096, 4096 + 32), (128, 128, 64, 2, 4, 1)),))
    # K not a whole number of 64-deep slices: the measured tile and DEFAULT_FEW give way to the first fallback
    assert mq.config(deep, 128, 4096, 4096 + 32, "Q4_0") == mq.FALLBACKS[0]
    assert mq.config(lim, 512, 14336, 4096 + 32) == mq.DEFAULT  # 32 deep
    assert mq.config(lim, 512, 4096, 4096 + 32) == mq.FALLBACKS[0]  # few tiles, 32 deep
    # a K split is taken where K is a whole number of its parts' slices (QuantLinear sums the planes)
    split = dataclasses.replace(lim, tuned=((q4, (128, 128, 32, 2, 4, 2, 2, 4)),))
    assert mq.config(split, 128, 4096, 4096, "Q4_0") == mq.Prefill(128, 128, 32, 2, 4, 2, 2, 4)
    # the ninth number is the order of decoding and products, the tenth the form of the levels
    spread = dataclasses.replace(lim, tuned=((q4, (128, 128, 32, 2, 4, 2, 2, 1, 2)),))
    assert mq.config(spread, 128, 4096, 4096, "Q4_0").order == 2
    one = dataclasses.replace(lim, tuned=((q4, (128, 128, 64, 2, 4, 1, 1, 1, 1, 1)),))
    assert mq.config(one, 128, 4096, 4096, "Q4_0") == mq.Prefill(128, 128, 64, 2, 4, 1, 1, 1, 1, 1)
    for bad in ((128, 128, 64, 2, 4, 1, 1, 1, 3), (128, 128, 64, 2, 4, 1, 1, 1, 0, 2)):
        assert mq.config(dataclasses.replace(lim, tuned=((q4, bad),)), 128, 4096, 4096, "Q4_0") == few


def test_search_candidates():
    """The tiles the search measures fit the device, take whole slices of K, come in every order with one and two
    stages, and split K only for outputs of few tiles; the default is among them."""
    lim = fake_limits()
    frag = (16, 16, 16)
    assert {mq.DEFAULT, mq.DEFAULT_FEW, *mq.FALLBACKS[:1]} <= set(mq.CANDIDATES)
    assert len(set(mq.CANDIDATES)) == len(mq.CANDIDATES)
    wide = mq.candidates(lim, 512, 14336, 4096)
    few = mq.candidates(lim, 512, 4096, 14336)
    assert {c.order for c in wide} == {0, 1, 2} and any(c.ks > 1 for c in few)
    assert all(c.ks == 1 or -(-512 // c.bm) * -(-14336 // c.bn) < matmul_coop.SPLIT_TILES for c in wide)
    assert any(c.ks == 1 and c.bm * c.bn == 128 * 128 and c in few for c in wide)
    assert [c for c in wide if c.ks > 1 and c.bm * c.bn == 128 * 128] == []  # 448 tiles: no split
    assert {(c.stages, c.order) for c in few} == {(s, o) for s in (1, 2) for o in (0, 1, 2)}
    for c in few:
        assert c.fits(frag, lim) and c.bk % mq.CHUNK == 0 and 14336 % (c.bk * c.ks) == 0
    assert mq.candidates(lim, 512, 4096, 48) == [] and mq.candidates(fake_limits(coop=()), 512, 4096, 4096) == []
    assert mq.DEFAULT not in mq.candidates(fake_limits(max_shared=32768), 512, 4096, 4096)  # 34 KiB


@pytest.mark.parametrize("fmt,cfg,residual", [("Q8_0", matmul_coop.Config(128, 128, 32, 2, 4), False),
                                              ("Q4_0", matmul_coop.Config(128, 128, 64, 2, 4, 1), True),
                                              ("Q4_K", matmul_coop.Config(64, 128, 32, 2, 4), True),
                                              ("Q6_K", matmul_coop.Config(128, 256, 32, 2, 4, 1), False),
                                              ("Q4_0", matmul_coop.Config(128, 128, 32, 2, 4, 2, 2), True),
                                              ("Q4_K", matmul_coop.Config(128, 128, 64, 4, 2, 1, 2), False),
                                              ("Q8_0", mq.Prefill(128, 128, 32, 2, 4, 2, 1, 1, 1), True),
                                              ("Q4_0", mq.Prefill(128, 128, 32, 4, 2, 2, 2, 2, 2), False),
                                              ("Q6_K", mq.Prefill(256, 128, 16, 4, 2, 2, 2, 1, 1), True)])
def test_programs_compile(fmt, cfg, residual):
    n, k = 200, 512
    weights = mq_weights(fmt, n, k)
    src = mq.source(fmt, n, k, weights.w_stride, weights.s_stride, cfg, (16, 16, 16), 32, residual)
    assert "coopMatMulAdd" in src and ("res[" in src) == residual
    compiles(src)


@pytest.mark.parametrize("kb", [1, 2, 4, 8, 16])
def test_staged_weight_chunks_of_eight_invocations_fall_in_distinct_banks(kb):
    """Each chunk of W's 64-row slice (kb chunks of 16 values a row, two 16-byte words each) is staged once, each
    8 invocations' stores land in 8 distinct 16-byte bank groups, and each warp stages the chunks it would in row
    order (so its global reads are unchanged)."""
    row, j = (x.replace("/", "//") for x in mq._deal("e", kb, 64))
    pos = [(eval(row, {"e": e}), eval(j, {"e": e})) for e in range(64 * kb)]
    assert sorted(pos) == [(r, c) for r in range(64) for c in range(kb)]
    for g in range(0, len(pos), 8):
        assert len({(r * (2 * kb + 1) + 2 * c) % 8 for r, c in pos[g:g + 8]}) == 8
    for g in range(0, len(pos), 32):
        assert sorted(pos[g:g + 32]) == [(e // kb, e % kb) for e in range(g, g + 32)]


def mq_weights(fmt: str, n: int, k: int):
    from vkgraph.templates.matvec import weight_words

    return weight_words(random_blocks(np.random.default_rng(0), fmt, n, k))[0]


@pytest.mark.parametrize("fmt", mq.FORMATS)
@pytest.mark.parametrize("bn,bk,nt", [(128, 32, 256), (64, 64, 128), (64, 128, 64), (32, 256, 64), (64, 16, 32)])
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


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("form", sorted(mq._LEVELS))
def test_staging_is_numpy_rounded_to_float16(fmt, form):
    """Q8_0 and Q4_0 are staged in float16 arithmetic (each level 1024 + q from its bits, in every form of
    `levels`, the offset taken off, one multiply by the scale's bits as float16): every value is numpy's
    dequantization rounded to float16 (round to nearest even), bit for bit, over scales that make subnormal, huge,
    infinite, zero, negative and NaN products."""
    n, k = 64, 256
    qt = random_blocks(np.random.default_rng(4), fmt, n, k)
    blocks = qt.data.reshape(-1, qt.format.type_size)
    special = np.array([2.0**-24, 3 * 2.0**-24, 2.0**-14, 1e-4, 0.0, -0.0, -0.02, 1.0, 4097.0, 65504.0, np.inf,
                        -np.inf, np.nan], np.float16)
    d = np.resize(special, len(blocks))
    np.random.default_rng(5).shuffle(d)
    blocks[:, :2] = d.view(np.uint8).reshape(-1, 2)
    dev = get_device()
    weights = upload_weights(dev, qt)
    out = dev.alloc(n * k * 2)
    kern = dev.pipeline(mq.stage_source(fmt, n, k, weights.w_stride, weights.s_stride, 32, 32, 64, form),
                        name="stage")
    dev.dispatch(kern, [weights.body, weights.scales, out], (n // 32, k // 32, 1))
    got = dev.download(out, np.float16, (n, k))
    with np.errstate(invalid="ignore", over="ignore"):
        want = dequantize(qt).astype(np.float16)
    assert np.isnan(want).any() and np.isinf(want).any() and (np.abs(want) < 2.0**-14).any()
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got[~np.isnan(got)]), np.signbit(want[~np.isnan(want)]))


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
    monkeypatch.setenv("VKGRAPH_DECODE_MM_ROWS", "0")  # fewer rows: the matvec (small tiles: further down)
    assert _graph_names(lin(Tensor(np.zeros((template_ops.DEQUANT_ROWS - 1, 256), np.float32)))) == {f"matvec_{fmt}"}
    monkeypatch.setenv("VKGRAPH_QUANT_COOP", "0")
    assert _graph_names(lin(x)) == {f"dequant_f16_{fmt}"}


@pytest.mark.slow
@pytest.mark.parametrize("fmt,cfg", [("Q4_0", matmul_coop.Config(64, 64, 32, 2, 2, 2, 2, 1)),
                                     ("Q4_K", matmul_coop.Config(64, 64, 32, 2, 2, 1, 2, 2)),
                                     ("Q8_0", matmul_coop.Config(64, 64, 64, 2, 2, 1, 1, 2)),
                                     ("Q8_0", mq.Prefill(64, 64, 32, 2, 2, 2, 1, 2, 1)),
                                     ("Q4_K", mq.Prefill(64, 64, 32, 2, 2, 2, 2, 1, 1))],
                         ids=["Q4_0-p2", "Q4_K-s1-p2-k2", "Q8_0-s1-k2", "Q8_0-before-k2", "Q4_K-before-p2"])
def test_prefill_tiles_emulated_match_numpy(fmt, cfg, monkeypatch):
    """The prefill product with two slices in flight, with K split (partial planes) and decoding before the
    products, its cooperative matrices emulated (test_matmul_coop.emulated), on any device with a fixed subgroup
    size dividing 16."""
    _prefill_tile_case(emulate_coop(monkeypatch), fmt, cfg, 70, 100, 512)


@pytest.mark.parametrize("n,k", [(128, 512), (100, 96)])
def test_decoding_between_the_products_emulated_matches_numpy(n, k, monkeypatch):
    """Each slice decoded between the products of the one before (order 2, two slices in flight), emulated: over
    whole column tiles (W read without bounds tests) and ragged ones, an even and an odd number of slices; then
    16-deep slices (half blocks) decoded before the products."""
    lim = emulate_coop(monkeypatch)
    _prefill_tile_case(lim, "Q4_0", mq.Prefill(64, 64, 32, 2, 2, 2, 2, 1, 2), 70, n, k)
    _prefill_tile_case(lim, "Q8_0", mq.Prefill(64, 64, 16, 2, 2, 2, 2, 1, 1), 70, n, k)


@pytest.mark.parametrize("cfg", [mq.Prefill(64, 64, 64, 2, 2, 1, 1, 1, 2), mq.Prefill(64, 64, 32, 2, 2, 1, 2, 2, 1)],
                         ids=["between", "before-p2-k2"])
def test_one_stage_decoding_during_the_products_emulated_matches_numpy(cfg, monkeypatch):
    """One stage: the next slice of W decoded into registers between or before the current slice's products and
    stored after the barrier, emulated (with two slices in flight and K split too), ragged and whole tiles, and a
    K-quant's decoder (converting each value) in the same place."""
    lim = emulate_coop(monkeypatch)
    _prefill_tile_case(lim, "Q4_0", cfg, 70, 100, 512)
    _prefill_tile_case(lim, "Q8_0", cfg, 64, 128, 256)
    _prefill_tile_case(lim, "Q6_K", cfg, 40, 72, 512)


def test_byte_shuffled_levels_emulated_match_numpy(monkeypatch):
    """The default wide tile's form of the levels (byte vectors shuffled, FORM 1) in a one-stage product, emulated,
    over ragged rows and columns."""
    lim = emulate_coop(monkeypatch)
    cfg = mq.Prefill(64, 64, 32, 2, 2, 1, 1, 1, 0, 1)
    _prefill_tile_case(lim, "Q4_0", cfg, 70, 100, 256)
    _prefill_tile_case(lim, "Q8_0", cfg, 40, 64, 128)


def test_w_stages_emulated_match_numpy(monkeypatch):
    """W in two stages of its own beside one of x (WSTAGES 2: each slice decoded into W's other stage between the
    products), emulated, over ragged rows and columns."""
    _prefill_tile_case(emulate_coop(monkeypatch), "Q4_0", mq.Prefill(64, 64, 32, 2, 2, 1, 1, 1, 0, 1, 2), 70, 100, 256)


@pytest.mark.slow
def test_w_stages_variants_emulated_match_numpy(monkeypatch):
    """WSTAGES 2 over whole column tiles and an odd number of slices, and with K split in two."""
    lim = emulate_coop(monkeypatch)
    _prefill_tile_case(lim, "Q4_0", mq.Prefill(64, 64, 32, 2, 2, 1, 1, 1, 0, 1, 2), 70, 128, 96)
    _prefill_tile_case(lim, "Q8_0", mq.Prefill(64, 64, 32, 2, 2, 1, 1, 2, 0, 0, 2), 40, 100, 512)


# ---- on a device with cooperative matrices ---------------------------------------------------------------------


def _check(got: np.ndarray, x16: np.ndarray, w: np.ndarray, extra: np.ndarray | float = 0.0,
           rounded: float = 2.0**-10) -> None:
    """|got - x @ W.T| within float32 accumulation over |x| @ |W|.T plus one float16 rounding of each weight (the
    kernel rounds dequantized values with packHalf2x16, whose rounding mode is the device's; `rounded`: the
    relative rounding of the staged operands); NaN never passes."""
    x64, w64 = x16.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64.T + extra
    mag = np.abs(x64) @ np.abs(w64).T + np.abs(extra)
    tol = mag * (x16.shape[1] * 2.0**-23 + rounded) + 2.0**-24
    assert not np.isnan(got).any()
    bad = np.abs(got.astype(np.float64) - ref) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} off; worst {np.max(np.abs(got - ref) / tol)} x tolerance"


_DEEP = [c for c in matmul_coop.CONFIGS if c.bk % mq.CHUNK == 0] + [
    c for c in mq.CANDIDATES if c.order or c.bk == 16 or c.form != mq.FORM or c.wstages > 1]
_WHOLE = [c for c in _DEEP if c.ks == 1]  # tiles that write y itself (a K split writes partial planes)


def _operands(dev, fmt: str, m: int, n: int, k: int, x_dtype, seed: int) -> tuple:
    """Random W [n, k] in fmt, x [m, k] in x_dtype and a residual [m, n] float32, drawn in that order from seed, and
    on the device: (qt, weights, x, x buffer, r, r buffer)."""
    rng = np.random.default_rng(seed)
    qt = random_blocks(rng, fmt, n, k)
    x = rng.standard_normal((m, k)).astype(x_dtype)
    r = rng.standard_normal((m, n)).astype(np.float32)
    xb, rb = dev.alloc(x.nbytes), dev.alloc(r.nbytes)
    dev.upload(xb, x)
    dev.upload(rb, r)
    return qt, upload_weights(dev, qt), x, xb, r, rb


def _prefill_tile_case(lim, fmt: str, cfg: matmul_coop.Config, m: int, n: int, k: int) -> None:
    """One prefill product in tile cfg against numpy, its residual added where it writes y itself; a K split's
    partial planes summed here."""
    dev = get_device()
    qt, weights, x, xb, r, rb = _operands(dev, fmt, m, n, k, np.float16, 3)
    out = mq.matmul_quant(dev, lim, weights, xb, m, cfg, residual=rb if cfg.ks == 1 else None)
    got = dev.download(out, np.float32, (cfg.ks, m, n)).sum(0, dtype=np.float32)
    _check(got, x, dequantize(qt).astype(np.float16), r if cfg.ks == 1 else 0.0)


@needs_f16
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(mq.FORMATS), m=st.integers(1, 300), n=st.integers(1, 300), kb=st.integers(1, 8),
       cfg=st.sampled_from(_WHOLE), residual=st.booleans(), seed=st.integers(0, 2**16))
def test_products_match_numpy(fmt, m, n, kb, cfg, residual, seed):
    # whole slices of whole blocks (K-quants: super-blocks)
    k = math.lcm(cfg.bk, mq.BLOCK) * kb if fmt in ("Q8_0", "Q4_0") else 256 * (1 + kb % 3)
    lim = realize_mod.limits()
    if not cfg.fits(matmul_coop.fragment(lim, "float16"), lim):
        cfg = mq.config(dataclasses.replace(lim, tuned=()), m, n, k)  # the default: y itself, no K split
    dev = get_device()
    qt, weights, x, xb, r, rb = _operands(dev, fmt, m, n, k, np.float16, seed)
    out = mq.matmul_quant(dev, lim, weights, xb, m, cfg, residual=rb if residual else None)
    got = dev.download(out, np.float32, (m, n))
    _check(got, x, dequantize(qt).astype(np.float16), r if residual else 0.0)


@needs_f16
@pytest.mark.parametrize("cfg", _DEEP, ids=lambda c: c.label())
def test_every_prefill_tile_matches_numpy(cfg):
    """Each tile the search may pick (matmul_coop.CONFIGS of whole blocks: both prefetch depths and stage counts,
    K split or not) computes the same product, over rows and columns that are not whole tiles; a split one writes
    partial planes whose sum is the product."""
    lim = realize_mod.limits()
    if not cfg.fits(matmul_coop.fragment(lim, "float16"), lim):
        pytest.skip(f"{cfg} does not fit this device")
    _prefill_tile_case(lim, "Q4_0", cfg, 200, 136, 3 * math.lcm(cfg.bk * cfg.ks, mq.BLOCK))


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


# ---- few rows (a batched decode step): small tiles, int8-block activations ---------------------------------------


def test_decode_config_fills_the_device_with_few_rows():
    lim = fake_limits()
    for m in (1, 8, 16, 17, 32, 40, 63):
        for n, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (200, 512)):
            cfg = mq.decode_config(lim, m, n, k)
            assert cfg is not None and cfg.fits((16, 16, 16), lim)
            assert cfg.bm == 16 * -(-m // 16) and k % (cfg.bk * cfg.ks) == 0 and cfg.bk % (cfg.wk * 16) == 0
            groups = -(-n // cfg.bn) * cfg.ks
            assert groups >= min(mq.DECODE_GROUPS, -(-n // cfg.bn) * 8) or (k // (2 * cfg.ks)) % cfg.bk
    assert mq.decode_config(lim, 8, 4096, 4096).ks == 4  # 128 column tiles: K split four ways
    assert mq.decode_config(lim, 8, 28672, 4096).ks == 1
    assert mq.decode_config(lim, 64, 4096, 4096) is None  # prefill tiles from there
    assert mq.decode_config(fake_limits(coop=()), 8, 4096, 4096) is None
    assert mq.decode_config(lim, 8, 4096, 48) is None


@pytest.mark.parametrize("fmt", mq.FORMATS)
@pytest.mark.parametrize("residual,int8,pf", [(False, True, 1), (True, True, 2), (True, False, 1), (False, False, 2)])
def test_decode_programs_compile(fmt, residual, int8, pf):
    n, k = 200, 768
    weights = mq_weights(fmt, n, k)
    cfg = dataclasses.replace(mq.decode_config(fake_limits(), 8, n, k), pf=pf)
    if residual:
        cfg = dataclasses.replace(cfg, ks=1)
    src = mq.source(fmt, n, k, weights.w_stride, weights.s_stride, cfg, (16, 16, 16), 32, residual, int8)
    assert ("xq[" in src) == int8 and ("res[" in src) == residual
    compiles(src)
    with pytest.raises(ValueError, match="residual"):
        mq.source(fmt, n, k, weights.w_stride, weights.s_stride, dataclasses.replace(cfg, ks=2), (16, 16, 16), 32,
                  True, int8)


@pytest.mark.parametrize("m,bm,bk,nt", [(5, 16, 64, 32), (37, 16, 256, 256), (8, 32, 128, 96)])
def test_int8_activation_staging_matches_numpy(m, bm, bk, nt):
    """The product's staging of int8 activations (Q8Acts as quantize_activations and the fused norms write them),
    run alone on any device: every value is int8 * its block's scale rounded to float16 (one unit in the last
    place: packHalf2x16's rounding mode), rows past m never read."""
    k = 512
    rng = np.random.default_rng(m)
    x = (rng.standard_normal((m, k)) * rng.choice([1e-2, 1.0, 30.0], size=(m, 1))).astype(np.float32)
    dev = get_device()
    xb = dev.alloc(x.nbytes)
    dev.upload(xb, x)
    xq, xd, _ = mv.quantize_activations(dev, xb, m, k)
    out = dev.alloc(m * k * 2)
    kern = dev.pipeline(mq.stage_x_source(m, k, bm, bk, nt), name="stage_x8")
    dev.dispatch(kern, [xq, xd, out], (-(-m // bm), k // bk, 1))
    got = dev.download(out, np.float16, (m, k)).astype(np.float64)
    q = dev.download(xq, np.int8, (m, k)).astype(np.float64)
    d = dev.download(xd, np.float32, (m, k // 32)).astype(np.float64)
    want = q * np.repeat(d, 32, axis=1)
    assert np.abs(q).max() == 127 and np.all(np.abs(want - x) <= np.repeat(d, 32, axis=1) / 2 + 1e-6)
    assert np.all(np.abs(got - want) <= np.maximum(np.abs(want) * 2.0**-10, 2.0**-24))


def _int8_acts(rows: int, k: int) -> template_ops.Int8Activations:
    x = Tensor(np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32))
    return template_ops.rms_norm_q8(x, Tensor(np.ones(k, np.float32)), 1e-5)


def test_decode_rows_take_the_kernel_from_the_threshold(monkeypatch):
    """With cooperative matrices, from VKGRAPH_DECODE_MM_ROWS rows up to DEQUANT_ROWS - 1 a decode step's products
    take matmul_quant's small tiles, int8 activations as they come (takes_int8 says so); fewer rows, the flag at
    0, a device without them or a prefill keep the matvec. A K split sums its planes in a generated kernel with the
    residual."""
    monkeypatch.setattr(template_ops, "limits", lambda: fake_limits())
    monkeypatch.setattr(template_ops, "has_dtype", lambda d: True)
    lin = QuantLinear(random_blocks(np.random.default_rng(0), "Q4_0", 96, 512))
    monkeypatch.delenv("VKGRAPH_DECODE_MM_ROWS", raising=False)  # the default: where the tile won on an H200
    # a prefill's rows keep the matvec whatever their count: its logits do not depend on its padding
    assert lin.decode_tile(16) is None and not lin.takes_int8(16)
    assert _graph_names(lin(Tensor(np.zeros((16, 512), np.float32)))) == {"matvec_Q4_0"}
    with template_ops.decoding():
        assert lin.decode_tile(8) is None and lin.decode_tile(15) is None and lin.decode_tile(16) is not None
        monkeypatch.setenv("VKGRAPH_DECODE_MM_ROWS", "8")
        for rows in (8, 32, template_ops.DEQUANT_ROWS - 1):
            assert lin.decode_tile(rows) is not None and lin.takes_int8(rows)
            r = Tensor(np.zeros((rows, 96), np.float32))
            assert _graph_names(lin(_int8_acts(rows, 512), residual=r)) == {"matmul_quant_Q4_0", "rmsnorm_q8"}
            assert _graph_names(lin(Tensor(np.zeros((rows, 512), np.float32)))) == {"matmul_quant_Q4_0"}
        assert lin.decode_tile(7) is None
        assert _graph_names(lin(Tensor(np.zeros((7, 512), np.float32)))) == {"matvec_Q4_0"}
        assert lin.decode_tile(template_ops.DEQUANT_ROWS) is None
        monkeypatch.setenv("VKGRAPH_DECODE_MM_ROWS", "0")
        assert lin.decode_tile(8) is None
        assert _graph_names(lin(Tensor(np.zeros((8, 512), np.float32)))) == {"matvec_Q4_0"}
        monkeypatch.setenv("VKGRAPH_DECODE_MM_ROWS", "8")
        monkeypatch.setattr(template_ops, "limits", lambda: fake_limits(coop=()))
        assert lin.decode_tile(8) is None
        assert lin.takes_int8(8) == template_ops.mv.takes_int8(lin.weights.format, 8, 512)
        monkeypatch.setattr(template_ops, "limits", lambda: fake_limits())
        monkeypatch.setenv("VKGRAPH_DECODE_FUSION", "0")
        assert not lin.takes_int8(8)


def _decode_case(fmt: str, m: int, n: int, k: int, cfg: mq.Tile, residual: bool, int8: bool, seed: int) -> None:
    """One small-row product on the device (float16 rows or int8 blocks, the planes of a K split summed here)
    against numpy in float64 over the values the kernel stages."""
    lim = realize_mod.limits()
    dev = get_device()
    qt, weights, x, xb, r, rb = _operands(dev, fmt, m, n, k, np.float32, seed)
    if int8:
        xq, xd, xs = mv.quantize_activations(dev, xb, m, k)
        xin = mv.Q8Acts(xq, xd, xs)
        q = dev.download(xq, np.int8, (m, k)).astype(np.float32)
        xs16 = (q * np.repeat(dev.download(xd, np.float32, (m, k // 32)), 32, axis=1)).astype(np.float16)
    else:
        xs16 = x.astype(np.float16)
        xin = dev.alloc(xs16.nbytes)
        dev.upload(xin, xs16)
    out = mq.matmul_quant(dev, lim, weights, xin, m, cfg, residual=rb if residual else None)
    got = dev.download(out, np.float32, (cfg.ks, m, n)).astype(np.float64).sum(0)
    # x rounded to float16 on the device too where it is staged from int8 blocks
    _check(got, xs16, dequantize(qt).astype(np.float16), r if residual else 0.0, 2.0**-9 if int8 else 2.0**-10)


@needs_f16
@pytest.mark.parametrize("int8,wk,ks,pf,residual", [
    (False, 1, 1, 1, False), (True, 1, 1, 1, False), (True, 4, 1, 1, False), (True, 1, 4, 1, False),
    (True, 1, 1, 2, False), (True, 4, 4, 1, False), (True, 4, 1, 2, True), (False, 2, 2, 2, False)])
def test_decode_tile_variants(int8, wk, ks, pf, residual):
    """Each part of the small-row tile alone, then together (a failing case names the part): the int8 staging,
    the depth split among subgroups, the K split among workgroups, two slices in flight (over an odd number
    of slices: 1024 / 128 / ks with ks = 1, and 1152 deep), the residual."""
    tile = mq.Tile(16, 32, 128, 1, 2, 1, pf=pf, wk=wk, ks=ks)
    _decode_case("Q4_0", 11, 100, 1152 if ks == 1 else 1024, tile, residual, int8, 5)


@needs_f16
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(mq.FORMATS), m=st.integers(1, 40), n=st.integers(1, 300), kb=st.integers(1, 4),
       residual=st.booleans(), int8=st.booleans(), seed=st.integers(0, 2**16))
def test_decode_products_match_numpy(fmt, m, n, kb, residual, int8, seed):
    """The small tiles (decode_config, its K split; without it where a residual is fused) on float16 rows or
    int8 blocks, against numpy in float64 over the values the kernel stages."""
    k = 256 * kb
    cfg = mq.decode_config(realize_mod.limits(), m, n, k)
    if residual:
        cfg = dataclasses.replace(cfg, ks=1)
    _decode_case(fmt, m, n, k, cfg, residual, int8, seed)


def test_decode_step_batch8_matches_the_matvec_route(tmp_path, monkeypatch):
    """A batch-8 decode step of a Q4_0 model (norms, attention and GLU writing int8 blocks) through matmul_quant's
    small tiles gives the matvec route's logits within the int8 activations' reach: the float16 staging's
    rounding (2^-11 of x and of W) is far smaller, but where it moves a value across an int8 rounding boundary of
    the next layer's blocks, that value moves by half a step (1/254 of its block's largest), as in
    test_llm.test_int8_activations_stay_close_to_the_reference (1.09% of the largest logit on an H200)."""
    from vkgraph.nn import tiny_model
    from vkgraph.nn.layers import StepInputs
    from vkgraph.nn.llama import LlamaModel
    from vkgraph.nn.weights import load_weights

    if not _has("float16"):
        emulate_coop(monkeypatch)  # the same routing, its matrix operations emulated
    path = tiny_model.write_model(tmp_path, tiny_model.tiny_config(n_heads=2, n_kv_heads=1, head_dim=32),
                                  gguf_types=("Q4_0",), safetensors=False)["Q4_0"]
    model = LlamaModel(load_weights(path, progress=False), num_blocks=16, block_size=16, kv_dtype="f32",
                       max_blocks_per_seq=2, float_dtype="float32")
    b = 8
    tokens = Tensor(np.array([5, 17, 42, 99, 7, 3, 250, 11], np.int32))
    step = StepInputs(Tensor(np.zeros(b, np.int32)), Tensor(np.arange(b, dtype=np.int32) * 32),
                      block_tables=Tensor(np.arange(2 * b, dtype=np.int32).reshape(b, 2)),
                      context_lens=Tensor(np.ones(b, np.int32)), decode=True)
    got = {}
    for rows in ("8", "0"):
        monkeypatch.setenv("VKGRAPH_DECODE_MM_ROWS", rows)
        with count_kernels() as c:
            got[rows] = model(tokens, step).numpy()
        assert any(n.startswith("matmul_quant") for n in c.names) == (rows == "8"), c.names
    err = np.abs(got["8"] - got["0"]).max() / np.abs(got["0"]).max()
    assert np.isfinite(got["8"]).all() and err < 3e-2, err

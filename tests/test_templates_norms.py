"""RMSNorm, softmax, argmax, SwiGLU and RoPE templates against float64 numpy, and the decode step's int8 writers
(rmsnorm_q8, glu_q8) against numpy's quantization of numpy's results."""

import dataclasses
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_templates_common import check, device, quantize_q8_ref, snapshot, upload

from vkgraph.templates import norms
from vkgraph.templates.matvec import Q8Acts

shapes = st.tuples(st.integers(1, 6), st.integers(1, 5000))


@settings(max_examples=15, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_rmsnorm(shape, seed):
    rows, n = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    dev = device()
    since = snapshot()
    y = norms.rmsnorm(dev, upload(dev, x), upload(dev, w), rows, n, eps=1e-5)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    check(dev.download(y, np.float32, (rows, n)), ref, since)


@settings(max_examples=15, deadline=None)
@given(shape=shapes, scale=st.sampled_from([1.0, 0.125, 30.0]), seed=st.integers(0, 2**31))
def test_softmax(shape, scale, seed):
    rows, n = shape
    x = (np.random.default_rng(seed).standard_normal((rows, n)) * 3).astype(np.float32)
    x[0, : n // 3] = -np.inf  # masked entries
    dev = device()
    since = snapshot()
    y = norms.softmax(dev, upload(dev, x), rows, n, scale=scale)
    s = x.astype(np.float64) * scale
    e = np.exp(s - s.max(axis=1, keepdims=True))
    check(dev.download(y, np.float32, (rows, n)), e / e.sum(axis=1, keepdims=True), since)


@settings(max_examples=15, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31), ties=st.booleans())
def test_argmax(shape, seed, ties):
    rows, n = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    if ties:
        x = np.round(x).astype(np.float32)  # many equal maxima: the first must win
    dev = device()
    since = snapshot()
    got = dev.download(norms.argmax(dev, upload(dev, x), rows, n), np.int32, rows)
    check(got, np.argmax(x, axis=1), since, tol=0)


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 70000), seed=st.integers(0, 2**31))
def test_swiglu(n, seed):
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(n) * 4).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32)
    dev = device()
    since = snapshot()
    y = norms.swiglu(dev, upload(dev, g), upload(dev, u), n)
    g64 = g.astype(np.float64)
    check(dev.download(y, np.float32, n), g64 / (1 + np.exp(-g64)) * u, since)


@pytest.mark.parametrize("neox", [False, True])
@settings(max_examples=8, deadline=None)
@given(tokens=st.integers(1, 9), heads=st.integers(1, 4), d=st.sampled_from([64, 80, 128]),
       seed=st.integers(0, 2**31))
def test_rope(neox, tokens, heads, d, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, heads, d)).astype(np.float32)
    pos = rng.integers(0, 4096, tokens).astype(np.int32)
    dev = device()
    buf = upload(dev, x)
    since = snapshot()
    norms.rope(dev, buf, upload(dev, pos), tokens, heads, d, base=10000.0, neox=neox)
    theta = pos[:, None].astype(np.float64) * 10000.0 ** (-2 * np.arange(d // 2) / d)  # [T, D/2]
    c, s = np.cos(theta)[:, None], np.sin(theta)[:, None]
    x64 = x.astype(np.float64)
    a, b = (x64[..., : d // 2], x64[..., d // 2:]) if neox else (x64[..., 0::2], x64[..., 1::2])
    ra, rb = a * c - b * s, a * s + b * c
    ref = np.concatenate([ra, rb], axis=-1) if neox else np.stack([ra, rb], axis=-1).reshape(x.shape)
    check(dev.download(buf, np.float32, x.shape), ref, since)


def test_norms_bad_input():
    dev = device()
    x = upload(dev, np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match="smaller than"):
        norms.rmsnorm(dev, x, upload(dev, np.zeros(4, np.float32)), 2, 8)
    with pytest.raises(ValueError, match="positive"):
        norms.softmax(dev, x, 0, 8)
    with pytest.raises(ValueError, match="even"):
        norms.rope(dev, x, upload(dev, np.zeros(2, np.int32)), 2, 1, 7)


@contextmanager
def _shuffles(dev, on: bool):
    """The device as it is, or as one without subgroup shuffles (the templates' shared-memory path)."""
    saved = dev.info
    if not on:
        dev.info = dataclasses.replace(saved, subgroup_ops=saved.subgroup_ops - {"shuffle"})
    try:
        yield
    finally:
        dev.info = saved


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("n", [5, 96, 1000])
def test_row_reductions_either_path(shuffle, n):
    """rmsnorm and softmax through the subgroup reduction and through the shared-memory tree."""
    dev = device()
    x = (np.random.default_rng(n).standard_normal((3, n)) * 3).astype(np.float32)
    w = np.random.default_rng(n + 1).standard_normal(n).astype(np.float32)
    x64 = x.astype(np.float64)
    with _shuffles(dev, shuffle):
        since = snapshot()
        y = norms.rmsnorm(dev, upload(dev, x), upload(dev, w), 3, n, eps=1e-5)
        check(dev.download(y, np.float32, x.shape), x64 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + 1e-5) * w,
              since)
        since = snapshot()
        y = norms.softmax(dev, upload(dev, x), 3, n)
    e = np.exp(x64 - x64.max(1, keepdims=True))
    check(dev.download(y, np.float32, x.shape), e / e.sum(1, keepdims=True), since)


def _check_q8(dev, buf, y: np.ndarray, since) -> None:
    """The int8 blocks in `buf` against numpy's quantization of y [rows, n] (float32): values within one rounding
    step, rarely off (the kernel's float32 y may differ from y in the last bit), scales to float32 rounding,
    half-block sums exactly those of the int8 values."""
    rows, n = y.shape
    acts = Q8Acts.in_buffer(buf, rows, n)
    q = dev.download(acts.xq, np.int8, (rows, n))
    d = dev.download(acts.xd, np.float32, (rows * n // 32,))
    s = dev.download(acts.xs, np.int32, (rows * n // 16,))
    q_ref, d_ref = quantize_q8_ref(y)
    off = q.astype(int) - q_ref
    assert np.abs(off).max() <= 1 and np.count_nonzero(off) <= 2 + q.size // 100
    np.testing.assert_allclose(d, d_ref, rtol=1e-5, atol=0)
    assert (s == q.reshape(-1, 16).astype(np.int32).sum(1)).all()
    check(q.astype(np.float64), q_ref.astype(np.float64), since, tol=1e-2)


def _special(rng, shape, kind: str) -> np.ndarray:
    x = rng.standard_normal(shape) * 3
    if kind == "zeros":
        x[0] = 0  # a whole row of zeros
    elif kind == "huge":
        x *= 1e30  # squares past float32's range
        x[-1, 0] = 3e38  # and one value near its largest
    elif kind == "tiny":
        x *= 1e-18  # squares far below eps
    elif kind == "negative":
        x = -np.abs(x)
    return x.astype(np.float32)


SPECIALS = ["normal", "zeros", "huge", "tiny", "negative"]


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 32), blocks=st.integers(1, 256), kind=st.sampled_from(SPECIALS),
       wg=st.sampled_from([None, None, 256, 1024]), shuffle=st.booleans(), seed=st.integers(0, 2**31))
@example(rows=1, blocks=128, kind="normal", wg=None, shuffle=True, seed=0)
@example(rows=32, blocks=137, kind="huge", wg=None, shuffle=False, seed=1)
@example(rows=32, blocks=256, kind="zeros", wg=None, shuffle=True, seed=2)
@example(rows=3, blocks=128, kind="huge", wg=None, shuffle=True, seed=3)
def test_rmsnorm_q8_drawn(rows, blocks, kind, wg, shuffle, seed):
    """rmsnorm_q8 at decode's rows (1..32) and widths (multiples of 32 to 8192), either exchange path, special
    rows included: all zeros (scale 0), values whose squares overflow float32, tiny and all-negative ones."""
    n = 32 * blocks
    rng = np.random.default_rng(seed)
    x = _special(rng, (rows, n), kind)
    w = rng.standard_normal(n).astype(np.float32)
    w[:32] = 0  # a block of zeros in every row
    dev = device()
    with _shuffles(dev, shuffle):
        since = snapshot()
        buf = norms.rmsnorm_q8(dev, upload(dev, x), upload(dev, w), rows, n, eps=1e-5, wg=wg)
    x64 = x.astype(np.float64)
    y = (x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * w).astype(np.float32)
    _check_q8(dev, buf, y, since)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 32), blocks=st.integers(1, 448), gelu=st.booleans(),
       kind=st.sampled_from(["normal", "zeros", "huge", "negative"]), wg=st.sampled_from([64, 64, 8, 256]),
       shuffle=st.booleans(), seed=st.integers(0, 2**31))
@example(rows=1, blocks=448, gelu=False, kind="normal", wg=64, shuffle=True, seed=0)
@example(rows=32, blocks=45, gelu=True, kind="huge", wg=64, shuffle=False, seed=1)
def test_glu_q8_drawn(rows, blocks, gelu, kind, wg, shuffle, seed):
    """glu_q8 at decode's rows and widths (F a multiple of 32 to 14336), either exchange path: zero up halves
    (scale 0), huge gates (SiLU and GELU saturate to g or 0), all-negative ones."""
    f = 32 * blocks
    rng = np.random.default_rng(seed)
    gu = (rng.standard_normal((rows, 2 * f)) * 4).astype(np.float32)
    if kind == "zeros":
        gu[:, f:] = 0
    elif kind == "huge":
        gu[:, :f] *= 1e17  # products up to ~1e19: finite
    elif kind == "negative":
        gu = -np.abs(gu)
    gu[:, f:f + 32] = 0  # the first block of every row: scale 0
    dev = device()
    with _shuffles(dev, shuffle):
        since = snapshot()
        buf = norms.glu_q8(dev, upload(dev, gu), rows, f, gelu_tanh=gelu, wg=wg)
    g, u = gu[:, :f].astype(np.float64), gu[:, f:].astype(np.float64)
    with np.errstate(over="ignore"):
        a = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) if gelu else g / (1 + np.exp(-g))
    _check_q8(dev, buf, (a * u).astype(np.float32), since)


def test_q8_writers_bad_input():
    dev = device()
    x = upload(dev, np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="n % 32"):
        norms.rmsnorm_q8(dev, x, x, 2, 48)
    with pytest.raises(ValueError, match="power of two"):
        norms.rmsnorm_q8(dev, x, x, 2, 64, wg=48)
    with pytest.raises(ValueError, match="f % 32"):
        norms.glu_q8(dev, x, 2, 16)
    with pytest.raises(ValueError, match="power of two"):
        norms.glu_q8(dev, x, 1, 32, wg=4)

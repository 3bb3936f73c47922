"""RMSNorm, softmax, argmax, SwiGLU and RoPE templates against float64 numpy."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_templates_common import check, device, snapshot, upload

from vkgraph.templates import norms

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

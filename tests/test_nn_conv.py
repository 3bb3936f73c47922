"""Convolution, pooling, resizing and padding modes against direct numpy loops (hypothesis-drawn small shapes,
size-1 axes and empty batches), with their gradients against finite differences."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from gradcheck import check_grad
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vkgraph import Tensor
from vkgraph.nn import functional as F

FAST = settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))


def close(got, want, tol=2e-5):
    got = got.numpy() if isinstance(got, Tensor) else np.asarray(got)
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.size:
        err = np.abs(got.astype(np.float64) - want).max() / max(np.abs(want).max(), 1.0)
        assert err <= tol, err


def ref_conv(x, w, b, stride, pads, dilation, groups):
    """Direct cross-correlation: out[n, o, p] = sum over c, k of xpad[n, g c, p s + k d] w[o, c, k]."""
    nd = w.ndim - 2
    xp = np.pad(x, [(0, 0), (0, 0)] + list(pads))
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    k = w.shape[2:]
    outs = [(xp.shape[2 + i] - dilation[i] * (k[i] - 1) - 1) // stride[i] + 1 for i in range(nd)]
    out = np.zeros((n, o, *outs))
    og = o // groups
    for pos in itertools.product(*(range(v) for v in outs)):
        for kk in itertools.product(*(range(v) for v in k)):
            src = tuple(p * s + q * d for p, s, q, d in zip(pos, stride, kk, dilation))
            patch = xp[(slice(None), slice(None)) + src]  # (n, c)
            for gi in range(groups):
                out[(slice(None), slice(gi * og, (gi + 1) * og)) + pos] += \
                    patch[:, gi * cg:(gi + 1) * cg] @ w[(slice(gi * og, (gi + 1) * og), slice(None)) + kk].T
    if b is not None:
        out += b.reshape((1, o) + (1,) * nd)
    return out


@FAST
@given(nd=st.sampled_from([1, 2, 3]), n=st.integers(0, 2), groups=st.sampled_from([1, 2]), cpg=st.integers(1, 2),
       opg=st.integers(1, 2), size=st.integers(1, 6), k=st.integers(1, 3), stride=st.integers(1, 2),
       dilation=st.integers(1, 2), padding=st.sampled_from([0, 1, "same", "valid"]), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_conv(nd, n, groups, cpg, opg, size, k, stride, dilation, padding, bias, seed):
    if nd == 3:
        size, k = min(size, 4), min(k, 2)
    if padding == "same":
        stride = 1
    pad_n = 0 if padding in ("valid", "same") else padding
    if size + 2 * pad_n < dilation * (k - 1) + 1 and padding != "same":
        return
    rng = np.random.default_rng(seed)
    c, o = groups * cpg, groups * opg
    x = rng.standard_normal((n, c) + (size,) * nd)
    w = rng.standard_normal((o, cpg) + (k,) * nd)
    b = rng.standard_normal(o) if bias else None
    if padding == "same":
        t = dilation * (k - 1)
        pads = [(t // 2, t - t // 2)] * nd
    else:
        pads = [(pad_n, pad_n)] * nd
    want = ref_conv(x, w, b, (stride,) * nd, pads, (dilation,) * nd, groups)
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    got = fn(Tensor(x.astype(np.float32)), Tensor(w.astype(np.float32)),
             None if b is None else Tensor(b.astype(np.float32)), stride, padding, dilation, groups)
    close(got, want)


def test_conv_grads():
    rng = np.random.default_rng(1)
    x, w, b = rng.standard_normal((2, 4, 5, 6)), rng.standard_normal((6, 2, 3, 2)), rng.standard_normal(6)
    check_grad(lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=1, dilation=(1, 2), groups=2),
               lambda x, w, b: ref_conv(x, w, b, (2, 1), [(1, 1), (1, 1)], (1, 2), 2), [x, w, b])
    x1, w1 = rng.standard_normal((1, 2, 7)), rng.standard_normal((3, 2, 3))
    check_grad(lambda x, w: F.conv1d(x, w, padding="same", dilation=2),
               lambda x, w: ref_conv(x, w, None, (1,), [(2, 2)], (2,), 1), [x1, w1])


def ref_conv_transpose(x, w, b, stride, padding, output_padding, groups, dilation):
    nd = w.ndim - 2
    n, c = x.shape[:2]
    og = w.shape[1]
    k = w.shape[2:]
    full = [(x.shape[2 + i] - 1) * stride[i] + dilation[i] * (k[i] - 1) + 1 + output_padding[i] for i in range(nd)]
    out = np.zeros((n, og * groups, *full))
    cg = c // groups
    for pos in itertools.product(*(range(v) for v in x.shape[2:])):
        for kk in itertools.product(*(range(v) for v in k)):
            dst = tuple(p * s + q * d for p, s, q, d in zip(pos, stride, kk, dilation))
            for gi in range(groups):
                xs = x[(slice(None), slice(gi * cg, (gi + 1) * cg)) + pos]  # (n, cg)
                ws = w[(slice(gi * cg, (gi + 1) * cg), slice(None)) + kk]  # (cg, og)
                out[(slice(None), slice(gi * og, (gi + 1) * og)) + dst] += xs @ ws
    crop = tuple(slice(p, f - p) for p, f in zip(padding, full))
    out = out[(slice(None), slice(None)) + crop]
    if b is not None:
        out += b.reshape((1, -1) + (1,) * nd)
    return out


@FAST
@given(nd=st.sampled_from([1, 2]), groups=st.sampled_from([1, 2]), size=st.integers(1, 5), k=st.integers(1, 3),
       stride=st.integers(1, 3), padding=st.integers(0, 1), dilation=st.integers(1, 2), extra=st.booleans(),
       seed=st.integers(0, 2**16))
def test_conv_transpose(nd, groups, size, k, stride, padding, dilation, extra, seed):
    op = 1 if extra and max(stride, dilation) > 1 else 0
    full = (size - 1) * stride + dilation * (k - 1) + 1 + op
    if full - 2 * padding <= 0:
        return
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 2 * groups) + (size,) * nd)
    w = rng.standard_normal((2 * groups, 3) + (k,) * nd)
    b = rng.standard_normal(3 * groups)
    fn = F.conv_transpose1d if nd == 1 else F.conv_transpose2d
    got = fn(Tensor(x.astype(np.float32)), Tensor(w.astype(np.float32)), Tensor(b.astype(np.float32)), stride,
             padding, op, groups, dilation)
    close(got, ref_conv_transpose(x, w, b, (stride,) * nd, (padding,) * nd, (op,) * nd, groups, (dilation,) * nd))


def test_conv_transpose_grad():
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((1, 2, 3, 3)), rng.standard_normal((2, 2, 2, 3))
    check_grad(lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=(0, 1), output_padding=1),
               lambda x, w: ref_conv_transpose(x, w, None, (2, 2), (0, 1), (1, 1), 1, (1, 1)), [x, w])


def _pool_out(L, k, s, p, d, ceil):
    span = L + 2 * p - d * (k - 1) - 1
    o = (-(-span // s) if ceil else span // s) + 1
    if ceil and (o - 1) * s >= L + p:
        o -= 1
    return o


def ref_pool2d(x, k, s, p, d, ceil, kind, count_include_pad=True):
    n, c, h, w = x.shape
    oh, ow = _pool_out(h, k, s, p, d, ceil), _pool_out(w, k, s, p, d, ceil)
    out = np.zeros((n, c, oh, ow))
    idx = np.zeros((n, c, oh, ow), np.int64)
    for i in range(oh):
        for j in range(ow):
            rows = [i * s - p + a * d for a in range(k)]
            cols = [j * s - p + b * d for b in range(k)]
            if kind == "max":
                best = np.full((n, c), -np.inf)
                for r in rows:
                    for q in cols:
                        if 0 <= r < h and 0 <= q < w:
                            v = x[:, :, r, q]
                            upd = v > best
                            best = np.where(upd, v, best)
                            idx[:, :, i, j] = np.where(upd, r * w + q, idx[:, :, i, j])
                out[:, :, i, j] = best
            else:
                tot = np.zeros((n, c))
                for r in rows:
                    for q in cols:
                        if 0 <= r < h and 0 <= q < w:
                            tot += x[:, :, r, q]
                if count_include_pad:
                    hs, ws_ = i * s - p, j * s - p
                    he, we = min(hs + k, h + p), min(ws_ + k, w + p)
                    cnt = (he - hs) * (we - ws_)
                else:
                    cnt = sum(1 for r in rows if 0 <= r < h) * sum(1 for q in cols if 0 <= q < w)
                out[:, :, i, j] = tot / cnt
    return out, idx


@FAST
@given(h=st.integers(1, 7), w=st.integers(1, 7), k=st.integers(1, 3), s=st.integers(1, 3), p=st.integers(0, 1),
       d=st.integers(1, 2), ceil=st.booleans(), seed=st.integers(0, 2**16))
@example(h=1, w=1, k=2, s=1, p=1, d=2, ceil=False, seed=0)
def test_max_pool2d(h, w, k, s, p, d, ceil, seed):
    if p > k // 2 or min(h, w) + 2 * p < d * (k - 1) + 1:
        return
    x = np.random.default_rng(seed).standard_normal((2, 3, h, w))
    want, widx = ref_pool2d(x, k, s, p, d, ceil, "max")
    out, idx = F.max_pool2d(Tensor(x.astype(np.float32)), k, s, p, d, ceil, return_indices=True)
    empty = np.isneginf(want)  # a window wholly in the padding: -inf, its index unspecified
    np.testing.assert_array_equal(np.isneginf(out.numpy()), empty)
    close(np.where(empty, 0, out.numpy()), np.where(empty, 0, want))
    idx = idx.numpy()
    np.testing.assert_array_equal(idx[~empty], widx[~empty])


@FAST
@given(h=st.integers(1, 7), w=st.integers(1, 7), k=st.integers(1, 3), s=st.integers(1, 3), p=st.integers(0, 1),
       ceil=st.booleans(), include=st.booleans(), seed=st.integers(0, 2**16))
def test_avg_pool2d(h, w, k, s, p, ceil, include, seed):
    if p > k // 2 or min(h, w) + 2 * p < k:
        return
    x = np.random.default_rng(seed).standard_normal((1, 2, h, w))
    want, _ = ref_pool2d(x, k, s, p, 1, ceil, "avg", include)
    close(F.avg_pool2d(Tensor(x.astype(np.float32)), k, s, p, ceil, include), want)


def test_pool1d_and_grads():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 9))
    close(F.max_pool1d(Tensor(x.astype(np.float32)), 1, 2), x[:, :, ::2])
    close(F.max_pool1d(Tensor(x.astype(np.float32)), 3), np.stack([x[..., i:i + 3].max(-1) for i in (0, 3, 6)], -1))
    close(F.avg_pool1d(Tensor(x.astype(np.float32)), 3, 2, 1, count_include_pad=False), _avg1d(x, 3, 2, 1))
    x2 = rng.permutation(36).reshape(1, 1, 6, 6) / 7.0  # distinct values: the max is unique
    check_grad(lambda t: F.max_pool2d(t, 2), lambda t: ref_pool2d(t, 2, 2, 0, 1, False, "max")[0], [x2])
    check_grad(lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True),
               lambda t: ref_pool2d(t, 3, 2, 1, 1, True, "avg")[0], [x2])


def _avg1d(x, k, s, p):
    L = x.shape[-1]
    o = (L + 2 * p - k) // s + 1
    out = np.zeros(x.shape[:-1] + (o,))
    for i in range(o):
        lo, hi = max(i * s - p, 0), min(i * s - p + k, L)
        out[..., i] = x[..., lo:hi].mean(-1)
    return out


def ref_adaptive(x, out, kind):
    h, w = x.shape[-2:]
    oh, ow = out
    res = np.zeros(x.shape[:-2] + (oh, ow))
    for i in range(oh):
        for j in range(ow):
            hs, he = (i * h) // oh, -((-(i + 1) * h) // oh)
            ws, we = (j * w) // ow, -((-(j + 1) * w) // ow)
            win = x[..., hs:he, ws:we]
            res[..., i, j] = win.max((-1, -2)) if kind == "max" else win.mean((-1, -2))
    return res


@FAST
@given(h=st.integers(1, 9), w=st.integers(1, 9), oh=st.integers(1, 4), ow=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_adaptive_pools(h, w, oh, ow, seed):
    x = np.random.default_rng(seed).standard_normal((2, 3, h, w))
    t = Tensor(x.astype(np.float32))
    close(F.adaptive_avg_pool2d(t, (oh, ow)), ref_adaptive(x, (oh, ow), "avg"))
    close(F.adaptive_max_pool2d(t, (oh, ow)), ref_adaptive(x, (oh, ow), "max"))
    close(F.adaptive_avg_pool1d(t[:, :, 0], ow), ref_adaptive(x[:, :, :1], (1, ow), "avg")[:, :, 0])


def _ref_resize_axis(x, axis, out, mode, align):
    L = x.shape[axis]
    res = []
    for i in range(out):
        if mode == "nearest":
            src = min(int(math.floor(i * L / out)), L - 1)
            res.append(np.take(x, src, axis))
            continue
        if mode == "nearest-exact":
            src = min(int(math.floor((i + 0.5) * L / out)), L - 1)
            res.append(np.take(x, src, axis))
            continue
        if align:
            pos = i * (L - 1) / (out - 1) if out > 1 else 0.0
        else:
            pos = (i + 0.5) * L / out - 0.5
        if mode == "linear":
            pos = max(pos, 0.0)
            i0 = min(int(math.floor(pos)), L - 1)
            i1 = min(i0 + 1, L - 1)
            t = pos - math.floor(pos)
            res.append(np.take(x, i0, axis) * (1 - t) + np.take(x, i1, axis) * t)
        else:  # cubic convolution, A = -0.75, clamped taps
            f = math.floor(pos)
            t = pos - f
            acc = 0
            for m in range(-1, 3):
                u = abs(t - m)
                a = -0.75
                wgt = ((a + 2) * u - (a + 3)) * u * u + 1 if u <= 1 else (((a * u - 5 * a) * u + 8 * a) * u - 4 * a
                                                                          if u < 2 else 0.0)
                acc = acc + np.take(x, min(max(f + m, 0), L - 1), axis) * wgt
            res.append(acc)
    return np.stack(res, axis)


@FAST
@given(h=st.integers(1, 6), w=st.integers(1, 6), oh=st.integers(1, 9), ow=st.integers(1, 9),
       mode=st.sampled_from(["nearest", "nearest-exact", "bilinear", "bicubic"]), align=st.booleans(),
       seed=st.integers(0, 2**16))
def test_interpolate(h, w, oh, ow, mode, align, seed):
    x = np.random.default_rng(seed).standard_normal((1, 2, h, w))
    ac = align if mode in ("bilinear", "bicubic") else None
    axis_mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    want = _ref_resize_axis(_ref_resize_axis(x, 2, oh, axis_mode, ac), 3, ow, axis_mode, ac)
    close(F.interpolate(Tensor(x.astype(np.float32)), size=(oh, ow), mode=mode, align_corners=ac), want, 1e-5)


def test_interpolate_scale_and_linear():
    x = np.arange(5, dtype=np.float32).reshape(1, 1, 5)
    np.testing.assert_allclose(F.interpolate(Tensor(x), scale_factor=2, mode="linear").numpy(),
                               _ref_resize_axis(x.astype(np.float64), 2, 10, "linear", False), atol=1e-6)
    with pytest.raises(ValueError):
        F.interpolate(Tensor(x), size=3, mode="nearest", align_corners=True)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular", "constant"])
def test_pad_modes(mode):
    x = np.random.default_rng(4).standard_normal((2, 3, 4))
    pads = (2, 1, 1, 2)
    np_mode = {"replicate": "edge", "circular": "wrap"}.get(mode, mode)
    want = np.pad(x, [(0, 0), (1, 2), (2, 1)], mode=np_mode)
    close(F.pad(Tensor(x.astype(np.float32)), pads, mode), want)
    check_grad(lambda t: F.pad(t, pads, mode), lambda t: np.pad(t, [(0, 0), (1, 2), (2, 1)], mode=np_mode), [x])


def test_pixel_shuffle_round_trip():
    x = np.random.default_rng(5).standard_normal((2, 8, 3, 5)).astype(np.float32)
    y = F.pixel_shuffle(Tensor(x), 2)
    n, c, h, w = x.shape
    want = x.reshape(n, c // 4, 2, 2, h, w).transpose(0, 1, 4, 2, 5, 3).reshape(n, c // 4, h * 2, w * 2)
    close(y, want.astype(np.float64))
    close(F.pixel_unshuffle(y, 2), x.astype(np.float64))


def test_pool3d_and_area():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 2, 4, 6, 5))
    t = Tensor(x.astype(np.float32))
    want_max = x[:, :, :4, :6, :4].reshape(1, 2, 2, 2, 3, 2, 2, 2).max((3, 5, 7))
    close(F.max_pool3d(t, 2), want_max)
    want_avg = x[:, :, :4, :6, :4].reshape(1, 2, 2, 2, 3, 2, 2, 2).mean((3, 5, 7))
    close(F.avg_pool3d(t, 2), want_avg)
    y = rng.standard_normal((1, 3, 7, 5))
    close(F.interpolate(Tensor(y.astype(np.float32)), size=(3, 2), mode="area"), ref_adaptive(y, (3, 2), "avg"))

"""Losses, activations, normalization layers and the composed math functions against numpy (float64 references),
with gradients against finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_grad
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vkgraph import Tensor
from vkgraph.nn import functional as F

FAST = settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


def close(got, want, tol=2e-6):
    got = got.numpy() if isinstance(got, Tensor) else np.asarray(got)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.array_equal(np.isnan(got), np.isnan(want)), (got, want)
    inf = np.isinf(want)
    assert np.array_equal(got[inf], want[inf]), (got, want)
    ok = np.isfinite(want)
    if ok.any():
        err = np.abs(got[ok].astype(np.float64) - want[ok]).max() / max(np.abs(want[ok]).max(), 1.0)
        assert err <= tol, f"{err}\n{got}\n{want}"


def _softplus(x, beta=1.0, threshold=20.0):
    return np.where(x * beta > threshold, x, np.log1p(np.exp(x * beta)) / beta)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


ACT = {
    "relu6": (F.relu6, lambda x: np.clip(x, 0, 6)),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.2), lambda x: np.where(x > 0, x, 0.2 * x)),
    "elu": (lambda x: F.elu(x, 1.3), lambda x: np.where(x > 0, x, 1.3 * np.expm1(x))),
    "selu": (F.selu, lambda x: 1.0507009873554805 * np.where(x > 0, x, 1.6732632423543772 * np.expm1(x))),
    "celu": (lambda x: F.celu(x, 0.7), lambda x: np.maximum(x, 0) + np.minimum(0, 0.7 * np.expm1(x / 0.7))),
    "softplus": (lambda x: F.softplus(x, 2.0, 3.0), lambda x: _softplus(x, 2.0, 3.0)),
    "softsign": (F.softsign, lambda x: x / (1 + np.abs(x))),
    "mish": (F.mish, lambda x: x * np.tanh(_softplus(x))),
    "hardswish": (F.hardswish, lambda x: x * np.clip(x / 6 + 0.5, 0, 1)),
    "hardsigmoid": (F.hardsigmoid, lambda x: np.clip(x / 6 + 0.5, 0, 1)),
    "hardtanh": (lambda x: F.hardtanh(x, -0.5, 0.7), lambda x: np.clip(x, -0.5, 0.7)),
    "logsigmoid": (F.logsigmoid, lambda x: -np.log1p(np.exp(-x))),
    "quick_gelu": (F.quick_gelu, lambda x: x * _sigmoid(1.702 * x)),
    "softmin": (lambda x: F.softmin(x, -1), lambda x: np.exp(-x) / np.exp(-x).sum(-1, keepdims=True)),
    "tanhshrink": (F.tanhshrink, lambda x: x - np.tanh(x)),
    "glu": (lambda x: F.glu(x, -1), lambda x: x[..., :x.shape[-1] // 2] * _sigmoid(x[..., x.shape[-1] // 2:])),
}


@pytest.mark.parametrize("name", sorted(ACT))
@FAST
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), seed=st.integers(0, 2**16))
def test_activation(name, shape, seed):
    vk, ref = ACT[name]
    if name == "glu":
        shape = shape[:-1] + (2 * shape[-1],)
    x = np.random.default_rng(seed).standard_normal(shape) * 3
    close(vk(Tensor(x.astype(np.float32))), ref(x.astype(np.float32).astype(np.float64)), 3e-6)
    xs = np.where(np.abs(x) < 0.05, 0.3, x)  # away from kinks for the finite differences
    xs = np.where(np.abs(np.abs(xs) - 3.0) < 0.05, 2.5, xs)
    check_grad(vk, ref, [xs], seed, tol=5e-3)


MATH = {
    "tan": (lambda x: x.tan(), np.tan, (-1.2, 1.2)), "atan": (lambda x: x.atan(), np.arctan, (-30, 30)),
    "asin": (lambda x: x.asin(), np.arcsin, (-0.99, 0.99)), "acos": (lambda x: x.acos(), np.arccos, (-0.99, 0.99)),
    "sinh": (lambda x: x.sinh(), np.sinh, (-5, 5)), "cosh": (lambda x: x.cosh(), np.cosh, (-5, 5)),
    "asinh": (lambda x: x.asinh(), np.arcsinh, (-20, 20)), "acosh": (lambda x: x.acosh(), np.arccosh, (1.01, 20)),
    "atanh": (lambda x: x.atanh(), np.arctanh, (-0.95, 0.95)), "expm1": (lambda x: x.expm1(), np.expm1, (-3, 3)),
    "log1p": (lambda x: x.log1p(), np.log1p, (-0.9, 5)),
}

# Vulkan bounds sin and cos by an absolute error of 2^-11 in [-pi, pi] (the precision table of the SPIR-V
# environment), and some drivers (NVIDIA's) use all of it. tan = sin / cos: errors ds and dc move it by
# ds / cos + sin * dc / cos^2, at most 2^-11 * (|cos| + |sin|) / cos^2.
SIN_COS_ABS = 2.0**-11
TRIG_ABS = {"tan": lambda x: SIN_COS_ABS * (np.abs(np.cos(x)) + np.abs(np.sin(x))) / np.cos(x) ** 2}


@pytest.mark.parametrize("name", sorted(MATH))
@FAST
@given(shape=shapes, seed=st.integers(0, 2**16), tiny=st.booleans())
def test_math(name, shape, seed, tiny):
    vk, ref, (lo, hi) = MATH[name]
    rng = np.random.default_rng(seed)
    x = rng.uniform(lo, hi, shape).astype(np.float32)
    if tiny and name in ("expm1", "log1p", "sinh", "asinh", "atan", "tan", "atanh", "asin"):
        x = (x * 1e-6).astype(np.float32)  # the small-argument accuracy these exist for
    want = ref(x.astype(np.float64))
    got = vk(Tensor(x)).numpy()
    assert got.shape == want.shape
    if want.size:
        err = np.abs(got - want)
        rel = err / np.maximum(np.abs(want), 1e-30)
        ok = rel <= (2e-6 if name != "atanh" else 5e-6)
        if name in TRIG_ABS:  # or within the device's precision of the sin and cos it is built from
            ok |= err <= TRIG_ABS[name](x.astype(np.float64))
        assert ok.all(), (x[~ok], got[~ok], want[~ok])
    if shape and all(shape) and not tiny:
        check_grad(vk, ref, [x.astype(np.float64)], seed, tol=5e-3)


def test_math_domains_and_specials():
    x = Tensor(np.array([-2.0, 2.0, np.inf, -np.inf, np.nan, 0.0], np.float32))
    with np.errstate(all="ignore"):
        ref = np.array([-2.0, 2.0, np.inf, -np.inf, np.nan, 0.0])
        close(x.asin(), np.arcsin(ref))
        close(x.acosh(), np.arccosh(ref))
        close(x.atan(), np.arctan(ref))
        close(x.expm1(), np.expm1(ref))
        close(x.log1p(), np.log1p(ref))


@FAST
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_binary_math(shape, seed):
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    w = rng.uniform(0, 1, shape).astype(np.float32)
    ta, tb = Tensor(a), Tensor(b)
    close(ta.atan2(tb), np.arctan2(a.astype(np.float64), b), 2e-6)
    close(ta.hypot(tb), np.hypot(a.astype(np.float64), b), 2e-6)
    close(ta.lerp(tb, Tensor(w)), a + (b.astype(np.float64) - a) * w, 2e-6)
    for mode, ref in (("trunc", np.trunc), ("floor", np.floor)):
        bb = np.where(np.abs(b) < 0.1, 0.5, b).astype(np.float32)
        close(ta.div(Tensor(bb), rounding_mode=mode), ref(a / bb))
    ia, ib = rng.integers(-20, 20, shape).astype(np.int32), rng.integers(1, 7, shape).astype(np.int32)
    ib = np.where(rng.random(shape) < 0.5, -ib, ib).astype(np.int32)
    np.testing.assert_array_equal(Tensor(ia).div(Tensor(ib), rounding_mode="trunc").numpy(),
                                  np.trunc(ia / ib).astype(np.int32))
    np.testing.assert_array_equal(Tensor(ia).div(Tensor(ib), rounding_mode="floor").numpy(), ia // ib)


# ---- losses --------------------------------------------------------------------------------------------------------


def ref_cross_entropy(x, t, weight=None, ignore_index=-100, reduction="mean", smoothing=0.0):
    """PyTorch's definition, written out per sample (class axis 1)."""
    xl = np.moveaxis(x, 1, -1).reshape(-1, x.shape[1])
    lp = xl - xl.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    c = x.shape[1]
    w = np.ones(c) if weight is None else weight
    if t.dtype.kind == "f":
        p = np.moveaxis(t, 1, -1).reshape(-1, c) * (1 - smoothing) + smoothing / c
        losses = -(lp * p * w).sum(-1)
        return {"mean": losses.mean(), "sum": losses.sum(), "none": losses.reshape(np.moveaxis(x, 1, -1).shape[:-1])
                }[reduction]
    tf = t.reshape(-1)
    keep = tf != ignore_index
    safe = np.where(keep, tf, 0)
    wt = w[safe] * keep
    nll = -lp[np.arange(len(tf)), safe] * wt
    smooth = -(lp * w).sum(-1) * keep
    if reduction == "mean":
        return ((1 - smoothing) * nll.sum() + smoothing / c * smooth.sum()) / wt.sum()
    per = (1 - smoothing) * nll + smoothing / c * smooth
    return per.sum() if reduction == "sum" else per.reshape(t.shape)


@FAST
@given(n=st.integers(1, 5), c=st.integers(2, 5), extra=st.sampled_from([(), (3,)]),
       reduction=st.sampled_from(["mean", "sum", "none"]), smoothing=st.sampled_from([0.0, 0.2]),
       weighted=st.booleans(), ignore=st.booleans(), probs=st.booleans(), seed=st.integers(0, 2**16))
def test_cross_entropy(n, c, extra, reduction, smoothing, weighted, ignore, probs, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c) + extra) * 2
    w = rng.uniform(0.5, 2, c) if weighted else None
    if probs:
        t = rng.dirichlet(np.ones(c), (n,) + extra)
        t = np.moveaxis(t, -1, 1)
        ignore_index = -100
    else:
        t = rng.integers(0, c, (n,) + extra)
        ignore_index = 1 if ignore else -100
        if ignore and (t != 1).sum() == 0:
            t[(0,) * t.ndim] = 0
    want = ref_cross_entropy(x, t, w, ignore_index, reduction, smoothing)
    tt = Tensor(t.astype(np.float32)) if probs else Tensor(t.astype(np.int32))
    wt = None if w is None else Tensor(w.astype(np.float32))
    got = F.cross_entropy(Tensor(x.astype(np.float32)), tt, wt, ignore_index, reduction, smoothing)
    close(got, want, 1e-5)
    check_grad(lambda xx: F.cross_entropy(xx, tt, wt, ignore_index, reduction, smoothing),
               lambda xx: ref_cross_entropy(xx, t, w, ignore_index, reduction, smoothing), [x], seed)


def test_nll_and_unbatched():
    rng = np.random.default_rng(7)
    lp = np.log(rng.dirichlet(np.ones(4), 3))
    t = np.array([0, 3, 2])
    close(F.nll_loss(Tensor(lp.astype(np.float32)), Tensor(t.astype(np.int32))), -lp[np.arange(3), t].mean())
    x = rng.standard_normal(4)
    close(F.cross_entropy(Tensor(x.astype(np.float32)), Tensor(np.int32(2))), -(x[2] - np.log(np.exp(x).sum())))
    with pytest.raises(TypeError):
        F.nll_loss(Tensor(lp.astype(np.float32)), Tensor(t.astype(np.float32)))


def _bce_logits(x, t, pw=None):
    p = _sigmoid(x)
    pw = 1.0 if pw is None else pw
    return -(pw * t * np.log(p) + (1 - t) * np.log(1 - p))


LOSSES = {
    "mse": (F.mse_loss, lambda x, t: (x - t) ** 2),
    "l1": (F.l1_loss, lambda x, t: np.abs(x - t)),
    "smooth_l1": (lambda x, t, reduction: F.smooth_l1_loss(x, t, reduction, beta=0.5),
                  lambda x, t: np.where(np.abs(x - t) < 0.5, 0.5 * (x - t) ** 2 / 0.5, np.abs(x - t) - 0.25)),
    "huber": (lambda x, t, reduction: F.huber_loss(x, t, reduction, delta=0.7),
              lambda x, t: np.where(np.abs(x - t) < 0.7, 0.5 * (x - t) ** 2, 0.7 * (np.abs(x - t) - 0.35))),
    "bce": (lambda x, t, reduction: F.binary_cross_entropy(x.sigmoid(), t, reduction=reduction),
            lambda x, t: _bce_logits(x, t)),
    "bce_logits": (lambda x, t, reduction: F.binary_cross_entropy_with_logits(
        x, t, reduction=reduction, pos_weight=Tensor(np.float32(1.5))), lambda x, t: _bce_logits(x, t, 1.5)),
    "kl_div": (lambda x, t, reduction: F.kl_div(x.log_softmax(-1), t, reduction),
               lambda x, t: t * (np.log(t) - (x - np.log(np.exp(x).sum(-1, keepdims=True))))),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_losses(name, reduction):
    vk, ref = LOSSES[name]
    rng = np.random.default_rng(hash(name) % 2**16)
    x = rng.standard_normal((3, 4))
    t = rng.uniform(0.05, 1, (3, 4)) if name in ("bce", "bce_logits", "kl_div") else rng.standard_normal((3, 4))
    if name == "kl_div":
        t = t / t.sum(-1, keepdims=True)

    def r(x, t=t):
        v = ref(x, t)
        return {"mean": v.mean(), "sum": v.sum(), "none": v}[reduction]
    tt = Tensor(t.astype(np.float32))
    close(vk(Tensor(x.astype(np.float32)), tt, reduction=reduction), r(x), 1e-5)
    check_grad(lambda a: vk(a, tt, reduction=reduction), r, [x])


def test_kl_div_log_target_and_batchmean():
    rng = np.random.default_rng(8)
    lp, lt = np.log(rng.dirichlet(np.ones(5), 2)), np.log(rng.dirichlet(np.ones(5), 2))
    want = (np.exp(lt) * (lt - lp)).sum() / 2
    close(F.kl_div(Tensor(lp.astype(np.float32)), Tensor(lt.astype(np.float32)), "batchmean", log_target=True), want,
          1e-5)
    zero_target = F.kl_div(Tensor(lp.astype(np.float32)), Tensor(np.zeros((2, 5), np.float32)), "sum")
    assert zero_target.item() == 0.0


# ---- normalization ---------------------------------------------------------------------------------------------------


def test_batch_norm_training_and_eval():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 3, 2, 5))
    w, b = rng.standard_normal(3), rng.standard_normal(3)
    rm, rv = Tensor(np.zeros(3, np.float32)), Tensor(np.ones(3, np.float32))
    mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3))
    cs = (1, 3, 1, 1)
    want = (x - mean.reshape(cs)) / np.sqrt(var.reshape(cs) + 1e-5) * w.reshape(cs) + b.reshape(cs)
    got = F.batch_norm(Tensor(x.astype(np.float32)), rm, rv, Tensor(w.astype(np.float32)),
                       Tensor(b.astype(np.float32)), training=True, momentum=0.2)
    close(got, want, 1e-5)
    n = x.size // 3
    close(rm, 0.2 * mean, 1e-6)
    close(rv, 0.8 + 0.2 * var * n / (n - 1), 1e-6)
    got = F.batch_norm(Tensor(x.astype(np.float32)), rm, rv, training=False)
    close(got, (x - rm.numpy().reshape(cs)) / np.sqrt(rv.numpy().reshape(cs) + 1e-5), 1e-5)

    def ref(x, w, b):
        m, v = x.mean((0, 2, 3), keepdims=True), x.var((0, 2, 3), keepdims=True)
        return (x - m) / np.sqrt(v + 1e-5) * w.reshape(cs) + b.reshape(cs)
    check_grad(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), ref, [x, w, b])


def test_group_and_instance_norm():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 6, 3, 2))
    w, b = rng.standard_normal(6), rng.standard_normal(6)

    def ref_group(x, w, b, g=3):
        xr = x.reshape(2, g, -1)
        out = ((xr - xr.mean(-1, keepdims=True)) / np.sqrt(xr.var(-1, keepdims=True) + 1e-5)).reshape(x.shape)
        return out * w.reshape(1, 6, 1, 1) + b.reshape(1, 6, 1, 1)
    close(F.group_norm(Tensor(x.astype(np.float32)), 3, Tensor(w.astype(np.float32)), Tensor(b.astype(np.float32))),
          ref_group(x, w, b), 1e-5)
    check_grad(lambda x, w, b: F.group_norm(x, 3, w, b), ref_group, [x, w, b])
    close(F.instance_norm(Tensor(x.astype(np.float32))), ref_group(x, np.ones(6), np.zeros(6), 6), 1e-5)
    with pytest.raises(ValueError):
        F.group_norm(Tensor(x.astype(np.float32)), 4)


def test_dropout():
    x = Tensor(np.ones((64, 64), np.float32))
    y = F.dropout(x, 0.25).numpy()
    assert set(np.unique(y)) <= {0.0, np.float32(1 / 0.75)}
    assert abs((y == 0).mean() - 0.25) < 0.05
    assert F.dropout(x, 0.5, training=False) is x


def test_dropout_draws_anew_at_each_replay():
    import vkgraph
    f = vkgraph.jit(lambda x: F.dropout(x, 0.5))
    x = Tensor(np.ones(2048, np.float32))
    masks = [f(x).numpy() == 0 for _ in range(5)]  # eager, capture, three replays
    assert all(abs(m.mean() - 0.5) < 0.05 for m in masks)
    assert all(not np.array_equal(masks[i], masks[i + 1]) for i in range(4))

"""Autograd: every differentiable op's gradient against central finite differences of a float64 numpy reference,
movement chains against their exact transpose, and the semantics of backward, grad, detach and no_grad."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gradcheck import check_grad, close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vkgraph
from vkgraph import Tensor, autograd
from vkgraph.tensor import cat, realize_all, where

FAST = settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _erf(x):
    return np.vectorize(math.erf)(x)


def _softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def _layer_norm(x, w, b):
    c = x - x.mean(-1, keepdims=True)
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-5) * w + b


def _sdpa(q, k, v, causal):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    return _softmax(s) @ v


POS, ANY, AWAY = "pos", "any", "away"
# name -> (vkgraph function, numpy float64 function, domain of each input, whether shapes are (rows, cols))
UNARY = {
    "exp": (lambda x: x.exp(), np.exp), "log": (lambda x: x.log(), np.log), "sin": (lambda x: x.sin(), np.sin),
    "cos": (lambda x: x.cos(), np.cos), "tanh": (lambda x: x.tanh(), np.tanh),
    "sqrt": (lambda x: x.sqrt(), np.sqrt), "rsqrt": (lambda x: x.rsqrt(), lambda x: 1 / np.sqrt(x)),
    "reciprocal": (lambda x: x.reciprocal(), lambda x: 1 / x), "exp2": (lambda x: x.exp2(), np.exp2),
    "log2": (lambda x: x.log2(), np.log2), "abs": (lambda x: x.abs(), np.abs),
    "sigmoid": (lambda x: x.sigmoid(), _sigmoid), "relu": (lambda x: x.relu(), lambda x: np.maximum(x, 0)),
    "silu": (lambda x: x.silu(), lambda x: x * _sigmoid(x)),
    "gelu": (lambda x: x.gelu(), lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2)))),
    "gelu_tanh": (lambda x: x.gelu("tanh"),
                  lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))),
    "square": (lambda x: x.square(), np.square), "cube": (lambda x: x ** 3, lambda x: x ** 3),
    "pow_frac": (lambda x: x ** 1.5, lambda x: x ** 1.5), "neg": (lambda x: -x, np.negative),
    "clip": (lambda x: x.clip(-0.3, 0.4), lambda x: np.clip(x, -0.3, 0.4)),
    "floor": (lambda x: x.floor() + x, lambda x: np.floor(x) + x),
    "scalar_ops": (lambda x: (2 - x) / 3 + 1 / x, lambda x: (2 - x) / 3 + 1 / x),
}
DOMAIN = {"log": POS, "sqrt": POS, "rsqrt": POS, "reciprocal": AWAY, "log2": POS, "abs": AWAY, "relu": AWAY,
          "pow_frac": POS, "clip": AWAY, "floor": AWAY, "scalar_ops": AWAY}


def draw(rng: np.random.Generator, shape: tuple[int, ...], domain: str = ANY) -> np.ndarray:
    if domain == POS:
        return rng.uniform(0.5, 2.0, shape)
    if domain == AWAY:  # away from kinks (0, clip bounds, integers): finite differences are exact there
        base = rng.integers(-2, 2, shape) + rng.uniform(0.45, 0.55, shape)
        return base * 0.5 if shape else np.float64(base * 0.5)
    return rng.standard_normal(shape)


shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)


@pytest.mark.parametrize("name", sorted(UNARY))
@FAST
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_unary_grad(name, shape, seed):
    rng = np.random.default_rng(seed)
    vk, ref = UNARY[name]
    check_grad(vk, ref, [draw(rng, shape, DOMAIN.get(name, ANY))], seed)


BINARY = {
    "add": (lambda a, b: a + b, np.add, ANY), "sub": (lambda a, b: a - b, np.subtract, ANY),
    "mul": (lambda a, b: a * b, np.multiply, ANY), "div": (lambda a, b: a / b, np.divide, AWAY),
    "pow": (lambda a, b: a ** b, np.power, POS), "maximum": (lambda a, b: a.maximum(b), np.maximum, ANY),
    "minimum": (lambda a, b: a.minimum(b), np.minimum, ANY),
    "where": (lambda a, b: where(a > b, a * b, a - b), lambda a, b: np.where(a > b, a * b, a - b), ANY),
    "mod": (lambda a, b: a % b, np.mod, POS),
}


@pytest.mark.parametrize("name", sorted(BINARY))
@FAST
@given(shape=shapes, seed=st.integers(0, 2**16), bcast=st.booleans())
def test_binary_grad(name, shape, seed, bcast):
    rng = np.random.default_rng(seed)
    vk, ref, dom = BINARY[name]
    other = tuple(1 if bcast and i % 2 else s for i, s in enumerate(shape))  # broadcast some axes
    a, b = draw(rng, shape, dom), draw(rng, other, dom)
    if name == "mod":  # keep a / b away from integers, where floor jumps
        b = np.full(other, 0.7)
        a = rng.integers(0, 3, shape) * 0.7 + rng.uniform(0.2, 0.5, shape)
    check_grad(vk, ref, [a, b], seed)


REDUCE = {
    "sum": (lambda x: x.sum(-1), lambda x: x.sum(-1)), "sum_all": (lambda x: x.sum(), lambda x: np.sum(x)),
    "mean": (lambda x: x.mean(0), lambda x: x.mean(0)), "max": (lambda x: x.max(-1), lambda x: x.max(-1)),
    "min": (lambda x: x.min(0, keepdim=True), lambda x: x.min(0, keepdims=True)),
    "prod": (lambda x: x.prod(-1), lambda x: x.prod(-1)),
    "var": (lambda x: x.var(-1), lambda x: x.var(-1, ddof=1)), "std": (lambda x: x.std(0), lambda x: x.std(0, ddof=1)),
    "logsumexp": (lambda x: x.logsumexp(-1), lambda x: np.log(np.exp(x).sum(-1))),
    "softmax": (lambda x: x.softmax(-1), _softmax),
    "log_softmax": (lambda x: x.log_softmax(0), lambda x: np.log(_softmax(x, 0))),
    "cumsum": (lambda x: x.cumsum(-1), lambda x: np.cumsum(x, -1)),
    "rms_norm": (lambda x: x.rms_norm(eps=1e-5), lambda x: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)),
}


@pytest.mark.parametrize("name", sorted(REDUCE))
@FAST
@given(rows=st.integers(1, 3), cols=st.integers(2, 5), seed=st.integers(0, 2**16))
def test_reduce_grad(name, rows, cols, seed):
    rng = np.random.default_rng(seed)
    vk, ref = REDUCE[name]
    x = rng.standard_normal((rows, cols))
    if name in ("var", "std"):
        x = x[:2] if rows >= 2 else np.concatenate([x, x + 1])
    check_grad(vk, ref, [x], seed)


def test_max_ties_share_the_gradient():
    x = Tensor(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]], np.float32)).requires_grad_()
    x.max(-1).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [[0, 0.5, 0.5], [1, 0, 0]])


def test_prod_with_zeros():
    a = np.array([[2.0, 0.0, 3.0], [0.0, 0.0, 1.0], [1.0, 2.0, 4.0]], np.float32)
    x = Tensor(a).requires_grad_()
    x.prod(-1).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [[0, 6, 0], [0, 0, 0], [8, 4, 2]])


@FAST
@given(m=st.integers(1, 20), k=st.integers(1, 20), n=st.integers(1, 20), batch=st.sampled_from([(), (2,), (2, 1)]),
       seed=st.integers(0, 2**16))
def test_matmul_grad(m, k, n, batch, seed):
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal(batch + (m, k)), rng.standard_normal((k, n))
    check_grad(lambda x, y: x @ y, np.matmul, [a, b], seed)


def test_matmul_tiled_and_vector_grads():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((40, 24)), rng.standard_normal((24, 33))  # the tiled MATMUL node
    ta, tb = Tensor(a.astype(np.float32)).requires_grad_(), Tensor(b.astype(np.float32)).requires_grad_()
    cot = rng.standard_normal((40, 33))
    (ta @ tb * Tensor(cot.astype(np.float32))).sum().backward()
    close(ta.grad.numpy(), cot @ b.T, 1e-4)
    close(tb.grad.numpy(), a.T @ cot, 1e-4)
    check_grad(lambda x, y: x @ y, np.matmul, [rng.standard_normal(5), rng.standard_normal((5, 3))])
    check_grad(lambda x, y: x @ y, np.matmul, [rng.standard_normal((2, 5)), rng.standard_normal(5)])


def test_nn_function_grads():
    rng = np.random.default_rng(4)
    x, w, b = rng.standard_normal((3, 6)), rng.standard_normal(6), rng.standard_normal(6)
    check_grad(lambda x, w, b: x.layer_norm(None, w, b), _layer_norm, [x, w, b])
    lw, lb = rng.standard_normal((4, 6)), rng.standard_normal(4)
    check_grad(lambda x, w, b: x.linear(w, b), lambda x, w, b: x @ w.T + b, [x, lw, lb])
    q, k, v = (rng.standard_normal((2, 3, 4)) for _ in range(3))
    for causal in (False, True):
        check_grad(lambda q, k, v, c=causal: q.scaled_dot_product_attention(k, v, is_causal=c),
                   lambda q, k, v, c=causal: _sdpa(q, k, v, c), [q, k, v])


def test_gather_grads():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((5, 3))
    idx = np.array([[0, 4, 4], [-1, 2, 0]])
    check_grad(lambda w: w.take(Tensor(idx.astype(np.int32)), 0), lambda w: w[idx], [w])
    check_grad(lambda w: w[:, Tensor(np.array([2, 0, 2], np.int32))], lambda w: w[:, [2, 0, 2]], [w])
    check_grad(lambda w: vkgraph.tensor.embedding(Tensor(np.array([1, 1, 3], np.int32)), w),
               lambda w: w[[1, 1, 3]], [w])


def test_cat_stack_split_grads():
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((2, 3)), rng.standard_normal((4, 3))
    check_grad(lambda a, b: cat([a, b * 2], 0), lambda a, b: np.concatenate([a, b * 2], 0), [a, b])
    check_grad(lambda a, b: vkgraph.stack([a, a * b[:2]], 1), lambda a, b: np.stack([a, a * b[:2]], 1), [a, b])
    check_grad(lambda b: b.split([1, 3], 0)[1] * b.chunk(2, 0)[0].sum(),
               lambda b: b[1:] * b[:2].sum(), [b])


# ---- movement chains: the view transpose against the exact one, from an index map -----------------------------

MOVES = ["reshape", "permute", "expand", "pad", "shrink", "flip", "step", "window"]


def _apply(move: str, x, xp, rng):
    """One movement on a Tensor x and its numpy twin xp (an int array of source positions, -1 where padded)."""
    shape = xp.shape
    if move == "reshape" and xp.size:
        flat = [d for d in shape]
        new = (int(np.prod(flat[:1])), -1) if len(flat) > 1 else (1, -1)
        return x.reshape(new), xp.reshape(new)
    if move == "permute" and xp.ndim > 1:
        order = tuple(rng.permutation(xp.ndim))
        return x.permute(order), xp.transpose(order)
    if move == "expand":
        new = (2,) + tuple(3 if s == 1 else s for s in shape)
        xp1 = xp.reshape((1,) + shape)
        return x.reshape((1,) + shape).expand(new), np.broadcast_to(xp1, new)
    if move == "pad" and xp.ndim:
        pads = [(int(rng.integers(0, 2)), int(rng.integers(0, 3))) for _ in shape]
        return x.pad(pads), np.pad(xp, pads, constant_values=-1)
    if move == "shrink" and xp.ndim:
        b = [(int(rng.integers(0, s)) if s else 0, s) for s in shape]
        b = [(lo, max(lo, hi - int(rng.integers(0, 2)))) for lo, hi in b]
        return x.shrink(b), xp[tuple(slice(lo, hi) for lo, hi in b)]
    if move == "flip" and xp.ndim:
        axes = tuple(i for i in range(xp.ndim) if rng.random() < 0.6) or (0,)
        return x.flip(axes), np.flip(xp, axes)
    if move == "step" and xp.ndim:
        idx = tuple(slice(None, None, int(rng.integers(1, 3)) * (1 if rng.random() < 0.7 else -1)) for _ in shape)
        return x[idx], xp[idx]
    if move == "window" and xp.ndim and shape[-1] >= 2:  # overlapping sliding windows (what convolutions read)
        k = int(rng.integers(1, shape[-1] + 1))
        return _windows(x, k), np.lib.stride_tricks.sliding_window_view(xp, k, axis=-1)
    return x, xp


def _windows(x, k):
    n = x.shape[-1]
    return x.unsqueeze(-2).expand(*x.shape[:-1], k, n).reshape(*x.shape[:-1], k * n).pad(
            [(0, 0)] * (x.ndim - 1) + [(0, k)]).reshape(*x.shape[:-1], k, n + 1).shrink(
        [None] * (x.ndim - 1) + [None, (0, n - k + 1)]).transpose(-1, -2)


@pytest.mark.parametrize("sweep", [pytest.param(SLOW, marks=pytest.mark.slow), FAST])
def test_movement_transpose(sweep):
    @sweep
    @given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
           moves=st.lists(st.sampled_from(MOVES), min_size=1, max_size=4), seed=st.integers(0, 2**16))
    def run(shape, moves, seed):
        rng = np.random.default_rng(seed)
        n = int(np.prod(shape))
        src = rng.standard_normal(shape).astype(np.float32)
        x = Tensor(src).requires_grad_()
        y, yp = x, np.arange(n).reshape(shape)
        for m in moves:
            y, yp = _apply(m, y, yp, rng)
        assert y.shape == yp.shape
        np.testing.assert_array_equal(y.numpy(), np.where(yp >= 0, src.reshape(-1)[np.maximum(yp, 0)], 0))
        if yp.size == 0:  # a graph that folded to a constant reaches no leaf
            return
        cot = rng.standard_normal(yp.shape).astype(np.float32)
        (y * Tensor(cot)).sum().backward()
        want = np.bincount(yp[yp >= 0].ravel(), weights=cot[yp >= 0].ravel(), minlength=n).reshape(shape)
        np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-5)
    run()


# ---- semantics ---------------------------------------------------------------------------------------------------

def test_backward_accumulates_and_item_first_keeps_the_graph():
    a = np.array([1.0, -2.0, 3.0], np.float32)
    w = Tensor(a).requires_grad_()
    loss = (w * w).sum()
    assert loss.requires_grad and not loss.is_leaf and w.is_leaf
    assert loss.item() == pytest.approx(14.0)  # realized before backward: its graph is remembered
    loss.backward()
    np.testing.assert_allclose(w.grad.numpy(), 2 * a)
    (w * 3).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), 2 * a + 3)
    w.grad = None
    assert w.grad is None


def test_realized_intermediate_keeps_the_path():
    a = np.array([[0.5, -1.0], [2.0, 1.5]], np.float32)
    w = Tensor(a).requires_grad_()
    h = (w @ w).tanh().realize()
    (h * h).sum().backward()
    t = np.tanh(a @ a)
    gh = 2 * t * (1 - t * t)
    np.testing.assert_allclose(w.grad.numpy(), gh @ a.T + a.T @ gh, rtol=1e-5)


def test_detach_and_no_grad():
    w = Tensor(np.array([1.0, 2.0], np.float32)).requires_grad_()
    d = w.detach()
    assert not d.requires_grad
    (w * d).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), [1.0, 2.0])  # only the tracked factor
    with autograd.no_grad():
        y = (w * 2).realize()  # realized inside: no history
        assert w.requires_grad and not (w * 2).requires_grad
        with pytest.raises(RuntimeError):
            (w * 2).sum().backward()
    w.grad = None
    (w * y).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), [2.0, 4.0])


def test_requires_grad_turned_off_is_forgotten():
    """Turning a leaf off (or a new leaf in one realize with others) answers from the leaves of now, not from what
    was remembered about the earlier ones."""
    w = Tensor(np.array([1.0, 2.0], np.float32)).requires_grad_()
    v = Tensor(np.array([5.0], np.float32)).requires_grad_()  # a leaf that stays on
    y = w * 3
    assert y.requires_grad and v.requires_grad
    w.requires_grad_(False)
    assert not y.requires_grad and not (w * 3).requires_grad and (w * v).requires_grad
    assert not (w * 2).realize().requires_grad
    w.requires_grad_(True)
    assert y.requires_grad
    c, d = w * 2, w + 1
    realize_all(c, d)  # both remember their graph, found with one set of leaves
    (c * d).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), [2 * (2 * 1.0 + 1), 2 * (2 * 2.0 + 1)])


def test_functional_grad_and_second_order():
    x = Tensor(np.array([0.5, -1.0, 2.0], np.float32)).requires_grad_()
    (dx,) = autograd.grad((x ** 3).sum(), x)
    np.testing.assert_allclose(dx.numpy(), 3 * np.array([0.5, -1.0, 2.0]) ** 2, rtol=1e-6)
    (ddx,) = autograd.grad(dx.sum(), x)
    np.testing.assert_allclose(ddx.numpy(), 6 * np.array([0.5, -1.0, 2.0]), rtol=1e-6)
    assert x.grad is None  # grad() leaves .grad alone
    y = Tensor(np.ones(3, np.float32)).requires_grad_()
    with pytest.raises(RuntimeError, match="not used"):
        autograd.grad((x * 2).sum(), [x, y])
    gx, gy = autograd.grad((x * 2).sum(), [x, y], allow_unused=True)
    assert gy is None and np.allclose(gx.numpy(), 2)
    (gv,) = autograd.grad(x * 2, x, grad_outputs=Tensor(np.array([1.0, 2.0, 3.0], np.float32)))
    np.testing.assert_allclose(gv.numpy(), [2, 4, 6])


def test_errors():
    with pytest.raises(TypeError, match="floating"):
        Tensor([1, 2]).requires_grad_()
    w = Tensor(np.ones(3, np.float32)).requires_grad_()
    with pytest.raises(RuntimeError, match="one-element"):
        (w * 2).backward()
    with pytest.raises(RuntimeError, match="does not require grad"):
        Tensor(np.ones(3, np.float32)).sum().backward()
    with pytest.raises(ValueError):
        w.grad = Tensor(np.ones(2, np.float32))


def test_gradient_is_fused_and_one_schedule():
    from vkgraph.realize import count_kernels
    w = Tensor(np.linspace(-1, 1, 64).astype(np.float32)).requires_grad_()
    loss = ((w * 1.5).tanh() * w).sum()
    with count_kernels() as c:
        loss.backward()
    assert c.count <= 3  # forward reduction, gradient elementwise (fused), nothing per op
    t = np.tanh(1.5 * np.linspace(-1, 1, 64))
    np.testing.assert_allclose(w.grad.numpy(), t + np.linspace(-1, 1, 64) * 1.5 * (1 - t * t), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.slow
def test_gradient_sweep():
    """The long sweep: every unary, binary and reduction rule over many random shapes and values."""
    rng = np.random.default_rng(123)
    for k in range(25):
        shape = tuple(int(s) for s in rng.integers(1, 5, rng.integers(0, 4)))
        for name, (vk, ref) in UNARY.items():
            check_grad(vk, ref, [draw(rng, shape, DOMAIN.get(name, ANY))], k)
        for name, (vk, ref, dom) in BINARY.items():
            other = tuple(1 if rng.random() < 0.3 else s for s in shape)
            a, b = draw(rng, shape, dom), draw(rng, other, dom)
            if name == "mod":
                b = np.full(other, 0.7)
                a = rng.integers(0, 3, shape) * 0.7 + rng.uniform(0.2, 0.5, shape)
            check_grad(vk, ref, [a, b], k)
        rows, cols = int(rng.integers(2, 4)), int(rng.integers(2, 6))
        for vk, ref in REDUCE.values():
            check_grad(vk, ref, [rng.standard_normal((rows, cols))], k)


def test_embedding_gradient_through_the_tiled_matmul():
    rng = np.random.default_rng(9)
    w = Tensor(rng.standard_normal((300, 20)).astype(np.float32)).requires_grad_()
    idx = rng.integers(0, 300, (4, 25))
    g = rng.standard_normal((4, 25, 20)).astype(np.float32)
    (vkgraph.tensor.embedding(Tensor(idx.astype(np.int32)), w) * Tensor(g)).sum().backward()
    want = np.zeros((300, 20))
    np.add.at(want, idx.ravel(), g.reshape(-1, 20))
    close(w.grad.numpy(), want, 1e-6)


def test_requires_grad_as_a_constructor_argument():
    """`Tensor(data, requires_grad=True)` as PyTorch's `torch.tensor(data, requires_grad=True)`: a leaf at once."""
    a = np.array([1.0, -2.0, 3.0], np.float32)
    x = Tensor(a, requires_grad=True)
    assert x.is_leaf and Tensor(a).grad is None
    (x * x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * a)

"""Optimizers against numpy transcriptions of PyTorch's update rules, their saved state, gradient clipping, the
parameter finder, and a training step captured by jit that replays in one submit."""

from __future__ import annotations

import numpy as np
import pytest

import vkgraph
from vkgraph import Tensor
from vkgraph.nn import optim

rng = np.random.default_rng(0)


def ref_sgd(p, grads, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    buf = None
    for g in grads:
        g = g + weight_decay * p
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p


def ref_adam(p, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False, amsgrad=False):
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    vmax = np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        vmax = np.maximum(vmax, v)
        vh = (vmax if amsgrad else v) / (1 - betas[1] ** t)
        p = p - lr * (m / (1 - betas[0] ** t)) / (np.sqrt(vh) + eps)
    return p


CASES = [
    (optim.SGD, dict(lr=0.1), ref_sgd),
    (optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01), ref_sgd),
    (optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.3), ref_sgd),
    (optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True), ref_sgd),
    (optim.Adam, dict(lr=0.01), ref_adam),
    (optim.Adam, dict(lr=0.01, weight_decay=0.1, amsgrad=True), ref_adam),
    (optim.AdamW, dict(lr=0.01, weight_decay=0.1), lambda p, g, **k: ref_adam(p, g, decoupled=True, **k)),
]


@pytest.mark.parametrize("cls, kwargs, ref", CASES)
def test_update_rules(cls, kwargs, ref):
    p0 = rng.standard_normal((3, 4)).astype(np.float32)
    grads = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(4)]
    p = Tensor(p0).requires_grad_()
    opt = cls([p], **kwargs)
    for g in grads:
        p.grad = Tensor(g)
        opt.step()
    np.testing.assert_allclose(p.numpy(), ref(p0.astype(np.float64), [g.astype(np.float64) for g in grads], **kwargs),
                               rtol=2e-5, atol=2e-6)


def test_state_round_trips_through_safetensors(tmp_path):
    p0 = rng.standard_normal(5).astype(np.float32)
    grads = [rng.standard_normal(5).astype(np.float32) for _ in range(4)]
    a, b = Tensor(p0).requires_grad_(), Tensor(p0).requires_grad_()
    oa, ob = optim.Adam([a], lr=0.02), optim.Adam([b], lr=0.02)
    for g in grads[:2]:
        a.grad = Tensor(g)
        oa.step()
    oa.save(tmp_path / "opt.safetensors")
    b.assign(a.numpy())
    ob.load(tmp_path / "opt.safetensors")
    for g in grads[2:]:
        a.grad, b.grad = Tensor(g), Tensor(g)
        oa.step()
        ob.step()
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    with pytest.raises(KeyError):
        ob.load_state_dict({"step": np.zeros(1, np.float32)})


def test_clip_grad_norm_and_value():
    a, b = Tensor(np.zeros(3, np.float32)).requires_grad_(), Tensor(np.zeros(2, np.float32)).requires_grad_()
    a.grad, b.grad = Tensor(np.array([3.0, 0.0, 0.0], np.float32)), Tensor(np.array([0.0, 4.0], np.float32))
    total = optim.clip_grad_norm_([a, b], 1.0)
    assert total.item() == pytest.approx(5.0)
    np.testing.assert_allclose(np.concatenate([a.grad.numpy(), b.grad.numpy()]), [0.6, 0, 0, 0, 0.8], rtol=1e-5)
    assert optim.clip_grad_norm_([a, b], 10.0).item() == pytest.approx(1.0, rel=1e-5)  # under the bound: unchanged
    np.testing.assert_allclose(a.grad.numpy(), [0.6, 0, 0], rtol=1e-5)
    b.grad = Tensor(np.array([-2.0, 0.5], np.float32))
    optim.clip_grad_value_([a, b], 0.55)
    np.testing.assert_allclose(b.grad.numpy(), [-0.55, 0.5])
    assert optim.clip_grad_norm_([a, b], 1.0, norm_type=float("inf")).item() == pytest.approx(0.55)


class _Block:
    def __init__(self):
        self.w = Tensor(rng.standard_normal((4, 3)).astype(np.float32) * 0.5).requires_grad_()
        self.b = Tensor(np.zeros(3, np.float32)).requires_grad_()
        self.frozen = Tensor(np.ones(3, np.float32))
        self.layers = [{"scale": Tensor(np.ones(3, np.float32)).requires_grad_()}]
        self.again = self.w

    def __call__(self, x):
        return (x @ self.w + self.b) * self.layers[0]["scale"] * self.frozen


def test_parameter_finder():
    m = _Block()
    names = [n for n, _ in optim.named_parameters(m)]
    assert names == ["w", "b", "layers.0.scale"]
    assert optim.parameters(m)[0] is m.w
    with pytest.raises(ValueError):
        optim.SGD(object())


def _mse_step(w, opt, x, y):
    """One training step of x @ w against y (mean squared error); returns the loss."""
    opt.zero_grad()
    loss = ((x @ w - y) ** 2).mean()
    loss.backward()
    opt.step()
    return loss


def test_jit_training_step_replays_in_one_submit():
    def make():
        np.random.seed(7)
        w = Tensor(np.random.standard_normal((4, 3)).astype(np.float32)).requires_grad_()
        return w, optim.Adam([w], lr=0.05)

    xs = [rng.standard_normal((8, 4)).astype(np.float32) for _ in range(6)]
    ys = [rng.standard_normal((8, 3)).astype(np.float32) for _ in range(6)]

    w_eager, opt_eager = make()
    eager = [_mse_step(w_eager, opt_eager, Tensor(x), Tensor(y)).item() for x, y in zip(xs, ys)]
    w_jit, opt_jit = make()
    step = vkgraph.jit(lambda x, y: _mse_step(w_jit, opt_jit, x, y))
    dev = vkgraph.get_device()
    got = []
    for i, (x, y) in enumerate(zip(xs, ys)):
        tx, ty = Tensor(x).realize(), Tensor(y).realize()
        dev.synchronize()
        submits = dev.queue.stats["submits"]
        loss = step(tx, ty)
        if i >= 2:  # replays: the whole step (forward, backward, Adam) in one submit
            assert dev.queue.stats["submits"] == submits + 1
        got.append(loss.item())
    np.testing.assert_allclose(got, eager, rtol=1e-5)
    np.testing.assert_allclose(w_jit.numpy(), w_eager.numpy(), rtol=1e-5, atol=1e-6)


def test_jit_replays_with_inputs_freed_at_once():
    """Inputs made inline die right after the call; their buffers go back to the pool while the replay's copy
    from them may still be queued: the next upload into the same buffer must wait for that copy."""
    def make():
        w = Tensor(np.full((6, 2), 0.1, np.float32)).requires_grad_()
        return w, optim.SGD([w], lr=0.1, momentum=0.9)

    data = [(rng.standard_normal((16, 6)).astype(np.float32), rng.standard_normal((16, 2)).astype(np.float32))
            for _ in range(12)]

    w_e, o_e = make()
    eager = [_mse_step(w_e, o_e, Tensor(x), Tensor(y)).item() for x, y in data]
    w_j, o_j = make()
    step = vkgraph.jit(lambda x, y: _mse_step(w_j, o_j, x, y))
    kept = [step(Tensor(x), Tensor(y)).clone().realize() for x, y in data]
    np.testing.assert_allclose([k.item() for k in kept], eager, rtol=1e-5)


def test_replay_input_copy_is_covered_by_the_graphs_fence():
    """The replay submits the input copies and the graph together: waiting for the input's last use must wait for
    that submission (else a freed input's buffer is overwritten by the next upload before the copy ran)."""
    f = vkgraph.jit(lambda x: (x * 2).sum())
    for _ in range(2):
        f(Tensor(np.ones(64, np.float32)))
    x = Tensor(np.ones(64, np.float32)).realize()
    dev = vkgraph.get_device()
    dev.synchronize()
    f(x)
    q = dev.queue
    alloc = x.node.arg[0].buf.alloc
    q.wait_for(alloc)
    assert q.completed >= alloc.last_use and all(sub.seq > alloc.last_use for sub in q.in_flight)

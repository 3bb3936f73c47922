"""Layers: parameters found through attributes, train/eval switching, state saved and loaded, and outputs equal
to the functional forms they wrap."""

from __future__ import annotations

import numpy as np
import pytest

from vkgraph import Tensor
from vkgraph.nn import functional as F
from vkgraph.nn import modules as nn
from vkgraph.nn import optim


class Net(nn.Module):
    def __init__(self):
        rng = np.random.default_rng(0)
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, rng=rng), nn.BatchNorm2d(4), nn.ReLU(),
                                      nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(4 * 2 * 2, 3, rng=rng))

    def forward(self, x):
        return self.head(self.features(x))


def test_module_parameters_modes_and_state(tmp_path):
    net = Net()
    names = [n for n, _ in net.named_parameters()]
    assert names == ["features.layers.0.weight", "features.layers.0.bias", "features.layers.1.weight",
                     "features.layers.1.bias", "head.layers.2.weight", "head.layers.2.bias"]
    x = Tensor(np.random.default_rng(1).standard_normal((5, 1, 4, 4)).astype(np.float32))
    opt = optim.SGD(net.parameters(), lr=0.1)
    loss = F.cross_entropy(net(x), Tensor(np.array([0, 1, 2, 0, 1], np.int32)))
    loss.backward()
    opt.step()
    bn = net.features[1]
    assert np.abs(bn.running_mean.numpy()).sum() > 0  # training updated the running statistics
    net.eval()
    assert not net.head[1].training
    a = net(x).numpy()
    np.testing.assert_array_equal(net(x).numpy(), a)  # eval: no dropout, running statistics
    net.save(tmp_path / "net.safetensors")
    other = Net().eval()
    assert not np.array_equal(other(x).numpy(), a)
    other.load(tmp_path / "net.safetensors")
    np.testing.assert_allclose(other(x).numpy(), a, rtol=1e-6)
    with pytest.raises(KeyError):
        other.load_state_dict({"nothing": np.zeros(1, np.float32)})


def test_layers_match_functional():
    rng = np.random.default_rng(2)
    x = Tensor(rng.standard_normal((2, 3, 6, 6)).astype(np.float32))
    conv = nn.Conv2d(3, 4, 3, stride=2, padding=1, padding_mode="reflect", rng=rng)
    want = F.conv2d(F.pad(x, [1, 1, 1, 1], "reflect"), conv.weight, conv.bias, 2)
    np.testing.assert_allclose(conv(x).numpy(), want.numpy(), rtol=1e-6)
    lin = nn.Linear(6, 2, bias=False, rng=rng)
    assert lin.bias is None and lin.weight.shape == (2, 6)
    np.testing.assert_allclose(nn.Upsample(scale_factor=2, mode="nearest")(x).numpy(),
                               F.interpolate(x, scale_factor=2).numpy())
    np.testing.assert_allclose(nn.LayerNorm(6)(x).numpy(), x.layer_norm(6).numpy(), rtol=1e-6)
    np.testing.assert_allclose(nn.GroupNorm(3, 3)(x).numpy(), F.group_norm(x, 3).numpy(), rtol=1e-6)
    emb = nn.Embedding(5, 2, rng=rng)
    np.testing.assert_array_equal(emb(Tensor(np.array([4, 0], np.int32))).numpy(), emb.weight.numpy()[[4, 0]])


def test_training_step_with_batch_norm_under_jit():
    """Running statistics are written in place inside the forward: a captured step keeps updating them."""
    import vkgraph

    def make():
        net = Net()
        net.head.layers[1].p = 0.0  # no dropout: eager and replayed runs draw no random numbers
        return net, optim.Adam(net.parameters(), lr=0.01)

    rng = np.random.default_rng(3)
    data = [(rng.standard_normal((6, 1, 4, 4)).astype(np.float32), rng.integers(0, 3, 6).astype(np.int32))
            for _ in range(5)]

    def run(net, opt, x, y):
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss

    ne, oe = make()
    eager = [run(ne, oe, Tensor(x), Tensor(y)).item() for x, y in data]
    nj, oj = make()
    step = vkgraph.jit(lambda x, y: run(nj, oj, x, y))
    got = [step(Tensor(x), Tensor(y)).item() for x, y in data]
    np.testing.assert_allclose(got, eager, rtol=1e-5)
    np.testing.assert_allclose(nj.features[1].running_var.numpy(), ne.features[1].running_var.numpy(), rtol=1e-5)

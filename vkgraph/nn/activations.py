"""Activation functions with PyTorch's names and arguments, composed of Tensor ops."""

from __future__ import annotations

import math

import numpy as np

from ..tensor import Tensor, _axis


def _f(x: Tensor) -> Tensor:
    return x if x.dtype.is_float else x.float()


def relu(x: Tensor) -> Tensor:
    return x.relu()


def relu6(x: Tensor) -> Tensor:
    return x.clip(0.0, 6.0)


def leaky_relu(x: Tensor, negative_slope: float = 0.01) -> Tensor:
    x = _f(x)
    return (x > 0).where(x, x * negative_slope)


def elu(x: Tensor, alpha: float = 1.0) -> Tensor:
    x = _f(x)
    return (x > 0).where(x, x.minimum(0.0).expm1() * alpha)


def selu(x: Tensor) -> Tensor:
    alpha, scale = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946
    return elu(x, alpha) * scale


def celu(x: Tensor, alpha: float = 1.0) -> Tensor:
    x = _f(x)
    return x.maximum(0.0) + ((x / alpha).minimum(0.0).expm1() * alpha)


def softplus(x: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """log(1 + exp(beta x)) / beta, and x itself where beta x > threshold."""
    x = _f(x)
    bx = x * beta
    soft = (bx.minimum(threshold).exp()).log1p() / beta
    return (bx > threshold).where(x, soft)


def softsign(x: Tensor) -> Tensor:
    x = _f(x)
    return x / (1.0 + x.abs())


def mish(x: Tensor) -> Tensor:
    x = _f(x)
    return x * softplus(x).tanh()


def hardsigmoid(x: Tensor) -> Tensor:
    return (_f(x) / 6.0 + 0.5).clip(0.0, 1.0)


def hardswish(x: Tensor) -> Tensor:
    x = _f(x)
    return x * hardsigmoid(x)


def hardtanh(x: Tensor, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    return _f(x).clip(min_val, max_val)


def logsigmoid(x: Tensor) -> Tensor:
    """-softplus(-x), computed without overflow: min(x, 0) - log1p(exp(-|x|))."""
    x = _f(x)
    return x.minimum(0.0) - (-(x.abs())).exp().log1p()


def glu(x: Tensor, dim: int = -1) -> Tensor:
    a = _axis(dim, x.ndim)
    if x.shape[a] % 2:
        raise ValueError(f"glu: axis {a} has odd size {x.shape[a]}")
    first, second = x.chunk(2, a)
    return first * second.sigmoid()


def quick_gelu(x: Tensor) -> Tensor:
    x = _f(x)
    return x * (x * 1.702).sigmoid()


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return x.gelu(approximate)


def silu(x: Tensor) -> Tensor:
    return x.silu()


def sigmoid(x: Tensor) -> Tensor:
    return x.sigmoid()


def tanh(x: Tensor) -> Tensor:
    return x.tanh()


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    return x.softmax(dim)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    return x.log_softmax(dim)


def softmin(x: Tensor, dim: int = -1) -> Tensor:
    return (-_f(x)).softmax(dim)


def tanhshrink(x: Tensor) -> Tensor:
    return _f(x) - x.tanh()


_STREAM: list[Tensor] = []  # a device counter (uint32) of the random numbers dropout has used


def _uniform(shape: tuple[int, ...]) -> Tensor:
    """Uniform [0, 1) numbers from a hash of (a device counter + position). The counter lives in a device tensor
    and moves on in place at each call, so a step captured by `vkgraph.jit` draws new numbers at every replay
    (Tensor.rand's counters are push constants, frozen at capture)."""
    from ..autograd import no_grad
    from ..tensor import _rng
    if not _STREAM:
        _STREAM.append(Tensor(np.zeros((), np.uint32)))
    counter = _STREAM[0]
    n = math.prod(shape)
    with no_grad():
        start = counter.clone().realize()  # read before the in-place step below
        counter.assign(counter + (n & 0xFFFFFFFF))
    h = (Tensor.arange(n, dtype="uint32") + start) * 0x9E3779B1 + (_rng["seed"] & 0xFFFFFFFF)
    h = h ^ (h >> 16)  # murmur3's finalizer: every input bit reaches every output bit
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    h = h ^ (h >> 16)
    return ((h >> 8).cast("float32") * (1.0 / (1 << 24))).reshape(shape)


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Zero each element with probability p and scale the rest by 1 / (1 - p) (only when training). The mask is
    drawn anew at every call, replays of a captured step included."""
    if not 0 <= p <= 1:
        raise ValueError(f"dropout probability {p} is not in [0, 1]")
    if not training or p == 0:
        return x
    if p == 1:
        return x * 0.0
    keep = _uniform(x.shape) >= p
    return keep.where(_f(x) * (1.0 / (1.0 - p)), 0.0)

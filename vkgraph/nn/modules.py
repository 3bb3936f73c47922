"""Trainable layers with PyTorch's names, arguments and default initialisation, over `vkgraph.nn.functional`.

A `Module` finds its parameters through its attributes (`vkgraph.nn.optim.named_parameters`), switches between
training and evaluation (`train()`, `eval()`), and saves and loads its parameters and buffers as safetensors.
Initial weights are drawn on the host from a numpy generator (`seed`), so a model is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from ..tensor import Tensor
from . import functional as F
from .conv import conv
from .optim import named_parameters

_default_rng = np.random.default_rng(0)


def _uniform(shape: tuple[int, ...], bound: float, rng: np.random.Generator | None) -> Tensor:
    r = rng if rng is not None else _default_rng
    return Tensor(r.uniform(-bound, bound, shape).astype(np.float32)).requires_grad_()


class Module:
    """Base of the layers: call it like a function (`forward`), find its parameters, save and load them."""

    training = True

    def forward(self, *args: Any) -> Any:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        return named_parameters(self)

    def parameters(self) -> list[Tensor]:
        return [t for _, t in self.named_parameters()]

    def modules(self) -> Iterator[Module]:
        return (m for _, m in _named_modules(self))

    def train(self, mode: bool = True) -> Module:
        for m in self.modules():
            m.training = mode
        return self

    def eval(self) -> Module:
        return self.train(False)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters and buffers (running statistics) by dotted name, as numpy arrays."""
        out = {name: t.numpy() for name, t in self.named_parameters()}
        for prefix, m in _named_modules(self):
            for name, t in m._buffers().items():
                out[f"{prefix}{name}"] = t.numpy()
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        targets = dict(self.named_parameters())
        for prefix, m in _named_modules(self):
            targets.update({f"{prefix}{k}": v for k, v in m._buffers().items()})
        if set(state) != set(targets):
            raise KeyError(f"state keys differ: {sorted(set(state) ^ set(targets))[:5]}")
        for k, t in targets.items():
            if tuple(state[k].shape) != t.shape:
                raise ValueError(f"{k}: shape {state[k].shape}, expected {t.shape}")
            t.assign(Tensor(np.asarray(state[k]), t.dtype))

    def save(self, path: str | Path) -> None:
        save_file(self.state_dict(), str(path))

    def load(self, path: str | Path) -> None:
        self.load_state_dict(load_file(str(path)))

    def _buffers(self) -> dict[str, Tensor]:
        return {}


def _named_modules(root: Module) -> Iterator[tuple[str, Module]]:
    seen: set[int] = set()

    def walk(obj: Any, prefix: str) -> Iterator[tuple[str, Module]]:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Module):
            yield prefix, obj
            items: Any = vars(obj).items()
        elif isinstance(obj, (list, tuple)):
            items = ((str(i), v) for i, v in enumerate(obj))
        elif isinstance(obj, dict):
            items = ((str(k), v) for k, v in obj.items())
        else:
            return
        for k, v in items:
            yield from walk(v, f"{prefix}{k}.")

    return walk(root, "")


class Sequential(Module):
    def __init__(self, *layers: Any) -> None:
        self.layers = list(layers)

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x

    def __getitem__(self, i: int) -> Any:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)


class Linear(Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, rng: np.random.Generator | None = None
                 ) -> None:
        bound = 1 / math.sqrt(in_features) if in_features else 0.0
        self.weight = _uniform((out_features, in_features), bound, rng)
        self.bias = _uniform((out_features,), bound, rng) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return x.linear(self.weight, self.bias)


class _ConvNd(Module):
    nd = 2

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | Sequence[int], stride: Any = 1,
                 padding: Any = 0, dilation: Any = 1, groups: int = 1, bias: bool = True,
                 padding_mode: str = "zeros", rng: np.random.Generator | None = None) -> None:
        k = (kernel_size,) * self.nd if isinstance(kernel_size, int) else tuple(kernel_size)
        fan_in = in_channels // groups * math.prod(k)
        bound = 1 / math.sqrt(fan_in) if fan_in else 0.0
        self.weight = _uniform((out_channels, in_channels // groups, *k), bound, rng)
        self.bias = _uniform((out_channels,), bound, rng) if bias else None
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        if padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            raise ValueError(f"padding_mode {padding_mode!r}")
        self.padding_mode = padding_mode

    def forward(self, x: Tensor) -> Tensor:
        padding = self.padding
        if self.padding_mode != "zeros" and padding != 0:
            p = (padding,) * self.nd if isinstance(padding, int) else tuple(padding)
            x = F.pad(x, [v for q in reversed(p) for v in (q, q)], self.padding_mode)
            padding = 0
        return conv(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)


class Conv1d(_ConvNd):
    nd = 1


class Conv2d(_ConvNd):
    nd = 2


class Conv3d(_ConvNd):
    nd = 3


class _BatchNorm(Module):
    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 track_running_stats: bool = True) -> None:
        self.eps, self.momentum = eps, momentum
        self.weight = Tensor(np.ones(num_features, np.float32)).requires_grad_() if affine else None
        self.bias = Tensor(np.zeros(num_features, np.float32)).requires_grad_() if affine else None
        self.running_mean = Tensor(np.zeros(num_features, np.float32)) if track_running_stats else None
        self.running_var = Tensor(np.ones(num_features, np.float32)) if track_running_stats else None

    def forward(self, x: Tensor) -> Tensor:
        use_batch = self.training or self.running_mean is None
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, use_batch,
                            self.momentum, self.eps)

    def _buffers(self) -> dict[str, Tensor]:
        if self.running_mean is None:
            return {}
        return {"running_mean": self.running_mean, "running_var": self.running_var}


class BatchNorm1d(_BatchNorm):
    pass


class BatchNorm2d(_BatchNorm):
    pass


class LayerNorm(Module):
    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5, elementwise_affine: bool = True
                 ) -> None:
        self.shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = eps
        self.weight = Tensor(np.ones(self.shape, np.float32)).requires_grad_() if elementwise_affine else None
        self.bias = Tensor(np.zeros(self.shape, np.float32)).requires_grad_() if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        return x.layer_norm(self.shape, self.weight, self.bias, self.eps)


class GroupNorm(Module):
    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True) -> None:
        self.groups, self.eps = num_groups, eps
        self.weight = Tensor(np.ones(num_channels, np.float32)).requires_grad_() if affine else None
        self.bias = Tensor(np.zeros(num_channels, np.float32)).requires_grad_() if affine else None

    def forward(self, x: Tensor) -> Tensor:
        return F.group_norm(x, self.groups, self.weight, self.bias, self.eps)


class Embedding(Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, rng: np.random.Generator | None = None) -> None:
        r = rng if rng is not None else _default_rng
        self.weight = Tensor(r.standard_normal((num_embeddings, embedding_dim)).astype(np.float32)).requires_grad_()

    def forward(self, idx: Tensor) -> Tensor:
        return F.embedding(idx, self.weight)


class Dropout(Module):
    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training)


class Flatten(Module):
    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x: Tensor) -> Tensor:
        return x.flatten(self.start_dim, self.end_dim)


class _Fn(Module):
    """A layer that applies a functional op with fixed arguments."""

    fn: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def forward(self, x: Tensor) -> Any:
        return type(self).fn(x, *self.args, **self.kwargs)


def _layer(name: str, fn: Any) -> type:
    return type(name, (_Fn,), {"fn": staticmethod(fn), "__doc__": f"The module form of {fn.__name__}."})


ReLU = _layer("ReLU", F.relu)
GELU = _layer("GELU", F.gelu)
SiLU = _layer("SiLU", F.silu)
Tanh = _layer("Tanh", F.tanh)
Sigmoid = _layer("Sigmoid", F.sigmoid)
LeakyReLU = _layer("LeakyReLU", F.leaky_relu)
Softmax = _layer("Softmax", F.softmax)
LogSoftmax = _layer("LogSoftmax", F.log_softmax)
MaxPool1d = _layer("MaxPool1d", F.max_pool1d)
MaxPool2d = _layer("MaxPool2d", F.max_pool2d)
AvgPool1d = _layer("AvgPool1d", F.avg_pool1d)
AvgPool2d = _layer("AvgPool2d", F.avg_pool2d)
AdaptiveAvgPool2d = _layer("AdaptiveAvgPool2d", F.adaptive_avg_pool2d)
AdaptiveMaxPool2d = _layer("AdaptiveMaxPool2d", F.adaptive_max_pool2d)
Upsample = _layer("Upsample", F.interpolate)
PixelShuffle = _layer("PixelShuffle", F.pixel_shuffle)

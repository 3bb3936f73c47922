"""Optimizers (SGD, Adam, AdamW), gradient clipping, and finding the parameters of a model object.

Every update is written in place (`assign`) into the parameter's own buffer and each piece of state lives in a
device tensor, the step count included, so a training step captured by `vkgraph.jit` replays correctly: nothing
that changes from step to step is a Python value baked into the capture. A learning rate given as a Python float
is baked in; give a 0-d Tensor and `assign` new values to it to schedule the rate under `jit`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from ..autograd import no_grad
from ..tensor import Tensor


def named_parameters(model: Any, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    """(dotted name, tensor) for every tensor that requires grad reachable through the model's attributes, lists,
    tuples and dicts, in attribute order; each tensor once."""
    seen: set[int] = set()

    def walk(obj: Any, name: str) -> Iterator[tuple[str, Tensor]]:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            if obj.requires_grad:
                yield name, obj
            return
        if isinstance(obj, dict):
            items: Iterable[tuple[str, Any]] = ((str(k), v) for k, v in obj.items())
        elif isinstance(obj, (list, tuple)):
            items = ((str(i), v) for i, v in enumerate(obj))
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            items = vars(obj).items()
        else:
            return
        for k, v in items:
            yield from walk(v, f"{name}.{k}" if name else k)

    yield from walk(model, prefix)


def parameters(model: Any) -> list[Tensor]:
    """The tensors that require grad in a model object (see named_parameters)."""
    return [t for _, t in named_parameters(model)]


def _params(params: Any) -> list[Tensor]:
    if isinstance(params, Tensor):
        return [params]
    if isinstance(params, (list, tuple)) and all(isinstance(p, Tensor) for p in params):
        return list(params)
    return parameters(params)


@no_grad()
def clip_grad_norm_(params: Any, max_norm: float, norm_type: float = 2.0, eps: float = 1e-6) -> Tensor:
    """Scale every gradient so that their joint norm is at most max_norm; returns the norm before clipping.
    Computed on the device (no read-back), so it captures under `jit`."""
    ps = [p for p in _params(params) if p.grad is not None]
    if not ps:
        return Tensor.full((), 0.0)
    if math.isinf(norm_type):
        total = ps[0].grad.abs().max()
        for p in ps[1:]:
            total = total.maximum(p.grad.abs().max())
    else:
        acc = None
        for p in ps:
            s = (p.grad.abs() ** norm_type).sum()
            acc = s if acc is None else acc + s
        total = acc ** (1.0 / norm_type)
    scale = (max_norm / (total + eps)).minimum(1.0)
    for p in ps:
        p.grad = (p.grad * scale).realize()
    return total


@no_grad()
def clip_grad_value_(params: Any, clip_value: float) -> None:
    for p in _params(params):
        if p.grad is not None:
            p.grad = p.grad.clip(-clip_value, clip_value).realize()


class Optimizer:
    """Holds parameters and per-parameter state tensors; `step()` updates in place, `zero_grad()` clears."""

    state_names: tuple[str, ...] = ()

    def __init__(self, params: Any, lr: float | Tensor) -> None:
        self.params = _params(params)
        if not self.params:
            raise ValueError("the optimizer got no parameters (mark them with requires_grad_())")
        self.lr = lr
        # uploaded zeros: realized constants are shared by equal nodes, and each state needs a buffer of its own
        self.step_count = Tensor(np.zeros((), np.float32))
        self.state: list[dict[str, Tensor]] = [
            {k: Tensor(np.zeros(p.shape, np.float32), p.dtype) for k in self.state_names} for p in self.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad = Tensor(np.zeros(p.shape, np.float32), p.dtype)

    @no_grad()
    def step(self) -> None:
        self.step_count.assign(self.step_count + 1.0)
        for p, st in zip(self.params, self.state, strict=True):
            if p.grad is not None:
                self._update(p, p.grad.cast(p.dtype), st, self.step_count)

    def _update(self, p: Tensor, g: Tensor, st: dict[str, Tensor], t: Tensor) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, np.ndarray]:
        out = {"step": self.step_count.numpy().reshape(1)}
        for i, st in enumerate(self.state):
            for k, v in st.items():
                out[f"{i}.{k}"] = v.numpy()
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        want = {"step"} | {f"{i}.{k}" for i, st in enumerate(self.state) for k in st}
        if set(state) != want:
            raise KeyError(f"optimizer state has keys {sorted(set(state) ^ want)[:5]} that do not match")
        self.step_count.assign(Tensor(np.asarray(state["step"], np.float32).reshape(())))
        for i, st in enumerate(self.state):
            for k, v in st.items():
                arr = state[f"{i}.{k}"]
                if arr.shape != v.shape:
                    raise ValueError(f"optimizer state {i}.{k}: shape {arr.shape}, expected {v.shape}")
                v.assign(Tensor(arr, v.dtype))

    def save(self, path: str | Path) -> None:
        """The state (step count and every state tensor) as a safetensors file."""
        save_file(self.state_dict(), str(path))

    def load(self, path: str | Path) -> None:
        self.load_state_dict(load_file(str(path)))


class SGD(Optimizer):
    """PyTorch's SGD: weight decay as L2 on the gradient, momentum with dampening, Nesterov."""

    def __init__(self, params: Any, lr: float | Tensor = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False) -> None:
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum needs a momentum and zero dampening")
        self.state_names = ("momentum_buffer",) if momentum else ()
        self.momentum, self.dampening, self.weight_decay = momentum, dampening, weight_decay
        self.nesterov, self.maximize = nesterov, maximize
        super().__init__(params, lr)

    def _update(self, p: Tensor, g: Tensor, st: dict[str, Tensor], t: Tensor) -> None:
        if self.maximize:
            g = -g
        if self.weight_decay:
            g = g + self.weight_decay * p
        if self.momentum:
            buf = st["momentum_buffer"]
            # the first step takes the gradient itself as the buffer, as PyTorch does
            buf.assign((t == 1.0).where(g, buf * self.momentum + g * (1 - self.dampening)))
            g = g + buf * self.momentum if self.nesterov else buf
        p.assign(p - g * self.lr)


class Adam(Optimizer):
    """PyTorch's Adam (weight decay as L2 on the gradient; amsgrad optional)."""

    decoupled = False

    def __init__(self, params: Any, lr: float | Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, maximize: bool = False) -> None:
        self.state_names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        self.betas, self.eps, self.weight_decay, self.amsgrad, self.maximize = betas, eps, weight_decay, amsgrad, \
            maximize
        super().__init__(params, lr)

    def _update(self, p: Tensor, g: Tensor, st: dict[str, Tensor], t: Tensor) -> None:
        b1, b2 = self.betas
        if self.maximize:
            g = -g
        if self.weight_decay and self.decoupled:
            p.assign(p * (1 - self.lr * self.weight_decay))
        elif self.weight_decay:
            g = g + self.weight_decay * p
        m, v = st["exp_avg"], st["exp_avg_sq"]
        m.assign(m * b1 + g * (1 - b1))
        v.assign(v * b2 + g * g * (1 - b2))
        if self.amsgrad:
            vmax = st["max_exp_avg_sq"]
            vmax.assign(vmax.maximum(v))
            v = vmax
        bc1 = 1.0 - Tensor.full((), b1) ** t
        bc2 = 1.0 - Tensor.full((), b2) ** t
        p.assign(p - (m / bc1) / ((v / bc2).sqrt() + self.eps) * self.lr)


class AdamW(Adam):
    """Adam with decoupled weight decay (the parameter shrinks by lr * weight_decay before the step)."""

    decoupled = True

    def __init__(self, params: Any, lr: float | Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize)

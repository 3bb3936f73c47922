"""Normalization functions beyond layer/RMS norm: batch, group and instance norm (PyTorch's arguments)."""

from __future__ import annotations

from ..autograd import no_grad
from ..tensor import Tensor


def _channel_shape(x: Tensor) -> tuple[int, ...]:
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def batch_norm(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None, weight: Tensor | None = None,
               bias: Tensor | None = None, training: bool = False, momentum: float = 0.1, eps: float = 1e-5
               ) -> Tensor:
    """Normalize over every axis but the channel axis 1. Training uses the batch's statistics and updates the
    running ones in place (running_var with the unbiased variance, as PyTorch); eval uses the running ones."""
    if x.ndim < 2:
        raise ValueError(f"batch_norm: input of shape {x.shape} has no channel axis")
    axes = (0,) + tuple(range(2, x.ndim))
    cs = _channel_shape(x)
    xf = x.float()
    if training:
        n = x.numel() // x.shape[1]
        if n <= 1:
            raise ValueError(f"batch_norm: training needs more than one value per channel, got input {x.shape}")
        mean = xf.mean(axes, keepdim=True)
        var = ((xf - mean) ** 2).mean(axes, keepdim=True)
        if running_mean is not None and running_var is not None:
            with no_grad():
                m, v = mean.detach().reshape(-1), var.detach().reshape(-1)
                running_mean.assign(running_mean * (1 - momentum) + m * momentum)
                running_var.assign(running_var * (1 - momentum) + v * (n / (n - 1)) * momentum)
    else:
        if running_mean is None or running_var is None:
            raise ValueError("batch_norm: eval needs running_mean and running_var")
        mean, var = running_mean.float().reshape(cs), running_var.float().reshape(cs)
    out = (xf - mean) * (var + eps).rsqrt()
    if weight is not None:
        out = out * weight.float().reshape(cs)
    if bias is not None:
        out = out + bias.float().reshape(cs)
    return out.cast(x.dtype if x.dtype.is_float else out.dtype)


def group_norm(x: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """Normalize each of num_groups channel groups of each sample; weight and bias per channel."""
    n, c = x.shape[:2]
    if c % num_groups:
        raise ValueError(f"group_norm: {c} channels are not divisible into {num_groups} groups")
    xf = x.float().reshape(n, num_groups, -1)
    mean = xf.mean(-1, keepdim=True)
    var = ((xf - mean) ** 2).mean(-1, keepdim=True)
    out = ((xf - mean) * (var + eps).rsqrt()).reshape(x.shape)
    cs = _channel_shape(x)
    if weight is not None:
        out = out * weight.float().reshape(cs)
    if bias is not None:
        out = out + bias.float().reshape(cs)
    return out.cast(x.dtype if x.dtype.is_float else out.dtype)


def instance_norm(x: Tensor, running_mean: Tensor | None = None, running_var: Tensor | None = None,
                  weight: Tensor | None = None, bias: Tensor | None = None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """Normalize each channel of each sample over its spatial axes."""
    if not use_input_stats:
        return batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps)
    n, c = x.shape[:2]
    if running_mean is not None and running_var is not None:
        xf = x.float().reshape(n, c, -1)
        m = xf.mean(-1).mean(0)
        k = xf.shape[-1]
        v = ((xf - xf.mean(-1, keepdim=True)) ** 2).mean(-1).mean(0) * (k / max(k - 1, 1))
        with no_grad():
            running_mean.assign(running_mean * (1 - momentum) + m.detach() * momentum)
            running_var.assign(running_var * (1 - momentum) + v.detach() * momentum)
    return group_norm(x, c, weight, bias, eps)


def layer_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    return x.layer_norm(normalized_shape, weight, bias, eps)


def rms_norm(x: Tensor, normalized_shape=None, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    return x.rms_norm(weight, eps)

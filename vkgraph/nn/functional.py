"""vkgraph's counterpart of torch.nn.functional: one namespace over the modules that implement each family."""

from __future__ import annotations

from ..einsum import einsum
from ..tensor import Tensor, embedding
from .activations import (
    celu,
    dropout,
    elu,
    gelu,
    glu,
    hardsigmoid,
    hardswish,
    hardtanh,
    leaky_relu,
    log_softmax,
    logsigmoid,
    mish,
    quick_gelu,
    relu,
    relu6,
    selu,
    sigmoid,
    silu,
    softmax,
    softmin,
    softplus,
    softsign,
    tanh,
    tanhshrink,
)
from .conv import (
    adaptive_avg_pool1d,
    adaptive_avg_pool2d,
    adaptive_max_pool1d,
    adaptive_max_pool2d,
    avg_pool1d,
    avg_pool2d,
    avg_pool3d,
    conv1d,
    conv2d,
    conv3d,
    conv_transpose1d,
    conv_transpose2d,
    interpolate,
    max_pool1d,
    max_pool2d,
    max_pool3d,
    pad,
    pixel_shuffle,
    pixel_unshuffle,
)
from .losses import (
    binary_cross_entropy,
    binary_cross_entropy_with_logits,
    cross_entropy,
    huber_loss,
    kl_div,
    l1_loss,
    mse_loss,
    nll_loss,
    smooth_l1_loss,
)
from .norms import batch_norm, group_norm, instance_norm, layer_norm, rms_norm


def one_hot(x: Tensor, num_classes: int = -1) -> Tensor:
    return x.one_hot(num_classes)


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Tensor:
    if dropout_p:
        raise ValueError("scaled_dot_product_attention: attention dropout is not supported (dropout_p must be 0)")
    return query.scaled_dot_product_attention(key, value, attn_mask, is_causal, scale, enable_gqa)


__all__ = [
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_max_pool1d", "adaptive_max_pool2d", "avg_pool1d",
    "avg_pool2d", "avg_pool3d", "batch_norm", "binary_cross_entropy", "binary_cross_entropy_with_logits", "celu",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "cross_entropy", "dropout", "einsum",
    "elu", "embedding", "gelu", "glu", "group_norm", "hardsigmoid", "hardswish", "hardtanh", "huber_loss",
    "instance_norm", "interpolate", "kl_div", "l1_loss", "layer_norm", "leaky_relu", "log_softmax", "logsigmoid",
    "max_pool1d", "max_pool2d", "max_pool3d", "mish", "mse_loss", "nll_loss", "one_hot", "pad", "pixel_shuffle",
    "pixel_unshuffle", "quick_gelu", "relu", "relu6", "rms_norm", "scaled_dot_product_attention", "selu", "sigmoid",
    "silu", "smooth_l1_loss", "softmax", "softmin", "softplus", "softsign", "tanh", "tanhshrink",
]

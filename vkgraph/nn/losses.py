"""Loss functions with PyTorch's names, arguments and reductions ("mean", "sum", "none"), composed of Tensor ops
(so they fuse and differentiate like any other graph)."""

from __future__ import annotations

from ..dtype import dtypes
from ..tensor import Tensor


def _reduce(loss: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', not {reduction!r}")


def _float(x: Tensor) -> Tensor:
    return x if x.dtype.is_float else x.float()


def _class_axis_last(x: Tensor) -> Tensor:
    """(N, C, d1, ...) -> (N, d1, ..., C); (C,) and (N, C) stay."""
    return x if x.ndim <= 2 else x.permute(0, *range(2, x.ndim), 1)


def nll_loss(log_probs: Tensor, target: Tensor, weight: Tensor | None = None, ignore_index: int = -100,
             reduction: str = "mean") -> Tensor:
    """-log_probs[target] per sample (class axis 1, or 0 for an unbatched (C,) input); `weight` per class;
    targets equal to ignore_index count for nothing (and are left out of the mean's denominator)."""
    if target.dtype.is_float:
        raise TypeError("nll_loss takes class indices (an integer target)")
    lp = _class_axis_last(_float(log_probs))
    c = lp.shape[-1]
    if tuple(target.shape) != tuple(lp.shape[:-1]):
        raise ValueError(f"nll_loss: target of shape {target.shape} for input of shape {log_probs.shape}")
    t = target.cast(dtypes.int32)
    keep = t != ignore_index
    hot = (t.unsqueeze(-1) == Tensor.arange(c).reshape(*(1,) * t.ndim, c)).logical_and(keep.unsqueeze(-1))
    w = hot.float() if weight is None else hot.where(_float(weight), 0.0)
    picked = -(lp * w).sum(-1)
    if reduction == "mean":
        return picked.sum() / w.sum()
    return _reduce(picked, reduction)


def cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """Softmax cross entropy over axis 1 (0 for unbatched input). target: class indices (ignore_index, per-class
    weight) or class probabilities of the input's shape; label_smoothing mixes in the uniform distribution."""
    lp = _float(input).log_softmax(1 if input.ndim > 1 else 0)
    c = lp.shape[1 if input.ndim > 1 else 0]
    if target.dtype.is_float:  # probabilities
        if tuple(target.shape) != tuple(input.shape):
            raise ValueError(f"cross_entropy: probabilities of shape {target.shape} for input {input.shape}")
        p = target if label_smoothing == 0 else target * (1 - label_smoothing) + label_smoothing / c
        lpl = _class_axis_last(lp)
        pl = _class_axis_last(p)
        if weight is not None:
            pl = pl * _float(weight)
        return _reduce(-(lpl * pl).sum(-1), reduction)
    nll = nll_loss(lp, target, weight, ignore_index, reduction)
    if label_smoothing == 0:
        return nll
    # the smoothing term: -mean over classes of log p (weighted like PyTorch), on the same samples
    lpl = _class_axis_last(lp)
    t = target.cast(dtypes.int32)
    keep = (t != ignore_index).float()
    per_class = lpl if weight is None else lpl * _float(weight)
    smooth = -per_class.sum(-1) * keep
    if reduction == "mean":
        if weight is None:
            denom = keep.sum()
        else:
            hot = t.unsqueeze(-1) == Tensor.arange(c).reshape(*(1,) * t.ndim, c)
            denom = (hot.where(_float(weight), 0.0).sum(-1) * keep).sum()
        smooth = smooth.sum() / denom
    else:
        smooth = _reduce(smooth, reduction)
    return nll * (1 - label_smoothing) + smooth * (label_smoothing / c)


def binary_cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None,
                         reduction: str = "mean") -> Tensor:
    """-(t log p + (1 - t) log(1 - p)), with each log clamped at -100 as PyTorch does."""
    p, t = _float(input), _float(target)
    loss = -(t * p.log().maximum(-100.0) + (1 - t) * (1 - p).log().maximum(-100.0))
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


def binary_cross_entropy_with_logits(input: Tensor, target: Tensor, weight: Tensor | None = None,
                                     reduction: str = "mean", pos_weight: Tensor | None = None) -> Tensor:
    """BCE of sigmoid(input), computed stably: (1 - t) x + (1 + (pw - 1) t) softplus(-x)."""
    x, t = _float(input), _float(target)
    sp = (-x).maximum(0.0) + (-(x.abs())).exp().log1p()
    lw = 1.0 if pos_weight is None else (pos_weight - 1) * t + 1
    loss = (1 - t) * x + lw * sp
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


def mse_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    d = _float(input) - target
    return _reduce(d * d, reduction)


def l1_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    return _reduce((_float(input) - target).abs(), reduction)


def smooth_l1_loss(input: Tensor, target: Tensor, reduction: str = "mean", beta: float = 1.0) -> Tensor:
    d = (_float(input) - target).abs()
    if beta == 0:
        return _reduce(d, reduction)
    return _reduce((d < beta).where(0.5 * d * d / beta, d - 0.5 * beta), reduction)


def huber_loss(input: Tensor, target: Tensor, reduction: str = "mean", delta: float = 1.0) -> Tensor:
    d = (_float(input) - target).abs()
    return _reduce((d < delta).where(0.5 * d * d, delta * (d - 0.5 * delta)), reduction)


def kl_div(input: Tensor, target: Tensor, reduction: str = "mean", log_target: bool = False) -> Tensor:
    """target * (log target - input) pointwise (input holds log-probabilities); 0 where target is 0.
    reduction "batchmean" divides the sum by the batch size."""
    x = _float(input)
    if log_target:
        loss = target.exp() * (target - x)
    else:
        loss = (target > 0).where(target * (target.maximum(1e-45).log() - x), 0.0)
    if reduction == "batchmean":
        return loss.sum() / (x.shape[0] if x.ndim else 1)
    return _reduce(loss, reduction)

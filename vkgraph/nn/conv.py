"""Convolution, pooling, resizing and padding modes, lowered to views plus a reduction or a matmul.

A convolution reads its input through one strided view of sliding windows (overlapping strides stacked on the
padded input's view: no im2col copy) and contracts it with the weight through `Tensor.matmul`, so the scheduler
fuses the padding, the window reads and the epilogue (bias, activation) as it does any matmul, and autograd's
view transpose gives the input gradient. Pools reduce the same windows. Shapes follow PyTorch:
(N, C, *spatial), weights (C_out, C_in / groups, *kernel).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..dtype import dtypes
from ..tensor import Tensor
from ..view import ShapeTracker, View, strides_for

IntOrTuple = int | Sequence[int]


def _tuple(v: IntOrTuple, n: int, name: str) -> tuple[int, ...]:
    out = (int(v),) * n if isinstance(v, (int, np.integer)) else tuple(int(x) for x in v)
    if len(out) != n:
        raise ValueError(f"{name} needs {n} values, got {v}")
    return out


def _batched(x: Tensor, nd: int, name: str) -> tuple[Tensor, bool]:
    if x.ndim == nd + 1:  # unbatched (C, *spatial), as PyTorch accepts
        return x.unsqueeze(0), True
    if x.ndim != nd + 2:
        raise ValueError(f"{name}: input of shape {x.shape} is not (N, C, {nd} spatial axes)")
    return x, False


def windows(x: Tensor, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int]) -> Tensor:
    """Sliding windows over the trailing len(kernel) axes: shape lead + out + kernel, a view (no copy)."""
    nd = len(kernel)
    lead, sp = x.shape[:-nd], x.shape[-nd:]
    out = tuple((s - d * (k - 1) - 1) // st + 1 for s, k, st, d in zip(sp, kernel, stride, dilation, strict=True))
    if any(o <= 0 for o in out):
        raise ValueError(f"kernel {tuple(kernel)} (dilation {tuple(dilation)}) is larger than the padded input {sp}")
    cs = strides_for(x.shape) if 0 not in x.shape else (0,) * x.ndim
    strides = cs[:-nd] + tuple(c * s for c, s in zip(cs[-nd:], stride, strict=True)) + \
        tuple(c * d for c, d in zip(cs[-nd:], dilation, strict=True))
    v = View.make(lead + out + tuple(kernel), strides)
    return x._move(lambda st: ShapeTracker(st.views + (v,)))


def _same_pad(kernel: Sequence[int], dilation: Sequence[int]) -> list[tuple[int, int]]:
    tot = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
    return [(t // 2, t - t // 2) for t in tot]


def conv(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntOrTuple = 1,
         padding: IntOrTuple | str = 0, dilation: IntOrTuple = 1, groups: int = 1) -> Tensor:
    """N-d convolution (cross-correlation, as PyTorch's convNd) over the axes after (N, C)."""
    nd = weight.ndim - 2
    name = f"conv{nd}d"
    x, unbatched = _batched(x, nd, name)
    n, c = x.shape[:2]
    o, cg = weight.shape[:2]
    kernel = weight.shape[2:]
    stride, dilation = _tuple(stride, nd, "stride"), _tuple(dilation, nd, "dilation")
    if groups < 1 or c % groups or o % groups or cg != c // groups:
        raise ValueError(f"{name}: input channels {c}, weight {weight.shape} and groups {groups} do not fit")
    if isinstance(padding, str):
        if padding == "valid":
            pads = [(0, 0)] * nd
        elif padding == "same":
            if any(s != 1 for s in stride):
                raise ValueError(f"{name}: padding='same' needs stride 1")
            pads = _same_pad(kernel, dilation)
        else:
            raise ValueError(f"{name}: padding must be 'same', 'valid' or numbers, not {padding!r}")
    else:
        pads = [(p, p) for p in _tuple(padding, nd, "padding")]
    d = x.dtype if x.dtype.is_float else dtypes.float32
    x = x.cast(d).pad([(0, 0), (0, 0)] + pads)
    win = windows(x.reshape(n, groups, cg, *x.shape[2:]), kernel, stride, dilation)  # (N, G, Cg, *O, *K)
    out_sp = win.shape[3:3 + nd]
    p, ck, og = math.prod(out_sp), cg * math.prod(kernel), o // groups
    if n * p * og >= 4096 and n * p >= 16 and og >= 16:  # im2col as a view, one GEMM per group: the tiled matmul
        order = (1, 0) + tuple(range(3, 3 + nd)) + (2,) + tuple(range(3 + nd, 3 + 2 * nd))
        a = win.permute(order).reshape(groups, n * p, ck)  # (G, N * P, Cg * K), rows of the batch stacked
        w = weight.cast(d).reshape(groups, og, ck).transpose(-1, -2)  # (G, Cg * K, Og)
        out = (a @ w).reshape(groups, n, p, og).permute(1, 0, 3, 2).reshape(n, o, *out_sp)
    else:  # one reduction over (Cg, *K) read straight through the window view (no reshape of it: less index math)
        a = win.reshape(n, groups, 1, cg, *out_sp, *kernel)  # only a size-1 axis comes in: the same view
        acc = dtypes.float32 if d in (dtypes.float16, dtypes.bfloat16) else d
        w = weight.cast(acc).reshape(1, groups, og, cg, *(1,) * nd, *kernel)
        axes = (3,) + tuple(range(4 + nd, 4 + 2 * nd))
        out = (a.cast(acc) * w).sum(axes).reshape(n, o, *out_sp).cast(d)
    if bias is not None:
        out = out + bias.cast(d).reshape(o, *(1,) * nd)
    return out.squeeze(0) if unbatched else out


def conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntOrTuple = 1,
           padding: IntOrTuple | str = 0, dilation: IntOrTuple = 1, groups: int = 1) -> Tensor:
    _check_weight(weight, 1)
    return conv(x, weight, bias, stride, padding, dilation, groups)


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntOrTuple = 1,
           padding: IntOrTuple | str = 0, dilation: IntOrTuple = 1, groups: int = 1) -> Tensor:
    _check_weight(weight, 2)
    return conv(x, weight, bias, stride, padding, dilation, groups)


def conv3d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntOrTuple = 1,
           padding: IntOrTuple | str = 0, dilation: IntOrTuple = 1, groups: int = 1) -> Tensor:
    _check_weight(weight, 3)
    return conv(x, weight, bias, stride, padding, dilation, groups)


def _check_weight(weight: Tensor, nd: int) -> None:
    if weight.ndim != nd + 2:
        raise ValueError(f"conv{nd}d: weight of shape {weight.shape} is not (C_out, C_in / groups, {nd} kernel axes)")


def conv_transpose(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntOrTuple = 1,
                   padding: IntOrTuple = 0, output_padding: IntOrTuple = 0, groups: int = 1,
                   dilation: IntOrTuple = 1) -> Tensor:
    """N-d transposed convolution: a stride-1 convolution over the input with stride - 1 zeros between elements,
    with the weight flipped and its in/out axes swapped per group. Weight: (C_in, C_out / groups, *kernel)."""
    nd = weight.ndim - 2
    x, unbatched = _batched(x, nd, f"conv_transpose{nd}d")
    c = x.shape[1]
    og = weight.shape[1]
    kernel = weight.shape[2:]
    stride, dilation = _tuple(stride, nd, "stride"), _tuple(dilation, nd, "dilation")
    padding, opad = _tuple(padding, nd, "padding"), _tuple(output_padding, nd, "output_padding")
    if weight.shape[0] != c or c % groups:
        raise ValueError(f"conv_transpose{nd}d: input channels {c}, weight {weight.shape}, groups {groups} do not fit")
    if any(op >= max(s, d) for op, s, d in zip(opad, stride, dilation, strict=True)):
        raise ValueError("output_padding must be smaller than stride or dilation")
    for i, s in enumerate(stride):  # zeros between input elements
        if s > 1:
            ax = 2 + i
            L = x.shape[ax]
            x = x.unsqueeze(ax + 1).pad([(0, 0)] * (ax + 1) + [(0, s - 1)] + [(0, 0)] * (x.ndim - ax - 1))
            x = x.reshape(*x.shape[:ax], L * s, *x.shape[ax + 2:])
            x = x.shrink([None] * ax + [(0, (L - 1) * s + 1)] + [None] * (x.ndim - ax - 1))
    pads = [(d * (k - 1) - p, d * (k - 1) - p + op)
            for k, d, p, op in zip(kernel, dilation, padding, opad, strict=True)]
    x = x.pad([(0, 0), (0, 0)] + pads)
    w = weight.reshape(groups, c // groups, og, *kernel).transpose(1, 2).reshape(groups * og, c // groups, *kernel)
    w = w.flip(tuple(range(2, 2 + nd)))
    out = conv(x, w, bias, 1, 0, dilation, groups)
    return out.squeeze(0) if unbatched else out


def conv_transpose1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntOrTuple = 1,
                     padding: IntOrTuple = 0, output_padding: IntOrTuple = 0, groups: int = 1,
                     dilation: IntOrTuple = 1) -> Tensor:
    _check_weight(weight, 1)
    return conv_transpose(x, weight, bias, stride, padding, output_padding, groups, dilation)


def conv_transpose2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntOrTuple = 1,
                     padding: IntOrTuple = 0, output_padding: IntOrTuple = 0, groups: int = 1,
                     dilation: IntOrTuple = 1) -> Tensor:
    _check_weight(weight, 2)
    return conv_transpose(x, weight, bias, stride, padding, output_padding, groups, dilation)


# ---- pooling ----------------------------------------------------------------------------------------------------


def _pool_geometry(shape: Sequence[int], kernel: IntOrTuple, stride: IntOrTuple | None, padding: IntOrTuple,
                   dilation: IntOrTuple, ceil_mode: bool, nd: int) -> tuple:
    k = _tuple(kernel, nd, "kernel_size")
    s = _tuple(stride if stride is not None and stride != [] else k, nd, "stride")
    p, d = _tuple(padding, nd, "padding"), _tuple(dilation, nd, "dilation")
    if any(pi > ki // 2 for pi, ki in zip(p, k, strict=True)):
        raise ValueError(f"pool: padding {p} must be at most half the kernel {k}")
    outs, extra = [], []
    for L, ki, si, pi, di in zip(shape, k, s, p, d, strict=True):
        span = L + 2 * pi - di * (ki - 1) - 1
        o = (-(-span // si) if ceil_mode else span // si) + 1
        if ceil_mode and (o - 1) * si >= L + pi:  # the last window must start inside the input or left padding
            o -= 1
        if o <= 0:
            raise ValueError(f"pool: kernel {k} does not fit the input {tuple(shape)} with padding {p}")
        outs.append(o)
        extra.append(max(0, (o - 1) * si + di * (ki - 1) + 1 - (L + 2 * pi)))
    return k, s, p, d, outs, extra


def _max_pool(x: Tensor, nd: int, kernel_size: IntOrTuple, stride: IntOrTuple | None, padding: IntOrTuple,
              dilation: IntOrTuple, ceil_mode: bool, return_indices: bool) -> Tensor | tuple[Tensor, Tensor]:
    x, unbatched = _batched(x, nd, f"max_pool{nd}d")
    sp = x.shape[2:]
    k, s, p, d, outs, extra = _pool_geometry(sp, kernel_size, stride, padding, dilation, ceil_mode, nd)
    lo = float("-inf") if x.dtype.is_float else _int_min(x)
    xp = x.pad([(0, 0), (0, 0)] + [(pi, pi + e) for pi, e in zip(p, extra, strict=True)], lo)
    win = windows(xp, k, s, d)
    kaxes = tuple(range(2 + nd, 2 + 2 * nd))
    out = win.max(kaxes)
    if not return_indices:
        return out.squeeze(0) if unbatched else out
    flat = win.reshape(*win.shape[:2 + nd], math.prod(k))
    kidx = flat.argmax(-1)  # first largest in the window, as PyTorch
    pos = None  # flat index into the input's spatial plane
    rem = kidx
    for i in reversed(range(nd)):
        ki = rem % k[i]
        rem = rem // k[i]
        o = Tensor.arange(outs[i]).reshape(*(outs[i] if j == i else 1 for j in range(nd)))
        coord = o * s[i] - p[i] + ki * d[i]
        stride_in = math.prod(sp[i + 1:])
        pos = coord * stride_in if pos is None else pos + coord * stride_in
    idx = pos.expand(out.shape)  # int32, like argmax (int64 is not on every device)
    return (out.squeeze(0), idx.squeeze(0)) if unbatched else (out, idx)


def _int_min(x: Tensor) -> int:
    return int(np.iinfo(x.dtype.np).min)


def max_pool1d(x: Tensor, kernel_size: IntOrTuple, stride: IntOrTuple | None = None, padding: IntOrTuple = 0,
               dilation: IntOrTuple = 1, ceil_mode: bool = False, return_indices: bool = False):
    return _max_pool(x, 1, kernel_size, stride, padding, dilation, ceil_mode, return_indices)


def max_pool2d(x: Tensor, kernel_size: IntOrTuple, stride: IntOrTuple | None = None, padding: IntOrTuple = 0,
               dilation: IntOrTuple = 1, ceil_mode: bool = False, return_indices: bool = False):
    return _max_pool(x, 2, kernel_size, stride, padding, dilation, ceil_mode, return_indices)


def max_pool3d(x: Tensor, kernel_size: IntOrTuple, stride: IntOrTuple | None = None, padding: IntOrTuple = 0,
               dilation: IntOrTuple = 1, ceil_mode: bool = False, return_indices: bool = False):
    return _max_pool(x, 3, kernel_size, stride, padding, dilation, ceil_mode, return_indices)


def _avg_pool(x: Tensor, nd: int, kernel_size: IntOrTuple, stride: IntOrTuple | None, padding: IntOrTuple,
              ceil_mode: bool, count_include_pad: bool, divisor_override: int | None) -> Tensor:
    x, unbatched = _batched(x, nd, f"avg_pool{nd}d")
    sp = x.shape[2:]
    k, s, p, d, outs, extra = _pool_geometry(sp, kernel_size, stride, padding, 1, ceil_mode, nd)
    x = x.cast(x.dtype if x.dtype.is_float else dtypes.float32)
    pads = [(pi, pi + e) for pi, e in zip(p, extra, strict=True)]
    kaxes = tuple(range(2 + nd, 2 + 2 * nd))
    total = windows(x.pad([(0, 0), (0, 0)] + pads), k, s, d).sum(kaxes)
    if divisor_override:
        count: Tensor | float = float(divisor_override)
    else:
        # what each window covers: the padded input (count_include_pad) or the input alone; never the overhang
        # that ceil_mode adds past the padding
        if count_include_pad:
            ones = Tensor.ones(*(L + 2 * pi for L, pi in zip(sp, p, strict=True))).pad([(0, e) for e in extra])
        else:
            ones = Tensor.ones(*sp).pad(pads)
        count = windows(ones, k, s, d).sum(tuple(range(nd, 2 * nd)))
    out = total / count
    return out.squeeze(0) if unbatched else out


def avg_pool1d(x: Tensor, kernel_size: IntOrTuple, stride: IntOrTuple | None = None, padding: IntOrTuple = 0,
               ceil_mode: bool = False, count_include_pad: bool = True) -> Tensor:
    return _avg_pool(x, 1, kernel_size, stride, padding, ceil_mode, count_include_pad, None)


def avg_pool2d(x: Tensor, kernel_size: IntOrTuple, stride: IntOrTuple | None = None, padding: IntOrTuple = 0,
               ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None) -> Tensor:
    return _avg_pool(x, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


def avg_pool3d(x: Tensor, kernel_size: IntOrTuple, stride: IntOrTuple | None = None, padding: IntOrTuple = 0,
               ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None) -> Tensor:
    return _avg_pool(x, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


def _adaptive(x: Tensor, output_size: IntOrTuple, nd: int, kind: str) -> Tensor:
    """Adaptive pooling, one axis at a time (both max and mean are separable): output i of an axis of length L
    covers [floor(i L / o), ceil((i + 1) L / o)); a mask (o, L) selects each bin."""
    x, unbatched = _batched(x, nd, f"adaptive_{kind}_pool{nd}d")
    sizes = _tuple(output_size, nd, "output_size") if not isinstance(output_size, (list, tuple)) or None not in \
        output_size else tuple(x.shape[2 + i] if o is None else int(o) for i, o in enumerate(output_size))
    for i, o in enumerate(sizes):
        ax = 2 + i
        L = x.shape[ax]
        if L == 0 or o <= 0:
            raise ValueError(f"adaptive pool: cannot pool an axis of {L} into {o}")
        j = np.arange(L)
        start = (np.arange(o) * L) // o
        end = -((-(np.arange(o) + 1) * L) // o)
        mask = (j[None, :] >= start[:, None]) & (j[None, :] < end[:, None])  # (o, L)
        xe = x.unsqueeze(ax)  # (..., 1, L, ...)
        m = Tensor(mask.reshape((o, L) + (1,) * (x.ndim - ax - 1)))
        if kind == "max":
            x = m.where(xe, float("-inf")).max(ax + 1)
        else:
            w = mask / mask.sum(1, keepdims=True)
            x = (xe * Tensor(w.astype(np.float32).reshape((o, L) + (1,) * (x.ndim - ax - 1)))).sum(ax + 1)
    return x.squeeze(0) if unbatched else x


def adaptive_avg_pool1d(x: Tensor, output_size: IntOrTuple) -> Tensor:
    return _adaptive(x, output_size, 1, "avg")


def adaptive_avg_pool2d(x: Tensor, output_size: IntOrTuple) -> Tensor:
    return _adaptive(x, output_size, 2, "avg")


def adaptive_max_pool1d(x: Tensor, output_size: IntOrTuple) -> Tensor:
    return _adaptive(x, output_size, 1, "max")


def adaptive_max_pool2d(x: Tensor, output_size: IntOrTuple) -> Tensor:
    return _adaptive(x, output_size, 2, "max")


# ---- resizing -----------------------------------------------------------------------------------------------------


def _source_coords(out: int, size: int, scale: float | None, align_corners: bool | None) -> np.ndarray:
    i = np.arange(out, dtype=np.float64)
    if align_corners:
        return i * ((size - 1) / (out - 1)) if out > 1 else np.zeros(out)
    r = 1.0 / scale if scale is not None else size / out
    return (i + 0.5) * r - 0.5


def _taps(mode: str, out: int, size: int, scale: float | None, align_corners: bool | None
          ) -> tuple[np.ndarray, np.ndarray]:
    """Source indices (out, taps) and weights (out, taps) of one axis."""
    if mode in ("nearest", "nearest-exact"):
        r = 1.0 / scale if scale is not None else size / out
        i = np.arange(out, dtype=np.float64)
        src = np.floor(i * r) if mode == "nearest" else np.floor((i + 0.5) * r)
        return np.minimum(src, size - 1).astype(np.int64)[:, None], np.ones((out, 1))
    src = _source_coords(out, size, scale, align_corners)
    if mode == "linear":
        src = np.maximum(src, 0.0) if not align_corners else src
        i0 = np.floor(src).astype(np.int64)
        t = src - i0
        i0 = np.minimum(i0, size - 1)
        i1 = np.minimum(i0 + 1, size - 1)
        return np.stack([i0, i1], 1), np.stack([1 - t, t], 1)
    if mode == "cubic":  # Keys' kernel with A = -0.75, edge indices clamped (PyTorch's bicubic)
        a = -0.75
        i0 = np.floor(src).astype(np.int64)
        t = src - i0

        def near(u):
            return ((a + 2) * u - (a + 3)) * u * u + 1

        def far(u):
            return ((a * u - 5 * a) * u + 8 * a) * u - 4 * a
        w = np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], 1)
        idx = np.clip(np.stack([i0 - 1, i0, i0 + 1, i0 + 2], 1), 0, size - 1)
        return idx, w
    raise ValueError(f"interpolate: unknown mode {mode!r}")


def interpolate(x: Tensor, size: IntOrTuple | None = None, scale_factor: float | Sequence[float] | None = None,
                mode: str = "nearest", align_corners: bool | None = None) -> Tensor:
    """Resize the spatial axes (after N, C): nearest, nearest-exact, linear, bilinear, bicubic, trilinear, area."""
    nd = x.ndim - 2
    if nd < 1:
        raise ValueError(f"interpolate: input of shape {x.shape} has no spatial axis")
    if mode == "area":  # PyTorch's area mode is adaptive average pooling to the output size
        if align_corners is not None:
            raise ValueError("align_corners applies to linear and cubic modes only")
        sp = x.shape[2:]
        outs = _tuple(size, nd, "size") if size is not None else tuple(
            int(math.floor(L * s)) for L, s in zip(sp, scale_factor if isinstance(scale_factor, (list, tuple))
                                                   else (scale_factor,) * nd, strict=True))
        return _adaptive(x.cast(x.dtype if x.dtype.is_float else dtypes.float32), outs, nd, "avg")
    axis_mode = {"nearest": "nearest", "nearest-exact": "nearest-exact", "linear": "linear", "bilinear": "linear",
                 "trilinear": "linear", "bicubic": "cubic"}.get(mode)
    if axis_mode is None:
        raise ValueError(f"interpolate: unsupported mode {mode!r}")
    if mode in ("nearest", "nearest-exact") and align_corners is not None:
        raise ValueError("align_corners applies to linear and cubic modes only")
    sp = x.shape[2:]
    if (size is None) == (scale_factor is None):
        raise ValueError("interpolate: give exactly one of size and scale_factor")
    if size is not None:
        outs, scales = _tuple(size, nd, "size"), (None,) * nd
    else:
        scales = tuple(float(s) for s in (scale_factor if isinstance(scale_factor, (list, tuple))
                                          else (scale_factor,) * nd))
        outs = tuple(int(math.floor(L * s)) for L, s in zip(sp, scales, strict=True))
    d = x.dtype if x.dtype.is_float else dtypes.float32
    x = x.cast(d)
    for i, (o, L, sc) in enumerate(zip(outs, sp, scales, strict=True)):
        ax = 2 + i
        idx, w = _taps(axis_mode, o, L, sc, align_corners)
        taps = idx.shape[1]
        g = x.take(Tensor(idx.reshape(-1).astype(np.int32)), ax)  # (..., o * taps, ...)
        g = g.reshape(*g.shape[:ax], o, taps, *g.shape[ax + 1:])
        wt = Tensor(w.astype(np.float32).reshape((o, taps) + (1,) * (x.ndim - ax - 1)))
        x = (g * wt).sum(ax + 1) if taps > 1 else g.squeeze(ax + 1)
    return x


def pixel_shuffle(x: Tensor, upscale_factor: int) -> Tensor:
    """(..., C r^2, H, W) -> (..., C, H r, W r)."""
    r = int(upscale_factor)
    *lead, c, h, w = x.shape
    if c % (r * r):
        raise ValueError(f"pixel_shuffle: {c} channels are not divisible by {r * r}")
    n = len(lead)
    y = x.reshape(*lead, c // (r * r), r, r, h, w)
    y = y.permute(*range(n), n, n + 3, n + 1, n + 4, n + 2)
    return y.reshape(*lead, c // (r * r), h * r, w * r)


def pixel_unshuffle(x: Tensor, downscale_factor: int) -> Tensor:
    """(..., C, H r, W r) -> (..., C r^2, H, W)."""
    r = int(downscale_factor)
    *lead, c, hr, wr = x.shape
    if hr % r or wr % r:
        raise ValueError(f"pixel_unshuffle: {hr}x{wr} is not divisible by {r}")
    n = len(lead)
    y = x.reshape(*lead, c, hr // r, r, wr // r, r)
    y = y.permute(*range(n), n, n + 2, n + 4, n + 1, n + 3)
    return y.reshape(*lead, c * r * r, hr // r, wr // r)


def pad(x: Tensor, pad: Sequence[int], mode: str = "constant", value: float = 0.0) -> Tensor:
    """PyTorch's F.pad: flat (last_before, last_after, ...) pairs; modes constant, reflect, replicate, circular
    (the non-constant ones gather host-computed positions along each padded axis)."""
    if mode == "constant":
        return x.pad(list(pad), value)
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise ValueError(f"pad {pad}: need an even count, at most two per axis")
    for i in range(len(pad) // 2):
        ax = x.ndim - 1 - i
        lo, hi = int(pad[2 * i]), int(pad[2 * i + 1])
        if lo == 0 and hi == 0:
            continue
        L = x.shape[ax]
        j = np.arange(-lo, L + hi)
        if mode == "reflect":
            if lo >= L or hi >= L:
                raise ValueError(f"reflect padding ({lo}, {hi}) must be smaller than the axis ({L})")
            j = np.abs(j)
            j = np.where(j >= L, 2 * (L - 1) - j, j)
        elif mode == "replicate":
            if L == 0:
                raise ValueError("replicate padding of an empty axis")
            j = np.clip(j, 0, L - 1)
        elif mode == "circular":
            if lo > L or hi > L:
                raise ValueError(f"circular padding ({lo}, {hi}) must be at most the axis ({L})")
            j = np.mod(j, L)
        else:
            raise ValueError(f"pad: unknown mode {mode!r}")
        x = x.take(Tensor(j.astype(np.int32)), ax)
    return x


__all__ = ["adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_max_pool1d", "adaptive_max_pool2d", "avg_pool1d",
           "avg_pool2d", "avg_pool3d", "conv", "conv1d", "conv2d", "conv3d", "conv_transpose", "conv_transpose1d",
           "conv_transpose2d", "interpolate", "max_pool1d", "max_pool2d", "max_pool3d", "pad", "pixel_shuffle",
           "pixel_unshuffle", "windows"]

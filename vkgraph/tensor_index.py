"""Indexing and sorting methods of Tensor (a mixin), composed of gathers, comparisons and reductions.

- `gather`/`take_along_dim` read through one flat gather; `scatter`, `scatter_add`, `scatter_reduce`, writes through
  integer-tensor indices and `index_put` compare each index with every position it may land on (work: indices x
  axis length), so they suit moderate sizes; where several indices hit one place, the last one wins (numpy's and
  PyTorch's CPU order).
- Boolean masks select through their nonzero positions, which are read back to the host (the result's shape
  depends on the data): one synchronisation, as in any library.
- `sort` ranks each element against every other along the axis (n^2 comparisons per row, all in one fused
  reduction) and is stable; NaN sorts as the largest value, as in PyTorch and numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .tensor import Tensor

_REDUCES = ("sum", "prod", "mean", "amax", "amin")


def _T():
    from .tensor import Tensor
    return Tensor


def _int_index(index: Any) -> Tensor:
    from .dtype import dtypes
    Tensor = _T()
    if not isinstance(index, Tensor):
        arr = np.asarray(index)
        if arr.dtype.kind not in "iu":
            raise IndexError(f"index arrays must be integers, not {arr.dtype}")
        return Tensor(arr.astype(np.int32))
    if not index.dtype.is_int:
        raise IndexError(f"index tensors must be integers, not {index.dtype}")
    return index.cast(dtypes.int32)


def _wrap(idx: Tensor, size: int) -> Tensor:
    return (idx < 0).where(idx + size, idx)


class TensorIndexing:
    __slots__ = ()

    # ---- reads -------------------------------------------------------------------------------------------------

    def gather(self: Tensor, dim: int, index: Any) -> Tensor:
        """PyTorch's gather: out[i][j][k] = self[index[i][j][k]][j][k] for dim 0 (index no larger than self
        outside dim)."""
        from .tensor import _axis
        index = _int_index(index)
        a = _axis(dim, self.ndim)
        if index.ndim != self.ndim or any(i > s for d, (i, s) in enumerate(zip(index.shape, self.shape, strict=True))
                                          if d != a):
            raise ValueError(f"gather: index of shape {index.shape} does not fit input {self.shape} at dim {a}")
        Tensor = _T()
        flat = None
        stride = 1
        for d in reversed(range(self.ndim)):
            coord = _wrap(index, self.shape[d]) if d == a else \
                Tensor.arange(index.shape[d]).reshape(*(index.shape[d] if k == d else 1 for k in range(self.ndim)))
            term = coord * stride if stride != 1 else coord
            flat = term if flat is None else flat + term
            stride *= self.shape[d]
        return self.reshape(-1).take(flat.expand(index.shape) if flat.shape != index.shape else flat, 0)

    def take_along_dim(self: Tensor, indices: Any, dim: int) -> Tensor:
        return self.gather(dim, indices)

    def index_select(self: Tensor, dim: int, index: Any) -> Tensor:
        index = _int_index(index)
        if index.ndim > 1:
            raise IndexError("index_select takes a 1-D index")
        return self.take(index, dim)

    def masked_fill(self: Tensor, mask: Tensor, value: Any) -> Tensor:
        from .tensor import _as_tensor
        v = _as_tensor(value, self).cast(self.dtype)
        return mask.bool().where(v, self)

    def masked_select(self: Tensor, mask: Any) -> Tensor:
        from .tensor import broadcast_shape
        m = mask if isinstance(mask, _T()) else _T()(np.asarray(mask, bool))
        shape = broadcast_shape(self.shape, m.shape)
        return self.expand(shape)[m.bool().expand(shape)]

    def nonzero(self: Tensor, as_tuple: bool = False) -> Tensor | tuple[Tensor, ...]:
        """Positions of non-zero elements (read back to the host: the count depends on the data)."""
        Tensor = _T()
        pos = np.nonzero(self.numpy())
        if as_tuple:
            return tuple(Tensor(p.astype(np.int32)) for p in pos)
        return Tensor(np.stack(pos, -1).astype(np.int32).reshape(-1, self.ndim))

    def one_hot(self: Tensor, num_classes: int = -1) -> Tensor:
        """(..., ) integer classes -> (..., num_classes) of 0/1 in the default integer dtype."""
        from .dtype import dtypes
        if not self.dtype.is_int:
            raise TypeError(f"one_hot takes integer classes, not {self.dtype}")
        n = int(self.max().item()) + 1 if num_classes < 0 else int(num_classes)
        return (self.unsqueeze(-1) == _T().arange(n).reshape(*(1,) * self.ndim, n)).cast(dtypes.default_int)

    # ---- writes (out of place) -----------------------------------------------------------------------------------

    def _hits(self: Tensor, dim: int, index: Tensor) -> tuple[int, Tensor]:
        """(axis, hit) with hit[..., i, l, ...] = index[..., i, ...] == l along a new axis after dim."""
        from .tensor import _axis
        a = _axis(dim, self.ndim)
        if index.ndim != self.ndim or any(i > s for d, (i, s) in enumerate(zip(index.shape, self.shape, strict=True))
                                          if d != a):
            raise ValueError(f"scatter: index of shape {index.shape} does not fit {self.shape} at dim {a}")
        L = self.shape[a]
        pos = _T().arange(L).reshape(*(1,) * (a + 1), L, *(1,) * (self.ndim - a - 1))
        return a, _wrap(index, L).unsqueeze(a + 1) == pos

    def _spread(self: Tensor, part: Tensor, a: int) -> Tensor:
        """Pad a result over index's extent (outside dim) to self's shape with zeros / False."""
        pads = [(0, 0) if d == a else (0, s - p) for d, (p, s) in enumerate(zip(part.shape, self.shape, strict=True))]
        return part.pad(pads) if any(p != (0, 0) for p in pads) else part

    def _src(self: Tensor, src: Any, index: Tensor) -> Tensor:
        Tensor = _T()
        if isinstance(src, Tensor):
            if src.ndim != index.ndim or any(i > s for i, s in zip(index.shape, src.shape, strict=True)):
                raise ValueError(f"scatter: src of shape {src.shape} is smaller than index {index.shape}")
            return src.cast(self.dtype).shrink([(0, i) for i in index.shape])
        return Tensor.full(index.shape, src, self.dtype)

    def scatter(self: Tensor, dim: int, index: Any, src: Any = None, value: Any = None, reduce: str | None = None
                ) -> Tensor:
        """PyTorch's scatter (out of place): self[index[i][j]][j] = src[i][j] for dim 0; reduce 'add' or
        'multiply' combines instead."""
        if reduce is not None:
            mode = {"add": "sum", "multiply": "prod"}.get(reduce)
            if mode is None:
                raise ValueError(f"scatter: reduce must be 'add' or 'multiply', not {reduce!r}")
            return self.scatter_reduce(dim, index, src if src is not None else value, mode)
        index = _int_index(index)
        s = self._src(src if src is not None else value, index)
        a, hit = self._hits(dim, index)
        if index.numel() == 0:
            return self
        n = index.shape[a]
        order = _T().arange(n).reshape(*(1,) * a, n, *(1,) * (self.ndim - a))
        last = hit.where(order, -1).max(a)  # the last index landing on each place
        chosen = hit.logical_and(order == last.unsqueeze(a))
        val = chosen.where(s.unsqueeze(a + 1), _T().full((), 0, self.dtype)).sum(a, dtype=self.dtype)
        return self._spread(last >= 0, a).where(self._spread(val, a), self)

    def scatter_add(self: Tensor, dim: int, index: Any, src: Tensor) -> Tensor:
        return self.scatter_reduce(dim, index, src, "sum")

    def scatter_reduce(self: Tensor, dim: int, index: Any, src: Any, reduce: str, include_self: bool = True
                       ) -> Tensor:
        """Combine src into self at index along dim with 'sum', 'prod', 'mean', 'amax' or 'amin'."""
        if reduce not in _REDUCES:
            raise ValueError(f"scatter_reduce: reduce must be one of {_REDUCES}, not {reduce!r}")
        from .dtype import max_value, min_value
        Tensor = _T()
        index = _int_index(index)
        a, hit = self._hits(dim, index)
        s = self._src(src, index).unsqueeze(a + 1)
        if index.numel() == 0:
            return self
        count = self._spread(hit.cast(self.dtype if self.dtype.is_float else "int32").sum(a), a)
        any_hit = count > 0
        if reduce in ("sum", "mean"):
            part = self._spread(hit.where(s, Tensor.full((), 0, self.dtype)).sum(a, dtype=self.dtype), a)
            if reduce == "sum":
                return self + part if include_self else any_hit.where(part, self)
            total = self + part if include_self else part
            n = count + 1 if include_self else count
            mean = total / n.maximum(1) if self.dtype.is_float else total // n.maximum(1)
            return any_hit.where(mean.cast(self.dtype), self)
        if reduce == "prod":
            part = self._spread(hit.where(s, Tensor.full((), 1, self.dtype)).prod(a, dtype=self.dtype), a)
            return any_hit.where(self * part if include_self else part, self)
        fill = min_value(self.dtype) if reduce == "amax" else max_value(self.dtype)
        masked = hit.where(s, Tensor.full((), fill, self.dtype))
        part = self._spread(masked.max(a) if reduce == "amax" else masked.min(a), a)
        if include_self:
            part = part.maximum(self) if reduce == "amax" else part.minimum(self)
        return any_hit.where(part, self)

    def index_put(self: Tensor, indices: Sequence[Any], values: Any, accumulate: bool = False) -> Tensor:
        """A copy of self with self[indices] = values (or += with accumulate), indices as in advanced indexing."""
        return self._write_indexed(tuple(indices), values, accumulate)

    # ---- advanced indexing (called by Tensor.__getitem__ and __setitem__) ---------------------------------------

    def _advanced_read(self: Tensor, idx: Any) -> Tensor:
        """self[idx] where idx holds several integer arrays and/or boolean masks (numpy's rules)."""
        from .tensor import _basic_index, broadcast_shape
        idx, together = _normalize_advanced(self, idx)
        x, tensor_dims = _basic_index(self, idx)
        if not tensor_dims:
            return x
        axes = [a for a, _ in tensor_dims]
        sizes = [x.shape[a] for a in axes]
        idxs = [_wrap(_int_index(t), s) for (_, t), s in zip(tensor_dims, sizes, strict=True)]
        bshape = broadcast_shape(*[t.shape for t in idxs])
        rest = [d for d in range(x.ndim) if d not in axes]
        moved = x.permute(axes + rest).reshape(math.prod(sizes), *[x.shape[d] for d in rest])
        flat = None
        stride = 1
        for t, s in zip(reversed(idxs), reversed(sizes), strict=True):
            term = t * stride if stride != 1 else t
            flat = term if flat is None else flat + term
            stride *= s
        out = moved.take(flat.expand(bshape) if flat.shape != bshape else flat, 0)  # bshape + rest
        if together and axes[0] > 0:  # numpy: adjacent advanced indices keep their place
            nb, first = len(bshape), axes[0]
            order = list(range(nb, nb + first)) + list(range(nb)) + list(range(nb + first, out.ndim))
            out = out.permute(order)
        return out

    def _write_indexed(self: Tensor, idx: Any, value: Any, accumulate: bool = False) -> Tensor:
        """A copy of self with the elements idx selects set to (or, accumulating, increased by) value."""
        from .tensor import _as_tensor
        Tensor = _T()
        n = self.numel()
        pos = Tensor.arange(n).reshape(self.shape)._advanced_read(idx)  # where each selected element lives
        v = _as_tensor(value, self).cast(self.dtype).expand(pos.shape).reshape(-1)
        p = pos.reshape(-1)
        r = p.shape[0]
        if r == 0:
            return self
        flat = self.reshape(-1)
        target = Tensor.arange(n).reshape(1, n)
        hit = p.reshape(r, 1) == target  # (r, n)
        if accumulate:
            add = hit.where(v.reshape(r, 1), Tensor.full((), 0, self.dtype)).sum(0, dtype=self.dtype)
            return (flat + add).reshape(self.shape)
        last = hit.where(Tensor.arange(r).reshape(r, 1), -1).max(0)
        return (last >= 0).where(v.take(last.maximum(0), 0), flat).reshape(self.shape)

    # ---- sorting ------------------------------------------------------------------------------------------------

    def sort(self: Tensor, dim: int = -1, descending: bool = False, stable: bool = True) -> tuple[Tensor, Tensor]:
        """(values, indices) along dim, stable; NaN is the largest value."""
        from .tensor import _axis
        if self.ndim == 0:
            return self, _T().full((), 0, "int32")
        a = _axis(dim, self.ndim)
        n = self.shape[a]
        Tensor = _T()
        if n == 0:
            return self, Tensor.full(self.shape, 0, "int32")
        x = self.float() if self.dtype.itemsize < 4 and self.dtype.is_float else self
        xi = x.unsqueeze(a + 1)  # element i at axis a (its rank is counted over j at axis a + 1)
        xj = x.unsqueeze(a)
        shape = list(x.shape[:a + 1]) + [n] + list(x.shape[a + 1:])
        if x.dtype.is_float:
            ni, nj = xi.isnan(), xj.isnan()
            if descending:
                first = (xj > xi).logical_or(nj.logical_and(ni.logical_not()))
            else:
                first = (xj < xi).logical_or(ni.logical_and(nj.logical_not()))
            same = (xj == xi).logical_or(ni.logical_and(nj))
        else:
            first = (xj > xi) if descending else (xj < xi)
            same = xj == xi
        i = Tensor.arange(n).reshape(*(1,) * a, n, 1, *(1,) * (x.ndim - a - 1))
        j = Tensor.arange(n).reshape(*(1,) * a, 1, n, *(1,) * (x.ndim - a - 1))
        before = first.logical_or(same.logical_and(j < i)).expand(tuple(shape))
        rank = before.sum(a + 1)  # int32: where element i goes
        # the element whose rank is k: indices[k] = sum over i of i * (rank_i == k)
        k = Tensor.arange(n).reshape(*(1,) * a, 1, n, *(1,) * (x.ndim - a - 1))
        idx = ((rank.unsqueeze(a + 1) == k).where(i, 0)).sum(a)
        return self.gather(a, idx), idx

    def argsort(self: Tensor, dim: int = -1, descending: bool = False, stable: bool = True) -> Tensor:
        return self.sort(dim, descending, stable)[1]

    def msort(self: Tensor) -> Tensor:
        return self.sort(0)[0]

    def topk(self: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
             ) -> tuple[Tensor, Tensor]:
        """The k largest (or smallest) along dim with their indices, in order; ties keep the earlier element."""
        from .tensor import _axis
        a = _axis(dim, self.ndim) if self.ndim else 0
        n = self.shape[a] if self.ndim else 1
        if not 0 <= k <= n:
            raise ValueError(f"topk: k={k} is out of range for a dimension of size {n}")
        vals, idx = self.sort(a, descending=largest)
        cut = [(0, k) if d == a else None for d in range(self.ndim)]
        return (vals.shrink(cut), idx.shrink(cut)) if self.ndim else (vals, idx)

    def kthvalue(self: Tensor, k: int, dim: int = -1, keepdim: bool = False) -> tuple[Tensor, Tensor]:
        """The k-th smallest (1-based) along dim and its index."""
        from .tensor import _axis
        a = _axis(dim, self.ndim) if self.ndim else 0
        n = self.shape[a] if self.ndim else 1
        if not 1 <= k <= n:
            raise ValueError(f"kthvalue: k={k} is out of range for a dimension of size {n}")
        vals, idx = self.sort(a)
        if not self.ndim:
            return vals, idx
        pick = [(k - 1, k) if d == a else None for d in range(self.ndim)]
        v, i = vals.shrink(pick), idx.shrink(pick)
        return (v, i) if keepdim else (v.squeeze(a), i.squeeze(a))

    def median(self: Tensor, dim: int | None = None, keepdim: bool = False) -> Any:
        """The lower median (PyTorch's): over everything (a value), or along dim ((values, indices)); NaN if the
        values hold one."""
        if dim is None:
            flat = self.reshape(-1)
            if flat.shape[0] == 0:
                raise ValueError("median of an empty tensor")
            v, _ = flat.kthvalue((flat.shape[0] + 1) // 2, 0)
            if self.dtype.is_float:
                v = flat.isnan().any().where(float("nan"), v)
            return v
        from .tensor import _axis
        a = _axis(dim, self.ndim) if self.ndim else 0
        n = self.shape[a] if self.ndim else 1
        v, i = self.kthvalue((n + 1) // 2, a, keepdim)
        if self.dtype.is_float and self.ndim:
            nan = self.isnan()
            has = nan.any(a, keepdim=keepdim)
            first_nan = nan.cast("int32").argmax(a, keepdim=keepdim)
            v = has.where(float("nan"), v)
            i = has.where(first_nan, i)
        return v, i


def needs_advanced(idx: Any) -> bool:
    """Whether an index holds a boolean mask, more than one integer array, or an integer array apart from an int
    (numpy then puts the array's axes first): what basic indexing and one take do not cover."""
    items = idx if type(idx) is tuple else (idx,)
    arrays, adv = 0, []
    for k, i in enumerate(items):
        if isinstance(i, (list, np.ndarray)) or hasattr(i, "node"):
            kind = np.asarray(i).dtype.kind if isinstance(i, list) else i.dtype.kind
            if kind == "b":
                return True
            arrays += 1
            adv.append(k)
        elif isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)):
            adv.append(k)
    return arrays > 1 or (arrays == 1 and adv[-1] - adv[0] + 1 != len(adv))


def _normalize_advanced(x: Tensor, idx: Any) -> tuple[tuple, bool]:
    """Boolean masks become their nonzero positions (one integer array per masked axis), lists become arrays;
    returns the index tuple and whether the advanced entries (integers and arrays) are adjacent."""
    Tensor = _T()
    idx = idx if isinstance(idx, tuple) else (idx,)
    out: list[Any] = []
    for i in idx:
        if isinstance(i, Tensor) and i.dtype.kind == "b" or isinstance(i, np.ndarray) and i.dtype == np.bool_ or \
                isinstance(i, list) and i and all(isinstance(v, (bool, np.bool_)) for v in np.ravel(i)):
            mask = i.numpy() if isinstance(i, Tensor) else np.asarray(i, bool)
            if mask.ndim == 0:
                raise IndexError("a 0-d boolean index is not supported")
            out.extend(p.astype(np.int32) for p in np.nonzero(mask))
        elif isinstance(i, list):
            out.append(np.asarray(i))
        else:
            out.append(i)
    kinds = [isinstance(i, (Tensor, np.ndarray, int, np.integer)) and not isinstance(i, (bool, np.bool_))
             for i in out]
    where = [k for k, v in enumerate(kinds) if v]
    together = not where or where[-1] - where[0] + 1 == len(where)
    return tuple(out), together

"""Views: how a logical shape maps onto a flat buffer, so movement ops never copy.

A `View` is (shape, strides, offset, mask): element ``c`` lives at ``offset + sum(c[i] * strides[i])`` and is
valid only where ``mask[i][0] <= c[i] < mask[i][1]`` for every i (invalid elements read as zero; pad makes
them). A `ShapeTracker` is a stack of views: ``views[-1]`` is what the user sees; each view indexes the
contiguous numbering of the shape of the view below it, and ``views[0]`` indexes the buffer. A movement op
first tries to merge into the top view; when it cannot (a reshape of a permuted or padded view, say) a new
contiguous view stacks on top, and codegen turns the stack into one index expression.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .caches import Memo

Shape = tuple[int, ...]
Mask = tuple[tuple[int, int], ...]


def prod(xs) -> int:
    return math.prod(xs)


def strides_for(shape: Shape) -> tuple[int, ...]:
    """Row-major strides; size-1 dimensions get stride 0 so that equal layouts compare equal."""
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc if s != 1 else 0)
        acc *= s
    return tuple(reversed(out))


def _canon_strides(shape: Shape, strides: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(0 if s == 1 else st for s, st in zip(shape, strides, strict=True))


@dataclass(frozen=True)
class View:
    shape: Shape
    strides: tuple[int, ...]
    offset: int = 0
    mask: Mask | None = None

    @staticmethod
    def contiguous(shape: Shape) -> View:
        return _contiguous_view(tuple(shape))

    @staticmethod
    def make(shape: Shape, strides: tuple[int, ...], offset: int = 0, mask: Mask | None = None) -> View:
        shape = tuple(int(s) for s in shape)
        strides = _canon_strides(shape, tuple(int(s) for s in strides))
        if mask is not None:
            mask = tuple((max(0, lo), min(s, hi)) for (lo, hi), s in zip(mask, shape, strict=True))
            if any(lo >= hi for lo, hi in mask):  # nothing is valid: every element reads zero
                mask = tuple((0, 0) for _ in shape)
                strides, offset = tuple(0 for _ in shape), 0
            elif all(lo == 0 and hi == s for (lo, hi), s in zip(mask, shape, strict=True)):
                mask = None
        return View(shape, strides, int(offset), mask)

    @property
    def is_contiguous(self) -> bool:
        return self.offset == 0 and self.mask is None and self.strides == strides_for(self.shape)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def permute(self, order: tuple[int, ...]) -> View:
        mask = tuple(self.mask[i] for i in order) if self.mask else None
        return View.make(tuple(self.shape[i] for i in order), tuple(self.strides[i] for i in order),
                         self.offset, mask)

    def expand(self, shape: Shape) -> View:
        strides = tuple(st if s == n else 0 for s, n, st in zip(self.shape, shape, self.strides, strict=True))
        mask = None
        if self.mask:
            mask = tuple(m if s == n else ((0, n) if m[1] > m[0] else (0, 0))
                         for m, s, n in zip(self.mask, self.shape, shape, strict=True))
        return View.make(shape, strides, self.offset, mask)

    def shrink(self, bounds: tuple[tuple[int, int], ...]) -> View:
        offset = self.offset + sum(b * st for (b, _), st in zip(bounds, self.strides, strict=True))
        mask = None
        if self.mask:
            mask = tuple((max(lo, b) - b, min(hi, e) - b) for (lo, hi), (b, e) in zip(self.mask, bounds, strict=True))
        return View.make(tuple(e - b for b, e in bounds), self.strides, offset, mask)

    def pad(self, pads: tuple[tuple[int, int], ...]) -> View:
        old = self.mask or tuple((0, s) for s in self.shape)
        mask = tuple((lo + p0, hi + p0) for (lo, hi), (p0, _) in zip(old, pads, strict=True))
        offset = self.offset - sum(p0 * st for (p0, _), st in zip(pads, self.strides, strict=True))
        shape = tuple(s + a + b for s, (a, b) in zip(self.shape, pads, strict=True))
        return View.make(shape, self.strides, offset, mask)

    def flip(self, axes: tuple[int, ...]) -> View:
        strides, offset, mask = list(self.strides), self.offset, list(self.mask) if self.mask else None
        for a in axes:
            offset += (self.shape[a] - 1) * strides[a]
            strides[a] = -strides[a]
            if mask:
                lo, hi = mask[a]
                mask[a] = (self.shape[a] - hi, self.shape[a] - lo)
        return View.make(self.shape, tuple(strides), offset, tuple(mask) if mask else None)

    def step(self, steps: tuple[int, ...]) -> View:
        """Every steps[i]-th element along each axis, starting at 0 (positive steps only)."""
        shape = tuple((s + k - 1) // k for s, k in zip(self.shape, steps, strict=True))
        strides = tuple(st * k for st, k in zip(self.strides, steps, strict=True))
        mask = None
        if self.mask:
            mask = tuple(((lo + k - 1) // k, (hi + k - 1) // k) for (lo, hi), k in zip(self.mask, steps, strict=True))
        return View.make(shape, strides, self.offset, mask)

    def reshape(self, shape: Shape) -> View | None:
        """The same elements under a new shape as one view, or None when that needs a stacked view."""
        if self.shape == shape:
            return self
        if 0 in self.shape or 0 in shape:
            return View.contiguous(shape)
        if self.is_contiguous:
            return View.contiguous(shape)
        old = [(s, st, m) for s, st, m in zip(self.shape, self.strides, self.mask or [None] * len(self.shape),
                                               strict=True) if s != 1]
        new = [s for s in shape if s != 1]
        if self.mask and any(m == (0, 0) for m in self.mask):
            if not shape:  # a 0-d view has no axis to hold "nothing valid": keep this view below a new one
                return None
            return View.make(shape, tuple(0 for _ in shape), 0, tuple((0, 0) for _ in shape))
        if [s for s, _, _ in old] == new:  # only size-1 axes come or go: carry strides and mask across
            it = iter(old)
            strides, mask = [], []
            for s in shape:
                if s == 1:
                    strides.append(0)
                    mask.append((0, 1))
                else:
                    _, st, m = next(it)
                    strides.append(st)
                    mask.append(m if m is not None else (0, s))
            return View.make(shape, tuple(strides), self.offset, tuple(mask) if self.mask else None)
        if self.mask:
            return None
        strides = _reshape_strides([s for s, _, _ in old], [st for _, st, _ in old], new)
        if strides is None:
            return None
        it = iter(strides)
        return View.make(shape, tuple(0 if s == 1 else next(it) for s in shape), self.offset)


def _reshape_strides(old: list[int], ostr: list[int], new: list[int]) -> list[int] | None:
    """Strides for `new` over the same memory as (old, ostr), all sizes > 1; None if impossible.

    Axes are grouped so that each group of old axes and new axes covers the same count; inside a group the
    old axes must be laid out as one run (stride[i] == stride[i+1] * size[i+1]).
    """
    out: list[int] = []
    i = j = 0
    while i < len(old) and j < len(new):
        oi, nj = i, j
        po, pn = old[i], new[j]
        while po != pn:
            if po < pn:
                i += 1
                po *= old[i]
            else:
                j += 1
                pn *= new[j]
        for k in range(oi, i):
            if ostr[k] != ostr[k + 1] * old[k + 1]:
                return None
        st = ostr[i]
        group = []
        for k in range(j, nj - 1, -1):
            group.append(st)
            st *= new[k]
        out.extend(reversed(group))
        i += 1
        j += 1
    return out


_MEMOS: list[Any] = []  # every movement's lru_cache, reported and cleared together (caches.Memo)


def _memo(move: Callable[[ShapeTracker, Any], ShapeTracker]) -> Callable[[ShapeTracker, Any], ShapeTracker]:
    """A movement remembered by (tracker, argument): trackers are immutable and equal ones move alike, and a
    program's graph repeats the same movements at every call. Unhashable arguments (lists) are not remembered."""
    cached = functools.lru_cache(maxsize=4096)(move)
    _MEMOS.append(cached)

    @functools.wraps(move)
    def moved(self: ShapeTracker, arg: Any) -> ShapeTracker:
        try:
            hash(arg)
        except TypeError:
            return move(self, arg)
        return cached(self, arg)

    return moved


@dataclass(frozen=True)
class ShapeTracker:
    views: tuple[View, ...]

    def __hash__(self) -> int:
        # remembered: schedule and lowering keys hash every tracker of a graph at each call, and the generated
        # hash recomputes each view's
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(self.views)
            object.__setattr__(self, "_hash", h)
        return h

    @staticmethod
    def contiguous(shape: Shape) -> ShapeTracker:
        return _contiguous_tracker(tuple(shape))

    @property
    def shape(self) -> Shape:
        return self.views[-1].shape

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def is_contiguous(self) -> bool:
        """Reads its source in order from the start: no offset, no mask, no reordering."""
        return len(self.views) == 1 and self.views[0].is_contiguous

    def _top(self, view: View) -> ShapeTracker:
        return ShapeTracker(self.views[:-1] + (view,))

    @_memo
    def reshape(self, shape: Shape) -> ShapeTracker:
        shape = tuple(int(s) for s in shape)
        if prod(shape) != self.numel:
            raise ValueError(f"cannot reshape {self.shape} ({self.numel} elements) to {shape}")
        merged = self.views[-1].reshape(shape)
        if merged is not None:
            return self._top(merged)
        return ShapeTracker(self.views + (View.contiguous(shape),))

    @_memo
    def permute(self, order: tuple[int, ...]) -> ShapeTracker:
        return self._top(self.views[-1].permute(order))

    @_memo
    def expand(self, shape: Shape) -> ShapeTracker:
        return self._top(self.views[-1].expand(tuple(shape)))

    @_memo
    def shrink(self, bounds: tuple[tuple[int, int], ...]) -> ShapeTracker:
        return self._top(self.views[-1].shrink(bounds))

    @_memo
    def pad(self, pads: tuple[tuple[int, int], ...]) -> ShapeTracker:
        return self._top(self.views[-1].pad(pads))

    @_memo
    def flip(self, axes: tuple[int, ...]) -> ShapeTracker:
        return self._top(self.views[-1].flip(axes))

    @_memo
    def step(self, steps: tuple[int, ...]) -> ShapeTracker:
        return self._top(self.views[-1].step(steps))

    def index(self, coords: tuple[int, ...]) -> tuple[int, bool]:
        """Buffer index and validity of one element, evaluated on the host (tests and small lookups)."""
        valid = True
        idx = 0
        for k, v in enumerate(reversed(self.views)):
            if v.mask is not None:
                valid = valid and all(lo <= c < hi for c, (lo, hi) in zip(coords, v.mask, strict=True))
            idx = v.offset + sum(c * st for c, st in zip(coords, v.strides, strict=True))
            if k + 1 < len(self.views):
                below = self.views[-2 - k].shape
                coords = tuple(int(c) for c in _unravel(idx, below))
        return idx, valid


def _unravel(idx: int, shape: Shape) -> list[int]:
    out = []
    for s in reversed(shape):
        out.append(idx % s if s else 0)
        idx = idx // s if s else 0
    return list(reversed(out))


# views are immutable, so the contiguous ones are shared (every movement op on a node that is not a view starts
# from one)
@functools.lru_cache(maxsize=4096)
def _contiguous_view(shape: Shape) -> View:
    return View(shape, strides_for(shape), 0, None)


@functools.lru_cache(maxsize=4096)
def _contiguous_tracker(shape: Shape) -> ShapeTracker:
    return ShapeTracker((_contiguous_view(shape),))


_MEMOS += [_contiguous_view, _contiguous_tracker]
MOVEMENTS = Memo("movements", _MEMOS)

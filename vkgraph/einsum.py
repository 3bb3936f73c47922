"""einsum: any valid equation (implicit or explicit output, ellipsis, repeated indices), as views and matmuls.

A repeated index inside one operand takes a diagonal (a strided view, no copy); an index that appears in one
operand only and not in the output is summed away first; then operands contract pairwise, left to right, each
pair as one batched `Tensor.matmul` over (shared kept, left only, shared summed, right only) index groups, so a
large contraction takes the tiled matmul path and a small one a fused reduction.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence

from .dtype import result_type
from .tensor import Tensor
from .view import ShapeTracker, View, strides_for


def _parse(equation: str, operands: Sequence[Tensor]) -> tuple[list[list[str]], list[str], dict[str, int]]:
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        raise ValueError(f"einsum: {len(terms)} operand terms for {len(operands)} operands")
    letters = set(eq) - set(",->.")
    if any(c not in string.ascii_letters for c in letters):
        raise ValueError(f"einsum: invalid subscripts in {equation!r}")
    spare = [c for c in string.ascii_letters if c not in letters]  # names for the axes under '...'
    ell_nd = 0
    parsed: list[list[str]] = []
    for term, op in zip(terms, operands, strict=True):
        if term.count("...") > 1 or term.replace("...", "").count("."):
            raise ValueError(f"einsum: bad ellipsis in {term!r}")
        named = len(term.replace("...", ""))
        if "..." in term:
            n = op.ndim - named
            if n < 0:
                raise ValueError(f"einsum: term {term!r} has more subscripts than operand dimensions {op.shape}")
            ell_nd = max(ell_nd, n)
        elif named != op.ndim:
            raise ValueError(f"einsum: term {term!r} does not match an operand of {op.ndim} dimensions")
    ell = spare[:ell_nd]
    for term, op in zip(terms, operands, strict=True):
        if "..." in term:
            a, b = term.split("...")
            n = op.ndim - len(a) - len(b)
            parsed.append(list(a) + ell[ell_nd - n:] + list(b))
        else:
            parsed.append(list(term))
    sizes: dict[str, int] = {}
    for labels, op in zip(parsed, operands, strict=True):
        for c, s in zip(labels, op.shape, strict=True):
            old = sizes.get(c)
            if old is not None and (old == 1 or s == 1):  # size-1 axes broadcast (as numpy and PyTorch)
                sizes[c] = max(old, s) if old and s else 0
            elif old is not None and old != s:
                raise ValueError(f"einsum: subscript {c!r} has sizes {old} and {s}")
            else:
                sizes[c] = s
    if arrow:
        if rhs.count("...") > 1 or rhs.replace("...", "").count("."):
            raise ValueError(f"einsum: bad output subscripts {rhs!r}")
        a, _, b = rhs.partition("...")
        out = list(a) + (ell if "..." in rhs else []) + list(b)
        if len(set(out)) != len(out) or any(c not in sizes for c in out):
            raise ValueError(f"einsum: bad output subscripts {rhs!r}")
    else:
        counts: dict[str, int] = {}
        for t in parsed:
            for c in t:
                counts[c] = counts.get(c, 0) + 1
        out = ell + sorted(c for c, k in counts.items() if k == 1 and c not in ell)
    return parsed, out, sizes


def _diagonal(x: Tensor, labels: list[str]) -> tuple[Tensor, list[str]]:
    """Collapse repeated labels into one axis: the diagonal as a strided view."""
    if len(set(labels)) == len(labels):
        return x, labels
    cs = strides_for(x.shape)
    keep: list[str] = []
    shape: list[int] = []
    strides: list[int] = []
    for c, s, st in zip(labels, x.shape, cs, strict=True):
        if c in keep:
            k = keep.index(c)
            if shape[k] != s:
                raise ValueError(f"einsum: repeated subscript {c!r} over axes of sizes {shape[k]} and {s}")
            strides[k] += st
        else:
            keep.append(c)
            shape.append(s)
            strides.append(st)
    v = View.make(tuple(shape), tuple(strides))
    return x._move(lambda t: ShapeTracker(t.views + (v,))), keep


def _sum_out(x: Tensor, labels: list[str], needed: set[str]) -> tuple[Tensor, list[str]]:
    axes = tuple(i for i, c in enumerate(labels) if c not in needed)
    if not axes:
        return x, labels
    return x.sum(axes), [c for c in labels if c in needed]


def _contract(a: Tensor, la: list[str], b: Tensor, lb: list[str], keep: set[str], sizes: dict[str, int]
              ) -> tuple[Tensor, list[str]]:
    batch = [c for c in la if c in lb and c in keep]
    summed = [c for c in la if c in lb and c not in keep]
    left = [c for c in la if c not in lb]
    right = [c for c in lb if c not in la]

    def arrange(x: Tensor, lx: list[str], groups: list[list[str]]) -> Tensor:
        order = [lx.index(c) for g in groups for c in g]
        x = x.permute(order) if order != list(range(len(order))) else x
        full = [sizes[c] for g in groups for c in g]
        x = x.expand(full) if tuple(full) != x.shape else x  # size-1 axes under '...' broadcast
        return x.reshape([math.prod(sizes[c] for c in g) for g in groups])

    am = arrange(a, la, [batch, left, summed])
    bm = arrange(b, lb, [batch, summed, right])
    out = am @ bm
    return out.reshape([sizes[c] for c in batch + left + right]), batch + left + right


def einsum(equation: str, *operands: Tensor | Sequence[Tensor]) -> Tensor:
    """numpy's and PyTorch's einsum."""
    ops = list(operands[0]) if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else list(operands)
    if not ops:
        raise ValueError("einsum needs at least one operand")
    parsed, out, sizes = _parse(equation, ops)
    d = result_type(*[o.dtype for o in ops])
    xs = []
    for x, labels in zip(ops, parsed, strict=True):
        x, labels = _diagonal(x.cast(d), labels)
        xs.append((x, labels))
    for k, (x, labels) in enumerate(xs):  # sum indices no one else needs
        others = set(out).union(*[set(l2) for j, (_, l2) in enumerate(xs) if j != k])
        xs[k] = _sum_out(x, labels, others)
    x, labels = xs[0]
    for k in range(1, len(xs)):
        y, ly = xs[k]
        later = set(out).union(*[set(l2) for _, l2 in xs[k + 1:]])
        x, labels = _contract(x, labels, y, ly, later, sizes)
    x, labels = _sum_out(x, labels, set(out))
    full = [sizes[c] for c in labels]
    if tuple(full) != x.shape:
        x = x.expand(full)
    order = [labels.index(c) for c in out]
    return x.permute(order) if order != list(range(len(order))) else x

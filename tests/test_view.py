"""Views and shape trackers against numpy, evaluated on the host; index simplification (no GPU needed)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vkgraph.codegen.symbolic import Var, ravel, unravel
from vkgraph.view import ShapeTracker, View


def evaluate(tracker: ShapeTracker, base: np.ndarray) -> np.ndarray:
    out = np.zeros(tracker.shape, base.dtype)
    for c in itertools.product(*[range(s) for s in tracker.shape]):
        i, valid = tracker.index(c)
        out[c] = base[i] if valid else 0
    return out


def _factor(n: int, draw) -> tuple[int, ...]:
    dims = []
    while n > 1 and len(dims) < 3:
        divs = [d for d in range(2, n + 1) if n % d == 0]
        d = draw(st.sampled_from(divs))
        dims.append(d)
        n //= d
    if n > 1:
        dims.append(n)
    dims.insert(draw(st.integers(0, len(dims))), 1) if draw(st.booleans()) else None
    return tuple(dims) or draw(st.sampled_from([(1,), ()]))  # one element: a scalar too


@st.composite
def movement_chains(draw):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    ops = []
    cur = shape
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["reshape", "permute", "expand", "shrink", "pad", "flip", "step"]))
        n = len(cur)
        if kind == "reshape":
            new = _factor(int(np.prod(cur)), draw)
            ops.append((kind, new))
            cur = new
        elif kind == "permute":
            order = tuple(draw(st.permutations(range(n))))
            ops.append((kind, order))
            cur = tuple(cur[i] for i in order)
        elif kind == "expand":
            new = tuple(draw(st.integers(1, 3)) if s == 1 else s for s in cur)
            ops.append((kind, new))
            cur = new
        elif kind == "shrink":
            b = []
            for s in cur:
                lo = draw(st.integers(0, s - 1))
                b.append((lo, draw(st.integers(lo + 1, s))))
            ops.append((kind, tuple(b)))
            cur = tuple(hi - lo for lo, hi in b)
        elif kind == "pad":
            p = tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in cur)
            ops.append((kind, p))
            cur = tuple(s + a + b for s, (a, b) in zip(cur, p, strict=True))
        elif kind == "flip":
            axes = tuple(i for i in range(n) if draw(st.booleans()))
            ops.append((kind, axes))
        else:
            steps = tuple(draw(st.integers(1, 3)) for _ in cur)
            ops.append((kind, steps))
            cur = tuple((s + k - 1) // k for s, k in zip(cur, steps, strict=True))
    return shape, ops


def apply_numpy(x: np.ndarray, kind: str, arg):
    if kind == "reshape":
        return x.reshape(arg)
    if kind == "permute":
        return x.transpose(arg)
    if kind == "expand":
        return np.broadcast_to(x, arg)
    if kind == "shrink":
        return x[tuple(slice(a, b) for a, b in arg)]
    if kind == "pad":
        return np.pad(x, arg) if arg else x  # numpy pads no 0-d array
    if kind == "flip":
        return np.flip(x, arg) if arg else x
    return x[tuple(slice(None, None, k) for k in arg)]


@settings(max_examples=300, deadline=None)
@given(movement_chains())
def test_movement_chains_match_numpy(chain):
    shape, ops = chain
    base = np.arange(1, int(np.prod(shape)) + 1)
    ref = base.reshape(shape)
    tracker = ShapeTracker.contiguous(shape)
    for kind, arg in ops:
        ref = apply_numpy(ref, kind, arg)
        tracker = getattr(tracker, kind)(arg)
        assert tracker.shape == ref.shape
    np.testing.assert_array_equal(evaluate(tracker, base), ref)


def test_views_merge_instead_of_stacking():
    t = ShapeTracker.contiguous((4, 6, 8)).permute((2, 0, 1)).shrink(((1, 7), (1, 4), (0, 6))).flip((0,))
    assert len(t.views) == 1
    assert len(t.reshape((6, 18)).views) == 1  # the last two axes are one run in memory
    assert len(ShapeTracker.contiguous((4, 6)).permute((1, 0)).reshape((24,)).views) == 2
    assert len(ShapeTracker.contiguous((2, 3)).expand((5, 2, 3)[1:]).reshape((6,)).views) == 1


def test_pad_then_reshape_keeps_mask_across_unit_axes():
    t = ShapeTracker.contiguous((3,)).pad(((1, 1),)).reshape((1, 5, 1))
    assert len(t.views) == 1 and t.views[0].mask == ((0, 1), (1, 4), (0, 1))


def test_a_padded_only_element_stays_padding_as_a_scalar():
    """Found by the long fuzz run: a (1,) view of padding only, reshaped to (), read the source's element 0.
    A 0-d view cannot hold "nothing valid", so the masked view stays below a new one."""
    t = ShapeTracker.contiguous((2,)).pad(((1, 2),)).shrink(((4, 5),)).reshape(())
    base = np.array([0.3, -0.7], np.float32)
    assert evaluate(t, base) == 0
    assert evaluate(ShapeTracker.contiguous((2,)).pad(((1, 2),)).shrink(((1, 2),)).reshape(()), base) == base[0]


def test_contiguous_detection():
    assert View.contiguous((3, 1, 4)).is_contiguous
    assert not ShapeTracker.contiguous((3, 4)).shrink(((1, 3), (0, 4))).is_contiguous
    with pytest.raises(ValueError, match="cannot reshape"):
        ShapeTracker.contiguous((3, 4)).reshape((5,))


@pytest.mark.parametrize("shape", [(7,), (2, 3, 4), (5, 1, 6), (1, 3), (3, 5, 2, 2)])
def test_unravel_then_ravel_is_the_identity(shape):
    n = int(np.prod(shape))
    gid = Var("gid", 0, n - 1)
    assert ravel(unravel(gid, shape), shape).render() == "gid"


def test_index_expressions_fold():
    x = Var("x", 0, 99)
    assert ((x * 4 + 3) // 4).render() == "x"
    assert ((x * 4 + 3) % 4).render() == "3"
    assert ((x % 10) // 10).render() == "0"
    assert ((x // 5) // 2).render() == "(x/10)"
    assert ((x % 6) % 3).render() == "(x%3)"
    assert (x * 0 + 7).render() == "7"


def test_remembered_movements_match_fresh_ones():
    tr = ShapeTracker.contiguous((4, 1)).expand((4, 6))
    again = ShapeTracker.contiguous((4, 1)).expand((4, 6))
    assert again == tr and hash(again) == hash(tr)
    assert tr.permute((1, 0)) is again.permute((1, 0))  # one remembered result for equal trackers
    assert tr.reshape([24]) == tr.reshape((24,))  # an unhashable argument is moved, not remembered
    with pytest.raises(ValueError):
        tr.reshape((5, 5))
    with pytest.raises(ValueError):
        tr.reshape((5, 5))  # errors are raised each time, never remembered

"""Run-time row counts: elementwise and row-reduction kernels take their outer extent (the rows) as a push
constant, so the same graph over a new number of rows runs the program compiled before.

Each test runs one graph over several row counts, checks every result against numpy, and counts shader
compiles (memory and disk cache hits included) and pipelines made after the first run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
from numerics import assert_close_to_terms

from vkgraph import realize
from vkgraph.runtime import get_device
from vkgraph.tensor import Tensor

rng = np.random.default_rng(11)
ROWS = (1, 3, 17, 64, 1000)


def data(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def compiles() -> tuple[int, int]:
    dev = get_device()
    s = dev.compiler.stats
    return s.misses + s.disk_hits + s.memory_hits, dev.pipelines.built


def softmax(a: np.ndarray) -> np.ndarray:
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def run_rows(fn: Callable[[Tensor], Tensor], ref: Callable[[np.ndarray], np.ndarray], width: int,
             rows: tuple[int, ...] = ROWS, **tol: float) -> list[tuple[int, int]]:
    """(compiles, pipelines) of each run of fn over data of (n, width) for n in rows, each checked against ref."""
    out = []
    for n in rows:
        a = data(n, width)
        c0 = compiles()
        got = fn(Tensor(a)).numpy()
        c1 = compiles()
        np.testing.assert_allclose(got, ref(a), **({"rtol": 1e-5, "atol": 1e-5} | tol))
        out.append((c1[0] - c0[0], c1[1] - c0[1]))
    return out


GRAPHS = {
    "elementwise": (lambda t: (t * 2.5 + 1.25).exp() * t - 3, lambda a: np.exp(a * 2.5 + 1.25) * a - 3),
    "scalar elementwise": (lambda t: (t * 1.5).half().float() + 0.5,
                           lambda a: (a * 1.5).astype(np.float16).astype(np.float32) + 0.5),
    "sum": (lambda t: (t * 2 + 1).sum(-1), lambda a: (a * 2 + 1).sum(-1)),
    "max": (lambda t: (t * 0.75 - 1).max(-1), lambda a: (a * 0.75 - 1).max(-1)),
    "mean keepdim": (lambda t: t.exp().mean(-1, keepdim=True) * 2, lambda a: np.exp(a).mean(-1, keepdims=True) * 2),
    "softmax": (lambda t: t.softmax(-1), softmax),
    "bias": (lambda t: t + Tensor(np.arange(328, dtype=np.float32)), lambda a: a + np.arange(328, dtype=np.float32)),
}


@pytest.mark.parametrize("name", list(GRAPHS))
def test_new_row_counts_compile_nothing(name: str):
    fn, ref = GRAPHS[name]
    counts = run_rows(fn, ref, 328, rtol=1e-4)
    assert counts[1:] == [(0, 0)] * (len(ROWS) - 1), counts


def test_row_reductions_over_a_middle_axis_and_argmax():
    a3 = data(5, 6, 200)
    for n in (5, 2, 9):
        a = data(n, 6, 200)
        c0 = compiles()
        t = Tensor(a)
        assert_close_to_terms(((t - 1) * t).sum(1).numpy(), ((a - 1) * a).sum(1), np.abs((a - 1) * a).sum(1), 1e-5)
        np.testing.assert_array_equal(t.argmax(-1).numpy(), a.argmax(-1))
        if n != 5:
            assert compiles()[0] == c0[0]
    del a3


def test_a_new_inner_size_compiles_anew_and_stays_right():
    first = run_rows(lambda t: (t * 3 + 2).sum(-1), lambda a: (a * 3 + 2).sum(-1), 77, rows=(4, 9), rtol=1e-4)
    second = run_rows(lambda t: (t * 3 + 2).sum(-1), lambda a: (a * 3 + 2).sum(-1), 78, rows=(4, 9), rtol=1e-4)
    assert first[1] == (0, 0) and second[1] == (0, 0)
    assert second[0][0] >= 1  # the row size is still compiled in


def test_one_row_then_broadcast_rows():
    """With one row a (1, w) operand walks the rows like the data; with more it is broadcast over them."""
    b = data(1, 96)
    for n in (1, 3, 1, 7):
        a = data(n, 96)
        # a fused multiply-add rounds once where numpy rounds twice
        np.testing.assert_allclose((Tensor(a) * Tensor(b) + 1).numpy(), a * b + 1, rtol=1e-6, atol=1e-7)
        assert_close_to_terms((Tensor(a) - Tensor(b).sum(-1, keepdim=True)).numpy(), a - b.sum(-1, keepdims=True),
                              np.abs(a) + np.abs(b).sum(-1, keepdims=True), 1e-5)


def test_fallbacks_stay_right():
    """Transposed inputs, pads and crops along the rows, and split reductions keep baked shapes."""
    for n in (1, 3, 17):
        a, wide = data(40, n), data(n, 40)
        np.testing.assert_allclose((Tensor(a).T * 2 + 1).numpy(), a.T * 2 + 1, rtol=1e-6)
        assert_close_to_terms(Tensor(a).T.sum(-1).numpy(), a.T.sum(-1), np.abs(a.T).sum(-1), 1e-5)
        np.testing.assert_allclose(Tensor(wide).pad(((1, 2), (0, 0))).numpy() * 3,
                                   np.pad(wide, ((1, 2), (0, 0))) * 3, rtol=1e-6)
        np.testing.assert_allclose((Tensor(wide)[1:] + Tensor(wide)[:-1]).numpy(), wide[1:] + wide[:-1], rtol=1e-6)
        assert_close_to_terms(Tensor(wide).pad(((0, 0), (3, 1))).sum(-1).numpy(), wide.sum(-1),
                              np.abs(wide).sum(-1), 1e-5)
    for n in (2, 3):
        long = data(n, 40_000)
        assert_close_to_terms(Tensor(long).sum(1).numpy(), long.sum(1), np.abs(long).sum(1), 1e-5)


def test_group_counts_fold_from_the_run_time_rows(monkeypatch: pytest.MonkeyPatch):
    """More rows than one dispatch dimension holds: the launch folds into y from the row count of the run.

    The x limit is lowered to 1000 groups (lavapipe's is 65535, NVIDIA's 2^31 - 1, which no test can fill)."""
    dev = get_device()
    small = dataclasses.replace(realize.limits(), max_group_count=(1000, 65535, 65535))
    monkeypatch.setitem(realize._limits, dev, small)
    counts = run_rows(lambda t: (t + 0.5).sum(-1), lambda a: (a + 0.5).sum(-1), 128, rows=(5, 1007, 2400),
                      rtol=1e-4, atol=1e-4)
    assert counts[1] == (0, 0) and counts[2] == (0, 0)

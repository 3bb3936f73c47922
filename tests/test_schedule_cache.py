"""The schedule cache: a graph whose structure was scheduled before reuses its kernels with its own buffers.

Each test runs a structure twice (or more) and checks both the values against numpy and that the second run
was a cache hit, so a cache that returned a wrong schedule, or bound the wrong buffers, fails here."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from numerics import assert_close_to_terms

import vkgraph
import vkgraph.realize as realize_mod
from vkgraph import Variable
from vkgraph.runtime import get_device
from vkgraph.tensor import Tensor, custom, realize_all

rng = np.random.default_rng(7)


def data(*shape):
    return rng.standard_normal(shape).astype(np.float32)


class Hits:
    """Plans reused and made in a block (vkgraph.stats()'s "plans" cache)."""

    def __enter__(self):
        s = vkgraph.stats()["caches"]["plans"]
        self.h0, self.m0 = s["hits"], s["misses"]
        return self

    def __exit__(self, *exc):
        s = vkgraph.stats()["caches"]["plans"]
        self.hits = s["hits"] - self.h0
        self.misses = s["misses"] - self.m0


def f(x, w, b):
    return ((x @ w + b).relu() * 2).softmax(-1) + x.sum(-1, keepdim=True)


def ref_f(x, w, b):
    h = np.maximum(x @ w + b, 0) * 2
    e = np.exp(h - h.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True) + x.sum(-1, keepdims=True)


def test_same_structure_new_buffers_hits_and_computes_each():
    w, b = data(16, 16), data(16)
    tw, tb = Tensor(w), Tensor(b)
    xs = [data(8, 16) for _ in range(4)]
    f(Tensor(xs[0]), tw, tb).numpy()
    with Hits() as h:
        outs = [f(Tensor(x), tw, tb).numpy() for x in xs]
    assert h.hits == 4 and h.misses == 0
    for x, out in zip(xs, outs, strict=True):
        np.testing.assert_allclose(out, ref_f(x, w, b), rtol=1e-4, atol=1e-5)
    # other weights, same structure
    w2 = data(16, 16)
    with Hits() as h:
        out = f(Tensor(xs[1]), Tensor(w2), tb).numpy()
    assert h.hits == 1
    np.testing.assert_allclose(out, ref_f(xs[1], w2, b), rtol=1e-4, atol=1e-5)


def test_outputs_are_fresh_buffers_each_run():
    x = Tensor(data(32))
    a = (x * 3 + 1).realize()
    b = (x * 3 + 1 + 0 * x).realize()  # another structure, so a is not reused as realized
    y = Tensor(data(32))
    c = (y * 3 + 1).realize()
    assert a.node.arg[0] is not c.node.arg[0]
    np.testing.assert_allclose(a.numpy(), x.numpy() * 3 + 1, rtol=1e-6)
    np.testing.assert_allclose(b.numpy(), x.numpy() * 3 + 1, rtol=1e-6)
    np.testing.assert_allclose(c.numpy(), y.numpy() * 3 + 1, rtol=1e-6)


def test_new_constants_views_and_shapes_use_their_own_values():
    x = data(10, 12)
    t = Tensor(x)
    for k in (2.0, 3.0, -1.5):
        # atol: drivers may contract x*k+1 into one fused multiply-add, exact where numpy rounds twice
        np.testing.assert_allclose((t * k + 1).numpy(), x * k + 1, rtol=1e-6, atol=1e-6)
    for s in range(4):  # the slice's offset differs: a push constant or a baked index, never the old one
        np.testing.assert_allclose((t[s:s + 3, 1:5] * 2).numpy(), x[s:s + 3, 1:5] * 2, rtol=1e-6)
        np.testing.assert_allclose((t.T[s:s + 2] + 1).numpy(), x.T[s:s + 2] + 1, rtol=1e-6)
    for n in (5, 6, 7):
        y = data(n, 3)
        assert_close_to_terms(Tensor(y).sum(0).numpy(), y.sum(0), np.abs(y).sum(0), 1e-5)


def test_aliased_inputs_are_told_apart():
    a, b = data(64), data(64)
    ta, tb = Tensor(a), Tensor(b)
    np.testing.assert_allclose((ta * 2 + tb).numpy(), a * 2 + b, rtol=1e-6)
    np.testing.assert_allclose((ta * 2 + ta).numpy(), a * 3, rtol=1e-6)
    np.testing.assert_allclose((tb * 2 + ta).numpy(), b * 2 + a, rtol=1e-6)
    np.testing.assert_allclose((tb * 2 + tb).numpy(), b * 3, rtol=1e-6)


def test_in_place_writes_between_runs():
    x = data(6, 8)
    t = Tensor(x.copy())
    np.testing.assert_allclose((t * 2).numpy(), x * 2, rtol=1e-6)
    for i in range(3):
        t[i] = Tensor(np.full(8, i + 10, np.float32))  # the same setitem structure each time
        x[i] = i + 10
        np.testing.assert_allclose((t * 2).numpy(), x * 2, rtol=1e-6)
        np.testing.assert_allclose(t.numpy(), x, rtol=1e-6)
    # x[a] = f(x[b]) goes through a copy, also when the schedule is reused
    for _ in range(2):
        t[1:4] = t[0:3] + 1
        x[1:4] = x[0:3] + 1
        np.testing.assert_allclose(t.numpy(), x, rtol=1e-6)


def test_stale_lazy_graph_still_raises_on_a_cached_structure():
    t = Tensor(data(8))
    (t + 1).numpy()
    lazy = t + 1
    t[0] = 5.0
    with pytest.raises(RuntimeError, match="written in place"):
        lazy.realize()
    np.testing.assert_allclose((t + 1).numpy()[0], 6.0)


def test_realized_nodes_are_reused_and_not_recomputed():
    x = Tensor(data(4, 300))
    for _ in range(2):
        y = x.exp().sum(1, keepdim=True)
        y.realize()
        z = x.exp().sum(1, keepdim=True) + 1  # loads y's buffer
        with realize_mod.count_kernels() as c:
            z.realize()
        assert c.count == 1
        np.testing.assert_allclose(z.numpy(), np.exp(x.numpy()).sum(1, keepdims=True) + 1, rtol=1e-5)


def test_realized_entries_go_with_their_buffer_and_ignore_writes():
    """An entry lives as long as its buffer (the table does not keep one for a dropped tensor); an equal node
    built later finds it; a buffer written in place since is not taken for the node's value."""
    x, w = Tensor(data(3, 50)), Tensor(data(3, 50))
    table = realize_mod.REALIZED._map
    gc.collect()
    before = len(table)
    y = (x * w).realize()
    assert len(table) == before + 1 and realize_mod.REALIZED.get((x * w).node) is y.node.arg[0]
    (x * w - 1).realize()  # dropped at once
    assert len(table) == before + 1
    y[0] = 7.0  # written in place: the entry is stale
    assert realize_mod.REALIZED.get((x * w).node) is None
    np.testing.assert_allclose((x * w + 0.5).numpy(), x.numpy() * w.numpy() + 0.5, rtol=1e-6)
    del y
    gc.collect()
    assert len(table) == before


def test_rng_counters_move_on_under_the_cache():
    a = Tensor.rand(1000).numpy()
    b = Tensor.rand(1000).numpy()
    c = Tensor.rand(1000).numpy()
    assert not np.array_equal(a, b) and not np.array_equal(b, c)


def test_variables_are_read_at_each_run():
    pos = Variable("pos", 1)
    x = data(16)
    for p in (1, 5, -3, 5):
        pos.value = p
        np.testing.assert_allclose((Tensor(x) * 2 + pos).numpy(), x * 2 + p, rtol=1e-6)


ADD = """#version 450
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) writeonly buffer Out { float o[]; };
layout(set = 0, binding = 1) readonly buffer X { float x[]; };
layout(push_constant) uniform Push { uint n; float k; } pc;
void main() { uint i = gl_GlobalInvocationID.x; if (i < pc.n) o[i] = x[i] + pc.k; }
"""


def add_k(x: Tensor, k: float) -> Tensor:
    n = x.numel()

    def run(dev, out, ins):
        dev.dispatch(dev.pipeline(ADD), [out, ins[0]], ((n + 63) // 64, 1, 1), (n, k))

    return custom(run, [x], x.shape, x.dtype, name="add_k")


def test_custom_ops_call_their_own_function_on_a_reused_schedule():
    x = data(100)
    with Hits() as h:
        for k in (1.0, 2.0, 7.0):  # a new closure each time: the same structure, another computation
            np.testing.assert_allclose((add_k(Tensor(x) * 2, k) * 3).numpy(), (x * 2 + k) * 3, rtol=1e-6)
    assert h.hits >= 2


def test_assign_reuses_its_schedule_and_bumps_versions():
    x = np.zeros((4, 5), np.float32)
    t = Tensor(x.copy())
    t[0] = Tensor(np.arange(5, dtype=np.float32))
    x[0] = np.arange(5)
    v = t.node.arg[0].version
    with Hits() as h:
        for i in range(1, 4):
            t[i] = t[i - 1] * 2  # one structure over the same buffer, another view each time
            x[i] = x[i - 1] * 2
    assert t.node.arg[0].version == v + 3
    np.testing.assert_allclose(t.numpy(), x, rtol=1e-6)
    assert h.misses <= 3


def test_intermediates_are_released_on_reused_schedules():
    dev = get_device()
    w, b = Tensor(data(16, 16)), Tensor(data(16))
    x = Tensor(data(8, 16))
    realize_all(f(x, w, b))
    dev.synchronize()
    gc.collect()
    live = dev.memory.pool.stats.live_bytes
    outs = []
    for _ in range(5):
        outs.append(f(x, w, b).realize())
    del outs
    dev.synchronize()
    gc.collect()
    assert dev.memory.pool.stats.live_bytes <= live


def test_several_targets_and_shared_subgraphs():
    x = data(5, 7)
    for _ in range(2):
        t = Tensor(x)
        h = (t * 2).exp()
        a, b = h.sum(1), h.max(0)
        realize_all(a, b, h)
        np.testing.assert_allclose(a.numpy(), np.exp(x * 2).sum(1), rtol=1e-5)
        np.testing.assert_allclose(b.numpy(), np.exp(x * 2).max(0), rtol=1e-5)
        np.testing.assert_allclose(h.numpy(), np.exp(x * 2), rtol=1e-5)


def test_one_buffer_under_two_nodes_is_one_slot():
    """A realized reshape shares its source's buffer: the same structure over one buffer or two is told apart."""
    a, b = data(64), data(64)
    ta, tb = Tensor(a), Tensor(b)
    ra = ta.reshape(8, 8).realize()  # another node, the same buffer as ta
    rb = tb.reshape(8, 8).realize()
    assert ra.node.arg[0] is ta.node.arg[0]
    for m, n, want in [(ra, ta, a * 2 + a), (rb, ta, b * 2 + a), (ra, ta, a * 2 + a), (rb, tb, b * 3)]:
        np.testing.assert_allclose((m.reshape(64) * 2 + n).numpy(), want, rtol=1e-6)


class Compiles:
    """Shader compiles (SPIR-V from GLSL, memory and disk cache hits included) and pipelines made in a block."""

    def __enter__(self):
        dev = get_device()
        s = dev.compiler.stats
        self.c0, self.p0 = s.misses + s.disk_hits + s.memory_hits, dev.pipelines.built
        return self

    def __exit__(self, *exc):
        dev = get_device()
        s = dev.compiler.stats
        self.compiles = s.misses + s.disk_hits + s.memory_hits - self.c0
        self.pipelines = dev.pipelines.built - self.p0


def test_new_float_constants_reuse_the_compiled_kernels():
    """Float constants are push constants: a new value neither compiles nor schedules anew."""
    x, w, long = data(16, 300), data(300, 64), data(2, 40_000)
    t, tw, tl = Tensor(x), Tensor(w), Tensor(long)

    def graphs(k: float):
        return [t * k + (k + 1),  # elementwise
                ((t * k).exp() * (2 * k)).sum(1),  # reduction with a producer and an epilogue
                # fused reductions walking the row again; the max's factor stays below 1 in size, since x - m * 3e5
                # loses its low bits and a fused multiply-add loses different ones than numpy
                (t - t.max(1, keepdim=True) * (k / (1 + abs(k)))).softmax(-1),
                ((t @ tw) * k).relu() + 0.25 * k,  # matmul epilogue
                (tl * k).sum(1) * (3 * k)]  # a split reduction: a constant in each of its two programs

    def refs(k: float):
        k32 = np.float32(k)
        return [x * k32 + np.float32(k + 1), np.exp(x * k32).sum(1) * np.float32(2 * k),
                _softmax(x - x.max(1, keepdims=True) * np.float32(k / (1 + abs(k)))),
                np.maximum((x @ w) * k32, 0) + np.float32(0.25 * k),
                (long * k32).sum(1) * np.float32(3 * k)]

    for out in graphs(0.37):
        out.realize()
    for k in (0.38, -1.7, 3e5, 1e-3):
        with Hits() as h, Compiles() as c:
            outs = [o.numpy() for o in graphs(k)]
        assert (h.misses, c.compiles, c.pipelines) == (0, 0, 0), (k, h.misses, c.compiles, c.pipelines)
        for got, want in zip(outs, refs(k), strict=True):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-4 * max(1.0, np.abs(want).max()))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_new_rng_counters_reuse_the_compiled_kernels():
    from vkgraph.tensor import manual_seed

    manual_seed(3)
    first = [Tensor.rand(4, 300).numpy(), (Tensor.randn(1000) * 2).numpy()]
    with Hits() as h, Compiles() as c:
        later = [[Tensor.rand(4, 300).numpy(), (Tensor.randn(1000) * 2).numpy()] for _ in range(5)]
    assert (h.misses, c.compiles, c.pipelines) == (0, 0, 0), (h.misses, c.compiles, c.pipelines)
    draws = [first[0]] + [r for r, _ in later]
    assert all(not np.array_equal(a, b) for i, a in enumerate(draws) for b in draws[:i])
    assert all(0 <= r.min() and r.max() < 1 and abs(r.mean() - 0.5) < 0.05 for r in draws)
    manual_seed(3)  # the same seed gives the same numbers on the reused kernels
    np.testing.assert_array_equal(Tensor.rand(4, 300).numpy(), first[0])
    np.testing.assert_array_equal((Tensor.randn(1000) * 2).numpy(), first[1])


def test_new_variables_reuse_the_schedule():
    x = data(32)
    (Tensor(x) * 2 + Variable("pos", 0)).numpy()
    with Hits() as h, Compiles() as c:
        for p in (4, -9):
            np.testing.assert_allclose((Tensor(x) * 2 + Variable("pos", p)).numpy(), x * 2 + p, rtol=1e-6)
    assert (h.misses, c.compiles) == (0, 0)


def test_special_float_constants_stay_literals():
    """0, -0, inf, NaN and subnormal constants are compiled in (the compiler folds them its own way, the same in
    every kernel); the results are numpy's for finite inputs."""
    from vkgraph.codegen import lower
    from vkgraph.schedule import create_schedule

    x = data(50)
    t = Tensor(x)

    def src(out: Tensor) -> str:
        return lower(create_schedule([out.node], realize_mod.REALIZED).items[0], realize_mod.limits()).programs[0].src

    for k in (0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40):
        with np.errstate(all="ignore"):
            want = x + np.float32(k) if k == 1e-40 else x * np.float32(k)  # x + 1e-40 is x, flushed or not
        out = t + k if k == 1e-40 else t * k
        assert "pc.f" not in src(out), k
        np.testing.assert_array_equal(out.numpy(), want)
    assert "pc.f" in src(t * 0.5)


def test_float_constants_past_the_push_budget_are_literals_and_still_right():
    """A kernel with more float constants than push-constant room compiles the rest in: a new value there makes
    a new schedule (never the old value), a new value among the pushed ones does not."""
    from vkgraph.codegen import lower
    from vkgraph.codegen.render import MAX_PUSH_FLOATS, PUSH_BYTES
    from vkgraph.schedule import create_schedule

    x = data(40)
    t = Tensor(x)
    n = MAX_PUSH_FLOATS + 4

    def g(ks):
        out = t * ks[0]
        for k in ks[1:]:
            out = (out + k) * 1.5
        return out

    def ref(ks):
        out = x * np.float32(ks[0])
        for k in ks[1:]:
            out = (out + np.float32(k)) * np.float32(1.5)
        return out

    base = [0.1 * (i + 1) for i in range(n)]
    prog = lower(create_schedule([g(base).node], realize_mod.REALIZED).items[0], realize_mod.limits()).programs[0]
    assert 0 < sum(name.startswith("f") for name in prog.push) <= MAX_PUSH_FLOATS
    assert 4 * len(prog.push) <= PUSH_BYTES
    np.testing.assert_allclose(g(base).numpy(), ref(base), rtol=1e-5)
    misses = 0
    for i in range(n):  # one constant changed at a time: pushed or compiled in, the value used is the new one
        ks = list(base)
        ks[i] = -ks[i] * 3
        with Hits() as h:
            np.testing.assert_allclose(g(ks).numpy(), ref(ks), rtol=1e-5, err_msg=str(i))
        misses += h.misses
    assert 0 < misses < n  # both kinds were changed


def test_realizing_a_custom_output_early_changes_no_kernel():
    """ends_kernel: a realized tensor or a template's output sits in a buffer in any schedule, so realizing it
    first (and its readers after) runs the kernels of one graph with the same values; a lazy result does not."""
    from vkgraph.realize import count_kernels

    x = data(100)
    t = Tensor(x)
    assert t.ends_kernel() and not (t * 2).ends_kernel() and not (t * 2).reshape(10, 10).ends_kernel()
    runs = []
    for early in (False, True):
        y = add_k(Tensor(x) * 2, 1.5)
        assert y.ends_kernel()
        with count_kernels() as c:
            if early:
                y.realize()
            runs.append(((y * 3 + 1).exp().numpy(), sorted(c.names)))
    assert np.array_equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]

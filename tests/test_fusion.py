"""Fusion asserted by counting kernels, plus the scheduler's reuse, lifetimes and the renderer's stability."""

from __future__ import annotations

import re

import numpy as np
import pytest
from numerics import assert_close_to_terms

import vkgraph.realize as realize_mod
from vkgraph.codegen import Limits, lower
from vkgraph.schedule import create_schedule
from vkgraph.tensor import Tensor, realize_all

rng = np.random.default_rng(1)


def kernels(*tensors: Tensor) -> int:
    with realize_mod.count_kernels() as c:
        realize_all(*tensors)
    return c.count


def data(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_elementwise_chain_into_a_reduction_is_one_kernel():
    a, b, c, d = (Tensor(data(64, 300)) for _ in range(4))
    out = ((a * b + c).exp() * d).sum(axis=1)
    assert kernels(out) == 1
    an, bn, cn, dn = (t.numpy() for t in (a, b, c, d))
    terms = np.abs(np.exp(an * bn + cn) * dn)
    assert_close_to_terms(out.numpy(), (np.exp(an * bn + cn) * dn).sum(1), terms.sum(1), 2e-5)


def test_ten_elementwise_ops_are_one_kernel():
    x = Tensor(data(1000))
    y = x
    for k in range(10):
        y = (y * 0.9 + k).tanh() if k % 2 else y.abs() + 0.1
    assert kernels(y) == 1


@pytest.mark.parametrize("shape,axis", [((37, 500), -1), ((8, 3000), 1), ((600, 9), 0)])
def test_softmax_and_layer_norm_are_single_kernels(shape, axis):
    x = Tensor(data(*shape))
    assert kernels(x.softmax(axis)) <= 2
    assert kernels(x.layer_norm()) == 1


def test_matmul_with_epilogue_is_one_kernel():
    a, b, bias = Tensor(data(128, 96)), Tensor(data(96, 80)), Tensor(data(80))
    assert kernels((a @ b + bias).relu()) == 1


def test_reduce_broadcast_to_another_shape_is_a_boundary():
    x, z = data(4, 8), data(5, 8)
    out = Tensor(x).sum(0, keepdim=True).expand(5, 8) + Tensor(z)
    assert kernels(out) == 2
    assert_close_to_terms(out.numpy(), x.sum(0) + z, np.abs(x).sum(0) + np.abs(z), 1e-5)
    twice = Tensor(x).sum(1).sum(0)
    assert kernels(twice) == 2
    assert_close_to_terms(twice.numpy(), x.sum(), np.abs(x).sum(), 1e-5)
    perm = Tensor(data(6, 7, 8)).sum(2).T + 1
    assert kernels(perm) == 2


def test_one_reduction_feeding_two_outputs_is_computed_once():
    x = Tensor(data(16, 50))
    s = x.sum(1)
    assert kernels(s * 2, s + 1) == 3
    assert kernels((x - x.max(1, keepdim=True)).exp(), (x + 1).max(1)) == 2


def test_realized_tensors_are_reused_and_dead_nodes_dropped():
    x = Tensor(data(300))
    y = x.exp()
    _unused = (x * 2).sin()
    assert kernels(y) == 1
    z = x.exp() + 1  # x.exp() is the same node, already in a buffer
    sched = create_schedule([z.node], realize_mod.REALIZED)
    assert len(sched.items) == 1
    assert "exp" not in lower(sched.items[0], realize_mod.limits()).programs[0].src


def test_common_subexpressions_are_shared():
    a, b = Tensor(data(100)), Tensor(data(100))
    out = (a + b) * (a + b)
    assert (a + b).node is (a + b).node
    sched = create_schedule([out.node], realize_mod.REALIZED)
    src = lower(sched.items[0], realize_mod.limits()).programs[0].src
    lanes = 4 if "vec4" in src else 1  # a vec4 kernel computes each of its 4 elements once
    assert len(re.findall(r"= \(\S+ \+ \S+\)", src)) == lanes


def test_intermediates_are_released_after_their_last_reader():
    x = Tensor(data(6, 7, 8))
    out = x.sum(2).T.exp() * 2
    sched = create_schedule([out.node], realize_mod.REALIZED)
    assert len(sched.items) == 2 and len(sched.frees[1]) == 1 and not sched.frees[0]
    realize_mod.run(sched)
    assert sched.frees[1][0].buf is None


def test_same_graph_renders_the_same_glsl_and_offsets_are_push_constants():
    x = Tensor(data(10, 16)).realize()
    srcs = set()
    for start in (0, 1, 3):
        sched = create_schedule([(x[start + 1:start + 3] * 2).node], realize_mod.REALIZED)
        srcs.add(lower(sched.items[0], realize_mod.limits()).programs[0].src)
    assert len(srcs) == 1


def test_dispatch_counts_over_the_limit_fold_into_y_and_z(monkeypatch):
    monkeypatch.setattr(realize_mod, "limits", lambda: Limits(max_invocations=64, max_group_count=(3, 3, 65535),
                                                       max_shared=16384))
    x = data(64 * 20 + 5)
    np.testing.assert_allclose((Tensor(x) * 3).numpy(), x * 3, rtol=1e-6)
    m = data(50, 11)
    assert_close_to_terms(Tensor(m).sum(1).numpy(), m.sum(1), np.abs(m).sum(1), 1e-5)  # sums near 0 cancel
    a, b = data(130, 70), data(70, 200)
    np.testing.assert_allclose((Tensor(a) @ Tensor(b)).numpy(), a @ b, rtol=1e-4, atol=1e-4)


def test_debug_flag_prints_schedule_and_glsl(monkeypatch, capsys):
    monkeypatch.setenv("VKGRAPH_DEBUG", "1")
    (Tensor(data(9)) + 1).realize()
    out = capsys.readouterr().out
    assert "schedule: 1 item" in out and "#version" not in out
    monkeypatch.setenv("VKGRAPH_DEBUG", "3")
    (Tensor(data(9)) * 5).realize()
    assert "#version 450" in capsys.readouterr().out


def test_buffers_over_the_binding_range_are_bound_in_pieces(monkeypatch):
    monkeypatch.setattr(realize_mod, "limits", lambda: Limits(max_invocations=256, max_group_count=(65535,) * 3,
                                                       max_shared=16384, max_storage_range=1024))
    x, y = data(40, 33), data(33, 70)
    np.testing.assert_allclose((Tensor(x) * 2 + 1).numpy(), x * 2 + 1, rtol=1e-6)
    assert_close_to_terms(Tensor(x).sum(0).numpy(), x.sum(0), np.abs(x).sum(0), 1e-5)
    np.testing.assert_allclose(Tensor(x).T[3:7].numpy(), x.T[3:7])
    np.testing.assert_allclose((Tensor(x) @ Tensor(y)).numpy(), x @ y, rtol=1e-4, atol=1e-4)
    t = Tensor(x.copy())
    t[30:, 1] = 5.0
    want = x.copy()
    want[30:, 1] = 5.0
    np.testing.assert_allclose(t.numpy(), want)
    np.testing.assert_allclose(Tensor(x.astype(np.float16))[[39, 0, 20]].numpy(), x.astype(np.float16)[[39, 0, 20]])


def test_compiled_kernels_do_not_keep_buffers_alive():
    import gc
    import weakref
    x = Tensor(data(64, 64)).realize()
    out = (x @ x).realize()
    ref = weakref.ref(out.node.arg[0])
    del out
    gc.collect()
    assert ref() is None
    with realize_mod.count_kernels() as c:
        (x @ x).realize()
    assert c.count == 1


def test_reduction_over_a_matmul_epilogue_schedules_in_one_pass():
    """A reduction whose input holds a matmul: the matmul is cut out and the reduction is its own kernel
    (this once made the scheduler loop forever)."""
    import numpy as np

    from vkgraph.realize import count_kernels
    from vkgraph.tensor import Tensor

    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 16)).astype(np.float32)
    b = rng.standard_normal((16, 40)).astype(np.float32)
    with count_kernels() as c:
        got = ((Tensor(a) @ Tensor(b)) * 2 + 1).argmax(-1).numpy()
    np.testing.assert_array_equal(got, (a @ b * 2 + 1).argmax(-1))
    assert c.count == 2


def test_kernels_never_bind_more_buffers_than_the_device_allows():
    """A sum of many realized tensors is cut into kernels that each read at most half the device's bindings."""
    import numpy as np

    from vkgraph.realize import _max_inputs, count_kernels
    from vkgraph.tensor import Tensor

    n = 3 * _max_inputs() + 5
    arrays = [np.full(8, i, np.float32) for i in range(n)]
    ts = [Tensor(a) for a in arrays]
    total = ts[0]
    for t in ts[1:]:
        total = total + t
    with count_kernels() as c:
        got = total.numpy()
    np.testing.assert_array_equal(got, np.full(8, sum(range(n)), np.float32))
    assert c.count >= 3


def _naive_boundaries(order, realize, realized, max_inputs):
    """The scheduler's fixed point without its kept analyses: every pass analyses every kernel afresh."""
    from vkgraph.schedule import _analyze

    while True:
        users: dict = {}
        grown = False
        for r in reversed(order):
            if r not in realize:
                continue
            viol, fused = _analyze(r, realize, realized, max_inputs)
            if viol:
                realize |= viol - realize
                grown = True
                continue
            for f in fused:
                users.setdefault(f, []).append(r)
        if grown:
            continue
        shared = {f for f, rs in users.items() if len(rs) > 1}
        if not shared:
            return
        realize |= shared


def test_kept_analyses_give_the_partition_a_fresh_analysis_gives():
    from vkgraph.graph import Op
    from vkgraph.schedule import _choose_boundaries, _Memo

    w = [Tensor(data(32, 32)) for _ in range(12)]
    x = Tensor(data(2, 32))
    for i in range(6):  # matmuls, softmax, norms and many weights: cuts for fusion and for the binding limit
        h = x * (x * x).mean(-1, keepdim=True).rsqrt()
        att = (h @ w[2 * i]).softmax(-1)
        x = x + (att @ w[2 * i + 1]).relu() + w[i].sum(0, keepdim=True)
    realized = _Memo(realize_mod.REALIZED)
    order = x.node.toposort(lambda n: n.op is Op.BUFFER or n in realized)
    for max_inputs in (4, 8, 16):
        a, b = {x.node}, {x.node}
        _choose_boundaries(order, a, realized, max_inputs)
        _naive_boundaries(order, b, realized, max_inputs)
        assert {id(n) for n in a} == {id(n) for n in b}
        assert len(a) > 6


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_thin_product_of_many_inputs_never_materializes_its_broadcast(rows):
    """A residual stream summed from more buffers than one kernel binds, times a weight matrix: the cut falls on
    the operand side ([rows, K]), never on the product's [rows, N, K] broadcast before its reduction."""
    n, k = 96, 40
    parts = [Tensor(data(rows, k)).realize() for _ in range(20)]
    w = Tensor(data(k, n)).realize()
    x = parts[0]
    for p in parts[1:]:
        x = x + p
    out = x @ w
    sched = create_schedule([out.node], realize_mod.REALIZED)
    shapes = [tuple(it.root.shape) for it in sched.items]
    assert all(np.prod(s) <= rows * max(n, k) for s in shapes), shapes
    xs = sum(p.numpy().astype(np.float64) for p in parts)
    ref = xs @ w.numpy()
    assert_close_to_terms(out.numpy(), ref, np.abs(xs) @ np.abs(w.numpy()), 1e-5)

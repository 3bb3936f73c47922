"""Subgroup reductions and vec4 elementwise kernels: the generated GLSL uses them where they apply (so they cannot
silently turn off), falls back where they do not, and the results match numpy either way."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from numerics import assert_close_to_terms

import vkgraph.realize as realize_mod
from vkgraph.codegen import Limits, lower
from vkgraph.runtime.device import get_device
from vkgraph.schedule import create_schedule
from vkgraph.tensor import Tensor


def sources(t: Tensor, lim: Limits | None = None) -> list[str]:
    sched = create_schedule([t.node], realize_mod.REALIZED)
    return [p.src for item in sched.items for p in lower(item, lim or realize_mod.limits()).programs]


def device_has_subgroup_arith() -> bool:
    return "arithmetic" in get_device().info.subgroup_ops


def test_limits_carry_the_subgroup_properties():
    info = get_device().info
    lim = Limits.from_info(info)
    assert lim.subgroup_arith == ("arithmetic" in info.subgroup_ops)
    assert (lim.min_subgroup, lim.max_subgroup) == (info.min_subgroup_size, info.max_subgroup_size)


def test_sum_uses_subgroup_add_when_the_device_has_it():
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    t = Tensor(x).sum()
    src = "\n".join(sources(t))
    if device_has_subgroup_arith():
        assert "subgroupAdd(" in src and "gl_NumSubgroups" in src
    else:
        assert "subgroup" not in src
    assert_close_to_terms(t.numpy(), x.sum(dtype=np.float64), np.abs(x).sum(), 1e-6)


def _nan_tie_rows() -> np.ndarray:
    rng = np.random.default_rng(1)
    x = rng.integers(0, 4, (8, 4096)).astype(np.float32)  # many ties
    x[1, [1, 256, 3000]] = np.nan  # NaNs held by different invocations: the first index must win
    x[2, [4095, 1024]] = np.nan
    x[3] = np.nan
    x[4] = 2.0  # all tied: index 0
    x[5, :] = -np.inf
    x[6, 7] = np.inf
    return x


@pytest.mark.parametrize("subgroups", [True, False])
def test_max_min_argmax_over_nan_and_ties_match_numpy(monkeypatch, subgroups):
    lim = dataclasses.replace(realize_mod.limits(), subgroup_arith=subgroups and device_has_subgroup_arith())
    monkeypatch.setattr(realize_mod, "limits", lambda: lim)
    x = _nan_tie_rows()
    t = Tensor(x)
    src = "\n".join(sources(t.max(1), lim) + sources(t.argmax(1), lim))
    assert ("subgroupMax(" in src) == lim.subgroup_arith
    np.testing.assert_array_equal(t.max(1).numpy(), x.max(1))
    np.testing.assert_array_equal(t.min(1).numpy(), x.min(1))
    np.testing.assert_array_equal(t.argmax(1).numpy(), x.argmax(1))
    np.testing.assert_array_equal(t.argmin(1).numpy(), x.argmin(1))  # the first NaN, as numpy
    finite = np.nan_to_num(x, nan=1.0)
    np.testing.assert_array_equal(Tensor(finite).argmin(1).numpy(), finite.argmin(1))
    ints = np.random.default_rng(2).integers(-3, 3, (5, 3000)).astype(np.int32)
    np.testing.assert_array_equal(Tensor(ints).argmax(1).numpy(), ints.argmax(1))
    np.testing.assert_array_equal(Tensor(ints).max(1).numpy(), ints.max(1))
    np.testing.assert_array_equal(Tensor(ints).sum(1).numpy(), ints.sum(1))


def test_split_and_fused_reductions_with_subgroups():
    rng = np.random.default_rng(3)
    long = rng.standard_normal((2, 40000)).astype(np.float32)  # split: partials, then their reduction
    long[1, 39999] = np.nan
    np.testing.assert_array_equal(Tensor(long).max(1).numpy(), long.max(1))
    assert_close_to_terms(Tensor(long).sum(1).numpy(), long.sum(1, dtype=np.float64), np.abs(long).sum(1), 1e-6)
    x = rng.standard_normal((3, 1000)).astype(np.float32)
    e = np.exp(x - x.max(1, keepdims=True))  # softmax: a max and a sum fused into one kernel
    np.testing.assert_allclose(Tensor(x).softmax(1).numpy(), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
    b = rng.random((4, 700)) > 0.5  # bools keep the shared-memory tree
    np.testing.assert_array_equal(Tensor(b).any(1).numpy(), b.any(1))
    np.testing.assert_array_equal(Tensor(b).all(1).numpy(), b.all(1))


def test_subgroup_layout_follows_the_size_range(monkeypatch):
    t = Tensor(np.ones((2, 4096), np.float32)).sum(1)
    base = realize_mod.limits()
    varying = dataclasses.replace(base, max_invocations=256, subgroup_arith=True, min_subgroup=4, max_subgroup=64)
    src = sources(t, varying)[0]
    assert "shared float sg_float[64];" in src  # as many partials as the smallest subgroups leave
    too_wide = dataclasses.replace(varying, max_subgroup=512)  # the workgroup would not hold whole subgroups
    assert "subgroup" not in sources(t, too_wide)[0]
    if device_has_subgroup_arith():  # more partial slots than the device's subgroups fill: still exact
        lim = dataclasses.replace(base, min_subgroup=1)
        monkeypatch.setattr(realize_mod, "limits", lambda: lim)
        x = np.random.default_rng(4).standard_normal((2, 4096)).astype(np.float32)
        local = re.search(r"local_size_x = (\d+)", sources(Tensor(x).sum(1), lim)[0]).group(1)
        assert f"sg_float[{local}];" in sources(Tensor(x).sum(1), lim)[0]
        assert_close_to_terms(Tensor(x).sum(1).numpy(), x.sum(1, dtype=np.float64), np.abs(x).sum(1), 1e-6)
        x[1, [5, 900]] = np.nan
        np.testing.assert_array_equal(Tensor(x).argmax(1).numpy(), x.argmax(1))


def test_contiguous_elementwise_uses_vec4_and_matches_numpy():
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal(4096).astype(np.float32), rng.standard_normal(4096).astype(np.float32)
    a, b = Tensor(x).realize(), Tensor(y).realize()
    out = (a * b + 1).exp()
    src = sources(out)[0]
    assert "vec4 data[]" in src and "vec4(" in src
    np.testing.assert_allclose(out.numpy(), np.exp(x * y + 1), rtol=1e-6)
    i = Tensor(np.arange(4096, dtype=np.int32)).realize()
    iout = i * 3 - 7
    assert "ivec4 data[]" in sources(iout)[0]
    np.testing.assert_array_equal(iout.numpy(), np.arange(4096, dtype=np.int32) * 3 - 7)
    r = Tensor.rand(64, 64) * 0 + Tensor(np.arange(64, dtype=np.float32))  # rand and broadcasts: per lane
    np.testing.assert_array_equal(r.numpy(), np.broadcast_to(np.arange(64, dtype=np.float32), (64, 64)))


@pytest.mark.parametrize("start,stop,vec", [(4, 4004, True), (8, 4096, True), (1, 4001, False), (0, 4093, False),
                                            (2, 4094, False)])
def test_views_vectorise_only_when_aligned(start, stop, vec):
    rng = np.random.default_rng(6)
    x, y = rng.standard_normal(4096).astype(np.float32), rng.standard_normal(4096).astype(np.float32)
    a, b = Tensor(x).realize(), Tensor(y).realize()
    out = a[start:stop] * 2 + b[start:stop]
    assert ("vec4 data[]" in sources(out)[0]) == vec
    np.testing.assert_allclose(out.numpy(), x[start:stop] * 2 + y[start:stop], rtol=1e-6)


def test_aligned_then_unaligned_offsets_of_one_shape():
    """Offsets are push constants: a vec4 kernel lowered for offset 4 must not serve offset 1."""
    x = np.arange(4100, dtype=np.float32)
    a = Tensor(x).realize()
    for start in (4, 1, 8, 3, 0):
        np.testing.assert_array_equal((a[start:start + 4096] + 1).numpy(), x[start:start + 4096] + 1)


def test_layouts_that_stay_scalar():
    rng = np.random.default_rng(7)
    m = rng.standard_normal((64, 64)).astype(np.float32)
    cases = [
        (Tensor(m).T + 1, m.T + 1),  # strided
        (Tensor(m).pad(((0, 0), (1, 3))) * 2, np.pad(m, ((0, 0), (1, 3))) * 2),  # masked
        (Tensor(m.astype(np.float16)) * 2, m.astype(np.float16) * 2),  # 16-bit
        (Tensor(m.ravel()[:4094]) + 1, m.ravel()[:4094] + 1),  # numel % 4
    ]
    for t, want in cases:
        assert "vec4" not in sources(t)[0]
        np.testing.assert_allclose(t.numpy(), want, rtol=1e-3)

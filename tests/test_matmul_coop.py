"""Matrix products on cooperative matrices: which products take them (decided from device limits, tested here
with made-up limits on any device), that every such program compiles, and, on a device that has them, that
results match numpy in float64 within tolerances from the inputs' magnitudes over drawn shapes and views."""

from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vkgraph.realize as realize_mod
from vkgraph.codegen import Limits, lower, matmul_coop, tune
from vkgraph.dtype import dtypes
from vkgraph.realize import count_kernels
from vkgraph.runtime.compiler import Compiler
from vkgraph.runtime.device import CoopShape, get_device
from vkgraph.schedule import create_schedule
from vkgraph.tensor import Tensor

F16 = ("float16", "float16", "float32", "float32")
BF16 = ("bfloat16", "bfloat16", "float32", "float32")
# an H200's list, at subgroup scope (float16 accumulators and int8 left out: codegen does not take them)
COOP = ((16, 16, 16) + F16, (16, 8, 16) + F16, (16, 8, 8) + F16, (16, 16, 16) + BF16)


def fake_limits(**kw) -> Limits:
    base = dict(max_invocations=1024, max_group_count=(2**31 - 1, 65535, 65535), max_shared=49152,
                max_storage_range=2**32 - 1, max_buffers=64, subgroup_arith=True, min_subgroup=32, max_subgroup=32,
                coop=COOP, subgroup=32, device="fake", f32_compute="")
    base.update(kw)
    return Limits(**base)


def programs(t: Tensor, lim: Limits) -> list:
    sched = create_schedule([t.node], realize_mod.REALIZED)
    return [p for item in sched.items for p in lower(item, lim).programs]


def rand(shape, dtype=np.float16, seed=0):
    return Tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).cast(
        {np.float16: dtypes.float16, np.float32: dtypes.float32, "bf16": dtypes.bfloat16}[dtype])


_compiler = None


def compiles(src: str) -> None:
    global _compiler
    if _compiler is None:
        _compiler = Compiler(backend="glslang")
    assert _compiler.compile(src, target="vulkan1.3")[:4] == b"\x03\x02\x23\x07"


# ---- the decision, on made-up device limits -------------------------------------------------------------------


def test_float16_product_takes_cooperative_matrices_with_the_epilogue_in_one_program():
    a, b, bias = (rand(s, seed=i).realize() for i, s in enumerate(((200, 96), (96, 130), (130,))))
    progs = programs((a @ b + bias).relu(), fake_limits())
    assert len(progs) == 1 and progs[0].name.startswith("MC_")
    src = progs[0].src
    # a, b and the bias read, the output written: the epilogue is in the program
    assert "coopMatMulAdd" in src and len(progs[0].bindings) == 4
    compiles(src)


@pytest.mark.parametrize("what", ["no_coop", "float32", "subgroup_range", "bf16_missing"])
def test_products_that_stay_on_the_tiled_path(what):
    lim = {"no_coop": fake_limits(coop=()), "subgroup_range": fake_limits(min_subgroup=32, max_subgroup=64),
           "bf16_missing": fake_limits(coop=COOP[:3])}.get(what, fake_limits())
    dt = {"float32": np.float32, "bf16_missing": "bf16"}.get(what, np.float16)
    (p,) = programs(rand((64, 64), dt) @ rand((64, 64), dt, 1), lim)
    assert p.name.startswith("M_") and "coopmat" not in p.src


@pytest.mark.parametrize("compute", ["float16", "bfloat16"])
def test_float32_product_takes_cooperative_matrices_only_when_asked(compute):
    (p,) = programs(rand((64, 64), np.float32) @ rand((64, 64), np.float32, 1), fake_limits(f32_compute=compute))
    assert p.name.startswith("MC_")
    assert ("float16_t fragments are bfloat16" in p.src) == (compute == "bfloat16")
    compiles(p.src)


def test_bfloat16_product_reading_float16_keeps_the_tiled_path():
    a, b = rand((64, 64), "bf16"), rand((64, 64), "bf16", 1)
    (p,) = programs(a @ b + rand((64,), np.float16, 2).realize(), fake_limits())
    assert p.name.startswith("M_")


def test_fragment_prefers_16x16x16_and_reads_only_float32_accumulation():
    assert matmul_coop.fragment(fake_limits(), "float16") == (16, 16, 16)
    assert matmul_coop.fragment(fake_limits(coop=((16, 8, 16) + F16,)), "float16") == (16, 8, 16)
    assert matmul_coop.fragment(fake_limits(coop=((16, 16, 16, "float16", "float16", "float16", "float16"),)),
                                "float16") is None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(64, 300), n=st.integers(64, 300), k=st.integers(1, 200), batch=st.sampled_from([(), (3,), (2, 2)]),
       ta=st.booleans(), tb=st.booleans(), bf16=st.booleans(), sub=st.integers(0, 1))
def test_every_drawn_cooperative_program_compiles(m, n, k, batch, ta, tb, bf16, sub):
    """Operands as buffers, transposed views, batch broadcasts and slices: each program glslang accepts, with
    vector reads exactly where rows are 8-element aligned plain reads."""
    dt = "bf16" if bf16 else np.float16
    a = rand(batch + ((k, m + sub) if ta else (m + sub, k)), dt)
    b = rand(((n, k) if tb else (k, n)), dt, 1)
    a = a.transpose(-1, -2) if ta else a
    b = b.transpose(-1, -2) if tb else b
    a = a[..., :m, :] if sub else a
    progs = programs(a @ b, fake_limits())
    assert progs[-1].name.startswith("MC_")
    compiles(progs[-1].src)


def test_device_info_lists_cooperative_matrices_as_the_driver_gives_them():
    info = get_device().info
    assert all(isinstance(s, CoopShape) and s.m > 0 and s.n > 0 and s.k > 0 for s in info.cooperative_matrix)
    lim = Limits.from_info(info)
    assert lim.coop == tuple((s.m, s.n, s.k, s.a, s.b, s.c, s.result) for s in info.cooperative_matrix
                             if s.scope == "subgroup" and not s.saturating) or not info.float16
    if not any(s.a == "bfloat16" for s in info.cooperative_matrix):
        assert not info.bfloat16_cooperative_matrix or info.cooperative_matrix == ()


def test_tuned_configurations_are_read_per_device_and_class(tmp_path, monkeypatch):
    cls = matmul_coop.shape_class(512, 4096, 4096, 1, dtypes.float16)
    pa, pb = tune.path(tmp_path, "dev A/1"), tune.path(tmp_path, "dev B/1")
    assert tune.load(pa) == ()
    tune.record(pa, cls, matmul_coop.Config(64, 128, 32, 2, 2, 1))
    assert json.loads(pa.read_text())[cls] == [64, 128, 32, 2, 2, 1] and tune.load(pb) == ()
    lim = fake_limits(tuned=tune.load(pa))
    want = matmul_coop.Config(64, 128, 32, 2, 2, 1)
    assert matmul_coop.choose(512, 4096, 4096, 1, lim, (16, 16, 16), dtypes.float16) == want
    assert matmul_coop.choose(512, 4096, 4096, 1, fake_limits(), (16, 16, 16), dtypes.float16) == \
        matmul_coop.default_config(512, 4096, 4096, 1, fake_limits(), (16, 16, 16))
    # realize loads the table of its device from the cache folder, unless told not to
    monkeypatch.setenv("VKGRAPH_CACHE_DIR", str(tmp_path))
    dev_lim = dataclasses.replace(realize_mod.limits(), coop=COOP, device="dev A/1")
    assert realize_mod._with_matmul_settings(dev_lim).tuned == tune.load(pa)
    monkeypatch.setenv("VKGRAPH_MATMUL_TUNE", "0")
    assert realize_mod._with_matmul_settings(dev_lim).tuned == ()


def test_the_bfloat16_mark_is_the_compilers():
    from vkgraph.runtime.spirv import BF16_FRAGMENTS
    assert matmul_coop.BF16_FRAGMENTS == BF16_FRAGMENTS


# ---- on a device with cooperative matrices ---------------------------------------------------------------------

def _has(operand: str) -> bool:
    lim = realize_mod.limits()
    return matmul_coop.fragment(lim, operand) is not None and lim.min_subgroup == lim.max_subgroup


needs_f16 = pytest.mark.skipif(not _has("float16"), reason="no float16 cooperative matrices on this device "
                               "(VK_KHR_cooperative_matrix, with float32 accumulation; off under an older "
                               "validation layer)")
needs_bf16 = pytest.mark.skipif(not _has("bfloat16"), reason="the device has no bfloat16 cooperative matrices "
                                "(VK_KHR_cooperative_matrix with VK_KHR_shader_bfloat16)")


def _check(got: np.ndarray, a: np.ndarray, b: np.ndarray, out_eps: float, extra: np.ndarray | float = 0.0):
    """|got - a @ b| within float32 accumulation over |a| @ |b| plus the output's rounding (relative, and half the
    smallest float16 subnormal); NaN never passes."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = a64 @ b64 + extra
    mag = np.abs(a64) @ np.abs(b64) + np.abs(extra)
    k = a.shape[-1]
    tol = mag * (k * 2.0**-23 + out_eps) + 2.0**-25
    assert not np.isnan(got).any()
    bad = np.abs(got.astype(np.float64) - ref) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} off; worst {np.max(np.abs(got - ref) / tol)} x tolerance"


def _arr(shape, seed, dt):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return x.astype(dt)


@needs_f16
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(64, 260), n=st.integers(64, 260), k=st.integers(1, 300), batch=st.sampled_from([(), (3,)]),
       ta=st.booleans(), tb=st.booleans(), seed=st.integers(0, 2**16))
def test_float16_products_match_numpy(m, n, k, batch, ta, tb, seed):
    a = _arr(batch + ((k, m) if ta else (m, k)), seed, np.float16)
    b = _arr((n, k) if tb else (k, n), seed + 1, np.float16)
    an = np.swapaxes(a, -1, -2) if ta else a
    bn = b.T if tb else b
    ta_, tb_ = Tensor(a), Tensor(b)
    ta_ = ta_.transpose(-1, -2) if ta else ta_
    tb_ = tb_.transpose(-1, -2) if tb else tb_
    with count_kernels() as c:
        got = (ta_ @ tb_).numpy()
    assert any(nm.startswith("MC_") for nm in c.names)
    _check(got, an, bn, 2.0**-11)


@needs_f16
def test_epilogue_and_sliced_operands_on_cooperative_matrices():
    a = _arr((300, 200), 1, np.float16)
    b = _arr((200, 136), 2, np.float16)
    bias = _arr((130,), 3, np.float16)
    with count_kernels() as c:
        got = (Tensor(a)[7:290, 3:] @ Tensor(b)[3:, :130] + Tensor(bias)).relu().numpy()
    assert c.count == 1 and c.names[0].startswith("MC_")
    ref_in = (a[7:290, 3:], b[3:, :130])
    pre = ref_in[0].astype(np.float64) @ ref_in[1].astype(np.float64) + bias.astype(np.float64)
    mag = np.abs(ref_in[0].astype(np.float64)) @ np.abs(ref_in[1].astype(np.float64)) + np.abs(bias)
    assert np.all(np.abs(got - np.maximum(pre, 0)) <= mag * 2e-3 + 1e-6)


@needs_f16
def test_float16_large_product_matches_numpy():
    a, b = _arr((1000, 1536), 5, np.float16), _arr((1536, 776), 6, np.float16)
    _check((Tensor(a) @ Tensor(b)).numpy(), a, b, 2.0**-11)


@needs_bf16
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(64, 200), n=st.integers(64, 200), k=st.integers(1, 200), tb=st.booleans(),
       seed=st.integers(0, 2**16))
def test_bfloat16_products_match_numpy(m, n, k, tb, seed):
    bf = ml_dtypes.bfloat16
    a = _arr((m, k), seed, bf)
    b = _arr((n, k) if tb else (k, n), seed + 1, bf)
    tb_ = Tensor(b).transpose(-1, -2) if tb else Tensor(b)
    with count_kernels() as c:
        got = (Tensor(a) @ tb_).numpy().astype(np.float32)
    assert any(nm.startswith("MC_") for nm in c.names)
    _check(got, a.astype(np.float32), (b.T if tb else b).astype(np.float32), 2.0**-8)


@needs_f16
def test_float32_products_stay_exact_unless_asked(monkeypatch):
    a, b = _arr((96, 80), 7, np.float32), _arr((80, 112), 8, np.float32)
    with count_kernels() as c:
        (Tensor(a) @ Tensor(b)).numpy()
    assert not any(nm.startswith("MC_") for nm in c.names)
    lim = dataclasses.replace(realize_mod.limits(), f32_compute="float16")
    monkeypatch.setattr(realize_mod, "limits", lambda: lim)
    with count_kernels() as c:
        got = (Tensor(a) @ Tensor(b)).numpy()
    assert any(nm.startswith("MC_") for nm in c.names)
    _check(got, a.astype(np.float16).astype(np.float32), b.astype(np.float16).astype(np.float32), 2.0**-22)


@needs_f16
@pytest.mark.parametrize("tb", [False, True])
def test_every_tile_configuration_matches_numpy(tb):
    """Any configuration the search may pick computes the same product (odd sizes, both B layouts)."""
    from vkgraph import graph
    from vkgraph.schedule import Kernel
    from vkgraph.view import ShapeTracker

    dev, lim, d = get_device(), realize_mod.limits(), dtypes.float16
    m, n, k = 200, 136, 300
    a, b = _arr((m, k), 11, np.float16), _arr((n, k) if tb else (k, n), 12, np.float16)
    na = graph.buffer(realize_mod.upload(a, d), 0, d, a.shape)
    nb = graph.buffer(realize_mod.upload(b, d), 0, d, b.shape)
    if tb:
        nb = graph.movement(nb, lambda s: s.permute((1, 0)))
    mm = graph.matmul(na, nb, d)
    out = realize_mod.allocate(d, mm.numel)
    kern = Kernel(mm, out, ShapeTracker.contiguous(mm.shape))
    frag = matmul_coop.fragment(lim, "float16")
    for cfg in matmul_coop.CONFIGS:
        if not cfg.fits(frag, lim):
            continue
        (prog,) = matmul_coop.lower_coop(kern, mm, lim, {}, cfg).programs
        dev.upload(out.buf, np.full(m * n, np.nan, np.float16).view(np.uint8))  # poison: every element is written
        dev.dispatch(dev.pipeline(prog.src, name=prog.name), [ref.buf for ref, _, _ in prog.bindings], prog.groups,
                     prog.push or None)
        _check(realize_mod.download(out, (m, n)), a, b.T if tb else b, 2.0**-11)


# ---- the tiled path (devices without cooperative matrices, float32 and integer products) -------------------------

@pytest.mark.parametrize("m,n,k", [(200, 130, 70), (64, 300, 33), (65, 65, 17), (130, 129, 1)])
def test_tiled_path_tiles_and_matches_numpy(m, n, k):
    a, b = _arr((m, k), 1, np.float32), _arr((k, n), 2, np.float32)
    (p,) = programs(Tensor(a) @ Tensor(b), fake_limits(coop=()))
    assert p.name.endswith("_128" if m > 64 and n > 64 else "_64")
    _check((Tensor(a) @ Tensor(b)).numpy(), a, b, 2.0**-24)
    bt = np.ascontiguousarray(b.T)  # the weight layout of x @ w.T
    _check((Tensor(a) @ Tensor(bt).T).numpy(), a, b, 2.0**-24)


def test_tiled_integer_product_is_exact():
    rng = np.random.default_rng(3)
    a, b = rng.integers(-50, 50, (150, 90), dtype=np.int32), rng.integers(-50, 50, (90, 140), dtype=np.int32)
    np.testing.assert_array_equal((Tensor(a) @ Tensor(b)).numpy(), a @ b)


@pytest.mark.parametrize("layer", [(1, 3, 239), (1, 3, 280), (1, 4, 320)])
def test_an_older_validation_layer_leaves_off_what_it_cannot_check(layer):
    from types import SimpleNamespace

    from vkgraph.runtime.device import Device, vk

    shapes = tuple(CoopShape(*c[:3], *c[3:], scope="subgroup") for c in COOP)
    stub = SimpleNamespace(validation_version=vk.VK_MAKE_VERSION(*layer),
                           info=SimpleNamespace(cooperative_matrix=shapes, bfloat16_cooperative_matrix=True))
    Device._within_validation(stub)
    kept = {s.a for s in stub.info.cooperative_matrix}
    assert kept == {(1, 3, 239): set(), (1, 3, 280): {"float16"}, (1, 4, 320): {"float16", "bfloat16"}}[layer]
    assert stub.info.bfloat16_cooperative_matrix == (layer >= (1, 4, 311))

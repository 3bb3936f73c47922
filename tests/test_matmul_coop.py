"""Matrix products on cooperative matrices: which products take them (decided from device limits, tested here
with made-up limits on any device), that every such program compiles, and, on a device that has them, that
results match numpy in float64 within tolerances from the inputs' magnitudes over drawn shapes and views."""

from __future__ import annotations

import dataclasses
import json
import re

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
I8 = ("int8", "int8", "int32", "int32")
# an H200's list, at subgroup scope (float16 accumulators left out: codegen does not take them)
COOP = ((16, 16, 16) + F16, (16, 8, 16) + F16, (16, 8, 8) + F16, (16, 16, 16) + BF16)
COOP_I8 = COOP + ((16, 16, 32) + I8, (16, 8, 32) + I8)
U8 = ("uint8", "uint8", "int32", "int32")
UI8 = ("uint8", "int8", "int32", "int32")
COOP_8BIT = COOP_I8 + ((16, 16, 32) + U8, (16, 16, 32) + UI8)


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
    # workgroup-scope matrices (VK_NV_cooperative_matrix2) only beside subgroup-scope ones, in whole subgroups
    assert not info.cooperative_matrix_flexible or info.cooperative_matrix
    assert all(s.invocations % info.subgroup_size == 0 and min(s.m, s.n, s.k) > 0
               for s in info.cooperative_matrix_flexible)
    assert info.cooperative_matrix_flexible or not info.cooperative_matrix_tensor_addressing
    # VK_NV_cooperative_vector's combinations only with a vector length to use them at
    assert bool(info.cooperative_vector) == (info.cooperative_vector_max_components > 0)


def test_tuned_configurations_are_read_per_device_and_class(tmp_path, monkeypatch):
    cls = matmul_coop.shape_class(512, 4096, 4096, 1, dtypes.float16)
    pa, pb = tune.path(tmp_path, "dev A/1"), tune.path(tmp_path, "dev B/1")
    assert tune.load(pa) == ()
    tune.record(pa, cls, matmul_coop.Config(64, 128, 32, 2, 2, 1))
    assert json.loads(pa.read_text())[cls] == [64, 128, 32, 2, 2, 1, 1, 1] and tune.load(pb) == ()
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


def test_tables_written_before_the_prefetch_depth_and_k_split_read_as_one_slice_in_flight_unsplit(tmp_path):
    p = tune.path(tmp_path, "dev")
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({"float16:4096x4096x4096": [256, 128, 32, 4, 2, 1], "bad": [1, 2, 3]}))
    assert tune.load(p) == (("float16:4096x4096x4096", (256, 128, 32, 4, 2, 1, 1, 1)),)
    tune.record(p, "float16:512x4096x4096", matmul_coop.Config(128, 128, 32, 2, 4, 2, 2))
    lim = fake_limits(tuned=tune.load(p))
    assert matmul_coop.choose(512, 4096, 4096, 1, lim, (16, 16, 16), dtypes.float16).pf == 2
    assert matmul_coop.choose(4096, 4096, 4096, 1, lim, (16, 16, 16), dtypes.float16) == \
        matmul_coop.Config(256, 128, 32, 4, 2, 1, 1, 1)


def _lowered(m: int, n: int, k: int, tb: bool, cfg: matmul_coop.Config, d=dtypes.float16, first: bool = True):
    """The source of an m x k @ k x n product of buffers (B read transposed with tb) in tile cfg: its first
    program's, or with first=False the Lowered."""
    from vkgraph import graph
    from vkgraph.schedule import Kernel
    from vkgraph.view import ShapeTracker

    na = graph.buffer(realize_mod.allocate(d, m * k), 0, d, (m, k))
    nb = graph.buffer(realize_mod.allocate(d, k * n), 0, d, (n, k) if tb else (k, n))
    if tb:
        nb = graph.movement(nb, lambda s: s.permute((1, 0)))
    if d is dtypes.int8:
        na, nb = (graph.alu(graph.Op.CAST, dtypes.int32, x) for x in (na, nb))
    mm = graph.matmul(na, nb, dtypes.int32 if d is dtypes.int8 else d)
    kern = Kernel(mm, realize_mod.allocate(mm.dtype, mm.numel), ShapeTracker.contiguous(mm.shape))
    lowered = matmul_coop.lower_coop(kern, mm, fake_limits(coop=COOP_I8), {}, cfg, d)
    return lowered.programs[0].src if first else lowered


@pytest.mark.parametrize("d", [dtypes.float16, dtypes.int8])
def test_every_tile_configuration_compiles(d):
    """Each configuration the search measures (both prefetch depths and stage counts), on whole tiles and on
    ragged sizes with B in both layouts: glslang accepts the program."""
    lim = fake_limits(coop=COOP_I8)
    frag = matmul_coop.fragment(lim, matmul_coop.operand_type(d))
    fitting = [c for c in matmul_coop.configs(d) if c.fits(frag, lim, d.itemsize)]
    assert {c.pf for c in fitting} == {1, 2} and {c.stages for c in fitting} == {1, 2}
    assert {c.ks for c in fitting} == ({1, 2, 4} if d.itemsize == 2 else {1})
    for i, cfg in enumerate(fitting):
        shape = (512, 256, 512, i % 2 == 1) if i % 3 == 0 or cfg.ks > 1 else (200, 136, 300, i % 2 == 0)
        for prog in _lowered(*shape, cfg, d, first=False).programs:
            compiles(prog.src)
            # within the device's shared memory, the epilogue's staging included (a driver may take more and
            # lose the device when it runs)
            declared = re.search(r"shared uvec4 sm\[(\d+)\]", prog.src)
            assert declared is None or int(declared[1]) * 16 <= lim.max_shared, cfg
    wide = matmul_coop.Config(128, 256, 16, 4, 4, 2, 2)  # 16 subgroups of 64 columns: 69632 bytes to stage them
    assert wide.shared_bytes() <= lim.max_shared < wide.epilogue_bytes(frag[0]) and not wide.fits(frag, lim)
    with pytest.raises(ValueError, match="shared memory"):
        _lowered(512, 512, 512, False, wide)


def test_default_tiles_are_the_measured_ones():
    """Without a search: 128 x 256 x 32 in one stage where the output has at least 128 such tiles, 128 x 128 x 64
    in one stage for outputs of fewer (a 512-token prefill's 4096 columns), smaller tiles for small outputs or
    less shared memory; int8 as before."""
    lim, f = fake_limits(), (16, 16, 16)
    assert matmul_coop.default_config(4096, 4096, 4096, 1, lim, f) == matmul_coop.Config(128, 256, 32, 2, 4, 1)
    assert matmul_coop.default_config(512, 14336, 4096, 1, lim, f) == matmul_coop.Config(128, 256, 32, 2, 4, 1)
    assert matmul_coop.default_config(512, 4096, 4096, 1, lim, f) == matmul_coop.Config(128, 128, 64, 4, 2, 1)
    assert matmul_coop.default_config(512, 4096, 14336, 1, lim, f) == matmul_coop.Config(128, 128, 64, 4, 2, 1)
    assert matmul_coop.default_config(300, 200, 64, 1, lim, f).bm * 2 <= 128
    small = fake_limits(max_shared=32768)
    assert matmul_coop.default_config(4096, 4096, 4096, 1, small, f).fits(f, small)
    assert matmul_coop.default_config(4096, 4096, 4096, 1, fake_limits(coop=COOP_I8), (16, 16, 32), dtypes.int8) \
        == matmul_coop.Config(128, 128, 64, 2, 4)


def test_the_search_splits_k_only_for_outputs_of_few_tiles():
    lim, frag = fake_limits(), (16, 16, 16)
    big = matmul_coop.candidates(4096, 4096, 4096, 1, lim, frag, dtypes.float16)
    few = matmul_coop.candidates(512, 4096, 4096, 1, lim, frag, dtypes.float16)
    ragged = matmul_coop.candidates(512, 4096, 4000, 1, lim, frag, dtypes.float16)
    assert {c.ks for c in big} == {1} and {c.ks for c in few} == {1, 2, 4} and {c.ks for c in ragged} == {1}
    assert {c for c in few if c.ks == 1} == set(big) and all(c.fits(frag, lim) for c in few)


def test_a_k_split_writes_partial_planes_that_a_reduction_sums():
    """KS parts of K each write a float32 plane of a scratch buffer; the second program sums them and runs the
    epilogue. Where K is not a whole number of KS slices, or the operands are 8-bit, K is not split."""
    cfg = matmul_coop.Config(128, 128, 32, 2, 4, 2, 1, 4)
    split = _lowered(200, 136, 512, True, cfg, first=False)
    first, *rest = split.programs
    assert first.name.endswith("_k4") and rest and split.scratch[0].numel == 4 * 200 * 136
    assert "int kz0 = kz * 128;" in first.src and "coopMatMulAdd" in first.src
    assert all("coopmat" not in p.src for p in rest)
    whole = _lowered(200, 136, 500, True, cfg, first=False)
    assert len(whole.programs) == 1 and not whole.scratch and "kz" not in whole.programs[0].src
    assert not matmul_coop.Config(128, 128, 64, 2, 4, 2, 1, 2).fits((16, 16, 32), fake_limits(coop=COOP_I8), 1)


def test_two_slices_in_flight_alternate_register_sets():
    """PF 2 reads slice kt + 2 into one register set while the other, read a step earlier, is stored; PF 1 reads
    kt + 1 into one set, as before."""
    one = _lowered(200, 136, 304, False, matmul_coop.Config(128, 128, 32, 2, 4, 2, 1))
    two = _lowered(200, 136, 304, False, matmul_coop.Config(128, 128, 32, 2, 4, 2, 2))
    assert "(kt + 1) * 32" in one and "(kt + 2)" not in one and "aq0" not in one
    assert "(kt + 2) * 32" in two and "((kt + 1) + 2) * 32" in two and "kt += 2" in two
    assert "aq0 = b" in two and "= aq0;" in two and "ar0 = b" in two and "= ar0;" in two
    # K of one slice: nothing is in flight past the first, and the program still compiles
    compiles(_lowered(64, 64, 16, False, matmul_coop.Config(128, 128, 32, 2, 4, 2, 2)))


@pytest.mark.parametrize("per_row", [2, 4, 8, 16])
def test_staged_chunks_of_eight_invocations_fall_in_distinct_banks(per_row):
    """Every chunk of a 64-row tile is stored once, and each group of 8 invocations' 16-byte stores (one pass of
    the banks) covers 8 distinct 16-byte bank groups of rows padded by one chunk."""
    from vkgraph.codegen.matmul_coop import spread

    row, col = (x.replace("/", "//") for x in spread("e", per_row, 64))
    pos = [(eval(row, {"e": e}), eval(col, {"e": e})) for e in range(64 * per_row)]
    assert sorted(pos) == [(r, c) for r in range(64) for c in range(per_row)]
    for g in range(0, len(pos), 8):
        assert len({(r * (per_row + 1) + c) % 8 for r, c in pos[g:g + 8]}) == 8


def test_reads_of_whole_tiles_leave_out_the_bounds_checks():
    cfg = matmul_coop.Config(128, 128, 32, 2, 4)
    assert "gr < " not in _lowered(256, 256, 512, False, cfg) and "gc < " not in _lowered(256, 256, 512, True, cfg)
    ragged_m, ragged_k = _lowered(200, 256, 512, False, cfg), _lowered(256, 256, 500, False, cfg)
    assert "gr < 200" in ragged_m and "gc < 512" not in ragged_m
    assert "gc < 500" in ragged_k and "gr < 500" in ragged_k and "gr < 256" not in ragged_k


def test_the_bfloat16_mark_is_the_compilers():
    from vkgraph.runtime.spirv import BF16_FRAGMENTS
    assert matmul_coop.BF16_FRAGMENTS == BF16_FRAGMENTS


# ---- int8 products, on made-up device limits ---------------------------------------------------------------------


def ints(shape, seed=0, dtype=np.int8):
    info = np.iinfo(dtype)
    return np.random.default_rng(seed).integers(info.min, info.max + 1, shape, dtype=dtype)


@pytest.mark.parametrize("form", ["dtype_int32", "cast_int32", "int8_result", "dtype_int64", "epilogue", "dequant"])
def test_int8_products_take_int8_cooperative_matrices(form):
    """Every spelling of an int8 product summed in a wider signed type, and int8 @ int8 itself (its int32 sum
    wraps to numpy's int8), runs on int8 fragments with int32 accumulators, operands read as 16-byte vectors."""
    a, b = Tensor(ints((200, 96))), Tensor(ints((130, 96), 1)).T  # b read transposed, as x @ w.T
    t = {"dtype_int32": lambda: a.matmul(b, dtype=dtypes.int32),
         "cast_int32": lambda: a.cast(dtypes.int32) @ b.cast(dtypes.int32),
         "int8_result": lambda: a @ b,
         "dtype_int64": lambda: a.matmul(b, dtype="int64"),
         "epilogue": lambda: (a.matmul(b, dtype=dtypes.int32) + Tensor(ints((130,), 2, np.int32))).maximum(0),
         # the scales of int8-quantized rows and columns, applied in the product's epilogue
         "dequant": lambda: a.matmul(b, dtype=dtypes.int32).cast(dtypes.float32) * rand((200, 1), np.float32)
         * rand((130,), np.float32, 1)}[form]()
    (p,) = programs(t, fake_limits(coop=COOP_I8))
    assert p.name.startswith("MC_") and p.name.endswith("_i8")
    assert "coopmat<int8_t" in p.src and "coopmat<int32_t" in p.src
    assert sum("uvec4 data[]" in line for line in p.src.splitlines() if "buffer B" in line) == 2
    compiles(p.src)


def test_int8_values_of_a_narrowing_cast_are_read_element_by_element():
    """int16 values cast to int8 (wrapping) are int8 values: the product takes int8 fragments and reads that
    operand through the cast, element by element; numpy's result on the tiled path here."""
    a16, b = ints((100, 80), 0, np.int16), ints((80, 96), 1)
    a = Tensor(a16).cast(dtypes.int8)
    (p,) = programs(a.matmul(Tensor(b), dtype=dtypes.int32), fake_limits(coop=COOP_I8))
    assert p.name.endswith("_i8") and "int16_t data[]" in p.src
    compiles(p.src)
    np.testing.assert_array_equal(a.matmul(Tensor(b), dtype=dtypes.int32).numpy(),
                                  np.matmul(a16.astype(np.int8), b, dtype=np.int32))


@pytest.mark.parametrize("ta,tb,mask", [(np.int8, np.int8, 0xF), (np.uint8, np.uint8, 0xC), (np.uint8, np.int8, 0xE)])
def test_int8_signedness_reaches_the_spirv(ta, tb, mask):
    """coopMatMulAdd of int8_t fragments must be marked signed (A, B, C and result), or the bytes multiply as
    unsigned, and uint8_t ones unsigned: the operand mask of every OpCooperativeMatrixMulAddKHR (signed A 1,
    B 2, C 4, result 8)."""
    import struct

    (p,) = programs(Tensor(ints((64, 64), 0, ta)).matmul(Tensor(ints((64, 64), 1, tb)), dtype=dtypes.int32),
                    fake_limits(coop=COOP_8BIT))
    global _compiler
    if _compiler is None:
        _compiler = Compiler(backend="glslang")
    spv = _compiler.compile(p.src, target="vulkan1.3")
    words = struct.unpack(f"<{len(spv) // 4}I", spv)
    i, masks = 5, []
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        if op == 4459:  # OpCooperativeMatrixMulAddKHR: result type, id, A, B, C[, operands]
            masks.append(words[i + 6] if count > 6 else 0)
        i += count
    assert masks and all(m == mask for m in masks)


@pytest.mark.parametrize("types,out", [(("uint8", "uint8"), "uint8"), (("uint8", "uint8"), "int32"),
                                       (("uint8", "int8"), "int16"), (("uint8", "int8"), "int64")])
def test_int8_family_uint8_operands_take_the_types_the_device_lists(types, out):
    """uint8 operands (and uint8 x int8) run on fragments of their own types where listed, summed in int32."""
    ta, tb = (getattr(np, t) for t in types)
    a, b = Tensor(ints((200, 96), 0, ta)), Tensor(ints((96, 144), 1, tb))
    (p,) = programs(a.matmul(b, dtype=out), fake_limits(coop=COOP_8BIT))
    assert p.name.endswith("_i8")
    assert f"coopmat<{types[0]}_t, gl_ScopeSubgroup, 16, 32, gl_MatrixUseA>" in p.src
    assert f"coopmat<{types[1]}_t, gl_ScopeSubgroup, 32, 16, gl_MatrixUseB>" in p.src
    compiles(p.src)
    (p,) = programs(a.matmul(b, dtype=out), fake_limits(coop=COOP_I8))  # the pair not listed: the tiled path
    assert p.name.startswith("M_")


def test_int8_family_length_limits_follow_the_operand_types():
    assert matmul_coop.max_k("uint8", "uint8") * 255 * 255 < 2**31 <= (matmul_coop.max_k("uint8", "uint8") + 1) * 255**2
    a, b = Tensor(ints((64, 33025), 0, np.uint8)), Tensor(ints((33025, 64), 1, np.uint8))
    assert programs(a.matmul(b, dtype="int32"), fake_limits(coop=COOP_8BIT))[0].name.endswith("_i8")
    a, b = Tensor(ints((64, 33026), 0, np.uint8)), Tensor(ints((33026, 64), 1, np.uint8))
    assert programs(a.matmul(b, dtype="int32"), fake_limits(coop=COOP_8BIT))[0].name.startswith("M_")


@pytest.mark.parametrize("what", ["no_int8_shape", "only_16x8", "long_k", "int16_operand", "uint8_operand",
                                  "unsigned_result", "subgroup_range"])
def test_int8_products_that_stay_on_the_tiled_path(what):
    """No fitting int8 shape (16x8x32 fragments are half a 16-byte chunk wide), K past what int32 holds exactly,
    operands that are not 8-bit values of a listed type (uint8 here: only int8 listed), a sum in an unsigned type
    of int8 operands (their casts change values), or a subgroup size that is not fixed."""
    lim = {"no_int8_shape": fake_limits(), "only_16x8": fake_limits(coop=COOP + ((16, 8, 32) + I8,)),
           "subgroup_range": fake_limits(coop=COOP_I8, min_subgroup=32, max_subgroup=64)}.get(
        what, fake_limits(coop=COOP_I8))
    k = matmul_coop.INT8_MAX_K + 1 if what == "long_k" else 64
    a, b = Tensor(ints((64, k))), Tensor(ints((k, 64), 1))
    if what == "int16_operand":
        b = Tensor(ints((k, 64), 1, np.int16))
    if what == "uint8_operand":
        a, b = Tensor(ints((64, k), 0, np.uint8)), Tensor(ints((k, 64), 1, np.uint8))
    (p,) = programs(a.matmul(b, dtype=dtypes.uint32 if what == "unsigned_result" else dtypes.int32), lim)
    assert p.name.startswith("M_") and "coopmat" not in p.src
    assert matmul_coop.INT8_MAX_K * 2**14 < 2**31 <= (matmul_coop.INT8_MAX_K + 1) * 2**14


def test_int8_fragment_is_16x16x32_with_int32_accumulation():
    assert matmul_coop.fragment(fake_limits(coop=COOP_I8), "int8") == (16, 16, 32)
    assert matmul_coop.fragment(fake_limits(), "int8") is None
    assert matmul_coop.fragment(fake_limits(coop=((16, 16, 32, "int8", "int8", "float32", "float32"),)),
                                "int8") is None
    # the tile configurations of a search all hold int8 slices in the same shared memory as float16 ones
    assert all(c.bk % 32 == 0 for c in matmul_coop.configs(dtypes.int8))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(64, 300), n=st.integers(64, 300), k=st.integers(1, 200), batch=st.sampled_from([(), (3,), (2, 2)]),
       ta=st.booleans(), tb=st.booleans(), sub=st.integers(0, 1),
       types=st.sampled_from([(np.int8, np.int8), (np.uint8, np.uint8), (np.uint8, np.int8)]))
def test_every_drawn_int8_cooperative_program_compiles(m, n, k, batch, ta, tb, sub, types):
    a = Tensor(ints(batch + ((k, m + sub) if ta else (m + sub, k)), 0, types[0]))
    b = Tensor(ints((n, k) if tb else (k, n), 1, types[1]))
    a = a.transpose(-1, -2) if ta else a
    b = b.transpose(-1, -2) if tb else b
    a = a[..., :m, :] if sub else a
    progs = programs(a.matmul(b, dtype=dtypes.int32), fake_limits(coop=COOP_8BIT))
    assert progs[-1].name.endswith("_i8")
    compiles(progs[-1].src)


@pytest.mark.parametrize("m,n,k", [(200, 130, 70), (65, 300, 33), (130, 129, 1)])
def test_int8_products_on_the_tiled_path_match_numpy(m, n, k):
    """int8 @ int8 wraps in int8 as numpy's does; summed in int32 or int64 it is numpy's sum of the same type."""
    a, b = ints((2, m, k)), ints((n, k), 1)
    ta, tb = Tensor(a), Tensor(b).T
    np.testing.assert_array_equal((ta @ tb).numpy(), a @ b.T)
    np.testing.assert_array_equal(ta.matmul(tb, dtype=dtypes.int32).numpy(), np.matmul(a, b.T, dtype=np.int32))
    np.testing.assert_array_equal((ta.cast(dtypes.int32) @ tb.cast(dtypes.int32)).numpy(),
                                  a.astype(np.int32) @ b.T.astype(np.int32))


# ---- the programs with their cooperative matrices emulated, on any device ---------------------------------------

_EMULATION = """
float h_sm(int i) { return unpackHalf2x16(sm[i >> 3][(i >> 1) & 3] >> (16u * uint(i & 1))).x; }
float f_at(ivec3 f, int r, int c) {
    int i = f.z != 0 ? (f.x + c * f.y) * 8 + r : (f.x + r * f.y) * 8 + c;
    return h_sm(i);
}
void m_zero(out float m[AR * FN]) { for (int i = 0; i < AR * FN; i++) m[i] = 0.0; }
void m_store(float m[AR * FN], int off, int stride) {
    int l = int(gl_SubgroupInvocationID);
    for (int i = 0; i < AR; i++) for (int c = 0; c < FN; c++)
        sm[off + (l + i * SG) * stride + (c >> 2)][c & 3] = floatBitsToUint(m[i * FN + c]);
}
void m_mma(ivec3 a, ivec3 b, inout float m[AR * FN]) {
    int l = int(gl_SubgroupInvocationID);
    for (int i = 0; i < AR; i++) for (int c = 0; c < FN; c++) {
        float t = m[i * FN + c];
        for (int k = 0; k < FK; k++) t += f_at(a, l + i * SG, k) * f_at(b, k, c);
        m[i * FN + c] = t;
    }
}
"""
_COOPMAT = r"coopmat<[^>]*>"


def emulated(src: str, sg: int) -> str:
    """A float16 program of matmul_coop or matmul_quant with its cooperative matrices emulated (any device with a
    fixed subgroup size sg that divides the fragments' rows), of the fragment shape its types name: an A or B
    fragment is (offset, stride, column-major) where it lies in shared memory, read when multiplied, which holds
    since the programs store no staged slice between a fragment's load and its products; lane l of a subgroup holds
    rows l, l + sg, .. of each accumulator. Everything but the matrix operations (staging, pipelining, K split,
    epilogue) is the program's own. The matrix operations' loops are left for the compiler to unroll: kept rolled
    (`[[dont_unroll]]`), matmul_quant's two-stage 64x64x32 prefill tile with two slices in flight gave garbage on
    lavapipe at K = 512 in every decoding order (0, 1 and 2) and was right at K = 96 and 256, and unrolled at all
    four, as on an H200."""
    fm, fn, fk = _dims(src)
    src = src.replace("#extension GL_KHR_cooperative_matrix : require\n", "")
    src = re.sub(rf"{_COOPMAT} (\w+) = {_COOPMAT}\(0\.0\);", r"float \1[AR * FN]; m_zero(\1);", src)
    src = re.sub(rf"{_COOPMAT} (\w+)\[(\d+)\];", r"ivec3 \1[\2];", src)
    src = re.sub(r"coopMatLoad\(([^,]+), sm, (.+), (\d+), gl_CooperativeMatrixLayout(Row|Column)Major\);",
                 lambda m: f"{m[1]} = ivec3({m[2]}, {m[3]}, {int(m[4] == 'Column')});", src)
    src = re.sub(r"(\w+) = coopMatMulAdd\(([^,]+), ([^,]+), \1\);", r"m_mma(\2, \3, \1);", src)
    src = re.sub(r"coopMatStore\((\w+), sm, (.+), (\d+), gl_CooperativeMatrixLayoutRowMajor\);",
                 r"m_store(\1, \2, \3);", src)
    assert "coopMat" not in src and "coopmat" not in src
    consts = f"const int SG = {sg}, FM = {fm}, FN = {fn}, FK = {fk}, AR = {fm // sg};"
    return re.sub(r"(shared uvec4 sm\[\d+\];)", lambda m: m[1] + "\n" + consts + "\n" + _EMULATION, src)


def _dims(src: str) -> tuple[int, int, int]:
    """The fragment shape (M, N, K) a program's cooperative matrix types name."""
    fm, fn = (int(v) for v in re.search(r"(\d+), (\d+), gl_MatrixUseAccumulator", src).groups())
    fk = int(re.search(r"(\d+), \d+, gl_MatrixUseB", src).group(1))
    return fm, fn, fk


def _float16_product(m: int, n: int, k: int, tb: bool, seed: int):
    """A float16 (m, k) @ (k, n) product kernel over random operands uploaded to the device, B stored (n, k) and
    read transposed when tb: (kern, mm, out, a, b), b as numpy multiplies it."""
    from vkgraph import graph
    from vkgraph.schedule import Kernel
    from vkgraph.view import ShapeTracker

    d = dtypes.float16
    a, b = _arr((m, k), seed, np.float16), _arr((n, k) if tb else (k, n), seed + 1, np.float16)
    na = graph.buffer(realize_mod.upload(a, d), 0, d, a.shape)
    nb = graph.buffer(realize_mod.upload(b, d), 0, d, b.shape)
    if tb:
        nb = graph.movement(nb, lambda s: s.permute((1, 0)))
    mm = graph.matmul(na, nb, d)
    out = realize_mod.allocate(d, mm.numel)
    return Kernel(mm, out, ShapeTracker.contiguous(mm.shape)), mm, out, a, b.T if tb else b


def _run_poisoned(dev, lowered, out, a: np.ndarray, b: np.ndarray) -> None:
    """Run a lowered float16 product over a NaN-poisoned output (every element must be written); check a @ b."""
    m, n = a.shape[0], b.shape[1]
    dev.upload(out.buf, np.full(m * n, np.nan, np.float16).view(np.uint8))
    run_lowered(dev, lowered)
    _check(realize_mod.download(out, (m, n)), a, b, 2.0**-11)


def _emulation_limits(coop=COOP):
    """The device's limits with `coop` listed; skips where its subgroup size is not fixed or does not divide 16."""
    lim = dataclasses.replace(realize_mod.limits(), coop=coop)
    if lim.subgroup < 1 or 16 % lim.subgroup or lim.min_subgroup != lim.max_subgroup:
        pytest.skip("the emulation needs a fixed subgroup size that divides 16")
    return lim


def _emulated_product(m: int, n: int, k: int, tb: bool, cfgs: list) -> None:
    """Each tile configuration's float16 product, emulated, against numpy (NaN-poisoned output)."""
    dev = get_device()
    lim = _emulation_limits()
    kern, mm, out, a, b = _float16_product(m, n, k, tb, 21)
    for cfg in cfgs:
        lowered = matmul_coop.lower_coop(kern, mm, lim, {}, cfg)
        assert len(lowered.programs) == (2 if cfg.ks > 1 and k % (cfg.bk * cfg.ks) == 0 else 1), cfg
        for p in lowered.programs:
            if p.name.startswith("MC_"):
                p.src = emulated(p.src, lim.subgroup)
        _run_poisoned(dev, lowered, out, a, b)


def emulate_coop(monkeypatch, coop=COOP) -> Limits:
    """Let a device without cooperative matrices run the float16 programs that need them, emulated (`emulated`),
    for the rest of a test: the limits say it has `coop` and every pipeline built from coopMat source is emulated.
    Returns those limits. Skips where the device's subgroup size is not fixed or does not divide 16."""
    dev = get_device()
    lim = _emulation_limits(coop)
    monkeypatch.setitem(realize_mod._limits, dev, lim)
    get = dev.pipelines.get
    monkeypatch.setattr(dev.pipelines, "get",
                        lambda src, **kw: get(emulated(src, lim.subgroup) if "coopMat" in src else src, **kw))
    return lim


def test_pipelined_split_product_emulated_matches_numpy():
    """Two slices in flight and K split in four, ragged M and N, B read transposed."""
    _emulated_product(130, 72, 256, True, [matmul_coop.Config(64, 64, 16, 2, 2, 2, 2, 4)])


@pytest.mark.slow
@pytest.mark.parametrize("tb", [False, True])
def test_tile_parameters_emulated_match_numpy(tb):
    """Both prefetch depths, both stage counts and K splits on small tiles (the device's shared memory), over
    ragged M and N and a K of whole slices; then a ragged K, whose split falls back to one part."""
    cfgs = [matmul_coop.Config(64, 64, 32, 2, 2, s, pf, ks) for s in (1, 2) for pf in (1, 2) for ks in (1, 2)]
    _emulated_product(130, 72, 256, tb, cfgs)
    _emulated_product(100, 70, 88, tb, [matmul_coop.Config(64, 64, 32, 2, 2, s, 2, 2) for s in (1, 2)])


# ---- on a device with cooperative matrices ---------------------------------------------------------------------

def _has(operand: str) -> bool:
    lim = realize_mod.limits()
    return matmul_coop.fragment(lim, operand) is not None and lim.min_subgroup == lim.max_subgroup


needs_f16 = pytest.mark.skipif(not _has("float16"), reason="no float16 cooperative matrices on this device "
                               "(VK_KHR_cooperative_matrix, with float32 accumulation; off under an older "
                               "validation layer)")
needs_i8 = pytest.mark.skipif(not _has("int8"), reason="no int8 cooperative matrices with int32 accumulation on "
                              "this device (VK_KHR_cooperative_matrix)")
needs_bf16 = pytest.mark.skipif(not _has("bfloat16"), reason="the device has no bfloat16 cooperative matrices "
                                "(VK_KHR_cooperative_matrix with VK_KHR_shader_bfloat16)")


def run_lowered(dev, lowered) -> None:
    """Record a lowered kernel's programs in order, its scratch buffers allocated first."""
    for ref in lowered.scratch:
        ref.buf = dev.alloc(ref.nbytes)
    for prog in lowered.programs:
        dev.dispatch(dev.pipeline(prog.src, name=prog.name), [ref.buf for ref, _, _ in prog.bindings], prog.groups,
                     prog.push or None)


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
    dev, lim = get_device(), realize_mod.limits()
    kern, mm, out, a, b = _float16_product(200, 136, 300, tb, 11)
    frag = matmul_coop.fragment(lim, "float16")
    for cfg in matmul_coop.CONFIGS:
        if not cfg.fits(frag, lim):
            continue
        _run_poisoned(dev, matmul_coop.lower_coop(kern, mm, lim, {}, cfg), out, a, b)


@needs_f16
@pytest.mark.parametrize("tb", [False, True])
def test_every_split_configuration_matches_numpy(tb):
    """Configurations that split K (partial planes, then their sum) on a K they divide, B in both layouts."""
    dev, lim = get_device(), realize_mod.limits()
    kern, mm, out, a, b = _float16_product(200, 136, 512, tb, 13)
    frag = matmul_coop.fragment(lim, "float16")
    for cfg in matmul_coop.CONFIGS:
        if cfg.ks == 1 or not cfg.fits(frag, lim):
            continue
        lowered = matmul_coop.lower_coop(kern, mm, lim, {}, cfg)
        assert len(lowered.programs) >= 2 and lowered.scratch, cfg
        _run_poisoned(dev, lowered, out, a, b)


@needs_f16
def test_split_product_with_epilogue_and_batch_through_realize(monkeypatch):
    """A batched product with a fused bias and relu, its class tuned to a K split: the partial planes' sum takes
    the epilogue, and realize allocates the scratch."""
    a, b, bias = _arr((2, 100, 256), 15, np.float16), _arr((256, 72), 16, np.float16), _arr((72,), 17, np.float16)
    cls = matmul_coop.shape_class(100, 72, 256, 2, dtypes.float16)
    lim = dataclasses.replace(realize_mod.limits(), tuned=((cls, (64, 64, 32, 2, 2, 2, 2, 4)),))
    monkeypatch.setattr(realize_mod, "limits", lambda: lim)
    with count_kernels() as c:
        got = (Tensor(a) @ Tensor(b) + Tensor(bias)).relu().numpy()
    assert any(nm.startswith("MC_") and nm.endswith("_k4") for nm in c.names), c.names
    pre = a.astype(np.float64) @ b.astype(np.float64) + bias.astype(np.float64)
    mag = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)) + np.abs(bias.astype(np.float64))
    assert np.all(np.abs(got - np.maximum(pre, 0)) <= mag * 2e-3 + 1e-6)


@needs_i8
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(64, 260), n=st.integers(64, 260), k=st.integers(1, 300), batch=st.sampled_from([(), (3,), (2, 2)]),
       ta=st.booleans(), tb=st.booleans(), sub=st.integers(0, 2), out=st.sampled_from(["int32", None, "int64"]),
       types=st.sampled_from([("int8", "int8"), ("int8", "int8"), ("uint8", "uint8"), ("uint8", "int8")]),
       seed=st.integers(0, 2**16))
def test_int8_products_match_numpy_exactly(m, n, k, batch, ta, tb, sub, out, types, seed):
    """Odd M, N and K (K not a multiple of 32), batches, transposed and sliced views, int8 and uint8 operands,
    summed in int32, int64 or their own result type (int8 @ int8 wraps in int8): numpy's result exactly, on
    cooperative matrices where the device lists the operand types."""
    a = ints(batch + ((k, m + sub) if ta else (m + sub, k)), seed, getattr(np, types[0]))
    b = ints((n, k) if tb else (k, n), seed + 1, getattr(np, types[1]))
    an = np.swapaxes(a, -1, -2) if ta else a
    bn = b.T if tb else b
    ta_, tb_ = Tensor(a), Tensor(b)
    ta_ = ta_.transpose(-1, -2) if ta else ta_
    tb_ = tb_.transpose(-1, -2) if tb else tb_
    ta_, an = ta_[..., sub:, :], an[..., sub:, :]
    with count_kernels() as c:
        got = ta_.matmul(tb_, dtype=out).numpy()
    listed = matmul_coop.int_fragment(realize_mod.limits(), *types) is not None
    assert any(nm.startswith("MC_") and nm.endswith("_i8") for nm in c.names) == listed
    want = np.matmul(an, bn, dtype=getattr(np, out) if out else None)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@needs_i8
def test_int8_epilogue_and_int8_result_on_cooperative_matrices():
    a, b, bias = ints((300, 200), 1), ints((200, 136), 2), ints((130,), 3, np.int32)
    with count_kernels() as c:
        got = (Tensor(a)[7:290, 3:].matmul(Tensor(b)[3:, :130], dtype=dtypes.int32) + Tensor(bias)).maximum(0).numpy()
    assert c.count == 1 and c.names[0].endswith("_i8")
    want = np.maximum(a[7:290, 3:].astype(np.int32) @ b[3:, :130].astype(np.int32) + bias, 0)
    np.testing.assert_array_equal(got, want)
    with count_kernels() as c:
        got8 = (Tensor(a) @ Tensor(b)).numpy()
    assert c.names[0].endswith("_i8") and got8.dtype == np.int8
    np.testing.assert_array_equal(got8, a @ b)
    # dequantized in the epilogue: the int32 sum rounded to float32 once, then the two scales, as numpy does
    sa, sb = np.random.default_rng(4).random((300, 1), np.float32), np.random.default_rng(5).random(136, np.float32)
    with count_kernels() as c:
        got = (Tensor(a).matmul(Tensor(b), dtype=dtypes.int32).cast(dtypes.float32) * Tensor(sa) * Tensor(sb)).numpy()
    assert c.count == 1 and c.names[0].endswith("_i8")
    np.testing.assert_allclose(got, np.matmul(a, b, dtype=np.int32).astype(np.float32) * sa * sb, rtol=2**-22)


@needs_i8
def test_int8_longest_exact_sum_on_cooperative_matrices():
    """K = INT8_MAX_K products of -128 * -128: 2^31 - 2^14, the largest int32 sum the path allows."""
    k = matmul_coop.INT8_MAX_K
    a = np.full((64, k), -128, np.int8)
    b = np.full((k, 64), -128, np.int8)
    b[:, 1] = 127
    with count_kernels() as c:
        got = Tensor(a).matmul(Tensor(b), dtype=dtypes.int32).numpy()
    assert c.names[0].endswith("_i8")
    np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64))


@needs_i8
@pytest.mark.parametrize("tb", [False, True])
def test_every_int8_tile_configuration_matches_numpy(tb):
    from vkgraph import graph
    from vkgraph.schedule import Kernel
    from vkgraph.view import ShapeTracker

    dev, lim, d = get_device(), realize_mod.limits(), dtypes.int8
    m, n, k = 200, 144, 300
    a, b = ints((m, k), 11), ints((n, k) if tb else (k, n), 12)
    na = graph.alu(graph.Op.CAST, dtypes.int32, graph.buffer(realize_mod.upload(a, d), 0, d, a.shape))
    nb = graph.buffer(realize_mod.upload(b, d), 0, d, b.shape)
    if tb:
        nb = graph.movement(nb, lambda s: s.permute((1, 0)))
    mm = graph.matmul(na, graph.alu(graph.Op.CAST, dtypes.int32, nb), dtypes.int32)
    out = realize_mod.allocate(dtypes.int32, mm.numel)
    kern = Kernel(mm, out, ShapeTracker.contiguous(mm.shape))
    frag = matmul_coop.fragment(lim, "int8")
    want = a.astype(np.int64) @ (b.T if tb else b).astype(np.int64)
    for cfg in matmul_coop.configs(d):
        if not cfg.fits(frag, lim, 1):
            continue
        (prog,) = matmul_coop.lower_coop(kern, mm, lim, {}, cfg, d).programs
        dev.upload(out.buf, np.full(m * n, -7, np.int32).view(np.uint8))  # poison: every element is written
        dev.dispatch(dev.pipeline(prog.src, name=prog.name), [ref.buf for ref, _, _ in prog.bindings], prog.groups,
                     prog.push or None)
        np.testing.assert_array_equal(realize_mod.download(out, (m, n)), want, err_msg=str(cfg))


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


@pytest.mark.parametrize("layer", [(1, 3, 239), (1, 3, 280), (1, 3, 301), (1, 4, 320)])
def test_an_older_validation_layer_leaves_off_what_it_cannot_check(layer):
    from types import SimpleNamespace

    from vkgraph.runtime.device import CoopFlexShape, CoopVecTypes, Device, layer_knows_hand_laid, vk

    shapes = tuple(CoopShape(*c[:3], *c[3:], scope="subgroup") for c in COOP)
    flexible = tuple(CoopFlexShape(32, 32, 16, t, t, "float32", "float32", invocations=256)
                     for t in ("float16", "bfloat16"))
    stub = SimpleNamespace(validation_version=vk.VK_MAKE_VERSION(*layer),
                           info=SimpleNamespace(cooperative_matrix=shapes, bfloat16_cooperative_matrix=True,
                                                cooperative_matrix_flexible=flexible,
                                                cooperative_matrix_tensor_addressing=True,
                                                cooperative_vector=(CoopVecTypes(*["float16"] * 5, False),),
                                                cooperative_vector_max_components=64))
    Device._within_validation(stub)
    kept = {s.a for s in stub.info.cooperative_matrix}
    assert kept == {(1, 3, 239): set(), (1, 3, 280): {"float16"}, (1, 3, 301): {"float16"},
                    (1, 4, 320): {"float16", "bfloat16"}}[layer]
    # VK_NV_cooperative_matrix2 (workgroup scope) and VK_NV_cooperative_vector are known to layers from 1.3.300:
    # older ones never see them queried (their property structures would be reported), newer ones keep them
    assert layer_knows_hand_laid(stub.validation_version) == (layer >= (1, 3, 300))
    assert layer_knows_hand_laid(None)
    if layer >= (1, 3, 300):
        assert {s.a for s in stub.info.cooperative_matrix_flexible} == kept
        assert stub.info.cooperative_matrix_tensor_addressing
        assert len(stub.info.cooperative_vector) == 1 and stub.info.cooperative_vector_max_components == 64
    assert stub.info.bfloat16_cooperative_matrix == (layer >= (1, 4, 311))

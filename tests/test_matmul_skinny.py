"""Products of few rows over quantized weights (templates.matmul_skinny): the configuration follows the device's
limits, every program compiles, and results match numpy in float64, on devices without cooperative matrices
with the matrix operations emulated (test_matmul_coop.emulate_coop), on a device that has them as they are."""

from __future__ import annotations

import numpy as np
import pytest
from test_matmul_coop import COOP, F16, compiles, emulate_coop, fake_limits, needs_f16
from test_matmul_quant import _check

import vkgraph.realize as realize_mod
from vkgraph.quant import dequantize, random_blocks
from vkgraph.runtime import get_device
from vkgraph.templates import matmul_skinny as ms
from vkgraph.templates import matvec as mv
from vkgraph.templates.matvec import upload_weights


def _emulate(monkeypatch, coop=COOP):
    """emulate_coop with the matrix operations' loops rolled (the emulated programs build in seconds)."""
    return emulate_coop(monkeypatch, coop, rolled=True)


def _int8_acts(dev, rng, m: int, k: int):
    """m rows of int8 blocks (Q8Acts, quantized on the device from random float32 rows), its buffers, and the
    values they stand for rounded to float16 as the product stages them."""
    xf = rng.standard_normal((m, k)).astype(np.float32)
    xb = dev.alloc(xf.nbytes)
    dev.upload(xb, xf)
    xq, xd, xs = mv.quantize_activations(dev, xb, m, k)
    q = dev.download(xq, np.int8, (m, k)).astype(np.float32)
    d = dev.download(xd, np.float32, (m, k // 32))
    return mv.Q8Acts(xq, xd, xs), [xb, xq, xd, xs], (q * np.repeat(d, 32, axis=1)).astype(np.float16)


def _case(lim, fmt: str, m: int, n: int, k: int, cfg: ms.Skinny | None = None, seed: int = 0,
          int8: bool = False, residual: bool = False) -> None:
    """One product against numpy in float64, over a NaN-poisoned output (every element must be written); with K
    split over workgroups twice over one Scratch (its counters back at zero after each product). x: float16 rows
    (with rows past m, where read, full of infinities), or int8 blocks; with residual, y = x @ W.T + r."""
    dev = get_device()
    rng = np.random.default_rng(seed)
    qt = random_blocks(rng, fmt, n, k)
    cfg = cfg or ms.config(lim, m, n, k, int8)
    assert cfg is not None
    out = dev.alloc(m * n * 4)
    if int8:
        xin, bufs, x = _int8_acts(dev, rng, m, k)
    else:
        mb = ms.x_rows(ms.fragment(lim), m) if not cfg.xs else m
        x = rng.standard_normal((mb, k)).astype(np.float16)
        x[m:] = np.inf  # rows past m are read; their products must not reach y
        xin = dev.alloc(x.nbytes)
        dev.upload(xin, x)
        bufs = [xin]
    weights = upload_weights(dev, qt)
    r = rng.standard_normal((m, n)).astype(np.float32) if residual else np.zeros((m, n))
    rb = dev.alloc(m * n * 4) if residual else None
    if rb is not None:
        dev.upload(rb, r)
        bufs.append(rb)
    sc = ms.scratch(dev, cfg, ms.fragment(lim), m, n) if cfg.ks > 1 else None
    for _ in range(2 if sc else 1):
        dev.upload(out, np.full(m * n, np.nan, np.float32))
        ms.matmul_skinny(dev, lim, weights, xin, m, cfg, out=out, scratch=sc, residual=rb)
        got = dev.download(out, np.float32, (m, n))
        _check(got, x[:m], dequantize(qt).reshape(n, k), r)
    if sc:
        assert not dev.download(sc.counters, np.uint32).any()
    for buf in (*bufs, out, weights.body, *([weights.scales] if weights.scales is not None else []),
                *([sc.partial, sc.counters] if sc else [])):
        buf.release()


def test_config_follows_the_device():
    lim = fake_limits()
    assert ms.fragment(lim) == (16, 8, 16)  # the narrowest listed: eight rows of x need no padding
    assert ms.fragment(fake_limits(coop=((16, 16, 16) + F16,))) == (16, 16, 16)
    assert ms.fragment(fake_limits(coop=())) is None
    cfg = ms.config(lim, 8, 4096, 4096)
    assert cfg is not None and cfg.fits((16, 8, 16), lim, 4096, 8) and cfg.bk == 256
    assert ms.config(lim, 8, 4096, 4096 + 128).bk == 128  # the deepest slice that divides K
    assert ms.config(lim, 33, 4096, 4096) is None and ms.config(lim, 0, 4096, 4096) is None
    assert ms.config(lim, 8, 4096, 48) is None  # K not whole blocks
    assert ms.config(fake_limits(coop=()), 8, 4096, 4096) is None
    assert ms.config(fake_limits(min_subgroup=32, max_subgroup=64), 8, 4096, 4096) is None
    # shared memory bounds the subgroups a workgroup has at 256-deep slices (each decodes its own)
    assert not ms.Skinny(8, 256).fits((16, 8, 16), lim, 4096)
    # int8 x is staged: K split into the fewest parts whose x fits beside the slices (48 KiB), else shallower slices
    assert ms.config(lim, 8, 4096, 4096, int8=True) == ms.Skinny(2, 128, 4, 1, 4, 2, 1)
    assert ms.config(lim, 32, 4096, 4096, int8=True) == ms.Skinny(2, 128, 4, 1, 16, 2, 1)
    assert ms.config(lim, 32, 4096, 14336, int8=True) == ms.Skinny(2, 64, 4, 1, 32, 2, 1)
    # 129 blocks: whole slices only 32 deep and no split of them, where x does not fit whole
    assert ms.split(ms.Skinny(2, 128, 3, 1, 1, 2, 1), (16, 8, 16), lim, 4096 + 32, 8) is None
    assert ms.x_rows((16, 8, 16), 1) == 8 and ms.x_rows((16, 8, 16), 17) == 24 and ms.x_rows((16, 16, 16), 17) == 32


@pytest.mark.parametrize("fmt", ms.FORMATS)
def test_programs_compile(fmt):
    lim = fake_limits()
    for cfg, mb in ((ms.Skinny(4, 256, 3), 8), (ms.Skinny(2, 128, 2, 2), 32), (ms.Skinny(2, 128, 3, 1, 2, 2), 24)):
        compiles(ms.source(fmt, 4096, 4096, 4096 // 32, 4096 // 32, cfg, (16, 8, 16), lim.subgroup, mb))


def _barrier_semantics(src: str) -> list[int]:
    """The memory semantics of every OpControlBarrier and OpMemoryBarrier in src's SPIR-V."""
    import struct

    from vkgraph.runtime.compiler import Compiler

    spv = Compiler(backend="glslang").compile(src, target="vulkan1.3")
    words = struct.unpack(f"<{len(spv) // 4}I", spv)
    consts, found, i = {}, [], 5
    while i < len(words):
        op, count = words[i] & 0xFFFF, words[i] >> 16
        if op == 43:  # OpConstant: result type, id, value
            consts[words[i + 2]] = words[i + 3]
        elif op in (224, 225):  # OpControlBarrier (exec, mem, semantics), OpMemoryBarrier (mem, semantics)
            found.append(consts[words[i + count - 1]])
        i += count
    return found


def test_the_loop_never_waits_for_device_memory():
    """No barrier of a product without a K split over workgroups orders device memory (UniformMemory, 0x40): the
    reads of W in flight must not be waited for at each slice; shared memory (0x100) is what the barriers order."""
    for cfg in (ms.Skinny(2, 128, 3), ms.Skinny(2, 128, 3, 1, 1, 2, 1)):
        for int8 in (False, True) if cfg.xs else (False,):
            found = _barrier_semantics(ms.source("Q4_0", 4096, 4096, 128, 128, cfg, (16, 8, 16), 32, 8, int8))
            assert found and all(sem & 0x100 and not sem & 0x40 for sem in found), found


def test_errors_before_any_gpu_work(monkeypatch):
    lim = _emulate(monkeypatch)
    dev = get_device()
    qt = random_blocks(np.random.default_rng(0), "Q4_0", 32, 256)
    weights = upload_weights(dev, qt)
    x = dev.alloc(8 * 256 * 2)
    cfg = ms.Skinny(2, 64, 2)
    with pytest.raises(ValueError, match="rows"):
        ms.matmul_skinny(dev, lim, weights, x, 33, cfg)
    with pytest.raises(ValueError, match="smaller"):  # 9 rows read 16
        ms.matmul_skinny(dev, lim, weights, x, 9, cfg)
    with pytest.raises(ValueError, match="slices"):
        ms.matmul_skinny(dev, lim, weights, x, 8, ms.Skinny(2, 96, 2))
    with pytest.raises(ValueError, match="slices"):  # 8 slices in 3 parts
        ms.matmul_skinny(dev, lim, weights, x, 8, ms.Skinny(2, 32, 2, 1, 3))
    with pytest.raises(ValueError, match="Scratch"):
        ms.matmul_skinny(dev, lim, weights, x, 8, ms.Skinny(2, 32, 2, 1, 2))
    acts, bufs, _ = _int8_acts(dev, np.random.default_rng(1), 8, 256)
    with pytest.raises(ValueError, match="xs"):  # int8 blocks are staged
        ms.matmul_skinny(dev, lim, weights, acts, 8, cfg)
    for buf in bufs:
        buf.release()
    x.release()


@pytest.mark.parametrize("m", [1, 3, 8, 17, 32])
def test_q4_0_emulated_matches_numpy(m, monkeypatch):
    """Ragged N (a last workgroup of fewer rows), 14 slices over 2 subgroups (7 each, the last trip of 3 register
    sets cut short), and rows of x past m full of infinities."""
    _case(_emulate(monkeypatch), "Q4_0", m, 40, 448, ms.Skinny(2, 32, 3), seed=m)


@pytest.mark.parametrize("m,cfg", [(17, ms.Skinny(2, 32, 3, 1, 2)), (3, ms.Skinny(1, 32, 2, 2, 7))])
def test_k_split_over_workgroups_emulated_matches_numpy(m, cfg, monkeypatch):
    """K split in 2 parts of 7 slices (over 2 subgroups: 4 and 3) and in 7 parts of 2 slices (one subgroup, two
    fragments of W rows), the last workgroup of each rows summing the parts."""
    _case(_emulate(monkeypatch), "Q4_0", m, 40, 448, cfg, seed=m)


@pytest.mark.parametrize("m,cfg", [(8, ms.Skinny(2, 32, 2, 1, 1, 2)), (17, ms.Skinny(1, 32, 3, 1, 2, 3))])
def test_subgroups_on_rows_emulated_match_numpy(m, cfg, monkeypatch):
    """Subgroups on distinct rows of W in a workgroup: 2 of them (each with 2 splitting K), the second workgroup
    ragged; 3 of them over K split in 2 parts, one workgroup past N's 40 rows."""
    _case(_emulate(monkeypatch), "Q4_0", m, 40, 448, cfg, seed=m + 2)


@pytest.mark.parametrize("m,cfg,int8", [(3, ms.Skinny(2, 32, 3, 1, 2, 2, 1), True),
                                        (17, ms.Skinny(1, 64, 2, 2, 1, 1, 1), True),
                                        (9, ms.Skinny(2, 32, 2, 1, 7, 1, 1), False)])
def test_staged_x_emulated_matches_numpy(m, cfg, int8, monkeypatch):
    """x's part of K staged in shared memory first: int8 blocks over K split in 2 (2 x 2 subgroups), over all of K
    (two fragments of W rows); float16 rows (exactly m of them: no padding read) over K split in 7. A residual
    added where K is split (by the last workgroup) and where not."""
    _case(_emulate(monkeypatch), "Q4_0", m, 40, 448, cfg, seed=m + 4, int8=int8, residual=m != 3)


@pytest.mark.parametrize("fmt,cfg", [("Q8_0", ms.Skinny(2, 32, 2, 2)), ("Q4_K", ms.Skinny(3, 64, 1)),
                                     ("Q6_K", ms.Skinny(1, 32, 4))])
def test_formats_emulated_match_numpy(fmt, cfg, monkeypatch):
    """Two fragments of W rows a subgroup; 4 slices over 3 subgroups (2, 1 and 1) with no slice in flight; 8 over
    one subgroup with three in flight."""
    _case(_emulate(monkeypatch), fmt, 5, 48, 256, cfg, seed=1)


def test_square_fragments_emulated_match_numpy(monkeypatch):
    """A device listing 16 x 16 x 16 alone: x in fragments of 16 rows."""
    _case(_emulate(monkeypatch, ((16, 16, 16) + F16,)), "Q4_0", 20, 40, 256, ms.Skinny(2, 32, 2), seed=3)


@needs_f16
@pytest.mark.parametrize("m", [1, 3, 8, 17, 32])
def test_on_device_matches_numpy(m):
    """The default configurations (float16 and int8 x) on the Llama-3-8B o product's shape (Q4_0), and on a ragged
    one in each format."""
    lim = realize_mod.limits()
    for int8 in (False, True):
        _case(lim, "Q4_0", m, 4096, 4096, seed=m, int8=int8, residual=m == 8)
        for fmt in ms.FORMATS:
            _case(lim, fmt, m, 200, 1024 + 256, seed=m + 1, int8=int8)


@needs_f16
@pytest.mark.parametrize("cfg", [ms.Skinny(sg, bk, depth, frags) for sg in (1, 2, 4) for bk in (128, 256)
                                 for depth in (2, 4) for frags in (1, 2)]
                         + [ms.Skinny(2, 128, 3, 1, 4), ms.Skinny(1, 128, 2, 4, 2), ms.Skinny(4, 256, 3, 1, 2),
                            ms.Skinny(1, 256, 3, 1, 4, 4), ms.Skinny(2, 128, 2, 2, 2, 2),
                            ms.Skinny(2, 128, 3, 1, 4, 2, 1), ms.Skinny(1, 64, 3, 2, 8, 2, 1)])
def test_configurations_on_device_match_numpy(cfg):
    lim = realize_mod.limits()
    if not cfg.fits(ms.fragment(lim), lim, 2048, 32):
        pytest.skip(f"{cfg} does not fit this device")
    _case(lim, "Q4_0", 32, 96, 2048, cfg, seed=5, int8=bool(cfg.xs))

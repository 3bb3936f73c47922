"""benchmarks/probe_coop_peak.py without cooperative matrices: its kernels compile to SPIR-V (glslang needs no
device for that), its staging kernel reads the tile's chunks (checked against numpy), and the script exits cleanly
on a device without them."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from vkgraph.codegen.matmul_coop import Config

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "probe_coop_peak.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("probe_coop_peak", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


# the fragment shapes an H200 lists (benchmarks/RESULTS.md), as the probe takes them
H200 = [(16, 16, 16, "float16", "float32"), (16, 16, 16, "float16", "float16"), (16, 8, 16, "float16", "float32"),
        (16, 8, 8, "float16", "float16"), (16, 16, 32, "int8", "int32"), (16, 8, 32, "int8", "int32"),
        (16, 16, 16, "bfloat16", "float32")]


def test_kernels_compile(dev, probe):
    srcs = [probe.reg_source(probe.Frag(*s), nsub, gm, gn, 32) for s in H200 for nsub, gm, gn in ((1, 1, 1), (8, 4, 4))]
    srcs += [probe.shared_source(t, 32) for t in (probe.SharedTile(2, 4, 4, 4, barriers=2),
                                                   probe.SharedTile(2, 4, 4, 4, a_col=True),
                                                   probe.SharedTile(4, 2, 4, 4, b_col=True, pad=0),
                                                   probe.SharedTile(2, 4, 4, 2, barriers=2, bk=64))]
    srcs += [probe.stage_source(cfg, 4096, 32, pf, store) for cfg in (probe.TILE,) + probe.MORE_TILES
             for pf, store in ((1, True), (2, True), (1, False))]
    for src in srcs:
        assert dev.compiler.compile(src, target="vulkan1.3")


def test_staging_reads_the_tiles(dev, probe):
    """Loads alone: each invocation's XOR of its chunks equals numpy's over the same chunks, in the grouped tile
    order, with a workgroup per tile and with 3 workgroups taking every third; with shared stores, one slice in
    flight and two give the same result."""
    sg, size, cfg = dev.info.subgroup_size, 256, Config(64, 128, 32, 2, 2, 1)
    nt, tiles = cfg.wm * cfg.wn * sg, (256 // 64) * (256 // 128)
    rng = np.random.default_rng(0)
    a, b = (rng.integers(0, 2**32, (size, size // 8, 4), dtype=np.uint32) for _ in range(2))
    ba, bb, out = dev.alloc(a.nbytes), dev.alloc(b.nbytes), dev.alloc(tiles * nt * 16)
    dev.upload(ba, a)
    dev.upload(bb, b)
    got = {}
    try:
        for pf, store, groups in ((1, False, tiles), (1, False, 3), (1, True, tiles), (2, True, tiles)):
            dev.dispatch(dev.pipeline(probe.stage_source(cfg, size, sg, pf, store)), [ba, bb, out], (groups, 1, 1))
            got[pf, store, groups] = dev.download(out, np.uint32, (groups, nt, 4))
    finally:
        for buf in (ba, bb, out):
            buf.release()
    ref = np.zeros((tiles, nt, 4), np.uint32)
    tiles_m, tiles_n = size // cfg.bm, size // cfg.bn
    for g in range(tiles):
        first = g // (8 * tiles_n) * 8
        rows = min(tiles_m - first, 8)
        tm, tn = first + g % rows, g % (8 * tiles_n) // rows
        for kt in range(size // cfg.bk):
            a_slice = a[tm * cfg.bm:(tm + 1) * cfg.bm, kt * 4:(kt + 1) * 4]
            b_slice = b[kt * cfg.bk:(kt + 1) * cfg.bk, tn * cfg.bn // 8:(tn + 1) * cfg.bn // 8]
            for chunks in (a_slice.reshape(-1, nt, 4), b_slice.reshape(-1, nt, 4)):
                ref[g] ^= np.bitwise_xor.reduce(chunks, axis=0)
    np.testing.assert_array_equal(got[1, False, tiles], ref)
    np.testing.assert_array_equal(got[1, False, 3], [np.bitwise_xor.reduce(ref[w::3], axis=0) for w in range(3)])
    np.testing.assert_array_equal(got[1, True, tiles], got[2, True, tiles])


def test_exits_without_cooperative_matrices(dev, probe, monkeypatch, capsys):
    if dev.info.cooperative_matrix:
        pytest.skip(f"{dev.info.name} has cooperative matrices")
    monkeypatch.setattr(sys, "argv", ["probe_coop_peak.py"])
    probe.main()
    assert "no cooperative matrices" in capsys.readouterr().out

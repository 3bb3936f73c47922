"""The streaming small-row product (templates.matmul_skinny) beside the matvec and matmul_quant's small-row tile,
on a decode step's products: GB/s of weight bytes and GPU microseconds per product.

    python benchmarks/bench_skinny.py [--formats Q4_0] [--rows 1,8,16,32] [--products qkv,o,gate_up,down]
                                      [--sweep] [--sweep-rows 8,32] [--reps 10]

For each format, product of a Llama-3-8B layer and number of activation rows, the product alone is timed
(100 calls captured into one command graph, common.capture_graph; every graph of a product captured first, then
the clocks raised, common.raise_clocks, and the graphs replayed in turn, common.replay_many_us; weights cycled
through copies past the L2, bench_kernels._weight_copies):
- matvec: the matvec the decode step runs (matvec.choose_config, subgroup-rows launch), on int8 activations where
  the integer path runs (quantized beforehand, as the fused decode step feeds it);
- tile: matmul_quant's small-row tile (decode_config) on the same int8 activations; a tile that splits K writes
  partial planes that the decode step sums in one more kernel, not in this time;
- skinny: matmul_skinny's default configuration (config) on float16 activations;
- skinny8: its default configuration for int8 activations (x staged in shared memory) on the int8 activations.
--sweep also times matmul_skinny's configurations around the default at --sweep-rows rows and prints them
fastest first (float16 x from SWEEP, int8 x staged from XS_SWEEP), each as sg (subgroups per workgroup) / bk
(slice depth) / d (register sets) / f (16-row fragments of W per subgroup) / ks (workgroups splitting K) / wn
(subgroups on distinct rows of W) / xs (x staged), the last three where used.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from bench_kernels import _release_weights, _weight_copies
from bench_matvec_launch import _acts, _cell, mm_run, product_run
from common import capture_graph, raise_clocks, replay_many_us

from vkgraph.quant import FORMATS
from vkgraph.realize import limits
from vkgraph.runtime import get_device
from vkgraph.templates import matmul_quant as mq
from vkgraph.templates import matmul_skinny as ms
from vkgraph.templates import matvec as mv

PRODUCTS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
# (sg, bk, depth, frags, ks, wn): subgroups splitting K, slice depth and register sets, fragments of W rows per
# subgroup (more: fewer reads of x per weight byte), K split over workgroups (more of them), subgroups on distinct
# rows of W walking the same slices (x read once per workgroup from the L2)
SWEEP = [ms.Skinny(*c) for c in (
    (2, 128, 2), (2, 128, 4), (2, 256, 2), (2, 256, 4), (2, 128, 3, 2), (2, 256, 3, 2),
    (4, 128, 2), (4, 128, 4), (4, 256, 2), (4, 256, 4), (4, 128, 3, 2), (8, 128, 3),
    (1, 128, 2, 4), (2, 128, 3, 4),
    (2, 128, 3, 2, 2), (2, 128, 3, 2, 4), (2, 128, 3, 4, 4), (1, 128, 3, 4, 8), (4, 256, 3, 1, 2),
    (1, 256, 3, 1, 4, 4), (2, 128, 3, 1, 2, 4), (1, 128, 3, 2, 4, 4), (1, 256, 3, 1, 1, 4))]
# x staged in shared memory (xs), timed on int8 activations: (sg, bk, depth, frags, wn), K split into the fewest
# parts whose x fits beside the slices (matmul_skinny.split)
XS_SWEEP = [ms.Skinny(sg, bk, depth, frags, 1, wn, 1) for sg, bk, depth, frags, wn in (
    (2, 128, 3, 1, 2), (1, 128, 3, 1, 4), (1, 128, 3, 2, 2), (2, 64, 3, 2, 1), (4, 64, 3, 1, 1), (1, 256, 2, 1, 4),
    (2, 64, 3, 1, 2), (1, 64, 4, 1, 4))]


def _skinny_run(dev, lim, ws, x, y, rows: int, cfg: ms.Skinny, sc: ms.Scratch) -> Callable[[], None]:
    calls = itertools.count()
    return lambda: ms.matmul_skinny(dev, lim, ws[next(calls) % len(ws)], x, rows, cfg, out=y, scratch=sc)


def _capture(dev, run: Callable[[], None]) -> Any:
    """run's calls captured into a graph (common.capture_graph), or the error it raised (printed in its place, so
    that the others still run: a pipeline the driver refuses)."""
    try:
        return capture_graph(dev, run)
    except Exception as e:
        dev.synchronize()
        return f"{type(e).__name__}: {str(e)[:200]}"


def _label(c: ms.Skinny) -> str:
    return (f"sg{c.sg}/bk{c.bk}/d{c.depth}/f{c.frags}" + (f"/ks{c.ks}" if c.ks > 1 else "")
            + (f"/wn{c.wn}" if c.wn > 1 else "") + ("/xs" if c.xs else ""))


def _result(nbytes: int, times: dict, graphs: dict, rows: int, key: Any) -> str:
    """The cell of (rows, key): its time, or the error its capture raised, or '-' where there was none."""
    return _cell(nbytes, times.get((rows, key), graphs.get((rows, key))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="Q4_0")
    ap.add_argument("--rows", default="1,8,16,32")
    ap.add_argument("--products", default="", help="only these products, e.g. o,gate_up (default: all)")
    ap.add_argument("--sweep", action="store_true", help="also time matmul_skinny's configurations")
    ap.add_argument("--sweep-rows", default="8,32")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    dev = get_device()
    lim = limits()
    frag = ms.fragment(lim)
    rng = np.random.default_rng(0)
    print(f"{dev.info.name}: GB/s of weight bytes and us per product; fragment {frag}, subgroup {lim.subgroup}")
    print(f"{'fmt':>5s} {'product':>8s} {'N x K':>13s} {'rows':>4s} {'matvec GB/s us':>15s} {'tile GB/s us':>15s} "
          f"{'skinny GB/s us':>15s} {'skinny8 GB/s us':>15s}  skinny config / skinny8 config")
    for fmt in a.formats.split(","):
        f = FORMATS[fmt]
        for name, n, k in PRODUCTS:
            if a.products and name not in a.products.split(","):
                continue
            nbytes = n * f.row_bytes(k)
            ws = _weight_copies(dev, rng, fmt, n, k)
            # every product of this shape captured first (compiled and warmed up), then timed in turn after the
            # clocks are raised: compiling and generating weights leave the GPU idle, and an idle H200 drops its
            # clocks (common.raise_clocks)
            graphs: dict = {}
            keep: list = []
            rows_list = [int(r) for r in a.rows.split(",")]
            for rows in rows_list:
                cfg_mv = mv.choose_config(dev, f, n, k, rows, subgroup_rows=True)
                x, bufs = _acts(dev, rng, rows, k, cfg_mv.int_dot)
                q8 = x if isinstance(x, mv.Q8Acts) else mv.Q8Acts(*mv.quantize_activations(dev, x, rows, k))
                if q8 is not x:
                    bufs += [q8.xq, q8.xd, q8.xs]
                y = dev.alloc(8 * rows * n * 4)  # room for the tile's partial planes
                mb = ms.x_rows(frag, rows) if frag else rows
                xh = dev.alloc(mb * k * 2)
                dev.upload(xh, rng.standard_normal((mb, k)).astype(np.float16))
                sc = ms.scratch(dev, ms.Skinny(ks=ms.MAX_SPLIT), frag, rows, n) if frag else None
                keep += [*bufs, y, xh, *([sc.partial, sc.counters] if sc else [])]
                graphs[rows, "matvec"] = _capture(dev, product_run(dev, ws, x, y, rows, cfg_mv))
                tile = mq.decode_config(lim, rows, n, k) if fmt in mq.FORMATS else None
                if tile is not None:
                    graphs[rows, "tile"] = _capture(dev, mm_run(dev, ws, q8, y, rows, tile))
                configs = {"skinny": ms.config(lim, rows, n, k) if fmt in ms.FORMATS else None,
                           "skinny8": ms.config(lim, rows, n, k, int8=True) if fmt in ms.FORMATS else None}
                if a.sweep and frag and fmt in ms.FORMATS and str(rows) in a.sweep_rows.split(","):
                    configs.update({c: c for c in SWEEP if c.fits(frag, lim, k, mb)})
                    configs.update({t: t for c in XS_SWEEP if (t := ms.split(c, frag, lim, k, mb)) is not None})
                for key, cfg in configs.items():
                    if cfg is not None:
                        xin = q8 if cfg.xs else xh
                        graphs[rows, key] = _capture(dev, _skinny_run(dev, lim, ws, xin, y, rows, cfg, sc))
                graphs[rows, "configs"] = configs
            timed = {key: g for key, g in graphs.items() if key[1] != "configs" and not isinstance(g, str)}
            raise_clocks()
            times = replay_many_us(dev, timed, a.reps)
            for rows in rows_list:
                configs = graphs[rows, "configs"]
                cell = partial(_result, nbytes, times, graphs, rows)
                cfg, cfg8 = configs["skinny"], configs["skinny8"]
                print(f"{fmt:>5s} {name:>8s} {n:>6d}x{k:<6d} {rows:>4d} {cell('matvec'):>15s} {cell('tile'):>15s} "
                      f"{cell('skinny'):>15s} {cell('skinny8'):>15s}  {_label(cfg) if cfg else '-'} / "
                      f"{_label(cfg8) if cfg8 else '-'}", flush=True)
                swept = [c for c in configs if isinstance(c, ms.Skinny)]
                if swept:
                    ok = sorted((c for c in swept if (rows, c) in times), key=lambda c: times[rows, c])
                    print("      skinny, fastest first (GB/s us): " + ", ".join(
                        f"{_label(c)} {cell(c)}" for c in ok), flush=True)
                    for c in swept:
                        if (rows, c) not in times:
                            print(f"      {_label(c)}: {cell(c)}", flush=True)
            for g in timed.values():
                g.destroy()
            for buf in keep:
                buf.release()
            _release_weights(ws)

if __name__ == "__main__":
    main()

"""The streaming small-row product (templates.matmul_skinny) beside the matvec and matmul_quant's small-row tile,
on a decode step's products: GB/s of weight bytes and GPU microseconds per product.

    python benchmarks/bench_skinny.py [--formats Q4_0] [--rows 1,8,16,32] [--products qkv,o,gate_up,down]
                                      [--sweep] [--sweep-rows 8,32] [--reps 10]

For each format, product of a Llama-3-8B layer and number of activation rows, the product alone is timed
(benchmarks/common.replay_us after common.raise_clocks: 100 calls captured into one command graph and replayed;
weights cycled through copies past the L2, bench_kernels._weight_copies):
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

import numpy as np
from bench_kernels import _release_weights, _weight_copies
from bench_matvec_launch import _acts, mm_us, product_us
from common import raise_clocks, replay_us

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


def skinny_us(dev, ws, x, y, rows: int, cfg: ms.Skinny, reps: int, sc: ms.Scratch | None = None) -> float:
    """GPU microseconds of one matmul_skinny product of `rows` float16 rows with cfg, on the next weight copy."""
    lim, calls = limits(), itertools.count()

    def run() -> None:
        ms.matmul_skinny(dev, lim, ws[next(calls) % len(ws)], x, rows, cfg, out=y, scratch=sc)

    return replay_us(dev, run, reps)


def _timed(dev, ws, x, y, rows: int, cfg: ms.Skinny, reps: int, sc: ms.Scratch) -> float | str:
    """skinny_us, or the error a configuration raised (printed in its place, so that the others still run)."""
    try:
        return skinny_us(dev, ws, x, y, rows, cfg, reps, sc)
    except Exception as e:  # a pipeline the driver refuses: report it, time the rest
        return f"{type(e).__name__}: {str(e)[:200]}"


def _label(c: ms.Skinny) -> str:
    return (f"sg{c.sg}/bk{c.bk}/d{c.depth}/f{c.frags}" + (f"/ks{c.ks}" if c.ks > 1 else "")
            + (f"/wn{c.wn}" if c.wn > 1 else "") + ("/xs" if c.xs else ""))


def _cell(nbytes: int, us: float | str | None) -> str:
    return "-" if us is None else us if isinstance(us, str) else f"{nbytes / us / 1e3:6.0f} {us:7.1f}"


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
    raise_clocks()
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
            for rows in (int(r) for r in a.rows.split(",")):
                cfg_mv = mv.choose_config(dev, f, n, k, rows, subgroup_rows=True)
                x, bufs = _acts(dev, rng, rows, k, cfg_mv.int_dot)
                y = dev.alloc(8 * rows * n * 4)  # room for the tile's partial planes
                t_mv = product_us(dev, ws, x, y, rows, cfg_mv, a.reps)
                tile = mq.decode_config(lim, rows, n, k) if fmt in mq.FORMATS else None
                q8 = x if isinstance(x, mv.Q8Acts) else mv.Q8Acts(*mv.quantize_activations(dev, x, rows, k))
                if q8 is not x:
                    bufs += [q8.xq, q8.xd, q8.xs]
                t_tile = mm_us(dev, ws, q8, y, rows, tile, a.reps) if tile is not None else None
                cfg = ms.config(lim, rows, n, k) if fmt in ms.FORMATS else None
                cfg8 = ms.config(lim, rows, n, k, int8=True) if fmt in ms.FORMATS else None
                t_sk, t_sk8, xh, sc = None, None, None, None
                if cfg is not None:
                    mb = ms.x_rows(frag, rows)
                    xh = dev.alloc(mb * k * 2)
                    dev.upload(xh, rng.standard_normal((mb, k)).astype(np.float16))
                    sc = ms.scratch(dev, ms.Skinny(ks=ms.MAX_SPLIT), frag, rows, n)
                    bufs += [sc.partial, sc.counters]
                    t_sk = _timed(dev, ws, xh, y, rows, cfg, a.reps, sc)
                    if cfg8 is not None:
                        t_sk8 = _timed(dev, ws, q8, y, rows, cfg8, a.reps, sc)
                print(f"{fmt:>5s} {name:>8s} {n:>6d}x{k:<6d} {rows:>4d} {_cell(nbytes, t_mv):>15s} "
                      f"{_cell(nbytes, t_tile):>15s} {_cell(nbytes, t_sk):>15s} {_cell(nbytes, t_sk8):>15s}  "
                      f"{_label(cfg) if cfg else '-'} / {_label(cfg8) if cfg8 else '-'}", flush=True)
                if a.sweep and cfg is not None and str(rows) in a.sweep_rows.split(","):
                    mb = ms.x_rows(frag, rows)
                    staged = [t for c in XS_SWEEP if (t := ms.split(c, frag, lim, k, mb)) is not None]
                    found = {c: _timed(dev, ws, q8 if c.xs else xh, y, rows, c, 3, sc)
                             for c in [c for c in SWEEP if c.fits(frag, lim, k, mb)] + staged}
                    times = {c: t for c, t in found.items() if not isinstance(t, str)}
                    best = sorted(times, key=times.get)
                    print("      skinny, fastest first (GB/s us): " + ", ".join(
                        f"{_label(c)} {_cell(nbytes, times[c])}" for c in best), flush=True)
                    for c, t in found.items():
                        if isinstance(t, str):
                            print(f"      {_label(c)}: {t}", flush=True)
                for buf in (*bufs, y, *([xh] if xh is not None else [])):
                    buf.release()
            _release_weights(ws)


if __name__ == "__main__":
    main()

"""The matvec launches side by side on a decode step's shapes: GB/s of weight bytes, PyTorch's float16 beside.

    python benchmarks/bench_matvec_launch.py [--formats Q4_0,Q8_0,Q4_K] [--batches 1,8,32] [--shapes 8b,1b]
                                             [--products o,gate_up] [--sweep] [--nb-sweep] [--wg-sweep]
                                             [--mm-sweep]
                                             [--reps 10] [--budget 8]

For each format, shape (the products of a Llama-3-8B or Llama-3.2-1B layer and the head) and batch, the product
alone is timed (benchmarks/common.replay_us: 100 calls captured into one command graph, replayed; weights cycled
through copies past the L2) with the activations already quantized to int8 where the integer path runs (as
the fused decode step feeds it: no quantization kernel in the time), in both launches:
- workgroup: a workgroup per few rows, shared-memory reduction (VKGRAPH_MATVEC_LAUNCH=workgroup), 8 rows a call;
- subgroup: groups of a subgroup's lanes per few rows, several units in flight (VKGRAPH_MATVEC_LAUNCH=subgroup).
Batches past 8 run the workgroup launch as calls of 8 rows (as the decode step did) and the subgroup launch
as one call; "default" is the launch choose_config takes (VKGRAPH_MATVEC_LAUNCH=auto, e.g. INT_DOT_ONE_ROW's
entry for the shape at one row), its configuration and figure at the end of the line. "us" is the GPU time of the
whole product; "torch" is torch.matmul of float16 W [N, K] by
float16 x [K, batch] (CUDA events), in GB/s of its own float16 weight bytes. --sweep also times
subgroup-launch configurations around the chosen one (rows per group, units in flight, workgroup size, group
width) and prints the best three. --nb-sweep times the integer path's candidates for 2-16 activation rows
(matvec.SG_INT_DOT_PREFERRED's entries): rows per group and units in flight, each with and without fold (a
unit's runs summed as integers first) and stage (a round's activations staged in shared memory per workgroup),
and the workgroup launch with and without fold; it prints the chosen configuration's figure, the best of each
(fold, stage) pair and the ten fastest, all captured first (at most --budget seconds per product and batch), then
replayed in turn after the clocks are raised. --wg-sweep times the
workgroup launch around the default configuration ("chosen"): invocations per
workgroup, rows per workgroup and rounds of units in flight per invocation (`unroll`), all compiled and captured
first (at most --budget seconds per product and batch), then replayed in turn --reps times after the clocks are
raised; it prints the chosen configuration's figure and the ten fastest, then the finals: the three fastest, each
with fold where the format takes it, and the chosen one timed against each other once more, with a floor (the
chosen and the fastest configuration on 264 rows of the same K, copies within the L2: the fixed cost of a
dependent product).
On a device with float16 cooperative matrices, "mm" times templates.matmul_quant's small-row tile
(decode_config) on the same int8 activations, as a decode step from VKGRAPH_DECODE_MM_ROWS rows runs it: the
product's kernel alone (a tile that splits K over ks workgroups writes ks partial planes; the decode step sums
them in one more small kernel, not in this time). --mm-sweep also times tiles around it and prints them all,
fastest first.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
from bench_kernels import _release_weights, _torch_matvec, _weight_copies
from common import capture_graph, raise_clocks, replay_many_us, replay_us

from vkgraph.quant import FORMATS
from vkgraph.realize import limits
from vkgraph.runtime import get_device
from vkgraph.templates import matmul_quant as mq
from vkgraph.templates import matvec as mv
from vkgraph.templates.common import pow2_ceil

SHAPES = {"8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
                 ("head", 128256, 4096)],
          "1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
                 ("head", 128256, 2048)],
          "smoke": [("small", 96, 512)]}  # a check that the script runs (lavapipe)
# (workgroup size, rows per group, units in flight, group width as a fraction of the chosen one)
SWEEP = [(wg, rows, unroll, tpr_div) for wg in (128, 256) for rows in (1, 2, 4) for unroll in (1, 2, 4, 8)
         for tpr_div in (1, 2)]
# --nb-sweep: (rows per group, units in flight), each with fold and stage, both, neither (in that order: what a
# spent budget leaves out is the least likely to win), then both with workgroups of 256 (twice the groups share
# a staged round)
NB_SWEEP = [(2, 2), (4, 1), (4, 2), (8, 1)]


def _acts(dev, rng, batch: int, k: int, int_dot: bool):
    """batch rows of random activations: float32, or quantized for the integer path (one buffer, Q8Acts)."""
    xs = rng.standard_normal((batch, k)).astype(np.float32)
    x = dev.alloc(xs.nbytes)
    dev.upload(x, xs)
    if not int_dot:
        return x, [x]
    xq, xd, xsum = mv.quantize_activations(dev, x, batch, k)
    return mv.Q8Acts(xq, xd, xsum), [x, xq, xd, xsum]


def _rows(x, r0: int, count: int, k: int):
    return x.rows(r0, count, k) if isinstance(x, mv.Q8Acts) else x.view(r0 * k * 4, count * k * 4)


def product_us(dev, ws, x, y, batch: int, cfg: mv.MatvecConfig, reps: int) -> float:
    """GPU microseconds of one product of `batch` rows: one call, or calls of 8 rows for the workgroup launch."""
    return replay_us(dev, product_run(dev, ws, x, y, batch, cfg), reps)


def product_run(dev, ws, x, y, batch: int, cfg: mv.MatvecConfig) -> Callable[[], None]:
    """One product of `batch` rows as product_us times it, each call on the next of the weight copies `ws`."""
    n, k = ws[0].shape
    per_call = mv.MAX_BATCH_SUBGROUP if cfg.tpr else mv.MAX_BATCH
    calls = itertools.count()

    def run() -> None:
        w = ws[next(calls) % len(ws)]
        for r0 in range(0, batch, per_call):
            b = min(per_call, batch - r0)
            xin = _rows(x, r0, b, k) if batch > b else x
            mv.matvec(dev, w, xin, b, out=y.view(r0 * n * 4, b * n * 4) if batch > b else y, config=cfg)

    return run


def mm_us(dev, ws, x, y, batch: int, cfg: mq.Tile, reps: int) -> float:
    """GPU microseconds of one matmul_quant product of `batch` int8 rows with tile cfg."""
    return replay_us(dev, mm_run(dev, ws, x, y, batch, cfg), reps)


def mm_run(dev, ws, x, y, batch: int, cfg: mq.Tile) -> Callable[[], None]:
    """One matmul_quant product as mm_us times it, each call on the next of the weight copies `ws`."""
    lim, calls = limits(), itertools.count()
    return lambda: mq.matmul_quant(dev, lim, ws[next(calls) % len(ws)], x, batch, cfg, out=y)


def _mm_tiles(base: mq.Tile, k: int) -> list[mq.Tile]:
    """Tiles around `base` for --mm-sweep, each telling what holds the tile back: fewer subgroups per workgroup
    (more workgroups per multiprocessor where registers limit them), shallower slices (less shared memory per
    workgroup), two slices in flight; then other K splits and wider column tiles."""
    found = [replace(base, wk=wk, bk=bk, pf=pf) for wk in (1, 2, 4) for bk in (64, 128, 256) for pf in (1, 2)]
    found += [replace(base, ks=ks) for ks in (1, 2, 8)]
    found += [replace(base, bn=64), replace(base, bn=64, wn=4), replace(base, wk=1, ks=8), replace(base, wk=1, bn=64)]
    fits = [t for t in dict.fromkeys(found)
            if t != base and k % (t.bk * t.ks) == 0 and t.fits((16, 16, 16), limits())]
    return fits


def _tile(t: mq.Tile) -> str:
    return f"{t.bm}x{t.bn}x{t.bk} wn{t.wn} wk{t.wk} ks{t.ks} pf{t.pf}"


def _nb_configs(dev, f, base: mv.MatvecConfig, old: mv.MatvecConfig, batch: int) -> list[mv.MatvecConfig]:
    """--nb-sweep's candidates around the chosen subgroup-rows configuration `base` (its group width; NB_SWEEP's
    order), then the workgroup launch's `old` with and without fold (at most 8 rows)."""
    found = []
    for wg, fold, stage in ((base.wg, True, True), (base.wg, True, False), (base.wg, False, True),
                            (base.wg, False, False), (256, True, True)):
        for rows, unroll in NB_SWEEP:
            if rows * batch > 64 and rows > 2:  # past the registers an invocation has
                continue
            cfg = replace(base, wg=max(wg, base.wg), rows=rows, unroll=unroll,
                          fold=fold and f.name in mv.FOLD_FORMATS, stage=False)
            if stage:
                if not mv.stage_fits(dev, f, cfg, batch):
                    continue
                cfg = replace(cfg, stage=True)
            found.append(cfg)
    if batch <= mv.MAX_BATCH:
        found += [old, replace(old, fold=f.name in mv.FOLD_FORMATS)]
    return list(dict.fromkeys(found))


def _nb_name(c: mv.MatvecConfig) -> str:
    launch = f"sg wg{c.wg} r{c.rows} u{c.unroll} tpr{c.tpr}" if c.tpr else f"wg wg{c.wg} r{c.rows}"
    return launch + (" fold" if c.fold else "") + (" stage" if c.stage else "")


def capture_configs(dev, graphs: dict, configs: list[mv.MatvecConfig], ws, x, y, batch: int, budget: float,
                    what: str) -> None:
    """Each configuration's product (product_run) captured into `graphs` (config -> graph; the caller replays and
    destroys them), in order, until `budget` seconds are spent: the sweeps then replay them all with no compile
    between timings."""
    start = time.perf_counter()
    for cfg in configs:
        if cfg in graphs:
            continue
        if time.perf_counter() - start > budget:
            print(f"      {what}: budget spent after {len(graphs)} configurations", flush=True)
            break
        graphs[cfg] = capture_graph(dev, product_run(dev, ws, x, y, batch, cfg))


def nb_sweep(dev, f, ws, x, y, batch: int, base: mv.MatvecConfig, old: mv.MatvecConfig, reps: int,
             budget: float) -> None:
    """Capture _nb_configs for --budget seconds at most, then replay them in turn after the clocks are raised (as
    wg_sweep: no compile between timings), and print what --nb-sweep promises (GB/s of weight bytes)."""
    nbytes = ws[0].shape[0] * f.row_bytes(ws[0].shape[1])
    graphs = {}
    try:
        capture_configs(dev, graphs, [base, *_nb_configs(dev, f, base, old, batch)], ws, x, y, batch, budget, "nb")
        raise_clocks(1.0)
        times = replay_many_us(dev, graphs, reps)
    finally:
        for graph in graphs.values():
            graph.destroy()
    gbs = {c: nbytes / t / 1e3 for c, t in times.items()}
    best = {}
    for c in sorted(gbs, key=gbs.get, reverse=True):
        best.setdefault((c.tpr > 0, c.fold, c.stage), c)
    print(f"      nb chosen: {_nb_name(base)} {gbs[base]:.0f}; best per (launch, fold, stage): " + ", ".join(
        f"{_nb_name(c)} {gbs[c]:.0f}" for c in best.values()), flush=True)
    print("      nb top: " + ", ".join(f"{_nb_name(c)} {gbs[c]:.0f}"
                                       for c in sorted(gbs, key=gbs.get, reverse=True)[:10]), flush=True)


# --wg-sweep: invocations per workgroup, rows per workgroup, rounds of units in flight
WG_SWEEP = [(wg, rows, unroll) for wg in (128, 64, 256, 32, 512) for rows in (2, 4, 1, 8) for unroll in (1, 2, 4)]
# ... and the subgroup-rows launch's (workgroup size, rows per group, units in flight) for comparison, last
WG_SWEEP_SUBGROUP = [(128, 2, 4), (128, 1, 4), (256, 1, 2), (128, 2, 2)]


FLOOR_ROWS = 264  # --wg-sweep's floor: two rows for each of an H200's 132 multiprocessors


def _wg_configs(dev, f, base: mv.MatvecConfig, k: int, batch: int) -> list[mv.MatvecConfig]:
    """--wg-sweep's candidates in WG_SWEEP's order (most likely first): workgroups no wider than a row's units
    and at least a subgroup, no more rounds in flight than the row has, at most 16 loads in flight and 32 sums
    per invocation; then WG_SWEEP_SUBGROUP's, with the group as wide as choose_config makes it."""
    units = k // mv.UNIT_ELEMS[f.name]
    span = pow2_ceil(units)  # a row's units, to a power of two
    found = []
    for wg, rows, unroll in WG_SWEEP:
        if wg > max(span, dev.info.max_subgroup_size) or wg < dev.info.max_subgroup_size or wg * unroll > max(
                span, wg) or rows * unroll > 16 or rows * batch > 32 or wg > dev.info.max_workgroup_invocations:
            continue
        found.append(replace(base, wg=wg, rows=rows, unroll=unroll, tpr=0, fold=False))
    if "shuffle" in dev.info.subgroup_ops:  # the subgroup-rows launch beside them, as its table would take it
        for wg, rows, unroll in WG_SWEEP_SUBGROUP:
            tpr = mv.group_width(dev, units, unroll)
            if wg >= dev.info.max_subgroup_size and wg % tpr == 0 and wg <= dev.info.max_workgroup_invocations:
                found.append(replace(base, wg=wg, rows=rows, unroll=unroll, tpr=tpr, fold=False))
    return [c for c in dict.fromkeys(found) if c != base]


def _wg_name(c: mv.MatvecConfig) -> str:
    return ("sg " if c.tpr else "") + f"wg{c.wg} r{c.rows} u{c.unroll}" + (" fold" if c.fold else "")


def wg_sweep(dev, f, ws, x, y, batch: int, base: mv.MatvecConfig, rounds: int, budget: float) -> None:
    """What --wg-sweep promises. Every candidate is compiled and captured first (for --budget seconds at most),
    then all are replayed in turn after the clocks are raised, so the host's compiles leave no idle gap between
    timings; the three fastest, fold on each where the format takes it, and the chosen one are then timed against
    each other once more, with the floors."""
    n, k = ws[0].shape
    nbytes = n * f.row_bytes(k)
    graphs, finals = {}, {}
    small = _weight_copies(dev, np.random.default_rng(1), f.name, FLOOR_ROWS, k)
    y_small = dev.alloc(batch * FLOOR_ROWS * 4)
    try:
        capture_configs(dev, graphs, [base, *_wg_configs(dev, f, base, k, batch)], ws, x, y, batch, budget, "wg")
        raise_clocks(1.0)
        first = replay_many_us(dev, graphs, rounds)
        top = sorted(first, key=first.get)[:3]
        for cfg in dict.fromkeys([*top, base]):
            finals[cfg] = graphs[cfg]
            folded = replace(cfg, fold=True)
            if cfg.int_dot and f.name in mv.FOLD_FORMATS and not cfg.fold:
                finals[folded] = capture_graph(dev, product_run(dev, ws, x, y, batch, folded))
        for cfg in (base, top[0]):
            finals[("floor", cfg)] = capture_graph(dev, product_run(dev, small, x, y_small, batch, cfg))
        raise_clocks(0.5)
        last = replay_many_us(dev, finals, rounds)
    finally:
        for graph in {id(g): g for g in (*graphs.values(), *finals.values())}.values():
            graph.destroy()
        _release_weights(small)
        y_small.release()
    gbs = {c: nbytes / t / 1e3 for c, t in first.items()}
    print(f"      wg chosen: {_wg_name(base)} {gbs[base]:.0f}; {len(first)} timed; top: " + ", ".join(
        f"{_wg_name(c)} {gbs[c]:.0f}" for c in sorted(gbs, key=gbs.get, reverse=True)[:10]), flush=True)
    ranked = sorted((c for c in last if isinstance(c, mv.MatvecConfig)), key=last.get)
    print("      wg finals: " + ", ".join(f"{_wg_name(c)} {nbytes / last[c] / 1e3:.0f}" for c in ranked)
          + f"; {FLOOR_ROWS} rows: chosen {last[('floor', base)]:.1f} us, fastest {last[('floor', top[0])]:.1f} us",
          flush=True)


def _cell(nbytes: int, us: float | str | None) -> str:
    """GB/s of `nbytes` and microseconds, or the error text given in their place, or '-' where there was none."""
    return "-" if us is None else us if isinstance(us, str) else f"{nbytes / us / 1e3:6.0f} {us:7.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="Q4_0,Q8_0,Q4_K")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--shapes", default="8b", help="comma-separated: 8b, 1b, smoke")
    ap.add_argument("--products", default="", help="only these products, e.g. o,gate_up (default: all)")
    ap.add_argument("--sweep", action="store_true", help="also sweep subgroup-launch configurations")
    ap.add_argument("--nb-sweep", action="store_true",
                    help="also time the integer path's candidates for 2-16 rows (fold, stage, rows, units in flight)")
    ap.add_argument("--wg-sweep", action="store_true",
                    help="also time workgroup-launch configurations (workgroup size, rows, units in flight, fold)")
    ap.add_argument("--mm-sweep", action="store_true", help="also sweep matmul_quant's small-row tiles")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--budget", type=float, default=8.0, help="--nb-sweep's seconds per product and batch")
    a = ap.parse_args()
    dev = get_device()
    rng = np.random.default_rng(0)
    batches = [int(b) for b in a.batches.split(",")]
    print(f"{dev.info.name}: GB/s of weight bytes and us per product (int8 activations where the integer path "
          f"runs); torch: float16 W, its own bytes")
    print(f"{'fmt':>5s} {'shape':>4s} {'product':>8s} {'N x K':>13s} {'batch':>5s} {'workgroup GB/s us':>18s} "
          f"{'subgroup GB/s us':>17s} {'ratio':>6s} {'torch':>6s} {'mm GB/s us':>14s}  subgroup config / mm tile")
    for fmt in a.formats.split(","):
        f = FORMATS[fmt]
        for shape in a.shapes.split(","):
            for name, n, k in SHAPES[shape]:
                if a.products and name not in a.products.split(","):
                    continue
                nbytes = n * f.row_bytes(k)
                if nbytes > dev.info.max_storage_buffer_range:
                    continue
                ws = _weight_copies(dev, rng, fmt, n, k)
                for batch in batches:
                    old = mv.choose_config(dev, f, n, k, min(batch, mv.MAX_BATCH), subgroup_rows=False)
                    new = mv.choose_config(dev, f, n, k, batch, subgroup_rows=True)
                    x, bufs = _acts(dev, rng, batch, k, new.int_dot)
                    y = dev.alloc(batch * n * 4)
                    t_old = product_us(dev, ws, x, y, batch, old, a.reps)
                    t_new = product_us(dev, ws, x, y, batch, new, a.reps)
                    auto = mv.choose_config(dev, f, n, k, batch)
                    t_auto = {old: t_old, new: t_new}.get(auto) or product_us(dev, ws, x, y, batch, auto, a.reps)
                    tile = mq.decode_config(limits(), batch, n, k) if fmt in mq.FORMATS else None
                    mm, q8 = "-", None
                    if tile is not None:
                        q8 = x if isinstance(x, mv.Q8Acts) else mv.Q8Acts(*mv.quantize_activations(dev, x, batch, k))
                        ym = dev.alloc(8 * batch * n * 4)
                        mm = _cell(nbytes, mm_us(dev, ws, q8, ym, batch, tile, a.reps))
                    print(f"{fmt:>5s} {shape:>4s} {name:>8s} {n:>6d}x{k:<6d} {batch:>5d} {_cell(nbytes, t_old):>18s} "
                          f"{_cell(nbytes, t_new):>17s} {t_old / t_new:6.2f} {_torch_matvec(n, k, 50, batch):>6s} "
                          f"{mm:>14s}  wg{new.wg} r{new.rows} tpr{new.tpr} u{new.unroll}"
                          f"{' / ' + _tile(tile) if tile else ''}; default {_wg_name(auto)} {_cell(nbytes, t_auto)}",
                          flush=True)
                    if a.mm_sweep and tile is not None:
                        times = {t: mm_us(dev, ws, q8, ym, batch, t, 3) for t in _mm_tiles(tile, k)}
                        ranked = sorted(times, key=times.get)
                        print("      mm, fastest first (GB/s): " + ", ".join(
                            f"{_tile(t)} {nbytes / times[t] / 1e3:.0f}" for t in ranked), flush=True)
                    if tile is not None:
                        ym.release()
                        if q8 is not x:
                            for buf in (q8.xq, q8.xd, q8.xs):
                                buf.release()
                    if a.nb_sweep and new.int_dot:
                        nb_sweep(dev, f, ws, x, y, batch, new, old, max(3, a.reps // 2), a.budget)
                    if a.wg_sweep and batch <= mv.MAX_BATCH:
                        wg_sweep(dev, f, ws, x, y, batch, auto, a.reps, a.budget)
                    if a.sweep:
                        found = {}
                        for wg, rows, unroll, tpr_div in SWEEP:
                            if rows * batch > 128 or rows * unroll > 16:  # past the registers an invocation has
                                continue
                            tpr = max(1, new.tpr // tpr_div)
                            cfg = mv.MatvecConfig(wg, rows, True, new.int_dot, tpr, unroll)
                            found[(wg, rows, unroll, tpr)] = product_us(dev, ws, x, y, batch, cfg, max(3, a.reps // 2))
                        top = sorted(found, key=found.get)[:3]
                        print("      best: " + ", ".join(f"wg{c[0]} r{c[1]} u{c[2]} tpr{c[3]} {_cell(nbytes, found[c])}"
                                                     for c in top), flush=True)
                    for buf in (*bufs, y):
                        buf.release()
                _release_weights(ws)


if __name__ == "__main__":
    main()

"""Sweep the matvec launch parameters on this GPU and print the best per format, shape and batch.

    python benchmarks/tune_matvec.py [--formats Q8_0,Q4_0,...] [--batches 1,2,4,8] [--acts f32,f16] [--reps 20]
                                     [--paths float,int8]

For each format, shape (bench_kernels.MATVEC_SHAPES) and number of activation rows, every workgroup size in
WGS and rows-per-workgroup choice in ROWS (with and without the integer dot-product path for mv.INT_DOT_FORMATS,
where the device has it) is timed as bench_kernels times it (calls replayed from a captured
command graph, weights cycled past the L2). Prints GB/s of weight bytes for the chosen
configuration (vkgraph.templates.matvec.choose_config) and the best one found, then the best per batch as a
Python literal to compare with PREFERRED and BATCH_ROWS in vkgraph/templates/matvec.py. This is the workgroup
launch (VKGRAPH_MATVEC_LAUNCH=workgroup); bench_matvec_launch.py --sweep sweeps the subgroup-rows launch.
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_kernels import MATVEC_SHAPES, _release_weights, _weight_copies, matvec_us

from vkgraph.quant import FORMATS
from vkgraph.runtime import get_device
from vkgraph.templates import matvec as mv

WGS = (32, 64, 128, 256)
ROWS = (1, 2, 4, 8)


def _cfg(wg: int, rows: int, int_dot: bool) -> str:
    return f"(wg{wg:>3d} r{rows}{' int8' if int_dot else '     '})"


def _sweep(dev, rng, f, ws, n: int, k: int, batch: int, act: str, nbytes: int, reps: int, paths: set[str]):
    """GB/s of every (workgroup size, rows) for one shape, batch and activation dtype; the best key too."""
    xs = rng.standard_normal(batch * k).astype(np.float16 if act == "f16" else np.float32)
    x = dev.alloc(xs.nbytes)
    dev.upload(x, xs)
    y = dev.alloc(batch * n * 4)
    chosen = mv.choose_config(dev, f, n, k, batch, subgroup_rows=False)
    has_int8 = f.name in mv.INT_DOT_FORMATS and dev.info.integer_dot_product
    int_dots = [dot for dot in (False, True) if ("int8" if dot else "float") in paths and (has_int8 or not dot)]
    results = {}
    for wg in WGS:
        if wg > dev.info.max_workgroup_invocations:
            continue
        for rows in ROWS:
            for int_dot in int_dots:
                cfg = mv.MatvecConfig(wg, rows, chosen.use_subgroup and wg % dev.info.subgroup_size == 0, int_dot)
                results[(wg, rows, int_dot)] = nbytes / matvec_us(dev, ws, x, y, batch, cfg, reps, act) / 1e3
    x.release()
    y.release()
    if not results:
        raise SystemExit(f"no path of {sorted(paths)} runs {f.name} here")
    return max(results, key=results.get), results, chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="Q8_0,Q4_0,Q4_K,Q6_K,F16")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--acts", default="f32", help="activation dtypes, comma-separated (f32, f16)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--paths", default="float,int8", help="float (float activations), int8 (integer dot products)")
    a = ap.parse_args()
    dev = get_device()
    rng = np.random.default_rng(0)
    batches = [int(b) for b in a.batches.split(",")]
    best: dict[str, dict[int, list]] = {}
    print(f"{dev.info.name}: GB/s of weight bytes, chosen configuration vs the best workgroup size and rows per "
          "workgroup (int8: the integer dot-product path, where the format and device have it)")
    print(f"{'format':>6s} {'act':>3s} {'shape':>13s} {'batch':>5s} {'chosen':>21s} {'best':>21s}")
    for fmt in a.formats.split(","):
        f = FORMATS[fmt]
        for n, k in MATVEC_SHAPES:
            nbytes = n * f.row_bytes(k)
            if nbytes > dev.info.max_storage_buffer_range:
                continue
            ws = _weight_copies(dev, rng, fmt, n, k)
            for act in a.acts.split(","):
                for batch in batches:
                    top, results, chosen = _sweep(dev, rng, f, ws, n, k, batch, act, nbytes, a.reps,
                                                  set(a.paths.split(",")))
                    mine = results.get((chosen.wg, chosen.rows, chosen.int_dot), float("nan"))
                    print(f"{fmt:>6s} {act:>3s} {n:>6d}x{k:<6d} {batch:>5d} {mine:7.0f} "
                          f"{_cfg(chosen.wg, chosen.rows, chosen.int_dot)} {results[top]:7.0f} {_cfg(*top)}  next: "
                          + ", ".join(f"{results[c]:.0f} {_cfg(*c)}"
                                      for c in sorted(results, key=results.get, reverse=True)[1:3]), flush=True)
                    best.setdefault(f"{fmt} {act}", {}).setdefault(batch, []).append(((n, k), top,
                                                                                     round(results[top])))
            _release_weights(ws)
    print("\nbest (wg, rows, int_dot) per format and batch, by shape:")
    for fmt, per_batch in best.items():
        print(f"  {fmt!r}: {{" + ", ".join(f"{b}: {v}" for b, v in per_batch.items()) + "},")


if __name__ == "__main__":
    main()

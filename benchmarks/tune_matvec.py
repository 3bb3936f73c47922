"""Sweep the matvec launch parameters on this GPU and print the best per format, shape and batch.

    python benchmarks/tune_matvec.py [--formats Q8_0,Q4_0,...] [--batches 1,2,4,8] [--reps 20]

For each format, shape (bench_kernels.MATVEC_SHAPES) and number of activation rows, every workgroup size in
WGS and rows-per-workgroup choice in ROWS is timed by GPU timestamps (bench_kernels' method: spacing of
consecutive dispatch ends, weights cycled past the L2). Prints GB/s of weight bytes for the chosen
configuration (vkgraph.ops.matvec.choose_config) and the best one found, then the best per batch as a
Python literal to compare with PREFERRED and BATCH_ROWS in vkgraph/ops/matvec.py.
"""

from __future__ import annotations

import argparse
import os

os.environ["VKGRAPH_PROFILE"] = "1"
os.environ.setdefault("VKGRAPH_PROFILE_FILE", os.devnull)

import numpy as np  # noqa: E402
from bench_kernels import MATVEC_SHAPES, _copies, _gpu_median_us, _random_weights  # noqa: E402

from vkgraph.ops import matvec as mv  # noqa: E402
from vkgraph.quant import FORMATS  # noqa: E402
from vkgraph.runtime import get_device  # noqa: E402

WGS = (32, 64, 128, 256)
ROWS = (1, 2, 4, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="Q8_0,Q4_0,Q4_K,Q6_K,F16")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev = get_device()
    if dev.queue.profiler is None or not dev.info.timestamps:
        raise SystemExit("this device gives no timestamps; the sweep needs them")
    rng = np.random.default_rng(0)
    batches = [int(b) for b in a.batches.split(",")]
    best: dict[str, dict[int, list]] = {}
    print(f"{dev.info.name}: GB/s of weight bytes, chosen configuration vs best of {len(WGS) * len(ROWS)}")
    print(f"{'format':>6s} {'shape':>13s} {'batch':>5s} {'chosen':>16s} {'best':>16s}")
    for fmt in a.formats.split(","):
        f = FORMATS[fmt]
        for n, k in MATVEC_SHAPES:
            nbytes = n * f.row_bytes(k)
            if nbytes > dev.info.max_storage_buffer_range:
                continue
            ws = [_random_weights(dev, rng, fmt, n, k) for _ in range(_copies(nbytes))]
            for batch in batches:
                x = dev.alloc(batch * k * 4)
                dev.upload(x, rng.standard_normal(batch * k).astype(np.float32))
                y = dev.alloc(batch * n * 4)
                chosen = mv.choose_config(dev, f, n, k, batch)
                results = {}
                for wg in WGS:
                    if wg > dev.info.max_workgroup_invocations:
                        continue
                    for rows in ROWS:
                        cfg = mv.MatvecConfig(wg, rows, chosen.use_subgroup and wg % dev.info.subgroup_size == 0)
                        it = iter(range(1 << 62))

                        def run(ws=ws, x=x, y=y, it=it, batch=batch, cfg=cfg):
                            mv.matvec(dev, ws[next(it) % len(ws)], x, batch, out=y, config=cfg)

                        results[(wg, rows)] = nbytes / _gpu_median_us(dev, mv.TEMPLATE[fmt], run, a.reps) / 1e3
                top = max(results, key=results.get)
                mine = results.get((chosen.wg, chosen.rows), float("nan"))
                print(f"{fmt:>6s} {n:>6d}x{k:<6d} {batch:>5d} {mine:7.0f} (wg{chosen.wg:>3d} r{chosen.rows}) "
                      f"{results[top]:7.0f} (wg{top[0]:>3d} r{top[1]})", flush=True)
                best.setdefault(fmt, {}).setdefault(batch, []).append(((n, k), top, round(results[top])))
            for w in ws:
                w.body.release()
                if w.scales is not None:
                    w.scales.release()
    print("\nbest (wg, rows) per format and batch, by shape:")
    for fmt, per_batch in best.items():
        print(f"  {fmt!r}: {{" + ", ".join(f"{b}: {v}" for b, v in per_batch.items()) + "},")


if __name__ == "__main__":
    main()

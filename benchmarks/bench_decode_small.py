"""The decode step's small int8 writers alone: rmsnorm_q8 and glu_q8 at decode's rows, device timestamps.

    python benchmarks/bench_decode_small.py [--rows 1,8,32] [--reps 200] [--wg-sweep]

Each launch is timed by GPU timestamps around its dispatch (VKGRAPH_PROFILE): `reps` consecutive calls after
warm-up, each writing the same output so a barrier orders every pair, as in a decode step. Printed per shape and
row count: the median microseconds inside one dispatch ("kernel us") and the span of the whole chain divided by
the calls ("chain us", which adds the barrier between dependent dispatches). Shapes: RMSNorm over the hidden
size and the gated unit over the MLP width of the 1B, 8B and 70B Llama shapes. The default run passes nothing
but the shapes, so the same script times an older checkout's kernels (PYTHONPATH=that checkout) for comparison;
--wg-sweep then times each kernel again at several workgroup sizes (the launchers' `wg` argument), after the
default pass so that its figures come first and clean: rmsnorm_q8 only where an invocation holds at most 4 vec4s
(on the H200 a launch with 32 each, spilling registers, left every later figure of that run 2-3x slow).
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ["VKGRAPH_PROFILE"] = "1"
os.environ.setdefault("VKGRAPH_PROFILE_FILE", os.devnull)

import numpy as np  # noqa: E402
from common import device_events, raise_clocks  # noqa: E402

import vkgraph  # noqa: E402
from vkgraph.runtime import get_device  # noqa: E402
from vkgraph.templates import norms  # noqa: E402
from vkgraph.templates.matvec import Q8Acts  # noqa: E402

HIDDEN = [2048, 4096, 8192]  # rmsnorm_q8 widths: Llama-3.2-1B, Llama-3-8B, Llama-3-70B
FFN = [8192, 14336, 28672]  # glu_q8 widths of the same models
ROW_WGS = [64, 128, 256, 512, 1024]  # swept where n <= 16 * wg
GLU_WGS = [32, 64, 128, 256]


def timed(dev, name: str, run, reps: int) -> tuple[float, float]:
    """(median kernel microseconds, chain microseconds per call) of `reps` dependent calls of `run`."""
    ev = [(t0, t1) for n, t0, t1 in device_events(dev, run, reps) if n == name]
    if len(ev) != reps:
        raise RuntimeError(f"expected {reps} timestamps of {name}, got {len(ev)} (no timestamps on this device?)")
    kernel = statistics.median((t1 - t0) / 1e3 for t0, t1 in ev)
    return kernel, (ev[-1][1] - ev[0][0]) / 1e3 / reps


def bench_rmsnorm(dev, rng, rows_list: list[int], reps: int, wgs: list[int | None]) -> None:
    print(f"\nrmsnorm_q8 (x [rows, n] float32 -> int8 blocks): us per call, {dev.info.name}")
    print(f"{'n':>6s} {'rows':>4s} {'wg':>5s} {'kernel us':>9s} {'chain us':>9s}")
    for n in HIDDEN:
        w = dev.alloc(n * 4)
        dev.upload(w, rng.standard_normal(n).astype(np.float32))
        for rows in rows_list:
            x = dev.alloc(rows * n * 4)
            dev.upload(x, rng.standard_normal(rows * n).astype(np.float32))
            out = dev.alloc(Q8Acts.layout(rows, n)[0])
            for wg in [w for w in wgs if w is None or n <= 16 * w]:
                kw = {} if wg is None else {"wg": wg}
                k, c = timed(dev, "rmsnorm_q8",
                             lambda x=x, w=w, out=out, rows=rows, n=n, kw=kw:
                             norms.rmsnorm_q8(dev, x, w, rows, n, eps=1e-5, out=out, **kw), reps)
                print(f"{n:6d} {rows:4d} {wg or 'auto':>5} {k:9.2f} {c:9.2f}", flush=True)
            x.release()
            out.release()
        w.release()


def bench_glu(dev, rng, rows_list: list[int], reps: int, wgs: list[int | None]) -> None:
    print(f"\nglu_q8 (SiLU(gate) * up from gu [rows, 2F] -> int8 blocks): us per call, {dev.info.name}")
    print(f"{'F':>6s} {'rows':>4s} {'wg':>5s} {'kernel us':>9s} {'chain us':>9s}")
    for f in FFN:
        for rows in rows_list:
            gu = dev.alloc(rows * 2 * f * 4)
            dev.upload(gu, (rng.standard_normal(rows * 2 * f) * 4).astype(np.float32))
            out = dev.alloc(Q8Acts.layout(rows, f)[0])
            for wg in wgs:
                kw = {} if wg is None else {"wg": wg}
                k, c = timed(dev, "glu_q8", lambda gu=gu, out=out, rows=rows, f=f, kw=kw:
                             norms.glu_q8(dev, gu, rows, f, out=out, **kw), reps)
                print(f"{f:6d} {rows:4d} {wg or 'auto':>5} {k:9.2f} {c:9.2f}", flush=True)
            gu.release()
            out.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32", help="activation rows, e.g. 1,8,32")
    ap.add_argument("--reps", type=int, default=200, help="timed calls per case (after 10 untimed)")
    ap.add_argument("--wg-sweep", action="store_true", help="also time each case at several workgroup sizes")
    a = ap.parse_args()
    rows_list = [int(r) for r in a.rows.split(",")]
    dev = get_device()
    print(f"vkgraph from {os.path.dirname(vkgraph.__file__)}")
    raise_clocks()
    rng = np.random.default_rng(0)
    bench_rmsnorm(dev, rng, rows_list, a.reps, [None])
    bench_glu(dev, rng, rows_list, a.reps, [None])
    if a.wg_sweep:
        bench_rmsnorm(dev, rng, rows_list, a.reps, ROW_WGS)
        bench_glu(dev, rng, rows_list, a.reps, GLU_WGS)


if __name__ == "__main__":
    main()

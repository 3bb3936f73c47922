"""The MLP's gated unit in the gate/up product's epilogue against its own kernel, at decode's rows.

    python benchmarks/bench_glu_epilogue.py [--formats Q4_0,Q4_K] [--batches 1,2,4,8] [--shapes 8b,1b,small]
                                            [--max-wg 512] [--launches "16,4,2;8,4,4"] [--norm] [--reps 10]

Per format, shape (gate/up of a Llama-3-8B or Llama-3.2-1B layer: F = 14336 or 8192 over K = 4096 or 2048) and
activation rows, three ways from the same int8 activations (as rmsnorm_q8 leaves them) to the down product's
int8 input, each timed as benchmarks/common.replay_us times a product (100 calls captured into one command graph,
replayed in turn with the others; weights cycled through copies past the L2), so the barrier between the two
kernels of the unfused ways is in their time:
- unfused: the product under its default launch (choose_config), then glu_q8 (today's route with
  VKGRAPH_GLU_EPILOGUE=0);
- same launch: the product under the epilogue's launch (matvec.glu_config) writing floats, then glu_q8;
- epilogue: matvec_glu_q8, one kernel.
Printed: microseconds per way, the weights' GB/s of the epilogue, and its launch, a line per epilogue launch: the
one glu_config chooses under each value of --max-wg (its largest workgroup, matvec.GLU_MAX_WG by default), then
those of --launches (group width, rows per group, units in flight; 64 rows per workgroup). Launches wider than the
device's workgroups are left out, with a note.

With --norm, the route a decode step takes where the norm runs in the gate/up product's prologue (the float rows
of the residual stream and the norm's weight, NormedRows): "unfused" is then rmsnorm_q8 followed by the epilogue
under glu_config's launch, "same launch" is not run, and "epilogue" is the product with the norm in its prologue and
the gated unit in its epilogue, under glu_norm_config's launch and then each of --launches (staged activations,
units in flight rounded up to whole blocks as glu_norm_config does). A winner of the plain epilogue need not carry
over: on the H200 the 1B model's best plain launch (16 lanes, 1 row, 4 units) took 17.7 us a call with the norm
against 13.0 for the derived one.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

import numpy as np
from bench_kernels import _release_weights, _weight_copies
from common import capture_graph, raise_clocks, replay_many_us

from vkgraph.quant import FORMATS
from vkgraph.runtime import get_device
from vkgraph.templates import matvec as mv
from vkgraph.templates import norms

SHAPES = {"8b": (14336, 4096), "1b": (8192, 2048), "small": (1024, 512)}  # small: a smoke test on a CPU device


def launches(dev, fmt: str, f: int, k: int, batch: int, max_wgs: list[int], given: list[tuple[int, int, int]],
             norm: bool = False) -> list[mv.MatvecConfig]:
    """The epilogue launches to time: glu_config's under each of `max_wgs` (glu_norm_config's with `norm`), then
    each (group width, rows per group, units in flight) of `given` with its fold (64 rows per workgroup), without
    repeats; those wider than the device's workgroups left out."""
    qf = FORMATS[fmt]
    if norm:
        base = mv.glu_norm_config(dev, qf, f, k, batch)
        if base is None:
            return []
        out = [base]
    else:
        out = [mv.glu_config(dev, qf, f, k, batch, int_dot=True, max_wg=max_wg) for max_wg in max_wgs]
    limit = dev.info.max_workgroup_invocations
    for tpr, rows, unroll in given:
        wg = 64 // rows * tpr
        if wg > limit:
            print(f"  (launch {tpr},{rows},{unroll} left out: {wg} invocations, the device's limit is {limit})")
            continue
        if norm:
            out.append(replace(out[0], wg=wg, rows=rows, tpr=tpr, unroll=mv.whole_rounds(qf, tpr, unroll)))
        else:
            out.append(replace(out[0], wg=wg, rows=rows, tpr=tpr, unroll=unroll, stage=False))
    return list(dict.fromkeys(out))


def ways(dev, ws: list[mv.DeviceWeights], x: mv.Q8Acts, y, h, batch: int, f: int,
         cfgs: list[mv.MatvecConfig], normed: mv.NormedRows | None = None, qbuf=None) -> dict:
    """The runs of the three ways (see the module doc), the last two per launch in `cfgs`, each call on the next of
    the weight copies; with `normed`, the norm's two ways instead (rmsnorm_q8 writing `qbuf`, which `x` views)."""
    calls = itertools.count()
    if normed is not None:
        k = ws[0].shape[1]

        def apart() -> None:
            norms.rmsnorm_q8(dev, normed.x, normed.gain, batch, k, eps=normed.eps, out=qbuf)
            mv.matvec_glu_q8(dev, ws[next(calls) % len(ws)], x, batch, out=h)

        def prologue(config: mv.MatvecConfig):
            def run() -> None:
                mv.matvec_glu_q8(dev, ws[next(calls) % len(ws)], normed, batch, out=h, config=config)
            return run

        return {("unfused", None): apart} | {("epilogue", cfg): prologue(cfg) for cfg in cfgs}

    def unfused(config: mv.MatvecConfig | None):
        def run() -> None:
            mv.matvec(dev, ws[next(calls) % len(ws)], x, batch, out=y, config=config)
            norms.glu_q8(dev, y, batch, f, out=h)
        return run

    def epilogue(config: mv.MatvecConfig):
        def run() -> None:
            mv.matvec_glu_q8(dev, ws[next(calls) % len(ws)], x, batch, out=h, config=config)
        return run

    runs = {("unfused", None): unfused(None)}
    for cfg in cfgs:
        runs["same launch", cfg] = unfused(cfg)
        runs["epilogue", cfg] = epilogue(cfg)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="Q4_0,Q4_K")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--shapes", default="8b")
    ap.add_argument("--max-wg", default=str(mv.GLU_MAX_WG), help="the epilogue launch's largest workgroups, e.g. "
                    "256,512,1024")
    ap.add_argument("--launches", default="", help="more epilogue launches, e.g. '16,4,2;8,4,4' (group width, rows "
                    "per group, units in flight)")
    ap.add_argument("--norm", action="store_true", help="the norm in the product's prologue (see the module doc)")
    ap.add_argument("--reps", type=int, default=10, help="rounds of replays of the 100-call graphs")
    a = ap.parse_args()
    given = [tuple(int(v) for v in e.split(",")) for e in a.launches.split(";") if e.strip()]
    dev = get_device()
    if not dev.info.integer_dot_product:
        raise SystemExit(f"{dev.info.name} has no integer dot products: the epilogue's inputs are int8 here")
    rng = np.random.default_rng(0)
    print(f"gate/up product + gated unit -> int8 activations, us per MLP, {dev.info.name}")
    print(f"{'format':>6s} {'shape':>5s} {'rows':>4s} {'unfused':>8s} {'same launch':>11s} {'epilogue':>8s} "
          f"{'saved':>6s} {'GB/s':>6s}  launch")
    for fmt, shape in itertools.product(a.formats.split(","), a.shapes.split(",")):
        f, k = SHAPES[shape]
        ws = _weight_copies(dev, rng, fmt, 2 * f, k)
        for batch in (int(b) for b in a.batches.split(",")):
            xf = dev.alloc(batch * k * 4)
            dev.upload(xf, rng.standard_normal(batch * k).astype(np.float32))
            x = mv.Q8Acts(*mv.quantize_activations(dev, xf, batch, k))
            y, h = dev.alloc(batch * 2 * f * 4), dev.alloc(mv.Q8Acts.layout(batch, f)[0])
            gain = dev.alloc(k * 4)
            dev.upload(gain, rng.standard_normal(k).astype(np.float32))
            normed = mv.NormedRows(xf, gain, 1e-5) if a.norm else None
            cfgs = launches(dev, fmt, f, k, batch, [int(m) for m in a.max_wg.split(",")], given, a.norm)
            qbuf = dev.alloc(mv.Q8Acts.layout(batch, k)[0])  # where rmsnorm_q8 writes (the norm's unfused way)
            if not cfgs:
                print(f"{fmt:>6s} {shape:>5s} {batch:4d}  no launch with the norm in the prologue (glu_norm_config)")
            else:
                acts = mv.Q8Acts.in_buffer(qbuf, batch, k) if a.norm else x
                graphs = {key: capture_graph(dev, run)
                          for key, run in ways(dev, ws, acts, y, h, batch, f, cfgs, normed, qbuf).items()}
                raise_clocks()
                us = replay_many_us(dev, graphs, a.reps)
                for g in graphs.values():
                    g.destroy()
                unfused = us["unfused", None]
            for cfg in cfgs:
                epi = us["epilogue", cfg]
                same = f"{us['same launch', cfg]:11.2f}" if ("same launch", cfg) in us else f"{'-':>11s}"
                print(f"{fmt:>6s} {shape:>5s} {batch:4d} {unfused:8.2f} {same} {epi:8.2f} "
                      f"{unfused - epi:6.2f} {ws[0].nbytes / epi / 1e3:6.0f}  wg={cfg.wg} rows={cfg.rows} "
                      f"tpr={cfg.tpr} unroll={cfg.unroll} fold={int(cfg.fold)} stage={int(cfg.stage)}", flush=True)
            for buf in (xf, x.xq, x.xd, x.xs, y, h, gain, qbuf):
                buf.release()
        _release_weights(ws)


if __name__ == "__main__":
    main()

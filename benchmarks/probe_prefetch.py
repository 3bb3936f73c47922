"""Does pulling a product's weights into the L2 during the latency-bound kernel before it pay?

    python benchmarks/probe_prefetch.py [--products qkv,o,down] [--reps 10] [--groups 264]

A decode step alternates latency-bound kernels (RMSNorm, attention, the gated unit: a few microseconds with the
memory idle) with the products that stream the weights. This probe times, per product of the Llama-3-8B shape at
one activation row (Q4_0, int8 activations, weights cycled through copies past the L2), chains of:
- norm+mv: rmsnorm_q8 then the matvec (as a decode step runs them);
- norm+pf+mv: the same, with a prefetch kernel between them that reads one word of every 32-byte sector of the
  matvec's weights and writes nothing (so no barrier separates it from the norm: the two overlap);
- pf+mv: the prefetch alone before the matvec, a barrier between them (the matvec's speed from the L2);
- mv: the matvec alone; norm: the norm alone;
- mv||: matvecs writing rotating outputs, so no barrier parts them and each overlaps the one before (the bound
  for a product whose weight loads start before its input is ready).
GPU microseconds per chain link (benchmarks/common.replay_us), and the matvec's GB/s of weight bytes.
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
from bench_kernels import _release_weights, _weight_copies
from common import raise_clocks, replay_us

from vkgraph.runtime import get_device
from vkgraph.templates import matvec as mv
from vkgraph.templates import norms

PRODUCTS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}

PREFETCH = """#version 450
layout(local_size_x = 256) in;
layout(set = 0, binding = 0) readonly buffer W { uint w[]; };
layout(set = 0, binding = 1) buffer Sink { uint sink[]; };
layout(push_constant) uniform P { uint words; uint stride; };
void main() {
    uint acc = 0u;
    // one word of every 32-byte sector: the L2 fills whole sectors
    for (uint i = gl_GlobalInvocationID.x * 8u; i < words; i += stride * 8u) {
        acc ^= w[i];
    }
    if (acc == 0x9e3779b9u && gl_GlobalInvocationID.x == 0xffffffffu) {
        sink[0] = acc;  // never taken; keeps the loads
    }
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--products", default="qkv,o,down")
    ap.add_argument("--fmt", default="Q4_0")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--groups", type=int, default=264, help="prefetch workgroups of 256")
    a = ap.parse_args()
    dev = get_device()
    rng = np.random.default_rng(0)
    pf = dev.pipeline(PREFETCH, name="prefetch")
    sink = dev.alloc(256)
    raise_clocks()
    print(f"{dev.info.name}: us per chain link; matvec GB/s of weight bytes ({a.fmt}, one row, int8 activations)")
    print(f"{'product':>8s} {'N x K':>12s} {'mv':>7s} {'norm':>7s} {'norm+mv':>8s} {'norm+pf+mv':>10s} "
          f"{'pf+mv':>7s} {'pf':>6s} {'mv||':>6s}  {'GB/s mv':>8s}")
    for name in a.products.split(","):
        probe(dev, pf, sink, rng, name, a.fmt, a.groups, a.reps)


def probe(dev, pf, sink, rng, name: str, fmt: str, groups: int, reps: int) -> None:
    n, k = PRODUCTS[name]
    ws = _weight_copies(dev, rng, fmt, n, k)
    nbytes = ws[0].body.size
    x = dev.alloc(k * 4)
    dev.upload(x, rng.standard_normal(k).astype(np.float32))
    gamma = dev.alloc(k * 4)
    dev.upload(gamma, rng.standard_normal(k).astype(np.float32))
    acts_buf = dev.alloc(mv.Q8Acts.layout(1, k)[0])
    acts = mv.Q8Acts.in_buffer(acts_buf, 1, k)
    ys = [dev.alloc(n * 4) for _ in range(8)]
    y = ys[0]
    cfg = mv.choose_config(dev, ws[0].format, n, k, 1, int_dot=True)
    calls = itertools.count()

    def prefetch(w, out) -> None:
        dev.dispatch(pf, [w.body, out], (groups, 1, 1), push={"words": w.body.size // 4, "stride": groups * 256})

    def overlapped() -> None:
        i = next(calls)
        mv.matvec(dev, ws[i % len(ws)], acts, 1, out=ys[i % len(ys)], config=cfg)

    def chain(norm: bool, pre: bool, mat: bool):
        def run() -> None:
            w = ws[next(calls) % len(ws)]
            if norm:
                norms.rmsnorm_q8(dev, x, gamma, 1, k, out=acts_buf)
            if pre:
                # beside a norm: its own sink, so no barrier parts the two; alone: it "writes" the activations,
                # so the matvec waits for it and then reads the weights from the L2
                prefetch(w, sink if norm else acts_buf)
            if mat:
                mv.matvec(dev, w, acts, 1, out=y, config=cfg)
        return run

    t = {key: replay_us(dev, chain(*flags), reps) for key, flags in
         (("mv", (False, False, True)), ("norm", (True, False, False)), ("norm+mv", (True, False, True)),
          ("norm+pf+mv", (True, True, True)), ("pf+mv", (False, True, True)), ("pf", (False, True, False)))}
    t["mv||"] = replay_us(dev, overlapped, reps)
    print(f"{name:>8s} {n:>6d}x{k:<5d} {t['mv']:7.2f} {t['norm']:7.2f} {t['norm+mv']:8.2f} {t['norm+pf+mv']:10.2f} "
          f"{t['pf+mv']:7.2f} {t['pf']:6.2f} {t['mv||']:6.2f}  {nbytes / t['mv'] / 1e3:8.0f}", flush=True)
    _release_weights(ws)
    for b in (x, gamma, acts_buf, *ys):
        b.release()


if __name__ == "__main__":
    main()

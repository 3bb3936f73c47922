"""Eager against JIT for a chain of synthetic transformer blocks (decode-shaped: one token).

    python benchmarks/bench_jit.py [--blocks 32] [--dim 256] [--steps 50]

Prints the step time both ways, the kernels per step, and the host time per replayed kernel (time spent in
the replay call before the GPU wait, divided by the kernels in the graph).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from vkgraph.jit import jit
from vkgraph.realize import count_kernels
from vkgraph.runtime import get_device
from vkgraph.tensor import Tensor


def make_weights(blocks: int, dim: int, rng: np.random.Generator) -> list[dict[str, Tensor]]:
    def w(*shape: int) -> Tensor:
        return Tensor((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32))

    return [{"norm1": Tensor(np.ones(dim, np.float32)), "qkv": w(dim, 3 * dim), "proj": w(dim, dim),
             "norm2": Tensor(np.ones(dim, np.float32)), "up": w(dim, 2 * dim), "down": w(dim, dim)}
            for _ in range(blocks)]


def step(x: Tensor, ctx: Tensor, weights: list[dict[str, Tensor]]) -> Tensor:
    """x: (1, dim) token; ctx: (T, dim) keys/values stand-in shared by every block."""
    dim = x.shape[-1]
    for p in weights:
        h = x.rms_norm(p["norm1"])
        q, k, v = (h @ p["qkv"]).chunk(3, -1)
        keys = ctx + k
        att = ((q @ keys.T) / np.sqrt(dim)).softmax(axis=-1)
        x = x + (att @ (ctx + v)) @ p["proj"]
        h = x.rms_norm(p["norm2"])
        gate, up = (h @ p["up"]).chunk(2, -1)
        x = x + (gate.silu() * up) @ p["down"]
    return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    dev = get_device()
    rng = np.random.default_rng(0)
    weights = make_weights(args.blocks, args.dim, rng)
    ctx = Tensor(rng.standard_normal((args.ctx, args.dim)).astype(np.float32))
    xs = [Tensor(rng.standard_normal((1, args.dim)).astype(np.float32)).realize() for _ in range(4)]
    dev.synchronize()

    with count_kernels() as c:
        step(xs[0], ctx, weights).realize()
    dev.synchronize()
    kernels = c.count

    def eager(i: int) -> None:
        step(xs[i % 4], ctx, weights).realize()
        dev.synchronize()

    jitted = jit(lambda x: step(x, ctx, weights))
    host: list[float] = []

    def replay(i: int) -> None:
        t = time.perf_counter()
        out = jitted(xs[i % 4])
        host.append(time.perf_counter() - t)
        dev.synchronize()
        return out

    for i in range(3):
        eager(i)
        replay(i)
    host.clear()
    submits = dev.queue.stats["submits"]
    t_jit = []
    for i in range(args.steps):
        t = time.perf_counter()
        replay(i)
        t_jit.append(time.perf_counter() - t)
    submits_per_step = (dev.queue.stats["submits"] - submits) / args.steps
    t_eager = []
    for i in range(max(5, args.steps // 5)):
        t = time.perf_counter()
        eager(i)
        t_eager.append(time.perf_counter() - t)
    ok = np.allclose(jitted(xs[1]).numpy(), step(xs[1], ctx, weights).numpy(), rtol=1e-4, atol=1e-4)
    e, j, h = statistics.median(t_eager), statistics.median(t_jit), statistics.median(host)
    print(f"device: {dev.info.name}; {args.blocks} blocks, dim {args.dim}, context {args.ctx}")
    print(f"kernels per step                   {kernels}")
    print(f"eager step (build+schedule+record) {e * 1e3:9.3f} ms")
    print(f"jit step (replay + wait)           {j * 1e3:9.3f} ms   speed-up {e / j:6.1f}x")
    print(f"jit host time per step             {h * 1e6:9.1f} us = {h / kernels * 1e6:.3f} us per kernel")
    print(f"submits per jit step               {submits_per_step:9.2f}")
    print(f"jit output equals eager            {ok}")


if __name__ == "__main__":
    main()

"""What IEEE marking costs: fused elementwise chains with generated arithmetic marked (`precise` temporaries,
hidden special constants, float controls: VKGRAPH_IEEE=1, the default) and unmarked (VKGRAPH_IEEE=0).

    python benchmarks/bench_precise.py [--log2 26] [--reps 20]

Each mode runs in a process of its own (the flag is read when the device's limits are first taken). Each chain is
one fused kernel; its GPU time per call comes from a replayed command graph of 100 calls (common.replay_us), on
random inputs, median over the replays. GB/s counts the bytes the kernel reads and writes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable

import numpy as np
from common import replay_us

from vkgraph.runtime import get_device
from vkgraph.tensor import Tensor


def horner(a: Tensor, c: Tensor, d: Tensor) -> Tensor:
    """32 multiply-adds per element: where fusing them into FMAs (which `precise` forbids) would pay most."""
    y = a
    for k in range(32):
        y = y * c + (d if k % 2 else 0.25)
    return y


def transcendental(a: Tensor, c: Tensor, d: Tensor) -> Tensor:
    """bench_tensor's chain of 10 ops: multiply-adds and tanh."""
    y = a * c + d
    for k in range(8):
        y = (y * 0.5).tanh() if k % 2 else y * c + 0.25
    return y * c


def memory_bound(a: Tensor, c: Tensor, d: Tensor) -> Tensor:
    return (a * c + d).exp() * c


def with_zero(a: Tensor, c: Tensor, d: Tensor) -> Tensor:
    """Special constants (a zero and an infinity), which marking turns from literals into hidden values."""
    return (a * 0.0 + c).maximum(d * float("-inf")) + a * c


CHAINS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "memory-bound (a*c+d).exp()*c": memory_bound, "10 ops with tanh": transcendental,
    "32 multiply-adds (Horner)": horner, "special constants": with_zero,
}


def measure(log2: int, reps: int) -> dict[str, float]:
    """GPU microseconds per call of each chain, in this process's mode."""
    dev = get_device()
    rng = np.random.default_rng(0)
    n = 1 << log2
    ts = [Tensor(rng.standard_normal(n, dtype=np.float32)).realize() for _ in range(3)]
    dev.synchronize()
    return {name: replay_us(dev, lambda f=fn: f(*ts).realize(), reps) for name, fn in CHAINS.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log2", type=int, default=26, help="elements per input, as a power of two")
    p.add_argument("--reps", type=int, default=20, help="replays of the 100-call graph per chain")
    p.add_argument("--mode", choices=("0", "1"), help="measure one mode in this process and print JSON")
    args = p.parse_args()
    if args.mode is not None:
        print("result: " + json.dumps(measure(args.log2, args.reps)))
        return
    results = {}
    for mode in ("1", "0"):
        env = dict(os.environ, VKGRAPH_IEEE=mode)
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--log2", str(args.log2), "--reps",
                              str(args.reps)], env=env, check=True, capture_output=True, text=True).stdout
        line, = (x for x in out.splitlines() if x.startswith("result: "))
        results[mode] = json.loads(line[len("result: "):])
    n = 1 << args.log2
    print(f"{get_device().info.name}; 2^{args.log2} float32 elements; GPU time per call (replayed graphs)")
    print(f"{'chain':34} {'marked us':>10} {'GB/s':>7} {'unmarked us':>12} {'GB/s':>7} {'cost':>7}")
    for name in CHAINS:
        on, off = results["1"][name], results["0"][name]
        gbs = 4 * n * 4 / 1e3  # three inputs read, one output written; bytes per microsecond = GB/s * 1e-3
        print(f"{name:34} {on:10.1f} {gbs / on:7.0f} {off:12.1f} {gbs / off:7.0f} {on / off - 1:+7.1%}")


if __name__ == "__main__":
    main()

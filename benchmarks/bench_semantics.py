"""What numpy's semantics cost on the GPU: integer sums and prefix sums in numpy's int64 accumulator against an
int32 one (`dtype="int32"`), and a float product that handles infinities (three more reductions fused into its
kernel) against the plain product reduction, plus torch.sum/prod on the same data where PyTorch sees CUDA.

    python benchmarks/bench_semantics.py [--log2 26] [--reps 20]

GPU time per call comes from a replayed command graph of 100 calls (common.replay_us) on random inputs; GB/s
counts the bytes read. Prints one line per case and a JSON summary.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from common import cuda_torch, replay_us, torch_time_us

from vkgraph.graph import ReduceOp
from vkgraph.runtime import get_device
from vkgraph.tensor import Tensor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log2", type=int, default=26, help="elements per input, as a power of two")
    p.add_argument("--reps", type=int, default=20, help="replays of the 100-call graph per case")
    args = p.parse_args()
    dev = get_device()
    rng = np.random.default_rng(0)
    n = 1 << args.log2
    xi = rng.integers(-1000, 1000, size=n, dtype=np.int32)
    xf = rng.uniform(0.999, 1.001, size=n).astype(np.float32)
    ti, tf = Tensor(xi).realize(), Tensor(xf).realize()
    rows = Tensor(xi.reshape(-1, 1024)).realize()
    cases = {
        "int32 sum, int64 accumulator (default)": (lambda: ti.sum().realize(), 4 * n),
        "int32 sum, int32 accumulator": (lambda: ti.sum(dtype="int32").realize(), 4 * n),
        "int32 row sums (n/1024 x 1024), int64": (lambda: rows.sum(1).realize(), 4 * n),
        "int32 row sums (n/1024 x 1024), int32": (lambda: rows.sum(1, dtype="int32").realize(), 4 * n),
        "float32 prod (infinities handled)": (lambda: tf.prod().realize(), 4 * n),
        "float32 prod (plain reduction)": (lambda: tf._reduce(ReduceOp.PROD, None, False).realize(), 4 * n),
    }
    assert ti.sum().item() == int(xi.astype(np.int64).sum())
    results = {}
    for name, (fn, nbytes) in cases.items():
        us = replay_us(dev, fn, args.reps)
        results[name] = us
        print(f"{name:45s} {us:10.1f} us  {nbytes / us / 1e3:8.1f} GB/s")
    torch = cuda_torch()
    if torch is not None:
        gi, gf = torch.from_numpy(xi).cuda(), torch.from_numpy(xf).cuda()
        for name, fn in {"torch int32 sum (int64)": lambda: gi.sum(), "torch float32 prod": lambda: gf.prod()}.items():
            us = torch_time_us(torch, fn, args.reps)
            results[name] = us
            print(f"{name:45s} {us:10.1f} us  {4 * n / us / 1e3:8.1f} GB/s")
    print("result: " + json.dumps(results))


if __name__ == "__main__":
    main()

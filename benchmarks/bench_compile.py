"""First-run compile time: one realize of a graph with K kernels never compiled (empty disk caches), compiled
one at a time against on the thread pool (vkgraph.realize.COMPILE_THREADS), each mode in a fresh process.

    python benchmarks/bench_compile.py [--kernels 48]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

CHILD = """
import sys, time
import numpy as np
from vkgraph import Tensor, realize
from vkgraph.runtime import get_device
from vkgraph.tensor import realize_all
realize.COMPILE_THREADS = int(sys.argv[1])
k = int(sys.argv[2])
dev = get_device()
rng = np.random.default_rng(0)
xs = [Tensor(rng.standard_normal((4, 33 + i)).astype(np.float32)).realize() for i in range(k)]
dev.synchronize()
t = time.perf_counter()
outs = [((x * (i + 2)).exp() / (x.abs() + 1)).sum(axis=1) for i, x in enumerate(xs)]
realize_all(*outs)
dev.synchronize()
print(time.perf_counter() - t, dev.compiler.stats.misses)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=48)
    a = ap.parse_args()
    rows = []
    for threads in (1, 8, 1, 8):  # alternating: the first process also pays for warming the driver
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, VKGRAPH_CACHE_DIR=cache)
            t = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(a.kernels)], env=env, check=True,
                                 capture_output=True, text=True).stdout.split()
            rows.append((threads, float(out[0]), int(out[1]), time.perf_counter() - t))
    print(f"{a.kernels} new kernels in one realize, empty caches; cores: {os.cpu_count()}")
    for threads, realize_s, misses, process_s in rows:
        print(f"compile threads {threads}: realize {realize_s:.2f} s ({misses} compiled), process {process_s:.2f} s")


if __name__ == "__main__":
    main()

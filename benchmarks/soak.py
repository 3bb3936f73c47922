"""Soak: many iterations of a mixed workload, watching pool bytes, Vulkan object counts and process RSS.

    python benchmarks/soak.py [--iterations 10000] [--every 1000]

Each iteration runs an eager fused graph, a JIT replay, a quantized matvec template op, and (every 10th) a
short generation with prefix caching on a tiny random model. Prints a row of figures every `--every`
iterations, then start and end figures; exits non-zero if live bytes, object counts or RSS grew beyond noise.
"""

from __future__ import annotations

import argparse
import gc
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from vkgraph import Tensor, jit
from vkgraph.nn.engine import Engine
from vkgraph.nn.llama import LlamaModel
from vkgraph.nn.template_ops import QuantLinear
from vkgraph.nn.weights import load_weights
from vkgraph.quant import quantize
from vkgraph.runtime import get_device

ROOT = Path(__file__).resolve().parents[1]


def tiny_model(out: Path) -> Path:
    from vkgraph.nn import tiny_model as mk

    return mk.write_model(out, mk.tiny_config(), gguf_types=("Q8_0",))["Q8_0"]


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def snapshot() -> dict[str, float]:
    gc.collect()
    dev = get_device()
    dev.synchronize()
    pool = dev.memory.pool.stats
    counts = dev.queue.object_counts()
    return {"live MiB": pool.live_bytes / 2**20, "idle MiB": pool.idle_bytes / 2**20,
            "allocations": dev.memory.allocation_count, "command buffers": counts["command_buffers"],
            "descriptor sets": counts["descriptor_sets"], "pipelines": len(dev.pipelines.cached),
            "RSS MiB": rss_mib()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=10000)
    ap.add_argument("--every", type=int, default=1000)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        model_path = tiny_model(Path(d))
        model = LlamaModel(load_weights(model_path, progress=False), num_blocks=64, max_blocks_per_seq=8)
    engine = Engine(model, max_batch=4)
    lin = QuantLinear(quantize(rng.standard_normal((256, 512)).astype(np.float32), "Q4_0"))
    w = Tensor(rng.standard_normal((64, 64)).astype(np.float32))
    step = jit(lambda x: ((x @ w).relu() * 2 + 1).softmax(-1).sum(axis=0))
    prompts = [list(range(5, 5 + 40)), list(range(5, 5 + 40)) + [7, 8], [9, 10, 11]]
    rows = []
    t0 = time.perf_counter()
    for i in range(a.iterations + 1):
        x = rng.standard_normal((8, 64)).astype(np.float32)
        eager = ((Tensor(x) * 3 + 1).exp() * Tensor(x)).sum(axis=1)
        out = step(Tensor(x))
        y = lin(Tensor(x[:, :8].repeat(64, axis=1)))
        _ = eager.numpy(), out.numpy(), y.numpy()
        if i % 10 == 0:
            for _ev in engine.generate([prompts[i % 3]], max_tokens=4, stop_token_ids=[]):
                pass
        if i % a.every == 0:
            s = snapshot()
            rows.append((i, s))
            print(f"iter {i:6d}  {time.perf_counter() - t0:8.1f} s  " + "  ".join(f"{k} {v:.1f}" for k, v in s.items()),
                  flush=True)
    start, end = rows[1][1] if len(rows) > 2 else rows[0][1], rows[-1][1]  # after warm-up, and the last
    print("\nfigure              start        end")
    for k in start:
        print(f"{k:16s} {start[k]:10.1f} {end[k]:10.1f}")
    grew = [k for k in start if k != "RSS MiB" and end[k] > start[k] * 1.01 + 1]
    if end["RSS MiB"] > start["RSS MiB"] * 1.10 + 20:
        grew.append("RSS MiB")
    kv_free = engine.kv.num_free_blocks == engine.kv.num_blocks
    print(f"KV blocks all free: {kv_free}; grew: {grew or 'nothing'}")
    return 1 if grew or not kv_free else 0


if __name__ == "__main__":
    raise SystemExit(main())

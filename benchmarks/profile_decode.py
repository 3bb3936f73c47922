"""Where a decode step's GPU time goes: per-kernel timestamps of eager decode steps of a random-weight model.

    python benchmarks/profile_decode.py [--shape llama3-8b|small] [--format Q4_0] [--batch 1] [--steps 5]

Runs the engine's decode step without the JIT (the same kernels, recorded one by one) under VKGRAPH_PROFILE,
and prints per kernel name: dispatches per step, GPU microseconds per step (sum of dispatch durations), and
the share of the step. Also prints the wall time per step of the captured (JIT) step for comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

os.environ["VKGRAPH_PROFILE"] = "1"
os.environ.setdefault("VKGRAPH_PROFILE_FILE", os.devnull)

from bench_llm import SHAPES, random_model  # noqa: E402

from vkgraph.nn.config import ModelConfig  # noqa: E402
from vkgraph.nn.engine import Engine  # noqa: E402
from vkgraph.nn.llama import LlamaModel  # noqa: E402
from vkgraph.runtime import get_device  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--format", default="Q4_0")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    cfg = ModelConfig(arch="llama", max_seq_len=8192, **SHAPES[a.shape])
    dev = get_device()
    model = LlamaModel(random_model(cfg, a.format), num_blocks=a.batch * 8 + 16, max_blocks_per_seq=8)
    engine = Engine(model, max_batch=a.batch)
    for i in range(a.batch):
        engine.add_request([(i * 7 + j) % cfg.vocab_size for j in range(16)], max_tokens=3 * a.steps + 16,
                           stop_token_ids=[])
    for _ in range(4):  # prefill, then the JIT's eager call, capture and first replay
        engine.step()
    dev.synchronize()
    walls = []
    for _ in range(a.steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    prof = dev.queue.profiler
    prof.events.clear()
    engine._decode = engine._decode_step  # eager: every dispatch is recorded, so every one is timed
    t = time.perf_counter()
    for _ in range(a.steps):
        engine.step()
    dev.synchronize()
    eager_wall = (time.perf_counter() - t) / a.steps
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    first = min(t0 for _, t0, _ in prof.events)
    last = max(t1 for _, _, t1 in prof.events)
    for name, t0, t1 in prof.events:
        per[name][0] += 1
        per[name][1] += (t1 - t0) / 1e3
    busy = sum(v[1] for v in per.values()) / a.steps
    print(f"{dev.info.name}: {a.shape} {a.format} batch {a.batch}")
    print(f"JIT step wall {statistics.median(walls) * 1e3:.2f} ms; eager step wall {eager_wall * 1e3:.2f} ms; "
          f"GPU span {(last - first) / 1e6 / a.steps:.2f} ms/step, of which inside dispatches {busy / 1e3:.2f} ms")
    print(f"{'kernel':28s} {'per step':>9s} {'us/step':>10s} {'share':>7s}")
    for name, (count, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"{name[:28]:28s} {count / a.steps:9.1f} {us / a.steps:10.1f} {us / a.steps / busy:7.1%}")


if __name__ == "__main__":
    main()

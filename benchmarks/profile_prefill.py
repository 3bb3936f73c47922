"""Prefill tokens/s of a random-weight model, and where its GPU time goes, beside eager PyTorch float16.

    python benchmarks/profile_prefill.py [--shape llama3-8b] [--formats Q4_0,Q8_0] [--layers 8] [--prompt 512]
                                         [--reps 3] [--quant-coop 1,0] [--flash 1,0]

Per format, per VKGRAPH_QUANT_COOP setting (1: quantized products on cooperative matrices where the device has
them, templates.matmul_quant; 0: a float16 copy of each weight and the generated matmul) and per
VKGRAPH_FLASH_PREFILL setting (1: attention on cooperative matrices, templates.flash_prefill; 0: the template
prefill_attention), the median wall time of `--reps` prefills of one prompt after a clock warm-up
(common.raise_clocks; each prompt new, so no cached prefix; the first token sampled as the engine does) and the
calling thread's CPU time in it (the host's work; a driver's threads not counted): as the engine runs them (the
first captures the forward pass, the others replay it: VKGRAPH_PREFILL_CAPTURE_ROWS), then eagerly
(every graph built, scheduled and recorded, each layer submitted as it is built); then one more eager prefill
under VKGRAPH_PROFILE, whose per-kernel GPU time is printed by kernel name. `--layers` keeps only the first layers of
the shape (the random weights of all 32 layers of the 8B shape take a minute to draw): every layer does the same
work, so a full-depth prefill takes about (measured time - head) * 32 / layers + head. PyTorch runs the same
reduced shape.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

os.environ["VKGRAPH_PROFILE"] = "1"
os.environ.setdefault("VKGRAPH_PROFILE_FILE", os.devnull)

from bench_llm import SHAPES, bench_torch, random_model  # noqa: E402
from common import raise_clocks  # noqa: E402

from vkgraph.nn.config import ModelConfig  # noqa: E402
from vkgraph.nn.engine import Engine  # noqa: E402
from vkgraph.nn.llama import LlamaModel  # noqa: E402
from vkgraph.runtime import get_device  # noqa: E402


def prefill(dev, model, vocab: int, prompt: int, reps: int) -> tuple[tuple[float, float], tuple[float, float], dict]:
    """(median seconds of one prefill and of the host's CPU time in it) as the engine runs it (the first of `reps`
    captures the forward pass, later ones replay it) and eagerly (every graph built, scheduled and recorded; each
    layer submitted as it is built), and {kernel: [dispatches, GPU us]} of one more eager prefill, profiled."""
    engine = Engine(model, max_batch=1)

    def one(r: int) -> tuple[float, float]:
        engine.add_request([(i * 3 + r) % vocab for i in range(prompt)], max_tokens=1, stop_token_ids=[])
        dev.synchronize()
        t, c = time.perf_counter(), time.thread_time()
        engine.step()
        dev.synchronize()
        return time.perf_counter() - t, time.thread_time() - c

    def medians(runs: list[tuple[float, float]]) -> tuple[float, float]:
        return statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)

    one(1000)  # compiles
    raise_clocks()
    captured = medians([one(r) for r in range(reps)])
    engine._prefill_pass = engine._forward  # eager: every dispatch is recorded, so every one is timed
    eager = medians([one(100 + r) for r in range(reps)])
    prof = dev.queue.profiler
    prof.events.clear()
    one(2000)
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, t0, t1 in prof.events:
        per[name][0] += 1
        per[name][1] += (t1 - t0) / 1e3
    prof.events.clear()
    return captured, eager, per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--formats", default="Q4_0,Q8_0")
    ap.add_argument("--layers", type=int, default=0, help="keep only this many layers (0: all)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quant-coop", default="1,0", help="VKGRAPH_QUANT_COOP settings to run, e.g. 1,0")
    ap.add_argument("--flash", default="1,0", help="VKGRAPH_FLASH_PREFILL settings to run, e.g. 1,0")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per run")
    a = ap.parse_args()
    shape = dict(SHAPES[a.shape])
    if a.layers:
        shape["n_layers"] = a.layers
    cfg = ModelConfig(arch="llama", max_seq_len=8192, **shape)
    dev = get_device()
    per_seq = -(-(a.prompt + 2) // 16)
    print(f"{dev.info.name}: {a.shape}, {cfg.n_layers} layers, prompt {a.prompt}", flush=True)
    for fmt in a.formats.split(","):
        model = LlamaModel(random_model(cfg, fmt), num_blocks=2 * per_seq + 16, max_blocks_per_seq=per_seq)
        for coop, flash in [(c, f) for c in a.quant_coop.split(",") for f in a.flash.split(",")]:
            # read when the step's graph is built
            os.environ["VKGRAPH_QUANT_COOP"], os.environ["VKGRAPH_FLASH_PREFILL"] = coop, flash
            (wall, host), (eager, eager_host), per = prefill(dev, model, cfg.vocab_size, a.prompt, a.reps)
            busy = sum(v[1] for v in per.values())
            print(f"vkgraph {fmt} quant_coop={coop} flash={flash}: {a.prompt / wall:.1f} tok/s ({wall * 1e3:.2f} ms, "
                  f"host CPU {host * 1e3:.2f} ms); eager {a.prompt / eager:.1f} tok/s ({eager * 1e3:.2f} ms, host CPU "
                  f"{eager_host * 1e3:.2f} ms); GPU busy {busy / 1e3:.2f} ms in "
                  f"{sum(v[0] for v in per.values()):.0f} dispatches", flush=True)
            for name, (count, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:a.top]:
                print(f"  {name[:44]:44s} {count:5.0f} {us / 1e3:9.3f} ms {us / busy:6.1%}")
        del model
    t = bench_torch(cfg, [], 1, a.prompt)
    if t is not None:
        print(f"PyTorch eager f16: {t['prefill']:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()

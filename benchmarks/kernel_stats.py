"""What the driver compiled for the kernels that set the LLM figures: registers, shared memory, spills, ...

    python benchmarks/kernel_stats.py [--only SUBSTRING] [--decode llama3-8b:Q4_0:1,8]

Builds (and runs once) the float16 product of 4096^3 and of the prefill shapes, the quantized prefill product
(Q4_0, 512 rows), the integer matvec at 1 and 8 activation rows (Q4_0 and Q8_0, the Llama-3-8B q/k/v and down
shapes), rmsnorm_q8 and the paged decode attention at batch 32 (with --decode also a model's decode steps, whose
kernels carry the step's fusions and launches: bench_llm.py's random-weight model), then prints every kernel the
device holds with the statistics its driver reports through VK_KHR_pipeline_executable_properties
(VKGRAPH_PIPELINE_STATS=1, set here), in the driver's own names. Where the driver reports registers per
invocation, it also prints the workgroups of that kernel one multiprocessor can hold by registers alone, for a
register file of --regs-per-sm (65536 on every NVIDIA GPU since Kepler, the H200 included).
"""

from __future__ import annotations

import argparse
import os

os.environ["VKGRAPH_PIPELINE_STATS"] = "1"  # before the device is made

import numpy as np  # noqa: E402
from bench_llm import SHAPES, random_model, warm_engine  # noqa: E402

from vkgraph import Tensor  # noqa: E402
from vkgraph.dtype import dtypes  # noqa: E402
from vkgraph.nn.config import ModelConfig  # noqa: E402
from vkgraph.nn.llama import LlamaModel  # noqa: E402
from vkgraph.nn.template_ops import QuantLinear  # noqa: E402
from vkgraph.quant import random_blocks  # noqa: E402
from vkgraph.runtime import get_device  # noqa: E402
from vkgraph.templates import matvec as mv  # noqa: E402
from vkgraph.templates import norms  # noqa: E402
from vkgraph.templates import paged_attention as pa  # noqa: E402

MATMULS = ((4096, 4096, 4096), (512, 4096, 14336), (512, 14336, 4096))  # m, k, n
MATVECS = (("qkv", 6144, 4096), ("down", 4096, 14336))


def build_all(dev, rng) -> None:
    for m, k, n in MATMULS:
        a = Tensor(rng.standard_normal((m, k), dtype=np.float32)).cast(dtypes.float16)
        b = Tensor(rng.standard_normal((k, n), dtype=np.float32)).cast(dtypes.float16)
        (a @ b).realize()
    lin = QuantLinear(random_blocks(rng, "Q4_0", 14336, 4096, d_range=(1e-3, 1e-2)))
    lin(Tensor(rng.standard_normal((512, 4096), dtype=np.float32))).realize()
    for fmt in ("Q4_0", "Q8_0"):
        for _, n, k in MATVECS:
            w = mv.upload_weights(dev, random_blocks(rng, fmt, n, k, d_range=(1e-3, 1e-2)))
            for rows in (1, 8):
                x = dev.alloc(rows * k * 4)
                dev.upload(x, rng.standard_normal(rows * k).astype(np.float32))
                gamma = dev.alloc(k * 4)
                dev.upload(gamma, np.ones(k, np.float32))
                acts = norms.rmsnorm_q8(dev, x, gamma, rows, k)
                mv.matvec(dev, w, mv.Q8Acts.in_buffer(acts, rows, k), rows)
    b, ctx, hq, hkv, d, bs = 32, 2048, 32, 8, 128, 16
    blocks = b * ctx // bs
    cache = pa.PagedKVCache.create(dev, blocks, hkv, d, bs, "f16")
    tables = np.arange(blocks, dtype=np.int32).reshape(b, ctx // bs)
    q, tb, lens = dev.alloc(b * hq * d * 4), dev.alloc(tables.nbytes), dev.alloc(b * 4)
    dev.upload(tb, tables)
    dev.upload(lens, np.full(b, ctx, np.int32))
    pa.paged_decode(dev, cache, q, tb, lens, num_seqs=b, num_heads=hq, max_blocks_per_seq=tables.shape[1],
                    max_context_len=ctx)
    dev.synchronize()


def build_decode(spec: str) -> None:
    """The decode steps of `spec` = shape:format:batches (bench_llm's random-weight model), through the JIT's
    eager call, capture and replay, as bench_llm runs them."""
    shape, fmt, batches = spec.split(":")
    cfg = ModelConfig(arch="llama", max_seq_len=8192, **SHAPES[shape])
    sizes = [int(b) for b in batches.split(",")]
    model = LlamaModel(random_model(cfg, fmt), num_blocks=max(sizes) * 8 + 16, max_blocks_per_seq=8)
    for b in sizes:
        engine = warm_engine(model, cfg.vocab_size, b, 8)
        while engine.has_work():
            engine.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="kernels whose name holds this")
    ap.add_argument("--regs-per-sm", type=int, default=65536)
    ap.add_argument("--decode", default="", help="also a model's decode steps: shape:format:batches, e.g. "
                    "llama3-8b:Q4_0:1,8")
    a = ap.parse_args()
    dev = get_device()
    if not dev.capture_statistics:
        raise SystemExit(f"{dev.info.name}: its driver does not offer VK_KHR_pipeline_executable_properties")
    build_all(dev, np.random.default_rng(0))
    if a.decode:
        build_decode(a.decode)
    pipes = sorted({id(p): p for p in dev.pipelines.live.values()}.values(), key=lambda p: p.name)
    print(f"{dev.info.name}: {len(pipes)} kernels")
    for p in pipes:
        if a.only not in p.name:
            continue
        invocations = p.local_size[0] * p.local_size[1] * p.local_size[2]
        for exe, stats in dev.kernel_statistics(p).items():
            regs = next((v for s, v in stats.items() if "register" in s.lower() and isinstance(v, int)), None)
            fit = f", {a.regs_per_sm // (regs * invocations)} workgroups/SM by registers" if regs else ""
            print(f"\n{p.name} ({invocations} invocations, spec {p.spec}) [{exe}]{fit}")
            for s, v in stats.items():
                print(f"    {s}: {v}")


if __name__ == "__main__":
    main()

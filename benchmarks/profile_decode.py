"""Where a decode step's GPU time goes: per-kernel timestamps of eager decode steps of a random-weight model.

    python benchmarks/profile_decode.py [--shape llama3-8b|llama3.2-1b|small] [--format Q4_0] [--batches 1,8]
                                        [--fusion 0,1] [--glu 1,0] [--launch workgroup,subgroup] [--mm 8,0]
                                        [--steps 5] [--context 16]
                                        [--matvec-sg "/8:128,4,2,0,1,1"] [--norm 0,8]
                                        [--norm-sg "/1:1024,1,4,32,1"]
                                        [--copy-mib 1024] [--kernels]

Per batch size (and per VKGRAPH_DECODE_FUSION setting, on the same model: 0 is the unfused layers), runs the
engine's decode step of requests of --context prompt tokens captured (JIT, timed by wall clock) and then without the
JIT (the same kernels, recorded one by one) under VKGRAPH_PROFILE (and per VKGRAPH_GLU_EPILOGUE setting in --glu:
the MLP's gated unit in the gate/up product's epilogue, or a kernel of its own; per VKGRAPH_MATVEC_LAUNCH setting in
--launch: the matvec launches; per VKGRAPH_DECODE_MM_ROWS setting in --mm: from how many rows the products take
matmul_quant's small-row tiles, 0 never; per VKGRAPH_MATVEC_SG setting in --matvec-sg, separated by '/', an empty
one for the tables' parameters; per VKGRAPH_NORM_PROLOGUE setting in --norm: the most activation rows at which the
norms before the products of up to matvec.NORM_MAX_ROWS rows (q/k/v) run in their prologue, 0 never; per
VKGRAPH_NORM_PROLOGUE_SG setting in --norm-sg, as --matvec-sg), and prints the dispatches per step and the GPU time
inside them; with --kernels also per kernel name: dispatches per step, GPU microseconds per step, and the share of
the step.

Then the floor of a step on this device, from two probes: the copy bandwidth (bench_runtime's grid-stride
copy of --copy-mib MiB, bytes read + written per second) and the cost of one dependent dispatch (a chain of
CHAIN empty dispatches, each writing the buffer the next one reads, so a barrier separates every pair, in one
submit: (time of the chain - time of a chain of one) / (CHAIN - 1)). A step is then modelled as
weight bytes / bandwidth + dispatches x barrier cost, printed against the measured JIT step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections import defaultdict

os.environ["VKGRAPH_PROFILE"] = "1"
os.environ.setdefault("VKGRAPH_PROFILE_FILE", os.devnull)

from bench_llm import SHAPES, random_model, request_blocks, warm_engine, weight_bytes  # noqa: E402
from bench_runtime import bench_copy_kernel  # noqa: E402
from common import raise_clocks  # noqa: E402

from vkgraph.flags import flag  # noqa: E402
from vkgraph.nn.config import ModelConfig  # noqa: E402
from vkgraph.nn.llama import LlamaModel  # noqa: E402
from vkgraph.runtime import get_device  # noqa: E402

CHAIN = 400
# an empty kernel over one read-write buffer: consecutive dispatches of it are ordered by a barrier
EMPTY = """#version 450
layout(local_size_x = 1) in;
layout(set = 0, binding = 0) buffer B { uint v[]; };
void main() {}
"""


def barrier_us(dev, reps: int = 7) -> float:
    """Microseconds one dependent dispatch adds on the device (see the module doc); the profiler's timestamps
    are left out of the chain, and the chain is recorded into one command buffer."""
    kern = dev.pipeline(EMPTY, name="empty")
    buf = dev.alloc(256)
    queue = dev.queue
    saved = queue.profiler, queue.max_recorded
    queue.profiler, queue.max_recorded = None, 2 * CHAIN
    dev.synchronize()

    def chain(n: int) -> float:
        for _ in range(n):
            dev.dispatch(kern, [buf], (1, 1, 1))
        t = time.perf_counter()
        dev.synchronize()  # the submit: recording is outside the time
        return time.perf_counter() - t

    try:
        chain(CHAIN)  # warm-up
        long = statistics.median(chain(CHAIN) for _ in range(reps))
        short = statistics.median(chain(1) for _ in range(reps))
    finally:
        queue.profiler, queue.max_recorded = saved
        buf.release()
    return max(long - short, 0.0) / (CHAIN - 1) * 1e6


def profile(dev, model, vocab: int, batch: int, steps: int, context: int) -> tuple[float, float, dict]:
    """(median JIT step seconds, dispatches per step, {kernel: [dispatches, GPU us]} over the eager steps) of
    requests of `context` prompt tokens."""
    engine = warm_engine(model, vocab, batch, 2 * steps + 8, context)
    raise_clocks()  # loading and capture left the GPU idle, its clocks low: short timed runs read 2-4x slow
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    prof = dev.queue.profiler
    engine._decode = engine._decode_step  # eager: every dispatch is recorded, so every one is timed
    raise_clocks()
    prof.events.clear()  # the clock-raising products' own timestamps are not the step's
    for _ in range(steps):
        engine.step()
    dev.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, t0, t1 in prof.events:
        per[name][0] += 1
        per[name][1] += (t1 - t0) / 1e3
    dispatches = len(prof.events) / steps
    while engine.has_work():  # the requests' last tokens, so their KV blocks return for the next run
        engine.step()
    dev.synchronize()
    prof.events.clear()  # no table of every run at exit
    return statistics.median(walls), dispatches, per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--format", default="Q4_0")
    ap.add_argument("--batches", default="1", help="decode batch sizes, e.g. 1,8,32")
    ap.add_argument("--fusion", default="1",
                    help="VKGRAPH_DECODE_FUSION settings to run on the same model, e.g. 0,1 (unfused, then fused)")
    ap.add_argument("--glu", default=None,
                    help="VKGRAPH_GLU_EPILOGUE settings to run on the same model, e.g. 1,8,0 (the most rows the "
                    "gate/up product's epilogue takes; 0 never; default: the flag's)")
    ap.add_argument("--launch", default="auto",
                    help="VKGRAPH_MATVEC_LAUNCH settings to run on the same model, e.g. workgroup,subgroup")
    ap.add_argument("--mm", default="",
                    help="VKGRAPH_DECODE_MM_ROWS settings to run on the same model, e.g. 8,0 (default: the flag's)")
    ap.add_argument("--matvec-sg", default=None,
                    help="VKGRAPH_MATVEC_SG settings separated by '/', e.g. '/8:128,4,2,0,1,1' (empty: the tables)")
    ap.add_argument("--norm", default="",
                    help="VKGRAPH_NORM_PROLOGUE settings to run on the same model, e.g. 0,8 (default: the flag's)")
    ap.add_argument("--norm-sg", default=None,
                    help="VKGRAPH_NORM_PROLOGUE_SG settings separated by '/', e.g. '/1:1024,1,4,32,1' (empty: the "
                         "table's)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--context", type=int, default=16, help="prompt tokens of each decoding request")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the copy-bandwidth probe")
    ap.add_argument("--kernels", action="store_true", help="also print the per-kernel table of each run")
    a = ap.parse_args()
    cfg = ModelConfig(arch="llama", max_seq_len=8192, **SHAPES[a.shape])
    batches = [int(b) for b in a.batches.split(",")]
    dev = get_device()
    weights = random_model(cfg, a.format)
    nbytes = weight_bytes(weights)
    per_seq = max(8, request_blocks(max(batches), a.context, 2 * a.steps + 24))
    model = LlamaModel(weights, num_blocks=max(batches) * per_seq + 16, max_blocks_per_seq=per_seq)
    del weights
    gbs = bench_copy_kernel(dev, a.copy_mib << 20, 256, [256, 1024, 4096, 16384])["GB/s"]
    barrier = barrier_us(dev)
    bytes_ms = nbytes / (gbs * 1e9) * 1e3
    print(f"{dev.info.name}: {a.shape} {a.format}, {nbytes / 1e9:.3f} GB of weights per step; copy bandwidth "
          f"{gbs:.0f} GB/s ({bytes_ms:.3f} ms per step); dependent dispatch {barrier:.2f} us (chain of {CHAIN})")
    print(f"{'fusion':>6s} {'glu':>3s} {'launch':>9s} {'mm':>3s} {'norm':>4s} {'batch':>5s} {'dispatches':>10s}"
          f" {'GPU busy ms':>11s} {'floor ms':>9s} {'JIT ms':>8s} "
          f"{'explained':>9s} {'tok/s':>9s} {'floor tok/s':>11s}", flush=True)
    mm_rows = a.mm.split(",") if a.mm else [str(flag("VKGRAPH_DECODE_MM_ROWS"))]
    sg_settings = a.matvec_sg.split("/") if a.matvec_sg is not None else [flag("VKGRAPH_MATVEC_SG")]
    glus = a.glu.split(",") if a.glu is not None else [str(flag("VKGRAPH_GLU_EPILOGUE"))]
    norms = a.norm.split(",") if a.norm else [str(flag("VKGRAPH_NORM_PROLOGUE"))]
    norm_sgs = a.norm_sg.split("/") if a.norm_sg is not None else [flag("VKGRAPH_NORM_PROLOGUE_SG")]
    for sg, norm_sg, fusion, glu, launch, mm, norm in itertools.product(
            sg_settings, norm_sgs, a.fusion.split(","), glus, a.launch.split(","), mm_rows, norms):
        if len(sg_settings) > 1:
            print(f"VKGRAPH_MATVEC_SG={sg!r}", flush=True)
        if len(norm_sgs) > 1:
            print(f"VKGRAPH_NORM_PROLOGUE_SG={norm_sg!r}", flush=True)
        os.environ["VKGRAPH_MATVEC_SG"] = sg  # read when a matvec is recorded
        os.environ["VKGRAPH_NORM_PROLOGUE_SG"] = norm_sg  # read when the step's graph is built and recorded
        os.environ["VKGRAPH_NORM_PROLOGUE"] = norm  # read when the step's graph is built
        os.environ["VKGRAPH_DECODE_FUSION"] = fusion  # read when the step's graph is built
        os.environ["VKGRAPH_GLU_EPILOGUE"] = glu  # read when the step's graph is built
        os.environ["VKGRAPH_MATVEC_LAUNCH"] = launch  # read when a matvec is recorded
        os.environ["VKGRAPH_DECODE_MM_ROWS"] = mm  # read when the step's graph is built
        for b in batches:
            wall, dispatches, per = profile(dev, model, cfg.vocab_size, b, a.steps, a.context)
            busy = sum(v[1] for v in per.values()) / a.steps
            floor_ms = bytes_ms + dispatches * barrier / 1e3
            jit_ms = wall * 1e3
            print(f"{fusion:>6s} {glu:>3s} {launch:>9s} {mm:>3s} {norm:>4s} {b:5d} {dispatches:10.0f} "
                  f"{busy / 1e3:11.3f} {floor_ms:9.3f} {jit_ms:8.3f} "
                  f"{floor_ms / jit_ms:9.0%} {b / wall:9.1f} {b / (floor_ms / 1e3):11.1f}", flush=True)
            if a.kernels:
                print(f"  {'kernel':28s} {'per step':>9s} {'us/step':>10s} {'share':>7s}")
                for name, (count, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
                    print(f"  {name[:28]:28s} {count / a.steps:9.1f} {us / a.steps:10.1f} {us / a.steps / busy:7.1%}")


if __name__ == "__main__":
    main()

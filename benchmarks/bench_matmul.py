"""Matrix products on the GPU: vkgraph's generated kernels against torch.matmul in the same process.

    python benchmarks/bench_matmul.py                 # float16 and bfloat16 (where offered), default tiles
    python benchmarks/bench_matmul.py --tune          # first search tile configurations per shape (codegen.tune)
    python benchmarks/bench_matmul.py --tune --dtypes float16 --shapes 4096x4096x4096,512x4096x14336   # some shapes
    python benchmarks/bench_matmul.py --quant Q4_0,Q8_0   # the prefill products over quantized weights
    python benchmarks/bench_matmul.py --quant Q4_0,Q8_0 --tune   # the same, each product's tiles searched first
    python benchmarks/bench_matmul.py --quant Q4_0 --tune --shapes 512x4096x14336   # one of them
    python benchmarks/bench_matmul.py --int8          # int8 x int8 -> int32 against torch._int_mm, and float16
    python benchmarks/bench_matmul.py --int8 --tune   # the same, int8 tiles searched first

Shapes (M x K @ K x N): 4096^3, and the Llama-3-8B prefill products of 512 tokens, with the weight stored
(N, K) and read transposed as `x @ w.T` is (the attention and MLP projections; with --quant also the fused qkv and
gate_up products, 512x4096x6144 and 512x4096x28672). GPU time per product: vkgraph's
through a replayed command graph (benchmarks/common.replay_us), PyTorch's through CUDA events; inputs random.
The last column is the fraction of the dense float16/bfloat16 peak, PEAK_TFLOPS (the H100/H200 SXM datasheet).
With --quant, the prefill products run through QuantLinear over random blocks of the formats given (float32
activations in, float32 out): the kernel that dequantizes into shared memory (templates.matmul_quant), and the
float16 copy of the weights with the generated matmul (VKGRAPH_QUANT_COOP=0), beside torch.matmul in float16 on
the same shape; the first in the tile measured for its class (--tune) and in matmul_quant's default. With --int8,
`x.matmul(w.T, dtype=int32)` of int8 operands (int8 cooperative matrices, int32 accumulation) against
torch._int_mm, beside the float16 product of the same shape, in TOPS (checked exact).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import raise_clocks, replay_us, torch_time_us  # noqa: E402

from vkgraph import graph, realize  # noqa: E402
from vkgraph.codegen import matmul_coop, tune  # noqa: E402
from vkgraph.dtype import dtypes  # noqa: E402
from vkgraph.flags import flag  # noqa: E402
from vkgraph.nn.template_ops import QuantLinear  # noqa: E402
from vkgraph.quant import random_blocks  # noqa: E402
from vkgraph.runtime import get_device  # noqa: E402
from vkgraph.schedule import Kernel  # noqa: E402
from vkgraph.templates import matmul_quant as mq  # noqa: E402
from vkgraph.tensor import Tensor  # noqa: E402
from vkgraph.view import ShapeTracker  # noqa: E402

PEAK_TFLOPS = 989.5


def search(m: int, n: int, k: int, dname: str, reps: int = 5, wt: bool = False) -> tuple[Any, dict]:
    """Time every configuration of matmul_coop.candidates (those that fit the device) on one (m, k) @ (k, n) product of
    random `dname` values (int8: summed in int32) and record the fastest for its shape class (codegen.tune).
    Each is timed as the replayed figures are (a graph of 10 products replayed `reps` times, the median): bursts
    of dispatches read up to 3x low; each is named before it runs). Every pipeline is built before any is timed
    and the clocks raised after (a compile idles the GPU long enough for its clocks to fall: search_quant), then
    every configuration is timed twice, in one order and in reverse, at its better figure. With wt, B is stored
    (n, k) and read transposed, as `x @ w.T` reads a weight. Returns the best and the microseconds of each."""
    d = getattr(dtypes, dname)
    dev = get_device()
    lim = realize.limits()
    rng = np.random.default_rng(0)
    srcs = [graph.buffer(realize.upload(rng.integers(-128, 128, s, dtype=np.int8) if d is dtypes.int8 else
                                        rng.standard_normal(s, dtype=np.float32), d), 0, d, s)
            for s in ((m, k), (n, k) if wt else (k, n))]
    if wt:
        srcs[1] = graph.movement(srcs[1], lambda st: st.permute((1, 0)))
    if d is dtypes.int8:
        srcs = [graph.alu(graph.Op.CAST, dtypes.int32, s) for s in srcs]
    mm = graph.matmul(srcs[0], srcs[1], dtypes.int32 if d is dtypes.int8 else d)
    compute = matmul_coop.compute_type(mm, lim)
    frag = matmul_coop.fragment(lim, matmul_coop.operand_type(compute))
    kern = Kernel(mm, realize.allocate(mm.dtype, mm.numel), ShapeTracker.contiguous(mm.shape))
    built = []
    for cfg in matmul_coop.candidates(m, n, k, 1, lim, frag, compute):
        lowered = matmul_coop.lower_coop(kern, mm, lim, {}, cfg, compute)
        for ref in lowered.scratch:  # a K split's partial planes
            ref.buf = dev.alloc(ref.nbytes)
        steps = [(dev.pipeline(p.src, name=p.name), [ref.buf for ref, _, _ in p.bindings], p.groups, p.push or None)
                 for p in lowered.programs]
        built.append((cfg, lowered, steps))
    raise_clocks()
    runs = {cfg: lambda steps=steps: [dev.dispatch(*st) for st in steps] for cfg, _, steps in built}
    times = _time_twice(dev, f"{dname} {m}x{k}x{n}", 2 * m * n * k, runs, reps, 10)
    for _, lowered, _ in built:
        for ref in lowered.scratch:
            ref.buf.release()
    best = min(times, key=times.get)
    tune.record(tune.path(flag("VKGRAPH_CACHE_DIR"), lim.device), matmul_coop.shape_class(m, n, k, 1, compute), best)
    realize.forget_limits()
    return best, times
# (label, M, K, N, weight stored transposed)
SHAPES = [("4096^3", 4096, 4096, 4096, False), ("prefill 512x4096 @ 4096x4096 (w.T)", 512, 4096, 4096, True),
          ("prefill 512x4096 @ 4096x14336 (w.T)", 512, 4096, 14336, True),
          ("prefill 512x14336 @ 14336x4096 (w.T)", 512, 14336, 4096, True)]
# the quantized products also in the Llama-3-8B layer's fused shapes: qkv (6144 columns) and gate_up (28672), whose
# shape classes differ from the unfused ones'
QUANT_SHAPES = [*SHAPES[1:], ("prefill qkv 512x4096 @ 4096x6144 (w.T)", 512, 4096, 6144, True),
                ("prefill gate_up 512x4096 @ 4096x28672 (w.T)", 512, 4096, 28672, True)]


def _time_twice(dev: Any, name: str, flop: int, runs: dict, reps: int, per_graph: int) -> dict:
    """Microseconds of each configuration's run (common.replay_us, `per_graph` calls a graph), timed twice, in one
    order and in reverse, at its better figure; each named before it runs and printed in TFLOP/s."""
    times: dict = {}
    for rnd, order in enumerate((list(runs), list(runs)[::-1])):
        for cfg in order:
            print(f"  {name} {cfg.label()} (round {rnd + 1}): ", end="", flush=True)
            us = replay_us(dev, runs[cfg], reps, per_graph=per_graph)
            times[cfg] = min(times.get(cfg, us), us)
            print(f"{flop / us / 1e6:.1f} TFLOP/s", flush=True)
    return times


def _shapes(sizes: str, shapes: list) -> list:
    """The rows of `shapes` named by sizes ("MxKxN,..."), in that order; all of them when sizes is empty."""
    by_size = {f"{m}x{k}x{n}": row for row in shapes for _, m, k, n, _ in [row]}
    return [by_size[s] for s in sizes.split(",") if s in by_size] if sizes else shapes


QUANT_PER_GRAPH = 10


def search_quant(lin: QuantLinear, x: Any, m: int, reps: int = 5) -> dict:
    """Time templates.matmul_quant in every tile of its search (matmul_quant.candidates), on QuantLinear lin's
    weights and the float16 rows x; record the fastest for the product's class (codegen.tune). Each of the
    QUANT_PER_GRAPH products of a replayed graph writes its own output, as QuantLinear's calls do (so no barrier
    orders them). Every tile's pipeline is built first and the clocks raised after: a compile leaves the GPU idle
    long enough for its clocks to fall, and the ninth session's search, compiling between timings, read the same
    tiles 1.5-3x apart (RESULTS.md). Then every tile is timed twice, in one order and in reverse, and keeps its
    better figure. A tile whose first rows differ from the first tile's by more than float32 accumulation could
    (1e-3 of the largest value) is reported and left out. Returns the microseconds of each."""
    dev = get_device()
    lim = realize.limits()
    n, k = lin.out_features, lin.in_features
    bufs = [t.realize().node.arg[0].buf for t in lin.tensors]  # the weight Tensors' device buffers
    lin.weights.bind(dev, bufs[0], bufs[1])
    tiles = mq.candidates(lim, m, n, k)
    outs = [dev.alloc(max(c.ks for c in tiles) * m * n * 4) for _ in range(QUANT_PER_GRAPH)]  # a K split: planes
    rows, ref, wrong = min(m, 16), None, set()
    for cfg in tiles:  # builds each pipeline, and checks its result against the first tile's
        mq.matmul_quant(dev, lim, lin.weights, x, m, cfg, out=outs[0])
        got = dev.download(outs[0], np.float32, (cfg.ks, m, n))[:, :rows].sum(0, dtype=np.float64)
        ref = got if ref is None else ref
        if not np.isfinite(got).all() or np.abs(got - ref).max() > 1e-3 * np.abs(ref).max():
            print(f"  {lin.format} {m}x{k}x{n} {cfg.label()}: WRONG RESULT, left out", flush=True)
            wrong.add(cfg)
    tiles = [c for c in tiles if c not in wrong]
    dev.synchronize()
    raise_clocks()
    runs = {}
    for cfg in tiles:
        calls = iter(range(1 << 30))

        def run(cfg=cfg, calls=calls) -> None:
            mq.matmul_quant(dev, lim, lin.weights, x, m, cfg, out=outs[next(calls) % QUANT_PER_GRAPH])
        runs[cfg] = run
    times = _time_twice(dev, f"{lin.format} {m}x{k}x{n}", 2 * m * n * k, runs, reps, QUANT_PER_GRAPH)
    best = min(times, key=times.get)
    tune.record(tune.path(flag("VKGRAPH_CACHE_DIR"), lim.device), mq.shape_class(lin.format, m, n, k), best)
    realize.forget_limits()
    for o in outs:
        o.release()
    return times


def quant(formats: list[str], reps: int, torch: Any, tune_tiles: bool = False, sizes: str = "") -> None:
    """TFLOP/s of the prefill products over quantized weights, both vkgraph paths and torch float16; with
    tune_tiles, each product's tiles are searched first (search_quant)."""
    dev = get_device()
    rng = np.random.default_rng(0)
    print(f"\n{'quantized prefill product':40s}{'coop':>8s}{'default':>9s}{'f16 copy':>10s}{'torch f16':>11s}"
          f"{'ratio':>7s}  tile (coop: tuned where measured; default: matmul_quant.config without)")
    for fmt in formats:
        for label, m, k, n, _ in _shapes(sizes, QUANT_SHAPES):
            flop = 2 * m * n * k
            lin = QuantLinear(random_blocks(rng, fmt, n, k, d_range=(1e-3, 1e-2)))
            tx = Tensor(rng.standard_normal((m, k), dtype=np.float32)).realize()
            if tune_tiles and lin.coop_tile(m) is not None:
                x16 = tx.cast(dtypes.float16).realize()
                times = search_quant(lin, x16.node.arg[0].buf, m)
                print(f"{fmt} {label}: tuned TFLOP/s " + ", ".join(
                    f"{c.label()} {flop / t / 1e6:.0f}"
                    for c, t in sorted(times.items(), key=lambda kv: kv[1])), flush=True)
            cells = []
            for coop, tuned in (("1", "1"), ("1", "0"), ("0", "1")):
                os.environ["VKGRAPH_QUANT_COOP"] = coop  # read when the graph is built
                os.environ["VKGRAPH_MATMUL_TUNE"] = tuned  # read with the device's limits
                realize.forget_limits()
                lin(tx).realize()  # builds the pipelines: the clocks are raised after, for this and torch's figure
                dev.synchronize()
                raise_clocks(1.0)
                us = replay_us(dev, lambda lin=lin, tx=tx: lin(tx).realize(), reps, per_graph=20)
                cells.append(flop / us / 1e6)
            os.environ.pop("VKGRAPH_QUANT_COOP")
            os.environ.pop("VKGRAPH_MATMUL_TUNE")
            realize.forget_limits()
            pt = float("nan")
            if torch is not None:
                txx = torch.randn(m, k, device="cuda", dtype=torch.float16)
                tww = torch.randn(n, k, device="cuda", dtype=torch.float16)
                pt = flop / torch_time_us(torch, lambda txx=txx, tww=tww: txx @ tww.T, 20) / 1e6
            cfg = lin.coop_tile(m)
            tile = cfg.label() if cfg else "none"
            print(f"{fmt + ' ' + label:40s}{cells[0]:8.1f}{cells[1]:9.1f}{cells[2]:10.1f}{pt:11.1f}"
                  f"{cells[0] / pt:7.2f}  {tile}", flush=True)


# 4096^3 in both layouts of B: cuBLASLt's int8 kernels take B column-major (w stored (N, K), read as w.T); with B
# row-major torch._int_mm measured 123 TOPS on an H200
INT8_SHAPES = [("4096^3", 4096, 4096, 4096, False), ("4096^3 (w.T)", 4096, 4096, 4096, True),
               ("512x4096 @ 4096x14336 (w.T)", 512, 4096, 14336, True)]


def int8(reps: int, torch: Any, tune_tiles: bool = False) -> None:
    """TOPS of int8 x int8 -> int32 products (cooperative matrices where the device has int8 ones) against
    torch._int_mm and the float16 product of the same shape, each side's int8 result checked exact."""
    dev = get_device()
    lim = realize.limits()
    rng = np.random.default_rng(0)
    if matmul_coop.fragment(lim, "int8") is None:
        print(f"int8: {dev.info.name} has no int8 cooperative matrices; the tiled integer path is measured")
    rows, searched = [], set()
    for label, m, k, n, wt in INT8_SHAPES:
        ops = 2 * m * n * k
        if tune_tiles and matmul_coop.fragment(lim, "int8") is not None and (m, n, k) not in searched:
            searched.add((m, n, k))
            best, times = search(m, n, k, "int8")
            print(f"int8 {label}: tuned TOPS " + ", ".join(
                f"{c.label()} {ops / t / 1e6:.0f}"
                for c, t in sorted(times.items(), key=lambda kv: kv[1])), flush=True)
        x = rng.integers(-128, 128, (m, k), dtype=np.int8)
        w = rng.integers(-128, 128, (n, k) if wt else (k, n), dtype=np.int8)
        wk = w.T if wt else w
        tx, tw = Tensor(x).realize(), Tensor(w).realize()
        b = tw.T if wt else tw
        # float64 products of int8 values and their sums over K < 2^39 are exact, and BLAS computes them fast
        ref = (x[:64].astype(np.float64) @ wk.astype(np.float64)).astype(np.int64)
        got = tx[:64].matmul(b, dtype=dtypes.int32).numpy()
        exact = bool(np.array_equal(got, ref))
        with realize.count_kernels() as c:
            tx.matmul(b, dtype=dtypes.int32).realize()
        us = replay_us(dev, lambda tx=tx, b=b: tx.matmul(b, dtype=dtypes.int32).realize(), reps, per_graph=20)
        x16, w16 = Tensor(x).cast(dtypes.float16).realize(), Tensor(w).cast(dtypes.float16).realize()
        b16 = w16.T if wt else w16
        us16 = replay_us(dev, lambda x16=x16, b16=b16: (x16 @ b16).realize(), reps, per_graph=20)
        row = [f"int8 {label}", f"{ops / us / 1e6:.1f}", "", "", f"{ops / us16 / 1e6:.1f}", "", str(exact),
               c.names[0] if c.names else ""]
        if torch is not None:
            txx, tww = torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()
            tb = tww.T if wt else tww
            try:
                pt_got = torch._int_mm(txx[:64], tb).cpu().numpy()
            except RuntimeError:  # a build whose _int_mm takes only a contiguous second operand
                tb = tb.contiguous()
                pt_got = torch._int_mm(txx[:64], tb).cpu().numpy()
            pt_exact = bool(np.array_equal(pt_got, ref))
            pt = ops / torch_time_us(torch, lambda txx=txx, tb=tb: torch._int_mm(txx, tb), 20) / 1e6
            t16 = torch.from_numpy(x).cuda().half(), (torch.from_numpy(w).cuda().half())
            tb16 = t16[1].T if wt else t16[1]
            pt16 = ops / torch_time_us(torch, lambda a=t16[0], tb16=tb16: a @ tb16, 20) / 1e6
            row[2:4] = [f"{pt:.1f}{'' if pt_exact else ' (inexact)'}", f"{ops / us / 1e6 / pt:.2f}"]
            row[5] = f"{pt16:.1f}"
        rows.append(row)
        print("  ".join(row), flush=True)
    print(f"\nGPU: {dev.info.name}; int8 TOPS (2*M*N*K per second, 1e12), float16 TFLOP/s of the same shape")
    header = ["product", "vkgraph int8", "torch _int_mm", "ratio", "vkgraph f16", "torch f16", "exact", "kernel"]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(v.ljust(wd) for v, wd in zip(r, widths, strict=True)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tune", action="store_true", help="search tile configurations for each shape first")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtypes", default="float16,bfloat16")
    p.add_argument("--shapes", default="",
                   help="MxKxN products of the float shapes to run, in this order (default: all of SHAPES)")
    p.add_argument("--quant", default="", help="quantized formats (Q4_0,Q8_0,Q4_K,Q6_K): their prefill products only")
    p.add_argument("--int8", action="store_true", help="int8 x int8 -> int32 products only, against torch._int_mm")
    args = p.parse_args()
    dev = get_device()
    lim = realize.limits()
    try:
        import torch
        torch = torch if torch.cuda.is_available() else None
    except ImportError:
        torch = None
    if args.quant:
        raise_clocks()
        quant(args.quant.split(","), args.reps, torch, args.tune, args.shapes)
        return
    if args.int8:
        raise_clocks(3.0)
        int8(args.reps, torch, args.tune)
        return
    rng = np.random.default_rng(0)
    print(f"{dev.info.name}: shared memory per workgroup {dev.info.max_shared_memory} bytes", flush=True)
    if args.tune:  # the clocks rise under load: without this the first shape's search reads low
        raise_clocks(3.0)
    rows = []
    for dname in args.dtypes.split(","):
        d = getattr(dtypes, dname)
        npd = np.float16 if d is dtypes.float16 else ml_dtypes.bfloat16
        if matmul_coop.fragment(lim, matmul_coop.operand_type(d)) is None:
            print(f"{dname}: {dev.info.name} has no cooperative matrices for it; the tiled path is measured")
        for label, m, k, n, wt in _shapes(args.shapes, SHAPES):
            flop = 2 * m * n * k
            x = rng.standard_normal((m, k), dtype=np.float32).astype(npd)
            w = rng.standard_normal((n, k) if wt else (k, n), dtype=np.float32).astype(npd)
            pt = float("nan")
            if torch is not None:  # first, so that a search cut short still leaves the reference printed
                tdt = torch.float16 if d is dtypes.float16 else torch.bfloat16
                txx = torch.from_numpy(x.astype(np.float32)).cuda().to(tdt)
                tww = torch.from_numpy(w.astype(np.float32)).cuda().to(tdt)
                tb = tww.T if wt else tww
                pt = flop / torch_time_us(torch, lambda txx=txx, tb=tb: txx @ tb, 20) / 1e6
                print(f"{dname} {label}: torch.matmul {pt:.1f} TFLOP/s", flush=True)
            if args.tune and matmul_coop.fragment(lim, matmul_coop.operand_type(d)) is not None:
                best, times = search(m, n, k, dname, wt=wt)
                spread = ", ".join(f"{c.label()} {flop / t / 1e6:.0f}"
                                   for c, t in sorted(times.items(), key=lambda kv: kv[1]))
                print(f"{dname} {label}: tuned TFLOP/s {spread}", flush=True)
            tx, tw = Tensor(x).realize(), Tensor(w).realize()
            b = tw.T if wt else tw
            ref = (x[:64].astype(np.float64) @ (w.T if wt else w).astype(np.float64))
            got = (tx[:64] @ b).numpy().astype(np.float64)
            err = np.max(np.abs(got - ref) / (np.abs(x[:64].astype(np.float64)) @ np.abs((w.T if wt else w)
                                                                                         .astype(np.float64))))
            us = replay_us(dev, lambda tx=tx, b=b: (tx @ b).realize(), args.reps, per_graph=20)
            vk = flop / us / 1e6
            row = [f"{dname} {label}", f"{vk:.1f}", "", "", f"{vk / PEAK_TFLOPS:.1%}", f"{err:.1e}"]
            if torch is not None:
                row[2:4] = [f"{pt:.1f}", f"{vk / pt:.2f}"]
            rows.append(row)
            print("  ".join(row), flush=True)
    print(f"\nGPU: {dev.info.name}; TFLOP/s; peak {PEAK_TFLOPS} dense (datasheet)")
    header = ["product", "vkgraph", "torch", "ratio", "of peak", "max err/|a||b|"]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(v.ljust(wd) for v, wd in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()

"""Template throughput: matvec GB/s of weight bytes read, paged decode GB/s of KV bytes read, PyTorch beside.

    python benchmarks/bench_kernels.py [--quick] [--formats Q4_1,Q5_0,...] [--matvec-only]

GPU time per call: 100 calls captured into one command graph (a barrier between consecutive ones, as they
write the same output), replayed after warm-up with a wait each; median over the replays, divided by 100.
The host's cost per call (tens of microseconds in Python) is outside the timing, which it was not when
consecutive dispatches were timed one submit each. Weights and caches are
random bits (never zeros) and cycled through enough copies to exceed the GPU's L2 cache. PyTorch (when
importable with CUDA) is timed with CUDA events the same way: torch.matmul in float16, and
F.scaled_dot_product_attention over contiguous float16 KV.
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
from common import cuda_torch, replay_us, torch_time_us

from vkgraph import quant
from vkgraph.quant import FORMATS
from vkgraph.runtime import get_device
from vkgraph.templates import matvec as mv
from vkgraph.templates import paged_attention as pa

MATVEC_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
MATVEC_FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS",
                  "F16"]
DECODE_CASES = [(1, 4096), (32, 2048)]  # (sequences, context length)
HQ, HKV, HEAD = 32, 8, 128
COPY_BYTES = 512 << 20  # cycle through copies until this many bytes: several times a large L2
TORCH_REPS = 100  # PyTorch calls timed one by one with CUDA events


def _copies(nbytes: int, cap: int = 16) -> int:
    return max(1, min(cap, -(-COPY_BYTES // nbytes)))


def _weight_copies(dev, rng, fmt: str, n: int, k: int) -> list[mv.DeviceWeights]:
    """Device weights in the matvec layout, uploaded into enough copies to exceed the L2 cache: random valid blocks
    (quant.random_blocks), random bits for F16/BF16 (the kernels' speed ignores the values). One host array serves
    every copy: generating blocks in numpy is the slow part of the sweep (0.2-0.3 s per 14336x4096 matrix, which
    generated per copy and per column took the 8-format table past 100 s)."""
    f = FORMATS[fmt]
    if f.block_size == 1:
        qt = quant.QuantizedTensor(rng.integers(0, 256, (n, f.row_bytes(k)), dtype=np.uint8), f, (n, k))
    else:
        qt = quant.random_blocks(rng, f, n, k, d_range=(1e-3, 1e-2))
    return [mv.upload_weights(dev, qt) for _ in range(_copies(n * f.row_bytes(k)))]


def _release_weights(ws: list[mv.DeviceWeights]) -> None:
    for w in ws:
        w.body.release()
        if w.scales is not None:
            w.scales.release()


def matvec_us(dev, ws: list[mv.DeviceWeights], x, y, batch: int, cfg: mv.MatvecConfig, reps: int,
              act: str = "f32") -> float:
    """GPU microseconds per matvec with `cfg` (replay_us), each call reading the next of the weight copies `ws`."""
    calls = itertools.count()

    def run() -> None:
        mv.matvec(dev, ws[next(calls) % len(ws)], x, batch, act_dtype=act, out=y, config=cfg)

    return replay_us(dev, run, reps)


def _matvec_row(dev, rng, cols: list[tuple[str, bool]], n: int, k: int, reps: int) -> list[str]:
    """GB/s of weight bytes of each (format, integer path) column for one shape, chosen configuration; a format's
    columns share its weights."""
    cells: dict[tuple[str, bool], str] = {}
    for fmt in dict.fromkeys(f for f, _ in cols):
        paths = [dot for f, dot in cols if f == fmt]
        nbytes = n * FORMATS[fmt].row_bytes(k)
        if nbytes > dev.info.max_storage_buffer_range:
            cells.update({(fmt, dot): f"{'-':>9s}" for dot in paths})
            continue
        ws = _weight_copies(dev, rng, fmt, n, k)
        x = dev.alloc(k * 4)
        dev.upload(x, rng.standard_normal(k).astype(np.float32))
        y = dev.alloc(n * 4)
        for dot in paths:
            us = matvec_us(dev, ws, x, y, 1, mv.choose_config(dev, FORMATS[fmt], n, k, 1, int_dot=dot), reps)
            cells[fmt, dot] = f"{nbytes / us / 1e3:9.0f}"
        x.release()
        y.release()
        _release_weights(ws)
    return [cells[c] for c in cols]


def bench_matvec(dev, rng, reps: int, formats: list[str] = MATVEC_FORMATS) -> None:
    # the formats, then those with an integer dot-product path through it ("int8": activations quantized to
    # int8 per block of 32 by a kernel of their own, included in the time)
    cols = [(f, False) for f in formats]
    if dev.info.integer_dot_product:
        cols += [(f, True) for f in formats if f in mv.INT_DOT_FORMATS]
    # an untimed pass over the first shape, compiling every column's kernels: timed right after their
    # compiles, the first row's integer-path columns ran 2-3x slower on the H200 than the same configurations
    # timed again in one process (the GPU likely clocked down while the host compiled)
    _matvec_row(dev, rng, cols, *MATVEC_SHAPES[0], 2)
    print(f"\nmatvec, batch 1, float32 activations: GB/s of weight bytes ({dev.info.name})")
    print(f"{'shape':>14s} " + " ".join(f"{f + (' int8' if dot else ''):>9s}" for f, dot in cols)
          + f" {'torch f16':>10s}")
    for n, k in MATVEC_SHAPES:
        row = _matvec_row(dev, rng, cols, n, k, reps)
        print(f"{n:>6d}x{k:<7d} " + " ".join(row) + f" {_torch_matvec(n, k, TORCH_REPS):>10s}")


def bench_matvec_batches(dev, rng, reps: int, shape=(14336, 4096), formats=("Q4_0", "Q8_0")) -> None:
    """Small-batch products: GB/s of weight bytes for 1..8 activation rows with the chosen configuration,
    float activations and (where the device has it) the integer dot-product path; tune_matvec.py sweeps the
    alternatives."""
    n, k = shape
    paths = [False, True] if dev.info.integer_dot_product else [False]
    print(f"\nmatvec {n}x{k}, 1-8 activation rows: GB/s of weight bytes, chosen configuration")
    print(f"{'format':>6s} {'batch':>5s} " + " ".join(f"{'int8' if dot else 'float':>22s}" for dot in paths))
    for fmt in formats:
        nbytes = n * FORMATS[fmt].row_bytes(k)
        ws = _weight_copies(dev, rng, fmt, n, k)
        for batch in (1, 2, 4, 8):
            x = dev.alloc(batch * k * 4)
            dev.upload(x, rng.standard_normal(batch * k).astype(np.float32))
            y = dev.alloc(batch * n * 4)
            cells = []
            for dot in paths:
                cfg = mv.choose_config(dev, FORMATS[fmt], n, k, batch, int_dot=dot)
                us = matvec_us(dev, ws, x, y, batch, cfg, reps)
                cells.append(f"{nbytes / us / 1e3:7.0f} (wg{cfg.wg:>3d} r{cfg.rows})")
            print(f"{fmt:>6s} {batch:>5d} " + " ".join(f"{c:>22s}" for c in cells))
            x.release()
            y.release()
        _release_weights(ws)


def bench_decode(dev, rng, reps: int) -> None:
    print(f"\npaged decode, {HQ} q heads, {HKV} kv heads, head {HEAD}, float16 KV: GB/s of KV bytes")
    for b, ctx in DECODE_CASES:
        nblk = b * ctx // 16
        kv_bytes = 2 * b * ctx * HKV * HEAD * 2
        caches = []
        for _ in range(_copies(kv_bytes, cap=8)):
            c = pa.PagedKVCache.create(dev, nblk, HKV, HEAD, 16, "f16")
            for buf in (c.key, c.value):
                dev.upload(buf, rng.standard_normal(buf.size // 2).astype(np.float16))
            caches.append(c)
        tables = rng.permutation(nblk).astype(np.int32).reshape(b, ctx // 16)
        tb, lens, q = dev.alloc(tables.nbytes), dev.alloc(b * 4), dev.alloc(b * HQ * HEAD * 4)
        dev.upload(tb, tables)
        dev.upload(lens, np.full(b, ctx, np.int32))
        dev.upload(q, rng.standard_normal(b * HQ * HEAD).astype(np.float32))
        out = dev.alloc(b * HQ * HEAD * 4)
        it = itertools.count()

        def run(caches=caches, tb=tb, lens=lens, q=q, out=out, it=it, b=b, ctx=ctx):
            pa.paged_decode(dev, caches[next(it) % len(caches)], q, tb, lens, num_seqs=b, num_heads=HQ,
                            max_blocks_per_seq=ctx // 16, max_context_len=ctx, out=out)

        tile = pa._choose_tile(dev, HQ // HKV, HEAD, "f16")
        parts = pa.choose_split(dev, b, HKV, ctx, tile)[1]
        us = replay_us(dev, run, reps)
        print(f"  B={b:<3d} L={ctx:<5d} parts={parts if parts > 1 else 'off':>4}  {kv_bytes / us / 1e3:7.0f} GB/s  "
              f"({us:.1f} us)   torch sdpa: {_torch_sdpa(b, ctx, TORCH_REPS)}")


def _torch_matvec(n: int, k: int, reps: int, batch: int = 1) -> str:
    """GB/s of float16 weight bytes of torch.matmul of W [n, k] by x [k, batch] (weights cycled past the L2)."""
    torch = cuda_torch()
    if torch is None:
        return "-"
    nbytes = n * k * 2
    ws = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(_copies(nbytes))]
    x = torch.randn(k, batch, device="cuda", dtype=torch.float16)
    it = itertools.count()
    us = torch_time_us(torch, lambda: torch.matmul(ws[next(it) % len(ws)], x), reps)
    return f"{nbytes / us / 1e3:.0f}"


def _torch_sdpa(b: int, ctx: int, reps: int) -> str:
    torch = cuda_torch()
    if torch is None:
        return "-"
    import torch.nn.functional as F

    kv_bytes = 2 * b * ctx * HKV * HEAD * 2
    q = torch.randn(b, HQ, 1, HEAD, device="cuda", dtype=torch.float16)
    kvs = [(torch.randn(b, HKV, ctx, HEAD, device="cuda", dtype=torch.float16),
            torch.randn(b, HKV, ctx, HEAD, device="cuda", dtype=torch.float16)) for _ in range(_copies(kv_bytes, 8))]
    it = itertools.count()

    def run():
        k, v = kvs[next(it) % len(kvs)]
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    us = torch_time_us(torch, run, reps)
    return f"{kv_bytes / us / 1e3:.0f} GB/s ({us:.1f} us)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke test)")
    ap.add_argument("--batches-only", action="store_true", help="only the small-batch table")
    ap.add_argument("--matvec-only", action="store_true", help="only the batch-1 matvec table")
    ap.add_argument("--formats", default=",".join(MATVEC_FORMATS), help="comma-separated formats of the matvec table")
    args = ap.parse_args()
    formats = [f.strip().upper() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in mv.TEMPLATE]
    if unknown:
        ap.error(f"no matvec template for {unknown}; known: {sorted(mv.TEMPLATE)}")
    dev = get_device()
    reps = 3 if args.quick else 15  # replays of 100 calls each
    rng = np.random.default_rng(0)
    if not args.batches_only:
        bench_matvec(dev, rng, reps, formats)
    if args.matvec_only:
        return
    bench_matvec_batches(dev, rng, reps)
    if not args.batches_only:
        bench_decode(dev, rng, reps)


if __name__ == "__main__":
    main()

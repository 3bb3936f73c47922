"""Time to first token for a prompt whose long prefix sits in each tier of the KV prefix store, against
recomputing it (vkgraph/nn/kv_tiers.py, docs/serving.md).

    python benchmarks/bench_kv_tiers.py --model /tmp/m8b/model-q4_0.gguf --prefix 2048 --reps 3    # H200
    python benchmarks/bench_kv_tiers.py --prefix 256 --reps 3                          # lavapipe, tiny: a smoke run
    python benchmarks/bench_kv_tiers.py --preset kv8b --prefix 256 --reps 3            # lavapipe, 8B-shaped KV
    python benchmarks/bench_kv_tiers.py --preset llama3-8b --copies-only --reps 5      # the copies alone

Engine level (no HTTP). Each repetition draws a fresh random prefix (so no tier holds it from before) and asks
for one token of prefix + a 16-token suffix, with the prefix:
- cold: nowhere (the whole prompt is computed);
- gpu: still in the GPU prefix cache (the same prefix was just computed);
- host / disk: moved from the GPU into host memory / straight to disk (`Engine.offload_prefix_cache`), so the
  timed request pays only its restore. Disk files are fsynced and dropped from the page cache first
  (posix_fadvise), so a disk hit reads the device, not memory.
Prints the median and the best time to first token per case, and for the host and disk cases the restore's own
time (median): reading the entries from its tier (disk: files read and digests checked), staging them (the
payloads copied into host memory the GPU reads, and the copies recorded) and waiting for the GPU's copies into
the cache blocks, with the effective rate over the prefix's bytes; and the offload's time
(out of the GPU into the tier, disk files written, before the page cache is dropped) with its rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vkgraph.nn import tiny_model as mk  # noqa: E402
from vkgraph.nn.engine import Engine  # noqa: E402
from vkgraph.nn.kv_tiers import BlockCopier, DiskTier, HostTier, PrefixStore, model_fingerprint  # noqa: E402
from vkgraph.nn.llama import LlamaModel  # noqa: E402
from vkgraph.nn.model_file import open_model  # noqa: E402
from vkgraph.nn.template_ops import KVCache  # noqa: E402
from vkgraph.nn.weights import load_weights  # noqa: E402

SUFFIX = 16
BLOCK = 16
PRESETS = {"tiny": lambda: mk.tiny_config(n_layers=2), "llama3-8b": mk.llama3_8b_config,
           "kv8b": lambda: mk.tiny_config(n_layers=32, n_heads=8, n_kv_heads=8, head_dim=128)}


def ttft(engine: Engine, prompt: list[int]) -> float:
    t = time.perf_counter()
    rid = engine.add_request(prompt, max_tokens=1)
    while True:
        if any(ev.request_id == rid for ev in engine.step()):
            return time.perf_counter() - t


def drop_page_cache(folder: Path) -> None:
    for f in folder.glob("*.kv"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def copies_only(layers: int, kv_heads: int, head_dim: int, prefix: int, reps: int, kv_dtype: str) -> None:
    """The copies alone, without a model: caches of a model's KV shape, a prefix's blocks of random bits
    written (staged, then waited for) and read back, checked bit for bit."""
    blocks = list(range(3, 3 + prefix // BLOCK))
    caches = [KVCache.create(len(blocks) + 8, kv_heads, head_dim, BLOCK, kv_dtype) for _ in range(layers)]
    copier = BlockCopier(caches)
    rng = np.random.default_rng(0)
    payloads = [rng.bytes(copier.payload_bytes) for _ in blocks]
    nbytes = len(blocks) * copier.payload_bytes
    print(f"copies only: {len(caches)} layers, {nbytes / 2**20:.1f} MiB of KV")
    print("rep   stage ms   wait ms   in GB/s   out ms   out GB/s")
    for rep in range(reps + 1):  # the first warms the pools
        t0 = time.perf_counter()
        copier.write(blocks, payloads)
        t1 = time.perf_counter()
        copier.wait()
        t2 = time.perf_counter()
        back = copier.read(blocks)
        t3 = time.perf_counter()
        if back != payloads:
            raise SystemExit("the blocks read back differ from those written")
        print(f"{rep:3d}  {1000 * (t1 - t0):9.1f} {1000 * (t2 - t1):9.1f}  {nbytes / (t2 - t0) / 1e9:8.2f} "
              f"{1000 * (t3 - t2):8.1f}  {nbytes / (t3 - t2) / 1e9:8.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="a model (default: write one of --preset with random weights)")
    ap.add_argument("--preset", choices=PRESETS, default="tiny",
                    help="kv8b: tiny weights with the 8B model's KV shape (32 layers of 8 KV heads of 128)")
    ap.add_argument("--prefix", type=int, default=2048, help="prefix tokens (a multiple of 16)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kv-dtype", choices=["f16", "f32"], default="f16")
    ap.add_argument("--copies-only", action="store_true",
                    help="time the restore's and the offload's copies alone, with caches of --preset's KV shape")
    a = ap.parse_args()
    if a.prefix % BLOCK:
        raise SystemExit(f"--prefix must be a multiple of {BLOCK}")
    if a.copies_only:
        cfg = PRESETS[a.preset]()
        copies_only(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, a.prefix, a.reps, a.kv_dtype)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model
        if path is None:
            cfg = PRESETS[a.preset]()
            big = a.preset == "llama3-8b"
            files = mk.write_model(Path(tmp) / "model", cfg, gguf_types=("Q4_0",) if big else (),
                                   safetensors=not big, random_quants=big)
            path = files["Q4_0" if big else "hf"]
        weights = load_weights(open_model(path), progress=False)
        blocks = (a.prefix + SUFFIX) // BLOCK + 8
        model = LlamaModel(weights, num_blocks=blocks, block_size=BLOCK, kv_dtype=a.kv_dtype,
                           max_blocks_per_seq=blocks)
        fp = model_fingerprint(weights, kv_dtype=a.kv_dtype, block_size=BLOCK)
        disk = DiskTier(Path(tmp) / "kv", 64 << 30, fp)
        host_store = PrefixStore(HostTier(16 << 30), disk)
        disk_store = PrefixStore(None, disk)
        engine = Engine(model, max_batch=4, prefix_store=host_store)
        vocab = weights.config.vocab_size
        rng = np.random.default_rng(0)
        draw = lambda n: [int(t) for t in rng.integers(3, vocab, n)]  # noqa: E731

        copier = engine._blocks
        write = copier.write
        to_gpu = [0.0, 0.0]  # seconds recording the copies (payloads copied into staging memory), then waiting

        def timed_write(blocks: list[int], payloads: list[bytes]) -> None:
            t = time.perf_counter()
            write(blocks, payloads)
            t1 = time.perf_counter()
            copier.wait()  # the copies have run
            to_gpu[0] += t1 - t
            to_gpu[1] += time.perf_counter() - t1

        copier.write = timed_write

        def case(kind: str) -> tuple[float, float, float, float]:
            """Time to first token, the restore's parts (reading the tier, copying into the GPU) and the
            offload's time before it (out of the GPU into the tier, files written)."""
            prefix = draw(a.prefix)
            store = host_store if kind != "disk" else disk_store
            offload = 0.0
            if kind != "cold":
                engine.kv.store = store
                ttft(engine, prefix + draw(SUFFIX))  # computed: its blocks in the GPU prefix cache
                if kind in ("host", "disk"):
                    t = time.perf_counter()
                    engine.offload_prefix_cache()  # from the GPU into the tier
                    offload = time.perf_counter() - t
                    if kind == "disk":
                        drop_page_cache(disk.dir)
            before = dict(engine.kv.hit_tokens_by_tier)
            fetch0, to_gpu[:] = sum(store.fetch_s.values()), [0.0, 0.0]
            t = ttft(engine, prefix + draw(SUFFIX))
            hit = {k: v - before[k] for k, v in engine.kv.hit_tokens_by_tier.items() if v != before[k]}
            want = {} if kind == "cold" else {kind: a.prefix}
            if hit != want:
                raise SystemExit(f"{kind}: expected prefix hits {want}, got {hit}")
            return t, sum(store.fetch_s.values()) - fetch0, to_gpu[0], to_gpu[1], offload

        print(f"model {Path(path).name}, prefix {a.prefix} + suffix {SUFFIX} tokens, KV {a.kv_dtype}, "
              f"{copier.payload_bytes * a.prefix // BLOCK / 2**20:.1f} MiB of KV per prefix")
        kinds = ("cold", "gpu", "host", "disk")
        for kind in kinds:
            case(kind)  # compile and warm every path
        runs = {k: [case(k) for _ in range(a.reps)] for k in kinds}
        nbytes = copier.payload_bytes * (a.prefix // BLOCK)
        cold = statistics.median(r[0] for r in runs["cold"])
        print("prefix in   ttft median ms   best ms   vs recomputing   restore ms = read + stage + wait     GB/s"
              "   offload ms   GB/s")
        for k in kinds:
            ttfts = [r[0] for r in runs[k]]
            med = statistics.median(ttfts)
            line = f"{k:9s}  {1000 * med:14.1f}  {1000 * min(ttfts):8.1f}   {cold / med:6.2f}x"
            if k in ("host", "disk"):
                read, stage, wait, off = (1000 * statistics.median(r[i] for r in runs[k]) for i in (1, 2, 3, 4))
                total = statistics.median(sum(r[1:4]) for r in runs[k])
                line += f"        {1000 * total:8.1f} = {read:6.1f} + {stage:5.1f} + {wait:5.1f}"
                line += f"   {nbytes / total / 1e9:6.2f}   {off:10.1f} {nbytes / off / 1e6:6.2f}"
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

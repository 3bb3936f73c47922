"""A decode step's attention of one layer, its routes side by side, device timestamps.

    python benchmarks/bench_decode_attn.py [--batches 1,8,32] [--contexts 32,512,2048] [--reps 200]
        [--routes one,two] [--forms tiles,stream] [--splits auto]

The Llama-3-8B layer's shape (32 query heads on 8 KV heads of 128, float16 cache, the output as the output
product's int8 rows): `two` is kv_write (keys and queries rotated from the q/k/v rows, keys and values written)
then paged_decode over the rotated queries; `one` is paged_decode writing the new tokens itself (NewTokens), as a
fused decode step runs it. `forms`: paged_decode's walks of the context (DecodeForm.parse: tiles, stream,
stream:WGxUNROLL; `default`: what paged_decode takes without one); `splits`: its split-K partition (auto: what
paged_decode chooses for the form, 0: none, else tokens per partition).
Each route runs `reps` times after its compilation, the clocks raised again (they idle while it compiles) and a
warm-up, every call writing the same cache slots and output, so a barrier orders each pair of dependent
dispatches as in a step; the calls cycle through copies of the cache (as many as
PyTorch's below, bench_kernels' count) so that the small cases are not all read from the L2. Printed per batch
and context: the span of the whole chain per call (kernels plus barriers), the attention's microseconds
(paged_decode, split or not, medians) as GB/s of KV bytes read, and the median microseconds inside each
kernel; then PyTorch's F.scaled_dot_product_attention over contiguous float16 KV (CUDA events), where importable.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
from collections import defaultdict

os.environ["VKGRAPH_PROFILE"] = "1"
os.environ.setdefault("VKGRAPH_PROFILE_FILE", os.devnull)

import numpy as np  # noqa: E402
from bench_kernels import _copies, _torch_sdpa  # noqa: E402
from common import device_events, raise_clocks  # noqa: E402

from vkgraph.runtime import get_device  # noqa: E402
from vkgraph.templates import paged_attention as pa  # noqa: E402
from vkgraph.templates.matvec import Q8Acts  # noqa: E402

HQ, HKV, HEAD, BLOCK = 32, 8, 128, 16


def chain(dev, run, reps: int) -> tuple[dict[str, float], float]:
    """({kernel: median us}, chain us per call) of `reps` consecutive calls of `run`."""
    ev = device_events(dev, run, reps)
    if not ev:
        raise RuntimeError("no timestamps on this device")
    per: dict[str, list[float]] = defaultdict(list)
    for name, t0, t1 in ev:
        per[name].append((t1 - t0) / 1e3)
    return {k: statistics.median(v) for k, v in per.items()}, (ev[-1][2] - ev[0][1]) / 1e3 / reps


def case(dev, rng, b: int, ctx: int, reps: int, routes: list[str], forms: list[str], splits: list[str]) -> None:
    blocks = -(-ctx // BLOCK)
    kv_bytes = 2 * b * ctx * HKV * HEAD * 2
    caches = []
    for _ in range(_copies(kv_bytes, 8)):
        cache = pa.PagedKVCache.create(dev, b * blocks, HKV, HEAD, BLOCK, "f16")
        for buf in (cache.key, cache.value):
            dev.upload(buf, rng.standard_normal(buf.size // 2).astype(np.float16))
        caches.append(cache)
    tables = rng.permutation(b * blocks).astype(np.int32).reshape(b, blocks)
    slots = (tables[:, (ctx - 1) // BLOCK] * BLOCK + (ctx - 1) % BLOCK).astype(np.int32)
    width = (HQ + 2 * HKV) * HEAD
    ang = rng.random((b, HEAD // 2))
    bufs = {}
    for name, arr in [("rows", rng.standard_normal((b, width)).astype(np.float32)), ("tables", tables),
                      ("lens", np.full(b, ctx, np.int32)), ("slots", slots),
                      ("cos", np.cos(ang).astype(np.float32)), ("sin", np.sin(ang).astype(np.float32))]:
        bufs[name] = dev.alloc(arr.nbytes)
        dev.upload(bufs[name], arr)
    rope = (bufs["cos"], bufs["sin"])
    q = dev.alloc(b * HQ * HEAD * 4)
    out = dev.alloc(Q8Acts.layout(b, HQ * HEAD)[0])
    it = itertools.count()

    def runner(route: str, form: pa.DecodeForm | None, split: int | None):
        kw = dict(num_seqs=b, num_heads=HQ, max_blocks_per_seq=blocks, max_context_len=ctx, out=out, int8=True,
                  part_tokens=split, form=form)

        def two() -> None:
            cache = caches[next(it) % len(caches)]
            pa.write_kv(dev, cache, bufs["rows"], bufs["rows"], bufs["slots"], b, src_stride=width,
                        k_off=HQ * HEAD, v_off=(HQ + HKV) * HEAD, rope=rope, q_out=q, q_heads=HQ)
            pa.paged_decode(dev, cache, q, bufs["tables"], bufs["lens"], **kw)

        def one() -> None:
            pa.paged_decode(dev, caches[next(it) % len(caches)], bufs["rows"], bufs["tables"], bufs["lens"], **kw,
                            new_tokens=pa.NewTokens(bufs["slots"], width, 0, HQ * HEAD, (HQ + HKV) * HEAD, rope=rope))

        return {"one": one, "two": two}[route]

    for form_text in forms:
        form = None if form_text == "default" else pa.DecodeForm.parse(form_text)
        for split in dict.fromkeys(None if s == "auto" else int(s) for s in splits):
            if split is not None and split >= ctx:
                continue
            for route in routes:
                run = runner(route, form, split)
                run()  # compiles: the clocks idle meanwhile, so they are raised again before the timing
                raise_clocks(0.3)
                kernels, per_call = chain(dev, run, reps)
                attn = kernels.get("paged_decode", 0.0)
                inside = "  ".join(f"{k} {v:.1f}" for k, v in sorted(kernels.items()))
                print(f"{b:5d} {ctx:6d} {form_text:>12s} {'auto' if split is None else split or 'off':>5} "
                      f"{route:>5s} {per_call:9.1f} {attn:8.1f} {kv_bytes / attn / 1e3:7.0f}   {inside}", flush=True)
    print(f"{b:5d} {ctx:6d} {'torch sdpa':>12s} {'':>5} {'':>5} {'':>9} {'':>8}         "
          f"{_torch_sdpa(b, ctx, 100)}", flush=True)
    for buf in (q, out, *bufs.values(), *(c for cache in caches for c in (cache.key, cache.value))):
        buf.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="32,512,2048")
    ap.add_argument("--reps", type=int, default=200, help="timed calls per route and case (after 10 untimed)")
    ap.add_argument("--routes", default="one,two", help="one: paged_decode writing the new tokens; two: kv_write first")
    ap.add_argument("--forms", default="default", help="paged_decode's forms: default, tiles, stream, stream:WGxUNROLL")
    ap.add_argument("--splits", default="auto", help="split-K partitions: auto, 0 (none) or tokens, comma-separated")
    a = ap.parse_args()
    routes, forms, splits = a.routes.split(","), a.forms.split(","), a.splits.split(",")
    dev = get_device()
    raise_clocks()
    rng = np.random.default_rng(0)
    print(f"{dev.info.name}: one layer's decode attention, {HQ} q / {HKV} kv heads of {HEAD}, float16 cache, int8 out")
    print(f"{'batch':>5s} {'ctx':>6s} {'form':>12s} {'split':>5s} {'route':>5s} {'chain us':>9s} {'attn us':>8s} "
          f"{'GB/s':>7s}   kernel us (median inside each)")
    for b in (int(x) for x in a.batches.split(",")):
        for ctx in (int(x) for x in a.contexts.split(",")):
            case(dev, rng, b, ctx, a.reps, routes, forms, splits)


if __name__ == "__main__":
    main()

"""Prefill attention over a cached prefix: flash_prefill reading the prefix from the paged cache, against what runs
without it (each new token a query row of paged_decode) and PyTorch's float16 attention.

    python benchmarks/bench_flash_prefix.py [--prefix 2048] [--new 512] [--seqs 1] [--reps 20]

The Llama-3-8B attention shape (32 query heads over 8 KV heads, D = 128) with a float16 cache of 16-token blocks
(shuffled): each of `--seqs` sequences holds `--prefix` cached tokens and `--new` new ones. GPU microseconds per
call from a replayed command graph (common.replay_us), and each path's normalised error against numpy in float64
for the first sequence's last 64 rows, so a wrong program shows here too. Needs float16 cooperative matrices.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from common import cuda_torch, replay_us, torch_time_us

import vkgraph.realize as realize_mod
from vkgraph.runtime import get_device
from vkgraph.templates import flash_prefill as fp
from vkgraph.templates import paged_attention as pa

HQ, HKV, D, BS = 32, 8, 128, 16


def upload(dev, a: np.ndarray):
    buf = dev.alloc(max(a.nbytes, 4))
    dev.upload(buf, np.ascontiguousarray(a))
    return buf


def reference(q, k, v, first: int) -> np.ndarray:
    """float64 causal attention of query rows first.. (positions first..) over keys 0..; q [rows, HQ, D]."""
    g = HQ // HKV
    out = np.zeros(q.shape)
    for i in range(q.shape[0]):
        kk = np.repeat(k[:first + i + 1].astype(np.float64), g, 1)
        vv = np.repeat(v[:first + i + 1].astype(np.float64), g, 1)
        s = np.einsum("hd,khd->hk", q[i].astype(np.float64), kk) / math.sqrt(D)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[i] = np.einsum("hk,khd->hd", p / p.sum(-1, keepdims=True), vv)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev, lim = get_device(), realize_mod.limits()
    if not fp.usable(lim, D):
        raise SystemExit(f"{dev.info.name}: no float16 cooperative matrices that fit flash_prefill at D = {D}")
    rng = np.random.default_rng(0)
    b, p, n = a.seqs, a.prefix, a.new
    ctx = p + n
    width = -(-ctx // BS)
    nblocks = b * width
    t = b * n
    # every sequence's keys and values at all its positions; the cache holds the first p of each, the new ones
    # are written there too (paged_decode reads them from it; flash reads them from k and v)
    keys = rng.standard_normal((b, ctx, HKV, D)).astype(np.float16)
    vals = rng.standard_normal((b, ctx, HKV, D)).astype(np.float16)
    q = rng.standard_normal((t, HQ, D)).astype(np.float32)
    tables = rng.permutation(nblocks).astype(np.int32).reshape(b, width)
    kc = np.zeros((nblocks, HKV, BS, D), np.float16)
    vc = np.zeros_like(kc)
    for s in range(b):
        pos = np.arange(ctx)
        kc[tables[s, pos // BS], :, pos % BS] = keys[s]
        vc[tables[s, pos // BS], :, pos % BS] = vals[s]
    cache = pa.PagedKVCache(nblocks, HKV, D, BS, "f16", upload(dev, kc), upload(dev, vc))
    k_new = keys[:, p:].reshape(t, HKV, D).astype(np.float32)
    v_new = vals[:, p:].reshape(t, HKV, D).astype(np.float32)
    bufs = dict(q=upload(dev, q), k=upload(dev, k_new), v=upload(dev, v_new),
                cu=upload(dev, (np.arange(b + 1) * n).astype(np.int32)), tables=upload(dev, tables),
                prefix=upload(dev, np.full(b, p, np.int32)),
                rows=upload(dev, np.repeat(tables, n, 0)), ctx=upload(dev, np.tile(np.arange(p, ctx) + 1, b)
                                                                        .astype(np.int32)))
    out_f, out_d = dev.alloc(t * HQ * D * 4), dev.alloc(t * HQ * D * 4)

    def flash():
        fp.flash_prefill(dev, lim, bufs["q"], bufs["k"], bufs["v"], bufs["cu"], num_seqs=b, num_tokens=t,
                         num_heads=HQ, num_kv_heads=HKV, head_size=D, max_seq_len=n, out=out_f, cache=cache,
                         block_tables=bufs["tables"], prefix_lens=bufs["prefix"], max_blocks_per_seq=width)

    def rows():
        pa.paged_decode(dev, cache, bufs["q"], bufs["rows"], bufs["ctx"], num_seqs=t, num_heads=HQ,
                        max_blocks_per_seq=width, max_context_len=ctx, out=out_d)

    tail = slice(n - 64, n)
    want = reference(q[tail], keys[0], vals[0], p + n - 64)
    flops = 4 * b * HQ * D * (n * p + n * (n + 1) / 2)
    print(f"prefix {p}, new {n}, sequences {b}: {HQ} query heads over {HKV} KV heads, D = {D}, float16 cache")
    for name, fn, out in (("flash_prefill", flash, out_f), ("paged_decode rows", rows, out_d)):
        fn()
        dev.synchronize()
        got = dev.download(out, np.float32, q.shape)[tail]
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        us = replay_us(dev, fn, a.reps, per_graph=5)
        print(f"  {name:18s} {us:10.1f} us  {flops / us / 1e6:7.1f} TFLOP/s  normalised error {err:.2e}")
    torch = cuda_torch()
    if torch is None:
        print("  torch: no CUDA device")
        return
    qt = torch.tensor(q.reshape(b, n, HQ, D), device="cuda", dtype=torch.float16).transpose(1, 2)
    kt = torch.tensor(keys, device="cuda").transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    vt = torch.tensor(vals, device="cuda").transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    mask = torch.ones(n, ctx, dtype=torch.bool, device="cuda").tril(p)  # row i sees keys up to p + i
    sdpa = torch.nn.functional.scaled_dot_product_attention
    us = torch_time_us(torch, lambda: sdpa(qt, kt, vt, attn_mask=mask), a.reps)
    print(f"  {'torch sdpa f16':18s} {us:10.1f} us  {flops / us / 1e6:7.1f} TFLOP/s  (contiguous K/V, no paging)")


if __name__ == "__main__":
    main()

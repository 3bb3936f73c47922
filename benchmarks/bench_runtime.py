"""Runtime benchmark: dispatch recording cost, submit round trip, transfers, a memory-bound kernel beside
PyTorch's device copy (when PyTorch with CUDA is present), compile and cache times.

    python benchmarks/bench_runtime.py [--sizes-mib 64,256,1024,4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time

import numpy as np
from common import cuda_torch, median_time, torch_time_us

from vkgraph.runtime import get_device
from vkgraph.runtime.compiler import Compiler

COPY = """
#version 450
// kernel: copy_vec4
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;
layout(set = 0, binding = 0) readonly buffer Src { uvec4 src[]; };
layout(set = 0, binding = 1) writeonly buffer Dst { uvec4 dst[]; };
layout(push_constant) uniform Push { uint n4; } pc;
void main() {
    uint stride = gl_NumWorkGroups.x * WG;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n4; i += stride) dst[i] = src[i];
}
"""

TINY = """
#version 450
// kernel: tiny
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) readonly buffer A { float a[]; };
layout(set = 0, binding = 1) writeonly buffer B { float b[]; };
layout(push_constant) uniform Push { uint n; float s; } pc;
void main() { uint i = gl_GlobalInvocationID.x; if (i < pc.n) b[i] = a[i] * pc.s; }
"""


def bench_recording(dev) -> dict:
    k = dev.pipeline(TINY)
    a = dev.alloc(4096)
    outs = [dev.alloc(4096) for _ in range(64)]
    q = dev.queue
    n = 4096
    saved = q.max_recorded
    q.max_recorded = 1 << 30

    def independent():
        for i in range(n):
            q.dispatch(k, [a, outs[i & 63]], (1, 1, 1), (64, 1.0))

    def dependent():
        for i in range(n):
            q.dispatch(k, [outs[i & 63], outs[(i + 1) & 63]], (1, 1, 1), (64, 1.0))

    out = {}
    for name, fn in (("independent", independent), ("dependent (barrier each)", dependent)):
        fn()
        dev.synchronize()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) / n)
            dev.synchronize()
        out[name] = statistics.median(times) * 1e6
    q.max_recorded = saved
    return out


def bench_roundtrip(dev) -> float:
    k = dev.pipeline(TINY)
    a, b = dev.alloc(256), dev.alloc(256)

    def once():
        dev.dispatch(k, [a, b], (1, 1, 1), (64, 1.0))
        dev.synchronize()

    for _ in range(20):
        once()
    return median_time(once, 200) * 1e6


def bench_transfers(dev, nbytes: int) -> dict:
    x = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    b = dev.alloc(nbytes)

    def up():
        dev.upload(b, x)
        dev.synchronize()

    up()
    t_up = median_time(up, 5)
    dev.download(b, np.uint8, nbytes)
    t_down = median_time(lambda: dev.download(b, np.uint8, nbytes), 5)
    b.release()
    return {"upload GB/s": nbytes / t_up / 1e9, "download GB/s": nbytes / t_down / 1e9}


def bench_copy_kernel(dev, nbytes: int, wg: int, groups_per_cu: list[int]) -> dict:
    """Read+write GB/s of a grid-stride vec4 copy of `nbytes`, held in buffers of at most what one allocation
    and one binding may hold (so 4 GiB is two or more buffer pairs on most devices)."""
    k = dev.pipeline(COPY, spec={"WG": wg})
    piece = min(dev.info.max_storage_buffer_range, dev.info.max_allocation_size) // (1 << 20) * (1 << 20)
    sizes = [min(piece, nbytes - o) for o in range(0, nbytes, piece)]
    pairs = [(dev.alloc(n), dev.alloc(n)) for n in sizes]
    rng = np.random.default_rng(1)
    chunk = 64 << 20
    block = rng.integers(0, 2**32 - 1, chunk // 4, dtype=np.uint32)
    for (src, _), n in zip(pairs, sizes):  # random data: fresh allocations are zero and compress
        for off in range(0, n, chunk):
            dev.upload(src, block[: min(chunk, n - off) // 4], offset=off)
    dev.synchronize()
    best = {}
    for g in groups_per_cu:
        groups = min(g, dev.info.max_workgroup_count[0])

        def run(reps: int, groups=groups):
            for _ in range(reps):
                for (src, dst), n in zip(pairs, sizes):
                    dev.dispatch(k, [src, dst], (groups, 1, 1), (n // 16,))
            dev.synchronize()

        run(2)  # warm-up: pipeline, caches, clocks
        t1 = median_time(lambda: run(1), 3)
        reps = max(1, min(50, int(0.2 / max(t1, 1e-6))))
        t = median_time(lambda reps=reps: run(reps), 5) / reps
        best[groups] = 2 * nbytes / t / 1e9
    ok = np.array_equal(dev.download(pairs[0][1], np.uint32, (1 << 16,)), block[: 1 << 16])
    for src, dst in pairs:
        src.release()
        dst.release()
    g_best = max(best, key=best.get)
    return {"GB/s": best[g_best], "groups": g_best, "all": best, "correct": ok}


def torch_copy(nbytes: int) -> float | None:
    torch = cuda_torch()
    if torch is None:
        return None
    a = torch.randint(0, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
    b = torch.empty_like(a)
    us = torch_time_us(torch, functools.partial(b.copy_, a), 10, warmup=3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / (us / 1e6) / 1e9


def bench_compile() -> dict:
    with tempfile.TemporaryDirectory() as d:
        c = Compiler(cache_dir=d)
        c.compile(TINY, {"X": -1})
        warm = median_time(lambda: c.compile(TINY, {"X": time.perf_counter_ns() % 1000000007}), 20)
        c.compile(TINY, {"X": 0})
        mem_hit = median_time(lambda: c.compile(TINY, {"X": 0}), 200)
        c2 = Compiler(cache_dir=d)

        def disk():
            c2.memory.clear()
            c2.compile(TINY, {"X": 0})

        disk_hit = median_time(disk, 50)
    return {"warm compile ms": warm * 1e3, "memory hit ms": mem_hit * 1e3, "disk hit ms": disk_hit * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", default="64,256,1024,4096")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = get_device()
    print(f"device: {dev.info.name} ({dev.info.device_type}), subgroup {dev.info.subgroup_size}")
    results: dict = {"device": dev.info.name}
    rec = bench_recording(dev)
    results["record us/dispatch"] = rec
    for k, v in rec.items():
        print(f"record one dispatch, {k:26s} {v:8.2f} us")
    rt = bench_roundtrip(dev)
    results["submit+wait us"] = rt
    print(f"submit-and-wait round trip (1 dispatch)     {rt:8.1f} us")
    comp = bench_compile()
    results["compile"] = comp
    for k, v in comp.items():
        print(f"{k:43s} {v:8.3f}")
    tr = bench_transfers(dev, 256 << 20)
    results["transfers 256 MiB"] = tr
    for k, v in tr.items():
        print(f"{k} (256 MiB) {v:31.2f}")
    heap = max(s for s, _ in dev.info.heaps)
    print(f"\n{'size':>10s} {'vkgraph GB/s':>13s} {'groups':>7s} {'torch GB/s':>11s} {'ratio':>6s}")
    results["copy"] = {}
    for mib in (int(s) for s in args.sizes_mib.split(",")):
        nbytes = mib << 20
        if 2 * nbytes > heap * 0.8:
            print(f"{mib:>7d} MiB  skipped (heap {heap >> 20} MiB)")
            continue
        cu = [128, 512, 1024, 2048, 8192, 32768] if dev.info.device_type == "discrete" else [16, 64]
        r = bench_copy_kernel(dev, nbytes, 256, cu)
        t = torch_copy(nbytes)
        ratio = f"{r['GB/s'] / t:6.2f}" if t else "   n/a"
        ts = f"{t:11.1f}" if t else "        n/a"
        print(f"{mib:>7d} MiB {r['GB/s']:13.1f} {r['groups']:7d} {ts} {ratio}  correct={r['correct']}")
        results["copy"][mib] = {"vkgraph": r["GB/s"], "torch": t, "groups": r["groups"], "by_groups": r["all"]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()

"""The runtime on its own: run a GLSL kernel on numpy arrays, check it against numpy, time it.

    python examples/runtime_demo.py
"""

from __future__ import annotations

import time

import numpy as np

from vkgraph.info import table
from vkgraph.runtime import get_device

SAXPY = """
#version 450
// kernel: saxpy
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;
layout(set = 0, binding = 0) readonly buffer X { vec4 x[]; };
layout(set = 0, binding = 1) readonly buffer Y { vec4 y[]; };
layout(set = 0, binding = 2) writeonly buffer Out { vec4 o[]; };
layout(push_constant) uniform Push { uint n4; float alpha; } pc;

void main() {
    // grid-stride loop: a fixed grid keeps every multiprocessor busy at any size
    for (uint i = gl_GlobalInvocationID.x; i < pc.n4; i += gl_NumWorkGroups.x * WG) {
        o[i] = pc.alpha * x[i] + y[i];
    }
}
"""


def main() -> None:
    dev = get_device()
    print(table())
    print()
    n = 1 << 22
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    t0 = time.perf_counter()
    k = dev.pipeline(SAXPY, spec={"WG": 256})
    t_compile = time.perf_counter() - t0
    bx, by, bo = dev.alloc(x.nbytes), dev.alloc(y.nbytes), dev.alloc(x.nbytes)
    t0 = time.perf_counter()
    dev.upload(bx, x)
    dev.upload(by, y)
    dev.synchronize()
    t_up = time.perf_counter() - t0
    groups = min((n // 4 + 255) // 256, 4096)
    dev.dispatch(k, [bx, by, bo], (groups, 1, 1), push={"n4": n // 4, "alpha": 2.5})
    dev.synchronize()
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        dev.dispatch(k, [bx, by, bo], (groups, 1, 1), push={"n4": n // 4, "alpha": 2.5})
    dev.synchronize()
    t_kernel = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    out = dev.download(bo, np.float32, n)
    t_down = time.perf_counter() - t0
    ref = 2.5 * x + y
    err = float(np.abs(out - ref).max() / np.abs(ref).max())
    t0 = time.perf_counter()
    for _ in range(reps):
        np.add(2.5 * x, y)
    t_numpy = (time.perf_counter() - t0) / reps
    print(f"saxpy on {n} float32 elements: max normalised error vs numpy {err:.2e} -> {'OK' if err < 1e-6 else 'FAIL'}")
    print(f"  compile (or cache hit) {t_compile * 1e3:8.2f} ms")
    print(f"  upload 2 x {x.nbytes >> 20} MiB  {t_up * 1e3:8.2f} ms")
    print(f"  kernel               {t_kernel * 1e3:8.3f} ms  ({3 * x.nbytes / t_kernel / 1e9:.1f} GB/s)")
    print(f"  numpy same expr      {t_numpy * 1e3:8.3f} ms")
    print(f"  download {x.nbytes >> 20} MiB      {t_down * 1e3:8.2f} ms")
    if err >= 1e-6:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

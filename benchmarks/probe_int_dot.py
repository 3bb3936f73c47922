"""Throughput of the integer matvec's instructions on this device: packed int8 dot products against float FMAs.

    python benchmarks/probe_int_dot.py [--iters 2048] [--groups 4096] [--reps 5]

Each kernel keeps 8 independent accumulators per invocation and, per iteration, applies one operation to each
with an operand that changes every iteration (so nothing is hoisted out of the loop): OpSUDotKHR (int8 x uint8,
four products, what the integer matvec's `run_idot` issues), an integer multiply-add, a float FMA, and an int to
float conversion plus an add (the integer path's per-run conversion); the changing operand adds one instruction
per iteration, an eighth of the kernel's. Printed: giga-operations per second (an
operation = one instruction of that kind per invocation) and the ratio to the float FMA's rate. At 8 activation
rows the Q4_0 matvec issues 64 dot products per 16-byte weight unit; if they run at a quarter of the FMA rate,
they, not memory, set its pace (docs/kernels.md, "The integer path at 2-16 activation rows").
"""

from __future__ import annotations

import argparse

import numpy as np
from common import replay_us

from vkgraph.runtime import get_device
from vkgraph.templates.catalog import GLSL_DIR

KERNEL = """#version 450
#include "common.glsl"
layout(local_size_x = 256) in;
layout(set = 0, binding = 0) buffer Out { int v[]; };
layout(push_constant) uniform Push { uint iters; uint seed; } pc;

void main() {
    const uint id = gl_GlobalInvocationID.x;
    uint y = id * 0x9E3779B9u + pc.seed;
    uint x[8];
    int acc[8];
    float fa[8];
    [[unroll]] for (uint i = 0; i < 8; i++) {
        x[i] = y ^ (i * 0x01030507u);
        acc[i] = 0;
        fa[i] = float(i);
    }
    float fy = float(id & 255u) * 1e-3;
    for (uint it = 0; it < pc.iters; it++) {
        y = y * 1664525u + 1013904223u;
        fy = fy * 0.999 + 1e-4;
        [[unroll]] for (uint i = 0; i < 8; i++) {
#if OP == 0
            acc[i] = dot_s8u8(x[i], y, 0) + acc[i];
#elif OP == 1
            acc[i] = int(x[i]) * int(y) + acc[i];
#elif OP == 2
            fa[i] = fa[i] * fy + float(i);
#else
            fa[i] += float(int(x[i] ^ y));
#endif
        }
    }
    int s = 0;
    float f = 0.0;
    [[unroll]] for (uint i = 0; i < 8; i++) {
        s += acc[i];
        f += fa[i];
    }
    v[id] = s + int(f);
}
"""
OPS = {"dot4 s8u8": 0, "imad": 1, "ffma": 2, "i2f + fadd": 3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=2048)
    ap.add_argument("--groups", type=int, default=4096, help="workgroups of 256 invocations")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    dev = get_device()
    if not dev.info.integer_dot_product:
        raise SystemExit(f"{dev.info.name} has no shaderIntegerDotProduct")
    out = dev.alloc(a.groups * 256 * 4)
    ops = a.groups * 256 * a.iters * 8
    rates = {}
    for name, op in OPS.items():
        kern = dev.pipeline(KERNEL, defines={"INT_DOT": 1, "OP": op}, name=f"probe_{op}", include_dirs=[GLSL_DIR])

        def run(kern=kern) -> None:
            dev.dispatch(kern, [out], (a.groups, 1, 1), push={"iters": a.iters, "seed": 12345})

        us = replay_us(dev, run, a.reps, per_graph=5)
        rates[name] = ops / us / 1e3
    print(f"{dev.info.name}: {a.groups * 256} invocations x {a.iters} iterations x 8 accumulators")
    for name, rate in rates.items():
        print(f"{name:>12s} {rate:10.0f} Gop/s {rate / rates['ffma']:6.2f} x ffma")
    check = dev.download(out, np.int32, (a.groups * 256,))
    print(f"(checksum {int(check.astype(np.int64).sum())})")
    out.release()


if __name__ == "__main__":
    main()

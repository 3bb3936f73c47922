"""Q4_0 weights times 8 int8 activation rows on int8 cooperative matrices, beside the integer matvec's figures.

    cd benchmarks && python3 probe_mma_matvec.py [--products qkv,o,gate_up,down] [--reps 5]

A hand-written kernel (not a template): each subgroup owns 16 rows of W; per 32-value block it unpacks the rows'
nibbles to int8 (q - 8) into its own part of shared memory, multiplies them by the block's 8 activation rows
(read straight from device memory as the B operand) in one 16 x 8 x 32 int8 product with int32 sums, and adds the
sums times the block's scales to a float32 accumulator element by element: the weight scales (16, staged) and the
activation scales (8, stored transposed) are loaded as 16 x 8 accumulators with a stride of 0, so element i of each
is the scale of element i of the sums, whatever the device's layout (matrices of one type share it). K may be
split over KS workgroups, each writing a plane that the check sums on the host. Per configuration (subgroups a
workgroup SGW, blocks a round BPI, KS) it prints the time, GB/s of Q4_0 weight bytes and the error against numpy
in float64 (relative to |x| |W|). On the H200 (RESULTS.md, nineteenth session) it is exact to float32 and
streams at most half of what the integer matvec does at 8 rows. NVIDIA's 580 driver crashes building it when two
cooperative matrices are declared in one statement, as matmul_coop also found.
"""

from __future__ import annotations

import argparse

import numpy as np
from common import raise_clocks, replay_us

from vkgraph.quant import dequantize, random_blocks
from vkgraph.runtime import get_device

SRC = r"""#version 450
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_explicit_arithmetic_types : require
layout(local_size_x = LOCAL) in;
#define ACC_F coopmat<float, gl_ScopeSubgroup, 16, 8, gl_MatrixUseAccumulator>
#define ACC_I coopmat<int32_t, gl_ScopeSubgroup, 16, 8, gl_MatrixUseAccumulator>
layout(set = 0, binding = 0) readonly buffer WQ { uvec2 wq[]; };     // [N][K/2] bytes of nibbles
layout(set = 0, binding = 1) readonly buffer WS { uint ws[]; };      // [N][K/32] float16 scales, two a word
layout(set = 0, binding = 2) readonly buffer XQ { uvec4 xq[]; };     // [8][K] int8
layout(set = 0, binding = 3) readonly buffer XD { float xd[]; };     // [K/32][8] scales (transposed)
layout(set = 0, binding = 4) writeonly buffer Y { float y[]; };      // [KS][8][N]
const int ROWSTR = (BPI * 32 + 16) / 8;   // a staged row of BPI blocks in uvec2, padded
shared uvec2 sa[SGW * 16 * ROWSTR];
shared float sw[SGW * 16 * BPI];
void main() {
    const int sg = int(gl_SubgroupID), l = int(gl_SubgroupInvocationID);
    const int row0 = (int(gl_WorkGroupID.x) * SGW + sg) * 16;
    const int kz = int(gl_WorkGroupID.y);
    const int nblk = K / 32, part = nblk / KS, b0 = kz * part;
    const int r = l >> 1, half_ = l & 1;
    const int abase = sg * 16 * ROWSTR, wbase = sg * 16 * BPI;
    ACC_F acc = ACC_F(0.0);
    uvec2 w[BPI];
    uint sc[BPI];
    [[unroll]] for (int j = 0; j < BPI; j++) {
        w[j] = wq[(row0 + r) * (K / 16) + (b0 + j) * 2 + half_];
        sc[j] = ws[((row0 + (l & 15)) * nblk + b0 + j) >> 1];
    }
    for (int kb = b0; kb < b0 + part; kb += BPI) {
        subgroupBarrier();   // the previous round's fragments are read
        [[unroll]] for (int j = 0; j < BPI; j++) {
            const uvec2 lo = ((w[j] & 0x0F0F0F0Fu) + 0x78787878u) ^ 0x80808080u;
            const uvec2 hi = (((w[j] >> 4) & 0x0F0F0F0Fu) + 0x78787878u) ^ 0x80808080u;
            sa[abase + r * ROWSTR + j * 4 + half_] = lo;
            sa[abase + r * ROWSTR + j * 4 + 2 + half_] = hi;
            const uint odd = uint((row0 + l) * nblk + kb + j) & 1u;   // the scale's half of its word
            if (l < 16) sw[wbase + j * 16 + l] = unpackHalf2x16(sc[j] >> (16u * odd)).x;
        }
        if (kb + BPI < b0 + part) {   // the next round's words in flight during this one's products
            [[unroll]] for (int j = 0; j < BPI; j++) {
                w[j] = wq[(row0 + r) * (K / 16) + (kb + BPI + j) * 2 + half_];
                sc[j] = ws[((row0 + (l & 15)) * nblk + kb + BPI + j) >> 1];
            }
        }
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        [[unroll]] for (int j = 0; j < BPI; j++) {
            coopmat<int8_t, gl_ScopeSubgroup, 16, 32, gl_MatrixUseA> a;
            coopmat<int8_t, gl_ScopeSubgroup, 32, 8, gl_MatrixUseB> b;
            coopMatLoad(a, sa, abase + j * 4, ROWSTR, gl_CooperativeMatrixLayoutRowMajor);
            coopMatLoad(b, xq, (kb + j) * 2, K / 16, gl_CooperativeMatrixLayoutColumnMajor);
            ACC_I c = ACC_I(0);
            c = coopMatMulAdd(a, b, c);
            ACC_F cf = ACC_F(c);
            ACC_F ds;
            ACC_F dx;
            coopMatLoad(ds, sw, wbase + j * 16, 0, gl_CooperativeMatrixLayoutColumnMajor);   // (i, n) = dW[i]
            coopMatLoad(dx, xd, (kb + j) * 8, 0, gl_CooperativeMatrixLayoutRowMajor);       // (i, n) = dX[n]
            for (int i = 0; i < acc.length(); i++) acc[i] += cf[i] * ds[i] * dx[i];
        }
    }
    coopMatStore(acc, y, kz * 8 * N + row0, N, gl_CooperativeMatrixLayoutColumnMajor);
}
"""

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# (subgroups a workgroup, blocks a round, workgroups splitting K)
CONFIGS = [(4, 4, 1), (4, 4, 2), (4, 4, 4), (2, 4, 4), (4, 2, 4), (4, 8, 2), (8, 4, 2), (2, 8, 4)]


def _operands(rng: np.random.Generator, n: int, k: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Random Q4_0 rows (quant.random_blocks) split into the kernel's nibbles [n, K/2] and float16 scales, 8 int8
    rows (scales stored [K/32, 8]), and the product and its magnitude in float64."""
    nblk = k // 32
    qt = random_blocks(rng, "Q4_0", n, k)
    blocks = qt.data.reshape(n, nblk, 18)  # per block: the float16 scale, then 16 bytes of nibbles
    xq = rng.integers(-127, 128, (8, k), dtype=np.int8)
    xd = (rng.random((8, nblk)) * 0.02 + 0.001).astype(np.float32)
    w = dequantize(qt).astype(np.float64)
    x = (xq.astype(np.float64).reshape(8, nblk, 32) * xd.astype(np.float64)[:, :, None]).reshape(8, k)
    weights = [np.ascontiguousarray(blocks[:, :, 2:]), np.ascontiguousarray(blocks[:, :, :2])]
    return [*weights, xq, np.ascontiguousarray(xd.T)], x @ w.T, np.abs(x) @ np.abs(w).T


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--products", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    dev = get_device()
    if not any((c.m, c.n, c.k, c.a, c.b, c.result, c.scope) == (16, 8, 32, "int8", "int8", "int32", "subgroup")
               for c in dev.info.cooperative_matrix):
        raise SystemExit(f"{dev.info.name} has no 16 x 8 x 32 int8 cooperative matrices")
    rng = np.random.default_rng(0)
    raise_clocks(2.0)
    for name in a.products.split(","):
        n, k = SHAPES[name]
        arrays, ref, scale = _operands(rng, n, k)
        bufs = [dev.alloc(x.nbytes) for x in arrays]
        for buf, x in zip(bufs, arrays):
            dev.upload(buf, np.ascontiguousarray(x))
        nbytes = n * k * 18 // 32
        for sgw, bpi, ks in CONFIGS:
            if (k // 32 // ks) % bpi or n % (16 * sgw):
                continue
            out = dev.alloc(ks * 8 * n * 4)
            pipe = dev.pipeline(SRC.replace("LOCAL", str(sgw * 32)),
                                defines={"SGW": sgw, "BPI": bpi, "KS": ks, "K": k, "N": n},
                                name=f"mma_matvec_{name}_{sgw}_{bpi}_{ks}")

            def run(pipe=pipe, bound=(*bufs, out), groups=(n // (16 * sgw), ks, 1)) -> None:
                dev.dispatch(pipe, list(bound), groups)

            run()
            got = dev.download(out, np.float32, (ks, 8, n)).astype(np.float64).sum(0)
            err = float(np.max(np.abs(got - ref) / scale))
            us = replay_us(dev, run, a.reps, per_graph=50)
            print(f"{name} {n}x{k} SGW {sgw} BPI {bpi} KS {ks}: {us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s "
                  f"error {err:.1e}", flush=True)
            out.release()
        for buf in bufs:
            buf.release()


if __name__ == "__main__":
    main()

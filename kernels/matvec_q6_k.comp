#version 450
// y = W x for Q6_K weights in the kernel layout: per row K/256 super-blocks of 208 bytes = 13 uvec4 (ql: 8,
// qh: 4, int8 scales: 1) in `w`, and one float16 d per super-block in `s`. A unit is a quarter super-block:
// half hh = k/2 (elements 128*hh..), positions l = 16*(k%2) + 0..15, and the four runs l, l+32, l+64, l+96.
#define RUN 16
#define RUNS 4
#define UNIT_ELEMS 64
#define HAS_OFFSET true
#include "matvec_common.glsl"

void decode_unit(uint row, uint u, out vec4 q[RUNS * RUN / 4], out float a[RUNS], out float b[RUNS],
                 out uint xoff[RUNS]) {
    const uint sb = u >> 2, k = u & 3u, hh = k >> 1, t = k & 1u;
    const uint base = row * pc.w_stride + sb * 13;
    const uvec4 lo = w[base + 4 * hh + t];       // ql[l]      : runs 0 (low nibble) and 2 (high)
    const uvec4 hi = w[base + 4 * hh + 2 + t];   // ql[l + 32] : runs 1 and 3
    const uvec4 qh = w[base + 8 + 2 * hh + t];   // 2 high bits for each of the four runs
    const uvec4 scw = w[base + 12];
    [[unroll]] for (uint i = 0; i < 4; i++) {
        q[i] = bytes_bits(lo[i], 0u, 0xFu) + 16.0 * bytes_bits(qh[i], 0u, 3u);
        q[4 + i] = bytes_bits(hi[i], 0u, 0xFu) + 16.0 * bytes_bits(qh[i], 2u, 3u);
        q[8 + i] = bytes_bits(lo[i], 4u, 0xFu) + 16.0 * bytes_bits(qh[i], 4u, 3u);
        q[12 + i] = bytes_bits(hi[i], 4u, 0xFu) + 16.0 * bytes_bits(qh[i], 6u, 3u);
    }
    const float d = scale_at(row, sb);
    [[unroll]] for (uint j = 0; j < 4; j++) {
        const uint si = 8 * hh + t + 2 * j;        // int8 scale of this run's 16 elements
        const float sc = float(bitfieldExtract(int(scw[si >> 2]), int(8 * (si & 3u)), 8));
        a[j] = d * sc;
        b[j] = -32.0 * d * sc;   // levels are stored as q + 32
        xoff[j] = sb * 256 + 128 * hh + 16 * t + 32 * j;
    }
}

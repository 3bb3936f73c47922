#version 450
// y = W x for Q3_K weights in the kernel layout: per row K/256 super-blocks of 110 bytes padded to 112 = 7 uvec4 in
// `w`: 32 bytes of high bits (bit b of byte l: element 32 b + l), 64 bytes of 2-bit low levels (laid out as Q2_K's),
// 12 bytes of 6-bit signed scales (one per sub-block of 16) and float16 d. An element is d (scale - 32) (q - 4)
// with q = low | high << 2. A unit is low-level word k = 2 h + t: runs r = 0..3 are elements
// 128 h + 32 r + 16 t + 0..15 (sub-block 8 h + 2 r + t), whose high bits are bit 4 h + r of high-bit word t.
#define RUN 16
#define RUNS 4
#define UNIT_ELEMS 64
#define HAS_OFFSET true
#define HAS_MIN false
struct Unit { uvec4 v; uvec4 hm; uvec4 sc; uint k; };
#include "matvec_common.glsl"

Unit load_unit(uint row, uint u) {
    const uint base = row * pc.w_stride + (u >> 2) * 7;
    return Unit(w[base + 2 + (u & 3u)], w[base + (u & 1u)], w[base + 6], u & 3u);
}

uint x_run(uint u, uint j) { return (u >> 2) * 256 + 128 * ((u & 3u) >> 1) + 16 * (u & 1u) + 32 * j; }

vec4 run_levels(Unit q, uint j, uint i) {
    const uint hb = (q.hm[i] >> (4 * (q.k >> 1) + j)) & 0x01010101u;
    return bytes7(((q.v[i] >> (2 * j)) & 0x03030303u) | (hb << 2));
}

vec4 x_factor(uint j) { return BYTES7; }

// scale i: low nibble from byte i % 8 (bits 4 (i / 8)..), two high bits from byte 8 + i % 4 (bits 2 (i / 4)..)
vec2 run_coeffs(Unit q, uint u, uint j) {
    const uint i = 8 * (q.k >> 1) + 2 * j + (q.k & 1u);
    const uint lo = (q.sc[(i & 7u) >> 2] >> (8 * (i & 3u) + 4 * (i >> 3))) & 0xFu;
    const uint hi = (q.sc[2] >> (8 * (i & 3u) + 2 * (i >> 2))) & 3u;
    const float c = unpackHalf2x16(q.sc.w).x * float(int(lo | (hi << 4)) - 32);
    return vec2(c, -4.0 * c);
}

#ifdef INT_DOT
int run_idot(Unit q, uint j, uvec4 xq, int xs) {   // levels are stored as q + 4
    uvec4 l;
    [[unroll]] for (uint i = 0; i < 4; i++) {
        l[i] = ((q.v[i] >> (2 * j)) & 0x03030303u) | (((q.hm[i] >> (4 * (q.k >> 1) + j)) & 0x01010101u) << 2);
    }
    return dot16_s8u8(xq, l) - 4 * xs;
}
#endif

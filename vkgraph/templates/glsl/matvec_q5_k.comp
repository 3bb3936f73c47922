#version 450
// y = W x for Q5_K weights as GGUF stores them: per row K/256 super-blocks of 176 bytes = 11 uvec4: a header as
// Q4_K's (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32), 2 words of fifth bits (bit b
// of byte l: element 32 b + l) and 8 words of low nibbles laid out as Q4_K's. A unit is nibble word k: its low
// nibbles are elements 64*(k/2) + 16*(k%2) + 0..15 (sub-block 2*(k/2)), its high nibbles the same plus 32.
#define RUN 16
#define RUNS 2
#define UNIT_ELEMS 32
#define HAS_OFFSET true
#define HAS_MIN true
struct Unit { uvec4 h; uvec4 v; uvec4 qh; uint k; };
#include "matvec_common.glsl"

Unit load_unit(uint row, uint u) {
    const uint base = row * pc.w_stride + (u >> 3) * 11, k = u & 7u;
    return Unit(w[base], w[base + 3 + k], w[base + 1 + (k & 1u)], k);
}

uint x_run(uint u, uint j) { return (u >> 3) * 256 + 64 * ((u & 7u) >> 1) + 16 * (u & 1u) + 32 * j; }

// run j is sub-block b = 2 * (k / 2) + j; its fifth bits are bit b of the qh bytes at the same positions
vec4 run_levels(Unit q, uint j, uint i) {
    const uint b = 2 * (q.k >> 1) + j;
    return bytes7(((q.v[i] >> (4 * j)) & 0x0F0F0F0Fu) | (((q.qh[i] >> b) & 0x01010101u) << 4));
}

vec4 x_factor(uint j) { return BYTES7; }

// (d * scale, -dmin * min) of sub-block 2 * (k / 2) + j, unpacked as in matvec_q4_k
vec2 run_coeffs(Unit q, uint u, uint j) {
    const uint p = (u & 7u) >> 1, sh = 16u * (p & 1u) + 8u * j;
    const uint y = q.h.y >> sh, z = q.h.z >> sh, x4 = q.h.w >> sh;
    uint sc, mn;
    if (p < 2) {
        sc = y & 63u;
        mn = z & 63u;
    } else {
        sc = (x4 & 0xFu) | ((y >> 2) & 0x30u);
        mn = ((x4 >> 4) & 0xFu) | ((z >> 2) & 0x30u);
    }
    const vec2 dm = unpackHalf2x16(q.h.x);
    return vec2(dm.x * float(sc), -dm.y * float(mn));
}

#ifdef INT_DOT
int run_idot(Unit q, uint j, uvec4 xq, int xs) {
    const uint b = 2 * (q.k >> 1) + j;
    uvec4 l;
    [[unroll]] for (uint i = 0; i < 4; i++) {
        l[i] = ((q.v[i] >> (4 * j)) & 0x0F0F0F0Fu) | (((q.qh[i] >> b) & 0x01010101u) << 4);
    }
    return dot16_s8u8(xq, l);
}
#endif

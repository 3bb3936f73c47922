#version 450
// y = W x for Q4_K weights as GGUF stores them: per row K/256 super-blocks of 144 bytes = 9 uvec4: a header
// (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32) and 8 words of nibbles.
// A unit is one nibble word k of a super-block: its low nibbles are elements 64*(k/2) + 16*(k%2) + 0..15
// (sub-block 2*(k/2)), its high nibbles the same plus 32 (sub-block 2*(k/2) + 1). The header is loaded by
// the 8 invocations of a super-block alike (one transaction).
#define RUN 16
#define RUNS 2
#define UNIT_ELEMS 32
#define HAS_OFFSET true
#define HAS_MIN true
struct Unit { uvec4 h; uvec4 v; };
#include "matvec_common.glsl"

Unit load_unit(uint row, uint u) {
    const uint base = row * pc.w_stride + (u >> 3) * 9;
    return Unit(w[base], w[base + 1 + (u & 7u)]);
}

uint x_run(uint u, uint j) { return (u >> 3) * 256 + 64 * ((u & 7u) >> 1) + 16 * (u & 1u) + 32 * j; }

vec4 run_levels(Unit q, uint j, uint i) { return j == 0 ? nibbles_lo(q.v[i]) : nibbles_hi(q.v[i]); }

vec4 x_factor(uint j) { return j == 0 ? NIB_LO : NIB_HI; }

// run j is sub-block 2 * (k / 2) + j: (d * scale, -dmin * min) from get_scale_min_k4; bytes 4..15 of the
// header are h.y, h.z, h.w. The 6-bit scale and min become floats through the mantissa of 2^23 (exact), not
// through conversions, which run at a fraction of the float rate on NVIDIA.
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
    const vec2 sm = uintBitsToFloat(uvec2(sc, mn) | 0x4B000000u) - 8388608.0;   // (sc, mn)
    return vec2(dm.x * sm.x, -dm.y * sm.y);
}

#ifdef INT_DOT
// run 0 is the low nibbles, run 1 the high ones, as in run_levels
int run_idot(Unit q, uint j, uvec4 xq, int xs) { return dot16_s8u8(xq, (q.v >> (4 * j)) & 0x0F0F0F0Fu); }
#endif

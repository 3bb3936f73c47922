#version 450
// y = W x for Q4_K weights as GGUF stores them: per row K/256 super-blocks of 144 bytes = 9 uvec4: a header
// (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32) and 8 words of nibbles; nibble
// word k holds elements 64*(k/2) + 16*(k%2) + 0..15 in its low nibbles (sub-block 2*(k/2)) and the same plus 32
// in its high ones (sub-block 2*(k/2) + 1).
// A unit is the pair of nibble words 2p, 2p+1 (p = u % 4): 64 consecutive elements, sub-blocks 2p and 2p+1,
// which share their header bytes. So one header load and one decoding of the pair's scales and mins serve 32
// weight bytes, where a unit of one word loaded and decoded them for 16 (the 4 invocations of a super-block
// load its header alike: one transaction).
#define RUN 16
#define RUNS 4
#define UNIT_ELEMS 64
#define HAS_OFFSET true
#define HAS_MIN true
struct Unit { uvec4 h; uvec4 a; uvec4 b; };
#include "matvec_common.glsl"

Unit load_unit(uint row, uint u) {
    const uint base = row * pc.w_stride + (u >> 2) * 9 + 1 + 2 * (u & 3u);
    return Unit(w[base - 1 - 2 * (u & 3u)], w[base], w[base + 1]);
}

// runs 0, 1: the low nibbles of words 2p, 2p+1 (sub-block 2p); runs 2, 3: their high nibbles (sub-block 2p+1)
uint x_run(uint u, uint j) { return u * 64 + 16 * j; }

uint run_word(Unit q, uint j, uint i) { return (j & 1u) == 0 ? q.a[i] : q.b[i]; }

vec4 run_levels(Unit q, uint j, uint i) {
    return j < 2 ? nibbles_lo(run_word(q, j, i)) : nibbles_hi(run_word(q, j, i));
}

vec4 x_factor(uint j) { return j < 2 ? NIB_LO : NIB_HI; }

// run j is sub-block 2p + j / 2: (d * scale, -dmin * min) from get_scale_min_k4; bytes 4..15 of the header are
// h.y, h.z, h.w (runs 0 and 1, 2 and 3 compute the same, once). The 6-bit scale and min become floats through
// the mantissa of 2^23 (exact), not through conversions, which run at a fraction of the float rate on NVIDIA.
vec2 run_coeffs(Unit q, uint u, uint j) {
    const uint p = u & 3u, sh = 16u * (p & 1u) + 8u * (j >> 1);
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
int run_idot(Unit q, uint j, uvec4 xq, int xs) {
    const uvec4 v = (j & 1u) == 0 ? q.a : q.b;
    return dot16_s8u8(xq, (v >> (4 * (j >> 1))) & 0x0F0F0F0Fu);
}
#endif

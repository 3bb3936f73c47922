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

// u = 8 s + 2 p + t: element 256 s + 64 p + 16 t = 32 u - 16 t, plus 32 for the high nibbles
uint x_run(uint u, uint j) { return 32u * (u + j) - 16u * (u & 1u); }

vec4 run_levels(Unit q, uint j, uint i) { return j == 0 ? nibbles_lo(q.v[i]) : nibbles_hi(q.v[i]); }

vec4 x_factor(uint j) { return j == 0 ? NIB_LO : NIB_HI; }

// run j is sub-block 2 * (k / 2) + j: (d * scale, -dmin * min) from get_scale_min_k4; bytes 4..15 of the
// header are h.y, h.z, h.w. Both runs' fields are unpacked at once, as bytes j of `sc` and `mn` (the shifts and
// masks are the same for both runs of a unit, so the two calls share them), without a branch (the 8 lanes of a
// super-block take both sides). The 6-bit scale and min become floats through the mantissa of 2^23 (exact), not
// through conversions, which run at a fraction of the float rate on NVIDIA. On the integer path run 1's scale
// is sc / 16, from the mantissa of 2^19 (exact, no multiply): run_idot dots its nibbles where they lie.
vec2 run_coeffs(Unit q, uint u, uint j) {
    const uint p = (u >> 1) & 3u, sh = 16u * (p & 1u);
    const uint y = q.h.y >> sh, z = q.h.z >> sh, x4 = q.h.w >> sh;
    const bool first = p < 2u;   // sub-blocks 0..3: 6-bit fields; 4..7: a nibble of x4 and two high bits
    const uint sc = first ? y & 0x3F3Fu : (x4 & 0x0F0Fu) | ((y >> 2) & 0x3030u);
    const uint mn = first ? z & 0x3F3Fu : ((x4 >> 4) & 0x0F0Fu) | ((z >> 2) & 0x3030u);
#ifdef INT_DOT
    const vec2 top = vec2(j == 0 ? 8388608.0 : 524288.0, 8388608.0);   // 2^23, or 2^19 for run 1's scale
#else
    const vec2 top = vec2(8388608.0);
#endif
    const vec2 sm = uintBitsToFloat(((uvec2(sc, mn) >> (8u * j)) & 0xFFu) | floatBitsToUint(top)) - top;
    return unpackHalf2x16(q.h.x) * vec2(sm.x, -sm.y);
}

#ifdef INT_DOT
// run 0 is the low nibbles, run 1 the high ones, as in run_levels; the high ones are dotted where they lie, as 16
// times their levels (the dot product stays below 2^19, exact as a float; run_coeffs takes sc / 16, so the product
// is the same float), four shifts fewer per unit and row than shifting them down: 8-22% faster at 8 activation
// rows on the H200's K = 4096 products (bench_matvec_forms --h2h, 2026-12-02; one row within 3%)
int run_idot(Unit q, uint j, uvec4 xq, int xs) { return dot16_s8u8(xq, q.v & (j == 0 ? 0x0F0F0F0Fu : 0xF0F0F0F0u)); }
#endif

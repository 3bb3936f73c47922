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
struct Unit { uvec4 h; uvec4 v; };
#include "matvec_common.glsl"

Unit load_unit(uint row, uint u) {
    const uint base = row * pc.w_stride + (u >> 3) * 9;
    return Unit(w[base], w[base + 1 + (u & 7u)]);
}

uint x_run(uint u, uint j) { return (u >> 3) * 256 + 64 * ((u & 7u) >> 1) + 16 * (u & 1u) + 32 * j; }

float unit_dot(Unit q, uint u, vec4 xv[XV], float xs[RUNS]) {
    vec4 d0 = vec4(0.0), d1 = vec4(0.0);
    [[unroll]] for (uint i = 0; i < 4; i++) {
        vec4 lo, hi;
        nibbles(q.v[i], lo, hi);
        d0 += lo * (xv[i] * NIB_LO);
        d1 += hi * (xv[4 + i] * NIB_HI);
    }
    // get_scale_min_k4 for sub-blocks 2j and 2j+1 (j = k/2): bytes 4..15 of the header are h.y, h.z, h.w
    const uint j = (u & 7u) >> 1, sh = 16u * (j & 1u);
    const uint y = q.h.y >> sh, z = q.h.z >> sh, x4 = q.h.w >> sh;
    uvec2 sc, mn;
    if (j < 2) {
        sc = uvec2(y, y >> 8) & 63u;
        mn = uvec2(z, z >> 8) & 63u;
    } else {
        sc = (uvec2(x4, x4 >> 8) & 0xFu) | ((uvec2(y, y >> 8) >> 2) & 0x30u);
        mn = ((uvec2(x4, x4 >> 8) >> 4) & 0xFu) | ((uvec2(z, z >> 8) >> 2) & 0x30u);
    }
    const vec2 dm = unpackHalf2x16(q.h.x);
    const vec2 a = dm.x * vec2(sc), b = dm.y * vec2(mn);
    return a.x * hsum(d0) + a.y * hsum(d1) - b.x * xs[0] - b.y * xs[1];
}

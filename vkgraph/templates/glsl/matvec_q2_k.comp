#version 450
// y = W x for Q2_K weights in the kernel layout: per row K/256 super-blocks of 80 bytes = 5 uvec4 in `w` (16 bytes
// of scale|min nibble pairs, one per sub-block of 16, then 64 bytes of 2-bit levels) and per super-block the float16
// pair (d, dmin) in `s`. Element 128 h + 32 r + l is bits 2r..2r+1 of level byte 32 h + l. A unit is level word
// k = 2 h + t: runs r = 0..3 are elements 128 h + 32 r + 16 t + 0..15, each one sub-block (8 h + 2 r + t).
#define RUN 16
#define RUNS 4
#define UNIT_ELEMS 64
#define HAS_OFFSET true
#define HAS_MIN true
struct Unit { uvec4 v; uvec4 sc; vec2 dm; uint k; };
#include "matvec_common.glsl"

Unit load_unit(uint row, uint u) {
    const uint base = row * pc.w_stride + (u >> 2) * 5;
    return Unit(w[base + 1 + (u & 3u)], w[base], unpackHalf2x16(s[((row * pc.s_stride) >> 1) + (u >> 2)]), u & 3u);
}

uint x_run(uint u, uint j) { return (u >> 2) * 256 + 128 * ((u & 3u) >> 1) + 16 * (u & 1u) + 32 * j; }

vec4 run_levels(Unit q, uint j, uint i) { return bytes7((q.v[i] >> (2 * j)) & 0x03030303u); }

vec4 x_factor(uint j) { return BYTES7; }

// x = d * (sc & 15) * q - dmin * (sc >> 4)
vec2 run_coeffs(Unit q, uint u, uint j) {
    const uint bi = 8 * (q.k >> 1) + 2 * j + (q.k & 1u);
    const uint sc = (q.sc[bi >> 2] >> (8 * (bi & 3u))) & 0xFFu;
    return vec2(q.dm.x * float(sc & 15u), -q.dm.y * float(sc >> 4));
}

#ifdef INT_DOT
int run_idot(Unit q, uint j, uvec4 xq, int xs) { return dot16_s8u8(xq, (q.v >> (2 * j)) & 0x03030303u); }
#endif

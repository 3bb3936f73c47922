#version 450
// y = W x for IQ4_XS weights in the kernel layout: per row K/256 super-blocks of eight 16-byte words of nibbles in
// `w` (word b: sub-block b, elements 32 b + 0..15 in its low nibbles, 32 b + 16..31 in its high ones; indices into
// IQ4_VALUES), and per super-block four 16-bit entries in `s`: float16 d, the scales' high bits (2 per sub-block),
// then their low nibbles (4 bytes). Sub-block b's scale is d (ls_b - 32).
#define RUN 16
#define RUNS 2
#define UNIT_ELEMS 32
#define HAS_OFFSET false
#define HAS_MIN false
#define UNIT_COEFFS
#define IQ4_TABLE
struct Unit { uvec4 v; float dl; };
#include "matvec_common.glsl"

Unit load_unit(uint row, uint u) {
    const uint base = ((row * pc.s_stride) >> 1) + 2 * (u >> 3), b = u & 7u;  // s_stride is even
    const uint dh = s[base], sl = s[base + 1];
    const uint ls = ((sl >> (4 * b)) & 0xFu) | (((dh >> (16 + 2 * b)) & 3u) << 4);
    return Unit(w[row * pc.w_stride + u], unpackHalf2x16(dh).x * float(int(ls) - 32));
}

uint x_run(uint u, uint j) { return u * 32 + 16 * j; }

vec4 run_levels(Unit q, uint j, uint i) { return iq4_levels((q.v[i] >> (4 * j)) & 0x0F0F0F0Fu); }

vec4 x_factor(uint j) { return vec4(1.0); }

vec2 run_coeffs(Unit q, uint u, uint j) { return vec2(q.dl, 0.0); }

#ifdef INT_DOT
int run_idot(Unit q, uint j, uvec4 xq, int xs) { return dot16_s8(xq, iq4_bytes(q.v >> (4 * j))); }
#endif

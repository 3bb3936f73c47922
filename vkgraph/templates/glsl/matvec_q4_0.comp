#version 450
// y = W x for Q4_0 weights in the kernel layout: per row K/32 blocks of 16 bytes in `w` (a unit is one block:
// element i in the low nibble of byte i, element i + 16 in its high nibble) and K/32 float16 scales in `s`.
#define RUN 16
#define RUNS 2
#define UNIT_ELEMS 32
#define HAS_OFFSET true
#define HAS_MIN false
#define UNIT_COEFFS
struct Unit { uvec4 v; float d; };
#include "matvec_common.glsl"

Unit load_unit(uint row, uint u) { return Unit(w[row * pc.w_stride + u], scale_at(row, u)); }

uint x_run(uint u, uint j) { return u * 32 + 16 * j; }

vec4 run_levels(Unit q, uint j, uint i) { return j == 0 ? nibbles_lo(q.v[i]) : nibbles_hi(q.v[i]); }

vec4 x_factor(uint j) { return j == 0 ? NIB_LO : NIB_HI; }

vec2 run_coeffs(Unit q, uint u, uint j) { return vec2(q.d, -8.0 * q.d); }   // levels are stored as q + 8

#ifdef INT_DOT
// run 0 is the low nibbles (elements 0..15), run 1 the high ones (16..31), stored as levels q + 8
int run_idot(Unit q, uint j, uvec4 xq, int xs) {
    return dot16_s8u8(xq, (q.v >> (4 * j)) & 0x0F0F0F0Fu) - 8 * xs;
}
#endif

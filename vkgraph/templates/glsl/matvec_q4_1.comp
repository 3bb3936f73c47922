#version 450
// y = W x for Q4_1 weights in the kernel layout: per row K/32 blocks of 16 bytes of nibbles in `w` (as Q4_0: element
// i in the low nibble of byte i, element i + 16 in its high nibble) and a float16 pair (d, m) per block in `s`;
// an element is d q + m.
#define RUN 16
#define RUNS 2
#define UNIT_ELEMS 32
#define HAS_OFFSET true
#define HAS_MIN true
#define UNIT_COEFFS
struct Unit { uvec4 v; vec2 dm; };
#include "matvec_common.glsl"

// s_stride (two entries a block) is even, so a block's pair is one uint
Unit load_unit(uint row, uint u) {
    return Unit(w[row * pc.w_stride + u], unpackHalf2x16(s[((row * pc.s_stride) >> 1) + u]));
}

uint x_run(uint u, uint j) { return u * 32 + 16 * j; }

vec4 run_levels(Unit q, uint j, uint i) { return j == 0 ? nibbles_lo(q.v[i]) : nibbles_hi(q.v[i]); }

vec4 x_factor(uint j) { return j == 0 ? NIB_LO : NIB_HI; }

vec2 run_coeffs(Unit q, uint u, uint j) { return q.dm; }

#ifdef INT_DOT
// run 0 is the low nibbles, run 1 the high ones; m enters through the run's activation sum (HAS_MIN)
int run_idot(Unit q, uint j, uvec4 xq, int xs) { return dot16_s8u8(xq, (q.v >> (4 * j)) & 0x0F0F0F0Fu); }
#endif

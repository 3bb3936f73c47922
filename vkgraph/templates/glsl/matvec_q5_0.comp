#version 450
// y = W x for Q5_0 weights in the kernel layout: per row K/32 blocks of 16 bytes of low nibbles in `w` (as Q4_0),
// and per block three 16-bit entries in `s`: float16 d, then the 32 fifth bits (bit i: element i); an element is
// d (q - 16).
#define RUN 16
#define RUNS 2
#define UNIT_ELEMS 32
#define HAS_OFFSET true
#define HAS_MIN false
#define UNIT_COEFFS
struct Unit { uvec4 v; uint qh; float d; };
#include "matvec_common.glsl"

Unit load_unit(uint row, uint u) {
    return Unit(w[row * pc.w_stride + u], half_bits(row, 3 * u + 1) | (half_bits(row, 3 * u + 2) << 16),
                scale_at(row, 3 * u));
}

uint x_run(uint u, uint j) { return u * 32 + 16 * j; }

// the 5-bit levels of elements 16 j + 4 i .. + 3, one per byte
uint run_bytes(Unit q, uint j, uint i) {
    return ((q.v[i] >> (4 * j)) & 0x0F0F0F0Fu) | (spread4((q.qh >> (16 * j + 4 * i)) & 0xFu) << 4);
}

vec4 run_levels(Unit q, uint j, uint i) { return bytes7(run_bytes(q, j, i)); }

vec4 x_factor(uint j) { return BYTES7; }

vec2 run_coeffs(Unit q, uint u, uint j) { return vec2(q.d, -16.0 * q.d); }

#ifdef INT_DOT
int run_idot(Unit q, uint j, uvec4 xq, int xs) {   // levels are stored as q + 16
    return dot16_s8u8(xq, uvec4(run_bytes(q, j, 0), run_bytes(q, j, 1), run_bytes(q, j, 2), run_bytes(q, j, 3)))
         - 16 * xs;
}
#endif

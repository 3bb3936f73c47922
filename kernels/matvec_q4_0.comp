#version 450
// y = W x for Q4_0 weights in the kernel layout: per row K/32 blocks of 16 bytes in `w` (a unit is one block:
// element i in the low nibble of byte i, element i + 16 in its high nibble) and K/32 float16 scales in `s`.
#define RUN 16
#define RUNS 2
#define UNIT_ELEMS 32
#define HAS_OFFSET true
struct Unit { uvec4 v; float d; };
#include "matvec_common.glsl"

Unit load_unit(uint row, uint u) { return Unit(w[row * pc.w_stride + u], scale_at(row, u)); }

uint x_run(uint u, uint j) { return u * 32 + 16 * j; }

float unit_dot(Unit q, uint u, vec4 xv[XV], float xs[RUNS]) {
    vec4 d4 = vec4(0.0);
    [[unroll]] for (uint i = 0; i < 4; i++) {
        vec4 lo, hi;
        nibbles(q.v[i], lo, hi);
        d4 += lo * (xv[i] * NIB_LO) + hi * (xv[4 + i] * NIB_HI);
    }
    return q.d * (hsum(d4) - 8.0 * (xs[0] + xs[1]));   // levels are stored as q + 8
}

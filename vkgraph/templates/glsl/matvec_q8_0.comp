#version 450
// y = W x for Q8_0 weights in the kernel layout (vkgraph.quant.kernel_layout): per row K int8 values in
// `w` (a unit is one uvec4: 16 values, half a block) and K/32 float16 scales in `s`.
#define RUN 16
#define RUNS 1
#define UNIT_ELEMS 16
#define HAS_OFFSET false
#define HAS_MIN false
#define UNIT_COEFFS
struct Unit { uvec4 v; float d; };
#include "matvec_common.glsl"

Unit load_unit(uint row, uint u) { return Unit(w[row * pc.w_stride + u], scale_at(row, u >> 1)); }

uint x_run(uint u, uint j) { return u * 16; }

vec4 run_levels(Unit q, uint j, uint i) { return bytes_i8(q.v[i]); }

vec4 x_factor(uint j) { return I8; }

vec2 run_coeffs(Unit q, uint u, uint j) { return vec2(q.d, 0.0); }

#ifdef INT_DOT
int run_idot(Unit q, uint j, uvec4 xq, int xs) { return dot16_s8(xq, q.v); }
#endif

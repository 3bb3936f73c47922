#version 450
// y = W x for Q8_0 weights in the kernel layout (vkgraph.quant.kernel_layout): per row K int8 values in
// `w` (a unit is one uvec4: 16 values, half a block) and K/32 float16 scales in `s`.
#define RUN 16
#define RUNS 1
#define UNIT_ELEMS 16
#define HAS_OFFSET false
struct Unit { uvec4 v; float d; };
#include "matvec_common.glsl"

Unit load_unit(uint row, uint u) { return Unit(w[row * pc.w_stride + u], scale_at(row, u >> 1)); }

uint x_run(uint u, uint j) { return u * 16; }

float unit_dot(Unit q, uint u, vec4 xv[XV], float xs[RUNS]) {
    const vec4 d4 = bytes_i8(q.v.x) * (xv[0] * I8) + bytes_i8(q.v.y) * (xv[1] * I8)
                  + bytes_i8(q.v.z) * (xv[2] * I8) + bytes_i8(q.v.w) * (xv[3] * I8);
    return q.d * hsum(d4);
}

#version 450
// y = W x for float16 weights (bfloat16 with -DW_BF16): rows of K values (K % 8 == 0), a unit is one uvec4
// of 8 values. `s` is unused.
#define RUN 8
#define RUNS 1
#define UNIT_ELEMS 8
#define HAS_OFFSET false
struct Unit { uvec4 v; };
#include "matvec_common.glsl"

Unit load_unit(uint row, uint u) { return Unit(w[row * pc.w_stride + u]); }

uint x_run(uint u, uint j) { return u * 8; }

float unit_dot(Unit q, uint u, vec4 xv[XV], float xs[RUNS]) {
#ifdef W_BF16
    return hsum(unpack_bf16x4(q.v.xy) * xv[0] + unpack_bf16x4(q.v.zw) * xv[1]);
#else
    return hsum(unpack_half4(q.v.xy) * xv[0] + unpack_half4(q.v.zw) * xv[1]);
#endif
}

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

vec4 run_levels(Unit q, uint j, uint i) {
    const uvec2 h = i == 0 ? q.v.xy : q.v.zw;
#ifdef W_BF16
    return unpack_bf16x4(h);
#else
    return unpack_half4(h);
#endif
}

vec4 x_factor(uint j) { return vec4(1.0); }

vec2 run_coeffs(Unit q, uint u, uint j) { return vec2(1.0, 0.0); }

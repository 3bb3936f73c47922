#version 450
// y = W x for float16 weights (bfloat16 with -DW_BF16): rows of K values (K % 8 == 0), a unit is one uvec4
// of 8 values. `s` is unused.
#define RUN 8
#define RUNS 1
#define UNIT_ELEMS 8
#define HAS_OFFSET false
#include "matvec_common.glsl"

void decode_unit(uint row, uint u, out vec4 q[RUNS * RUN / 4], out float a[RUNS], out float b[RUNS],
                 out uint xoff[RUNS]) {
    const uvec4 v = w[row * pc.w_stride + u];
#ifdef W_BF16
    q[0] = unpack_bf16x4(v.xy);
    q[1] = unpack_bf16x4(v.zw);
#else
    q[0] = unpack_half4(v.xy);
    q[1] = unpack_half4(v.zw);
#endif
    a[0] = 1.0;
    b[0] = 0.0;
    xoff[0] = u * 8;
}

#version 450
// y = W x for Q8_0 weights in the kernel layout (vkgraph.quant.kernel_layout): per row K int8 values in
// `w` (a unit is one uvec4: 16 values, half a block) and K/32 float16 scales in `s`.
#define RUN 16
#define RUNS 1
#define UNIT_ELEMS 16
#define HAS_OFFSET false
#include "matvec_common.glsl"

void decode_unit(uint row, uint u, out vec4 q[RUNS * RUN / 4], out float a[RUNS], out float b[RUNS],
                 out uint xoff[RUNS]) {
    const uvec4 v = w[row * pc.w_stride + u];
    q[0] = bytes_i8(v.x);
    q[1] = bytes_i8(v.y);
    q[2] = bytes_i8(v.z);
    q[3] = bytes_i8(v.w);
    a[0] = scale_at(row, u >> 1);
    b[0] = 0.0;
    xoff[0] = u * 16;
}

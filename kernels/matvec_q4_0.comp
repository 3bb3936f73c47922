#version 450
// y = W x for Q4_0 weights in the kernel layout: per row K/32 blocks of 16 bytes in `w` (a unit is one block:
// element i in the low nibble of byte i, element i + 16 in its high nibble) and K/32 float16 scales in `s`.
#define RUN 16
#define RUNS 2
#define UNIT_ELEMS 32
#define HAS_OFFSET true
#include "matvec_common.glsl"

void decode_unit(uint row, uint u, out vec4 q[RUNS * RUN / 4], out float a[RUNS], out float b[RUNS],
                 out uint xoff[RUNS]) {
    const uvec4 v = w[row * pc.w_stride + u];
    [[unroll]] for (uint i = 0; i < 4; i++) {
        q[i] = bytes_bits(v[i], 0u, 0xFu);
        q[4 + i] = bytes_bits(v[i], 4u, 0xFu);
    }
    const float d = scale_at(row, u);
    a[0] = d;
    a[1] = d;
    b[0] = -8.0 * d;   // levels are stored as q + 8
    b[1] = -8.0 * d;
    xoff[0] = u * 32;
    xoff[1] = u * 32 + 16;
}

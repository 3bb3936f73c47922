#version 450
// RMSNorm straight into the integer dot-product matvec's input: y[r, i] = x[r, i] / sqrt(mean_i(x[r, i]^2) + eps)
// * w[i], written as quantize_q8.comp writes activations (per block of 32 of y: 32 int8 round(y / d) as four
// per uint in xq, the scale d = max |y| / 127 in xd, the int8 sums of its two halves in xs), so the float y
// never goes to memory and no quantization kernel runs between the norm and the product.
// One workgroup per row; n % 32 == 0.
#include "common.glsl"
#include "row_reduce.glsl"
layout(set = 0, binding = 0) readonly buffer X { vec4 x[]; };
layout(set = 0, binding = 1) readonly buffer W { vec4 w[]; };
layout(set = 0, binding = 2) writeonly buffer XQ { uint xq[]; };
layout(set = 0, binding = 3) writeonly buffer XD { float xd[]; };
layout(set = 0, binding = 4) writeonly buffer XS { int xs[]; };

layout(push_constant) uniform Push {
    uint n;
    float eps;
} pc;

#include "q8_store.glsl"

void main() {
    const uint row = gl_WorkGroupID.x;
    const uint base = row * (pc.n / 4);
    float ss = 0.0;
    for (uint i = gl_LocalInvocationID.x; i < pc.n / 4; i += WG) {
        const vec4 v = x[base + i];
        ss += dot(v, v);
    }
    const float inv = inversesqrt(wg_sum(ss) / float(pc.n) + pc.eps);
    const uint blocks = pc.n / 32;
    for (uint b = gl_LocalInvocationID.x; b < blocks; b += WG) {
        vec4 v[8];
        [[unroll]] for (uint i = 0; i < 8; i++) v[i] = x[base + b * 8 + i] * inv * w[b * 8 + i];
        store_q8_block(row * blocks + b, v);
    }
}

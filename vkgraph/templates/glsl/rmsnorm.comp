#version 450
// y[r, i] = x[r, i] / sqrt(mean_i(x[r, i]^2) + eps) * w[i].
// One workgroup per row.
#include "common.glsl"
#include "row_reduce.glsl"
layout(set = 0, binding = 0) readonly buffer X { float x[]; };
layout(set = 0, binding = 1) readonly buffer W { float w[]; };
layout(set = 0, binding = 2) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint n;
    float eps;
} pc;

void main() {
    const uint base = gl_WorkGroupID.x * pc.n;
    float ss = 0.0;
    for (uint i = gl_LocalInvocationID.x; i < pc.n; i += WG) ss += x[base + i] * x[base + i];
    const float inv = inversesqrt(wg_sum(ss) / float(pc.n) + pc.eps);
    for (uint i = gl_LocalInvocationID.x; i < pc.n; i += WG) y[base + i] = x[base + i] * inv * w[i];
}

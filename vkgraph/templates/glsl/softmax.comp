#version 450
// y[r, :] = softmax(x[r, :] * scale), one workgroup per row; a row of -inf gives zeros.
#include "common.glsl"
#include "row_reduce.glsl"
layout(set = 0, binding = 0) readonly buffer X { float x[]; };
layout(set = 0, binding = 1) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint n;
    float scale;
} pc;

void main() {
    const uint base = gl_WorkGroupID.x * pc.n;
    float m = -1.0 / 0.0;
    for (uint i = gl_LocalInvocationID.x; i < pc.n; i += WG) m = max(m, x[base + i] * pc.scale);
    m = wg_max(m);
    float s = 0.0;
    if (m != -1.0 / 0.0) {
        for (uint i = gl_LocalInvocationID.x; i < pc.n; i += WG) s += exp(x[base + i] * pc.scale - m);
    }
    s = wg_sum(s);
    for (uint i = gl_LocalInvocationID.x; i < pc.n; i += WG) {
        y[base + i] = s > 0.0 ? exp(x[base + i] * pc.scale - m) / s : 0.0;
    }
}

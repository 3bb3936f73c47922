#version 450
// y = silu(gate) * up = gate / (1 + exp(-gate)) * up, elementwise over n values.
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;
layout(set = 0, binding = 0) readonly buffer Gate { float gate[]; };
layout(set = 0, binding = 1) readonly buffer Up { float up[]; };
layout(set = 0, binding = 2) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint n;
    uint groups_x;
} pc;

void main() {
    const uint i = (gl_WorkGroupID.y * pc.groups_x + gl_WorkGroupID.x) * WG + gl_LocalInvocationID.x;
    if (i >= pc.n) return;
    const float g = gate[i];
    y[i] = g / (1.0 + exp(-g)) * up[i];
}

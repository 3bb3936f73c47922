#version 450
// Rotary position embedding, in place on x [T, H, D] float32 with positions pos[T] (int32).
// Pair i (0 <= i < D/2) rotates by angle pos * base^(-2i/D): the pair is (2i, 2i+1) in the normal (GPT-J)
// layout, (i, i + D/2) with -DNEOX. One invocation per pair.
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;
layout(set = 0, binding = 0) buffer X { float x[]; };
layout(set = 0, binding = 1) readonly buffer Pos { int pos[]; };

layout(push_constant) uniform Push {
    uint tokens;
    uint heads;
    uint head_size;
    float base;
    uint groups_x;
} pc;

void main() {
    const uint half_d = pc.head_size / 2;
    const uint p = (gl_WorkGroupID.y * pc.groups_x + gl_WorkGroupID.x) * WG + gl_LocalInvocationID.x;
    if (p >= pc.tokens * pc.heads * half_d) return;
    const uint i = p % half_d, row = p / half_d, t = row / pc.heads;
    const float theta = float(pos[t]) * pow(pc.base, -2.0 * float(i) / float(pc.head_size));
    const float c = cos(theta), s = sin(theta);
#ifdef NEOX
    const uint a = row * pc.head_size + i, b = a + half_d;
#else
    const uint a = row * pc.head_size + 2 * i, b = a + 1;
#endif
    const float x0 = x[a], x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x0 * s + x1 * c;
}

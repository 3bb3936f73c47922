#version 450
// The gated unit of an MLP straight into the integer dot-product matvec's input: from the rows of the stacked
// gate/up product gu [rows, 2F] (gate in columns 0..F, up in F..2F), h = act(gate) * up [rows, F], written as
// quantize_q8.comp writes activations (per block of 32: int8 values in xq, the scale max |h| / 127 in xd, the
// int8 sums of the two halves in xs). act is SiLU, g / (1 + exp(-g)), or with -DGELU_TANH the tanh GELU,
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))). One invocation per block; F % 32 == 0.
#include "common.glsl"
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;

layout(set = 0, binding = 0) readonly buffer GU { vec4 gu[]; };
layout(set = 0, binding = 1) writeonly buffer XQ { uint xq[]; };
layout(set = 0, binding = 2) writeonly buffer XD { float xd[]; };
layout(set = 0, binding = 3) writeonly buffer XS { int xs[]; };

layout(push_constant) uniform Push {
    uint n_blocks;    // rows * F / 32
    uint f;           // F, the width of h
    uint groups_x;    // workgroups along x (blocks are spread over x and y)
} pc;

#include "q8_store.glsl"

vec4 act(vec4 g) {
#ifdef GELU_TANH
    const vec4 z = 0.7978845608028654 * (g + 0.044715 * g * g * g);
    return 0.5 * g * (1.0 + (1.0 - 2.0 / (exp(2.0 * z) + 1.0)));  // tanh without inf / inf at large |z|
#else
    return g / (1.0 + exp(-g));
#endif
}

void main() {
    const uint blk = (gl_WorkGroupID.y * pc.groups_x + gl_WorkGroupID.x) * WG + gl_LocalInvocationID.x;
    if (blk >= pc.n_blocks) return;
    const uint per_row = pc.f / 32;
    const uint row = blk / per_row;
    const uint g0 = (row * 2 * pc.f + (blk % per_row) * 32) / 4;  // the block's first gate vec4
    const uint u0 = g0 + pc.f / 4;
    vec4 v[8];
    [[unroll]] for (uint i = 0; i < 8; i++) v[i] = act(gu[g0 + i]) * gu[u0 + i];
    store_q8_block(blk, v);
}

#version 450
// Activations to int8 for the integer dot-product matvec (-DINT_DOT): per block of 32 elements of the
// flattened [rows, K] input (K % 32 == 0), xq holds the 32 values round(x / d) as four int8 per uint, xd the
// scale d = max |x| / 127 and xs the sums of its two halves' int8 values (a matvec run is 16 activations; the
// formats fold their offsets, e.g. Q4_0's 8, into a multiple of the run's sum).
// One invocation per block. Float16 input with -DA_F16.
#include "common.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;

#ifdef A_F16
#define XVEC uvec2
#else
#define XVEC vec4
#endif

layout(set = 0, binding = 0) readonly buffer X { XVEC x[]; };
layout(set = 0, binding = 1) writeonly buffer XQ { uint xq[]; };
layout(set = 0, binding = 2) writeonly buffer XD { float xd[]; };
layout(set = 0, binding = 3) writeonly buffer XS { int xs[]; };

layout(push_constant) uniform Push {
    uint n_blocks;    // blocks of 32 in the input
    uint groups_x;    // workgroups along x (blocks are spread over x and y)
} pc;

#include "q8_store.glsl"

vec4 load4(uint i) {
#ifdef A_F16
    return unpack_half4(x[i]);
#else
    return x[i];
#endif
}

void main() {
    const uint blk = (gl_WorkGroupID.y * pc.groups_x + gl_WorkGroupID.x) * WG + gl_LocalInvocationID.x;
    if (blk >= pc.n_blocks) return;
    vec4 v[8];
    [[unroll]] for (uint i = 0; i < 8; i++) v[i] = load4(blk * 8 + i);
    store_q8_block(blk, v);
}

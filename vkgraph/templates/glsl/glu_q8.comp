#version 450
// The gated unit of an MLP straight into the integer dot-product matvec's input: from the rows of the stacked
// gate/up product gu [rows, 2F] (gate in columns 0..F, up in F..2F), h = act(gate) * up [rows, F], written as
// quantize_q8.comp writes activations (per block of 32: int8 values in xq, the scale max |h| / 127 in xd, the
// int8 sums of the two halves in xs). act is SiLU, or with -DGELU_TANH the tanh GELU (glu_act.glsl). One
// invocation per vec4 of h, 8 to a block, which meet its largest |h| and half sums (q8_lanes.glsl): at decode's
// few rows every lane has one load pair and one exp of work, spread over many workgroups, where one invocation
// per block left most lanes idle. F % 32 == 0. The matvec's -DGLU_Q8 epilogue writes the same blocks from the
// gate/up product's own sums (matvec_common.glsl), where that launch applies.
#include "common.glsl"
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;

layout(set = 0, binding = 0) readonly buffer GU { vec4 gu[]; };
layout(set = 0, binding = 1) writeonly buffer XQ { uint xq[]; };
layout(set = 0, binding = 2) writeonly buffer XD { float xd[]; };
layout(set = 0, binding = 3) writeonly buffer XS { int xs[]; };

layout(push_constant) uniform Push {
    uint n4;          // rows * F / 4, the vec4s of h
    uint f;           // F, the width of h
    uint groups_x;    // workgroups along x (the vec4s are spread over x and y)
} pc;

#include "q8_lanes.glsl"
#include "glu_act.glsl"

void main() {
    // no early return: every invocation takes part in its block's exchange
    const uint e = (gl_WorkGroupID.y * pc.groups_x + gl_WorkGroupID.x) * WG + lane_slot();
    const bool valid = e < pc.n4;
    const uint f4 = pc.f / 4;
    const uint g0 = (e / f4) * 2 * f4 + e % f4;  // its gate vec4; the up vec4 is f4 further
    vec4 h = vec4(0.0);
    if (valid) h = glu_act(gu[g0]) * gu[g0 + f4];
    store_q8_part(e / 8, e % 8, h, valid);
}

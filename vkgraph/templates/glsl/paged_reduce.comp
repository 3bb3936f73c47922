#version 450
// Combines the split-K partitions of paged_decode: out = sum_p w_p * o_p / sum_p w_p * l_p with
// w_p = exp(m_p - max_p m_p). Partitions that saw no visible token carry m = -inf and weigh nothing.
// One workgroup per (sequence, query head). Its invocations first fold the partitions' (max, sum) pairs and
// combine them in a tree through shared memory; then each takes 4 dimensions of a slice of the partitions (WG /
// (head_size / 4) slices), its loads issued 4 partitions at a time so that they are in flight together rather
// than one memory round trip each, and the slices are summed through shared memory.
#include "common.glsl"
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128;   // a power of two, at least head_size / 4

layout(set = 0, binding = 0) readonly buffer PartOut { vec4 part_o[]; };  // [B, Hq, max_parts, D]
layout(set = 0, binding = 1) readonly buffer PartML { vec2 part_ml[]; };  // [B, Hq, max_parts] (max, sum)
layout(set = 0, binding = 2) readonly buffer Lens { int context_lens[]; };
layout(set = 0, binding = 3) writeonly buffer Out { vec4 o[]; };          // [B, Hq, D]
// -DQ8_OUT (with -DHEAD_SIZE): the output written as the integer matvec's input instead of `o` (q8_store.glsl;
// bound in both modes, as the interface parser does not preprocess)
layout(set = 0, binding = 4) writeonly buffer XQ { uint xq[]; };
layout(set = 0, binding = 5) writeonly buffer XD { float xd[]; };
layout(set = 0, binding = 6) writeonly buffer XS { int xs[]; };

layout(push_constant) uniform Push {
    uint num_heads;
    uint head_size;
    uint part_tokens;
    uint max_parts;
} pc;

#include "q8_store.glsl"
shared vec2 sml[WG];
shared vec4 sacc[WG];
#ifdef Q8_OUT
shared vec4 sv[HEAD_SIZE / 4];
#endif

vec2 combine(vec2 a, vec2 b) {   // two (max, sum) pairs as one; -inf maxima weigh nothing (no inf - inf)
    const float m = max(a.x, b.x);
    if (m == -1.0 / 0.0) return vec2(m, 0.0);
    return vec2(m, a.y * exp(a.x - m) + b.y * exp(b.x - m));
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint seq = gl_WorkGroupID.y, head = seq * pc.num_heads + gl_WorkGroupID.x;
    const uint parts = min((uint(context_lens[seq]) + pc.part_tokens - 1) / pc.part_tokens, pc.max_parts);
    const uint row = head * pc.max_parts;
    vec2 ml = vec2(-1.0 / 0.0, 0.0);
    for (uint p = tid; p < parts; p += WG) ml = combine(ml, part_ml[row + p]);
    sml[tid] = ml;
    barrier();
    for (uint s = WG / 2; s > 0; s /= 2) {
        if (tid < s) sml[tid] = combine(sml[tid], sml[tid + s]);
        barrier();
    }
    const float m = sml[0].x, l = sml[0].y;

    const uint quads = pc.head_size / 4, slices = WG / quads, q = tid % quads, sl = tid / quads;
    vec4 v = vec4(0.0);
    if (sl < slices && l > 0.0) {
        for (uint p0 = sl; p0 < parts; p0 += 4 * slices) {
            float w[4];
            vec4 x[4];
            [[unroll]] for (uint k = 0; k < 4; k++) {   // the loads of 4 partitions first, then their sums
                const uint p = p0 + k * slices;
                w[k] = p < parts ? part_ml[row + p].x : -1.0 / 0.0;
                x[k] = p < parts ? part_o[(row + p) * quads + q] : vec4(0.0);
            }
            [[unroll]] for (uint k = 0; k < 4; k++) v += exp(w[k] - m) * x[k];
        }
    }
    sacc[tid] = v;
    barrier();
    if (tid < quads) {
        vec4 sum = vec4(0.0);
        for (uint s = 0; s < slices; s++) sum += sacc[s * quads + tid];
        sum = l > 0.0 ? sum / l : vec4(0.0);
#ifdef Q8_OUT
        sv[tid] = sum;
#else
        o[head * quads + tid] = sum;
#endif
    }
#ifdef Q8_OUT
    barrier();
    for (uint blk = tid; blk < HEAD_SIZE / 32; blk += WG) {
        vec4 b[8];
        [[unroll]] for (uint i = 0; i < 8; i++) b[i] = sv[blk * 8 + i];
        store_q8_block(head * (HEAD_SIZE / 32) + blk, b);
    }
#endif
}

#version 450
// Combines the split-K partitions of paged_decode: out = sum_p w_p * o_p / sum_p w_p * l_p with
// w_p = exp(m_p - max_p m_p). Partitions that saw no visible token carry m = -inf and weigh nothing.
// One workgroup per (sequence, query head); invocations stride over the head's dimensions.
#include "common.glsl"
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128;

layout(set = 0, binding = 0) readonly buffer PartOut { float part_o[]; };  // [B, Hq, max_parts, D]
layout(set = 0, binding = 1) readonly buffer PartML { vec2 part_ml[]; };   // [B, Hq, max_parts]
layout(set = 0, binding = 2) readonly buffer Lens { int context_lens[]; };
layout(set = 0, binding = 3) writeonly buffer Out { float o[]; };           // [B, Hq, D]
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
#ifdef Q8_OUT
shared float sv[HEAD_SIZE];
#endif

void main() {
    const uint seq = gl_WorkGroupID.y, head = seq * pc.num_heads + gl_WorkGroupID.x;
    const uint parts = min((uint(context_lens[seq]) + pc.part_tokens - 1) / pc.part_tokens, pc.max_parts);
    float m = -1.0 / 0.0;
    for (uint p = 0; p < parts; p++) m = max(m, part_ml[head * pc.max_parts + p].x);
    float l = 0.0;
    if (m != -1.0 / 0.0) {
        for (uint p = 0; p < parts; p++) {
            const vec2 ml = part_ml[head * pc.max_parts + p];
            l += exp(ml.x - m) * ml.y;
        }
    }
    for (uint d = gl_LocalInvocationID.x; d < pc.head_size; d += WG) {
        float v = 0.0;
        if (l > 0.0) {
            for (uint p = 0; p < parts; p++) {
                const float w = exp(part_ml[head * pc.max_parts + p].x - m);
                v += w * part_o[(head * pc.max_parts + p) * pc.head_size + d];
            }
            v /= l;
        }
#ifdef Q8_OUT
        sv[d] = v;
#else
        o[head * pc.head_size + d] = v;
#endif
    }
#ifdef Q8_OUT
    barrier();
    for (uint blk = gl_LocalInvocationID.x; blk < HEAD_SIZE / 32; blk += WG) {
        vec4 v[8];
        [[unroll]] for (uint i = 0; i < 8; i++) {
            v[i] = vec4(sv[blk * 32 + 4 * i], sv[blk * 32 + 4 * i + 1], sv[blk * 32 + 4 * i + 2], sv[blk * 32 + 4 * i + 3]);
        }
        store_q8_block(head * (HEAD_SIZE / 32) + blk, v);
    }
#endif
}

#version 450
// Decode attention over a paged KV cache: one new query token per sequence, sequences of different lengths.
// A workgroup serves one (partition, KV head, sequence) and all GROUP query heads that share the KV head
// (grouped-query attention), so each key and value is read once per KV head.
//
// Cache layout (k and v alike): [num_blocks, num_kv_heads, block_size, HEAD_SIZE], float16 (-DKV_F16) or
// float32. block_tables[seq, i] is the physical block of the sequence's tokens i*block_size...; any block
// may be shared or in any order. Optional sliding window: only the last `window` positions are visible.
// Split-K: with part_tokens > 0, partition p covers positions [p*part_tokens, (p+1)*part_tokens) and writes
// its unnormalised output and (max, sum) to the partial buffers for paged_reduce; else the output directly.
#define ROWS GROUP
layout(set = 0, binding = 0) readonly buffer Q { float q[]; };            // [B, Hq, D] float32
layout(set = 0, binding = 1) readonly buffer KC { uvec4 kc[]; };
layout(set = 0, binding = 2) readonly buffer VC { uvec4 vc[]; };
layout(set = 0, binding = 3) readonly buffer Tables { int block_tables[]; };  // [B, max_blocks]
layout(set = 0, binding = 4) readonly buffer Lens { int context_lens[]; };    // [B]
layout(set = 0, binding = 5) writeonly buffer Out { float o[]; };           // [B, Hq, D]
layout(set = 0, binding = 6) writeonly buffer PartOut { float part_o[]; };  // [B, Hq, max_parts, D]
layout(set = 0, binding = 7) writeonly buffer PartML { vec2 part_ml[]; };   // [B, Hq, max_parts] (max, sum)
// -DQ8_OUT: the output written (unsplit) as the integer matvec's input instead of `o` (q8_store.glsl; bound in
// both modes, as the interface parser does not preprocess)
layout(set = 0, binding = 8) writeonly buffer XQ { uint xq[]; };
layout(set = 0, binding = 9) writeonly buffer XD { float xd[]; };
layout(set = 0, binding = 10) writeonly buffer XS { int xs[]; };

layout(push_constant) uniform Push {
    uint num_kv_heads;
    uint block_size;
    uint max_blocks;     // block table row length
    float scale;         // softmax scale, usually 1/sqrt(HEAD_SIZE)
    uint window;         // 0: no sliding window
    uint part_tokens;    // 0: one partition per sequence (no split)
    uint max_parts;
    float softcap;       // > 0: scores become softcap * tanh(score / softcap)
} pc;

#include "attention_common.glsl"
#include "q8_store.glsl"

uint seq_id() { return gl_WorkGroupID.z; }
uint kv_head() { return gl_WorkGroupID.y; }

uint kv_word(uint pos) {
    const uint block = uint(block_tables[seq_id() * pc.max_blocks + pos / pc.block_size]);
    return ((block * pc.num_kv_heads + kv_head()) * pc.block_size + pos % pc.block_size) * WORDS_PER_TOKEN;
}

bool visible(uint row, uint pos) { return true; }   // the window is applied through the range

vec4 q_at(uint row, uint e) {
    const uint base = ((seq_id() * pc.num_kv_heads + kv_head()) * GROUP + row) * HEAD_SIZE + e;
    return pc.scale * vec4(q[base], q[base + 1], q[base + 2], q[base + 3]);
}

void main() {
    const uint ctx = uint(context_lens[seq_id()]);
    const uint part = gl_WorkGroupID.x;
    uint begin = 0, end = ctx;
    if (pc.part_tokens > 0) {
        begin = min(part * pc.part_tokens, ctx);
        end = min(begin + pc.part_tokens, ctx);
    }
    if (pc.window > 0 && ctx > pc.window) begin = max(begin, ctx - pc.window);
    attend(begin, max(begin, end));

    const uint tid = gl_LocalInvocationID.x;
    const uint head0 = (seq_id() * pc.num_kv_heads + kv_head()) * GROUP;
    [[unroll]] for (uint j = 0; j < ACC_N; j++) {
        const uint i = tid + j * WG;
        if (i < PAIRS) {
            const uint r = i / (HEAD_SIZE / 4), e = 4 * (i % (HEAD_SIZE / 4));
            if (pc.part_tokens > 0) {
                const uint base = ((head0 + r) * pc.max_parts + part) * HEAD_SIZE + e;
                part_o[base] = acc[j].x;
                part_o[base + 1] = acc[j].y;
                part_o[base + 2] = acc[j].z;
                part_o[base + 3] = acc[j].w;
            } else {
                const float l = sL[r];
                const vec4 v = l > 0.0 ? acc[j] / l : vec4(0.0);
#ifdef Q8_OUT
                sQ[i] = v;   // the queries are consumed: sQ holds the output rows for their quantization
#else
                const uint base = (head0 + r) * HEAD_SIZE + e;
                o[base] = v.x;
                o[base + 1] = v.y;
                o[base + 2] = v.z;
                o[base + 3] = v.w;
#endif
            }
        }
    }
    if (pc.part_tokens > 0) {
        for (uint r = tid; r < ROWS; r += WG) part_ml[(head0 + r) * pc.max_parts + part] = vec2(sM[r], sL[r]);
    }
#ifdef Q8_OUT
    if (pc.part_tokens == 0) {   // uniform: a push constant
        barrier();
        for (uint blk = tid; blk < ROWS * HEAD_SIZE / 32; blk += WG) {
            vec4 v[8];
            [[unroll]] for (uint i = 0; i < 8; i++) v[i] = sQ[blk * 8 + i];
            store_q8_block(head0 * (HEAD_SIZE / 32) + blk, v);
        }
    }
#endif
}

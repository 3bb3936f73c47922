#version 450
// Causal attention for prompts (prefill) over contiguous keys and values, for a batch of sequences packed
// back to back (cu_seqlens[b] .. cu_seqlens[b+1] are sequence b's tokens). A workgroup serves QT query
// tokens of one sequence and the GROUP query heads of one KV head: ROWS = QT * GROUP rows share every key
// and value it loads. Query i sees keys 0..i (and, with a sliding window, only the last `window` of them).
// q, out: [T, Hq, HEAD_SIZE] float32; k, v: [T, Hkv, HEAD_SIZE] float32, or float16 with -DKV_F16.
#define ROWS (QT * GROUP)
layout(set = 0, binding = 0) readonly buffer Q { float q[]; };
layout(set = 0, binding = 1) readonly buffer KC { uvec4 kc[]; };
layout(set = 0, binding = 2) readonly buffer VC { uvec4 vc[]; };
layout(set = 0, binding = 3) readonly buffer Seqs { int cu_seqlens[]; };   // [B + 1]
layout(set = 0, binding = 4) writeonly buffer Out { float o[]; };

layout(push_constant) uniform Push {
    uint num_kv_heads;
    float scale;
    uint window;   // 0: no sliding window
    float softcap; // > 0: scores become softcap * tanh(score / softcap)
} pc;

#include "attention_common.glsl"

uint seq_start() { return uint(cu_seqlens[gl_WorkGroupID.z]); }
uint seq_len() { return uint(cu_seqlens[gl_WorkGroupID.z + 1]) - seq_start(); }
uint q0() { return gl_WorkGroupID.x * QT; }

uint kv_word(uint pos) {
    return ((seq_start() + pos) * pc.num_kv_heads + gl_WorkGroupID.y) * WORDS_PER_TOKEN;
}

bool visible(uint row, uint pos) {
    const uint qpos = q0() + row / GROUP;
    return pos <= qpos && (pc.window == 0 || pos + pc.window > qpos);
}

vec4 q_at(uint row, uint e) {
    const uint qpos = q0() + row / GROUP;
    if (qpos >= seq_len()) return vec4(0.0);
    const uint hq = gl_WorkGroupID.y * GROUP + row % GROUP;
    const uint base = ((seq_start() + qpos) * pc.num_kv_heads * GROUP + hq) * HEAD_SIZE + e;
    return pc.scale * vec4(q[base], q[base + 1], q[base + 2], q[base + 3]);
}

void main() {
    const uint n = seq_len();
    if (q0() >= n) return;   // uniform across the workgroup: sequences shorter than the longest
    const uint last = min(q0() + QT, n);
    const uint begin = (pc.window > 0 && q0() + 1 > pc.window) ? q0() + 1 - pc.window : 0;
    attend(begin, last);

    const uint tid = gl_LocalInvocationID.x;
    [[unroll]] for (uint j = 0; j < ACC_N; j++) {
        const uint i = tid + j * WG;
        if (i < PAIRS) {
            const uint r = i / (HEAD_SIZE / 4), e = 4 * (i % (HEAD_SIZE / 4));
            const uint qpos = q0() + r / GROUP;
            if (qpos < n) {
                const vec4 v = acc[j] / sL[r];
                const uint hq = gl_WorkGroupID.y * GROUP + r % GROUP;
                const uint base = ((seq_start() + qpos) * pc.num_kv_heads * GROUP + hq) * HEAD_SIZE + e;
                o[base] = v.x;
                o[base + 1] = v.y;
                o[base + 2] = v.z;
                o[base + 3] = v.w;
            }
        }
    }
}

#version 450
// Scatters new keys and values ([T, num_kv_heads, HEAD] float32) into the paged caches by slot mapping:
// token t goes to block slot[t] / block_size, offset slot[t] % block_size; a negative slot skips the token
// (padding). Cache layout [num_blocks, num_kv_heads, block_size, head_size], float16 with -DKV_F16 (two
// values per uint, rounded to nearest even) or float32. One invocation per cache word.
// Token t's keys start at key[t * src_stride + k_off], its values at value[t * src_stride + v_off]: both may be
// column ranges of one fused q/k/v product's rows. -DROPE rotates the keys on the way in (Hugging Face's
// rotate-half RoPE): element j < head/2 of a head becomes x[j] cos[t, j] - x[j + head/2] sin[t, j], element
// j + head/2 becomes x[j + head/2] cos[t, j] + x[j] sin[t, j], with cos/sin [T, head/2] per token. With
// q_heads > 0 (ROPE only) the same dispatch also rotates token t's q_heads query heads, read from
// key[t * src_stride + q_off ...], into q_out [T, q_heads, head]: one more invocation per query element.
#include "common.glsl"
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;

#ifdef KV_F16
#define PER_WORD 2
#else
#define PER_WORD 1
#endif

layout(set = 0, binding = 0) readonly buffer Key { float key[]; };
layout(set = 0, binding = 1) readonly buffer Value { float value[]; };
layout(set = 0, binding = 2) readonly buffer Slots { int slot_mapping[]; };
layout(set = 0, binding = 3) buffer KC { uint kc[]; };
layout(set = 0, binding = 4) buffer VC { uint vc[]; };
layout(set = 0, binding = 5) readonly buffer Cos { float rope_cos[]; };  // ROPE only (else any buffer)
layout(set = 0, binding = 6) readonly buffer Sin { float rope_sin[]; };
layout(set = 0, binding = 7) buffer QOut { float q_out[]; };  // q_heads > 0 only (else any buffer, not written)

layout(push_constant) uniform Push {
    uint num_tokens;
    uint num_kv_heads;
    uint head_size;
    uint block_size;
    uint groups_x;
    uint src_stride;  // floats per token in key/value
    uint k_off;       // where a token's keys start in its row of `key`
    uint v_off;       // where its values start in its row of `value`
    uint q_heads;     // query heads to rotate into q_out (0: none)
    uint q_off;       // where a token's queries start in its row of `key`
} pc;

// element e of the head that starts at key[base] for token t, rotated with -DROPE
float rotated(uint t, uint base, uint e) {
#ifdef ROPE
    const uint half_size = pc.head_size / 2;
    const uint j = e % half_size;
    const float c = rope_cos[t * half_size + j], s = rope_sin[t * half_size + j];
    return e < half_size ? key[base + e] * c - key[base + e + half_size] * s
                         : key[base + e] * c + key[base + j] * s;
#else
    return key[base + e];
#endif
}

float key_at(uint t, uint h, uint e) {  // element e of head h of token t's key
    return rotated(t, t * pc.src_stride + pc.k_off + h * pc.head_size, e);
}

void main() {
    const uint words = pc.head_size / PER_WORD;
    const uint i = (gl_WorkGroupID.y * pc.groups_x + gl_WorkGroupID.x) * WG + gl_LocalInvocationID.x;
    const uint kv_items = pc.num_tokens * pc.num_kv_heads * words;
    if (i >= kv_items) {  // the queries' invocations
        const uint iq = i - kv_items;
        if (iq >= pc.num_tokens * pc.q_heads * pc.head_size) return;
        const uint tq = iq / (pc.q_heads * pc.head_size);
        const uint hq = (iq / pc.head_size) % pc.q_heads;
        q_out[iq] = rotated(tq, tq * pc.src_stride + pc.q_off + hq * pc.head_size, iq % pc.head_size);
        return;
    }
    const uint t = i / (pc.num_kv_heads * words);
    const uint h = (i / words) % pc.num_kv_heads, c = i % words;
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const uint block = uint(slot) / pc.block_size, off = uint(slot) % pc.block_size;
    const uint dst = ((block * pc.num_kv_heads + h) * pc.block_size + off) * words + c;
    const uint e = c * PER_WORD;
    const uint src = t * pc.src_stride + pc.v_off + h * pc.head_size + e;
#ifdef KV_F16
    kc[dst] = packHalf2x16(vec2(key_at(t, h, e), key_at(t, h, e + 1)));
    vc[dst] = packHalf2x16(vec2(value[src], value[src + 1]));
#else
    kc[dst] = floatBitsToUint(key_at(t, h, e));
    vc[dst] = floatBitsToUint(value[src]);
#endif
}

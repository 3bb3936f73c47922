#version 450
// Scatters new keys and values ([T, num_kv_heads, HEAD] float32) into the paged caches by slot mapping:
// token t goes to block slot[t] / block_size, offset slot[t] % block_size; a negative slot skips the token
// (padding). Cache layout [num_blocks, num_kv_heads, block_size, head_size], float16 with -DKV_F16 (two
// values per uint, rounded to nearest even) or float32. One invocation per cache word.
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

layout(push_constant) uniform Push {
    uint num_tokens;
    uint num_kv_heads;
    uint head_size;
    uint block_size;
    uint groups_x;
} pc;

void main() {
    const uint words = pc.head_size / PER_WORD;
    const uint i = (gl_WorkGroupID.y * pc.groups_x + gl_WorkGroupID.x) * WG + gl_LocalInvocationID.x;
    if (i >= pc.num_tokens * pc.num_kv_heads * words) return;
    const uint t = i / (pc.num_kv_heads * words);
    const uint h = (i / words) % pc.num_kv_heads, c = i % words;
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const uint block = uint(slot) / pc.block_size, off = uint(slot) % pc.block_size;
    const uint dst = ((block * pc.num_kv_heads + h) * pc.block_size + off) * words + c;
    const uint src = (t * pc.num_kv_heads + h) * pc.head_size + c * PER_WORD;
#ifdef KV_F16
    kc[dst] = packHalf2x16(vec2(key[src], key[src + 1]));
    vc[dst] = packHalf2x16(vec2(value[src], value[src + 1]));
#else
    kc[dst] = floatBitsToUint(key[src]);
    vc[dst] = floatBitsToUint(value[src]);
#endif
}

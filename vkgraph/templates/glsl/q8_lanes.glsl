// Writing activations as q8_store.glsl does (the same values by the same arithmetic) from a block of 32 spread
// over 8 invocations, one vec4 each, so that no invocation walks a block alone: the block's largest |v| and its
// halves' int8 sums are met across the 8. Element e of a row's vec4s belongs to invocation slot e % WG
// (lane_slot()): block e / 8, part e % 8. With -DSUBGROUP_SHUFFLE (the launcher's promise: WG is a whole number of
// full subgroups of at least 8 lanes) a slot is a subgroup lane, so the 8 of a block are 8 lanes of one subgroup
// whatever order the device gives its subgroups, and they meet through subgroupShuffleXor. Without it a slot is
// the local invocation and they meet through shared memory behind barriers: every invocation must then make
// every call. The including file declares WG and, for store_q8_part, the buffers `uint xq[]`, `float xd[]` and
// `int xs[]` (with -DQ8_PART_ONLY it writes q8_part's results itself).
#ifdef SUBGROUP_SHUFFLE
#extension GL_KHR_shader_subgroup_shuffle : enable

uint lane_slot() {
    return gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
}

float max_of_8(float v) {
    [[unroll]] for (uint m = 1; m < 8; m <<= 1) v = max(v, subgroupShuffleXor(v, m));
    return v;
}

int sum_of_4(int v) {
    [[unroll]] for (uint m = 1; m < 4; m <<= 1) v += subgroupShuffleXor(v, m);
    return v;
}
#else
shared float lanes_f[WG];
shared int lanes_i[WG];

uint lane_slot() {
    return gl_LocalInvocationID.x;
}

float max_of_8(float v) {
    const uint s = gl_LocalInvocationID.x;
    barrier();
    lanes_f[s] = v;
    barrier();
    const uint b = s & ~7u;
    float m = lanes_f[b];
    [[unroll]] for (uint i = 1; i < 8; i++) m = max(m, lanes_f[b + i]);
    return m;
}

int sum_of_4(int v) {
    const uint s = gl_LocalInvocationID.x;
    barrier();
    lanes_i[s] = v;
    barrier();
    const uint b = s & ~3u;
    return (lanes_i[b] + lanes_i[b + 1]) + (lanes_i[b + 2] + lanes_i[b + 3]);
}
#endif

// The int8 form of one part of a block: its four values as one word, the block's scale and its half's int8 sum.
struct Q8Part { uint word; float d; int half_sum; };

// v: this invocation's part of its block (slot e holds part e % 8 of block e / 8); every slot of the launch calls
// it, those past the data with zeros (whole blocks are either valid or not).
Q8Part q8_part(vec4 v) {
    const vec4 a = abs(v);
    const float d = max_of_8(max(max(a.x, a.y), max(a.z, a.w))) / 127.0;
    const float id = d > 0.0 ? 1.0 / d : 0.0;
    const ivec4 q = clamp(ivec4(roundEven(v * id)), -127, 127);
    const int half_sum = sum_of_4((q.x + q.y) + (q.z + q.w));
    const uvec4 c = uvec4(q) & 0xFFu;
    return Q8Part(c.x | (c.y << 8) | (c.z << 16) | (c.w << 24), d, half_sum);
}

#ifndef Q8_PART_ONLY
// v: part `part` (0..7) of block `blk`; `valid` false for a slot past the data (it still takes part in the
// exchange).
void store_q8_part(uint blk, uint part, vec4 v, bool valid) {
    const Q8Part p = q8_part(v);
    if (valid) {
        xq[blk * 8 + part] = p.word;
        if (part == 0) xd[blk] = p.d;
        if (part % 4 == 0) xs[2 * blk + part / 4] = p.half_sum;
    }
}
#endif

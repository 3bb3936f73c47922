// Workgroup-wide reductions for templates that give one workgroup a row. Without -DSUBGROUP_SHUFFLE, a
// shared-memory tree (WG a power of two), correct on any device. With it (the launcher's promise: WG is a whole
// number of full subgroups of at least 8 lanes, see norms._shuffles), each subgroup reduces its lanes with
// subgroupShuffleXor and one shared-memory step crosses the subgroups: two barriers instead of log2(WG) + 2.
#ifdef SUBGROUP_SHUFFLE
#extension GL_KHR_shader_subgroup_shuffle : enable
#endif
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128;
shared float red_v[WG];

#ifdef SUBGROUP_SHUFFLE
// A butterfly: every lane ends with the same value (each step adds the same two operands on both sides).
float sg_sum(float v) {
    for (uint m = gl_SubgroupSize / 2; m > 0; m >>= 1) v += subgroupShuffleXor(v, m);
    return v;
}

float sg_max(float v) {
    for (uint m = gl_SubgroupSize / 2; m > 0; m >>= 1) v = max(v, subgroupShuffleXor(v, m));
    return v;
}

float wg_sum(float v) {
    v = sg_sum(v);
    barrier();
    if (gl_SubgroupInvocationID == 0) red_v[gl_SubgroupID] = v;
    barrier();
    float t = 0.0;
    for (uint g = gl_SubgroupInvocationID; g < gl_NumSubgroups; g += gl_SubgroupSize) t += red_v[g];
    return sg_sum(t);
}

float wg_max(float v) {
    v = sg_max(v);
    barrier();
    if (gl_SubgroupInvocationID == 0) red_v[gl_SubgroupID] = v;
    barrier();
    float t = -1.0 / 0.0;
    for (uint g = gl_SubgroupInvocationID; g < gl_NumSubgroups; g += gl_SubgroupSize) t = max(t, red_v[g]);
    return sg_max(t);
}
#else
float wg_sum(float v) {
    const uint tid = gl_LocalInvocationID.x;
    barrier();
    red_v[tid] = v;
    barrier();
    for (uint s = WG / 2; s > 0; s >>= 1) {
        if (tid < s) red_v[tid] += red_v[tid + s];
        barrier();
    }
    return red_v[0];
}

float wg_max(float v) {
    const uint tid = gl_LocalInvocationID.x;
    barrier();
    red_v[tid] = v;
    barrier();
    for (uint s = WG / 2; s > 0; s >>= 1) {
        if (tid < s) red_v[tid] = max(red_v[tid], red_v[tid + s]);
        barrier();
    }
    return red_v[0];
}
#endif

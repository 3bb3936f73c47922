// Workgroup-wide reductions for templates that give one workgroup a row: a shared-memory tree (WG must be a
// power of two), correct on any subgroup size.
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128;
shared float red_v[WG];

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

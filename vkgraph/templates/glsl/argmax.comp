#version 450
// idx[r] = argmax_i x[r, i] (the first index on ties, as numpy), one workgroup per row. NaN is never chosen.
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128;
layout(set = 0, binding = 0) readonly buffer X { float x[]; };
layout(set = 0, binding = 1) writeonly buffer Idx { int idx[]; };

layout(push_constant) uniform Push {
    uint n;
} pc;

shared float sv[WG];
shared uint si[WG];

void main() {
    const uint tid = gl_LocalInvocationID.x, base = gl_WorkGroupID.x * pc.n;
    float best = -1.0 / 0.0;
    uint bi = 0xFFFFFFFFu;
    for (uint i = tid; i < pc.n; i += WG) {
        const float v = x[base + i];
        if (v > best || (bi == 0xFFFFFFFFu && v == best)) {   // strictly greater keeps the first index
            best = v;
            bi = i;
        }
    }
    sv[tid] = best;
    si[tid] = bi;
    barrier();
    for (uint s = WG / 2; s > 0; s >>= 1) {
        if (tid < s) {
            const float v = sv[tid + s];
            const uint j = si[tid + s];
            if (j != 0xFFFFFFFFu && (si[tid] == 0xFFFFFFFFu || v > sv[tid] || (v == sv[tid] && j < si[tid]))) {
                sv[tid] = v;
                si[tid] = j;
            }
        }
        barrier();
    }
    if (tid == 0) idx[gl_WorkGroupID.x] = si[0] == 0xFFFFFFFFu ? 0 : int(si[0]);
}

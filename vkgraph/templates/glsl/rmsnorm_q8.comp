#version 450
// RMSNorm straight into the integer dot-product matvec's input: y[r, i] = x[r, i] / sqrt(mean_i(x[r, i]^2) + eps)
// * w[i], written as quantize_q8.comp writes activations (per block of 32 of y: 32 int8 round(y / d) as four
// per uint in xq, the scale d = max |y| / 127 in xd, the int8 sums of its two halves in xs), so the float y
// never goes to memory and no quantization kernel runs between the norm and the product.
// One workgroup per row, built for latency at decode's few rows: each invocation loads its VPI vec4s of x and w
// once, up front, and keeps them in registers through the row's sum of squares (row_reduce.glsl) and the
// quantization, where the 8 invocations holding a block meet its largest |y| and half sums (q8_lanes.glsl).
// n % 32 == 0 and WG * VPI * 4 >= n.
#include "common.glsl"
#include "row_reduce.glsl"
layout(constant_id = 1) const uint VPI = 4;  // vec4s of the row per invocation
layout(set = 0, binding = 0) readonly buffer X { vec4 x[]; };
layout(set = 0, binding = 1) readonly buffer W { vec4 w[]; };
layout(set = 0, binding = 2) writeonly buffer XQ { uint xq[]; };
layout(set = 0, binding = 3) writeonly buffer XD { float xd[]; };
layout(set = 0, binding = 4) writeonly buffer XS { int xs[]; };

layout(push_constant) uniform Push {
    uint n;
    float eps;
} pc;

#include "q8_lanes.glsl"

// 2^-80: a row scaled by it (exactly) has a finite sum of squares for any finite x and n < 2^32
const float DOWN = 1.0 / 1208925819614629174706176.0;

void main() {
    const uint row = gl_WorkGroupID.x;
    const uint n4 = pc.n / 4;
    const uint slot = lane_slot();
    vec4 v[VPI];
    vec4 g[VPI];
    float ss = 0.0;
    [[unroll]] for (uint j = 0; j < VPI; j++) {
        const uint e = slot + j * WG;
        v[j] = vec4(0.0);
        g[j] = vec4(0.0);
        if (e < n4) {
            v[j] = x[row * n4 + e];
            g[j] = w[e];
        }
        ss += dot(v[j], v[j]);
    }
    const float total = wg_sum(ss);  // the same in every invocation, so the branch below is uniform
    float inv;
    if (isinf(total)) {
        // the squares overflowed float32 where numpy's float64 does not: again on the row scaled down, whose
        // mean square is so far above eps * 2^-160 (below float32's range) that eps drops out. `precise`: a
        // compiler may not fold the scale out of the squares (DOWN^2 is 0 in float32)
        precise float s = 0.0;
        [[unroll]] for (uint j = 0; j < VPI; j++) {
            precise const vec4 t = v[j] * DOWN;
            s += dot(t, t);
        }
        inv = inversesqrt(wg_sum(s) / float(pc.n)) * DOWN;
    } else {
        inv = inversesqrt(total / float(pc.n) + pc.eps);
    }
    [[unroll]] for (uint j = 0; j < VPI; j++) {
        const uint e = slot + j * WG;
        store_q8_part(row * (pc.n / 32) + e / 8, e % 8, v[j] * inv * g[j], e < n4);
    }
}

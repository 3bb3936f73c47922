// Writing activations in the integer dot-product matvec's input form (matvec.Q8Acts), shared by every kernel
// that produces them (q8_lanes.glsl does the same over 8 invocations): per block of 32 values, xq holds
// round(v / d) as four int8 per uint (ties to even, clamped to +-127), xd the scale d = max |v| / 127 (0 for an
// all-zero block, whose values are then 0) and xs the int8 sums of its two halves (a matvec run is 16
// activations). The including file declares the buffers `uint xq[]`, `float xd[]` and `int xs[]`.
void store_q8_block(uint blk, vec4 v[8]) {
    float amax = 0.0;
    [[unroll]] for (uint i = 0; i < 8; i++) {
        const vec4 a = abs(v[i]);
        amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
    }
    const float d = amax / 127.0;
    const float id = d > 0.0 ? 1.0 / d : 0.0;
    int sum[2] = int[2](0, 0);
    [[unroll]] for (uint i = 0; i < 8; i++) {
        const ivec4 q = clamp(ivec4(roundEven(v[i] * id)), -127, 127);
        sum[i / 4] += (q.x + q.y) + (q.z + q.w);
        const uvec4 c = uvec4(q) & 0xFFu;
        xq[blk * 8 + i] = c.x | (c.y << 8) | (c.z << 16) | (c.w << 24);
    }
    xd[blk] = d;
    xs[2 * blk] = sum[0];
    xs[2 * blk + 1] = sum[1];
}

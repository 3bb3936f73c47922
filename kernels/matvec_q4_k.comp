#version 450
// y = W x for Q4_K weights as GGUF stores them: per row K/256 super-blocks of 144 bytes = 9 uvec4: a header
// (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32) and 8 words of nibbles.
// A unit is one nibble word k of a super-block: its low nibbles are elements 64*(k/2) + 16*(k%2) + 0..15
// (sub-block 2*(k/2)), its high nibbles the same plus 32 (sub-block 2*(k/2) + 1).
#define RUN 16
#define RUNS 2
#define UNIT_ELEMS 32
#define HAS_OFFSET true
#include "matvec_common.glsl"

uint byte_of(uvec4 h, uint i) {   // byte i of the header (bytes 4..15 are the packed scales)
    return (h[i >> 2] >> (8u * (i & 3u))) & 0xFFu;
}

void decode_unit(uint row, uint u, out vec4 q[RUNS * RUN / 4], out float a[RUNS], out float b[RUNS],
                 out uint xoff[RUNS]) {
    const uint sb = u >> 3, k = u & 7u, j = k >> 1;
    const uint base = row * pc.w_stride + sb * 9;
    const uvec4 h = w[base];
    const uvec4 v = w[base + 1 + k];
    [[unroll]] for (uint i = 0; i < 4; i++) {
        q[i] = bytes_bits(v[i], 0u, 0xFu);
        q[4 + i] = bytes_bits(v[i], 4u, 0xFu);
    }
    const vec2 dm = unpackHalf2x16(h.x);
    [[unroll]] for (uint t = 0; t < 2; t++) {
        const uint sub = 2 * j + t;   // get_scale_min_k4(sub)
        uint sc, mn;
        if (sub < 4) {
            sc = byte_of(h, 4 + sub) & 63u;
            mn = byte_of(h, 8 + sub) & 63u;
        } else {
            sc = (byte_of(h, 8 + sub) & 0xFu) | ((byte_of(h, sub) >> 6) << 4);
            mn = (byte_of(h, 8 + sub) >> 4) | ((byte_of(h, 4 + sub) >> 6) << 4);
        }
        a[t] = dm.x * float(sc);
        b[t] = -dm.y * float(mn);
        xoff[t] = sb * 256 + 64 * j + 16 * (k & 1u) + 32 * t;
    }
}

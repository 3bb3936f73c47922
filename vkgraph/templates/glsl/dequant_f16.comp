#version 450
// W as float16 [N, K] row-major, from the matvec templates' layout (vkgraph.templates.matvec.upload_weights), for the
// generated matmul to read when a batch has too many rows for the matvec. One define picks the format:
// W_Q8_0, W_Q4_0, W_Q4_1, W_Q5_0, W_Q5_1, W_Q2_K, W_Q3_K, W_Q4_K, W_Q5_K, W_Q6_K, W_IQ4_NL, W_IQ4_XS (16-byte words in
// `w`, and for the formats vkgraph.quant.SPLIT names the bytes moved out of each block in `s`), W_F16, W_BF16.
// An invocation decodes one unit (UNIT_ELEMS elements, the matvec's unit) and writes its 16-byte output words.
// Values are formed in float32 in the order vkgraph.quant.dequantize forms them (every product but Q6_K's last
// is exact), then rounded to float16 in integer arithmetic (ties to even): packHalf2x16's rounding mode is the
// implementation's, so the result is bit-exact to numpy's dequantize(...).astype(float16) on any device.
// The output is written as uvec4 words, so no 16-bit storage feature is needed; K % 8 == 0 in every format.
#if defined(W_IQ4_NL) || defined(W_IQ4_XS)
#define IQ4_TABLE
#endif
#include "common.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;

layout(set = 0, binding = 0) readonly buffer Weights { uvec4 w[]; };
layout(set = 0, binding = 1) readonly buffer Scales { uint s[]; };
layout(set = 0, binding = 2) writeonly buffer Out { uvec4 o[]; };

layout(push_constant) uniform Push {
    uint n_rows;      // N
    uint k;           // K (elements per row)
    uint w_stride;    // uvec4 words per row in `w`
    uint s_stride;    // scale entries (float16) per row in `s`
    uint groups_x;    // workgroups along x (units are spread over x and y: x is capped at 65535)
} pc;

#if defined(W_F16) || defined(W_BF16)
#define UNIT_ELEMS 8
#elif defined(W_Q8_0)
#define UNIT_ELEMS 16
#elif defined(W_Q4_0) || defined(W_Q4_1) || defined(W_Q5_0) || defined(W_Q5_1) || defined(W_Q4_K) \
    || defined(W_Q5_K) || defined(W_IQ4_NL) || defined(W_IQ4_XS)
#define UNIT_ELEMS 32
#elif defined(W_Q6_K) || defined(W_Q2_K) || defined(W_Q3_K)
#define UNIT_ELEMS 64
#else
#error "define one format (W_Q8_0, W_Q4_0, ..., W_F16, W_BF16)"
#endif

// float16 bits of x, rounded to nearest even; overflow gives infinity, NaN a quiet NaN of x's sign.
uint f16_bits(float x) {
    const uint u = floatBitsToUint(x);
    const uint sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00u;
    if (a >= 0x477FF000u) return sign | 0x7C00u;   // >= 65520 rounds to infinity
    if (a >= 0x38800000u) return sign | ((a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u)) >> 13);  // normal: rebias
    return sign | uint(roundEven(uintBitsToFloat(a) * 16777216.0));  // subnormal or zero: a multiple of 2^-24
}

uvec2 pack_f16x4(vec4 v) {
    return uvec2(f16_bits(v.x) | (f16_bits(v.y) << 16), f16_bits(v.z) | (f16_bits(v.w) << 16));
}

// 16 consecutive outputs of `row` from element e (e % 16 == 0): two output words
void store16(uint row, uint e, vec4 a, vec4 b, vec4 c, vec4 d) {
    const uint i = row * (pc.k >> 3) + (e >> 3);
    o[i] = uvec4(pack_f16x4(a), pack_f16x4(b));
    o[i + 1] = uvec4(pack_f16x4(c), pack_f16x4(d));
}

float scale_at(uint row, uint i) {  // float16 scale i of `row` in the scales array
    const uint idx = row * pc.s_stride + i;
    return half_at_u32(s[idx >> 1], idx);
}

uvec4 bytes_of(uint x) { return uvec4(x, x >> 8, x >> 16, x >> 24) & 0xFFu; }

uint half_bits(uint row, uint i) {  // the raw 16 bits of entry i of `row` in the scales array
    const uint idx = row * pc.s_stride + i;
    return (s[idx >> 1] >> (16u * (idx & 1u))) & 0xFFFFu;
}

// 32 values of a block of 16 nibble bytes `v` with fifth bits `qh` (or none): element i in the low nibble of
// byte i, element i + 16 in its high nibble; value = (level + off) * d + m (d * (level + off) exact, one rounding)
void store_block32(uint row, uint e, uvec4 v, uint qh, float d, float m, float off) {
    vec4 lo[4], hi[4];
    [[unroll]] for (uint i = 0; i < 4; i++) {
        lo[i] = (vec4(bytes_of((v[i] & 0x0F0F0F0Fu) | (spread4((qh >> (4 * i)) & 0xFu) << 4))) + off) * d + m;
        hi[i] = (vec4(bytes_of(((v[i] >> 4) & 0x0F0F0F0Fu) | (spread4((qh >> (16 + 4 * i)) & 0xFu) << 4))) + off) * d
              + m;
    }
    store16(row, e, lo[0], lo[1], lo[2], lo[3]);
    store16(row, e + 16, hi[0], hi[1], hi[2], hi[3]);
}

#ifdef IQ4_TABLE
// IQ4: 32 values d * IQ4_VALUES[nibble], laid out as store_block32's
void store_iq4(uint row, uint e, uvec4 v, float d) {
    vec4 lo[4], hi[4];
    [[unroll]] for (uint i = 0; i < 4; i++) {
        lo[i] = iq4_levels(v[i] & 0x0F0F0F0Fu) * d;
        hi[i] = iq4_levels((v[i] >> 4) & 0x0F0F0F0Fu) * d;
    }
    store16(row, e, lo[0], lo[1], lo[2], lo[3]);
    store16(row, e + 16, hi[0], hi[1], hi[2], hi[3]);
}
#endif

void main() {
#ifdef IQ4_TABLE
    iq4_init_tables();  // a barrier: before the return past the last row
#endif
    const uint g = (gl_WorkGroupID.y * pc.groups_x + gl_WorkGroupID.x) * WG + gl_LocalInvocationID.x;
    const uint units = pc.k / UNIT_ELEMS;
    const uint row = g / units, u = g % units;
    if (row >= pc.n_rows) return;
    const uint base = row * pc.w_stride;
#if defined(W_F16)
    o[row * (pc.k >> 3) + u] = w[base + u];
#elif defined(W_BF16)
    const uvec4 v = w[base + u];
    o[row * (pc.k >> 3) + u] = uvec4(pack_f16x4(unpack_bf16x4(v.xy)), pack_f16x4(unpack_bf16x4(v.zw)));
#elif defined(W_Q8_0)
    // int8 * d (exact in float32)
    const uvec4 v = w[base + u];
    const float d = scale_at(row, u >> 1);
    vec4 q[4];
    [[unroll]] for (uint i = 0; i < 4; i++) q[i] = vec4((ivec4(bytes_of(v[i])) << 24) >> 24) * d;
    store16(row, u * 16, q[0], q[1], q[2], q[3]);
#elif defined(W_Q4_0)
    // (q - 8) * d: element i in the low nibble of byte i, element i + 16 in its high nibble
    const uvec4 v = w[base + u];
    const float d = scale_at(row, u);
    vec4 lo[4], hi[4];
    [[unroll]] for (uint i = 0; i < 4; i++) {
        lo[i] = (vec4(bytes_of(v[i] & 0x0F0F0F0Fu)) - 8.0) * d;
        hi[i] = (vec4(bytes_of((v[i] >> 4) & 0x0F0F0F0Fu)) - 8.0) * d;
    }
    store16(row, u * 32, lo[0], lo[1], lo[2], lo[3]);
    store16(row, u * 32 + 16, hi[0], hi[1], hi[2], hi[3]);
#elif defined(W_Q4_1)
    // d q + m, (d, m) one uint per block (s_stride even)
    const vec2 dm = unpackHalf2x16(s[((row * pc.s_stride) >> 1) + u]);
    store_block32(row, u * 32, w[base + u], 0u, dm.x, dm.y, 0.0);
#elif defined(W_Q5_0)
    // d (q - 16); entries d, fifth bits low half, high half
    store_block32(row, u * 32, w[base + u], half_bits(row, 3 * u + 1) | (half_bits(row, 3 * u + 2) << 16),
                  scale_at(row, 3 * u), 0.0, -16.0);
#elif defined(W_Q5_1)
    // d q + m; entries d, m, fifth bits (two uints per block, s_stride even)
    const uint sb = ((row * pc.s_stride) >> 1) + 2 * u;
    const vec2 dm = unpackHalf2x16(s[sb]);
    store_block32(row, u * 32, w[base + u], s[sb + 1], dm.x, dm.y, 0.0);
#elif defined(W_IQ4_NL)
    store_iq4(row, u * 32, w[base + u], scale_at(row, u));
#elif defined(W_IQ4_XS)
    // sub-block b of a super-block: d (ls - 32), as in matvec_iq4_xs (d * (ls - 32) exact, times the level rounded)
    const uint sb = ((row * pc.s_stride) >> 1) + 2 * (u >> 3), b = u & 7u;
    const uint dh = s[sb], sl = s[sb + 1];
    const uint ls = ((sl >> (4 * b)) & 0xFu) | (((dh >> (16 + 2 * b)) & 3u) << 4);
    store_iq4(row, u * 32, w[base + u], unpackHalf2x16(dh).x * float(int(ls) - 32));
#elif defined(W_Q2_K)
    // (d * (sc & 15)) * q - dmin * (sc >> 4) (every product exact); unit = level word k, as in matvec_q2_k
    const uint k = u & 3u, sbw = base + (u >> 2) * 5;
    const uvec4 v = w[sbw + 1 + k], scw = w[sbw];
    const vec2 dm = unpackHalf2x16(s[((row * pc.s_stride) >> 1) + (u >> 2)]);
    const uint e = (u >> 2) * 256 + 128 * (k >> 1) + 16 * (k & 1u);
    [[unroll]] for (uint r = 0; r < 4; r++) {
        const uint bi = 8 * (k >> 1) + 2 * r + (k & 1u);
        const uint sc = (scw[bi >> 2] >> (8 * (bi & 3u))) & 0xFFu;
        const float dl = dm.x * float(sc & 15u), ml = dm.y * float(sc >> 4);
        vec4 q[4];
        [[unroll]] for (uint i = 0; i < 4; i++) q[i] = dl * vec4(bytes_of((v[i] >> (2 * r)) & 0x03030303u)) - ml;
        store16(row, e + 32 * r, q[0], q[1], q[2], q[3]);
    }
#elif defined(W_Q3_K)
    // (d * (scale - 32)) * (q - 4) (exact); unit = low-level word k, as in matvec_q3_k
    const uint k = u & 3u, sbw = base + (u >> 2) * 7;
    const uvec4 v = w[sbw + 2 + k], hm = w[sbw + (k & 1u)], scw = w[sbw + 6];
    const float d = unpackHalf2x16(scw.w).x;
    const uint e = (u >> 2) * 256 + 128 * (k >> 1) + 16 * (k & 1u);
    [[unroll]] for (uint r = 0; r < 4; r++) {
        const uint i8 = 8 * (k >> 1) + 2 * r + (k & 1u);
        const uint lo = (scw[(i8 & 7u) >> 2] >> (8 * (i8 & 3u) + 4 * (i8 >> 3))) & 0xFu;
        const uint hi = (scw[2] >> (8 * (i8 & 3u) + 2 * (i8 >> 2))) & 3u;
        const float dl = d * float(int(lo | (hi << 4)) - 32);
        vec4 q[4];
        [[unroll]] for (uint i = 0; i < 4; i++) {
            const uint hb = (hm[i] >> (4 * (k >> 1) + r)) & 0x01010101u;
            q[i] = dl * (vec4(bytes_of(((v[i] >> (2 * r)) & 0x03030303u) | (hb << 2))) - 4.0);
        }
        store16(row, e + 32 * r, q[0], q[1], q[2], q[3]);
    }
#elif defined(W_Q5_K)
    // (d * sc) * q - dmin * m (exact products); unit = nibble word k, as in matvec_q5_k
    const uint sbw = base + (u >> 3) * 11, k = u & 7u;
    const uvec4 h = w[sbw], v = w[sbw + 3 + k], qh = w[sbw + 1 + (k & 1u)];
    const uint j = k >> 1, sh = 16u * (j & 1u);
    const uint y = h.y >> sh, z = h.z >> sh, x4 = h.w >> sh;
    uvec2 sc, mn;
    if (j < 2) {
        sc = uvec2(y, y >> 8) & 63u;
        mn = uvec2(z, z >> 8) & 63u;
    } else {
        sc = (uvec2(x4, x4 >> 8) & 0xFu) | ((uvec2(y, y >> 8) >> 2) & 0x30u);
        mn = ((uvec2(x4, x4 >> 8) >> 4) & 0xFu) | ((uvec2(z, z >> 8) >> 2) & 0x30u);
    }
    const vec2 dm = unpackHalf2x16(h.x);
    const vec2 a = dm.x * vec2(sc), b = dm.y * vec2(mn);
    vec4 lo[4], hi[4];
    [[unroll]] for (uint i = 0; i < 4; i++) {
        lo[i] = a.x * vec4(bytes_of((v[i] & 0x0F0F0F0Fu) | (((qh[i] >> (2 * j)) & 0x01010101u) << 4))) - b.x;
        hi[i] = a.y * vec4(bytes_of(((v[i] >> 4) & 0x0F0F0F0Fu) | (((qh[i] >> (2 * j + 1)) & 0x01010101u) << 4)))
              - b.y;
    }
    const uint e = (u >> 3) * 256 + 64 * j + 16 * (k & 1u);
    store16(row, e, lo[0], lo[1], lo[2], lo[3]);
    store16(row, e + 32, hi[0], hi[1], hi[2], hi[3]);
#elif defined(W_Q4_K)
    // (d * sc) * q - dmin * m (both products exact); unit = nibble word k of a super-block, as in matvec_q4_k
    const uint sb = base + (u >> 3) * 9;
    const uvec4 h = w[sb], v = w[sb + 1 + (u & 7u)];
    const uint j = (u & 7u) >> 1, sh = 16u * (j & 1u);
    const uint y = h.y >> sh, z = h.z >> sh, x4 = h.w >> sh;
    uvec2 sc, mn;
    if (j < 2) {
        sc = uvec2(y, y >> 8) & 63u;
        mn = uvec2(z, z >> 8) & 63u;
    } else {
        sc = (uvec2(x4, x4 >> 8) & 0xFu) | ((uvec2(y, y >> 8) >> 2) & 0x30u);
        mn = ((uvec2(x4, x4 >> 8) >> 4) & 0xFu) | ((uvec2(z, z >> 8) >> 2) & 0x30u);
    }
    const vec2 dm = unpackHalf2x16(h.x);
    const vec2 a = dm.x * vec2(sc), b = dm.y * vec2(mn);
    vec4 lo[4], hi[4];
    [[unroll]] for (uint i = 0; i < 4; i++) {
        lo[i] = a.x * vec4(bytes_of(v[i] & 0x0F0F0F0Fu)) - b.x;
        hi[i] = a.y * vec4(bytes_of((v[i] >> 4) & 0x0F0F0F0Fu)) - b.y;
    }
    const uint e = (u >> 3) * 256 + 64 * j + 16 * (u & 1u);
    store16(row, e, lo[0], lo[1], lo[2], lo[3]);
    store16(row, e + 32, hi[0], hi[1], hi[2], hi[3]);
#elif defined(W_Q6_K)
    // (d * sc) * (q - 32), d * sc exact; unit = a quarter super-block (four runs of 16), as in matvec_q6_k
    const uint hh = (u & 3u) >> 1, t = u & 1u;
    const uint sb = base + (u >> 2) * 13;
    const uvec4 lo = w[sb + 4 * hh + t], hi = w[sb + 4 * hh + 2 + t], qh = w[sb + 8 + 2 * hh + t];
    const uvec4 scw = w[sb + 12];
    const uvec2 scs = hh == 0 ? scw.xy : scw.zw;   // the int8 scales of this half
    const float d = scale_at(row, u >> 2);
    const uint e = (u >> 2) * 256 + 128 * hh + 16 * t;
    [[unroll]] for (uint r = 0; r < 4; r++) {
        const uint bi = t + 2 * r;   // int8 scale of run r within this half's eight
        const float ds = d * float(bitfieldExtract(int(scs[bi >> 2]), int(8 * (bi & 3u)), 8));
        vec4 q[4];
        [[unroll]] for (uint i = 0; i < 4; i++) {
            const uint l = ((r & 1u) == 0 ? lo[i] : hi[i]) >> (4 * (r >> 1));
            q[i] = ds * (vec4(bytes_of((l & 0x0F0F0F0Fu) | (((qh[i] >> (2 * r)) & 0x03030303u) << 4))) - 32.0);
        }
        store16(row, e + 32 * r, q[0], q[1], q[2], q[3]);
    }
#endif
}

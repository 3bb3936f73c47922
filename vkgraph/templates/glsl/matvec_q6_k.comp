#version 450
// y = W x for Q6_K weights in the kernel layout: per row K/256 super-blocks of 208 bytes = 13 uvec4 (ql: 8,
// qh: 4, int8 scales: 1) in `w`, and one float16 d per super-block in `s`. A unit is a quarter super-block:
// half hh = k/2 (elements 128*hh..), positions l = 16*(k%2) + 0..15, and the four runs l, l+32, l+64, l+96.
#define RUN 16
#define RUNS 4
#define UNIT_ELEMS 64
#define HAS_OFFSET true
#define HAS_MIN false
struct Unit { uvec4 lo, hi, qh; uvec2 sc; float d; };
#include "matvec_common.glsl"

Unit load_unit(uint row, uint u) {
    const uint hh = (u & 3u) >> 1, t = u & 1u;
    const uint base = row * pc.w_stride + (u >> 2) * 13;
    const uvec4 scw = w[base + 12];
    return Unit(w[base + 4 * hh + t],        // ql[l]      : runs 0 (low nibble) and 2 (high)
                w[base + 4 * hh + 2 + t],    // ql[l + 32] : runs 1 and 3
                w[base + 8 + 2 * hh + t],    // 2 high bits for each of the four runs
                hh == 0 ? scw.xy : scw.zw,   // the int8 scales of this half
                scale_at(row, u >> 2));
}

uint x_run(uint u, uint j) { return (u >> 2) * 256 + 128 * ((u & 3u) >> 1) + 16 * (u & 1u) + 32 * j; }

// the 6-bit levels (stored as q + 32) of byte position i of run j, four to a uint
uint run_bytes(Unit q, uint j, uint i) {
    const uint h = q.qh[i];
    switch (j) {
        case 0: return (q.lo[i] & 0x0F0F0F0Fu) | ((h << 4) & 0x30303030u);
        case 1: return (q.hi[i] & 0x0F0F0F0Fu) | ((h << 2) & 0x30303030u);
        case 2: return ((q.lo[i] >> 4) & 0x0F0F0F0Fu) | (h & 0x30303030u);
        default: return ((q.hi[i] >> 4) & 0x0F0F0F0Fu) | ((h >> 2) & 0x30303030u);
    }
}

#ifdef INT_DOT
int run_idot(Unit q, uint j, uvec4 xq, int xs) {   // levels are stored as q + 32
    return dot16_s8u8(xq, uvec4(run_bytes(q, j, 0), run_bytes(q, j, 1), run_bytes(q, j, 2), run_bytes(q, j, 3)))
         - 32 * xs;
}
#else
// assembled in integer lanes before one conversion
vec4 run_levels(Unit q, uint j, uint i) { return bytes7(run_bytes(q, j, i)); }
#endif

vec4 x_factor(uint j) { return BYTES7; }

vec2 run_coeffs(Unit q, uint u, uint j) {
    const uint bi = (u & 1u) + 2 * j;   // int8 scale of run j within this half's eight
    const float c = q.d * float(bitfieldExtract(int(q.sc[bi >> 2]), int(8 * (bi & 3u)), 8));
    return vec2(c, -32.0 * c);   // levels are stored as q + 32
}

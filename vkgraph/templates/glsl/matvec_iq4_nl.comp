#version 450
// y = W x for IQ4_NL weights in the kernel layout: per row K/32 blocks of 16 bytes of nibbles in `w` (as Q4_0), each
// an index into ggml's fixed non-linear levels (IQ4_VALUES), and one float16 d per block in `s`.
#define RUN 16
#define RUNS 2
#define UNIT_ELEMS 32
#define HAS_OFFSET false
#define HAS_MIN false
#define UNIT_COEFFS
#define IQ4_TABLE
struct Unit { uvec4 v; float d; };
#include "matvec_common.glsl"

Unit load_unit(uint row, uint u) { return Unit(w[row * pc.w_stride + u], scale_at(row, u)); }

uint x_run(uint u, uint j) { return u * 32 + 16 * j; }

vec4 run_levels(Unit q, uint j, uint i) { return iq4_levels((q.v[i] >> (4 * j)) & 0x0F0F0F0Fu); }

vec4 x_factor(uint j) { return vec4(1.0); }

vec2 run_coeffs(Unit q, uint u, uint j) { return vec2(q.d, 0.0); }

#ifdef INT_DOT
int run_idot(Unit q, uint j, uvec4 xq, int xs) { return dot16_s8(xq, iq4_bytes(q.v >> (4 * j))); }
#endif

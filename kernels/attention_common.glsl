// The core shared by the attention templates: online-softmax attention of ROWS query rows against a stream
// of key/value tokens that all belong to one KV head, TILE tokens at a time.
//
// Per tile: (1) the workgroup loads the tile's keys and values into shared memory with 16-byte loads
// (a token's HEAD_SIZE values are contiguous in memory), (2) one invocation per (row, token) computes a
// score, (3) one invocation per row updates the running max m and sum l and turns scores into weights,
// (4) each invocation rescales and accumulates its (row, 4 dims) slices of the output.
//
// The including file defines HEAD_SIZE, ROWS, TILE, KV_F16 (or not), declares its bindings, and defines
//   uint kv_word(uint pos)              index of token pos's first uvec4 in the K/V buffers
//   bool visible(uint row, uint pos)    whether row may attend to key position pos
// then calls attend(begin, end) and reads acc[], row_m[], row_l[].
#include "common.glsl"

#ifdef KV_F16
#define KV_PER_WORD 8
#else
#define KV_PER_WORD 4
#endif
#define WORDS_PER_TOKEN (HEAD_SIZE / KV_PER_WORD)
#define PAIRS (ROWS * HEAD_SIZE / 4)

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128;
#define ACC_N ((PAIRS + WG - 1) / WG)

shared vec4 sQ[ROWS * HEAD_SIZE / 4];
shared uvec4 sK[TILE * WORDS_PER_TOKEN];
shared uvec4 sV[TILE * WORDS_PER_TOKEN];
shared float sP[ROWS * TILE];
shared float sM[ROWS], sL[ROWS], sAlpha[ROWS];

vec4 acc[ACC_N];

uint kv_word(uint pos);
bool visible(uint row, uint pos);

vec4 k4(uint t, uint e) {   // four key values of tile token t from dimension e
    const uvec4 wd = sK[t * WORDS_PER_TOKEN + e / KV_PER_WORD];
#ifdef KV_F16
    return unpack_half4(((e >> 2) & 1u) == 0u ? wd.xy : wd.zw);
#else
    return uintBitsToFloat(wd);
#endif
}

vec4 v4(uint t, uint e) {
    const uvec4 wd = sV[t * WORDS_PER_TOKEN + e / KV_PER_WORD];
#ifdef KV_F16
    return unpack_half4(((e >> 2) & 1u) == 0u ? wd.xy : wd.zw);
#else
    return uintBitsToFloat(wd);
#endif
}

// Loads the queries (already scaled) into sQ: q_at(row, e) gives four values of row from dimension e.
vec4 q_at(uint row, uint e);

void attend(uint begin, uint end) {
    const uint tid = gl_LocalInvocationID.x;
    for (uint i = tid; i < ROWS * HEAD_SIZE / 4; i += WG) sQ[i] = q_at(i / (HEAD_SIZE / 4), 4 * (i % (HEAD_SIZE / 4)));
    for (uint r = tid; r < ROWS; r += WG) {
        sM[r] = -1.0 / 0.0;
        sL[r] = 0.0;
    }
    [[unroll]] for (uint j = 0; j < ACC_N; j++) acc[j] = vec4(0.0);

    for (uint t0 = begin; t0 < end; t0 += TILE) {
        barrier();   // the previous tile is consumed; sQ/sM are written
        for (uint i = tid; i < TILE * WORDS_PER_TOKEN; i += WG) {
            const uint pos = t0 + i / WORDS_PER_TOKEN;
            uvec4 kw = uvec4(0), vw = uvec4(0);   // zeros past the end: a zero weight times garbage could be NaN
            if (pos < end) {
                const uint g = kv_word(pos) + i % WORDS_PER_TOKEN;
                kw = kc[g];
                vw = vc[g];
            }
            sK[i] = kw;
            sV[i] = vw;
        }
        barrier();
        for (uint i = tid; i < ROWS * TILE; i += WG) {
            const uint r = i / TILE, t = i % TILE, pos = t0 + t;
            float s = -1.0 / 0.0;
            if (pos < end && visible(r, pos)) {
                vec4 d4 = vec4(0.0);
                [[unroll]] for (uint e = 0; e < HEAD_SIZE; e += 4) d4 += sQ[(r * HEAD_SIZE + e) / 4] * k4(t, e);
                s = hsum(d4);
            }
            sP[i] = s;
        }
        barrier();
        for (uint r = tid; r < ROWS; r += WG) {
            const float m_old = sM[r];
            float m_new = m_old;
            for (uint t = 0; t < TILE; t++) m_new = max(m_new, sP[r * TILE + t]);
            float alpha = 1.0, sum = 0.0;
            if (m_new != -1.0 / 0.0) {   // all masked so far: keep alpha 1 and weights 0 (no inf - inf)
                alpha = exp(m_old - m_new);
                for (uint t = 0; t < TILE; t++) {
                    const float p = exp(sP[r * TILE + t] - m_new);
                    sP[r * TILE + t] = p;
                    sum += p;
                }
            } else {
                for (uint t = 0; t < TILE; t++) sP[r * TILE + t] = 0.0;
            }
            sM[r] = m_new;
            sL[r] = sL[r] * alpha + sum;
            sAlpha[r] = alpha;
        }
        barrier();
        [[unroll]] for (uint j = 0; j < ACC_N; j++) {
            const uint i = tid + j * WG;
            if (i < PAIRS) {
                const uint r = i / (HEAD_SIZE / 4), e = 4 * (i % (HEAD_SIZE / 4));
                vec4 a = acc[j] * sAlpha[r];
                for (uint t = 0; t < TILE; t++) a += sP[r * TILE + t] * v4(t, e);
                acc[j] = a;
            }
        }
    }
    barrier();   // sM / sL final for every row
}

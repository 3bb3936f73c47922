// paged_decode's core with -DLANES (the alternative to attention_common.glsl's tiles): keys and values go from
// memory straight into registers, never through shared memory, and the workgroup's invocations split the
// context between them instead of the query rows.
//
// A cluster of LANES neighbouring invocations of one subgroup (a power of two, at most the subgroup size) takes
// one token at a time: invocation l holds the 16-byte words l, l + LANES, ... of its key and value, and the
// matching dimensions of all ROWS queries in registers, so one load of a key serves every query head of the KV
// head. Its partial dot products are summed over the cluster by subgroupShuffleXor, which leaves every
// invocation of the cluster with the scores. Each cluster keeps its own online softmax (running max m, sum l,
// output slices acc) over the tokens c, c + NC, c + 2 NC, ... of each step of NC * UNROLL tokens (NC clusters,
// neighbouring clusters on neighbouring tokens, so a subgroup's loads cover consecutive bytes of a block).
// The next step's keys and values are loaded while the current step is computed, and the block-table entries of
// the step after that, so the table's indirection never stalls a load. At the end the clusters' results are
// merged into shared memory one cluster after another and left as attention_common.glsl leaves them: acc[j] the
// unnormalised output of pair tid + j * WG (row, 4 dims), sM and sL each row's max and sum.
//
// The including file defines HEAD_SIZE, ROWS, LANES, UNROLL, KV_F16 (or not), its bindings (kc, vc, a push
// constant `softcap`) and
//   uint kv_block(uint pos)              the physical block of position pos (a load of the block table)
//   uint kv_at(uint block, uint pos)     index of position pos's first uvec4 in the K/V buffers, in `block`
//   vec4 q_at(uint row, uint e)          four query values of `row` from dimension e, already scaled
// With -DNEW_KV it sets new_pos before attend and defines
//   bool new_words(uint w, bool writer, out uvec4 k, out uvec4 v)   word w of the new token's key and value
//       (false where there is none to attend: the cache's words at new_pos are attended then); `writer`: the
//       invocation that writes the word into the cache where this workgroup's partition owns it
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_shuffle : enable
#include "common.glsl"
#include "kv_words.glsl"
#define PAIRS (ROWS * HEAD_SIZE / 4)
#define WPL ((WORDS_PER_TOKEN + LANES - 1) / LANES)   // words of a token per invocation
#define V4W (KV_PER_WORD / 4)                          // vec4s per word
#define NC (WG / LANES)                                // clusters per workgroup
#define STEP (NC * UNROLL)                             // tokens per step

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128;
#define ACC_N ((PAIRS + WG - 1) / WG)
#if LANES > WORDS_PER_TOKEN
#error "a cluster of LANES invocations needs at least LANES words a token"
#endif

shared vec4 sQ[ROWS * HEAD_SIZE / 4];   // the merged output (and, for -DQ8_OUT, the normalised rows)
shared float sM[ROWS], sL[ROWS];
shared vec2 sML[NC * ROWS];             // each cluster's (m, l) per row
#ifdef NEW_KV
uint new_pos = 0xFFFFFFFFu;   // none
bool new_words(uint w, bool writer, out uvec4 k, out uvec4 v);
#endif

vec4 acc[ACC_N];
uint kv_block(uint pos);
uint kv_at(uint block, uint pos);
vec4 q_at(uint row, uint e);

vec4 kv4(uvec4 wd, uint h) {   // vec4 h of a word
#ifdef KV_F16
    return unpack_half4(h == 0u ? wd.xy : wd.zw);
#else
    return uintBitsToFloat(wd);
#endif
}

uint blk[UNROLL];   // block-table entries of the step whose loads are issued next
uvec4 nextK[UNROLL][WPL], nextV[UNROLL][WPL];

void table_step(uint t0, uint end, uint cl) {   // the block-table entries of the step at t0
    [[unroll]] for (uint u = 0; u < UNROLL; u++) blk[u] = kv_block(min(t0 + u * NC + cl, end - 1));
}

void load_step(uint t0, uint end, uint npos, uint lane, uint cl) {   // the step at t0 into nextK/nextV
    [[unroll]] for (uint u = 0; u < UNROLL; u++) {
        const uint pos = t0 + u * NC + cl;
        const uint base = kv_at(blk[u], pos);
        [[unroll]] for (uint j = 0; j < WPL; j++) {
            const uint w = lane + j * LANES;
            nextK[u][j] = uvec4(0);   // a zero weight times garbage could be NaN
            nextV[u][j] = uvec4(0);
            if (pos < end && pos != npos && w < WORDS_PER_TOKEN) {
                nextK[u][j] = kc[base + w];
                nextV[u][j] = vc[base + w];
            }
        }
    }
}

void attend(uint begin, uint end) {
    const uint tid = gl_LocalInvocationID.x;
    const uint lane = gl_SubgroupInvocationID % LANES;
    const uint cl = (gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID) / LANES;   // this cluster

    vec4 qr[ROWS][WPL * V4W];
    [[unroll]] for (uint r = 0; r < ROWS; r++) {
        [[unroll]] for (uint j = 0; j < WPL; j++) {
            const uint w = lane + j * LANES;
            [[unroll]] for (uint h = 0; h < V4W; h++) {
                qr[r][j * V4W + h] = w < WORDS_PER_TOKEN ? q_at(r, w * KV_PER_WORD + 4 * h) : vec4(0.0);
            }
        }
    }
    uint npos = 0xFFFFFFFFu;   // the position taken from nk/nv instead of the cache
    uvec4 nk[WPL], nv[WPL];
    [[unroll]] for (uint j = 0; j < WPL; j++) {
        nk[j] = uvec4(0);
        nv[j] = uvec4(0);
    }
#ifdef NEW_KV
    bool has_new = false;   // the same in every invocation: word `lane` exists (LANES <= WORDS_PER_TOKEN)
    [[unroll]] for (uint j = 0; j < WPL; j++) {
        const uint w = lane + j * LANES;
        if (w < WORDS_PER_TOKEN) {
            const bool got = new_words(w, cl == 0, nk[j], nv[j]);
            if (j == 0) has_new = got;
        }
    }
    if (has_new) npos = new_pos;
#endif

    float m[ROWS], l[ROWS];
    vec4 o[ROWS][WPL * V4W];
    [[unroll]] for (uint r = 0; r < ROWS; r++) {
        m[r] = -1.0 / 0.0;
        l[r] = 0.0;
        [[unroll]] for (uint i = 0; i < WPL * V4W; i++) o[r][i] = vec4(0.0);
    }

    if (begin < end) {
        table_step(begin, end, cl);
        load_step(begin, end, npos, lane, cl);
        if (begin + STEP < end) table_step(begin + STEP, end, cl);
    }
    for (uint t0 = begin; t0 < end; t0 += STEP) {
        uvec4 curK[UNROLL][WPL] = nextK, curV[UNROLL][WPL] = nextV;
        if (t0 + STEP < end) {   // the next step's loads, and the table entries of the one after, in flight
            load_step(t0 + STEP, end, npos, lane, cl);
            if (t0 + 2 * STEP < end) table_step(t0 + 2 * STEP, end, cl);
        }
        float s[UNROLL][ROWS];
        [[unroll]] for (uint u = 0; u < UNROLL; u++) {
            const uint pos = t0 + u * NC + cl;
            if (pos == npos) {
                curK[u] = nk;
                curV[u] = nv;
            }
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
                vec4 d4 = vec4(0.0);
                [[unroll]] for (uint j = 0; j < WPL; j++) {
                    [[unroll]] for (uint h = 0; h < V4W; h++) d4 += qr[r][j * V4W + h] * kv4(curK[u][j], h);
                }
                float d = hsum(d4);
                [[unroll]] for (uint off = LANES / 2; off > 0; off /= 2) d += subgroupShuffleXor(d, off);
                if (pc.softcap > 0.0) d = pc.softcap * tanh(d / pc.softcap);
                s[u][r] = pos < end ? d : -1.0 / 0.0;
            }
        }
        [[unroll]] for (uint r = 0; r < ROWS; r++) {
            float m_new = m[r];
            [[unroll]] for (uint u = 0; u < UNROLL; u++) m_new = max(m_new, s[u][r]);
            const bool none = m_new == -1.0 / 0.0;   // all masked so far: alpha 1, weights 0 (no inf - inf)
            const float alpha = none ? 1.0 : exp(m[r] - m_new);
            m[r] = m_new;
            float ps = 0.0;
            [[unroll]] for (uint i = 0; i < WPL * V4W; i++) o[r][i] *= alpha;
            [[unroll]] for (uint u = 0; u < UNROLL; u++) {
                const float p = none ? 0.0 : exp(s[u][r] - m_new);
                ps += p;
                [[unroll]] for (uint j = 0; j < WPL; j++) {
                    [[unroll]] for (uint h = 0; h < V4W; h++) o[r][j * V4W + h] += p * kv4(curV[u][j], h);
                }
            }
            l[r] = l[r] * alpha + ps;
        }
    }

    // merge: each row's max over the clusters, then the clusters' outputs added into sQ one cluster at a time
    if (lane == 0) {
        [[unroll]] for (uint r = 0; r < ROWS; r++) sML[cl * ROWS + r] = vec2(m[r], l[r]);
    }
    for (uint i = tid; i < ROWS * HEAD_SIZE / 4; i += WG) sQ[i] = vec4(0.0);
    barrier();
    float wgt[ROWS];
    [[unroll]] for (uint r = 0; r < ROWS; r++) {
        float mx = -1.0 / 0.0;
        for (uint c = 0; c < NC; c++) mx = max(mx, sML[c * ROWS + r].x);
        wgt[r] = m[r] == -1.0 / 0.0 ? 0.0 : exp(m[r] - mx);
        if (tid == 0) {
            float sum = 0.0;
            for (uint c = 0; c < NC; c++) {
                const vec2 ml = sML[c * ROWS + r];
                if (ml.x != -1.0 / 0.0) sum += exp(ml.x - mx) * ml.y;
            }
            sM[r] = mx;
            sL[r] = sum;
        }
    }
    for (uint c = 0; c < NC; c++) {
        if (cl == c) {
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
                [[unroll]] for (uint j = 0; j < WPL; j++) {
                    const uint w = lane + j * LANES;
                    [[unroll]] for (uint h = 0; h < V4W; h++) {
                        const uint i = (r * HEAD_SIZE + w * KV_PER_WORD) / 4 + h;
                        if (w < WORDS_PER_TOKEN) sQ[i] += wgt[r] * o[r][j * V4W + h];
                    }
                }
            }
        }
        barrier();
    }
    [[unroll]] for (uint j = 0; j < ACC_N; j++) {
        const uint i = tid + j * WG;
        acc[j] = i < PAIRS ? sQ[i] : vec4(0.0);
    }
}

// The core shared by the attention templates: online-softmax attention of ROWS query rows against a stream
// of key/value tokens that all belong to one KV head, TILE tokens at a time.
//
// Per tile: (1) the tile's keys and values, loaded into registers with 16-byte loads while the previous tile
// was computed (unconditional loads, see load_tile), go to shared memory, and the next tile's loads are issued, so a workgroup always has a tile
// in flight; (2) one invocation per (row, token) computes a score; (3) one invocation per row updates the
// running max m; (4) one invocation per (row, token) turns its score into a weight; (5) each invocation
// rescales and accumulates its (row, 4 dims) slices of the output and the row's running sum l.
// With -DSG_ROWMAX (a subgroup is exactly TILE invocations, so one row's scores) (2)-(4) are one pass:
// subgroupMax gives the tile's max, which otherwise one invocation per row reads serially.
// Tokens in shared memory are padded by one 16-byte word: in (2) neighbouring invocations read neighbouring
// tokens, which unpadded (a power-of-two stride) all fall in the same banks.
//
// Scores are soft-capped (cap * tanh(score / cap), Gemma 2) where the including file's push constant `softcap`
// is above 0.
//
// The including file defines HEAD_SIZE, ROWS, TILE, KV_F16 (or not), declares its bindings (its push constants
// with a float `softcap`), and defines
//   uint kv_word(uint pos)              index of token pos's first uvec4 in the K/V buffers
//   bool visible(uint row, uint pos)    whether row may attend to key position pos
// or, with -DKV_BLOCKS (a paged cache), in place of kv_word
//   uint kv_block(uint pos)             the physical block of position pos (a load of the block table)
//   uint kv_at(uint block, uint pos)    index of position pos's first uvec4 in the K/V buffers, in `block`
// and the block-table entries are then loaded a tile ahead of the keys and values that they locate.
// then calls attend(begin, end) and reads acc[], sM[] and sL[].
// With -DNEW_KV the including file sets new_pos before attend and defines
//   void new_token()   sets new_k/new_v in invocations below WORDS_PER_TOKEN: word w = invocation of position
//                      new_pos's key and value, as the K/V buffers hold them
// which attend calls once its first tile's loads are in flight; tiles take that position's words from new_k/new_v
// in place of the K/V buffers (a token that the same dispatch writes, which other workgroups of it may not see).
#include "common.glsl"
#include "kv_words.glsl"
// in shared memory a token's words are STRIDE apart (one word of padding, see above)
#define STRIDE (WORDS_PER_TOKEN + 1)

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128;
#define ACC_N ((PAIRS + WG - 1) / WG)
#define LOAD_N ((TILE * WORDS_PER_TOKEN + WG - 1) / WG)
#define SCORE_N ((ROWS * TILE + WG - 1) / WG)
#ifdef SG_ROWMAX
#extension GL_KHR_shader_subgroup_arithmetic : enable
float row_m[SCORE_N];   // the running max of the row this invocation scores
#endif

shared vec4 sQ[ROWS * HEAD_SIZE / 4];
shared uvec4 sK[TILE * STRIDE];
shared uvec4 sV[TILE * STRIDE];
// weight i = row * TILE + token at SP(i); -DROW_LANES pads each row by 4 (its rows are read together, which rows
// TILE * 4 bytes apart would read from the same banks)
#ifdef ROW_LANES
#define SP(i) ((i) + (i) / TILE * 4)
shared vec4 sP[ROWS * (TILE + 4) / 4];
#else
#define SP(i) (i)
shared vec4 sP[ROWS * TILE / 4];   // TILE is a multiple of 4
#endif
shared float sM[ROWS], sL[ROWS], sAlpha[ROWS];
#ifdef NEW_KV
uint new_pos = 0xFFFFFFFFu;   // none
uvec4 new_k = uvec4(0), new_v = uvec4(0);
void new_token();
#endif

vec4 acc[ACC_N];
float lsum[ACC_N];
uvec4 nextK[LOAD_N], nextV[LOAD_N];
#ifdef KV_BLOCKS
uint nextBlk[LOAD_N];   // block-table entries of the tile that load_tile loads next
uint kv_block(uint pos);
uint kv_at(uint block, uint pos);
#else

uint kv_word(uint pos);
#endif
bool visible(uint row, uint pos);

vec4 kv4(uvec4 wd, uint e) {   // four values from dimension e of the word holding dimension e
#ifdef KV_F16
    return unpack_half4(((e >> 2) & 1u) == 0u ? wd.xy : wd.zw);
#else
    return uintBitsToFloat(wd);
#endif
}

#ifdef KV_F16
vec4 k4(uint t, uint e) { return kv4(sK[t * STRIDE + e / KV_PER_WORD], e); }
vec4 v4(uint t, uint e) { return kv4(sV[t * STRIDE + e / KV_PER_WORD], e); }
#else   // a word is four float32 values
vec4 k4(uint t, uint e) { return uintBitsToFloat(sK[t * STRIDE + e / 4]); }
vec4 v4(uint t, uint e) { return uintBitsToFloat(sV[t * STRIDE + e / 4]); }
#endif

void put_word(uint t, uint w, uvec4 k, uvec4 v) {   // word w of the tile's token t, as the K/V buffers hold it
    sK[t * STRIDE + w] = k;
    sV[t * STRIDE + w] = v;
}

// Loads the queries (already scaled) into sQ: q_at(row, e) gives four values of row from dimension e.
vec4 q_at(uint row, uint e);

// The tile at t0 into nextK/nextV. The loads are unconditional, from positions clamped into the range, so that
// all of them (and the block-table loads before them) are in flight at once: a load under a condition whose
// result meets a default value after it was measured to wait for its data before the next load is issued (on
// the H200, one memory round trip per load). Words past the end are zeroed as they go into shared memory.
void load_tile(uint t0, uint end) {
    [[unroll]] for (uint j = 0; j < LOAD_N; j++) {
        const uint i = min(gl_LocalInvocationID.x + j * WG, TILE * WORDS_PER_TOKEN - 1);
        const uint pos = min(t0 + i / WORDS_PER_TOKEN, end - 1);
#ifdef KV_BLOCKS
        const uint g = kv_at(nextBlk[j], pos) + i % WORDS_PER_TOKEN;
#else
        const uint g = kv_word(pos) + i % WORDS_PER_TOKEN;
#endif
        nextK[j] = kc[g];
        nextV[j] = vc[g];
    }
}

#ifdef KV_BLOCKS
void load_table(uint t0, uint end) {   // the block-table entries of the tile at t0 into nextBlk, as load_tile clamps
    [[unroll]] for (uint j = 0; j < LOAD_N; j++) {
        const uint i = min(gl_LocalInvocationID.x + j * WG, TILE * WORDS_PER_TOKEN - 1);
        nextBlk[j] = kv_block(min(t0 + i / WORDS_PER_TOKEN, end - 1));
    }
}
#endif

void attend(uint begin, uint end) {
    const uint tid = gl_LocalInvocationID.x;
    for (uint i = tid; i < ROWS * HEAD_SIZE / 4; i += WG) sQ[i] = q_at(i / (HEAD_SIZE / 4), 4 * (i % (HEAD_SIZE / 4)));
    for (uint r = tid; r < ROWS; r += WG) sM[r] = -1.0 / 0.0;
#ifdef SG_ROWMAX
    [[unroll]] for (uint j = 0; j < SCORE_N; j++) row_m[j] = -1.0 / 0.0;
#endif
    [[unroll]] for (uint j = 0; j < ACC_N; j++) {
        acc[j] = vec4(0.0);
        lsum[j] = 0.0;
    }
    if (begin < end) {
#ifdef KV_BLOCKS
        load_table(begin, end);
        load_tile(begin, end);
        load_table(begin + TILE, end);
#else
        load_tile(begin, end);
#endif
    }
#ifdef NEW_KV
    new_token();   // its loads overlap the first tile's
#endif

    for (uint t0 = begin; t0 < end; t0 += TILE) {
        barrier();   // the previous tile is consumed; sQ/sM are written
#ifdef NEW_KV
        const bool has_new = new_pos - t0 < TILE && new_pos < end;   // the new token is in this tile
#endif
        [[unroll]] for (uint j = 0; j < LOAD_N; j++) {
            const uint i = tid + j * WG;
#ifdef NEW_KV
            if (i < TILE * WORDS_PER_TOKEN && !(has_new && t0 + i / WORDS_PER_TOKEN == new_pos)) {
#else
            if (i < TILE * WORDS_PER_TOKEN) {
#endif
                // past the end: zeros (a zero weight times garbage could be NaN); new_pos's words, which another
                // workgroup may be writing, were loaded from a clamped position and are never used
                const bool valid = t0 + i / WORDS_PER_TOKEN < end;
                put_word(i / WORDS_PER_TOKEN, i % WORDS_PER_TOKEN, valid ? nextK[j] : uvec4(0),
                         valid ? nextV[j] : uvec4(0));
            }
        }
#ifdef NEW_KV
        if (has_new && tid < WORDS_PER_TOKEN) put_word(new_pos - t0, tid, new_k, new_v);
#endif
        barrier();
        load_tile(t0 + TILE, end);   // past the end: the last position again, unused (unconditional, see load_tile)
#ifdef KV_BLOCKS
        load_table(t0 + 2 * TILE, end);
#endif
        [[unroll]] for (uint j = 0; j < SCORE_N; j++) {
            const uint i = tid + j * WG;
            if (i < ROWS * TILE) {
                const uint r = i / TILE, t = i % TILE, pos = t0 + t;
                float s = -1.0 / 0.0;
                if (pos < end && visible(r, pos)) {
                    vec4 d4 = vec4(0.0);
                    [[unroll]] for (uint e = 0; e < HEAD_SIZE; e += 4) d4 += sQ[(r * HEAD_SIZE + e) / 4] * k4(t, e);
                    s = hsum(d4);
                    if (pc.softcap > 0.0) s = pc.softcap * tanh(s / pc.softcap);
                }
#ifdef SG_ROWMAX
                // a subgroup holds one row's TILE scores: max, weights and alpha without a pass of their own
                const float m_new = max(row_m[j], subgroupMax(s));
                const bool none = m_new == -1.0 / 0.0;   // all masked so far: alpha 1, weights 0 (no inf - inf)
                sP[SP(i) / 4][SP(i) % 4] = none ? 0.0 : exp(s - m_new);
                if (t == 0) {
                    sAlpha[r] = none ? 1.0 : exp(row_m[j] - m_new);
                    sM[r] = m_new;
                }
                row_m[j] = m_new;
#else
                sP[SP(i) / 4][SP(i) % 4] = s;
#endif
            }
        }
        barrier();
#ifndef SG_ROWMAX
        for (uint r = tid; r < ROWS; r += WG) {
            const float m_old = sM[r];
            float m_new = m_old;
            for (uint t = 0; t < TILE; t += 4) {
                const vec4 s4 = sP[SP(r * TILE + t) / 4];
                m_new = max(m_new, max(max(s4.x, s4.y), max(s4.z, s4.w)));
            }
            // all masked so far: keep alpha 1 (weights are then 0; no inf - inf)
            sAlpha[r] = m_new == -1.0 / 0.0 ? 1.0 : exp(m_old - m_new);
            sM[r] = m_new;
        }
        barrier();
        for (uint i = tid; i < ROWS * TILE; i += WG) {
            const float m = sM[i / TILE];
            sP[SP(i) / 4][SP(i) % 4] = m == -1.0 / 0.0 ? 0.0 : exp(sP[SP(i) / 4][SP(i) % 4] - m);
        }
        barrier();
#endif
        [[unroll]] for (uint j = 0; j < ACC_N; j++) {
            const uint i = tid + j * WG;
            if (i < PAIRS) {
                const uint r = PAIR_ROW(i), e = 4 * PAIR_QUAD(i);
                const float alpha = sAlpha[r];
                vec4 a = acc[j] * alpha;
                float l = 0.0;
                for (uint t = 0; t < TILE; t += 4) {
                    const vec4 p = sP[SP(r * TILE + t) / 4];
                    a += p.x * v4(t, e) + p.y * v4(t + 1, e) + p.z * v4(t + 2, e) + p.w * v4(t + 3, e);
                    l += hsum(p);
                }
                acc[j] = a;
                lsum[j] = lsum[j] * alpha + l;
            }
        }
    }
    [[unroll]] for (uint j = 0; j < ACC_N; j++) {   // one invocation per row publishes its running sum
        const uint i = tid + j * WG;
        if (i < PAIRS && PAIR_QUAD(i) == 0) sL[PAIR_ROW(i)] = lsum[j];
    }
    barrier();   // sM / sL final for every row
}

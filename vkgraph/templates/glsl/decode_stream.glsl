// paged_decode's core with -DSTREAM (the alternative to attention_common.glsl's tiles): keys and values go from
// memory straight into registers, in chunks of CHUNK tokens with one online-softmax step per chunk.
//
// Why: the tiles stage keys and values through shared memory and every query row's invocation reads and converts
// each of them again (4 reads of every byte for 4 rows), so at large batches their shared-memory traffic, not the
// memory bus, bounds them. Here each 16-byte word of a key or value is loaded once, by one invocation, converted
// once and used for all ROWS query rows from registers.
//
// A group of LANES neighbouring invocations of one subgroup (a power of two dividing WORDS_PER_TOKEN and the
// subgroup size) takes one token: invocation `lane` holds words lane, lane + LANES, ... of its key and value and
// the matching dimensions of every query row. The workgroup's NG = WG / LANES groups take neighbouring tokens, so
// each load instruction of a subgroup covers consecutive bytes of a block; UNROLL tokens a group make a chunk.
// Per chunk:
//   (1) the keys, loaded during the previous chunk, are scored: ROWS partial dot products per invocation, summed
//       over the group by a reduce-scatter of shuffles (ROWS - 1 shuffles share the rows out, log2(LANES / ROWS)
//       finish the sums: 5 shuffles a token for 4 rows of 16 lanes, not 16), and written to sS; as each key is
//       scored, the next chunk's key goes into its registers;
//   (2) one subgroup per row takes the chunk's max, rescales the row's running max and sum and writes the
//       weights exp(s - m) to sP (ROWS per token, so that (3) reads a token's in one 16-byte load);
//   (3) every invocation rescales its output slices and accumulates the values it loaded (during the previous
//       chunk) times the weights, each value's registers taking the next chunk's as soon as it is used.
// Two barriers a chunk. At the end the groups' outputs are summed (shuffles within a subgroup, then NSLOT slots
// of shared memory) and left as attention_common.glsl leaves them: acc[j] the unnormalised output of pair
// tid + j * WG (row, 4 dims), sM and sL each row's max and sum, sQ free for the epilogue.
//
// The including file defines HEAD_SIZE, ROWS, KV_F16 (or not), LANES, UNROLL, SG (the subgroup size, fixed),
// NSLOT (a power of two dividing WG / SG), RP (ROWS rounded up to a power of two, at most LANES), its bindings (kc, vc, a push
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
#extension GL_KHR_shader_subgroup_arithmetic : enable
#include "common.glsl"
#include "kv_words.glsl"
#define WPL (WORDS_PER_TOKEN / LANES)   // words of a token per invocation
#define V4W (KV_PER_WORD / 4)           // vec4s per word
#define R4 ((ROWS + 3) / 4)             // vec4s of one token's weights
#if WORDS_PER_TOKEN % LANES != 0 || SG % LANES != 0 || RP > LANES
#error "LANES must divide the words of a token and the subgroup, and hold the rows"
#endif

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128;
#define ACC_N ((PAIRS + WG - 1) / WG)
#define NG (WG / LANES)       // token groups
#define NW (WG / SG)          // subgroups
#define CHUNK (NG * UNROLL)   // tokens a chunk

shared float sS[ROWS * CHUNK];          // the chunk's scores [row][token]
shared vec4 sP[CHUNK * R4];             // its weights [token][row]
shared float sM[ROWS], sL[ROWS], sAlpha[ROWS];
shared vec4 sO[NSLOT * PAIRS];          // the groups' outputs summed at the end
#define sQ sO                           // the epilogue's rows: slot 0 (each invocation reads and writes its own)
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

uint blk_a[UNROLL], blk_b[UNROLL];   // block-table entries of the next chunk and of the one after
uvec4 kr[UNROLL][WPL], vr[UNROLL][WPL];
uvec4 nk[WPL], nv[WPL];              // the new token's words, attended at npos in place of the cache's
uint npos = 0xFFFFFFFFu;

void table(uint t0, uint end, uint grp, out uint blk[UNROLL]) {   // the block-table entries of the chunk at t0
    [[unroll]] for (uint u = 0; u < UNROLL; u++) blk[u] = kv_block(min(t0 + u * NG + grp, end - 1));
}

// token u of the chunk at t0 (its block-table entry blk, of the position clamped into the range): its key (value:
// !key) words into kr[u] (vr[u]). The loads are unconditional, from the clamped position, so that they are all in
// flight at once (a load under a condition whose result meets a default value after it waits for its data before
// the next is issued); word() takes the new token's words and the zeros past the end where they are used.
void load(bool key, uint u, uint blk, uint t0, uint end, uint grp, uint lane) {
    const uint base = kv_at(blk, min(t0 + u * NG + grp, end - 1));
    [[unroll]] for (uint j = 0; j < WPL; j++) {
        const uint g = base + lane + j * LANES;
        if (key) kr[u][j] = kc[g];
        else vr[u][j] = vc[g];
    }
}

// word j of token u of the chunk at t0 as attended: the loaded one, the new token's at npos, zeros past the end
// (a zero weight times garbage could be NaN)
uvec4 word(bool key, uint u, uint j, uint t0, uint end, uint grp) {
    const uint pos = t0 + u * NG + grp;
    if (pos == npos) return key ? nk[j] : nv[j];
    return pos < end ? (key ? kr[u][j] : vr[u][j]) : uvec4(0);
}

void attend(uint begin, uint end) {
    const uint tid = gl_LocalInvocationID.x;
    const uint lin = gl_SubgroupID * SG + gl_SubgroupInvocationID;   // groups are lanes of one subgroup
    const uint lane = lin % LANES, grp = lin / LANES;

    vec4 qr[ROWS][WPL * V4W];
    [[unroll]] for (uint r = 0; r < ROWS; r++) {
        [[unroll]] for (uint j = 0; j < WPL; j++) {
            [[unroll]] for (uint h = 0; h < V4W; h++) qr[r][j * V4W + h] = q_at(r, (lane + j * LANES) * KV_PER_WORD + 4 * h);
        }
    }
    [[unroll]] for (uint j = 0; j < WPL; j++) {
        nk[j] = uvec4(0);
        nv[j] = uvec4(0);
    }
#ifdef NEW_KV
    bool has_new = false;   // the same in every invocation
    [[unroll]] for (uint j = 0; j < WPL; j++) {
        const bool got = new_words(lane + j * LANES, grp == 0, nk[j], nv[j]);
        if (j == 0) has_new = got;
    }
    if (has_new) npos = new_pos;
#endif
    for (uint r = tid; r < ROWS; r += WG) {
        sM[r] = -1.0 / 0.0;
        sL[r] = 0.0;
    }
    vec4 oa[ROWS][WPL * V4W];   // this invocation's output slices
    [[unroll]] for (uint r = 0; r < ROWS; r++) {
        [[unroll]] for (uint i = 0; i < WPL * V4W; i++) oa[r][i] = vec4(0.0);
    }

    // every load is issued as soon as the register it fills is free: a token's key of the next chunk right after
    // this chunk's key in that register is scored, its value right after this one's is accumulated, so each is
    // in flight for a whole chunk; the block-table entries come a chunk earlier still
    if (begin < end) {
        table(begin, end, grp, blk_a);
        [[unroll]] for (uint u = 0; u < UNROLL; u++) {
            load(true, u, blk_a[u], begin, end, grp, lane);
            load(false, u, blk_a[u], begin, end, grp, lane);
        }
        table(begin + CHUNK, end, grp, blk_a);
    }
    // past the end the loads repeat the last position (unconditional, see load), and go unused
    for (uint t0 = begin; t0 < end; t0 += CHUNK) {
        table(t0 + 2 * CHUNK, end, grp, blk_b);
        // (1) the keys scored
        [[unroll]] for (uint u = 0; u < UNROLL; u++) {
            float v[RP];
            [[unroll]] for (uint r = 0; r < RP; r++) {
                vec4 d4 = vec4(0.0);
                if (r < ROWS) {
                    [[unroll]] for (uint j = 0; j < WPL; j++) {
                        const uvec4 k = word(true, u, j, t0, end, grp);
                        [[unroll]] for (uint h = 0; h < V4W; h++) d4 += qr[r][j * V4W + h] * kv4(k, h);
                    }
                }
                v[r] = hsum(d4);
            }
            // reduce-scatter over the group's lanes: a step over lane bit s halves the rows an invocation holds
            // (it keeps the upper half where its bit is set) until one is left, row rbase, then sums whole
            uint rbase = 0;
            [[unroll]] for (uint s = 0; (1u << s) < LANES; s++) {
                const uint mask = 1u << s, cnt = RP >> s;
                const bool hi = (lane & mask) != 0u;
                if (cnt >= 2) {
                    [[unroll]] for (uint i = 0; i < cnt / 2; i++) {
                        const float send = hi ? v[i] : v[i + cnt / 2];
                        v[i] = (hi ? v[i + cnt / 2] : v[i]) + subgroupShuffleXor(send, mask);
                    }
                    if (hi) rbase += cnt / 2;
                } else {
                    v[0] += subgroupShuffleXor(v[0], mask);
                }
            }
            const uint t = u * NG + grp, pos = t0 + t;
            if (lane < RP && rbase < ROWS) {   // one writer per row (the others hold the same sums)
                float s = v[0];
                if (pc.softcap > 0.0) s = pc.softcap * tanh(s / pc.softcap);
                sS[rbase * CHUNK + t] = pos < end ? s : -1.0 / 0.0;
            }
            load(true, u, blk_a[u], t0 + CHUNK, end, grp, lane);
        }
        barrier();
        // (2) one subgroup per row: the chunk's max, the weights, the running max and sum
        for (uint r = gl_SubgroupID; r < ROWS; r += NW) {
            const float m_old = sM[r];
            float mx = -1.0 / 0.0;
            for (uint t = gl_SubgroupInvocationID; t < CHUNK; t += SG) mx = max(mx, sS[r * CHUNK + t]);
            const float m_new = max(m_old, subgroupMax(mx));
            const bool none = m_new == -1.0 / 0.0;   // all masked so far: alpha 1, weights 0 (no inf - inf)
            float sum = 0.0;
            for (uint t = gl_SubgroupInvocationID; t < CHUNK; t += SG) {
                const float p = none ? 0.0 : exp(sS[r * CHUNK + t] - m_new);
                sP[t * R4 + r / 4][r % 4] = p;
                sum += p;
            }
            sum = subgroupAdd(sum);
            if (subgroupElect()) {
                const float alpha = none ? 1.0 : exp(m_old - m_new);
                sAlpha[r] = alpha;
                sM[r] = m_new;
                sL[r] = sL[r] * alpha + sum;
            }
        }
        barrier();
        // (3) the values times the weights
        [[unroll]] for (uint r = 0; r < ROWS; r++) {
            const float alpha = sAlpha[r];
            [[unroll]] for (uint i = 0; i < WPL * V4W; i++) oa[r][i] *= alpha;
        }
        [[unroll]] for (uint u = 0; u < UNROLL; u++) {
            vec4 p4[R4];
            [[unroll]] for (uint k = 0; k < R4; k++) p4[k] = sP[(u * NG + grp) * R4 + k];
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
                const float p = p4[r / 4][r % 4];
                [[unroll]] for (uint j = 0; j < WPL; j++) {
                    const uvec4 v = word(false, u, j, t0, end, grp);
                    [[unroll]] for (uint h = 0; h < V4W; h++) oa[r][j * V4W + h] += p * kv4(v, h);
                }
            }
            load(false, u, blk_a[u], t0 + CHUNK, end, grp, lane);
        }
        [[unroll]] for (uint u = 0; u < UNROLL; u++) blk_a[u] = blk_b[u];
    }

    // the groups' outputs summed: over a subgroup's groups by shuffles, then its first group's lanes into a slot
    [[unroll]] for (uint mask = LANES; mask < SG; mask *= 2) {
        [[unroll]] for (uint r = 0; r < ROWS; r++) {
            [[unroll]] for (uint i = 0; i < WPL * V4W; i++) oa[r][i] += subgroupShuffleXor(oa[r][i], mask);
        }
    }
    const uint slot = gl_SubgroupID % NSLOT;
    for (uint rnd = 0; rnd < NW / NSLOT; rnd++) {
        if (gl_SubgroupID / NSLOT == rnd && gl_SubgroupInvocationID < LANES) {
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
                [[unroll]] for (uint j = 0; j < WPL; j++) {
                    [[unroll]] for (uint h = 0; h < V4W; h++) {
                        const uint i = slot * PAIRS + (r * HEAD_SIZE + (lane + j * LANES) * KV_PER_WORD) / 4 + h;
                        sO[i] = rnd == 0 ? oa[r][j * V4W + h] : sO[i] + oa[r][j * V4W + h];
                    }
                }
            }
        }
        barrier();
    }
    [[unroll]] for (uint j = 0; j < ACC_N; j++) {
        const uint i = tid + j * WG;
        vec4 a = vec4(0.0);
        if (i < PAIRS) {
            [[unroll]] for (uint s = 0; s < NSLOT; s++) a += sO[s * PAIRS + i];
        }
        acc[j] = a;
    }
}

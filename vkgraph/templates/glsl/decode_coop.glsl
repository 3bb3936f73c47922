// paged_decode's core with -DCOOP (the alternative to attention_common.glsl's tiles and decode_stream.glsl): the
// query rows of a KV head against its keys and values on cooperative matrices (16 x 16 x 16, float16 operands,
// float32 accumulation), for a float16 cache.
//
// Why: the tiles core has every query row's invocations read and convert each key and value from shared memory
// again; at large batches that shared-memory traffic, not the memory bus, bounds it (B=32, L=2048 on an H200:
// 112 us against about 67 for the cache's bytes). Here the ROWS query rows (padded to 16) are the rows of a matrix
// product, so each staged key and value is read from shared memory once, by a fragment load.
//
// Each subgroup of the workgroup walks its own tiles of TT = 16 tokens (tile i of the range goes to subgroup
// i % NSG) with its own online softmax, and needs no workgroup barrier inside the walk. Per tile:
//   (1) the tile's keys and values, loaded into registers during the previous tile, go to the subgroup's part of
//       shared memory (zeros past the range's end; the new token's words, -DNEW_KV, from where attend put them),
//       and the next tile's loads (block-table entry, then the words) are issued;
//   (2) S = Q K^T: the queries, split once into two float16 parts (hi: the leading 11 bits, lo: the rest rounded
//       to float16) so that their product with the float16 keys keeps about 22 bits, times the staged keys;
//   (3) S through shared memory to SG / 16 lanes a row: the tile's max, the running max and sum, the weights P
//       (two float16 parts again) and the factor exp(m_old - m_new) that rescales the row's output;
//   (4) O = O * factors + P V, the factors a matrix whose row r holds row r's (two cooperative matrices of one type
//       share their element layout, whatever it is), V the staged values.
// At the end each subgroup's output, max and sum meet the others' in shared memory and leave the result as the
// other cores leave it: acc[j] the unnormalised output of pair tid + j * WG (row, 4 dimensions), sM and sL each
// row's max and sum; sQ (the scaled queries at the start) is free for the epilogue.
//
// The result is float32 attention over the keys and values as the float16 cache holds them, as the tiles core
// computes it (not bit for bit: products of about 22-bit operands in another order).
//
// -DEMULATE: the same program with the matrix operations written as loops, every invocation holding whole
// matrices (the tests run it on devices without cooperative matrices; slow to compile and to run).
//
// The including file defines HEAD_SIZE (a multiple of 16), ROWS (at most 16), KV_F16, SG (the fixed subgroup size:
// 16 or 32; 8 too where emulated), NSG (subgroups a workgroup), its bindings (kc, vc, a push constant `softcap`) and
//   uint kv_block(uint pos)              the physical block of position pos (a load of the block table)
//   uint kv_at(uint block, uint pos)     index of position pos's first uvec4 in the K/V buffers, in `block`
//   vec4 q_at(uint row, uint e)          four query values of `row` from dimension e, already scaled
// With -DNEW_KV it sets new_pos before attend and defines new_words (as for decode_stream.glsl).
#include "common.glsl"
#include "kv_words.glsl"
#if !defined(KV_F16) || ROWS > 16 || HEAD_SIZE % 16 != 0 || (SG != 8 && SG != 16 && SG != 32)
#error "the cooperative core takes a float16 cache, at most 16 rows, heads of a multiple of 16, subgroups of 8-32"
#endif

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;   // NSG * SG (the host makes it so)
#define ACC_N ((PAIRS + WG - 1) / WG)
#define TT 16                                  // tokens a tile
#define FD (HEAD_SIZE / 16)                    // 16-dimension slices of a head
#define DS (WORDS_PER_TOKEN + 1)               // a staged row of HEAD_SIZE float16 values, padded by one word
#define SS 5                                   // a row of 16 float32 scores, padded
#define PS 3                                   // a row of 16 float16 weights, padded
#define TPR (SG < 16 ? 1 : SG / 16)            // lanes a row in (3)
#define RPL (SG < 16 ? 16 / SG : 1)            // rows a lane in (3)
#define TPL (TT / TPR)                         // tokens a lane in (3)
#define LW (TT * WORDS_PER_TOKEN / SG)         // words of a tile's keys (and of its values) a lane loads
#if (TT * WORDS_PER_TOKEN) % SG != 0
#error "a tile's words must spread evenly over a subgroup"
#endif
// shared memory in 16-byte words: the queries' two parts, then each subgroup's part
#define Q_HI 0
#define Q_LO (16 * DS)
#define SUB0 (32 * DS)
#define KB 0                                   // a subgroup's keys (its output at the end: 16 x HEAD_SIZE / 4)
#define VB (TT * DS)                           // its values
#define SB (2 * TT * DS)                       // its scores
#define PB (SB + 16 * SS)                      // its weights' high parts
#define PL (PB + 16 * PS)                      // and low parts
#define FB (PL + 16 * PS)                      // its per-row factors
#define PER (FB + 64)
shared uvec4 sm[SUB0 + NSG * PER];
shared vec4 sQ[ROWS * HEAD_SIZE / 4];
shared float sM[ROWS], sL[ROWS];
shared vec2 sML[NSG * 16];                     // each subgroup's (max, sum) per row
#ifdef NEW_KV
shared uvec4 sNew[2 * WORDS_PER_TOKEN];        // the new token's key words, then its value words
shared uint sHasNew;
uint new_pos = 0xFFFFFFFFu;   // none
bool new_words(uint w, bool writer, out uvec4 k, out uvec4 v);
#endif
uint npos = 0xFFFFFFFFu;      // the position attended from sNew (none where there is no new token to attend)

vec4 acc[ACC_N];
uint kv_block(uint pos);
uint kv_at(uint block, uint pos);
vec4 q_at(uint row, uint e);

// v's leading 11 significant bits (rounded in the float32 bits): exact in float16 where v is a normal float16, so
// v - head11(v) is exact too. Bit operations, since a driver folds the round trip unpackHalf2x16(packHalf2x16(v))
uvec2 head11(vec4 v) {
    const vec4 h = uintBitsToFloat((floatBitsToUint(v) + 0x1000u) & 0xFFFFE000u);
    return uvec2(packHalf2x16(h.xy), packHalf2x16(h.zw));
}
uvec2 tail11(vec4 v) {   // what head11 leaves out, rounded to float16
    const vec4 h = uintBitsToFloat((floatBitsToUint(v) + 0x1000u) & 0xFFFFE000u);
    return uvec2(packHalf2x16((v - h).xy), packHalf2x16((v - h).zw));
}

#ifdef EMULATE
// every invocation holds a whole 16 x 16 matrix, row-major; offsets and strides in 16-byte words of sm
#define MAT_ACC(n) float n[256]
#define MAT_A(n) float n[256]
#define MAT_B(n) float n[256]
float h_at(uint i) { return unpackHalf2x16(sm[i >> 3][(i >> 1) & 3u] >> (16u * (i & 1u))).x; }
void m_zero(out float m[256]) { for (int i = 0; i < 256; i++) m[i] = 0.0; }
void m_load_h(out float m[256], uint off, uint stride, bool col) {
    for (uint r = 0; r < 16; r++) for (uint c = 0; c < 16; c++)
        m[r * 16 + c] = h_at(col ? (off + c * stride) * 8 + r : (off + r * stride) * 8 + c);
}
void m_load_f(out float m[256], uint off, uint stride) {
    for (uint r = 0; r < 16; r++) for (uint c = 0; c < 16; c++)
        m[r * 16 + c] = uintBitsToFloat(sm[off + r * stride + (c >> 2)][c & 3u]);
}
void m_store(float m[256], uint off, uint stride) {
    if (gl_SubgroupInvocationID == 0u) for (uint r = 0; r < 16; r++) for (uint c = 0; c < 16; c++)
        sm[off + r * stride + (c >> 2)][c & 3u] = floatBitsToUint(m[r * 16 + c]);
}
void m_mma2(float a[256], float a2[256], float b[256], inout float c[256]) {   // c += (a + a2) b
    for (int r = 0; r < 16; r++) for (int n = 0; n < 16; n++) {
        float t = c[r * 16 + n];
        for (int k = 0; k < 16; k++) t += (a[r * 16 + k] + a2[r * 16 + k]) * b[k * 16 + n];
        c[r * 16 + n] = t;
    }
}
void m_mul(inout float a[256], float b[256]) { for (int i = 0; i < 256; i++) a[i] *= b[i]; }
#define ZERO(n) m_zero(n)
#define LOAD_A(n, off, stride) m_load_h(n, off, stride, false)
#define LOAD_B(n, off, stride) m_load_h(n, off, stride, false)
#define LOAD_BT(n, off, stride) m_load_h(n, off, stride, true)
#define LOAD_ACC(n, off, stride) m_load_f(n, off, stride)
#define STORE(n, off, stride) m_store(n, off, stride)
#define MMA2(hi, lo, b, c) m_mma2(hi, lo, b, c)
#define MUL(a, b) m_mul(a, b)
#else
#define MAT_ACC(n) coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> n
#define MAT_A(n) coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> n
#define MAT_B(n) coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> n
#define ZERO(n) n = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0)
#define LOAD_A(n, off, stride) coopMatLoad(n, sm, off, stride, gl_CooperativeMatrixLayoutRowMajor)
#define LOAD_B(n, off, stride) coopMatLoad(n, sm, off, stride, gl_CooperativeMatrixLayoutRowMajor)
#define LOAD_BT(n, off, stride) coopMatLoad(n, sm, off, stride, gl_CooperativeMatrixLayoutColumnMajor)
#define LOAD_ACC(n, off, stride) coopMatLoad(n, sm, off, stride, gl_CooperativeMatrixLayoutRowMajor)
#define STORE(n, off, stride) coopMatStore(n, sm, off, stride, gl_CooperativeMatrixLayoutRowMajor)
#define MMA2(hi, lo, b, c) c = coopMatMulAdd(hi, b, c); c = coopMatMulAdd(lo, b, c)
#define MUL(a, b) a = a * b
#endif

void subgroup_sync() {   // the subgroup's shared-memory writes seen by all of its lanes
    subgroupMemoryBarrierShared();
    subgroupBarrier();
}

uvec4 nk[LW], nv[LW];   // the next tile's words of this lane: word i of the tile is lane + i * SG's

// the tile at t0's words of this lane into nk/nv. The loads are unconditional, from positions clamped into the
// range, so that all are in flight at once (see attention_common.glsl's load_tile); put_tile drops the extra ones.
void load_tile(uint t0, uint end, uint lane) {
    [[unroll]] for (uint i = 0; i < LW; i++) {
        const uint w = lane + i * SG, pos = min(t0 + w / WORDS_PER_TOKEN, end - 1);
        const uint g = kv_at(kv_block(pos), pos) + w % WORDS_PER_TOKEN;
        nk[i] = kc[g];
        nv[i] = vc[g];
    }
}

// the loaded tile at t0 into the subgroup's part at `base`: zeros past the end (a zero weight times garbage could
// be NaN), the new token's words at npos (its cache words may be being written by this dispatch)
void put_tile(uint base, uint t0, uint end, uint lane) {
    [[unroll]] for (uint i = 0; i < LW; i++) {
        const uint w = lane + i * SG, t = w / WORDS_PER_TOKEN, c = w % WORDS_PER_TOKEN, pos = t0 + t;
        uvec4 k = nk[i], v = nv[i];
        if (pos >= end) {
            k = uvec4(0);
            v = uvec4(0);
        }
#ifdef NEW_KV
        if (pos == npos) {
            k = sNew[c];
            v = sNew[WORDS_PER_TOKEN + c];
        }
#endif
        sm[base + KB + t * DS + c] = k;
        sm[base + VB + t * DS + c] = v;
    }
}

void attend(uint begin, uint end) {
    const uint tid = gl_LocalInvocationID.x, sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    const uint base = SUB0 + sg * PER;
    for (uint i = tid; i < ROWS * HEAD_SIZE / 4; i += WG) sQ[i] = q_at(i / (HEAD_SIZE / 4), 4 * (i % (HEAD_SIZE / 4)));
#ifdef NEW_KV
    if (tid < WORDS_PER_TOKEN) {   // one writer per word of the new token (new_words writes where this partition owns it)
        uvec4 k, v;
        const bool got = new_words(tid, true, k, v);
        sNew[tid] = k;
        sNew[WORDS_PER_TOKEN + tid] = v;
        if (tid == 0) sHasNew = got ? 1u : 0u;
    }
#endif
    barrier();
#ifdef NEW_KV
    if (sHasNew != 0u) npos = new_pos;   // else the cache's words at ctx - 1 (a padding row's) are attended
#endif
    // the queries' two float16 parts, 16 rows (those past ROWS zero) of HEAD_SIZE
    for (uint i = tid; i < 16 * WORDS_PER_TOKEN; i += WG) {
        const uint r = i / WORDS_PER_TOKEN, c = i % WORDS_PER_TOKEN;
        uvec4 hi = uvec4(0), lo = uvec4(0);
        if (r < ROWS) {
            const vec4 a = sQ[r * (HEAD_SIZE / 4) + 2 * c], b = sQ[r * (HEAD_SIZE / 4) + 2 * c + 1];
            hi = uvec4(head11(a), head11(b));
            lo = uvec4(tail11(a), tail11(b));
        }
        sm[Q_HI + r * DS + c] = hi;
        sm[Q_LO + r * DS + c] = lo;
    }
    barrier();

    MAT_ACC(o[FD]);
    [[unroll]] for (uint j = 0; j < FD; j++) ZERO(o[j]);
    // (3)'s rows (lane % 16 + i * SG) and tokens (part's TPL) of this lane, and the rows' running max and sum (the
    // same in a row's TPR lanes)
    const uint part = lane / 16;
    float m_row[RPL], l_row[RPL];
    [[unroll]] for (uint i = 0; i < RPL; i++) {
        m_row[i] = -1.0 / 0.0;
        l_row[i] = 0.0;
    }
    const uint step = NSG * TT;
    uint t0 = begin + sg * TT;
    if (t0 < end) load_tile(t0, end, lane);
    for (; t0 < end; t0 += step) {   // uniform in the subgroup
        put_tile(base, t0, end, lane);
        subgroup_sync();
        if (t0 + step < end) load_tile(t0 + step, end, lane);   // in flight during this tile's work
        // (2) the scores of the 16 rows and TT tokens
        MAT_ACC(s);
        ZERO(s);
        [[unroll]] for (uint i = 0; i < FD; i++) {
            MAT_A(qa);
            MAT_A(ql);
            MAT_B(kb);
            LOAD_A(qa, Q_HI + 2 * i, DS);
            LOAD_A(ql, Q_LO + 2 * i, DS);
            LOAD_BT(kb, base + KB + 2 * i, DS);   // K^T: column t is the staged row of token t
            MMA2(qa, ql, kb, s);
        }
        STORE(s, base + SB, SS);
        subgroup_sync();
        // (3) the softmax step of each of this lane's rows over its TPL tokens of the tile
        [[unroll]] for (uint i = 0; i < RPL; i++) {
            const uint row = lane % 16 + i * SG;
            float sv[TPL];
            float mx = -1.0 / 0.0;
            [[unroll]] for (uint t = 0; t < TPL; t++) {
                const uint tt = part * TPL + t;
                float x = uintBitsToFloat(sm[base + SB + row * SS + tt / 4][tt % 4]);
                if (pc.softcap > 0.0) x = pc.softcap * tanh(x / pc.softcap);
                sv[t] = row < ROWS && t0 + tt < end ? x : -1.0 / 0.0;
                mx = max(mx, sv[t]);
            }
            [[unroll]] for (uint mask = 16; mask < SG; mask *= 2) mx = max(mx, subgroupShuffleXor(mx, mask));
            const float m_new = max(m_row[i], mx);
            const bool none = m_new == -1.0 / 0.0;   // all masked so far: alpha 1, weights 0 (no inf - inf)
            const float alpha = none ? 1.0 : exp(m_row[i] - m_new);
            float sum = 0.0;
            [[unroll]] for (uint t = 0; t < TPL; t++) {
                sv[t] = none ? 0.0 : exp(sv[t] - m_new);
                sum += sv[t];
            }
            [[unroll]] for (uint mask = 16; mask < SG; mask *= 2) sum += subgroupShuffleXor(sum, mask);
            m_row[i] = m_new;
            l_row[i] = l_row[i] * alpha + sum;
            [[unroll]] for (uint t = 0; t < TPL; t += 8) {
                const vec4 a = vec4(sv[t], sv[t + 1], sv[t + 2], sv[t + 3]);
                const vec4 b = vec4(sv[t + 4], sv[t + 5], sv[t + 6], sv[t + 7]);
                const uint at = row * PS + (part * TPL + t) / 8;
                sm[base + PB + at] = uvec4(head11(a), head11(b));
                sm[base + PL + at] = uvec4(tail11(a), tail11(b));
            }
            if (part == 0) {
                [[unroll]] for (uint c = 0; c < 4; c++) sm[base + FB + row * 4 + c] = uvec4(floatBitsToUint(alpha));
            }
        }
        subgroup_sync();
        // (4) the output rescaled, plus the weights times the values
        MAT_ACC(fac);
        LOAD_ACC(fac, base + FB, 4);
        MAT_A(pa);
        MAT_A(pl);
        LOAD_A(pa, base + PB, PS);
        LOAD_A(pl, base + PL, PS);
        [[unroll]] for (uint j = 0; j < FD; j++) {
            MUL(o[j], fac);
            MAT_B(vb);
            LOAD_B(vb, base + VB + 2 * j, DS);
            MMA2(pa, pl, vb, o[j]);
        }
        subgroup_sync();   // every lane is done with the tile before the next is staged over it
    }

    // each subgroup's output (rows of HEAD_SIZE / 4 words, over its keys) and its rows' max and sum; then the
    // subgroups' combined: max m = max_g m_g, weights exp(m_g - m) (0 for a subgroup that saw nothing visible)
    [[unroll]] for (uint j = 0; j < FD; j++) STORE(o[j], base + KB + 4 * j, HEAD_SIZE / 4);
    if (part == 0) {
        [[unroll]] for (uint i = 0; i < RPL; i++) sML[sg * 16 + lane % 16 + i * SG] = vec2(m_row[i], l_row[i]);
    }
    barrier();
    [[unroll]] for (uint j = 0; j < ACC_N; j++) {
        const uint i = tid + j * WG;
        vec4 a = vec4(0.0);
        if (i < PAIRS) {
            const uint r = PAIR_ROW(i), q = PAIR_QUAD(i);
            float m = -1.0 / 0.0;
            [[unroll]] for (uint g = 0; g < NSG; g++) m = max(m, sML[g * 16 + r].x);
            [[unroll]] for (uint g = 0; g < NSG; g++) {
                const float w = m == -1.0 / 0.0 ? 0.0 : exp(sML[g * 16 + r].x - m);
                a += w * uintBitsToFloat(sm[SUB0 + g * PER + KB + r * (HEAD_SIZE / 4) + q]);
            }
        }
        acc[j] = a;
    }
    for (uint r = tid; r < ROWS; r += WG) {
        float m = -1.0 / 0.0, l = 0.0;
        [[unroll]] for (uint g = 0; g < NSG; g++) m = max(m, sML[g * 16 + r].x);
        [[unroll]] for (uint g = 0; g < NSG; g++) l += m == -1.0 / 0.0 ? 0.0 : exp(sML[g * 16 + r].x - m) * sML[g * 16 + r].y;
        sM[r] = m;
        sL[r] = l;
    }
    barrier();   // sM / sL final for every row
}

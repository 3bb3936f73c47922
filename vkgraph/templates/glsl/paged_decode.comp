#version 450
// Decode attention over a paged KV cache: one new query token per sequence, sequences of different lengths.
// A workgroup serves one (partition, KV head, sequence) and all GROUP query heads that share the KV head
// (grouped-query attention), so each key and value is read once per KV head. Two walks of the context: tiles of
// keys and values through shared memory, the invocations split over the query rows (attention_common.glsl), or
// with -DSTREAM keys and values straight into registers, each word loaded and converted once for all the rows,
// in chunks with one softmax step each (decode_stream.glsl); the epilogue below takes either's result.
//
// Cache layout (k and v alike): [num_blocks, num_kv_heads, block_size, HEAD_SIZE], float16 (-DKV_F16) or
// float32, block_size = -DBLOCK_SIZE (a constant, so that positions split into block and offset without a
// division). block_tables[seq, i] is the physical block of the sequence's tokens i*block_size...; any block
// may be shared or in any order. Optional sliding window: only the last `window` positions are visible.
// Split-K: with part_tokens > 0, partition p covers positions [p*pt, (p+1)*pt), pt = part_len(ctx), and writes
// its unnormalised output and (max, sum) to the partial buffers; the last of a (sequence, KV head)'s partitions
// to finish (an arrival counter per pair, zero before the dispatch and set back to zero by that workgroup)
// combines them into the output, so no second kernel and no dependent launch is paid for the split. Partitions
// past the sequence's context do nothing; where one holds positions (or two of a short context), partition 0
// attends the whole context and writes the output as unsplit (live_parts).
//
// -DNEW_KV: the decode step's new token (the last of each context, position ctx - 1) is written here instead of by
// kv_write.comp. `q` is then the rows [B, src_stride] of the fused q/k/v product: queries from column q_off, the
// new key from k_off, its value from v_off; -DROPE rotates queries and key as kv_write.comp does (rotate-half,
// cos/sin [B, HEAD_SIZE / 2] per sequence). The new key and value, as the cache will hold them (float16 rounded
// to nearest even, or float32), are attended at position ctx - 1 from registers, never read back from the cache,
// and the workgroup of the partition that covers ctx - 1 (partition 0 where it walks the whole context) writes
// them at block slot_mapping[seq] / block_size, offset slot_mapping[seq] % block_size: one writer per cache word.
// A negative slot (padding) writes nothing and attends the cache as it is. The slot must be the one the block table
// gives position ctx - 1, and no other sequence of the dispatch may read it.
#define ROWS GROUP
layout(set = 0, binding = 0) readonly buffer Q { float q[]; };  // [B, Hq, D] float32; -DNEW_KV: [B, src_stride]
layout(set = 0, binding = 1) readonly buffer KC { uvec4 kc[]; };
layout(set = 0, binding = 2) readonly buffer VC { uvec4 vc[]; };
layout(set = 0, binding = 3) readonly buffer Tables { int block_tables[]; };  // [B, max_blocks]
layout(set = 0, binding = 4) readonly buffer Lens { int context_lens[]; };    // [B]
layout(set = 0, binding = 5) writeonly buffer Out { float o[]; };           // [B, Hq, D]
// the partitions' outputs, written by each and read by the last to finish: coherent, past the workgroups' caches
layout(set = 0, binding = 6) coherent buffer PartOut { vec4 part_o[]; };  // [B, Hq, max_parts, D / 4]
layout(set = 0, binding = 7) coherent buffer PartML { vec2 part_ml[]; };  // [B, Hq, max_parts] (max, sum)
// -DQ8_OUT: the output written (by the workgroup that finishes it) as the integer matvec's input instead of `o`
// (q8_store.glsl; bound in both modes, as the interface parser does not preprocess)
layout(set = 0, binding = 8) writeonly buffer XQ { uint xq[]; };
layout(set = 0, binding = 9) writeonly buffer XD { float xd[]; };
layout(set = 0, binding = 10) writeonly buffer XS { int xs[]; };
// -DNEW_KV only (else any buffers; the cache's writes go through bindings of their own, so the loads above keep
// their read-only binding)
layout(set = 0, binding = 11) readonly buffer Slots { int slot_mapping[]; };  // [B]
layout(set = 0, binding = 12) readonly buffer Cos { float rope_cos[]; };      // [B, HEAD_SIZE / 2] (-DROPE)
layout(set = 0, binding = 13) readonly buffer Sin { float rope_sin[]; };
layout(set = 0, binding = 14) writeonly buffer KW { uvec4 kw[]; };            // the cache's K buffer
layout(set = 0, binding = 15) writeonly buffer VW { uvec4 vw[]; };            // and its V buffer
// split only: the partitions finished per (sequence, KV head) pair [B, num_kv_heads] (else any buffer, untouched)
layout(set = 0, binding = 16) coherent buffer Arrivals { uint arrivals[]; };

layout(push_constant) uniform Push {
    uint num_kv_heads;
    uint max_blocks;     // block table row length
    float scale;         // softmax scale, usually 1/sqrt(HEAD_SIZE)
    uint window;         // 0: no sliding window
    uint part_tokens;    // 0: one partition per sequence (no split)
    uint max_parts;
    float softcap;       // > 0: scores become softcap * tanh(score / softcap)
    uint src_stride;     // -DNEW_KV: floats per row of q, and where a row's queries, key and value start
    uint q_off;
    uint k_off;
    uint v_off;
} pc;

#ifdef STREAM
#include "decode_stream.glsl"
#else
#define KV_BLOCKS   // kv_block and kv_at below: the block-table entries loaded a tile ahead
#include "attention_common.glsl"
#endif
#include "q8_store.glsl"

uint seq_id() { return gl_WorkGroupID.z; }
uint kv_head() { return gl_WorkGroupID.y; }

uint kv_block(uint pos) { return uint(block_tables[seq_id() * pc.max_blocks + pos / BLOCK_SIZE]); }

uint kv_at(uint block, uint pos) {
    return ((block * pc.num_kv_heads + kv_head()) * BLOCK_SIZE + pos % BLOCK_SIZE) * WORDS_PER_TOKEN;
}

uint kv_word(uint pos) { return kv_at(kv_block(pos), pos); }

// A sequence's split is sized by its own context, not the longest one the dispatch was recorded for (a captured
// decode step serves every length up to its capacity): partitions of the fewest tokens, a multiple of part_tokens
// (the host's least), that cover ctx in max_parts (the grid's partitions). For a context up to max_parts *
// part_tokens that is part_tokens itself.
uint part_len(uint ctx) {
    if (pc.part_tokens == 0) return ctx;   // unsplit (and no division by zero)
    const uint per = (ctx + pc.max_parts - 1) / pc.max_parts;
    return max(1u, (per + pc.part_tokens - 1) / pc.part_tokens) * pc.part_tokens;
}

// The partitions that hold positions of a context of ctx tokens in partitions of pt: those past it do nothing (no
// partial output, no arrival). Two of a context of at most UNSPLIT_MAX tokens are one: partition 0 then walks the
// whole context, since two partitions and their combining cost more there than the second one's tiles (H200: a
// context of two tiles 9.5 us unsplit, 11.2 in two partitions; of four, 10.0 against 10.2). One live partition
// writes the output itself, with no arrival and no combining, as an unsplit dispatch does. One at least, so that an
// empty context writes its zeros.
const uint UNSPLIT_MAX = 128u;
uint live_parts(uint ctx, uint pt) {
    if (pc.part_tokens == 0) return 1u;
    const uint parts = clamp((ctx + pt - 1) / pt, 1u, pc.max_parts);
    return parts <= 2u && ctx <= UNSPLIT_MAX ? 1u : parts;
}

bool visible(uint row, uint pos) { return true; }   // the window is applied through the range

// this workgroup's sequence's partitions (set first in main): their tokens and how many hold positions
uint seq_part_len = 0, seq_parts = 1;

#ifdef NEW_KV
// element e of the head at q[base], with rope rotated as kv_write.comp rotates it (-DROPE)
float element(uint base, uint e, bool rope) {
#ifdef ROPE
    if (rope) {
        const uint half_size = HEAD_SIZE / 2, j = e % half_size, t = seq_id();
        const float c = rope_cos[t * half_size + j], s = rope_sin[t * half_size + j];
        return e < half_size ? q[base + e] * c - q[base + e + half_size] * s
                             : q[base + e] * c + q[base + j] * s;
    }
#endif
    return q[base + e];
}

vec4 element4(uint base, uint e, bool rope) {
    return vec4(element(base, e, rope), element(base, e + 1, rope), element(base, e + 2, rope),
                element(base, e + 3, rope));
}

uvec4 cache_word(uint base, uint e, bool rope) {   // dimensions e... of the head at q[base] as one cache word
#ifdef KV_F16
    const vec4 a = element4(base, e, rope), b = element4(base, e + 4, rope);
    return uvec4(packHalf2x16(a.xy), packHalf2x16(a.zw), packHalf2x16(b.xy), packHalf2x16(b.zw));
#else
    return floatBitsToUint(element4(base, e, rope));
#endif
}

// Word w of the new token's key and value as the cache will hold them, false where the slot is negative (padding:
// nothing written, the cache's words at position ctx - 1 attended). With `writer`, this invocation writes the word
// into the cache if this workgroup's partition covers ctx - 1 (see main): one writer per word.
bool new_words(uint w, bool writer, out uvec4 k, out uvec4 v) {
    k = uvec4(0);
    v = uvec4(0);
    const int slot = slot_mapping[seq_id()];
    if (slot < 0) return false;
    const uint row = seq_id() * pc.src_stride, ctx = new_pos + 1;   // new_pos is ctx - 1 (0xFFFFFFFF where ctx is 0)
    k = cache_word(row + pc.k_off + kv_head() * HEAD_SIZE, w * KV_PER_WORD, true);
    v = cache_word(row + pc.v_off + kv_head() * HEAD_SIZE, w * KV_PER_WORD, false);
    const uint owner = seq_parts > 1 ? new_pos / seq_part_len : 0;   // < seq_parts where they are several
    if (writer && gl_WorkGroupID.x == owner) {
        const uint dst = ((uint(slot) / BLOCK_SIZE * pc.num_kv_heads + kv_head()) * BLOCK_SIZE
                          + uint(slot) % BLOCK_SIZE) * WORDS_PER_TOKEN + w;
        kw[dst] = k;
        vw[dst] = v;
    }
    return true;
}

#ifndef STREAM
// new_k/new_v (attention_common.glsl): word w (this invocation) of the new token's key and value, as new_words
// makes them; where the slot is negative, the cache's own words at position ctx - 1.
void new_token() {
    const uint w = gl_LocalInvocationID.x;
    if (w >= WORDS_PER_TOKEN) return;
    if (!new_words(w, true, new_k, new_v) && new_pos != 0xFFFFFFFFu) {
        const uint g = kv_word(new_pos) + w;
        new_k = kc[g];
        new_v = vc[g];
    }
}
#endif
#endif

vec4 q_at(uint row, uint e) {
#ifdef NEW_KV
    return pc.scale * element4(seq_id() * pc.src_stride + pc.q_off + (kv_head() * GROUP + row) * HEAD_SIZE, e,
                                true);
#else
    const uint base = ((seq_id() * pc.num_kv_heads + kv_head()) * GROUP + row) * HEAD_SIZE + e;
    return pc.scale * vec4(q[base], q[base + 1], q[base + 2], q[base + 3]);
#endif
}

shared uint sLast;

// Whether this workgroup is the last of its pair's `parts` partitions to finish, once its partial output is written;
// that one sets the pair's counter back to zero (every partition has arrived) and sees the others' partial outputs.
bool last_arrival(uint parts) {
    memoryBarrierBuffer();
    barrier();
    if (gl_LocalInvocationID.x == 0) {
        const uint pair = seq_id() * pc.num_kv_heads + kv_head();
        const bool last = atomicAdd(arrivals[pair], 1u) == parts - 1u;
        if (last) arrivals[pair] = 0u;
        sLast = last ? 1u : 0u;
    }
    barrier();
    memoryBarrierBuffer();
    return sLast != 0u;
}

// PARTS_AHEAD (the host's MAX_PARTS): partitions whose loads are issued together, one memory round trip for all

// Dimensions 4q... of the query row whose partitions start at entry `row` of part_ml (and row * HEAD_SIZE / 4 of
// part_o), combined over the partitions that hold tokens: sum_p w_p o_p / sum_p w_p l_p with
// w_p = exp(m_p - max m), in one pass over the partitions, PARTS_AHEAD at a time, the running sums rescaled when a
// larger maximum comes (the online softmax's step); partitions that saw no visible token carry m = -inf and weigh
// nothing. The round trips, not the arithmetic, are the cost: this runs after every other workgroup of the pair.
vec4 combine_parts(uint row, uint q, uint parts) {
    float m = -1.0 / 0.0, l = 0.0;
    vec4 v = vec4(0.0);
    for (uint p0 = 0; p0 < parts; p0 += PARTS_AHEAD) {
        vec2 ml[PARTS_AHEAD];
        vec4 x[PARTS_AHEAD];
        [[unroll]] for (uint k = 0; k < PARTS_AHEAD; k++) {   // the loads first, then their sums
            const uint p = p0 + k;
            ml[k] = p < parts ? part_ml[row + p] : vec2(-1.0 / 0.0, 0.0);
            x[k] = p < parts ? part_o[(row + p) * (HEAD_SIZE / 4) + q] : vec4(0.0);
        }
        float mc = m;
        [[unroll]] for (uint k = 0; k < PARTS_AHEAD; k++) mc = max(mc, ml[k].x);
        if (mc == -1.0 / 0.0) continue;   // nothing visible yet
        const float s = exp(m - mc);   // 0 while m is -inf
        l *= s;
        v *= s;
        [[unroll]] for (uint k = 0; k < PARTS_AHEAD; k++) {
            const float w = exp(ml[k].x - mc);
            l += w * ml[k].y;
            v += w * x[k];
        }
        m = mc;
    }
    return l > 0.0 ? v / l : vec4(0.0);
}

void main() {
    const uint ctx = uint(context_lens[seq_id()]);
    const uint part = gl_WorkGroupID.x;
    seq_part_len = part_len(ctx);
    seq_parts = live_parts(ctx, seq_part_len);
    if (part >= seq_parts) return;   // the whole workgroup, before any barrier
    uint begin = 0, end = ctx;
    if (seq_parts > 1) {
        begin = min(part * seq_part_len, ctx);
        end = min(begin + seq_part_len, ctx);
    }
    if (pc.window > 0 && ctx > pc.window) begin = max(begin, ctx - pc.window);
#ifdef NEW_KV
    new_pos = ctx - 1;   // attend takes it from new_token(), not the cache
#endif
    attend(begin, max(begin, end));

    const uint tid = gl_LocalInvocationID.x;
    const uint head0 = (seq_id() * pc.num_kv_heads + kv_head()) * GROUP;
    if (seq_parts > 1) {   // uniform in the workgroup: its sequence's context
        [[unroll]] for (uint j = 0; j < ACC_N; j++) {
            const uint i = tid + j * WG;
            if (i < PAIRS) {
                const uint r = PAIR_ROW(i);
                part_o[((head0 + r) * pc.max_parts + part) * (HEAD_SIZE / 4) + PAIR_QUAD(i)] = acc[j];
            }
        }
        for (uint r = tid; r < ROWS; r += WG) part_ml[(head0 + r) * pc.max_parts + part] = vec2(sM[r], sL[r]);
        if (!last_arrival(seq_parts)) return;
        [[unroll]] for (uint j = 0; j < ACC_N; j++) {
            const uint i = tid + j * WG;
            if (i < PAIRS) {
                acc[j] = combine_parts((head0 + PAIR_ROW(i)) * pc.max_parts, PAIR_QUAD(i), seq_parts);
            }
        }
    } else {
        [[unroll]] for (uint j = 0; j < ACC_N; j++) {
            const uint i = tid + j * WG;
            if (i < PAIRS) {
                const float l = sL[PAIR_ROW(i)];
                acc[j] = l > 0.0 ? acc[j] / l : vec4(0.0);
            }
        }
    }
    // acc[j]: the output of pair tid + j * WG (row PAIR_ROW, 4 dimensions from 4 * PAIR_QUAD)
    [[unroll]] for (uint j = 0; j < ACC_N; j++) {
        const uint i = tid + j * WG;
        if (i < PAIRS) {
#ifdef Q8_OUT
            // the queries are consumed: sQ holds the output rows (row-major) for their quantization
            sQ[PAIR_AT(i)] = acc[j];
#else
            const uint base = head0 * HEAD_SIZE + 4 * PAIR_AT(i);
            o[base] = acc[j].x;
            o[base + 1] = acc[j].y;
            o[base + 2] = acc[j].z;
            o[base + 3] = acc[j].w;
#endif
        }
    }
#ifdef Q8_OUT
    barrier();
    for (uint blk = tid; blk < ROWS * HEAD_SIZE / 32; blk += WG) {
        vec4 v[8];
        [[unroll]] for (uint i = 0; i < 8; i++) v[i] = sQ[blk * 8 + i];
        store_q8_block(head0 * (HEAD_SIZE / 32) + blk, v);
    }
#endif
}

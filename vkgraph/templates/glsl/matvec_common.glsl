// The body shared by every matvec template: y[b, row] = sum_k W[row, k] * x[b, k] (+ bias[row]) (+ res[b, row]).
//
// A workgroup owns ROWS consecutive rows; its WG invocations stride over the row's "units" (one 16-byte load
// of weight data plus its scales), so neighbouring invocations read neighbouring 16-byte words and every
// weight byte is read once. Per unit an invocation first issues the loads of all ROWS rows (ROWS independent
// 16-byte loads in flight), then loads the unit's activations once per batch row and reuses them for every
// weight row: the activations (4 or 8 bytes per weight byte for the 8- and 4-bit formats, read through L1
// with a stride between invocations) are what bounded the kernel when they were reloaded per row.
// A unit covers RUNS runs of RUN contiguous activations. Run by run, the weights of all ROWS rows are decoded
// once and then used for every activation row: decoding is most of the work, and redoing it per activation
// row made a batch of 8 cost nearly 8 batches of 1. Each run contributes c * dot(levels, x) + m * sum(x):
// the format folds its offsets (-8d for Q4_0, ...) into m instead of subtracting them per element.
// With UNROLL > 1 an invocation issues the loads of UNROLL rounds of WG units (of all ROWS rows) before decoding
// any, where a row is long enough to have them. The per-invocation sums are reduced with subgroupAdd
// (USE_SUBGROUP; a workgroup of one subgroup then needs no shared memory and no barrier) or a shared-memory tree.
//
// The format file defines RUN, RUNS, UNIT_ELEMS, HAS_OFFSET, HAS_MIN (INT_DOT, below), IQ4_TABLE where it looks
// levels up in common.glsl's shared tables, UNIT_COEFFS where every run of a unit has the same (c, m) and lies in
// one block of 32 activations (-DFOLD, below), and `struct Unit` (a unit's raw words), then
//   Unit load_unit(uint row, uint u)                   the loads of unit u of `row`
//   uint x_run(uint u, uint j)                         the first element of run j of unit u
//   vec4 run_levels(Unit q, uint j, uint i)            weights 4i..4i+3 of run j, each possibly times a power
//                                                      of two that x_factor(j) undoes
//   vec4 x_factor(uint j)                              per-lane factors for run j's activations
//   vec2 run_coeffs(Unit q, uint u, uint j)            (c, m) of run j (m is read only when HAS_OFFSET)
// Activations: float32, or float16 with -DA_F16. Output, bias and residual are float32.
//
// -DINT_DOT: the activations come quantized to int8 per block of 32 (quantize_q8.comp: `x` holds 16 int8 per
// uvec4, `xd` the blocks' scales, `xsum` the int8 sums of each half block, i.e. of each run) and each run's
// dot product is integer dot products of four int8 lanes (SPV_KHR_integer_dot_product), from the format's
//   int run_idot(Unit q, uint j, uvec4 xq, int xs)   dot(levels of run j, the run's 16 int8 activations xq),
//                                                    a constant offset of the stored levels taken off through
//                                                    their sum xs, exactly, in integers
// and the same (c, m) as the float path: run j adds xd * c * run_idot, plus xd * m * xs where the format's m
// is a minimum of its own (HAS_MIN: Q4_K). This computes W times the int8-quantized activations, as
// llama.cpp's integer path does. Two options of the integer path, launch parameters measured per activation rows:
// -DFOLD (UNIT_COEFFS formats) sums a unit's runs as integers before its one scale, and -DSTAGE_X (subgroup-rows
// launch) reads the activations from a copy in shared memory (both described where they are used). -DNORM_X (with
// STAGE_X): the activations come as float32 rows that the kernel normalizes (RMSNorm) and quantizes itself.
//
// -DEXPERT_IDS (mul_mat_id): `w` holds n_experts matrices of n_rows rows each, stacked; pair p of n_pairs
// computes y[p] = W[ids[p]] x[p / x_div] (NB = 1, no bias or residual). The weight row and its scale row are
// offset by ids[p] * n_rows through the row passed to load_unit, so every format gets it. The binding and
// push constants are declared in both modes (the interface parser does not preprocess); plain dispatches
// bind `w` there.
//
// -DGLU_Q8 (the subgroup-rows launch; with -DGELU_TANH for GeGLU): the product is a stacked gate/up matrix (rows
// 0..F gate, F..2F up, n_rows = 2F, F % 32 == 0) and the epilogue writes the down product's int8 activations
// h = act(gate) * up instead of y, as glu_q8.comp writes them from y (glu_act.glsl, q8_lanes.glsl: the same
// arithmetic). Workgroup j owns block j of h's columns: its WG / TPR groups of ROWS rows (the host makes them
// 64 rows) take gate rows 32j.. 32j + 31 then up rows F + 32j .., their sums meet in shared memory, and 8
// invocations per block of each activation row quantize it into the bindings GluQ, GluD and GluS (Q8Acts).
#extension GL_KHR_shader_subgroup_arithmetic : enable
#extension GL_KHR_shader_subgroup_shuffle : enable   // SG_ROWS
#include "common.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128;          // invocations per workgroup (a power of two)
layout(constant_id = 1) const uint ROWS = 2;          // rows per workgroup
layout(constant_id = 2) const uint NB = 1;            // activation rows (1..8)
layout(constant_id = 3) const bool USE_SUBGROUP = false;  // subgroupAdd is available ("arithmetic")
layout(constant_id = 4) const bool HAS_BIAS = false;
layout(constant_id = 5) const bool HAS_RESIDUAL = false;
layout(constant_id = 6) const uint SUBGROUP = 32;     // the device's subgroup size, for the shared scratch
layout(constant_id = 7) const float EPS = 0.0;        // NORM_X: the norm's epsilon

#if defined(INT_DOT) && !defined(NORM_X)
#define XVEC uvec4
#elif defined(A_F16)
#define XVEC uvec2
#else
#define XVEC vec4
#endif

layout(set = 0, binding = 0) readonly buffer Weights { uvec4 w[]; };
layout(set = 0, binding = 1) readonly buffer Scales { uint s[]; };
layout(set = 0, binding = 2) readonly buffer X { XVEC x[]; };
layout(set = 0, binding = 3) buffer Y { float y[]; };
layout(set = 0, binding = 4) readonly buffer Bias { float bias[]; };
layout(set = 0, binding = 5) readonly buffer Residual { float res[]; };
layout(set = 0, binding = 6) readonly buffer Ids { uint ids[]; };
layout(set = 0, binding = 7) readonly buffer XD { float xd[]; };   // INT_DOT: activation block scales (NORM_X: g)
layout(set = 0, binding = 8) readonly buffer XSum { int xsum[]; }; // INT_DOT: int8 sums per 16 activations
layout(set = 0, binding = 9) writeonly buffer GluQ { uint glu_q[]; };   // GLU_Q8: h's int8 values (else: y, unwritten)
layout(set = 0, binding = 10) writeonly buffer GluD { float glu_d[]; }; // GLU_Q8: h's block scales
layout(set = 0, binding = 11) writeonly buffer GluS { int glu_s[]; };   // GLU_Q8: h's half-block int8 sums

layout(push_constant) uniform Push {
    uint n_rows;      // N
    uint k;           // K (elements per row)
    uint w_stride;    // uvec4 words per row in `w`
    uint s_stride;    // scale entries (float16) per row in `s`
    uint groups_x;    // workgroups along x (rows are spread over x and y: x is capped at 65535)
    uint n_pairs;     // EXPERT_IDS: (token, slot) pairs
    uint x_div;       // EXPERT_IDS: pairs per activation row (a token's k slots share its x; 1: x per pair)
    uint n_experts;   // EXPERT_IDS: matrices stacked in `w` (ids are clamped to them)
} pc;

#ifdef EXPERT_IDS
uint pair, x_row0;  // this workgroup's pair and its activation row, set first in main
#define X_ROW(b) (x_row0 + (b))
#define Y_ROW(b) (pair + (b))
#else
#define X_ROW(b) (b)
#define Y_ROW(b) (b)
#endif

#ifndef INT_DOT
vec4 load_x4(uint b, uint e) {   // four activations of row b from element e (e % 4 == 0)
#ifdef A_F16
    return unpack_half4(x[(X_ROW(b) * pc.k + e) >> 2]);
#else
    return x[(X_ROW(b) * pc.k + e) >> 2];
#endif
}
#endif

float scale_at(uint row, uint i) {  // float16 scale i of `row` in the scales array
    uint idx = row * pc.s_stride + i;
    return half_at_u32(s[idx >> 1], idx);
}

uint half_bits(uint row, uint i) {  // the raw 16 bits of entry i of `row` in the scales array
    const uint idx = row * pc.s_stride + i;
    return (s[idx >> 1] >> (16u * (idx & 1u))) & 0xFFFFu;
}

Unit load_unit(uint row, uint u);
uint x_run(uint u, uint j);
vec2 run_coeffs(Unit q, uint u, uint j);
#ifdef INT_DOT
int run_idot(Unit q, uint j, uvec4 xq, int xs);
#else
vec4 run_levels(Unit q, uint j, uint i);
vec4 x_factor(uint j);
#endif

#ifdef NORM_X
float nf[NB];   // per activation row: the factor its blocks' products take (norm_finish)
#endif

float finished(float v, uint b) {   // a whole sum of activation row b (NORM_X: times the row's factor)
#ifdef NORM_X
    return v * nf[b];
#else
    return v;
#endif
}

void store(uint row0, uint i, float v) {  // the epilogue for partial sum i = r * NB + b
    const uint b = i % NB, row = row0 + i / NB;
    if (row >= pc.n_rows) return;
    v = finished(v, b);
    if (HAS_BIAS) v += bias[row];
    if (HAS_RESIDUAL) v += res[b * pc.n_rows + row];
    y[Y_ROW(b) * pc.n_rows + row] = v;
}

#ifndef SG_ROWS
shared float red[(USE_SUBGROUP ? (WG + SUBGROUP - 1) / SUBGROUP : WG) * ROWS * NB];   // the workgroup reduction's
#endif

// -DSG_ROWS (the subgroup-rows launch): TPR invocations (a power of two, at most the device's smallest subgroup,
// so a group never straddles two subgroups) own ROWS rows; a workgroup holds WG / TPR such groups. Each
// invocation first issues the loads of UNROLL units of all ROWS rows (UNROLL * ROWS independent 16-byte loads
// in flight), then decodes them; the group's partial sums meet through subgroupShuffleXor, with no shared
// memory and no barrier. Many small groups per workgroup keep the SMs full at 4096-row shapes, where a
// workgroup per row block and its barrier left most of the memory system idle.
#ifndef TPR
#define TPR 1
#endif
#ifndef UNROLL
#define UNROLL 1
#endif
#if defined(SG_ROWS) && defined(EXPERT_IDS)
#error "the subgroup-rows launch has no expert-indexed form"
#endif
#if defined(STAGE_X) && !(defined(SG_ROWS) && defined(INT_DOT))
#error "STAGE_X is a form of the subgroup-rows launch's integer path"
#endif
#if defined(GLU_Q8) && !defined(SG_ROWS)
#error "GLU_Q8 is an epilogue of the subgroup-rows launch"
#endif

#if defined(GLU_Q8) || defined(NORM_X)
#define Q8_PART_ONLY
#include "q8_lanes.glsl"
#endif
#ifdef GLU_Q8
#include "glu_act.glsl"
shared float glu_sums[64 * NB];   // the workgroup's sums: [gate rows 0..31, up rows 0..31][activation row]

// after every group has put its sums in glu_sums: block `blk` of h's columns for every activation row, one vec4
// of h per slot (8 to a block), all slots taking part in the exchange
void glu_store(uint blk, bool live) {
    const uint blocks = pc.n_rows / 64;   // of one activation row of h
    for (uint e0 = 0; e0 < NB * 8; e0 += WG) {
        const uint e = e0 + lane_slot(), b = e / 8, part = e % 8;
        const bool valid = live && e < NB * 8;
        vec4 h = vec4(0.0);
        if (valid) {
            vec4 g, u;
            [[unroll]] for (uint j = 0; j < 4; j++) {
                g[j] = glu_sums[(4 * part + j) * NB + b];
                u[j] = glu_sums[(32 + 4 * part + j) * NB + b];
            }
            h = glu_act(g) * u;
        }
        const Q8Part p = q8_part(h);
        if (valid) {
            const uint ob = b * blocks + blk;   // the block's index in the rows of h
            glu_q[ob * 8 + part] = p.word;
            if (part == 0) glu_d[ob] = p.d;
            if (part % 4 == 0) glu_s[2 * ob + part / 4] = p.half_sum;
        }
    }
}
#endif
#if defined(NORM_X) && !defined(STAGE_X)
#error "NORM_X stages the normalized activations (STAGE_X)"
#endif

float acc[ROWS * NB];
Unit q[UNROLL * ROWS];   // the units in flight: q[t * ROWS + r] is unit t of row r

// The integer path's activations: 16 int8 from element e of activation row b (e % 16 == 0), the scale of
// e's block of 32, the int8 sum of e's 16, from the global buffers or from the chunk staged in shared memory.
#ifdef INT_DOT
#ifdef STAGE_X
// -DSTAGE_X (the subgroup-rows launch): per round of TPR * UNROLL units, the workgroup first copies the NB rows'
// activations of those units into shared memory (consecutive invocations, consecutive 16-byte words), then every
// group reads them there: the WG / TPR groups of a workgroup read the same activations, which each of them
// otherwise loaded from global memory through L1 with its lanes a unit apart. A block of 32 keeps its scale and
// its two half sums in one 16-byte record, one load for a unit of the UNIT_COEFFS formats under FOLD. The host
// checks that a round's units cover SX_ELEMS consecutive elements (whole super-blocks) and that the arrays fit.
const uint SX_ELEMS = TPR * UNROLL * UNIT_ELEMS;   // elements of one round, per activation row
shared uvec4 sxq[((NB * (SX_ELEMS / 16) + 1) / 2) * 2];   // even: sq_at swaps neighbours
shared uvec4 sxm[NB * (SX_ELEMS / 32)];   // per block: (float bits of the scale, sum of 0..15, of 16..31, 0)
uint x0;   // the round's first element
// word i's place: lanes reading every other word (two runs per unit) spread over all banks, not half of them
uint sq_at(uint i) { return i ^ ((i >> 3) & 1u); }
uvec4 load_xq(uint b, uint e) { return sxq[sq_at(b * (SX_ELEMS / 16) + ((e - x0) >> 4))]; }
uvec4 load_rec(uint b, uint e) { return sxm[b * (SX_ELEMS / 32) + ((e - x0) >> 5)]; }
float load_xd(uint b, uint e) { return uintBitsToFloat(load_rec(b, e).x); }
int load_xs(uint b, uint e) { return int(load_rec(b, e)[1 + ((e >> 4) & 1u)]); }

#ifdef NORM_X
// -DNORM_X: x holds the float32 rows and xd the norm's weight g [K]; the activations are y = x * g / rms(x) with
// rms(x) = sqrt(mean(x^2) + EPS), quantized per block of 32 as rmsnorm_q8 writes them. The quantization of a block
// does not change when the block is scaled (the int8 values of c * y are those of y, the scale c times y's), so
// each round stages the blocks of t * g, t = x * 2^-e (exactly), and the row's 1 / rms and 2^e scale only the
// finished sums (nf, applied by store). First a pass over the whole row finds its largest |x| and with it e, so
// that |t| <= 4: the sum of t^2 neither overflows (rows whose squares overflow float32) nor vanishes (tiny rows),
// and t * g stays finite where x * g would not. Every workgroup does this for its rows' whole K (from L2).
shared float nred[NB * (WG / 8)];   // per activation row and subgroup (at least 8 lanes): largest |x|, later sum t^2
#ifndef SUBGROUP_SHUFFLE
#error "NORM_X meets a block's 8 lanes through subgroup shuffles"
#endif
float nscale[NB];   // 2^-e per activation row
float nss[NB];   // this invocation's sum of t^2 per activation row (`precise` where added, see norm_round: on the
                 // array itself lavapipe lost its values)

// each subgroup's largest |x| per activation row into nred (read after a barrier)
void row_max_pass() {
    float m[NB];
    [[unroll]] for (uint b = 0; b < NB; b++) m[b] = 0.0;
    for (uint i = lane_slot(); i < pc.k / 4; i += WG) {
        [[unroll]] for (uint b = 0; b < NB; b++) {
            const vec4 a = abs(x[X_ROW(b) * (pc.k / 4) + i]);
            m[b] = max(m[b], max(max(a.x, a.y), max(a.z, a.w)));
        }
    }
    [[unroll]] for (uint b = 0; b < NB; b++) {
        const float v = subgroupMax(m[b]);
        if (gl_SubgroupInvocationID == 0) nred[b * (WG / 8) + gl_SubgroupID] = v;
    }
}

// the rows' scales from their largest |x| (after row_max_pass and a barrier)
void norm_scales() {
    [[unroll]] for (uint b = 0; b < NB; b++) {
        float m = 0.0;
        for (uint g = 0; g < gl_NumSubgroups; g++) m = max(m, nred[b * (WG / 8) + g]);
        int e;
        frexp(m, e);   // m = f * 2^e, 0.5 <= f < 1
        // clamped so that 2^-e and 2^e are normal floats: rows past 2^126 then scale to within 4, and subnormal rows
        // scale up by 2^126 exactly; a row of zeros (or of infinities or NaN, which then propagate) is not scaled
        e = m > 0.0 && m <= 3.4028235e38 ? clamp(e, -126, 126) : 0;
        nscale[b] = ldexp(1.0, -e);
        nss[b] = 0.0;
    }
}

// stage the round from element x0 as int8 blocks of t * g: piece p (4 elements) of a row is slot p % WG's, the 8
// pieces of a block 8 lanes of one subgroup (q8_lanes.glsl with SUBGROUP_SHUFFLE, which the host sets), which meet
// its largest |t * g| and half sums as every writer of int8 blocks does (q8_part)
void norm_round() {
    const uint slot = lane_slot();
    for (uint p0 = 0; p0 < SX_ELEMS / 4; p0 += WG) {   // the same trips in every invocation: all take part
        const uint p = p0 + slot, e = x0 + 4 * p;
        const bool valid = p < SX_ELEMS / 4 && e < pc.k;   // whole blocks either way (K % 32 == 0)
        const vec4 g = valid ? vec4(xd[e], xd[e + 1], xd[e + 2], xd[e + 3]) : vec4(0.0);
        [[unroll]] for (uint b = 0; b < NB; b++) {
            // `precise`: t is x times a power of two; a compiler that moved the scale out of the squares (2^-2e
            // underflows or overflows float32) would sum zeros or infinities
            precise const vec4 t = valid ? x[(X_ROW(b) * pc.k + e) / 4] * nscale[b] : vec4(0.0);
            precise const float sq = dot(t, t);
            nss[b] += sq;
            const Q8Part q = q8_part(t * g);
            const int h_next = subgroupShuffleXor(q.half_sum, 4u);   // the other half's sum
            if (valid) {
                sxq[sq_at(b * (SX_ELEMS / 16) + p / 4)][p % 4] = q.word;
                if (p % 8 == 0) sxm[b * (SX_ELEMS / 32) + p / 8] = uvec4(floatBitsToUint(q.d), q.half_sum, h_next, 0);
            }
        }
    }
}

// after the last round: each row's factor nf = 2^e / rms(x) = 1 / sqrt(mean(t^2) + EPS * 2^-2e), or where EPS * 2^-2e
// overflows (a row far below EPS's scale) 2^e / sqrt(2^2e * mean(t^2) + EPS)
void norm_finish() {
    [[unroll]] for (uint b = 0; b < NB; b++) {
        const float v = subgroupAdd(nss[b]);
        if (gl_SubgroupInvocationID == 0) nred[b * (WG / 8) + gl_SubgroupID] = v;   // nred's maxima all read by now
    }
    barrier();
    [[unroll]] for (uint b = 0; b < NB; b++) {
        float ss = 0.0;
        for (uint g = 0; g < gl_NumSubgroups; g++) ss += nred[b * (WG / 8) + g];
        const float mean = ss / float(pc.k), s = nscale[b], big = 1.0 / s;
        precise const float es = EPS * s * s;
        nf[b] = isinf(es) ? big * inversesqrt(big * big * mean + EPS) : inversesqrt(mean + es);
    }
}
#endif

// copy the round from element x0 (pieces past K are left as they are: no unit reads them)
void stage_round(uint tid) {
#ifdef NORM_X
    norm_round();
#else
    const uint pieces = min(SX_ELEMS, pc.k - x0) / 16;   // 16-element pieces per row (K % 32 == 0)
    for (uint i = tid; i < NB * (SX_ELEMS / 16); i += WG) {
        const uint b = i / (SX_ELEMS / 16), p = i % (SX_ELEMS / 16);
        if (p < pieces) sxq[sq_at(i)] = x[(X_ROW(b) * pc.k + x0) / 16 + p];
    }
    for (uint i = tid; i < NB * (SX_ELEMS / 32); i += WG) {
        const uint b = i / (SX_ELEMS / 32), p = i % (SX_ELEMS / 32);
        if (p < pieces / 2) {
            const uint g = (X_ROW(b) * pc.k + x0) / 32 + p;
            const uvec2 hs = HAS_OFFSET ? uvec2(xsum[2 * g], xsum[2 * g + 1]) : uvec2(0);
            sxm[i] = uvec4(floatBitsToUint(xd[g]), hs, 0);
        }
    }
#endif
}
#else
uvec4 load_xq(uint b, uint e) { return x[(X_ROW(b) * pc.k + e) >> 4]; }
float load_xd(uint b, uint e) { return xd[(X_ROW(b) * pc.k + e) >> 5]; }
int load_xs(uint b, uint e) { return xsum[(X_ROW(b) * pc.k + e) >> 4]; }
#endif
#endif
#if defined(FOLD) && !(defined(INT_DOT) && defined(UNIT_COEFFS))
#error "FOLD needs the integer path and a format whose runs share their coefficients (UNIT_COEFFS)"
#endif

// add unit u, held in q[base .. base + ROWS), to the partial sums of every (row, activation row)
void accumulate(uint base, uint u) {
#if defined(FOLD)
    // -DFOLD: the format's runs share (c, m) and one activation block (UNIT_COEFFS), so the runs' integer dot
    // products (offsets included) add up as integers and each (row, activation row) takes one conversion and
    // one scale per unit instead of one per run
    vec2 cm[ROWS];
    [[unroll]] for (uint r = 0; r < ROWS; r++) cm[r] = run_coeffs(q[base + r], u, 0);
    [[unroll]] for (uint b = 0; b < NB; b++) {
        uvec4 xq[RUNS];
        int xs[RUNS];
        int xsu = 0;   // the unit's int8 sum (HAS_MIN)
#ifdef STAGE_X
        const uvec4 rec = load_rec(b, x_run(u, 0));   // the unit's one block: scale and both half sums at once
        const float dx = uintBitsToFloat(rec.x);
#else
        const float dx = load_xd(b, x_run(u, 0));
#endif
        [[unroll]] for (uint j = 0; j < RUNS; j++) {
            const uint e = x_run(u, j);
            xq[j] = load_xq(b, e);
#ifdef STAGE_X
            xs[j] = HAS_OFFSET ? int(rec[1 + ((e >> 4) & 1u)]) : 0;
#else
            xs[j] = HAS_OFFSET ? load_xs(b, e) : 0;
#endif
            xsu += xs[j];
        }
        [[unroll]] for (uint r = 0; r < ROWS; r++) {
            int d = 0;
            [[unroll]] for (uint j = 0; j < RUNS; j++) d += run_idot(q[base + r], j, xq[j], xs[j]);
            const float t = cm[r].x * float(d);
            acc[r * NB + b] += dx * (HAS_MIN ? t + cm[r].y * float(xsu) : t);
        }
    }
#elif defined(INT_DOT)
    [[unroll]] for (uint j = 0; j < RUNS; j++) {
        vec2 cm[ROWS];
        [[unroll]] for (uint r = 0; r < ROWS; r++) cm[r] = run_coeffs(q[base + r], u, j);
        const uint e = x_run(u, j);
        [[unroll]] for (uint b = 0; b < NB; b++) {
            const uvec4 xq = load_xq(b, e);
            const float dx = load_xd(b, e);
            const int xs = HAS_OFFSET ? load_xs(b, e) : 0;
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
                const float t = cm[r].x * float(run_idot(q[base + r], j, xq, xs));
                acc[r * NB + b] += dx * (HAS_MIN ? t + cm[r].y * float(xs) : t);
            }
        }
    }
#else
    [[unroll]] for (uint j = 0; j < RUNS; j++) {
        vec4 wv[ROWS * (RUN / 4)];  // run j of every row, decoded once for all activation rows
        vec2 cm[ROWS];
        [[unroll]] for (uint r = 0; r < ROWS; r++) {
            cm[r] = run_coeffs(q[base + r], u, j);
            [[unroll]] for (uint i = 0; i < RUN / 4; i++) wv[r * (RUN / 4) + i] = run_levels(q[base + r], j, i);
        }
        const uint e = x_run(u, j);
        [[unroll]] for (uint b = 0; b < NB; b++) {
            vec4 xv[RUN / 4];
            vec4 s4 = vec4(0.0);
            [[unroll]] for (uint i = 0; i < RUN / 4; i++) {
                const vec4 v = load_x4(b, e + 4 * i);
                s4 += v;
                xv[i] = v * x_factor(j);
            }
            const float xs = HAS_OFFSET ? hsum(s4) : 0.0;
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
                vec4 d4 = vec4(0.0);
                [[unroll]] for (uint i = 0; i < RUN / 4; i++) d4 += wv[r * (RUN / 4) + i] * xv[i];
                acc[r * NB + b] += cm[r].x * hsum(d4) + (HAS_OFFSET ? cm[r].y * xs : 0.0);
            }
        }
    }
#endif
}

void main() {
#ifdef IQ4_TABLE
    iq4_init_tables();  // a barrier: before the grid padding's return
#endif
    const uint tid = gl_LocalInvocationID.x;
    const uint wg_linear = gl_WorkGroupID.y * pc.groups_x + gl_WorkGroupID.x;
#ifdef EXPERT_IDS
    // pairs vary fastest, so neighbouring workgroups read the same rows, of the same expert when pairs share it
    if (wg_linear >= pc.n_pairs * ((pc.n_rows + ROWS - 1) / ROWS)) return;  // grid padding (whole workgroups)
    pair = wg_linear % pc.n_pairs;
    x_row0 = pair / pc.x_div;
    const uint row0 = (wg_linear / pc.n_pairs) * ROWS;
    const uint wrow0 = min(ids[pair], pc.n_experts - 1) * pc.n_rows;
#elif defined(SG_ROWS) && defined(GLU_Q8)
    // the group's first of the workgroup's 64 rows: gate rows of block wg_linear, then its up rows
    const uint lane = tid % TPR, lrow0 = (tid / TPR) * ROWS, f = pc.n_rows / 2;
    const bool glu_live = wg_linear < f / 32;   // not grid padding
    const uint row0 = !glu_live ? pc.n_rows : (lrow0 < 32 ? 0 : f - 32) + wg_linear * 32 + lrow0;
    const uint wrow0 = 0;
#elif defined(SG_ROWS)
    const uint lane = tid % TPR;
    const uint row0 = (wg_linear * (WG / TPR) + tid / TPR) * ROWS;
    const uint wrow0 = 0;
#else
    const uint row0 = wg_linear * ROWS;
    const uint wrow0 = 0;
#endif
    const uint units = pc.k / UNIT_ELEMS;

    [[unroll]] for (uint i = 0; i < ROWS * NB; i++) acc[i] = 0.0;

#if defined(SG_ROWS) && defined(STAGE_X)
    // rounds of TPR * UNROLL units for the whole workgroup (the barriers need every group in every round): the
    // weight loads first, in flight while the round's activations are staged
    const bool live = row0 < pc.n_rows;   // a group past the last row stages and joins the sums only
    for (uint c0 = 0; c0 < units; c0 += TPR * UNROLL) {
        if (live) {
            [[unroll]] for (uint t = 0; t < UNROLL; t++) {
                const uint u = min(c0 + lane + t * TPR, units - 1);
                [[unroll]] for (uint r = 0; r < ROWS; r++) {
                    q[t * ROWS + r] = load_unit(min(row0 + r, pc.n_rows - 1), u);
                }
            }
        }
#ifdef NORM_X
        if (c0 == 0) row_max_pass();   // the first round's weights in flight meanwhile
#endif
        barrier();   // every group is done with the previous round
#ifdef NORM_X
        if (c0 == 0) norm_scales();
#endif
        x0 = c0 * UNIT_ELEMS;
        stage_round(tid);
        barrier();
        if (live) {
            [[unroll]] for (uint t = 0; t < UNROLL; t++) {
                if (c0 + lane + t * TPR < units) accumulate(t * ROWS, c0 + lane + t * TPR);
            }
        }
    }
#ifdef NORM_X
    norm_finish();
#endif
#elif defined(SG_ROWS)
    const uint group_units = row0 < pc.n_rows ? units : 0;   // a group past the last row only joins the sums
    for (uint u0 = lane; u0 < group_units; u0 += TPR * UNROLL) {
        [[unroll]] for (uint t = 0; t < UNROLL; t++) {
            const uint u = min(u0 + t * TPR, units - 1);   // past the row's end: a repeat, loaded but not added
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
                q[t * ROWS + r] = load_unit(min(row0 + r, pc.n_rows - 1), u);  // clamped rows compute, never store
            }
        }
        [[unroll]] for (uint t = 0; t < UNROLL; t++) {
            if (u0 + t * TPR < units) accumulate(t * ROWS, u0 + t * TPR);
        }
    }
#endif
#ifdef SG_ROWS
    // a butterfly over the group's TPR lanes leaves every lane with the same sum; lane i % TPR stores sum i
    [[unroll]] for (uint i = 0; i < ROWS * NB; i++) {
        float v = acc[i];
        [[unroll]] for (uint m = TPR / 2; m > 0; m >>= 1) v += subgroupShuffleXor(v, m);
#ifdef GLU_Q8
        if (lane == i % TPR) glu_sums[lrow0 * NB + i] = finished(v, i % NB);
#else
        if (lane == i % TPR) store(row0, i, v);
#endif
    }
#ifdef GLU_Q8
    barrier();
    glu_store(wg_linear, glu_live);
#endif
#else
    // UNROLL rounds of WG units at once: the loads of all of them (UNROLL * ROWS words) are issued before any is
    // decoded, so an invocation keeps that many in flight where a row has units for them (K past WG units)
    for (uint u0 = tid; u0 < units; u0 += WG * UNROLL) {
        [[unroll]] for (uint t = 0; t < UNROLL; t++) {
            const uint u = min(u0 + t * WG, units - 1);   // past the row's end: a repeat, loaded but not added
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
                // clamped: out-of-range rows compute, never store
                q[t * ROWS + r] = load_unit(wrow0 + min(row0 + r, pc.n_rows - 1), u);
            }
        }
        [[unroll]] for (uint t = 0; t < UNROLL; t++) {
            if (u0 + t * WG < units) accumulate(t * ROWS, u0 + t * WG);
        }
    }

    // workgroup reduction of the ROWS * NB partial sums
    if (USE_SUBGROUP && gl_NumSubgroups == 1) {
        // the workgroup is one subgroup (WG within the device's subgroup size): no shared memory, no barrier;
        // the branch is uniform, so the other one's barriers stay legal
        [[unroll]] for (uint i = 0; i < ROWS * NB; i++) {
            const float v = subgroupAdd(acc[i]);
            if (tid == i % WG) store(row0, i, v);
        }
    } else if (USE_SUBGROUP) {
        const uint nsg = (WG + SUBGROUP - 1) / SUBGROUP;
        [[unroll]] for (uint i = 0; i < ROWS * NB; i++) {
            float v = subgroupAdd(acc[i]);
            if (gl_SubgroupInvocationID == 0) red[i * nsg + gl_SubgroupID] = v;
        }
        barrier();
        for (uint i = tid; i < ROWS * NB; i += WG) {
            float v = 0.0;
            for (uint g = 0; g < gl_NumSubgroups; g++) v += red[i * nsg + g];
            store(row0, i, v);
        }
    } else {
        [[unroll]] for (uint i = 0; i < ROWS * NB; i++) red[i * WG + tid] = acc[i];
        barrier();
        for (uint stride = WG / 2; stride > 0; stride >>= 1) {
            if (tid < stride) {
                [[unroll]] for (uint i = 0; i < ROWS * NB; i++) red[i * WG + tid] += red[i * WG + tid + stride];
            }
            barrier();
        }
        for (uint i = tid; i < ROWS * NB; i += WG) store(row0, i, red[i * WG]);
    }
#endif
}

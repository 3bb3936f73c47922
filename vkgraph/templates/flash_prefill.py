"""Causal prefill attention on cooperative matrices (flash-attention style), for devices that have them.

The prefill_attention graph op runs it where the device has the fragments it needs and the keys and values go to a
float16 cache (VKGRAPH_FLASH_PREFILL=auto; 1 takes it for any cache, 0 never): its keys and values are float16, as
that cache holds them, and everything else is carried at about float32 precision (below). Elsewhere the tests
compile it, and run it with its matrix operations emulated by loops (`source(..., emulate=True)`, `pytest -m
slow`): everything but the cooperative matrices.

Same contract as paged_attention.prefill_attention (the prefill_attention.comp template, which every other device
runs): packed prompts, cu_seqlens, grouped KV heads, an optional sliding window; q, k, v and the output float32.
Beyond it, prompts may continue cached prefixes (the engine's prefix cache, restored KV tiers): sequence b's new
tokens then sit at positions prefix_lens[b].., and the key walk reads positions below prefix_lens[b] from the
paged cache through the sequence's block table (float16 or float32, any block size) and the rest from k and v,
one online softmax over both; the template has no such form, and those prefills run there as paged_decode rows.

A workgroup takes BQ = 16 * SUBGROUPS query rows of one sequence and one query head; each subgroup owns 16 rows. The
queries are split once into two float16 parts, hi (q's leading 11 bits) and lo = fp16(q - hi), kept as fragments.
Keys and values are walked in tiles of BKV: both tiles are staged through shared memory as float16, each subgroup
computes its 16 x BKV scores S = Q_hi K^T + Q_lo K^T on cooperative matrices (float32 accumulation), and one
invocation per row applies scale, causal mask and window and updates the row's running maximum and sum (online
softmax, exp2 of log2-scaled scores) and writes the probabilities P as two float16 parts the same way. The output
accumulators, 16 x D per subgroup, are rescaled by each row's correction exp(m_old - m_new) by a component-wise
product with a matrix whose row r holds row r's factor (two cooperative matrices of one type share their element
layout, whatever it is), then O += P_hi V + P_lo V. At the end O / l goes through shared memory to the rows that lie
inside the sequence.

Rounding: K and V are float16, rounded as the float16 cache rounds them; Q and P as hi + lo pairs keep about 22 bits
(hi's 11 and lo's, less where lo falls below float16's normal range, for values under 1/8, whose absolute error
stays under 2^-25), and scores, sums and O are float32. So the result is float32 attention over the keys and values
as the cache holds them (what a decode step attends), at twice the matrix products of one float16 operand each;
PyTorch's float16 attention rounds Q and P too. The template path keeps k and v float32.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from ..codegen.lower import Limits
from ..runtime import Device
from .common import check_buffer
from .paged_attention import KV_DTYPES, PagedKVCache

SUBGROUPS = 4
BQ = 16 * SUBGROUPS  # query rows per workgroup
BKV = 32  # keys per tile


def usable(lim: Limits, head_size: int) -> bool:
    """Whether this device runs the kernel for heads of head_size: float16 16x16x16 fragments with float32
    accumulation at a fixed subgroup size of at least 16, D a multiple of 16, and the shared memory it takes."""
    if head_size < 16 or head_size % 16 or lim.min_subgroup != lim.max_subgroup or lim.subgroup < 16:
        return False
    if (16, 16, 16, "float16", "float16", "float32", "float32") not in lim.coop:
        return False
    return SUBGROUPS * lim.subgroup <= lim.max_invocations and shared_bytes(head_size) <= lim.max_shared


def _layout(d: int) -> dict[str, int]:
    """Shared memory in 16-byte units: the query tile (at the start) or the key and value tiles, then per subgroup
    the scores (float32), the probabilities' two float16 parts and a 16 x 16 float32 matrix of per-row factors."""
    ds = (d + 8) // 8  # a staged row of D float16 values, padded by 8
    ss, ps = (BKV + 4) // 4, (BKV + 8) // 8
    kv = max(BQ * ds, 2 * BKV * ds)
    per = 16 * ss + 2 * 16 * ps + 16 * 4
    return {"ds": ds, "ss": ss, "ps": ps, "kv": kv, "per": per, "total": kv + SUBGROUPS * per}


def shared_bytes(d: int) -> int:
    return 16 * _layout(d)["total"]


# GLSL of the emulated matrices (source(..., emulate=True)): every invocation of a subgroup holds a whole 16 x 16
# matrix, row-major, and the operations are loops with the cooperative ones' meaning (offsets and strides in
# 16-byte units of `sm`; float16 operands, float32 accumulation); the first invocation stores
_EMULATION = """
float h_at(int i) { return unpackHalf2x16(sm[i >> 3][(i >> 1) & 3] >> (16u * uint(i & 1))).x; }
void m_zero(out float m[256]) { for (int i = 0; i < 256; i++) m[i] = 0.0; }
void m_load_h(out float m[256], int off, int stride, bool col) {
    for (int r = 0; r < 16; r++) for (int c = 0; c < 16; c++)
        m[r * 16 + c] = h_at(col ? (off + c * stride) * 8 + r : (off + r * stride) * 8 + c);
}
void m_load_f(out float m[256], int off, int stride) {
    for (int r = 0; r < 16; r++) for (int c = 0; c < 16; c++)
        m[r * 16 + c] = uintBitsToFloat(sm[off + r * stride + (c >> 2)][c & 3]);
}
void m_store(float m[256], int off, int stride) {
    if (gl_SubgroupInvocationID == 0u) for (int r = 0; r < 16; r++) for (int c = 0; c < 16; c++)
        sm[off + r * stride + (c >> 2)][c & 3] = floatBitsToUint(m[r * 16 + c]);
}
// (a + a2) b + c in one pass: the two parts' products at the cost of one
void m_mma2(float a[256], float a2[256], float b[256], inout float c[256]) {
    for (int r = 0; r < 16; r++) for (int n = 0; n < 16; n++) {
        float t = c[r * 16 + n];
        for (int k = 0; k < 16; k++) t += (a[r * 16 + k] + a2[r * 16 + k]) * b[k * 16 + n];
        c[r * 16 + n] = t;
    }
}
void m_mul(inout float a[256], float b[256]) { for (int i = 0; i < 256; i++) a[i] *= b[i]; }
"""


class _Matrices:
    """Emits the kernel's 16 x 16 matrix operations: on cooperative matrices, or emulated (_EMULATION)."""

    def __init__(self, emit: Any, emulate: bool) -> None:
        self.emit, self.emulate = emit, emulate
        self.types = {"acc": "coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>",
                      "a": "coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>",
                      "b": "coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>"}

    def declare(self, kind: str, name: str, zero: bool = False) -> str:
        if self.emulate:
            return f"float {name}[256];" + (f" m_zero({name});" if zero else "")
        t = self.types[kind]
        return f"{t} {name}" + (f" = {t}(0.0);" if zero else ";")

    def load(self, kind: str, name: str, off: str, stride: int, col: bool = False) -> str:
        if self.emulate:
            if kind == "acc":
                return f"m_load_f({name}, {off}, {stride});"
            return f"m_load_h({name}, {off}, {stride}, {'true' if col else 'false'});"
        lay = "gl_CooperativeMatrixLayoutColumnMajor" if col else "gl_CooperativeMatrixLayoutRowMajor"
        return f"coopMatLoad({name}, sm, {off}, {stride}, {lay});"

    def store(self, name: str, off: str, stride: int) -> str:
        if self.emulate:
            return f"m_store({name}, {off}, {stride});"
        return f"coopMatStore({name}, sm, {off}, {stride}, gl_CooperativeMatrixLayoutRowMajor);"

    def mma2(self, hi: str, lo: str, b: str, c: str) -> str:
        """c += hi b + lo b: two products on cooperative matrices; emulated, one pass over hi + lo (its float32 sum
        holds both float16 parts), which keeps the slow emulated tests' loops to what the unsplit program ran."""
        if self.emulate:
            return f"m_mma2({hi}, {lo}, {b}, {c});"
        return f"{c} = coopMatMulAdd({hi}, {b}, {c}); {c} = coopMatMulAdd({lo}, {b}, {c});"

    def mul(self, a: str, b: str) -> str:
        return f"m_mul({a}, {b});" if self.emulate else f"{a} = {a} * {b};"


@cache
def source(d: int, group: int, subgroup: int, emulate: bool = False, cache: str | None = None) -> str:
    """The GLSL for head size d, `group` query heads per KV head, at subgroup size `subgroup`. With `cache` ("f16"
    or "f32": a paged cache's dtype), each sequence continues a cached prefix whose keys and values the program
    reads from that cache. With `emulate`, the same program with its matrix operations written as loops
    (_EMULATION), for any device: the tests run it where there are no cooperative matrices."""
    if cache not in (None, *KV_DTYPES):
        raise ValueError(f"flash_prefill: cache dtype must be one of {sorted(KV_DTYPES)}, got {cache!r}")
    lay = _layout(d)
    ds, ss, ps, kv, per = lay["ds"], lay["ss"], lay["ps"], lay["kv"], lay["per"]
    nt = SUBGROUPS * subgroup
    fd, fkv = d // 16, BKV // 16
    rpl = -(-16 // subgroup)  # rows of the subgroup's 16 each invocation updates (1 where the subgroup has 16+)
    L: list[str] = []
    emit = L.append
    mat = _Matrices(emit, emulate)

    def halves(src: str, at: str, tail: str = "", fn: str = "packHalf2x16") -> None:
        """w = the 8 float32 values src[at], src[at + 1] (vec4s) through fn: packHalf2x16 rounds them to float16
        (as the cache does), hi_half and lo_half split them into two float16 parts."""
        emit(f"      vec4 lo = {src}[{at}], hi = {src}[{at} + 1];")
        emit(f"      w = uvec4({fn}(lo.xy), {fn}(lo.zw), {fn}(hi.xy), {fn}(hi.zw));{tail}")

    def stage(rows: int, at: str, row_pos: str, src: str, index: str, fn: str) -> None:
        """Rows of D float32 values into shared memory as float16 (fn as halves takes it; zero where `row_pos` >=
        n)."""
        chunks = rows * (d // 8)
        for c in range(math.ceil(chunks / nt)):
            cond = f"e < {chunks} && " if (c + 1) * nt > chunks else ""
            emit(f"{{ int e = lid + {c * nt}; int row = e / {d // 8}, c8 = e % {d // 8}; int pos = {row_pos};")
            emit(f"  if ({cond}true) {{ uvec4 w = uvec4(0u);")
            emit(f"    if (pos < n) {{ int b = ({index}) / 4 + c8 * 2;")
            halves(src, "b", " }", fn)
            emit(f"    sm[{at} + row * {ds} + c8] = w; }} }}")

    def stage_keys(at: str, src: str, cached: str) -> None:
        """The tile's BKV key (or value) rows at positions kt.. into shared memory as float16: positions before
        the sequence's cached prefix from the paged cache, through its block table (float16 words copied as
        they are, float32 rounded), the new tokens' own from `src`, zero past the end."""
        chunks = BKV * (d // 8)
        for c in range(math.ceil(chunks / nt)):
            cond = f"e < {chunks}" if (c + 1) * nt > chunks else "true"
            emit(f"{{ int e = lid + {c * nt}; int row = e / {d // 8}, c8 = e % {d // 8}; int pos = kt + row;")
            emit(f"  if ({cond}) {{ uvec4 w = uvec4(0u);")
            if cache is not None:
                emit("    if (pos < pre) {")
                emit("      int blk = tables[int(gl_WorkGroupID.z) * int(pc.max_blocks) + pos / int(pc.block_size)];")
                emit(f"      int off = ((blk * hkv + kvh) * int(pc.block_size) + pos % int(pc.block_size)) * {d};")
                if cache == "f16":
                    emit(f"      w = {cached}[off / 8 + c8];")
                else:
                    halves(cached, "off / 4 + c8 * 2")
                emit("    } else")
            emit("    if (pos < pre + n) {")
            emit(f"      int b = ((seq0 + pos - pre) * hkv + kvh) * {d // 4} + c8 * 2;")
            halves(src, "b", " }")
            emit(f"    sm[{at} + row * {ds} + c8] = w; }} }}")

    def rows(body: list[str]) -> None:
        """body for each row r (0..15) of the subgroup's this invocation updates, with its state m_[i], l_[i]."""
        emit(f"for (int i = 0; i < {rpl}; i++) {{ int r = lane + i * {subgroup}; if (r < 16) {{")
        for line in body:
            emit("  " + line)
        emit("} }")

    emit("int lid = int(gl_LocalInvocationID.x);")
    emit("int sg = int(gl_SubgroupID);")
    emit("int lane = int(gl_SubgroupInvocationID);")
    emit("int h = int(gl_WorkGroupID.y);")
    emit("int seq0 = cu_seqlens[gl_WorkGroupID.z];")
    emit("int n = cu_seqlens[gl_WorkGroupID.z + 1] - seq0;")
    emit(f"int q0 = int(gl_WorkGroupID.x) * {BQ};")
    emit("if (q0 >= n) return;  // uniform: sequences shorter than the longest")
    emit(f"int kvh = h / {group};")
    emit("int pre = " + ("prefix_lens[gl_WorkGroupID.z];" if cache is not None else "0;")
         + "  // the cached prefix: query row i sits at position pre + i")
    emit("int hq = int(pc.num_heads), hkv = int(pc.num_kv_heads);")
    emit(f"int sb = {kv} + sg * {per};  // this subgroup's scores")
    emit(f"int pb = sb + {16 * ss};  // its probabilities")
    emit(f"int pl = pb + {16 * ps};  // what their rounding to float16 left out")
    emit(f"int fb = pl + {16 * ps};  // its per-row factors")
    # the queries as two float16 parts, hi + lo, each held as fragments for the whole walk
    for part, fn in (("qa", "hi_half"), ("ql", "lo_half")):
        stage(BQ, "0", "q0 + row", "q", f"((seq0 + pos) * hq + h) * {d}", fn)
        emit("barrier();")
        for i in range(fd):
            emit(mat.declare("a", f"{part}{i}"))
            emit(mat.load("a", f"{part}{i}", f"sg * {16 * ds} + {2 * i}", ds))
        if part == "qa":
            emit("barrier();  // every subgroup holds the first part before the second is staged")
    for j in range(fd):
        emit(mat.declare("acc", f"o{j}", zero=True))
    emit("barrier();  // every subgroup holds its queries: the tile's memory takes keys and values next")
    # the running maximum (log2-scaled) and sum of each row this invocation updates
    emit(f"float m_[{rpl}], l_[{rpl}];")
    emit(f"for (int i = 0; i < {rpl}; i++) {{ m_[i] = -1e30; l_[i] = 0.0; }}")
    emit(f"int kend = pre + min(q0 + {BQ}, n);")
    emit(f"int kbeg = pc.window > 0u ? max(0, pre + q0 + 1 - int(pc.window)) / {BKV} * {BKV} : 0;")
    emit(f"for (int kt = kbeg; kt < kend; kt += {BKV}) {{")
    stage_keys("0", "k", "kc")
    stage_keys(str(BKV * ds), "v", "vc")
    emit("barrier();")
    for j in range(fkv):
        emit(mat.declare("acc", f"sc{j}", zero=True))
    for i in range(fd):
        for j in range(fkv):  # B = K^T: column `key` of it is the staged row of that key
            emit(f"{{ {mat.declare('b', 'kb')} {mat.load('b', 'kb', str(16 * j * ds + 2 * i), ds, col=True)} "
                 f"{mat.mma2(f'qa{i}', f'ql{i}', 'kb', f'sc{j}')} }}")
    for j in range(fkv):
        emit(mat.store(f"sc{j}", f"sb + {4 * j}", ss))
    emit("subgroupMemoryBarrierShared();")
    emit("subgroupBarrier();")
    vis = "pos <= qpos && pos < pre + n && (pc.window == 0u || pos + int(pc.window) > qpos)"
    rows(["int qpos = pre + q0 + sg * 16 + r;",
          "float mx = m_[i];",
          f"for (int c = 0; c < {BKV}; c++) {{",
          "  int pos = kt + c;",
          f"  if ({vis}) mx = max(mx, uintBitsToFloat(sm[sb + r * {ss} + (c >> 2)][c & 3]) * pc.scale_log2);",
          "}",
          "float alpha = exp2(m_[i] - mx);",
          "float l = l_[i] * alpha;",
          f"for (int c = 0; c < {BKV}; c += 8) {{",
          "  float p[8];",
          "  for (int t = 0; t < 8; t++) {",
          "    int pos = kt + c + t;",
          f"    float s = uintBitsToFloat(sm[sb + r * {ss} + ((c + t) >> 2)][(c + t) & 3]) * pc.scale_log2;",
          f"    p[t] = ({vis}) ? exp2(s - mx) : 0.0;",
          "    l += p[t];",
          "  }",
          f"  sm[pb + r * {ps} + (c >> 3)] = uvec4(hi_half(vec2(p[0], p[1])), hi_half(vec2(p[2], p[3])),",
          "                                     hi_half(vec2(p[4], p[5])), hi_half(vec2(p[6], p[7])));",
          f"  sm[pl + r * {ps} + (c >> 3)] = uvec4(lo_half(vec2(p[0], p[1])), lo_half(vec2(p[2], p[3])),",
          "                                     lo_half(vec2(p[4], p[5])), lo_half(vec2(p[6], p[7])));",
          "}",
          "m_[i] = mx;",
          "l_[i] = l;",
          "for (int c = 0; c < 4; c++) sm[fb + r * 4 + c] = uvec4(floatBitsToUint(alpha));"])
    emit("subgroupMemoryBarrierShared();")
    emit("subgroupBarrier();")
    # the output rows rescaled by their factors: a component-wise product with a matrix whose row r holds row r's
    emit(mat.declare("acc", "fac"))
    emit(mat.load("acc", "fac", "fb", 4))
    for j in range(fd):
        emit(mat.mul(f"o{j}", "fac"))
    for kk in range(fkv):
        emit(mat.declare("a", f"pa{kk}"))
        emit(mat.load("a", f"pa{kk}", f"pb + {2 * kk}", ps))
        emit(mat.declare("a", f"pl{kk}"))
        emit(mat.load("a", f"pl{kk}", f"pl + {2 * kk}", ps))
        for j in range(fd):
            emit(f"{{ {mat.declare('b', 'vb')} {mat.load('b', 'vb', str(BKV * ds + 16 * kk * ds + 2 * j), ds)} "
                 f"{mat.mma2(f'pa{kk}', f'pl{kk}', 'vb', f'o{j}')} }}")
    emit("barrier();  // every subgroup is done with the tiles before the next are staged")
    emit("}")
    # O / l, through this subgroup's factor matrix, to the rows inside the sequence
    rows(["for (int c = 0; c < 4; c++) sm[fb + r * 4 + c] = uvec4(floatBitsToUint(1.0 / l_[i]));"])
    emit("subgroupMemoryBarrierShared();")
    emit("subgroupBarrier();")
    emit(mat.declare("acc", "inv"))
    emit(mat.load("acc", "inv", "fb", 4))
    emit("subgroupBarrier();")
    for j in range(fd):
        emit(mat.mul(f"o{j}", "inv"))
        emit(mat.store(f"o{j}", "sb", 4))
        emit("subgroupMemoryBarrierShared();")
        emit("subgroupBarrier();")
        emit(f"for (int e = lane; e < 256; e += {subgroup}) {{")
        emit("  int r = e / 16, c = e % 16, pos = q0 + sg * 16 + r;")
        emit(f"  if (pos < n) o_[((seq0 + pos) * hq + h) * {d} + {16 * j} + c] = "
             "uintBitsToFloat(sm[sb + r * 4 + c / 4][c % 4]);")
        emit("}")
        emit("subgroupBarrier();")
    word = "uvec4" if cache == "f16" else "vec4"  # a float16 cache's 8 values, or a float32 cache's 4
    ext = ([] if emulate else ["#extension GL_KHR_cooperative_matrix : require",
                               "#extension GL_KHR_memory_scope_semantics : require",
                               "#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require"])
    head = [
        "#version 450",
        *ext,
        "#extension GL_KHR_shader_subgroup_basic : require",
        f"// causal prefill attention, D = {d}, {group} query heads per KV head, {BQ} queries x {BKV} keys per tile"
        + (f", cached prefixes in a {cache} paged cache" if cache else "")
        + (" (matrices emulated)" if emulate else ""),
        f"layout(local_size_x = {nt}) in;",
        "layout(set = 0, binding = 0) readonly buffer Q { vec4 q[]; };",
        "layout(set = 0, binding = 1) readonly buffer K { vec4 k[]; };",
        "layout(set = 0, binding = 2) readonly buffer V { vec4 v[]; };",
        "layout(set = 0, binding = 3) readonly buffer Seqs { int cu_seqlens[]; };",
        "layout(set = 0, binding = 4) writeonly buffer O { float o_[]; };",
        *([] if cache is None else [
            f"layout(set = 0, binding = 5) readonly buffer KC {{ {word} kc[]; }};",
            f"layout(set = 0, binding = 6) readonly buffer VC {{ {word} vc[]; }};",
            "layout(set = 0, binding = 7) readonly buffer Tables { int tables[]; };",
            "layout(set = 0, binding = 8) readonly buffer Prefix { int prefix_lens[]; };"]),
        "layout(push_constant) uniform Push { uint num_heads; uint num_kv_heads; float scale_log2; uint window;"
        + (" uint block_size; uint max_blocks;" if cache else "") + " } pc;",
        f"shared uvec4 sm[{lay['total']}];",
        "// v's leading 11 significant bits (rounded in the float32 bits): exact in float16 where v is a normal",
        "// float16, so v - head11(v) is exact too. Bit operations: a driver folded the float16 round trip",
        "// unpackHalf2x16(packHalf2x16(v)) into v, which left every low part zero",
        "vec2 head11(vec2 v) { return uintBitsToFloat((floatBitsToUint(v) + 0x1000u) & 0xFFFFE000u); }",
        "uint hi_half(vec2 v) { return packHalf2x16(head11(v)); }",
        "// what hi_half leaves out, rounded to float16: hi + lo carries v to about 2^-22",
        "uint lo_half(vec2 v) { return packHalf2x16(v - head11(v)); }",
        *([_EMULATION] if emulate else []),
        "void main() {",
    ]
    return "\n".join(head + L + ["}", ""])


def flash_prefill(dev: Device, lim: Limits, q: Any, k: Any, v: Any, cu_seqlens: Any, *, num_seqs: int,
                  num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int, max_seq_len: int,
                  scale: float | None = None, window: int = 0, out: Any | None = None, emulate: bool = False,
                  cache: PagedKVCache | None = None, block_tables: Any | None = None, prefix_lens: Any | None = None,
                  max_blocks_per_seq: int = 0) -> Any:
    """Causal attention over packed prompts (see paged_attention.prefill_attention; float32 k and v); returns
    out [num_tokens, num_heads, head_size] float32. Records the dispatch; does not wait. `emulate` runs the
    program with its matrix operations emulated (any device with a fixed subgroup size; for the tests).

    With `cache`, sequence b continues a cached prefix of prefix_lens[b] tokens (int32 [num_seqs]) whose keys and
    values lie in `cache` at the blocks block_tables[b] lists (int32 [num_seqs, max_blocks_per_seq]): its new
    tokens cu_seqlens[b] .. cu_seqlens[b+1] sit at positions prefix_lens[b].. and attend to the prefix and to
    each other, causally. The new tokens' own keys and values are read from k and v (they need not be in the
    cache yet). The kernel trusts the tables and lengths as paged_decode does: a prefix must fit its table."""
    if emulate:
        if lim.min_subgroup != lim.max_subgroup or head_size % 16 or shared_bytes(head_size) > lim.max_shared:
            raise ValueError(f"flash_prefill: cannot emulate heads of {head_size} on this device")
    elif not usable(lim, head_size):
        raise ValueError(f"flash_prefill: this device cannot run heads of {head_size} on cooperative matrices")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    check_buffer("q", q, num_tokens * num_heads * head_size * 4)
    check_buffer("k", k, num_tokens * num_kv_heads * head_size * 4)
    check_buffer("v", v, num_tokens * num_kv_heads * head_size * 4)
    check_buffer("cu_seqlens", cu_seqlens, (num_seqs + 1) * 4)
    prefix: list[Any] = []
    push: dict[str, Any] = {}
    if cache is not None:
        if block_tables is None or prefix_lens is None or max_blocks_per_seq < 1:
            raise ValueError("flash_prefill: a cached prefix needs block_tables, prefix_lens and max_blocks_per_seq")
        if (cache.num_kv_heads, cache.head_size) != (num_kv_heads, head_size):
            raise ValueError(f"flash_prefill: the cache holds {cache.num_kv_heads} KV heads of {cache.head_size}, "
                             f"the prompts {num_kv_heads} of {head_size}")
        check_buffer("block_tables", block_tables, num_seqs * max_blocks_per_seq * 4)
        check_buffer("prefix_lens", prefix_lens, num_seqs * 4)
        prefix = [cache.key, cache.value, block_tables, prefix_lens]
        push = {"block_size": cache.block_size, "max_blocks": max_blocks_per_seq}
    elif block_tables is not None or prefix_lens is not None:
        raise ValueError("flash_prefill: block_tables and prefix_lens come with the cache they index")
    out = out if out is not None else dev.alloc(num_tokens * num_heads * head_size * 4)
    check_buffer("out", out, num_tokens * num_heads * head_size * 4)
    group = num_heads // num_kv_heads
    kern = dev.pipeline(source(head_size, group, lim.subgroup, emulate, cache.dtype if cache else None),
                        name="flash_prefill")
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    dev.dispatch(kern, [q, k, v, cu_seqlens, out, *prefix], (-(-max_seq_len // BQ), num_heads, num_seqs),
                 push={"num_heads": num_heads, "num_kv_heads": num_kv_heads, "scale_log2": scale / math.log(2.0),
                       "window": window, **push})
    return out

"""Causal prefill attention on cooperative matrices (flash-attention style), for devices that have them.

The prefill_attention graph op runs it with VKGRAPH_FLASH_PREFILL=1 (off by default until tests/test_flash_prefill.py
has run on a GPU with cooperative matrices; every other test only compiles it).

Same contract as paged_attention.prefill_attention (the prefill_attention.comp template, which every other device
runs): packed prompts, cu_seqlens, grouped KV heads, an optional sliding window; q, k, v and the output float32.

A workgroup takes BQ = 16 * SUBGROUPS query rows of one sequence and one query head; each subgroup owns 16 rows.
The queries are rounded to float16 once and kept as fragments. Keys and values are walked in tiles of BKV: both
tiles are staged through shared memory as float16, each subgroup computes its 16 x BKV scores S = Q K^T on
cooperative matrices (float32 accumulation), and one invocation per row applies scale, causal mask and window
and updates the row's running maximum and sum (online softmax, exp2 of log2-scaled scores) and writes the
probabilities P as float16. The output accumulators, 16 x D per subgroup, are rescaled by each row's correction
exp(m_old - m_new) by a component-wise product with a matrix whose row r holds row r's factor (two cooperative
matrices of one type share their element layout, whatever it is), then O += P V. At the end O / l goes through
shared memory to the rows that lie inside the sequence.

Rounding: Q, K, V and P are float16 (scores, sums and O in float32), as in PyTorch's float16 attention; the
template path keeps everything float32.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from ..codegen.lower import Limits
from ..runtime import Device
from .common import check_buffer

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
    the scores (float32), the probabilities (float16) and a 16 x 16 float32 matrix of per-row factors."""
    ds = (d + 8) // 8  # a staged row of D float16 values, padded by 8
    ss, ps = (BKV + 4) // 4, (BKV + 8) // 8
    kv = max(BQ * ds, 2 * BKV * ds)
    per = 16 * ss + 16 * ps + 16 * 4
    return {"ds": ds, "ss": ss, "ps": ps, "kv": kv, "per": per, "total": kv + SUBGROUPS * per}


def shared_bytes(d: int) -> int:
    return 16 * _layout(d)["total"]


@cache
def source(d: int, group: int, subgroup: int) -> str:
    """The GLSL for head size d, `group` query heads per KV head, at subgroup size `subgroup`."""
    lay = _layout(d)
    ds, ss, ps, kv, per = lay["ds"], lay["ss"], lay["ps"], lay["kv"], lay["per"]
    nt = SUBGROUPS * subgroup
    fd, fkv = d // 16, BKV // 16
    acc_t = "coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>"
    a_t = "coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>"
    b_t = "coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>"
    L: list[str] = []
    emit = L.append

    def stage(rows: int, at: str, row_pos: str, src: str, index: str) -> None:
        """Rows of D float32 values into shared memory as float16 (zero where `row_pos` >= n)."""
        chunks = rows * (d // 8)
        for c in range(math.ceil(chunks / nt)):
            cond = f"e < {chunks} && " if (c + 1) * nt > chunks else ""
            emit(f"{{ int e = lid + {c * nt}; int row = e / {d // 8}, c8 = e % {d // 8}; int pos = {row_pos};")
            emit(f"  if ({cond}true) {{ uvec4 w = uvec4(0u);")
            emit(f"    if (pos < n) {{ int b = ({index}) / 4 + c8 * 2;")
            emit(f"      vec4 lo = {src}[b], hi = {src}[b + 1];")
            emit("      w = uvec4(packHalf2x16(lo.xy), packHalf2x16(lo.zw), packHalf2x16(hi.xy), "
                 "packHalf2x16(hi.zw)); }")
            emit(f"    sm[{at} + row * {ds} + c8] = w; }} }}")

    emit("int lid = int(gl_LocalInvocationID.x);")
    emit("int sg = int(gl_SubgroupID);")
    emit("int lane = int(gl_SubgroupInvocationID);")
    emit("int h = int(gl_WorkGroupID.y);")
    emit("int seq0 = cu_seqlens[gl_WorkGroupID.z];")
    emit("int n = cu_seqlens[gl_WorkGroupID.z + 1] - seq0;")
    emit(f"int q0 = int(gl_WorkGroupID.x) * {BQ};")
    emit("if (q0 >= n) return;  // uniform: sequences shorter than the longest")
    emit(f"int kvh = h / {group};")
    emit("int hq = int(pc.num_heads), hkv = int(pc.num_kv_heads);")
    emit(f"int sb = {kv} + sg * {per};  // this subgroup's scores")
    emit(f"int pb = sb + {16 * ss};  // its probabilities")
    emit(f"int fb = pb + {16 * ps};  // its per-row factors")
    stage(BQ, "0", "q0 + row", "q", f"((seq0 + pos) * hq + h) * {d}")
    emit("barrier();")
    for i in range(fd):
        emit(f"{a_t} qa{i};")
        emit(f"coopMatLoad(qa{i}, sm, sg * {16 * ds} + {2 * i}, {ds}, gl_CooperativeMatrixLayoutRowMajor);")
    for j in range(fd):
        emit(f"{acc_t} o{j} = {acc_t}(0.0);")
    emit("barrier();  // every subgroup holds its queries: the tile's memory takes keys and values next")
    emit("float m = -1e30, l = 0.0;  // the running maximum (log2-scaled) and sum of row `lane` (lanes < 16)")
    emit("int qpos = q0 + sg * 16 + lane;")
    emit("int kend = min(q0 + 16 * " + str(SUBGROUPS) + ", n);")
    emit(f"int kbeg = pc.window > 0u ? max(0, q0 + 1 - int(pc.window)) / {BKV} * {BKV} : 0;")
    emit(f"for (int kt = kbeg; kt < kend; kt += {BKV}) {{")
    stage(BKV, "0", "kt + row", "k", f"((seq0 + pos) * hkv + kvh) * {d}")
    stage(BKV, str(BKV * ds), "kt + row", "v", f"((seq0 + pos) * hkv + kvh) * {d}")
    emit("barrier();")
    for j in range(fkv):
        emit(f"{acc_t} sc{j} = {acc_t}(0.0);")
    for i in range(fd):
        for j in range(fkv):  # B = K^T: column `key` of it is the staged row of that key
            emit(f"{{ {b_t} kb; coopMatLoad(kb, sm, {16 * j * ds + 2 * i}, {ds}, "
                 f"gl_CooperativeMatrixLayoutColumnMajor); sc{j} = coopMatMulAdd(qa{i}, kb, sc{j}); }}")
    for j in range(fkv):
        emit(f"coopMatStore(sc{j}, sm, sb + {4 * j}, {ss}, gl_CooperativeMatrixLayoutRowMajor);")
    emit("subgroupMemoryBarrierShared();")
    emit("subgroupBarrier();")
    emit("if (lane < 16) {")
    emit("  float mx = m;")
    emit(f"  for (int c = 0; c < {BKV}; c++) {{")
    emit("    int pos = kt + c;")
    emit("    bool vis = pos <= qpos && pos < n && (pc.window == 0u || pos + int(pc.window) > qpos);")
    emit(f"    if (vis) mx = max(mx, uintBitsToFloat(sm[sb + lane * {ss} + (c >> 2)][c & 3]) * pc.scale_log2);")
    emit("  }")
    emit("  float alpha = exp2(m - mx);")
    emit("  l *= alpha;")
    emit(f"  for (int c = 0; c < {BKV}; c += 8) {{")
    emit("    float p[8];")
    emit("    for (int t = 0; t < 8; t++) {")
    emit("      int pos = kt + c + t;")
    emit("      bool vis = pos <= qpos && pos < n && (pc.window == 0u || pos + int(pc.window) > qpos);")
    emit(f"      float s = uintBitsToFloat(sm[sb + lane * {ss} + ((c + t) >> 2)][(c + t) & 3]) * pc.scale_log2;")
    emit("      p[t] = vis ? exp2(s - mx) : 0.0;")
    emit("      l += p[t];")
    emit("    }")
    emit(f"    sm[pb + lane * {ps} + (c >> 3)] = uvec4(packHalf2x16(vec2(p[0], p[1])), packHalf2x16(vec2(p[2], p[3])), "
         "packHalf2x16(vec2(p[4], p[5])), packHalf2x16(vec2(p[6], p[7])));")
    emit("  }")
    emit("  m = mx;")
    emit("  for (int c = 0; c < 4; c++) sm[fb + lane * 4 + c] = uvec4(floatBitsToUint(alpha));")
    emit("}")
    emit("subgroupMemoryBarrierShared();")
    emit("subgroupBarrier();")
    emit(f"{acc_t} fac;")
    emit("coopMatLoad(fac, sm, fb, 4, gl_CooperativeMatrixLayoutRowMajor);")
    for j in range(fd):
        emit(f"o{j} = o{j} * fac;")
    for kk in range(fkv):
        emit(f"{a_t} pa{kk};")
        emit(f"coopMatLoad(pa{kk}, sm, pb + {2 * kk}, {ps}, gl_CooperativeMatrixLayoutRowMajor);")
        for j in range(fd):
            emit(f"{{ {b_t} vb; coopMatLoad(vb, sm, {BKV * ds + 16 * kk * ds + 2 * j}, {ds}, "
                 f"gl_CooperativeMatrixLayoutRowMajor); o{j} = coopMatMulAdd(pa{kk}, vb, o{j}); }}")
    emit("barrier();  // every subgroup is done with the tiles before the next are staged")
    emit("}")
    # O / l, through this subgroup's factor matrix, to the rows inside the sequence
    emit("if (lane < 16) for (int c = 0; c < 4; c++) sm[fb + lane * 4 + c] = uvec4(floatBitsToUint(1.0 / l));")
    emit("subgroupMemoryBarrierShared();")
    emit("subgroupBarrier();")
    emit(f"{acc_t} inv;")
    emit("coopMatLoad(inv, sm, fb, 4, gl_CooperativeMatrixLayoutRowMajor);")
    emit("subgroupBarrier();")
    for j in range(fd):
        emit(f"o{j} = o{j} * inv;")
        emit(f"coopMatStore(o{j}, sm, sb, 4, gl_CooperativeMatrixLayoutRowMajor);")
        emit("subgroupMemoryBarrierShared();")
        emit("subgroupBarrier();")
        emit(f"for (int e = lane; e < 256; e += {subgroup}) {{")
        emit("  int r = e / 16, c = e % 16, pos = q0 + sg * 16 + r;")
        emit(f"  if (pos < n) o_[((seq0 + pos) * hq + h) * {d} + {16 * j} + c] = "
             "uintBitsToFloat(sm[sb + r * 4 + c / 4][c % 4]);")
        emit("}")
        emit("subgroupBarrier();")
    head = [
        "#version 450",
        "#extension GL_KHR_cooperative_matrix : require",
        "#extension GL_KHR_memory_scope_semantics : require",
        "#extension GL_KHR_shader_subgroup_basic : require",
        "#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require",
        f"// causal prefill attention, D = {d}, {group} query heads per KV head, {BQ} queries x {BKV} keys per tile",
        f"layout(local_size_x = {nt}) in;",
        "layout(set = 0, binding = 0) readonly buffer Q { vec4 q[]; };",
        "layout(set = 0, binding = 1) readonly buffer K { vec4 k[]; };",
        "layout(set = 0, binding = 2) readonly buffer V { vec4 v[]; };",
        "layout(set = 0, binding = 3) readonly buffer Seqs { int cu_seqlens[]; };",
        "layout(set = 0, binding = 4) writeonly buffer O { float o_[]; };",
        "layout(push_constant) uniform Push { uint num_heads; uint num_kv_heads; float scale_log2; uint window; } pc;",
        f"shared uvec4 sm[{lay['total']}];",
        "void main() {",
    ]
    return "\n".join(head + L + ["}", ""])


def flash_prefill(dev: Device, lim: Limits, q: Any, k: Any, v: Any, cu_seqlens: Any, *, num_seqs: int,
                  num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int, max_seq_len: int,
                  scale: float | None = None, window: int = 0, out: Any | None = None) -> Any:
    """Causal attention over packed prompts (see paged_attention.prefill_attention; float32 k and v); returns
    out [num_tokens, num_heads, head_size] float32. Records the dispatch; does not wait."""
    if not usable(lim, head_size):
        raise ValueError(f"flash_prefill: this device cannot run heads of {head_size} on cooperative matrices")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    check_buffer("q", q, num_tokens * num_heads * head_size * 4)
    check_buffer("k", k, num_tokens * num_kv_heads * head_size * 4)
    check_buffer("v", v, num_tokens * num_kv_heads * head_size * 4)
    check_buffer("cu_seqlens", cu_seqlens, (num_seqs + 1) * 4)
    out = out if out is not None else dev.alloc(num_tokens * num_heads * head_size * 4)
    check_buffer("out", out, num_tokens * num_heads * head_size * 4)
    group = num_heads // num_kv_heads
    kern = dev.pipeline(source(head_size, group, lim.subgroup), name="flash_prefill")
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    dev.dispatch(kern, [q, k, v, cu_seqlens, out], (-(-max_seq_len // BQ), num_heads, num_seqs),
                 push={"num_heads": num_heads, "num_kv_heads": num_kv_heads, "scale_log2": scale / math.log(2.0),
                       "window": window})
    return out

"""Matrix products over GGUF weights on cooperative matrices: y = x @ W.T (+ residual), W stored quantized.

A prefill multiplies many activation rows by each weight matrix, which tensor cores do far faster than the
matvec templates. Rather than expanding W to a float16 copy first (dequant_f16.comp, then the generated matmul),
this program reads W's blocks as they are stored (the matvec layout, vkgraph.templates.matvec) and dequantizes
each slice of them into shared memory, where the cooperative matrices read it: W's bytes cross memory once per
tile, and no float16 copy is written or read.

The tiling is matmul_coop's (codegen/matmul_coop.py, which explains it): a workgroup computes a BM x BN tile of
y with WM x WN subgroups, slices BK deep are staged through shared memory, the next slice's words are read into
registers while the current one is multiplied. x comes as float16 rows [M, K]; W's slice of each row is BK / 16
chunks of 16 values, one 16-byte word and one float16 scale each (Q8_0: 16 int8 values; Q4_0: the low or high
nibbles of a block's word), decoded as dequant_f16.comp decodes them and rounded to float16 (the values of the
float16 copy, up to the rounding mode of packHalf2x16). Accumulation is float32, and so is y. The number of rows
M is a push constant, so one pipeline serves every prompt length.

Only devices with float16 cooperative matrices run it (a Limits.coop shape with float32 accumulation and a fixed
subgroup size); elsewhere QuantLinear keeps the float16 copy and the generated matmul.
"""

from __future__ import annotations

import math
from typing import Any

from ..codegen import matmul_coop
from ..codegen.lower import Limits
from ..dtype import dtypes
from ..runtime import Device
from .common import check_binding_range, check_buffer, grid_2d
from .matvec import DeviceWeights

FORMATS = ("Q8_0", "Q4_0")
BLOCK = 32  # elements per quant block of both formats: a slice is a whole number of blocks deep


def shape_class(fmt: str, m: int, n: int, k: int) -> str:
    """The key of measured tiles (codegen.tune) for products over fmt blocks: the format, then matmul_coop's class."""
    return f"{fmt}:{matmul_coop.shape_class(m, n, k, 1, dtypes.float16)}"


def config(lim: Limits, m: int, n: int, k: int, fmt: str = "") -> matmul_coop.Config | None:
    """The tile configuration for an m x n product over K = k on this device, or None where the device has no
    fitting float16 cooperative matrices (or k is not a whole number of blocks): the one measured for fmt's
    products of this class (benchmarks/bench_matmul.py --quant --tune), else the float16 product's choice."""
    if not lim.coop or lim.min_subgroup != lim.max_subgroup or lim.subgroup < 1 or k % BLOCK or m < 1 or n < 1:
        return None
    frag = matmul_coop.fragment(lim, "float16")
    if frag is None:
        return None
    cls = shape_class(fmt, m, n, k)
    for c, v in lim.tuned:
        if c == cls and (cfg := matmul_coop.Config(*v)).fits(frag, lim) and cfg.bk % BLOCK == 0 and k % cfg.bk == 0:
            return cfg
    cfg = matmul_coop.choose(m, n, k, 1, lim, frag, dtypes.float16)
    if cfg.bk % BLOCK or k % cfg.bk:  # slices of whole blocks that divide K: take the default (BK 32) instead
        cfg = matmul_coop.default_config(m, n, k, 1, lim, frag)
    return cfg if cfg.bk % BLOCK == 0 and k % cfg.bk == 0 and cfg.fits(frag, lim) else None


def source(fmt: str, n: int, k: int, w_stride: int, s_stride: int, cfg: matmul_coop.Config,
           frag: tuple[int, int, int], subgroup: int, residual: bool) -> str:
    """The GLSL of the product for format fmt, W [n, k] with the given strides, tile cfg and fragment shape."""
    if fmt not in FORMATS:
        raise ValueError(f"matmul_quant: unsupported format {fmt!r}; known: {FORMATS}")
    fm, fn, fk = frag
    bm, bn, bk, wm, wn = cfg.bm, cfg.bn, cfg.bk, cfg.wm, cfg.wn
    nt = wm * wn * subgroup
    tm_, tn_ = bm // wm, bn // wn
    ffm, ffn = tm_ // fm, tn_ // fn
    tiles_n = math.ceil(n / bn)
    nk = k // bk
    a_stride = b_stride = (bk + 8) // 8  # shared rows in 16-byte units, padded by 8 elements
    a_size, b_size = bm * a_stride, bn * b_stride
    stage = a_size + b_size
    c_stride = (tn_ + 4) // 4  # a row of a subgroup's accumulators, float32, padded by 4
    smem = max(cfg.stages * stage, wm * wn * fm * c_stride)
    chunks_a, chunks_b = bm * (bk // 8), bn * (bk // 16)
    per_a, per_b = math.ceil(chunks_a / nt), math.ceil(chunks_b / nt)
    ka, kb = bk // 8, bk // 16  # 8-element chunks of a row of x's slice; 16-element chunks of W's
    g_m = matmul_coop.GROUP_M
    L: list[str] = []
    emit = L.append

    def load_slice(k0: str) -> None:
        # x: row-major float16, 16-byte words; zero past row M
        for c in range(per_a):
            guard = f"e < {chunks_a} && " if (c + 1) * nt > chunks_a else ""
            emit(f"{{ int e = lid + {c * nt}; int row = tm * {bm} + e / {ka};")
            emit(f"  ar{c} = ({guard}row < int(pc.m)) ? x[row * {k // 8} + ({k0}) / 8 + e % {ka}] : uvec4(0u); }}")
        # W: one 16-byte word and one scale per chunk of 16 values; zero past row N
        for c in range(per_b):
            guard = f"e < {chunks_b} && " if (c + 1) * nt > chunks_b else ""
            emit(f"{{ int e = lid + {c * nt}; int row = tn * {bn} + e / {kb}; int j = e % {kb};")
            emit(f"  int blk = (({k0}) + 16 * j) / {BLOCK};")
            word = "row * {ws} + (({k0}) + 16 * j) / 16" if fmt == "Q8_0" else "row * {ws} + blk"
            emit(f"  bool ok = {guard}row < {n};")
            emit(f"  br{c} = ok ? w[{word.format(ws=w_stride, k0=k0)}] : uvec4(0u);")
            emit(f"  uint si = uint(row * {s_stride} + blk);")
            emit(f"  bs{c} = ok ? unpackHalf2x16(s[si >> 1] >> (16u * (si & 1u))).x : 0.0; }}")

    def store_slice(at: str) -> None:
        for c in range(per_a):
            cond = "" if (c + 1) * nt <= chunks_a else f"if (lid + {c * nt} < {chunks_a}) "
            emit(f"{{ int e = lid + {c * nt}; {cond}sm[{at} + (e / {ka}) * {a_stride} + e % {ka}] = ar{c}; }}")
        for c in range(per_b):
            cond = "" if (c + 1) * nt <= chunks_b else f"if (lid + {c * nt} < {chunks_b}) "
            emit(f"{{ int e = lid + {c * nt}; int j = e % {kb};")
            if fmt == "Q8_0":  # 16 signed bytes times the block's scale
                emit(f"  vec4 q0 = vec4((ivec4(bytes_of(br{c}.x)) << 24) >> 24), "
                     f"q1 = vec4((ivec4(bytes_of(br{c}.y)) << 24) >> 24);")
                emit(f"  vec4 q2 = vec4((ivec4(bytes_of(br{c}.z)) << 24) >> 24), "
                     f"q3 = vec4((ivec4(bytes_of(br{c}.w)) << 24) >> 24);")
            else:  # the block's low nibbles (values 0-15) or high ones (16-31), minus 8, times the scale
                emit("  uint sh = 4u * uint(j & 1);")
                for i, comp in enumerate("xyzw"):
                    emit(f"  vec4 q{i} = vec4(bytes_of((br{c}.{comp} >> sh) & 0x0F0F0F0Fu)) - 8.0;")
            emit(f"  float d = bs{c};")
            emit(f"  {cond}{{ int at = {at} + {a_size} + (e / {kb}) * {b_stride} + 2 * j;")
            emit("    sm[at] = uvec4(packHalf2x16(q0.xy * d), packHalf2x16(q0.zw * d), packHalf2x16(q1.xy * d), "
                 "packHalf2x16(q1.zw * d));")
            emit("    sm[at + 1] = uvec4(packHalf2x16(q2.xy * d), packHalf2x16(q2.zw * d), packHalf2x16(q3.xy * d), "
                 "packHalf2x16(q3.zw * d)); } }")

    acc_t = f"coopmat<float, gl_ScopeSubgroup, {fm}, {fn}, gl_MatrixUseAccumulator>"
    a_t = f"coopmat<float16_t, gl_ScopeSubgroup, {fm}, {fk}, gl_MatrixUseA>"
    b_t = f"coopmat<float16_t, gl_ScopeSubgroup, {fk}, {fn}, gl_MatrixUseB>"
    emit("int grp = int(gl_WorkGroupID.x + pc.groups_x * gl_WorkGroupID.y);")
    emit(f"int tiles_m = (int(pc.m) + {bm - 1}) / {bm};")
    emit(f"if (grp >= tiles_m * {tiles_n}) return;")
    emit("int lid = int(gl_LocalInvocationID.x);")
    emit("int sgid = int(gl_SubgroupID);")
    # grouped order: GROUP_M row tiles share each column tile (its W slices) while it is in the cache
    emit(f"int gfirst = (grp / {g_m * tiles_n}) * {g_m};")
    emit(f"int gsize = min(tiles_m - gfirst, {g_m});")
    emit("int tm = gfirst + (grp % gsize);")
    emit(f"int tn = (grp % {g_m * tiles_n}) / gsize;")
    emit(f"int arow = (sgid / {wn}) * {tm_};")
    emit(f"int bcol = (sgid % {wn}) * {tn_};")
    # one declaration per statement: NVIDIA's 580 driver crashed creating pipelines declaring several at once
    for i in range(ffm):
        for j in range(ffn):
            emit(f"{acc_t} acc{i}_{j} = {acc_t}(0.0);")
    emit(f"uvec4 {', '.join(f'ar{c}' for c in range(per_a))};")
    emit(f"uvec4 {', '.join(f'br{c}' for c in range(per_b))};")
    emit(f"float {', '.join(f'bs{c}' for c in range(per_b))};")
    load_slice("0")
    store_slice("0")
    emit("barrier();")
    emit(f"for (int kt = 0; kt < {nk}; kt++) {{")
    emit(f"int cur = (kt & 1) * {stage};" if cfg.stages == 2 else "int cur = 0;")
    emit(f"bool more = kt + 1 < {nk};")
    emit("if (more) {")
    load_slice(f"(kt + 1) * {bk}")
    emit("}")
    emit(f"{a_t} fa[{ffm}];")
    emit(f"{b_t} fb[{ffn}];")
    for kk in range(0, bk, fk):
        for i in range(ffm):
            emit(f"coopMatLoad(fa[{i}], sm, cur + (arow + {i * fm}) * {a_stride} + {kk // 8}, {a_stride}, "
                 "gl_CooperativeMatrixLayoutRowMajor);")
        for j in range(ffn):
            emit(f"coopMatLoad(fb[{j}], sm, cur + {a_size} + (bcol + {j * fn}) * {b_stride} + {kk // 8}, "
                 f"{b_stride}, gl_CooperativeMatrixLayoutColumnMajor);")
        for i in range(ffm):
            for j in range(ffn):
                emit(f"acc{i}_{j} = coopMatMulAdd(fa[{i}], fb[{j}], acc{i}_{j});")
    if cfg.stages == 1:
        emit("barrier();")  # every subgroup is done with the slice before it is overwritten
    emit("if (more) {")
    store_slice(f"{stage} - cur" if cfg.stages == 2 else "0")
    emit("}")
    emit("barrier();")
    emit("}")
    # epilogue: per fragment row, through this subgroup's own region of shared memory, then one element a lane
    emit(f"int cb = sgid * {fm * c_stride};")
    emit("int lane = int(gl_SubgroupInvocationID);")
    for i in range(ffm):
        for j in range(ffn):
            emit(f"coopMatStore(acc{i}_{j}, sm, cb + {j * fn // 4}, {c_stride}, gl_CooperativeMatrixLayoutRowMajor);")
        emit("subgroupMemoryBarrierShared();")
        emit("subgroupBarrier();")
        emit(f"for (int e = lane; e < {fm * tn_}; e += {subgroup}) {{")
        emit(f"  int er = e / {tn_}, ec = e % {tn_};")
        emit(f"  int m = tm * {bm} + arow + {i * fm} + er, n = tn * {bn} + bcol + ec;")
        val = f"uintBitsToFloat(sm[cb + er * {c_stride} + (ec >> 2)][ec & 3])"
        if residual:
            val += f" + res[m * {n} + n]"
        emit(f"  if (m < int(pc.m) && n < {n}) y[m * {n} + n] = {val};")
        emit("}")
        emit("subgroupBarrier();")

    head = [
        "#version 450",
        "#extension GL_KHR_cooperative_matrix : require",
        "#extension GL_KHR_memory_scope_semantics : require",
        "#extension GL_KHR_shader_subgroup_basic : require",
        "#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require",
        f"// y = x @ W.T, W {fmt} [{n}, {k}]; tile {bm}x{bn}x{bk}, {wm}x{wn} subgroups, {cfg.stages} stage(s)",
        f"layout(local_size_x = {nt}) in;",
        "layout(set = 0, binding = 0) readonly buffer X { uvec4 x[]; };",
        "layout(set = 0, binding = 1) readonly buffer W { uvec4 w[]; };",
        "layout(set = 0, binding = 2) readonly buffer S { uint s[]; };",
        "layout(set = 0, binding = 3) writeonly buffer Y { float y[]; };",
    ]
    if residual:
        head.append("layout(set = 0, binding = 4) readonly buffer R { float res[]; };")
    head += ["layout(push_constant) uniform Push { uint m; uint groups_x; } pc;",
             f"shared uvec4 sm[{smem}];",
             "uvec4 bytes_of(uint v) { return uvec4(v, v >> 8, v >> 16, v >> 24) & 0xFFu; }",
             "void main() {"]
    return "\n".join(head + L + ["}", ""])


def matmul_quant(dev: Device, lim: Limits, weights: DeviceWeights, x: Any, m: int, cfg: matmul_coop.Config,
                 out: Any | None = None, residual: Any | None = None) -> Any:
    """y [m, N] float32 = x [m, K] (float16, row-major) @ W.T (+ residual [m, N] float32) into `out` or a new
    buffer; returns it. Records the dispatch; does not wait. cfg: from `config` (which must not be None)."""
    fmt = weights.format.name
    if fmt not in FORMATS:
        raise ValueError(f"matmul_quant: unsupported format {fmt!r}; known: {FORMATS}")
    n, k = weights.shape
    if k % cfg.bk or cfg.bk % BLOCK:
        raise ValueError(f"matmul_quant: K={k} is not a whole number of {cfg.bk}-deep slices of {BLOCK}-blocks")
    if m < 1:
        raise ValueError(f"matmul_quant: no rows (m={m})")
    frag = matmul_coop.fragment(lim, "float16")
    if frag is None or not cfg.fits(frag, lim):
        raise ValueError(f"matmul_quant: tile {cfg} does not fit this device's cooperative matrices")
    check_buffer("x", x, m * k * 2)
    check_buffer("weights.body", weights.body, n * weights.w_stride * 16)
    check_buffer("weights.scales", weights.scales, (n * weights.s_stride + 1) // 2 * 4)
    nbytes = m * n * 4
    check_binding_range(dev, f"matmul_quant output [{m}, {n}]", nbytes)
    if residual is not None:
        check_buffer("residual", residual, nbytes)
    if out is None:
        out = dev.alloc(nbytes)
    check_buffer("out", out, nbytes)
    key = ("mmq", k, cfg, residual is not None)
    kern = weights.pipelines.get(key)
    if kern is None:
        src = source(fmt, n, k, weights.w_stride, weights.s_stride, cfg, frag, lim.subgroup, residual is not None)
        kern = weights.pipelines[key] = dev.pipeline(src, name=f"matmul_quant_{fmt.lower()}")
    groups = grid_2d(dev, math.ceil(m / cfg.bm) * math.ceil(n / cfg.bn))
    bufs = [x, weights.body, weights.scales, out] + ([residual] if residual is not None else [])
    dev.dispatch(kern, bufs, groups, push={"m": m, "groups_x": groups[0]})
    return out

"""Products of few activation rows over GGUF weights (a batched decode step), streaming W at bandwidth on
cooperative matrices: y [m, N] float32 = x [m, K] @ W.T, W stored quantized in the matvec layout
(vkgraph.templates.matvec), x float16 rows or int8 blocks, m from 1 to MAX_ROWS.

At 8-32 rows the tensor cores make the arithmetic free; what bounds the product is how many of W's bytes are in
flight. matmul_quant's small-row tile holds about a kilobyte of W in flight per workgroup and streams 0.3-0.8 TB/s
on an H200, where keeping its ~3.9 TB/s busy takes ~30 KB in flight per multiprocessor. Here each subgroup streams
its own part of W with no workgroup barrier on the way:

- A subgroup owns FRAGS x FM rows of W (the A operand: FM x FK fragments of W rows by K) and all m rows of x (the
  B operand: FK x FN fragments, m rounded up to whole FN); a workgroup has WN x SG subgroups: WN of them on
  distinct rows of W walk the same slices of K at about the same time (so x's slice, read by each, is mostly
  read once from the L2), and SG split K: subgroup s takes the BK-deep slices s, s + SG, s + 2 SG, .. and keeps
  its own accumulators; at the end they are summed through shared memory into y, so no second kernel sums K's
  parts. Where the rows of W alone give too few workgroups, KS workgroups may split K further: each writes its
  part to a plane, and the last of them to finish (a counter per rows of W) sums the planes in order into y
  (`Scratch`). A residual is added as y is written.
- A subgroup reads its slice's blocks (32 values of one row each, the format's words and scale) into one of DEPTH
  register sets, DEPTH - 1 slices ahead of the one it decodes: each invocation has (DEPTH - 1) x ROWS x BK / 32 /
  subgroup-size blocks' loads in flight. It decodes the oldest set into its own region of shared memory
  (float16, rows padded to an odd number of 16-byte words, so that eight invocations storing the same block of
  eight rows fall in distinct banks), then multiplies: A fragments from shared memory, B fragments read straight
  from x in device memory (column-major: x's rows are B's columns), which every workgroup shares through the
  caches. Only subgroup barriers separate the decoding from the products.
- x's rows past m are read (their products discarded): the x buffer holds whole FN rows (`x_rows`). Or (XS) the
  workgroup stages its part of x (K split over workgroups until it fits) in shared memory first, as float16, from
  float16 rows or from the int8 blocks the fused decode step writes (Q8Acts), and reads B there.

The fragment shape is the device's (`fragment`): the narrowest float16 shape with float32 accumulation, 16 x 8 x 16
on NVIDIA (eight activation rows need no padding). The formats' decoding is matmul_quant's (`load_q`, `decode_q`:
each value rounded to float16 as dequant_f16.comp rounds it); accumulation is float32. Only devices with float16
cooperative matrices and a fixed subgroup size run it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ..codegen.lower import Limits
from ..runtime import Device
from .common import check_binding_range, check_buffer, grid_2d, product_output
from .matmul_quant import _X8, BLOCK, FORMATS, _check_format, _check_weights, _codec
from .matvec import DeviceWeights, Q8Acts

MAX_ROWS = 32  # activation rows: accumulators grow with them (m / FN fragments per fragment of W rows)
# formats whose two 16-value halves of a block come from one load (Q4_0: low and high nibbles of one word); the
# others load each half (their own words)
_ONE_LOAD = ("Q4_0",)
# the subgroup's barrier between decoding a slice into shared memory and reading it: ordering shared memory only
# (subgroupBarrier orders every kind of memory, device memory too, which the loads in flight must not wait for)
_SUBGROUP_SYNC = ("controlBarrier(gl_ScopeSubgroup, gl_ScopeSubgroup, gl_StorageSemanticsShared, "
                  "gl_SemanticsAcquireRelease);")
MAX_SPLIT = 32  # workgroups a K split may take (`split`)
STAGE_LOADS = 4  # with xs: reads of x's words in flight per invocation while x is staged
TARGET_SUBGROUPS = 2048  # subgroups a product aims for: ~16 per multiprocessor of an H200, each with loads in flight


def fragment(lim: Limits) -> tuple[int, int, int] | None:
    """The fragment shape (M, N, K) of float16 operands with float32 accumulation at subgroup scope the device lists
    that pads the fewest activation rows: the smallest N, then the deepest K, then M = 16; M a multiple of 8, N of
    8 and K of 16 (whole 16-byte words of shared memory and of x). None where the device lists none."""
    shapes = [(m, n, k) for m, n, k, a, b, c, res in lim.coop
              if a == b == "float16" and c == res == "float32" and m % 8 == 0 and n % 8 == 0 and k % 16 == 0]
    if not shapes:
        return None
    return min(shapes, key=lambda s: (s[1], -s[2], abs(s[0] - 16)))


@dataclass(frozen=True)
class Skinny:
    """sg: subgroups per workgroup, splitting K by slices; bk: slice depth (whole 32-value blocks); depth: register
    sets (depth - 1 slices in flight while one is decoded); frags: fragments of W rows per subgroup; wn: subgroups
    on distinct rows of W per workgroup (each with sg subgroups splitting K; wn x sg in all); ks:
    workgroups that split K per rows of W (each a whole part of K; the last of them to finish sums their partial
    products, in the order of K, into y: see `Scratch`); xs: 1 to stage the workgroup's part of x (all its K) in
    shared memory as float16 first, from float16 rows or int8 blocks (Q8Acts), and read the B fragments there;
    0 to read them from x in device memory (float16 rows only)."""

    sg: int = 4
    bk: int = 256
    depth: int = 3
    frags: int = 1
    ks: int = 1
    wn: int = 1
    xs: int = 0

    def rows(self, frag: tuple[int, int, int]) -> int:
        """Rows of W per workgroup."""
        return self.wn * self.frags * frag[0]

    def subgroups(self) -> int:
        return self.wn * self.sg

    def shared_words(self, frag: tuple[int, int, int], mb: int, k: int) -> int:
        """16-byte words of shared memory: each subgroup's decoded slice (and with xs the staged x after them), or
        (reusing them) its accumulators."""
        staged = mb * (k // self.ks // 8 + 1) if self.xs else 0
        return max(self.sg * self.rows(frag) * (self.bk // 8 + 1) + staged, self.sg * self.rows(frag) * (mb // 4 + 1))

    def fits(self, frag: tuple[int, int, int], lim: Limits, k: int, mb: int = MAX_ROWS) -> bool:
        """Whether the device runs it for K = k and mb rows of x: whole blocks a slice, K whole slices, whole
        blocks for each invocation of a subgroup, and the threads and shared memory the device has."""
        rows = self.frags * frag[0]  # a subgroup's
        return (min(self.sg, self.depth, self.frags, self.ks, self.wn) >= 1 and self.xs in (0, 1)
                and self.bk % BLOCK == 0
                and self.bk % frag[2] == 0 and k % (self.bk * self.ks) == 0 and lim.subgroup >= 1
                and (rows * self.bk // BLOCK) % lim.subgroup == 0
                and self.subgroups() * lim.subgroup <= lim.max_invocations
                and self.shared_words(frag, mb, k) * 16 <= lim.max_shared)


# x staged from int8 blocks where config is asked for int8 activations: 2 x 2 subgroups on 32 rows of W, 128-deep
# slices, four register sets (K split by `split`)
INT8_BASE = Skinny(2, 128, 4, 1, 1, 2, 1)


@dataclass(frozen=True)
class Scratch:
    """What a product that splits K over workgroups (ks > 1) needs besides y: `partial`, float32 [ks, m, N] (each
    workgroup's part), and `counters`, a uint per rows of W (the parts finished; zero before a product, and the
    last workgroup of each rows sets it back to zero). Products run one after another may share one."""

    partial: Any
    counters: Any

    @staticmethod
    def nbytes(cfg: Skinny, frag: tuple[int, int, int], m: int, n: int) -> tuple[int, int]:
        return cfg.ks * m * n * 4, 4 * math.ceil(n / cfg.rows(frag))


def scratch(dev: Device, cfg: Skinny, frag: tuple[int, int, int], m: int, n: int) -> Scratch:
    """A Scratch for products of up to m rows and N = n with cfg: its counters zeroed."""
    part, count = Scratch.nbytes(cfg, frag, m, n)
    counters = dev.alloc(count)
    dev.upload(counters, bytes(count))
    return Scratch(dev.alloc(part), counters)


def x_rows(frag: tuple[int, int, int], m: int) -> int:
    """Rows the x buffer of an m-row product holds (m rounded up to whole fragments; rows past m are read)."""
    return frag[1] * math.ceil(m / frag[1])


def config(lim: Limits, m: int, n: int, k: int, int8: bool = False) -> Skinny | None:
    """The configuration for an m x n product over K = k, or None where the device has no fitting float16
    cooperative matrices or fixed subgroup size, or m is past MAX_ROWS. float16 x: 256-deep slices (else the
    deepest whole slice) and enough subgroups per workgroup that the product has about TARGET_SUBGROUPS of them.
    int8 x (staged, xs): INT8_BASE with K split into the fewest parts whose x fits (`split`)."""
    if not lim.coop or lim.min_subgroup != lim.max_subgroup or lim.subgroup < 1 or not 1 <= m <= MAX_ROWS:
        return None
    frag = fragment(lim)
    if frag is None or k % BLOCK or n < 1:
        return None
    mb = x_rows(frag, m)
    if int8:
        return split(INT8_BASE, frag, lim, k, mb)
    groups = math.ceil(n / frag[0])
    want = 1 << max(1, min(3, math.ceil(math.log2(max(1, TARGET_SUBGROUPS / groups)))))
    for bk in (256, 128, 64, 32):
        for sg in sorted({want, 4, 2, 1}, key=lambda s: abs(s - want)):
            cfg = Skinny(sg, bk, 3)
            if cfg.fits(frag, lim, k, mb):
                return cfg
    return None


def split(base: Skinny, frag: tuple[int, int, int], lim: Limits, k: int, mb: int) -> Skinny | None:
    """base with K split over the fewest workgroups (up to MAX_SPLIT) with which it fits the device (with xs: x's
    part beside the slices in shared memory), at base's slice depth or else shallower ones; None where none fits."""
    bk = base.bk
    while bk >= BLOCK:
        ks = 1
        while ks <= MAX_SPLIT:
            if (cfg := replace(base, bk=bk, ks=ks)).fits(frag, lim, k, mb):
                return cfg
            ks *= 2
        bk //= 2
    return None


def _declare(emit: Any, units: int, halves: int, reg: str) -> None:
    for c in range(units):
        for h in range(halves):
            emit(f"uvec4 w{reg}_{c}_{h}_0 = uvec4(0u), w{reg}_{c}_{h}_1 = uvec4(0u), w{reg}_{c}_{h}_2 = uvec4(0u);")
            emit(f"uint s{reg}_{c}_{h} = 0u;")


def _load(emit: Any, n: int, whole: bool, rows: int, units: int, halves: int, sgs: int, k0: str, reg: str) -> None:
    """Register set `reg` <- the raw words of the subgroup's blocks of the slice from element k0: block u (lane +
    c * subgroup size) is row rbase + u % rows, 32 values from k0 + 32 * (u / rows); zero past row n (`whole`:
    no row is)."""
    for c in range(units):
        emit(f"{{ int u = lane + {c * sgs}; int row = rbase + u % {rows}; int e0 = ({k0}) + 32 * (u / {rows});")
        loads = " ".join(f"load_q(row, e0 + {16 * h}, w{reg}_{c}_{h}_0, w{reg}_{c}_{h}_1, w{reg}_{c}_{h}_2, "
                         f"s{reg}_{c}_{h});" for h in range(halves))
        if whole:
            emit(f"  {loads} }}")
        else:
            zero = " ".join(f"w{reg}_{c}_{h}_0 = uvec4(0u); w{reg}_{c}_{h}_1 = uvec4(0u); w{reg}_{c}_{h}_2 = uvec4(0u);"
                            f" s{reg}_{c}_{h} = 0u;" for h in range(halves))
            emit(f"  if (row < {n}) {{ {loads} }} else {{ {zero} }} }}")


def _store(emit: Any, rows: int, units: int, halves: int, sgs: int, stride: int, k0: str, reg: str) -> None:
    """Register set `reg` decoded into the subgroup's region of shared memory (from wb): row r's 32 values of
    block u at words r * stride + 4 * (u / rows) .. + 3."""
    for c in range(units):
        emit(f"{{ int u = lane + {c * sgs}; int e0 = ({k0}) + 32 * (u / {rows});")
        emit(f"  int at = wb + (u % {rows}) * {stride} + 4 * (u / {rows}); uvec4 q0, q1, q2, q3;")
        hi = halves - 1
        emit(f"  decode_q(e0, w{reg}_{c}_0_0, w{reg}_{c}_0_1, w{reg}_{c}_0_2, s{reg}_{c}_0, q0, q1);")
        emit(f"  decode_q(e0 + 16, w{reg}_{c}_{hi}_0, w{reg}_{c}_{hi}_1, w{reg}_{c}_{hi}_2, s{reg}_{c}_{hi}, q2, q3);")
        emit("  sm[at] = q0; sm[at + 1] = q1; sm[at + 2] = q2; sm[at + 3] = q3; }")


def source(fmt: str, n: int, k: int, w_stride: int, s_stride: int, cfg: Skinny, frag: tuple[int, int, int],
           subgroup: int, mb: int, int8: bool = False, residual: bool = False) -> str:
    """The GLSL of the product for format fmt, W [n, k] with the given strides, configuration cfg, the device's
    fragment shape and subgroup size, and mb rows of x (whole fragments; m itself is a push constant); x float16
    rows, or with int8 (cfg.xs only) the int8 blocks of Q8Acts (xq at binding 0, xd last); with residual, y = x @
    W.T + res (float32 [m, N], bound after the K split's buffers)."""
    if int8 and not cfg.xs:
        raise ValueError("matmul_skinny: int8 activations are staged in shared memory (xs = 1)")
    _check_format(fmt)
    fm, fn, fk = frag
    sg, bk, depth, frags, wn = cfg.sg, cfg.bk, cfg.depth, cfg.frags, cfg.wn
    rows = frags * fm  # a subgroup's rows of W
    wrows = wn * rows  # a workgroup's
    nt = cfg.subgroups() * subgroup
    units = rows * bk // BLOCK // subgroup  # blocks per invocation per slice
    halves = 1 if fmt in _ONE_LOAD else 2
    stride = bk // 8 + 1  # 16-byte words per decoded row: odd, so eight rows' same block fall in distinct banks
    region = rows * stride
    c_stride = mb // 4 + 1  # 16-byte words per row of a subgroup's accumulators (float32), odd likewise
    ks = cfg.ks
    slices = k // bk // ks  # slices of each workgroup's part of K
    groups_n = math.ceil(n / wrows)
    whole = n % wrows == 0
    mj = mb // fn
    kpart = slices * bk
    xo = sg * wrows * stride  # with xs: x's part of K staged after the subgroups' regions, rows x_stride words
    x_stride = kpart // 8 + 1
    acc_t = f"coopmat<float, gl_ScopeSubgroup, {fm}, {fn}, gl_MatrixUseAccumulator>"
    a_t = f"coopmat<float16_t, gl_ScopeSubgroup, {fm}, {fk}, gl_MatrixUseA>"
    b_t = f"coopmat<float16_t, gl_ScopeSubgroup, {fk}, {fn}, gl_MatrixUseB>"
    L = ["#version 450",
         "#extension GL_KHR_cooperative_matrix : require",
         "#extension GL_KHR_memory_scope_semantics : require",
         "#extension GL_KHR_shader_subgroup_basic : require",
         "#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require",
         f"// y = x @ W.T, W {fmt} [{n}, {k}], x {'int8 blocks' if int8 else 'float16'} [{mb} rows]"
         f"{', staged' if cfg.xs else ''}; {wn} x {rows} rows of W a workgroup, {sg} subgroups splitting K by "
         f"{bk}-deep slices, K split {ks}, {depth} register sets",
         f"layout(local_size_x = {nt}) in;",
         "layout(set = 0, binding = 0) readonly buffer X { uvec4 x[]; };",
         "layout(set = 0, binding = 1) readonly buffer W { uvec4 w[]; };",
         "layout(set = 0, binding = 2) readonly buffer S { uint s[]; };",
         "layout(set = 0, binding = 3) writeonly buffer Y { float y[]; };",
         *(["layout(set = 0, binding = 4) coherent buffer P { float part[]; };",
            "layout(set = 0, binding = 5) coherent buffer C { uint cnt[]; };", "shared uint last;"] if ks > 1 else []),
         *([f"layout(set = 0, binding = {4 + 2 * (ks > 1)}) readonly buffer R {{ float res[]; }};"] if residual
           else []),
         *([f"layout(set = 0, binding = {4 + 2 * (ks > 1) + residual}) readonly buffer XD {{ float xd[]; }};"]
           if int8 else []),
         "layout(push_constant) uniform Push { uint m; uint groups_x; } pc;",
         f"shared uvec4 sm[{cfg.shared_words(frag, mb, k)}];",
         *_codec(fmt, w_stride, s_stride), *([_X8] if int8 else []),
         "void main() {"]
    emit = L.append
    emit("int grp = int(gl_WorkGroupID.x + pc.groups_x * gl_WorkGroupID.y);")
    emit(f"if (grp >= {groups_n * ks}) return;")
    # workgroup (tn, kz): rows tn * ROWS .. of W over part kz of K (slices kz * slices ..)
    emit(f"int tn = grp % {groups_n}, kz = grp / {groups_n}, kbase = kz * {slices * bk};")
    emit("int tid = int(gl_LocalInvocationID.x), lane = int(gl_SubgroupInvocationID), sgid = int(gl_SubgroupID);")
    # subgroup sgid: rows sn of the workgroup's, slices sk, sk + sg, .. of its part of K
    emit(f"int sn = sgid / {sg}, sk = sgid % {sg}, rbase = tn * {wrows} + sn * {rows};")
    emit(f"int wb = sgid * {region};")
    # one declaration per statement: NVIDIA's 580 driver crashed creating pipelines declaring several at once
    for f in range(frags):
        for j in range(mj):
            emit(f"{acc_t} acc{f}_{j} = {acc_t}(0.0);")
    for d in range(depth):
        _declare(emit, units, halves, f"r{d}")
    def load_b(kk: int) -> None:
        for j in range(mj):
            if cfg.xs:
                emit(f"coopMatLoad(fb[{j}], sm, {xo + j * fn * x_stride + kk // 8} + (k0 - kbase) / 8, "
                     f"{x_stride}, gl_CooperativeMatrixLayoutColumnMajor);")
            else:
                emit(f"coopMatLoad(fb[{j}], x, {j * fn * k // 8 + kk // 8} + k0 / 8, {k // 8}, "
                     "gl_CooperativeMatrixLayoutColumnMajor);")

    def compute(reg: str, t: str) -> None:
        emit(f"{{ int k0 = kbase + ({t}) * {bk};")
        emit(f"{a_t} fa[{frags}];")
        emit(f"{b_t} fb[{mj}];")
        load_b(0)  # x's first fragments (never stored over in the loop) read while the slice is decoded
        _store(emit, rows, units, halves, subgroup, stride, "k0", reg)
        emit(_SUBGROUP_SYNC)
        for kk in range(0, bk, fk):
            for f in range(frags):
                emit(f"coopMatLoad(fa[{f}], sm, wb + {f * fm * stride + kk // 8}, {stride}, "
                     "gl_CooperativeMatrixLayoutRowMajor);")
            if kk:
                load_b(kk)
            for f in range(frags):
                for j in range(mj):
                    emit(f"acc{f}_{j} = coopMatMulAdd(fa[{f}], fb[{j}], acc{f}_{j});")
        emit(_SUBGROUP_SYNC)  # every lane's fragments read before the next slice is decoded over them
        emit("}")

    # set d holds the slice of trip position d (of depth)
    for d in range(depth - 1):
        emit(f"if (sk + {d * sg} < {slices}) {{")
        _load(emit, n, whole, rows, units, halves, subgroup, f"kbase + (sk + {d * sg}) * {bk}", f"r{d}")
        emit("}")
    if cfg.xs:
        # rows r < mb of x's part of K, 16 values a word pair (zero past row m), before any product and after the
        # first slices' loads of W are issued: STAGE_LOADS pairs' reads in flight per invocation at a time
        pairs = mb * (kpart // 16)
        emit(f"for (int eb = tid; eb < {pairs}; eb += {STAGE_LOADS * nt}) {{")
        for i in range(STAGE_LOADS):
            emit(f"  int e{i} = eb + {i * nt}, r{i} = e{i} / {kpart // 16}, at{i} = r{i} * {k} + kbase + "
                 f"16 * (e{i} % {kpart // 16});")
            emit(f"  bool in{i} = e{i} < {pairs} && r{i} < int(pc.m);")
            if int8:
                emit(f"  uvec4 q{i} = in{i} ? x[at{i} / 16] : uvec4(0u); float d{i} = in{i} ? xd[at{i} / 32] : 0.0;")
            else:
                emit(f"  uvec4 q{i} = in{i} ? x[at{i} / 8] : uvec4(0u), h{i} = in{i} ? x[at{i} / 8 + 1] : uvec4(0u);")
        for i in range(STAGE_LOADS):
            emit(f"  if (e{i} < {pairs}) {{")
            if int8:
                emit(f"    uvec4 lo, hi; decode_x8(q{i}, d{i}, lo, hi);")
            else:
                emit(f"    uvec4 lo = q{i}, hi = h{i};")
            emit(f"    int at = {xo} + r{i} * {x_stride} + 2 * (e{i} % {kpart // 16}); sm[at] = lo; sm[at + 1] = hi;")
            emit("  }")
        emit("}")
        emit("barrier();")
    emit(f"for (int t = sk; t < {slices}; t += {depth * sg}) {{")
    for d in range(depth):
        emit(f"if (t + {d * sg} >= {slices}) break;")
        ahead = d + depth - 1  # the slice read now, decoded depth - 1 slices later
        emit(f"if (t + {ahead * sg} < {slices}) {{")
        _load(emit, n, whole, rows, units, halves, subgroup, f"kbase + (t + {ahead * sg}) * {bk}",
              f"r{ahead % depth}")
        emit("}")
        compute(f"r{d}", f"t + {d * sg}")
    emit("}")
    # the subgroups' accumulators summed through shared memory (over the decoded slices: after a barrier)
    emit("barrier();")
    emit(f"int cb = sgid * {rows * c_stride};")
    for f in range(frags):
        for j in range(mj):
            emit(f"coopMatStore(acc{f}_{j}, sm, cb + {f * fm * c_stride + j * fn // 4}, {c_stride}, "
                 "gl_CooperativeMatrixLayoutRowMajor);")
    emit("barrier();")
    emit(f"for (int e = tid; e < {wrows * mb}; e += {nt}) {{")
    # row cw of the workgroup's: row cw % rows of subgroups (cw / rows) * sg + q, q < sg (rows x c_stride words each)
    emit(f"  int r = e / {wrows}, cw = e % {wrows}, col = tn * {wrows} + cw;")
    emit(f"  int at = (cw / {rows}) * {sg * rows * c_stride} + (cw % {rows}) * {c_stride} + (r >> 2);")
    total = " + ".join(f"uintBitsToFloat(sm[at + {q * rows * c_stride}][r & 3])" for q in range(sg))
    add = f" + res[r * {n} + col]" if residual else ""
    if ks == 1:
        emit(f"  if (r < int(pc.m) && col < {n}) y[r * {n} + col] = {total}{add};")
        emit("}")
    else:
        # this part into plane kz; the workgroup that finishes a rows' parts last sums the planes in order (the
        # same sum whichever finishes last) and sets the rows' counter back to zero for the next product
        emit(f"  if (r < int(pc.m) && col < {n}) part[(kz * int(pc.m) + r) * {n} + col] = {total};")
        emit("}")
        emit("memoryBarrierBuffer();")
        emit("barrier();")
        emit(f"if (tid == 0) last = atomicAdd(cnt[tn], 1u) == {ks - 1}u ? 1u : 0u;")
        emit("barrier();")
        emit("if (last == 0u) return;")
        emit("memoryBarrierBuffer();")
        emit(f"for (int e = tid; e < {wrows * mb}; e += {nt}) {{")
        emit(f"  int r = e / {wrows}, col = tn * {wrows} + e % {wrows};")
        emit(f"  if (r < int(pc.m) && col < {n}) {{")
        emit("    float v = 0.0;")
        emit(f"    for (int q = 0; q < {ks}; q++) v += part[(q * int(pc.m) + r) * {n} + col];")
        emit(f"    y[r * {n} + col] = v{add};")
        emit("  }")
        emit("}")
        emit("if (tid == 0) cnt[tn] = 0u;")
    emit("}")
    emit("")
    return "\n".join(L)


def matmul_skinny(dev: Device, lim: Limits, weights: DeviceWeights, x: Any, m: int, cfg: Skinny,
                  out: Any | None = None, scratch: Scratch | None = None, residual: Any | None = None) -> Any:
    """y [m, N] float32 = x [m, K] @ W.T (+ residual [m, N] float32) into `out` or a new buffer; returns it.
    x: float16 rows (row-major), in a buffer of x_rows(fragment(lim), m) rows unless cfg.xs (without, those past m
    are read, their products discarded); or with cfg.xs int8 blocks (a Q8Acts: value = int8 * its block's scale,
    rounded to float16 as it is staged). With cfg.ks > 1 the product needs a Scratch (`scratch`) of at least m
    rows. Records the dispatch; does not wait. cfg: from `config` (not None)."""
    fmt = weights.format.name
    _check_format(fmt)
    n, k = weights.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"matmul_skinny: {m} rows; it takes 1 to {MAX_ROWS}")
    frag = fragment(lim)
    if frag is None:
        raise ValueError("matmul_skinny: the device has no float16 cooperative matrices with float32 accumulation")
    mb = x_rows(frag, m)
    if not cfg.fits(frag, lim, k, mb):
        raise ValueError(f"matmul_skinny: {cfg} does not fit this device or K={k} (whole {cfg.bk}-deep slices "
                         f"in each of {cfg.ks} parts)")
    int8 = isinstance(x, Q8Acts)
    if int8 and not cfg.xs:
        raise ValueError("matmul_skinny: int8 activations (Q8Acts) need a configuration that stages x (xs = 1)")
    if int8:
        x.check(m, k)
    elif cfg.xs:
        check_buffer(f"x (float16, {m} rows of {k})", x, m * k * 2)
    else:
        check_buffer(f"x (float16, {mb} rows of {k})", x, mb * k * 2)
    scales = _check_weights(weights)
    nbytes = m * n * 4
    out = product_output(dev, f"matmul_skinny output [{m}, {n}]", nbytes, out, residual)
    extra = []
    if cfg.ks > 1:
        if scratch is None:
            raise ValueError(f"matmul_skinny: K split over {cfg.ks} workgroups needs a Scratch (`scratch`)")
        part, count = Scratch.nbytes(cfg, frag, m, n)
        check_binding_range(dev, f"matmul_skinny partial products [{cfg.ks}, {m}, {n}]", part)
        check_buffer("scratch.partial", scratch.partial, part)
        check_buffer("scratch.counters", scratch.counters, count)
        extra = [scratch.partial, scratch.counters]
    key = ("skinny", k, cfg, mb, int8, residual is not None)
    kern = weights.pipelines.get(key)
    if kern is None:
        src = source(fmt, n, k, weights.w_stride, weights.s_stride, cfg, frag, lim.subgroup, mb, int8,
                     residual is not None)
        kern = weights.pipelines[key] = dev.pipeline(src, name=f"matmul_skinny_{fmt.lower()}")
    groups = grid_2d(dev, math.ceil(n / cfg.rows(frag)) * cfg.ks)
    bufs = [x.xq if int8 else x, weights.body, scales, out, *extra, *([residual] if residual is not None else []),
            *([x.xd] if int8 else [])]
    dev.dispatch(kern, bufs, groups, push={"m": m, "groups_x": groups[0]})
    return out


__all__ = ["FORMATS", "MAX_ROWS", "Scratch", "Skinny", "config", "fragment", "matmul_skinny", "scratch", "source",
           "x_rows"]

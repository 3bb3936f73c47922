"""Matrix products on cooperative matrices (VK_KHR_cooperative_matrix: tensor cores, matrix cores, XMX).

A workgroup computes a BM x BN tile of the output with WM x WN subgroups, each holding a (BM/WM) x (BN/WN)
block of float32 accumulator fragments; per 16-deep step a subgroup loads each of its A and B fragments from
shared memory once and multiplies every pair. Slices BK deep of both operands are staged through shared memory
as 16-byte chunks (8 16-bit values): the next slice is read from memory into registers while the subgroups
multiply the current one, then written to the other of two buffers (one barrier per slice), or, in the
single-stage configurations that fit deeper slices into shared memory, over the current one after a second
barrier. With two register sets (Config.pf 2) the slice after next is read while the current one is multiplied,
so each read has two slices' multiplies to arrive in (Vulkan has no asynchronous copy into shared memory: the
registers are the pipeline). Bounds checks are left out of the reads where the sizes are whole tiles. With K
split among KS workgroups per output tile (Config.ks, for outputs of too few tiles to fill the device), each
writes its float32 partial product to its own plane of a scratch buffer and a second program (the generated
reduction, lower._reduce) sums the planes and runs the epilogue. Tile configurations come from a measured search
(codegen.tune) or a default. Operands
that are plain buffers or strided views of them, with 8-element-aligned rows, are read as 16-byte vectors;
anything else (fused producers, pads, broadcasts, odd strides) is read element by element through the
renderer, with the same shared layout. Out-of-range rows and columns read as zero, so any M, N and K work.
The elementwise epilogue runs per output element: each subgroup stores a row of its fragments to shared
memory and its invocations apply the fused elementwise code and store through the kernel's output view.

bfloat16 operands use the same program with the fragment type renamed in the SPIR-V (runtime/spirv.py):
glslang of this vintage cannot spell bfloat16_t, but the operands never leave shared memory as values.

8-bit integer operands (an int8 @ int8 product, or int8/uint8 values under casts that keep them, as
`a.matmul(b, dtype=int32)` and `a.cast(int32) @ b.cast(int32)` give) use the same program on int8/uint8 fragments
with int32 accumulators, for the operand types the device lists: 16 values to a staged chunk, fragment K 32. It
is taken only where the int32 sum cannot overflow (K < 2^17 for int8 x int8, `max_k`), so the result, cast to the
product's integer type, is numpy's exactly; longer products keep the tiled integer path (which wraps as numpy
does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..dtype import DType, dtypes
from ..graph import BufferRef, Node, Op, ReduceOp, alu, buffer, movement, reduce, substitute
from ..view import ShapeTracker, prod
from . import glsl
from .symbolic import Var, unravel

if TYPE_CHECKING:
    from ..schedule import Kernel
    from .lower import Limits, Lowered

_OPERAND_TYPES = {dtypes.float16: "float16", dtypes.bfloat16: "bfloat16", dtypes.int8: "int8", dtypes.uint8: "uint8"}
_BYTES = {dtypes.int8: "int8", dtypes.uint8: "uint8"}
_BYTE_MAX = {"int8": 128, "uint8": 255}  # the largest magnitude of each


def max_k(ta: str, tb: str) -> int:
    """The longest product of 8-bit values of types ta and tb whose int32 sum cannot overflow."""
    return (2**31 - 1) // (_BYTE_MAX[ta] * _BYTE_MAX[tb])


INT8_MAX_K = max_k("int8", "int8")  # 2^17 - 1
# The SPIR-V of a program whose source holds this line gets its float16 fragment type marked bfloat16 by the
# compiler (runtime/spirv.py holds the same text; codegen does not import the runtime)
BF16_FRAGMENTS = "// vkgraph: float16_t fragments are bfloat16"
GROUP_M = 8  # output tiles walked column-block by column-block in groups of 8 rows, for L2 reuse


@dataclass(frozen=True)
class Config:
    """A tile configuration: workgroup tile BM x BN, slice depth BK, WM x WN subgroups, the slices held in
    shared memory: 2 (the next is stored beside the current one, one barrier per slice) or 1 (half the shared
    memory, so deeper slices fit; a second barrier before the store), PF, the slices in flight in registers:
    1 (the next slice is read while the current one is multiplied) or 2 (the one after it too, in a second
    register set: twice the reads in flight, for twice the registers), and KS, the workgroups that split K per
    output tile (16-bit operands only; taken where K is a whole number of KS * BK-deep parts, else 1)."""

    bm: int = 128
    bn: int = 128
    bk: int = 32
    wm: int = 2
    wn: int = 2
    stages: int = 2
    pf: int = 1
    ks: int = 1

    def key(self) -> list[int]:
        """The configuration as the tuned table stores it (codegen.tune)."""
        return [self.bm, self.bn, self.bk, self.wm, self.wn, self.stages, self.pf, self.ks]

    def label(self) -> str:
        extra = (f"/p{self.pf}" if self.pf > 1 else "") + (f"/k{self.ks}" if self.ks > 1 else "")
        return f"{self.bm}x{self.bn}x{self.bk}/{self.wm}x{self.wn}/s{self.stages}{extra}"

    def shared_bytes(self, itemsize: int = 2) -> int:
        """Both operand tiles per stage with 16 bytes of padding per staged row, in whichever layout (rows along
        K or across it) takes more; operands of `itemsize` bytes."""
        p = 16 // itemsize

        def tile(edge: int) -> int:
            return max(edge * (self.bk + p), self.bk * (edge + p))
        return self.stages * itemsize * (tile(self.bm) + tile(self.bn))

    def epilogue_bytes(self, fm: int) -> int:
        """The epilogue's staging: per subgroup one row of its fragments (fm rows of BN / WN 32-bit values, padded
        by 4), in the same shared memory as the operand tiles."""
        return self.wm * self.wn * fm * ((self.bn // self.wn + 4) // 4) * 16

    def fits(self, frag: tuple[int, int, int], lim: Limits, itemsize: int = 2) -> bool:
        fm, fn, fk = frag
        return (self.bm % (self.wm * fm) == 0 and self.bn % (self.wn * fn) == 0 and self.bk % fk == 0
                and self.bk % (16 // itemsize) == 0 and self.wm * self.wn * lim.subgroup <= lim.max_invocations
                and max(self.shared_bytes(itemsize), self.epilogue_bytes(fm)) <= lim.max_shared
                and self.stages in (1, 2) and self.pf in (1, 2) and self.ks >= 1 and (self.ks == 1 or itemsize == 2))


CONFIGS = (Config(128, 128, 32, 2, 4), Config(128, 128, 32, 4, 2), Config(128, 128, 32, 4, 4),
           Config(128, 128, 32, 2, 2), Config(64, 128, 32, 2, 4), Config(128, 64, 32, 4, 2),
           Config(64, 128, 32, 2, 2), Config(64, 64, 32, 2, 2), Config(128, 256, 16, 2, 4),
           Config(256, 128, 16, 4, 2), Config(128, 128, 16, 2, 4), Config(128, 128, 64, 2, 4, 1),
           Config(128, 128, 64, 4, 2, 1), Config(128, 256, 32, 2, 4, 1), Config(256, 128, 32, 4, 2, 1),
           # two slices in flight: the fastest tiles of the search without it (benchmarks/RESULTS.md), and shallow
           # slices, whose single slice in flight gives the reads the least time
           Config(128, 128, 32, 2, 4, 2, 2), Config(128, 128, 32, 4, 2, 2, 2), Config(128, 128, 16, 2, 4, 2, 2),
           Config(256, 128, 16, 4, 2, 2, 2), Config(128, 256, 16, 2, 4, 2, 2), Config(128, 128, 64, 2, 4, 1, 2),
           Config(128, 128, 64, 4, 2, 1, 2), Config(256, 128, 32, 4, 2, 1, 2), Config(128, 256, 32, 2, 4, 1, 2),
           # 16 subgroups: twice the warps per multiprocessor where registers allow one workgroup of 8 (a barrier's
           # wait then leaves no other workgroup to run)
           Config(128, 128, 32, 4, 4, 2, 2), Config(256, 128, 16, 4, 4, 2, 2), Config(128, 256, 16, 4, 4, 2, 2),
           Config(256, 128, 32, 4, 4, 1, 1), Config(256, 128, 32, 4, 4, 1, 2),
           # K split in two or four: outputs of few tiles (512 x 4096: 128 of 128 x 128 for ~132 multiprocessors)
           Config(128, 128, 32, 2, 4, 2, 1, 2), Config(128, 128, 32, 2, 4, 2, 2, 2),
           Config(128, 128, 64, 2, 4, 1, 1, 2), Config(128, 128, 32, 2, 4, 2, 2, 4),
           Config(256, 128, 32, 4, 2, 1, 1, 2),
           # the fastest on an H200 at 4096^3 (2026-12-02: 128 x 256 x 32, one stage, 64 x 64 per subgroup) split,
           # and subgroups of 128 x 32
           Config(128, 256, 32, 2, 4, 1, 1, 2), Config(128, 256, 32, 2, 4, 1, 1, 4), Config(256, 128, 32, 2, 4, 1))
# int8 slices go deeper for the same shared memory (a fragment is 32 deep)
INT8_CONFIGS = (Config(128, 128, 64, 2, 4), Config(128, 128, 64, 4, 2), Config(128, 128, 64, 4, 4),
                Config(128, 128, 64, 2, 2), Config(64, 128, 64, 2, 4), Config(128, 64, 64, 4, 2),
                Config(64, 64, 64, 2, 2), Config(128, 128, 32, 2, 4), Config(128, 256, 32, 2, 4),
                Config(128, 128, 128, 2, 4, 1), Config(128, 128, 128, 4, 2, 1), Config(128, 256, 64, 2, 4, 1),
                Config(256, 128, 64, 4, 2, 1), Config(128, 128, 64, 2, 4, 2, 2), Config(128, 128, 64, 4, 2, 2, 2),
                Config(128, 128, 128, 2, 4, 1, 2), Config(256, 128, 64, 4, 2, 1, 2))


SPLIT_TILES = 256  # outputs of fewer tiles may split K: under about two workgroups per multiprocessor of an H200


def configs(compute: DType) -> tuple[Config, ...]:
    """The tile configurations of operands of type compute (those a search may measure)."""
    return INT8_CONFIGS if compute in _BYTES else CONFIGS


def candidates(m: int, n: int, k: int, batch: int, lim: Limits, frag: tuple[int, int, int],
               compute: DType) -> list[Config]:
    """The configurations a search measures for a batch of m x k @ k x n products: those of `configs` that fit the
    device, splitting K only where the output has fewer than SPLIT_TILES tiles and K is a whole number of the
    parts' slices (elsewhere the split adds a pass and no parallelism the device lacks)."""
    return [c for c in configs(compute) if c.fits(frag, lim, compute.itemsize) and (c.ks == 1 or (
        batch * math.ceil(m / c.bm) * math.ceil(n / c.bn) < SPLIT_TILES and k % (c.bk * c.ks) == 0))]


def operand_type(d: DType) -> str | None:
    return _OPERAND_TYPES.get(d)


def fragment(lim: Limits, operand: str) -> tuple[int, int, int] | None:
    """The fragment shape (M, N, K) for operand type `operand` with float32 accumulation (int32 for 8-bit
    integers: int_fragment) at subgroup scope, the device offers: 16x16x16 where listed (the most work per
    instruction), else the largest listed. Fragment edges are whole 16-byte chunks of staged operands."""
    if operand in _BYTE_MAX:
        return int_fragment(lim, operand, operand)
    return _pick([(m, n, k) for m, n, k, a, b, c, res in lim.coop
                  if a == b == operand and c == res == "float32" and m % 8 == 0 and n % 8 == 0 and k % 8 == 0],
                 (16, 16, 16))


def int_fragment(lim: Limits, ta: str, tb: str) -> tuple[int, int, int] | None:
    """The fragment shape for 8-bit integer operands of types ta (A) and tb (B) with int32 accumulation:
    16x16x32 where listed; edges of 16 values (a 16x8x32 fragment would split a staged chunk)."""
    return _pick([(m, n, k) for m, n, k, a, b, c, res in lim.coop
                  if (a, b) == (ta, tb) and c == res == "int32" and m % 16 == 0 and n % 16 == 0 and k % 16 == 0],
                 (16, 16, 32))


def _pick(shapes: list[tuple[int, int, int]], pref: tuple[int, int, int]) -> tuple[int, int, int] | None:
    if not shapes:
        return None
    return pref if pref in shapes else max(shapes, key=lambda s: (s[0] * s[1] * s[2], s))


def _widens(n: Node) -> bool:
    """Whether n is a cast between integer types that keeps every value of its source."""
    if n.op is not Op.CAST:
        return False
    s, d = n.srcs[0].dtype, n.dtype
    if not (s.is_int and d.is_int):
        return False
    return s.itemsize <= d.itemsize if s.kind == d.kind else (s.kind == "u" and s.itemsize < d.itemsize)


def byte_type(src: Node) -> DType | None:
    """int8 or uint8 when operand src holds values of that type (under casts that keep them, and views), else
    None."""
    n = src
    while n.dtype not in _BYTES:
        if n.op is not Op.VIEW and not _widens(n):
            return None
        n = n.srcs[0]
    return n.dtype


def _byte_types(mm: Node) -> tuple[DType, DType] | None:
    """The 8-bit types of an integer product's operands, where both have one and the int32 sum of K products
    cannot overflow (so the result, cast to mm's type, is exact)."""
    if not mm.dtype.is_int:
        return None
    ta, tb = byte_type(mm.srcs[0]), byte_type(mm.srcs[1])
    if ta is None or tb is None or mm.srcs[0].shape[-1] > max_k(_BYTES[ta], _BYTES[tb]):
        return None
    return ta, tb


def _fragment_of(mm: Node, compute: DType, lim: Limits) -> tuple[int, int, int] | None:
    if compute in _BYTES:
        ta, tb = _byte_types(mm)
        return int_fragment(lim, _BYTES[ta], _BYTES[tb])
    return fragment(lim, operand_type(compute))


def compute_type(mm: Node, lim: Limits) -> DType | None:
    """The operand type matmul node mm runs in on cooperative matrices, or None for the plain tiled path:
    float16 and bfloat16 products in their own type; float32 ones only where 16-bit compute was asked for
    (Limits.f32_compute), since it rounds the operands; a fitting fragment shape and a fixed subgroup size."""
    if mm.dtype in (dtypes.float16, dtypes.bfloat16):
        d = mm.dtype
    elif mm.dtype is dtypes.float32 and lim.f32_compute:
        d = dtypes.float16 if lim.f32_compute == "float16" else dtypes.bfloat16
    elif (bt := _byte_types(mm)) is not None:
        d = bt[0]  # A's type names the compute type (B's is read from mm again)
    else:
        return None
    if not lim.coop or lim.min_subgroup != lim.max_subgroup or lim.subgroup < 1:
        return None
    if any(s < 1 for s in mm.shape) or mm.srcs[0].shape[-1] < 1:
        return None
    frag = _fragment_of(mm, d, lim)
    if frag is None or not any(c.fits(frag, lim, d.itemsize) for c in configs(d)):
        return None
    return d


def default_config(m: int, n: int, k: int, batch: int, lim: Limits, frag: tuple[int, int, int],
                   compute: DType = dtypes.float16) -> Config:
    """The largest tile that still gives a device of ~128 multiprocessors a workgroup each. 16-bit operands (the
    fastest of the search on an H200, benchmarks/RESULTS.md, 2026-12-02): 128 x 256 x 32 in one stage with 8
    subgroups of 64 x 64 where the output has at least 128 such tiles (4096^3: 263 TFLOP/s, where 128 x 128 x 32
    in two stages gave 191), else 128 x 128 x 64 in one stage with 8 subgroups of 32 x 64 (512 x 4096 x 4096: 196,
    against 125), smaller tiles for smaller outputs. 8-bit ones (not searched again): 128 x 128 x 64 in two
    stages with subgroups of 64 x 32."""
    size = compute.itemsize
    if size == 1:
        tiles = (Config(128, 128, 64, 2, 4), Config(64, 128, 64, 2, 4), Config(64, 64, 64, 2, 2))
    else:
        tiles = (Config(128, 256, 32, 2, 4, 1), Config(128, 128, 64, 4, 2, 1), Config(64, 128, 32, 2, 4),
                 Config(64, 64, 32, 2, 2))
    for c in tiles:
        if c.fits(frag, lim, size) and batch * math.ceil(m / c.bm) * math.ceil(n / c.bn) >= 128:
            return c
    fitting = [c for c in configs(compute) if c.fits(frag, lim, size)]
    return min(fitting, key=lambda c: (c.bm * c.bn, c.bk))


# ---- operand staging ---------------------------------------------------------------------------------------------


@dataclass
class _Operand:
    """How one operand is staged: its node, logical axes (rows, cols) of the tile, which of them is contiguous
    in shared memory, and for a vector operand the buffer, its strides in chunk units (8 16-bit or 16 8-bit
    elements) and its offset."""

    node: Node
    rows: int  # extent of the operand's first logical axis (M for A, K for B)
    cols: int
    col_major: bool  # shared rows run along the operand's first axis (contiguous along rows)
    vec: tuple[Any, tuple[int, ...], int] | None = None  # (BufferRef, strides / chunk of every axis, offset / chunk)


def _strip(n: Node) -> Node:
    """n without casts that keep its values: to its own type, and widening integer ones down to an 8-bit type."""
    while n.op is Op.CAST and (n.srcs[0].dtype is n.dtype or (n.dtype not in _BYTES and _widens(n))):
        n = n.srcs[0]
    return n


def _operand(src: Node, compute: DType, lim: Limits, refs_elsewhere: set[int]) -> _Operand:
    rows, cols = src.shape[-2], src.shape[-1]
    vw = 16 // compute.itemsize
    n = _strip(src)
    strides: tuple[int, ...] | None = None
    ref, offset = None, 0
    if n.op is Op.BUFFER and n.dtype is compute:
        ref = n.arg[0]
        strides = tuple(prod(n.shape[i + 1:]) for i in range(len(n.shape)))
    elif (n.op is Op.VIEW and n.dtype is compute and n.srcs[0].op is Op.BUFFER and len(n.arg.views) == 1
          and n.arg.views[0].mask is None):
        ref = n.srcs[0].arg[0]
        strides, offset = n.arg.views[0].strides, n.arg.views[0].offset
    col_major = False
    if strides is not None:
        col_major = strides[-2] == 1 and strides[-1] != 1
        inner = rows if col_major else cols
        inner_axis = len(strides) - (2 if col_major else 1)
        ok = (strides[inner_axis] == 1 and inner % vw == 0 and offset % vw == 0
              and all(s % vw == 0 for i, s in enumerate(strides) if i != inner_axis)
              and all(s >= 0 for s in strides) and ref.nbytes <= lim.max_storage_range
              and id(ref) not in refs_elsewhere)
        if ok:
            vs = tuple(0 if i == inner_axis else s // vw for i, s in enumerate(strides))
            return _Operand(src, rows, cols, col_major, (ref, vs, offset // vw))
    else:
        from .lower import _column_major  # the tiled path's rule: unit stride along the next-to-last axis

        col_major = _column_major(src)
    return _Operand(src, rows, cols, col_major)


def _refs_outside(k: Kernel, mm: Node) -> set[int]:
    """Buffers the kernel reads other than through mm's operands themselves (the epilogue's, or inside a fused
    producer of an operand): those keep their element-typed binding."""
    out: set[int] = {id(k.out)}
    operands = {id(_strip(s)) for s in mm.srcs}
    stack, seen = [k.root], set()
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n is mm:
            for s in mm.srcs:
                inner = _strip(s)
                if inner.op is Op.VIEW:
                    if inner.srcs[0].op is not Op.BUFFER:
                        stack.append(inner.srcs[0])
                elif inner.op is not Op.BUFFER:
                    stack.append(inner)
            continue
        if n.op is Op.BUFFER and id(n) not in operands:
            out.add(id(n.arg[0]))
        if n.op is Op.VIEW and id(n) not in operands and n.srcs[0].op is Op.BUFFER:
            out.add(id(n.srcs[0].arg[0]))
        stack.extend(n.srcs)
    return out


def _pack(compute: DType, vals: list[str]) -> str:
    """A chunk of values of the compute type as one uvec4: eight floats as 16-bit bit patterns (exact: they are
    representable), or sixteen int8-valued ints as bytes."""
    if compute in _BYTES:
        words = [" | ".join(f"((uint({vals[i + j]}) & 0xffu) << {8 * j})" for j in range(4)) for i in range(0, 16, 4)]
    elif compute is dtypes.float16:
        words = [f"packHalf2x16(vec2({vals[i]}, {vals[i + 1]}))" for i in range(0, 8, 2)]
    else:
        words = [f"((floatBitsToUint({vals[i]}) >> 16) | (floatBitsToUint({vals[i + 1]}) & 0xffff0000u))"
                 for i in range(0, 8, 2)]
    return f"uvec4({', '.join(words)})"


def spread(e: str, per_row: int, rows: int) -> tuple[str, str]:
    """(shared row, chunk in the row) of a tile's staged chunk e, rows of per_row 16-byte chunks padded by one.
    Eight invocations' 16-byte stores go to the banks together: in row order, two rows of 4 chunks (four of 2)
    would put the second row's last chunk in the first's first bank, so the chunks of every 8 rows are dealt to
    the invocations in an order whose groups of 8 fall in 8 distinct banks (rows r and r + 4; r, r + 2, r + 4 and
    r + 6) where the tile has whole groups of 8 rows. A row's chunks stay with neighbouring invocations, so the
    global reads stay as contiguous."""
    if rows % 8:
        return f"({e}) / {per_row}", f"({e}) % {per_row}"
    if per_row == 4:
        return f"(({e}) >> 5) * 8 + ((({e}) >> 2) & 1) * 4 + ((({e}) >> 3) & 3)", f"({e}) & 3"
    if per_row == 2:
        return f"(({e}) >> 4) * 8 + ((({e}) >> 1) & 3) * 2 + ((({e}) >> 3) & 1)", f"({e}) & 1"
    return f"({e}) / {per_row}", f"({e}) % {per_row}"


# ---- the program ---------------------------------------------------------------------------------------------------


def lower_coop(k: Kernel, mm: Node, lim: Limits, params: dict[int, int], cfg: Config | None = None,
               compute: DType | None = None) -> Lowered | None:
    """The program for kernel k, whose matmul node is mm, on cooperative matrices with `compute` operands
    (mm's dtype by default) and tile configuration cfg (tuned or default when None), then with K split (cfg.ks)
    the reduction of the partial products that runs the epilogue; None for a bfloat16 product whose kernel also
    reads float16 values (the one 16-bit float type of the SPIR-V is renamed)."""
    from .lower import Lowered, _finish, _reduce, _renderer

    compute = compute or mm.dtype
    a, b = mm.srcs
    batch = mm.shape[:-2]
    m_, n_, k_ = a.shape[-2], b.shape[-1], a.shape[-1]
    nb = prod(batch)
    frag = _fragment_of(mm, compute, lim)
    assert frag is not None
    fm, fn, fk = frag
    cfg = cfg or choose(m_, n_, k_, nb, lim, frag, compute)
    int8 = compute in _BYTES  # 8-bit integer operands, each of its own type
    ta, tb = _byte_types(mm) if int8 else (compute, compute)
    vw = 16 // compute.itemsize  # elements per 16-byte chunk
    sh = vw.bit_length() - 1
    bm, bn, bk, wm, wn = cfg.bm, cfg.bn, cfg.bk, cfg.wm, cfg.wn
    sg = lim.subgroup
    nt = wm * wn * sg
    tm_, tn_ = bm // wm, bn // wn  # a subgroup's block
    ffm, ffn = tm_ // fm, tn_ // fn  # its fragments along M and N
    tiles_m, tiles_n = math.ceil(m_ / bm), math.ceil(n_ / bn)
    per_batch = tiles_m * tiles_n
    # K split among ks workgroups per output tile, each over kspan elements of K (a whole number of slices)
    ks = cfg.ks if cfg.ks > 1 and not int8 and k_ % (bk * cfg.ks) == 0 else 1
    kspan = k_ // ks
    groups = ks * nb * per_batch
    nk = math.ceil(kspan / bk)

    outside = _refs_outside(k, mm)
    opa = _operand(a, ta, lim, outside)
    opb = _operand(b, tb, lim, outside)
    r = _renderer(lim, params)
    r.ext |= {"GL_KHR_cooperative_matrix", "GL_KHR_memory_scope_semantics", "GL_KHR_shader_subgroup_basic",
              "GL_EXT_shader_explicit_arithmetic_types_float16"}
    if int8:
        r.ext |= {"GL_EXT_shader_explicit_arithmetic_types_int8", "GL_EXT_shader_explicit_arithmetic_types_int32"}

    # shared memory in 16-byte units: [stage][A tile | B tile], then reused for the epilogue's staging
    def layout(op: _Operand, tile_r: int, tile_c: int) -> tuple[int, int, int]:
        """(outer extent, inner extent in elements, padded row stride in uvec4) of op's tile in shared memory."""
        outer, inner = (tile_c, tile_r) if op.col_major else (tile_r, tile_c)
        return outer, inner, (inner + vw) // vw

    a_outer, a_inner, a_stride = layout(opa, bm, bk)
    b_outer, b_inner, b_stride = layout(opb, bk, bn)
    a_size, b_size = a_outer * a_stride, b_outer * b_stride
    stage = a_size + b_size
    c_stride = (tn_ + 4) // 4  # a row of a subgroup's fragments, float32 (int32), padded by 4
    c_size = wm * wn * fm * c_stride
    smem = max(cfg.stages * stage, c_size)
    if smem * 16 > lim.max_shared:  # a driver may accept more and fail at run time (an H200's was lost)
        raise ValueError(f"matmul tile {cfg.label()} needs {smem * 16} bytes of shared memory; the device gives "
                         f"{lim.max_shared}")
    shared = [f"shared uvec4 sm[{smem}];"]

    r.emit(f"int grp = {'int(gl_WorkGroupID.x + gl_NumWorkGroups.x * gl_WorkGroupID.y)'};")
    r.emit(f"if (grp >= {groups}) return;")
    if ks > 1:  # part kz of K: workgroups kz * nb * per_batch ..
        r.emit(f"int kz = grp / {nb * per_batch};")
        r.emit(f"grp -= kz * {nb * per_batch};")
        r.emit(f"int kz0 = kz * {kspan};")
    r.emit("int lid = int(gl_LocalInvocationID.x);")
    r.emit("int sgid = int(gl_SubgroupID);")
    r.emit(f"int bt = grp / {per_batch};")
    r.emit(f"int pid = grp % {per_batch};")
    # grouped order: GROUP_M row tiles share each column tile while it is in the cache
    r.emit(f"int gfirst = (pid / {GROUP_M * tiles_n}) * {GROUP_M};")
    r.emit(f"int gsize = min({tiles_m} - gfirst, {GROUP_M});")
    r.emit("int tm = gfirst + (pid % gsize);")
    r.emit(f"int tn = (pid % {GROUP_M * tiles_n}) / gsize;")
    r.emit(f"int wr = sgid / {wn};")
    r.emit(f"int wc = sgid % {wn};")
    bc = unravel(Var("bt", 0, nb - 1), batch)

    # the fragment component types as GLSL spells them (bfloat16: float16_t, renamed in the SPIR-V)
    at_, zero_ = ("int32_t", "0") if int8 else ("float", "0.0")
    ct_a, ct_b = (f"{_BYTES[ta]}_t", f"{_BYTES[tb]}_t") if int8 else ("float16_t", "float16_t")
    if compute is dtypes.bfloat16:
        r.emit(BF16_FRAGMENTS)
    # every fragment, register and slice loop is unrolled here: fragment arrays indexed in a loop the driver
    # does not unroll would live in local memory
    acc_t = f"coopmat<{at_}, gl_ScopeSubgroup, {fm}, {fn}, gl_MatrixUseAccumulator>"
    acc = [[f"acc{i}_{j}" for j in range(ffn)] for i in range(ffm)]
    for row_ in acc:
        for name_ in row_:
            r.emit(f"{acc_t} {name_} = {acc_t}({zero_});")

    chunks_a = a_outer * (a_inner // vw)
    chunks_b = b_outer * (b_inner // vw)
    per_a, per_b = math.ceil(chunks_a / nt), math.ceil(chunks_b / nt)

    def base_index(op: _Operand, which: str) -> str:
        """The operand's start, in 16-byte units, for this workgroup's batch entry (vector operands)."""
        _, vs, off = op.vec
        terms = [str(off)] if off else []
        rest = nb
        for i, dim in enumerate(batch):
            rest //= dim
            if vs[i]:
                terms.append(f"((bt / {rest}) % {dim}) * {vs[i]}" if rest > 1 else f"(bt % {dim}) * {vs[i]}")
        return r.define("int", " + ".join(terms) if terms else "0", f"base{which}")

    def fetch(op: _Operand, regs: str, tile_r0: str, tile_c0: str, outer: int, inner: int, per: int,
              base: str | None, whole: tuple[bool, bool]) -> None:
        """Emit reads of op's slice into the uvec4 registers `regs`0.., zero outside the operand; `whole`: whether
        the operand's rows (columns) are a whole number of tiles, so that no read of a chunk needs their check."""
        chunks = outer * (inner // vw)
        for c in range(per):
            r.emit(f"{regs}{c} = uvec4(0u);")
            with r.block("if (true)"):
                r.emit(f"int e = lid + {c * nt};")
                # shared row `so` and chunk `si` of the tile; (gr, gc): the chunk's first element
                row, col = spread("e", inner // vw, outer)
                r.emit(f"int so = {row};")
                r.emit(f"int si = ({col}) * {vw};")
                r.emit(f"int gr = {tile_r0} + {'si' if op.col_major else 'so'};")
                r.emit(f"int gc = {tile_c0} + {'so' if op.col_major else 'si'};")
                guard = ([] if (c + 1) * nt <= chunks else [f"e < {chunks}"]) + \
                    [g for g, w in ((f"gr < {op.rows}", whole[0]), (f"gc < {op.cols}", whole[1])) if not w]
                with r.block(f"if ({' && '.join(guard) or 'true'})"):
                    if op.vec is not None:
                        ref, vs, _ = op.vec
                        bnd = r.binding(ref, ref.dtype)
                        r.block_types[bnd] = "uvec4"
                        idx = [base]
                        if vs[-2]:
                            idx.append(f"gr * {vs[-2]}")
                        if vs[-1]:
                            idx.append(f"gc * {vs[-1]}")
                        idx.append(f"({'gr' if op.col_major else 'gc'} >> {sh})")
                        r.emit(f"{regs}{c} = b{bnd}.data[{' + '.join(idx)}];")
                    else:
                        vals = []
                        # int8 values as int (exact: the operand holds int8 values)
                        node, xt = op.node, (dtypes.int32 if int8 else compute)
                        for j in range(vw):
                            rv = r.define("int", f"gr + {j}" if op.col_major else "gr", "rr")
                            cv = r.define("int", "gc" if op.col_major else f"gc + {j}", "cc")
                            x = r.define("int" if int8 else "float", zero_, "x")
                            with r.block(f"if ({rv} < {op.rows} && {cv} < {op.cols})"):
                                coords = bc + (Var(rv, 0, op.rows - 1), Var(cv, 0, op.cols - 1))
                                val = r.value(node, coords)
                                r.emit(f"{x} = {glsl.cast(val, node.dtype, xt, r.need)};")
                            vals.append(x)
                        r.emit(f"{regs}{c} = {_pack(compute, vals)};")

    def put(regs: str, per: int, chunks: int, inner: int, stride: int, at: str) -> None:
        outer = chunks // (inner // vw)
        for c in range(per):
            e = f"(lid + {c * nt})"
            cond = "" if (c + 1) * nt <= chunks else f"if ({e} < {chunks}) "
            row, col = spread(e, inner // vw, outer)
            r.emit(f"{cond}sm[{at} + ({row}) * {stride} + ({col})] = {regs}{c};")

    base_a = base_index(opa, "a") if opa.vec else None
    base_b = base_index(opb, "b") if opb.vec else None
    pf = cfg.pf
    sets = ("r", "q")[:pf]  # register sets: with pf 2 the slices in flight alternate between two
    for s_ in sets:
        r.emit(f"uvec4 {', '.join(f'a{s_}{c}' for c in range(per_a))};")
        r.emit(f"uvec4 {', '.join(f'b{s_}{c}' for c in range(per_b))};")
    # (rows, columns) whole tiles: A is M x K, B is K x N
    whole_k = kspan % bk == 0
    whole_a, whole_b = (m_ % bm == 0, whole_k), (whole_k, n_ % bn == 0)

    def load_slice(k0: str, s_: str) -> None:
        k0 = f"kz0 + {k0}" if ks > 1 else k0
        fetch(opa, f"a{s_}", f"tm * {bm}", k0, a_outer, a_inner, per_a, base_a, whole_a)
        fetch(opb, f"b{s_}", k0, f"tn * {bn}", b_outer, b_inner, per_b, base_b, whole_b)

    def store_slice(at: str, s_: str) -> None:
        put(f"a{s_}", per_a, chunks_a, a_inner, a_stride, at)
        put(f"b{s_}", per_b, chunks_b, b_inner, b_stride, f"{at} + {a_size}")

    load_slice("0", sets[0])
    store_slice("0", sets[0])
    if pf == 2 and nk > 1:
        load_slice(f"{bk}", sets[1])
    r.emit("barrier();")
    a_t = f"coopmat<{ct_a}, gl_ScopeSubgroup, {fm}, {fk}, gl_MatrixUseA>"
    b_t = f"coopmat<{ct_b}, gl_ScopeSubgroup, {fk}, {fn}, gl_MatrixUseB>"
    lay_a = "gl_CooperativeMatrixLayoutColumnMajor" if opa.col_major else "gl_CooperativeMatrixLayoutRowMajor"
    lay_b = "gl_CooperativeMatrixLayoutColumnMajor" if opb.col_major else "gl_CooperativeMatrixLayoutRowMajor"
    r.emit(f"int arow = wr * {tm_};")
    r.emit(f"int bcol = wc * {tn_};")

    def step(kt: str, load_set: str, store_set: str) -> None:
        """Slice kt multiplied from shared memory while slice kt + pf is read into registers load_set; then slice
        kt + 1 (read pf - 1 steps earlier, into store_set) is stored for the next step."""
        r.emit(f"int cur = (({kt}) & 1) * {stage};" if cfg.stages == 2 else "int cur = 0;")
        with r.block(f"if ({kt} + {pf} < {nk})"):  # the reads are in flight during the multiplies
            load_slice(f"({kt} + {pf}) * {bk}", load_set)
        # fragments are declared in the step's block, so none is carried from one step to the next, as arrays
        # (indexed by constants): NVIDIA's 580 driver crashed creating the pipeline when they were declared as
        # several variables of one statement
        r.emit(f"{a_t} fa[{ffm}];")
        r.emit(f"{b_t} fb[{ffn}];")
        for kk in range(0, bk, fk):
            # fragment starts in 16-byte units (rows, columns and kk are multiples of a chunk's elements); each
            # fragment is loaded once and used by every product of its row (column) of accumulators
            for i in range(ffm):
                row = f"arow + {i * fm}"
                at = f"{kk} * {a_stride} + (({row}) >> {sh})" if opa.col_major else f"({row}) * {a_stride} + {kk // vw}"
                r.emit(f"coopMatLoad(fa[{i}], sm, cur + {at}, {a_stride}, {lay_a});")
            for j in range(ffn):
                col = f"bcol + {j * fn}"
                at = f"({col}) * {b_stride} + {kk // vw}" if opb.col_major else f"{kk} * {b_stride} + (({col}) >> {sh})"
                r.emit(f"coopMatLoad(fb[{j}], sm, cur + {a_size} + {at}, {b_stride}, {lay_b});")
            for i in range(ffm):
                for j in range(ffn):
                    r.emit(f"{acc[i][j]} = coopMatMulAdd(fa[{i}], fb[{j}], {acc[i][j]});")
        if cfg.stages == 1:
            r.emit("barrier();")  # every subgroup is done with the slice before it is overwritten
        with r.block(f"if ({kt} + 1 < {nk})"):
            store_slice(f"{stage} - cur" if cfg.stages == 2 else "0", store_set)
        r.emit("barrier();")

    if pf == 1:
        with r.block(f"for (int kt = 0; kt < {nk}; kt++)"):
            step("kt", sets[0], sets[0])
    else:  # two steps a trip, so each names its register sets: even steps read into the first, odd the second
        with r.block(f"for (int kt = 0; kt < {nk}; kt += 2)"):
            with r.block("if (true)"):
                step("kt", sets[0], sets[1])
            with r.block(f"if (kt + 1 < {nk})"):
                step("(kt + 1)", sets[1], sets[0])

    # epilogue: per fragment row, stage in shared memory (this subgroup's own region), then per element: the
    # fused elementwise code and the kernel's output, or with K split the partial product into plane kz * nb + bt
    # of the scratch buffer
    t = mm.dtype.glsl
    scratch = BufferRef(dtypes.float32, ks * nb * m_ * n_) if ks > 1 else None
    if scratch is not None:
        r.emit(f"int kb = kz * {nb} + bt;")
    cbase = r.define("int", f"sgid * {fm * c_stride}", "cb")
    r.emit("int lane = int(gl_SubgroupInvocationID);")
    for i in range(ffm):
        for j in range(ffn):
            r.emit(f"coopMatStore({acc[i][j]}, sm, {cbase} + {j * fn // 4}, {c_stride}, "
                   "gl_CooperativeMatrixLayoutRowMajor);")
        r.emit("subgroupMemoryBarrierShared();")
        r.emit("subgroupBarrier();")
        with r.block(f"for (int e = lane; e < {fm * tn_}; e += {sg})"):
            r.emit(f"int er = e / {tn_};")
            r.emit(f"int ec = e % {tn_};")
            r.emit(f"int m = tm * {bm} + arow + {i * fm} + er;")
            r.emit(f"int n = tn * {bn} + bcol + ec;")
            with r.block(f"if (m < {m_} && n < {n_})"):
                w = f"sm[{cbase} + er * {c_stride} + (ec >> 2)][ec & 3]"
                accv, acc_d = (f"int({w})", dtypes.int32) if int8 else (f"uintBitsToFloat({w})", dtypes.float32)
                mn = (Var("m", 0, m_ - 1), Var("n", 0, n_ - 1))
                if scratch is not None:
                    r.store(scratch, dtypes.float32, ShapeTracker.contiguous((ks * nb, m_, n_)),
                            (Var("kb", 0, ks * nb - 1),) + mn, accv)
                else:
                    r.subst[mm] = r.define(t, glsl.cast(accv, acc_d, mm.dtype, r.need), "mm")
                    r.store(k.out, k.out.dtype, k.st, bc + mn, r.value(k.root, bc + mn))
        r.emit("subgroupBarrier();")
    if compute is dtypes.bfloat16 and any(d is dtypes.float16 for i, (_, d) in enumerate(r.bindings)
                                          if i not in r.block_types):
        return None
    name = (f"MC_{nb}_{m_}_{n_}_{k_}_{bm}x{bn}x{bk}_{wm}x{wn}_s{cfg.stages}{f'_p{pf}' if pf > 1 else ''}"
            f"{f'_k{ks}' if ks > 1 else ''}{'_i8' if int8 else ''}")
    prog = _finish(r, name, nt, groups, lim, shared)
    prog.groups = _groups2d(groups, lim)
    if scratch is None:
        return Lowered([prog], [])
    # the planes summed in float32 (one rounding to mm's type after), then the kernel's epilogue, as a reduction
    from ..schedule import Kernel

    planes = buffer(scratch, 0, dtypes.float32, (ks, *batch, m_, n_))
    total = movement(reduce(planes, ReduceOp.SUM, (0,)), lambda st: st.reshape(mm.shape))
    if mm.dtype is not dtypes.float32:
        total = alu(Op.CAST, mm.dtype, total)
    second = _reduce(Kernel(substitute(k.root, {mm: total}), k.out, k.st), lim, params)
    return Lowered([prog, *second.programs], [scratch, *second.scratch])


def _groups2d(groups: int, lim: Limits) -> tuple[int, int, int]:
    mx = lim.max_group_count[0]
    return (groups, 1, 1) if groups <= mx else (mx, math.ceil(groups / mx), 1)


# ---- tile choice --------------------------------------------------------------------------------------------------


def shape_class(m: int, n: int, k: int, batch: int, compute: DType) -> str:
    """Products whose sizes round to the same powers of two share a tuned configuration."""
    def p2(x: int) -> int:
        return 1 << max(0, round(math.log2(max(x, 1))))
    return f"{compute.name}:{p2(m * batch)}x{p2(n)}x{p2(k)}"


def choose(m: int, n: int, k: int, batch: int, lim: Limits, frag: tuple[int, int, int], compute: DType) -> Config:
    """The measured configuration for this shape class on this device (Limits.tuned), else the default."""
    cls = shape_class(m, n, k, batch, compute)
    for c, v in lim.tuned:
        if c == cls and Config(*v).fits(frag, lim, compute.itemsize):
            return Config(*v)
    return default_config(m, n, k, batch, lim, frag, compute)

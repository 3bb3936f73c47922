"""Matrix products over GGUF weights on cooperative matrices: y = x @ W.T (+ residual), W stored quantized.

A prefill multiplies many activation rows by each weight matrix, which tensor cores do far faster than the
matvec templates. Rather than expanding W to a float16 copy first (dequant_f16.comp, then the generated matmul),
this program reads W's blocks as they are stored (the matvec layout, vkgraph.templates.matvec) and dequantizes
each slice of them into shared memory, where the cooperative matrices read it: W's bytes cross memory once per
tile, and no float16 copy is written or read.

The tiling is matmul_coop's (codegen/matmul_coop.py, which explains it): a workgroup computes a BM x BN tile of
y with WM x WN subgroups, slices BK deep are staged through shared memory, the next slice's words are read into
registers while the current one is multiplied. x comes as float16 rows [M, K]; W's slice of each row is BK / 16
chunks of 16 values. Per format, `_CODECS` holds two GLSL functions: `load_q` reads
a chunk's raw words (up to three 16-byte words and the bits of one float16 scale: Q8_0 16 int8 values; Q4_0 a
block's word, whose low or high nibbles are the chunk; Q4_K a super-block's header and one nibble word; Q6_K a
low-bits word, a high-bits word and the scales word) in the load phase, and `decode_q` turns them into 16 float16
values in the store phase: Q8_0 and Q4_0 in float16 arithmetic (`_SCALED`: numpy's value rounded to nearest even,
bit for bit, no conversion instruction), Q4_K and Q6_K as
dequant_f16.comp decodes them (rounded by packHalf2x16, in the device's rounding mode). Where a step decodes
relative to its products is the tile's ORDER (`Prefill`). `stage_source` runs the product's staging of W alone
(both functions, the same code), without cooperative matrices, so every device checks it against numpy.
Accumulation is float32, and so is y. The number of rows M is a push constant, so one pipeline serves every
prompt length.

Only devices with float16 cooperative matrices run it (a Limits.coop shape with float32 accumulation and a fixed
subgroup size); elsewhere QuantLinear keeps the float16 copy and the generated matmul.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..codegen import matmul_coop
from ..codegen.lower import Limits
from ..dtype import dtypes
from ..runtime import Device
from .common import check_buffer, grid_2d, product_output
from .matvec import DeviceWeights, Q8Acts

BLOCK = 32  # K is a whole number of 32-element (sub-)blocks
CHUNK = 16  # W is staged in chunks of 16 values (half a Q8_0/Q4_0 block), so a prefill slice is a multiple of 16 deep
# a float16 scale's raw bits (the low half of the returned word; the high half is the next scale or zero): the scales
# stay bits until they are used, so Q8_0's and Q4_0's go into float16 arithmetic with no conversion at all
_SCALE_BITS = "uint scale_bits(uint i) { return s[i >> 1] >> (16u * (i & 1u)); }"
# Q8_0's and Q4_0's values are small integers times a float16 scale: each byte b goes into a float16's low mantissa
# bits (0x6400 | b is 1024 + b exactly), the offset (1024 plus the format's zero) comes off exactly, and one float16
# multiply rounds the product, which equals numpy's dequantized value (exact in float32) rounded to float16. Two
# values an instruction and no conversion instructions, which run at a quarter of the arithmetic rate or less on
# NVIDIA GPUs; the other formats convert each value (`val`) and round it with packHalf2x16. `levels` puts bytes
# b0..b3 of v beside the 0x64 bytes: form 0 with shifts and masks, form 1 as a shuffle of byte vectors (one byte
# permute per pair where the compiler has one, NVIDIA's PRMT).
_LEVELS = {
    0: """
uvec2 levels(uint v) {  // (1024 + b0, 1024 + b1), (1024 + b2, 1024 + b3) as float16 pairs
    return ((uvec2(v, v >> 16) & 0xFFu) | (uvec2(v << 8, v >> 8) & 0xFF0000u)) | 0x64006400u;
}""",
    1: """
#extension GL_EXT_shader_explicit_arithmetic_types_int8 : require
uvec2 levels(uint v) {  // (1024 + b0, 1024 + b1), (1024 + b2, 1024 + b3) as float16 pairs
    u8vec4 b = unpack8(v);
    uint8_t e = uint8_t(0x64u);
    return uvec2(pack32(u8vec4(b.x, e, b.y, e)), pack32(u8vec4(b.z, e, b.w, e)));
}"""}
_SCALED = """
void scaled16(uvec4 v, f16vec2 off, f16vec2 d, out uvec4 lo, out uvec4 hi) {  // 16 bytes of v, less off, times d
    uvec2 p0 = levels(v.x), p1 = levels(v.y), p2 = levels(v.z), p3 = levels(v.w);
    lo = uvec4(packFloat2x16((unpackFloat2x16(p0.x) - off) * d), packFloat2x16((unpackFloat2x16(p0.y) - off) * d),
               packFloat2x16((unpackFloat2x16(p1.x) - off) * d), packFloat2x16((unpackFloat2x16(p1.y) - off) * d));
    hi = uvec4(packFloat2x16((unpackFloat2x16(p2.x) - off) * d), packFloat2x16((unpackFloat2x16(p2.y) - off) * d),
               packFloat2x16((unpackFloat2x16(p3.x) - off) * d), packFloat2x16((unpackFloat2x16(p3.y) - off) * d));
}"""
FORM = 0  # the form of `levels` where a tile names none (decode tiles, the staging checks)
# Per format: GLSL of load_q(row, e0, r0, r1, r2, sc), which reads the raw words of W[row, e0 .. e0 + 16) (e0 % 16
# == 0) and the bits of its float16 scale (where it has one apart), and decode_q(e0, r0, r1, r2, sc, lo, hi), which
# turns them into the 16 values as float16 pairs. WS and SS are W's row strides in 16-byte words and in float16
# scales. Each follows dequant_f16.comp's decoding.
_CODECS = {
    "Q8_0": """
void load_q(int row, int e0, out uvec4 r0, out uvec4 r1, out uvec4 r2, out uint sc) {
    r0 = w[row * WS + e0 / 16]; r1 = uvec4(0u); r2 = uvec4(0u);
    sc = scale_bits(uint(row * SS + e0 / 32));
}
void decode_q(int e0, uvec4 r0, uvec4 r1, uvec4 r2, uint sc, out uvec4 lo, out uvec4 hi) {
    // int8 q, as the byte q + 128 (sign bit flipped): 1024 + q + 128 - 1152 = q
    scaled16(r0 ^ 0x80808080u, f16vec2(float16_t(1152.0)), unpackFloat2x16(sc).xx, lo, hi);
}""",
    "Q4_0": """
void load_q(int row, int e0, out uvec4 r0, out uvec4 r1, out uvec4 r2, out uint sc) {
    r0 = w[row * WS + e0 / 32]; r1 = uvec4(0u); r2 = uvec4(0u);
    sc = scale_bits(uint(row * SS + e0 / 32));
}
void decode_q(int e0, uvec4 r0, uvec4 r1, uvec4 r2, uint sc, out uvec4 lo, out uvec4 hi) {
    // low nibbles: values 0-15, high: 16-31; nibble q: 1024 + q - 1032 = q - 8
    uvec4 q = (r0 >> (4u * uint((e0 >> 4) & 1))) & 0x0F0F0F0Fu;
    scaled16(q, f16vec2(float16_t(1032.0)), unpackFloat2x16(sc).xx, lo, hi);
}""",
    "Q4_K": """
void load_q(int row, int e0, out uvec4 r0, out uvec4 r1, out uvec4 r2, out uint sc) {
    // a super-block: a header word (d, dmin, 12 bytes of scales and mins), then 8 nibble words; word 2j + t holds
    // values 64j + 16t .. (low nibbles) and 64j + 32 + 16t .. (high nibbles)
    int sbw = row * WS + (e0 >> 8) * 9, wi = e0 & 255;
    r0 = w[sbw]; r1 = w[sbw + 1 + 2 * (wi >> 6) + ((wi >> 4) & 1)]; r2 = uvec4(0u); sc = 0u;
}
vec4 val(int e0, uvec4 r0, uvec4 r1, uvec4 r2, uint sc, int i) {  // (d * scale) * q - dmin * min
    int wi = e0 & 255, j = wi >> 6, hf = (wi >> 5) & 1;
    uint sh = 16u * uint(j & 1);
    uint y = r0.y >> sh, z = r0.z >> sh, x4 = r0.w >> sh;
    uvec2 scv, mnv;
    if (j < 2) {
        scv = uvec2(y, y >> 8) & 63u;
        mnv = uvec2(z, z >> 8) & 63u;
    } else {
        scv = (uvec2(x4, x4 >> 8) & 0xFu) | ((uvec2(y, y >> 8) >> 2) & 0x30u);
        mnv = ((uvec2(x4, x4 >> 8) >> 4) & 0xFu) | ((uvec2(z, z >> 8) >> 2) & 0x30u);
    }
    vec2 dm = unpackHalf2x16(r0.x);
    float a = dm.x * float(scv[hf]), b = dm.y * float(mnv[hf]);
    return a * vec4(bytes_of((r1[i] >> (4u * uint(hf))) & 0x0F0F0F0Fu)) - b;
}""",
    "Q6_K": """
void load_q(int row, int e0, out uvec4 r0, out uvec4 r1, out uvec4 r2, out uint sc) {
    // a super-block: 8 low-bits words, 4 high-bits words, the int8 scales word; d in the scales buffer. Values
    // 128hh + 32r + 16t ..: low bits in word 4hh + 2(r & 1) + t (nibble r >> 1), high bits in word 8 + 2hh + t
    int sbw = row * WS + (e0 >> 8) * 13, wi = e0 & 255;
    int hh = wi >> 7, r = (wi >> 5) & 3, t = (wi >> 4) & 1;
    r0 = w[sbw + 4 * hh + 2 * (r & 1) + t]; r1 = w[sbw + 8 + 2 * hh + t]; r2 = w[sbw + 12];
    sc = scale_bits(uint(row * SS + (e0 >> 8)));
}
vec4 val(int e0, uvec4 r0, uvec4 r1, uvec4 r2, uint sc, int i) {  // (d * scale) * (q - 32)
    int wi = e0 & 255, hh = wi >> 7, r = (wi >> 5) & 3, t = (wi >> 4) & 1, bi = t + 2 * r;
    uvec2 scs = hh == 0 ? r2.xy : r2.zw;
    float ds = unpackHalf2x16(sc).x * float(bitfieldExtract(int(scs[bi >> 2]), 8 * (bi & 3), 8));
    uint l = r0[i] >> (4u * uint(r >> 1));
    return ds * (vec4(bytes_of((l & 0x0F0F0F0Fu) | (((r1[i] >> (2u * uint(r))) & 0x03030303u) << 4))) - 32.0);
}""",
}
_DECODE = """
void decode_q(int e0, uvec4 r0, uvec4 r1, uvec4 r2, uint sc, out uvec4 lo, out uvec4 hi) {
    vec4 v0 = val(e0, r0, r1, r2, sc, 0), v1 = val(e0, r0, r1, r2, sc, 1);
    vec4 v2 = val(e0, r0, r1, r2, sc, 2), v3 = val(e0, r0, r1, r2, sc, 3);
    lo = uvec4(packHalf2x16(v0.xy), packHalf2x16(v0.zw), packHalf2x16(v1.xy), packHalf2x16(v1.zw));
    hi = uvec4(packHalf2x16(v2.xy), packHalf2x16(v2.zw), packHalf2x16(v3.xy), packHalf2x16(v3.zw));
}"""
FORMATS = tuple(_CODECS)


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"matmul_quant: unsupported format {fmt!r}; known: {FORMATS}")


def _codec(fmt: str, w_stride: int, s_stride: int, form: int = FORM) -> list[str]:
    """The helper functions of format fmt's decoding, for W's strides, `levels` in form `form` (the program
    enables float16 arithmetic)."""
    return [f"const int WS = {w_stride}, SS = {s_stride};",
            "uvec4 bytes_of(uint v) { return uvec4(v, v >> 8, v >> 16, v >> 24) & 0xFFu; }",
            _SCALE_BITS, _LEVELS[form], _SCALED, _CODECS[fmt], *([_DECODE] if "vec4 val(" in _CODECS[fmt] else [])]


def _check_weights(weights: DeviceWeights) -> Any:
    """Check that W's buffers hold its N rows at their strides; returns the buffer to bind as the scales (W's body
    where the format keeps none apart, Q4_K: bound, never read)."""
    n = weights.shape[0]
    check_buffer("weights.body", weights.body, n * weights.w_stride * 16)
    if weights.scales is None:
        return weights.body
    check_buffer("weights.scales", weights.scales, (n * weights.s_stride + 1) // 2 * 4)
    return weights.scales


def shape_class(fmt: str, m: int, n: int, k: int) -> str:
    """The key of measured tiles (codegen.tune) for products over fmt blocks: the format, then matmul_coop's class."""
    return f"{fmt}:{matmul_coop.shape_class(m, n, k, 1, dtypes.float16)}"


@dataclass(frozen=True)
class Prefill(matmul_coop.Config):
    """A prefill tile: matmul_coop's Config plus ORDER, where each step decodes the next slice of W: 0 after the
    current slice's products (behind a branch: the products, then the decoding), 1 before them, 2 between their
    16-deep steps (see `source`). Two stages take the decoded slice into the other stage at once; one stage keeps
    it in registers until every subgroup is done with the current slice. FORM: how Q8_0's and Q4_0's bytes are
    placed into float16 levels (`_LEVELS`; the same values either way, a tile's speed not: RESULTS.md). WSTAGES 2
    (with one stage of x, one slice in flight): W's slices get two stages of their own and two register sets, so
    each step decodes the next slice straight into W's other stage between its products (read a step earlier: no
    wait on the read, no decoded values held in registers), and only x's words are stored after the barrier."""

    order: int = 0
    form: int = FORM
    wstages: int = 1

    def key(self) -> list[int]:
        return [*super().key(), self.order, self.form, self.wstages]

    def label(self) -> str:
        return (super().label() + (f"/o{self.order}" if self.order else "") + (f"/f{self.form}" if self.form else "")
                + ("/w2" if self.wstages == 2 else ""))

    def shared_bytes(self, itemsize: int = 2) -> int:
        p = 16 // itemsize
        return super().shared_bytes(itemsize) + (self.wstages - 1) * itemsize * max(
            self.bn * (self.bk + p), self.bk * (self.bn + p))

    def fits(self, frag: tuple[int, int, int], lim: Limits, itemsize: int = 2) -> bool:
        return (super().fits(frag, lim, itemsize) and self.order in (0, 1, 2) and self.form in _LEVELS
                and (self.wstages == 1 or self.wstages == 2 and self.stages == 1 and self.pf == 1))


# The prefill product's tiles where none was measured for the format's class (`bench_matmul.py --quant Q4_0 --tune`
# on an H200, 2026-12-02, eleventh session, RESULTS.md): 256 x 128 x 32 in one stage, 64 x 64 per subgroup, the
# levels as byte shuffles (FORM 1), the fastest on gate_up at 512 rows (214 TFLOP/s), where the rows fill its tiles
# and the output has WIDE_TILES of them; else 128 x 128 x 64 in one stage with subgroups of 32 x 64; else, where K is
# no whole number of 64-deep slices, the best 32-deep tile with two stages; else 64 x 64 (a device of little shared
# memory). Outputs of 64 such tiles (o and down: N = 4096 at 512 rows) ran at half 128 x 128 x 64's rate in the
# twelfth session's default timings (o 102 against 171 TFLOP/s, down 99 against 184; qkv's 96 tiles 153 against
# about 190), though a search had ranked them the other way: WIDE_TILES leaves them the smaller tile.
DEFAULT = Prefill(256, 128, 32, 4, 2, 1, 1, 1, 0, 1)
DEFAULT_FEW = Prefill(128, 128, 64, 4, 2, 1)
FALLBACKS = (Prefill(128, 128, 32, 4, 2), Prefill(64, 64, 32, 2, 2))
WIDE_TILES = 128
# The tiles `bench_matmul.py --quant --tune` measures (those that fit the device, take whole slices of K and, with
# K split, split an output of few tiles). Its searches (RESULTS.md, tenth and eleventh sessions) put one stage first:
# 256 x 128 x 32 and 128 x 256 x 32 with 64 x 64 per subgroup (the fewest fragment loads per product), 128 x 128 x 64
# with 32 x 64, each in both forms of `levels` or in the orders that came close. Two stages: at 48 KiB
# 128 x 128 x 32 is the largest 32-deep tile. K split for outputs of few tiles (N = 4096 at 512 rows: 64 of
# 256 x 128, 128 of 128 x 128). WSTAGES 2 fits 256 x 128 x 32 in 40 KiB. Left out, 10-55% behind the best: tiles
# of 16 subgroups, of 64 rows or 64 x 32 per subgroup, 16-deep slices, 128 x 192 (one workgroup a multiprocessor for
# qkv), an invocation staging both chunks of a block (fewer instructions, yet 5-15% slower), and A fragments read
# from x in device memory with W alone in shared memory (two stages of 128 x 256 x 32: 90-127).
_S2, _S1 = 2, 1
CANDIDATES = (
    DEFAULT, Prefill(256, 128, 32, 4, 2, _S1), Prefill(256, 128, 32, 4, 2, _S1, 1, 1, 2, 1),
    *(Prefill(128, 256, 32, 2, 4, _S1, 1, 1, o, f) for o, f in ((2, 0), (0, 1), (0, 0))),
    DEFAULT_FEW, Prefill(128, 128, 64, 4, 2, _S1, 1, 1, 0, 1), Prefill(128, 128, 64, 4, 2, _S1, 1, 1, 1),
    Prefill(128, 128, 64, 2, 4, _S1, 2, 1, 2),
    FALLBACKS[0], Prefill(128, 128, 32, 2, 4, _S2, 2, 1, 1), Prefill(128, 128, 32, 2, 4, _S2, 2, 1, 2),
    # W in two stages of its own beside one of x
    *(Prefill(256, 128, 32, 4, 2, _S1, 1, 1, 0, f, 2) for f in (1, 0)), Prefill(128, 128, 32, 4, 2, _S1, 1, 1, 0, 1, 2),
    Prefill(256, 128, 32, 4, 2, _S1, 1, 2, 0, 1, 2),
    # K split
    Prefill(256, 128, 32, 4, 2, _S1, 1, 2, 0, 1), Prefill(128, 256, 32, 2, 4, _S1, 1, 2, 2),
    Prefill(128, 128, 64, 4, 2, _S1, 1, 2, 0))


def candidates(lim: Limits, m: int, n: int, k: int) -> list[Prefill]:
    """The tiles of CANDIDATES a search measures for an m x n product over K = k on this device."""
    frag = matmul_coop.fragment(lim, "float16")
    if frag is None or k % BLOCK:
        return []
    return [c for c in CANDIDATES if c.fits(frag, lim) and _whole(c, k) and (
        c.ks == 1 or math.ceil(m / c.bm) * math.ceil(n / c.bn) < matmul_coop.SPLIT_TILES)]


def config(lim: Limits, m: int, n: int, k: int, fmt: str = "") -> Prefill | None:
    """The tile configuration for an m x n product over K = k on this device, or None where the device has no
    fitting float16 cooperative matrices (or k is not a whole number of blocks): the one measured for fmt's
    products of this class (benchmarks/bench_matmul.py --quant --tune), else DEFAULT where the rows fill its tiles
    (M at least its BM) and the output has WIDE_TILES of them, else DEFAULT_FEW, else FALLBACKS (the first that
    fits the device and takes whole slices of K). The float16 product's choices are not taken: its staging is
    another program's."""
    if not lim.coop or lim.min_subgroup != lim.max_subgroup or lim.subgroup < 1 or k % BLOCK or m < 1 or n < 1:
        return None
    frag = matmul_coop.fragment(lim, "float16")
    if frag is None:
        return None
    cls = shape_class(fmt, m, n, k)
    for c, v in lim.tuned:
        if c == cls and (cfg := Prefill(*v)).fits(frag, lim) and _whole(cfg, k):
            return cfg
    wide = m >= DEFAULT.bm and math.ceil(m / DEFAULT.bm) * math.ceil(n / DEFAULT.bn) >= WIDE_TILES
    for cfg in ((DEFAULT,) if wide else ()) + (DEFAULT_FEW, *FALLBACKS):
        if _whole(cfg, k) and cfg.fits(frag, lim):
            return cfg
    return None


def _whole(cfg: matmul_coop.Config, k: int) -> bool:
    """Whether cfg's slices are whole chunks and K a whole number of slices in each of its KS parts."""
    return cfg.bk % CHUNK == 0 and k % (cfg.bk * cfg.ks) == 0


@dataclass(frozen=True)
class Tile(matmul_coop.Config):
    """A tile for few rows (a batched decode step): matmul_coop's Config plus WK subgroups that split each slice's
    depth among themselves (their partial tiles summed through shared memory at the end). This program takes the
    Config's PF (2: the next but one slice is read while the next is decoded, in two alternating register sets)
    and KS (workgroups that split K: each writes its partial product to its own [m, n] plane of the output; the
    caller sums the planes) from any tile. With one or two fragment rows of y per workgroup, N / BN tiles alone are
    too few to keep W streaming from every multiprocessor at N = 4096: the splits and the depth of reads in flight
    multiply the loads in flight."""

    wk: int = 1

    def threads(self, subgroup: int) -> int:
        return self.wm * self.wn * self.wk * subgroup

    def fits(self, frag: tuple[int, int, int], lim: Limits) -> bool:
        fm, fn, fk = frag
        epilogue = self.wm * self.wn * self.wk * fm * ((self.bn // self.wn + 4) // 4) * 16
        return (self.bm % (self.wm * fm) == 0 and self.bn % (self.wn * fn) == 0 and self.bk % (self.wk * fk) == 0
                and self.bk % BLOCK == 0 and self.threads(lim.subgroup) <= lim.max_invocations
                and max(self.shared_bytes(), epilogue) <= lim.max_shared and self.ks >= 1 and self.pf in (1, 2))


def _splits(cfg: matmul_coop.Config) -> tuple[int, int, int]:
    """(wk, ks, pf) of a tile; a Config does not split a slice's depth."""
    return (cfg.wk if isinstance(cfg, Tile) else 1), cfg.ks, cfg.pf


DECODE_GROUPS = 512  # workgroups a small-M product aims for (about four per multiprocessor of an H200)


def decode_config(lim: Limits, m: int, n: int, k: int) -> Tile | None:
    """The tile for a product of few rows (m < 64, a batched decode step) over K = k, or None where the device has
    no fitting float16 cooperative matrices: all m rows (whole fragments) by 32 columns, slices 64 deep (32 where K
    is not a multiple of 64) split between 2 subgroups, and K split among up to 8 workgroups until the product has
    DECODE_GROUPS of them. On an H200 (2026-12-02, `bench_matvec_launch.py --mm-sweep`, Q4_0 o and gate_up at 8 and
    32 rows) 64-deep slices between 2 subgroups were the fastest of 24 tiles on all four, 1.4-1.7x the 256-deep
    slices between 4 subgroups chosen before: shallow slices keep more workgroups resident per multiprocessor."""
    if not lim.coop or lim.min_subgroup != lim.max_subgroup or lim.subgroup < 1 or k % BLOCK or not 1 <= m < 64:
        return None
    frag = matmul_coop.fragment(lim, "float16")
    if frag is None or n < 1:
        return None
    fm, fn, fk = frag
    bm, bn = fm * math.ceil(m / fm), 2 * fn
    for bk in (64, 32):
        wk = max(1, min(2, bk // fk))
        if k % bk or bk % (wk * fk) or not Tile(bm, bn, bk, 1, 2, 1, wk=wk).fits(frag, lim):
            continue
        ks = 1
        while ks < 8 and math.ceil(n / bn) * ks < DECODE_GROUPS and (k // (2 * ks)) % bk == 0:
            ks *= 2
        return Tile(bm, bn, bk, 1, 2, 1, wk=wk, ks=ks)
    return None


# ---- staging W's slices: the same code in the product and in stage_source, which checks it on any device ----------


def _declare_w(emit: Any, bn: int, bk: int, nt: int, reg: str = "") -> None:
    for c in range(math.ceil(bn * (bk // 16) / nt)):
        emit(f"uvec4 br{c}{reg}_0 = uvec4(0u), br{c}{reg}_1 = uvec4(0u), br{c}{reg}_2 = uvec4(0u);")
        emit(f"uint bs{c}{reg} = 0u;")


def _deal(e: str, kb: int, rows: int) -> tuple[str, str]:
    """(row of the tile, chunk j of the row) of W's staged chunk e, rows of kb chunks of 16 values (each stored as
    two 16-byte words, rows padded by one word). Eight invocations' stores go to the banks together: in row
    order, 2 chunks a row (BK 32) or 8 and more (BK 128, 256) put two of them in one bank, so those are dealt
    by rows r, r + 1, r + 4, r + 5 (2 a row) or by two rows of 4 chunks each; all 8 then fall in distinct banks.
    A warp's chunks are the same rows and chunks as in row order, so its global reads are too."""
    if kb == 2 and rows % 8 == 0:
        return (f"(({e}) >> 4) * 8 + ((({e}) >> 1) & 1) + ((({e}) >> 2) & 1) * 4 + ((({e}) >> 3) & 1) * 2",
                f"({e}) & 1")
    if kb >= 8 and rows % 2 == 0:
        return f"(({e}) / {2 * kb}) * 2 + ((({e}) >> 2) & 1)", f"(({e}) & 3) + ((({e}) >> 3) & {kb // 4 - 1}) * 4"
    return f"({e}) / {kb}", f"({e}) % {kb}"


def _load_w(emit: Any, n: int, bn: int, bk: int, nt: int, k0: str, reg: str = "") -> None:
    """The raw words of every chunk of 16 values of W's slice from element k0, rows tn * bn ..: load_q into the
    registers br*, bs*; zero past row n (no test where N is whole tiles and the chunks whole rounds of nt)."""
    chunks, kb = bn * (bk // 16), bk // 16
    for c in range(math.ceil(chunks / nt)):
        guard = f"e < {chunks} && " if (c + 1) * nt > chunks else ""
        row, j = _deal("e", kb, bn)
        emit(f"{{ int e = lid + {c * nt}; int row = tn * {bn} + {row};")
        r = f"br{c}{reg}"
        load = f"load_q(row, ({k0}) + 16 * ({j}), {r}_0, {r}_1, {r}_2, bs{c}{reg});"
        if not guard and n % bn == 0:
            emit(f"  {load} }}")
            continue
        emit(f"  if ({guard}row < {n}) {load}")
        emit(f"  else {{ {r}_0 = uvec4(0u); {r}_1 = uvec4(0u); {r}_2 = uvec4(0u); bs{c}{reg} = 0u; }} }}")


def _store_w(emit: Any, bn: int, bk: int, nt: int, at: str, k0: str, reg: str = "", only: int | None = None,
             part: str = "") -> None:
    """The registers' chunks decoded (decode_q) into shared memory from `at`: bn rows of bk float16 values, rows
    padded by 8 values; with `only`, that round of chunks alone. Part "decode" only decodes round c into the
    registers dl<c>, dh<c>, part "store" only stores them (a one-stage step decodes while it multiplies, and stores
    once every subgroup is done with the slice)."""
    chunks, kb, stride = bn * (bk // 16), bk // 16, (bk + 8) // 8
    for c in range(math.ceil(chunks / nt)) if only is None else (only,):
        row, j = _deal("e", kb, bn)
        r = f"br{c}{reg}"
        decode = f"decode_q(({k0}) + 16 * ({j}), {r}_0, {r}_1, {r}_2, bs{c}{reg}, "
        if part == "decode":
            emit(f"{{ int e = lid + {c * nt}; {decode}dl{c}, dh{c}); }}")
            continue
        cond = "" if (c + 1) * nt <= chunks else f"if (lid + {c * nt} < {chunks}) "
        emit(f"{{ int e = lid + {c * nt}; int j = {j};")
        emit(f"  {cond}{{ int at = {at} + ({row}) * {stride} + 2 * j;")
        if part == "store":
            emit(f"    sm[at] = dl{c}; sm[at + 1] = dh{c}; }} }}")
            continue
        emit(f"    uvec4 lo, hi; {decode}lo, hi);")
        emit("    sm[at] = lo; sm[at + 1] = hi; } }")


# ---- staging x's slices from int8 blocks (Q8Acts: int8 values, a float32 scale per 32) ----------------------------

_X8 = """
void decode_x8(uvec4 q, float d, out uvec4 lo, out uvec4 hi) {  // 16 int8 values times their block's scale
    vec4 v0 = vec4((ivec4(bytes_of(q.x)) << 24) >> 24) * d, v1 = vec4((ivec4(bytes_of(q.y)) << 24) >> 24) * d;
    vec4 v2 = vec4((ivec4(bytes_of(q.z)) << 24) >> 24) * d, v3 = vec4((ivec4(bytes_of(q.w)) << 24) >> 24) * d;
    lo = uvec4(packHalf2x16(v0.xy), packHalf2x16(v0.zw), packHalf2x16(v1.xy), packHalf2x16(v1.zw));
    hi = uvec4(packHalf2x16(v2.xy), packHalf2x16(v2.zw), packHalf2x16(v3.xy), packHalf2x16(v3.zw));
}"""


def _declare_x8(emit: Any, bm: int, bk: int, nt: int, reg: str = "") -> None:
    for c in range(math.ceil(bm * (bk // 16) / nt)):
        emit(f"uvec4 aq{c}{reg};")
        emit(f"float ad{c}{reg};")


def _load_x8(emit: Any, k: int, bm: int, bk: int, nt: int, k0: str, m: str, reg: str = "") -> None:
    """The int8 words and scale of every chunk of 16 values of x's slice from element k0, rows tm * bm .. (bindings
    xq, uvec4, and xd, float): into the registers aq*, ad*; zero past row m."""
    chunks, kb = bm * (bk // 16), bk // 16
    for c in range(math.ceil(chunks / nt)):
        guard = f"e < {chunks} && " if (c + 1) * nt > chunks else ""
        emit(f"{{ int e = lid + {c * nt}; int row = tm * {bm} + e / {kb}; int e0 = ({k0}) + 16 * (e % {kb});")
        emit(f"  if ({guard}row < {m}) {{ aq{c}{reg} = xq[row * {k // 16} + e0 / 16]; "
             f"ad{c}{reg} = xd[row * {k // 32} + e0 / 32]; }}")
        emit(f"  else {{ aq{c}{reg} = uvec4(0u); ad{c}{reg} = 0.0; }} }}")


def _store_x8(emit: Any, bm: int, bk: int, nt: int, at: str, reg: str = "") -> None:
    """The registers' chunks (decode_x8) into shared memory from `at`: bm rows of bk float16 values, rows padded by
    8 values (as W's)."""
    chunks, kb, stride = bm * (bk // 16), bk // 16, (bk + 8) // 8
    for c in range(math.ceil(chunks / nt)):
        cond = "" if (c + 1) * nt <= chunks else f"if (lid + {c * nt} < {chunks}) "
        emit(f"{{ int e = lid + {c * nt};")
        emit(f"  {cond}{{ int at = {at} + (e / {kb}) * {stride} + 2 * (e % {kb});")
        emit(f"    uvec4 lo, hi; decode_x8(aq{c}{reg}, ad{c}{reg}, lo, hi); sm[at] = lo; sm[at + 1] = hi; }} }}")


def stage_x_source(m: int, k: int, bm: int, bk: int, nt: int) -> str:
    """A program that runs only the product's staging of int8 activations: workgroup (tm, kt) of nt invocations
    loads rows tm * bm .. of x's slice at element kt * bk from the int8 blocks (xq, xd) and writes them as float16
    into shared memory, as the product does, then copies them out to float16 [m, k] (16-byte words)."""
    stride = (bk + 8) // 8
    L = ["#version 450", f"layout(local_size_x = {nt}) in;",
         "layout(set = 0, binding = 0) readonly buffer XQ { uvec4 xq[]; };",
         "layout(set = 0, binding = 1) readonly buffer XD { float xd[]; };",
         "layout(set = 0, binding = 2) writeonly buffer O { uvec4 o[]; };",
         f"shared uvec4 sm[{bm * stride}];",
         "uvec4 bytes_of(uint v) { return uvec4(v, v >> 8, v >> 16, v >> 24) & 0xFFu; }", _X8, "void main() {",
         "int lid = int(gl_LocalInvocationID.x), tm = int(gl_WorkGroupID.x), kt = int(gl_WorkGroupID.y);"]
    _declare_x8(L.append, bm, bk, nt)
    _load_x8(L.append, k, bm, bk, nt, f"kt * {bk}", str(m))
    _store_x8(L.append, bm, bk, nt, "0")
    _copy_out(L.append, m, k, bm, bk, nt, stride, "tm")
    return "\n".join(L)


def stage_source(fmt: str, n: int, k: int, w_stride: int, s_stride: int, bn: int, bk: int, nt: int,
                 form: int = FORM) -> str:
    """A program that runs only the product's staging of W: workgroup (tn, kt) of nt invocations loads and decodes
    the bn x bk slice of rows tn * bn .. at element kt * bk into shared memory, as the product does (`levels` in
    form `form`), then copies it out to float16 [n, k] (16-byte words). For checking the staging against numpy on
    any device."""
    _check_format(fmt)
    stride = (bk + 8) // 8
    L = ["#version 450", "#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require",
         f"layout(local_size_x = {nt}) in;",
         "layout(set = 0, binding = 0) readonly buffer W { uvec4 w[]; };",
         "layout(set = 0, binding = 1) readonly buffer S { uint s[]; };",
         "layout(set = 0, binding = 2) writeonly buffer O { uvec4 o[]; };",
         f"shared uvec4 sm[{bn * stride}];", *_codec(fmt, w_stride, s_stride, form), "void main() {",
         "int lid = int(gl_LocalInvocationID.x), tn = int(gl_WorkGroupID.x), kt = int(gl_WorkGroupID.y);"]
    _declare_w(L.append, bn, bk, nt)
    _load_w(L.append, n, bn, bk, nt, f"kt * {bk}")
    _store_w(L.append, bn, bk, nt, "0", f"kt * {bk}")
    _copy_out(L.append, n, k, bn, bk, nt, stride, "tn")
    return "\n".join(L)


def _copy_out(emit: Any, rows: int, k: int, tile_rows: int, bk: int, nt: int, stride: int, tile: str) -> None:
    """The end of a staging check program: after a barrier, the tile_rows x bk slice staged in shared memory
    (rows `stride` uvec4 apart) copied out to float16 [rows, k] at the tile's rows (`tile` * tile_rows ..) and
    slice kt; then main's closing brace."""
    emit("barrier();")
    emit(f"for (int e = lid; e < {tile_rows * (bk // 8)}; e += {nt}) {{")
    emit(f"  int r = e / {bk // 8}, c = e % {bk // 8}, row = {tile} * {tile_rows} + r;")
    emit(f"  if (row < {rows}) o[row * {k // 8} + kt * {bk // 8} + c] = sm[r * {stride} + c];")
    emit("}")
    emit("}")
    emit("")


def source(fmt: str, n: int, k: int, w_stride: int, s_stride: int, cfg: matmul_coop.Config,
           frag: tuple[int, int, int], subgroup: int, residual: bool, int8: bool = False) -> str:
    """The GLSL of the product for format fmt, W [n, k] with the given strides, tile cfg (a Config, or a Tile with
    its K splits) and fragment shape; x float16 rows, or with int8 the int8 blocks of Q8Acts (xq, xd)."""
    _check_format(fmt)
    fm, fn, fk = frag
    bm, bn, bk, wm, wn = cfg.bm, cfg.bn, cfg.bk, cfg.wm, cfg.wn
    wk, ks, pf = _splits(cfg)
    order, form, wsplit = (cfg.order, cfg.form, cfg.wstages == 2) if isinstance(cfg, Prefill) else (0, FORM, False)
    if residual and ks > 1:
        raise ValueError("matmul_quant: a product split over K writes partial planes; add the residual to their sum")
    nt = wm * wn * wk * subgroup
    tm_, tn_ = bm // wm, bn // wn
    ffm, ffn = tm_ // fm, tn_ // fn
    tiles_n = math.ceil(n / bn)
    kspan = k // ks  # elements of K each workgroup covers
    nk = kspan // bk
    a_stride = b_stride = (bk + 8) // 8  # shared rows in 16-byte units, padded by 8 elements
    a_size, b_size = bm * a_stride, bn * b_stride
    stage = a_size + b_size
    c_stride = (tn_ + 4) // 4  # a row of a subgroup's accumulators, float32, padded by 4
    smem = max(cfg.stages * stage + wsplit * b_size, wm * wn * wk * fm * c_stride)
    chunks_a = bm * (bk // 8)
    per_a = math.ceil(chunks_a / nt)
    rounds_w = math.ceil(bn * (bk // 16) / nt)  # W's chunks per invocation
    ka = bk // 8  # 8-element chunks of a row of x's slice (W's: 16-element chunks, _load_w)
    srow, scol = matmul_coop.spread("e", ka, bm)  # x's chunk e: the stores of each 8 invocations in distinct banks
    g_m = matmul_coop.GROUP_M
    L: list[str] = []
    emit = L.append

    def load_slice(k0: str, reg: str, w_reg: str | None = None) -> None:
        """x's and W's words of the slice from element k0 into registers reg (W's into w_reg where given; "-":
        x's alone)."""
        k0 = f"kz0 + {k0}"
        if w_reg != "-":
            _load_w(emit, n, bn, bk, nt, k0, reg if w_reg is None else w_reg)
        if int8:
            _load_x8(emit, k, bm, bk, nt, k0, "int(pc.m)", reg)
        else:  # x: row-major float16, 16-byte words; zero past row M
            for c in range(per_a):
                guard = f"e < {chunks_a} && " if (c + 1) * nt > chunks_a else ""
                emit(f"{{ int e = lid + {c * nt}; int row = tm * {bm} + {srow};")
                emit(f"  ar{c}{reg} = ({guard}row < int(pc.m)) ? "
                     f"x[row * {k // 8} + ({k0}) / 8 + ({scol})] : uvec4(0u); }}")

    def store_parts(at: str, k0: str, reg: str, part: str = "") -> list[Any]:
        """The staging of a slice into shared memory from `at` as parts that may be emitted apart: W's rounds of
        chunks first (the decoding), then x's; with part "decode" W's decoding into registers alone, with part
        "store" the rest (see _store_w)."""
        k0 = f"kz0 + {k0}"
        parts: list[Any] = [partial(_store_w, emit, bn, bk, nt, f"{at} + {a_size}", k0, reg, only=c, part=part)
                            for c in range(rounds_w)]
        if part == "decode":
            return parts
        if int8:
            return [*parts, partial(_store_x8, emit, bm, bk, nt, at, reg)]

        def store_x(c: int) -> None:
            cond = "" if (c + 1) * nt <= chunks_a else f"if (lid + {c * nt} < {chunks_a}) "
            emit(f"{{ int e = lid + {c * nt}; {cond}sm[{at} + ({srow}) * {a_stride} + ({scol})] = ar{c}{reg}; }}")
        return parts + [partial(store_x, c) for c in range(per_a)]

    def store_slice(at: str, k0: str, reg: str, part: str = "") -> None:
        for p in store_parts(at, k0, reg, part):
            p()

    acc_t = f"coopmat<float, gl_ScopeSubgroup, {fm}, {fn}, gl_MatrixUseAccumulator>"
    a_t = f"coopmat<float16_t, gl_ScopeSubgroup, {fm}, {fk}, gl_MatrixUseA>"
    b_t = f"coopmat<float16_t, gl_ScopeSubgroup, {fk}, {fn}, gl_MatrixUseB>"
    emit("int grp = int(gl_WorkGroupID.x + pc.groups_x * gl_WorkGroupID.y);")
    emit(f"int tiles_m = (int(pc.m) + {bm - 1}) / {bm};")
    emit(f"if (grp >= tiles_m * {tiles_n * ks}) return;")
    # K split: workgroups kz = 0 .. ks - 1 each take one span of K and write plane kz of the output
    emit(f"int kz = grp / (tiles_m * {tiles_n}); grp -= kz * tiles_m * {tiles_n}; int kz0 = kz * {kspan};")
    emit("int lid = int(gl_LocalInvocationID.x);")
    emit("int sgid = int(gl_SubgroupID);")
    emit(f"int smn = sgid % {wm * wn}, kidx = sgid / {wm * wn};")  # kidx: which part of a slice's depth
    # grouped order: GROUP_M row tiles share each column tile (its W slices) while it is in the cache
    emit(f"int gfirst = (grp / {g_m * tiles_n}) * {g_m};")
    emit(f"int gsize = min(tiles_m - gfirst, {g_m});")
    emit("int tm = gfirst + (grp % gsize);")
    emit(f"int tn = (grp % {g_m * tiles_n}) / gsize;")
    emit(f"int arow = (smn / {wn}) * {tm_};")
    emit(f"int bcol = (smn % {wn}) * {tn_};")
    emit(f"int kb8 = kidx * {bk // wk // 8};")
    # one declaration per statement: NVIDIA's 580 driver crashed creating pipelines declaring several at once
    for i in range(ffm):
        for j in range(ffn):
            emit(f"{acc_t} acc{i}_{j} = {acc_t}(0.0);")
    regs = ("", "p")[:pf]  # register sets: with pf = 2 the slices in flight alternate between two
    for reg in regs:
        if int8:
            _declare_x8(emit, bm, bk, nt, reg)
        else:
            emit(f"uvec4 {', '.join(f'ar{c}{reg} = uvec4(0u)' for c in range(per_a))};")
        _declare_w(emit, bn, bk, nt, reg)
    if wsplit:
        _declare_w(emit, bn, bk, nt, "p")
    if order and cfg.stages == 1:
        for c in range(rounds_w):
            emit(f"uvec4 dl{c} = uvec4(0u), dh{c} = uvec4(0u);")
    load_slice("0", "")
    store_slice("0", "0", "")
    if pf == 2 and nk > 1:
        load_slice(f"{bk}", "p")
    if wsplit and nk > 1:  # W runs a slice ahead of x: slice j's words in set j % 2 ("", "p")
        _load_w(emit, n, bn, bk, nt, f"kz0 + {bk}", "p")
    emit("barrier();")

    def products(a_at: str, b_at: str, k_at: str, ksteps: range, parts: list[Any]) -> None:
        """The fragments of each 16-deep step kk of ksteps loaded from shared memory (x's rows from a_at, W's from
        b_at, the step's K from k_at: GLSL prefixes) and multiplied into the accumulators; part p of `parts`
        emitted after the step p * steps // parts."""
        emit(f"{a_t} fa[{ffm}];")
        emit(f"{b_t} fb[{ffn}];")
        for s_, kk in enumerate(ksteps):
            for i in range(ffm):
                emit(f"coopMatLoad(fa[{i}], sm, {a_at}(arow + {i * fm}) * {a_stride} + {k_at}{kk // 8}, "
                     f"{a_stride}, gl_CooperativeMatrixLayoutRowMajor);")
            for j in range(ffn):
                emit(f"coopMatLoad(fb[{j}], sm, {b_at}(bcol + {j * fn}) * {b_stride} + {k_at}{kk // 8}, "
                     f"{b_stride}, gl_CooperativeMatrixLayoutColumnMajor);")
            for i in range(ffm):
                for j in range(ffn):
                    emit(f"acc{i}_{j} = coopMatMulAdd(fa[{i}], fb[{j}], acc{i}_{j});")
            for p_, part in enumerate(parts):
                if p_ * len(ksteps) // len(parts) == s_:
                    part()

    def w_step(kt: str, load_reg: str, decode_reg: str) -> None:
        """WSTAGES 2: slice kt multiplied (x at 0, W in stage kt % 2) while x's slice kt + 1 and W's kt + 2 are read
        (W's into set load_reg); W's slice kt + 1, read a step earlier (set decode_reg), is decoded into W's other
        stage between the products, unconditionally (past the last slice into the stage no one reads again); after
        the barrier x's words are stored, and a second barrier ends the step."""
        emit(f"int cur = {a_size} + (({kt}) & 1) * {b_size};")
        emit(f"if (({kt}) + 1 < {nk}) {{")
        load_slice(f"(({kt}) + 1) * {bk}", "", "-")
        emit("}")
        emit(f"if (({kt}) + 2 < {nk}) {{")
        _load_w(emit, n, bn, bk, nt, f"kz0 + (({kt}) + 2) * {bk}", load_reg)
        emit("}")
        parts = [partial(_store_w, emit, bn, bk, nt, f"{2 * a_size + b_size} - cur", f"kz0 + (({kt}) + 1) * {bk}",
                         decode_reg, only=c) for c in range(rounds_w)]
        products("", "cur + ", "", range(0, bk, fk), parts)
        emit("barrier();")
        emit(f"if (({kt}) + 1 < {nk}) {{")
        for p in store_parts("0", f"(({kt}) + 1) * {bk}", "")[rounds_w:]:  # x's words alone
            p()
        emit("}")
        emit("barrier();")

    def step(kt: str, load_reg: str, store_reg: str) -> None:
        """Slice kt multiplied from shared memory while slice kt + pf is read into registers load_reg; slice
        kt + 1 (read pf - 1 steps earlier, in store_reg) is decoded into shared memory: after the products (order
        0), or before them (1) or between their 16-deep steps (2), unconditionally, so that the step's products and
        decoding are one stretch of code the compiler can interleave. With two stages the staging goes into the
        other (past the last slice it fills the stage no one reads again); with one, W's decoding goes into
        registers, stored with x's words after a barrier (past the last slice, before the epilogue's barrier)."""
        emit(f"int cur = (({kt}) & 1) * {stage};" if cfg.stages == 2 else "int cur = 0;")
        emit(f"if (({kt}) + {pf} < {nk}) {{")
        load_slice(f"(({kt}) + {pf}) * {bk}", load_reg)
        emit("}")
        # two stages: the whole staging into the other; one: W's decoding into registers, stored after a barrier
        part = "decode" if cfg.stages == 1 else ""
        parts = store_parts(f"{stage} - cur", f"(({kt}) + 1) * {bk}", store_reg, part) if order else []
        if order == 1:
            for part in parts:
                part()
        products("cur + ", f"cur + {a_size} + ", "kb8 + ", range(0, bk // wk, fk), parts if order == 2 else [])
        if order:
            emit("barrier();")
            if cfg.stages == 1:
                store_slice("0", f"(({kt}) + 1) * {bk}", store_reg, "store")
                emit("barrier();")
            return
        if cfg.stages == 1:
            emit("barrier();")  # every subgroup is done with the slice before it is overwritten
        emit(f"if (({kt}) + 1 < {nk}) {{")
        store_slice(f"{stage} - cur" if cfg.stages == 2 else "0", f"(({kt}) + 1) * {bk}", store_reg)
        emit("}")
        emit("barrier();")

    if wsplit or pf == 2:  # two steps a trip, so each names its register sets: even steps read into "", odd into "p"
        one = w_step if wsplit else step
        emit(f"for (int kt = 0; kt < {nk}; kt += 2) {{")
        emit("{")
        one("kt", "", "p")
        emit("}")
        emit(f"if (kt + 1 < {nk}) {{")
        one("kt + 1", "p", "")
        emit("}")
        emit("}")
    else:
        emit(f"for (int kt = 0; kt < {nk}; kt++) {{")
        step("kt", "", "")
        emit("}")
    # epilogue: per fragment row, through this subgroup's own region of shared memory, then one element a lane;
    # with the depth split (wk > 1) the subgroups of part 0 add the other parts' regions
    region = fm * c_stride
    emit(f"int cb = sgid * {region};")
    emit("int lane = int(gl_SubgroupInvocationID);")
    out_row = "(kz * int(pc.m) + m)" if ks > 1 else "m"
    for i in range(ffm):
        for j in range(ffn):
            emit(f"coopMatStore(acc{i}_{j}, sm, cb + {j * fn // 4}, {c_stride}, gl_CooperativeMatrixLayoutRowMajor);")
        if wk > 1:
            emit("barrier();")
            emit("if (kidx == 0) {")
        else:
            emit("subgroupMemoryBarrierShared();")
            emit("subgroupBarrier();")
        emit(f"for (int e = lane; e < {fm * tn_}; e += {subgroup}) {{")
        emit(f"  int er = e / {tn_}, ec = e % {tn_};")
        emit(f"  int m = tm * {bm} + arow + {i * fm} + er, n = tn * {bn} + bcol + ec;")
        val = " + ".join(f"uintBitsToFloat(sm[cb + {q * wm * wn * region} + er * {c_stride} + (ec >> 2)][ec & 3])"
                         for q in range(wk))
        if residual:
            val += f" + res[m * {n} + n]"
        emit(f"  if (m < int(pc.m) && n < {n}) y[{out_row} * {n} + n] = {val};")
        emit("}")
        if wk > 1:
            emit("}")
            emit("barrier();")  # the regions are read before the next fragment row overwrites them
        else:
            emit("subgroupBarrier();")

    xbind = (["layout(set = 0, binding = 0) readonly buffer XQ { uvec4 xq[]; };",
              f"layout(set = 0, binding = {5 if residual else 4}) readonly buffer XD {{ float xd[]; }};"] if int8 else
             ["layout(set = 0, binding = 0) readonly buffer X { uvec4 x[]; };"])
    head = [
        "#version 450",
        "#extension GL_KHR_cooperative_matrix : require",
        "#extension GL_KHR_memory_scope_semantics : require",
        "#extension GL_KHR_shader_subgroup_basic : require",
        "#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require",
        f"// y = x @ W.T, W {fmt} [{n}, {k}], x {'int8 blocks' if int8 else 'float16'}; tile {bm}x{bn}x{bk}, "
        f"{wm}x{wn}x{wk} subgroups, K split {ks}, {cfg.stages} stage(s)",
        f"layout(local_size_x = {nt}) in;",
        *xbind,
        "layout(set = 0, binding = 1) readonly buffer W { uvec4 w[]; };",
        "layout(set = 0, binding = 2) readonly buffer S { uint s[]; };",
        "layout(set = 0, binding = 3) writeonly buffer Y { float y[]; };",
    ]
    if residual:
        head.append("layout(set = 0, binding = 4) readonly buffer R { float res[]; };")
    head += ["layout(push_constant) uniform Push { uint m; uint groups_x; } pc;",
             f"shared uvec4 sm[{smem}];",
             *_codec(fmt, w_stride, s_stride, form), *([_X8] if int8 else []),
             "void main() {"]
    return "\n".join(head + L + ["}", ""])


def matmul_quant(dev: Device, lim: Limits, weights: DeviceWeights, x: Any, m: int, cfg: matmul_coop.Config,
                 out: Any | None = None, residual: Any | None = None) -> Any:
    """y [m, N] float32 = x [m, K] @ W.T (+ residual [m, N] float32) into `out` or a new buffer; returns it. x is
    float16 rows (row-major), or int8 blocks (a Q8Acts: value = int8 * its block's scale, rounded to float16 as it
    is staged). A Tile splitting K over ks workgroups writes ks partial planes [ks, m, N] (their sum is y) and
    takes no residual. Records the dispatch; does not wait. cfg: from `config` or `decode_config` (not None)."""
    fmt = weights.format.name
    _check_format(fmt)
    n, k = weights.shape
    wk, ks, _ = _splits(cfg)
    if k % (cfg.bk * ks) or cfg.bk % CHUNK or k % BLOCK:
        raise ValueError(f"matmul_quant: K={k} is not a whole number of {BLOCK}-blocks and of {cfg.bk}-deep slices "
                         f"({CHUNK}-value chunks) in each of {ks} parts")
    if m < 1:
        raise ValueError(f"matmul_quant: no rows (m={m})")
    if residual is not None and ks > 1:
        raise ValueError("matmul_quant: a product split over K (ks > 1) takes no residual: add it to the planes' sum")
    frag = matmul_coop.fragment(lim, "float16")
    if frag is None or not cfg.fits(frag, lim):
        raise ValueError(f"matmul_quant: tile {cfg} does not fit this device's cooperative matrices")
    int8 = isinstance(x, Q8Acts)
    if int8:
        x.check(m, k)
    else:
        check_buffer("x", x, m * k * 2)
    scales = _check_weights(weights)
    nbytes = ks * m * n * 4
    out = product_output(dev, f"matmul_quant output [{ks}, {m}, {n}]", nbytes, out, residual)
    key = ("mmq", k, cfg, residual is not None, int8)
    kern = weights.pipelines.get(key)
    if kern is None:
        src = source(fmt, n, k, weights.w_stride, weights.s_stride, cfg, frag, lim.subgroup, residual is not None,
                     int8)
        kern = weights.pipelines[key] = dev.pipeline(src, name=f"matmul_quant_{fmt.lower()}")
    groups = grid_2d(dev, math.ceil(m / cfg.bm) * math.ceil(n / cfg.bn) * ks)
    bufs = [x.xq if int8 else x, weights.body, scales, out] + ([residual] if residual is not None else [])
    if int8:
        bufs.append(x.xd)
    dev.dispatch(kern, bufs, groups, push={"m": m, "groups_x": groups[0]})
    return out

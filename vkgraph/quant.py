"""GGUF weight formats in numpy, bit for bit as ggml stores them: F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS.

A `QuantizedTensor` holds a 2-D weight matrix as the raw GGUF blocks of its rows plus the format, so weights
read from a GGUF file keep their bits. `quantize` and `dequantize` are the numpy references the kernels are
checked against; every format dequantizes bit for bit as `gguf.quants` does. Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and
BF16 quantize exactly as `gguf.quants` does; Q4_K and Q6_K follow llama.cpp's reference quantizers
(`quantize_row_q4_K_ref`, `quantize_row_q6_K_ref`), which `gguf` does not implement. Q2_K, Q3_K, Q5_K, IQ4_NL
and IQ4_XS have no quantizer here (GGUF files bring their blocks); `random_blocks` makes valid blocks of any
format for tests and benchmarks.

`kernel_layout` is the one-time repack the matvec templates read: a few bytes of each block (its float16 scales,
and for Q5_0/Q5_1/IQ4_XS the bits that do not fit) move into a separate array so that the rest of every block is
a whole number of 16-byte words (34-, 18-, 22-, 210-byte blocks cannot be read with 16-byte loads); Q3_K's
110-byte blocks are padded to 112 instead. `from_kernel_layout` restores the blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

QK_K = 256


@dataclass(frozen=True)
class QuantFormat:
    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block

    def row_bytes(self, k: int) -> int:
        if k % self.block_size:
            raise ValueError(f"{self.name}: row length {k} is not a multiple of the block size "
                             f"{self.block_size}")
        return k // self.block_size * self.type_size


FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in [
        QuantFormat("F16", 1, 2),
        QuantFormat("BF16", 1, 2),
        QuantFormat("Q8_0", 32, 34),
        QuantFormat("Q4_0", 32, 18),
        QuantFormat("Q4_1", 32, 20),
        QuantFormat("Q5_0", 32, 22),
        QuantFormat("Q5_1", 32, 24),
        QuantFormat("Q2_K", QK_K, 84),
        QuantFormat("Q3_K", QK_K, 110),
        QuantFormat("Q4_K", QK_K, 144),
        QuantFormat("Q5_K", QK_K, 176),
        QuantFormat("Q6_K", QK_K, 210),
        QuantFormat("IQ4_NL", 32, 18),
        QuantFormat("IQ4_XS", QK_K, 136),
    ]
}


def get_format(fmt: str | QuantFormat) -> QuantFormat:
    if isinstance(fmt, QuantFormat):
        return fmt
    try:
        return FORMATS[fmt.upper()]
    except KeyError:
        raise ValueError(f"unknown weight format {fmt!r}; known: {sorted(FORMATS)}") from None


@dataclass(frozen=True)
class QuantizedTensor:
    """A (rows, cols) weight matrix stored as GGUF blocks: `data` is uint8 of shape (rows, row_bytes)."""

    data: np.ndarray
    format: QuantFormat
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        rows, cols = self.shape
        want = (rows, self.format.row_bytes(cols))
        if self.data.dtype != np.uint8 or self.data.shape != want:
            raise ValueError(f"{self.format.name} {self.shape}: expected uint8 blocks of shape {want}, "
                             f"got {self.data.dtype} {self.data.shape}")

    @classmethod
    def from_raw(cls, raw: np.ndarray | bytes, fmt: str | QuantFormat,
                 shape: tuple[int, int]) -> QuantizedTensor:
        """Wrap blocks as read from a GGUF file (any dtype; only the bytes matter)."""
        f = get_format(fmt)
        if isinstance(raw, bytes):
            flat = np.frombuffer(raw, np.uint8)
        else:
            flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        rows, cols = int(shape[0]), int(shape[1])
        if flat.size != rows * f.row_bytes(cols):
            raise ValueError(f"{f.name} {shape}: expected {rows * f.row_bytes(cols)} bytes, got {flat.size}")
        return cls(flat.reshape(rows, f.row_bytes(cols)), f, (rows, cols))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def dequantize(self) -> np.ndarray:
        return dequantize(self)


def quantize(x: np.ndarray, fmt: str | QuantFormat) -> QuantizedTensor:
    """Quantize a 2-D float matrix row by row (row length a multiple of the format's block size)."""
    f = get_format(fmt)
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"quantize expects a 2-D matrix, got shape {x.shape}")
    rows, cols = x.shape
    f.row_bytes(cols)
    if f.name not in _QUANTIZE:
        raise ValueError(f"no quantizer for {f.name} (files bring their own blocks); quantizers: {sorted(_QUANTIZE)}")
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, f.block_size)
    raw = _QUANTIZE[f.name](blocks)
    return QuantizedTensor(raw.reshape(rows, -1), f, (rows, cols))


def dequantize(qt: QuantizedTensor) -> np.ndarray:
    """The float32 matrix the blocks encode."""
    blocks = qt.data.reshape(-1, qt.format.type_size)
    return _DEQUANTIZE[qt.format.name](blocks).reshape(qt.shape)


# ---- F16 / BF16 -----------------------------------------------------------------------------------------

def stack_rows(tensors: list[QuantizedTensor]) -> QuantizedTensor:
    """Matrices of one format and row length as one [sum of rows, cols] matrix (rows are independent blocks)."""
    fmt, cols = tensors[0].format, tensors[0].shape[1]
    for t in tensors:
        if t.format.name != fmt.name or t.shape[1] != cols:
            raise ValueError(f"stack_rows: {t.format.name} {t.shape} does not match {fmt.name} rows of {cols}")
    return QuantizedTensor(np.concatenate([t.data for t in tensors]), fmt, (sum(t.shape[0] for t in tensors), cols))


def _quant_f16(b: np.ndarray) -> np.ndarray:
    return b.astype(np.float16).view(np.uint8)


def _dequant_f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def _quant_bf16(b: np.ndarray) -> np.ndarray:
    n = b.view(np.uint32).astype(np.uint64)
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    # NaN made quiet; everything else rounded to nearest even
    n = np.where(nan, (n & 0xFFFF0000) | (64 << 16), n + (0x7FFF + ((n >> 16) & 1)))
    return (n >> 16).astype(np.uint16).view(np.uint8)


def _dequant_bf16(b: np.ndarray) -> np.ndarray:
    return (b.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)


# ---- Q8_0: f16 d, 32 x int8 --------------------------------------------------------------------------------

def _round_away(v: np.ndarray) -> np.ndarray:
    """roundf: halves away from zero (ggml's Q8_0 and Q4_0 reference quantizers use it)."""
    a = np.abs(v)
    fl = np.floor(a)
    return np.sign(v) * (fl + np.floor(2 * (a - fl)))


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _quant_q8_0(b: np.ndarray) -> np.ndarray:
    d = (np.abs(b).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    qs = _round_away(b * _inverse(d)).astype(np.int8)
    return np.concatenate([d.astype(np.float16).view(np.uint8), qs.view(np.uint8)], axis=1)


def _dequant_q8_0(b: np.ndarray) -> np.ndarray:
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    return b[:, 2:].view(np.int8).astype(np.float32) * d


# ---- Q4_0: f16 d, 16 bytes: element i in the low nibble of byte i, element i+16 in its high nibble ---

def _quant_q4_0(b: np.ndarray) -> np.ndarray:
    imax = np.abs(b).argmax(axis=1)[:, None]
    d = (np.take_along_axis(b, imax, axis=1) / np.float32(-8)).astype(np.float32)
    q = np.trunc(b * _inverse(d) + np.float32(8.5)).clip(0, 15).astype(np.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([d.astype(np.float16).view(np.uint8), qs], axis=1)


def _dequant_q4_0(b: np.ndarray) -> np.ndarray:
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    qs = b[:, 2:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32) - 8
    return q * d


# ---- Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins for 8 sub-blocks of 32, 128 bytes of nibbles ----

def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: float32 round half to even."""
    return np.rint(v.astype(np.float32)).astype(np.int32)


def _q4_k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def _make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
                      nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's make_qkx2_quants over rows of x: (scale, -min, levels) minimising weighted error."""
    f32 = np.float32
    mn = np.minimum(x.min(axis=1), 0).astype(f32)
    mx = x.max(axis=1).astype(f32)
    sum_w = w.sum(axis=1, dtype=f32)
    sum_x = (w * x).sum(axis=1, dtype=f32)
    flat = mx == mn
    rng = np.where(flat, f32(1), mx - mn).astype(f32)
    iscale = (f32(nmax) / rng).astype(f32)
    scale = (f32(1) / iscale).astype(f32)
    L = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    best = (w * (scale[:, None] * L + mn[:, None] - x) ** 2).sum(axis=1, dtype=f32)
    for step in range(nstep + 1):
        isc = (f32(rmin + rdelta * step + nmax) / rng).astype(f32)
        la = np.clip(_nearest_int(isc[:, None] * (x - mn[:, None])), 0, nmax)
        lf = la.astype(f32)
        sum_l = (w * lf).sum(axis=1, dtype=f32)
        sum_l2 = (w * lf * lf).sum(axis=1, dtype=f32)
        sum_xl = (w * lf * x).sum(axis=1, dtype=f32)
        den = sum_w * sum_l2 - sum_l * sum_l
        ok = den > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = ((sum_w * sum_xl - sum_x * sum_l) / den).astype(f32)
            this_min = ((sum_l2 * sum_x - sum_l * sum_xl) / den).astype(f32)
            pos = this_min > 0
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale).astype(f32)
            this_min = np.where(pos, f32(0), this_min).astype(f32)
        mad = (w * (this_scale[:, None] * lf + this_min[:, None] - x) ** 2).sum(axis=1, dtype=f32)
        better = ok & (mad < best)
        L = np.where(better[:, None], la, L)
        best = np.where(better, mad, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    scale = np.where(flat, f32(0), scale)
    L = np.where(flat[:, None], 0, L)
    return scale.astype(f32), (-mn).astype(f32), L


def _quant_q4_k(b: np.ndarray) -> np.ndarray:
    f32 = np.float32
    nb = b.shape[0]
    x = b.reshape(nb * 8, 32)
    av_x = np.sqrt((x * x).sum(axis=1, dtype=f32) / f32(32)).astype(f32)
    w = (av_x[:, None] + np.abs(x)).astype(f32)
    scales, mins, _ = _make_qkx2_quants(x, w, 15, -1.0, 0.1, 20)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    inv_scale = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, 1), 0).astype(f32)
    inv_min = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, 1), 0).astype(f32)
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales), 63).astype(np.uint8)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins), 63).astype(np.uint8)
    packed = np.zeros((nb, 12), np.uint8)
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    d16 = (max_scale / f32(63)).astype(np.float16)
    dmin16 = (max_min / f32(63)).astype(np.float16)
    sc, m = _q4_k_scale_min(packed)
    d = (d16.astype(f32)[:, None] * sc).astype(f32)
    dm = (dmin16.astype(f32)[:, None] * m).astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        lv = _nearest_int((b.reshape(nb, 8, 32) + dm[:, :, None]) / d[:, :, None])
    lv = np.where(d[:, :, None] == 0, 0, np.clip(lv, 0, 15)).astype(np.uint8).reshape(nb, 4, 2, 32)
    qs = (lv[:, :, 0] | (lv[:, :, 1] << 4)).reshape(nb, 128)
    return np.concatenate([d16[:, None].view(np.uint8), dmin16[:, None].view(np.uint8), packed, qs], axis=1)


def _dequant_q4_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = _q4_k_scale_min(b[:, 4:16])
    qs = b[:, 16:].reshape(nb, 4, 1, 32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(nb, 8, 32).astype(np.float32)
    return ((d * sc)[:, :, None] * q - (dmin * m)[:, :, None]).reshape(nb, QK_K)


# ---- Q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, f16 d ---------------------

def _make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> np.ndarray:
    """llama.cpp's make_qx_quants(rmse_type=1, no weights) over rows of x: the scale per row."""
    f32 = np.float32
    amax_i = np.abs(x).argmax(axis=1)[:, None]
    mx = np.take_along_axis(x, amax_i, axis=1)[:, 0]
    zero = np.abs(mx) < f32(1e-15)
    safe = np.where(zero, f32(1), mx).astype(f32)
    w = x * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lv = np.clip(_nearest_int(iscale[:, None] * x), -nmax, nmax - 1).astype(f32)
        return (w * x * lv).sum(axis=1, dtype=f32), (w * lv * lv).sum(axis=1, dtype=f32)

    sumlx, suml2 = fit((f32(-nmax) / safe).astype(f32))
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, f32(0)).astype(f32)
    best = (scale * sumlx).astype(f32)
    for step in range(-9, 10):
        if step == 0:
            continue
        sumlx, suml2 = fit((-(f32(nmax) + f32(0.1) * f32(step)) / safe).astype(f32))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        with np.errstate(divide="ignore", invalid="ignore"):
            cand = (sumlx / suml2).astype(f32)
        scale = np.where(better, cand, scale)
        best = np.where(better, cand * sumlx, best).astype(f32)
    return np.where(zero, f32(0), scale).astype(f32)


def _quant_q6_k(b: np.ndarray) -> np.ndarray:
    f32 = np.float32
    nb = b.shape[0]
    scales = _make_qx_quants_rmse1(b.reshape(nb * 16, 16), 32).reshape(nb, 16)
    imax = np.abs(scales).argmax(axis=1)[:, None]
    max_scale = np.take_along_axis(scales, imax, axis=1)[:, 0]
    zero = np.abs(max_scale) < f32(1e-15)
    iscale = np.where(zero, f32(0), f32(-128) / np.where(zero, f32(1), max_scale)).astype(f32)
    with np.errstate(divide="ignore"):
        d16 = np.where(zero, f32(0), f32(1) / iscale).astype(np.float16)
    sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
    d = (d16.astype(f32)[:, None] * sc.astype(f32)).astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        lv = _nearest_int(b.reshape(nb, 16, 16) / d[:, :, None])
    lv = (np.where(d[:, :, None] == 0, 0, np.clip(lv, -32, 31)) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)
    ql = np.concatenate([(lv[:, :, 0] & 0xF) | ((lv[:, :, 2] & 0xF) << 4),
                         (lv[:, :, 1] & 0xF) | ((lv[:, :, 3] & 0xF) << 4)], axis=2).reshape(nb, 128)
    qh = ((lv[:, :, 0] >> 4) | ((lv[:, :, 1] >> 4) << 2) | ((lv[:, :, 2] >> 4) << 4)
          | ((lv[:, :, 3] >> 4) << 6)).reshape(nb, 64)
    sc = np.where(zero[:, None], 0, sc).astype(np.int8)
    return np.concatenate([ql, qh, sc.view(np.uint8), d16[:, None].view(np.uint8)], axis=1)


def _dequant_q6_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    ql = b[:, :128].reshape(nb, 2, 1, 64)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
    low = np.concatenate([ql & 0xF, ql >> 4], axis=2).reshape(nb, 2, 4, 32)
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    q = (low | (high << 4)).astype(np.float32).reshape(nb, 16, 16) - 32
    return ((d * sc)[:, :, None] * q).reshape(nb, QK_K)


# ---- Q4_1: f16 d, f16 m, 16 bytes of nibbles (as Q4_0): x = d q + m -------------------------------------------

def _f16(b: np.ndarray, off: int) -> np.ndarray:
    """The float16 at byte `off` of each block, as float32 (n, 1)."""
    return b[:, off:off + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 levels: element i in the low nibble of byte i, element i + 16 in its high nibble."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1)


def _quant_min_max(b: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """gguf's Q4_1/Q5_1 quantizer: (d, min, q) with q in [0, levels]."""
    mx, mn = b.max(axis=1, keepdims=True), b.min(axis=1, keepdims=True)
    d = (mx - mn) / np.float32(levels)
    q = np.trunc((b - mn) * _inverse(d) + np.float32(0.5)).astype(np.uint8).clip(0, levels)
    return d, mn, q


def _quant_q4_1(b: np.ndarray) -> np.ndarray:
    d, mn, q = _quant_min_max(b, 15)
    return np.concatenate([d.astype(np.float16).view(np.uint8), mn.astype(np.float16).view(np.uint8),
                           q[:, :16] | (q[:, 16:] << 4)], axis=1)


def _dequant_q4_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _nibbles(b[:, 4:]).astype(np.float32) + _f16(b, 2)


# ---- Q5_0 / Q5_1: f16 d (, f16 m), 4 bytes of fifth bits (bit i: element i), 16 bytes of nibbles ---------------

def _pack5(q: np.ndarray) -> np.ndarray:
    qh = np.packbits((q >> 4).reshape(-1, 1, 32), axis=-1, bitorder="little").reshape(-1, 4)
    return np.concatenate([qh, (q[:, :16] & 0xF) | (q[:, 16:] << 4)], axis=1)


def _levels5(b: np.ndarray, off: int) -> np.ndarray:
    """The 32 five-bit levels of blocks whose fifth bits start at byte `off`."""
    qh = b[:, off:off + 4].copy().view(np.uint32)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _nibbles(b[:, off + 4:off + 20]) | (high << 4)


def _quant_q5_0(b: np.ndarray) -> np.ndarray:
    imax = np.abs(b).argmax(axis=1)[:, None]
    d = (np.take_along_axis(b, imax, axis=1) / np.float32(-16)).astype(np.float32)
    q = np.trunc(b * _inverse(d) + np.float32(16.5)).astype(np.uint8).clip(0, 31)
    return np.concatenate([d.astype(np.float16).view(np.uint8), _pack5(q)], axis=1)


def _dequant_q5_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * (_levels5(b, 2).astype(np.int8) - np.int8(16)).astype(np.float32)


def _quant_q5_1(b: np.ndarray) -> np.ndarray:
    d, mn, q = _quant_min_max(b, 31)
    return np.concatenate([d.astype(np.float16).view(np.uint8), mn.astype(np.float16).view(np.uint8), _pack5(q)],
                          axis=1)


def _dequant_q5_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _levels5(b, 4).astype(np.float32) + _f16(b, 2)


# ---- Q2_K: 16 bytes of 4-bit scale|min pairs, 64 bytes of 2-bit levels, f16 d, f16 dmin ---------------------------

def _crumbs(qs: np.ndarray, bits: int) -> np.ndarray:
    """K-quant low bits: (n, 64) bytes -> (n, 256) levels; element 128 h + 32 s + l is field s of byte 32 h + l."""
    n = qs.shape[0]
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(1, 1, -1, 1)
    return ((qs.reshape(n, -1, 1, 32) >> shifts) & ((1 << bits) - 1)).reshape(n, QK_K)


def _dequant_q2_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    sc = b[:, :16]
    dl = (_f16(b, 80) * (sc & 0xF).astype(np.float32))[:, :, None]
    ml = (_f16(b, 82) * (sc >> 4).astype(np.float32))[:, :, None]
    q = _crumbs(b[:, 16:80], 2).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


# ---- Q3_K: 32 bytes of high bits, 64 bytes of 2-bit levels, 12 bytes of 6-bit scales, f16 d ------------------------

def _q3_k_scales(sc: np.ndarray) -> np.ndarray:
    """16 signed 6-bit scales from 12 bytes: low nibbles in bytes 0..7, two high bits each in bytes 8..11."""
    low = np.concatenate([sc[:, :8] & 0xF, sc[:, :8] >> 4], axis=1)
    high = np.concatenate([(sc[:, 8:12] >> s) & 3 for s in (0, 2, 4, 6)], axis=1)
    return ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)


def _dequant_q3_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl = (_f16(b, 108) * _q3_k_scales(b[:, 96:108]))[:, :, None]
    low = _crumbs(b[:, 32:96], 2).astype(np.int8)
    hbit = ((b[:, :32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1).reshape(n, QK_K)
    q = (low - ((hbit ^ 1) << 2).astype(np.int8)).astype(np.float32)  # a clear high bit subtracts 4
    return (dl * q.reshape(n, 16, 16)).reshape(n, QK_K)


# ---- Q5_K: f16 d, f16 dmin, 12 bytes of scales/mins (as Q4_K), 32 bytes of fifth bits, 128 bytes of nibbles -------

def _dequant_q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    sc, m = _q4_k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc.astype(np.float32))[:, :, None]
    dm = (_f16(b, 2) * m.astype(np.float32))[:, :, None]
    qs = b[:, 48:].reshape(n, 4, 1, 32)
    low = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(n, 8, 32)
    high = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return (d * (low | (high << 4)).astype(np.float32) - dm).reshape(n, QK_K)


# ---- IQ4_NL: f16 d, 16 bytes of nibbles indexing a fixed non-linear table; IQ4_XS: super-blocks of eight -----------

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _dequant_iq4_nl(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * IQ4_VALUES[_nibbles(b[:, 2:])].astype(np.float32)


def _dequant_iq4_xs(b: np.ndarray) -> np.ndarray:
    """f16 d, 2 bytes of scales' high bits (2 per sub-block), 4 bytes of their low nibbles, 8 x 16 bytes."""
    n = b.shape[0]
    sh = b[:, 2:4].copy().view(np.uint16)
    high = ((sh >> np.arange(0, 16, 2, dtype=np.uint16)) & 3).astype(np.uint8)
    low = np.stack([b[:, 4:8] & 0xF, b[:, 4:8] >> 4], axis=2).reshape(n, 8)
    dl = (_f16(b, 0) * ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32))[:, :, None]
    qs = b[:, 8:].reshape(n * 8, 16)
    return (dl * IQ4_VALUES[_nibbles(qs)].astype(np.float32).reshape(n, 8, 32)).reshape(n, QK_K)


_QUANTIZE = {"F16": _quant_f16, "BF16": _quant_bf16, "Q8_0": _quant_q8_0, "Q4_0": _quant_q4_0,
             "Q4_1": _quant_q4_1, "Q5_0": _quant_q5_0, "Q5_1": _quant_q5_1, "Q4_K": _quant_q4_k, "Q6_K": _quant_q6_k}
_DEQUANTIZE = {"F16": _dequant_f16, "BF16": _dequant_bf16, "Q8_0": _dequant_q8_0, "Q4_0": _dequant_q4_0,
               "Q4_1": _dequant_q4_1, "Q5_0": _dequant_q5_0, "Q5_1": _dequant_q5_1, "Q2_K": _dequant_q2_k,
               "Q3_K": _dequant_q3_k, "Q4_K": _dequant_q4_k, "Q5_K": _dequant_q5_k, "Q6_K": _dequant_q6_k,
               "IQ4_NL": _dequant_iq4_nl, "IQ4_XS": _dequant_iq4_xs}
QUANTIZERS = tuple(_QUANTIZE)

# byte offsets of each block's float16 scales (d, and m or dmin): `random_blocks` writes finite values there
_F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def random_blocks(rng: np.random.Generator, fmt: str | QuantFormat, rows: int, cols: int,
                  d_range: tuple[float, float] = (0.005, 0.045)) -> QuantizedTensor:
    """Valid blocks of any quantized format: random levels, scales and bits, with finite float16 scales drawn
    from d_range (values stay moderate). For tests and speed benchmarks of formats without a quantizer."""
    f = get_format(fmt)
    nbytes = rows * f.row_bytes(cols)
    # drawn as 64-bit words where the bytes allow (twice as fast as bytes: benchmarks draw gigabytes)
    raw = rng.integers(0, 2**64, nbytes // 8, dtype=np.uint64).view(np.uint8) if nbytes % 8 == 0 \
        else rng.integers(0, 256, nbytes, dtype=np.uint8)
    data = raw.reshape(-1, f.type_size)
    lo, hi = d_range
    for off in _F16_FIELDS[f.name]:
        d = (rng.random(data.shape[0], dtype=np.float32) * np.float32(hi - lo) + np.float32(lo)).astype(np.float16)
        data[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return QuantizedTensor(data.reshape(rows, -1), f, (rows, cols))


# ---- the matvec templates' layout ------------------------------------------------------------------

# (offset, length) of the bytes of a block that move to the side array, or None when the block needs no split
SPLIT = {"Q8_0": (0, 2), "Q4_0": (0, 2), "Q4_1": (0, 4), "Q5_0": (0, 6), "Q5_1": (0, 8), "Q2_K": (80, 4),
         "Q6_K": (208, 2), "IQ4_NL": (0, 2), "IQ4_XS": (0, 8), "Q3_K": None, "Q4_K": None, "Q5_K": None,
         "F16": None, "BF16": None}
# zero bytes appended to each block so that blocks are whole 16-byte words
BLOCK_PAD = {"Q3_K": 2}

# F16/BF16 rows are padded to a multiple of this many elements so every row starts on a 16-byte boundary
ROW_ALIGN_ELEMS = 8


def kernel_layout(qt: QuantizedTensor) -> tuple[np.ndarray, np.ndarray | None]:
    """(blocks, scales): the bytes the matvec template binds. Pure byte moves; see the module docstring."""
    name = qt.format.name
    rows, cols = qt.shape
    if name in ("F16", "BF16"):
        pad = -cols % ROW_ALIGN_ELEMS
        body = np.pad(qt.data.view(np.uint16), ((0, 0), (0, pad))).view(np.uint8) if pad else qt.data
        return np.ascontiguousarray(body), None
    blocks = qt.data.reshape(rows, -1, qt.format.type_size)
    if name in BLOCK_PAD:
        return np.ascontiguousarray(np.pad(blocks, ((0, 0), (0, 0), (0, BLOCK_PAD[name])))).reshape(rows, -1), None
    if SPLIT[name] is None:
        return qt.data, None
    off, n = SPLIT[name]
    scales = np.ascontiguousarray(blocks[:, :, off:off + n]).reshape(rows, -1)
    # the two runs around the scales copied as the widest words that tile them (np.delete's byte-wise copy took
    # 15x longer: a model's load moves gigabytes here)
    word = np.dtype(f"u{math.gcd(8, qt.format.type_size, off, n)}")
    w_off, w_n = off // word.itemsize, n // word.itemsize
    words = np.ascontiguousarray(blocks).view(word)
    body = np.empty((*words.shape[:2], words.shape[2] - w_n), word)
    body[:, :, :w_off] = words[:, :, :w_off]
    body[:, :, w_off:] = words[:, :, w_off + w_n:]
    return body.view(np.uint8).reshape(rows, -1), scales


def from_kernel_layout(body: np.ndarray, scales: np.ndarray | None, fmt: str | QuantFormat,
                       shape: tuple[int, int]) -> QuantizedTensor:
    """Inverse of `kernel_layout`."""
    f = get_format(fmt)
    rows, cols = shape
    if f.name in ("F16", "BF16"):
        return QuantizedTensor(np.ascontiguousarray(body.view(np.uint16)[:, :cols]).view(np.uint8), f, shape)
    nblk = cols // f.block_size
    if f.name in BLOCK_PAD:
        raw = body.reshape(rows, nblk, -1)[:, :, :f.type_size]
        return QuantizedTensor(np.ascontiguousarray(raw).reshape(rows, -1), f, shape)
    if SPLIT[f.name] is None:
        return QuantizedTensor(body, f, shape)
    off, n = SPLIT[f.name]
    b = body.reshape(rows, nblk, f.type_size - n)
    s = scales.reshape(rows, nblk, n)
    raw = np.concatenate([b[:, :, :off], s, b[:, :, off:]], axis=2)
    return QuantizedTensor(raw.reshape(rows, -1), f, shape)

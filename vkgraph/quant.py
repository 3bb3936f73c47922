"""GGUF weight formats in numpy: Q8_0, Q4_0, Q4_K, Q6_K, F16 and BF16, bit for bit as ggml stores them.

A `QuantizedTensor` holds a 2-D weight matrix as the raw GGUF blocks of its rows plus the format, so weights
read from a GGUF file keep their bits. `quantize` and `dequantize` are the numpy references the kernels are
checked against. Q8_0, Q4_0 and BF16 quantize exactly as `gguf.quants` does; Q4_K and Q6_K follow llama.cpp's
reference quantizers (`quantize_row_q4_K_ref`, `quantize_row_q6_K_ref`), which `gguf` does not implement.

`kernel_layout` is the one-time repack the matvec templates read: each block's float16 scale `d` moves into a
separate array so that the rest of every block is a whole number of 16-byte words (34-, 18- and 210-byte
blocks cannot be read with 16-byte loads). It moves bytes only; `from_kernel_layout` restores the blocks.
"""

from __future__ import annotations

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
        QuantFormat("Q4_K", QK_K, 144),
        QuantFormat("Q6_K", QK_K, 210),
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


_QUANTIZE = {"F16": _quant_f16, "BF16": _quant_bf16, "Q8_0": _quant_q8_0, "Q4_0": _quant_q4_0,
             "Q4_K": _quant_q4_k, "Q6_K": _quant_q6_k}
_DEQUANTIZE = {"F16": _dequant_f16, "BF16": _dequant_bf16, "Q8_0": _dequant_q8_0, "Q4_0": _dequant_q4_0,
               "Q4_K": _dequant_q4_k, "Q6_K": _dequant_q6_k}


# ---- the matvec templates' layout ------------------------------------------------------------------

# (offset of the f16 scale d inside a block, or None when the block needs no split)
_SCALE_OFFSET = {"Q8_0": 0, "Q4_0": 0, "Q6_K": 208, "Q4_K": None, "F16": None, "BF16": None}

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
    off = _SCALE_OFFSET[name]
    if off is None:
        return qt.data, None
    blocks = qt.data.reshape(rows, -1, qt.format.type_size)
    scales = np.ascontiguousarray(blocks[:, :, off:off + 2]).reshape(rows, -1)
    body = np.ascontiguousarray(np.delete(blocks, [off, off + 1], axis=2)).reshape(rows, -1)
    return body, scales


def from_kernel_layout(body: np.ndarray, scales: np.ndarray | None, fmt: str | QuantFormat,
                       shape: tuple[int, int]) -> QuantizedTensor:
    """Inverse of `kernel_layout`."""
    f = get_format(fmt)
    rows, cols = shape
    if f.name in ("F16", "BF16"):
        return QuantizedTensor(np.ascontiguousarray(body.view(np.uint16)[:, :cols]).view(np.uint8), f, shape)
    off = _SCALE_OFFSET[f.name]
    if off is None:
        return QuantizedTensor(body, f, shape)
    nblk = cols // f.block_size
    b = body.reshape(rows, nblk, f.type_size - 2)
    s = scales.reshape(rows, nblk, 2)
    raw = np.concatenate([b[:, :, :off], s, b[:, :, off:]], axis=2)
    return QuantizedTensor(raw.reshape(rows, -1), f, shape)

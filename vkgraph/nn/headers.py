"""Bounds-checked reading of model file headers (GGUF, safetensors), before any library walks them.

A header is a list of counts and sizes that the rest of the file must honour. Each one is checked against the
bytes that remain before it is believed: a count of n items of at least k bytes each needs n * k bytes, a tensor
must lie inside the file, a string inside the header. So nothing a file says can make the loader loop longer
than the file is long, recurse deeper than a small bound, or allocate more than the file holds. `gguf.GGUFReader`
itself trusts the counts (an array said to hold 10**12 items past the end of the file loops on empty reads).
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path
from typing import Any

from .config import ModelFormatError


class TruncatedFileError(ModelFormatError):
    pass


# ---- GGUF -------------------------------------------------------------------------------------------------------

_GGUF_MAGIC = b"GGUF"
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MIN_KV = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 4  # arrays of arrays: the reader recurses once per level
_DEFAULT_ALIGNMENT = 32


class _Cursor:
    def __init__(self, buf: Any, path: Path, order: str) -> None:
        self.buf, self.path, self.order, self.pos = buf, path, order, 0

    def need(self, n: int, what: str) -> None:
        if n > len(self.buf) - self.pos:
            raise TruncatedFileError(f"{self.path}: {what} at byte {self.pos} needs {n} bytes, the file has "
                                     f"{len(self.buf) - self.pos} left; truncated or corrupt")

    def uint(self, size: int, what: str) -> int:
        self.need(size, what)
        (v,) = struct.unpack_from(self.order + {4: "I", 8: "Q"}[size], self.buf, self.pos)
        self.pos += size
        return v

    def string(self, what: str) -> bytes:
        n = self.uint(8, f"{what} length")
        self.need(n, what)
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s

    def new_name(self, what: str, seen: set[str], kind: str) -> str:
        """A UTF-8 string not in `seen`, added to it (an error calls a repeat "`kind` 'name'")."""
        try:
            name = self.string(what).decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFormatError(f"{self.path}: {what} is not UTF-8") from None
        if name in seen:
            raise ModelFormatError(f"{self.path}: {kind} {name!r} appears twice")
        seen.add(name)
        return name

    def skip_strings(self, count: int, what: str) -> None:
        """count strings, walked by their length prefixes (each needs at least its 8 bytes)."""
        self.need(count * 8, what)
        unpack, fmt, buf, end = struct.unpack_from, self.order + "Q", self.buf, len(self.buf)
        pos = self.pos
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8, what)
            (n,) = unpack(fmt, buf, pos)
            pos += 8 + n
        self.pos = pos
        if pos > end:
            self.pos = end
            raise TruncatedFileError(f"{self.path}: {what} runs past the end of the file; truncated or corrupt")


def check_gguf(path: str | Path) -> None:
    """Walk a GGUF header with every count and size bounds-checked; raise `ModelFormatError` (a
    `TruncatedFileError` where the file ends too soon) naming the field, or return if the header is sound and
    every tensor it lists lies inside the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    p = Path(path)
    with open(p, "rb") as fh:
        size = fh.seek(0, 2)
        if size < 24:
            raise TruncatedFileError(f"{p}: {size} bytes is too short for a GGUF header")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != _GGUF_MAGIC:
                raise ModelFormatError(f"{p}: not a GGUF file (magic {bytes(buf[:4])!r})")
            (version,) = struct.unpack_from("<I", buf, 4)
            order = ">" if version & 0xFFFF == 0 else "<"  # a file written on a big-endian machine, as gguf reads
            c = _Cursor(buf, p, order)
            c.pos = 4
            version = c.uint(4, "version")
            if version not in (2, 3):
                raise ModelFormatError(f"{p}: GGUF version {version} is not supported (2 and 3 are)")
            n_tensors = c.uint(8, "tensor count")
            n_kv = c.uint(8, "metadata count")
            c.need(n_kv * _MIN_KV, f"{n_kv} metadata entries")
            alignment = _DEFAULT_ALIGNMENT
            keys: set[str] = set()
            for i in range(n_kv):
                key = c.new_name(f"metadata key {i}", keys, "metadata key")
                vtype = c.uint(4, f"type of {key}")
                if key == "general.alignment":
                    if vtype != _UINT32:
                        raise ModelFormatError(f"{p}: general.alignment must be a uint32")
                    alignment = c.uint(4, key)
                    if alignment == 0 or alignment & (alignment - 1):
                        raise ModelFormatError(f"{p}: general.alignment {alignment} is not a power of two")
                    continue
                _skip_value(c, vtype, key, 0)
            c.need(n_tensors * _MIN_TENSOR_INFO, f"{n_tensors} tensor descriptions")
            names: set[str] = set()
            spans: list[tuple[str, int, int]] = []
            for i in range(n_tensors):
                name = c.new_name(f"tensor name {i}", names, "tensor")
                n_dims = c.uint(4, f"dimension count of {name}")
                if not 1 <= n_dims <= _MAX_DIMS:
                    raise ModelFormatError(f"{p}: tensor {name} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
                dims = [c.uint(8, f"dimensions of {name}") for _ in range(n_dims)]
                raw_type = c.uint(4, f"type of {name}")
                try:
                    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
                except (ValueError, KeyError):
                    raise ModelFormatError(f"{p}: tensor {name} has unknown type {raw_type}") from None
                if dims[0] % block:
                    raise ModelFormatError(f"{p}: tensor {name}: its rows of {dims[0]} are not whole blocks of "
                                           f"{block} ({GGMLQuantizationType(raw_type).name})")
                offset = c.uint(8, f"data offset of {name}")
                if offset % alignment:
                    raise ModelFormatError(f"{p}: tensor {name}: data offset {offset} is not a multiple of the "
                                           f"alignment {alignment}")
                spans.append((name, offset, math.prod(dims) // block * type_size))
            data_start = -(-c.pos // alignment) * alignment
            for name, offset, nbytes in spans:
                if data_start + offset + nbytes > size:
                    end = data_start + offset + nbytes
                    raise TruncatedFileError(f"{p}: truncated: tensor {name} ends at byte {end}, the file has {size}")


def _skip_value(c: _Cursor, vtype: int, key: str, depth: int) -> None:
    if vtype in _SCALAR_SIZES:
        c.need(_SCALAR_SIZES[vtype], key)
        c.pos += _SCALAR_SIZES[vtype]
    elif vtype == _STRING:
        c.string(key)
    elif vtype == _ARRAY:
        if depth >= _MAX_NESTING:
            raise ModelFormatError(f"{c.path}: {key}: arrays nested deeper than {_MAX_NESTING}")
        itype = c.uint(4, f"{key} item type")
        count = c.uint(8, f"{key} length")
        if itype in _SCALAR_SIZES:
            c.need(count * _SCALAR_SIZES[itype], f"{key} ({count} items)")
            c.pos += count * _SCALAR_SIZES[itype]
        elif itype == _STRING:
            c.skip_strings(count, f"{key} ({count} strings)")
        elif itype == _ARRAY:
            c.need(count * 12, f"{key} ({count} arrays)")
            for _ in range(count):
                _skip_value(c, _ARRAY, key, depth + 1)
        else:
            raise ModelFormatError(f"{c.path}: {key}: unknown array item type {itype}")
    else:
        raise ModelFormatError(f"{c.path}: {key}: unknown value type {vtype}")


# ---- safetensors ------------------------------------------------------------------------------------------------

SAFETENSORS_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                        "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}


def read_safetensors_header(path: str | Path) -> tuple[dict[str, dict[str, Any]], int, int]:
    """(tensors, data offset, data length) of a safetensors file, every entry checked: a known dtype, a shape of
    non-negative integers, offsets inside the data whose span is exactly the shape's bytes. Tensor entries map a
    name to {"dtype", "shape", "data_offsets"}; `__metadata__` is left out."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise TruncatedFileError(f"{p}: truncated or not a safetensors file (header of {n} bytes, file {size})")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSON or UTF-8 errors, or nesting past Python's stack
        raise ModelFormatError(f"{p}: unreadable safetensors header ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{p}: the safetensors header is a {type(header).__name__}, not an object")
    data_len = size - 8 - n
    tensors: dict[str, dict[str, Any]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise ModelFormatError(f"{p}: tensor {name!r}: entry {info!r:.80} lacks dtype, shape or data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_ITEMSIZE:
            raise ModelFormatError(f"{p}: tensor {name}: unknown dtype {dtype!r:.40}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise ModelFormatError(f"{p}: tensor {name}: shape {shape!r:.80} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise ModelFormatError(f"{p}: tensor {name}: data_offsets {offsets!r:.80} are not [begin, end]")
        if offsets[1] > data_len:
            raise TruncatedFileError(f"{p}: truncated: tensor {name} needs {offsets[1]} bytes of data, the file "
                                     f"holds {data_len}")
        if offsets[1] - offsets[0] != math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]:
            raise ModelFormatError(f"{p}: tensor {name} spans {offsets[1] - offsets[0]} bytes, not {shape} x {dtype}")
        tensors[name] = info
    return tensors, 8 + n, data_len


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)

"""Paged attention: a KV cache of fixed-size blocks, the KV-write scatter, decode (with split-K) and prefill.

Cache layout, keys and values alike: [num_blocks, num_kv_heads, block_size, head_size], float16 or float32.
A sequence's tokens live in the blocks its block-table row lists, in any order; blocks may be shared.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..runtime import Device
from . import catalog
from .common import arrival_counters, check_binding_range, check_buffer, grid_2d
from .matvec import Q8Acts

KV_DTYPES = {"f16": 2, "f32": 4}
ATTN_WG = 128
TILES = (32, 16, 8)


@dataclass
class PagedKVCache:
    num_blocks: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    key: Any
    value: Any

    @classmethod
    def create(cls, dev: Device, num_blocks: int, num_kv_heads: int, head_size: int, block_size: int = 16,
               dtype: str = "f16") -> PagedKVCache:
        nbytes = cache_bytes(num_blocks, num_kv_heads, head_size, block_size, dtype)
        check_binding_range(dev, "KV cache", nbytes)
        key, value = dev.alloc(nbytes), dev.alloc(nbytes)
        return cls(num_blocks, num_kv_heads, head_size, block_size, dtype, key, value)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


def cache_bytes(num_blocks: int, num_kv_heads: int, head_size: int, block_size: int, dtype: str) -> int:
    """Bytes of each of a paged cache's key and value buffers (checking the shape and dtype)."""
    _check_head(head_size, dtype)
    if num_blocks < 1 or num_kv_heads < 1 or block_size < 1:
        raise ValueError("num_blocks, num_kv_heads and block_size must be positive")
    return num_blocks * num_kv_heads * block_size * head_size * KV_DTYPES[dtype]


def _check_head(head_size: int, dtype: str) -> None:
    if dtype not in KV_DTYPES:
        raise ValueError(f"KV dtype must be one of {sorted(KV_DTYPES)}, got {dtype!r}")
    if head_size % 8 or head_size <= 0:
        raise ValueError(f"head_size must be a positive multiple of 8 (64, 80, 96, 128, 256), got {head_size}")


def _defines(dev: Device, head_size: int, dtype: str, wg: int = ATTN_WG, **extra: int) -> dict[str, int]:
    d = {"HEAD_SIZE": head_size, **extra}
    if dtype == "f16":
        d["KV_F16"] = 1
    info = dev.info
    # one subgroup per row's tile of scores (attention_common.glsl): a fixed subgroup size equal to the tile
    if ("TILE" in extra and "arithmetic" in info.subgroup_ops and info.min_subgroup_size == info.max_subgroup_size
            == extra["TILE"] and wg % extra["TILE"] == 0):
        d["SG_ROWMAX"] = 1
    return d


def _shared_bytes(rows: int, tile: int, head_size: int, dtype: str, row_lanes: bool = False) -> int:
    # tokens are padded by one 16-byte word in shared memory, and with row_lanes each row's weights by 16 bytes
    # (see attention_common.glsl)
    per_token = 2 * (head_size * KV_DTYPES[dtype] + 16)
    return rows * head_size * 4 + tile * per_token + rows * (tile + 4 * row_lanes) * 4 + 3 * rows * 4


def _choose_tile(dev: Device, rows: int, head_size: int, dtype: str) -> int:
    for tile in TILES:
        if _shared_bytes(rows, tile, head_size, dtype) <= dev.info.max_shared_memory:
            return tile
    raise ValueError(f"{rows} query rows of head size {head_size} do not fit the device's shared memory")


@dataclass(frozen=True)
class NewTokens:
    """A decode step's new token per sequence, for paged_decode to write into the cache and attend itself: the
    token is the last of its sequence's context (position context_lens[b] - 1, at slot_mapping[b], int32 [B];
    negative: none, a padding row). paged_decode's `q` is then the rows [B, src_stride] float32 of the fused q/k/v
    product: row b's query heads from column q_off, its new key from k_off and value from v_off (kv heads x head
    size each). rope: (cos, sin) float32 [B, head_size / 2], rotating the queries and the key (rotate-half)."""

    slot_mapping: Any
    src_stride: int
    q_off: int
    k_off: int
    v_off: int
    rope: tuple[Any, Any] | None = None


def _check_rows(name: str, buf: Any, rows: int, stride: int, spans: dict[str, tuple[int, int]]) -> None:
    """Raise ValueError unless every (offset, width) of spans fits rows of `stride` floats, and `buf` holds them."""
    for what, (off, width) in spans.items():
        if off < 0 or off + width > stride:
            raise ValueError(f"{what} at {off} ({width} wide) do not fit rows of {stride}")
        check_buffer(name, buf, ((rows - 1) * stride + off + width) * 4 if rows else 0)


def write_kv(dev: Device, cache: PagedKVCache, key: Any, value: Any, slot_mapping: Any,
             num_tokens: int, *, src_stride: int | None = None, k_off: int = 0, v_off: int = 0,
             rope: tuple[Any, Any] | None = None, q_out: Any | None = None, q_heads: int = 0,
             q_off: int = 0) -> None:
    """Scatter key/value ([num_tokens, num_kv_heads, head_size] float32) into the cache at slot_mapping
    (int32; slot = block * block_size + offset, negative = skip).

    Token t's keys are key[t * src_stride + k_off ...], its values value[t * src_stride + v_off ...]
    (src_stride defaults to kv_heads * head_size: packed rows), so both may be read from the rows of one
    q/k/v product. `rope`: (cos, sin), float32 [num_tokens, head_size / 2], rotates the keys as they are
    written (rotate-half RoPE). With rope, `q_out` [num_tokens, q_heads, head_size] float32 receives the
    same rotation of the q_heads query heads at key[t * src_stride + q_off ...], in the same dispatch."""
    row = cache.num_kv_heads * cache.head_size
    stride = row if src_stride is None else src_stride
    _check_rows("key", key, num_tokens, stride, {"keys": (k_off, row)})
    _check_rows("value", value, num_tokens, stride, {"values": (v_off, row)})
    check_buffer("slot_mapping", slot_mapping, num_tokens * 4)
    q_items = num_tokens * q_heads * cache.head_size if q_out is not None else 0
    if q_out is not None:
        if rope is None or q_heads < 1:
            raise ValueError("q_out takes the rotated queries: it needs rope and q_heads >= 1")
        _check_rows("key", key, num_tokens, stride, {"queries": (q_off, q_heads * cache.head_size)})
        check_buffer("q_out", q_out, q_items * 4)
    defines = _defines(dev, cache.head_size, cache.dtype)
    tables = [key, key]
    if rope is not None:
        if cache.head_size % 2:
            raise ValueError(f"RoPE needs an even head size, got {cache.head_size}")
        for name, buf in zip(("cos", "sin"), rope):
            check_buffer(name, buf, num_tokens * cache.head_size // 2 * 4)
        tables = list(rope)
        defines["ROPE"] = 1
    wg = 256
    words = num_tokens * cache.num_kv_heads * cache.head_size // (2 if cache.dtype == "f16" else 1)
    kern = catalog.compile(dev, "kv_write", spec={"WG": wg}, defines=defines)
    groups = grid_2d(dev, -(-(words + q_items) // wg))
    catalog.dispatch(dev, kern, [key, value, slot_mapping, cache.key, cache.value, *tables,
                                 q_out if q_out is not None else cache.key], groups,
                     push={"num_tokens": num_tokens, "num_kv_heads": cache.num_kv_heads,
                           "head_size": cache.head_size, "block_size": cache.block_size,
                           "groups_x": groups[0], "src_stride": stride, "k_off": k_off, "v_off": v_off,
                           "q_heads": q_heads if q_out is not None else 0, "q_off": q_off})


def copy_blocks(dev: Device, src: Any, dst: Any, src_offsets: Any, dst_offsets: Any, nbytes: int) -> None:
    """Pieces of `nbytes` (whole blocks of a cache: one block of keys or values is contiguous) from byte
    src_offsets[i] of `src` to byte dst_offsets[i] of `dst`, as one recorded copy of many regions: a restore
    or an offload of KV blocks moves their bytes as they are, with no kernel and no conversion."""
    s, d = np.asarray(src_offsets, np.int64), np.asarray(dst_offsets, np.int64)
    if s.ndim != 1 or s.shape != d.shape:
        raise ValueError(f"copy_blocks: offsets {s.shape} and {d.shape} must be two equal 1-D lists")
    if not len(s):
        return
    if nbytes <= 0 or nbytes % 4:
        raise ValueError(f"copy_blocks: pieces of {nbytes} bytes (a positive multiple of 4)")
    if s.min() < 0 or d.min() < 0 or s.max() + nbytes > src.size or d.max() + nbytes > dst.size:
        raise ValueError(f"copy_blocks: a piece of {nbytes} bytes falls outside the source ({src.size} bytes) "
                         f"or the destination ({dst.size} bytes)")
    if len(d) > 1 and np.diff(np.sort(d)).min() < nbytes:
        raise ValueError("copy_blocks: destination pieces overlap")
    dev.queue.copy_regions(src, dst, np.stack([s, d, np.full_like(s, nbytes)], 1))


def stage_bytes(dev: Device, parts: list[Any]) -> Any:
    """A staging buffer (host-visible memory that copies into device buffers read from) holding `parts` (bytes
    objects) one after another, each copied into it once. Whoever records copies from it holds it on the queue
    (`dev.queue.hold`) after them."""
    ends = np.cumsum([len(p) for p in parts], dtype=np.int64)
    stage = dev.memory.staging.alloc(max(int(ends[-1]) if len(ends) else 0, 4))
    host = stage.alloc.host

    def put(i: int) -> None:
        host[ends[i] - len(parts[i]):ends[i]] = np.frombuffer(parts[i], np.uint8)

    if len(ends) > 1 and ends[-1] >= _PARALLEL_COPY:
        list(_copy_pool().map(put, range(len(parts))))
    else:
        for i in range(len(parts)):
            put(i)
    return stage


_PARALLEL_COPY = 8 << 20  # bytes from which stage_bytes copies in several threads
_copier: ThreadPoolExecutor | None = None


def _copy_pool() -> ThreadPoolExecutor:
    """Threads for host copies: numpy lets go of the GIL while it copies, and one core alone copies well short
    of what a server's memory can."""
    global _copier
    if _copier is None:
        _copier = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="vkgraph-stage")
    return _copier


def readback_buffer(dev: Device, nbytes: int) -> Any:
    """Host memory (cached where the device has such) that copies out of device buffers may write, for
    `read_parts` to read once they have run."""
    return dev.memory.readback.alloc(max(nbytes, 4))


def read_parts(dev: Device, buf: Any, size: int, count: int) -> list[bytes]:
    """The first `count` pieces of `size` bytes of a readback buffer, each its own bytes object, after every
    copy recorded into it has run; then the buffer goes back to its pool."""
    if count * size > buf.size:
        raise ValueError(f"read_parts: {count} pieces of {size} bytes overflow a buffer of {buf.size} bytes")
    dev.queue.wait_for(buf.alloc)
    host = buf.alloc.host
    out = [host[i * size:(i + 1) * size].tobytes() for i in range(count)]
    buf.release()
    return out


SPLIT_PAIRS = 256  # split below this many (sequence, KV head) pairs
SPLIT_TARGET = 256  # workgroups a split aims for
MIN_PART = 32  # tokens per partition at least: one tile of the default form
MAX_PARTS = 16  # partitions per pair: what paged_decode.comp's finish combines in one round of loads (its PARTS_AHEAD)


def choose_split(dev: Device, num_seqs: int, num_kv_heads: int, max_context_len: int, step: int) -> tuple[int, int]:
    """The split-K of a decode dispatch: (least tokens per partition, partitions per (sequence, KV head) pair), or
    (0, 1) for none. Split when few pairs run, into as many partitions as bring the workgroups to SPLIT_TARGET, at
    most MAX_PARTS and none shorter than MIN_PART (rounded up to `step`, the form's tile). The kernel sizes each
    sequence's partitions by its own context (paged_decode.comp's part_len: the fewest tokens, a multiple of the
    least, that cover it in the partitions), so a graph captured for a long context splits a short one as finely.

    Measured on an H200 (32 q / 8 KV heads, head 128, float16 cache; bench_decode_attn.py, us): at B=1 the best
    partitions were 32 tokens up to L=512 (L=256: 9.7 against 12.3 for 128-token ones, L=512: 10.1 against 12.5),
    64 at L=1024 (11.3 against 12.8), 128 at L=2048 and 4096 (14.3, 18.4; 64-token ones 15.1, 23.6): the finish's
    loads of more than 16 partitions cost more than shorter partitions gain. B=2 and 4 the same up to L=256 and
    within 2% of this rule beyond; B=16 (128 pairs) 1.26x at L=2048 from two partitions; at B=32 L=2048 (256
    pairs) partitions of 256-1024 tokens were 2-22% slower than none."""
    pairs = num_seqs * num_kv_heads
    least = -(-MIN_PART // step) * step
    parts = min(MAX_PARTS, -(-SPLIT_TARGET // pairs), -(-max_context_len // least))
    return (least, parts) if pairs < SPLIT_PAIRS and parts > 1 else (0, 1)


@dataclass(frozen=True)
class DecodeForm:
    """How paged_decode's kernel walks the context. "tiles" (attention_common.glsl): tiles of keys and values
    through shared memory, the workgroup's invocations split over the query rows. "stream" (decode_stream.glsl):
    keys and values straight into registers, each 16-byte word loaded and converted once for all the query rows of
    its KV head, groups of `lanes` invocations a token (at most; 0: up to 16), `unroll` tokens a group in each chunk
    of one softmax step; `wg` invocations a workgroup."""

    kind: str = "tiles"
    wg: int = ATTN_WG
    unroll: int = 4
    lanes: int = 0
    tile: int = 0   # tiles: tokens a tile (0: the largest of TILES that fits the shared memory)
    row_lanes: bool = False   # tiles: the query rows interleaved in the lanes (-DROW_LANES, kv_words.glsl)

    @classmethod
    def parse(cls, text: str) -> DecodeForm:
        """"tiles", "tiles:TILE[xWG]" (e.g. tiles:64x256), either followed by "/rows" (the rows interleaved),
        "stream" or "stream:WGxUNROLL[xLANES]" (e.g. stream:256x8), as the benchmark takes them."""
        if text.startswith("tiles") and text.endswith("/rows"):
            return replace(cls.parse(text[:-len("/rows")]), row_lanes=True)
        kind, _, rest = text.partition(":")
        try:
            nums = [int(x) for x in rest.split("x")] if rest else []
        except ValueError:
            nums = None
        if kind == "tiles" and nums is not None and len(nums) <= 2:
            tile, wg = (nums + [0, ATTN_WG][len(nums):])[:2]
            return cls(kind, wg, tile=tile)
        if kind != "stream" or nums is None or len(nums) > 3:
            raise ValueError(f"decode form {text!r}: tiles, tiles:TILE[xWG], stream or stream:WGxUNROLL[xLANES]")
        if not nums:
            return cls(kind)
        wg, unroll, lanes = (nums + [4, 0][len(nums) - 1:])[:3]
        return cls(kind, wg, unroll, lanes)


DEFAULT_FORM = DecodeForm()


def _stream_defines(dev: Device, form: DecodeForm, rows: int, head_size: int, dtype: str) -> dict[str, int] | None:
    """The "stream" form's defines (decode_stream.glsl), or None where the device or the shape does not suit it:
    a fixed subgroup size with shuffles and reductions, a workgroup of a power of two of subgroups, invocations
    a token (LANES) a power of two dividing the token's 16-byte words and the subgroup, and each invocation's
    query and output slices (rows x the dimensions it holds) at most 64 floats, the rows at most LANES."""
    info = dev.info
    sg, wg = info.max_subgroup_size, form.wg
    if (info.min_subgroup_size != sg or not {"basic", "shuffle", "arithmetic"} <= info.subgroup_ops
            or wg % sg or (wg // sg) & (wg // sg - 1) or wg > info.max_workgroup_invocations or form.unroll < 1):
        return None
    words = head_size * KV_DTYPES[dtype] // 16
    lanes = 1 << (min(form.lanes or 16, sg, words).bit_length() - 1)
    while words % lanes:
        lanes //= 2
    rp = 1 << (rows - 1).bit_length()
    if rows * (words // lanes) * (16 // KV_DTYPES[dtype]) > 64 or rp > lanes:
        return None
    chunk = wg // lanes * form.unroll
    base = rows * chunk * 4 + chunk * -(-rows // 4) * 16 + 3 * rows * 4
    nslot = wg // sg  # the groups' outputs summed in as many slots as fit the shared memory
    while nslot > 1 and base + nslot * rows * head_size * 4 > info.max_shared_memory:
        nslot //= 2
    if base + nslot * rows * head_size * 4 > info.max_shared_memory:
        return None
    return {"STREAM": 1, "LANES": lanes, "UNROLL": form.unroll, "SG": sg, "NSLOT": nslot, "RP": rp}


def _tiles_form(dev: Device, form: DecodeForm, rows: int, head_size: int, dtype: str) -> int:
    """The tile of a "tiles" form (its own, or the largest that fits where it names none), checked with its
    workgroup: a multiple of 4 tokens whose arrays fit the device's shared memory, a workgroup of a power of two of
    invocations, at least the words of a token (one invocation builds each word of the new token)."""
    info = dev.info
    tile, words = form.tile or _choose_tile(dev, rows, head_size, dtype), head_size * KV_DTYPES[dtype] // 16
    if (tile < 4 or tile % 4 or form.wg & (form.wg - 1) or form.wg > info.max_workgroup_invocations
            or form.wg < words or _shared_bytes(rows, tile, head_size, dtype, form.row_lanes) > info.max_shared_memory):
        raise ValueError(f"decode form tiles:{tile}x{form.wg}: tiles of a multiple of 4 tokens within the shared "
                         f"memory ({info.max_shared_memory} bytes), workgroups of a power of two of invocations up "
                         f"to {info.max_workgroup_invocations} and at least a token's {words} words")
    return tile


def _softcap(cap: float) -> float:
    if not (math.isfinite(cap) and cap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0: none), got {cap}")
    return float(cap)


def paged_decode(dev: Device, cache: PagedKVCache, q: Any, block_tables: Any, context_lens: Any, *,
                 num_seqs: int, num_heads: int, max_blocks_per_seq: int, max_context_len: int,
                 scale: float | None = None, window: int = 0, softcap: float = 0.0, part_tokens: int | None = None,
                 out: Any | None = None, int8: bool = False, new_tokens: NewTokens | None = None,
                 form: DecodeForm | None = None) -> Any:
    """Attention of one query token per sequence over its cached context; returns out [B, num_heads, D].

    q: float32 [num_seqs, num_heads, D]; block_tables: int32 [num_seqs, max_blocks_per_seq]; context_lens:
    int32 [num_seqs], each at most max_context_len. part_tokens: None chooses split-K automatically, 0 turns
    it off, else the tokens per partition (a multiple of the tile). window > 0: only the last `window`
    positions are visible. softcap > 0: scores (scaled) become softcap * tanh(score / softcap). int8: `out`
    holds the rows [B, num_heads * D] as the integer matvec's input (matvec.Q8Acts.layout), written by the kernel
    that finishes the output instead of float32; D % 32 == 0. new_tokens: the same dispatch writes each sequence's
    new key and value into the cache and attends them from registers (see NewTokens; `q` is then the q/k/v rows),
    where write_kv would run before it. form: the kernel's walk of the context (DecodeForm; None: the default;
    "stream" falls back to "tiles" where the device or the shape does not suit it).
    """
    d, hkv = cache.head_size, cache.num_kv_heads
    if num_heads % hkv:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({hkv})")
    if max_context_len > max_blocks_per_seq * cache.block_size:
        raise ValueError(f"max_context_len {max_context_len} exceeds {max_blocks_per_seq} blocks of "
                         f"{cache.block_size} tokens")
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    group = num_heads // hkv
    new = new_tokens
    if new is None:
        check_buffer("q", q, num_seqs * num_heads * d * 4)
    else:
        _check_rows("q", q, num_seqs, new.src_stride, {"queries": (new.q_off, num_heads * d),
                                                      "keys": (new.k_off, hkv * d), "values": (new.v_off, hkv * d)})
        check_buffer("slot_mapping", new.slot_mapping, num_seqs * 4)
        if d * KV_DTYPES[cache.dtype] // 16 > ATTN_WG:  # one invocation builds each 16-byte word of the new token
            raise ValueError(f"new tokens of head size {d} ({cache.dtype}) have more words than a workgroup has "
                             f"invocations ({ATTN_WG})")
        for name, buf in zip(("cos", "sin"), new.rope or ()):
            check_buffer(name, buf, num_seqs * d // 2 * 4)
    check_buffer("block_tables", block_tables, num_seqs * max_blocks_per_seq * 4)
    check_buffer("context_lens", context_lens, num_seqs * 4)
    if int8 and d % 32:
        raise ValueError(f"int8 output comes in blocks of 32: head size {d} is not a multiple of 32")
    nbytes = Q8Acts.layout(num_seqs, num_heads * d)[0] if int8 else num_seqs * num_heads * d * 4
    out = out if out is not None else dev.alloc(nbytes)
    check_buffer("out", out, nbytes)
    # the int8 parts, or `out` bound where the float output is written
    acts = Q8Acts.in_buffer(out, num_seqs, num_heads * d) if int8 else Q8Acts(out, out, out)
    form = form or DEFAULT_FORM
    named = form.kind == "tiles" and form != DEFAULT_FORM   # a tile or workgroup of its own, checked
    tile = _tiles_form(dev, form, group, d, cache.dtype) if named else _choose_tile(dev, group, d, cache.dtype)
    core = _stream_defines(dev, form, group, d, cache.dtype) if form.kind == "stream" else None
    wg = form.wg if core or form.kind == "tiles" else ATTN_WG
    if core is None:
        core = {"TILE": tile, **({"ROW_LANES": 1} if form.row_lanes else {})}
    if part_tokens is None:  # stream: partitions of whole chunks (a multiple of the tile too)
        step = math.lcm(tile, wg // core["LANES"] * core["UNROLL"]) if "STREAM" in core else tile
        part_tokens, parts = choose_split(dev, num_seqs, hkv, max_context_len, step)
    elif part_tokens < 0 or part_tokens % tile:
        raise ValueError(f"part_tokens must be 0 or a positive multiple of the tile {tile}, got {part_tokens}")
    else:
        parts = max(1, -(-max_context_len // part_tokens)) if part_tokens else 1
    if part_tokens:
        part_o = dev.alloc(num_seqs * num_heads * parts * d * 4)
        part_ml = dev.alloc(num_seqs * num_heads * parts * 8)
        arrivals = arrival_counters(dev, num_seqs * hkv)
    else:
        part_o = part_ml = arrivals = out  # bound but never written
    flags = {"Q8_OUT": 1} if int8 else {}
    push = {"num_kv_heads": hkv, "max_blocks": max_blocks_per_seq,
            "scale": 1.0 / math.sqrt(d) if scale is None else scale, "window": window,
            "part_tokens": part_tokens, "max_parts": parts, "softcap": _softcap(softcap), "src_stride": 0,
            "q_off": 0, "k_off": 0, "v_off": 0}
    # without new tokens the bindings of their inputs take context_lens (read) and `out` (written anyway)
    extra = [context_lens, context_lens, context_lens, out, out]
    if new is not None:
        flags["NEW_KV"] = 1
        if new.rope is not None:
            if d % 2:
                raise ValueError(f"RoPE needs an even head size, got {d}")
            flags["ROPE"] = 1
        extra = [new.slot_mapping, *(new.rope or (context_lens, context_lens)), cache.key, cache.value]
        push.update(src_stride=new.src_stride, q_off=new.q_off, k_off=new.k_off, v_off=new.v_off)
    kern = catalog.compile(dev, "paged_decode", spec={"WG": wg},
                           defines=_defines(dev, d, cache.dtype, wg, GROUP=group, **core, BLOCK_SIZE=cache.block_size,
                                            PARTS_AHEAD=MAX_PARTS, **flags))
    catalog.dispatch(dev, kern, [q, cache.key, cache.value, block_tables, context_lens, out, part_o, part_ml,
                                 acts.xq, acts.xd, acts.xs, *extra, arrivals], (parts, hkv, num_seqs), push=push)
    return out


def prefill_attention(dev: Device, q: Any, k: Any, v: Any, cu_seqlens: Any, *, num_seqs: int,
                      num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int, max_seq_len: int,
                      kv_dtype: str = "f32", scale: float | None = None, window: int = 0, softcap: float = 0.0,
                      out: Any | None = None) -> Any:
    """Causal attention over packed prompts; returns out [num_tokens, num_heads, head_size] float32.

    q: float32 [num_tokens, num_heads, D]; k, v: [num_tokens, num_kv_heads, D] in kv_dtype; cu_seqlens: int32
    [num_seqs + 1], sequence b being tokens cu_seqlens[b] .. cu_seqlens[b+1], none longer than max_seq_len.
    """
    _check_head(head_size, kv_dtype)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    group = num_heads // num_kv_heads
    check_buffer("q", q, num_tokens * num_heads * head_size * 4)
    check_buffer("k", k, num_tokens * num_kv_heads * head_size * KV_DTYPES[kv_dtype])
    check_buffer("v", v, num_tokens * num_kv_heads * head_size * KV_DTYPES[kv_dtype])
    check_buffer("cu_seqlens", cu_seqlens, (num_seqs + 1) * 4)
    out = out if out is not None else dev.alloc(num_tokens * num_heads * head_size * 4)
    check_buffer("out", out, num_tokens * num_heads * head_size * 4)
    qt = 16
    # query tokens per workgroup: as many as registers (8 vec4 accumulators) and shared memory allow
    limit = dev.info.max_shared_memory
    while qt > 1 and (qt * group * head_size // 4 > 8 * ATTN_WG
                      or _shared_bytes(qt * group, TILES[-1], head_size, kv_dtype) > limit):
        qt //= 2
    tile = _choose_tile(dev, qt * group, head_size, kv_dtype)
    kern = catalog.compile(dev, "prefill_attention", spec={"WG": ATTN_WG},
                           defines=_defines(dev, head_size, kv_dtype, GROUP=group, QT=qt, TILE=tile))
    catalog.dispatch(dev, kern, [q, k, v, cu_seqlens, out], (-(-max_seq_len // qt), num_kv_heads, num_seqs),
                     push={"num_kv_heads": num_kv_heads,
                           "scale": 1.0 / math.sqrt(head_size) if scale is None else scale, "window": window,
                           "softcap": _softcap(softcap)})
    return out

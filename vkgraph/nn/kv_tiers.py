"""The KV prefix store below the GPU: blocks the GPU prefix cache evicts go to host memory, then to disk.

Entries are keyed by a block's chained prefix hash (`kv_cache.hash_block`) and hold the block's keys and values
for every layer, as the GPU cache stores them (the payload's bytes are opaque here). Each tier has a byte
budget and evicts least recently used first: host-memory entries fall to the disk tier (when there is one),
disk entries are deleted. A hit in the disk tier is promoted back to host memory.

Disk entries are files named by the hash under a folder named by the model's fingerprint (weights, config, KV
dtype, block size), and each file repeats the fingerprint and the hash and carries a sha256 digest of its
payload: a file from another model, another block or a torn write is dropped with a warning, never restored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path

import numpy as np

from ..quant import QuantizedTensor
from ..templates.paged_attention import KV_DTYPES
from ..tensor import Tensor, stack
from .template_ops import KVCache, write_kv

log = logging.getLogger("vkgraph.kv_tiers")

_MAGIC = b"VKGKV001"
_HEADER = struct.Struct("<8s32s32s32sQ")  # magic, fingerprint, block hash, payload sha256, payload bytes
_SAMPLE = 1 << 16  # bytes of each weight tensor the fingerprint reads, spread over the tensor


def model_fingerprint(weights: object, *, kv_dtype: str, block_size: int) -> bytes:
    """32 bytes naming what a KV block depends on: the config, the KV dtype, the block size, and the weights
    (each tensor's name, shape and dtype, and 64 KiB of its bytes read at evenly spaced places: reading all of
    an 8B model's 16 GB would take longer than the cache saves; any retrained or requantized tensor differs
    in the sampled bytes all but surely)."""
    h = hashlib.sha256(b"vkgraph kv v1")
    h.update(json.dumps({"kv_dtype": kv_dtype, "block_size": block_size,
                         "config": asdict(weights.config)}, sort_keys=True, default=str).encode())  # type: ignore[attr-defined]
    for name, arr in _tensors(weights, "w"):
        flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        h.update(f"{name} {arr.shape} {arr.dtype}".encode())
        if flat.size <= _SAMPLE:
            h.update(flat.tobytes())
        else:
            chunk = 4096
            starts = np.linspace(0, flat.size - chunk, _SAMPLE // chunk).astype(np.int64)
            for s in starts:
                h.update(flat[s:s + chunk].tobytes())
    return h.digest()


def _tensors(obj: object, name: str) -> Iterator[tuple[str, np.ndarray]]:
    if isinstance(obj, QuantizedTensor):
        yield name + f".{obj.format.name}", obj.data
    elif isinstance(obj, np.ndarray):
        yield name, obj
    elif isinstance(obj, list):
        for i, x in enumerate(obj):
            yield from _tensors(x, f"{name}.{i}")
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            if f.name != "config":
                yield from _tensors(getattr(obj, f.name), f"{name}.{f.name}")


class HostTier:
    """Payloads in host memory, least recently used first out (to `spill`, when set)."""

    name = "host"

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[bytes, bytes] = OrderedDict()
        self.bytes = 0

    def __contains__(self, h: bytes) -> bool:
        return h in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, h: bytes) -> bytes | None:
        p = self.entries.get(h)
        if p is not None:
            self.entries.move_to_end(h)
        return p

    def put(self, h: bytes, payload: bytes) -> list[tuple[bytes, bytes]]:
        """Store; returns the entries evicted to make room (the payload itself when it alone exceeds the budget)."""
        if h in self.entries:
            self.entries.move_to_end(h)
            return []
        if len(payload) > self.max_bytes:
            return [(h, payload)]
        self.entries[h] = payload
        self.bytes += len(payload)
        out = []
        while self.bytes > self.max_bytes:
            old, p = self.entries.popitem(last=False)
            self.bytes -= len(p)
            out.append((old, p))
        return out


class DiskTier:
    """Payloads as files under `root / fingerprint`, with a byte budget, least recently used first out.

    Files already there (from an earlier run of the same model) are adopted at start, oldest access first."""

    name = "disk"

    def __init__(self, root: str | Path, max_bytes: int, fingerprint: bytes) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if len(fingerprint) != 32:
            raise ValueError("fingerprint must be 32 bytes")
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.dir = Path(root) / fingerprint.hex()[:32]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.entries: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes
        self.bytes = 0
        self.dropped = 0  # entries found corrupt or foreign
        found = []
        for f in self.dir.glob("*.kv"):
            try:
                h = bytes.fromhex(f.stem)
                st = f.stat()
            except (ValueError, OSError):
                continue
            if len(h) == 32:
                found.append((st.st_atime_ns, h, st.st_size))
        for _, h, size in sorted(found):
            self.entries[h] = size
            self.bytes += size
        self._evict()

    def __contains__(self, h: bytes) -> bool:
        return h in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def _path(self, h: bytes) -> Path:
        return self.dir / f"{h.hex()}.kv"

    def put(self, h: bytes, payload: bytes) -> None:
        if h in self.entries:
            self.entries.move_to_end(h)
            return
        size = _HEADER.size + len(payload)
        if size > self.max_bytes:
            return
        header = _HEADER.pack(_MAGIC, self.fingerprint, h, hashlib.sha256(payload).digest(), len(payload))
        path = self._path(h)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes sharing the folder never share a temp file
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)  # a reader never sees half a file under the entry's name
        except OSError as e:
            log.warning("KV disk tier: cannot write %s: %s", path, e)
            tmp.unlink(missing_ok=True)
            return
        self.entries[h] = size
        self.bytes += size
        self._evict()

    def get(self, h: bytes) -> bytes | None:
        if h not in self.entries:
            return None
        path = self._path(h)
        try:
            data = path.read_bytes()
        except OSError as e:
            return self._drop(h, f"unreadable ({e})")
        if len(data) < _HEADER.size:
            return self._drop(h, "truncated")
        magic, fp, key, digest, n = _HEADER.unpack_from(data)
        payload = data[_HEADER.size:]
        if magic != _MAGIC:
            return self._drop(h, "not a vkgraph KV file")
        if fp != self.fingerprint:
            return self._drop(h, "written for another model")
        if key != h:
            return self._drop(h, "holds another block")
        if n != len(payload) or hashlib.sha256(payload).digest() != digest:
            return self._drop(h, "payload does not match its digest")
        self.entries.move_to_end(h)
        return payload

    def _drop(self, h: bytes, why: str) -> None:
        log.warning("KV disk tier: dropping %s: %s", self._path(h), why)
        self.dropped += 1
        self.bytes -= self.entries.pop(h)
        self._path(h).unlink(missing_ok=True)
        return None

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self.entries:
            h, size = self.entries.popitem(last=False)
            self.bytes -= size
            self._path(h).unlink(missing_ok=True)


class PrefixStore:
    """The tiers below the GPU, host memory then disk (either may be absent), with counters for metrics."""

    def __init__(self, host: HostTier | None = None, disk: DiskTier | None = None) -> None:
        if host is None and disk is None:
            raise ValueError("a prefix store needs a host tier, a disk tier or both")
        self.host = host
        self.disk = disk
        self.spilled = 0  # blocks the GPU cache handed down

    def __contains__(self, h: bytes) -> bool:
        return (self.host is not None and h in self.host) or (self.disk is not None and h in self.disk)

    def put(self, h: bytes, payload: bytes) -> None:
        """A block the GPU cache evicted."""
        self.spilled += 1
        self._keep(h, payload)

    def _keep(self, h: bytes, payload: bytes) -> None:
        """Into host memory, and what that evicts (the payload itself, when it alone exceeds the budget) down
        to disk; straight to disk without a host tier."""
        down = self.host.put(h, payload) if self.host is not None else [(h, payload)]
        if self.disk is not None:
            for old, p in down:
                self.disk.put(old, p)

    def get(self, h: bytes) -> tuple[bytes, str] | None:
        """The payload and the tier it came from; a disk hit is promoted to host memory."""
        if self.host is not None:
            p = self.host.get(h)
            if p is not None:
                return p, "host"
        if self.disk is not None:
            p = self.disk.get(h)
            if p is not None:
                if self.host is not None:
                    self._keep(h, p)  # (too large for host memory: it stays where it is on disk)
                return p, "disk"
        return None

    def sizes(self) -> dict[str, tuple[int, int]]:
        """Per tier: (entries, bytes)."""
        return {t.name: (len(t), t.bytes) for t in (self.host, self.disk) if t is not None}


class BlockCopier:
    """Copies whole blocks of a model's paged KV caches (every layer, keys and values) between the GPU and
    host bytes: one payload per block, the caches' own words in the caches' own layout."""

    def __init__(self, caches: list[KVCache]) -> None:
        c = caches[0]
        self.caches = caches
        self.words = c.num_kv_heads * c.block_size * c.head_size * KV_DTYPES[c.dtype] // 4  # per block, per buffer

    @property
    def payload_bytes(self) -> int:
        return 2 * len(self.caches) * self.words * 4

    def read(self, blocks: list[int]) -> list[bytes]:
        idx = Tensor(np.asarray(blocks, np.int32))
        parts = [t.reshape(c.num_blocks, self.words).take(idx, 0) for c in self.caches for t in (c.key, c.value)]
        words = stack(parts, 1).numpy()  # (blocks, 2 * layers, words): one download
        return [words[i].tobytes() for i in range(len(blocks))]

    def write(self, blocks: list[int], payloads: list[bytes]) -> None:
        """Into the given blocks, through the cache's own write (keys and values per token at their slots)."""
        c = self.caches[0]
        n, bs = len(blocks), c.block_size
        words = np.frombuffer(b"".join(payloads), np.uint32).reshape(n, 2 * len(self.caches), self.words)
        slots = Tensor((np.asarray(blocks, np.int64)[:, None] * bs + np.arange(bs)).reshape(-1).astype(np.int32))
        done = []
        for i, cache in enumerate(self.caches):
            k, v = (self._rows(cache, words[:, 2 * i + j]) for j in (0, 1))
            done.append(write_kv(cache, Tensor(k), Tensor(v), slots))
        stack(done).numpy()  # written before any pass reads them

    @staticmethod
    def _rows(cache: KVCache, words: np.ndarray) -> np.ndarray:
        """(blocks, words) in the layout [kv_heads, block_size, head] -> (tokens, kv_heads, head) float32."""
        vals = words.view(np.float16 if cache.dtype == "f16" else np.float32)
        vals = vals.reshape(len(words), cache.num_kv_heads, cache.block_size, cache.head_size).transpose(0, 2, 1, 3)
        return vals.reshape(-1, cache.num_kv_heads, cache.head_size).astype(np.float32)

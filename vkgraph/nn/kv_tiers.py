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
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path

import numpy as np

from ..quant import QuantizedTensor
from ..templates.paged_attention import cache_bytes
from ..tensor import realize_all
from .template_ops import KVCache, read_kv_blocks, write_kv_blocks

log = logging.getLogger("vkgraph.kv_tiers")

_MAGIC = b"VKGKV001"
_HEADER = struct.Struct("<8s32s32s32sQ")  # magic, fingerprint, block hash, payload sha256, payload bytes
_SAMPLE = 1 << 16  # bytes of each weight tensor the fingerprint reads, spread over the tensor
_IO_THREADS = min(8, os.cpu_count() or 1)  # disk entries read or written at once
_AHEAD_BYTES = 1 << 30  # disk entries read ahead of their lookup and not yet taken, at most
_CHUNK = 64 << 20  # bytes of KV blocks per copy between the GPU and the host (bounds the staging buffers; nn/
# may not import the runtime, whose transfer.STAGING_CHUNK is the same size)


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


_pool: ThreadPoolExecutor | None = None


def _io_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="vkgraph-kv-io")
    return _pool


def _parallel(fn: Callable, args: list[tuple]) -> list:
    """fn(*a) for each a, in worker threads when there are several; results in order."""
    if len(args) < 2:
        return [fn(*a) for a in args]
    return list(_io_pool().map(fn, *zip(*args)))


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
        self.ahead: OrderedDict[bytes, Future] = OrderedDict()  # reads started by `prefetch`, oldest first
        self.ahead_bytes = 0
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
        self.put_many([(h, payload)])

    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        """Write entries, several files at once (each digest and write runs in a worker thread: hashlib and file
        IO release the GIL), then count them in, oldest of `items` first."""
        new = []
        for h, payload in items:
            if h in self.entries:
                self.entries.move_to_end(h)
            elif _HEADER.size + len(payload) <= self.max_bytes:
                new.append((h, payload))
        for (h, payload), error in zip(new, _parallel(self._write, new)):
            if error is not None:
                log.warning("KV disk tier: cannot write %s: %s", self._path(h), error)
            elif h not in self.entries:
                self.entries[h] = _HEADER.size + len(payload)
                self.bytes += _HEADER.size + len(payload)
        self._evict()

    def _write(self, h: bytes, payload: bytes) -> OSError | None:
        header = _HEADER.pack(_MAGIC, self.fingerprint, h, hashlib.sha256(payload).digest(), len(payload))
        path = self._path(h)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")  # never shared by two writers
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)  # a reader never sees half a file under the entry's name
        except OSError as e:
            tmp.unlink(missing_ok=True)
            return e
        return None

    def get(self, h: bytes) -> bytes | None:
        return self.get_many([h])[0]

    def prefetch(self, hashes: list[bytes]) -> None:
        """Start reading (and checking) these entries in worker threads, for a `get_many` to come: e.g. for a
        request still queued. At most `_AHEAD_BYTES` are kept read ahead; the oldest reads are let go first."""
        for h in hashes:
            if h in self.entries and h not in self.ahead:
                self.ahead[h] = _io_pool().submit(self._read, h)
                self.ahead_bytes += self.entries[h]
        while self.ahead_bytes > _AHEAD_BYTES:
            self._let_go(next(iter(self.ahead)))

    def _let_go(self, h: bytes) -> Future | None:
        f = self.ahead.pop(h, None)
        if f is not None:
            f.cancel()
            self.ahead_bytes -= self.entries.get(h, 0)
        return f

    def get_many(self, hashes: list[bytes]) -> list[bytes | None]:
        """Each entry's payload (None where absent, or found corrupt or foreign and dropped with a warning),
        several files read and checked at once in worker threads, or taken from a read `prefetch` started."""
        want = [h for h in hashes if h in self.entries]
        early = {h: f for h in want if (f := self._let_go(h)) is not None and not f.cancelled()}
        rest = [h for h in want if h not in early]
        got = dict(zip(rest, _parallel(self._read, [(h,) for h in rest])))
        got.update((h, f.result()) for h, f in early.items())
        out: list[bytes | None] = []
        for h in hashes:
            p = got.get(h)
            if isinstance(p, str):
                if h in self.entries:
                    self._drop(h, p)
                p = None
            elif p is not None:
                self.entries.move_to_end(h)
            out.append(p)
        return out

    def _read(self, h: bytes) -> bytes | str:
        """The payload of h's file, checked, in one read after the header; or why it cannot be used."""
        try:
            with open(self._path(h), "rb", buffering=0) as f:
                head = f.read(_HEADER.size)
                if len(head) < _HEADER.size:
                    return "truncated"
                magic, fp, key, digest, n = _HEADER.unpack(head)
                if magic != _MAGIC:
                    return "not a vkgraph KV file"
                if fp != self.fingerprint:
                    return "written for another model"
                if key != h:
                    return "holds another block"
                payload = f.read(n + 1)  # one byte more than the header says: a longer file is caught too
        except OSError as e:
            return f"unreadable ({e})"
        if len(payload) != n or hashlib.sha256(payload).digest() != digest:
            return "payload does not match its digest"
        return payload

    def _drop(self, h: bytes, why: str) -> None:
        log.warning("KV disk tier: dropping %s: %s", self._path(h), why)
        self.dropped += 1
        self._let_go(h)
        self.bytes -= self.entries.pop(h)
        self._path(h).unlink(missing_ok=True)

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self.entries:
            self._let_go(next(iter(self.entries)))
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
        self.fetched = {"host": 0, "disk": 0}  # payload bytes found per tier
        self.fetch_s = {"host": 0.0, "disk": 0.0}  # seconds spent finding them (disk: reading and checking)

    def __contains__(self, h: bytes) -> bool:
        return (self.host is not None and h in self.host) or (self.disk is not None and h in self.disk)

    def put(self, h: bytes, payload: bytes) -> None:
        """A block the GPU cache evicted."""
        self.put_many([(h, payload)])

    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        """Blocks the GPU cache evicted, oldest first."""
        self.spilled += len(items)
        self._keep(items)

    def _keep(self, items: list[tuple[bytes, bytes]]) -> None:
        """Into host memory, and what that evicts (a payload itself, when it alone exceeds the budget) down to
        disk; straight to disk without a host tier."""
        if self.host is None:
            down = items
        else:
            down = [d for h, p in items for d in self.host.put(h, p)]
        if self.disk is not None and down:
            self.disk.put_many(down)

    def get(self, h: bytes) -> tuple[bytes, str] | None:
        """The payload and the tier it came from; a disk hit is promoted to host memory."""
        got = self.get_many([h])
        return got[0] if got else None

    def get_many(self, hashes: list[bytes]) -> list[tuple[bytes, str]]:
        """(payload, tier) of the leading hashes found, up to the first that is not (absent, or a disk entry
        found corrupt or foreign: dropped with a warning). Disk entries are read together (`DiskTier.get_many`)
        and promoted to host memory. Counts the time and bytes per tier in `fetch_s` and `fetched`."""
        t0 = time.perf_counter()
        found: list[tuple[bytes | None, str]] = []
        for h in hashes:
            p = self.host.get(h) if self.host is not None else None
            if p is not None:
                found.append((p, "host"))
            elif self.disk is not None and h in self.disk:
                found.append((None, "disk"))
            else:
                break
        t1 = time.perf_counter()
        on_disk = [h for h, (p, _) in zip(hashes, found) if p is None]
        read = iter(self.disk.get_many(on_disk) if on_disk else [])
        out: list[tuple[bytes, str]] = []
        promote = []
        for h, (p, tier) in zip(hashes, found):
            if p is None:
                p = next(read)
                if p is None:
                    break
                promote.append((h, p))
            out.append((p, tier))
        if self.host is not None and promote:
            self._keep(promote)  # (what host memory cannot hold stays where it is on disk)
        for tier in ("host", "disk"):
            self.fetched[tier] += sum(len(p) for p, t in out if t == tier)
        self.fetch_s["host"] += t1 - t0
        self.fetch_s["disk"] += time.perf_counter() - t1
        return out

    def sizes(self) -> dict[str, tuple[int, int]]:
        """Per tier: (entries, bytes)."""
        return {t.name: (len(t), t.bytes) for t in (self.host, self.disk) if t is not None}


class BlockCopier:
    """Copies whole blocks of a model's paged KV caches (every layer, keys and values) between the GPU and
    host bytes: one payload per block, the caches' own bytes in the caches' own layout, moved by copies of many
    regions (no kernel, no conversion), `_CHUNK` bytes of blocks at a time, through host memory the GPU reads
    (restores) or writes (offloads) with no buffer between it and the blocks."""

    def __init__(self, caches: list[KVCache]) -> None:
        c = caches[0]
        self.caches = caches
        self.payload_bytes = 2 * len(caches) * cache_bytes(1, c.num_kv_heads, c.head_size, c.block_size, c.dtype)
        self.per_copy = max(1, _CHUNK // self.payload_bytes)  # blocks per copy

    def read(self, blocks: list[int]) -> list[bytes]:
        out = []
        for s in range(0, len(blocks), self.per_copy):
            out += read_kv_blocks(self.caches, blocks[s:s + self.per_copy])
        return out

    def write(self, blocks: list[int], payloads: list[bytes]) -> None:
        """Into the given blocks, recorded ahead of any later pass (which reads them after, in queue order)."""
        if len(blocks) != len(payloads):
            raise ValueError(f"{len(blocks)} blocks for {len(payloads)} payloads")
        if any(len(p) != self.payload_bytes for p in payloads):
            raise ValueError(f"a KV block payload must be {self.payload_bytes} bytes")
        for s in range(0, len(blocks), self.per_copy):
            part = slice(s, s + self.per_copy)
            realize_all(*write_kv_blocks(self.caches, payloads[part], blocks[part]))

    def wait(self) -> None:
        """Until every copy recorded so far has run (for timing): the last cache's values are the last buffer
        written, and the work recorded before their last writer completes before it (one queue, in order)."""
        self.caches[-1].value[:1].numpy()


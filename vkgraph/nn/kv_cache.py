"""Paged KV cache bookkeeping on the host: which physical blocks hold which sequence's keys and values.

No GPU here. The cache tensors themselves ([num_blocks, kv_heads, block_size, head_dim], see
`vkgraph.templates.paged_attention`) are indexed by what this module hands out: block tables, context lengths and the
slot (block * block_size + offset) each new token's key and value are written to.

Prefix caching: once a FULL block's tokens are computed, the block is indexed by a hash chained over everything
before it (sha256(parent hash, its token ids)), so equal prefixes map to equal hashes. A new sequence looks its
full prompt blocks up in order and shares every hit (reference counts), computing only the rest. A block whose
count drops to zero joins the free queue but keeps its hash: until it is evicted it can still be hit.
Eviction takes the front of the free queue: blocks without a hash first, then hashed blocks least recently
freed first (a sequence's blocks are freed tail first, so a prefix's head outlives its tail).

Tiers below the GPU (`store`, a `kv_tiers.PrefixStore`): a hashed block the pool evicts is listed in
`pool.evicted` for the caller to copy out (before any pass overwrites it) into the store; a lookup that misses
on the GPU asks the store, and a block found there is allocated, counted as cached, and listed in
`take_restores()` for the caller to write back before the pass that reads it (`commit_restores` then indexes
it on the GPU again).

Only full, computed blocks are ever shared, and a sequence's partly filled last block is always private, so no
copy-on-write is needed: nobody writes into a shared block.

Lifecycle: `add_sequence` (returns the prompt tokens already cached) -> compute the pending tokens at
`slot_mapping` -> `mark_computed` -> `append_tokens` for each sampled token (or several, for speculative
decoding; `truncate` drops rejected, uncomputed ones) -> ... -> `free_sequence`. Running out of blocks raises
`OutOfKVBlocks` and changes nothing, so a scheduler can preempt a sequence (free it, re-add it later: its
computed prefix is likely still cached) and retry.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .kv_tiers import PrefixStore


class OutOfKVBlocks(RuntimeError):
    """Not enough free KV blocks for the request; the cache manager's state is unchanged."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"out of KV cache blocks: need {needed}, {free} free; preempt a sequence or add blocks")
        self.needed = needed
        self.free = free


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The chained hash of one full block: a digest of the parent block's hash and this block's token ids."""
    h = hashlib.sha256(parent or b"root")
    h.update(np.asarray(token_ids, np.int64).tobytes())
    return h.digest()


class BlockPool:
    """Physical blocks: reference counts, the free queue in eviction order and the hash -> block index."""

    def __init__(self, num_blocks: int, record_evictions: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.record_evictions = record_evictions
        self.evicted: list[tuple[int, bytes]] = []  # (block, hash) of hashed blocks evicted, when recorded
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # front: evict first
        self.cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        """n fresh private blocks, evicting cached free blocks as needed."""
        if n > len(self.free):
            raise OutOfKVBlocks(n, len(self.free))
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            self._forget(b)
            self.ref_count[b] = 1
            out.append(b)
        return out

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def acquire(self, b: int) -> None:
        """Share block b (a prefix-cache hit), taking it off the free queue if nobody held it."""
        if self.ref_count[b] == 0:
            del self.free[b]
        self.ref_count[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block, in the given order (that order becomes the eviction order)."""
        for b in blocks:
            self.ref_count[b] -= 1
            if self.ref_count[b] < 0:
                raise AssertionError(f"KV block {b} released more often than acquired")
            if self.ref_count[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)  # holds nothing reusable: evict it first

    def register(self, b: int, h: bytes) -> None:
        """Index a full, computed block by its chained hash. If an equal block is indexed already (two sequences
        computed the same prefix at once), keep the first; b stays unindexed and is simply freed later."""
        if h not in self.cached:
            self.cached[h] = b
            self.block_hash[b] = h

    def _forget(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            del self.cached[h]
            self.block_hash[b] = None
            if self.record_evictions:
                self.evicted.append((b, h))


@dataclass
class _Sequence:
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of the first len(hashes) full blocks


@dataclass
class Restore:
    """A block found in a tier below the GPU: its payload is to be written into `block` of sequence `seq_id`."""

    seq_id: Hashable
    block: int
    hash: bytes
    payload: bytes


@dataclass
class BatchMetadata:
    """What one forward pass over the pending tokens of several sequences needs, as int32 arrays.

    Pending tokens of sequence i occupy rows query_start_loc[i]:query_start_loc[i+1] of the token arrays.
    Padding: token rows beyond the real ones have slot -1 (the KV write skips them), position 0 and token 0;
    sequence rows beyond the real ones have context length 0; unused block-table entries are 0 (a valid block,
    so a kernel that reads past the context length still reads in bounds)."""

    seq_ids: list[Hashable]
    input_ids: np.ndarray  # [tokens]
    positions: np.ndarray  # [tokens]
    slot_mapping: np.ndarray  # [tokens]
    query_start_loc: np.ndarray  # [seqs + 1]
    context_lens: np.ndarray  # [seqs]: all tokens, cached and pending
    block_tables: np.ndarray  # [seqs, width]
    num_tokens: int  # real (unpadded) token rows


class KVCacheManager:
    """Per-sequence block tables over a `BlockPool`, with prefix caching."""

    def __init__(self, num_blocks: int, block_size: int = 16, *, prefix_caching: bool = True,
                 store: PrefixStore | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if store is not None and not prefix_caching:
            raise ValueError("a prefix store needs prefix caching")
        self.block_size = block_size
        self.store = store
        self.pool = BlockPool(num_blocks, record_evictions=store is not None)
        self.prefix_caching = prefix_caching
        self.seqs: dict[Hashable, _Sequence] = {}
        self.queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # ... and found there (any tier)
        self.hit_tokens_by_tier = {"gpu": 0, "host": 0, "disk": 0}
        self._restores: list[Restore] = []

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def add_sequence(self, seq_id: Hashable, prompt: Sequence[int], *, reserve: int = 0) -> int:
        """Reserve blocks for a prompt; returns how many leading prompt tokens are already in the cache (a
        multiple of block_size, at most len(prompt) - 1 so the last token is always computed for its logits).
        `reserve`: free blocks that must remain afterwards (room a scheduler has promised to others), or
        `OutOfKVBlocks` is raised and nothing changes."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        if not prompt:
            raise ValueError("a sequence needs at least one prompt token")
        seq = _Sequence(tokens=list(prompt))
        found: list[int | bytes] = []  # a GPU block, or the hash of a block in the store
        if self.prefix_caching:
            self._hash_full_blocks(seq)
            found = self._cached_prefix(seq.hashes[:(len(prompt) - 1) // self.block_size])
        self._check_room(prompt, found, reserve)  # before any restore is read: a refused request reads nothing
        stored = [f for f in found if isinstance(f, bytes)]
        got = self.store.get_many(stored) if stored else []
        if len(got) < len(stored):  # an entry could not be used: the cached prefix ends before it
            found = found[:found.index(stored[len(got)])]
            self._check_room(prompt, found, reserve)
        got_it = iter(got)
        hits = [b for b in found if isinstance(b, int)]
        for b in hits:
            self.pool.acquire(b)
        fresh = self.pool.allocate(self.blocks_for(len(prompt)) - len(hits))
        for f in found:
            if isinstance(f, int):
                seq.blocks.append(f)
                self.hit_tokens_by_tier["gpu"] += self.block_size
            else:
                payload, tier = next(got_it)
                seq.blocks.append(fresh.pop(0))
                self._restores.append(Restore(seq_id, seq.blocks[-1], f, payload))
                self.hit_tokens_by_tier[tier] += self.block_size
        seq.blocks += fresh
        seq.num_computed = len(found) * self.block_size
        self.seqs[seq_id] = seq
        if self.prefix_caching:
            self.queried_tokens += len(prompt)
            self.hit_tokens += seq.num_computed
        return seq.num_computed

    def prefetch(self, prompt: Sequence[int]) -> None:
        """Start reading the disk entries of a queued prompt's cached prefix (the blocks neither on the GPU nor in
        host memory) in the background, so that its `add_sequence` finds them read."""
        disk = self.store.disk if self.store is not None else None
        if disk is None or not self.prefix_caching:
            return
        seq = _Sequence(tokens=list(prompt[:len(prompt) - 1]))
        self._hash_full_blocks(seq)
        host = self.store.host
        disk.prefetch([f for f in self._cached_prefix(seq.hashes)
                       if isinstance(f, bytes) and not (host is not None and f in host)])

    def _cached_prefix(self, hashes: list[bytes]) -> list[int | bytes]:
        """The leading blocks of `hashes` cached somewhere: each its GPU block, or its hash where the store holds
        it; up to the first found in neither."""
        found: list[int | bytes] = []
        for h in hashes:
            b = self.pool.lookup(h)
            if b is not None:
                found.append(b)
            elif self.store is not None and h in self.store:
                found.append(h)
            else:
                break
        return found

    def _check_room(self, prompt: Sequence[int], found: list[int | bytes], reserve: int) -> None:
        """Raise OutOfKVBlocks unless the prompt's blocks beyond the GPU hits in `found` fit, leaving `reserve`."""
        hits = [b for b in found if isinstance(b, int)]
        need = self.blocks_for(len(prompt)) - len(hits)
        free_after_hits = self.pool.num_free - sum(self.pool.ref_count[b] == 0 for b in hits)
        if need + reserve > free_after_hits:
            raise OutOfKVBlocks(need + reserve, free_after_hits)

    def take_restores(self) -> list[Restore]:
        """Blocks found below the GPU since the last call, to write into their GPU blocks before the next pass."""
        out, self._restores = self._restores, []
        return out

    def commit_restores(self, restores: list[Restore]) -> None:
        """The restored blocks are written: index them in the GPU prefix cache again."""
        for r in restores:
            seq = self.seqs.get(r.seq_id)
            if seq is not None and r.block in seq.blocks:
                self.pool.register(r.block, r.hash)

    def evict_cached(self) -> None:
        """Evict every cached block no sequence holds (each listed in `take_evicted`, for a store to keep)."""
        self.pool.release(self.pool.allocate(self.pool.num_free)[::-1])

    def take_evicted(self) -> list[tuple[int, bytes]]:
        """(block, hash) of the hashed blocks evicted since the last call, to copy out before the next pass."""
        out, self.pool.evicted = self.pool.evicted, []
        return out

    def append_tokens(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Add tokens to be computed next (a sampled token, or draft tokens), allocating blocks as needed."""
        seq = self.seqs[seq_id]
        need = self.blocks_for(len(seq.tokens) + len(token_ids)) - len(seq.blocks)
        if need > 0:
            seq.blocks += self.pool.allocate(need)
        seq.tokens += token_ids

    def set_token(self, seq_id: Hashable, index: int, token: int) -> None:
        """Replace token `index`, not yet computed, in place (its slot and block stay): e.g. the placeholder of a
        slot reserved for a token that was still being sampled."""
        seq = self.seqs[seq_id]
        if not seq.num_computed <= index < len(seq.tokens):
            raise ValueError(f"set_token({index}): must be between the computed length {seq.num_computed} and "
                             f"the length {len(seq.tokens)}")
        seq.tokens[index] = token
        del seq.hashes[index // self.block_size:]  # hashes over the old token

    def truncate(self, seq_id: Hashable, length: int) -> None:
        """Drop tokens beyond `length` (rejected draft tokens) and the blocks they alone used. Only tokens not
        yet marked computed can be dropped: computed full blocks may be indexed and shared."""
        seq = self.seqs[seq_id]
        if not seq.num_computed <= length <= len(seq.tokens):
            raise ValueError(f"truncate to {length}: must be between the computed length {seq.num_computed} and "
                             f"the length {len(seq.tokens)}")
        keep = self.blocks_for(length)
        self.pool.release(seq.blocks[keep:][::-1])
        del seq.blocks[keep:], seq.tokens[length:]
        del seq.hashes[length // self.block_size:]

    def mark_computed(self, seq_id: Hashable, num_tokens: int | None = None) -> None:
        """Record that the KV of the first `num_tokens` tokens (default: all) is written; full blocks among them
        become available to the prefix cache."""
        seq = self.seqs[seq_id]
        n = len(seq.tokens) if num_tokens is None else num_tokens
        if not seq.num_computed <= n <= len(seq.tokens):
            raise ValueError(f"mark_computed({n}): must be between {seq.num_computed} and {len(seq.tokens)}")
        if self.prefix_caching:
            self._hash_full_blocks(seq)
            for i in range(seq.num_computed // self.block_size, n // self.block_size):
                self.pool.register(seq.blocks[i], seq.hashes[i])
        seq.num_computed = n

    def free_sequence(self, seq_id: Hashable) -> None:
        """Release a finished (or preempted) sequence's blocks; hashed ones stay hittable until evicted."""
        seq = self.seqs.pop(seq_id)
        self.pool.release(seq.blocks[::-1])
        self._restores = [r for r in self._restores if r.seq_id != seq_id]

    def reset(self) -> None:
        """Drop every sequence and the prefix index: all blocks free. The way back to balanced books after an
        interruption left them half updated (a scheduler then recomputes its sequences)."""
        self.pool = BlockPool(self.pool.num_blocks, record_evictions=self.store is not None)
        self.seqs.clear()
        self._restores = []

    # ---- views for the forward pass --------------------------------------------------------------------------

    def context_len(self, seq_id: Hashable) -> int:
        return len(self.seqs[seq_id].tokens)

    def num_computed(self, seq_id: Hashable) -> int:
        return self.seqs[seq_id].num_computed

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self.seqs[seq_id].blocks)

    def slot_mapping(self, seq_id: Hashable, start: int | None = None, end: int | None = None) -> np.ndarray:
        """int32 cache slots of tokens start..end-1 (default: the pending, uncomputed tokens)."""
        seq = self.seqs[seq_id]
        start = seq.num_computed if start is None else start
        end = len(seq.tokens) if end is None else end
        pos = np.arange(start, end)
        return (np.asarray(seq.blocks, np.int64)[pos // self.block_size] * self.block_size
                + pos % self.block_size).astype(np.int32)

    def batch(self, seq_ids: Sequence[Hashable], *, width: int | None = None, pad_seqs: int | None = None,
              pad_tokens: int | None = None) -> BatchMetadata:
        """Metadata for one forward pass over each sequence's pending tokens, optionally padded to fixed sizes
        (block-table width, sequence rows, token rows) so captured kernels can be replayed."""
        seqs = [self.seqs[s] for s in seq_ids]
        width = max((len(s.blocks) for s in seqs), default=0) if width is None else width
        n_rows = len(seqs) if pad_seqs is None else pad_seqs
        counts = [len(s.tokens) - s.num_computed for s in seqs]
        n_tok = sum(counts)
        n_tok_rows = n_tok if pad_tokens is None else pad_tokens
        if n_rows < len(seqs) or n_tok_rows < n_tok:
            raise ValueError(f"padding too small: {len(seqs)} sequences and {n_tok} tokens into {n_rows} and "
                             f"{n_tok_rows}")
        tables = np.zeros((n_rows, width), np.int32)
        ctx = np.zeros(n_rows, np.int32)
        qsl = np.zeros(n_rows + 1, np.int32)
        ids = np.zeros(n_tok_rows, np.int32)
        pos = np.zeros(n_tok_rows, np.int32)
        slots = np.full(n_tok_rows, -1, np.int32)
        t = 0
        for i, (sid, s, c) in enumerate(zip(seq_ids, seqs, counts)):
            if len(s.blocks) > width:
                raise ValueError(f"sequence {sid!r} holds {len(s.blocks)} blocks, more than width {width}")
            tables[i, :len(s.blocks)] = s.blocks
            ctx[i] = len(s.tokens)
            ids[t:t + c] = s.tokens[s.num_computed:]
            pos[t:t + c] = np.arange(s.num_computed, len(s.tokens))
            slots[t:t + c] = self.slot_mapping(sid)
            t += c
            qsl[i + 1] = t
        qsl[len(seqs) + 1:] = t
        return BatchMetadata(list(seq_ids), ids, pos, slots, qsl, ctx, tables, n_tok)

    # ---- checks ------------------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the books do not balance (reference counts, free queue, hash index)."""
        pool = self.pool
        refs = [0] * pool.num_blocks
        for sid, s in self.seqs.items():
            if len(s.blocks) != self.blocks_for(len(s.tokens)):
                raise AssertionError(f"sequence {sid!r}: {len(s.blocks)} blocks for {len(s.tokens)} tokens")
            for i, b in enumerate(s.blocks):
                refs[b] += 1
                if (i + 1) * self.block_size > s.num_computed and pool.ref_count[b] != 1:
                    raise AssertionError(f"sequence {sid!r}: block {b} is not fully computed but shared")
        for b in range(pool.num_blocks):
            if refs[b] != pool.ref_count[b]:
                raise AssertionError(f"block {b}: ref count {pool.ref_count[b]}, held by {refs[b]} tables")
            if (b in pool.free) != (refs[b] == 0):
                raise AssertionError(f"block {b}: in free queue {b in pool.free} with {refs[b]} holders")
            h = pool.block_hash[b]
            if h is not None and pool.cached.get(h) != b:
                raise AssertionError(f"block {b}: hash not indexed to it")
        if len(pool.cached) != sum(h is not None for h in pool.block_hash):
            raise AssertionError("hash index and block hashes disagree")

    def _hash_full_blocks(self, seq: _Sequence) -> None:
        bs = self.block_size
        for i in range(len(seq.hashes), len(seq.tokens) // bs):
            seq.hashes.append(hash_block(seq.hashes[-1] if seq.hashes else None, seq.tokens[i * bs:(i + 1) * bs]))

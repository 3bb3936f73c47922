"""The KV prefix store below the GPU (vkgraph/nn/kv_tiers.py): host-memory and disk tiers with budgets, LRU,
fingerprints and digests, and the engine restoring evicted prefixes from each tier with outputs identical to
those of a prefix still on the GPU."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from vkgraph.nn import tiny_model as mk
from vkgraph.nn.engine import Engine
from vkgraph.nn.kv_cache import KVCacheManager, OutOfKVBlocks
from vkgraph.nn.kv_tiers import BlockCopier, DiskTier, HostTier, PrefixStore, model_fingerprint
from vkgraph.nn.llama import LlamaModel
from vkgraph.nn.template_ops import KVCache, write_kv_blocks
from vkgraph.nn.weights import load_weights
from vkgraph.templates import paged_attention as pa
from vkgraph.tensor import Tensor

FP = bytes(range(32))


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_host_tier_keeps_its_budget_and_hands_the_oldest_down():
    t = HostTier(30)
    assert t.put(h(1), b"a" * 10) == [] and t.put(h(2), b"b" * 10) == [] and t.put(h(3), b"c" * 10) == []
    assert t.get(h(1)) == b"a" * 10  # now the most recent
    assert t.put(h(4), b"d" * 10) == [(h(2), b"b" * 10)]
    assert t.bytes == 30 and set(t.entries) == {h(1), h(3), h(4)}
    assert t.put(h(5), b"e" * 31) == [(h(5), b"e" * 31)]  # larger than the whole budget: straight down


def test_disk_tier_budget_reload_and_lru(tmp_path):
    d = DiskTier(tmp_path, 3 * (200 + 112), FP)
    for i in range(4):
        d.put(h(i), bytes([i]) * 200)
    assert len(d) == 3 and h(0) not in d and len(list(d.dir.glob("*.kv"))) == 3
    assert d.get(h(1)) == bytes([1]) * 200
    again = DiskTier(tmp_path, 10_000, FP)  # a restart adopts the files
    assert {h(1), h(2), h(3)} == set(again.entries) and again.get(h(3)) == bytes([3]) * 200
    other = DiskTier(tmp_path, 10_000, bytes(32))  # another model: another folder, nothing shared
    assert len(other) == 0 and other.get(h(3)) is None


def test_disk_tier_drops_corrupt_and_foreign_entries(tmp_path, caplog):
    d = DiskTier(tmp_path, 1 << 20, FP)
    for i in range(3):
        d.put(h(i), bytes([i]) * 100)
    f0, f1, f2 = (d.dir / f"{h(i).hex()}.kv" for i in range(3))
    raw = bytearray(f0.read_bytes())
    raw[-1] ^= 1
    f0.write_bytes(bytes(raw))  # a flipped bit in the payload
    f2.write_bytes(f1.read_bytes())  # another block's file under this block's name
    foreign = DiskTier(tmp_path / "x", 1 << 20, bytes(32))
    foreign.put(h(7), b"z" * 100)
    (d.dir / f"{h(7).hex()}.kv").write_bytes((foreign.dir / f"{h(7).hex()}.kv").read_bytes())
    d = DiskTier(tmp_path, 1 << 20, FP)
    with caplog.at_level(logging.WARNING, logger="vkgraph.kv_tiers"):
        assert d.get(h(0)) is None and d.get(h(2)) is None and d.get(h(7)) is None
    assert d.get(h(1)) == bytes([1]) * 100
    assert d.dropped == 3 and len(d) == 1 and not f0.exists()
    text = caplog.text
    assert "digest" in text and "another block" in text and "another model" in text


def test_store_spills_host_to_disk_and_promotes_disk_hits(tmp_path):
    s = PrefixStore(HostTier(250), DiskTier(tmp_path, 1 << 20, FP))
    for i in range(4):
        s.put(h(i), bytes([i]) * 100)
    assert set(s.host.entries) == {h(2), h(3)} and set(s.disk.entries) == {h(0), h(1)}
    assert s.get(h(0)) == (bytes([0]) * 100, "disk") and h(0) in s.host  # promoted
    assert s.get(h(0)) == (bytes([0]) * 100, "host") and h(2) in s.disk  # and the host's oldest went down
    assert s.get(h(9)) is None and s.spilled == 4



def test_many_entries_are_read_together_and_a_prefix_ends_at_the_first_unusable_one(tmp_path, caplog):
    s = PrefixStore(HostTier(250), DiskTier(tmp_path, 1 << 20, FP))
    s.put_many([(h(i), bytes([i]) * 100) for i in range(6)])  # 4 and 5 in host memory, 0-3 on disk
    assert set(s.host.entries) == {h(4), h(5)} and s.spilled == 6
    f = s.disk.dir / f"{h(2).hex()}.kv"
    f.write_bytes(f.read_bytes() + b"!")  # one byte longer than its header says
    order = [h(5), h(0), h(1), h(2), h(3), h(9)]
    with caplog.at_level(logging.WARNING, logger="vkgraph.kv_tiers"):
        got = s.get_many(order)
    assert got == [(bytes([5]) * 100, "host"), (bytes([0]) * 100, "disk"), (bytes([1]) * 100, "disk")]
    assert "digest" in caplog.text and h(2) not in s and not f.exists() and h(3) in s.disk
    assert s.fetched == {"host": 100, "disk": 200} and s.fetch_s["disk"] > 0
    assert s.disk.get_many([h(3), h(9), h(3)]) == [bytes([3]) * 100, None, bytes([3]) * 100]


def test_a_request_without_room_reads_nothing_from_the_store(tmp_path):
    store = PrefixStore(None, DiskTier(tmp_path, 1 << 20, FP))
    kv = KVCacheManager(4, 4, store=store)
    prompt = list(range(13))  # 4 blocks, the first 3 of them full and cached
    kv.add_sequence("a", prompt)
    hashes = list(kv.seqs["a"].hashes)
    store.put_many([(x, bytes(8)) for x in hashes])
    kv.free_sequence("a")
    kv.evict_cached()
    kv.take_evicted()
    kv.add_sequence("b", [99])
    with pytest.raises(OutOfKVBlocks):
        kv.add_sequence("c", prompt)  # 4 blocks needed, 3 free: refused before any entry is read
    assert store.fetched == {"host": 0, "disk": 0} and kv.take_restores() == []
    kv.free_sequence("b")
    assert kv.add_sequence("c", prompt) == 12 and store.fetched["disk"] == 24
    assert [r.hash for r in kv.take_restores()] == hashes[:3]


def test_a_queued_prompt_has_its_disk_entries_read_ahead(tmp_path, monkeypatch):
    store = PrefixStore(HostTier(8), DiskTier(tmp_path, 1 << 20, FP))
    kv = KVCacheManager(8, 4, store=store)
    prompt = list(range(17))  # 4 full blocks of which the first 4 (16 tokens) may be cached
    kv.add_sequence("a", prompt)
    hashes = list(kv.seqs["a"].hashes)
    kv.free_sequence("a")
    kv.evict_cached()
    kv.take_evicted()
    store.put_many([(x, bytes([i]) * 8) for i, x in enumerate(hashes)])  # the last one in host memory
    kv.prefetch(prompt)
    disk = store.disk
    assert list(disk.ahead) == hashes[:3] and disk.ahead_bytes == 3 * (8 + 112)
    for f in disk.ahead.values():
        f.result()
    disk._path(hashes[0]).unlink()  # read already: the read ahead is what the lookup uses
    assert kv.add_sequence("b", prompt) == 16
    assert [r.payload for r in kv.take_restores()] == [bytes([i]) * 8 for i in range(4)]
    assert not disk.ahead and disk.ahead_bytes == 0
    # bounded: the oldest reads are let go; an entry evicted or dropped lets its read go too
    monkeypatch.setattr("vkgraph.nn.kv_tiers._AHEAD_BYTES", 2 * (8 + 112))
    disk.prefetch([hashes[1], hashes[2], hashes[3]])
    assert list(disk.ahead) == [hashes[2], hashes[3]] and disk.ahead_bytes == 2 * (8 + 112)
    disk.max_bytes = 0
    disk._evict()
    assert not disk.entries and not disk.ahead and disk.ahead_bytes == 0

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = mk.write_model(tmp_path_factory.mktemp("tiers"), mk.tiny_config(n_layers=2), gguf_types=())["hf"]
    return load_weights(d, progress=False)



@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_block_copier_moves_blocks_bit_for_bit(dtype, monkeypatch):
    """Offload and restore move a block's bytes as they are: any bits (NaN payloads, signed zeros, subnormals)
    come back unchanged, blocks not named stay untouched, and several copies (chunks) serve a long list."""
    rng = np.random.default_rng(1)
    caches = [KVCache.create(7, 2, 8, 4, dtype) for _ in range(3)]
    words = caches[0].key.shape[0]
    before = [rng.integers(0, 2**32, words, dtype=np.uint32) for _ in range(6)]
    for c, (k, v) in zip(caches, zip(before[::2], before[1::2])):
        c.key, c.value = Tensor(k), Tensor(v)
    copier = BlockCopier(caches)
    assert copier.payload_bytes == 2 * 3 * 2 * 4 * 8 * (2 if dtype == "f16" else 4)
    copier.per_copy = 2  # three copies for five blocks
    out = copier.read([5, 0, 3, 1, 6])
    piece = copier.payload_bytes // 6
    for i, b in enumerate([5, 0, 3, 1, 6]):
        want = b"".join(x.view(np.uint8)[b * piece:(b + 1) * piece].tobytes() for x in before)
        assert out[i] == want
    payloads = [rng.bytes(copier.payload_bytes) for _ in range(3)]
    payloads[0] = np.full(copier.payload_bytes // 2, 0x7C01, np.uint16).tobytes()  # f16 signalling NaNs
    monkeypatch.setattr(pa, "_PARALLEL_COPY", 1 if dtype == "f16" else 1 << 40)  # payloads staged in threads, or not
    copier.write([2, 6, 0], payloads)
    copier.wait()
    assert copier.read([2, 6, 0]) == payloads
    assert copier.read([1, 3, 5]) == [out[3], out[2], out[0]]
    assert copier.read([4]) == [b"".join(x.view(np.uint8)[4 * piece:5 * piece].tobytes() for x in before)]
    copier.write([], [])
    with pytest.raises(ValueError, match="payload must be"):
        copier.write([1], [b"x"])
    with pytest.raises(ValueError, match="repeat"):
        write_kv_blocks(caches, payloads[:2], [1, 1])
    with pytest.raises(ValueError, match="below 7"):
        copier.read([7])

def test_fingerprint_names_weights_dtype_and_block_size(tiny):
    fp = model_fingerprint(tiny, kv_dtype="f16", block_size=16)
    assert fp == model_fingerprint(tiny, kv_dtype="f16", block_size=16)
    assert fp != model_fingerprint(tiny, kv_dtype="f32", block_size=16)
    assert fp != model_fingerprint(tiny, kv_dtype="f16", block_size=32)
    wv = np.array(tiny.layers[1].wv)
    wv[3, 5] += 1e-3
    layers = [*tiny.layers[:1], dataclasses.replace(tiny.layers[1], wv=wv)]
    assert fp != model_fingerprint(dataclasses.replace(tiny, layers=layers), kv_dtype="f16", block_size=16)


PROMPT_LEN, NEW = 70, 6  # 4 full (hashed) prompt blocks of 16


def _run(engine: Engine, prompt: list[int]) -> list[tuple[int, float]]:
    engine.add_request(prompt, max_tokens=NEW, logprobs=0)
    out = [(ev.token, ev.logprobs.logprob) for ev in engine.generate([])]
    engine.kv.check_invariants()
    return out


def _engine(weights, store: PrefixStore | None) -> Engine:
    # 12 blocks: three other prompts of 5 blocks evict the first one's blocks from the GPU
    return Engine(LlamaModel(weights, num_blocks=12, block_size=16, max_blocks_per_seq=8), prefix_store=store)


def test_evicted_prefixes_come_back_from_host_and_disk_with_identical_outputs(tiny, tmp_path, caplog):
    rng = np.random.default_rng(0)
    a, *others = ([int(t) for t in rng.integers(3, 250, PROMPT_LEN)] for _ in range(4))
    plain = _engine(tiny, None)
    cold = _run(plain, a)
    want = _run(plain, a)  # a prefix still on the GPU: what restored prefixes must give, bit for bit
    assert [t for t, _ in want] == [t for t, _ in cold]
    assert plain.kv.hit_tokens_by_tier["gpu"] == 64

    fp = model_fingerprint(tiny, kv_dtype="f16", block_size=16)
    block = 2 * 2 * 2 * 16 * 16 * 2  # keys and values, 2 layers, 2 kv heads x 16 tokens x head 16, f16
    store = PrefixStore(HostTier(2 * block), DiskTier(tmp_path, 64 * (block + 112), fp))
    eng = _engine(tiny, store)
    assert eng._blocks.payload_bytes == block
    assert _run(eng, a) == cold
    for p in others:
        _run(eng, p)
    assert eng.kv.hit_tokens_by_tier == {"gpu": 0, "host": 0, "disk": 0}
    assert store.spilled >= 4 and len(store.host) == 2 and len(store.disk) >= 2
    assert store.host.bytes <= 2 * block
    assert _run(eng, a) == want  # its 4 prompt blocks: the newest 2 spilled in host memory, the rest on disk
    assert eng.kv.hit_tokens_by_tier["gpu"] == 0
    assert eng.kv.hit_tokens_by_tier["host"] > 0 and eng.kv.hit_tokens_by_tier["disk"] > 0
    assert eng.kv.hit_tokens_by_tier["host"] + eng.kv.hit_tokens_by_tier["disk"] == 64
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert _run(eng, a) == want and eng.kv.hit_tokens_by_tier["gpu"] == 64  # restored blocks are GPU hits again

    # a restart: a new engine and store find the prefix on disk; a corrupt file is dropped and recomputed
    fresh = PrefixStore(None, DiskTier(tmp_path, 64 * (block + 112), fp))
    assert len(fresh.disk) >= 4
    eng = _engine(tiny, fresh)
    assert _run(eng, a) == want and eng.kv.hit_tokens_by_tier["disk"] == 64
    files = sorted(fresh.disk.dir.glob("*.kv"))
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[-3] ^= 0x40
        f.write_bytes(bytes(raw))
    eng = _engine(tiny, PrefixStore(HostTier(8 * block), DiskTier(tmp_path, 64 * (block + 112), fp)))
    with caplog.at_level(logging.WARNING, logger="vkgraph.kv_tiers"):
        assert _run(eng, a) == cold  # recomputed from the first block
    assert eng.kv.hit_tokens_by_tier["disk"] == 0 and eng.kv.store.disk.dropped >= 1 and "digest" in caplog.text


def test_a_store_needs_prefix_caching():
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(8, 16, prefix_caching=False, store=PrefixStore(HostTier(10)))


def test_offload_moves_the_gpu_prefix_cache_into_the_store(tiny):
    a = list(range(5, 5 + PROMPT_LEN))
    store = PrefixStore(HostTier(1 << 20))
    eng = _engine(tiny, store)
    _run(eng, a)
    want = _run(eng, a)  # a GPU hit
    eng.offload_prefix_cache()
    assert len(store.host) == 4 and eng.kv.pool.cached == {} and eng.kv.num_free_blocks == eng.kv.num_blocks
    assert _run(eng, a) == want and eng.kv.hit_tokens_by_tier["host"] == 64
    eng.kv.check_invariants()

"""The paged KV cache manager: allocation, slots, prefix caching, eviction order, errors and invariants."""

from __future__ import annotations

import random

import numpy as np
import pytest

from vkgraph.nn.kv_cache import KVCacheManager, OutOfKVBlocks, hash_block

BS = 4


def run(m: KVCacheManager, sid, prompt) -> int:
    """Add a sequence and mark its prompt computed, as an engine would after prefill."""
    cached = m.add_sequence(sid, prompt)
    m.mark_computed(sid)
    return cached


def test_prefill_and_decode_slots():
    m = KVCacheManager(8, BS)
    assert m.add_sequence("a", list(range(10))) == 0
    blocks = m.block_table("a")
    assert len(blocks) == 3 and m.num_free_blocks == 5
    want = [blocks[i // BS] * BS + i % BS for i in range(10)]
    np.testing.assert_array_equal(m.slot_mapping("a"), want)
    assert m.slot_mapping("a").dtype == np.int32
    m.mark_computed("a")
    assert m.slot_mapping("a").size == 0
    m.append_tokens("a", [10, 11])  # fills block 3 (slots 10, 11)
    assert len(m.block_table("a")) == 3
    np.testing.assert_array_equal(m.slot_mapping("a"), [blocks[2] * BS + 2, blocks[2] * BS + 3])
    m.mark_computed("a")
    m.append_tokens("a", [12])  # a new block for position 12
    assert len(m.block_table("a")) == 4 and m.context_len("a") == 13
    np.testing.assert_array_equal(m.slot_mapping("a"), [m.block_table("a")[3] * BS])
    m.free_sequence("a")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_prefix_hit_shares_full_blocks_and_skips_their_tokens():
    m = KVCacheManager(16, BS)
    prompt = list(range(100, 111))  # 2 full blocks + 3 tokens
    assert run(m, "a", prompt) == 0
    assert m.add_sequence("b", prompt[:8] + [7, 7, 7, 7, 7]) == 8
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    assert m.block_table("b")[2] not in m.block_table("a")
    assert m.pool.ref_count[m.block_table("a")[0]] == 2
    np.testing.assert_array_equal(m.slot_mapping("b"), m.slot_mapping("b", 8, 13))  # only the tail is pending
    assert m.hit_tokens == 8 and m.queried_tokens == 11 + 13
    m.check_invariants()


def test_full_prompt_hit_still_computes_the_last_token():
    m = KVCacheManager(16, BS)
    run(m, "a", list(range(8)))
    # all 8 tokens are cached, but the last one must run for logits, so only the first block counts
    assert m.add_sequence("b", list(range(8))) == 4
    assert m.block_table("b")[0] == m.block_table("a")[0]
    assert m.block_table("b")[1] != m.block_table("a")[1]
    m.check_invariants()


def test_uncomputed_blocks_are_not_hit():
    m = KVCacheManager(16, BS)
    m.add_sequence("a", list(range(9)))  # KV not written yet
    assert m.add_sequence("b", list(range(9))) == 0
    m.mark_computed("a", 4)  # first block written
    assert m.add_sequence("c", list(range(9))) == 4
    m.check_invariants()


def test_hash_is_chained_over_the_whole_prefix():
    m = KVCacheManager(16, BS)
    run(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert m.add_sequence("b", [0, 0, 0, 0, 5, 6, 7, 8, 9]) == 0  # same second block after another first
    assert hash_block(None, [5, 6, 7, 8]) != hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_freed_blocks_keep_their_hash_until_evicted_lru():
    m = KVCacheManager(6, BS)
    run(m, "a", list(range(13)))  # 4 blocks: 3 full (hashed) + 1 partial
    a_blocks = m.block_table("a")
    m.free_sequence("a")
    assert m.num_free_blocks == 6
    # eviction order: unhashed blocks first (a's partial block, then the never-used ones), then a's hashed
    # blocks tail first
    assert a_blocks == [0, 1, 2, 3]
    assert list(m.pool.free) == [3, 4, 5, 2, 1, 0]
    assert run(m, "b", list(range(13))) == 12  # everything but the last token's block
    m.free_sequence("b")
    assert list(m.pool.free) == [3, 4, 5, 2, 1, 0]
    run(m, "c", [50] * 17)  # needs 5 fresh blocks: evicts the 3 unhashed, then a's two tail-most hashed ones
    assert m.block_table("c") == [3, 4, 5, 2, 1]
    h0 = hash_block(None, range(4))
    assert m.pool.lookup(h0) == 0 and m.pool.lookup(hash_block(h0, range(4, 8))) is None
    m.free_sequence("c")
    assert m.add_sequence("d", list(range(9))) == 4  # the head of a's prefix survived
    m.check_invariants()


def test_out_of_blocks_raises_and_changes_nothing():
    m = KVCacheManager(4, BS)
    run(m, "a", list(range(12)))
    free, tables = m.num_free_blocks, m.block_table("a")
    with pytest.raises(OutOfKVBlocks, match="need 2, 1 free"):
        m.add_sequence("b", list(range(100, 108)))
    assert "b" not in m.seqs and m.num_free_blocks == free and m.block_table("a") == tables
    m.append_tokens("a", [1] * 4)  # uses the last block
    with pytest.raises(OutOfKVBlocks):
        m.append_tokens("a", [1])
    assert m.context_len("a") == 16
    m.check_invariants()
    m.free_sequence("a")  # preempt, then the other request fits
    assert m.add_sequence("b", list(range(100, 108))) == 0


def test_hits_on_free_cached_blocks_count_against_free_space():
    m = KVCacheManager(3, BS)
    run(m, "a", list(range(9)))  # blocks: 2 hashed + 1 partial
    m.free_sequence("a")
    # hitting 2 free cached blocks leaves 1 free block: a 3-block prompt with 2 hits fits exactly
    assert m.add_sequence("b", list(range(9))) == 8
    m.free_sequence("b")
    with pytest.raises(OutOfKVBlocks):
        m.add_sequence("c", list(range(13)))  # 3 hits + 1 fresh needs 4 blocks in all
    m.check_invariants()


def test_truncate_drops_rejected_draft_tokens():
    m = KVCacheManager(8, BS)
    run(m, "a", list(range(6)))
    m.append_tokens("a", [1, 2, 3, 4, 5])  # draft tokens crossing into a third block
    assert len(m.block_table("a")) == 3
    m.truncate("a", 7)  # accept one
    assert m.context_len("a") == 7 and len(m.block_table("a")) == 2 and m.num_free_blocks == 6
    with pytest.raises(ValueError):
        m.truncate("a", 5)  # computed tokens are final
    m.mark_computed("a")
    m.free_sequence("a")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_set_token_replaces_a_placeholder_in_place():
    m = KVCacheManager(8, BS)
    run(m, "a", list(range(BS - 1)))
    m.append_tokens("a", [-1])  # a slot for a token still being sampled: it fills the first block
    table = m.block_table("a")
    with pytest.raises(ValueError):
        m.set_token("a", 0, 5)  # computed tokens are final
    m.set_token("a", BS - 1, 99)
    assert m.block_table("a") == table and m.context_len("a") == BS
    m.mark_computed("a")
    m.free_sequence("a")
    # the block is cached under the real token, not the placeholder
    assert m.add_sequence("b", list(range(BS - 1)) + [99, 7]) == BS
    m.check_invariants()


def test_batch_metadata_is_padded():
    m = KVCacheManager(16, BS)
    run(m, "a", list(range(6)))
    m.append_tokens("a", [42])
    m.add_sequence("b", [9, 8, 7])
    meta = m.batch(["a", "b"], width=4, pad_seqs=3, pad_tokens=6)
    np.testing.assert_array_equal(meta.input_ids, [42, 9, 8, 7, 0, 0])
    np.testing.assert_array_equal(meta.positions, [6, 0, 1, 2, 0, 0])
    np.testing.assert_array_equal(meta.slot_mapping[:4], np.concatenate([m.slot_mapping("a"),
                                                                          m.slot_mapping("b")]))
    np.testing.assert_array_equal(meta.slot_mapping[4:], [-1, -1])
    np.testing.assert_array_equal(meta.query_start_loc, [0, 1, 4, 4])
    np.testing.assert_array_equal(meta.context_lens, [7, 3, 0])
    assert meta.block_tables.shape == (3, 4) and meta.block_tables.dtype == np.int32
    assert list(meta.block_tables[0, :2]) == m.block_table("a") and meta.block_tables[0, 2:].tolist() == [0, 0]
    assert meta.num_tokens == 4
    with pytest.raises(ValueError, match="width"):
        m.batch(["a"], width=1)


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_reads_back_its_own_tokens_and_frees_everything(seed):
    """Simulate the device cache: write each pending token into its slot, then read every sequence back through
    its block table. Shared prefix blocks must hold exactly the tokens of each sequence that uses them."""
    rng = random.Random(seed)
    m = KVCacheManager(24, BS)
    store = np.full(m.num_blocks * BS, -1)
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    live: list[int] = []
    next_id = 0
    for _ in range(300):
        op = rng.random()
        try:
            if op < 0.3 or not live:
                prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
                m.add_sequence(next_id, prompt)
                live.append(next_id)
                next_id += 1
            elif op < 0.8:
                sid = rng.choice(live)
                m.append_tokens(sid, [rng.randrange(5) for _ in range(rng.choice([1, 1, 3]))])
            else:
                sid = live.pop(rng.randrange(len(live)))
                m.free_sequence(sid)
        except OutOfKVBlocks:
            m.free_sequence(live.pop(0))  # preempt the oldest
        for sid in live:  # "compute" everything pending, then read back
            store[m.slot_mapping(sid)] = m.seqs[sid].tokens[m.num_computed(sid):]
            m.mark_computed(sid)
            n = m.context_len(sid)
            slots = m.slot_mapping(sid, 0, n)
            assert store[slots].tolist() == m.seqs[sid].tokens
        m.check_invariants()
    assert m.hit_tokens > 0
    for sid in live:
        m.free_sequence(sid)
    assert m.num_free_blocks == m.num_blocks
    assert all(r == 0 for r in m.pool.ref_count)
    m.check_invariants()

"""Paged attention templates (KV write, decode with and without split-K, reduce, prefill) against numpy."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_templates_common import TOL, check, device, normalised_error, snapshot, upload

from vkgraph.templates import paged_attention as pa
from vkgraph.templates.common import arrival_counters

HEADS = [64, 80, 96, 128, 256]
NP_KV = {"f16": np.float16, "f32": np.float32}


def _softmax_attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, softcap: float = 0.0) -> np.ndarray:
    """q [H, D] against k, v [T, H, D] (already expanded to the query heads), float64; scores soft-capped
    (softcap * tanh(score / softcap)) where softcap > 0."""
    if k.shape[0] == 0:
        return np.zeros_like(q)
    s = np.einsum("hd,thd->ht", q, k) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return np.einsum("ht,thd->hd", p / p.sum(axis=1, keepdims=True), v)


def _random_cache(rng, num_blocks, hkv, bs, d, dtype):
    shape = (num_blocks, hkv, bs, d)
    return (rng.standard_normal(shape).astype(NP_KV[dtype]), rng.standard_normal(shape).astype(NP_KV[dtype]))


def _block_tables(rng, lens, bs, num_blocks, shared_prefix):
    """Distinct shuffled blocks per sequence; with shared_prefix every sequence's first block is block 0."""
    max_blocks = max(-(-max(lens) // bs), 1)
    perm = rng.permutation(np.arange(1 if shared_prefix else 0, num_blocks))
    tables = np.zeros((len(lens), max_blocks), np.int32)
    used = 0
    for b, n in enumerate(lens):
        nb = -(-n // bs)
        start = 1 if shared_prefix else 0
        if shared_prefix:
            tables[b, 0] = 0
        tables[b, start:nb] = perm[used:used + nb - start]
        used += max(nb - start, 0)
    return tables


def _with_capacity(tables, bs, max_context_len):
    """Block tables with room in their rows for a dispatch sized past the contexts (as a captured step is, for its
    capacity): the extra entries point at block 0, never attended."""
    extra = -(-max_context_len // bs) - tables.shape[1]
    return np.pad(tables, ((0, 0), (0, extra))) if extra > 0 else tables


def _decode_case(rng, lens, hkv, group, d, bs, dtype, window, part_tokens, shared_prefix=False, softcap=0.0,
                 form=None, max_context_len=None):
    dev = device()
    need = sum(-(-n // bs) for n in lens) + 1
    kc, vc = _random_cache(rng, need, hkv, bs, d, dtype)
    tables = _block_tables(rng, lens, bs, need, shared_prefix)
    max_context_len = max_context_len or max(lens)
    tables = _with_capacity(tables, bs, max_context_len)
    q = rng.standard_normal((len(lens), hkv * group, d)).astype(np.float32)
    cache = pa.PagedKVCache.create(dev, need, hkv, d, bs, dtype)
    dev.upload(cache.key, kc)
    dev.upload(cache.value, vc)
    since = snapshot()
    lens_buf = upload(dev, np.array(lens, np.int32))
    out = pa.paged_decode(dev, cache, upload(dev, q), upload(dev, tables), lens_buf,
                          num_seqs=len(lens), num_heads=hkv * group, max_blocks_per_seq=tables.shape[1],
                          max_context_len=max_context_len, window=window, part_tokens=part_tokens,
                          softcap=softcap, form=form)
    got = dev.download(out, np.float32, q.shape)
    # a split's last workgroup of each (sequence, KV head) sets its arrival counter back to zero for the next dispatch
    pairs = len(lens) * hkv
    assert not dev.download(arrival_counters(dev, pairs), np.uint32, pairs).any()
    ref = np.zeros(q.shape)
    for b, n in enumerate(lens):
        pos = np.arange(max(0, n - window) if window else 0, n)
        blk, off = tables[b, pos // bs], pos % bs
        k = np.repeat(kc[blk, :, off].astype(np.float64), group, axis=1)  # [T, Hq, D]
        v = np.repeat(vc[blk, :, off].astype(np.float64), group, axis=1)
        ref[b] = _softmax_attend(q[b].astype(np.float64), k, v, 1 / math.sqrt(d), softcap)
    check(got, ref, since)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), d=st.sampled_from(HEADS), dtype=st.sampled_from(["f16", "f32"]),
       hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]), bs=st.sampled_from([16, 8, 32]),
       seed=st.integers(0, 2**31))
def test_paged_decode_fuzz(data, d, dtype, hkv, group, bs, seed):
    lens = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=4))
    window = data.draw(st.sampled_from([0, 0, 1, 40]))
    part = data.draw(st.sampled_from([None, 0, 32, 64]))
    # the dispatch sized for the lengths, or for more (as a captured step is, for its capacity)
    capacity = max(lens) + data.draw(st.sampled_from([0, 0, 100, 1000]))
    _decode_case(np.random.default_rng(seed), lens, hkv, group, d, bs, dtype, window, part,
                 shared_prefix=data.draw(st.booleans()), softcap=data.draw(st.sampled_from([0.0, 0.0, 1.5])),
                 form=data.draw(st.sampled_from(FORMS)), max_context_len=capacity)


# the kernel's walks of the context (DecodeForm): tiles through shared memory, and keys and values streamed into
# registers; STREAM_FORMS: a workgroup of 64 with an odd unroll, and groups of 4 invocations a token (several to a
# subgroup, a token's words several to an invocation)
FORMS = [pa.DecodeForm(), pa.DecodeForm("stream")]
STREAM_FORMS = [pa.DecodeForm("stream", 64, 3), pa.DecodeForm("stream", 256, 2, lanes=4)]


@pytest.mark.parametrize("form", STREAM_FORMS)
def test_paged_decode_stream(form):
    """The "stream" form where the device suits it (lavapipe does), over GQA up to 8 rows a KV head, float16 and
    float32 caches, a head whose words do not fill a power of two, a window, a soft cap, split and unsplit, and the
    new tokens written."""
    dev = device()
    assert pa._stream_defines(dev, form, 4, 64, "f16")
    rng = np.random.default_rng(form.wg + form.lanes)
    _decode_case(rng, [150, 7, 90], 2, 4, 64, 16, "f16", 0, 0, form=form)
    _decode_case(rng, [300, 1, 33], 1, 2, 96, 8, "f16", 40, None, softcap=1.5, form=form)
    _decode_case(rng, [200, 129], 1, 8, 64, 32, "f32", 0, 32, form=form)
    _new_token_case(rng, [70, 1, 33, 0, 0, 200], 2, 4, 64, 16, "f16", 0, 32, rope=True, stale=(1,), moved=(4,),
                    form=form)


# "tiles" forms that name their tile and workgroup: a tile of two subgroups' rows and wider workgroups, a tile
# smaller than a subgroup in a workgroup of 64, a tile of no power of two; the rows interleaved in the lanes
# (row_lanes) on the default tile and on the small one
TILE_FORMS = [pa.DecodeForm("tiles", 256, tile=64), pa.DecodeForm("tiles", 64, tile=8),
              pa.DecodeForm("tiles", 128, tile=12), pa.DecodeForm("tiles", row_lanes=True),
              pa.DecodeForm("tiles", 64, tile=8, row_lanes=True)]


@pytest.mark.parametrize("form", TILE_FORMS)
def test_paged_decode_tile_forms(form):
    rng = np.random.default_rng(form.tile + form.row_lanes)
    _decode_case(rng, [150, 7, 90], 2, 4, 64, 16, "f16", 0, 0, form=form)
    _decode_case(rng, [300, 1, 33], 1, 2, 96, 8, "f16", 40, None, softcap=1.5, form=form)
    if pa._shared_bytes(8, form.tile, 64, "f32") <= device().info.max_shared_memory:   # lavapipe: 32 KiB
        _decode_case(rng, [200, 129], 1, 8, 64, 32, "f32", 0, 2 * form.tile, form=form)
    _new_token_case(rng, [70, 1, 33, 0, 0, 200], 2, 4, 64, 16, "f16", 0, None, rope=True, stale=(1,), moved=(4,),
                    form=form)


def test_decode_forms_parsed_and_refused():
    assert pa.DecodeForm.parse("tiles") == pa.DecodeForm()
    assert pa.DecodeForm.parse("tiles:64x256") == pa.DecodeForm("tiles", 256, tile=64)
    assert pa.DecodeForm.parse("tiles:16") == pa.DecodeForm("tiles", pa.ATTN_WG, tile=16)
    assert pa.DecodeForm.parse("stream:256x8") == pa.DecodeForm("stream", 256, 8)
    assert pa.DecodeForm.parse("tiles/rows") == pa.DecodeForm(row_lanes=True)
    assert pa.DecodeForm.parse("tiles:16x64/rows") == pa.DecodeForm("tiles", 64, tile=16, row_lanes=True)
    for text in ("tiles:a", "tiles:8x64x2", "cols", "stream:1x2x3x4"):
        with pytest.raises(ValueError, match="decode form"):
            pa.DecodeForm.parse(text)
    dev = device()
    cache = pa.PagedKVCache.create(dev, 2, 1, 64, 16, "f16")
    q, tables, lens = (upload(dev, a) for a in (np.zeros((1, 1, 64), np.float32), np.zeros((1, 2), np.int32),
                                                  np.ones(1, np.int32)))
    for form in (pa.DecodeForm("tiles", 128, tile=6), pa.DecodeForm("tiles", 96, tile=8),
                 pa.DecodeForm("tiles", 128, tile=4096), pa.DecodeForm("tiles", 96), pa.DecodeForm("tiles", 4)):
        with pytest.raises(ValueError, match="decode form tiles"):
            pa.paged_decode(dev, cache, q, tables, lens, num_seqs=1, num_heads=1, max_blocks_per_seq=2,
                            max_context_len=1, form=form)


@pytest.mark.parametrize("part", [None, 0, 32])
def test_paged_decode_softcap_and_window(part):
    """Gemma 2's attention: soft-capped scores (a cap that bends them) over a sliding window, split or not."""
    _decode_case(np.random.default_rng(3), [150, 7, 90], 2, 2, 64, 16, "f16", 40, part, softcap=1.5)


@pytest.mark.parametrize("form", FORMS)
def test_paged_decode_contexts_shorter_than_the_split(form):
    """A split sized for 200 tokens over contexts that fill one, two (which partition 0 then walks alone) or more of
    its partitions of 32, and none, in one dispatch, twice (the arrival counters back at zero in between)."""
    for seed in (5, 6):
        _decode_case(np.random.default_rng(seed), [200, 32, 33, 64, 65, 97, 1, 0], 2, 2, 64, 16, "f16", 0, 32,
                     form=form)


@pytest.mark.parametrize("part", [None, 0, 32])
@pytest.mark.parametrize("form", FORMS)
def test_paged_decode_long_context(part, form):
    """A context beyond 4096 tokens beside a one-token one; split-K chosen automatically, turned off, or into more
    partitions (130) than the workgroup that combines them has invocations."""
    _decode_case(np.random.default_rng(7), [4133, 1], 1, 4, 64, 16, "f16", 0, part, form=form)


@pytest.mark.parametrize("part,d,group", [(0, 64, 4), (64, 128, 2), (None, 96, 1)])
@pytest.mark.parametrize("form", FORMS + [pa.DecodeForm(row_lanes=True)])
def test_paged_decode_int8_output(part, d, group, form):
    """int8=True writes what quantize_q8 makes of the float output (paged_decode's workgroup, or split the last of
    its partitions to finish, quantizes it): the same int8 values, scales and sums."""
    from vkgraph.templates import matvec as mv

    dev = device()
    rng = np.random.default_rng(d)
    lens, hkv, bs = [150, 7, 300], 2, 16
    need = sum(-(-n // bs) for n in lens) + 1
    kc, vc = _random_cache(rng, need, hkv, bs, d, "f16")
    tables = _block_tables(rng, lens, bs, need, False)
    q = rng.standard_normal((len(lens), hkv * group, d)).astype(np.float32)
    cache = pa.PagedKVCache.create(dev, need, hkv, d, bs, "f16")
    dev.upload(cache.key, kc)
    dev.upload(cache.value, vc)
    args = (dev, cache, upload(dev, q), upload(dev, tables), upload(dev, np.array(lens, np.int32)))
    kw = dict(num_seqs=len(lens), num_heads=hkv * group, max_blocks_per_seq=tables.shape[1],
              max_context_len=max(lens), part_tokens=part, form=form)
    rows, k = len(lens), hkv * group * d
    want = mv.quantize_activations(dev, pa.paged_decode(*args, **kw), rows, k)
    got = mv.Q8Acts.in_buffer(pa.paged_decode(*args, **kw, int8=True), rows, k)
    for w, g, dtype, n in zip(want, (got.xq, got.xd, got.xs), (np.int8, np.float32, np.int32),
                              (rows * k, rows * k // 32, rows * k // 16)):
        np.testing.assert_array_equal(dev.download(g, dtype, n), dev.download(w, dtype, n))


def test_paged_decode_int8_needs_blocks_of_32():
    dev = device()
    cache = pa.PagedKVCache.create(dev, 2, 1, 80, 16, "f16")
    zeros = upload(dev, np.zeros(80, np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        pa.paged_decode(dev, cache, zeros, upload(dev, np.zeros(1, np.int32)), upload(dev, np.ones(1, np.int32)),
                        num_seqs=1, num_heads=1, max_blocks_per_seq=1, max_context_len=1, int8=True)


def test_paged_decode_auto_split_is_used():
    dev = device()
    assert pa.choose_split(dev, 1, 8, 4096, 32) == (32, 16)  # at most 16 partitions (the finish's one round)
    assert pa.choose_split(dev, 1, 8, 32, 32) == (0, 1)  # a context of one tile
    assert pa.choose_split(dev, 1, 8, 128, 32) == (32, 4)
    assert pa.choose_split(dev, 1, 8, 100, 64) == (64, 2)  # the least partition a whole tile of the form
    assert pa.choose_split(dev, 64, 8, 4096, 32) == (0, 1)  # enough (sequence, KV head) pairs
    assert pa.choose_split(dev, 32, 8, 2048, 32) == (0, 1)
    # partitions toward SPLIT_TARGET workgroups: two for 128 or 192 pairs, four for 64
    assert pa.choose_split(dev, 16, 8, 2048, 32) == pa.choose_split(dev, 24, 8, 2048, 32) == (32, 2)
    assert pa.choose_split(dev, 8, 8, 2048, 32) == (32, 4)


def test_paged_decode_sizes_each_split_by_its_own_context():
    """A dispatch sized for 2048 tokens (as a captured decode step is, for its capacity) over contexts of 1000, 300,
    100, 40 and 0 tokens, each split by its own length (the kernel's part_len), with the split chosen and given."""
    for part in (None, 32):
        _decode_case(np.random.default_rng(9), [1000, 300, 100, 40, 0], 2, 2, 64, 16, "f16", 0, part,
                     max_context_len=2048)


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(lens=st.lists(st.integers(1, 5000), min_size=1, max_size=3), d=st.sampled_from(HEADS),
       seed=st.integers(0, 2**31))
def test_paged_decode_fuzz_long(lens, d, seed):
    _decode_case(np.random.default_rng(seed), lens, 2, 4, d, 16, "f16", 0, None)


@settings(max_examples=15, deadline=None)
@given(num_tokens=st.integers(1, 40), hkv=st.integers(1, 3), d=st.sampled_from(HEADS),
       dtype=st.sampled_from(["f16", "f32"]), bs=st.sampled_from([16, 4]), seed=st.integers(0, 2**31))
def test_kv_write(num_tokens, hkv, d, dtype, bs, seed):
    dev = device()
    rng = np.random.default_rng(seed)
    num_blocks = -(-num_tokens // bs) + 2
    cache = pa.PagedKVCache.create(dev, num_blocks, hkv, d, bs, dtype)
    init_k, init_v = _random_cache(rng, num_blocks, hkv, bs, d, dtype)
    dev.upload(cache.key, init_k)
    dev.upload(cache.value, init_v)
    slots = rng.permutation(num_blocks * bs)[:num_tokens].astype(np.int32)
    slots[rng.random(num_tokens) < 0.2] = -1  # padding tokens are skipped
    key = rng.standard_normal((num_tokens, hkv, d)).astype(np.float32)
    value = rng.standard_normal((num_tokens, hkv, d)).astype(np.float32)
    since = snapshot()
    pa.write_kv(dev, cache, upload(dev, key), upload(dev, value), upload(dev, slots), num_tokens)
    ref_k, ref_v = init_k.copy(), init_v.copy()
    ok = slots >= 0
    ref_k[slots[ok] // bs, :, slots[ok] % bs] = key[ok]
    ref_v[slots[ok] // bs, :, slots[ok] % bs] = value[ok]
    got_k = dev.download(cache.key, NP_KV[dtype], ref_k.shape)
    got_v = dev.download(cache.value, NP_KV[dtype], ref_v.shape)
    # float16 conversion: the round-to-nearest result, allowing one unit in the last place
    tol = 1e-3 if dtype == "f16" else 0
    check(np.concatenate([got_k, got_v]), np.concatenate([ref_k, ref_v]), since, tol=tol)


def _prefill_case(rng, lens, hkv, group, d, dtype, window, softcap=0.0):
    dev = device()
    t = sum(lens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = rng.standard_normal((t, hkv * group, d)).astype(np.float32)
    k = rng.standard_normal((t, hkv, d)).astype(NP_KV[dtype])
    v = rng.standard_normal((t, hkv, d)).astype(NP_KV[dtype])
    since = snapshot()
    out = pa.prefill_attention(dev, upload(dev, q), upload(dev, k), upload(dev, v), upload(dev, cu),
                               num_seqs=len(lens), num_tokens=t, num_heads=hkv * group, num_kv_heads=hkv,
                               head_size=d, max_seq_len=max(lens), kv_dtype=dtype, window=window, softcap=softcap)
    got = dev.download(out, np.float32, q.shape)
    ref = np.zeros(q.shape)
    for b in range(len(lens)):
        for i in range(lens[b]):
            lo = max(0, i - window + 1) if window else 0
            kk = np.repeat(k[cu[b] + lo:cu[b] + i + 1].astype(np.float64), group, axis=1)
            vv = np.repeat(v[cu[b] + lo:cu[b] + i + 1].astype(np.float64), group, axis=1)
            ref[cu[b] + i] = _softmax_attend(q[cu[b] + i].astype(np.float64), kk, vv, 1 / math.sqrt(d), softcap)
    check(got, ref, since)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=3), hkv=st.integers(1, 2),
       group=st.sampled_from([1, 4]), d=st.sampled_from(HEADS), dtype=st.sampled_from(["f16", "f32"]),
       window=st.sampled_from([0, 0, 5]), softcap=st.sampled_from([0.0, 0.0, 1.5]), seed=st.integers(0, 2**31))
def test_prefill_fuzz(lens, hkv, group, d, dtype, window, softcap, seed):
    _prefill_case(np.random.default_rng(seed), lens, hkv, group, d, dtype, window, softcap)


def test_attention_bad_input():
    dev = device()
    with pytest.raises(ValueError, match="head_size"):
        pa.PagedKVCache.create(dev, 4, 1, 60)
    with pytest.raises(ValueError, match="KV dtype"):
        pa.PagedKVCache.create(dev, 4, 1, 64, dtype="bf16")
    cache = pa.PagedKVCache.create(dev, 4, 2, 64)
    q = upload(dev, np.zeros((1, 4, 64), np.float32))
    ints = upload(dev, np.zeros(8, np.int32))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        pa.paged_decode(dev, cache, q, ints, ints, num_seqs=1, num_heads=3, max_blocks_per_seq=1,
                        max_context_len=1)
    with pytest.raises(ValueError, match="exceeds"):
        pa.paged_decode(dev, cache, q, ints, ints, num_seqs=1, num_heads=4, max_blocks_per_seq=1,
                        max_context_len=17)
    with pytest.raises(ValueError, match="smaller than"):
        pa.paged_decode(dev, cache, q, ints, ints, num_seqs=2, num_heads=4, max_blocks_per_seq=1,
                        max_context_len=16)
    with pytest.raises(ValueError, match="part_tokens"):
        pa.paged_decode(dev, cache, q, ints, ints, num_seqs=1, num_heads=4, max_blocks_per_seq=1,
                        max_context_len=16, part_tokens=10)
    with pytest.raises(ValueError, match="softcap"):
        pa.paged_decode(dev, cache, q, ints, ints, num_seqs=1, num_heads=4, max_blocks_per_seq=1,
                        max_context_len=16, softcap=-1.0)
    # the new tokens' q/k/v rows: 4 query heads and 2 KV heads of 64 are 512 floats a row
    rows = upload(dev, np.zeros(512, np.float32))
    for new, seqs, match in [(pa.NewTokens(ints, 512, 0, 256, 385), 1, "values at 385"),
                             (pa.NewTokens(ints, 512, 0, 256, 384, rope=(ints, ints)), 1, "cos"),
                             (pa.NewTokens(ints, 512, 0, 256, 384), 2, "smaller than")]:
        with pytest.raises(ValueError, match=match):
            pa.paged_decode(dev, cache, rows, ints, ints, num_seqs=seqs, num_heads=4, max_blocks_per_seq=1,
                            max_context_len=16, new_tokens=new)
    wide = pa.PagedKVCache.create(dev, 1, 1, 1024, 16, "f32")  # 256 words a token, one invocation each
    rows = upload(dev, np.zeros(3 * 1024, np.float32))
    with pytest.raises(ValueError, match="more words"):
        pa.paged_decode(dev, wide, rows, ints, ints, num_seqs=1, num_heads=1, max_blocks_per_seq=1,
                        max_context_len=16, new_tokens=pa.NewTokens(ints, 3 * 1024, 0, 1024, 2048))


@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_kv_write_rows_with_rope(dtype):
    """Keys and values read from the rows of one fused q/k/v product (stride and offsets), keys rotated on the
    way in (rotate-half RoPE) and the queries rotated into their own buffer by the same dispatch, against
    numpy; offsets past the row are refused."""
    dev = device()
    rng = np.random.default_rng(5)
    tokens, hkv, d, bs, q_width = 5, 2, 64, 4, 3 * 64
    row = q_width + 2 * hkv * d
    num_blocks = 4
    cache = pa.PagedKVCache.create(dev, num_blocks, hkv, d, bs, dtype)
    init_k, init_v = _random_cache(rng, num_blocks, hkv, bs, d, dtype)
    dev.upload(cache.key, init_k)
    dev.upload(cache.value, init_v)
    slots = rng.permutation(num_blocks * bs)[:tokens].astype(np.int32)
    slots[2] = -1
    rows = rng.standard_normal((tokens, row)).astype(np.float32)
    ang = rng.random((tokens, d // 2)) * 6
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    since = snapshot()
    rbuf = upload(dev, rows)
    q_out = dev.alloc(tokens * q_width * 4)
    pa.write_kv(dev, cache, rbuf, rbuf, upload(dev, slots), tokens, src_stride=row, k_off=q_width,
                v_off=q_width + hkv * d, rope=(upload(dev, cos), upload(dev, sin)), q_out=q_out, q_heads=3)
    c, s = cos[:, None, :], sin[:, None, :]

    def rotate(x):
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    k = rotate(rows[:, q_width:q_width + hkv * d].reshape(tokens, hkv, d).astype(np.float64))
    v = rows[:, q_width + hkv * d:].reshape(tokens, hkv, d)
    q = rotate(rows[:, :q_width].reshape(tokens, 3, d).astype(np.float64))
    ref_k, ref_v = init_k.astype(np.float64), init_v.astype(np.float64)
    ok = slots >= 0
    ref_k[slots[ok] // bs, :, slots[ok] % bs] = k[ok]
    ref_v[slots[ok] // bs, :, slots[ok] % bs] = v[ok]
    got_k = dev.download(cache.key, NP_KV[dtype], ref_k.shape)
    got_v = dev.download(cache.value, NP_KV[dtype], ref_v.shape)
    check(np.concatenate([got_k, got_v]), np.concatenate([ref_k, ref_v]), since,
          tol=1e-3 if dtype == "f16" else 1e-6)
    check(dev.download(q_out, np.float32, q.shape), q, since, tol=1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        pa.write_kv(dev, cache, rbuf, rbuf, upload(dev, slots), tokens, src_stride=row, k_off=q_width,
                    v_off=q_width + hkv * d + 1)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x [B, heads, D] with cos/sin [B, D/2], in x's precision as kv_write computes it."""
    h = x.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)


def _new_token_case(rng, lens, hkv, group, d, bs, dtype, window, part, rope, int8=False, stale=(), moved=(),
                    form=None, max_context_len=None):
    """paged_decode writing each sequence's new token itself (NewTokens) against write_kv then paged_decode (the
    two-kernel route), on two copies of one cache, and against numpy. lens: context lengths with the new token;
    0 is a padding row (slot -1, nothing attended), and rows in `stale` also get slot -1 but attend their context
    as the cache holds it. Rows in `moved` write their new token into a spare block instead of the slot their
    table gives position ctx - 1: the attention still takes that position from the new token, never from the cache
    (there the two-kernel route differs); a padding row in `moved` writes its token and attends nothing. The q/k/v
    rows sit between padding columns (offsets and strides)."""
    dev = device()
    b, heads = len(lens), hkv * group
    need = sum(-(-n // bs) for n in lens) + 1
    kc, vc = _random_cache(rng, need, hkv, bs, d, dtype)
    tables = _block_tables(rng, lens, bs, need, False)
    slots = np.array([tables[i, (n - 1) // bs] * bs + (n - 1) % bs if n and i not in stale else -1
                      for i, n in enumerate(lens)], np.int32)
    spare = sorted(set(range(need)) - {tables[i, j] for i, n in enumerate(lens) for j in range(-(-n // bs))})[0]
    for j, i in enumerate(moved):
        slots[i] = spare * bs + j
    max_context_len = max_context_len or max(lens)
    tables = _with_capacity(tables, bs, max_context_len)
    q_off = int(rng.integers(0, 3)) * 4
    k_off, v_off = q_off + heads * d, q_off + heads * d + hkv * d
    stride = v_off + hkv * d + int(rng.integers(0, 3)) * 4
    rows = rng.standard_normal((b, stride)).astype(np.float32)
    ang = rng.random((b, d // 2)) * 6
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    caches = []
    for _ in range(2):
        cache = pa.PagedKVCache.create(dev, need, hkv, d, bs, dtype)
        dev.upload(cache.key, kc)
        dev.upload(cache.value, vc)
        caches.append(cache)
    rbuf, sbuf, tbuf, lbuf = (upload(dev, a) for a in (rows, slots, tables, np.array(lens, np.int32)))
    tabs = (upload(dev, cos), upload(dev, sin)) if rope else None
    kw = dict(num_seqs=b, num_heads=heads, max_blocks_per_seq=tables.shape[1], max_context_len=max_context_len,
              window=window, part_tokens=part, int8=int8)
    since = snapshot()
    if rope:  # the two-kernel route: write_kv rotates the queries into a buffer of their own
        q2 = dev.alloc(b * heads * d * 4)
        pa.write_kv(dev, caches[0], rbuf, rbuf, sbuf, b, src_stride=stride, k_off=k_off, v_off=v_off, rope=tabs,
                    q_out=q2, q_heads=heads, q_off=q_off)
    else:
        pa.write_kv(dev, caches[0], rbuf, rbuf, sbuf, b, src_stride=stride, k_off=k_off, v_off=v_off)
        q2 = upload(dev, np.ascontiguousarray(rows[:, q_off:k_off]))
    two = pa.paged_decode(dev, caches[0], q2, tbuf, lbuf, **kw, form=form)
    one = pa.paged_decode(dev, caches[1], rbuf, tbuf, lbuf, **kw, form=form,
                          new_tokens=pa.NewTokens(sbuf, stride, q_off, k_off, v_off, rope=tabs))
    assert templates_used(since) >= {"kv_write", "paged_decode"}
    # the cache: every word as the two-kernel route leaves it (float16 rounding allows one unit in the last place)
    got = [dev.download(c, NP_KV[dtype], kc.shape) for c in (caches[1].key, caches[1].value)]
    want = [dev.download(c, NP_KV[dtype], kc.shape) for c in (caches[0].key, caches[0].value)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=1e-3 if dtype == "f16" else 1e-6,
                                   atol=0)
    q = rows[:, q_off:k_off].reshape(b, heads, d).astype(np.float64)
    k_new = rows[:, k_off:v_off].reshape(b, hkv, d).astype(np.float64)
    if rope:
        q, k_new = _rotate(q, cos, sin), _rotate(k_new, cos, sin)
    ref_k, ref_v = kc.copy(), vc.copy()
    ok = slots >= 0
    ref_k[slots[ok] // bs, :, slots[ok] % bs] = k_new[ok]
    ref_v[slots[ok] // bs, :, slots[ok] % bs] = rows[:, v_off:v_off + hkv * d].reshape(b, hkv, d)[ok]
    check(np.concatenate(got), np.concatenate([ref_k, ref_v]), since, tol=1e-3 if dtype == "f16" else 1e-6)
    if int8:  # the int8 rows [B, heads * D] as values (blocks of 32 times their scales)
        from vkgraph.templates import matvec as mv

        def values(buf):
            acts = mv.Q8Acts.in_buffer(buf, b, heads * d)
            xq = dev.download(acts.xq, np.int8, b * heads * d).reshape(-1, 32).astype(np.float64)
            return (xq * dev.download(acts.xd, np.float32, b * heads * d // 32)[:, None]).reshape(b, heads, d)

        got_o, two_o = values(one), values(two)
        tol = 2e-2  # int8 rounding of the output
    else:
        got_o, two_o = (dev.download(o, np.float32, (b, heads, d)) for o in (one, two))
        tol = TOL
        same = [i for i in range(b) if i not in moved]
        assert normalised_error(got_o[same], two_o[same]) <= 1e-6
    ref = np.zeros((b, heads, d))
    for i, n in enumerate(lens):
        pos = np.arange(max(0, n - window) if window else 0, n)
        blk, off = tables[i, pos // bs], pos % bs
        kk = np.repeat(ref_k[blk, :, off].astype(np.float64), group, axis=1)
        vv = np.repeat(ref_v[blk, :, off].astype(np.float64), group, axis=1)
        if slots[i] >= 0 and n:  # the new token, as the cache holds it
            kk[-1] = np.repeat(ref_k[slots[i] // bs, :, slots[i] % bs], group, axis=0)
            vv[-1] = np.repeat(ref_v[slots[i] // bs, :, slots[i] % bs], group, axis=0)
        ref[i] = _softmax_attend(q[i], kk, vv, 1 / math.sqrt(d))
    check(got_o, ref, since, tol=tol)


def templates_used(since) -> set:
    from vkgraph import templates

    return set(templates.DISPATCHES - since)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), d=st.sampled_from([64, 128, 96]), dtype=st.sampled_from(["f16", "f32"]),
       hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]), bs=st.sampled_from([16, 8]),
       seed=st.integers(0, 2**31))
def test_paged_decode_writes_new_tokens(data, d, dtype, hkv, group, bs, seed):
    """Batches of 1-8 sequences of different lengths, padding rows, split-K on and off, GQA, float16 and float32
    caches, sliding windows, with and without RoPE."""
    lens = data.draw(st.lists(st.integers(1, 200), min_size=1, max_size=8))
    lens += [0] * data.draw(st.integers(0, 1))  # a padding row
    stale = {i for i in range(len(lens)) if data.draw(st.integers(0, 5)) == 0}
    moved = [i for i in range(len(lens)) if i not in stale and data.draw(st.integers(0, 4)) == 0]
    window = data.draw(st.sampled_from([0, 0, 1, 40]))
    part = data.draw(st.sampled_from([None, 0, 32, 64]))
    capacity = max(max(lens), 1) + data.draw(st.sampled_from([0, 0, 100, 1000]))  # as in test_paged_decode_fuzz
    _new_token_case(np.random.default_rng(seed), lens, hkv, group, d, bs, dtype, window, part,
                    rope=data.draw(st.booleans()), stale=stale, moved=moved[:bs], max_context_len=capacity)


def test_paged_decode_writes_new_tokens_in_partitions_sized_by_context():
    """New tokens written by the partition that covers them where a sequence's partitions are longer than the
    least (a context of 700 in a dispatch sized for 2048, split automatically: 64-token partitions), beside short
    contexts and a padding row."""
    _new_token_case(np.random.default_rng(12), [700, 40, 130, 0], 2, 2, 64, 16, "f16", 0, None, rope=True,
                    max_context_len=2048)


@pytest.mark.parametrize("part", [0, 32])
@pytest.mark.parametrize("form", FORMS)
def test_paged_decode_writes_new_tokens_int8(part, form):
    """The new tokens written by the attention that writes the output product's int8 rows, split or not; a row of
    no context with a slot (written, attending nothing) beside a padding row, and a row of slot -1 that attends the
    cache as it is."""
    _new_token_case(np.random.default_rng(11), [70, 1, 33, 0, 0], 2, 2, 64, 16, "f16", 0, part, rope=True, int8=True,
                    stale=(1,), moved=(4,), form=form)

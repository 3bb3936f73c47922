"""Causal prefill attention on cooperative matrices (templates.flash_prefill): which devices and head sizes take
it (made-up limits, any device), that its programs compile, and, on a device that has float16 cooperative
matrices, that it matches numpy in float64 over drawn packed prompts, GQA groups, head sizes and windows."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_llama import ReferenceLlama
from test_matmul_coop import compiles, fake_limits, needs_f16
from test_templates_common import normalised_error, upload

import vkgraph.realize as realize_mod
from vkgraph.graph import Op
from vkgraph.nn import template_ops, tiny_model
from vkgraph.nn.engine import Engine
from vkgraph.nn.layers import Attention, RotaryEmbedding, StepInputs
from vkgraph.nn.llama import LlamaModel
from vkgraph.nn.weights import load_weights
from vkgraph.realize import count_kernels
from vkgraph.runtime import get_device
from vkgraph.templates import flash_prefill as fp
from vkgraph.templates import paged_attention as pa
from vkgraph.tensor import Tensor

# Against float64 attention over the keys and values rounded to float16 (as a float16 cache holds them): the
# queries and probabilities carried as two float16 parts each (about 2^-22), scores and sums float32. Leaving out
# either low part errs by about 2^-12 (2.4e-4), well past this bound.
TOL = 2e-5
# Against float64 attention over the float32 keys and values: their rounding to float16 (unit roundoff 2^-11) moves
# the scores by about 4e-4 for unit normal inputs (scale 1/sqrt(D)), each probability by as much relatively; 4e-3
# leaves a margin of about 4x (a model's logits through its layers: measured 1.03e-3 with q and the probabilities
# rounded too)
KV_TOL = 4e-3


def as_cached(x: np.ndarray) -> np.ndarray:
    """x rounded to float16, as a float16 cache holds it (and as the kernel stages keys and values)."""
    return x.astype(np.float16).astype(np.float32)


def test_usable_follows_the_device():
    lim = fake_limits()
    assert fp.usable(lim, 128) and fp.usable(lim, 64)
    assert not fp.usable(lim, 72)  # not whole fragments
    assert not fp.usable(lim, 256)  # more shared memory than 48 KiB
    assert fp.usable(fake_limits(max_shared=65536), 256)
    assert not fp.usable(fake_limits(coop=()), 128)
    assert not fp.usable(fake_limits(min_subgroup=32, max_subgroup=64), 128)
    assert not fp.usable(fake_limits(coop=((16, 8, 16, "float16", "float16", "float32", "float32"),)), 128)


@pytest.mark.parametrize("cache", [None, "f16", "f32"])
def test_program_compiles(cache):
    src = fp.source(128, 4, 32, cache=cache)
    assert "coopMatMulAdd" in src and f"shared uvec4 sm[{fp.shared_bytes(128) // 16}]" in src
    assert ("prefix_lens" in src) == (cache is not None)
    compiles(src)


def _custom_names(t: Tensor) -> set[str]:
    seen, stack, names = set(), [t.node], set()
    while stack:
        n = stack.pop()
        if id(n) not in seen:
            seen.add(id(n))
            names |= {n.arg.name} if n.op is Op.CUSTOM else set()
            stack.extend(n.srcs)
    return names


@pytest.mark.parametrize("d,flash,kv_dtype,takes", [
    (128, "1", None, True), (128, "1", "f32", True), (256, "1", None, False), (128, "0", "f16", False),
    (128, "auto", "f16", True), (128, "", "f16", True), (128, "auto", "f32", False), (128, "auto", None, False),
    (256, "auto", "f16", False)])
def test_prefill_attention_op_takes_it_where_usable(d, flash, kv_dtype, takes, monkeypatch):
    """By default (auto) flash prefill runs where the keys and values go to a float16 cache, whose rounding it
    shares; 1 takes it for any, 0 for none; never where the device cannot run the head size."""
    monkeypatch.setattr(template_ops, "limits", lambda: fake_limits())
    monkeypatch.setenv("VKGRAPH_FLASH_PREFILL", flash)
    q, kv = Tensor(np.zeros((5, 4, d), np.float32)), Tensor(np.zeros((5, 2, d), np.float32))
    out = template_ops.prefill_attention(q, kv, kv, Tensor(np.array([0, 5], np.int32)), num_seqs=1, max_seq_len=5,
                                         kv_dtype=kv_dtype)
    assert _custom_names(out) == {"flash_prefill" if takes else "prefill_attention"}


def test_a_flash_setting_that_means_nothing_is_refused(monkeypatch):
    monkeypatch.setenv("VKGRAPH_FLASH_PREFILL", "yes")
    with pytest.raises(ValueError, match="VKGRAPH_FLASH_PREFILL must be auto, 0 or 1, got 'yes'"):
        template_ops.flash_takes(128, kv_dtype="f16")


def _reference(q, k, v, cu, group, window):
    ref = np.zeros(q.shape)
    d = q.shape[-1]
    for b in range(len(cu) - 1):
        for i in range(cu[b + 1] - cu[b]):
            lo = max(0, i - window + 1) if window else 0
            kk = np.repeat(k[cu[b] + lo:cu[b] + i + 1].astype(np.float64), group, axis=1)  # (keys, heads, D)
            vv = np.repeat(v[cu[b] + lo:cu[b] + i + 1].astype(np.float64), group, axis=1)
            sc = np.einsum("hd,khd->hk", q[cu[b] + i].astype(np.float64), kk) / math.sqrt(d)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            ref[cu[b] + i] = np.einsum("hk,khd->hd", p / p.sum(-1, keepdims=True), vv)
    return ref


def _packed(rng, lens, hkv, group, d):
    """cu_seqlens of prompts of `lens` tokens, and their packed random q [T, hkv * group, D], k and v [T, hkv, D]."""
    t = sum(lens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = rng.standard_normal((t, hkv * group, d)).astype(np.float32)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    return t, cu, q, k, v


def _case(lens, hkv, group, d, window, seed, emulate):
    rng = np.random.default_rng(seed)
    dev, lim = get_device(), realize_mod.limits()
    t, cu, q, k, v = _packed(rng, lens, hkv, group, d)
    out = fp.flash_prefill(dev, lim, upload(dev, q), upload(dev, k), upload(dev, v), upload(dev, cu),
                           num_seqs=len(lens), num_tokens=t, num_heads=hkv * group, num_kv_heads=hkv, head_size=d,
                           max_seq_len=max(lens), window=window, emulate=emulate)
    got = dev.download(out, np.float32, q.shape)
    assert normalised_error(got, _reference(q, as_cached(k), as_cached(v), cu, group, window)) <= TOL


@needs_f16
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 200), min_size=1, max_size=3), hkv=st.integers(1, 2),
       group=st.sampled_from([1, 4]), d=st.sampled_from([64, 128]), window=st.sampled_from([0, 0, 5, 70]),
       seed=st.integers(0, 2**31))
def test_matches_numpy(lens, hkv, group, d, window, seed):
    _case(lens, hkv, group, d, window, seed, emulate=False)


@pytest.mark.slow  # lavapipe takes one to two minutes a case
@pytest.mark.skipif(realize_mod.limits().min_subgroup != realize_mod.limits().max_subgroup,
                    reason="the program needs a fixed subgroup size")
@pytest.mark.parametrize("lens,hkv,group,d,window", [([5], 1, 1, 16, 0), ([20, 3], 1, 2, 16, 0),
                                                     ([70, 33], 1, 4, 16, 0), ([90, 7], 1, 1, 32, 40)])
def test_emulated_program_matches_numpy(lens, hkv, group, d, window, monkeypatch):
    """The program with its matrix operations written as loops, on any device: every step but the cooperative
    matrices themselves (staging, masks, online softmax, the per-row rescaling, the output) against numpy."""
    monkeypatch.setattr(get_device().queue, "timeout_s", 900.0)  # its loops run for minutes on lavapipe
    _case(lens, hkv, group, d, window, 11, emulate=True)


@needs_f16
def test_llama_prefill_shape(monkeypatch):
    """One 512-token prompt at the Llama-3-8B attention shape (32 query heads over 8 KV heads, D = 128), through
    the graph op."""
    monkeypatch.setenv("VKGRAPH_FLASH_PREFILL", "1")
    rng = np.random.default_rng(5)
    q = rng.standard_normal((512, 32, 128)).astype(np.float32)
    k = rng.standard_normal((512, 8, 128)).astype(np.float32)
    v = rng.standard_normal((512, 8, 128)).astype(np.float32)
    cu = np.array([0, 512], np.int32)
    with count_kernels() as c:
        got = template_ops.prefill_attention(Tensor(q), Tensor(k), Tensor(v), Tensor(cu), num_seqs=1,
                                             max_seq_len=512).numpy()
    assert "flash_prefill" in c.names
    assert normalised_error(got, _reference(q, as_cached(k), as_cached(v), cu, 4, 0)) <= TOL
    assert normalised_error(got, _reference(q, k, v, cu, 4, 0)) <= KV_TOL


def _cached_case(prefixes, lens, hkv, group, d, kv_dtype, window, seed, emulate):
    """Prompts that continue cached prefixes: each prefix's keys and values in a paged cache of 16-token blocks
    (shuffled block ids, tables wider than needed), the new tokens' own in k and v, against numpy in float64 over
    the prefix (as the cache holds it) and the new tokens together."""
    rng = np.random.default_rng(seed)
    dev, lim = get_device(), realize_mod.limits()
    bs = 16
    width = max(-(-p // bs) for p in prefixes) + 1
    num_blocks = len(prefixes) * width + 1
    t, cu, q, k, v = _packed(rng, lens, hkv, group, d)
    np_dtype = {"f16": np.float16, "f32": np.float32}[kv_dtype]
    kc = rng.standard_normal((num_blocks, hkv, bs, d)).astype(np_dtype)  # blocks nobody lists hold noise
    vc = rng.standard_normal((num_blocks, hkv, bs, d)).astype(np_dtype)
    ids = rng.permutation(num_blocks).astype(np.int32)
    tables = ids[:len(prefixes) * width].reshape(len(prefixes), width)
    cache = pa.PagedKVCache(num_blocks, hkv, d, bs, kv_dtype, upload(dev, kc), upload(dev, vc))
    out = fp.flash_prefill(dev, lim, upload(dev, q), upload(dev, k), upload(dev, v), upload(dev, cu),
                           num_seqs=len(lens), num_tokens=t, num_heads=hkv * group, num_kv_heads=hkv, head_size=d,
                           max_seq_len=max(lens), window=window, emulate=emulate, cache=cache,
                           block_tables=upload(dev, tables), prefix_lens=upload(dev, np.array(prefixes, np.int32)),
                           max_blocks_per_seq=width)
    got = dev.download(out, np.float32, q.shape)
    ref = np.zeros(q.shape)
    for b, (p, n) in enumerate(zip(prefixes, lens)):
        pos = np.arange(p)
        # (p + n, hkv, D), rounded to float16 as the kernel stages them (a float16 cache's words as they are)
        seq_k = as_cached(np.concatenate([kc[tables[b, pos // bs], :, pos % bs], k[cu[b]:cu[b + 1]]]))
        seq_v = as_cached(np.concatenate([vc[tables[b, pos // bs], :, pos % bs], v[cu[b]:cu[b + 1]]]))
        # the whole sequence through the packed reference: its last n rows are the new tokens' attention
        qq = np.concatenate([np.zeros((p, hkv * group, d), np.float32), q[cu[b]:cu[b + 1]]])
        ref[cu[b]:cu[b + 1]] = _reference(qq, seq_k, seq_v, np.array([0, p + n]), group, window)[p:]
    assert normalised_error(got, ref) <= TOL


# prefix lengths around the 16-token block and the 32-key tile, several blocks, GQA groups 1/2/4, two packed
# sequences with different prefixes, both cache dtypes, a window that starts inside the prefix
CACHED = [([0], [5], 1, 1, "f16", 0), ([1], [20], 1, 2, "f32", 0), ([15, 16], [3, 40], 1, 4, "f16", 0),
          ([17, 50], [33, 7], 2, 2, "f32", 0), ([70], [9], 1, 1, "f16", 40), ([64, 33], [1, 70], 1, 1, "f16", 0)]


@pytest.mark.slow  # lavapipe compiles each emulated program for minutes (then runs a case in a second)
@pytest.mark.skipif(realize_mod.limits().min_subgroup != realize_mod.limits().max_subgroup,
                    reason="the program needs a fixed subgroup size")
@pytest.mark.parametrize("prefixes,lens,hkv,group,kv_dtype,window", CACHED)
def test_emulated_program_with_cached_prefix(prefixes, lens, hkv, group, kv_dtype, window, monkeypatch):
    monkeypatch.setattr(get_device().queue, "timeout_s", 900.0)
    _cached_case(prefixes, lens, hkv, group, 16, kv_dtype, window, 3, emulate=True)


@needs_f16
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 150)), min_size=1, max_size=3),
       hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]), d=st.sampled_from([64, 128]),
       kv_dtype=st.sampled_from(["f16", "f32"]), window=st.sampled_from([0, 0, 5, 70]), seed=st.integers(0, 2**31))
def test_cached_prefix_matches_numpy(seqs, hkv, group, d, kv_dtype, window, seed):
    _cached_case([p for p, _ in seqs], [n for _, n in seqs], hkv, group, d, kv_dtype, window, seed, emulate=False)


def test_cached_prefix_arguments_are_checked():
    dev, lim = get_device(), fake_limits()
    buf = dev.alloc(4096)
    cache = pa.PagedKVCache(4, 2, 16, 16, "f16", buf, buf)
    kw = dict(num_seqs=1, num_tokens=2, num_heads=2, num_kv_heads=2, head_size=16, max_seq_len=2, emulate=True)
    with pytest.raises(ValueError, match="needs block_tables"):
        fp.flash_prefill(dev, lim, buf, buf, buf, buf, cache=cache, **kw)
    with pytest.raises(ValueError, match="come with the cache"):
        fp.flash_prefill(dev, lim, buf, buf, buf, buf, block_tables=buf, prefix_lens=buf, **kw)
    with pytest.raises(ValueError, match="the cache holds 2 KV heads of 16, the prompts 1 of 16"):
        fp.flash_prefill(dev, lim, buf, buf, buf, buf, cache=cache, block_tables=buf, prefix_lens=buf,
                         max_blocks_per_seq=1, **{**kw, "num_kv_heads": 1})
    with pytest.raises(ValueError, match="cache dtype"):
        fp.source(16, 1, 32, cache="bf16")


def _cached_step() -> StepInputs:
    """A StepInputs of two prompts that continue cached prefixes, both ways of reading the cache filled in."""
    return StepInputs(Tensor(np.arange(3, dtype=np.int32) + 16), Tensor(np.arange(3, dtype=np.int32) + 16),
                      block_tables=Tensor(np.array([[0, 1], [0, 1], [2, 3]], np.int32)),
                      context_lens=Tensor(np.array([17, 18, 17], np.int32)),
                      cu_seqlens=Tensor(np.array([0, 2, 3], np.int32)), max_seq_len=2,
                      prefix_lens=Tensor(np.array([16, 16], np.int32)),
                      seq_block_tables=Tensor(np.array([[0, 1], [2, 3]], np.int32)))


@pytest.mark.parametrize("flash,softcap,kv_dtype,want", [
    ("1", 0.0, "f16", {"flash_prefill"}), ("1", 0.0, "f32", {"flash_prefill"}), ("auto", 0.0, "f16", {"flash_prefill"}),
    ("auto", 0.0, "f32", {"paged_decode"}), ("0", 0.0, "f16", {"paged_decode"}), ("1", 5.0, "f16", {"paged_decode"})])
def test_cached_prefix_takes_flash_where_it_runs(flash, softcap, kv_dtype, want, monkeypatch):
    """The attention layer's choice for a prefill that continues cached prefixes: one flash prefill where
    flash_takes, else each new token as a query row of paged_decode; the plain template never sees a prefix."""
    monkeypatch.setattr(template_ops, "limits", lambda: fake_limits())
    monkeypatch.setenv("VKGRAPH_FLASH_PREFILL", flash)
    cfg = tiny_model.tiny_config(attn_softcap=softcap)
    rng = np.random.default_rng(0)
    dim, q, kv = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attn = Attention(cfg, *(rng.standard_normal(s).astype(np.float32) for s in [(q, dim), (kv, dim), (kv, dim),
                                                                                   (dim, q)]), float_dtype="float32")
    cache = template_ops.KVCache.create(4, cfg.n_kv_heads, cfg.head_dim, dtype=kv_dtype)
    x = Tensor(rng.standard_normal((3, dim)).astype(np.float32))
    step = _cached_step()
    out = attn(x, None, RotaryEmbedding(cfg, 64).tables(step.positions), cache, step)
    assert _custom_names(out) & {"flash_prefill", "paged_decode", "prefill_attention"} == want


def test_prefill_attention_refuses_a_prefix_without_flash(monkeypatch):
    monkeypatch.setenv("VKGRAPH_FLASH_PREFILL", "0")
    q, kv = Tensor(np.zeros((2, 2, 16), np.float32)), Tensor(np.zeros((2, 1, 16), np.float32))
    cache = template_ops.KVCache.create(4, 1, 16)
    with pytest.raises(ValueError, match="runs on flash_prefill only"):
        template_ops.prefill_attention(q, kv, kv, Tensor(np.array([0, 2], np.int32)), num_seqs=1, max_seq_len=2,
                                       cache=cache, block_tables=Tensor(np.zeros((1, 2), np.int32)),
                                       prefix_lens=Tensor(np.array([16], np.int32)))
    monkeypatch.setenv("VKGRAPH_FLASH_PREFILL", "1")
    monkeypatch.setattr(template_ops, "limits", lambda: fake_limits())
    with pytest.raises(ValueError, match="come together"):
        template_ops.prefill_attention(q, kv, kv, Tensor(np.array([0, 2], np.int32)), num_seqs=1, max_seq_len=2,
                                       cache=cache, block_tables=Tensor(np.zeros((1, 2), np.int32)))


def _emulated_flash(monkeypatch) -> None:
    """VKGRAPH_FLASH_PREFILL=1; where the device has no cooperative matrices, the emulated program stands in."""
    monkeypatch.setenv("VKGRAPH_FLASH_PREFILL", "1")
    if not fp.usable(realize_mod.limits(), 16):
        monkeypatch.setattr(fp, "usable", lambda lim, d: d % 16 == 0 and fp.shared_bytes(d) <= lim.max_shared)
        monkeypatch.setattr(fp, "flash_prefill", functools.partial(fp.flash_prefill, emulate=True))


@pytest.mark.slow  # lavapipe compiles the emulated programs for minutes
@pytest.mark.skipif(realize_mod.limits().min_subgroup != realize_mod.limits().max_subgroup,
                    reason="the program needs a fixed subgroup size")
@pytest.mark.parametrize("kv_dtype", ["f16", "f32"])
def test_engine_prefix_hit_with_flash_gives_the_cold_run(tmp_path, kv_dtype, monkeypatch):
    """With flash prefill on, a prompt whose first three blocks come from the prefix cache runs one flash
    prefill over the cached prefix and its new tokens: the same tokens as the cold run, and last-token logits
    within float16 attention's error of the float64 reference."""
    monkeypatch.setattr(get_device().queue, "timeout_s", 900.0)
    _emulated_flash(monkeypatch)
    w = load_weights(tiny_model.write_model(tmp_path, tiny_model.tiny_config(), gguf_types=())["hf"],
                     progress=False)
    model = LlamaModel(w, num_blocks=24, block_size=16, kv_dtype=kv_dtype, max_blocks_per_seq=6,
                       float_dtype="float32")
    prompt = list(range(3, 3 + 3 * 16 + 5))
    engine = Engine(model, max_batch=2)
    cold = _generate(engine, prompt, 6)
    warm = _generate(engine, prompt, 6)
    assert engine.stats["cached_prompt_tokens"] == 3 * 16
    assert warm == cold
    assert engine.kv.add_sequence("probe", prompt) == 3 * 16
    with count_kernels() as c:
        logits = engine._prefill([type("Probe", (), {"id": "probe"})()], continue_cached=True).numpy()
    assert "flash_prefill" in c.names and "paged_decode" not in c.names
    want = ReferenceLlama(w).forward(prompt)[-1:]
    # k and v rounded to float16 (KV_TOL for the attention's output) through two layers to the logits
    assert np.abs(logits - want).max() / np.abs(want).max() <= KV_TOL
    engine.kv.free_sequence("probe")


def _generate(engine: Engine, prompt: list[int], n: int) -> list[int]:
    rid = engine.add_request(prompt, None, max_tokens=n, stop_token_ids=[])
    out = []
    while engine.has_work():
        out += [ev.token for ev in engine.step() if ev.request_id == rid]
    return out

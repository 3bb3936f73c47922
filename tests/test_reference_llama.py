"""The numpy reference model: its pieces against independent formulations, and its consistency across weight
formats (safetensors vs GGUF, float vs quantized) and between prefill and incremental decode."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from reference_llama import RefCache, ReferenceLlama, attention, moe, rope, swiglu

from vkgraph.nn import tiny_model
from vkgraph.nn.config import RopeScaling
from vkgraph.nn.weights import ExpertWeights, load_weights

PROMPT = [0, 17, 99, 230, 5, 64, 64, 250, 3, 120, 7, 44]


def nerr(a: np.ndarray, b: np.ndarray) -> float:
    """Normalised error: max |a - b| over max |b|."""
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    mk = tiny_model
    dense = mk.write_model(tmp_path_factory.mktemp("dense"), mk.tiny_config(), gguf_types=("F32", "Q8_0", "Q4_0"))
    moe_cfg = mk.tiny_config(n_experts=4, n_experts_per_tok=2)
    moe_paths = mk.write_model(tmp_path_factory.mktemp("moe"), moe_cfg, gguf_types=("F32", "Q8_0"))
    scaled = mk.tiny_config(rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64), n_layers=1)
    scaled_paths = mk.write_model(tmp_path_factory.mktemp("llama3"), scaled, gguf_types=("F32",))
    qwen2 = mk.tiny_config(arch="qwen2", attn_bias=True, tie_embeddings=True)
    qwen2_paths = mk.write_model(tmp_path_factory.mktemp("qwen2"), qwen2, gguf_types=("F32",))
    return {"dense": dense, "moe": moe_paths, "llama3": scaled_paths, "qwen2": qwen2_paths}


def load(path) -> ReferenceLlama:
    return ReferenceLlama(load_weights(path, progress=False))


# ---- pieces ---------------------------------------------------------------------------------------------------

def test_rope_rotates_dimension_j_with_j_plus_half():
    rng = np.random.default_rng(0)
    d = 8
    inv = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    x = rng.standard_normal((3, 2, d))
    pos = np.array([0, 5, 11])
    got = rope(x, pos, inv)
    for t, p in enumerate(pos):
        for j in range(d // 2):
            c, s = np.cos(p * inv[j]), np.sin(p * inv[j])
            a, b = x[t, :, j], x[t, :, j + d // 2]
            np.testing.assert_allclose(got[t, :, j], c * a - s * b, atol=1e-12)
            np.testing.assert_allclose(got[t, :, j + d // 2], s * a + c * b, atol=1e-12)


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(1)
    inv = 1.0 / 10000 ** (np.arange(0, 16, 2) / 16)
    q, k = rng.standard_normal((1, 1, 16)), rng.standard_normal((1, 1, 16))
    score = lambda m, n: float((rope(q, np.array([m]), inv) * rope(k, np.array([n]), inv)).sum())
    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-9)
    assert score(7, 3) != pytest.approx(score(8, 3), rel=1e-3)


def test_llama3_scaling_divides_low_frequencies_only():
    cfg = tiny_model.tiny_config(rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
    plain = dataclasses.replace(cfg, rope_scaling=None).rope_inv_freq()
    ratio = plain / cfg.rope_inv_freq()
    wavelen = 2 * np.pi / plain
    np.testing.assert_allclose(ratio[wavelen < 64 / 4], 1.0)  # high frequencies untouched
    np.testing.assert_allclose(ratio[wavelen > 64 / 1], 8.0)  # low frequencies divided by the factor
    mid = (wavelen >= 16) & (wavelen <= 64)
    assert mid.any() and np.all((ratio[mid] > 1) & (ratio[mid] < 8))
    smooth = (64 / wavelen[mid] - 1) / (4 - 1)  # Hugging Face's formula, written out
    np.testing.assert_allclose(1 / ratio[mid], (1 - smooth) / 8 + smooth)


def test_gqa_equals_attention_with_repeated_kv_heads():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((5, 4, 8))
    k, v = rng.standard_normal((9, 2, 8)), rng.standard_normal((9, 2, 8))
    pos = np.arange(4, 9)
    got = attention(q, k, v, pos)
    for h in range(4):  # query head h reads kv head h // 2; query t sees keys 0..pos[t]
        for t, p in enumerate(pos):
            s = k[:p + 1, h // 2] @ q[t, h] / np.sqrt(8)
            w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            np.testing.assert_allclose(got[t, h], w @ v[:p + 1, h // 2], atol=1e-12)


def test_moe_weights_renormalise_and_route_to_top_experts():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 8))
    router = rng.standard_normal((4, 8))
    one = tuple(rng.standard_normal(s) * 0.3 for s in ((16, 8), (16, 8), (8, 16)))
    # identical experts: renormalised weights sum to 1, so any top-k gives the dense MLP
    np.testing.assert_allclose(moe(x, router, [one] * 4, 2), swiglu(x, *one), atol=1e-12)
    experts = [tuple(rng.standard_normal(s) * 0.3 for s in ((16, 8), (16, 8), (8, 16))) for _ in range(4)]
    best = np.argmax(x @ router.T, axis=1)  # top-1: the expert with the largest router logit, weight 1
    want = np.stack([swiglu(x[t:t + 1], *experts[best[t]])[0] for t in range(6)])
    np.testing.assert_allclose(moe(x, router, experts, 1), want, atol=1e-12)


# ---- the whole model ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dense", "moe", "llama3", "qwen2"])
def test_incremental_decode_matches_prefill(models, kind):
    ref = load(models[kind]["hf"])
    full = ref.forward(PROMPT, RefCache())
    cache = RefCache()
    parts = [ref.forward(PROMPT[:5], cache), ref.forward(PROMPT[5:9], cache)]
    parts += [ref.forward([t], cache) for t in PROMPT[9:]]
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=1e-10, atol=1e-10)
    assert cache.length == len(PROMPT)


@pytest.mark.parametrize("kind", ["dense", "moe", "llama3", "qwen2"])
def test_gguf_and_safetensors_give_the_same_logits(models, kind):
    """Also checks the q/k un-permutation: a wrong RoPE row order changes every logit."""
    want = load(models[kind]["hf"]).forward(PROMPT)
    got = load(models[kind]["F32"]).forward(PROMPT)
    assert nerr(got, want) < 1e-6


@pytest.mark.parametrize("kind,qtype,tol", [("dense", "Q8_0", 0.02), ("dense", "Q4_0", 0.25),
                                            ("moe", "Q8_0", 0.02)])
def test_quantized_logits_stay_close(models, kind, qtype, tol):
    """Per token; the median, since a near-tie in MoE routing may flip an expert for a token or two."""
    want = load(models[kind]["hf"]).forward(PROMPT)
    got = load(models[kind][qtype]).forward(PROMPT)
    errs = [nerr(g, w) for g, w in zip(got, want)]
    assert 0 < np.median(errs) < tol


def test_qwen2_biases_matter(models):
    w = load_weights(models["qwen2"]["F32"], progress=False)
    assert w.config.arch == "qwen2" and w.layers[0].bq is not None
    unbiased = dataclasses.replace(w, layers=[dataclasses.replace(lw, bq=lw.bq * 0, bk=lw.bk * 0, bv=lw.bv * 0)
                                              for lw in w.layers])
    assert nerr(ReferenceLlama(unbiased).forward(PROMPT), ReferenceLlama(w).forward(PROMPT)) > 1e-3


def test_gqa_model_equals_mha_model_with_repeated_kv(models):
    w = load_weights(models["dense"]["hf"], progress=False)
    cfg = w.config
    g = cfg.n_heads // cfg.n_kv_heads
    rep = lambda m: np.repeat(np.asarray(m).reshape(cfg.n_kv_heads, cfg.head_dim, -1), g, axis=0).reshape(
        cfg.n_heads * cfg.head_dim, -1)
    mha = dataclasses.replace(w, config=dataclasses.replace(cfg, n_kv_heads=cfg.n_heads),
                              layers=[dataclasses.replace(lw, wk=rep(lw.wk), wv=rep(lw.wv)) for lw in w.layers])
    np.testing.assert_allclose(ReferenceLlama(mha).forward(PROMPT), ReferenceLlama(w).forward(PROMPT), atol=1e-9)


def test_moe_model_with_identical_experts_equals_dense_model(models):
    dense = load_weights(models["dense"]["hf"], progress=False)
    cfg = dataclasses.replace(dense.config, n_experts=3, n_experts_per_tok=2)
    rng = np.random.default_rng(4)
    layers = [dataclasses.replace(lw, router=rng.standard_normal((3, cfg.dim)), w_gate=None, w_up=None,
                                  w_down=None, experts=[ExpertWeights(lw.w_gate, lw.w_up, lw.w_down)] * 3)
              for lw in dense.layers]
    as_moe = dataclasses.replace(dense, config=cfg, layers=layers)
    np.testing.assert_allclose(ReferenceLlama(as_moe).forward(PROMPT), ReferenceLlama(dense).forward(PROMPT),
                               atol=1e-9)


def test_float32_reference_close_to_float64(models):
    w = load_weights(models["moe"]["hf"], progress=False)
    got = ReferenceLlama(w, np.float32).forward(PROMPT)
    assert got.dtype == np.float32
    assert nerr(got, ReferenceLlama(w).forward(PROMPT)) < 1e-5


def test_greedy_generation_is_identical_across_formats(models):
    a = load(models["dense"]["hf"]).greedy(PROMPT, 8)
    assert a == load(models["dense"]["F32"]).greedy(PROMPT, 8)
    assert len(set(a)) > 1  # the random model does not just repeat one token

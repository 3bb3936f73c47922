"""Weight loading: safetensors and GGUF against the generator's own values, every supported tensor type, the RoPE
row layout, quantize-on-load, tied embeddings, MoE experts, and the errors for broken or unsupported files."""

from __future__ import annotations

import dataclasses
import json
import shutil

import ml_dtypes
import numpy as np
import pytest

from vkgraph.nn import tiny_model as mk
from vkgraph.nn.config import ModelConfig, ModelFormatError, RopeScaling, UnsupportedModelError
from vkgraph.nn.headers import TruncatedFileError
from vkgraph.nn.weights import (
    MissingTensorError,
    ShapeMismatchError,
    UnsupportedTensorTypeError,
    expected_tensors,
    load_weights,
    permute_rope_rows,
    unpermute_rope_rows,
)
from vkgraph.quant import QuantizedTensor, quantize

SEED = 0
# per-type bound on |loaded - original| relative to the tensor's max |value| (quantization error)
TYPE_TOL = {"F32": 0.0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 1e-2, "Q4_0": 0.15}


def as_f32(w) -> np.ndarray:
    return w.dequantize() if isinstance(w, QuantizedTensor) else np.asarray(w, np.float32)


def by_name(weights) -> dict[str, object]:
    """Loaded tensors keyed by Hugging Face name, to compare with the generator's values."""
    out = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.norm,
           "lm_head.weight": weights.lm_head}
    for i, lw in enumerate(weights.layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": lw.attn_norm, p + "post_attention_layernorm.weight": lw.ffn_norm,
                p + "self_attn.q_proj.weight": lw.wq, p + "self_attn.k_proj.weight": lw.wk,
                p + "self_attn.v_proj.weight": lw.wv, p + "self_attn.o_proj.weight": lw.wo}
        if lw.experts is None:
            out |= {p + "mlp.gate_proj.weight": lw.w_gate, p + "mlp.up_proj.weight": lw.w_up,
                    p + "mlp.down_proj.weight": lw.w_down}
        else:
            out[p + "block_sparse_moe.gate.weight"] = lw.router
            for e, ew in enumerate(lw.experts):
                q = p + f"block_sparse_moe.experts.{e}."
                out |= {q + "w1.weight": ew.w_gate, q + "w3.weight": ew.w_up, q + "w2.weight": ew.w_down}
    return out


def assert_matches_generator(weights, tol: float) -> None:
    cfg = weights.config
    got = by_name(weights)
    names = list(expected_tensors(cfg)) + (["lm_head.weight"] if cfg.tie_embeddings else [])
    for name in names:
        src = "model.embed_tokens.weight" if name == "lm_head.weight" and cfg.tie_embeddings else name
        want = mk.tensor(SEED, src, expected_tensors(cfg)[src][0])
        err = np.abs(as_f32(got[name]) - want).max() / np.abs(want).max()
        assert err <= tol, f"{name}: error {err}"


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return mk.write_model(tmp_path_factory.mktemp("dense"), mk.tiny_config(), seed=SEED,
                          gguf_types=tuple(TYPE_TOL))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    cfg = mk.tiny_config(n_experts=3, n_experts_per_tok=2, tie_embeddings=True)
    return mk.write_model(tmp_path_factory.mktemp("moe"), cfg, seed=SEED, gguf_types=("F32", "Q4_0"))


def test_safetensors_load_is_zero_copy_and_exact(dense):
    w = load_weights(dense["hf"], progress=False)
    assert w.config == ModelConfig.from_hf(dense["hf"])
    assert_matches_generator(w, 0.0)
    assert w.layers[0].wq.dtype == np.float32 and not w.layers[0].wq.flags.writeable  # a view of the file
    assert isinstance(w.layers[0].wq.base, np.ndarray)


@pytest.mark.parametrize("qtype", list(TYPE_TOL))
def test_gguf_types_load_to_the_same_weights(dense, qtype):
    w = load_weights(dense[qtype], progress=False)
    assert w.config == ModelConfig.from_hf(dense["hf"])
    kinds = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
    if qtype in kinds:
        assert w.layers[1].w_down.dtype == kinds[qtype]
    else:
        assert isinstance(w.layers[1].w_down, QuantizedTensor) and w.layers[1].w_down.format.name == qtype
        assert isinstance(w.embed, QuantizedTensor)  # the embedding stays as stored
    assert w.layers[0].attn_norm.dtype == np.float32
    assert_matches_generator(w, TYPE_TOL[qtype])  # q/k rows back in Hugging Face order


def test_k_quants_load(tmp_path):
    cfg = mk.tiny_config(dim=256, ffn_dim=256, n_heads=4, n_kv_heads=2, head_dim=64, n_layers=1)
    paths = mk.write_model(tmp_path, cfg, seed=SEED, gguf_types=("Q4_K", "Q6_K"))
    for qtype, tol in (("Q4_K", 0.1), ("Q6_K", 0.03)):
        w = load_weights(paths[qtype], progress=False)
        assert w.layers[0].wk.format.name == qtype
        assert_matches_generator(w, tol)


def test_moe_and_tied_embeddings(moe):
    a = load_weights(moe["hf"], progress=False)
    assert a.config.is_moe and a.config.tie_embeddings and a.lm_head is a.embed
    assert len(a.layers[0].experts) == 3 and a.layers[0].w_gate is None
    assert_matches_generator(a, 0.0)
    b = load_weights(moe["Q4_0"], progress=False)
    assert b.config == a.config
    assert isinstance(b.layers[1].experts[2].w_down, QuantizedTensor)
    assert_matches_generator(b, TYPE_TOL["Q4_0"])


def test_quantize_on_load(dense):
    w = load_weights(dense["hf"], quantize="Q8_0", progress=False)
    assert all(isinstance(x, QuantizedTensor) and x.format.name == "Q8_0"
               for lw in w.layers for x in (lw.wq, lw.wk, lw.wv, lw.wo, lw.w_gate, lw.w_up, lw.w_down))
    assert isinstance(w.lm_head, QuantizedTensor)
    assert isinstance(w.embed, np.ndarray) and isinstance(w.norm, np.ndarray)
    assert_matches_generator(w, TYPE_TOL["Q8_0"])


def test_bf16_safetensors(dense, tmp_path):
    """BF16 files, written in the safetensors format by hand (the safetensors numpy API has no bfloat16)."""
    w = load_weights(dense["hf"], progress=False)
    header, blobs, off = {}, [], 0
    for name, (shape, _) in expected_tensors(w.config).items():
        b = mk.tensor(SEED, name, shape).astype(ml_dtypes.bfloat16).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))
    shutil.copy(dense["hf"] / "config.json", tmp_path)
    got = load_weights(tmp_path, progress=False)
    assert got.layers[0].wv.dtype == ml_dtypes.bfloat16
    assert_matches_generator(got, TYPE_TOL["BF16"])


@pytest.mark.parametrize("scaling", [RopeScaling("llama3", 8.0, 1.0, 4.0, 64), RopeScaling("linear", 2.0)])
def test_gguf_rope_scaling_equals_hf_scaling(tmp_path, scaling):
    """GGUF keeps linear scaling as metadata and Llama 3's as a rope_freqs tensor of divisors."""
    cfg = mk.tiny_config(n_layers=1, rope_scaling=scaling)
    paths = mk.write_model(tmp_path, cfg, gguf_types=("F32",))
    hf, gg = ModelConfig.from_hf(paths["hf"]), load_weights(paths["F32"], progress=False).config
    assert hf == cfg
    assert (gg.rope_freq_factors is not None) == (scaling.type == "llama3")
    np.testing.assert_allclose(gg.rope_inv_freq(), hf.rope_inv_freq(), rtol=1e-6)
    assert not np.allclose(hf.rope_inv_freq(), dataclasses.replace(hf, rope_scaling=None).rope_inv_freq())


def test_rope_permutation_maps_rotate_half_to_adjacent_pairs():
    """What the layout claim means: RoPE on adjacent pairs (2j, 2j+1) of the permuted projection's output equals
    rotate-half RoPE (j, j + d/2) of the original's output, with rows permuted the same way."""
    rng = np.random.default_rng(0)
    heads, d, dim = 2, 8, 5
    w = rng.standard_normal((heads * d, dim))
    x = rng.standard_normal(dim)
    ang = 3 * 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    c, s = np.cos(ang), np.sin(ang)
    y = (w @ x).reshape(heads, d)
    half = np.concatenate([y[:, :d // 2] * c - y[:, d // 2:] * s, y[:, d // 2:] * c + y[:, :d // 2] * s], axis=1)
    z = (permute_rope_rows(w, heads) @ x).reshape(heads, d // 2, 2)
    pairs = np.stack([z[..., 0] * c - z[..., 1] * s, z[..., 1] * c + z[..., 0] * s], axis=-1).reshape(heads, d)
    np.testing.assert_allclose(pairs, permute_rope_rows(half.reshape(-1, 1), heads).reshape(heads, d))
    np.testing.assert_array_equal(unpermute_rope_rows(permute_rope_rows(w, heads), heads), w)
    qt = quantize(permute_rope_rows(w.repeat(32, axis=1), heads), "Q8_0")
    np.testing.assert_array_equal(unpermute_rope_rows(qt, heads).data, quantize(w.repeat(32, axis=1), "Q8_0").data)


def test_progress_bar(dense, capsys):
    load_weights(dense["F32"], progress=True)
    assert "loading model-f32.gguf" in capsys.readouterr().err


# ---- errors -----------------------------------------------------------------------------------------------------

def test_unsupported_architecture(dense, tmp_path):
    from gguf import GGUFWriter

    cfg = json.loads((dense["hf"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"model_type": "gpt2"}))
    shutil.copy(dense["hf"] / "model.safetensors", tmp_path)
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2'"):
        load_weights(tmp_path, progress=False)
    g = GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_ti_data_to_file()
    g.close()
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2'"):
        load_weights(tmp_path / "x.gguf", progress=False)


def test_unsupported_tensor_type(tmp_path):
    """A type vkgraph has no format for is named with the tensor that uses it."""
    cfg = mk.tiny_config(dim=256, ffn_dim=256, head_dim=64, n_layers=1)
    paths = mk.write_model(tmp_path, cfg, gguf_types=("IQ2_XXS",), safetensors=False)
    with pytest.raises(UnsupportedTensorTypeError, match=r"token_embd.weight is IQ2_XXS"):
        load_weights(paths["IQ2_XXS"], progress=False)


def test_more_formats_load(tmp_path):
    """Q4_1, Q5_0, Q5_1 (quantized here) decode close to the generator's values; the formats nothing here quantizes
    (random blocks in the file) load as their blocks, bit for bit."""
    from gguf import GGUFReader

    cfg = mk.tiny_config(dim=256, ffn_dim=256, n_heads=4, n_kv_heads=2, head_dim=64, n_layers=1)
    types = ("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "IQ4_NL", "IQ4_XS")
    paths = mk.write_model(tmp_path, cfg, seed=SEED, gguf_types=types, safetensors=False)
    for qtype, tol in (("Q4_1", 0.1), ("Q5_0", 0.05), ("Q5_1", 0.05)):
        w = load_weights(paths[qtype], progress=False)
        assert w.layers[0].wk.format.name == qtype
        assert_matches_generator(w, tol)
    for qtype in types[3:]:
        w = load_weights(paths[qtype], progress=False)
        raw = {t.name: t for t in GGUFReader(paths[qtype]).tensors}["blk.0.ffn_down.weight"]
        assert w.layers[0].w_down.format.name == qtype
        stored = np.asarray(raw.data).view(np.uint8).reshape(-1)
        np.testing.assert_array_equal(w.layers[0].w_down.data.reshape(-1), stored)


@pytest.mark.parametrize("kind", ["F32", "hf"])
@pytest.mark.parametrize("keep", [0.5, 0.999, 0.00001])
def test_truncated_file(dense, tmp_path, kind, keep):
    src = dense[kind] if kind != "hf" else dense["hf"] / "model.safetensors"
    data = src.read_bytes()
    dst = tmp_path / src.name
    dst.write_bytes(data[:int(len(data) * keep)])
    if kind == "hf":
        shutil.copy(dense["hf"] / "config.json", tmp_path)
    with pytest.raises(TruncatedFileError, match="truncated"):
        load_weights(dst, progress=False)


def test_shape_mismatch(dense, tmp_path):
    cfg = json.loads((dense["hf"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 96}))
    shutil.copy(dense["hf"] / "model.safetensors", tmp_path)
    with pytest.raises(ShapeMismatchError, match=r"gate_proj.weight has shape \(128, 64\).*\(96, 64\)"):
        load_weights(tmp_path, progress=False)


def test_missing_tensors(dense, tmp_path):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(dense["hf"] / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(dense["hf"] / "config.json", tmp_path)
    with pytest.raises(MissingTensorError, match=r"1 tensors missing.*layers\.1\.mlp\.up_proj"):
        load_weights(tmp_path, progress=False)


def test_missing_config(dense, tmp_path):
    shutil.copy(dense["hf"] / "model.safetensors", tmp_path)
    with pytest.raises(ModelFormatError, match="config.json"):
        load_weights(tmp_path, progress=False)


@pytest.mark.slow
def test_llama3_8b_shape_streams_with_bounded_memory(tmp_path):
    """One layer of the benchmark shape (the embedding and output alone are 2 x 525M values)."""
    import subprocess
    import sys

    # written in a fresh process, whose peak RSS is read from /proc (VmHWM belongs to the process's own memory
    # map; getrusage's ru_maxrss would carry this test process's peak over through vfork and exec)
    code = ("import dataclasses, re; from vkgraph.nn import tiny_model as mk; "
            "cfg = dataclasses.replace(mk.llama3_8b_config(), n_layers=1); "
            f"mk.write_model({str(tmp_path)!r}, cfg, gguf_types=('Q4_0',), safetensors=False); "
            f"print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(r.stdout.split()[-1]) < 2 * 2**20  # KiB: under 2 GiB, while the embedding alone is 2 GiB of float32
    cfg = dataclasses.replace(mk.llama3_8b_config(), n_layers=1)
    w = load_weights(tmp_path / "model-q4_0.gguf", progress=False)
    assert w.config == dataclasses.replace(cfg, rope_scaling=None, rope_freq_factors=w.config.rope_freq_factors)
    assert w.embed.shape == (128256, 4096) and w.layers[0].w_down.shape == (4096, 14336)
    np.testing.assert_allclose(w.config.rope_inv_freq(), cfg.rope_inv_freq(), rtol=1e-6)


def test_sliding_window_bounds_the_context(dense):
    """Mistral 7B v0.1's window (4096 of 32768 positions) caps the context, where attention without a window is
    exact; Qwen2's unused window and a window as long as the context change nothing."""
    base = json.loads((dense["hf"] / "config.json").read_text()) | {"max_position_embeddings": 32768}
    assert ModelConfig.from_hf(base | {"model_type": "mistral", "sliding_window": 4096}).max_seq_len == 4096
    assert ModelConfig.from_hf(base | {"model_type": "mistral", "sliding_window": None}).max_seq_len == 32768
    qwen = base | {"model_type": "qwen2", "sliding_window": 4096}
    assert ModelConfig.from_hf(qwen | {"use_sliding_window": False}).max_seq_len == 32768
    assert ModelConfig.from_hf(qwen | {"use_sliding_window": True}).max_seq_len == 4096


def test_gemma2_config_as_published():
    """gemma-2-2b's config.json fields: caps, the sliding layers' own window (the context stays whole), the query
    scale from query_pre_attn_scalar, tied embeddings by default; null caps are none; to_hf reads back."""
    hf = {"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304, "num_hidden_layers": 26,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 8192, "sliding_window": 4096,
          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256,
          "hidden_activation": "gelu_pytorch_tanh"}
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.arch, cfg.attn_softcap, cfg.final_softcap, cfg.sliding_window) == ("gemma2", 50.0, 30.0, 4096)
    assert cfg.max_seq_len == 8192 and cfg.tie_embeddings and cfg.attn_scale == 1 / 16
    assert [cfg.layer_window(i) for i in range(3)] == [4096, 0, 4096]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    none = ModelConfig.from_hf(hf | {"attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert none.attn_softcap == none.final_softcap == 0.0
    with pytest.raises(ModelFormatError, match="attn_logit_softcapping"):
        ModelConfig.from_hf(hf | {"attn_logit_softcapping": -1})


def test_gemma2_gguf_query_scale_as_llama_cpp_derives_it(tmp_path):
    """GGUF carries no query_pre_attn_scalar: head_dim, except for the 46-layer 27B, whose scale is dim / heads
    (llama.cpp's rule); the caps and the window come from the file."""
    for layers, want in ((2, 32), (46, 16)):
        cfg = mk.tiny_config(**mk.gemma2_overrides(), n_layers=layers, head_dim=32)  # dim 64 over 4 heads: 16
        path = mk.write_model(tmp_path / str(layers), cfg, gguf_types=("F32",), safetensors=False)["F32"]
        got = load_weights(path, progress=False).config
        assert got == dataclasses.replace(cfg, query_pre_attn_scalar=want)


def test_phi3_fused_tensors_load_as_projections(tmp_path):
    """Phi-3 (HF qkv_proj/gate_up_proj, GGUF attn_qkv/ffn_up) loads to the same per-projection weights as the
    generator's, float and quantized; a Phi-4-style partial rotary factor is refused by name."""
    cfg = mk.tiny_config(arch="phi3")
    paths = mk.write_model(tmp_path, cfg, seed=SEED, gguf_types=("F32", "Q8_0"))
    hf = json.loads((paths["hf"] / "config.json").read_text())
    assert hf["model_type"] == "phi3" and "model.layers.0.self_attn.qkv_proj.weight" in _st_names(paths["hf"])
    for key, tol in (("hf", 0.0), ("F32", 0.0), ("Q8_0", TYPE_TOL["Q8_0"])):
        w = load_weights(paths[key], progress=False)
        assert w.config.arch == "phi3"
        assert_matches_generator(w, tol)
    (tmp_path / "config.json").write_text(json.dumps(hf | {"partial_rotary_factor": 0.75}))
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        load_weights(paths["hf"], progress=False)


def _st_names(d):
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "np") as f:
        return set(f.keys())

"""Write a Llama-style model with random weights: Hugging Face files and the same model as GGUF.

    python -m vkgraph.nn.tiny_model OUT_DIR [--gguf F32,Q8_0,Q4_0] [--experts 4 --experts-per-tok 2] ...
    python -m vkgraph.nn.tiny_model OUT_DIR --preset llama3-8b --gguf Q4_0      # benchmark shape, GGUF only

(`scripts/make_tiny_model.py` is the same command.)

OUT_DIR receives config.json, tokenizer.json, model.safetensors (Hugging Face Llama names; Mixtral names with
--experts) and model-<type>.gguf per requested type (llama.cpp's "llama" architecture with q/k rows permuted as
its converter does, "qwen2" with --qwen2, or "phi3" and its fused tensors with --phi3; byte-level BPE vocabulary
embedded; a type may be one of MIXES, such as Q4_K_M). Everything is deterministic in --seed: each tensor's
values come from its own generator, seeded by (seed, tensor name, chunk), so the safetensors and GGUF copies hold
the same weights and large tensors are generated and written one chunk at a time.

The tokenizer is a byte-level BPE trained on a fixed built-in text (special tokens <|begin_of_text|>,
<|end_of_text|>, <|eot_id|> first), padded with reserved special tokens up to the model's vocabulary size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .. import quant
from .config import ModelConfig, RopeScaling, gguf_value, llama3_freq_factors
from .model_file import ModelSource, open_model
from .weights import MATRIX, expected_tensors, gguf_name, permute_rope_rows

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
# a chat template in the Llama 3 manner (shipped in both copies, as real models ship theirs)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
BOS_ID, EOS_ID, EOT_ID = 0, 1, 2
BPE_VOCAB = 300  # trained tokens (specials + 256 bytes + merges); the rest of the vocabulary is reserved
CORPUS = """\
Once upon a time there was a little model that wanted to run on every GPU in the world.
The quick brown fox jumps over the lazy dog. The lazy dog did not mind at all.
A lazy tensor waits until the last moment, then runs one fused kernel instead of ten small ones.
Hello world! Hello, tiny model. What is the capital of France? The capital of France is Paris.
Vulkan compute shaders read weights, write activations and never wait on the host.
one two three four five six seven eight nine ten, 1 2 3 4 5 6 7 8 9 10.
"""
RANDOM_NAME = "vkgraph-random"  # the model name both copies carry, so tools can say the weights are random
CHUNK_ELEMS = 1 << 22  # values generated per chunk: bounds memory for the 8B shape, fixed so values never change


def tiny_config(**overrides: object) -> ModelConfig:
    base = dict(arch="llama", vocab_size=BPE_VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                head_dim=16, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=512)
    return ModelConfig(**{**base, **overrides})


def gemma2_overrides() -> dict[str, object]:
    """A tiny Gemma 2: caps low enough to bend random scores and logits, and a window shorter than test prompts (the
    query scale stays head_dim's: GGUF files do not carry it, llama.cpp derives it)."""
    return {"arch": "gemma2", "tie_embeddings": True, "attn_softcap": 5.0, "final_softcap": 3.0, "sliding_window": 8}


def llama3_8b_config() -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                       ffn_dim=14336, head_dim=128, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192,
                       rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))


def is_random_model(model: ModelSource) -> bool:
    """Whether `model` (a .gguf file, a model directory or a file inside one, by path or as an open `ModelFile`)
    was written by this module."""
    try:
        m = open_model(model)
        if m.gguf is not None:
            return gguf_value(m.gguf, "general.name") == RANDOM_NAME
        return json.loads((m.folder / "config.json").read_text()).get("_name_or_path") == RANDOM_NAME
    except (OSError, ValueError, AttributeError):
        return False


# ---- weights ---------------------------------------------------------------------------------------------------

def _std(name: str, shape: tuple[int, ...]) -> float:
    """Scales that keep activations O(1) and logits spread out (clear greedy choices, few near-ties)."""
    if name.endswith("embed_tokens.weight"):
        return 1.0
    if name.endswith("lm_head.weight"):
        return 3.0 / np.sqrt(shape[-1])
    if name.endswith(".bias"):
        return 0.1
    return 1.0 / np.sqrt(shape[-1])


def tensor_chunks(seed: int, name: str, shape: tuple[int, ...]) -> Iterator[np.ndarray]:
    """The float32 values of one tensor, in row chunks along its first axis."""
    is_norm = name.endswith("norm.weight")
    rows = shape[0]
    inner = int(np.prod(shape[1:]))
    step = max(1, CHUNK_ELEMS // max(inner, 1))
    for c, r0 in enumerate(range(0, rows, step)):
        rng = np.random.default_rng([seed, zlib.crc32(name.encode()), c])
        x = rng.standard_normal((min(step, rows - r0), *shape[1:]), dtype=np.float32)
        yield 1.0 + 0.1 * x if is_norm else x * np.float32(_std(name, shape))


def tensor(seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.concatenate(list(tensor_chunks(seed, name, shape)))


# ---- tokenizer -------------------------------------------------------------------------------------------------

def build_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, BPE_VOCAB), special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    n = tok.get_vocab_size()
    if n > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {n} tokens")
    tok.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(vocab_size - n)])
    tok.post_processor = processors.TemplateProcessing(single=f"{SPECIALS[BOS_ID]} $A",
                                                       special_tokens=[(SPECIALS[BOS_ID], BOS_ID)])
    return tok


def vocab_for_gguf(tok) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, token types, merges as 'a b') in GGUF's tokenizer.ggml layout."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    types = [3 if t in special else 1 for t in tokens]  # gguf.TokenType CONTROL / NORMAL
    merges = json.loads(tok.to_str())["model"]["merges"]
    return tokens, types, [m if isinstance(m, str) else " ".join(m) for m in merges]


# ---- writers ---------------------------------------------------------------------------------------------------

def write_hf(out: Path, cfg: ModelConfig, seed: int, tok) -> None:
    from safetensors.numpy import save_file

    hf = cfg.to_hf() | {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, EOT_ID], "_name_or_path": RANDOM_NAME}
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2))
    tensors = {name: tensor(seed, name, shape) for name, (shape, _) in expected_tensors(cfg).items()}
    if cfg.is_gemma:  # Hugging Face's Gemma stores w for a norm scale of 1 + w (GGUF stores 1 + w)
        tensors = {k: v - np.float32(1) if k.endswith("norm.weight") else v for k, v in tensors.items()}
    if cfg.arch == "phi3":  # Phi-3's fused q/k/v and gate/up, rows in that order
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            for fused, names in (("self_attn.qkv_proj.weight", ("q_proj", "k_proj", "v_proj")),
                                 ("mlp.gate_up_proj.weight", ("gate_proj", "up_proj"))):
                prefix = fused.split(".")[0] + "."
                tensors[p + fused] = np.concatenate([tensors.pop(p + prefix + n + ".weight") for n in names])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _encode(x: np.ndarray, qtype: str) -> np.ndarray:
    """float32 values -> GGUF tensor data of type qtype (blocks along the last axis)."""
    from gguf import GGMLQuantizationType, quants

    if qtype == "F32":
        return x
    if qtype == "F16":
        return x.astype(np.float16)
    if qtype in quant.QUANTIZERS:  # gguf.quants cannot quantize K-quants; vkgraph.quant can
        return quant.quantize(x.reshape(-1, x.shape[-1]), qtype).data.reshape(*x.shape[:-1], -1)
    try:
        return quants.quantize(x, GGMLQuantizationType[qtype])
    except NotImplementedError:  # nothing here quantizes it: random blocks of its size (for loader tests)
        return _random_blocks(zlib.crc32(x.tobytes()), qtype, x.shape, qtype)


def _random_blocks(seed: int, gname: str, shape: tuple[int, ...], qtype: str) -> np.ndarray:
    """Valid blocks drawn directly (small float16 scales, random quants; `quant.random_blocks`): what a speed
    benchmark needs in seconds, where quantizing billions of random floats in numpy takes minutes. Types vkgraph
    does not know get random bytes of their size."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng([seed, zlib.crc32(gname.encode())])
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    if qtype in quant.FORMATS:
        data = quant.random_blocks(rng, qtype, rows, cols, d_range=(0.001, 0.011)).data  # stable over 32 layers
    else:
        data = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    return data.reshape(*shape[:-1], cols // block * size)


def _gguf_tensor(seed: int, cfg: ModelConfig, gname: str, parts: list[tuple[str, tuple[int, ...]]],
                 qtype: str, random_quants: bool = False) -> np.ndarray:
    """One GGUF tensor (experts stacked on a leading axis), permuted and quantized as llama.cpp stores it.
    Encoded chunk by chunk, so only the encoded tensor and one float chunk are in memory at once."""
    if random_quants and qtype in quant.FORMATS and quant.FORMATS[qtype].block_size > 1:
        shape = parts[0][1] if len(parts) == 1 else _joined_shape(parts)
        return _random_blocks(seed, gname, shape, qtype)
    pieces = []
    for hf_name, shape in parts:
        if cfg.arch == "llama" and gname.endswith(("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")):
            heads = cfg.n_heads if ".attn_q." in gname else cfg.n_kv_heads
            chunks: Iterator[np.ndarray] | list[np.ndarray] = [permute_rope_rows(tensor(seed, hf_name, shape), heads)]
        else:
            chunks = tensor_chunks(seed, hf_name, shape)
        pieces.append(np.concatenate([_encode(c, qtype) for c in chunks]))
    if len(parts) == 1:
        return pieces[0]
    return np.stack(pieces) if _is_experts(parts) else np.concatenate(pieces)


# llama.cpp's usual mixes, simplified: a base type, and the tensors (by GGUF name suffix) it keeps in another
MIXES = {"Q4_K_M": ("Q4_K", {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "output.weight": "Q6_K"}),
         "Q5_K_M": ("Q5_K", {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "output.weight": "Q6_K"}),
         "Q3_K_L": ("Q3_K", {"attn_v.weight": "Q5_K", "attn_output.weight": "Q5_K", "ffn_down.weight": "Q5_K",
                             "output.weight": "Q6_K"})}


def _is_experts(parts: list[tuple[str, tuple[int, ...]]]) -> bool:
    return ".experts." in parts[0][0]


def _joined_shape(parts: list[tuple[str, tuple[int, ...]]]) -> tuple[int, ...]:
    """Experts stack on a new leading axis; Phi-3's fused projections concatenate rows."""
    if _is_experts(parts):
        return (len(parts), *parts[0][1])
    return (sum(p[1][0] for p in parts), *parts[0][1][1:])


def write_gguf(path: Path, cfg: ModelConfig, seed: int, tok, qtype: str, *, progress: bool = False,
               random_quants: bool = False) -> None:
    """Stream a GGUF file: all tensor infos first, then each tensor generated, quantized and written in turn.
    qtype is a GGUF type or one of MIXES. random_quants: quantized matrices are random blocks rather than
    quantized random floats (benchmarks)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType, RopeScalingType
    from tqdm import tqdm

    w = GGUFWriter(str(path), cfg.arch)
    w.add_name(RANDOM_NAME)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(LlamaFileType[{"F32": "ALL_F32", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M",
                                  "Q5_K": "MOSTLY_Q5_K_M"}.get(qtype, f"MOSTLY_{qtype}")])
    if qtype not in ("F32", "F16", "BF16"):
        w.add_quantization_version(2)
    if cfg.arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_softcap)
        w.add_final_logit_softcapping(cfg.final_softcap)
        w.add_sliding_window(cfg.sliding_window)
    if cfg.is_moe:
        w.add_expert_count(cfg.n_experts)
        w.add_expert_used_count(cfg.n_experts_per_tok)
    tokens, types, merges = vocab_for_gguf(tok)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_eot_token_id(EOT_ID)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)

    # group Hugging Face tensors by GGUF tensor (experts stack), keeping order
    plan: dict[str, tuple[list[tuple[str, tuple[int, ...]]], str]] = {}
    for name, (shape, kind) in expected_tensors(cfg).items():
        gname, _ = gguf_name(name, cfg.arch)
        is_matrix = kind == MATRIX or name == "model.embed_tokens.weight"
        if cfg.arch == "phi3":  # fused tensors (attn_qkv; ffn_up holds gate then up), rows concatenated
            gname = re.sub(r"attn_[qkv]\.weight$", "attn_qkv.weight", gname.replace("ffn_gate.", "ffn_up."))
        base, overrides = MIXES.get(qtype, (qtype, {}))
        t = next((o for suffix, o in overrides.items() if gname.endswith(suffix)), base)
        plan.setdefault(gname, ([], t if is_matrix else "F32"))[0].append((name, shape))
    extra = {}
    if cfg.rope_scaling is not None and cfg.rope_scaling.type == "llama3":  # as llama.cpp's converter stores it
        inv = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
        extra["rope_freqs.weight"] = llama3_freq_factors(inv, cfg.rope_scaling).astype(np.float32)
    elif cfg.rope_scaling is not None:
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scaling.factor)

    def info(parts: list[tuple[str, tuple[int, ...]]], t: str) -> tuple[tuple[int, ...], int]:
        shape = parts[0][1] if len(parts) == 1 else _joined_shape(parts)
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[t]]
        return shape, int(np.prod(shape)) // block * size

    for gname, arr in extra.items():
        w.add_tensor_info(gname, arr.shape, arr.dtype, arr.nbytes)
    for gname, (parts, t) in plan.items():
        shape, nbytes = info(parts, t)
        w.add_tensor_info(gname, shape, np.dtype(np.float32), nbytes,
                          raw_dtype=None if t == "F32" else GGMLQuantizationType[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for arr in extra.values():
        w.write_tensor_data(arr)
    for gname, (parts, t) in tqdm(plan.items(), desc=path.name, unit="tensor", disable=not progress):
        w.write_tensor_data(_gguf_tensor(seed, cfg, gname, parts, t, random_quants))
    w.close()


def write_model(out: str | Path, cfg: ModelConfig, *, seed: int = 0, gguf_types: tuple[str, ...] = ("F32",),
                safetensors: bool = True, progress: bool = False, random_quants: bool = False) -> dict[str, Path]:
    """Write the model files into `out`; returns {"hf": dir, "<TYPE>": gguf path, ...}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(cfg.vocab_size)
    paths: dict[str, Path] = {}
    if safetensors:
        write_hf(out, cfg, seed, tok)
        paths["hf"] = out
    for t in gguf_types:
        p = out / f"model-{t.lower()}.gguf"
        write_gguf(p, cfg, seed, tok, t.upper(), progress=progress, random_quants=random_quants)
        paths[t.upper()] = p
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", choices=("tiny", "llama3-8b"), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gguf", default="F32", help="comma-separated GGUF types: F32,F16,Q8_0,Q4_0,Q4_K,Q6_K "
                                                  "(K-quants need dims that are multiples of 256); '' for none")
    ap.add_argument("--no-safetensors", action="store_true", help="skip the Hugging Face files (implied by "
                                                                  "the llama3-8b preset)")
    for flag, field in (("--dim", "dim"), ("--layers", "n_layers"), ("--heads", "n_heads"),
                        ("--kv-heads", "n_kv_heads"), ("--head-dim", "head_dim"), ("--ffn", "ffn_dim"),
                        ("--vocab", "vocab_size"), ("--experts", "n_experts"),
                        ("--experts-per-tok", "n_experts_per_tok")):
        ap.add_argument(flag, dest=field, type=int)
    ap.add_argument("--random-quants", action="store_true", help="quantized matrices as random blocks, written "
                                                                  "in seconds (for speed benchmarks)")
    ap.add_argument("--rope-scaling", choices=("none", "linear", "llama3"))
    ap.add_argument("--tie", action="store_true", help="tie lm_head to the embedding")
    ap.add_argument("--qwen2", action="store_true", help="Qwen2 architecture (q/k/v biases)")
    ap.add_argument("--phi3", action="store_true", help="Phi-3 architecture (fused q/k/v and gate/up tensors)")
    ap.add_argument("--gemma", action="store_true", help="Gemma architecture (GeGLU, scaled embedding, 1 + w norms)")
    ap.add_argument("--gemma2", action="store_true", help="Gemma 2 (Gemma's, plus post-attention and post-MLP norms, "
                                                          "soft-capped scores and logits, a sliding window of 8 on "
                                                          "even layers)")
    a = ap.parse_args(argv)
    cfg = llama3_8b_config() if a.preset == "llama3-8b" else tiny_config()
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    over = {k: v for k, v in vars(a).items() if k in fields and v is not None}
    if a.n_experts and "n_experts_per_tok" not in over:
        over["n_experts_per_tok"] = min(2, a.n_experts)
    if "dim" in over and "head_dim" not in over:
        over["head_dim"] = over["dim"] // over.get("n_heads", cfg.n_heads)
    if a.rope_scaling:
        over["rope_scaling"] = {"none": None, "linear": RopeScaling("linear", 2.0),
                                "llama3": RopeScaling("llama3", 8.0, 1.0, 4.0, 64)}[a.rope_scaling]
    if a.tie:
        over["tie_embeddings"] = True
    if a.qwen2:
        over |= {"arch": "qwen2", "attn_bias": True}
    if a.phi3:
        over["arch"] = "phi3"
    if a.gemma:
        over |= {"arch": "gemma", "tie_embeddings": True}
    if a.gemma2:
        over |= gemma2_overrides()
    cfg = dataclasses.replace(cfg, **over)
    types = tuple(t.strip().upper() for t in a.gguf.split(",") if t.strip())
    paths = write_model(a.out, cfg, seed=a.seed, gguf_types=types,
                        safetensors=not a.no_safetensors and a.preset == "tiny", progress=True,
                        random_quants=a.random_quants)
    for k, p in paths.items():
        print(f"{k}: {p}")


if __name__ == "__main__":
    main()

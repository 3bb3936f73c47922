"""Load a Llama-family model's weights from safetensors (Hugging Face names) or GGUF (llama.cpp names).

Files are memory-mapped: float tensors come back as read-only numpy views of the file (float32, float16 or
ml_dtypes.bfloat16, as stored), GGUF's quantized tensors (every format of vkgraph.quant) as `vkgraph.quant.
QuantizedTensor`s over the file's blocks. Nothing is read until used, except where a tensor must be rearranged
(see RoPE below) or quantized on load.

Orientation: every matrix is (out_features, in_features), as in Hugging Face and as GGUF's rows; y = x @ W.T.

RoPE layout: the loaded q and k projections always expect Hugging Face's "rotate half" RoPE, where head
dimension j is paired with j + head_dim/2. llama.cpp's converter permutes q and k rows of "llama" models so that
pairs are adjacent (2j, 2j+1); the GGUF loader undoes that permutation (a row reorder, exact for quantized rows
too), so the same model code serves both formats. Qwen2 GGUF files are stored unpermuted and left as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from vkgraph import quant
from vkgraph.dtype import dtypes
from vkgraph.quant import QuantizedTensor

from .config import ModelConfig, ModelFormatError, UnsupportedModelError
from .headers import read_safetensors_header
from .model_file import ModelSource, open_model


@dataclass
class DeviceMatrix:
    """A weight matrix made on the device (nn/shard.py: RandomWeights), never on the host: its float16 values
    as a realized (out_features, in_features) Tensor, which the layers use as it is (as GGUF's F16 rows)."""

    values: Any  # vkgraph.Tensor, float16

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @property
    def nbytes(self) -> int:
        return self.values.shape[0] * self.values.shape[1] * 2


Weight = np.ndarray | QuantizedTensor | DeviceMatrix


class MissingTensorError(ModelFormatError):
    pass


class ShapeMismatchError(ModelFormatError):
    pass


class UnsupportedTensorTypeError(UnsupportedModelError):
    pass


@dataclass
class ExpertWeights:
    w_gate: Weight  # (ffn, dim)
    w_up: Weight  # (ffn, dim)
    w_down: Weight  # (dim, ffn)


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # (dim,)
    wq: Weight  # (n_heads * head_dim, dim)
    wk: Weight  # (n_kv_heads * head_dim, dim)
    wv: Weight  # (n_kv_heads * head_dim, dim)
    wo: Weight  # (dim, n_heads * head_dim)
    ffn_norm: np.ndarray  # (dim,)
    bq: np.ndarray | None = None  # q/k/v biases (Qwen2)
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    w_gate: Weight | None = None  # dense SwiGLU MLP: (ffn, dim), (ffn, dim), (dim, ffn)
    w_up: Weight | None = None
    w_down: Weight | None = None
    router: np.ndarray | None = None  # mixture of experts: (n_experts, dim) and one ExpertWeights per expert
    experts: list[ExpertWeights] | None = None
    post_attn_norm: np.ndarray | None = None  # Gemma 2: norms of the attention's and the MLP's outputs (dim,)
    post_ffn_norm: np.ndarray | None = None


@dataclass
class ModelWeights:
    config: ModelConfig
    embed: Weight  # (vocab, dim)
    layers: list[LayerWeights]
    norm: np.ndarray  # (dim,)
    lm_head: Weight  # (vocab, dim); the embedding itself when tied (a quantized copy when quantized on load)


# ---- what a model of a given config holds, by Hugging Face name ---------------------------------------------

# MATRIX: projections, may be quantized on load. EMBED: the embedding, as stored. VECTOR: norms, biases and the
# router, always float (dequantized if a file stores them quantized).
MATRIX, EMBED, VECTOR = "matrix", "embed", "vector"


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Hugging Face name -> (shape, kind) of every tensor the config calls for."""
    d, q, kv, f = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    out: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((cfg.vocab_size, d), EMBED)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((d,), VECTOR)
        for name, shape in (("q_proj", (q, d)), ("k_proj", (kv, d)), ("v_proj", (kv, d)), ("o_proj", (d, q))):
            out[p + f"self_attn.{name}.weight"] = (shape, MATRIX)
        if cfg.attn_bias:
            for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                out[p + f"self_attn.{name}.bias"] = ((n,), VECTOR)
        out[p + "post_attention_layernorm.weight"] = ((d,), VECTOR)
        if cfg.arch == "gemma2":  # post_attention_layernorm is the attention output's norm there
            out[p + "pre_feedforward_layernorm.weight"] = ((d,), VECTOR)
            out[p + "post_feedforward_layernorm.weight"] = ((d,), VECTOR)
        if cfg.is_moe:
            out[p + "block_sparse_moe.gate.weight"] = ((cfg.n_experts, d), VECTOR)
            for e in range(cfg.n_experts):
                for w, shape in (("w1", (f, d)), ("w3", (f, d)), ("w2", (d, f))):
                    out[p + f"block_sparse_moe.experts.{e}.{w}.weight"] = (shape, MATRIX)
        else:
            for name, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
                out[p + f"mlp.{name}.weight"] = (shape, MATRIX)
    out["model.norm.weight"] = ((d,), VECTOR)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ((cfg.vocab_size, d), MATRIX)
    return out


# ---- entry point --------------------------------------------------------------------------------------------

class _Source(Protocol):
    """Tensors of one file format, by Hugging Face name."""

    config: ModelConfig
    capacity: int  # tensors the file lists, a stacked (3-D) tensor counting each of its matrices

    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> Weight: ...


# the formats `load_weights(quantize=...)` can quantize float projections to
QUANTIZE_FORMATS = tuple(f for f in quant.QUANTIZERS if f not in ("F16", "BF16"))


def load_weights(source: ModelSource, *, quantize: str | None = None, progress: bool = True) -> ModelWeights:
    """Load a model: a .gguf file, or a directory (or one .safetensors file inside it) with config.json and
    *.safetensors, by path or as an open `ModelFile`. `quantize` ("Q8_0", "Q4_0", ...) quantizes float projection
    matrices and lm_head on load; the embedding, norms, biases and router stay float."""
    m = open_model(source)
    p = m.path
    if m.gguf is not None:
        src: _Source = _GGUFSource(p, m.gguf)
    else:
        d = m.folder
        files = sorted(d.glob("*.safetensors")) if p.is_dir() else [p]
        if not files:
            raise ModelFormatError(f"no .safetensors files in {d}")
        src = _SafetensorsSource(files, ModelConfig.from_hf(d))
    if src.config.arch == "phi3":
        src = _FusedSource(src)
    weights = _assemble(src, quantize, progress, p.name)
    if weights.config.is_gemma and m.gguf is None:
        weights = _gemma_norms(weights)
    return weights


def _gemma_norms(w: ModelWeights) -> ModelWeights:
    """Gemma's norms scale by 1 + w, w as Hugging Face stores it (llama.cpp's converter stores 1 + w): added here
    in float32, as Gemma's RMSNorm computes it, so every format reaches the model code as a plain scale."""
    def plus1(v: np.ndarray) -> np.ndarray:
        return np.asarray(v, np.float32) + np.float32(1)

    layers = [replace(lw, attn_norm=plus1(lw.attn_norm), ffn_norm=plus1(lw.ffn_norm),
                      **({} if lw.post_attn_norm is None else
                         {"post_attn_norm": plus1(lw.post_attn_norm), "post_ffn_norm": plus1(lw.post_ffn_norm)}))
              for lw in w.layers]
    return replace(w, layers=layers, norm=plus1(w.norm))


def _assemble(src: _Source, quantize: str | None, progress: bool, label: str) -> ModelWeights:
    cfg = src.config
    # counts in the config are believed only as far as the file's own tensor list bears them out, before the
    # loop over what they imply: every layer holds a tensor, an MoE layer three per expert
    if cfg.n_layers * max(1, 3 * cfg.n_experts) > src.capacity:
        raise MissingTensorError(f"{label}: {cfg.n_layers} layers{f' of {cfg.n_experts} experts' if cfg.is_moe else ''}"
                                 f" need more tensors than the {src.capacity} the file lists")
    want = expected_tensors(cfg)
    missing = [n for n in want if not src.has(n)]
    if missing:
        raise MissingTensorError(f"{label}: {len(missing)} tensors missing, e.g. {missing[:5]}")
    fmt = None if quantize is None else quant.get_format(quantize)
    got: dict[str, Weight] = {}
    from tqdm import tqdm  # here, not at import: loading is the only user

    for name, (shape, kind) in tqdm(want.items(), desc=f"loading {label}", unit="tensor", disable=not progress):
        w = src.get(name)
        if tuple(w.shape) != shape:
            raise ShapeMismatchError(f"{label}: {name} has shape {tuple(w.shape)}, the config implies {shape}")
        if kind == VECTOR and isinstance(w, QuantizedTensor):
            w = w.dequantize().reshape(shape)
        if kind == MATRIX and fmt is not None and isinstance(w, np.ndarray):
            w = quant.quantize(np.asarray(w, np.float32), fmt)
        got[name] = w
    embed = got["model.embed_tokens.weight"]
    if cfg.tie_embeddings:
        lm_head = quant.quantize(np.asarray(embed, np.float32), fmt) if fmt and isinstance(embed, np.ndarray) else embed
    else:
        lm_head = got["lm_head.weight"]
    return ModelWeights(cfg, embed, [_layer(cfg, got, i) for i in range(cfg.n_layers)], got["model.norm.weight"],
                        lm_head)


def _layer(cfg: ModelConfig, got: dict[str, Weight], i: int) -> LayerWeights:
    p = f"model.layers.{i}."
    a = p + "self_attn."
    lw = LayerWeights(attn_norm=got[p + "input_layernorm.weight"], wq=got[a + "q_proj.weight"],
                      wk=got[a + "k_proj.weight"], wv=got[a + "v_proj.weight"], wo=got[a + "o_proj.weight"],
                      ffn_norm=got[p + "post_attention_layernorm.weight"])
    if cfg.arch == "gemma2":
        lw.post_attn_norm, lw.ffn_norm = lw.ffn_norm, got[p + "pre_feedforward_layernorm.weight"]
        lw.post_ffn_norm = got[p + "post_feedforward_layernorm.weight"]
    if cfg.attn_bias:
        lw.bq, lw.bk, lw.bv = (got[a + f"{n}_proj.bias"] for n in "qkv")
    if cfg.is_moe:
        m = p + "block_sparse_moe."
        lw.router = got[m + "gate.weight"]
        lw.experts = [ExpertWeights(got[m + f"experts.{e}.w1.weight"], got[m + f"experts.{e}.w3.weight"],
                                    got[m + f"experts.{e}.w2.weight"]) for e in range(cfg.n_experts)]
    else:
        lw.w_gate, lw.w_up, lw.w_down = (got[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
    return lw


# ---- safetensors ---------------------------------------------------------------------------------------------

# numpy dtypes by file type name; bfloat16's (ml_dtypes) is resolved on first use, not when vkgraph.nn is imported
_FLOATS = {"F32": dtypes.float32, "F16": dtypes.float16, "BF16": dtypes.bfloat16}


class _SafetensorsSource:
    """Parses the (tiny) safetensors header itself and memory-maps the data, so tensors are zero-copy views
    (the `safetensors` package's numpy API copies each tensor and has no bfloat16)."""

    def __init__(self, files: list[Path], config: ModelConfig) -> None:
        self.config = config
        self.index: dict[str, tuple[np.memmap, dict[str, Any], Path]] = {}
        for f in files:
            mm, header = _open_safetensors(f)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if name in self.index:
                    raise ModelFormatError(f"tensor {name} appears in both {self.index[name][2].name} and {f.name}")
                self.index[name] = (mm, info, f)
        self.capacity = len(self.index)

    def has(self, name: str) -> bool:
        return name in self.index

    def get(self, name: str) -> Weight:
        mm, info, f = self.index[name]
        stored = _FLOATS.get(info["dtype"])
        if stored is None:
            raise UnsupportedTensorTypeError(f"{f.name}: {name} is {info['dtype']}; supported: {sorted(_FLOATS)}")
        dt = stored.np
        start, end = info["data_offsets"]  # checked against the shape and the file by read_safetensors_header
        return mm[start:end].view(dt).reshape(tuple(info["shape"]))


# Phi-3 stores q/k/v as one matrix and gate/up as another, rows in that order: each projection is a row range
# of the fused tensor (exact for quantized rows too, as rows are independent blocks)
_FUSED = {"self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
          "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
          "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
          "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0), "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1)}


class _FusedSource:
    """The per-projection tensors of a source that stores them fused (Phi-3), by Hugging Face name."""

    def __init__(self, inner: _Source) -> None:
        self.inner, self.config, self.capacity = inner, inner.config, inner.capacity

    def _part(self, name: str) -> tuple[str, list[int], int] | None:
        m = _LAYER_RE.fullmatch(name)
        if m is None or m.group(2) not in _FUSED:
            return None
        fused, i = _FUSED[m.group(2)]
        c = self.config
        q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        return f"model.layers.{m.group(1)}.{fused}", [q, kv, kv] if "qkv" in fused else [c.ffn_dim] * 2, i

    def has(self, name: str) -> bool:
        part = self._part(name)
        return self.inner.has(part[0] if part else name)

    def get(self, name: str) -> Weight:
        part = self._part(name)
        if part is None:
            return self.inner.get(name)
        fused, sizes, i = part
        w = self.inner.get(fused)
        if len(w.shape) != 2 or w.shape[0] != sum(sizes):
            raise ShapeMismatchError(f"{fused} has shape {tuple(w.shape)}, the config implies {sum(sizes)} rows")
        rows = slice(sum(sizes[:i]), sum(sizes[:i + 1]))
        if isinstance(w, QuantizedTensor):
            return QuantizedTensor(np.ascontiguousarray(w.data[rows]), w.format, (sizes[i], w.shape[1]))
        return w[rows]


def _open_safetensors(f: Path) -> tuple[np.memmap, dict[str, Any]]:
    header, offset, data_len = read_safetensors_header(f)
    return np.memmap(f, np.uint8, "r", offset=offset, shape=(data_len,)), header


# ---- GGUF -----------------------------------------------------------------------------------------------------

_GGUF_QUANT = tuple(n for n in quant.FORMATS if n not in _FLOATS)

_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # Phi-3's fused tensors (gate and up share ffn_up)
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
# Gemma 2's four norms a layer: Hugging Face's post_attention_layernorm is the attention output's norm there
_GGUF_GEMMA2 = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
_GGUF_EXPERTS = {"w1": "ffn_gate_exps.weight", "w3": "ffn_up_exps.weight", "w2": "ffn_down_exps.weight"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")


def gguf_name(hf_name: str, arch: str = "llama") -> tuple[str, int | None]:
    """The GGUF tensor holding a Hugging Face tensor of an `arch` model, and the expert index within it for stacked
    experts."""
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name], None
    m = _LAYER_RE.fullmatch(hf_name)
    if m:
        layer, rest = m.groups()
        if arch == "gemma2" and rest in _GGUF_GEMMA2:
            return f"blk.{layer}.{_GGUF_GEMMA2[rest]}", None
        if rest in _GGUF_LAYER:
            return f"blk.{layer}.{_GGUF_LAYER[rest]}", None
        e = _EXPERT_RE.fullmatch(rest)
        if e:
            return f"blk.{layer}.{_GGUF_EXPERTS[e.group(2)]}", int(e.group(1))
    raise KeyError(f"no GGUF name for {hf_name}")


class _GGUFSource:
    def __init__(self, path: Path, reader: Any) -> None:
        self.path = path
        self.reader = reader
        self.config = ModelConfig.from_gguf(self.reader)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.capacity = sum(max(1, int(t.n_elements) // max(1, int(t.shape[0]) * int(t.shape[1])))
                            if len(t.shape) > 2 else 1 for t in self.reader.tensors)
        # llama.cpp's converter interleaves q/k rows of "llama" models for its RoPE; undo it (module docstring)
        self.unpermute = self.config.arch == "llama"

    def has(self, name: str) -> bool:
        return gguf_name(name, self.config.arch)[0] in self.tensors

    def get(self, name: str) -> Weight:
        gname, expert = gguf_name(name, self.config.arch)
        t = self.tensors[gname]
        kind = t.tensor_type.name
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dimensions innermost first
        if kind in _FLOATS:
            arr = np.asarray(t.data).view(np.uint8).view(_FLOATS[kind].np).reshape(shape)
            out: Weight = arr if expert is None else arr[expert]
        elif kind in _GGUF_QUANT:
            raw = np.asarray(t.data).view(np.uint8)
            if expert is not None:
                raw, shape = raw[expert], shape[1:]
            if len(shape) == 2:
                out = QuantizedTensor.from_raw(raw, kind, shape)
            else:  # a quantized vector: return (and shape-check) what it encodes
                out = QuantizedTensor.from_raw(raw, kind, (1, int(np.prod(shape)))).dequantize().reshape(shape)
        else:
            raise UnsupportedTensorTypeError(f"{self.path.name}: {gname} is {kind}; supported: "
                                             f"{sorted(_FLOATS) + list(_GGUF_QUANT)}")
        if self.unpermute and gname.endswith(("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")):
            heads = self.config.n_heads if ".attn_q." in gname else self.config.n_kv_heads
            if out.shape[0] == heads * self.config.head_dim:  # otherwise the caller's shape check reports it
                out = unpermute_rope_rows(out, heads)
        return out


def unpermute_rope_rows(w: Weight, n_heads: int) -> Weight:
    """Reorder rows of a q or k projection from llama.cpp's adjacent-pair RoPE layout to Hugging Face's
    rotate-half layout (the inverse of convert_hf_to_gguf.py's `permute`)."""
    data = w.data if isinstance(w, QuantizedTensor) else w
    rows = data.shape[0]
    out = np.ascontiguousarray(data.reshape(n_heads, rows // n_heads // 2, 2, *data.shape[1:]).swapaxes(1, 2)
                               ).reshape(data.shape)
    return QuantizedTensor(out, w.format, w.shape) if isinstance(w, QuantizedTensor) else out


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face rotate-half rows -> llama.cpp's adjacent pairs (what convert_hf_to_gguf.py writes)."""
    rows = w.shape[0]
    return np.ascontiguousarray(w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2)
                                ).reshape(w.shape)

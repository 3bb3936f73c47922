"""The shape of a Llama-family model, read from a Hugging Face config.json or from GGUF metadata.

Supported: Llama (1/2/3, with Llama 3's RoPE scaling or linear scaling), Mistral and Mixtral (mixture of experts
with softmax router, top-k and renormalised weights), Qwen2 (q/k/v biases). Anything else raises
`UnsupportedModelError` here, before any weight is read.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np


class ModelFormatError(ValueError):
    """A model file or config that vkgraph cannot use; the message says what and where."""


class UnsupportedModelError(ModelFormatError):
    """An architecture, RoPE variant or other feature that vkgraph does not implement."""


# Hugging Face model_type -> our architecture name (Mistral and Mixtral are Llama-shaped; GGUF calls them "llama")
HF_ARCHS = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2"}
GGUF_ARCHS = ("llama", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """`linear` divides every frequency by `factor`; `llama3` divides only the low ones, smoothly (Llama 3.1)."""

    type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.type not in ("linear", "llama3"):
            raise UnsupportedModelError(f"RoPE scaling {self.type!r} is not supported (supported: linear, llama3)")


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" (also Mistral, Mixtral) or "qwen2"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int  # per expert for MoE models
    head_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # GGUF stores Llama 3's scaling as a per-frequency divisor tensor (rope_freqs.weight) instead of parameters
    rope_freq_factors: tuple[float, ...] | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    attn_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    n_experts: int = 0  # 0: dense SwiGLU MLP
    n_experts_per_tok: int = 0

    def __post_init__(self) -> None:
        if self.arch not in GGUF_ARCHS:
            raise UnsupportedModelError(f"architecture {self.arch!r} is not supported (supported: {GGUF_ARCHS})")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelFormatError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ModelFormatError(f"config: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ModelFormatError(f"config: head_dim {self.head_dim} must be even for RoPE")
        if self.n_experts and not 0 < self.n_experts_per_tok <= self.n_experts:
            raise ModelFormatError(f"config: n_experts_per_tok {self.n_experts_per_tok} must be in 1..{self.n_experts}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ModelFormatError(f"config: {len(self.rope_freq_factors)} RoPE frequency factors for head_dim "
                                   f"{self.head_dim} (want {self.head_dim // 2})")

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def rope_inv_freq(self) -> np.ndarray:
        """float64 [head_dim // 2]: the angle per position of each rotated pair, scaling applied.
        The one place the model code and the numpy reference get RoPE frequencies from."""
        inv = 1.0 / self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        if self.rope_freq_factors is not None:
            return inv / np.asarray(self.rope_freq_factors, np.float64)
        s = self.rope_scaling
        if s is None:
            return inv
        if s.type == "linear":
            return inv / s.factor
        return inv / llama3_freq_factors(inv, s)

    @classmethod
    def from_hf(cls, source: str | Path | dict[str, Any]) -> ModelConfig:
        """From a config.json path, a directory holding one, or its parsed dict."""
        if isinstance(source, dict):
            hf = source
        else:
            p = Path(source)
            p = p / "config.json" if p.is_dir() else p
            try:
                hf = json.loads(p.read_text())
            except FileNotFoundError:
                raise ModelFormatError(f"no config.json at {p}") from None
        model_type = hf.get("model_type")
        if model_type not in HF_ARCHS:
            raise UnsupportedModelError(f"model_type {model_type!r} is not supported (supported: {sorted(HF_ARCHS)})")
        try:
            n_heads = int(hf["num_attention_heads"])
            dim = int(hf["hidden_size"])
            n_experts = int(hf.get("num_local_experts", 0) or 0)
            return cls(
                arch=HF_ARCHS[model_type],
                vocab_size=int(hf["vocab_size"]),
                dim=dim,
                n_layers=int(hf["num_hidden_layers"]),
                n_heads=n_heads,
                n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
                ffn_dim=int(hf["intermediate_size"]),
                head_dim=int(hf.get("head_dim") or dim // n_heads),
                norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                rope_theta=float(hf.get("rope_theta", 10000.0)),
                rope_scaling=_hf_rope_scaling(hf.get("rope_scaling")),
                max_seq_len=int(hf.get("max_position_embeddings", 2048)),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attn_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
                n_experts=n_experts,
                n_experts_per_tok=int(hf.get("num_experts_per_tok", 0)) if n_experts else 0,
            )
        except KeyError as e:
            raise ModelFormatError(f"config.json lacks {e.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that `from_hf` reads back to this config (GGUF-only fields excepted)."""
        hf: dict[str, Any] = {
            "architectures": ["MixtralForCausalLM" if self.is_moe else
                              "Qwen2ForCausalLM" if self.arch == "qwen2" else "LlamaForCausalLM"],
            "model_type": "mixtral" if self.is_moe else self.arch,
            "vocab_size": self.vocab_size, "hidden_size": self.dim, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads,
            "intermediate_size": self.ffn_dim, "head_dim": self.head_dim, "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_embeddings, "attention_bias": self.attn_bias,
            "hidden_act": "silu", "torch_dtype": "float32",
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = {"rope_type": self.rope_scaling.type,
                                  **{k: v for k, v in asdict(self.rope_scaling).items() if k != "type"}}
        if self.is_moe:
            hf["num_local_experts"] = self.n_experts
            hf["num_experts_per_tok"] = self.n_experts_per_tok
        return hf

    @classmethod
    def from_gguf(cls, reader: Any) -> ModelConfig:
        """From a `gguf.GGUFReader` (the tensor list settles tied embeddings and Llama 3's frequency factors)."""
        arch = gguf_value(reader, "general.architecture")
        if arch not in GGUF_ARCHS:
            raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (supported: {GGUF_ARCHS})")

        def get(key: str, default: Any = None) -> Any:
            v = gguf_value(reader, f"{arch}.{key}", default)
            if v is None:
                raise ModelFormatError(f"GGUF metadata lacks {arch}.{key}")
            return v

        tensors = {t.name: t for t in reader.tensors}
        if "token_embd.weight" not in tensors:
            raise ModelFormatError("GGUF file has no token_embd.weight")
        n_heads = int(get("attention.head_count"))
        dim = int(get("embedding_length"))
        head_dim = int(get("attention.key_length", dim // n_heads))
        if int(get("rope.dimension_count", head_dim)) != head_dim:
            raise UnsupportedModelError("partial rotary embeddings (rope.dimension_count < head_dim) are not supported")
        vocab = get("vocab_size", int(tensors["token_embd.weight"].shape[1]))
        scaling = None
        kind = get("rope.scaling.type", "none")
        if kind == "linear":
            scaling = RopeScaling("linear", _f32(get("rope.scaling.factor")))
        elif kind != "none":
            raise UnsupportedModelError(f"RoPE scaling {kind!r} is not supported (supported: linear, llama3)")
        freqs = tensors.get("rope_freqs.weight")
        n_experts = int(get("expert_count", 0))
        return cls(
            arch=arch,
            vocab_size=int(vocab),
            dim=dim,
            n_layers=int(get("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)),
            ffn_dim=int(get("expert_feed_forward_length", 0) or get("feed_forward_length")),
            head_dim=head_dim,
            norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=_f32(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rope_freq_factors=None if freqs is None else tuple(float(x) for x in np.asarray(freqs.data).ravel()),
            max_seq_len=int(get("context_length", 2048)),
            tie_embeddings="output.weight" not in tensors,
            attn_bias="blk.0.attn_q.bias" in tensors,
            n_experts=n_experts,
            n_experts_per_tok=int(get("expert_used_count", 0)) if n_experts else 0,
        )


def llama3_freq_factors(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1's divisor per frequency: 1 for short wavelengths, `factor` for long ones, smooth in between.
    The same numbers llama.cpp's converter stores as rope_freqs.weight."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor
                                                                                   - s.low_freq_factor)
    mid = 1.0 / ((1 - smooth) / s.factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, s.factor, mid))


def _f32(v: float) -> float:
    """GGUF stores these as float32: take the shortest decimal that rounds to it (1e-05, not 9.99999974e-06),
    so a GGUF config equals the config.json it was converted from."""
    return float(str(np.float32(v)))


def _hf_rope_scaling(rs: dict[str, Any] | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(rs["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", float(rs["factor"]), float(rs.get("low_freq_factor", 1.0)),
                           float(rs.get("high_freq_factor", 4.0)),
                           int(rs.get("original_max_position_embeddings", 8192)))
    raise UnsupportedModelError(f"RoPE scaling {kind!r} is not supported (supported: linear, llama3)")


def gguf_value(reader: Any, key: str, default: Any = None) -> Any:
    """A GGUF metadata value as a Python scalar, str or list (`default` when the key is absent)."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        return default

    def one(part: np.ndarray, vtype: GGUFValueType) -> Any:
        return bytes(part).decode("utf-8") if vtype == GGUFValueType.STRING else part.tolist()[0]

    if field.types[0] == GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])

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
HF_ARCHS = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "phi3": "phi3",
            "gemma": "gemma", "gemma2": "gemma2"}
GGUF_ARCHS = ("llama", "qwen2", "phi3", "gemma", "gemma2")
GEMMA_ARCHS = ("gemma", "gemma2")  # GeGLU with tanh GELU, the embedding scaled by sqrt(dim), norms scaling by 1 + w


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
        _check_float("rope_scaling.factor", self.factor, lo=0.0)
        if self.type == "llama3":
            _check_float("rope_scaling.low_freq_factor", self.low_freq_factor, lo=0.0)
            _check_float("rope_scaling.high_freq_factor", self.high_freq_factor, lo=self.low_freq_factor)
            _check_int("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings)


@dataclass(frozen=True)
class ModelConfig:
    # "llama" (also Mistral, Mixtral), "qwen2", "phi3" (Llama's blocks with fused qkv and gate/up), "gemma" (GeGLU
    # with tanh GELU, the embedding scaled by sqrt(dim), norms scaling by 1 + w: stored so in GGUF, added on load) or
    # "gemma2" (Gemma's, plus a norm after the attention and after the MLP, soft-capped attention scores and
    # logits, and a sliding window on every other layer, the first included)
    arch: str
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
    attn_softcap: float = 0.0  # > 0: attention scores become cap * tanh(score / cap) (Gemma 2); 0: none
    final_softcap: float = 0.0  # the same for the logits
    sliding_window: int = 0  # > 0: even layers see only the last `sliding_window` positions (Gemma 2)
    query_pre_attn_scalar: float | None = None  # scores scale by its -1/2 power (Gemma 2); None: head_dim's

    @property
    def is_gemma(self) -> bool:
        return self.arch in GEMMA_ARCHS

    @property
    def attn_scale(self) -> float:
        """What the attention multiplies q . k by before the softmax."""
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    def layer_window(self, i: int) -> int:
        """The sliding window of layer i (0: none): Gemma 2 alternates, starting with a sliding layer."""
        return self.sliding_window if self.sliding_window and i % 2 == 0 else 0

    def __post_init__(self) -> None:
        if self.arch not in GGUF_ARCHS:
            raise UnsupportedModelError(f"architecture {self.arch!r} is not supported (supported: {GGUF_ARCHS})")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim", "max_seq_len"):
            _check_int(name, getattr(self, name))
        for name in ("n_experts", "n_experts_per_tok", "sliding_window"):
            _check_int(name, getattr(self, name), lo=0)
        for name in ("attn_softcap", "final_softcap"):  # 0 is none
            if getattr(self, name) != 0:
                _check_float(name, getattr(self, name), lo=0.0)
        if self.query_pre_attn_scalar is not None:
            _check_float("query_pre_attn_scalar", self.query_pre_attn_scalar, lo=0.0)
        for name in ("tie_embeddings", "attn_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ModelFormatError(f"config: {name} must be true or false, got {getattr(self, name)!r}")
        _check_float("norm_eps", self.norm_eps, lo=0.0, hi=1.0)  # past 1 it outweighs the activations
        _check_float("rope_theta", self.rope_theta, lo=1.0)  # the base of decreasing frequencies
        if self.rope_freq_factors is not None:
            for f in self.rope_freq_factors:
                _check_float("rope_freq_factors", f, lo=0.0)
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
                hf = json.loads(p.read_bytes())
            except FileNotFoundError:
                raise ModelFormatError(f"no config.json at {p}") from None
            except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested past the stack
                raise ModelFormatError(f"{p}: unreadable ({type(e).__name__}: {e})") from None
        if not isinstance(hf, dict):
            raise ModelFormatError(f"config.json holds a {type(hf).__name__}, not an object")
        model_type = hf.get("model_type")
        if not isinstance(model_type, str) or model_type not in HF_ARCHS:
            raise UnsupportedModelError(f"model_type {model_type!r:.60} is not supported "
                                        f"(supported: {sorted(HF_ARCHS)})")
        f = _Fields(hf.get, "config.json: ")
        if hf.get("partial_rotary_factor", 1.0) != 1.0:  # Phi-4-mini's model_type is phi3 too
            raise UnsupportedModelError(f"partial rotary embeddings (partial_rotary_factor "
                                        f"{hf['partial_rotary_factor']!r:.20}) are not supported")
        n_heads = f.int("num_attention_heads")
        dim = f.int("hidden_size")
        head_dim = _head_dim(f.int("head_dim", None), dim, n_heads,
                             f"config.json: hidden_size {dim} is not a multiple of num_attention_heads {n_heads} "
                             "(and no head_dim is given)")
        n_experts = f.int("num_local_experts", 0, lo=0)
        max_seq_len = f.int("max_position_embeddings", 2048)
        # Mistral 7B v0.1 attends over a sliding window of 4096; the attention here has none for these models, so
        # the context stops at the window, within which the two agree exactly (Qwen2 names a window it does not
        # use unless use_sliding_window)
        window = hf.get("sliding_window")
        gemma2 = {}
        if model_type == "gemma2":  # the window is the sliding layers' own; null caps mean none
            def cap(key: str) -> float:
                return 0.0 if hf.get(key) is None else f.float(key, lo=0.0)

            gemma2 = dict(attn_softcap=cap("attn_logit_softcapping"), final_softcap=cap("final_logit_softcapping"),
                          sliding_window=f.int("sliding_window", 0, lo=0) or 0,
                          query_pre_attn_scalar=f.float("query_pre_attn_scalar", head_dim, lo=0.0))
        elif (isinstance(window, int) and not isinstance(window, bool) and 0 < window < max_seq_len
                and (model_type != "qwen2" or hf.get("use_sliding_window") is True)):
            max_seq_len = window
        return cls(
            arch=HF_ARCHS[model_type],
            vocab_size=f.int("vocab_size"),
            dim=dim,
            n_layers=f.int("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=f.int("num_key_value_heads", n_heads),
            ffn_dim=f.int("intermediate_size"),
            head_dim=head_dim,
            norm_eps=f.float("rms_norm_eps", 1e-5, lo=0.0, hi=1.0),
            rope_theta=f.float("rope_theta", 10000.0, lo=1.0),
            rope_scaling=_hf_rope_scaling(hf.get("rope_scaling")),
            max_seq_len=max_seq_len,
            tie_embeddings=f.bool("tie_word_embeddings", model_type in GEMMA_ARCHS),
            attn_bias=model_type == "qwen2" or f.bool("attention_bias", False),
            n_experts=n_experts,
            n_experts_per_tok=f.int("num_experts_per_tok") if n_experts else 0,
            **gemma2,
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that `from_hf` reads back to this config (GGUF-only fields excepted)."""
        hf: dict[str, Any] = {
            "architectures": ["MixtralForCausalLM" if self.is_moe else
                              {"qwen2": "Qwen2ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
                               "gemma2": "Gemma2ForCausalLM"}.get(self.arch, "LlamaForCausalLM")],
            "model_type": "mixtral" if self.is_moe else self.arch,
            "vocab_size": self.vocab_size, "hidden_size": self.dim, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads,
            "intermediate_size": self.ffn_dim, "head_dim": self.head_dim, "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_embeddings, "attention_bias": self.attn_bias,
            "hidden_act": "gelu_pytorch_tanh" if self.is_gemma else "silu", "torch_dtype": "float32",
        }
        if self.arch == "gemma2":
            hf |= {"hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": self.attn_softcap or None,
                   "final_logit_softcapping": self.final_softcap or None, "sliding_window": self.sliding_window,
                   "query_pre_attn_scalar": self.query_pre_attn_scalar or self.head_dim}
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
        if not isinstance(arch, str) or arch not in GGUF_ARCHS:
            raise UnsupportedModelError(f"GGUF architecture {arch!r:.60} is not supported (supported: {GGUF_ARCHS})")
        f = _Fields(lambda key: gguf_value(reader, f"{arch}.{key}"), f"GGUF metadata {arch}.")
        tensors = {t.name: t for t in reader.tensors}
        embd = tensors.get("token_embd.weight")
        if embd is None or len(embd.shape) != 2:
            raise ModelFormatError("GGUF file has no two-dimensional token_embd.weight")
        n_heads = f.int("attention.head_count")
        dim = f.int("embedding_length")
        head_dim = _head_dim(f.int("attention.key_length", None), dim, n_heads,
                             f"GGUF metadata: {arch}.embedding_length {dim} is not a multiple of "
                             f"{arch}.attention.head_count {n_heads} (and no key_length is given)")
        if f.int("rope.dimension_count", head_dim) != head_dim:
            raise UnsupportedModelError("partial rotary embeddings (rope.dimension_count < head_dim) are not supported")
        scaling = None
        kind = f.str("rope.scaling.type", "none")
        if kind == "linear":
            scaling = RopeScaling("linear", _f32(f.float("rope.scaling.factor", lo=0.0)))
        elif kind != "none":
            raise UnsupportedModelError(f"RoPE scaling {kind!r:.60} is not supported (supported: linear, llama3)")
        freqs = tensors.get("rope_freqs.weight")
        if freqs is not None and (freqs.tensor_type.name != "F32" or freqs.n_elements != head_dim // 2):
            raise ModelFormatError(f"GGUF rope_freqs.weight: {freqs.n_elements} {freqs.tensor_type.name} values, "
                                   f"want {head_dim // 2} F32 (head_dim {head_dim} / 2)")
        if "rope_factors_long.weight" in tensors:
            raise UnsupportedModelError("long-context RoPE factors (Phi-3's rope_factors_long/short, 'longrope') "
                                        "are not supported")
        n_experts = f.int("expert_count", 0, lo=0)
        ffn = f.int("expert_feed_forward_length", None) if n_experts else None
        max_seq_len = f.int("context_length", 2048)
        window = f.int("attention.sliding_window", None)
        gemma2 = {}
        if arch == "gemma2":  # llama.cpp's defaults for missing caps; its query scale (27B: dim / heads)
            n_layers = f.int("block_count")
            gemma2 = dict(attn_softcap=_f32(f.float("attn_logit_softcapping", 50.0, lo=0.0)),
                          final_softcap=_f32(f.float("final_logit_softcapping", 30.0, lo=0.0)),
                          sliding_window=f.int("attention.sliding_window", lo=0),
                          query_pre_attn_scalar=dim // n_heads if n_layers == 46 else head_dim)
        elif window is not None and 0 < window < max_seq_len:  # as from_hf: the window bounds the context
            max_seq_len = window
        return cls(
            arch=arch,
            vocab_size=f.int("vocab_size", int(embd.shape[1])),
            dim=dim,
            n_layers=f.int("block_count"),
            n_heads=n_heads,
            n_kv_heads=f.int("attention.head_count_kv", n_heads),
            ffn_dim=ffn or f.int("feed_forward_length"),
            head_dim=head_dim,
            norm_eps=_f32(f.float("attention.layer_norm_rms_epsilon", 1e-5, lo=0.0, hi=1.0)),
            rope_theta=_f32(f.float("rope.freq_base", 10000.0, lo=1.0)),
            rope_scaling=scaling,
            rope_freq_factors=None if freqs is None else tuple(float(x) for x in np.asarray(freqs.data).ravel()),
            max_seq_len=max_seq_len,
            tie_embeddings="output.weight" not in tensors,
            attn_bias="blk.0.attn_q.bias" in tensors,
            n_experts=n_experts,
            n_experts_per_tok=f.int("expert_used_count") if n_experts else 0,
            **gemma2,
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


def _hf_rope_scaling(rs: Any) -> RopeScaling | None:
    if not rs:
        return None
    if not isinstance(rs, dict):
        raise ModelFormatError(f"config.json: rope_scaling must be an object, got {rs!r:.60}")
    kind = rs.get("rope_type", rs.get("type"))
    if not isinstance(kind, str):
        raise ModelFormatError(f"config.json: rope_scaling.rope_type must be a string, got {kind!r:.60}")
    if kind == "default":
        return None
    f = _Fields(rs.get, "config.json: rope_scaling.")
    if kind == "linear":
        return RopeScaling("linear", f.float("factor", lo=0.0))
    if kind == "llama3":
        low = f.float("low_freq_factor", 1.0, lo=0.0)
        return RopeScaling("llama3", f.float("factor", lo=0.0), low, f.float("high_freq_factor", 4.0, lo=low),
                           f.int("original_max_position_embeddings", 8192))
    raise UnsupportedModelError(f"RoPE scaling {kind!r:.60} is not supported (supported: linear, llama3)")


_REQUIRED = object()


class _Fields:
    """Typed, range-checked fields of a config; every error names the field and where it came from. `get(key)`
    gives a field's value or None when absent; a default of None lets an absent field through as None."""

    def __init__(self, get: Any, where: str) -> None:
        self.get, self.where = get, where

    def _value(self, key: str, default: Any) -> Any:
        v = self.get(key)
        if v is None:
            if default is _REQUIRED:
                raise ModelFormatError(f"{self.where}{key} is missing")
            return default
        return v

    def int(self, key: str, default: Any = _REQUIRED, *, lo: int = 1) -> Any:
        v = self._value(key, default)
        if v is None:
            return None
        if isinstance(v, float) and v.is_integer():  # 4096.0 is 4096; 64.7 is an error
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ModelFormatError(f"{self.where}{key} must be an integer >= {lo}, got {v!r:.60}")
        return v

    def float(self, key: str, default: Any = _REQUIRED, *, lo: float, hi: float = math.inf) -> float:
        v = self._value(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo < v < hi:
            bound = f"in ({lo}, {hi})" if hi < math.inf else f"> {lo}"
            raise ModelFormatError(f"{self.where}{key} must be a finite number {bound}, got {v!r:.60}")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self._value(key, default)
        if not isinstance(v, bool):
            raise ModelFormatError(f"{self.where}{key} must be true or false, got {v!r:.60}")
        return v

    def str(self, key: str, default: str) -> str:
        v = self._value(key, default)
        if not isinstance(v, str):
            raise ModelFormatError(f"{self.where}{key} must be a string, got {v!r:.60}")
        return v


def _head_dim(given: int | None, dim: int, n_heads: int, error: str) -> int:
    """The head size a config gives, else dim / n_heads, which must then divide evenly (else `error`)."""
    if given is not None:
        return given
    if dim % n_heads:
        raise ModelFormatError(error)
    return dim // n_heads


def _check_int(name: str, v: Any, lo: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ModelFormatError(f"config: {name} must be an integer >= {lo}, got {v!r:.60}")


def _check_float(name: str, v: Any, lo: float, hi: float = math.inf) -> None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo < v < hi:
        raise ModelFormatError(f"config: {name} must be a finite number in ({lo}, {hi}), got {v!r:.60}")


def gguf_value(reader: Any, key: str, default: Any = None) -> Any:
    """A GGUF metadata value as a Python scalar, str or list (`default` when the key is absent)."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        return default

    def one(part: np.ndarray, vtype: GGUFValueType) -> Any:
        if vtype != GGUFValueType.STRING:
            return part.tolist()[0]
        try:
            return bytes(part).decode("utf-8")
        except UnicodeDecodeError as e:  # GGUF strings are UTF-8: a file that says otherwise is damaged
            raise ModelFormatError(f"GGUF metadata {key}: a string that is not UTF-8 ({e.reason} at byte "
                                   f"{e.start})") from None

    if field.types[0] == GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])

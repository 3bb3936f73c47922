"""A numpy reference of the Llama-family forward pass, to check vkgraph's model code against.

Plain and slow on purpose: float64 by default, one function per piece, no paging. It consumes the same
`ModelWeights` the loader returns (quantized tensors are dequantized), uses Hugging Face's rotate-half RoPE
layout (the one the loader guarantees) and `ModelConfig.rope_inv_freq` for RoPE frequencies (Llama 3 scaling
included). Supports GQA, q/k/v biases, RMSNorm, SwiGLU, Gemma's GeGLU and embedding scale, Gemma 2's norms after
attention and MLP, soft-capped scores and logits and sliding window on even layers, and the Mixtral mixture of
experts (router softmax, top-k, renormalised weights).

`vkgraph.nn.tiny_model` writes the models this reference runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vkgraph.nn.config import ModelConfig
from vkgraph.nn.weights import ModelWeights, Weight
from vkgraph.quant import QuantizedTensor


def to_float(w: Weight | None, dtype: type = np.float64) -> np.ndarray | None:
    if w is None:
        return None
    return (w.dequantize() if isinstance(w, QuantizedTensor) else np.asarray(w, np.float32)).astype(dtype)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """x: [tokens, heads, head_dim]; dimension j rotates with j + head_dim/2 by angle position * inv_freq[j]."""
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :]
    cos, sin = np.cos(ang)[:, None, :].astype(x.dtype), np.sin(ang)[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, scale: float | None = None,
              softcap: float = 0.0, window: int = 0) -> np.ndarray:
    """q: [T, H, D] at positions q_pos; k, v: [S, Hkv, D] at positions 0..S-1. Causal, grouped-query; scores times
    `scale` (default 1/sqrt(D)), then softcap * tanh(score / softcap) where softcap > 0; window > 0: a query sees
    only the last `window` positions."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    if scale is None:
        scores = np.einsum("thd,shd->hts", q, k) / q.dtype.type(np.sqrt(q.shape[-1]))
    else:
        scores = np.einsum("thd,shd->hts", q, k) * q.dtype.type(scale)
    if softcap:
        scores = np.tanh(scores / q.dtype.type(softcap)) * q.dtype.type(softcap)
    mask = np.arange(k.shape[0])[None, :] > q_pos[:, None]
    if window:
        mask |= np.arange(k.shape[0])[None, :] + window <= q_pos[:, None]
    scores = np.where(mask[None], -np.inf, scores)
    return np.einsum("hts,shd->thd", softmax(scores), v)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, act=silu) -> np.ndarray:
    """down(act(gate x) * up x): SwiGLU, or GeGLU with act=gelu_tanh (Gemma)."""
    return (act(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def moe(x: np.ndarray, router: np.ndarray, experts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        top_k: int) -> np.ndarray:
    """Mixtral's block: softmax over all experts, keep the top k per token, renormalise their weights to 1."""
    probs = softmax(x @ router.T)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(probs, top, axis=-1)
    w = w / w.sum(axis=-1, keepdims=True)
    out = np.zeros_like(x)
    for e, (g, u, d) in enumerate(experts):
        rows, slot = np.nonzero(top == e)
        if rows.size:
            out[rows] += w[rows, slot][:, None] * swiglu(x[rows], g, u, d)
    return out


@dataclass
class RefCache:
    """Per layer, keys and values of every position so far: [positions, n_kv_heads, head_dim]."""

    k: list[np.ndarray] = field(default_factory=list)
    v: list[np.ndarray] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.k[0].shape[0] if self.k else 0


class ReferenceLlama:
    def __init__(self, weights: ModelWeights, dtype: type = np.float64) -> None:
        self.cfg: ModelConfig = weights.config
        self.dtype = dtype
        f = lambda w: to_float(w, dtype)
        self.embed = f(weights.embed)
        self.norm = f(weights.norm)
        self.lm_head = f(weights.lm_head)
        self.layers = []
        for lw in weights.layers:
            layer = {n: f(getattr(lw, n)) for n in ("attn_norm", "ffn_norm", "wq", "wk", "wv", "wo", "bq", "bk",
                                                    "bv", "w_gate", "w_up", "w_down", "router", "post_attn_norm",
                                                    "post_ffn_norm")}
            layer["experts"] = [(f(e.w_gate), f(e.w_up), f(e.w_down)) for e in lw.experts or []]
            self.layers.append(layer)
        self.inv_freq = self.cfg.rope_inv_freq()

    def forward(self, tokens: Sequence[int], cache: RefCache | None = None) -> np.ndarray:
        """Logits [len(tokens), vocab] for tokens at positions cache.length.. ; appends their keys and values
        to the cache (prefill: an empty cache and the prompt; decode: one token at a time)."""
        c = self.cfg
        start = cache.length if cache is not None else 0
        pos = np.arange(start, start + len(tokens))
        x = self.embed[np.asarray(tokens)]
        if c.is_gemma:  # embeddings scaled by sqrt(dim) (a float32 constant in Hugging Face's Gemma)
            x = x * np.float32(np.sqrt(c.dim))
        for i, L in enumerate(self.layers):
            h = rms_norm(x, L["attn_norm"], c.norm_eps)
            q, k, v = h @ L["wq"].T, h @ L["wk"].T, h @ L["wv"].T
            if c.attn_bias:
                q, k, v = q + L["bq"], k + L["bk"], v + L["bv"]
            q = rope(q.reshape(len(tokens), c.n_heads, c.head_dim), pos, self.inv_freq)
            k = rope(k.reshape(len(tokens), c.n_kv_heads, c.head_dim), pos, self.inv_freq)
            v = v.reshape(len(tokens), c.n_kv_heads, c.head_dim)
            if cache is not None:
                if i < len(cache.k):
                    k = cache.k[i] = np.concatenate([cache.k[i], k])
                    v = cache.v[i] = np.concatenate([cache.v[i], v])
                else:
                    cache.k.append(k)
                    cache.v.append(v)
            scores = {"scale": c.attn_scale, "softcap": c.attn_softcap, "window": c.layer_window(i)}
            a = attention(q, k, v, pos, **scores).reshape(len(tokens), -1) @ L["wo"].T
            x = x + (a if L["post_attn_norm"] is None else rms_norm(a, L["post_attn_norm"], c.norm_eps))
            h = rms_norm(x, L["ffn_norm"], c.norm_eps)
            if c.is_moe:
                m = moe(h, L["router"], L["experts"], c.n_experts_per_tok)
            else:
                m = swiglu(h, L["w_gate"], L["w_up"], L["w_down"], gelu_tanh if c.is_gemma else silu)
            x = x + (m if L["post_ffn_norm"] is None else rms_norm(m, L["post_ffn_norm"], c.norm_eps))
        logits = rms_norm(x, self.norm, c.norm_eps) @ self.lm_head.T
        if c.final_softcap:
            logits = np.tanh(logits / logits.dtype.type(c.final_softcap)) * logits.dtype.type(c.final_softcap)
        return logits

    def greedy(self, prompt: Sequence[int], n_new: int) -> list[int]:
        """Greedy continuation through prefill plus incremental decode."""
        cache = RefCache()
        logits = self.forward(prompt, cache)
        out: list[int] = []
        for _ in range(n_new):
            out.append(int(np.argmax(logits[-1])))
            logits = self.forward([out[-1]], cache)
        return out

"""A Llama-family model (Llama 1-3, Mistral, Mixtral, Qwen2, Phi-3, Gemma, Gemma 2) written with vkgraph's layers.

    weights = load_weights("model.gguf")
    model = LlamaModel(weights, num_blocks=256)
    logits = model(tokens, step)          # tokens: int32 (T,), step: StepInputs

The forward pass is plain Tensor code: read it as the reference for writing your own model.
"""

from __future__ import annotations

import numpy as np

from ..tensor import Tensor, realize_all
from .config import ModelConfig
from .layers import MLP, Attention, Embedding, Linear, MoE, RMSNorm, RotaryEmbedding, StepInputs
from .template_ops import KVCache, decoding
from .weights import LayerWeights, ModelWeights


class TransformerBlock:
    def __init__(self, cfg: ModelConfig, w: LayerWeights, float_dtype: str, window: int = 0) -> None:
        self.attn_norm = RMSNorm(w.attn_norm, cfg.norm_eps)
        self.attn = Attention(cfg, w.wq, w.wk, w.wv, w.wo, w.bq, w.bk, w.bv, float_dtype=float_dtype, window=window)
        self.ffn_norm = RMSNorm(w.ffn_norm, cfg.norm_eps)
        if cfg.is_moe:
            self.ffn: MLP | MoE = MoE(w.router, w.experts, cfg.n_experts_per_tok, float_dtype)
        else:
            self.ffn = MLP(w.w_gate, w.w_up, w.w_down, float_dtype, gelu="tanh" if cfg.is_gemma else None)
        # Gemma 2 normalizes the attention's and the MLP's outputs before adding them to the residual stream
        self.post_norms = None if w.post_attn_norm is None else (RMSNorm(w.post_attn_norm, cfg.norm_eps),
                                                                 RMSNorm(w.post_ffn_norm, cfg.norm_eps))

    def __call__(self, x: Tensor, rope: tuple[Tensor, Tensor], cache: KVCache, step: StepInputs) -> Tensor:
        # each norm names the product it feeds, so it can write that product's int8 activations itself
        gate_up = self.ffn.gate_up if isinstance(self.ffn, MLP) else None
        if self.post_norms is not None:
            post_attn, post_ffn = self.post_norms
            x = x + post_attn(self.attn(self.attn_norm(x, into=self.attn.qkv), None, rope, cache, step))
            return x + post_ffn(self.ffn(self.ffn_norm(x, into=gate_up)))
        x = self.attn(self.attn_norm(x, into=self.attn.qkv), x, rope, cache, step)
        return self.ffn(self.ffn_norm(x, into=gate_up), residual=x)


class LlamaModel:
    """The model and its paged KV cache: `num_blocks` blocks of `block_size` tokens per layer, shared by all
    sequences through their block tables (vkgraph.nn.kv_cache.KVCacheManager hands them out). Float weight
    matrices are kept as `float_dtype` (float16 halves their memory and bandwidth; float32 is exact)."""

    def __init__(self, weights: ModelWeights, *, num_blocks: int, block_size: int = 16, kv_dtype: str = "f16",
                 max_blocks_per_seq: int | None = None, float_dtype: str = "float16") -> None:
        cfg = self.config = weights.config
        self.block_size = block_size
        # a sequence never holds more blocks than the pool: tables sized by the context (RoPE, block tables) are
        # bounded by what the caller asked for, not by the largest context a file may claim
        self.max_blocks_per_seq = min(max_blocks_per_seq or -(-cfg.max_seq_len // block_size), num_blocks)
        self.max_context = self.max_blocks_per_seq * block_size
        self.embed = Embedding(weights.embed, float_dtype)
        self.rope = RotaryEmbedding(cfg, self.max_context)
        self.layers = [TransformerBlock(cfg, w, float_dtype, cfg.layer_window(i)) for i, w in enumerate(weights.layers)]
        self.norm = RMSNorm(weights.norm, cfg.norm_eps)
        self.lm_head = Linear(weights.lm_head, float_dtype=float_dtype)
        self.caches = [KVCache.create(num_blocks, cfg.n_kv_heads, cfg.head_dim, block_size, kv_dtype)
                       for _ in self.layers]

    def __call__(self, tokens: Tensor, step: StepInputs, logit_rows: Tensor | None = None, *,
                 stream_layers: bool = False) -> Tensor:
        """Logits (rows, vocab) float32 for the tokens at `logit_rows` (all tokens when None).

        With `stream_layers` (a prefill's pass; inside a vkgraph.jit capture, where a realize only records the
        layer, it changes nothing) each layer's output is realized as soon as its graph is built, which submits
        that layer's kernels: the GPU runs layer i
        while the host builds layer i+1, where one graph of the whole pass would keep the GPU idle until the host
        had built and recorded most of it. Only where a layer ends in a template's output (a buffer in any
        schedule: the quantized products take the residual), so the kernels and results are those of one graph;
        layers after the first share one cached plan."""
        with decoding(step.decode):
            return self._forward(tokens, step, logit_rows, stream_layers)

    def _forward(self, tokens: Tensor, step: StepInputs, logit_rows: Tensor | None, stream_layers: bool) -> Tensor:
        x = self.embed(tokens)
        if self.config.is_gemma:  # Gemma scales its embeddings by sqrt(dim), rounded to float32 as HF does
            x = x * float(np.float32(np.sqrt(self.config.dim)))
        rope = self.rope.tables(step.positions)
        for layer, cache in zip(self.layers, self.caches):
            x = layer(x, rope, cache, step)
            if stream_layers and x.ends_kernel():  # the position tables with the first layer: computed once
                realize_all(x, *rope)
        if logit_rows is not None:
            x = x.take(logit_rows, 0)
        logits = self.lm_head(self.norm(x, into=self.lm_head))
        cap = self.config.final_softcap
        return logits if not cap else (logits / cap).tanh() * cap

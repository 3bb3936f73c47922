"""Layers of a Llama-family model, in plain Tensor code plus the template ops of vkgraph.nn.template_ops.

Each layer takes its weights as loaded by vkgraph.nn.weights (numpy arrays or QuantizedTensors) and puts them
on the device once. Activations are float32 Tensors shaped (tokens, features): a batch of sequences is packed
into one token axis, and what tells the sequences apart (positions, slot mapping, block tables, context
lengths) comes in as integer Tensors, so one JIT capture serves every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..dtype import dtypes
from ..quant import ROW_ALIGN_ELEMS, QuantizedTensor, dequantize, quantize, stack_rows
from ..templates.common import decode_fusion
from ..tensor import Tensor, cat
from .config import ModelConfig
from .template_ops import (
    ExpertLinear,
    Int8Activations,
    KVCache,
    PendingNorm,
    QuantLinear,
    flash_takes,
    glu_q8,
    paged_decode,
    prefill_attention,
    rms_norm_q8,
    rope_paged_decode,
    rope_write_kv,
    write_kv,
)
from .weights import DeviceMatrix


class Linear:
    """y = x @ W.T (+ bias) (+ residual). Quantized weights run the matvec templates, and so do float weights kept
    as float16 (GGUF's F16 rows, K % 8 == 0): a few activation rows read each weight once, where the generated
    product of a [rows, K] by [K, N] matrix reads W through its transpose. Other float weights run the generated
    matmul, stored as float16 or float32 (float32 accumulation)."""

    def __init__(self, weight: np.ndarray | QuantizedTensor | DeviceMatrix, bias: np.ndarray | None = None,
                 float_dtype: str = "float16") -> None:
        self.out_features, self.in_features = weight.shape
        if (float_dtype == "float16" and not isinstance(weight, QuantizedTensor | DeviceMatrix)
                and self.in_features % ROW_ALIGN_ELEMS == 0):
            weight = quantize(np.asarray(weight, np.float32), "F16")
        if isinstance(weight, QuantizedTensor | DeviceMatrix):
            self.quant: QuantLinear | None = QuantLinear(weight)
            self.weight_t = None
        else:
            self.quant = None
            self.weight_t = Tensor(np.ascontiguousarray(np.asarray(weight, np.float32).T), dtype=float_dtype).realize()
        self.bias = Tensor(np.asarray(bias, np.float32)).realize() if bias is not None else None

    def takes_int8(self, rows: int) -> bool:
        """Whether `rows` rows of input may come as Int8Activations (see QuantLinear.takes_int8)."""
        return self.quant is not None and self.quant.takes_int8(rows)

    def takes_norm(self, rows: int) -> bool:
        """Whether `rows` rows of input may come as a PendingNorm (see QuantLinear.takes_norm)."""
        return self.quant is not None and self.quant.takes_norm(rows)

    def __call__(self, x: Tensor | Int8Activations | PendingNorm, residual: Tensor | None = None) -> Tensor:
        if self.quant is not None:
            y = self.quant(x, residual=residual if self.bias is None else None)
        else:
            y = (x.cast(self.weight_t.dtype) @ self.weight_t).float()
            if self.bias is None and residual is not None:
                y = y + residual
        if self.bias is not None:
            y = y + self.bias
            if residual is not None:
                y = y + residual
        return y


class RMSNorm:
    def __init__(self, weight: np.ndarray, eps: float) -> None:
        self.weight = Tensor(np.asarray(weight, np.float32)).realize()
        self.eps = eps

    def __call__(self, x: Tensor, into: Linear | ParallelLinear | None = None
                 ) -> Tensor | Int8Activations | PendingNorm:
        """The normalised x. Where `into` (the one consumer of the result) normalizes its input itself (a decode
        step's integer matvec, takes_norm), x with the norm pending: no kernel of the norm's own; else where `into`
        takes int8 activations for these rows, the norm writes them directly (one kernel instead of the norm's and
        the quantization's)."""
        rows = math.prod(x.shape[:-1])
        if into is not None and into.takes_norm(rows):
            return PendingNorm(x, self.weight, self.eps)
        if into is not None and into.takes_int8(rows):
            return rms_norm_q8(x, self.weight, self.eps)
        return x.rms_norm(self.weight, self.eps)


class Embedding:
    """Token ids -> float32 rows; the table is kept as `float_dtype` (quantized tables are dequantized)."""

    def __init__(self, weight: np.ndarray | QuantizedTensor | DeviceMatrix, float_dtype: str = "float16") -> None:
        if isinstance(weight, DeviceMatrix):
            self.table = weight.values
            return
        table = dequantize(weight) if isinstance(weight, QuantizedTensor) else np.asarray(weight, np.float32)
        self.table = Tensor(table, dtype=float_dtype).realize()

    def __call__(self, tokens: Tensor) -> Tensor:
        return self.table.take(tokens, 0).float()


class RotaryEmbedding:
    """RoPE in Hugging Face's rotate-half layout, frequencies (with any scaling) from the config.

    cos/sin tables for every position are computed once; a step gathers the rows of its positions, and the
    rotation is elementwise, so it fuses into the kernels around it."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        angles = np.outer(np.arange(max_positions, dtype=np.float64), cfg.rope_inv_freq())
        self.cos = Tensor(np.cos(angles).astype(np.float32)).realize()
        self.sin = Tensor(np.sin(angles).astype(np.float32)).realize()
        self.max_positions = max_positions

    def tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(tokens, 1, head_dim/2) cos and sin for these positions."""
        return self.cos.take(positions, 0).unsqueeze(1), self.sin.take(positions, 0).unsqueeze(1)

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x: (tokens, heads, head_dim); pairs are (j, j + head_dim/2)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass
class StepInputs:
    """What one forward step needs besides token ids, all int32 Tensors.

    positions, slot_mapping: (tokens,). Attention reads the paged cache per query row: `block_tables`
    (rows, max_blocks) and `context_lens` (rows,), where a row is one sequence in decode, or one prompt token
    (its sequence's table, context = position + 1) in a prefill that continues a cached prefix. A prefill
    from scratch may pass `cu_seqlens` (sequences + 1) and `max_seq_len` instead, to use the prefill kernel.
    A prefill that continues cached prefixes may pass, besides the per-row tables, `cu_seqlens`, `max_seq_len`,
    `prefix_lens` (sequences,: the cached tokens) and `seq_block_tables` (sequences, max_blocks): where
    template_ops.flash_takes, attention then runs as one flash prefill over each prefix and its new tokens.
    `decode`: each row is one sequence's only new token, the last of its context (position context_lens - 1, at its
    slot; padding rows: slot -1), so the attention kernel may rotate and write the new keys and values itself."""

    positions: Tensor
    slot_mapping: Tensor
    block_tables: Tensor | None = None
    context_lens: Tensor | None = None
    cu_seqlens: Tensor | None = None
    max_seq_len: int = 0
    prefix_lens: Tensor | None = None
    seq_block_tables: Tensor | None = None
    decode: bool = False


class ParallelLinear:
    """Several Linears over the same input (q/k/v, gate/up) as one product when their weights allow: rows of
    equal format and width are stacked into one matrix, so a decode step runs one matvec instead of several
    (each costs a dispatch and its fixed ramp); the outputs are column slices, views that never copy."""

    def __init__(self, weights: list, biases: list | None = None, float_dtype: str = "float16") -> None:
        biases = biases or [None] * len(weights)
        self.sizes = [w.shape[0] for w in weights]
        quant = [isinstance(w, QuantizedTensor) for w in weights]
        fusable = len({w.shape[1] for w in weights}) == 1 and (
            all(quant) and len({w.format.name for w in weights}) == 1 or not any(quant))
        if not fusable:
            self.parts = [Linear(w, b, float_dtype) for w, b in zip(weights, biases, strict=True)]
            return
        if all(isinstance(w, DeviceMatrix) for w in weights):
            stacked = DeviceMatrix(cat([w.values for w in weights]).realize())  # stacked on the device
        elif all(quant):
            stacked = stack_rows(weights)
        else:
            stacked = np.concatenate([np.asarray(w, np.float32) for w in weights])
        bias = None
        if any(b is not None for b in biases):
            bias = np.concatenate([np.zeros(n, np.float32) if b is None else np.asarray(b, np.float32)
                                   for n, b in zip(self.sizes, biases, strict=True)])
        self.parts = [Linear(stacked, bias, float_dtype)]

    def takes_int8(self, rows: int) -> bool:
        """Whether `rows` rows of input may come as Int8Activations: one stacked product that takes them."""
        return len(self.parts) == 1 and self.parts[0].takes_int8(rows)

    def glu_q8(self, x: Tensor | Int8Activations | PendingNorm, gelu_tanh: bool = False) -> Int8Activations | None:
        """For gate/up: act(gate(x)) * up(x) as the down product's int8 activations, written by the one stacked
        product's epilogue (QuantLinear.glu_q8), or None where that cannot run (parts apart, float weights, a bias,
        rows the epilogue does not take, VKGRAPH_GLU_EPILOGUE=0)."""
        if len(self.parts) != 1 or len(self.sizes) != 2 or self.sizes[0] != self.sizes[1]:
            return None
        part = self.parts[0]
        if part.quant is None or part.bias is not None:
            return None
        if not part.quant.takes_glu(math.prod(x.shape[:-1]), isinstance(x, Int8Activations),
                                    isinstance(x, PendingNorm)):
            return None
        return part.quant.glu_q8(x, gelu_tanh)

    def takes_norm(self, rows: int) -> bool:
        """Whether `rows` rows of input may come as a PendingNorm: one stacked product that takes it."""
        return len(self.parts) == 1 and self.parts[0].takes_norm(rows)

    def stacked(self, x: Tensor | Int8Activations | PendingNorm) -> Tensor | None:
        """The one stacked product's output [..., sum of the widths], or None where the parts run apart."""
        return self.parts[0](x) if len(self.parts) == 1 else None

    def __call__(self, x: Tensor | Int8Activations | PendingNorm) -> list[Tensor]:
        if len(self.parts) > 1:
            return [p(x) for p in self.parts]
        return self.split(self.parts[0](x))

    def split(self, y: Tensor) -> list[Tensor]:
        """The stacked output's column ranges, one per weight."""
        outs, start = [], 0
        for n in self.sizes:
            outs.append(y[..., start:start + n])
            start += n
        return outs


class Attention:
    """`window` > 0: each query sees only the last `window` positions (a sliding layer of Gemma 2); the config
    gives the score scale and soft-cap."""

    def __init__(self, cfg: ModelConfig, wq, wk, wv, wo, bq=None, bk=None, bv=None,
                 float_dtype: str = "float16", window: int = 0) -> None:
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scores = {"scale": cfg.attn_scale, "softcap": cfg.attn_softcap, "window": window}
        self.qkv = ParallelLinear([wq, wk, wv], [bq, bk, bv], float_dtype)
        self.o = Linear(wo, float_dtype=float_dtype)

    def __call__(self, x: Tensor | Int8Activations | PendingNorm, residual: Tensor | None, rope: tuple[Tensor, Tensor],
                 cache: KVCache, step: StepInputs) -> Tensor:
        t = x.shape[0]
        fused = self.qkv.stacked(x) if decode_fusion() else None
        # the attention's last kernel writes the output product's int8 input where that product takes one
        int8 = fused is not None and self.head_dim % 32 == 0 and self.o.takes_int8(t)
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        half = (t, self.head_dim // 2)
        if fused is not None and step.decode:
            # one kernel rotates the queries and the new keys, writes the new keys and values into the cache and
            # attends, reading the product's rows in place
            att = rope_paged_decode(cache, fused, step.slot_mapping, (rope[0].reshape(half), rope[1].reshape(half)),
                                    step.block_tables, step.context_lens, q_heads=self.n_heads, k_off=q_width,
                                    v_off=q_width + kv_width,
                                    max_context_len=step.block_tables.shape[1] * cache.block_size, int8=int8,
                                    **self.scores)
            return self.o(att if int8 else att.reshape(t, q_width), residual=residual)
        q, k, v = self.qkv(x) if fused is None else self.qkv.split(fused)
        q = q.reshape(t, self.n_heads, self.head_dim)
        k = k.reshape(t, self.n_kv_heads, self.head_dim)
        v = v.reshape(t, self.n_kv_heads, self.head_dim)
        k = RotaryEmbedding.rotate(k, *rope)
        if fused is not None:
            # one kernel rotates queries and keys and writes keys and values, reading the product's rows in place;
            # its output, the rotated queries, orders the cache's readers after the write
            tables = (rope[0].reshape(half), rope[1].reshape(half))
            q = written = rope_write_kv(cache, fused, step.slot_mapping, tables, q_heads=self.n_heads, k_off=q_width,
                                        v_off=q_width + kv_width)
        else:
            q = RotaryEmbedding.rotate(q, *rope)
            written = write_kv(cache, k, v, step.slot_mapping)
        cached = step.prefix_lens is not None
        if step.cu_seqlens is not None and (not cached or flash_takes(self.head_dim, self.scores["softcap"],
                                                                     cache.dtype)):
            # a prefill attends over the prompt's own keys (the cache write still happens) and, where it continues
            # a cached prefix, over the prefix's in the cache
            prefix = dict(cache=cache, block_tables=step.seq_block_tables, prefix_lens=step.prefix_lens) if cached \
                else {}
            att = prefill_attention(q, k, v, step.cu_seqlens, num_seqs=step.cu_seqlens.shape[0] - 1,
                                    max_seq_len=step.max_seq_len, after=written, kv_dtype=cache.dtype, **prefix,
                                    **self.scores)
        else:
            max_context = step.block_tables.shape[1] * cache.block_size
            att = paged_decode(cache, q, step.block_tables, step.context_lens, written, max_context_len=max_context,
                               int8=int8, **self.scores)
            if int8:
                return self.o(att, residual=residual)
        return self.o(att.reshape(t, q_width), residual=residual)


class MLP:
    """SwiGLU: down(silu(gate(x)) * up(x)); GeGLU (gelu="tanh", Gemma): down(gelu(gate(x)) * up(x))."""

    def __init__(self, w_gate, w_up, w_down, float_dtype: str = "float16", gelu: str | None = None) -> None:
        self.gate_up = ParallelLinear([w_gate, w_up], float_dtype=float_dtype)
        self.down = Linear(w_down, float_dtype=float_dtype)
        self.gelu = gelu

    def __call__(self, x: Tensor | Int8Activations | PendingNorm, residual: Tensor | None = None) -> Tensor:
        if self.gelu in (None, "tanh") and self.down.takes_int8(math.prod(x.shape[:-1])):
            # one kernel: the product, its epilogue the gated unit written as the down product's int8 input
            if (h := self.gate_up.glu_q8(x, gelu_tanh=self.gelu == "tanh")) is not None:
                return self.down(h, residual=residual)
            stacked = self.gate_up.stacked(x)
            if stacked is not None:  # a kernel of its own: the gated unit, written as the down product's int8 input
                return self.down(glu_q8(stacked, gelu_tanh=self.gelu == "tanh"), residual=residual)
        gate, up = self.gate_up(x)
        act = gate.silu() if self.gelu is None else gate.gelu(self.gelu)
        return self.down(act * up, residual=residual)


class MoE:
    """Mixture of experts: router softmax, top-k by rank, weights renormalised over the chosen k.

    Quantized experts (gate, up and down each of one format and shape across experts) run grouped by expert:
    the expert ids and weights of the tokens * top_k (token, slot) pairs are computed on the GPU, and gate/up
    (stacked per expert, as ParallelLinear does) and down each run one expert-indexed matvec over all pairs,
    which reads only the chosen experts' weights; shapes stay static, so a step captures once.
    Other experts (float weights, mixed formats) run every expert for the whole batch and weight the results
    by the (mostly zero) routing weights: exact, but it reads every expert's weights."""

    def __init__(self, router: np.ndarray, experts: list, top_k: int, float_dtype: str = "float16") -> None:
        self.router_t = Tensor(np.ascontiguousarray(np.asarray(router, np.float32).T)).realize()
        self.top_k = top_k
        self.gate_up: ExpertLinear | None = None
        if self._groupable(experts):
            self.ffn_dim = experts[0].w_gate.shape[0]
            self.gate_up = ExpertLinear([stack_rows([e.w_gate, e.w_up]) for e in experts])
            self.down = ExpertLinear([e.w_down for e in experts])
        else:
            self.experts = [MLP(e.w_gate, e.w_up, e.w_down, float_dtype) for e in experts]

    @staticmethod
    def _groupable(experts: list) -> bool:
        """Whether every projection is quantized, and gate and up share a format and shape (so they stack)."""
        mats = [m for e in experts for m in (e.w_gate, e.w_up, e.w_down)]
        if not all(isinstance(m, QuantizedTensor) for m in mats):
            return False
        first = experts[0]
        return all(e.w_gate.format.name == e.w_up.format.name == first.w_gate.format.name
                   and e.w_down.format.name == first.w_down.format.name
                   and e.w_gate.shape == e.w_up.shape == first.w_gate.shape and e.w_down.shape == first.w_down.shape
                   for e in experts)

    def _rank(self, probs: Tensor) -> Tensor:
        """(tokens, experts) int32: each expert's rank by probability, ties to the lower expert index."""
        e = probs.shape[-1]
        mine, other = probs.unsqueeze(-1), probs.unsqueeze(-2)  # (t, e, 1) against (t, 1, e)
        idx = Tensor.arange(e, dtype=dtypes.int32)
        earlier = idx.reshape(1, 1, e) < idx.reshape(1, e, 1)
        return ((other > mine) | ((other == mine) & earlier)).cast(dtypes.int32).sum(-1, dtype=dtypes.int32)

    def routing(self, x: Tensor) -> Tensor:
        """(tokens, experts) weights: softmax probabilities of the top_k experts, renormalised; zero elsewhere."""
        probs = (x @ self.router_t).softmax(-1)
        chosen = (self._rank(probs) < self.top_k).float() * probs
        return chosen / chosen.sum(-1, keepdim=True)

    def routing_slots(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(tokens, top_k) int32 expert ids (slot j holds the expert of rank j) and their renormalised weights."""
        probs = (x @ self.router_t).softmax(-1)
        e, k = probs.shape[-1], self.top_k
        # ranks are a permutation of 0..e-1 per token, so each slot matches exactly one expert
        hit = self._rank(probs).unsqueeze(1) == Tensor.arange(k, dtype=dtypes.int32).reshape(1, k, 1)  # (t, k, e)
        slots = hit.cast(dtypes.int32) * Tensor.arange(e, dtype=dtypes.int32).reshape(1, 1, e)
        ids = slots.sum(-1, dtype=dtypes.int32)
        w = (hit.float() * probs.unsqueeze(1)).sum(-1)
        return ids, w / w.sum(-1, keepdim=True)

    def __call__(self, x: Tensor, residual: Tensor | None) -> Tensor:
        """The experts' weighted sum for each token (+ residual, where given)."""
        if self.gate_up is not None:
            t, k = x.shape[0], self.top_k
            ids, w = self.routing_slots(x)
            pair_ids = ids.reshape(t * k)
            gu = self.gate_up(x, pair_ids)  # (t * k, 2 * ffn): the k pairs of a token share its x
            h = gu[:, :self.ffn_dim].silu() * gu[:, self.ffn_dim:]
            y = (self.down(h, pair_ids).reshape(t, k, -1) * w.unsqueeze(-1)).sum(1)
            return y if residual is None else residual + y
        weights = self.routing(x)
        out = residual
        for i, expert in enumerate(self.experts):
            y = expert(x) * weights[:, i:i + 1]
            out = y if out is None else out + y
        return out

"""Megatron-style tensor-parallel shards of a Llama-family model: the weights one rank of `world` holds, and the
forward pass of one rank, with the all-reduces where the ranks' partial sums meet.

Column-parallel (each rank holds a contiguous range of output rows): q, k and v by attention head (so each rank
attends over its own heads and keeps their KV cache), gate and up by FFN row (experts: every expert's). Row-
parallel (each rank holds the matching range of input columns): the output projection and down, whose products
are partial sums over the ranks; `all_reduce` adds them. Embedding, norms and RoPE tables are replicated, and
every rank holds the same residual stream; the logits (final norm and LM head) are computed by rank 0 alone.

The lead rank (0) adds the residual in its partial product (the matvec's fused epilogue), the others none, so the
all-reduced sum is the new residual stream itself. `vkgraph.parallel` runs the ranks, each on its own device.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import fields, replace
from functools import partial
from typing import Any

import numpy as np

from ..dtype import dtypes
from ..jit import jit
from ..quant import QuantizedTensor
from ..tensor import Tensor
from .config import ModelConfig
from .layers import MLP, Embedding, Linear, RMSNorm, RotaryEmbedding, StepInputs
from .llama import TransformerBlock
from .template_ops import KVCache
from .weights import DeviceMatrix, ExpertWeights, LayerWeights, ModelWeights, Weight

AllReduce = Callable[[Tensor], Tensor]


def take_rows(w: Weight, start: int, stop: int) -> Weight:
    """Output rows [start, stop) of a (out, in) matrix, quantized or not (rows are whole blocks)."""
    if isinstance(w, QuantizedTensor):
        return QuantizedTensor(np.ascontiguousarray(w.data[start:stop]), w.format, (stop - start, w.shape[1]))
    return np.ascontiguousarray(w[start:stop])


def take_cols(w: Weight, start: int, stop: int) -> Weight:
    """Input columns [start, stop) of a (out, in) matrix; a quantized one splits only between its blocks."""
    if not isinstance(w, QuantizedTensor):
        return np.ascontiguousarray(w[:, start:stop])
    bs = w.format.block_size
    if start % bs or stop % bs:
        raise ValueError(f"{w.format.name} {w.shape}: columns [{start}, {stop}) do not split between its blocks "
                         f"of {bs}; use fewer ranks or another weight format")
    blocks = w.data.reshape(w.shape[0], -1, w.format.type_size)[:, start // bs:stop // bs]
    return QuantizedTensor(np.ascontiguousarray(blocks).reshape(w.shape[0], -1), w.format, (w.shape[0], stop - start))


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Raise ValueError unless heads, KV heads and FFN rows divide evenly over `world` ranks."""
    if world < 1:
        raise ValueError(f"tensor parallel needs at least one rank, got {world}")
    if cfg.arch == "gemma2":  # its norms of the attention's and MLP's outputs need the all-reduced sums
        raise ValueError("tensor parallel does not support Gemma 2 yet (norms after the attention and the MLP)")
    for name in ("n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(cfg, name) % world:
            raise ValueError(f"tensor parallel over {world} ranks: the model's {name} ({getattr(cfg, name)}) is not a "
                             f"multiple of {world}")


def _span(total: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s range of `total` rows or columns split evenly over `world` ranks."""
    return rank * total // world, (rank + 1) * total // world


def _local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The config of one rank's shard: it counts the rank's own heads and FFN rows."""
    return replace(cfg, n_heads=cfg.n_heads // world, n_kv_heads=cfg.n_kv_heads // world,
                   ffn_dim=cfg.ffn_dim // world)


def shard_weights(weights: ModelWeights, rank: int, world: int) -> ModelWeights:
    """What rank `rank` of `world` holds: its heads of q/k/v (and their biases) and the matching columns of the
    output projection, its rows of gate/up and columns of down; the rest as it is (shared, not copied).
    Its config counts the rank's own heads and FFN rows."""
    cfg = weights.config
    check_shardable(cfg, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside 0..{world - 1}")
    q0, q1 = _span(cfg.n_heads * cfg.head_dim, rank, world)  # whole heads: check_shardable divided them
    k0, k1 = _span(cfg.n_kv_heads * cfg.head_dim, rank, world)
    f0, f1 = _span(cfg.ffn_dim, rank, world)

    def vec(b: np.ndarray | None, a: int, z: int) -> np.ndarray | None:
        return None if b is None else np.ascontiguousarray(b[a:z])

    def mlp(gate: Weight, up: Weight, down: Weight) -> tuple[Weight, Weight, Weight]:
        return take_rows(gate, f0, f1), take_rows(up, f0, f1), take_cols(down, f0, f1)

    layers = []
    for lw in weights.layers:
        out = replace(lw, wq=take_rows(lw.wq, q0, q1), wk=take_rows(lw.wk, k0, k1), wv=take_rows(lw.wv, k0, k1),
                      wo=take_cols(lw.wo, q0, q1), bq=vec(lw.bq, q0, q1), bk=vec(lw.bk, k0, k1),
                      bv=vec(lw.bv, k0, k1))
        if lw.experts is not None:
            out.experts = [ExpertWeights(*mlp(e.w_gate, e.w_up, e.w_down)) for e in lw.experts]
        else:
            out.w_gate, out.w_up, out.w_down = mlp(lw.w_gate, lw.w_up, lw.w_down)
        layers.append(out)
    return replace(weights, config=_local_config(cfg, world), layers=layers)


def random_matrix(seed: int, name: str, full: tuple[int, int], rows: tuple[int, int], cols: tuple[int, int],
                  std: float) -> DeviceMatrix:
    """Rows [rows) and columns [cols) of a random (full[0], full[1]) matrix, made on the device as float16: uniform
    values of standard deviation `std`, each a hash of (seed, name, its index in the full matrix), so a shard holds
    exactly the values of the same part of the whole (the test of two devices against one relies on it)."""
    salt = (seed * 0x9E3779B1 + zlib.crc32(name.encode())) & 0xFFFFFFFF
    r = Tensor.arange(rows[0], rows[1], dtype=dtypes.uint32).reshape(-1, 1)
    c = Tensor.arange(cols[0], cols[1], dtype=dtypes.uint32).reshape(1, -1)
    h = (r * full[1] + c) ^ salt
    for mul in (0x7FEB352D, 0x846CA68B):  # an integer hash (lowbias32): every bit of the index moves every bit
        h = (h ^ (h >> 16)) * mul
    h = h ^ (h >> 16)
    u = (h >> 8).cast(dtypes.float32) * float(2.0 ** -23) - 1.0  # uniform in [-1, 1)
    return DeviceMatrix((u * float(std * np.sqrt(3.0))).cast(dtypes.float16).realize())


class RandomWeights:
    """Random weights of `config`, made on the device by each rank for its own shard (`shard`), never on the host:
    float16 matrices (random_matrix, standard deviation 1/sqrt(in_features); the embedding 1), norms of ones. For a
    model larger than one GPU's memory; `shard(0, 1)` is the whole model."""

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        if config.is_moe or config.attn_bias:
            raise ValueError("random weights on the device are made for dense models without biases")
        self.config, self.seed = config, seed

    def shard(self, rank: int, world: int) -> ModelWeights:
        """The weights of rank `rank` of `world` (as shard_weights would cut them), made on the current device."""
        cfg = self.config
        check_shardable(cfg, world)
        d, hd, f, v = cfg.dim, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
        q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
        qs, ks, fs = _span(q, rank, world), _span(kv, rank, world), _span(f, rank, world)

        def mat(name: str, full: tuple[int, int], rows: tuple[int, int], cols: tuple[int, int]) -> DeviceMatrix:
            return random_matrix(self.seed, name, full, rows, cols, 1.0 / np.sqrt(full[1]))

        layers = []
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            layers.append(LayerWeights(
                np.ones(d, np.float32), mat(p + "q", (q, d), qs, (0, d)), mat(p + "k", (kv, d), ks, (0, d)),
                mat(p + "v", (kv, d), ks, (0, d)), mat(p + "o", (d, q), (0, d), qs), np.ones(d, np.float32),
                w_gate=mat(p + "gate", (f, d), fs, (0, d)), w_up=mat(p + "up", (f, d), fs, (0, d)),
                w_down=mat(p + "down", (d, f), (0, d), fs)))
        embed = random_matrix(self.seed, "embed", (v, d), (0, v), (0, d), 1.0)
        head = mat("lm_head", (v, d), (0, v), (0, d)) if rank == 0 else embed  # only rank 0 computes logits
        return ModelWeights(_local_config(cfg, world), embed, layers, np.ones(d, np.float32), head)


def step_to_host(step: StepInputs) -> dict[str, Any]:
    """A step's inputs as host values by field name (arrays read back, the rest as it is): what goes to ranks on
    other devices or in other processes, each of which makes its own with step_from_host."""
    return {f.name: v.numpy() if isinstance(v := getattr(step, f.name), Tensor) else v for f in fields(step)}


def step_from_host(host: dict[str, Any]) -> StepInputs:
    """step_to_host's values as a step on the current device (its arrays uploaded)."""
    return StepInputs(**{k: Tensor(v) if isinstance(v, np.ndarray) else v for k, v in host.items()})


class ShardModel:
    """One rank's part of the model (see the module doc): its layers over its shard of the weights, its heads' KV
    cache, and on the lead rank the final norm and LM head. Float weights are kept as `float_dtype`.

    With `capture`, each piece between two all-reduces (the embedding, each layer's attention and its MLP, the
    head) is a `vkgraph.jit` function: captured on its second call per input shapes and replayed after, so a
    decode step records nothing on the host but the all-reduces."""

    def __init__(self, weights: ModelWeights, *, lead: bool, num_blocks: int, block_size: int = 16,
                 kv_dtype: str = "f16", max_blocks_per_seq: int | None = None, float_dtype: str = "float16",
                 capture: bool = False) -> None:
        cfg = self.config = weights.config
        self.lead = lead
        self.block_size = block_size
        self.max_blocks_per_seq = min(max_blocks_per_seq or -(-cfg.max_seq_len // block_size), num_blocks)
        self.max_context = self.max_blocks_per_seq * block_size
        self.embed = Embedding(weights.embed, float_dtype)
        self.rope = RotaryEmbedding(cfg, self.max_context)
        self.layers: list[TransformerBlock] = [TransformerBlock(cfg, w, float_dtype) for w in weights.layers]
        if lead:
            self.norm = RMSNorm(weights.norm, cfg.norm_eps)
            self.lm_head = Linear(weights.lm_head, float_dtype=float_dtype)
        self.caches = [KVCache.create(num_blocks, cfg.n_kv_heads, cfg.head_dim, block_size, kv_dtype)
                       for _ in self.layers]
        wrap = (lambda f: jit(f, max_entries=16)) if capture else (lambda f: f)
        self._embed = wrap(self._embedding)
        self._attn = [wrap(partial(self._attention, i)) for i in range(len(self.layers))]
        self._ffn = [wrap(partial(self._mlp, i)) for i in range(len(self.layers))]
        self._head = wrap(self._logits)

    def __call__(self, tokens: Tensor, step: StepInputs, all_reduce: AllReduce,
                 logit_rows: Tensor | None = None) -> Tensor:
        """Logits (rows, vocab) float32 on the lead rank (all tokens, or those at `logit_rows`); elsewhere the final
        residual stream (realizing it runs the rank's part of the step)."""
        # every field, in order: a cached prefix's lengths and tables and the decode mark change what attention
        # computes, not only how fast
        s = tuple(getattr(step, f.name) for f in fields(step))
        x = self._embed(tokens)
        for attn, ffn in zip(self._attn, self._ffn):
            x = all_reduce(attn(x, *s))
            x = all_reduce(ffn(x))
        return self._head(x, logit_rows) if self.lead else x

    # the pieces between all-reduces; the lead rank adds the residual in its partial product
    def _embedding(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        if self.config.arch == "gemma":
            x = x * float(np.float32(np.sqrt(self.config.dim)))
        return x

    def _attention(self, i: int, x: Tensor, *step: object) -> Tensor:
        st = StepInputs(*step)
        layer = self.layers[i]
        h = layer.attn_norm(x, into=layer.attn.qkv)
        return layer.attn(h, x if self.lead else None, self.rope.tables(st.positions), self.caches[i], st)

    def _mlp(self, i: int, x: Tensor) -> Tensor:
        layer = self.layers[i]
        h = layer.ffn_norm(x, into=layer.ffn.gate_up if isinstance(layer.ffn, MLP) else None)
        return layer.ffn(h, residual=x if self.lead else None)

    def _logits(self, x: Tensor, logit_rows: Tensor | None) -> Tensor:
        if logit_rows is not None:
            x = x.take(logit_rows, 0)
        return self.lm_head(self.norm(x, into=self.lm_head))

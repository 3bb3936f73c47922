"""Hand-tuned templates as Tensor ops: their inputs are realized, their output feeds generated kernels.

Each function wraps one template's launcher (vkgraph.templates) in a `custom` graph node: the template as an
op of the graph. The node's key names the weights or cache it works on, so equal calls are shared by the graph
like any other node. Everything a template reads or writes is a Tensor (weights as uint32 words in the
templates' layout, the paged KV cache as two Tensors): model code never allocates device memory itself.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtype import dtypes
from ..flags import flag
from ..quant import ROW_ALIGN_ELEMS, QuantizedTensor, get_format
from ..realize import has_dtype, limits
from ..templates import dequant as dq
from ..templates import flash_prefill as fp
from ..templates import matmul_quant as mq
from ..templates import matvec as mv
from ..templates import norms
from ..templates import paged_attention as pa
from ..templates.common import decode_fusion
from ..tensor import Tensor, custom, realize_all
from .weights import DeviceMatrix

_DECODING = contextvars.ContextVar("vkgraph_decoding", default=False)


@contextmanager
def decoding(on: bool = True) -> Iterator[None]:
    """Within it the model computes a decode step (one new token per sequence): products of
    VKGRAPH_DECODE_MM_ROWS to DEQUANT_ROWS - 1 rows then take matmul_quant's small-row tiles (int8 or float16
    activations). A prefill's products of as many rows keep the matvec's float32 or integer arithmetic, so a
    prompt's logits do not depend on how many rows its batch was padded to."""
    token = _DECODING.set(on)
    try:
        yield
    finally:
        _DECODING.reset(token)

# From this many activation rows on, QuantLinear expands W to a float16 temporary and runs the generated matmul,
# which reads W once per 64-row tile, instead of the matvec, which reads all of W once per 8 rows. An estimate:
# the crossover has not been measured on a GPU yet.
DEQUANT_ROWS = 64


@dataclass(frozen=True)
class Int8Activations:
    """Activations [*lead, K] already quantized for the integer matvec (int8 blocks of 32, their scales and
    half-block sums: templates.matvec.Q8Acts), all in the uint32 Tensor `words`: what `rms_norm_q8` makes and
    QuantLinear takes in place of float activations, so no quantization kernel runs between the two."""

    words: Tensor
    lead: tuple[int, ...]
    k: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.lead, self.k)


@dataclass(frozen=True)
class PendingNorm:
    """x.rms_norm(weight, eps) over the last axis, not computed: what RMSNorm hands a decode step's integer-path
    product that normalizes and quantizes its input itself (QuantLinear.takes_norm), so no norm kernel runs."""

    x: Tensor
    weight: Tensor
    eps: float

    @property
    def shape(self) -> tuple[int, ...]:
        return self.x.shape


def rms_norm_q8(x: Tensor, weight: Tensor, eps: float) -> Int8Activations:
    """x.rms_norm(weight, eps) over the last axis, written by one kernel as int8 activations (norms.rmsnorm_q8);
    K % 32 == 0."""
    *lead, k = x.shape
    rows = math.prod(lead)
    if k % 32:
        raise ValueError(f"rms_norm_q8 quantizes blocks of 32: the last axis must be a multiple of 32, got {k}")

    def run(dev: Any, out: Any, ins: list[Any]) -> None:
        norms.rmsnorm_q8(dev, ins[0], ins[1], rows, k, eps=eps, out=out)

    words = custom(run, [x.float().reshape(rows, k), weight.float()], (mv.Q8Acts.layout(rows, k)[0] // 4,),
                   dtypes.uint32, key=(rows, k, eps), name="rmsnorm_q8")
    return Int8Activations(words, tuple(lead), k)


def glu_q8(gate_up: Tensor, gelu_tanh: bool = False) -> Int8Activations:
    """act(gate) * up from the rows [..., 2F] of a stacked gate/up product (act: SiLU, or the tanh GELU), written
    by one kernel as int8 activations (norms.glu_q8) for the down product; F % 32 == 0."""
    *lead, width = gate_up.shape
    rows, f = math.prod(lead), width // 2
    if width % 64:
        raise ValueError(f"glu_q8 quantizes blocks of 32: the gate and up halves must be multiples of 32, got {width}")

    def run(dev: Any, out: Any, ins: list[Any]) -> None:
        norms.glu_q8(dev, ins[0], rows, f, gelu_tanh=gelu_tanh, out=out)

    words = custom(run, [gate_up.float().reshape(rows, width)], (mv.Q8Acts.layout(rows, f)[0] // 4,),
                   dtypes.uint32, key=(rows, f, gelu_tanh), name="glu_q8")
    return Int8Activations(words, tuple(lead), f)


def _matvec_calls(dev: Any, w: mv.DeviceWeights, x: Any, rows_of: Any, rows: int, out: Any,
                  residual: Any | None) -> None:
    """The matvec of `rows` activation rows x into out (+ residual): more rows than one template call takes run
    as calls of up to rows_per_call rows, each on rows_of(r0, count) of x and into its slice of out."""
    n = w.shape[0]
    per_call = mv.rows_per_call(dev)
    for r0 in range(0, rows, per_call):
        b = min(per_call, rows - r0)
        res = residual.view(r0 * n * 4, b * n * 4) if residual is not None else None
        o = out.view(r0 * n * 4, b * n * 4) if rows > b else out
        mv.matvec(dev, w, rows_of(r0, b) if rows > b else x, b, out=o, residual=res)


class QuantLinear:
    """A weight matrix in a GGUF format (Q8_0, Q4_0, Q4_K, Q6_K, F16, BF16) on the device, as `x @ W.T`.

    Up to DEQUANT_ROWS - 1 activation rows run the matvec template, except from VKGRAPH_DECODE_MM_ROWS rows on a
    device with cooperative matrices (Q8_0, Q4_0, Q4_K, Q6_K): templates.matmul_quant's small-row tiles, on float16
    rows or int8 ones as the fused decode step writes them (decode_tile). More rows run float16 x @ W.T with float32
    accumulation: Q8_0, Q4_0, Q4_K and Q6_K on a device with cooperative matrices through
    templates.matmul_quant, which dequantizes W's blocks into shared memory (float32 result); the others through a
    float16 copy of W and the generated matmul (float16 result), where the device has float16 and the float16 W
    fits one binding."""

    def __init__(self, weight: QuantizedTensor | DeviceMatrix) -> None:
        self.out_features, self.in_features = weight.shape
        if isinstance(weight, DeviceMatrix):  # float16 rows already on the device: the F16 layout as they are
            if self.in_features % ROW_ALIGN_ELEMS:
                raise ValueError(f"a float16 matrix on the device needs rows of a multiple of {ROW_ALIGN_ELEMS}, "
                                 f"got {self.in_features}")
            self.format = "F16"
            self.weights = mv.DeviceWeights(get_format("F16"), weight.shape, None, None, self.in_features // 8, 0)
            self.tensors = [weight.values]
        else:
            self.format = weight.format.name
            self.weights, body, scales = mv.weight_words(weight)
            self.tensors = [Tensor(body)] + ([Tensor(scales)] if scales is not None else [])
        self.can_dequantize = (has_dtype(dtypes.float16)
                               and weight.shape[0] * weight.shape[1] * 2 <= limits().max_storage_range)
        weights = self.weights

        def dequantize(dev: Any, out: Any, ins: list[Any]) -> None:
            _bind(dev, weights, ins)
            dq.dequantize_f16(dev, weights, out=out)

        self._dequantize = dequantize  # one function for every call, so a graph shares one W_f16 node

    def takes_int8(self, rows: int) -> bool:
        """Whether `rows` rows of activations may come as Int8Activations (they would take the integer matvec, or
        matmul_quant's small-row tiles: decode_tile)."""
        if rows >= DEQUANT_ROWS and self.can_dequantize:
            return False
        if self.decode_tile(rows) is not None:
            return decode_fusion()
        return mv.takes_int8(self.weights.format, rows, self.in_features)

    def takes_glu(self, rows: int, int8: bool, norm: bool = False) -> bool:
        """Whether this weight, a stacked gate/up matrix [2F, K], may compute an MLP's gated unit for `rows` rows of
        input (int8: as Int8Activations; norm: as a PendingNorm) in the matvec's epilogue (glu_q8): the matvec runs
        them (not matmul_quant's tiles), in one call that takes the epilogue (templates.matvec.glu_takes)."""
        if (rows >= DEQUANT_ROWS and self.can_dequantize) or self.decode_tile(rows) is not None:
            return False
        if norm and not self.takes_norm(rows):
            return False
        return decode_fusion() and mv.glu_takes(self.weights.format, self.out_features // 2, self.in_features, rows,
                                                int8, norm)

    def glu_q8(self, x: Tensor | Int8Activations | PendingNorm, gelu_tanh: bool = False) -> Int8Activations:
        """act(x @ W_gate.T) * (x @ W_up.T) (act: SiLU, or the tanh GELU) of this stacked gate/up matrix, written by
        the matvec's epilogue as the down product's int8 activations: one kernel where the product and glu_q8's
        would be two (see takes_glu); a PendingNorm's norm runs in the same kernel's prologue."""
        rows, k, f = math.prod(x.shape[:-1]), self.in_features, self.out_features // 2
        int8, norm = isinstance(x, Int8Activations), isinstance(x, PendingNorm)
        if x.shape[-1] != k or not self.takes_glu(rows, int8, norm):
            raise ValueError(f"QuantLinear {self.format} ({self.out_features}x{k}) takes no gated-unit epilogue for "
                             f"{rows} rows of {x.shape[-1]} here (see takes_glu)")
        w = self.weights
        if int8:
            acts = [x.words]
        elif norm:
            acts = [x.x.float().reshape(rows, k), x.weight.float()]
        else:
            acts = [x.float().reshape(rows, k)]

        def run(dev: Any, out: Any, ins: list[Any]) -> None:
            _bind(dev, w, ins[len(acts):])
            if int8:
                xin = mv.Q8Acts.in_buffer(ins[0], rows, k)
            else:
                xin = mv.NormedRows(ins[0], ins[1], x.eps) if norm else ins[0]
            mv.matvec_glu_q8(dev, w, xin, rows, gelu_tanh=gelu_tanh, out=out)

        key = (id(self), gelu_tanh, int8, x.eps if norm else None)
        words = custom(run, acts + self.tensors, (mv.Q8Acts.layout(rows, f)[0] // 4,), dtypes.uint32, key=key,
                       name=f"matvec_{self.format}_glu_q8" + ("+norm" if norm else ""))
        return Int8Activations(words, tuple(x.shape[:-1]), f)

    def takes_norm(self, rows: int) -> bool:
        """Whether `rows` rows of activations may come as a PendingNorm: in a decode step (inside `decoding()`), on
        the integer matvec (not decode_tile's tiles) in one call, where the device has a launch for it
        (templates.matvec.takes_norm; VKGRAPH_NORM_PROLOGUE)."""
        return (_DECODING.get() and rows <= mv.MAX_BATCH and self.decode_tile(rows) is None
                and mv.takes_norm(self.weights.format, rows, self.out_features, self.in_features))

    def decode_tile(self, rows: int) -> Any:
        """The small-row tile of templates.matmul_quant for `rows` (VKGRAPH_DECODE_MM_ROWS .. DEQUANT_ROWS - 1)
        activation rows of a decode step (inside `decoding()`), or None where they take the matvec (a prefill,
        fewer rows, flag 0, another format, no cooperative matrices): a batched decode step's products stream W
        once for all rows on cooperative matrices, where the matvec's cost per weight byte grows with the rows."""
        least = flag("VKGRAPH_DECODE_MM_ROWS")
        if (not _DECODING.get() or not least or not least <= rows < DEQUANT_ROWS or self.in_features % 32
                or not self._quant_coop()):
            return None
        return mq.decode_config(limits(), rows, self.out_features, self.in_features)

    def __call__(self, x: Tensor | Int8Activations, residual: Tensor | None = None) -> Tensor:
        """x [..., in_features] float32, or Int8Activations where takes_int8 -> [..., out_features] float32
        (+ residual, fused)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear {self.format} ({self.out_features}x{self.in_features}): input's last "
                             f"dimension is {x.shape[-1]}")
        lead = x.shape[:-1]
        rows = math.prod(lead)
        out_shape = (*lead, self.out_features)
        if residual is not None and residual.shape != out_shape:
            raise ValueError(f"QuantLinear residual has shape {residual.shape}, expected {out_shape}")
        w, n, k = self.weights, self.out_features, self.in_features
        if isinstance(x, Int8Activations):
            return self._from_int8(x, rows, residual)
        if isinstance(x, PendingNorm):
            return self._from_norm(x, rows, residual)
        if (cfg := self.coop_tile(rows) if rows >= DEQUANT_ROWS else self.decode_tile(rows)) is not None:
            return self._coop(x, rows, cfg, residual)
        if rows >= DEQUANT_ROWS and self.can_dequantize:
            # W_f16 is a temporary of the graph: made by the template, released after the matmul reads it
            w16 = custom(self._dequantize, self.tensors, (n, k), dtypes.float16, key=(id(self),),
                         name=f"dequant_f16_{self.format}")
            # the float16 rows in a buffer of their own: the matmul reads them as 16-byte vectors, where a cast fused
            # into its operand is read element by element (several times slower in a Q4_0 8B-shape prefill)
            y = (x.reshape(rows, k).cast(dtypes.float16).contiguous() @ w16.T).float()
            if residual is not None:  # added before the reshape, so it fuses into the matmul's epilogue
                y = y + residual.reshape(rows, n).float()
            return y.reshape(out_shape)
        acts = [x.float()] + ([residual.float()] if residual is not None else [])

        def run(dev: Any, out: Any, ins: list[Any]) -> None:
            _bind(dev, w, ins[len(acts):])
            _matvec_calls(dev, w, ins[0], lambda r0, b: ins[0].view(r0 * k * 4, b * k * 4), rows, out,
                          ins[1] if residual is not None else None)

        return custom(run, acts + self.tensors, out_shape, dtypes.float32, key=(id(self),),
                      name=f"matvec_{self.format}")

    def coop_tile(self, rows: int) -> Any:
        """The tile configuration of templates.matmul_quant for `rows` activation rows, or None where this weight
        takes the float16 copy (another format, no cooperative matrices, VKGRAPH_QUANT_COOP=0)."""
        if not self._quant_coop():
            return None
        return mq.config(limits(), rows, self.out_features, self.in_features, self.format)

    def _quant_coop(self) -> bool:
        """Whether this weight's products may run templates.matmul_quant at all (its format, the flag, float16)."""
        return self.format in mq.FORMATS and bool(flag("VKGRAPH_QUANT_COOP")) and has_dtype(dtypes.float16)

    def _coop(self, x: Tensor | Int8Activations, rows: int, cfg: Any, residual: Tensor | None) -> Tensor:
        """templates.matmul_quant on float16 rows, or on int8 blocks as they come (Int8Activations). A tile that
        splits K writes partial planes [ks, rows, n]: their sum (a generated kernel) takes the residual."""
        w, n, k = self.weights, self.out_features, self.in_features
        lim = limits()
        int8 = isinstance(x, Int8Activations)
        ks = getattr(cfg, "ks", 1)
        fused = residual if ks == 1 else None
        ins = [x.words if int8 else x.reshape(rows, k).cast(dtypes.float16), *self.tensors]
        if fused is not None:
            ins.append(fused.reshape(rows, n).float())

        nw = len(self.tensors)  # the body, and the scales where the format has them

        def run(dev: Any, out: Any, bufs: list[Any]) -> None:
            _bind(dev, w, bufs[1:1 + nw])
            xin = mv.Q8Acts.in_buffer(bufs[0], rows, k) if int8 else bufs[0]
            mq.matmul_quant(dev, lim, w, xin, rows, cfg, out=out,
                            residual=bufs[1 + nw] if len(bufs) > 1 + nw else None)

        y = custom(run, ins, (ks * rows, n), dtypes.float32, key=(id(self), cfg, int8),
                   name=f"matmul_quant_{self.format}")
        if ks > 1:
            y = y.reshape(ks, rows, n).sum(0)
            if residual is not None:
                y = y + residual.reshape(rows, n).float()
        return y.reshape(*x.shape[:-1], n)

    def _from_int8(self, x: Int8Activations, rows: int, residual: Tensor | None) -> Tensor:
        if not self.takes_int8(rows):
            raise ValueError(f"QuantLinear {self.format} ({self.out_features}x{self.in_features}) takes no int8 "
                             f"activations for {rows} rows here (see takes_int8)")
        if (cfg := self.decode_tile(rows)) is not None:
            return self._coop(x, rows, cfg, residual)
        w, n, k = self.weights, self.out_features, self.in_features
        acts = [x.words] + ([residual.float()] if residual is not None else [])

        def run(dev: Any, out: Any, ins: list[Any]) -> None:
            _bind(dev, w, ins[len(acts):])
            q8 = mv.Q8Acts.in_buffer(ins[0], rows, k)
            _matvec_calls(dev, w, q8, lambda r0, b: q8.rows(r0, b, k), rows, out,
                          ins[1] if residual is not None else None)

        return custom(run, acts + self.tensors, (*x.lead, n), dtypes.float32, key=(id(self),),
                      name=f"matvec_{self.format}")


    def _from_norm(self, x: PendingNorm, rows: int, residual: Tensor | None) -> Tensor:
        """The matvec over x's rows normalized and quantized in its own prologue (templates.matvec.NormedRows)."""
        if not self.takes_norm(rows):
            raise ValueError(f"QuantLinear {self.format} ({self.out_features}x{self.in_features}) takes no pending "
                             f"norm for {rows} rows here (see takes_norm)")
        w, n, k = self.weights, self.out_features, self.in_features
        acts = [x.x.float().reshape(rows, k), x.weight.float()] + ([residual.float()] if residual is not None else [])

        def run(dev: Any, out: Any, ins: list[Any]) -> None:
            _bind(dev, w, ins[len(acts):])
            mv.matvec(dev, w, mv.NormedRows(ins[0], ins[1], x.eps), rows, out=out,
                      residual=ins[2] if residual is not None else None)

        return custom(run, acts + self.tensors, (*x.shape[:-1], n), dtypes.float32, key=(id(self), x.eps),
                      name=f"matvec_{self.format}+norm")


class ExpertLinear:
    """The same projection of E experts (one GGUF format and shape) stacked in one device buffer, run per
    (token, slot) pair on the expert the router chose for it: y[p] = x[p // (pairs / rows)] @ W[ids[p]].T.

    One matvec_id dispatch reads only the chosen experts' rows, whatever E is. Every pair reads its expert's
    matrix, so many pairs read the weights many times (see docs/llm.md)."""

    def __init__(self, experts: list[QuantizedTensor]) -> None:
        self.n_experts = len(experts)
        self.out_features, self.in_features = experts[0].shape
        self.format = experts[0].format.name
        self.weights, body, scales = mv.weight_words(mv.stacked_experts(experts))
        self.tensors = [Tensor(body)] + ([Tensor(scales)] if scales is not None else [])

    def __call__(self, x: Tensor, ids: Tensor) -> Tensor:
        """x [rows, in_features] float32, ids [pairs] int32 (pairs a multiple of rows; a row's pairs are
        consecutive) -> [pairs, out_features] float32."""
        rows, pairs = x.shape[0], ids.shape[0]
        if x.ndim != 2 or x.shape[1] != self.in_features or ids.ndim != 1 or pairs % rows:
            raise ValueError(f"ExpertLinear {self.format} ({self.out_features}x{self.in_features}): x {x.shape} "
                             f"and ids {ids.shape} must be [rows, {self.in_features}] and [a multiple of rows]")
        w, e, x_div = self.weights, self.n_experts, pairs // rows

        def run(dev: Any, out: Any, ins: list[Any]) -> None:
            _bind(dev, w, ins[2:])
            mv.matvec_id(dev, w, e, ins[0], ins[1], pairs, x_div=x_div, out=out)

        return custom(run, [x.float(), ids.cast(dtypes.int32), *self.tensors], (pairs, self.out_features),
                      dtypes.float32, key=(id(self), x_div), name=f"matvec_id_{self.format}")


def _bind(dev: Any, weights: mv.DeviceWeights, bufs: list[Any]) -> None:
    """The weight Tensors' buffers (body, then scales if the format has them), as the launcher reads them."""
    weights.bind(dev, bufs[0], bufs[1] if len(bufs) > 1 else None)


@dataclass
class KVCache:
    """A paged KV cache: `num_blocks` blocks of `block_size` tokens, keys and values each one Tensor of uint32
    words holding `dtype` ("f16" or "f32") values in the templates' block layout."""

    num_blocks: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    key: Tensor
    value: Tensor

    @classmethod
    def create(cls, num_blocks: int, num_kv_heads: int, head_size: int, block_size: int = 16,
               dtype: str = "f16") -> KVCache:
        words = pa.cache_bytes(num_blocks, num_kv_heads, head_size, block_size, dtype) // 4
        return cls(num_blocks, num_kv_heads, head_size, block_size, dtype,
                   Tensor.empty(words, dtype=dtypes.uint32), Tensor.empty(words, dtype=dtypes.uint32))

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def on(self, dev: Any, key: Any, value: Any) -> pa.PagedKVCache:
        """The cache as the launchers take it, over its Tensors' buffers."""
        pa.check_binding_range(dev, "KV cache", key.size)
        return pa.PagedKVCache(self.num_blocks, self.num_kv_heads, self.head_size, self.block_size, self.dtype,
                               key, value)


def write_kv(cache: KVCache, key: Tensor, value: Tensor, slot_mapping: Tensor) -> Tensor:
    """Scatter key/value [tokens, kv_heads, head] into the paged cache at slot_mapping (int32, -1 skips).

    Returns a one-element token that later cache readers take as an input, so the graph orders them after
    this write (the cache itself lives outside the graph)."""
    tokens = key.shape[0]
    want = (tokens, cache.num_kv_heads, cache.head_size)
    if key.shape != want or value.shape != want:
        raise ValueError(f"write_kv: key {key.shape} and value {value.shape} must be {want}")
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"write_kv: slot_mapping {slot_mapping.shape} must be ({tokens},)")

    def run(dev: Any, out: Any, ins: list[Any]) -> None:
        pa.write_kv(dev, cache.on(dev, ins[3], ins[4]), ins[0], ins[1], ins[2], tokens)

    # the cache's Tensors are inputs: the template writes into them (ordering by the returned token)
    ins = [key.float(), value.float(), slot_mapping.cast(dtypes.int32), cache.key, cache.value]
    return custom(run, ins, (1,), dtypes.int32, key=(id(cache),), name="kv_write")


def _block_pieces(caches: list[KVCache], blocks: list[int]) -> tuple[int, np.ndarray]:
    """Bytes of one block of one cache buffer, and each block's offset in a buffer (checking the caches agree
    and the blocks exist)."""
    c = caches[0]
    if any((x.num_blocks, x.num_kv_heads, x.head_size, x.block_size, x.dtype)
           != (c.num_blocks, c.num_kv_heads, c.head_size, c.block_size, c.dtype) for x in caches):
        raise ValueError("KV blocks move between caches of one shape and dtype")
    idx = np.asarray(blocks, np.int64).reshape(-1)
    if len(idx) and (idx.min() < 0 or idx.max() >= c.num_blocks):
        raise ValueError(f"KV blocks {blocks} must lie below {c.num_blocks}")
    piece = pa.cache_bytes(1, c.num_kv_heads, c.head_size, c.block_size, c.dtype)
    return piece, idx * piece


def read_kv_blocks(caches: list[KVCache], blocks: list[int]) -> list[bytes]:
    """Whole blocks of every cache as host bytes, one payload per block: its keys then values of each layer in
    turn, the caches' own bytes, copied as they are (no kernel, no conversion) by one copy of a region per
    block out of each cache buffer into one readback buffer, then once each out of it. One op per two layers.
    Waits for the copies."""
    piece, at = _block_pieces(caches, blocks)
    row = 2 * len(caches) * piece
    row_at = np.arange(len(at), dtype=np.int64) * row
    staged: list[Any] = []  # the device and the readback buffer, made by the first op that runs

    def op(lo: int) -> Tensor:
        group = caches[lo:lo + 2]  # four buffers: within the inputs any device lets one op take

        def run(dev: Any, out: Any, ins: list[Any]) -> None:
            if not staged:
                staged.extend((dev, pa.readback_buffer(dev, len(at) * row)))
            for j, buf in enumerate(ins):
                pa.copy_blocks(dev, buf, staged[1], at, row_at + (2 * lo + j) * piece, piece)

        return custom(run, [t for c in group for t in (c.key, c.value)], (1,), dtypes.int32, key=(id(group[0]),),
                      name="kv_blocks_out")

    if not len(at):
        return []
    realize_all(*(op(lo) for lo in range(0, len(caches), 2)))
    return pa.read_parts(staged[0], staged[1], row, len(at))


def write_kv_blocks(caches: list[KVCache], payloads: list[bytes], blocks: list[int]) -> list[Tensor]:
    """Write whole blocks of every cache from host bytes: payloads[i] is block blocks[i]'s keys then values of
    each layer in turn (a row of read_kv_blocks), the caches' own bytes, copied as they are: once into one
    staging buffer, and from there by one copy of a region per block into each cache buffer (no kernel, no
    conversion, no buffer between). One op per two layers. Returns their tokens: realizing them records the
    copies, and a pass recorded later reads the blocks after them."""
    piece, at = _block_pieces(caches, blocks)
    if len(np.unique(at)) != len(at):
        raise ValueError(f"KV blocks {blocks} repeat: each is written once")
    if len(payloads) != len(at) or any(len(p) != 2 * len(caches) * piece for p in payloads):
        raise ValueError(f"write_kv_blocks: {len(at)} payloads of {2 * len(caches) * piece} bytes, one per block")
    row_at = np.arange(len(at), dtype=np.int64) * (2 * len(caches) * piece)
    staged: list[Any] = []  # the staging buffer, filled by the first op that runs

    def op(lo: int) -> Tensor:
        group = caches[lo:lo + 2]  # four buffers: within the inputs any device lets one op take

        def run(dev: Any, out: Any, ins: list[Any]) -> None:
            if not staged:
                staged.append(pa.stage_bytes(dev, payloads))
            for j, buf in enumerate(ins):
                pa.copy_blocks(dev, staged[0], buf, row_at + (2 * lo + j) * piece, at, piece)
            dev.queue.hold(staged[0])  # kept until these copies have run

        return custom(run, [t for c in group for t in (c.key, c.value)], (1,), dtypes.int32, key=(id(group[0]),),
                      name="kv_blocks_in")

    return [op(lo) for lo in range(0, len(caches), 2)]


def rope_write_kv(cache: KVCache, rows: Tensor, slot_mapping: Tensor, rope: tuple[Tensor, Tensor], *,
                  q_heads: int, k_off: int, v_off: int) -> Tensor:
    """From the rows [tokens, width] of a fused q/k/v product (queries from column 0, keys from k_off, values
    from v_off, read where they are), one kernel writes the keys rotated by RoPE (rotate-half; cos, sin
    [tokens, head_size / 2]) and the values into the paged cache at slot_mapping, and returns the queries
    rotated the same way, [tokens, q_heads, head_size] float32. Cache readers take the returned queries, so
    the graph orders them after the write."""
    tokens, width = rows.shape
    d = cache.head_size
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"rope_write_kv: slot_mapping {slot_mapping.shape} must be ({tokens},)")
    half = (tokens, d // 2)
    if rope[0].shape != half or rope[1].shape != half:
        raise ValueError(f"rope_write_kv: cos {rope[0].shape} and sin {rope[1].shape} must be {half}")

    def run(dev: Any, out: Any, ins: list[Any]) -> None:
        pa.write_kv(dev, cache.on(dev, ins[2], ins[3]), ins[0], ins[0], ins[1], tokens, src_stride=width,
                    k_off=k_off, v_off=v_off, rope=(ins[4], ins[5]), q_out=out, q_heads=q_heads)

    ins = [rows.float(), slot_mapping.cast(dtypes.int32), cache.key, cache.value, rope[0].float(), rope[1].float()]
    return custom(run, ins, (tokens, q_heads, d), dtypes.float32, key=(id(cache), q_heads, k_off, v_off),
                  name="kv_write")


def paged_decode(cache: KVCache, q: Tensor, block_tables: Tensor, context_lens: Tensor, after: Tensor,
                 *, max_context_len: int, scale: float | None = None, window: int = 0, softcap: float = 0.0,
                 int8: bool = False) -> Tensor | Int8Activations:
    """One query token per sequence over its cached context: q [B, heads, D] -> [B, heads, D] float32, or with
    int8 the rows [B, heads * D] as Int8Activations for an integer-path product (D % 32 == 0), written by the
    attention's last kernel so no quantization kernel runs before that product.

    `max_context_len` sizes the launch (use the cache's capacity per sequence so one capture serves every
    position); `after` is write_kv's token."""
    b, heads, d = q.shape
    if d != cache.head_size:
        raise ValueError(f"paged_decode: head size {d} but the cache holds {cache.head_size}")
    if int8 and d % 32:
        raise ValueError(f"paged_decode: int8 output comes in blocks of 32, head size {d} is not a multiple")
    max_blocks = block_tables.shape[1]

    def run(dev: Any, out: Any, ins: list[Any]) -> None:
        pa.paged_decode(dev, cache.on(dev, ins[4], ins[5]), ins[0], ins[1], ins[2], num_seqs=b, num_heads=heads,
                        max_blocks_per_seq=max_blocks, max_context_len=max_context_len, scale=scale, window=window,
                        softcap=softcap, out=out, int8=int8)

    ins = [q.float(), block_tables.cast(dtypes.int32), context_lens.cast(dtypes.int32), after, cache.key,
           cache.value]
    return _attention_out(run, ins, b, heads, d, (id(cache), max_context_len, scale, window, softcap, int8), int8)


def _attention_out(run: Any, ins: list[Tensor], b: int, heads: int, d: int, key: tuple, int8: bool
                   ) -> Tensor | Int8Activations:
    """The paged_decode node: its output [b, heads, d] float32, or the rows' int8 activations."""
    if int8:
        words = custom(run, ins, (mv.Q8Acts.layout(b, heads * d)[0] // 4,), dtypes.uint32, key=key,
                       name="paged_decode")
        return Int8Activations(words, (b,), heads * d)
    return custom(run, ins, (b, heads, d), dtypes.float32, key=key, name="paged_decode")


def rope_paged_decode(cache: KVCache, rows: Tensor, slot_mapping: Tensor, rope: tuple[Tensor, Tensor],
                      block_tables: Tensor, context_lens: Tensor, *, q_heads: int, k_off: int, v_off: int,
                      max_context_len: int, scale: float | None = None, window: int = 0, softcap: float = 0.0,
                      int8: bool = False) -> Tensor | Int8Activations:
    """A decode step's attention as one kernel, from the rows [B, width] of a fused q/k/v product (queries from
    column 0, keys from k_off, values from v_off, read where they are): it rotates the queries and the new key by
    RoPE (rotate-half; cos, sin [B, head_size / 2]), writes the new key and value into the paged cache at
    slot_mapping (-1 skips: padding) and attends each sequence's context with the new token as its last position
    (context_lens[b] - 1, which the block table must map to slot_mapping[b]), as paged_decode after rope_write_kv
    would. Row b must be sequence b's only new token: several tokens of one sequence need rope_write_kv first."""
    b, width = rows.shape
    d = cache.head_size
    half = (b, d // 2)
    if slot_mapping.shape != (b,) or context_lens.shape != (b,) or block_tables.shape[0] != b:
        raise ValueError(f"rope_paged_decode: slot_mapping {slot_mapping.shape}, context_lens {context_lens.shape} "
                         f"and block_tables {block_tables.shape} must have one row per sequence ({b})")
    if rope[0].shape != half or rope[1].shape != half:
        raise ValueError(f"rope_paged_decode: cos {rope[0].shape} and sin {rope[1].shape} must be {half}")
    if int8 and d % 32:
        raise ValueError(f"rope_paged_decode: int8 output comes in blocks of 32, head size {d} is not a multiple")
    max_blocks = block_tables.shape[1]

    def run(dev: Any, out: Any, ins: list[Any]) -> None:
        new = pa.NewTokens(ins[3], width, 0, k_off, v_off, rope=(ins[4], ins[5]))
        pa.paged_decode(dev, cache.on(dev, ins[6], ins[7]), ins[0], ins[1], ins[2], num_seqs=b, num_heads=q_heads,
                        max_blocks_per_seq=max_blocks, max_context_len=max_context_len, scale=scale, window=window,
                        softcap=softcap, out=out, int8=int8, new_tokens=new)

    # the cache's Tensors are inputs: the template writes the new tokens into them
    ins = [rows.float(), block_tables.cast(dtypes.int32), context_lens.cast(dtypes.int32),
           slot_mapping.cast(dtypes.int32), rope[0].float(), rope[1].float(), cache.key, cache.value]
    key = (id(cache), max_context_len, scale, window, softcap, int8, q_heads, k_off, v_off)
    return _attention_out(run, ins, b, q_heads, d, key, int8)


def flash_takes(head_size: int, softcap: float = 0.0, kv_dtype: str | None = None) -> bool:
    """Whether prefill attention runs templates.flash_prefill: on a device with float16 cooperative matrices that
    fit heads of head_size, without soft-capping (Gemma 2), which it lacks, where VKGRAPH_FLASH_PREFILL asks for it:
    auto where the keys and values go to a cache of kv_dtype "f16" (flash's float16 keys and values are then the
    cache's own), 1 always, 0 never. Only where it runs can a prefill that continues cached prefixes run as one
    prefill (else: paged_decode per query row)."""
    mode = flag("VKGRAPH_FLASH_PREFILL")
    asked = mode == "1" or (mode == "auto" and kv_dtype == "f16")
    return asked and fp.usable(limits(), head_size) and not softcap


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *, num_seqs: int, max_seq_len: int,
                      scale: float | None = None, window: int = 0, softcap: float = 0.0,
                      after: Tensor | None = None, cache: KVCache | None = None, block_tables: Tensor | None = None,
                      prefix_lens: Tensor | None = None, kv_dtype: str | None = None) -> Tensor:
    """Causal attention over packed prompts: q [T, heads, D], k/v [T, kv_heads, D] -> [T, heads, D].
    `after`: a token (e.g. write_kv's) this op must follow in the graph. `kv_dtype`: the dtype of the cache the
    keys and values are written to (the cache's own where `cache` is given). Where flash_takes, it runs
    templates.flash_prefill (keys and values rounded to float16); else the float32 template.

    With `cache`, sequence b continues a cached prefix of prefix_lens[b] tokens (sequences,) held in `cache` at
    the blocks of block_tables[b] (sequences, max_blocks): its new tokens attend to the prefix and to each other.
    Only flash_prefill runs that; elsewhere this raises, and the caller attends per query row (paged_decode)."""
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    lim = limits()
    flash = flash_takes(d, softcap, cache.dtype if cache is not None else kv_dtype)
    if cache is not None and not flash:
        raise ValueError("prefill_attention: a cached prefix runs on flash_prefill only (see flash_takes); "
                         "attend per query row with paged_decode instead")
    if (block_tables is None or prefix_lens is None) != (cache is None):
        raise ValueError("prefill_attention: cache, block_tables and prefix_lens come together")
    max_blocks = block_tables.shape[1] if block_tables is not None else 0

    def run(dev: Any, out: Any, ins: list[Any]) -> None:
        kw = dict(num_seqs=num_seqs, num_tokens=t, num_heads=heads, num_kv_heads=kv_heads, head_size=d,
                  max_seq_len=max_seq_len, scale=scale, window=window, out=out)
        if cache is not None:
            kw.update(cache=cache.on(dev, ins[4], ins[5]), block_tables=ins[6], prefix_lens=ins[7],
                      max_blocks_per_seq=max_blocks)
        if flash:
            fp.flash_prefill(dev, lim, ins[0], ins[1], ins[2], ins[3], **kw)
        else:
            pa.prefill_attention(dev, ins[0], ins[1], ins[2], ins[3], kv_dtype="f32", softcap=softcap, **kw)

    ins = [q.float(), k.float(), v.float(), cu_seqlens.cast(dtypes.int32)]
    if cache is not None:
        ins += [cache.key, cache.value, block_tables.cast(dtypes.int32), prefix_lens.cast(dtypes.int32)]
    ins += [after] if after is not None else []
    return custom(run, ins, (t, heads, d), dtypes.float32,
                  key=(num_seqs, max_seq_len, scale, window, softcap, flash, id(cache), max_blocks),
                  name="flash_prefill" if flash else "prefill_attention")

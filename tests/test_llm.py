"""The Llama-family model, engine and sampling against the numpy reference (tests/reference_llama.py)."""

import numpy as np
import pytest
from reference_llama import RefCache, ReferenceLlama
from test_matmul_coop import emulate_coop

from vkgraph.nn import tiny_model
from vkgraph.nn.config import RopeScaling
from vkgraph.nn.engine import Engine
from vkgraph.nn.layers import StepInputs
from vkgraph.nn.llama import LlamaModel
from vkgraph.nn.sampling import SamplingParams
from vkgraph.nn.template_ops import flash_takes
from vkgraph.nn.tokenizer import Tokenizer
from vkgraph.nn.weights import load_weights
from vkgraph.tensor import Tensor

BLOCK = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    mk = tiny_model
    dense = mk.write_model(tmp_path_factory.mktemp("dense"), mk.tiny_config(), gguf_types=("Q8_0", "Q4_0"))
    moe = mk.write_model(tmp_path_factory.mktemp("moe"), mk.tiny_config(n_experts=4, n_experts_per_tok=2),
                         gguf_types=("Q8_0",))
    # heads of 32: the attention can write the output product's int8 blocks (head_dim % 32 == 0)
    head32 = mk.write_model(tmp_path_factory.mktemp("head32"), mk.tiny_config(n_heads=2, n_kv_heads=1, head_dim=32),
                            gguf_types=("Q4_0",), safetensors=False)
    llama3 = mk.write_model(tmp_path_factory.mktemp("llama3"), mk.tiny_config(
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64), arch="qwen2", attn_bias=True), gguf_types=())
    return {"float32": dense["hf"], "Q8_0": dense["Q8_0"], "Q4_0": dense["Q4_0"], "moe": moe["hf"],
            "moe-Q8_0": moe["Q8_0"], "qwen2-llama3-rope": llama3["hf"], "tokenizer": dense["hf"],
            "Q4_0-head32": head32["Q4_0"]}


def nerr(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got).any()
    return float(np.abs(got - want).max() / np.abs(want).max())


def logits_tol(cfg) -> float:
    """The logits' bound against the float64 reference for these tests' float32 caches: 5e-4, or where prefill
    attention runs flash_prefill on them all the same (template_ops.flash_takes; VKGRAPH_FLASH_PREFILL=1), 4e-3 as
    for its output alone: k and v rounded to float16 (unit roundoff 2^-11) move each probability by up to
    u|score|, and the residual stream carries that to the logits (with q and the probabilities rounded as well,
    measured on an H200: 1.03e-3)."""
    return 4e-3 if flash_takes(cfg.head_dim, cfg.attn_softcap, "f32") else 5e-4


def build(path, **kw):
    w = load_weights(path, progress=False)
    kw = {"num_blocks": 48, "block_size": BLOCK, "kv_dtype": "f32", "max_blocks_per_seq": 6, "float_dtype": "float32",
          **kw}
    return w, LlamaModel(w, **kw)


@pytest.mark.parametrize("kind", ["float32", "Q8_0", "Q4_0", "moe", "moe-Q8_0", "qwen2-llama3-rope"])
def test_logits_match_reference_for_prefill_and_every_decode_step(models, kind):
    w, model = build(models[kind])
    ref = ReferenceLlama(w)
    prompt = [5, 17, 42, 99, 7, 3, 250, 11, 9, 33, 2, 71, 12, 150, 8, 1, 60, 61]
    table = np.array([[7, 2, 40, 5, 0, 0]], np.int32)  # shuffled physical blocks
    slot = lambda p: table[0, p // BLOCK] * BLOCK + p % BLOCK  # noqa: E731
    cache = RefCache()
    want = ref.forward(prompt, cache)
    n = len(prompt)
    step = StepInputs(Tensor(np.arange(n, dtype=np.int32)), Tensor(np.array([slot(p) for p in range(n)], np.int32)),
                      cu_seqlens=Tensor(np.array([0, n], np.int32)), max_seq_len=n)
    got = model(Tensor(np.array(prompt, np.int32)), step).numpy()
    assert nerr(got, want) < logits_tol(w.config)
    tok = int(np.argmax(want[-1]))
    for pos in range(n, n + 24):  # crosses a block boundary
        want = ref.forward([tok], cache)
        step = StepInputs(Tensor(np.array([pos], np.int32)), Tensor(np.array([slot(pos)], np.int32)),
                          block_tables=Tensor(table), context_lens=Tensor(np.array([pos + 1], np.int32)))
        got = model(Tensor(np.array([tok], np.int32)), step).numpy()
        assert nerr(got, want) < logits_tol(w.config), pos
        tok = int(np.argmax(want[-1]))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_reference_logits_and_batches_with_cooperative_matrices(models, kind, monkeypatch):
    """With cooperative matrices (emulated) a prefill of 18 rows keeps the reference's precision (the small-row
    tiles on int8 activations are a decode step's only), and a batch gives what each request gives alone."""
    emulate_coop(monkeypatch)
    test_logits_match_reference_for_prefill_and_every_decode_step(models, kind)
    if kind == "Q8_0":
        test_batch_gives_what_each_gives_alone_and_frees_every_block(models)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_int8_activations_stay_close_to_the_reference(models, kind, monkeypatch):
    """VKGRAPH_INT_DOT=1: every quantized matvec takes int8-quantized activations; prefill and decode logits
    stay within the int8 rounding's reach of the float reference (about 1-2% of the largest logit here). The
    prefill's 10 rows of width 64 quantize in the matvec; a decode step's norms write int8 themselves.
    (Not asserted for MoE: there the rounding can flip a near-tied routing choice, which moves that token's
    logits by ~10%; the expert-indexed kernel's int8 path is checked exactly in test_templates_matvec.)"""
    from vkgraph import templates
    from vkgraph.runtime import get_device

    if not get_device().info.integer_dot_product:
        pytest.skip("no shaderIntegerDotProduct on this device")
    monkeypatch.setenv("VKGRAPH_INT_DOT", "1")
    w, model = build(models[kind])
    ref = ReferenceLlama(w)
    prompt = [5, 17, 42, 99, 7, 3, 250, 11, 9, 33]
    cache = RefCache()
    want = ref.forward(prompt, cache)
    n = len(prompt)
    before = templates.DISPATCHES["quantize_q8"]
    step = StepInputs(Tensor(np.arange(n, dtype=np.int32)), Tensor(np.arange(n, dtype=np.int32)),
                      cu_seqlens=Tensor(np.array([0, n], np.int32)), max_seq_len=n)
    got = model(Tensor(np.array(prompt, np.int32)), step).numpy()
    assert templates.DISPATCHES["quantize_q8"] > before
    assert nerr(got, want) < 3e-2
    tok = int(np.argmax(want[-1]))
    for pos in range(n, n + 4):
        want = ref.forward([tok], cache)
        step = StepInputs(Tensor(np.array([pos], np.int32)), Tensor(np.array([pos], np.int32)),
                          block_tables=Tensor(np.array([[0, 1, 2, 3, 4, 5]], np.int32)),
                          context_lens=Tensor(np.array([pos + 1], np.int32)))
        fused = templates.DISPATCHES["rmsnorm_q8"]
        got = model(Tensor(np.array([tok], np.int32)), step).numpy()
        assert templates.DISPATCHES["rmsnorm_q8"] > fused
        assert nerr(got, want) < 3e-2, pos
        tok = int(np.argmax(want[-1]))


PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 11, 9, 8, 7, 6, 5, 4, 3, 2, 20, 21, 22, 23, 24, 25, 26, 27], [44],
           list(range(60, 100))]


def run(engine, prompts, params=None, max_tokens=10):
    out: dict[int, list[int]] = {}
    ids = [engine.add_request(p, params, max_tokens=max_tokens, stop_token_ids=[]) for p in prompts]
    while engine.has_work():
        for ev in engine.step():
            out.setdefault(ev.request_id, []).append(ev.token)
    return [out[i] for i in ids]


@pytest.mark.parametrize("kind", ["float32", "Q4_0"])
def test_greedy_generation_matches_reference_token_by_token(models, kind):
    w, model = build(models[kind])
    ref = ReferenceLlama(w)
    got = run(Engine(model, max_batch=4), PROMPTS)
    assert got == [ref.greedy(p, 10) for p in PROMPTS]


def test_batch_gives_what_each_gives_alone_and_frees_every_block(models):
    _, model = build(models["Q8_0"])
    engine = Engine(model, max_batch=8, prefix_caching=False)
    together = run(engine, PROMPTS, max_tokens=12)
    alone = [run(engine, [p], max_tokens=12)[0] for p in PROMPTS]
    assert together == alone
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_invariants()


def test_decode_steps_of_one_batch_reuse_its_sampling_inputs(models):
    """A batch's sampling parameters go to the device once, not every step; the noise of a sampling batch is new
    every step; a request joining with other parameters gives the batch new ones."""
    _, model = build(models["Q8_0"])
    engine = Engine(model, max_batch=4)
    calls = []
    decode = engine._decode

    def spy(*args):
        calls.append(args)
        return decode(*args)

    engine._decode = spy
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0.7, top_k=20), max_tokens=8, stop_token_ids=[])
    for _ in range(3):
        engine.step()
    engine.add_request(PROMPTS[2], SamplingParams(temperature=0.0), max_tokens=4, stop_token_ids=[])
    engine.step()
    params = slice(5, 11)  # temperature, top_k, top_p, min_p, penalty, presence
    first, second, joined = calls[0], calls[1], calls[-1]
    assert all(a is b for a, b in zip(first[params], second[params]))
    assert first[11] is not second[11]  # the Gumbel noise
    assert not any(a is b for a, b in zip(first[params], joined[params]))
    assert joined[5].numpy().ravel()[:2].tolist() == [np.float32(0.7), 0.0]
    while engine.has_work():
        engine.step()


def test_decode_ahead_gives_what_steps_one_at_a_time_give(models, monkeypatch):
    """Decode steps submitted before the host read the previous step's tokens give the same tokens, stops, freed
    blocks and prefix-cache entries as steps taken one at a time, with a stop token ending requests mid-flight."""
    _, model = build(models["Q8_0"])
    prompts = [PROMPTS[3], PROMPTS[0], PROMPTS[1]]
    first = run(Engine(model, max_batch=4), prompts[1:2], max_tokens=12)[0]
    stop = first[4]  # ends that request after a few tokens, while the next step is in flight

    def go(ahead: int):
        monkeypatch.setenv("VKGRAPH_DECODE_AHEAD", str(ahead))
        engine = Engine(model, max_batch=4)
        ids = [engine.add_request(p, max_tokens=12, stop_token_ids=[stop]) for p in prompts]
        out: dict[int, list[int]] = {}
        ends = {}
        while engine.has_work():
            for ev in engine.step():
                out.setdefault(ev.request_id, []).append(ev.token)
                ends[ev.request_id] = ev.finished
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        engine.kv.check_invariants()
        # the whole first sequence again: its full blocks come from the prefix cache, hashed over the real tokens
        again = run(engine, [prompts[0] + out[ids[0]]], max_tokens=4)[0]
        return [out[i] for i in ids], [ends[i] for i in ids], again, engine.stats

    tokens, ends, again, stats = go(1)
    assert (tokens, ends, again) == go(0)[:3]
    assert ends[1] == "stop" and ends[0] == "length" and len(tokens[0]) == 12
    assert stats["decode_ahead_steps"] > 0
    assert stats["cached_prompt_tokens"] >= 3 * BLOCK


def test_requests_join_while_others_decode(models):
    w, model = build(models["float32"])
    ref = ReferenceLlama(w)
    engine = Engine(model, max_batch=4)
    outs: dict[int, list[int]] = {}
    first = engine.add_request(PROMPTS[1], max_tokens=12, stop_token_ids=[])
    for _ in range(4):
        for ev in engine.step():
            outs.setdefault(ev.request_id, []).append(ev.token)
    late = engine.add_request(PROMPTS[0], max_tokens=6, stop_token_ids=[])
    while engine.has_work():
        for ev in engine.step():
            outs.setdefault(ev.request_id, []).append(ev.token)
    assert outs[first] == ref.greedy(PROMPTS[1], 12) and outs[late] == ref.greedy(PROMPTS[0], 6)


def test_prefix_cache_hit_gives_the_same_logits_as_a_cold_run(models):
    w, model = build(models["float32"])
    prompt = list(range(3, 3 + 3 * BLOCK + 5))  # three full blocks and a partial one
    engine = Engine(model, max_batch=2)
    cold = run(engine, [prompt], max_tokens=8)[0]
    warm_engine_tokens = run(engine, [prompt], max_tokens=8)[0]
    assert engine.stats["cached_prompt_tokens"] == 3 * BLOCK
    assert warm_engine_tokens == cold
    # and the logits themselves: compute the prompt's last-token logits through the cached path
    cached = engine.kv.add_sequence("probe", prompt)
    assert cached == 3 * BLOCK
    probe = type("Probe", (), {"id": "probe"})()
    logits = engine._prefill([probe], continue_cached=True).numpy()
    want = ReferenceLlama(w).forward(prompt)[-1:]
    assert nerr(logits, want) < logits_tol(w.config)
    engine.kv.free_sequence("probe")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_stop_conditions_and_text_stream(models):
    w, model = build(models["float32"])
    tok = Tokenizer.load(models["tokenizer"])
    ref = ReferenceLlama(w)
    prompt = tok.encode("Hello world!")
    greedy = ref.greedy(prompt, 8)
    engine = Engine(model, tok)
    # an end token: generation stops on it, and it is the last token emitted
    events = list(engine.generate([prompt], max_tokens=8, stop_token_ids=[greedy[3]]))
    assert [e.token for e in events] == greedy[:greedy.index(greedy[3]) + 1] and events[-1].finished == "stop"
    events = list(engine.generate([prompt], max_tokens=5, stop_token_ids=[]))
    assert len(events) == 5 and events[-1].finished == "length"
    assert "".join(e.text for e in events) == tok.decode(greedy[:5])


def test_sampling_is_seeded_and_reproducible(models):
    _, model = build(models["Q8_0"])
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.1)
    a = run(Engine(model, seed=7), PROMPTS[:2], params, max_tokens=10)
    b = run(Engine(model, seed=7), PROMPTS[:2], params, max_tokens=10)
    c = run(Engine(model, seed=8), PROMPTS[:2], params, max_tokens=10)
    assert a == b and a != c


def test_request_validation(models):
    _, model = build(models["float32"])
    engine = Engine(model)
    with pytest.raises(ValueError, match="context"):
        engine.add_request([1] * 90, max_tokens=10)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([100000])
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("text without a tokenizer")


def test_stop_string_cuts_the_text(models):
    w, model = build(models["float32"])
    tok = Tokenizer.load(models["tokenizer"])
    prompt = tok.encode("Hello world!")
    engine = Engine(model, tok)
    full = "".join(e.text for e in engine.generate([prompt], max_tokens=12, stop_token_ids=[]))
    stop = full[3:5]
    assert len(stop) == 2
    events = list(engine.generate([prompt], max_tokens=12, stop=[stop], stop_token_ids=[]))
    text = "".join(e.text for e in events)
    assert events[-1].finished == "stop" and text == full[:full.index(stop)] and stop not in text


def test_speculative_greedy_output_equals_plain_greedy(models, tmp_path):
    from vkgraph.nn.speculative import SpeculativeDecoder

    mk = tiny_model
    other = mk.write_model(tmp_path / "draft", mk.tiny_config(n_layers=1), seed=5, gguf_types=())["hf"]
    w, target = build(models["float32"])
    prompt = [5, 17, 42, 99, 7, 3]
    want = ReferenceLlama(w).greedy(prompt, 24)
    same_weights = build(models["float32"])[1]  # its own KV cache: a perfect draft
    for draft, min_acceptance in ((same_weights, 0.99), (build(other)[1], 0.0)):
        sd = SpeculativeDecoder(target, draft, k=3)
        assert list(sd.generate(prompt, 24)) == want
        assert sd.stats.acceptance >= min_acceptance
        assert all(kv.num_free_blocks == kv.num_blocks for kv in sd.kv.values())


def test_speculative_sampling_keeps_the_target_distribution(models, tmp_path):
    """With the rejection rule, the first generated token's distribution is the target's, whatever the draft."""
    from vkgraph.nn.speculative import SpeculativeDecoder, _probs

    mk = tiny_model
    other = mk.write_model(tmp_path / "draft", mk.tiny_config(n_layers=1), seed=9, gguf_types=())["hf"]
    w, target = build(models["float32"])
    draft = build(other)[1]
    prompt = [5, 17, 42]
    params = SamplingParams(temperature=1.5)
    sd = SpeculativeDecoder(target, draft, k=2, seed=3)
    counts = np.zeros(target.config.vocab_size)
    trials = 200
    for _ in range(trials):
        toks = list(sd.generate(prompt, 2, params))
        counts[toks[1]] += 1  # the second token went through the draft and the rejection rule
    ref = ReferenceLlama(w)
    first_logits = ref.forward(prompt)[-1]
    # the second token's law depends on the first; compare against the exact mixture over first tokens
    p_first = _probs(first_logits, params)
    law = np.zeros_like(counts)
    for t in np.nonzero(p_first > 1e-4)[0]:
        law += p_first[t] * _probs(ref.forward(prompt + [int(t)])[-1], params)
    expected = law * trials
    keep = expected >= 5
    chi2 = (((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum()
    assert chi2 < 3 * keep.sum(), (chi2, keep.sum())


def test_prompts_admitted_together_are_prefilled_in_one_pass(models):
    """Several waiting requests, some continuing a cached prefix, are prefilled together and give what each
    gives alone."""
    w, model = build(models["Q8_0"])
    ref = ReferenceLlama(w)
    shared = list(range(3, 3 + 2 * BLOCK))
    engine = Engine(model, max_batch=8)
    run(engine, [shared + [1]], max_tokens=2)  # caches the shared prefix
    prompts = [shared + [7, 8], [4, 5, 6], shared + [9]]
    got = run(engine, prompts, max_tokens=6)
    assert got == [ref.greedy(p, 6) for p in prompts]
    assert engine.stats["cached_prompt_tokens"] >= 2 * 2 * BLOCK
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_prompts_of_similar_length_share_compiled_kernels(models):
    w, model = build(models["Q8_0"])
    ref = ReferenceLlama(w)
    engine = Engine(model, max_batch=2, prefix_caching=False)
    from vkgraph.runtime import get_device

    dev = get_device()
    assert run(engine, [list(range(5, 25))], max_tokens=2) == [ref.greedy(list(range(5, 25)), 2)]
    pipelines = len(dev.pipelines.cached)
    for n in (21, 27, 31):  # same 32-row bucket as 20 tokens
        prompt = list(range(7, 7 + n))
        assert run(engine, [prompt], max_tokens=2) == [ref.greedy(prompt, 2)]
    assert len(dev.pipelines.cached) == pipelines


@pytest.mark.parametrize("kind", ["Q4_0", "float32"])
def test_prefill_streamed_layer_by_layer_equals_one_graph(models, kind):
    """stream_layers submits each layer as soon as it is built where the layer ends in a template's output (the
    quantized products): the same kernels and bit-identical logits as one graph of the whole pass; where a layer
    ends in generated code (float weights) nothing is cut."""
    from vkgraph.realize import count_kernels
    from vkgraph.runtime import get_device

    w, model = build(models[kind])
    dev = get_device()
    n = 20
    prompt = Tensor(np.array([(7 * i + 3) % w.config.vocab_size for i in range(n)], np.int32))
    runs = {}
    for stream in (False, True, False, True):  # the second of each: cached plans and pooled buffers
        step = StepInputs(Tensor(np.arange(n, dtype=np.int32)), Tensor(np.arange(n, dtype=np.int32)),
                          cu_seqlens=Tensor(np.array([0, n], np.int32)), max_seq_len=n)
        dev.synchronize()
        submits = dev.queue.stats["submits"]
        with count_kernels() as k:
            logits = model(prompt, step, logit_rows=Tensor(np.array([n - 1], np.int32)),
                           stream_layers=stream).numpy()
        runs[stream] = (logits, sorted(k.names), dev.queue.stats["submits"] - submits)
    (plain, plain_kernels, plain_submits), (streamed, streamed_kernels, streamed_submits) = runs[False], runs[True]
    assert np.array_equal(streamed, plain) and streamed_kernels == plain_kernels
    assert streamed_submits == plain_submits + (len(model.layers) if kind == "Q4_0" else 0)


def test_prefills_of_one_bucket_replay_one_captured_pass(models, monkeypatch):
    """Prompts padded to one row bucket: the first prefill runs eagerly, the second captures the forward pass and
    later ones replay it (no kernel from a built graph); the logits equal those of eager passes bit for bit."""
    from vkgraph.realize import count_kernels

    w, model = build(models["Q4_0"])
    vocab = w.config.vocab_size
    prompts = [[(5 * i + k) % vocab for i in range(n)] for k, n in enumerate((20, 31, 18, 27))]  # 32 rows each

    def prefill_all(engine):
        logits, kernels = [], []
        for k, prompt in enumerate(prompts):
            engine.kv.add_sequence(k, prompt)
            with count_kernels() as c:
                logits.append(engine._prefill([type("Probe", (), {"id": k})()], continue_cached=False).numpy())
            engine.kv.free_sequence(k)
            kernels.append(c.count)
        return logits, kernels

    captured, kernels = prefill_all(Engine(model, max_batch=1, prefix_caching=False))
    monkeypatch.setenv("VKGRAPH_PREFILL_CAPTURE_ROWS", "0")
    eager, eager_kernels = prefill_all(Engine(model, max_batch=1, prefix_caching=False))
    assert all(np.array_equal(a, b) for a, b in zip(captured, eager))
    assert kernels[:2] == eager_kernels[:2] and kernels[0] > 0 and kernels[2:] == [0, 0]


@pytest.mark.parametrize("n_experts", [4, 8])
def test_quantized_moe_runs_only_the_chosen_experts(n_experts):
    """Q8_0 experts run grouped by expert: gate/up and down are one expert-indexed matvec each, whatever the
    number of experts, for a decode-sized and a prefill-sized batch, and match the numpy reference."""
    from collections import Counter

    from reference_llama import moe

    from vkgraph import quant, templates
    from vkgraph.nn.layers import MoE
    from vkgraph.nn.weights import ExpertWeights

    rng = np.random.default_rng(n_experts)
    dim, ffn, top_k = 64, 96, 2

    def q8(*shape):
        return quant.quantize((rng.standard_normal(shape) * 0.2).astype(np.float32), "Q8_0")

    experts = [ExpertWeights(q8(ffn, dim), q8(ffn, dim), q8(dim, ffn)) for _ in range(n_experts)]
    router = rng.standard_normal((n_experts, dim)).astype(np.float32)
    layer = MoE(router, experts, top_k)
    deq = [(e.w_gate.dequantize(), e.w_up.dequantize(), e.w_down.dequantize()) for e in experts]
    for tokens in (3, 70):
        x = rng.standard_normal((tokens, dim)).astype(np.float32)
        r = rng.standard_normal((tokens, dim)).astype(np.float32)
        before = Counter(templates.DISPATCHES)
        got = layer(Tensor(x), Tensor(r)).numpy()
        matvecs = {n: c for n, c in (templates.DISPATCHES - before).items() if n.startswith("matvec")}
        assert matvecs == {"matvec_q8_0": 2}
        assert nerr(got, r + moe(x.astype(np.float64), router, deq, top_k)) < 5e-4


def test_quantized_moe_model_groups_its_experts(models):
    _, model = build(models["moe-Q8_0"])
    assert all(layer.ffn.gate_up is not None for layer in model.layers)


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q3_K_L"])
def test_mixed_quantization_files_match_reference(tmp_path, mix):
    """Files whose tensors differ in type (llama.cpp's mixes: v, down and output projections in a wider type, a
    tied or separate output) load as stored and run against the reference."""
    cfg = tiny_model.tiny_config(dim=256, ffn_dim=256, n_heads=4, n_kv_heads=2, head_dim=64, n_layers=2)
    path = tiny_model.write_model(tmp_path, cfg, gguf_types=(mix,), safetensors=False)[mix]
    w, model = build(path)
    base, overrides = tiny_model.MIXES[mix]
    assert w.layers[0].wq.format.name == base and w.layers[1].w_down.format.name == overrides["ffn_down.weight"]
    assert w.lm_head.format.name == overrides["output.weight"] and w.embed.format.name == base
    ref = ReferenceLlama(w)
    prompt = [5, 17, 42, 99, 7, 3, 250, 11, 9, 33]
    cache = RefCache()
    want = ref.forward(prompt, cache)
    n = len(prompt)
    step = StepInputs(Tensor(np.arange(n, dtype=np.int32)), Tensor(np.arange(n, dtype=np.int32)),
                      cu_seqlens=Tensor(np.array([0, n], np.int32)), max_seq_len=n)
    assert nerr(model(Tensor(np.array(prompt, np.int32)), step).numpy(), want) < logits_tol(w.config)
    tok = int(np.argmax(want[-1]))
    want = ref.forward([tok], cache)
    step = StepInputs(Tensor(np.array([n], np.int32)), Tensor(np.array([n], np.int32)),
                      block_tables=Tensor(np.arange(6, dtype=np.int32)[None]),
                      context_lens=Tensor(np.array([n + 1], np.int32)))
    assert nerr(model(Tensor(np.array([tok], np.int32)), step).numpy(), want) < logits_tol(w.config)


@pytest.mark.parametrize("kind", ["hf", "Q8_0"])
def test_gemma_matches_reference(tmp_path, kind):
    """Gemma: GeGLU with tanh GELU, embeddings scaled by sqrt(dim), norms of 1 + w (Hugging Face stores w, GGUF
    1 + w: both load to the same scale), tied output."""
    cfg = tiny_model.tiny_config(arch="gemma", tie_embeddings=True)
    paths = tiny_model.write_model(tmp_path, cfg, gguf_types=("Q8_0",))
    w, model = build(paths[kind])
    assert w.config.arch == "gemma" and w.config.tie_embeddings
    np.testing.assert_allclose(w.layers[0].attn_norm, tiny_model.tensor(0, "model.layers.0.input_layernorm.weight",
                                                                        (cfg.dim,)), rtol=1e-6)
    ref = ReferenceLlama(w)
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    want = ref.forward(prompt)
    n = len(prompt)
    step = StepInputs(Tensor(np.arange(n, dtype=np.int32)), Tensor(np.arange(n, dtype=np.int32)),
                      cu_seqlens=Tensor(np.array([0, n], np.int32)), max_seq_len=n)
    assert nerr(model(Tensor(np.array(prompt, np.int32)), step).numpy(), want) < logits_tol(w.config)
    assert ref.greedy(prompt, 6) == run(Engine(model), [prompt], max_tokens=6)[0]


@pytest.mark.parametrize("kind", ["hf", "Q8_0"])
def test_gemma2_matches_reference(tmp_path, kind):
    """Gemma 2: Gemma's blocks plus norms of the attention's and the MLP's outputs, soft-capped scores and logits,
    a sliding window on even layers (8 here, shorter than the prompt), Hugging Face's four norms a layer and GGUF's
    names for them; the query scale from query_pre_attn_scalar (config.json)."""
    import dataclasses

    cfg = tiny_model.tiny_config(**tiny_model.gemma2_overrides())
    paths = tiny_model.write_model(tmp_path, cfg, gguf_types=("Q8_0",))
    w = load_weights(paths[kind], progress=False)
    assert w.config == dataclasses.replace(cfg, query_pre_attn_scalar=cfg.head_dim)  # both files: head_dim's scale
    assert w.layers[0].post_ffn_norm is not None
    np.testing.assert_allclose(w.layers[1].post_attn_norm, tiny_model.tensor(
        0, "model.layers.1.post_attention_layernorm.weight", (cfg.dim,)), rtol=1e-6)
    prompt = [5, 17, 42, 99, 7, 3, 250, 11, 9, 33, 60, 2]
    n = len(prompt)
    step = StepInputs(Tensor(np.arange(n, dtype=np.int32)), Tensor(np.arange(n, dtype=np.int32)),
                      cu_seqlens=Tensor(np.array([0, n], np.int32)), max_seq_len=n)
    plain = dataclasses.replace(w, config=dataclasses.replace(cfg, attn_softcap=0.0, final_softcap=0.0,
                                                               sliding_window=0))
    scalars = [None, 24.0] if kind == "hf" else [None]
    for scalar in scalars:
        wi = dataclasses.replace(w, config=dataclasses.replace(cfg, query_pre_attn_scalar=scalar))
        ref = ReferenceLlama(wi)
        want = ref.forward(prompt)
        assert nerr(ReferenceLlama(plain).forward(prompt), want) > 1e-2  # caps and window change the result
        model = LlamaModel(wi, num_blocks=48, block_size=BLOCK, kv_dtype="f32", max_blocks_per_seq=6,
                           float_dtype="float32")
        assert nerr(model(Tensor(np.array(prompt, np.int32)), step).numpy(), want) < logits_tol(wi.config)
        assert ref.greedy(prompt, 6) == run(Engine(model), [prompt], max_tokens=6)[0]


@pytest.mark.slow
def test_gemma2_reference_is_transformers_gemma2(tmp_path):
    """The numpy reference's Gemma 2 against Hugging Face's own (PyTorch, float32, eager attention: the one that
    soft-caps) on the tiny model's Hugging Face files: norms, caps, the window's layers and its edge. Needs the
    `reference` extra."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = tiny_model.tiny_config(**tiny_model.gemma2_overrides(), n_layers=3)
    hf = tiny_model.write_model(tmp_path, cfg, gguf_types=())["hf"]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    prompt = [5, 17, 42, 99, 7, 3, 250, 11, 9, 33, 60, 2, 8, 100]
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].double().numpy()
    assert nerr(ReferenceLlama(load_weights(hf, progress=False)).forward(prompt), want) < 1e-5


def prefill_prompt(model) -> int:
    """Prefill the decode tests' prompt as one sequence (positions and slots 0..n-1); its length n."""
    prompt = [5, 17, 42, 99, 7, 3]
    n = len(prompt)
    model(Tensor(np.array(prompt, np.int32)), StepInputs(
        Tensor(np.arange(n, dtype=np.int32)), Tensor(np.arange(n, dtype=np.int32)),
        cu_seqlens=Tensor(np.array([0, n], np.int32)), max_seq_len=n)).numpy()
    return n


@pytest.mark.parametrize("int_dot,kind", [("0", "Q4_0"), ("1", "Q4_0"), ("1", "Q4_0-head32")])
def test_fused_decode_layers_match_unfused(models, int_dot, kind, monkeypatch):
    """A decode step with the fused templates (the norm, the gated unit and the attention writing int8 activations
    where the products take them; keys rotated and written from the q/k/v rows) against the same model built unfused
    (VKGRAPH_DECODE_FUSION=0), float and integer paths; the fused step dispatches fewer kernels."""
    from vkgraph import templates
    from vkgraph.realize import count_kernels
    from vkgraph.runtime import get_device

    if int_dot == "1" and not get_device().info.integer_dot_product:
        pytest.skip("no shaderIntegerDotProduct on this device")
    monkeypatch.setenv("VKGRAPH_INT_DOT", int_dot)
    w, model = build(models[kind])
    n = prefill_prompt(model)

    def decode(pos: int) -> tuple[np.ndarray, int]:
        step = StepInputs(Tensor(np.array([pos], np.int32)), Tensor(np.array([pos], np.int32)),
                          block_tables=Tensor(np.array([[0, 1, 2, 3, 4, 5]], np.int32)),
                          context_lens=Tensor(np.array([pos + 1], np.int32)))
        with count_kernels() as c:
            got = model(Tensor(np.array([11], np.int32)), step).numpy()
        return got, c.count

    before, glu = templates.DISPATCHES["kv_write"], templates.DISPATCHES["matvec_q4_0+glu_q8"]
    quantized = templates.DISPATCHES["quantize_q8"]
    fused, fused_kernels = decode(n)
    # the gate/up product writes the down product's int8 activations itself (test_glu_epilogue_... below)
    assert (templates.DISPATCHES["matvec_q4_0+glu_q8"] > glu) == (int_dot == "1")
    # with heads of 32 every integer-path product's input comes from the kernel before it (the norms, the gated
    # unit, the attention): no quantization kernel of its own; heads of 16 leave the output product's to quantize_q8
    assert (templates.DISPATCHES["quantize_q8"] == quantized) == (int_dot == "0" or w.config.head_dim % 32 == 0)
    monkeypatch.setenv("VKGRAPH_DECODE_FUSION", "0")
    q8 = templates.DISPATCHES["rmsnorm_q8"]
    unfused, unfused_kernels = decode(n)  # the same position again: rewrites the same cache slot
    assert templates.DISPATCHES["rmsnorm_q8"] == q8 and templates.DISPATCHES["kv_write"] > before
    assert fused_kernels < unfused_kernels
    assert nerr(fused, unfused) < (1e-2 if int_dot == "1" else 1e-5)


@pytest.mark.parametrize("kind,rows", [("Q4_0", 1), ("Q8_0", 3), ("Q4_0-head32", 8)])
def test_glu_epilogue_decode_matches_glu_q8(models, kind, rows, monkeypatch):
    """A decode step of `rows` sequences whose gate/up products write the down products' int8 activations in their
    epilogue (two kernels per MLP) against the same model with VKGRAPH_GLU_EPILOGUE=0 (gate/up, glu_q8, down), on
    the integer path: the logits (the epilogue's launch may sum the products in another order: a rare rounding
    step of an int8 activation), and one kernel fewer per layer."""
    from vkgraph import templates
    from vkgraph.realize import count_kernels
    from vkgraph.runtime import get_device

    if not get_device().info.integer_dot_product or "shuffle" not in get_device().info.subgroup_ops:
        pytest.skip("no shaderIntegerDotProduct or subgroup shuffles on this device")
    monkeypatch.setenv("VKGRAPH_INT_DOT", "1")
    w, model = build(models[kind])
    n = prefill_prompt(model)
    # rows queries continuing the prompt's sequence, each at its own position (its key written first)
    pos = np.arange(n, n + rows, dtype=np.int32)
    step = StepInputs(Tensor(pos), Tensor(pos), block_tables=Tensor(np.tile(np.arange(6, dtype=np.int32), (rows, 1))),
                      context_lens=Tensor(pos + 1))
    tokens = Tensor(np.array([11, 3, 250, 9, 60, 2, 8, 100][:rows], np.int32))
    label = f"matvec_{w.layers[0].w_gate.format.name.lower()}+glu_q8"
    runs = {}
    for setting in ("8", "0"):  # up to 8 rows, never
        monkeypatch.setenv("VKGRAPH_GLU_EPILOGUE", setting)
        epilogue, glu = templates.DISPATCHES[label], templates.DISPATCHES["glu_q8"]
        with count_kernels() as c:
            runs[setting] = model(tokens, step).numpy(), c.count
        assert (templates.DISPATCHES[label] - epilogue, templates.DISPATCHES["glu_q8"] - glu) == (
            (w.config.n_layers, 0) if setting == "8" else (0, w.config.n_layers))
    assert runs["8"][1] == runs["0"][1] - w.config.n_layers
    assert nerr(runs["8"][0], runs["0"][0]) < 2e-3


@pytest.mark.parametrize("kind", ["Q4_0-head32", "Q8_0"])
def test_norms_in_the_products_prologue_match_their_kernels(models, kind, monkeypatch):
    """VKGRAPH_NORM_PROLOGUE=8: a decode step's norms before the integer-path products (q/k/v, gate/up, the LM head)
    run in those products' prologue (matvec_<format>+norm; gate/up with the gated unit in its epilogue too,
    +norm+glu_q8), with no norm kernel; logits against the same step with the norms' own kernels (0) at 1, 3 and 8
    sequences, on one random cache. A prefill, and rows past the flag's, keep the norms' kernels."""
    from vkgraph import templates
    from vkgraph.realize import count_kernels
    from vkgraph.runtime import get_device

    if not get_device().info.integer_dot_product:
        pytest.skip("no shaderIntegerDotProduct on this device")
    monkeypatch.setenv("VKGRAPH_INT_DOT", "1")
    monkeypatch.setenv("VKGRAPH_GLU_EPILOGUE", "8")  # gate/up with both at every batch here
    w, model = build(models[kind])
    label = f"matvec_{kind.split('-')[0].lower()}+norm"
    both = label + "+glu_q8"  # gate/up: the norm in its prologue, the gated unit in its epilogue
    rng = np.random.default_rng(0)
    for c in model.caches:
        for name in ("key", "value"):
            setattr(c, name, Tensor(rng.standard_normal(getattr(c, name).shape[0]).astype(np.float32).view(np.uint32)))

    def run(step: StepInputs, ids: np.ndarray, setting: str) -> tuple[np.ndarray, int, int, int, int]:
        monkeypatch.setenv("VKGRAPH_NORM_PROLOGUE", setting)
        before = {name: templates.DISPATCHES[name] for name in ("rmsnorm_q8", label, both)}
        with count_kernels() as c:
            logits = model(Tensor(ids), step).numpy()
        runs = {name: templates.DISPATCHES[name] - n for name, n in before.items()}
        return logits, c.count, runs["rmsnorm_q8"], runs[label] + runs[both], runs[both]

    def step_of(batch: int) -> tuple[StepInputs, np.ndarray]:
        """A decode step of `batch` sequences of drawn lengths and block tables, and its token ids."""
        lens = rng.integers(1, 6 * BLOCK, batch)
        table = rng.permutation(48)[:batch * 6].reshape(batch, 6).astype(np.int32)
        slots = table[np.arange(batch), (lens - 1) // BLOCK] * BLOCK + (lens - 1) % BLOCK
        step = StepInputs(Tensor((lens - 1).astype(np.int32)), Tensor(slots.astype(np.int32)),
                          block_tables=Tensor(table), context_lens=Tensor(lens.astype(np.int32)), decode=True)
        return step, rng.integers(0, w.config.vocab_size, batch).astype(np.int32)

    for batch in (1, 3, 8):
        step, ids = step_of(batch)
        on, on_kernels, on_norms, on_prologues, on_both = run(step, ids, "8")
        off, off_kernels, off_norms, off_prologues, _ = run(step, ids, "0")  # rewrites the same cache slots
        assert on_norms == off_prologues == 0 and on_prologues == off_norms >= 2 * len(model.layers)
        assert on_both == len(model.layers)
        assert on_kernels == off_kernels - on_prologues
        # the same int8 values either way, but a last-bit difference may move a rounding step
        assert nerr(on, off) < 1e-2, batch
    n = 5
    prefill = StepInputs(Tensor(np.arange(n, dtype=np.int32)), Tensor(np.arange(n, dtype=np.int32)),
                         cu_seqlens=Tensor(np.array([0, n], np.int32)), max_seq_len=n)
    assert run(prefill, np.arange(1, n + 1, dtype=np.int32), "8")[3] == 0
    assert run(*step_of(3), "2")[3] == 0  # past the flag's rows


@pytest.mark.parametrize("kind,kv_dtype,int_dot", [("Q4_0", "f16", "0"), ("Q4_0-head32", "f32", "1"),
                                                   ("gemma2", "f32", "0"), ("float32", "f16", "0")])
def test_decode_step_writes_the_new_tokens_in_the_attention(models, kind, kv_dtype, int_dot, tmp_path, monkeypatch):
    """A decode step (StepInputs.decode) whose attention rotates and writes the new keys and values itself, one
    kernel per layer, against the two-kernel route (rope_write_kv, then paged_decode) on a second copy of the model
    with the same cache: drawn batches of 1-8 sequences of different lengths, block tables of 6 or 12 blocks (96 or
    192 positions: split-K off, or on in partitions of 128) and a padding row (slot -1, no context); GQA (4 query
    heads on 2), float16 and float32 caches, a sliding window and soft-capping (the Gemma 2 model's even layers),
    the integer path (heads of 32: the attention writes the output product's int8 rows); logits and every layer's
    cache after the step."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from vkgraph import templates
    from vkgraph.realize import count_kernels
    from vkgraph.runtime import get_device

    if int_dot == "1" and not get_device().info.integer_dot_product:
        pytest.skip("no shaderIntegerDotProduct on this device")
    monkeypatch.setenv("VKGRAPH_INT_DOT", int_dot)
    monkeypatch.setenv("VKGRAPH_NORM_PROLOGUE", "0")  # the norms' kernels in both routes: only the attention differs
    if kind == "gemma2":
        path = tiny_model.write_model(tmp_path, tiny_model.tiny_config(**tiny_model.gemma2_overrides()),
                                      gguf_types=())["hf"]
    w = load_weights(path if kind == "gemma2" else models[kind], progress=False)
    pair = [LlamaModel(w, num_blocks=108, block_size=BLOCK, kv_dtype=kv_dtype, max_blocks_per_seq=12,
                       float_dtype="float32") for _ in range(2)]
    kv = np.float16 if kv_dtype == "f16" else np.float32

    @settings(max_examples=5, deadline=None)
    @given(width=st.sampled_from([6, 12]), lens=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=8),
           pad=st.booleans(), seed=st.integers(0, 2**31))
    def case(width, lens, pad, seed):
        rng = np.random.default_rng(seed)
        for layer in zip(*(m.caches for m in pair)):  # one random cache for both models
            for name in ("key", "value"):
                words = rng.standard_normal(getattr(layer[0], name).shape[0] * 4 // kv().itemsize).astype(kv)
                for c in layer:
                    setattr(c, name, Tensor(words.view(np.uint32)))
        lens = np.array([n % (width * BLOCK) + 1 for n in lens] + [0] * (pad and len(lens) < 8))  # 8 rows at most
        table = rng.permutation(108)[:len(lens) * width].reshape(len(lens), width).astype(np.int32)
        slots = np.where(lens > 0, table[np.arange(len(lens)), (lens - 1) // BLOCK] * BLOCK + (lens - 1) % BLOCK, -1)
        step = dict(positions=np.maximum(lens - 1, 0), slot_mapping=slots, block_tables=table, context_lens=lens)
        ids = Tensor(rng.integers(0, w.config.vocab_size, len(lens)).astype(np.int32))
        outs, q8 = [], (templates.DISPATCHES["rmsnorm_q8"], templates.DISPATCHES["quantize_q8"])
        for m, decode in zip(pair, (False, True)):
            kv_writes = templates.DISPATCHES["kv_write"]
            with count_kernels() as c:
                logits = m(ids, StepInputs(**{k: Tensor(np.asarray(v, np.int32)) for k, v in step.items()},
                                           decode=decode)).numpy()
            outs.append((logits, c.count))
            assert (templates.DISPATCHES["kv_write"] == kv_writes) == decode
        (two, two_kernels), (one, one_kernels) = outs
        assert one_kernels == two_kernels - len(pair[0].layers)
        if int_dot == "1":  # int8 rows from the norms and the attention: no quantization kernel
            assert templates.DISPATCHES["rmsnorm_q8"] > q8[0] and templates.DISPATCHES["quantize_q8"] == q8[1]
        real = lens > 0
        # the integer path: a last-bit difference of the attention's output may move an int8 rounding step
        assert nerr(one[real], two[real]) < (1e-2 if int_dot == "1" else 1e-5) and not np.isnan(one).any()
        for a, b in zip(pair[0].caches, pair[1].caches):
            for x, y in ((a.key, b.key), (a.value, b.value)):
                # equal on lavapipe; a driver that contracts the rotation into an FMA in one kernel only may move a
                # rounding by one unit in the last place
                np.testing.assert_allclose(y.numpy().view(kv).astype(np.float64), x.numpy().view(kv),
                                           rtol=2.0 ** -10 if kv_dtype == "f16" else 1e-6, atol=0)

    case()


def test_logprobs_equal_numpy_log_softmax_of_the_reference_logits(models):
    """Prefill and decode steps, greedy and sampled rows, batched with a request that asks for none."""
    w, model = build(models["float32"])
    ref = ReferenceLlama(w)
    eng = Engine(model)
    prompts = {eng.add_request([5, 17, 42], max_tokens=6, logprobs=3): [5, 17, 42],
               eng.add_request([9, 8, 7, 6], SamplingParams(temperature=1.0, seed=3), max_tokens=6, logprobs=0):
               [9, 8, 7, 6]}
    plain = eng.add_request([9, 8], max_tokens=6)
    events: dict[int, list] = {}
    while eng.has_work():
        for ev in eng.step():
            events.setdefault(ev.request_id, []).append(ev)
    assert all(ev.logprobs is None for ev in events[plain])
    for rid, prompt in prompts.items():
        toks = [ev.token for ev in events[rid]]
        logits = ref.forward(prompt + toks)[len(prompt) - 1:-1]
        z = logits - logits.max(-1, keepdims=True)
        want = z - np.log(np.exp(z).sum(-1, keepdims=True))
        for j, ev in enumerate(events[rid]):
            assert abs(ev.logprobs.logprob - want[j, toks[j]]) < 1e-4
            k = len(ev.logprobs.top)
            assert k == (3 if rid == 0 else 0)
            assert [i for i, _ in ev.logprobs.top] == list(np.argsort(-want[j])[:k])
            np.testing.assert_allclose([v for _, v in ev.logprobs.top], np.sort(want[j])[::-1][:k], atol=1e-4)
    with pytest.raises(ValueError, match="logprobs"):
        eng.add_request([5], logprobs=21)

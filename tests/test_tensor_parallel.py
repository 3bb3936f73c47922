"""Tensor parallelism (vkgraph.parallel, vkgraph.nn.shard) over two logical devices on the one physical device:
the same code path as over two GPUs, with outputs equal to the single-device model's within float tolerance for
every weight format; and the runtime's device routing it stands on (runtime.use_device)."""

import httpx
import numpy as np
import pytest

import vkgraph as vg
from vkgraph import quant
from vkgraph.nn import tiny_model
from vkgraph.nn.engine import Engine
from vkgraph.nn.layers import StepInputs
from vkgraph.nn.llama import LlamaModel
from vkgraph.nn.shard import RandomWeights, shard_weights, take_cols, take_rows
from vkgraph.nn.weights import ExpertWeights, LayerWeights, ModelWeights
from vkgraph.parallel import TensorParallelModel, tensor_parallel_devices
from vkgraph.runtime import KernelInterfaceError, get_device, use_device
from vkgraph.tensor import Tensor

BLOCK = 16
KW = dict(num_blocks=16, block_size=BLOCK, kv_dtype="f32", max_blocks_per_seq=4, float_dtype="float32")
# formats of 256-element blocks need rows and the ranks' column ranges in whole blocks
SMALL = dict(vocab_size=256)
WIDE = dict(vocab_size=256, dim=256, head_dim=128, ffn_dim=512)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]  # the engine tests' requests


@pytest.fixture(scope="module")
def devices():
    return tensor_parallel_devices(2)


@pytest.fixture(autouse=True)
def float_activations(monkeypatch):
    """Quantized products on float activations, as on lavapipe: the sums of two devices differ from one device's
    in the last bits, which int8 activation rounding (the default where integer dot products are fast) can turn
    into a step of 1/127; test_int8_activations_stay_close checks that path with its own tolerance."""
    monkeypatch.setenv("VKGRAPH_INT_DOT", "0")


def make_weights(cfg, fmt: str, seed: int = 0) -> ModelWeights:
    """Random weights of `cfg`, every projection in `fmt` (quantized where vkgraph quantizes it, random valid
    blocks where it only reads it)."""
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int):
        x = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        if fmt == "F32":
            return x
        if fmt in quant.QUANTIZERS:
            return quant.quantize(x, fmt)
        return quant.random_blocks(rng, fmt, rows, cols)

    def vec(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    d, q, kv, f = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    layers = []
    for _ in range(cfg.n_layers):
        lw = LayerWeights(vec(d), mat(q, d), mat(kv, d), mat(kv, d), mat(d, q), vec(d))
        if cfg.attn_bias:
            lw.bq, lw.bk, lw.bv = (0.1 * rng.standard_normal(n).astype(np.float32) for n in (q, kv, kv))
        if cfg.is_moe:
            lw.router = rng.standard_normal((cfg.n_experts, d)).astype(np.float32)
            lw.experts = [ExpertWeights(mat(f, d), mat(f, d), mat(d, f)) for _ in range(cfg.n_experts)]
        else:
            lw.w_gate, lw.w_up, lw.w_down = mat(f, d), mat(f, d), mat(d, f)
        layers.append(lw)
    embed = rng.standard_normal((cfg.vocab_size, d)).astype(np.float32)
    return ModelWeights(cfg, embed, layers, vec(d), mat(cfg.vocab_size, d))


def nerr(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got).any()
    return float(np.abs(got - want).max() / np.abs(want).max())


def compare(weights: ModelWeights | RandomWeights, devices, decode_steps: int = 4, capture: bool = True,
            all_reduce: str = "host") -> float:
    """Largest normalised difference of the two-device model's logits from the single-device model's over a
    prefill and `decode_steps` decode steps (greedy tokens of the single-device model); with `capture` the ranks'
    pieces run eagerly, are captured, then replayed from the third decode step on."""
    single = LlamaModel(weights.shard(0, 1) if isinstance(weights, RandomWeights) else weights, **KW)
    tp = TensorParallelModel(weights, 2, devices=devices, capture=capture, all_reduce=all_reduce, **KW)
    prompt = np.array([5, 17, 42, 99, 7, 3, 250, 11, 9, 33], np.int32)
    n = len(prompt)
    table = np.array([[3, 0, 2, 1]], np.int32)  # shuffled physical blocks
    slots = lambda pos: table[0, pos // BLOCK] * BLOCK + pos % BLOCK  # noqa: E731

    def prefill() -> StepInputs:
        return StepInputs(Tensor(np.arange(n, dtype=np.int32)), Tensor(slots(np.arange(n)).astype(np.int32)),
                          cu_seqlens=Tensor(np.array([0, n], np.int32)), max_seq_len=n)

    want = single(Tensor(prompt), prefill()).numpy()
    worst = nerr(tp(Tensor(prompt), prefill()).numpy(), want)
    tok = int(want[-1].argmax())
    for pos in range(n, n + decode_steps):
        def step(pos: int = pos) -> StepInputs:
            return StepInputs(Tensor(np.array([pos], np.int32)), Tensor(np.array([slots(pos)], np.int32)),
                              block_tables=Tensor(table), context_lens=Tensor(np.array([pos + 1], np.int32)))

        want = single(Tensor(np.array([tok], np.int32)), step()).numpy()
        worst = max(worst, nerr(tp(Tensor(np.array([tok], np.int32)), step()).numpy(), want))
        tok = int(want[-1].argmax())
    tp.close()
    return worst


def generate_tokens(model, max_tokens: int = 6) -> dict[int, list[int]]:
    """The tokens the engine generates greedily for PROMPTS with `model`, by request."""
    out: dict[int, list[int]] = {}
    for ev in Engine(model, max_batch=4).generate(PROMPTS, max_tokens=max_tokens):
        out.setdefault(ev.request_id, []).append(ev.token)
    return out


# ---- the runtime's routing ----------------------------------------------------------------------------------

def test_use_device_routes_work_and_refuses_another_devices_buffers(devices):
    d0, d1 = devices
    assert d0 is get_device() and d1 is not d0
    a = Tensor(np.arange(8, dtype=np.float32))
    with use_device(d1):
        assert get_device() is d1
        b = Tensor(np.arange(8, dtype=np.float32))
        assert b.node.arg[0].buf.alloc.owner is d1.memory
        assert (b * 2).sum().numpy() == 56.0
        with pytest.raises(KernelInterfaceError, match="another device"):
            (a + b).numpy()
    assert get_device() is d0
    assert (a * 2).sum().numpy() == 56.0


def test_a_constant_realized_on_one_device_is_computed_again_on_another(devices):
    d0, d1 = devices
    r0 = Tensor.arange(6).realize()  # kept alive: its buffer on d0 stays the realized entry of arange(6)
    with use_device(d1):
        assert (Tensor.arange(6) + 1).numpy().tolist() == [1, 2, 3, 4, 5, 6]
    assert (r0 + 1).numpy().tolist() == [1, 2, 3, 4, 5, 6]


def test_jit_keeps_captures_per_device(devices):
    d0, d1 = devices
    f = vg.jit(lambda x: (x * 3).sum())
    a = Tensor(np.arange(4, dtype=np.float32))
    with use_device(d1):
        b = Tensor(np.arange(4, dtype=np.float32) + 1)
    for _ in range(3):  # eager, capture, replay on each, alternating
        assert f(a).numpy() == 18.0
        with use_device(d1):
            assert f(b).numpy() == 30.0
    assert len(f.cache) == 1
    with use_device(d1):
        assert len(f.cache) == 1


# ---- sharding -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["F32", "Q8_0", "Q4_K"])
def test_shards_put_back_together_are_the_weights(fmt):
    cfg = tiny_model.tiny_config(**(WIDE if fmt == "Q4_K" else SMALL))
    w = make_weights(cfg, fmt)
    shards = [shard_weights(w, r, 2) for r in range(2)]
    deq = lambda m: quant.dequantize(m) if isinstance(m, quant.QuantizedTensor) else m  # noqa: E731
    for name, axis in (("wq", 0), ("wk", 0), ("wv", 0), ("w_gate", 0), ("w_up", 0), ("wo", 1), ("w_down", 1)):
        whole = np.concatenate([deq(getattr(s.layers[0], name)) for s in shards], axis=axis)
        assert np.array_equal(whole, deq(getattr(w.layers[0], name))), name
    assert shards[1].config.n_heads == cfg.n_heads // 2 and shards[1].config.ffn_dim == cfg.ffn_dim // 2


def test_uneven_or_misaligned_splits_are_refused_before_gpu_work():
    w = make_weights(tiny_model.tiny_config(**SMALL), "F32")
    with pytest.raises(ValueError, match="n_kv_heads"):
        shard_weights(w, 0, 4)  # 2 KV heads over 4 ranks
    q = quant.quantize(np.ones((4, 512), np.float32), "Q4_K")
    assert take_cols(q, 256, 512).shape == (4, 256) and take_rows(q, 1, 3).shape == (2, 512)
    with pytest.raises(ValueError, match="do not split between its blocks"):
        take_cols(q, 0, 128)


# ---- two logical devices against one ------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["F32", "F16", "Q8_0", "Q4_0", "Q4_K"])
def test_two_devices_match_one(devices, fmt):
    cfg = tiny_model.tiny_config(**(WIDE if fmt.endswith("_K") else SMALL))
    assert compare(make_weights(cfg, fmt), devices) < 1e-5


def test_int8_activations_stay_close(devices, monkeypatch):
    if not get_device().info.integer_dot_product:
        pytest.skip("no shaderIntegerDotProduct on this device")
    monkeypatch.setenv("VKGRAPH_INT_DOT", "1")
    assert compare(make_weights(tiny_model.tiny_config(**SMALL), "Q8_0"), devices) < 3e-2


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["BF16", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_two_devices_match_one_every_other_format(devices, fmt):
    cfg = tiny_model.tiny_config(**(WIDE if fmt.endswith("_K") or fmt == "IQ4_XS" else SMALL))
    assert compare(make_weights(cfg, fmt), devices, decode_steps=4) < 1e-5


def test_moe_and_attention_biases_split_too(devices):
    cfg = tiny_model.tiny_config(arch="qwen2", attn_bias=True, n_experts=4, n_experts_per_tok=2, **SMALL)
    assert compare(make_weights(cfg, "Q8_0"), devices, decode_steps=2) < 1e-5


@pytest.mark.parametrize("all_reduce", ["host", "peer"])
def test_random_weights_made_on_each_device_match_one_device(devices, all_reduce):
    if all_reduce == "peer" and not get_device().info.host_import_alignment:
        pytest.skip("the device cannot import host memory")
    cfg = tiny_model.tiny_config(**SMALL)
    assert compare(RandomWeights(cfg, seed=7), devices, all_reduce=all_reduce) < 1e-5
    with pytest.raises(ValueError, match="dense models"):
        RandomWeights(tiny_model.tiny_config(n_experts=4, n_experts_per_tok=2))


needs_import = pytest.mark.skipif(not get_device().info.host_import_alignment,
                                  reason="the device cannot import host memory")


@needs_import
@pytest.mark.parametrize("fmt", ["F32", "Q8_0", "Q4_K"])
def test_peer_all_reduce_matches_one_device(devices, fmt):
    cfg = tiny_model.tiny_config(**(WIDE if fmt.endswith("_K") else SMALL))
    assert compare(make_weights(cfg, fmt), devices, all_reduce="peer") < 1e-5


@needs_import
def test_peer_steps_are_one_graph_per_device_and_a_timed_out_wait_runs_the_step_again(devices):
    w = make_weights(tiny_model.tiny_config(**SMALL), "Q8_0", seed=3)
    want = generate_tokens(LlamaModel(w, **KW))
    tp = TensorParallelModel(w, 2, devices=devices, all_reduce="peer", **KW)
    assert generate_tokens(tp) == want
    if tp.peer.fallbacks and devices[0].info.device_type != "cpu":
        pytest.skip("this driver does not run two logical devices' kernels at once: every peer wait gave up and "
                    "the steps ran again through the host (with the right tokens)")
    assert tp.last_times.reduces == 0  # no all-reduce through the host
    assert all(any(len(st.cache) for st in j._states) for j in tp._whole)  # each rank's steps were captured
    strict = TensorParallelModel(w, 2, devices=devices, all_reduce="peer", **KW)
    strict.peer.spin_limit = 0  # a rank that arrives first gives up at once
    assert generate_tokens(strict) == want
    assert strict.peer.fallbacks > 0 and not strict.peer.failed()
    tp.close()
    strict.close()


def test_uncaptured_ranks_match_too(devices):
    assert compare(make_weights(tiny_model.tiny_config(**SMALL), "Q8_0", seed=1), devices, capture=False) < 1e-5


def test_engine_generates_the_same_tokens_on_two_devices(devices):
    w = make_weights(tiny_model.tiny_config(**SMALL), "Q8_0", seed=3)
    tp = TensorParallelModel(w, 2, devices=devices, **KW)
    assert generate_tokens(tp) == generate_tokens(LlamaModel(w, **KW))
    assert tp.last_times.reduces == 2 * w.config.n_layers and tp.last_times.wall > 0
    tp.close()


def test_a_prompt_that_continues_a_cached_prefix_generates_what_one_device_does(devices):
    # the second prompt's first two blocks are the first's, cached: its prefill attends over them from the cache,
    # which the ranks only do if the step's prefix lengths and tables reach them
    w = make_weights(tiny_model.tiny_config(**SMALL), "Q8_0", seed=5)
    first = [(7 * i + 3) % 256 for i in range(2 * BLOCK + 3)]
    prompts = [first, first[:2 * BLOCK] + [11, 12, 13, 14]]

    def run(model) -> list[list[int]]:
        engine = Engine(model, max_batch=2)
        return [[ev.token for ev in engine.generate([p], max_tokens=4)] for p in prompts]

    tp = TensorParallelModel(w, 2, devices=devices, **KW)
    assert run(tp) == run(LlamaModel(w, **KW))
    tp.close()


def test_a_rank_that_fails_stops_the_others_and_the_next_step_runs(devices):
    w = make_weights(tiny_model.tiny_config(**SMALL), "Q8_0", seed=4)
    tp = TensorParallelModel(w, 2, devices=devices, **KW)
    ids = np.array([3, 1, 4], np.int32)

    def step() -> StepInputs:
        return StepInputs(Tensor(np.arange(3, dtype=np.int32)), Tensor(np.arange(3, dtype=np.int32)),
                          cu_seqlens=Tensor(np.array([0, 3], np.int32)), max_seq_len=3)

    want = tp(Tensor(ids), step()).numpy()
    good = tp.shards[1]._ffn[0]

    def broken(x):
        raise RuntimeError("rank 1 failed")

    tp.shards[1]._ffn[0] = broken  # after rank 0 has posted its first part: rank 0 waits at the second
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        tp(Tensor(ids), step())
    tp.shards[1]._ffn[0] = good
    assert np.array_equal(tp(Tensor(ids), step()).numpy(), want)
    tp.close()


# ---- the command line and the server ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    return tiny_model.write_model(tmp_path_factory.mktemp("tp"), tiny_model.tiny_config(n_layers=1),
                                  gguf_types=("Q8_0",))


def test_generate_with_tensor_parallel_prints_what_one_device_prints(tiny_files, capsys):
    from vkgraph import generate

    outs = []
    for n in ("1", "2"):
        assert generate.main(["--model", str(tiny_files["Q8_0"]), "--prompt", "Hello world", "--max-tokens", "8",
                              "--tensor-parallel", n]) == 0
        out, err = capsys.readouterr()
        outs.append(out)
        assert ("on 2 devices" in err) == (n == "2")
    assert outs[0] == outs[1] and outs[0].startswith("Hello world")
    assert generate.main(["--model", str(tiny_files["Q8_0"]), "--prompt", "a", "--tensor-parallel", "0"]) == 2
    assert "--tensor-parallel must be at least 1" in capsys.readouterr().err


def test_server_with_tensor_parallel_answers_as_one_device_does(tiny_files):
    pytest.importorskip("openai")
    from test_serve import Server

    from vkgraph.nn.tokenizer import Tokenizer
    from vkgraph.nn.weights import load_weights

    w = load_weights(tiny_files["hf"], progress=False)
    tok = Tokenizer.load(tiny_files["hf"])
    engine = Engine(LlamaModel(w, num_blocks=32, max_blocks_per_seq=8), tok)
    want = "".join(ev.text for ev in engine.generate(["The capital of France"], max_tokens=10))
    server = Server(tiny_files["hf"], "--tensor-parallel", "2", "--num-blocks", "32", "--max-context", "128")
    try:
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "The capital of France",
                                                             "max_tokens": 10, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    finally:
        server.stop()


@pytest.mark.slow
def test_ranks_as_ray_actors_generate_what_one_device_does(tiny_files):
    """Two processes on this host, each its own device, all-reducing through gloo."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("torch.distributed")
    from vkgraph.distributed import RayTensorParallelModel
    from vkgraph.nn.weights import load_weights

    kw = dict(num_blocks=16, max_blocks_per_seq=4)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        model = RayTensorParallelModel(tiny_files["Q8_0"], 2, **kw)
        single = LlamaModel(load_weights(tiny_files["Q8_0"], progress=False), **kw)
        assert generate_tokens(model, 8) == generate_tokens(single, 8)
        assert model.last_times.reduces == 2 * model.config.n_layers
        model.close()
    finally:
        ray.shutdown()

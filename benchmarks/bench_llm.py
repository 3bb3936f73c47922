"""LLM serving benchmark: decode tokens/s at several batch sizes and prefill tokens/s, for a model of a given
shape with random weights in Q4_0 / Q8_0, beside an eager PyTorch float16 implementation of the same shape
on the same GPU (when PyTorch with CUDA is present).

    python benchmarks/bench_llm.py [--shape llama3-8b|llama3.2-1b|smollm2-135m|small] [--formats Q4_0,Q8_0,Q4_K]
                                   [--batches 1,8,32] [--context 16]
    python benchmarks/bench_llm.py --gguf model-q4_0.gguf [--gguf model-q8_0.gguf]   # same files as llama.cpp

Decode: the median step of --steps after the requests' prompts of --context tokens (the context each step attends,
plus the tokens decoded so far; PyTorch's decode attends a cache of the same length).
Prefill: the median of three prompts of --prompt tokens (each new, so no cached prefix), the first token included.
Without --gguf, random weights are valid GGUF blocks of any quantized format built directly (small finite
float16 scales, random quants and bits: vkgraph.quant.random_blocks), so no file is written; a shape with tied
embeddings (llama3.2-1b) reads its embedding table from the head's blocks.
With --gguf (e.g. from `scripts/make_tiny_model.py OUT --preset llama3-8b --gguf Q4_0`), vkgraph and
llama.cpp's Vulkan backend (the `cyllama-vulkan` wheel, when importable) load the same file; llama.cpp's decode
rate counts the tokens its stream yields (its own statistics re-tokenize).
The bandwidth bound printed is weight bytes read per decode step over the copy bandwidth
given by --copy-gbs (measure it with benchmarks/bench_runtime.py on the same GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from common import cuda_torch, raise_clocks, raise_torch_clocks

from vkgraph.nn.config import ModelConfig, RopeScaling
from vkgraph.nn.engine import MAX_PREFILL_TOKENS, Engine
from vkgraph.nn.llama import LlamaModel
from vkgraph.nn.weights import LayerWeights, ModelWeights
from vkgraph.quant import dequantize, random_blocks
from vkgraph.runtime import get_device

SHAPES = {
    "llama3-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      head_dim=128, rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),
    # Llama-3.2-1B: the head is the embedding matrix (tie_embeddings)
    "llama3.2-1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                        head_dim=64, rope_theta=500000.0, tie_embeddings=True,
                        rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)),
    # SmolLM2-135M (the real checkpoint of tests/test_checkpoint.py, whose file cannot travel to a GPU machine)
    "smollm2-135m": dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536, head_dim=64,
                         rope_theta=100000.0, tie_embeddings=True),
    "small": dict(vocab_size=2048, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, head_dim=64),
}


def random_model(cfg: ModelConfig, fmt: str, seed: int = 0) -> ModelWeights:
    rng = np.random.default_rng(seed)
    d, q, kv, f = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    mat = lambda r, c: random_blocks(rng, fmt, r, c, d_range=(1e-3, 1e-2))  # noqa: E731
    ones = np.ones(d, np.float32)
    layers = [LayerWeights(ones, mat(q, d), mat(kv, d), mat(kv, d), mat(d, q), ones, w_gate=mat(f, d),
                           w_up=mat(f, d), w_down=mat(d, f)) for _ in range(cfg.n_layers)]
    head = mat(cfg.vocab_size, d)
    if cfg.tie_embeddings:  # one matrix: the table the model gathers from is the head's, dequantized
        embed = dequantize(head).astype(np.float16)
    else:
        embed = (rng.standard_normal((cfg.vocab_size, d), dtype=np.float32) * 0.02).astype(np.float16)
    return ModelWeights(cfg, embed, layers, ones, head)


def weight_bytes(w: ModelWeights) -> int:
    total = w.lm_head.nbytes
    for lw in w.layers:
        total += sum(m.nbytes for m in (lw.wq, lw.wk, lw.wv, lw.wo, lw.w_gate, lw.w_up, lw.w_down))
    return total


def admission_passes(batch: int, context: int, max_prefill_tokens: int) -> int:
    """The most admission passes (engine steps) that prefilling `batch` prompts of `context` tokens takes."""
    return -(-batch // max(1, max_prefill_tokens // context))


def request_blocks(batch: int, context: int, tokens: int, block: int = 16) -> int:
    """KV blocks one of warm_engine's `batch` requests of `context` prompt tokens reaches: its prompt, a token for
    each admission pass that prefills later requests, and `tokens` more (the warm-up's and the timed steps')."""
    return -(-(context + admission_passes(batch, context, MAX_PREFILL_TOKENS) + tokens) // block)


def warm_engine(model: LlamaModel, vocab: int, batch: int, max_tokens: int, context: int = 16) -> Engine:
    """An engine of `batch` requests of `context` prompt tokens each, past its warm-up: every prefill (one admission
    pass takes up to the engine's max_prefill_tokens, so long prompts take several steps), then the JIT's eager
    call, capture and first replay of the decode step (three steps), the device idle."""
    engine = Engine(model, max_batch=batch)
    # a request admitted early decodes a token in each later admission pass: its budget covers them
    passes = admission_passes(batch, context, engine.max_prefill_tokens)
    for i in range(batch):
        engine.add_request([(i * 7 + j) % vocab for j in range(context)], max_tokens=max_tokens + passes,
                           stop_token_ids=[])
    while engine.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    get_device().synchronize()
    return engine


def bench_vkgraph(w: ModelWeights, batches: list[int], decode_steps: int, prompt_len: int, context: int = 16) -> dict:
    block = 16
    decode_blocks = request_blocks(max(batches), context, decode_steps + 16, block)
    per_seq = max(decode_blocks, -(-(prompt_len + 2) // block))
    model = LlamaModel(w, num_blocks=max(batches) * decode_blocks + 2 * per_seq + 16, max_blocks_per_seq=per_seq)
    out = {}
    for b in batches:
        engine = warm_engine(model, w.config.vocab_size, b, decode_steps + 8, context)
        raise_clocks()  # an idle H200 sits at 345 MHz: short timed runs after loading read 2-4x slow
        times = []
        for _ in range(decode_steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        out[b] = b / statistics.median(times)
        while engine.has_work():
            engine.step()
    engine = Engine(model, max_batch=1)
    vocab = w.config.vocab_size
    engine.add_request([i % vocab for i in range(prompt_len)], max_tokens=1, stop_token_ids=[])
    engine.step()
    raise_clocks()
    times = []
    for r in range(1, 4):  # the median of three prefills (and their first tokens) of new prompts
        engine.add_request([(i + r) % vocab for i in range(prompt_len)], max_tokens=1, stop_token_ids=[])
        get_device().synchronize()
        t = time.perf_counter()
        engine.step()
        get_device().synchronize()
        times.append(time.perf_counter() - t)
    out["prefill"] = prompt_len / statistics.median(times)
    return out


def bench_torch(cfg: ModelConfig, batches: list[int], decode_steps: int, prompt_len: int,
                context: int = 16) -> dict | None:
    torch = cuda_torch()
    if torch is None:
        return None
    import torch.nn.functional as F
    dev, dt = "cuda", torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    d, hd, h, hkv, f = cfg.dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=g) * 0.02  # noqa: E731
    layers = [dict(wqkv=r((h + 2 * hkv) * hd, d), wo=r(d, h * hd), wgu=r(2 * f, d), wd=r(d, f))
              for _ in range(cfg.n_layers)]
    emb, head = r(cfg.vocab_size, d), r(cfg.vocab_size, d)
    max_len = max(prompt_len, context) + decode_steps + 32

    def norm(x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(dt)

    def forward(tok, caches, pos):
        x = emb[tok]  # (b, t, d)
        b, t, _ = x.shape
        for p, (kc, vc) in zip(layers, caches):
            qkv = norm(x) @ p["wqkv"].T
            q, k, v = qkv.split([h * hd, hkv * hd, hkv * hd], -1)
            q = q.view(b, t, h, hd).transpose(1, 2)
            kc[:, :, pos:pos + t] = k.view(b, t, hkv, hd).transpose(1, 2)
            vc[:, :, pos:pos + t] = v.view(b, t, hkv, hd).transpose(1, 2)
            kk, vv = kc[:, :, :pos + t], vc[:, :, :pos + t]
            a = F.scaled_dot_product_attention(q, kk, vv, is_causal=t > 1, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(b, t, h * hd) @ p["wo"].T
            gu = norm(x) @ p["wgu"].T
            gate, up = gu.chunk(2, -1)
            x = x + (F.silu(gate) * up) @ p["wd"].T
        return norm(x[:, -1]) @ head.T

    out = {}
    with torch.no_grad():
        for b in batches:
            caches = [(torch.zeros(b, hkv, max_len, hd, device=dev, dtype=dt),
                       torch.zeros(b, hkv, max_len, hd, device=dev, dtype=dt)) for _ in layers]
            tok = torch.zeros(b, 1, dtype=torch.long, device=dev)
            for i in range(3):
                forward(tok, caches, context + i)
            raise_torch_clocks(torch)
            times = []
            for i in range(decode_steps):
                t = time.perf_counter()
                tok = forward(tok, caches, context + 3 + i).argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            out[b] = b / statistics.median(times)
            del caches
        caches = [(torch.zeros(1, hkv, max_len, hd, device=dev, dtype=dt),
                   torch.zeros(1, hkv, max_len, hd, device=dev, dtype=dt)) for _ in layers]
        prompt = torch.arange(prompt_len, device=dev).view(1, -1)
        forward(prompt, caches, 0)
        raise_torch_clocks(torch)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            forward(prompt, caches, 0)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out["prefill"] = prompt_len / statistics.median(times)
    return out


def bench_llama_cpp(path: str, decode_tokens: int, prompt_len: int) -> dict | None:
    """llama.cpp (Vulkan) at batch 1 on a GGUF file: decode and prefill tokens/s, or None if unavailable."""
    try:
        from cyllama import LLM, GenerationConfig
    except ImportError:
        return None
    llm = LLM(path, GenerationConfig(n_gpu_layers=-1, temperature=0.0, max_tokens=decode_tokens, n_ctx=4096))
    prompt = " ".join(["hello"] * prompt_len)
    stamps: list[float] = []
    t0 = time.perf_counter()
    for _ in llm(prompt, stream=True, on_token=lambda _t: stamps.append(time.perf_counter())):
        pass
    llm.close()
    if len(stamps) < 2:
        return None
    return {1: (len(stamps) - 1) / (stamps[-1] - stamps[0]), "prefill": prompt_len / (stamps[0] - t0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--formats", default="Q4_0,Q8_0")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--context", type=int, default=16, help="prompt tokens of each decoding request")
    ap.add_argument("--copy-gbs", type=float, default=4100.0,
                    help="measured copy bandwidth, GB/s (bytes read + written per second)")
    ap.add_argument("--gguf", action="append", default=[], help="a GGUF file to load in vkgraph and llama.cpp")
    ap.add_argument("--no-peers", action="store_true", help="vkgraph only (no llama.cpp, no PyTorch)")
    a = ap.parse_args()
    cfg = ModelConfig(arch="llama", max_seq_len=8192, **SHAPES[a.shape])
    batches = [int(x) for x in a.batches.split(",")]
    print(f"device: {get_device().info.name}; " + (f"files {a.gguf}" if a.gguf else f"shape {a.shape}"))
    head = "".join(f"{'decode b=' + str(b):>14s}" for b in batches)
    print(f"{'':22s}{head}{'prefill':>12s}{'bound b=1':>11s}", flush=True)

    def row(name: str, r: dict, bound: float | None = None) -> None:
        cells = "".join(f"{r[b]:14.1f}" if b in r else f"{'-':>14s}" for b in batches)
        print(f"{name:22s}{cells}{r['prefill']:12.1f}" + (f"{bound:11.0f}" if bound else ""), flush=True)

    sources = [(p, None) for p in a.gguf] or [(None, fmt) for fmt in a.formats.split(",")]
    for path, fmt in sources:
        if path is not None:
            from vkgraph.nn.weights import load_weights

            w = load_weights(path)
            cfg = w.config
            label = path.rsplit("/", 1)[-1]
        else:
            w, label = random_model(cfg, fmt), fmt
        bound = a.copy_gbs * 1e9 / weight_bytes(w)  # decode reads every weight once per step
        row(f"vkgraph {label}", bench_vkgraph(w, batches, a.steps, a.prompt, a.context), bound)
        del w
        if path is not None and not a.no_peers:
            lc = bench_llama_cpp(path, a.steps * 5, a.prompt)
            if lc is not None:
                row(f"llama.cpp {label}", lc)
    t = None if a.no_peers else bench_torch(cfg, batches, a.steps, a.prompt, a.context)
    if t is not None:
        row("PyTorch eager f16", t)


if __name__ == "__main__":
    main()

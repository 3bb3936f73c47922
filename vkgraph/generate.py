"""`python -m vkgraph.generate --model PATH --prompt "..."`: stream a completion and report tokens per second.

PATH is a .gguf file or a Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
"""

from __future__ import annotations

import argparse
import sys
import time

from .nn.engine import Engine
from .nn.llama import LlamaModel
from .nn.sampling import SamplingParams
from .nn.tokenizer import Tokenizer
from .nn.weights import load_weights
from .runtime import get_device


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m vkgraph.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a .gguf file or a Hugging Face model directory")
    ap.add_argument("--prompt", action="append", required=True, help="repeat for several prompts (one batch)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantize", choices=["Q8_0", "Q4_0"], help="quantize float weights on load")
    ap.add_argument("--kv-dtype", choices=["f16", "f32"], default="f16")
    ap.add_argument("--num-blocks", type=int, default=512, help="KV cache blocks of 16 tokens")
    ap.add_argument("--max-context", type=int, default=None, help="tokens per sequence (default: the model's)")
    ap.add_argument("--draft", help="a draft model (same vocabulary) for speculative decoding of one prompt")
    ap.add_argument("--speculate", type=int, default=4, help="draft tokens per round with --draft")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    weights = load_weights(a.model, quantize=a.quantize, progress=sys.stderr.isatty())
    tokenizer = Tokenizer.load(a.model)
    cfg = weights.config
    max_ctx = a.max_context or cfg.max_seq_len
    model = LlamaModel(weights, num_blocks=a.num_blocks, kv_dtype=a.kv_dtype, max_blocks_per_seq=-(-max_ctx // 16))
    dev = get_device()
    if a.draft:
        return _speculative(a, model, tokenizer, max_ctx)
    engine = Engine(model, tokenizer, seed=a.seed)
    print(f"[vkgraph] {cfg.arch} dim {cfg.dim} x {cfg.n_layers} layers, vocab {cfg.vocab_size}, on {dev.info.name}; "
          f"loaded in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    params = SamplingParams(a.temperature, a.top_k, a.top_p, a.min_p, a.repetition_penalty)
    for p in a.prompt:
        engine.add_request(p, params, max_tokens=a.max_tokens, stop=a.stop)
    single = len(a.prompt) == 1
    if single:
        print(a.prompt[0], end="", flush=True)
    first: dict[int, float] = {}
    texts: dict[int, str] = {}
    t_start = time.perf_counter()
    while engine.has_work():
        for ev in engine.step():
            first.setdefault(ev.request_id, time.perf_counter())
            texts[ev.request_id] = texts.get(ev.request_id, "") + ev.text
            if single:
                print(ev.text, end="", flush=True)
    t_end = time.perf_counter()
    if single:
        print()
    else:
        for i, p in enumerate(a.prompt):
            print(f"--- {p!r}\n{p}{texts.get(i, '')}")
    s = engine.stats
    t_prefill = max(first.values()) - t_start if first else 0.0
    decode_tokens = s["decode_tokens"] - len(first)
    t_decode = t_end - max(first.values()) if first else 0.0
    print(f"[vkgraph] prompt: {s['prompt_tokens']} tokens ({s['cached_prompt_tokens']} from the prefix cache) in "
          f"{t_prefill:.3f} s = {s['prompt_tokens'] / max(t_prefill, 1e-9):.1f} tok/s; decode: {decode_tokens} tokens "
          f"in {t_decode:.3f} s = {decode_tokens / max(t_decode, 1e-9):.1f} tok/s", file=sys.stderr)
    return 0


def _speculative(a: argparse.Namespace, model: LlamaModel, tokenizer: Tokenizer, max_ctx: int) -> int:
    from .nn.speculative import SpeculativeDecoder

    if len(a.prompt) != 1:
        raise SystemExit("--draft decodes one prompt at a time")
    draft = LlamaModel(load_weights(a.draft, quantize=a.quantize, progress=False), num_blocks=a.num_blocks,
                       kv_dtype=a.kv_dtype, max_blocks_per_seq=-(-max_ctx // 16))
    sd = SpeculativeDecoder(model, draft, k=a.speculate, seed=a.seed)
    params = SamplingParams(a.temperature)
    stream = tokenizer.stream()
    print(a.prompt[0], end="", flush=True)
    t0 = time.perf_counter()
    n = 0
    for tok in sd.generate(tokenizer.encode(a.prompt[0]), a.max_tokens, params, tokenizer.eos_ids):
        print(stream.push(tok), end="", flush=True)
        n += 1
    print(stream.flush())
    dt = time.perf_counter() - t0
    print(f"[vkgraph] speculative: {n} tokens in {dt:.3f} s = {n / dt:.1f} tok/s; {sd.stats.accepted} of "
          f"{sd.stats.proposed} draft tokens accepted ({sd.stats.acceptance:.0%})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

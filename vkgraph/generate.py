"""`python -m vkgraph.generate --model PATH --prompt "..."`: stream a completion and report tokens per second.

PATH is a .gguf file, a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or one
.safetensors file inside such a directory.

Speed figures leave out the time spent compiling kernels (a first run compiles every one; the report says how
long that took). `--warmup` compiles the model's kernels into the disk caches and exits, so that later runs start
warm.

Every error a user can cause (a missing or corrupt file, an unsupported type or architecture, an argument that
cannot work) is one line on stderr and exit code 2; `--debug` shows the traceback. Arguments are checked before
anything loads, and whether the prompts fit the context and the KV cache before the weights go to the device.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from typing import NoReturn

from .nn.config import ModelFormatError
from .nn.kv_cache import OutOfKVBlocks
from .nn.sampling import SamplingParams
from .nn.weights import QUANTIZE_FORMATS
from .runtime import OutOfDeviceMemory

PROG = "python -m vkgraph.generate"
BLOCK_SIZE = 16  # tokens per KV cache block (LlamaModel's default)
WARMUP_PROMPT = "Hello"
WARMUP_TOKENS = 3  # a prefill and two decode steps (the first runs eagerly, the second captures: same kernels)


class UsageError(Exception):
    """An argument, or a combination of arguments and model, that cannot work."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description=__doc__.split("\n")[0],
                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True,
                    help="a .gguf file, a Hugging Face model directory, or a .safetensors file inside one")
    ap.add_argument("--prompt", action="append", help="repeat for several prompts (one batch); required unless "
                                                      "--chat")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    ap.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    ap.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="1 is none")
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--quantize", choices=QUANTIZE_FORMATS,
                    help="quantize float weights on load (K-quants need rows that are multiples of 256)")
    ap.add_argument("--kv-dtype", choices=["f16", "f32"], default="f16", help="KV cache element type")
    ap.add_argument("--num-blocks", type=int, default=512, help="KV cache blocks of 16 tokens")
    ap.add_argument("--max-context", type=int, default=None, help="tokens per sequence (default: the model's)")
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                    help="split the model over N devices (VKGRAPH_TP_DEVICES picks them; docs/tensor_parallel.md)")
    ap.add_argument("--draft", help="a draft model (same vocabulary) for speculative decoding of one prompt")
    ap.add_argument("--speculate", type=int, default=4, help="draft tokens per round with --draft")
    ap.add_argument("--chat", action="store_true", help="interactive chat through the model's chat template, one "
                                                        "user turn per line of input; earlier turns stay in the "
                                                        "KV cache")
    ap.add_argument("--warmup", action="store_true", help="compile the model's kernels into the disk caches (a "
                                                          "prefill of the prompts, or of a short one, and decode "
                                                          "steps at their batch size) and exit")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return ap


def check_args(a: argparse.Namespace) -> SamplingParams:
    """Everything that can be told from the arguments alone; raises UsageError."""
    if not a.chat and not a.prompt and not a.warmup:
        raise UsageError("--prompt is required (or --chat)")
    if a.warmup and not a.prompt:
        a.prompt = [WARMUP_PROMPT]
    if a.chat and a.warmup:
        raise UsageError("--warmup with --chat: warm up without --chat (a chat turn runs the same kernels)")
    if a.chat and (a.prompt or a.draft):
        raise UsageError("--chat takes neither --prompt nor --draft")
    if a.draft and a.tensor_parallel > 1:
        raise UsageError("--draft runs on one device: leave out --tensor-parallel")
    for name, value, low in (("--max-tokens", a.max_tokens, 1), ("--num-blocks", a.num_blocks, 1),
                             ("--speculate", a.speculate, 1), ("--max-context", a.max_context, 1),
                             ("--tensor-parallel", a.tensor_parallel, 1)):
        if value is not None and value < low:
            raise UsageError(f"{name} must be at least {low}, got {value}")
    if a.draft and len(a.prompt) != 1:
        raise UsageError(f"--draft decodes one prompt at a time, got {len(a.prompt)}")
    try:
        params = SamplingParams(a.temperature, a.top_k, a.top_p, a.min_p, a.repetition_penalty)
    except ValueError as e:
        raise UsageError("--" + str(e).replace("_", "-")) from None  # each message starts with the parameter
    from pathlib import Path

    for flag, path in (("--model", a.model), ("--draft", a.draft)):
        if path is not None and not Path(path).exists():
            raise UsageError(f"{flag}: no such file or directory: {path}")
    return params


def check_fit(prompt_lens: list[int], max_tokens: int, max_ctx: int, num_blocks: int, extra: int = 0) -> None:
    """Refuse prompts that cannot fit: each within the context and, alone, within the KV cache (the engine
    preempts and later recomputes requests when several together outgrow it).

    A sequence holds its prompt and every generated token but the last (`extra`: tokens a speculative round
    may hold beyond that)."""
    for n in prompt_lens:
        if n + max_tokens + extra > max_ctx:
            raise UsageError(f"a prompt of {n} tokens + --max-tokens {max_tokens}"
                             f"{f' + {extra} speculative' if extra else ''} exceeds the context of {max_ctx} "
                             f"tokens (--max-context)")
    need = max(-(-(n + max_tokens - 1 + extra) // BLOCK_SIZE) for n in prompt_lens)
    if need > num_blocks:
        raise UsageError(f"the longest prompt and --max-tokens {max_tokens} need {need} KV cache blocks of "
                         f"{BLOCK_SIZE} tokens; --num-blocks is {num_blocks}")


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        params = check_args(a)
        return _run(a, params)
    except KeyboardInterrupt:  # one line, no traceback; exit code 130 as a shell gives for SIGINT
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    except (UsageError, OSError, ModelFormatError, OutOfKVBlocks, OutOfDeviceMemory, ValueError) as e:
        if a.debug:
            traceback.print_exc()
        msg = " ".join(str(e).split()) or type(e).__name__
        hint = "" if a.debug or isinstance(e, UsageError) else " (--debug shows the traceback)"
        print(f"{PROG}: error: {msg}{hint}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace, params: SamplingParams) -> int:
    from .nn.engine import Engine
    from .nn.model_file import open_model
    from .nn.tiny_model import is_random_model
    from .nn.tokenizer import Tokenizer
    from .nn.weights import load_weights
    from .parallel import build_model
    from .runtime import get_device

    t0 = time.perf_counter()
    source = open_model(a.model)  # a GGUF file's metadata is parsed once, for every loader below
    tokenizer = Tokenizer.load(source)
    weights = load_weights(source, quantize=a.quantize, progress=sys.stderr.isatty())
    cfg = weights.config
    max_ctx = a.max_context or cfg.max_seq_len
    template = None
    if a.chat:
        from .nn.chat import ChatTemplate

        template = ChatTemplate.load(source, tokenizer)
    else:
        extra = a.speculate + 1 if a.draft else 0
        check_fit([len(tokenizer.encode(p)) for p in a.prompt], a.max_tokens, max_ctx, a.num_blocks, extra)
    if is_random_model(source):
        print(f"[vkgraph] {a.model} is vkgraph's demo model: its weights are random, so its text is noise",
              file=sys.stderr)
    model = build_model(weights, a.tensor_parallel, num_blocks=a.num_blocks, kv_dtype=a.kv_dtype,
                        max_blocks_per_seq=-(-max_ctx // BLOCK_SIZE))
    dev = get_device()
    where = dev.info.name if a.tensor_parallel == 1 else f"{a.tensor_parallel} devices ({dev.info.name}, ...)"
    print(f"[vkgraph] {cfg.arch} dim {cfg.dim} x {cfg.n_layers} layers, vocab {cfg.vocab_size}, on {where}; "
          f"loaded in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    if a.draft:
        return _speculative(a, model, tokenizer, max_ctx)
    engine = Engine(model, tokenizer, seed=a.seed)
    if a.warmup:
        return _warmup(lambda: list(engine.generate(a.prompt, params, max_tokens=min(a.max_tokens, WARMUP_TOKENS))))
    if template is not None:
        from .nn.chat import chat_loop

        return chat_loop(engine, template, params, max_tokens=a.max_tokens, stop=a.stop)
    for p in a.prompt:
        engine.add_request(p, params, max_tokens=a.max_tokens, stop=a.stop)
    single = len(a.prompt) == 1
    if single:
        print(a.prompt[0], end="", flush=True)
    clock = dev.pipelines.clock
    first: dict[int, tuple[float, float]] = {}  # request -> (time, compile clock) at its first token
    texts: dict[int, str] = {}
    t_start, c_start = time.perf_counter(), clock.seconds
    try:
        while engine.has_work():
            for ev in engine.step():
                first.setdefault(ev.request_id, (time.perf_counter(), clock.seconds))
                texts[ev.request_id] = texts.get(ev.request_id, "") + ev.text
                if single:
                    print(ev.text, end="", flush=True)
    finally:  # on Ctrl-C too: what was generated is printed
        if single:
            print()
        else:
            for i, p in enumerate(a.prompt):
                print(f"--- {p!r}\n{p}{texts.get(i, '')}")
    t_end, c_end = time.perf_counter(), clock.seconds
    s = engine.stats
    t_first, c_first = max(first.values()) if first else (t_start, c_start)
    # compiling is taken out of each phase: its wall time (several kernels at once count once) is host time the
    # GPU did not run the model
    c_prefill, c_decode = c_first - c_start, c_end - c_first
    t_prefill = t_first - t_start - c_prefill
    t_decode = t_end - t_first - c_decode
    decode_tokens = s["decode_tokens"] - len(first)
    compiled = (f"; not counted: {c_prefill + c_decode:.2f} s compiling kernels"
                if c_prefill + c_decode >= 0.0005 else "")
    print(f"[vkgraph] prompt: {s['prompt_tokens']} tokens ({s['cached_prompt_tokens']} from the prefix cache) in "
          f"{t_prefill:.3f} s = {s['prompt_tokens'] / max(t_prefill, 1e-9):.1f} tok/s; decode: {decode_tokens} tokens "
          f"in {t_decode:.3f} s = {decode_tokens / max(t_decode, 1e-9):.1f} tok/s{compiled}", file=sys.stderr)
    return 0


def _warmup(fn) -> int:
    from .warmup import warmup

    w = warmup(fn)
    where = f"in {w.cache_dir}" if w.cache_dir is not None else "not kept (VKGRAPH_DISK_CACHE=0)"
    print(f"[vkgraph] warm-up: {w.pipelines} pipelines created, {w.spirv_compiled} programs compiled from GLSL and "
          f"{w.spirv_from_disk} read from the disk cache, in {w.seconds:.2f} s ({w.compile_seconds:.2f} s "
          f"compiling); the caches are {where}", file=sys.stderr)
    return 0


def _speculative(a: argparse.Namespace, model, tokenizer, max_ctx: int) -> int:
    from .nn.llama import LlamaModel
    from .nn.speculative import SpeculativeDecoder
    from .nn.weights import load_weights

    draft = LlamaModel(load_weights(a.draft, quantize=a.quantize, progress=False), num_blocks=a.num_blocks,
                       kv_dtype=a.kv_dtype, max_blocks_per_seq=-(-max_ctx // BLOCK_SIZE))
    sd = SpeculativeDecoder(model, draft, k=a.speculate, seed=a.seed)
    params = SamplingParams(a.temperature)
    if a.warmup:
        ids = tokenizer.encode(a.prompt[0])
        return _warmup(lambda: list(sd.generate(ids, min(a.max_tokens, a.speculate + WARMUP_TOKENS), params,
                                                tokenizer.eos_ids)))
    stream = tokenizer.stream()
    print(a.prompt[0], end="", flush=True)
    from .runtime import get_device

    clock = get_device().pipelines.clock
    t0, c0 = time.perf_counter(), clock.seconds
    n = 0
    for tok in sd.generate(tokenizer.encode(a.prompt[0]), a.max_tokens, params, tokenizer.eos_ids):
        print(stream.push(tok), end="", flush=True)
        n += 1
    print(stream.flush())
    compiling = clock.seconds - c0
    dt = time.perf_counter() - t0 - compiling
    print(f"[vkgraph] speculative: {n} tokens in {dt:.3f} s = {n / max(dt, 1e-9):.1f} tok/s; {sd.stats.accepted} of "
          f"{sd.stats.proposed} draft tokens accepted ({sd.stats.acceptance:.0%}); not counted: {compiling:.2f} s "
          f"compiling kernels", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

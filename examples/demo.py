"""The main demo: write a small Llama-style model with random weights (safetensors + tokenizer, and the same
as GGUF Q8_0), then stream a completion from each with vkgraph and report tokens per second.

    python examples/demo.py [--out /tmp/vkgraph-tiny-model]

The weights are random, so the text is too; the point is the path: weights loaded, KV cache paged, kernels
fused, compiled and cached, steps captured and replayed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vkgraph.generate import main as generate
from vkgraph.info import table

ROOT = Path(__file__).resolve().parents[1]


def write_tiny_model(out: Path) -> dict[str, Path]:
    from vkgraph.nn import tiny_model as mk

    return mk.write_model(out, mk.tiny_config(), gguf_types=("Q8_0",))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/vkgraph-tiny-model"))
    a = ap.parse_args()
    print(table(), "\n")
    paths = write_tiny_model(a.out)
    prompt = "The capital of France is"
    for label, path in (("safetensors, float weights", paths["hf"]), ("GGUF Q8_0", paths["Q8_0"])):
        print(f"== {label}: {path}")
        rc = generate(["--model", str(path), "--prompt", prompt, "--max-tokens", "32", "--temperature", "0.8",
                       "--top-k", "40", "--seed", "1"])
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

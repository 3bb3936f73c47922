"""`python -m vkgraph.serve --model PATH [--host 127.0.0.1 --port 8000 --max-batch 32 ...]`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .app import ServerState

BLOCK_SIZE = 16


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m vkgraph.serve", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True, help="a .gguf file or a Hugging Face model directory")
    ap.add_argument("--served-model-name", help="the name clients pass as `model` (default: the path's name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-batch", type=int, default=32, help="requests decoded together")
    ap.add_argument("--max-pending", type=int, default=256, help="requests in flight before 429")
    ap.add_argument("--num-blocks", type=int, default=512, help=f"KV cache blocks of {BLOCK_SIZE} tokens")
    ap.add_argument("--max-context", type=int, default=None, help="tokens per sequence (default: the model's, "
                                                                  "bounded by the KV cache)")
    ap.add_argument("--quantize", choices=["Q8_0", "Q4_0"], help="quantize float weights on load")
    ap.add_argument("--kv-dtype", choices=["f16", "f32"], default="f16")
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                    help="split the model over N devices (VKGRAPH_TP_DEVICES picks them; docs/tensor_parallel.md)")
    ap.add_argument("--seed", type=int, default=0, help="seeds all sampling")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--kv-host-gib", type=float, default=0.0,
                    help="host memory for KV prefix blocks evicted from the GPU (0: no host tier)")
    ap.add_argument("--kv-disk-dir", help="folder for KV prefix blocks evicted from host memory (or from the GPU "
                                          "without a host tier); kept across restarts, per model")
    ap.add_argument("--kv-disk-gib", type=float, default=16.0, help="bytes the disk tier may hold")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds in-flight requests may run on after a shutdown signal before they are cancelled")
    ap.add_argument("--log-level", default="info")
    return ap


def build_state(a: argparse.Namespace) -> ServerState:
    """Load the model and start its engine thread, as the arguments say (also what each Ray Serve replica runs)."""
    from ..nn.chat import ChatTemplate, NoChatTemplateError
    from ..nn.engine import Engine
    from ..nn.kv_tiers import DiskTier, HostTier, PrefixStore, model_fingerprint
    from ..nn.model_file import open_model
    from ..nn.tokenizer import Tokenizer
    from ..nn.weights import load_weights
    from ..parallel import build_model
    from .app import ServerState
    from .async_engine import AsyncEngine
    from .metrics import Metrics

    if (a.kv_host_gib > 0 or a.kv_disk_dir) and a.tensor_parallel > 1:
        raise SystemExit("--kv-host-gib and --kv-disk-dir need the model on one device (no --tensor-parallel)")
    source = open_model(a.model)  # a GGUF file's metadata is parsed once, for every loader below
    tokenizer = Tokenizer.load(source)
    weights = load_weights(source, quantize=a.quantize, progress=sys.stderr.isatty())
    max_ctx = a.max_context or weights.config.max_seq_len
    model = build_model(weights, a.tensor_parallel, num_blocks=a.num_blocks, block_size=BLOCK_SIZE,
                        kv_dtype=a.kv_dtype, max_blocks_per_seq=-(-max_ctx // BLOCK_SIZE))
    store = None
    if (a.kv_host_gib > 0 or a.kv_disk_dir) and not a.no_prefix_caching:
        host = HostTier(int(a.kv_host_gib * 2**30)) if a.kv_host_gib > 0 else None
        disk = None
        if a.kv_disk_dir:
            fp = model_fingerprint(weights, kv_dtype=a.kv_dtype, block_size=BLOCK_SIZE)
            disk = DiskTier(a.kv_disk_dir, int(a.kv_disk_gib * 2**30), fp)
        store = PrefixStore(host, disk)
    metrics = Metrics()
    engine = AsyncEngine(Engine(model, tokenizer, max_batch=a.max_batch, seed=a.seed,
                                prefix_caching=not a.no_prefix_caching, prefix_store=store),
                         max_pending=a.max_pending, on_step=metrics.on_step)
    try:
        template: ChatTemplate | None = ChatTemplate.load(source, tokenizer)
    except NoChatTemplateError:
        template = None  # /v1/chat/completions then answers 400
    return ServerState(engine, tokenizer, a.served_model_name or Path(a.model).name, model.max_context, metrics,
                       template, a.shutdown_timeout)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    import uvicorn

    from .app import create_app

    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    state = build_state(a)
    uvicorn.run(create_app(state), host=a.host, port=a.port, log_level=a.log_level,
                timeout_graceful_shutdown=a.shutdown_timeout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a captured graph's second command buffer gives the engine's decode ahead: decode steps with one command
buffer per graph (RING=1: a replay waits on the host for the graph's previous submission, as before the ring)
against the ring (RING=2: step N+1 is submitted while step N runs), in one process on one model.

    python benchmarks/bench_replay_ahead.py [--shape llama3-8b] [--format Q4_0] [--batches 1,8] [--steps 16]
                                            [--rounds 2]

Per batch size, the settings alternate for --rounds rounds (GPU clocks drift between runs); each run is a new
engine (new captures) that decodes --steps timed steps after its warm-up. Prints the median step wall time and
tokens/s of each setting, and the host's waits per step inside replays (none expected with the ring).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench_llm import SHAPES, random_model, warm_engine
from common import raise_clocks

from vkgraph.nn.config import ModelConfig
from vkgraph.nn.llama import LlamaModel
from vkgraph.runtime import capture, get_device


def run(model: LlamaModel, vocab: int, batch: int, steps: int) -> tuple[float, float]:
    """(median step seconds, host waits per timed step inside a graph's replay) of one engine's decode."""
    dev = get_device()
    engine = warm_engine(model, vocab, batch, steps + 12)
    queue = dev.queue
    real = queue.wait
    waits = 0

    def wait(seq: int) -> None:
        nonlocal waits
        if _in_replay():
            waits += 1
        real(seq)

    queue.wait = wait
    try:
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
    finally:
        del queue.wait  # the method again
    while engine.has_work():
        engine.step()
    dev.synchronize()
    return statistics.median(times), waits / steps


def _in_replay() -> bool:
    """Whether the caller of the wait wrapper runs inside a graph's replay."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is capture.CommandGraph.replay.__code__:
            return True
        frame = frame.f_back
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--format", default="Q4_0")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    cfg = ModelConfig(arch="llama", max_seq_len=8192, **SHAPES[a.shape])
    batches = [int(b) for b in a.batches.split(",")]
    dev = get_device()
    model = LlamaModel(random_model(cfg, a.format), num_blocks=max(batches) * 8 + 16, max_blocks_per_seq=8)
    ring = capture.RING
    print(f"{dev.info.name}: {a.shape} {a.format}, decode ahead, {a.steps} steps a run, {a.rounds} rounds")
    print(f"{'batch':>5s} {'RING':>4s} {'step ms':>8s} {'tok/s':>8s} {'replay waits/step':>17s}", flush=True)
    try:
        for b in batches:
            got: dict[int, list[tuple[float, float]]] = {1: [], ring: []}
            raise_clocks()
            for _ in range(a.rounds):
                for r in got:
                    capture.RING = r  # read at each replay: a new engine's graphs keep at most r command buffers
                    got[r].append(run(model, cfg.vocab_size, b, a.steps))
            for r, runs in got.items():
                step = statistics.median(s for s, _ in runs)
                waits = statistics.mean(w for _, w in runs)
                print(f"{b:5d} {r:4d} {step * 1e3:8.3f} {b / step:8.1f} {waits:17.2f}", flush=True)
    finally:
        capture.RING = ring


if __name__ == "__main__":
    main()

"""The host path (issue 16's table): wall time per call, the wait included, as GB/s of the bytes each case must move;
vkgraph eager, vkgraph.jit, PyTorch eager and torch.compile in one process on the same inputs.

    python benchmarks/bench_host.py            # the issue's sizes (a GPU with a few GiB free)
    python benchmarks/bench_host.py --small    # sizes lavapipe finishes in seconds (no PyTorch columns on a CPU)

Each figure is the median of --reps calls after warm-up calls (eager: the plan is cached; jit: captured;
torch.compile: compiled). "eager x10, one wait": ten eager calls back to back and one wait, per call: realize()
returns without waiting, so the next call's graph is built while the GPU runs the last one; this column reaches
the GPU's own rate where the host keeps up. "host us" is the median time an eager call takes to return before
the wait (graph building, schedule lookup, recording, submit): what the host adds above the GPU's own time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from common import median_time

import vkgraph
from vkgraph.runtime import get_device
from vkgraph.tensor import Tensor

BURST = 10  # eager calls per wait in the pipelined column


def median_s(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    return median_time(fn, reps)


def cases(small: bool) -> list[tuple[str, float, list[tuple[int, ...]], Callable, str]]:
    """(name, GB moved per call, input shapes, vkgraph fn, torch expression name)."""
    n = 1 << (20 if small else 28)
    sm = (256, 256) if small else (4096, 4096)
    ln = (1024, 256) if small else (32768, 4096)
    return [
        (f"((a*c+d).exp()*c).sum() 2^{n.bit_length() - 1} f32", 3 * 4 * n / 1e9, [(n,)] * 3,
         lambda a, c, d: ((a * c + d).exp() * c).sum(), "chain"),
        (f"softmax {sm}", 2 * 4 * sm[0] * sm[1] / 1e9, [sm], lambda t: t.softmax(-1), "softmax"),
        (f"layer_norm {ln}", 2 * 4 * ln[0] * ln[1] / 1e9, [ln], lambda t: t.layer_norm(), "layer_norm"),
    ]


def torch_fn(torch, name: str) -> Callable:
    f = torch.nn.functional
    return {"chain": lambda a, c, d: ((a * c + d).exp() * c).sum(),
            "softmax": lambda t: torch.softmax(t, -1),
            "layer_norm": lambda t: f.layer_norm(t, (t.shape[-1],))}[name]


def gbs(gb: float, seconds: float) -> str:
    rate = gb / seconds
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.3f}"


def compiled_rate(torch, tf: Callable, xs: list, gb: float, reps: int, notes: list[str]) -> str:
    """torch.compile's figure, or "n/a" with a note where it cannot compile here (no Triton, no C compiler, a
    PyTorch without it): the compile happens at the first call, inside the warm-up."""
    try:
        tc = torch.compile(tf)
        return gbs(gb, median_s(lambda: (tc(*xs), torch.cuda.synchronize()), reps))
    except Exception as e:  # whatever the compiler stack raises: the other columns still stand
        note = f"torch.compile unavailable: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        if note not in notes:
            notes.append(note)
        return "n/a"


def measure(dev, name: str, gb: float, host: list[np.ndarray], fn: Callable, tname: str, torch, reps: int,
            compile_: bool, notes: list[str]) -> list[str]:
    ts = [Tensor(h).realize() for h in host]
    dev.synchronize()

    def eager() -> None:
        fn(*ts).realize()
        dev.synchronize()

    jitted = vkgraph.jit(fn)

    def replay() -> None:
        jitted(*ts).realize()
        dev.synchronize()

    t_eager = median_s(eager, reps)
    hosts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*ts).realize()
        hosts.append(time.perf_counter() - t)
        dev.synchronize()
    t_jit = median_s(replay, reps)

    def burst() -> None:  # eager calls back to back, one wait: realize() returns without waiting
        for _ in range(BURST):
            fn(*ts).realize()
        dev.synchronize()

    t_burst = median_s(burst, max(3, reps // 4), warmup=1) / BURST
    ok = np.allclose(jitted(*ts).numpy(), fn(*ts).numpy(), rtol=1e-4, atol=1e-5)
    row = [name, gbs(gb, t_eager), gbs(gb, t_burst), gbs(gb, t_jit), "-", "-", f"{statistics.median(hosts) * 1e6:.0f}",
           "yes" if ok else "NO"]
    if torch is not None:
        xs = [torch.from_numpy(h).cuda() for h in host]
        tf = torch_fn(torch, tname)
        row[4] = gbs(gb, median_s(lambda: (tf(*xs), torch.cuda.synchronize()), reps))
        if compile_:
            row[5] = compiled_rate(torch, tf, xs, gb, reps, notes)
        del xs
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="leave out torch.compile (its compile takes a while)")
    a = ap.parse_args()
    dev = get_device()
    try:
        import torch

        torch = torch if torch.cuda.is_available() else None
    except ImportError:
        torch = None
    notes = [] if torch is not None else ["PyTorch columns: no PyTorch with CUDA here"]
    if torch is not None and not a.no_compile and not hasattr(torch, "compile"):
        notes.append(f"torch.compile unavailable: PyTorch {torch.__version__} has none")
        a.no_compile = True
    rng = np.random.default_rng(0)
    rows = []
    for name, gb, shapes, fn, tname in cases(a.small):
        host = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
        rows.append(measure(dev, name, gb, host, fn, tname, torch, a.reps, not a.no_compile, notes))
    header = [f"case (GB/s, median of {a.reps}, wait included)", "vkgraph eager", f"eager x{BURST}, one wait",
              "vkgraph.jit", "PyTorch eager", "torch.compile", "eager host us", "jit = eager"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print(f"device: {dev.info.name}")
    for r in [header] + rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)))
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()

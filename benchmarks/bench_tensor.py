"""Tensor benchmarks: fused elementwise chains + reductions, softmax, layer_norm, matmul.

    python benchmarks/bench_tensor.py            # the lavapipe table: vkgraph against numpy on the same CPU
    python benchmarks/bench_tensor.py --gpu      # the GPU table: GB/s and TFLOP/s, beside PyTorch if installed
    VKGRAPH_PROFILE=1 python benchmarks/bench_tensor.py --gpu   # also each kernel's GPU time, at exit

Matrix products at more shapes and in bfloat16, with the fraction of peak: benchmarks/bench_matmul.py.

Inputs are random (never zeros: fresh allocations are zeroed and flatter the numbers). Each figure is the best
of several runs after a warm-up; a run builds the graph, schedules, dispatches and waits, as user code would.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from vkgraph.runtime import get_device
from vkgraph.tensor import Tensor


def best_of(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def chain(x: Tensor | np.ndarray, c, d, n_ops: int):
    """n_ops elementwise ops then a sum: ((x*c+d).exp()*c ...) — the same expression for both sides."""
    tanh = np.tanh if isinstance(x, np.ndarray) else Tensor.tanh
    y = x * c + d
    for k in range(n_ops - 2):
        y = tanh(y * 0.5) if k % 2 else y * c + 0.25
    return y * c


def vk_run(t: Tensor) -> None:
    t.realize()
    get_device().synchronize()


def table(rows: list[tuple], header: tuple) -> None:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)))


def cpu(n: int, reps: int) -> None:
    rng = np.random.default_rng(0)
    a, c, d = (rng.standard_normal(n, dtype=np.float32) for _ in range(3))
    ta, tc, td = Tensor(a).realize(), Tensor(c).realize(), Tensor(d).realize()
    rows = []
    for n_ops in (4, 6, 8, 10):
        t_np = best_of(lambda k=n_ops: chain(a, c, d, k).sum(), reps)
        t_vk = best_of(lambda k=n_ops: vk_run(chain(ta, tc, td, k).sum()), reps)
        rows.append((n_ops, n, f"{t_np * 1e3:.1f}", f"{t_vk * 1e3:.1f}", f"{t_np / t_vk:.2f}"))
    print(f"lavapipe ({get_device().info.name}) vs numpy, float32, chain of n ops + sum")
    table(rows, ("ops", "elements", "numpy ms", "vkgraph ms", "speedup"))


def gpu_cases(rng: np.random.Generator) -> list[tuple]:
    """(name, unit, amount per run, host inputs, vkgraph fn, torch fn or None) for each GPU benchmark."""
    cases = []
    for log2 in (26, 28):
        n = 1 << log2
        cases.append((f"((a*c+d).exp()*c).sum() 2^{log2}", "GB/s", 3 * n * 4 / 1e9,
                      lambda n=n: [rng.standard_normal(n, dtype=np.float32) for _ in range(3)],
                      lambda a, c, d: ((a * c + d).exp() * c).sum(), lambda a, c, d: ((a * c + d).exp() * c).sum()))
    for shape in ((4096, 4096), (32768, 4096)):
        nbytes = 2 * 4 * shape[0] * shape[1] / 1e9
        cases.append((f"softmax {shape}", "GB/s", nbytes, lambda s=shape: [rng.standard_normal(s, dtype=np.float32)],
                      lambda t: t.softmax(-1), None))
        cases.append((f"layer_norm {shape}", "GB/s", nbytes,
                      lambda s=shape: [rng.standard_normal(s, dtype=np.float32)], lambda t: t.layer_norm(), None))
    m = 4096
    cases.append(("matmul f16 4096^3", "TFLOP/s", 2 * m**3 / 1e12,
                  lambda: [rng.standard_normal((m, m)).astype(np.float16) for _ in range(2)], lambda a, b: a @ b, None))
    return cases


def _vk_seconds(fn: Callable, host: list[np.ndarray], reps: int) -> float:
    ts = [Tensor(h).realize() for h in host]
    return best_of(lambda: vk_run(fn(*ts)), reps)


def gpu_case(index: int, reps: int) -> list[str]:
    """One row, measured in this process: vkgraph first, then PyTorch (if installed) on the same inputs."""
    name, unit, amount, make, fn, tfn = gpu_cases(np.random.default_rng(0))[index]
    host = make()
    vk = amount / _vk_seconds(fn, host, reps)
    row = [name, f"{vk:.0f} {unit}" if unit == "GB/s" else f"{vk:.1f} {unit}", "", ""]
    try:
        import torch
    except ImportError:
        return row
    xs = [torch.from_numpy(h).cuda() for h in host]
    if tfn is None:
        tfn = {"softmax": lambda t: torch.softmax(t, -1),
               "layer_norm": lambda t: torch.nn.functional.layer_norm(t, (t.shape[-1],)),
               "matmul": lambda a, b: a @ b}[name.split()[0]]
    pt = amount / best_of(lambda: (tfn(*xs), torch.cuda.synchronize()), reps)
    row[2:] = [f"{pt:.0f}" if unit == "GB/s" else f"{pt:.1f}", f"{vk / pt:.2f}"]
    return row


ROW_MARK = "row: "  # marks the case's result among whatever else the case process prints


def gpu(reps: int) -> None:
    """Each case in a process of its own, so that one case's allocations cannot slow the next."""
    rows = []
    for i in range(len(gpu_cases(np.random.default_rng(0)))):
        out = subprocess.run([sys.executable, __file__, "--case", str(i), "--reps", str(reps)], check=True,
                             capture_output=True, text=True).stdout
        row, = (line for line in out.splitlines() if line.startswith(ROW_MARK))
        rows.append(tuple(json.loads(row[len(ROW_MARK):])))
        rest = "\n".join(line for line in out.splitlines() if not line.startswith(ROW_MARK)).strip()
        if rest:  # e.g. the VKGRAPH_PROFILE table of the case's kernels
            print(f"{rows[-1][0]}:\n{rest}\n")
    print(f"GPU ({get_device().info.name}); vkgraph = graph + schedule + dispatch + wait per call")
    table(rows, ("benchmark", "vkgraph", "pytorch", "ratio"))


def rate(amount: float, seconds: float, unit: str) -> str:
    return f"{amount / seconds:.0f}" if unit == "GB/s" else f"{amount / seconds:.1f}"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="the GPU table instead of the lavapipe one")
    p.add_argument("--n", type=int, default=1 << 24, help="elements for the lavapipe table")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--case", type=int, help="run one GPU case and print its row as JSON (used by --gpu)")
    args = p.parse_args()
    if args.case is not None:
        print(ROW_MARK + json.dumps(gpu_case(args.case, args.reps)), flush=True)
    else:
        gpu(args.reps) if args.gpu else cpu(args.n, args.reps)

"""Tensor benchmarks: fused elementwise chains + reductions, softmax, layer_norm, matmul.

    python benchmarks/bench_tensor.py            # the lavapipe table: vkgraph against numpy on the same CPU
    python benchmarks/bench_tensor.py --gpu      # the GPU table: GB/s and TFLOP/s, beside PyTorch if installed

Inputs are random (never zeros: fresh allocations are zeroed and flatter the numbers). Each figure is the best
of several runs after a warm-up; a run builds the graph, schedules, dispatches and waits, as user code would.
"""

from __future__ import annotations

import argparse
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


def gpu(reps: int) -> None:
    try:
        import torch
    except ImportError:
        torch = None
    rows = []
    rng = np.random.default_rng(0)
    for log2 in (26, 28):
        n = 1 << log2
        a, c, d = (rng.standard_normal(n, dtype=np.float32) for _ in range(3))
        ta, tc, td = Tensor(a).realize(), Tensor(c).realize(), Tensor(d).realize()
        t_vk = best_of(lambda: vk_run(((ta * tc + td).exp() * tc).sum()), reps)
        gbs = 3 * n * 4 / 1e9
        row = [f"((a*c+d).exp()*c).sum() 2^{log2}", f"{gbs / t_vk:.0f} GB/s"]
        if torch is not None:
            xa, xc, xd = (torch.from_numpy(v).cuda() for v in (a, c, d))
            f = lambda: ((xa * xc + xd).exp() * xc).sum()  # noqa: E731
            t_t = best_of(lambda: (f(), torch.cuda.synchronize()), reps)
            row += [f"{gbs / t_t:.0f} GB/s", f"{t_t / t_vk:.2f}"]
        rows.append(tuple(row) + ("",) * (4 - len(row)))
    for shape in ((4096, 4096), (32768, 4096)):
        x = rng.standard_normal(shape, dtype=np.float32)
        tx = Tensor(x).realize()
        gbs = 2 * x.nbytes / 1e9
        for name, fn in (("softmax", lambda t: t.softmax(-1)), ("layer_norm", lambda t: t.layer_norm())):
            t_vk = best_of(lambda f=fn: vk_run(f(tx)), reps)
            row = [f"{name} {shape}", f"{gbs / t_vk:.0f} GB/s"]
            if torch is not None:
                xt = torch.from_numpy(x).cuda()
                tf = (lambda: torch.softmax(xt, -1)) if name == "softmax" else (
                    lambda: torch.nn.functional.layer_norm(xt, (shape[1],)))
                t_t = best_of(lambda g=tf: (g(), torch.cuda.synchronize()), reps)
                row += [f"{gbs / t_t:.0f} GB/s", f"{t_t / t_vk:.2f}"]
            rows.append(tuple(row) + ("",) * (4 - len(row)))
    m = 4096
    a16, b16 = (rng.standard_normal((m, m)).astype(np.float16) for _ in range(2))
    ta, tb = Tensor(a16).realize(), Tensor(b16).realize()
    t_vk = best_of(lambda: vk_run(ta @ tb), reps)
    row = ["matmul f16 4096^3", f"{2 * m**3 / t_vk / 1e12:.1f} TFLOP/s"]
    if torch is not None:
        xa, xb = torch.from_numpy(a16).cuda(), torch.from_numpy(b16).cuda()
        t_t = best_of(lambda: (xa @ xb, torch.cuda.synchronize()), reps)
        row += [f"{2 * m**3 / t_t / 1e12:.1f} TFLOP/s", f"{t_t / t_vk:.2f}"]
    rows.append(tuple(row) + ("",) * (4 - len(row)))
    print(f"GPU ({get_device().info.name})")
    table(rows, ("benchmark", "vkgraph", "pytorch", "ratio to pytorch"))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="the GPU table instead of the lavapipe one")
    p.add_argument("--n", type=int, default=1 << 24, help="elements for the lavapipe table")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    gpu(args.reps) if args.gpu else cpu(args.n, args.reps)

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


def kernel_seconds(fn: Callable[[], object], reps: int) -> float | None:
    """Best GPU time of fn's dispatches from timestamps (VKGRAPH_PROFILE=1), or None without profiling."""
    prof = getattr(get_device().queue, "profiler", None)
    if prof is None:
        return None
    best = None
    for _ in range(reps):
        prof.events.clear()
        fn()
        total = sum(t1 - t0 for _, t0, t1 in prof.events) / 1e9
        best = total if best is None else min(best, total)
    return best


def gpu(reps: int) -> None:
    """vkgraph first, PyTorch after (both on the GPU at once slows the Vulkan side), one table at the end."""
    rng = np.random.default_rng(0)
    cases = []  # (name, unit, amount per run, vkgraph fn, torch fn maker)
    for log2 in (26, 28):
        n = 1 << log2
        a, c, d = (rng.standard_normal(n, dtype=np.float32) for _ in range(3))
        ta, tc, td = (Tensor(v).realize() for v in (a, c, d))
        cases.append((f"((a*c+d).exp()*c).sum() 2^{log2}", "GB/s", 3 * n * 4 / 1e9,
                      lambda ta=ta, tc=tc, td=td: vk_run(((ta * tc + td).exp() * tc).sum()),
                      lambda torch, a=a, c=c, d=d: _torch_chain(torch, a, c, d)))
    for shape in ((4096, 4096), (32768, 4096)):
        x = rng.standard_normal(shape, dtype=np.float32)
        tx = Tensor(x).realize()
        cases.append((f"softmax {shape}", "GB/s", 2 * x.nbytes / 1e9, lambda tx=tx: vk_run(tx.softmax(-1)),
                      lambda torch, x=x: (lambda xt: lambda: torch.softmax(xt, -1))(torch.from_numpy(x).cuda())))
        cases.append((f"layer_norm {shape}", "GB/s", 2 * x.nbytes / 1e9, lambda tx=tx: vk_run(tx.layer_norm()),
                      lambda torch, x=x: (lambda xt: lambda: torch.nn.functional.layer_norm(xt, (x.shape[1],)))(
                          torch.from_numpy(x).cuda())))
    m = 4096
    a16, b16 = (rng.standard_normal((m, m)).astype(np.float16) for _ in range(2))
    ta16, tb16 = Tensor(a16).realize(), Tensor(b16).realize()
    cases.append(("matmul f16 4096^3", "TFLOP/s", 2 * m**3 / 1e12, lambda: vk_run(ta16 @ tb16),
                  lambda torch: (lambda xa, xb: lambda: xa @ xb)(torch.from_numpy(a16).cuda(),
                                                               torch.from_numpy(b16).cuda())))
    results = []
    for name, unit, amount, vk_fn, _ in cases:
        wall = best_of(vk_fn, reps)
        gpu_s = kernel_seconds(vk_fn, reps)
        results.append([name, f"{rate(amount, wall, unit)} {unit}", "" if gpu_s is None else rate(amount, gpu_s, unit)])
    try:
        import torch
    except ImportError:
        torch = None
    for row, (_, unit, amount, _, torch_fn) in zip(results, cases, strict=True):
        if torch is None:
            row += ["", ""]
            continue
        f = torch_fn(torch)
        t = best_of(lambda f=f: (f(), torch.cuda.synchronize()), reps)
        wall = float(row[1].split()[0])
        row += [rate(amount, t, unit), f"{wall / (amount / t):.2f}"]
    print(f"GPU ({get_device().info.name}); vkgraph wall = graph + schedule + dispatch + wait per call")
    table([tuple(r) for r in results], ("benchmark", "vkgraph wall", "vkgraph kernels", "pytorch", "wall ratio"))


def rate(amount: float, seconds: float, unit: str) -> str:
    return f"{amount / seconds:.0f}" if unit == "GB/s" else f"{amount / seconds:.1f}"


def _torch_chain(torch, a, c, d):
    xa, xc, xd = (torch.from_numpy(v).cuda() for v in (a, c, d))
    return lambda: ((xa * xc + xd).exp() * xc).sum()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="the GPU table instead of the lavapipe one")
    p.add_argument("--n", type=int, default=1 << 24, help="elements for the lavapipe table")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    gpu(args.reps) if args.gpu else cpu(args.n, args.reps)

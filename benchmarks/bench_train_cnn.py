"""Time an epoch of the digits CNN (examples/train_digits_cnn.py) in vkgraph beside PyTorch on the CPU and on CUDA,
in the same run: the same model, optimizer (Adam), batches and per-step host-to-device copies of each batch.

    python benchmarks/bench_train_cnn.py                    # batch 64 and 256, 5 timed epochs each
    python benchmarks/bench_train_cnn.py --batches 64 --epochs 3

vkgraph replays each step (forward, backward, Adam) captured by `vkgraph.jit` as one submission; PyTorch runs
eagerly. Every framework trains one untimed warm-up epoch (compilation, capture, cuDNN autotuning), then each
timed epoch ends with a read-back of its last loss, so queued work is counted. Figures: median ms per epoch,
ms per step, and the test accuracy after the last epoch (a check that each run really trained).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from train_digits_cnn import DigitsCNN, accuracy, load_digits_split, training_step  # noqa: E402

import vkgraph  # noqa: E402
from vkgraph import Tensor  # noqa: E402


def batches(n: int, batch: int, rng: np.random.Generator) -> list[np.ndarray]:
    order = rng.permutation(n)
    return [order[i:i + batch] for i in range(0, n - batch + 1, batch)]


def run_vkgraph(data, batch: int, epochs: int, lr: float) -> tuple[list[float], float]:
    xtr, ytr, xte, yte = data
    model = DigitsCNN(0)
    step = vkgraph.jit(training_step(model, lr))
    rng = np.random.default_rng(1)
    times = []
    for epoch in range(epochs + 1):
        t0 = time.perf_counter()
        for idx in batches(len(ytr), batch, rng):
            loss = step(Tensor(xtr[idx]), Tensor(ytr[idx]))
        loss.item()
        if epoch:  # the first epoch compiles and captures
            times.append(time.perf_counter() - t0)
    return times, accuracy(model, xte, yte)


def run_torch(data, batch: int, epochs: int, lr: float, device: str) -> tuple[list[float], float]:
    import torch
    xtr, ytr, xte, yte = data
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(128, 10)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rng = np.random.default_rng(1)
    times = []
    for epoch in range(epochs + 1):
        t0 = time.perf_counter()
        for idx in batches(len(ytr), batch, rng):
            x = torch.from_numpy(xtr[idx]).to(device)
            y = torch.from_numpy(ytr[idx].astype(np.int64)).to(device)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        loss.item()
        sync()
        if epoch:
            times.append(time.perf_counter() - t0)
    with torch.no_grad():
        pred = model(torch.from_numpy(xte).to(device)).argmax(-1).cpu().numpy()
    return times, float((pred == yte).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    data = load_digits_split()
    n_train = len(data[1])
    print(f"device: {vkgraph.get_device().info.name}; {n_train} training images")
    runners = [("vkgraph (jit)", lambda b: run_vkgraph(data, b, args.epochs, args.lr))]
    try:
        import torch
        runners.append(("torch cpu", lambda b: run_torch(data, b, args.epochs, args.lr, "cpu")))
        if torch.cuda.is_available():
            runners.append((f"torch cuda ({torch.cuda.get_device_name()})",
                            lambda b: run_torch(data, b, args.epochs, args.lr, "cuda")))
        else:
            print("torch: no CUDA device")
    except ImportError:
        print("torch is not installed: vkgraph only")
    print(f"{'framework':40s} {'batch':>6s} {'ms/epoch':>10s} {'ms/step':>9s} {'test acc':>9s}")
    for b in (int(v) for v in args.batches.split(",")):
        steps = n_train // b
        for name, fn in runners:
            times, acc = fn(b)
            ms = statistics.median(times) * 1e3
            print(f"{name:40s} {b:6d} {ms:10.1f} {ms / steps:9.3f} {acc * 100:8.1f}%", flush=True)


if __name__ == "__main__":
    main()

"""Train a small convolutional network on scikit-learn's 8x8 handwritten digits (1797 images, bundled with the
package: `pip install vkgraph[examples]` or `pip install scikit-learn`).

    python examples/train_digits_cnn.py                 # 15 epochs: about 98% test accuracy
    python examples/train_digits_cnn.py --epochs 3 --no-jit

Model: conv 3x3 (1 -> 16) - ReLU - max-pool 2 - conv 3x3 (16 -> 32) - ReLU - max-pool 2 - linear (128 -> 10),
trained with Adam on cross entropy. Each step (forward, backward, Adam) is captured once by `vkgraph.jit` and
replayed as one GPU submission.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import vkgraph
from vkgraph import Tensor
from vkgraph.autograd import no_grad
from vkgraph.nn import functional as F
from vkgraph.nn import optim


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Images (N, 1, 8, 8) standardized by the training set's mean and deviation, int32 labels; shuffled and split
    into train and test."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)[:, None]
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    n_test = int(len(y) * test_fraction)
    mean, std = x[n_test:].mean(), x[n_test:].std()
    x = (x - mean) / std
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def _uniform(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> Tensor:
    bound = 1.0 / math.sqrt(fan_in)  # PyTorch's default initialisation of conv and linear layers
    return Tensor(rng.uniform(-bound, bound, shape).astype(np.float32)).requires_grad_()


class DigitsCNN:
    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.conv1_w, self.conv1_b = _uniform(rng, (16, 1, 3, 3), 9), _uniform(rng, (16,), 9)
        self.conv2_w, self.conv2_b = _uniform(rng, (32, 16, 3, 3), 144), _uniform(rng, (32,), 144)
        self.fc_w, self.fc_b = _uniform(rng, (10, 128), 128), _uniform(rng, (10,), 128)

    def __call__(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.conv2d(x, self.conv1_w, self.conv1_b, padding=1).relu(), 2)
        x = F.max_pool2d(F.conv2d(x, self.conv2_w, self.conv2_b, padding=1).relu(), 2)
        return x.flatten(1).linear(self.fc_w, self.fc_b)


@dataclass
class Result:
    losses: list[float]
    test_accuracy: float
    seconds_per_epoch: float


def accuracy(model: DigitsCNN, x: np.ndarray, y: np.ndarray) -> float:
    with no_grad():
        pred = model(Tensor(x)).argmax(-1).numpy()
    return float((pred == y).mean())


def training_step(model: DigitsCNN, lr: float) -> Callable[[Tensor, Tensor], Tensor]:
    """One Adam step on a batch's cross-entropy; returns the loss (capture it with vkgraph.jit)."""
    opt = optim.Adam(optim.parameters(model), lr=lr)

    def step(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def train(epochs: int = 15, batch: int = 64, lr: float = 3e-3, max_steps: int | None = None, use_jit: bool = True,
          seed: int = 0, log: bool = False) -> Result:
    xtr, ytr, xte, yte = load_digits_split(seed=seed)
    model = DigitsCNN(seed)
    step = training_step(model, lr)
    run = vkgraph.jit(step) if use_jit else step
    rng = np.random.default_rng(seed + 1)
    losses, steps, epoch_times = [], 0, []
    for epoch in range(epochs):
        start = time.perf_counter()
        order = rng.permutation(len(ytr))
        epoch_loss = []
        for i in range(0, len(order) - batch + 1, batch):  # full batches only: one captured shape
            idx = order[i:i + batch]
            # a replay's output lives in the captured graph's buffer, which the next replay overwrites: keep a copy
            epoch_loss.append(run(Tensor(xtr[idx]), Tensor(ytr[idx])).clone().realize())
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
        losses.extend(float(v.item()) for v in epoch_loss)  # read back once per epoch, not per step
        epoch_times.append(time.perf_counter() - start)
        if log:
            print(f"epoch {epoch + 1}: mean loss {np.mean([*losses[-len(epoch_loss):]]):.4f}, "
                  f"{epoch_times[-1] * 1e3:.0f} ms")
        if max_steps is not None and steps >= max_steps:
            break
    return Result(losses, accuracy(model, xte, yte), float(np.median(epoch_times)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--no-jit", action="store_true")
    args = ap.parse_args()
    r = train(args.epochs, args.batch, args.lr, use_jit=not args.no_jit, log=True)
    print(f"test accuracy {r.test_accuracy * 100:.1f}% after {args.epochs} epochs "
          f"({r.seconds_per_epoch * 1e3:.0f} ms per epoch, median)")


if __name__ == "__main__":
    main()

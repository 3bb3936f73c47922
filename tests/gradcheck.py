"""Gradient checks shared by the autograd and op tests: vkgraph's gradient (float32 on the device) against
central finite differences of a float64 numpy reference on the host."""

from __future__ import annotations

import numpy as np

from vkgraph import Tensor


def numgrad(fn, arrays: list[np.ndarray], cot: np.ndarray, h: float = 1e-6) -> list[np.ndarray]:
    """d(sum(fn(*arrays) * cot))/d(arrays) by central differences in float64."""
    out = []
    for k, a in enumerate(arrays):
        gk = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            args = [np.array(x, np.float64) for x in arrays]
            args[k][i] += h
            up = np.sum(fn(*args) * cot)
            args[k][i] -= 2 * h
            gk[i] = (up - np.sum(fn(*args) * cot)) / (2 * h)
        out.append(gk)
    return out


def close(got: np.ndarray, want: np.ndarray, tol: float = 2e-3) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.size == 0:
        return
    assert np.all(np.isfinite(got)), got
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1.0)
    assert err <= tol, f"normalised error {err:.3g} > {tol}\n{got}\n{want}"


def check_grad(vk_fn, np_fn, arrays: list[np.ndarray], seed: int = 0, tol: float = 2e-3) -> None:
    rng = np.random.default_rng(seed)
    arrays = [np.array(a, np.float64) for a in arrays]
    ts = [Tensor(a.astype(np.float32)).requires_grad_() for a in arrays]
    out = vk_fn(*ts)
    ref = np_fn(*[a.astype(np.float64) for a in arrays])
    cot = rng.standard_normal(np.shape(ref))
    close(out.numpy().astype(np.float64), np.asarray(ref), max(tol, 1e-4))
    (out * Tensor(cot.astype(np.float32))).sum().backward()
    want = numgrad(np_fn, [a.astype(np.float64) for a in arrays], cot)
    for t, w in zip(ts, want, strict=True):
        close(t.grad.numpy().astype(np.float64), w, tol)

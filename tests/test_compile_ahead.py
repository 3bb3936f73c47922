"""A new plan's programs are compiled together on a thread pool before its first dispatch, with a progress bar
on a terminal when they are many (issue 16: a first run sat silent while kernels compiled one by one)."""

from __future__ import annotations

import sys
import threading

import numpy as np

from vkgraph import Tensor
from vkgraph import realize as rz


def _graph(seed: int):
    """Four kernels never compiled before in this process (shapes of their own), in one realize."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((3 + seed % 5, 7 + k + 11 * seed)).astype(np.float32) for k in range(4)]
    outs = [(Tensor(x) * (k + 2)).exp().sum(axis=1) for k, x in enumerate(xs)]
    wants = [np.exp(x * (k + 2)).sum(axis=1) for k, x in enumerate(xs)]
    return outs, wants


def test_new_programs_compile_on_the_pool_and_give_numpys_results(dev, monkeypatch, capsys):
    threads: list[str] = []
    real = dev.pipeline

    def spy(src, **kw):
        threads.append(threading.current_thread().name)
        return real(src, **kw)

    monkeypatch.setattr(dev, "pipeline", spy)
    monkeypatch.setattr(rz, "PROGRESS_MIN", 2)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    outs, wants = _graph(1)
    from vkgraph.tensor import realize_all

    realize_all(*outs)
    for o, w in zip(outs, wants):
        np.testing.assert_allclose(o.numpy(), w, rtol=1e-5)
    assert len(threads) >= 4 and all(t.startswith("vkgraph-compile") for t in threads), threads
    assert "compiling" in capsys.readouterr().err

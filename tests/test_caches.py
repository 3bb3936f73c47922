"""One bounded cache policy: every cache that grows with the programs a process meets is an LRU, reported by
`vkgraph.stats()` and emptied by `vkgraph.clear_caches()`; a flood of distinct programs stays within bounds."""

from __future__ import annotations

import gc
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import vkgraph
from vkgraph import Tensor, caches
from vkgraph import realize as realize_mod
from vkgraph.runtime import get_device

lower_mod = importlib.import_module("vkgraph.codegen.lower")  # the package exports a function of that name
ROOT = Path(vkgraph.__file__).resolve().parent.parent

NAMED = {"lowerings", "plans", "programs", "spirv", "glsl sources", "pipelines", "movements"}


def test_lru_keeps_the_most_recently_used():
    dropped = []
    c = caches.LRU("test lru", 3, on_evict=lambda k, v: dropped.append((k, v)))
    for i in range(3):
        c.put(i, str(i))
    assert c.get(0) == "0"  # 0 is now the most recent; 1 is the oldest
    assert c.get(7) is None
    c.put(3, "3")
    assert dropped == [(1, "1")] and sorted(c.values()) == ["0", "2", "3"]
    assert c.stats() == {"size": 3, "capacity": 3, "hits": 1, "misses": 1, "evictions": 1}
    c.put(0, "zero")  # a replaced value is no eviction
    assert len(c) == 3 and c.get(0) == "zero" and c.stats()["evictions"] == 1
    c.clear()
    assert len(c) == 0 and sorted(dropped) == [(0, "zero"), (1, "1"), (2, "2"), (3, "3")]
    assert c.stats() == {"size": 0, "capacity": 3, "hits": 0, "misses": 0, "evictions": 0}
    with pytest.raises(ValueError):
        caches.LRU("empty", 0)


def test_stats_reports_every_cache_and_the_device():
    x = Tensor(np.arange(12, dtype=np.float32))
    np.testing.assert_allclose(((x * 2).reshape(3, 4).sum(1)).numpy(), np.arange(12).reshape(3, 4).sum(1) * 2)
    s = vkgraph.stats()
    assert NAMED <= set(s["caches"]), sorted(s["caches"])
    for name, c in s["caches"].items():
        assert set(c) == {"size", "capacity", "hits", "misses", "evictions"}, name
        assert 0 <= c["size"] <= c["capacity"], (name, c)
    assert s["caches"]["plans"]["hits"] + s["caches"]["plans"]["misses"] > 0
    assert {"queue", "objects", "pool", "compiles"} <= set(s["device"])


def test_a_flood_of_programs_stays_within_every_bound(monkeypatch):
    """Distinct integer constants are literals, so each graph is a new GLSL program: with small capacities,
    every cache stays at its bound, evicted pipelines are destroyed once unused, and results stay right."""
    dev = get_device()
    cap = 4
    bounded = [realize_mod._PLANS, lower_mod._CACHE, realize_mod._programs(dev), dev.pipelines.cached,
               dev.pipelines.sources, dev.compiler.memory]
    for c in bounded:
        monkeypatch.setattr(c, "capacity", cap)
    live0, built0 = len(dev.pipelines.live), dev.pipelines.built
    base = np.arange(10, dtype=np.int32)
    x = Tensor(base)
    for k in range(1000, 1016):
        np.testing.assert_array_equal((x * 3 + k).numpy(), base * 3 + k)
    assert dev.pipelines.built - built0 >= 16
    assert all(len(c) <= cap for c in bounded), [(c.name, len(c)) for c in bounded]
    assert all(c.evictions > 0 for c in bounded), [(c.name, c.evictions) for c in bounded]
    gc.collect()
    dev.synchronize()
    dev.pipelines.sweep()
    # held now: at most the cached pipelines and the compiled programs realize keeps, beyond those held before
    assert len(dev.pipelines.live) <= live0 + 2 * cap
    assert not dev.pipelines.retired  # the GPU is idle: every retired pipeline was destroyed
    np.testing.assert_array_equal((x * 3 + 1000).numpy(), base * 3 + 1000)  # evicted, made again, still right


def test_clear_caches_empties_them_and_work_goes_on():
    x = Tensor(np.ones(5, np.float32))
    (x + 1).numpy()
    vkgraph.clear_caches()
    assert all(c["size"] == 0 for c in vkgraph.stats()["caches"].values())
    np.testing.assert_array_equal((x + 1).numpy(), np.full(5, 2, np.float32))


def test_cached_pipelines_do_not_keep_a_closed_device_alive():
    """Compiled programs stay in caches after their device closes; they must not hold the device (and its
    caches, which `stats()` would keep summing) alive."""
    code = textwrap.dedent("""
        import gc, weakref
        import numpy as np
        from vkgraph import Tensor, stats
        from vkgraph.runtime import get_device, reset_device
        dev = get_device()
        x = Tensor(np.arange(8, dtype=np.float32))
        assert (x * 3 + 1).numpy().tolist() == [3 * i + 1 for i in range(8)]
        ref = weakref.ref(dev)
        del dev, x
        reset_device()
        gc.collect()
        assert ref() is None, gc.get_referrers(ref())
        assert stats()["caches"]["pipelines"]["size"] == 0
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]

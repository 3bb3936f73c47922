"""Where an eager call's host time goes, for a graph seen before (its plan cached): each phase's median in
microseconds, then cProfile's top entries over the same calls with the submit and the wait left out.

    python benchmarks/profile_host.py            # the issue's sizes (a GPU with a few GiB free)
    python benchmarks/profile_host.py --small    # small row counts: lavapipe runs the GPU work inside its submit

Phases, per call: `build` (the Tensor ops making the graph), `key` (schedule.structure: the walk that keys the
graph), `alloc` (buffers from the pool), `record` (Queue.dispatch: barriers, descriptor sets, push constants,
vkCmd* calls), `submit` (Queue.flush: vkEndCommandBuffer and vkQueueSubmit), `other` (the rest of realize: plan
lookup, slots, bookkeeping of realized nodes) and `wait` (synchronize). "host" is build + key + alloc + record +
other: the call's CPU time above the driver's submit-and-wait floor.

    python benchmarks/profile_host.py --small --cpu   # the calling thread's CPU time instead of wall time

--cpu times with time.thread_time: on a machine shared with other work, waiting for a core is left out (and so
is the driver's own threads' work: lavapipe runs kernels on threads of its own; `wait` then shows little).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import numpy as np

from vkgraph import realize as rz
from vkgraph.runtime import get_device
from vkgraph.runtime import memory as mem
from vkgraph.runtime import queue as q
from vkgraph.tensor import Tensor

_spent: dict[str, float] = {}
_clock = time.perf_counter  # --cpu: time.thread_time


def _timed(owner: object, name: str, phase: str) -> None:
    """Wrap owner.name so each call adds its wall time to _spent[phase]."""
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        clock = _clock
        t = clock()
        try:
            return real(*args, **kwargs)
        finally:
            _spent[phase] = _spent.get(phase, 0.0) + clock() - t

    setattr(owner, name, wrapper)


def cases(small: bool) -> list[tuple[str, list[tuple[int, ...]], Callable]]:
    n = 1 << (12 if small else 28)
    sm = (4, 4096) if small else (4096, 4096)
    ln = (4, 4096) if small else (32768, 4096)
    return [(f"((a*c+d).exp()*c).sum() {n}", [(n,)] * 3, lambda a, c, d: ((a * c + d).exp() * c).sum()),
            (f"softmax {sm}", [sm], lambda t: t.softmax(-1)),
            (f"layer_norm {ln}", [ln], lambda t: t.layer_norm())]


PHASES = ("build", "key", "alloc", "record", "other", "submit", "wait")


def phases(fn: Callable, ts: list[Tensor], dev, reps: int) -> dict[str, float]:
    rows = []
    clock = _clock
    for _ in range(reps):
        _spent.clear()
        t0 = clock()
        out = fn(*ts)
        t1 = clock()
        out.realize()
        t2 = clock()
        dev.synchronize()
        t3 = clock()
        s = {p: _spent.get(p, 0.0) for p in ("key", "alloc", "record", "submit")}
        s["submit"] -= _spent.get("submit-in-sync", 0.0)
        s["build"] = t1 - t0
        s["other"] = t2 - t1 - s["key"] - s["alloc"] - s["record"] - s["submit"]
        s["wait"] = t3 - t2
        rows.append(s)
    med = {p: statistics.median(r[p] for r in rows) * 1e6 for p in PHASES}
    med["host"] = statistics.median(sum(r[p] for p in ("build", "key", "alloc", "record", "other")) for r in rows)
    med["host"] *= 1e6
    return med


def main() -> None:
    global _clock
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--top", type=int, default=15, help="cProfile entries to print per case (0: none)")
    ap.add_argument("--cpu", action="store_true", help="time the calling thread's CPU time, not wall time")
    a = ap.parse_args()
    if a.cpu:
        _clock = time.thread_time
    dev = get_device()
    _timed(rz, "structure", "key")
    _timed(mem.BufferPool, "alloc", "alloc")
    _timed(q.Queue, "dispatch", "record")
    _timed(q.Queue, "flush", "submit")
    sync = q.Queue.synchronize

    def synchronize(self) -> None:  # its own (empty) flush is not the call's submit
        before = _spent.get("submit", 0.0)
        sync(self)
        _spent["submit-in-sync"] = _spent.get("submit-in-sync", 0.0) + _spent.get("submit", 0.0) - before

    q.Queue.synchronize = synchronize
    rng = np.random.default_rng(0)
    what = "thread CPU" if a.cpu else "wall"
    print(f"device: {dev.info.name}; median us ({what} time) per call over {a.reps} calls")
    print(f"{'case':36s} " + " ".join(f"{p:>7s}" for p in (*PHASES, "host")))
    profiles = []
    for name, shapes, fn in cases(a.small):
        ts = [Tensor(rng.standard_normal(s, dtype=np.float32)).realize() for s in shapes]
        for _ in range(5):
            fn(*ts).realize()
            dev.synchronize()
        med = phases(fn, ts, dev, a.reps)
        print(f"{name:36s} " + " ".join(f"{med[p]:7.1f}" for p in (*PHASES, "host")))
        if a.top:
            prof = cProfile.Profile()
            for _ in range(a.reps):
                prof.enable()
                out = fn(*ts)
                out.realize()
                prof.disable()
                dev.synchronize()
            profiles.append((name, prof))
    for name, prof in profiles:
        print(f"\n--- {name}: cProfile, the call without the wait (tottime order)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()

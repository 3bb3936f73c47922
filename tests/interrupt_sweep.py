"""Ctrl-C at every point of a call: `python tests/interrupt_sweep.py SCENARIO STRIDE` (run by test_interrupts.py in a
subprocess, so that a crash fails the test rather than pytest).

For each k (every STRIDE-th line that vkgraph executes during one call of the scenario), the call runs under a trace
function that simulates SIGINT (`_thread.interrupt_main`) at the k-th line; Python then raises KeyboardInterrupt at
its next check, wherever that is, unless vkgraph defers it out of a critical section. After each attempt the next
call, untraced, must give numpy's result, and every simulated interrupt must have arrived exactly once. Prints
"ok <attempts> <fired> <arrived>" (a call may run fewer lines than the first: then nothing fires).
"""

from __future__ import annotations

import _thread
import sys
import time

import numpy as np

import vkgraph
from vkgraph import Tensor
from vkgraph.runtime import get_device

rng = np.random.default_rng(0)


@vkgraph.jit
def step(x, y):
    return ((x * y + 1).exp() * 0.5).sum(axis=1)


def want_step(x, y):
    return (np.exp(x * y + 1) * 0.5).sum(axis=1)


def data(rows: int = 8, cols: int = 32) -> tuple[np.ndarray, np.ndarray]:
    return (rng.standard_normal((rows, cols)).astype(np.float32) * 0.5,
            rng.standard_normal((rows, cols)).astype(np.float32) * 0.5)


def close(got, want) -> None:
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)


def replay() -> None:
    x, y = data()
    close(step(Tensor(x), Tensor(y)).numpy(), want_step(x, y))


def replay_bound() -> None:
    """Inputs of 64 KiB: the replay reads them in place (their buffers bound, the graph recorded again)."""
    x, y = data(64, 256)
    close(step(Tensor(x), Tensor(y)).numpy(), want_step(x, y))


def capture() -> None:
    step.reset()
    x, y = data()
    step(Tensor(x), Tensor(y))  # eager
    close(step(Tensor(x), Tensor(y)).numpy(), want_step(x, y))  # the capture


_shape = [3]


def compile_new() -> None:
    """A shape never seen: schedule, lower, compile a new kernel, dispatch, read back."""
    _shape[0] += 1
    x, _ = data(_shape[0], 5)
    close((Tensor(x) * 3 - 1).max(axis=1).numpy(), (x * 3 - 1).max(axis=1))


def eager() -> None:
    x, y = data(64, 4096 // 64)
    close(((Tensor(x) + Tensor(y)) * 2).sum().numpy(), ((x + y) * 2).astype(np.float64).sum())


SCENARIOS = {"replay": replay, "replay_bound": replay_bound, "capture": capture, "compile": compile_new, "eager": eager}


class Sweep:
    def __init__(self) -> None:
        self.fired = 0
        self.arrived = 0
        self.where = ""  # the line the last interrupt was fired at

    def run(self, call, at: int) -> int:
        """Run call, firing one SIGINT at vkgraph's `at`-th line; returns how many lines vkgraph ran."""
        count = 0
        fired = False

        def local(frame, event, arg):
            nonlocal count, fired
            if event == "line":
                count += 1
                if count == at and not fired:
                    fired = True
                    self.fired += 1
                    code = frame.f_code
                    self.where = f"{code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} ({code.co_name})"
                    _thread.interrupt_main()
            return local

        def tracer(frame, event, arg):
            return local if "/vkgraph/" in frame.f_code.co_filename else None

        try:
            sys.settrace(tracer)
            try:
                call()
            finally:
                sys.settrace(None)
        except KeyboardInterrupt:  # a call that was not interrupted must be correct: other errors propagate
            self.arrived += 1
        deadline = time.monotonic() + 5.0
        while self.arrived < self.fired and time.monotonic() < deadline:
            try:  # an interrupt deferred out of a critical section arrives a few milliseconds later
                time.sleep(0.002)
            except KeyboardInterrupt:
                self.arrived += 1
        return count


def main() -> None:
    name, stride = sys.argv[1], int(sys.argv[2])
    call = SCENARIOS[name]
    for _ in range(3):  # warm: compiled, captured, plans cached
        call()
    sweep = Sweep()
    total = sweep.run(call, 0)
    attempts = 0
    for at in range(1, total + 1, stride):
        sweep.run(call, at)
        attempts += 1
        q = get_device().queue
        if q.capture is not None or get_device().memory.pool.keep_all:
            raise SystemExit(f"a capture was left open by an interrupt at {sweep.where}")
        if sweep.arrived != sweep.fired:
            raise SystemExit(f"{sweep.fired} interrupts fired, {sweep.arrived} arrived (the last at {sweep.where})")
        try:
            call()  # the next call, untraced, is correct
        except BaseException:
            print(f"after an interrupt at {sweep.where}:", file=sys.stderr)
            raise
    print("ok", attempts, sweep.fired, sweep.arrived)


if __name__ == "__main__":
    main()

"""Closed, reset and runaway devices: every entry point raises a typed error, old captures are dropped safely, and
the interpreter always exits. Each case runs in a subprocess, so that a crash fails the test instead of pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from glsl_samples import AXPB

PRELUDE = '''
import sys
import numpy as np
import vkgraph
from vkgraph import Tensor
from vkgraph.runtime import DeviceClosed, DeviceLost, DeviceTimeout, faults, get_device, reset_device
''' + f"\nAXPB = {AXPB!r}\n" + '''


def raises(kind, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except kind as e:
        return str(e)
    raise SystemExit(f"{getattr(fn, '__name__', fn)} did not raise {kind.__name__}")


@vkgraph.jit
def step(x):
    return (x * 2 + 1).sum(axis=1)


def check_step(x):
    np.testing.assert_allclose(step(Tensor(x)).numpy(), (x * 2 + 1).sum(axis=1), rtol=1e-5)


def warm_step(seed):
    """A jit function run eagerly, captured and replayed on the current device; a tensor made there first."""
    rng = np.random.default_rng(seed)
    x = rng.random((4, 8)).astype(np.float32)
    old = Tensor(x)
    for _ in range(3):
        check_step(x)
    return rng, old
'''


def run(body: str, timeout: float = 120, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    import os

    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, **(env or {})})
    return r, time.perf_counter() - t


def run_ok(body: str, timeout: float = 120, env: dict | None = None) -> float:
    """Runs `body` (see run), which must exit 0 having printed only "ok"; returns the seconds it took."""
    r, elapsed = run(body, timeout, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "ok"
    return elapsed


def test_every_entry_point_of_a_closed_device_raises_device_closed():
    run_ok('''
        d = get_device()
        k = d.pipeline(AXPB)
        a, b = d.alloc(256), d.alloc(256)
        d.upload(a, np.arange(64, dtype=np.float32))
        warm_step(0)  # eager, capture, replay
        d.queue.begin_capture()
        d.dispatch(k, [a, b], (1, 1, 1), (64, 2.0, 0.0))
        graph = d.queue.end_capture()
        d.close()
        raises(DeviceClosed, d.pipeline, AXPB + "// another kernel")
        raises(DeviceClosed, d.pipeline, AXPB)
        raises(DeviceClosed, d.alloc, 64)
        raises(DeviceClosed, d.upload, a, np.zeros(4, np.float32))
        raises(DeviceClosed, d.download, a, np.float32, 4)
        raises(DeviceClosed, d.dispatch, k, [a, b], (1, 1, 1), (64, 2.0, 0.0))
        raises(DeviceClosed, d.queue.copy, a, 0, b, 0, 64)
        raises(DeviceClosed, d.synchronize)
        raises(DeviceClosed, graph.replay)
        a.release()  # releasing and dropping old buffers and graphs is harmless
        del graph
        # the default device is a new one; buffers of the old one raise there too
        d2 = get_device()
        assert d2 is not d
        raises(DeviceClosed, d2.queue.copy, b, 0, d2.alloc(64), 0, 64)
        raises(DeviceClosed, d2.dispatch, d2.pipeline(AXPB), [b, d2.alloc(256)], (1, 1, 1), (64, 2.0, 0.0))
        raises(DeviceClosed, d2.download, b, np.float32, 4)
        c = d2.alloc(256)
        d2.upload(c, np.arange(64, dtype=np.float32))
        assert d2.download(c, np.float32, 64)[5] == 5
        print("ok")
    ''')


def test_jit_and_tensors_after_close_raise_or_start_afresh():
    run_ok('''
        rng, old = warm_step(0)
        get_device().close()
        raises(DeviceClosed, step, old)  # a tensor of the closed device
        raises(DeviceClosed, lambda: (old + 1).numpy())
        raises(DeviceClosed, old.numpy)
        assert ((Tensor(np.ones(4, np.float32)) + 1).numpy() == 2).all()  # the next plain op works
        for _ in range(4):  # the jit function starts afresh on the new device: eager, capture, replays
            check_step(rng.random((4, 8)).astype(np.float32))
        print("ok")
    ''')


def test_device_lost_then_reset_then_a_jit_captured_before():
    run_ok('''
        rng, old = warm_step(1)
        faults.inject("wait")
        raises(DeviceLost, (old * 3).numpy)
        raises(DeviceLost, get_device().alloc, 16)
        reset_device()
        raises(DeviceClosed, step, old)
        for _ in range(4):
            check_step(rng.random((4, 8)).astype(np.float32))
        assert ((Tensor(np.ones(4, np.float32)) * 3).numpy() == 3).all()
        print("ok")
    ''')


RUNAWAY = '''
SPIN = """#version 450
layout(local_size_x = 1) in;
layout(set = 0, binding = 0) buffer B { float v[]; };
void main() {
    float x = v[0];
    // a million steps per invocation (nested: lavapipe caps one loop at 65535), stored so none is dropped
    for (uint o = 0u; o < 1000u; o++) { for (uint i = 0u; i < 1000u; i++) { x = sin(x) + 1e-3; } }
    v[gl_WorkGroupID.x & 15u] = x;
}
"""
d = get_device()
runaway = d.pipeline(SPIN)
b = d.alloc(64)
d.dispatch(runaway, [b], (65535, 65535, 1))  # hours of work on any device
msg = raises(DeviceTimeout, d.synchronize)
assert "reset_device" in msg, msg
'''


def test_after_a_runaway_kernel_the_interpreter_exits():
    r, elapsed = run(RUNAWAY + textwrap.dedent('''
        print("timed out", flush=True)
        sys.exit(3)
    '''), timeout=60, env={"VKGRAPH_TIMEOUT_S": "1"})
    assert r.returncode == 3, r.stdout + r.stderr
    assert "timed out" in r.stdout
    assert elapsed < 20, f"exit took {elapsed:.1f} s"


def test_after_a_runaway_kernel_the_next_wait_says_so_and_reset_device_gives_a_working_device():
    elapsed = run_ok(RUNAWAY + textwrap.dedent('''
        c = d.alloc(256)
        d.dispatch(d.pipeline(AXPB), [b, c], (1, 1, 1), (16, 1.0, 0.0))
        raises(DeviceTimeout, d.synchronize)  # queued behind the runaway kernel
        d2 = reset_device()  # abandons the old device (its work cannot be cancelled) at once
        assert d.closed and d.abandoned and d2 is not d
        raises(DeviceClosed, d.alloc, 16)
        raises(DeviceClosed, d2.queue.copy, c, 0, d2.alloc(256), 0, 64)
        warm_step(2)
        print("ok", flush=True)
    '''), timeout=90, env={"VKGRAPH_TIMEOUT_S": "1"})
    assert elapsed < 45, f"took {elapsed:.1f} s"


def test_skipping_the_drivers_teardown_keeps_the_exit_status_and_the_output():
    # what an abandoned device arranges for the process's exit: status and buffered output survive
    for tail, code in (("sys.exit(3)", 3), ("raise ValueError('boom')", 1), ("pass", 0)):
        r, _ = run(f'''
            from vkgraph.runtime import device
            (Tensor(np.ones(4, np.float32)) + 1).numpy()
            device._skip_driver_teardown_at_exit()
            print("unflushed", end="")
            {tail}
        ''')
        assert r.returncode == code, (tail, r.stdout, r.stderr)
        assert r.stdout == "unflushed"

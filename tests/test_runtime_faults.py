import numpy as np
import pytest

from vkgraph.runtime import DeviceTimeout, OutOfDeviceMemory

SPIN = """#version 450
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) buffer B { float v[]; };
layout(push_constant) uniform Push { uint iters; } pc;
void main() {
    // every invocation iterates on its own value; the result is stored, so the loop cannot be dropped
    uint i = gl_GlobalInvocationID.x;
    float x = v[i];
    // nested: lavapipe caps any one loop at 65535 iterations
    for (uint o = 0; o < pc.iters; o++) {
        for (uint j = 0; j < 1024u; j++) { x = sin(x) * 1.0001 + float(j & 7u) * 1e-3; }
    }
    v[i] = x;
}
"""


def _spin_iters(dev, seconds: float) -> int:
    """Iterations of the spin kernel that take about `seconds` on this device."""
    import time

    k = dev.kernel(SPIN)
    b = dev.alloc(64 * 64 * 4)
    iters = 1
    while True:
        t = time.perf_counter()
        dev.dispatch(k, [b], (64, 1, 1), (iters,))
        dev.synchronize()
        dt = time.perf_counter() - t
        if dt > 0.05 or iters >= 1 << 20:
            return int(iters * seconds / dt)
        iters *= 4


def test_fence_timeout_raises_then_recovers(dev):
    iters = _spin_iters(dev, 1.5)
    k = dev.kernel(SPIN)
    b = dev.alloc(64 * 64 * 4)
    dev.upload(b, np.zeros(64 * 64, np.float32))
    q = dev.queue
    saved = q.timeout_s, q.timeout_ns
    q.timeout_s, q.timeout_ns = 0.05, int(0.05e9)
    try:
        dev.dispatch(k, [b], (64, 1, 1), (min(iters, 2**32 - 1),))
        with pytest.raises(DeviceTimeout, match="VKGRAPH_TIMEOUT_S"):
            dev.synchronize()
    finally:
        q.timeout_s, q.timeout_ns = saved
    dev.synchronize()  # the work finishes; the runtime is usable
    x = dev.alloc(64)
    dev.upload(x, np.arange(16, dtype=np.float32))
    assert dev.download(x, np.float32, 16)[3] == 3


def test_oom_leaves_pool_consistent(dev):
    pool = dev.memory.pool
    keep = [dev.alloc(1 << 20) for _ in range(3)]
    stats = pool.stats.as_dict()
    with pytest.raises(OutOfDeviceMemory) as e:
        dev.alloc(dev.info.max_buffer_size + 1)
    assert "bytes" in str(e.value)
    assert pool.stats.live_bytes == stats["live_bytes"] and pool.stats.live_buffers == stats["live_buffers"]
    for b in keep:
        b.release()

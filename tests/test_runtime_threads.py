"""The runtime is safe to use from several threads: the queue, pools and caches take locks, and each thread's
dispatches are ordered among themselves by the same hazard tracking."""

import threading

import numpy as np

AXPB = """#version 450
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) readonly buffer X { float x[]; };
layout(set = 0, binding = 1) writeonly buffer Y { float y[]; };
layout(push_constant) uniform Push { uint n; float a; float b; } pc;
void main() { uint i = gl_GlobalInvocationID.x; if (i < pc.n) y[i] = pc.a * x[i] + pc.b; }
"""


def test_two_threads_dispatch_concurrently(dev):
    k = dev.kernel(AXPB)
    n = 1024
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(30):
                x = rng.standard_normal(n).astype(np.float32)
                a, b = dev.alloc(4 * n), dev.alloc(4 * n)
                dev.upload(a, x)
                for _ in range(5):
                    dev.dispatch(k, [a, b], (n // 64, 1, 1), (n, 1.0, 1.0))
                    dev.dispatch(k, [b, a], (n // 64, 1, 1), (n, 1.0, 1.0))
                np.testing.assert_allclose(dev.download(a, np.float32, n), x + 10, rtol=1e-5, atol=1e-5)
                a.release()
                b.release()
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]

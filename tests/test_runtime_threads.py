"""The runtime is safe to use from several threads: the queue, pools and caches take locks, and each thread's
dispatches are ordered among themselves by the same hazard tracking."""

import threading

import numpy as np
from glsl_samples import AXPB


def errors_of(work, *args_per_thread) -> list[BaseException]:
    """Run work(args) in one thread per argument tuple; return what they raised."""
    errors: list[BaseException] = []

    def guarded(*args) -> None:
        try:
            work(*args)
        except BaseException as e:  # noqa: BLE001 (reported by the caller)
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=a) for a in args_per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_two_threads_dispatch_concurrently(dev):
    k = dev.kernel(AXPB)
    n = 1024

    def work(seed: int) -> None:
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

    errors = errors_of(work, (0,), (1,))
    assert not errors, errors[0]


def test_dispatch_from_another_thread_during_a_capture_raises(dev):
    from vkgraph.runtime import CaptureError

    k = dev.kernel(AXPB)
    a, b = dev.alloc(256), dev.alloc(256)
    dev.queue.begin_capture()
    try:
        errors = errors_of(lambda: dev.dispatch(k, [a, b], (1, 1, 1), (64, 1.0, 0.0)), ())
        dev.dispatch(k, [a, b], (1, 1, 1), (64, 1.0, 0.0))  # the capturing thread itself may dispatch
    finally:
        graph = dev.queue.end_capture()
    assert len(errors) == 1 and isinstance(errors[0], CaptureError) and "another thread" in str(errors[0])
    assert graph.kernels == 1
    graph.destroy()


def test_tensor_graphs_from_two_threads():
    from vkgraph import Tensor

    results: dict[int, np.ndarray] = {}

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(20):
            x = rng.standard_normal((16, 32)).astype(np.float32)
            got = ((Tensor(x) * 2 + 1).exp().sum(axis=1) / 3).numpy()
            np.testing.assert_allclose(got, np.exp(x * 2 + 1).sum(axis=1) / 3, rtol=1e-5)
        results[seed] = got

    errors = errors_of(work, (0,), (1,))
    assert not errors, errors[0]
    assert len(results) == 2


def test_split_reductions_of_one_structure_from_two_threads():
    """A large sum lowers to a split reduction with a scratch buffer; two threads running the same cached plan
    on different data must each get their own scratch (they shared the plan's, and read each other's partials)."""
    from vkgraph import Tensor
    from vkgraph.realize import count_kernels

    n = 1 << 18
    with count_kernels() as c:
        Tensor(np.ones(n, np.float32)).sum().numpy()
    assert c.count == 2, "the sum no longer splits: the test would not reach the shared scratch"

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(25):
            x = rng.random(n).astype(np.float32) + 10 * seed
            got = Tensor(x).sum().numpy()
            np.testing.assert_allclose(got, x.astype(np.float64).sum(), rtol=1e-4)

    errors = errors_of(work, (0,), (1,), (2,))
    assert not errors, errors[0]

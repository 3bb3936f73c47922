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
    k = dev.pipeline(AXPB)
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


def test_work_from_another_thread_waits_for_a_capture_and_stays_out_of_it(dev):
    """While one thread captures, another thread's allocations, dispatches and copies wait for the capture to end
    (they ran into it before, or took memory the capture was to keep); its reads of finished results do not."""
    k = dev.pipeline(AXPB)
    a, b = dev.alloc(256), dev.alloc(256)
    ready = dev.alloc(256)
    dev.upload(a, np.arange(64, dtype=np.float32))
    dev.upload(ready, np.full(64, 7, np.float32))
    read_back: list[np.ndarray] = []

    def other() -> None:
        read_back.append(dev.download(ready, np.float32, 64))  # a read does not wait, nor raise
        c, d = dev.alloc(256), dev.alloc(256)
        dev.upload(c, np.ones(64, np.float32))
        dev.dispatch(k, [c, d], (1, 1, 1), (64, 3.0, 0.0))
        dev.queue.copy(d, 0, c, 0, 256)
        read_back.append(dev.download(c, np.float32, 64))

    dev.queue.begin_capture()
    try:
        t = threading.Thread(target=other)
        t.start()
        t.join(timeout=1.0)
        blocked = t.is_alive()
        dev.dispatch(k, [a, b], (1, 1, 1), (64, 2.0, 0.0))
    finally:
        graph = dev.queue.end_capture()
    t.join()
    assert blocked, "another thread's work ran while the capture was open"
    assert graph.kernels == 1 and len(graph.entries) == 1
    np.testing.assert_array_equal(read_back[0], 7)
    np.testing.assert_array_equal(read_back[1], 3)
    graph.replay()
    np.testing.assert_array_equal(dev.download(b, np.float32, 64), 2 * np.arange(64))
    graph.destroy()


def test_a_thread_waiting_on_a_capture_that_never_ends_gets_capture_error(dev):
    from vkgraph.runtime import CaptureError

    k = dev.pipeline(AXPB)
    a, b = dev.alloc(256), dev.alloc(256)
    q = dev.queue
    saved = q.timeout_s
    q.timeout_s = 0.2
    q.begin_capture()
    try:
        errors = errors_of(lambda: dev.dispatch(k, [a, b], (1, 1, 1), (64, 1.0, 0.0)), ())
    finally:
        q.timeout_s = saved
        q.end_capture().destroy()
    assert len(errors) == 1 and isinstance(errors[0], CaptureError) and "capturing" in str(errors[0])


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


def test_jit_captures_and_replays_from_several_threads():
    """Threads calling jit functions (one shared, one each) capture and replay at once; with one capture slot per
    function, new shapes keep recapturing. A replay's input copy once landed in another thread's open capture."""
    import vkgraph
    from vkgraph import Tensor

    @vkgraph.jit(max_entries=1)
    def shared(x, y):
        return (x * y + 1).sum(axis=1)

    def work(seed: int) -> None:
        @vkgraph.jit(max_entries=1)
        def own(x):
            return (x * 3 - 2).max(axis=0)

        rng = np.random.default_rng(seed)
        for i in range(24):
            rows = 4 + (i // 3) % 3  # three calls per shape: eager, capture, replay; then a new shape
            x = rng.standard_normal((rows, 16)).astype(np.float32)
            y = rng.standard_normal((rows, 16)).astype(np.float32)
            np.testing.assert_allclose(shared(Tensor(x), Tensor(y)).numpy(), (x * y + 1).sum(axis=1), rtol=1e-5,
                                       atol=1e-5)
            np.testing.assert_allclose(own(Tensor(x)).numpy(), (x * 3 - 2).max(axis=0), rtol=1e-6)

    errors = errors_of(work, (0,), (1,), (2,))
    assert not errors, errors[0]


def test_pipelines_are_created_by_several_threads_at_once_and_one_kept_per_key(dev, monkeypatch):
    """Two threads creating pipelines meet inside the creation (a lock around it would keep them apart and
    break the barrier); two creating the same one end with one Pipeline, the extra handle destroyed."""
    meet = threading.Barrier(2, timeout=20)
    real = dev.pipelines._build

    def build(*args):
        meet.wait()
        return real(*args)

    monkeypatch.setattr(dev.pipelines, "_build", build)
    got: dict[int, object] = {}

    def work(i: int, src: str) -> None:
        got[i] = dev.pipeline(src)

    def unique(k: int) -> str:  # a program not compiled before in this process (a branch never taken here)
        tag = (id(meet) + k) % 1_000_000_000 + 1_000_000
        return AXPB.replace("y[i] = pc.a", f"if (pc.n == {tag}u) y[0] = 1.0; else y[i] = pc.a")

    distinct = [unique(0), unique(1)]
    assert errors_of(work, (0, distinct[0]), (1, distinct[1])) == []
    assert got[0] is not got[1]
    same = unique(2)
    built = dev.pipelines.built
    assert errors_of(work, (2, same), (3, same)) == []
    assert got[2] is got[3] and dev.pipelines.built == built + 2 and dev.pipelines.building == 0
    n = 256
    x = np.arange(n, dtype=np.float32)
    a, b = dev.alloc(4 * n), dev.alloc(4 * n)
    dev.upload(a, x)
    dev.dispatch(got[2], [a, b], (n // 64, 1, 1), (n, 2.0, 1.0))
    np.testing.assert_array_equal(dev.download(b, np.float32, (n,)), 2 * x + 1)

import gc

import numpy as np
import pytest
from glsl_samples import AXPB

from vkgraph import Variable
from vkgraph.runtime import VkgraphError


def _chain(dev, k, x, out, n, pos):
    """x -> t1 -> t2 -> out, with intermediates released as soon as read (memory planning by the pool)."""
    t1 = dev.alloc(4 * n)
    dev.dispatch(k, [x, t1], (n // 64, 1, 1), (n, 2.0, 1.0))
    t2 = dev.alloc(4 * n)
    dev.dispatch(k, [t1, t2], (n // 64, 1, 1), (n, 1.0, pos))
    t1.release()
    t3 = dev.alloc(4 * n)  # reuses t1's memory inside the graph
    dev.dispatch(k, [t2, t3], (n // 64, 1, 1), (n, 3.0, 0.0))
    t2.release()
    dev.dispatch(k, [t3, out], (n // 64, 1, 1), (n, 1.0, 0.5))
    t3.release()


def captured_chain(dev, n, pos=0.0):
    """(input buffer, output buffer, graph) of the chain captured once (and run once)."""
    k = dev.pipeline(AXPB)
    x, out = dev.alloc(4 * n), dev.alloc(4 * n)
    dev.queue.begin_capture()
    _chain(dev, k, x, out, n, pos)
    graph = dev.queue.end_capture()
    dev.synchronize()
    return x, out, graph


def ref(x, pos):
    return ((2 * x + 1) + pos) * 3 + 0.5


def test_replay_with_new_inputs_and_variable(dev):
    n = 1024
    k = dev.pipeline(AXPB)
    x, out = dev.alloc(4 * n), dev.alloc(4 * n)
    pos = Variable("pos", 0)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal(n).astype(np.float32)
    dev.upload(x, xs)
    dev.queue.begin_capture()
    _chain(dev, k, x, out, n, pos)
    graph = dev.queue.end_capture()
    np.testing.assert_allclose(dev.download(out, np.float32, n), ref(xs, 0), rtol=1e-5)
    assert graph.kernels == 4
    assert len(graph.owned) == 2  # t1 and t3 share one allocation; t2 has its own
    for p in [5, 5, 17, 0, 1000]:
        xs = rng.standard_normal(n).astype(np.float32)
        dev.upload(x, xs)
        pos.value = p
        graph.replay()
        np.testing.assert_allclose(dev.download(out, np.float32, n), ref(xs, p), rtol=1e-5, atol=1e-4)
    graph.destroy()
    with pytest.raises(VkgraphError, match="destroyed"):
        graph.replay()


def test_replay_is_one_submit(dev):
    n = 256
    x, out, graph = captured_chain(dev, n)
    before = dev.queue.stats["submits"]
    graph.replay()
    dev.synchronize()
    assert dev.queue.stats["submits"] == before + 1
    graph.destroy()


def test_graph_memory_is_exclusive_until_destroyed(dev):
    n = 256
    k = dev.pipeline(AXPB)
    x, out = dev.alloc(4 * n), dev.alloc(4 * n)
    dev.queue.begin_capture()
    _chain(dev, k, x, out, n, 0.0)
    graph = dev.queue.end_capture()
    owned = {a.handle for a in graph.owned}
    others = [dev.alloc(4 * n) for _ in range(4)]
    assert not owned & {b.alloc.handle for b in others}
    graph.destroy()
    again = [dev.alloc(4 * n) for _ in range(6)]
    assert owned <= {b.alloc.handle for b in again}


def test_capture_errors(dev):
    dev.queue.begin_capture()
    with pytest.raises(VkgraphError, match="already open"):
        dev.queue.begin_capture()
    dev.queue.abort_capture()
    with pytest.raises(VkgraphError, match="no capture"):
        dev.queue.end_capture()


def test_no_leaks_over_10000_replays(dev):
    n = 256
    k = dev.pipeline(AXPB)
    x, out = dev.alloc(4 * n), dev.alloc(4 * n)
    dev.upload(x, np.zeros(n, np.float32))
    pos = Variable("pos", 0)
    dev.queue.begin_capture()
    _chain(dev, k, x, out, n, pos)
    graph = dev.queue.end_capture()
    dev.synchronize()

    def snapshot():
        s = dev.memory.pool.stats
        return (s.live_bytes, s.idle_bytes, dev.memory.allocation_count, dev.queue.object_counts()["command_buffers"],
                dev.queue.object_counts()["descriptor_sets"], len(dev.pipelines.cached))

    gc.collect()  # buffers of earlier tests' garbage (a dropped jit's captures) are freed now, not mid-loop
    start = snapshot()
    for i in range(10_000):
        pos.value = i % 7
        graph.replay()
    dev.synchronize()
    assert snapshot() == start
    np.testing.assert_allclose(dev.download(out, np.float32, n), ref(np.zeros(n, np.float32), 9999 % 7),
                               rtol=1e-5)
    graph.destroy()


def test_input_copies_and_replay_share_one_submit(dev):
    n = 256
    x, out, graph = captured_chain(dev, n)
    new_input = dev.alloc(4 * n)
    xs = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    dev.upload(new_input, xs)
    dev.synchronize()
    before = dev.queue.stats["submits"]
    dev.queue.copy(new_input, 0, x, 0, 4 * n)  # recorded, not submitted
    graph.replay()
    dev.synchronize()
    assert dev.queue.stats["submits"] == before + 1
    np.testing.assert_allclose(dev.download(out, np.float32, n), ref(xs, 0.0), rtol=1e-5, atol=1e-5)
    graph.destroy()

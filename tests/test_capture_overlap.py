"""Replays of one command graph in flight together: the host does not wait for a graph's previous submission
(each graph has a small ring of command buffers), and the results equal replays run one at a time."""

import numpy as np
import pytest
from glsl_samples import AXPB

from vkgraph import Variable
from vkgraph.jit import BIND_BYTES, jit
from vkgraph.runtime import DeviceError, faults
from vkgraph.runtime import descriptors as descriptors_module
from vkgraph.runtime.capture import RING
from vkgraph.runtime.vk import vk
from vkgraph.tensor import Tensor


@pytest.fixture
def waits(dev, monkeypatch):
    """The sequence numbers the host waits for on the device's queue, from now on. Submissions leave the queue's
    books only through these waits (not when recording finds their fences signalled), so a replay that needed the
    previous one done would wait, however fast the device ran it."""
    seen: list[int] = []
    real = dev.queue.wait

    def wait(seq: int) -> None:
        seen.append(seq)
        real(seq)

    monkeypatch.setattr(dev.queue, "wait", wait)
    monkeypatch.setattr(dev.queue, "_retire", lambda block: None)
    return seen


def _doubling(dev, n, pos):
    """A graph of x <- 2x + pos (a kernel into t, t copied back into x): each replay reads what the one before
    it wrote, so the result shows the order of the replays and the value each one saw."""
    k = dev.pipeline(AXPB)
    x, t = dev.alloc(4 * n), dev.alloc(4 * n)
    dev.queue.begin_capture()
    dev.dispatch(k, [x, t], (n // 64, 1, 1), (n, 2.0, pos))
    dev.queue.copy(t, 0, x, 0, 4 * n)
    graph = dev.queue.end_capture()
    dev.synchronize()
    return x, graph


def _in_flight(dev, graph) -> int:
    return sum(s.sub in dev.queue.in_flight for s in graph.slots)


def test_replays_in_flight_together_equal_one_at_a_time(dev, waits):
    n = 256
    pos = Variable("pos", 0)
    x, graph = _doubling(dev, n, pos)
    x0 = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    values = [1, 5, 5, 9, -3]

    def run(one_at_a_time: bool) -> np.ndarray:
        dev.upload(x, x0)
        dev.synchronize()
        del waits[:]
        seqs = []
        for i, p in enumerate(values):
            pos.value = p  # a live value changing between replays in flight: each command buffer has its own
            seqs.append(graph.replay())
            if one_at_a_time:
                dev.queue.wait(seqs[-1])
            elif i == 1:  # the second replay was submitted without waiting for the first, still in flight
                assert not waits
                assert [s.seq for s in dev.queue.in_flight] == seqs
            assert _in_flight(dev, graph) <= RING
        dev.synchronize()
        return dev.download(x, np.float32, n)

    together = run(False)
    assert len(graph.slots) == RING
    want = x0.copy()
    for p in values:
        want = np.float32(2) * want + np.float32(p)
    np.testing.assert_allclose(together, want, rtol=1e-6)
    np.testing.assert_array_equal(together, run(True))
    graph.replay()
    graph.replay()
    assert _in_flight(dev, graph) == 2
    graph.destroy()  # waits for both before freeing their command buffers
    assert not _in_flight(dev, graph)


def test_jit_calls_in_flight_together_with_new_bound_inputs_and_values(dev, waits):
    """Two calls of a jitted function, the second submitted while the first runs, each with its own large
    (bound in place) input, small (copied) input and live value, give what the calls one at a time give."""
    rows = BIND_BYTES // (4 * 64)
    pos = Variable("pos", 0)
    f = jit(lambda x, b: (x * 2 + b + pos).sum(axis=1), fresh_outputs=True)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((rows, 64)).astype(np.float32) for _ in range(3)]
    bs = [rng.standard_normal(64).astype(np.float32) for _ in range(3)]
    ts = [Tensor(x).realize() for x in xs]
    tb = [Tensor(b).realize() for b in bs]
    f(ts[2], tb[2])  # eager
    f(ts[2], tb[2])  # captured
    dev.synchronize()
    (entry,) = f.cache.values()
    graph = entry.graph
    del waits[:]
    outs = []
    for i, p in [(0, 3), (1, 7)]:
        pos.value = p
        outs.append(f(ts[i], tb[i]))
    assert not waits  # the second call did not wait for the first
    assert _in_flight(dev, graph) == 2
    for o, i, p in zip(outs, (0, 1), (3, 7)):
        np.testing.assert_allclose(o.numpy(), (xs[i] * 2 + bs[i] + p).sum(axis=1), rtol=1e-5, atol=1e-4)
    f.reset()


def test_bound_inputs_stay_pinned_while_their_command_buffer_may_run(dev, monkeypatch, waits):
    """A descriptor set of a binding stays in the cache while a command buffer recorded with it is in flight,
    even when eviction runs at every new set."""
    n = 16384  # 64 KiB
    k = dev.pipeline(AXPB)
    slot, out = dev.alloc(4 * n), dev.alloc(4 * n)
    dev.queue.begin_capture()
    dev.dispatch(k, [slot, out], (n // 64, 1, 1), (n, 3.0, 1.0))
    graph = dev.queue.end_capture()
    inputs = [dev.alloc(4 * n) for _ in range(3)]
    data = [np.full(n, i + 1, np.float32) for i in range(3)]
    for b, d in zip(inputs, data):
        dev.upload(b, d)
    dev.synchronize()
    monkeypatch.setattr(descriptors_module, "CAPACITY", 2)  # every new set evicts every idle unpinned one
    del waits[:]
    graph.replay(((slot.alloc, inputs[0].alloc),))
    first = graph.slots[0].binding.sets
    graph.replay(((slot.alloc, inputs[1].alloc),))
    assert not waits and _in_flight(dev, graph) == 2
    cached = list(dev.queue.descriptors.sets.values())
    assert first and all(any(e is c for c in cached) and e[3] for e in first)
    graph.replay(((slot.alloc, inputs[2].alloc),))  # waits for the first, records its command buffer again
    assert len(waits) == 1
    assert all(not e[3] for e in first)  # unpinned: evictable once done
    np.testing.assert_array_equal(dev.download(out, np.float32, n), data[2] * 3 + 1)
    graph.destroy()


def test_failed_submit_with_a_replay_in_flight_leaves_the_graph_usable(dev):
    n = 256
    pos = Variable("pos", 0)
    x, graph = _doubling(dev, n, pos)
    dev.upload(x, np.ones(n, np.float32))
    dev.synchronize()
    graph.replay()
    faults.inject("submit", vk.VK_ERROR_OUT_OF_HOST_MEMORY)
    pos.value = 4
    with pytest.raises(DeviceError):
        graph.replay()
    assert _in_flight(dev, graph) == 1
    graph.replay()
    dev.synchronize()
    np.testing.assert_array_equal(dev.download(x, np.float32, n), np.full(n, (1 * 2 + 0) * 2 + 4, np.float32))
    graph.destroy()


def test_eager_work_on_a_graphs_buffers_keeps_its_sets_pinned(dev, monkeypatch):
    """Eager dispatches that bind the same buffers as a graph share its cached descriptor set: recording their
    use must not unpin it (the graph's command buffers bind it at every replay)."""
    n = 256
    k = dev.pipeline(AXPB)
    x, out = dev.alloc(4 * n), dev.alloc(4 * n)
    dev.upload(x, np.arange(n, dtype=np.float32))
    dev.queue.begin_capture()
    dev.dispatch(k, [x, out], (n // 64, 1, 1), (n, 2.0, 1.0))
    graph = dev.queue.end_capture()
    dev.dispatch(k, [x, out], (n // 64, 1, 1), (n, 5.0, 0.0))  # eager, the same set
    dev.synchronize()
    monkeypatch.setattr(descriptors_module, "CAPACITY", 2)  # every new set evicts every idle unpinned one
    other = dev.alloc(4 * n)
    dev.dispatch(k, [x, other], (n // 64, 1, 1), (n, 1.0, 0.0))  # a new set: eviction runs
    graph.replay()
    np.testing.assert_array_equal(dev.download(out, np.float32, n), np.arange(n, dtype=np.float32) * 2 + 1)
    entry = graph._home.prepared[0][3]
    assert any(e is entry for e in dev.queue.descriptors.sets.values())
    graph.destroy()

import gc

import numpy as np
import pytest

from vkgraph import Variable
from vkgraph.jit import jit
from vkgraph.realize import count_kernels
from vkgraph.runtime import CaptureError, get_device
from vkgraph.runtime.queue import MAX_IN_FLIGHT
from vkgraph.tensor import Tensor, custom

ADD_POS = """#version 450
// kernel: add_position
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) writeonly buffer Out { float o[]; };
layout(set = 0, binding = 1) readonly buffer X { float x[]; };
layout(push_constant) uniform Push { uint n; uint pos; } pc;
void main() { uint i = gl_GlobalInvocationID.x; if (i < pc.n) o[i] = x[i] * float(pc.pos + i % 3u); }
"""


def add_position(x: Tensor, pos: Variable | int) -> Tensor:
    """A template-style op whose push constant is a Variable: a replay uses its value at that call."""
    n = x.numel()

    def run(dev, out, ins):
        dev.dispatch(dev.pipeline(ADD_POS), [out, ins[0]], ((n + 63) // 64, 1, 1), (n, pos))

    return custom(run, [x], x.shape, x.dtype, key=(id(pos),), name="add_position")


def block(x, w, b):
    h = (x @ w + b).relu()
    return (h * h.sigmoid()).sum(axis=1, keepdim=True) / 3.0 + x


def test_replay_equals_eager_on_fresh_inputs():
    f = jit(block)
    rng = np.random.default_rng(0)
    w = Tensor(rng.standard_normal((16, 16)).astype(np.float32))
    b = Tensor(rng.standard_normal(16).astype(np.float32))
    outs = []
    for _ in range(5):
        x = rng.standard_normal((8, 16)).astype(np.float32)
        got = f(Tensor(x), w, b).numpy()
        want = block(Tensor(x), w, b).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        outs.append(got)
    assert len(f.cache) == 1
    assert not np.allclose(outs[-1], outs[-2])  # changing inputs changes outputs


def test_replay_is_one_submit_and_records_nothing():
    f = jit(block)
    rng = np.random.default_rng(1)
    w, b = Tensor(rng.standard_normal((16, 16)).astype(np.float32)), Tensor(np.zeros(16, np.float32))
    for _ in range(2):
        f(Tensor(rng.standard_normal((4, 16)).astype(np.float32)), w, b).realize()
    dev = get_device()
    x = Tensor(rng.standard_normal((4, 16)).astype(np.float32)).realize()
    dev.synchronize()
    submits, dispatches = dev.queue.stats["submits"], dev.queue.dispatch_count
    with count_kernels() as c:
        out = f(x, w, b)
    dev.synchronize()
    assert dev.queue.stats["submits"] == submits + 1 and dev.queue.dispatch_count == dispatches and c.count == 0
    assert out.shape == (4, 16)


def test_new_shape_captures_anew():
    f = jit(block)
    rng = np.random.default_rng(2)
    w, b = Tensor(rng.standard_normal((16, 16)).astype(np.float32)), Tensor(np.zeros(16, np.float32))
    for rows in (4, 4, 4, 9, 9, 9, 4):
        x = rng.standard_normal((rows, 16)).astype(np.float32)
        np.testing.assert_allclose(f(Tensor(x), w, b).numpy(), block(Tensor(x), w, b).numpy(), rtol=1e-5, atol=1e-5)
    assert len(f.cache) == 2


def test_variable_changes_per_call_without_recapture():
    pos = Variable("pos", 0)
    f = jit(lambda x: add_position(x * 2.0, pos) + 1.0)
    rng = np.random.default_rng(3)
    for p in [0, 1, 2, 7, 100, 4095, 3, 3]:
        pos.value = p
        x = rng.standard_normal(100).astype(np.float32)
        got = f(Tensor(x)).numpy()
        want = x * 2.0 * (p + np.arange(100) % 3) + 1.0
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert len(f.cache) == 1


def test_readback_inside_capture_raises_and_jit_stays_usable():
    calls = []

    @jit
    def g(x):
        calls.append(1)
        if len(calls) == 2:  # the capturing call
            return Tensor(float((x * 2).sum().item()))
        return x * 2

    x = Tensor(np.ones(4, np.float32))
    g(x).realize()
    with pytest.raises(CaptureError, match="numpy"):
        g(x)
    assert get_device().queue.capture is None
    np.testing.assert_array_equal(g(x).numpy(), np.full(4, 2, np.float32))  # captures now, cleanly
    np.testing.assert_array_equal(g(x).numpy(), np.full(4, 2, np.float32))


def test_copy_to_host_async_keeps_each_replay_s_output():
    """Each call's output, copied to the host asynchronously and fed to the next call, keeps its values after the
    next replay rewrites the graph's output buffer (an engine's decode ahead feeds tokens so)."""
    step = jit(lambda x: x * 2 + 1)
    y = Tensor(np.arange(8, dtype=np.float32))
    copies = []
    for _ in range(5):  # eager, capture, then replays reading the previous replay's output
        y = step(y)
        copies.append(y.copy_to_host_async())
    want = np.arange(8, dtype=np.float32)
    for c in copies:
        want = want * 2 + 1
        np.testing.assert_array_equal(c.result(), want)

    calls = []

    @jit
    def g(x):
        calls.append(1)
        y = x * 2
        if len(calls) == 2:  # the capturing call
            y.copy_to_host_async()
        return y

    x = Tensor(np.ones(4, np.float32))
    g(x).realize()
    with pytest.raises(CaptureError, match="inside a capture"):
        g(x)
    assert get_device().queue.capture is None


def test_exception_inside_capture_leaves_jit_usable():
    state = {"n": 0}

    @jit
    def h(x):
        state["n"] += 1
        if state["n"] == 2:
            raise RuntimeError("boom")
        return x + 1

    x = Tensor(np.zeros(3, np.float32))
    h(x).realize()
    with pytest.raises(RuntimeError, match="boom"):
        h(x)
    for _ in range(3):
        np.testing.assert_array_equal(h(x).numpy(), np.ones(3, np.float32))


def test_outputs_are_reused_between_calls():
    f = jit(lambda x: x * 3.0)
    a = Tensor(np.ones(4, np.float32))
    f(a).realize()
    first = f(a)  # captured
    kept = first.numpy()
    second = f(Tensor(np.full(4, 2.0, np.float32)))
    np.testing.assert_array_equal(second.numpy(), np.full(4, 6.0, np.float32))
    np.testing.assert_array_equal(kept, np.full(4, 3.0, np.float32))  # numpy() copies are yours
    np.testing.assert_array_equal(first.numpy(), np.full(4, 6.0, np.float32))  # the tensor shares the buffer


@pytest.mark.parametrize("n", [1000, 20000])  # a copied input, and one read in place (over BIND_BYTES)
def test_fresh_outputs_are_not_overwritten_by_later_calls(n):
    f = jit(lambda x, y: (x * 2.0 + 1.0, {"s": (x + y).sum()}), fresh_outputs=True)
    xs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(4)]
    y = Tensor(np.ones(n, np.float32))
    outs = [f(Tensor(x), y) for x in xs]  # eager, captured, replayed twice
    assert len(f.cache) == 1
    for x, (o, d) in zip(xs, outs):
        np.testing.assert_allclose(o.numpy(), x * 2 + 1, rtol=1e-6)
        np.testing.assert_allclose(d["s"].numpy(), (x + 1).sum(), rtol=1e-4)
    assert len({id(o.node.arg[0]) for o, _ in outs}) == 4  # four buffers


def test_no_leaks_over_10000_replays():
    pos = Variable("pos", 0)
    f = jit(lambda x: add_position(x + 1.0, pos).sum())
    x = Tensor(np.ones(64, np.float32)).realize()
    dev = get_device()
    for _ in range(3):
        f(x)
    dev.synchronize()

    def snapshot():
        gc.collect()  # objects of earlier tests must not be freed inside the measured interval
        dev.synchronize()
        s = dev.memory.pool.stats
        counts = dev.queue.object_counts()
        return (s.live_bytes, s.live_buffers, dev.memory.allocation_count,
                counts["descriptor_sets"], counts["descriptor_pools"], len(dev.pipelines.cached))

    start = snapshot()
    for i in range(10_000):
        pos.value = i % 5
        f(x)
    dev.synchronize()
    assert snapshot() == start
    # Command buffers are pooled per submission in flight: how many the pool reaches depends on how far
    # the host runs ahead of the GPU, but never past the in-flight bound.
    assert dev.queue.object_counts()["command_buffers"] <= MAX_IN_FLIGHT
    out = f(x)
    assert out.numpy() == pytest.approx(2.0 * sum(4 + i % 3 for i in range(64)))
    f.reset()


def test_variable_in_tensor_code_is_a_push_constant():
    """A Variable used as a scalar in Tensor ops is read at each dispatch: eager and replayed alike."""
    pos = Variable("pos", 3)
    x = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal((Tensor(x) * 2 + pos).numpy(), x * 2 + 3)
    f = jit(lambda t: (t * 2 + pos).sum() + Tensor(pos) * 10)
    for p in [3, 3, 3, 7, 100, -5, 0]:
        pos.value = p
        assert f(Tensor(x)).numpy() == pytest.approx((x * 2 + p).sum() + p * 10)
    assert len(f.cache) == 1


def test_two_variables_with_one_name_capture_separately():
    a, b = Variable("pos", 1), Variable("pos", 2)
    f = jit(lambda x, v: x + v)
    x = Tensor(np.zeros(4, np.float32))
    for _ in range(3):
        assert f(x, a).numpy()[0] == 1 and f(x, b).numpy()[0] == 2
    assert len(f.cache) == 2


def test_large_inputs_are_read_in_place_not_copied():
    """A replay binds a large argument's own buffer instead of copying it into the graph's slot; results follow
    the argument's current contents, new buffers rebind, and a small argument or the graph's own output passed
    back is still copied."""
    import vkgraph
    from vkgraph.jit import BIND_BYTES
    from vkgraph.runtime import get_device

    dev = get_device()
    rows = BIND_BYTES // (4 * 64)  # exactly the threshold

    @vkgraph.jit
    def f(x, b):
        return (x * 2 + b).sum(axis=1)

    rng = np.random.default_rng(3)
    small = rng.standard_normal(64).astype(np.float32)
    b = Tensor(small)
    xs = [rng.standard_normal((rows, 64)).astype(np.float32) for _ in range(3)]
    ts = [Tensor(x) for x in xs]
    for t in ts[:2]:
        f(t, b)  # eager, capture
    copies = 0
    for i in range(6):  # alternating buffers: bound again each time
        before = dev.queue.stats["copies"]
        out = f(ts[i % 3], b)  # the replay records its input copies before it returns
        # counted around the call alone: reading the result back is a copy too where memory is not host-visible
        copies += dev.queue.stats["copies"] - before
        np.testing.assert_allclose(out.numpy(), (xs[i % 3] * 2 + small).sum(axis=1), rtol=1e-5, atol=1e-5)
    assert copies == 6  # only the small argument was copied
    ts[0][0] = 5.0  # written in place: the next replay reads the new contents
    xs[0][0] = 5.0
    np.testing.assert_allclose(f(ts[0], b).numpy(), (xs[0] * 2 + small).sum(axis=1), rtol=1e-5, atol=1e-5)

    @vkgraph.jit
    def g(x):
        return x * 0.5 + 1

    y = Tensor(xs[1])
    want = xs[1]
    for _ in range(5):  # its own output passed back in: copied, not bound
        y = g(y)
        want = want * 0.5 + 1
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-6)

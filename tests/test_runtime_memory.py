import gc
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vkgraph.runtime import OutOfDeviceMemory, size_class
from vkgraph.runtime.memory import BufferPool


@pytest.mark.parametrize("n,cap", [(0, 256), (1, 256), (256, 256), (257, 512), (65536, 65536),
                                   (65537, 131072), (3 << 20, 4 << 20), (1 << 30, 1 << 30)])
def test_size_classes(n, cap):
    assert size_class(n) == cap


@given(st.integers(1, 1 << 34))
def test_size_class_properties(n):
    c = size_class(n)
    assert c >= n
    if n <= 65536:
        assert c % 256 == 0 and c - n < 256
    else:
        assert c & (c - 1) == 0 and c < 2 * n


def test_pool_reuses_buckets(dev):
    pool = dev.memory.pool
    a = dev.alloc(100_000)
    handle = a.alloc.handle
    a.release()
    hits = pool.stats.hits
    b = dev.alloc(120_000)  # same 128 KiB class
    assert b.alloc.handle == handle and pool.stats.hits == hits + 1
    assert b.size == 120_000 and b.capacity == 131072
    b.release()


def test_pool_hands_out_buffers_by_which_are_idle_not_by_return_order(dev):
    """A repeated sequence of allocations gets the same buffers whatever order they came back in, so the work it
    records binds the same buffers (and finds its descriptor sets cached) each time."""
    pool = BufferPool(dev.memory, "device")
    bufs = [pool.alloc(4096) for _ in range(3)]
    handles = [b.key[0] for b in bufs]
    got = []
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        for i in order:
            bufs[i].release()
        bufs = [pool.alloc(4096) for _ in range(3)]
        got.append([b.key[0] for b in bufs])
    assert got[0] == got[1] == got[2] and sorted(got[0]) == sorted(handles)
    for b in bufs:
        b.release()
    pool.trim(0)


def test_pool_cap_and_budget(dev):
    pool = BufferPool(dev.memory, "device")
    pool.bucket_cap = 2
    pool.stats.budget_bytes = 3 * 4096
    bufs = [pool.alloc(4096) for _ in range(5)]
    assert pool.stats.live_buffers == 5 and pool.stats.live_bytes == 5 * 4096
    for b in bufs:
        b.release()
    # the bucket keeps at most 2, the most recently returned ones
    assert pool.stats.idle_buffers == 2 and pool.stats.idle_bytes == 2 * 4096
    assert pool.stats.freed == 3 and pool.stats.live_bytes == 0
    assert {a.handle for a in pool.idle[4096]} == {b.key[0] for b in bufs[3:]}
    # a returned buffer makes room within the budget by freeing the least recently returned ones
    big = pool.alloc(8192)
    big.release()
    assert pool.stats.idle_bytes == 8192 + 4096 <= pool.stats.budget_bytes
    assert [a.handle for a in pool.idle[4096]] == [bufs[4].key[0]]
    huge = pool.alloc(4 * 4096)  # more than the whole budget: freed on return, the idle ones stay
    huge.release()
    assert pool.stats.idle_bytes == 8192 + 4096
    pool.trim(0)
    assert pool.stats.idle_bytes == 0 and pool.stats.idle_buffers == 0


def test_released_buffer_is_returned_on_gc(dev):
    pool = dev.memory.pool
    live = pool.stats.live_buffers
    b = dev.alloc(1000)
    assert pool.stats.live_buffers == live + 1
    del b
    assert pool.stats.live_buffers == live


@pytest.mark.parametrize("budget", [1 << 20, 0])  # kept idle, or freed (through the manager's books) on return
def test_a_buffer_collected_inside_a_held_section_is_returned_after_it(dev, budget):
    """A garbage collection runs finalizers at any allocation, also while this thread holds the pool's lock: a
    Buffer freed by it (in a reference cycle, as an exception's traceback makes) must neither wait for that lock
    nor edit the pool's books under their user; the pool's next allocation puts it back."""
    pool = BufferPool(dev.memory, "device")  # a pool of its own: a regression hangs it alone
    pool.stats.budget_bytes = budget

    def collect_inside_the_section():
        cycle = [pool.alloc(4096)]
        cycle.append(cycle)  # only the cyclic collector frees it
        del cycle
        with pool.lock:
            gc.collect()  # the finalizer runs here, on the thread inside the section
            inside.append((pool.stats.live_buffers, pool.stats.idle_buffers))

    inside: list[tuple[int, int]] = []
    t = threading.Thread(target=collect_inside_the_section, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the buffer's finalizer waited for the lock its own thread held"
    assert inside == [(1, 0)]  # the books untouched inside the section
    pool.alloc(256).release()
    assert pool.stats.live_buffers == 0 and pool.stats.idle_buffers == (2 if budget else 0)
    assert pool.stats.freed == (0 if budget else 2)
    pool.trim(0)


DTYPES = [np.float32, np.float16, np.float64, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
          np.int64, np.uint64, np.bool_]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 255, 257, 4099, 65537])
def test_round_trip_dtypes(dev, dtype, n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 100).astype(dtype)
    b = dev.alloc(x.nbytes)
    dev.upload(b, x)
    y = dev.download(b, dtype, x.shape)
    assert y.dtype == x.dtype and np.array_equal(x, y)


def test_round_trip_offsets_and_bytes(dev):
    b = dev.alloc(1)
    dev.upload(b, b"\x7f")
    assert dev.download(b, np.uint8, 1)[0] == 0x7F
    c = dev.alloc(1000)
    dev.upload(c, np.arange(100, dtype=np.uint8), offset=900)
    assert np.array_equal(dev.download(c, np.uint8, 100, offset=900), np.arange(100, dtype=np.uint8))
    with pytest.raises(ValueError, match="overflows"):
        dev.upload(c, np.zeros(200, np.uint8), offset=900)
    with pytest.raises(ValueError, match="overflows"):
        dev.download(c, np.float32, 251)


def test_download_async_gives_the_values_when_called(dev):
    x = np.arange(1000, dtype=np.float32)
    b = dev.alloc(x.nbytes + 64)
    dev.upload(b, x)
    pending = dev.download_async(b, np.float32, (10, 100))
    dev.upload(b, np.zeros(1000, np.float32))  # work after the call rewrites the buffer
    assert np.array_equal(pending.result(), x.reshape(10, 100))
    assert not dev.download(b, np.float32, 1000).any()
    with pytest.raises(ValueError, match="download_async"):
        dev.download_async(b, np.float32, (1017,))


def test_round_trip_over_storage_range(dev):
    # more than 128 MiB (lavapipe's binding range) and an odd size; fixed, so a 4 GiB range does not make it slow
    n = (129 << 20) + 3
    x = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
    b = dev.alloc(n)
    dev.upload(b, x)
    y = dev.download(b, np.uint8, n)
    assert np.array_equal(x, y)
    b.release()


def test_out_of_memory_then_usable(dev):
    heap = max(s for s, _ in dev.info.heaps)
    with pytest.raises(OutOfDeviceMemory) as e:
        dev.alloc(heap + 1 if heap + 1 <= dev.info.max_buffer_size else dev.info.max_buffer_size + 1)
    assert e.value.nbytes > 0
    b = dev.alloc(64)
    dev.upload(b, np.arange(16, dtype=np.float32))
    assert dev.download(b, np.float32, 16)[5] == 5


def test_bad_sizes(dev):
    with pytest.raises(ValueError):
        dev.alloc(-1)
    with pytest.raises(ValueError):
        dev.alloc(1.5)


def test_allocation_size_limit(dev):
    if dev.info.max_allocation_size >= dev.info.max_buffer_size:
        pytest.skip("this device allows one allocation as large as its largest buffer")
    with pytest.raises(OutOfDeviceMemory, match="maxMemoryAllocationSize"):
        dev.alloc(dev.info.max_allocation_size + 1)
    dev.alloc(1024).release()

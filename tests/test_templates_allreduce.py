"""The all-reduce template over host memory two logical devices import (the tensor-parallel peer path)."""

import mmap

import numpy as np
import pytest
import test_templates_common as common

from vkgraph.runtime import get_device, open_device
from vkgraph.templates import allreduce as ar

pytestmark = pytest.mark.skipif(not get_device().info.host_import_alignment,
                                reason="the device cannot import host memory")
# NVIDIA's driver (580, one H200) ran two logical devices' kernels one after the other: rank 0's wait gave up
# before rank 1's kernel started. Two GPUs are the peer path's real case; CPU drivers must always succeed.
SERIAL_DEVICES = "this driver does not run two logical devices' kernels at once, so a wait between them gives up"


def skip_if_the_wait_gave_up(flag: int) -> None:
    if flag and get_device().info.device_type != "cpu":
        pytest.skip(SERIAL_DEVICES)


@pytest.fixture(scope="module")
def pair():
    return get_device(), open_device()


def shared(world: int, max_values: int) -> tuple[mmap.mmap, np.ndarray]:
    align = get_device().info.host_import_alignment
    nbytes = -(-ar.shared_bytes(world, max_values) // align) * align
    mm = mmap.mmap(-1, nbytes)
    return mm, np.frombuffer(mm, np.uint8)


def test_two_devices_sum_their_parts_call_after_call(pair):
    max_values = 3000
    mm, host = shared(2, max_values)
    cells = [d.import_host(host) for d in pair]
    counters = [common.upload(d, np.zeros(ar.counter_words(max_values), np.uint32)) for d in pair]
    rng = np.random.default_rng(0)
    for call, n in enumerate((2500, 7, 2500, 1024)):  # sizes across workgroups; both slot sets, twice
        parts = [rng.standard_normal(n).astype(np.float32) for _ in pair]
        since = common.snapshot()
        outs = []
        for rank, dev in enumerate(pair):  # rank 0 waits inside its kernel until rank 1's values arrive
            out = dev.alloc(n * 4)
            ar.all_reduce(dev, common.upload(dev, parts[rank]), cells[rank], counters[rank], n, rank=rank, world=2,
                          site=call, max_values=max_values, out=out)
            dev.flush()
            outs.append(out)
        got = [dev.download(o, np.float32, n) for dev, o in zip(pair, outs)]
        skip_if_the_wait_gave_up(int(host.view(np.uint32)[0]))
        assert np.array_equal(got[0], got[1])  # the same bits on both
        common.check(got[0], parts[0].astype(np.float64) + parts[1], since, tol=1e-7)
    assert host.view(np.uint32)[0] == 0
    for d in pair:
        d.synchronize()
    del cells, host  # released after their last use: the buffers, then the memory under them
    mm.close()


def test_a_rank_that_never_posts_gives_nan_and_the_error_flag(pair):
    mm, host = shared(2, 64)
    dev = pair[0]
    cells = dev.import_host(host)
    counters = common.upload(dev, np.zeros(1, np.uint32))
    out = ar.all_reduce(dev, common.upload(dev, np.ones(64, np.float32)), cells, counters, 64, rank=0, world=2,
                        site=0, max_values=64, out=dev.alloc(256), spin_limit=1000)
    assert np.isnan(dev.download(out, np.float32, 64)).all()
    assert host.view(np.uint32)[0] == 1
    dev.synchronize()
    del cells, host
    mm.close()
    with pytest.raises(ValueError, match="holds parts of up to"):
        ar.all_reduce(dev, out, out, out, 65, rank=0, world=2, site=0, max_values=64, out=out)


def test_host_memory_is_shared_by_the_devices_that_import_it(pair):
    mm, host = shared(1, 512)
    bufs = [d.import_host(host) for d in pair]
    host.view(np.float32)[:4] = [1, 2, 3, 4]
    assert pair[1].download(bufs[1], np.float32, 4).tolist() == [1, 2, 3, 4]
    pair[0].upload(bufs[0], np.array([9, 8], np.float32))
    pair[0].synchronize()
    assert host.view(np.float32)[:2].tolist() == [9, 8]
    with pytest.raises(ValueError, match="multiples of"):
        pair[0].import_host(host[1:])
    del bufs, host
    mm.close()

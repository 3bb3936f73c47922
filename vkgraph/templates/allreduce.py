"""The all-reduce over host memory several devices import (glsl/allreduce.comp; vkgraph/parallel.py uses it).

Layout of the shared memory, in 8-byte cells: cell 0 holds the error flag (its first word), then two slot sets of
`world * max_values` cells each. Consecutive calls must use different sets (`site % 2`, with an even number of
all-reduces per step): a rank can be at most one call ahead of another, so two sets never mix calls in flight.
Each device also keeps its own counters (one uint per workgroup, zero at first), which number its calls.
"""

from __future__ import annotations

from typing import Any

from ..runtime import Device
from . import catalog
from .common import check_buffer

WG = 256
PER = 4
VALUES_PER_GROUP = WG * PER
SPIN_LIMIT = 1 << 20  # loads of a cell before giving up: about a second on a GPU (host memory over PCIe), well
# under the fence timeout (VKGRAPH_TIMEOUT_S), so a step whose wait gave up can run again through the host
# CPU drivers: llvmpipe ends a shader's loops after 65535 iterations in all, so each waits longer (BURN sin()s)
CPU_SPIN_LIMIT = 60000
CPU_BURN = 32


def shared_bytes(world: int, max_values: int) -> int:
    """Bytes of the shared memory for `world` ranks and parts of up to `max_values` float32."""
    return 8 * (1 + 2 * world * max_values)


def counter_words(max_values: int) -> int:
    return -(-max_values // VALUES_PER_GROUP)


def all_reduce(dev: Device, part: Any, cells: Any, counters: Any, n: int, *, rank: int, world: int, site: int,
               max_values: int, out: Any, spin_limit: int | None = None) -> Any:
    """out = the sum over ranks of each rank's `part` (n float32), in rank order; every rank makes the same calls
    with its own part, its import of the shared `cells` and its own `counters`. Records the dispatch."""
    if not 0 < n <= max_values:
        raise ValueError(f"all-reduce of {n} values; the shared memory holds parts of up to {max_values}")
    check_buffer("part", part, n * 4)
    check_buffer("out", out, n * 4)
    check_buffer("cells", cells, shared_bytes(world, max_values))
    check_buffer("counters", counters, counter_words(max_values) * 4)
    slots = 1 + (site % 2) * world * max_values
    cpu = dev.info.device_type == "cpu"
    if spin_limit is None:
        spin_limit = CPU_SPIN_LIMIT if cpu else SPIN_LIMIT
    kern = catalog.compile(dev, "allreduce", spec={"WG": WG, "PER": PER, "BURN": CPU_BURN if cpu else 0})
    catalog.dispatch(dev, kern, [part, cells, out, counters], (-(-n // VALUES_PER_GROUP), 1, 1),
                     push={"n": n, "rank": rank, "world": world, "slots": slots, "spin_limit": spin_limit})
    return out

"""Tensor parallelism over several Vulkan devices of one host: one engine, N devices, one thread per rank.

    model = TensorParallelModel(load_weights(path), world=2, num_blocks=512)
    engine = Engine(model, tokenizer)     # as with a LlamaModel

Each rank has its own `Device` (its VkDevice, queue, memory, compiled programs), its shard of the weights and its
heads' KV cache (`nn/shard.py`), and its own worker thread, which routes all its work to its device with
`runtime.use_device`: ranks record and submit in parallel, and each device runs its part of a step while the others
run theirs. Rank 0 works on the default device (`get_device()`), where the engine's own tensors (step inputs,
sampling) live, and returns the logits.

The all-reduce after each row-parallel product takes one of two paths (`all_reduce`, VKGRAPH_TP_ALLREDUCE):
- host (`HostAllReduce`): each rank waits for its partial sum, reads it back, and once every rank has posted its
  part, uploads the others' parts and adds them on its own device, in rank order (so every rank holds the same
  bits), fused by the compiler into the kernel that reads the sum next. Ranks capture the pieces between
  all-reduces (ShardModel).
- peer (`PeerAllReduce`): host memory every device imports, and a template inside each device's graph that
  posts its part there and waits for the others' (docs/tensor_parallel.md): no host in the loop, a rank's whole
  step is one captured graph. Steps of more rows than it holds, and a step in which a wait timed out, run on the
  host path.

Devices (`tensor_parallel_devices`): the physical devices VKGRAPH_TP_DEVICES names (a comma list of indices or
names), else as many physical devices of the default device's name as there are, else logical devices on the
default device's physical device (two VkDevices on one GPU: the same code path, for tests, not for speed).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import mmap
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Any, TypeVar

import numpy as np

from . import graph
from .dtype import dtypes
from .flags import flag
from .graph import BufferRef
from .jit import jit
from .nn import llama
from .nn.layers import StepInputs
from .nn.shard import RandomWeights, ShardModel, check_shardable, shard_weights, step_from_host, step_to_host
from .nn.weights import ModelWeights
from .runtime import Device, UnsupportedFeature, get_device, open_device, use_device
from .templates import allreduce
from .tensor import Tensor, custom

T = TypeVar("T")


def tensor_parallel_devices(world: int) -> list[Device]:
    """`world` devices for the ranks, the default device first (module doc says which)."""
    if world < 1:
        raise ValueError(f"tensor parallel needs at least one rank, got {world}")
    first = get_device()
    names = [n for n in flag("VKGRAPH_TP_DEVICES").split(",") if n.strip()]
    if names:
        if len(names) != world:
            raise ValueError(f"VKGRAPH_TP_DEVICES names {len(names)} devices for {world} ranks")
        return [first] + [open_device(n.strip()) for n in names[1:]]
    physical = first.physical_devices()
    mine = next(i for i, (_, me) in enumerate(physical) if me)
    peers = [str(i) for i, (name, me) in enumerate(physical) if name == physical[mine][0] and not me]
    if len(peers) >= world - 1:
        return [first] + [open_device(p) for p in peers[:world - 1]]
    return [first] + [open_device(str(mine)) for _ in range(world - 1)]


@dataclasses.dataclass
class StepTimes:
    """Seconds of one forward pass, as rank 0 saw it: waiting for its device's work and the read-back of its part
    before each all-reduce (compute; the read-back of a few KiB is a small share of it), waiting for the other
    ranks' parts and uploading them (all-reduce), and the rest (host: building graphs or replaying captures,
    recording, submitting)."""

    wall: float = 0.0
    compute: float = 0.0
    all_reduce: float = 0.0
    reduces: int = 0

    @property
    def host(self) -> float:
        return self.wall - self.compute - self.all_reduce


class HostAllReduce:
    """The all-reduce of `world` ranks through host memory (module doc). `reduce(rank, x)` is called by each
    rank's thread in the same order; parts are double-buffered, since a rank may post its next part before a
    slower rank has read this one (never two ahead: the barrier holds it)."""

    def __init__(self, devices: list[Device], timeout_s: float | None = None) -> None:
        self.devices = devices
        self.world = len(devices)
        self.barrier = threading.Barrier(self.world, timeout=timeout_s)
        self.parts: list[list[np.ndarray | None]] = [[None] * self.world for _ in range(2)]
        self.count = [0] * self.world
        self.times = [StepTimes() for _ in range(self.world)]

    def start(self) -> None:
        """Before a step: counters and times afresh (every rank idle)."""
        self.count = [0] * self.world
        self.times = [StepTimes() for _ in range(self.world)]
        self.barrier.reset()

    def reduce(self, rank: int, x: Tensor) -> Tensor:
        """The sum over ranks of each rank's `x` (same shape and dtype), on this rank's device."""
        t = self.times[rank]
        x = x.realize()  # recorded and submitted: host time
        slot = self.parts[self.count[rank] % 2]
        self.count[rank] += 1
        t0 = time.perf_counter()
        slot[rank] = x.numpy()  # one wait: for the device's work and the read-back recorded after it
        t1 = time.perf_counter()
        self.barrier.wait()
        total = None
        for j in range(self.world):  # in rank order on every rank: the same sum, bit for bit
            part = x if j == rank else Tensor(slot[j])
            total = part if total is None else total + part
        t.compute += t1 - t0
        t.all_reduce += time.perf_counter() - t1
        t.reduces += 1
        return total

    def abort(self) -> None:
        """Release ranks waiting for one that failed (they raise BrokenBarrierError)."""
        self.barrier.abort()


class PeerAllReduce:
    """The all-reduce with no host in the loop: host memory that every device imports (VK_EXT_external_memory_host)
    and a template (templates/allreduce.py) in which each device posts its part there and waits for the others'
    (module doc). It is a node of the graph like any template, so a rank's whole step is one captured graph.
    Parts of up to `max_values` float32; `failed()` tells that a wait timed out since `clear()`."""

    def __init__(self, devices: list[Device], max_values: int) -> None:
        align = min(d.info.host_import_alignment for d in devices)
        if not align:
            raise UnsupportedFeature("the peer all-reduce needs VK_EXT_external_memory_host on every device")
        align = max(d.info.host_import_alignment for d in devices)
        self.world, self.max_values, self.fallbacks = len(devices), max_values, 0
        self.spin_limit: int | None = None  # loads before a wait gives up (None: the template's default)
        nbytes = -(-allreduce.shared_bytes(self.world, max_values) // align) * align
        self._memory = mmap.mmap(-1, nbytes)  # page-aligned, zeroed: no call numbered yet
        self.host = np.frombuffer(self._memory, np.uint8)
        self.cells: list[Tensor] = []
        self.counters: list[Tensor] = []
        for d in devices:
            with use_device(d):
                ref = BufferRef(dtypes.uint32, nbytes // 4, d.import_host(self.host))
                self.cells.append(Tensor(graph.buffer(ref, 0, dtypes.uint32, (nbytes // 4,))))
                self.counters.append(Tensor(np.zeros(allreduce.counter_words(max_values), np.uint32)))

    def reduce(self, rank: int, x: Tensor, site: int) -> Tensor:
        """The sum over ranks of each rank's x (float32), as a node of rank's graph; `site` numbers the all-reduces of
        a step alike on every rank (consecutive ones alternate slot sets, so a step has an even number)."""
        n, world, max_values, spins = math.prod(x.shape), self.world, self.max_values, self.spin_limit

        def run(dev: Any, out: Any, ins: list[Any]) -> None:
            allreduce.all_reduce(dev, ins[0], ins[1], ins[2], n, rank=rank, world=world, site=site,
                                 max_values=max_values, out=out, spin_limit=spins)

        return custom(run, [x.float(), self.cells[rank], self.counters[rank]], x.shape, dtypes.float32,
                      key=("allreduce", id(self), rank, site, n, spins), name="allreduce")

    def failed(self) -> bool:
        return bool(self.host[:4].view(np.uint32)[0])

    def clear(self) -> None:
        self.host[:4].view(np.uint32)[0] = 0


class TensorParallelModel:
    """A Llama-family model split over `world` devices (module doc); called like `LlamaModel` (tokens, step,
    logit_rows) and returning rank 0's logits. `last_times` holds the split of the last call (StepTimes).

    `weights`: loaded weights (each rank cuts its shard), or RandomWeights (each rank makes its shard on its
    device). The engine calls a step as it is (`capturable` is False): the ranks' threads capture. With the peer
    all-reduce each rank captures its whole step (`peer_rows` token rows at most; `peer.fallbacks` counts steps
    run again through the host); with the host all-reduce, and `capture` (the default), the pieces between
    all-reduces (ShardModel), per input shapes."""

    capturable = False

    def __init__(self, weights: ModelWeights | RandomWeights, world: int, *, num_blocks: int, block_size: int = 16,
                 kv_dtype: str = "f16", max_blocks_per_seq: int | None = None, float_dtype: str = "float16",
                 devices: list[Device] | None = None, capture: bool = True, all_reduce: str = "auto",
                 peer_rows: int = 64) -> None:
        check_shardable(weights.config, world)
        self.config = weights.config
        self.world = world
        self.devices = devices if devices is not None else tensor_parallel_devices(world)
        if len(self.devices) != world:
            raise ValueError(f"{len(self.devices)} devices for {world} ranks")
        self.workers = [ThreadPoolExecutor(1, f"vkgraph-tp{r}") for r in range(world)]
        self.comm = HostAllReduce(self.devices)
        self.last_times = StepTimes()
        if all_reduce == "auto":
            all_reduce = flag("VKGRAPH_TP_ALLREDUCE")
        if all_reduce not in ("host", "peer"):
            raise ValueError(f"all_reduce must be host or peer, got {all_reduce!r}")
        self.peer = PeerAllReduce(self.devices, peer_rows * weights.config.dim) if all_reduce == "peer" else None
        self._whole = [jit(partial(self._whole_step, r), max_entries=16) for r in range(world)]

        def build(rank: int) -> ShardModel:
            shard = weights.shard(rank, world) if isinstance(weights, RandomWeights) else shard_weights(weights, rank,
                                                                                                        world)
            return ShardModel(shard, lead=rank == 0, num_blocks=num_blocks,
                              block_size=block_size, kv_dtype=kv_dtype, max_blocks_per_seq=max_blocks_per_seq,
                              float_dtype=float_dtype, capture=capture)

        self.shards: list[ShardModel] = self._on_ranks(build)
        lead = self.shards[0]
        self.block_size, self.max_blocks_per_seq, self.max_context = (lead.block_size, lead.max_blocks_per_seq,
                                                                      lead.max_context)
        self.caches = lead.caches  # the engine reads the pool's size here; every rank's pool has as many blocks

    def _on_ranks(self, fn: Callable[[int], T]) -> list[T]:
        """fn(rank) on every rank's thread with its device current; the first error (after all have stopped)."""

        def run(rank: int) -> T:
            try:
                with use_device(self.devices[rank]):
                    return fn(rank)
            except BaseException:
                self.comm.abort()  # ranks waiting in an all-reduce for this one give up
                raise

        futures: list[Future] = [w.submit(run, r) for r, w in enumerate(self.workers)]
        try:
            wait(futures)
        except BaseException:  # Ctrl-C here: stop the ranks at their next all-reduce, and let them finish first
            self.comm.abort()
            wait(futures)
            raise
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as e:  # noqa: BLE001 (reraised below: the root cause, not a broken barrier)
                errors.append(e)
        if errors:
            real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            raise (real or errors)[0]
        return results

    def __call__(self, tokens: Tensor, step: StepInputs, logit_rows: Tensor | None = None) -> Tensor:
        """Logits (rows, vocab) float32 on the default device (rank 0's)."""
        host = step_to_host(step)
        ids, rows = tokens.numpy(), None if logit_rows is None else logit_rows.numpy()
        self.comm.start()
        t0 = time.perf_counter()

        if self.peer is not None and ids.size * self.config.dim <= self.peer.max_values:
            logits = self._peer_step(ids, host, rows, t0)
            if logits is not None:
                return logits
            self.comm.start()  # a wait timed out (module doc): the step again, through the host
            t0 = time.perf_counter()

        def forward(rank: int) -> Tensor:
            return self.shards[rank](Tensor(ids), step_from_host(host), lambda x: self.comm.reduce(rank, x),
                                     None if rows is None else Tensor(rows)).realize()

        logits = self._on_ranks(forward)[0]
        times = self.comm.times[0]
        times.wall = time.perf_counter() - t0
        self.last_times = times
        return logits

    def _peer_step(self, ids: np.ndarray, host: dict[str, Any], rows: np.ndarray | None, t0: float) -> Tensor | None:
        """The step with PeerAllReduce, one captured graph per device; None if an all-reduce's wait timed out."""
        peer = self.peer
        times = StepTimes()

        def forward(rank: int) -> Tensor:
            args = [Tensor(v) if isinstance(v, np.ndarray) else v for v in host.values()]
            out = self._whole[rank](Tensor(ids), None if rows is None else Tensor(rows), *args).realize()
            t = time.perf_counter()
            self.devices[rank].synchronize()  # the step's one wait: then the error word is final
            if rank == 0:
                times.compute = time.perf_counter() - t
            return out

        logits = self._on_ranks(forward)[0]
        times.wall = time.perf_counter() - t0
        self.last_times = times
        if peer.failed():
            peer.clear()
            peer.fallbacks += 1
            return None
        return logits

    def _whole_step(self, rank: int, ids: Tensor, rows: Tensor | None, *step: Any) -> Tensor:
        sites = itertools.count()  # the all-reduces of a step, numbered alike on every rank
        st = StepInputs(*step)
        return self.shards[rank](ids, st, lambda x: self.peer.reduce(rank, x, next(sites)), rows)

    def close(self) -> None:
        """Stop the ranks' threads (the devices stay open; the process's exit closes them)."""
        for w in self.workers:
            w.shutdown()


def build_model(weights: ModelWeights, tensor_parallel: int = 1, **kw: Any) -> llama.LlamaModel | TensorParallelModel:
    """The model on one device (a LlamaModel), or split over `tensor_parallel` devices; kw as LlamaModel takes."""
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be at least 1, got {tensor_parallel}")
    if tensor_parallel == 1:
        return llama.LlamaModel(weights, **kw)
    return TensorParallelModel(weights, tensor_parallel, **kw)

"""Tensor parallel across processes and hosts: the ranks as Ray actors, the all-reduce by torch.distributed over
gloo (a host-side reduction), the same shards and forward as on one host (`nn/shard.py`).

    model = RayTensorParallelModel("model.gguf", world=2, num_blocks=512)   # ray.init() first, or address=
    engine = Engine(model, tokenizer)                                         # called like a LlamaModel

Each actor is a process with its own Vulkan device (VKGRAPH_DEVICE from `devices[rank]` where given), loads the
model file itself (no weights travel through Ray) and keeps its shard, its heads' KV cache and its captured pieces.
A step sends the step's inputs (a few int32 arrays) to every actor; each runs its part, all-reducing its partial
sums with the others through gloo (TCP between hosts, between processes on one), and rank 0 returns the logits,
which the caller's process uploads to its own device (where the engine samples). Ray schedules the actors
(`actor_options`, e.g. {"num_gpus": 1} on a cluster with GPUs registered); `pip install 'vkgraph[distributed]'`.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np

from .nn.layers import StepInputs
from .nn.shard import ShardModel, shard_weights, step_from_host, step_to_host
from .parallel import StepTimes
from .tensor import Tensor


class _Pool:
    """What the engine reads of a model's KV cache: the number of blocks (every rank's pool has as many)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks


class Rank:
    """One rank's process (run as a Ray actor): its shard on its device and its side of the gloo group."""

    def __init__(self, path: str, rank: int, world: int, model_kw: dict[str, Any], quantize: str | None = None,
                 device: str | None = None, capture: bool = True) -> None:
        if device is not None:
            os.environ["VKGRAPH_DEVICE"] = device
        import torch.distributed as dist

        from .nn.weights import load_weights

        self.rank, self.world, self.dist = rank, world, dist
        weights = load_weights(path, quantize=quantize, progress=False)
        self.config = weights.config
        self.model = ShardModel(shard_weights(weights, rank, world), lead=rank == 0, capture=capture, **model_kw)
        self.times = StepTimes()

    def describe(self) -> tuple[Any, int, int, int]:
        """The whole model's config, and the KV layout: block size, blocks per sequence, context."""
        return self.config, self.model.block_size, self.model.max_blocks_per_seq, self.model.max_context

    def endpoint(self) -> str:
        """Where the gloo group meets (asked of rank 0): this node's address and a free port on it."""
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"

    def join(self, init_method: str) -> None:
        self.dist.init_process_group("gloo", init_method=init_method, rank=self.rank, world_size=self.world)

    def _all_reduce(self, x: Tensor) -> Tensor:
        import torch

        t0 = time.perf_counter()
        part = x.numpy()  # waits for this device's work
        t1 = time.perf_counter()
        total = torch.from_numpy(part)
        self.dist.all_reduce(total)  # every rank receives the same bits
        out = Tensor(total.numpy())
        self.times.compute += t1 - t0
        self.times.all_reduce += time.perf_counter() - t1
        self.times.reduces += 1
        return out

    def forward(self, ids: np.ndarray, step: dict[str, Any], rows: np.ndarray | None) -> np.ndarray | None:
        """Rank 0: logits (rows, vocab) float32; other ranks: None."""
        self.times = StepTimes()
        t = time.perf_counter()
        out = self.model(Tensor(ids), step_from_host(step), self._all_reduce, None if rows is None else Tensor(rows))
        logits = out.numpy() if self.model.lead else None
        self.times.wall = time.perf_counter() - t
        return logits

    def last_times(self) -> StepTimes:
        return self.times

    def close(self) -> None:
        self.dist.destroy_process_group()


class RayTensorParallelModel:
    """A model split over `world` Ray actors (module doc); called like `LlamaModel` (tokens, step, logit_rows),
    returning rank 0's logits on the caller's device. `config` is read from the file here (no weights loaded)."""

    capturable = False

    def __init__(self, path: str | Path, world: int, *, num_blocks: int, block_size: int = 16,
                 kv_dtype: str = "f16", max_blocks_per_seq: int | None = None, float_dtype: str = "float16",
                 quantize: str | None = None, devices: list[str] | None = None, capture: bool = True,
                 actor_options: dict[str, Any] | None = None) -> None:
        import ray

        if world < 1:
            raise ValueError(f"tensor parallel needs at least one rank, got {world}")
        if devices is not None and len(devices) != world:
            raise ValueError(f"{len(devices)} devices for {world} ranks")
        if not ray.is_initialized():
            raise RuntimeError("call ray.init() (or ray.init(address=...)) before making a RayTensorParallelModel")
        kw = dict(num_blocks=num_blocks, block_size=block_size, kv_dtype=kv_dtype,
                  max_blocks_per_seq=max_blocks_per_seq, float_dtype=float_dtype)
        actor = ray.remote(Rank).options(**(actor_options or {}))
        self.ray = ray
        self.world = world
        self.ranks = [actor.remote(str(path), r, world, kw, quantize, None if devices is None else devices[r], capture)
                      for r in range(world)]
        try:  # a shard that cannot be made (heads that do not divide, ...) raises here, from its actor
            self.config, self.block_size, self.max_blocks_per_seq, self.max_context = ray.get(
                self.ranks[0].describe.remote())
            init = ray.get(self.ranks[0].endpoint.remote())
            ray.get([r.join.remote(init) for r in self.ranks])
        except BaseException:
            for r in self.ranks:
                ray.kill(r)
            raise
        self.caches = [_Pool(num_blocks)]
        self.last_times = StepTimes()

    def __call__(self, tokens: Tensor, step: StepInputs, logit_rows: Tensor | None = None) -> Tensor:
        """Logits (rows, vocab) float32 on this process's device."""
        t = time.perf_counter()
        host = step_to_host(step)
        ids, rows = tokens.numpy(), None if logit_rows is None else logit_rows.numpy()
        outs = self.ray.get([r.forward.remote(ids, host, rows) for r in self.ranks])
        logits = Tensor(outs[0])
        times = self.ray.get(self.ranks[0].last_times.remote())
        times.wall = time.perf_counter() - t  # the caller's view: the actors' split plus Ray's round trip as host
        self.last_times = times
        return logits

    def close(self) -> None:
        """End the actors (and their gloo group)."""
        self.ray.get([r.close.remote() for r in self.ranks])
        for r in self.ranks:
            self.ray.kill(r)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]

"""Tensor parallel: batch-1 decode on one device against N (vkgraph.parallel), the split of an N-device step into
compute, all-reduce and host time, the all-reduce alone, and NCCL's all-reduce of the same bytes as reference.

    python benchmarks/bench_tp.py [--shape llama3-8b|small] [--format Q8_0] [--world 2] [--decode-steps 32]
                                  [--nccl]

Weights are random valid blocks of the format (bench_llm.random_model). Devices: VKGRAPH_TP_DEVICES, else every
physical device of the first one's name, else logical devices on one (correct, not fast: lavapipe here).
The step split is rank 0's (StepTimes): compute = waiting for its device (and the read-back of its partial sum)
before each all-reduce; all-reduce = waiting for every rank's part, uploading the others'; host = the rest of the
step (replaying the captured pieces, the engine's own work). --nccl times torch.distributed's all_reduce (NCCL, one
process per GPU) of the same float32 bytes, where PyTorch sees as many CUDA GPUs.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from bench_llm import SHAPES, random_model, weight_bytes

from vkgraph.nn.config import ModelConfig
from vkgraph.nn.engine import Engine
from vkgraph.nn.llama import LlamaModel
from vkgraph.nn.shard import RandomWeights
from vkgraph.parallel import HostAllReduce, TensorParallelModel, tensor_parallel_devices
from vkgraph.quant import QUANTIZERS
from vkgraph.runtime import get_device, use_device
from vkgraph.tensor import Tensor

BLOCK = 16
PROMPT = 16


# a 100B-class dense shape (about 101e9 parameters: 202 GB as float16, more than one H200's 141 GB)
TP_SHAPES = {**SHAPES, "100b": dict(vocab_size=128256, dim=12288, n_layers=64, n_heads=96, n_kv_heads=8,
                                    ffn_dim=32768, head_dim=128, rope_theta=500000.0)}


def param_count(cfg: ModelConfig) -> int:
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = cfg.dim * (2 * q + 2 * kv) + 3 * cfg.dim * cfg.ffn_dim
    return cfg.n_layers * per_layer + 2 * cfg.vocab_size * cfg.dim


def decode_steps(model, steps: int, vocab: int) -> tuple[float, list]:
    """Median seconds of a batch-1 decode step through the engine, and the model's step splits (TP only)."""
    engine = Engine(model, max_batch=1)
    engine.add_request([(7 * j) % vocab for j in range(PROMPT)], max_tokens=steps + 8, stop_token_ids=[])
    engine.step()  # prefill
    for _ in range(4):  # eager, then capture, then replays
        engine.step()
    get_device().synchronize()
    times, splits = [], []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        if hasattr(model, "last_times"):
            splits.append(model.last_times)
    while engine.has_work():
        engine.step()
    return statistics.median(times), splits


def median_split_ms(splits: list) -> dict[str, float]:
    """The median of each part of the model's step splits (StepTimes), in milliseconds."""
    return {k: statistics.median(getattr(s, k) for s in splits) * 1e3
            for k in ("wall", "compute", "all_reduce", "host")}


def random_parts(devices: list, numel: int) -> list[Tensor]:
    """Each rank's part for an all-reduce alone: the same `numel` random float32, realized on its device."""
    parts = []
    for d in devices:
        with use_device(d):
            parts.append(Tensor(np.random.default_rng(0).standard_normal(numel, dtype=np.float32)).realize())
    return parts


def all_reduce_alone(devices: list, numel: int, reps: int = 50) -> float:
    """Median seconds of one HostAllReduce of `numel` float32 per rank (each rank's part realized first)."""
    comm = HostAllReduce(devices)
    parts = random_parts(devices, numel)
    pool = ThreadPoolExecutor(len(devices))

    def one(rank: int) -> None:
        with use_device(devices[rank]):
            comm.reduce(rank, parts[rank]).realize()
            devices[rank].synchronize()

    times = []
    for i in range(reps + 5):
        comm.start()
        t = time.perf_counter()
        list(pool.map(one, range(len(devices))))
        if i >= 5:
            times.append(time.perf_counter() - t)
    pool.shutdown()
    return statistics.median(times)


def peer_all_reduce_alone(devices: list, numel: int, chain: int = 64, reps: int = 20) -> float:
    """Median seconds of one PeerAllReduce of `numel` float32 per rank: `chain` of them back to back (each
    reducing the last one's result), captured on every device and replayed, wall time over `chain`."""
    from vkgraph.jit import jit
    from vkgraph.parallel import PeerAllReduce

    peer = PeerAllReduce(devices, numel)
    pool = ThreadPoolExecutor(len(devices))

    def chained(rank: int, x: Tensor) -> Tensor:
        for site in range(chain):
            x = peer.reduce(rank, x, site) * 0.5
        return x

    steps = [jit(lambda x, r=r: chained(r, x)) for r in range(len(devices))]
    parts = random_parts(devices, numel)

    def one(rank: int) -> None:
        with use_device(devices[rank]):
            steps[rank](parts[rank]).realize()
            devices[rank].synchronize()

    times = []
    for i in range(reps + 3):  # eager, capture, then replays
        t = time.perf_counter()
        list(pool.map(one, range(len(devices))))
        if i >= 3:
            times.append(time.perf_counter() - t)
    pool.shutdown()
    if peer.failed():
        print(f"  (peer all-reduce alone: a wait timed out; {peer.fallbacks} fallbacks)")
    return statistics.median(times) / chain


def _nccl_worker(rank: int, world: int, numel: int, reps: int, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    x = torch.randn(numel, device="cuda", dtype=torch.float32)
    for _ in range(20):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dist.all_reduce(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def nccl_all_reduce(world: int, numel: int, reps: int = 200) -> float | None:
    """Median seconds of NCCL's all_reduce of `numel` float32 over `world` GPUs (one process each), or None."""
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError:
        return None
    if not torch.cuda.is_available() or torch.cuda.device_count() < world or not torch.distributed.is_nccl_available():
        return None
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_nccl_worker, args=(r, world, numel, reps, out)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    return result


def bench_ray(cfg: ModelConfig, fmt: str, world: int, steps: int, kw: dict) -> None:
    """Batch-1 decode with the ranks as Ray actors on this host (vkgraph.distributed), all-reducing over gloo."""
    import tempfile

    import ray

    from vkgraph.distributed import RayTensorParallelModel
    from vkgraph.nn.tiny_model import write_model

    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(tmp, cfg, gguf_types=(fmt,), safetensors=False, random_quants=fmt not in QUANTIZERS)[fmt]
        ray.init(include_dashboard=False, log_to_driver=False)
        try:
            model = RayTensorParallelModel(path, world, devices=[str(i) for i in range(world)]
                                           if _physical_count() >= world else None, **kw)
            per_step, splits = decode_steps(model, steps, cfg.vocab_size)
            med = median_split_ms(splits)
            print(f"{world} Ray actors (gloo): {per_step * 1e3:8.2f} ms/step  {1 / per_step:7.1f} tok/s")
            print(f"  model step (rank 0's actor, median ms): wall {med['wall']:.2f} = compute {med['compute']:.2f} + "
                  f"all-reduce {med['all_reduce']:.2f} + host and Ray's round trip {med['host']:.2f}")
            model.close()
        finally:
            ray.shutdown()


def _physical_count() -> int:
    return len(get_device().physical_devices())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(TP_SHAPES), default="llama3-8b")
    ap.add_argument("--format", default="Q8_0")
    ap.add_argument("--random-on-device", action="store_true",
                    help="float16 random weights made by each device for its shard (nn.shard.RandomWeights), never on "
                         "the host: for a model larger than one GPU (--shape 100b); --format is then F16")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--all-reduce", default="host,peer", help="comma list of the paths to measure: host, peer")
    ap.add_argument("--nccl", action="store_true", help="time NCCL's all-reduce of the same bytes (PyTorch, CUDA)")
    ap.add_argument("--ray", action="store_true", help="also the ranks as Ray actors, one process each on this host "
                                                      "(the model written to a temporary GGUF file first)")
    a = ap.parse_args()
    cfg = ModelConfig(arch="llama", max_seq_len=256, **TP_SHAPES[a.shape])
    kw = dict(num_blocks=-(-(PROMPT + a.decode_steps + 16) // BLOCK) + 2, max_blocks_per_seq=8)
    devices = tensor_parallel_devices(a.world)
    physical = [next(i for i, (_, me) in enumerate(d.physical_devices()) if me) for d in devices]
    shared = len(set(physical)) < len(devices)
    print(f"devices: {', '.join(f'{i}: {d.info.name}' for i, d in zip(physical, devices))}"
          + (" (logical devices sharing a physical one: not a speed figure)" if shared else ""))
    if a.random_on_device:
        a.format = "F16"
        w = RandomWeights(cfg)
        size = param_count(cfg) * 2
        heap = max(size for size, local in get_device().info.heaps if local)
        print(f"{a.shape} F16 made on the devices: {size / 2**30:.1f} GiB of weights; one device's heap "
              f"{heap / 2**30:.1f} GiB")
    else:
        t = time.perf_counter()
        w = random_model(cfg, a.format)
        size = weight_bytes(w)
        heap = None
        print(f"{a.shape} {a.format}: random weights in {time.perf_counter() - t:.1f} s")

    one = None
    if heap is None or size < 0.9 * heap:
        t = time.perf_counter()
        single = LlamaModel(w.shard(0, 1) if a.random_on_device else w, **kw)
        built = time.perf_counter() - t
        one, _ = decode_steps(single, a.decode_steps, cfg.vocab_size)
        del single
        gc.collect()
        print(f"1 device : {one * 1e3:8.2f} ms/step  {1 / one:7.1f} tok/s  (built in {built:.1f} s)")
    else:
        print("1 device : does not fit")
    for mode in a.all_reduce.split(","):
        try:
            t = time.perf_counter()
            tp = TensorParallelModel(w, a.world, devices=devices, all_reduce=mode, **kw)
            built = time.perf_counter() - t
            many, splits = decode_steps(tp, a.decode_steps, cfg.vocab_size)
        except Exception as e:  # noqa: BLE001 (a path a driver refuses is reported, the others still run)
            print(f"{a.world} devices, all-reduce {mode}: failed: {type(e).__name__}: {e}")
            continue
        med = median_split_ms(splits)
        versus = f"{one / many:.2f}x one device" if one else "one device cannot hold it"
        print(f"{a.world} devices, all-reduce {mode}: {many * 1e3:8.2f} ms/step  {1 / many:7.1f} tok/s  "
              f"({versus}; built in {built:.1f} s)")
        if mode == "host":
            print(f"  model step (rank 0, median ms): wall {med['wall']:.2f} = compute {med['compute']:.2f} + "
                  f"all-reduce {med['all_reduce']:.2f} + host {med['host']:.2f}; {splits[-1].reduces} all-reduces")
        else:
            print(f"  model step (rank 0, median ms): wall {med['wall']:.2f} = waiting for the device (compute with "
                  f"{2 * cfg.n_layers} all-reduces inside) {med['compute']:.2f} + host {med['host']:.2f}; "
                  f"{tp.peer.fallbacks} steps fell back to the host path")
        tp.close()
        del tp  # its weights go before the next path's are made (a 100B-class model fits once, not twice)
        gc.collect()
    numel = cfg.dim  # batch 1: one row of the residual stream, float32
    ar = all_reduce_alone(devices, numel)
    print(f"host all-reduce alone, {numel * 4} bytes per rank: {ar * 1e6:.1f} us; x {2 * cfg.n_layers} per step = "
          f"{ar * 2 * cfg.n_layers * 1e3:.2f} ms")
    if "peer" in a.all_reduce.split(","):
        try:
            pr = peer_all_reduce_alone(devices, numel)
            print(f"peer all-reduce alone, {numel * 4} bytes per rank (64 in one captured graph): {pr * 1e6:.1f} us; "
                  f"x {2 * cfg.n_layers} per step = {pr * 2 * cfg.n_layers * 1e3:.2f} ms")
        except Exception as e:  # noqa: BLE001 (reported; the NCCL reference still runs)
            print(f"peer all-reduce alone: failed: {type(e).__name__}: {e}")
    if a.ray:
        bench_ray(cfg, a.format, a.world, a.decode_steps, kw)
    if a.nccl:
        ref = nccl_all_reduce(a.world, numel)
        print("NCCL all_reduce, same bytes: " + ("n/a (needs PyTorch with NCCL and as many CUDA GPUs)" if ref is None
                                                 else f"{ref * 1e6:.1f} us; x {2 * cfg.n_layers} per step = "
                                                      f"{ref * 2 * cfg.n_layers * 1e3:.2f} ms"))


if __name__ == "__main__":
    main()

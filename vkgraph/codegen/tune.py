"""Tile configurations of the cooperative-matrix matmul, measured per device and shape class, kept on disk.

`search` times every configuration of `matmul_coop.CONFIGS` that fits the device on one product of a shape
class and records the fastest in `<VKGRAPH_CACHE_DIR>/matmul/<device>.json`; `lookup` is what lowering asks.
A class is the product's compute type and its sizes rounded to powers of two (matmul_coop.shape_class), so a
handful of searches covers a model. Lowering reads the file once per process and device; a configuration
found later applies to products lowered after it (tune before the first product of the class runs).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..flags import flag
from . import matmul_coop

if TYPE_CHECKING:
    from .lower import Limits

_TABLES: dict[str, dict[str, list[int]]] = {}


def path(device: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", device) or "device"
    return Path(flag("VKGRAPH_CACHE_DIR")) / "matmul" / f"{safe}.json"


def _table(device: str) -> dict[str, list[int]]:
    table = _TABLES.get(device)
    if table is None:
        try:
            raw = json.loads(path(device).read_text())
            table = {k: v for k, v in raw.items() if isinstance(v, list) and len(v) == 5}
        except (OSError, ValueError, AttributeError):
            table = {}  # none yet, or unreadable: the defaults serve
        _TABLES[device] = table
    return table


def lookup(lim: Limits, cls: str) -> matmul_coop.Config | None:
    """The measured configuration of shape class `cls` on lim's device, or None."""
    if not flag("VKGRAPH_MATMUL_TUNE"):
        return None
    v = _table(lim.device).get(cls)
    return matmul_coop.Config(*v) if v else None


def record(lim: Limits, cls: str, cfg: matmul_coop.Config) -> None:
    """Remember cfg for cls on lim's device, in memory and on disk (written whole, then renamed)."""
    table = dict(_table(lim.device))
    table[cls] = [cfg.bm, cfg.bn, cfg.bk, cfg.wm, cfg.wn]
    _TABLES[lim.device] = table
    p = path(lim.device)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, p)


def search(m: int, n: int, k: int, dtype: Any = "float16", batch: int = 1, reps: int = 10,
           verbose: bool = False) -> tuple[matmul_coop.Config, dict[matmul_coop.Config, float]]:
    """Time each fitting configuration on a (batch, m, k) @ (batch, k, n) product of random `dtype` values and
    record the fastest for the product's shape class. Returns it and every configuration's microseconds."""
    import numpy as np

    from .. import graph, realize
    from ..dtype import to_dtype
    from ..runtime import get_device
    from ..schedule import Kernel
    from ..view import ShapeTracker

    d = to_dtype(dtype)
    dev = get_device()
    lim = realize.limits()
    rng = np.random.default_rng(0)
    lead = (batch,) if batch > 1 else ()
    srcs = [graph.buffer(realize.upload(rng.standard_normal(lead + s, dtype=np.float32), d), 0, d, lead + s)
            for s in ((m, k), (k, n))]
    mm = graph.matmul(srcs[0], srcs[1], d)
    compute = matmul_coop.compute_type(mm, lim)
    if compute is None:
        raise ValueError(f"{dev.info.name} has no cooperative matrices for a {d} product")
    frag = matmul_coop.fragment(lim, matmul_coop.operand_type(compute))
    out = realize.allocate(mm.dtype, mm.numel)
    kern = Kernel(mm, out, ShapeTracker.contiguous(mm.shape))
    times: dict[matmul_coop.Config, float] = {}
    for cfg in matmul_coop.CONFIGS:
        if not cfg.fits(frag, lim):
            continue
        (prog,) = matmul_coop.lower_coop(kern, mm, lim, {}, cfg, compute).programs
        pipe = dev.kernel(prog.src, name=prog.name)
        bufs = [ref.buf if nb is None else ref.buf.view(off, nb) for ref, off, nb in prog.bindings]
        push = dict(prog.push) or None
        for _ in range(5):  # compile, then let the clocks rise
            dev.dispatch(pipe, bufs, prog.groups, push)
        dev.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            dev.dispatch(pipe, bufs, prog.groups, push)
        dev.synchronize()
        times[cfg] = (time.perf_counter() - t) / reps * 1e6
        if verbose:
            flops = 2 * batch * m * n * k / times[cfg] / 1e6
            print(f"  {cfg}: {times[cfg]:.1f} us, {flops:.1f} TFLOP/s", flush=True)
    best = min(times, key=times.get)
    record(lim, matmul_coop.shape_class(m, n, k, batch, compute), best)
    return best, times

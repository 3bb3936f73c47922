"""Measured tile configurations of the cooperative-matrix matmul, kept on disk per device.

A file `<cache dir>/matmul/<device>.json` maps shape classes (matmul_coop.shape_class: the compute type and the
sizes rounded to powers of two) to [BM, BN, BK, WM, WN, stages, PF, KS] (matmul_coop.Config; tables written before
PF and KS existed hold six or seven numbers, the missing ones read as 1); the quantized prefill products'
classes add templates.matmul_quant.Prefill's ORDER, FORM and WSTAGES (older tables fewer: the missing ones take their
defaults). `realize` loads the device's table into `Limits.tuned` (unless VKGRAPH_MATMUL_TUNE=0), so lowering
keys on it; `benchmarks/bench_matmul.py --tune` measures the configurations of `matmul_coop.CONFIGS` on the device
and records the fastest.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from . import matmul_coop


def path(cache_dir: str | Path, device: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", device) or "device"
    return Path(cache_dir) / "matmul" / f"{safe}.json"


def load(p: Path) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The table at p as Limits.tuned holds it; empty when there is none or it cannot be read."""
    try:
        raw = json.loads(p.read_text())
        return tuple(sorted((str(k), tuple(int(x) for x in v) + (1,) * (8 - len(v))) for k, v in raw.items()
                            if isinstance(v, list) and 6 <= len(v) <= 11))
    except (OSError, ValueError, AttributeError, TypeError):
        return ()


def record(p: Path, cls: str, cfg: matmul_coop.Config) -> None:
    """Remember cfg for shape class cls in the table at p (written whole, then renamed)."""
    table = {k: list(v) for k, v in load(p)}
    table[cls] = cfg.key()
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, p)

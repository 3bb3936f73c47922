"""Every environment variable vkgraph reads, in one registry.

`python -m vkgraph.flags` lists them. Reading a flag goes through `flag(name)` so that the registry stays the
single source of truth; an unknown ``VKGRAPH_*`` variable in the environment gives a warning once.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Flag:
    name: str
    type: type
    default: Any
    meaning: str
    choices: tuple[str, ...] = ()  # the values a str flag may take (empty: any)


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "vkgraph")


FLAGS: dict[str, Flag] = {
    f.name: f
    for f in [
        Flag("VKGRAPH_DEVICE", str, "", "physical device to use: an index, or a substring of its name"),
        Flag("VKGRAPH_TP_DEVICES", str, "", "tensor parallel: the ranks' physical devices, a comma list of indices "
             "or names (default: every device like the first, else logical devices on it)"),
        Flag("VKGRAPH_TP_ALLREDUCE", str, "host", "tensor parallel all-reduce: host (staged through the host) or "
             "peer (host memory every device imports, no host in the loop; docs/tensor_parallel.md)"),
        Flag("VKGRAPH_POOL_BUDGET_MB", int, 1024, "idle bytes the buffer pool may keep, in MiB"),
        Flag("VKGRAPH_POOL_BUCKET_CAP", int, 16, "idle buffers the pool keeps per size class"),
        Flag("VKGRAPH_CACHE_DIR", str, _default_cache_dir(), "folder of the SPIR-V and pipeline caches"),
        Flag("VKGRAPH_DISK_CACHE", int, 1, "0 disables the on-disk SPIR-V and pipeline caches"),
        Flag("VKGRAPH_COMPILER", str, "auto", "GLSL compiler: auto, glslang (in process) or glslc"),
        Flag("VKGRAPH_PROFILE", int, 0, "1 records GPU timestamps per dispatch; table at exit, Chrome trace"),
        Flag("VKGRAPH_PROFILE_FILE", str, "vkgraph.trace.json", "where VKGRAPH_PROFILE writes the Chrome trace"),
        Flag("VKGRAPH_TIMEOUT_S", float, 60.0, "seconds to wait on a fence before raising a timeout"),
        Flag("VKGRAPH_IEEE", int, 1, "1 keeps generated float arithmetic IEEE as numpy's (precise temporaries, "
             "hidden special constants, the device's float controls); 0 lets the driver fold and fuse it"),
        Flag("VKGRAPH_DEBUG", int, 0, "1 prints the schedule, 3 also prints generated GLSL"),
        Flag("VKGRAPH_VALIDATION", int, 0, "1 enables the Khronos validation layer; messages raise errors; "
             "2 also prints each message to stderr as it arrives (for crashes inside the driver)"),
        Flag("VKGRAPH_PIPELINE_STATS", int, 0, "1 asks the driver to keep what it compiled for each kernel "
             "(registers, shared memory, ... : Device.kernel_statistics, benchmarks/kernel_stats.py) where it offers "
             "VK_KHR_pipeline_executable_properties"),
        Flag("VKGRAPH_MAX_RECORDED", int, 256, "dispatches recorded before a command buffer is submitted"),
        Flag("VKGRAPH_INT_DOT", str, "auto", "quantized matvecs over int8 activations: auto (where the device "
             "accelerates int8 dot products), 1 (wherever it has them) or 0 (never)", ("auto", "0", "1")),
        Flag("VKGRAPH_MATVEC_LAUNCH", str, "auto", "quantized matvecs: subgroup (groups of a subgroup's lanes own "
             "a few rows, several units in flight each), workgroup (a workgroup owns a few rows, shared-memory "
             "reduction: the earlier launch) or auto (subgroup where the device has subgroup shuffles, for more "
             "than one activation row)", ("auto", "subgroup", "workgroup")),
        Flag("VKGRAPH_MATVEC_SG", str, "", "subgroup-rows launch parameters replacing matvec.SG_PREFERRED and "
             "SG_INT_DOT_PREFERRED, e.g. '1:128,2,4;32:256,4,1,16;8:128,4,2,0,1,1' (activation rows bucket: "
             "workgroup size, rows per group, units in flight[, group width (0: derived)[, fold, stage]])"),
        Flag("VKGRAPH_NORM_PROLOGUE", int, 1, "the most activation rows (0 never) of a decode step whose RMSNorm "
             "before an integer-path matvec of up to matvec.NORM_MAX_ROWS rows (q/k/v) runs inside it (the matvec "
             "normalizes and quantizes its input rows itself, profiled as matvec_<format>+norm); elsewhere the "
             "norm's own kernel (rmsnorm_q8) writes the int8 rows. 1: faster on an H200 at one row, slower at 8"),
        Flag("VKGRAPH_NORM_PROLOGUE_SG", str, "", "launch parameters replacing matvec.NORM_PREFERRED, e.g. "
             "'1:256,2,4,32,1;8:512,1,2,16,0' (activation rows bucket: workgroup size, rows per group, units in "
             "flight, group width (0: derived), fold)"),
        Flag("VKGRAPH_MATMUL_F32_COMPUTE", str, "", "float32 matrix products with 16-bit operands on cooperative "
             "matrices (float16 or bfloat16; rounds the operands, accumulates in float32); empty: exact float32"),
        Flag("VKGRAPH_MATMUL_TUNE", int, 1, "0 ignores tuned matmul tile configurations (codegen.tune) and uses "
             "the default ones"),
        Flag("VKGRAPH_DECODE_FUSION", int, 1, "0 builds model layers unfused: norms write floats that the matvec "
             "quantizes, keys are rotated and copied by generated kernels before the KV write (to measure the "
             "fused templates against)"),
        Flag("VKGRAPH_GLU_EPILOGUE", int, 1, "the most activation rows (up to a matvec call's) for which the MLP's "
             "gate/up matvec writes the down product's int8 activations act(gate) * up in its epilogue (two kernels "
             "per MLP); more rows, or 0, run the gated unit as a kernel of its own, glu_q8. 1: measured faster on "
             "the H200 at one row, slower at 8 (docs/kernels.md)"),
        Flag("VKGRAPH_QUANT_COOP", int, 1, "0 runs quantized prefill products through a float16 copy of the weights "
             "and the generated matmul instead of the kernel that dequantizes into shared memory (to measure them)"),
        Flag("VKGRAPH_DECODE_MM_ROWS", int, 16, "from this many activation rows (up to 63) quantized products run "
             "templates.matmul_quant's small-row tiles on cooperative matrices, int8 activations staged as "
             "float16, instead of the matvec, where the device has them (16: where they won on an H200); 0 keeps "
             "the matvec"),
        Flag("VKGRAPH_FLASH_PREFILL", str, "auto", "prefill attention on cooperative matrices "
             "(templates.flash_prefill: keys and values rounded to float16, the rest about float32) where the device "
             "has them: auto where the keys and values go to a float16 cache (as it holds them), 1 for any cache, 0 "
             "never (the float32 template)", ("auto", "0", "1")),
        Flag("VKGRAPH_DECODE_AHEAD", int, 1, "1: an engine submits the next decode step before the host has read the "
             "tokens of the one in flight (their slots reserved, the tokens fed on the device), where the batch "
             "stays the same and no request needs its tokens on the host first; 0: one step at a time"),
        Flag("VKGRAPH_PREFILL_CAPTURE_ROWS", int, 512, "an engine's prefills of up to this many token rows replay "
             "a forward pass captured per shape (vkgraph.jit); each capture keeps its intermediates; 0: never"),
        Flag("VKGRAPH_FUZZ_EXAMPLES", int, 10000, "examples per long fuzz test (pytest -m slow)"),
    ]
}


def flag(name: str) -> Any:
    """The value of a registered flag, read from the environment now, converted to its type."""
    spec = FLAGS[name]
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return spec.default
    if spec.choices and raw not in spec.choices:
        raise ValueError(f"{name} must be {', '.join(spec.choices[:-1])} or {spec.choices[-1]}, got {raw!r}")
    try:
        return spec.type(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r}: expected {spec.type.__name__} ({spec.meaning})") from e


def warn_unknown(environ: dict[str, str] | None = None) -> list[str]:
    """Warn about VKGRAPH_* variables that no flag declares; returns their names."""
    env = os.environ if environ is None else environ
    unknown = sorted(k for k in env if k.startswith("VKGRAPH_") and k not in FLAGS)
    for name in unknown:
        warnings.warn(f"unknown environment variable {name}; `python -m vkgraph.flags` lists the known ones",
                      stacklevel=2)
    return unknown


def table() -> str:
    rows = [("name", "type", "default", "now", "meaning")]
    for f in FLAGS.values():
        rows.append((f.name, f.type.__name__, str(f.default), str(flag(f.name)), f.meaning))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4] for r in rows)


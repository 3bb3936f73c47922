"""The small templates of a decoder step: RMSNorm and the MLP's gated unit (each also straight into the integer
matvec's int8 activations), softmax, argmax (greedy sampling), SwiGLU and RoPE."""

from __future__ import annotations

from typing import Any

from ..runtime import Device
from . import catalog
from .common import check_buffer, grid_2d, pow2_ceil, pow2_floor
from .matvec import Q8Acts

ROW_WG = 128
# rmsnorm_q8: vec4s of the row each invocation holds (the workgroup is as wide as that needs, within MAX_ROW_WG).
# On the H200 (benchmarks/bench_decode_small.py --wg-sweep) one per invocation was the fastest at every n and row
# count timed: n = 4096, 1 row, 4.35 us per call in 1024 invocations against 5.89 in 256 holding 4 each.
ROW_VPI = 1
MAX_ROW_WG = 1024
# glu_q8: invocations per workgroup, one vec4 of h each (32 to 256 timed within 0.5 us of each other on the H200)
GLU_WG = 64


def _row_wg(dev: Device, n: int) -> int:
    return max(1, min(ROW_WG, pow2_floor(n), pow2_floor(dev.info.max_workgroup_invocations)))


def _shuffles(dev: Device, wg: int) -> bool:
    """Whether a launch of `wg` invocations may exchange values through subgroup shuffles (-DSUBGROUP_SHUFFLE in
    row_reduce.glsl and q8_lanes.glsl): the device shuffles within subgroups, its subgroups have at least 8
    lanes (a block's 8 invocations), and `wg` is a whole number of its largest ones, so every subgroup is full."""
    info = dev.info
    return "shuffle" in info.subgroup_ops and info.min_subgroup_size >= 8 and wg % info.max_subgroup_size == 0


def _lanes_defines(dev: Device, wg: int) -> dict[str, int]:
    return {"SUBGROUP_SHUFFLE": 1} if _shuffles(dev, wg) else {}


def _check_wg(dev: Device, wg: int) -> None:
    if wg < 8 or wg & (wg - 1) or wg > dev.info.max_workgroup_invocations:
        raise ValueError(f"wg must be a power of two from 8 to the device's {dev.info.max_workgroup_invocations} "
                         f"invocations, got {wg}")


def _check_rows(dev: Device, rows: int, n: int) -> None:
    if rows < 1 or n < 1:
        raise ValueError(f"rows and n must be positive, got {rows} x {n}")
    if rows > dev.info.max_workgroup_count[0]:
        raise ValueError(f"{rows} rows exceed the device's {dev.info.max_workgroup_count[0]} workgroups per axis")


def rmsnorm(dev: Device, x: Any, weight: Any, rows: int, n: int, *, eps: float = 1e-6, out: Any | None = None) -> Any:
    """y = x / sqrt(mean(x^2) + eps) * weight per row of x [rows, n]; weight [n]."""
    _check_rows(dev, rows, n)
    check_buffer("x", x, rows * n * 4)
    check_buffer("weight", weight, n * 4)
    out = out if out is not None else dev.alloc(rows * n * 4)
    check_buffer("out", out, rows * n * 4)
    wg = _row_wg(dev, n)
    kern = catalog.compile(dev, "rmsnorm", spec={"WG": wg}, defines=_lanes_defines(dev, wg))
    catalog.dispatch(dev, kern, [x, weight, out], (rows, 1, 1), push={"n": n, "eps": eps})
    return out


def rmsnorm_q8(dev: Device, x: Any, weight: Any, rows: int, n: int, *, eps: float = 1e-6,
               out: Any | None = None, wg: int | None = None) -> Any:
    """RMSNorm of x [rows, n] (as `rmsnorm`) written int8-quantized for the integer dot-product matvec, in one
    kernel: returns the buffer `out` (or a new one) holding matvec.Q8Acts.layout(rows, n); n % 32 == 0. The
    values equal quantize_activations of rmsnorm's output up to a rounding step where the two kernels' float
    results differ in the last bit. `wg`: invocations per row (a power of two, 8 or more; each holds
    ceil(n / 4 / wg) vec4s of the row); None: as many as hold ROW_VPI vec4s each, within MAX_ROW_WG."""
    _check_rows(dev, rows, n)
    if n % 32:
        raise ValueError(f"rmsnorm_q8 quantizes blocks of 32: n % 32 == 0 needed, got n={n}")
    check_buffer("x", x, rows * n * 4)
    check_buffer("weight", weight, n * 4)
    nbytes = Q8Acts.layout(rows, n)[0]
    out = out if out is not None else dev.alloc(nbytes)
    acts = Q8Acts.in_buffer(out, rows, n)
    if wg is None:
        # at least one full subgroup, so that small rows keep the shuffle path
        wg = min(max(pow2_ceil(-(-n // (4 * ROW_VPI))), dev.info.max_subgroup_size, 8), MAX_ROW_WG,
                 pow2_floor(dev.info.max_workgroup_invocations))
    _check_wg(dev, wg)
    kern = catalog.compile(dev, "rmsnorm_q8", spec={"WG": wg, "VPI": -(-n // (4 * wg))},
                           defines=_lanes_defines(dev, wg))
    catalog.dispatch(dev, kern, [x, weight, acts.xq, acts.xd, acts.xs], (rows, 1, 1), push={"n": n, "eps": eps})
    return out


def glu_q8(dev: Device, gu: Any, rows: int, f: int, *, gelu_tanh: bool = False, out: Any | None = None,
           wg: int = GLU_WG) -> Any:
    """act(gate) * up from the rows of a stacked gate/up product gu [rows, 2f] (act: SiLU, or the tanh GELU),
    written int8-quantized for the integer dot-product matvec in one kernel: returns the buffer `out` (or a
    new one) holding matvec.Q8Acts.layout(rows, f); f % 32 == 0. `wg`: invocations per workgroup (a power of
    two, 8 or more), one per vec4 of the output."""
    if rows < 1 or f < 1 or f % 32:
        raise ValueError(f"glu_q8 quantizes blocks of 32: rows >= 1 and f % 32 == 0 needed, got {rows} x {f}")
    check_buffer("gu", gu, rows * 2 * f * 4)
    _check_wg(dev, wg)
    out = out if out is not None else dev.alloc(Q8Acts.layout(rows, f)[0])
    acts = Q8Acts.in_buffer(out, rows, f)
    n4 = rows * f // 4
    groups = grid_2d(dev, -(-n4 // wg))
    defines = _lanes_defines(dev, wg) | ({"GELU_TANH": 1} if gelu_tanh else {})
    kern = catalog.compile(dev, "glu_q8", spec={"WG": wg}, defines=defines or None)
    catalog.dispatch(dev, kern, [gu, acts.xq, acts.xd, acts.xs], groups,
                     push={"n4": n4, "f": f, "groups_x": groups[0]})
    return out


def softmax(dev: Device, x: Any, rows: int, n: int, *, scale: float = 1.0, out: Any | None = None) -> Any:
    """softmax(x * scale) along each row of x [rows, n]."""
    _check_rows(dev, rows, n)
    check_buffer("x", x, rows * n * 4)
    out = out if out is not None else dev.alloc(rows * n * 4)
    check_buffer("out", out, rows * n * 4)
    wg = _row_wg(dev, n)
    kern = catalog.compile(dev, "softmax", spec={"WG": wg}, defines=_lanes_defines(dev, wg))
    catalog.dispatch(dev, kern, [x, out], (rows, 1, 1), push={"n": n, "scale": scale})
    return out


def argmax(dev: Device, x: Any, rows: int, n: int, *, out: Any | None = None) -> Any:
    """int32 index of the largest value of each row of x [rows, n] (first on ties; NaN never chosen)."""
    _check_rows(dev, rows, n)
    check_buffer("x", x, rows * n * 4)
    out = out if out is not None else dev.alloc(rows * 4)
    check_buffer("out", out, rows * 4)
    kern = catalog.compile(dev, "argmax", spec={"WG": _row_wg(dev, n)})
    catalog.dispatch(dev, kern, [x, out], (rows, 1, 1), push={"n": n})
    return out


def swiglu(dev: Device, gate: Any, up: Any, n: int, *, out: Any | None = None) -> Any:
    """silu(gate) * up over n float32 values."""
    for name, buf in (("gate", gate), ("up", up)):
        check_buffer(name, buf, n * 4)
    out = out if out is not None else dev.alloc(n * 4)
    check_buffer("out", out, n * 4)
    wg = 256
    groups = grid_2d(dev, -(-n // wg))
    catalog.dispatch(dev, catalog.compile(dev, "swiglu", spec={"WG": wg}), [gate, up, out], groups,
                     push={"n": n, "groups_x": groups[0]})
    return out


def rope(dev: Device, x: Any, positions: Any, tokens: int, heads: int, head_size: int, *, base: float = 10000.0,
         neox: bool = False) -> Any:
    """Rotate x [tokens, heads, head_size] float32 in place by positions [tokens] (int32); returns x."""
    if head_size % 2:
        raise ValueError(f"head_size must be even, got {head_size}")
    check_buffer("x", x, tokens * heads * head_size * 4)
    check_buffer("positions", positions, tokens * 4)
    wg = 256
    groups = grid_2d(dev, -(-(tokens * heads * head_size // 2) // wg))
    kern = catalog.compile(dev, "rope", spec={"WG": wg}, defines={"NEOX": 1} if neox else None)
    catalog.dispatch(dev, kern, [x, positions], groups,
                     push={"tokens": tokens, "heads": heads, "head_size": head_size, "base": base,
                           "groups_x": groups[0]})
    return x

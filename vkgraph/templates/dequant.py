"""Weights in the matvec layout dequantized to a float16 [N, K] matrix, for the generated matmul.

The matvec templates read each weight byte once per call, which is what a decode step wants; with many
activation rows (a prefill) a matmul reads the weights once per tile instead, so the weights are expanded to
float16 first (`vkgraph/templates/glsl/dequant_f16.comp`). The values are bit-exact to
`vkgraph.quant.dequantize(qt).astype(np.float16)`.
"""

from __future__ import annotations

from typing import Any

from ..quant import BLOCK_PAD, SPLIT
from ..runtime import Device
from . import catalog
from .common import check_binding_range, check_buffer, grid_2d, pow2_floor
from .matvec import UNIT_ELEMS, DeviceWeights

WG = 256


def dequantize_f16(dev: Device, weights: DeviceWeights, out: Any | None = None) -> Any:
    """W [N, K] as float16, row-major (N * K * 2 bytes) into `out` or a new buffer; returns it.

    Records the dispatch; does not wait. Raises ValueError when the weights are inconsistent with their format
    or the output exceeds what the device binds as one storage buffer."""
    if not isinstance(weights, DeviceWeights):
        raise TypeError(f"weights: expected DeviceWeights (from upload_weights), got {type(weights).__name__}")
    fmt = weights.format.name
    if fmt not in UNIT_ELEMS:
        raise ValueError(f"dequantize_f16: unsupported format {fmt!r}; known: {sorted(UNIT_ELEMS)}")
    n, k = weights.shape
    if n < 1 or k < 1:
        raise ValueError(f"dequantize_f16: empty weight matrix {weights.shape}")
    unit = UNIT_ELEMS[fmt]
    if k % unit:
        raise ValueError(f"dequantize_f16: {fmt} needs K % {unit} == 0, got K={k}")
    nbytes = n * k * 2
    check_binding_range(dev, f"dequantized {fmt} weights {weights.shape}", nbytes)
    split = SPLIT[fmt]  # bytes of each block moved to the scales buffer (vkgraph.quant.kernel_layout)
    if (weights.scales is not None) != (split is not None):
        raise ValueError(f"dequantize_f16: {fmt} weights {'need' if split else 'have no'} a separate scales buffer")
    blocks = k // weights.format.block_size
    moved = split[1] if split else 0
    row_bytes = weights.format.row_bytes(k) + blocks * (BLOCK_PAD.get(fmt, 0) - moved)
    if weights.w_stride * 16 < row_bytes or (weights.scales is not None and weights.s_stride * 2 < blocks * moved):
        raise ValueError(f"dequantize_f16: strides ({weights.w_stride} words, {weights.s_stride} scales) are too "
                         f"small for {fmt} rows of K={k}")
    check_buffer("weights.body", weights.body, n * weights.w_stride * 16)
    if weights.scales is not None:
        check_buffer("weights.scales", weights.scales, n * weights.s_stride * 2)
    if out is None:
        out = dev.alloc(nbytes)
    check_buffer("out", out, nbytes)
    wg = min(WG, pow2_floor(dev.info.max_workgroup_invocations))
    kern = catalog.compile(dev, "dequant_f16", spec={"WG": wg}, defines={f"W_{fmt}": 1})
    groups = grid_2d(dev, -(-n * (k // unit) // wg))
    w = weights.body
    catalog.dispatch(dev, kern, [w, weights.scales or w, out], groups,
                     push={"n_rows": n, "k": k, "w_stride": weights.w_stride, "s_stride": weights.s_stride,
                           "groups_x": groups[0]})
    return out

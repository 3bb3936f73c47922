"""Matrix-vector and small-batch products over GGUF weights: y[b] = W x[b] (+ bias) (+ residual).

`upload_weights` moves a QuantizedTensor to the device in the templates' layout (see vkgraph.quant);
`matvec` dispatches the format's template with launch parameters chosen from the device's features;
`upload_experts` and `matvec_id` do the same for a mixture of experts' matrices, stacked and indexed per
(token, slot) pair (llama.cpp's mul_mat_id), so a step reads only the chosen experts' weights;
`matvec_glu_q8` runs a stacked gate/up product whose epilogue writes the down product's int8 activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..flags import flag
from ..quant import QuantFormat, QuantizedTensor, kernel_layout, stack_rows
from ..runtime import Device, get_device
from . import catalog
from .common import check_binding_range, check_buffer, decode_fusion, grid_2d, pow2_ceil, pow2_floor

TEMPLATE = {"Q8_0": "matvec_q8_0", "Q4_0": "matvec_q4_0", "Q4_1": "matvec_q4_1", "Q5_0": "matvec_q5_0",
            "Q5_1": "matvec_q5_1", "Q2_K": "matvec_q2_k", "Q3_K": "matvec_q3_k", "Q4_K": "matvec_q4_k",
            "Q5_K": "matvec_q5_k", "Q6_K": "matvec_q6_k", "IQ4_NL": "matvec_iq4_nl", "IQ4_XS": "matvec_iq4_xs",
            "F16": "matvec_f16", "BF16": "matvec_f16"}
# elements one invocation handles per 16-byte load: must match UNIT_ELEMS in each template
UNIT_ELEMS = {"Q8_0": 16, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q2_K": 64, "Q3_K": 64, "Q4_K": 32,
              "Q5_K": 32, "Q6_K": 64, "IQ4_NL": 32, "IQ4_XS": 32, "F16": 8, "BF16": 8}
ACT_DTYPES = {"f32": np.float32, "f16": np.float16}
# templates with an integer dot-product path (-DINT_DOT)
INT_DOT_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
# integer-path templates whose runs share one scale and one activation block (UNIT_COEFFS): they take `fold`
FOLD_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS")
MAX_BATCH = 8  # activation rows one call of the workgroup launch takes
MAX_BATCH_SUBGROUP = 32  # ... of the subgroup-rows launch, which reads the weights once for all of them


@dataclass
class DeviceWeights:
    """A weight matrix on the device in the matvec layout: `body` (16-byte words per row) and f16 `scales`."""

    format: QuantFormat
    shape: tuple[int, int]
    body: Any
    scales: Any | None
    w_stride: int  # uvec4 words per row of body
    s_stride: int  # float16 scales per row
    # compiled templates by launch variant (see _kernel): one lookup per call instead of the runtime's
    pipelines: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return self.body.size + (self.scales.size if self.scales is not None else 0)

    def bind(self, dev: Device, body: Any, scales: Any | None) -> None:
        """Set the buffers that hold the weights (the same ones at every call of a layer: a check, then two
        stores); the body must fit one binding."""
        if body is not self.body:
            check_binding_range(dev, f"{self.format.name} weights {self.shape}", body.size)
        self.body, self.scales = body, scales


@dataclass(frozen=True)
class MatvecConfig:
    wg: int
    rows: int
    use_subgroup: bool
    # INT_DOT_FORMATS only: activations quantized to int8 per block of 32 (quantize_activations), integer dot
    # products of four int8 lanes; needs the device's shaderIntegerDotProduct
    int_dot: bool = False
    # the subgroup-rows launch (-DSG_ROWS) when > 0: groups of `tpr` invocations (a power of two within the
    # device's smallest subgroup) own `rows` rows each, WG / tpr groups per workgroup, each invocation keeping
    # `unroll` units of every row in flight; 0: the workgroup launch (a workgroup owns `rows` rows, and each
    # invocation keeps `unroll` rounds of WG units of every row in flight)
    tpr: int = 0
    unroll: int = 1
    # integer path, FOLD_FORMATS: a unit's runs summed as integers before its one scale (-DFOLD)
    fold: bool = False
    # integer path, subgroup-rows launch: each round of tpr * unroll units' activations staged in shared memory
    # once per workgroup, which its groups then read there (-DSTAGE_X; `stage_fits` says where it can)
    stage: bool = False

    @property
    def rows_per_workgroup(self) -> int:
        return self.rows * (self.wg // self.tpr) if self.tpr else self.rows


def weight_words(qt: QuantizedTensor) -> tuple[DeviceWeights, np.ndarray, np.ndarray | None]:
    """`qt` in the matvec templates' layout, as host uint32 words: the DeviceWeights that describes it (its
    buffers not bound yet, see `bind`), the body's words and the float16 scales' words (None: no scales)."""
    rows, cols = qt.shape
    if qt.format.name in ("F16", "BF16") and cols % 8:
        raise ValueError(f"{qt.format.name} matvec needs K % 8 == 0 (16-byte rows), got K={cols}")
    body, scales = kernel_layout(qt)
    swords = None
    if scales is not None:
        flat = scales.reshape(-1)
        swords = np.pad(flat, (0, -flat.size % 4)).view(np.uint32)  # the template reads the scales as whole uints
    weights = DeviceWeights(qt.format, (rows, cols), None, None, body.shape[1] // 16,
                            0 if scales is None else scales.shape[1] // 2)
    return weights, body.reshape(-1).view(np.uint32), swords


def upload_weights(dev: Device, qt: QuantizedTensor) -> DeviceWeights:
    """Copy `qt` to the device in the matvec templates' layout."""
    weights, body, scales = weight_words(qt)
    bbuf = dev.alloc(body.nbytes)
    dev.upload(bbuf, body)
    sbuf = None
    if scales is not None:
        sbuf = dev.alloc(scales.nbytes)
        dev.upload(sbuf, scales)
    weights.bind(dev, bbuf, sbuf)
    return weights


# (invocations per workgroup up to K = 4096, beyond it, rows per workgroup) at batch 1, measured on an H200.
# Each invocation keeps `rows` 16-byte weight loads in flight and reuses one load of activations for all of
# them; the 4-bit formats are bound by decoding, where few threads per row with few rows won.
PREFERRED = {"Q8_0": (64, 256, 8), "Q4_0": (64, 128, 4), "Q4_K": (64, 128, 8), "Q6_K": (64, 128, 4),
             "F16": (256, 256, 4), "BF16": (256, 256, 4)}
# formats not measured yet take the measured format their blocks resemble (bench_kernels.py measures them)
for _f, _like in (("Q4_1", "Q4_0"), ("Q5_0", "Q4_0"), ("Q5_1", "Q4_0"), ("IQ4_NL", "Q4_0"), ("IQ4_XS", "Q4_0"),
                  ("Q5_K", "Q4_K"), ("Q2_K", "Q6_K"), ("Q3_K", "Q6_K")):
    PREFERRED[_f] = PREFERRED[_like]
LONG_K = 4096
MANY_ROWS = 65536  # from here on (an output projection) Q4_0 takes 8 rows per workgroup
# Rows per workgroup for 2, 4 and 8 activation rows, measured on an H200 at 14336x4096 (a rows sweep;
# `tune_matvec.py --paths float` repeats it). Each weight row reuses the activations loaded for it, so fewer rows
# per workgroup multiply the activation traffic: at batch 8 (Q4_0) one row ran at 70 GB/s, four at 214, eight
# at 272.
BATCH_ROWS = {"Q4_0": {2: 8, 4: 8, 8: 8}, "Q8_0": {2: 4, 4: 8, 8: 8}}


# The integer dot-product path: (invocations per workgroup up to K = 4096, beyond it, rows per
# workgroup) by activation rows, measured on an H200 (`tune_matvec.py --paths int8`). With the weights' decoding
# reduced to a few integer instructions, one subgroup per workgroup and few rows won at every batch.
# Q8_0 at one row: two rows per workgroup, 256 invocations where K <= 4096 (2026-12-02, bench_matvec_launch.py
# --wg-sweep at the 8B products, GB/s against the earlier 128 invocations on one row in the same run: qkv 2545
# against 2456, o 2050 against 1984, gate_up 3874 against 3731, down (128 invocations) 3236 against 3179, head 4373
# against 4238); every product's fastest had two rows, within 1.5% of it.
INT_DOT_PREFERRED = {"Q4_0": {1: (128, 128, 2), 2: (32, 64, 2), 4: (32, 32, 2), 8: (32, 64, 2)},
                     "Q8_0": {1: (256, 128, 2), 2: (32, 64, 2), 4: (32, 64, 2), 8: (32, 32, 2)},
                     "Q4_K": {1: (128, 128, 4), 2: (32, 64, 4), 4: (32, 64, 4), 8: (32, 64, 4)},
                     "Q6_K": {1: (32, 64, 2), 2: (32, 64, 2), 4: (32, 32, 4), 8: (32, 32, 4)}}
for _f, _like in (("Q4_1", "Q4_0"), ("Q5_0", "Q4_0"), ("Q5_1", "Q4_0"), ("IQ4_NL", "Q4_0"), ("IQ4_XS", "Q4_0"),
                  ("Q5_K", "Q4_K"), ("Q2_K", "Q6_K"), ("Q3_K", "Q6_K")):  # not measured yet: as PREFERRED does
    INT_DOT_PREFERRED[_f] = INT_DOT_PREFERRED[_like]


@dataclass(frozen=True)
class OneRow:
    """One activation row's launch on the integer path for a class of product shapes (INT_DOT_ONE_ROW): the
    workgroup launch (`subgroup` False: `wg` invocations own `rows` rows, `unroll` rounds of units in flight) or
    the subgroup-rows one (`wg` invocations in groups as wide as choose_config makes them, `rows` per group,
    `unroll` units in flight), with fold or not."""

    wg: int
    rows: int
    unroll: int
    fold: bool
    subgroup: bool = False


# The integer path at one activation row by product shape, where other launch parameters measured faster than
# INT_DOT_PREFERRED's: by format, entries ((smallest N, largest N), (smallest K, largest K), OneRow), the first
# entry whose ranges hold the product's N and K taken; each range spans the measured shapes and less than twice
# them, so shapes not measured (the 1B model's K = 2048; the head, where no entry names it) keep
# INT_DOT_PREFERRED's. Measured on an H200 (2026-12-02, `bench_matvec_launch.py --wg-sweep`, Q4_0 at the 8B products,
# GB/s against INT_DOT_PREFERRED's 128 invocations and 2 rows in the same interleaved run): qkv 1618 against 1411
# and o 1230 against 1155 with 32-lane groups of one row, 4 units in flight, fold; gate_up 3168 against 2897 with
# one subgroup of 4 rows; down 2588 against 2428 with 64 invocations on one row, fold. The 1B model's down product
# (2048x8192; 2026-12-03, the same sweep at --shapes 1b, finals): 1393 against 1192 with 128 invocations on one row,
# two rounds in flight, fold. (Its q/k/v and gate/up products run fused, with launches of their own; its o product's
# best was the default.)
INT_DOT_ONE_ROW: dict[str, list[tuple[tuple[int, int], tuple[int, int], OneRow]]] = {
    "Q4_0": [((4096, 8192), (4096, 4096), OneRow(128, 1, 4, True, subgroup=True)),
             ((16384, 32768), (4096, 4096), OneRow(32, 4, 1, False)),
             ((4096, 8192), (8192, 16384), OneRow(64, 1, 1, True)),
             ((2048, 4095), (8192, 16383), OneRow(128, 1, 2, True))],
    # Q4_K (2026-12-02, bench_matvec_launch.py --wg-sweep, the one-word unit with both runs' scales unpacked at once,
    # GB/s in the finals against INT_DOT_PREFERRED's 128 invocations and 4 rows, and the earlier subgroup-rows entry
    # for qkv, in the same run): two rows per workgroup won on every product. qkv 1442 (first pass 1504) against 1300
    # (sg) and 1484; o 1180 (1161) against 1137; gate_up 2756 (2745) against 2410, one round in flight (four read
    # 2779, but glu_config takes the product's rounds and rows, 4 rows a group there: 16 Q4_K units in flight an
    # invocation); down 2258 (2134) against 1848; the head one subgroup of 4 rows, 3763 (3713) against 3106.
    "Q4_K": [((6144, 8192), (4096, 4096), OneRow(32, 2, 4, False)),
             ((4096, 5120), (4096, 4096), OneRow(64, 2, 2, False)),
             ((16384, 32768), (4096, 4096), OneRow(32, 2, 1, False)),
             ((4096, 8192), (8192, 16384), OneRow(128, 2, 4, False)),
             ((65536, 200000), (4096, 4096), OneRow(32, 4, 1, False))]}


def one_row_entry(fmt: QuantFormat, n: int, k: int) -> OneRow | None:
    """INT_DOT_ONE_ROW's entry for a product of this format and shape (None: none holds it)."""
    return next((e for (n_lo, n_hi), (k_lo, k_hi), e in INT_DOT_ONE_ROW.get(fmt.name, ())
                 if n_lo <= n <= n_hi and k_lo <= k <= k_hi), None)


def choose_config(dev: Device, fmt: QuantFormat, n: int, k: int, batch: int, *,
                  int_dot: bool | None = None, subgroup_rows: bool | None = None) -> MatvecConfig:
    """Launch parameters from the device and the shape (see PREFERRED, INT_DOT_PREFERRED, INT_DOT_ONE_ROW and
    SG_PREFERRED).
    `int_dot`: take the integer dot-product path or not; None leaves it to `int_dot_default`. `subgroup_rows`:
    the subgroup-rows launch or the workgroup one; None leaves it to `subgroup_rows_default`."""
    info = dev.info
    sg = info.subgroup_size
    if int_dot is None:
        int_dot = int_dot_default(dev, fmt)
    entry = one_row_entry(fmt, n, k) if int_dot and batch == 1 else None
    if subgroup_rows is None:
        subgroup_rows = subgroup_rows_default(dev, batch, fmt, k, int_dot)
        if entry is not None and flag("VKGRAPH_MATVEC_LAUNCH") == "auto":  # the entry's launch, where it runs
            subgroup_rows = entry.subgroup and "shuffle" in dev.info.subgroup_ops
    if entry is not None and entry.subgroup != subgroup_rows:  # a forced launch: the entry is for the other one
        entry = None
    bucket = 1 << (batch - 1).bit_length()
    units = k // UNIT_ELEMS[fmt.name]
    if subgroup_rows:
        return _subgroup_rows_config(dev, fmt, n, units, bucket, int_dot, entry)
    if batch > MAX_BATCH:
        raise ValueError(f"the workgroup launch takes 1..{MAX_BATCH} activation rows, got {batch}")
    unroll, fold = 1, False
    if entry is not None:
        wg_short = wg_long = entry.wg
        rows, unroll, fold = entry.rows, entry.unroll, entry.fold
    elif int_dot:
        wg_short, wg_long, rows = INT_DOT_PREFERRED[fmt.name][bucket]
    else:
        wg_short, wg_long, rows = PREFERRED[fmt.name]
        if fmt.name == "Q4_0" and n >= MANY_ROWS:
            rows = 8
        if batch > 1:  # formats not measured: four rows, which beat one and two for both measured formats
            rows = BATCH_ROWS.get(fmt.name, {}).get(bucket, min(rows, 4))
    wg = wg_long if k > LONG_K else wg_short
    # no wider than the row needs, at least a subgroup, within the device's limit
    wg = min(wg, max(sg, 32, 1 << (max(units, 1) - 1).bit_length()), pow2_floor(info.max_workgroup_invocations))
    use_subgroup = "arithmetic" in info.subgroup_ops and wg % sg == 0
    unroll = max(1, min(unroll, -(-units // wg)))  # no more rounds in flight than the row has
    return MatvecConfig(wg, rows, use_subgroup, int_dot, unroll=unroll, fold=fold and fmt.name in FOLD_FORMATS)


# The subgroup-rows launch: (invocations per workgroup, rows per group, units in flight per row) by activation
# rows. Not measured on a GPU yet (benchmarks/tune_matvec.py --launch subgroup sweeps them): chosen so that at
# K = 4096 an invocation of a Q4_0 row keeps 8 weight words in flight (two rows of four units), where the
# workgroup launch kept two.
# From 16 rows on, four rows per group share each activation load: the activations, not the weights, are most of
# what an invocation reads there.
SG_PREFERRED = {1: (128, 2, 4), 2: (128, 2, 4), 4: (128, 2, 2), 8: (128, 2, 2), 16: (128, 4, 1), 32: (128, 4, 1)}
# The integer path in that launch, by format and activation rows: (workgroup size, rows per group, units in
# flight, fold where the format can, stage where it fits) (`bench_matvec_launch.py --nb-sweep` times the
# candidates). A format or bucket without an H200 figure takes SG_PREFERRED's entry without fold and stage.
SG_INT_DOT_PREFERRED: dict[str, dict[int, tuple[int, int, int, bool, bool]]] = {}


def rows_per_call(dev: Device) -> int:
    """Activation rows one `matvec` call takes under the default launch (callers split more into calls). A CPU
    device takes 8: lavapipe's compiler spent 26 s on a 19-row Q6_K body, and it has no bandwidth to save."""
    wide = subgroup_rows_default(dev) and dev.info.device_type != "cpu"
    return MAX_BATCH_SUBGROUP if wide else MAX_BATCH


def group_width(dev: Device, units: int, unroll: int) -> int:
    """The subgroup-rows launch's invocations per group where no override gives them: as wide as a row's `units`
    allow with `unroll` units per invocation at least, within the device's smallest subgroup and 32."""
    return max(1, min(dev.info.min_subgroup_size, 32, pow2_floor(max(units // unroll, 1))))


def _subgroup_rows_config(dev: Device, fmt: QuantFormat, n: int, units: int, bucket: int,
                          int_dot: bool, entry: OneRow | None = None) -> MatvecConfig:
    """SG_PREFERRED with the group as wide as the row's units allow (`unroll` units per invocation at least),
    within the device's smallest subgroup; the workgroup a whole number of the largest subgroups. On the integer
    path, SG_INT_DOT_PREFERRED with fold and stage where the format and the device's shared memory take them."""
    info = dev.info
    plain = (*SG_PREFERRED[bucket], False, False)
    chosen = SG_INT_DOT_PREFERRED.get(fmt.name, {}).get(bucket, plain) if int_dot else plain
    if entry is not None:
        chosen = (entry.wg, entry.rows, entry.unroll, entry.fold, False)
    wg, rows, unroll, tpr, fold, stage = sg_overrides().get(bucket, (*chosen[:3], 0, *chosen[3:]))
    if not tpr:
        tpr = group_width(dev, units, unroll)
    # no more units in flight than a row has per invocation; a CPU device has no memory latency to hide, and
    # unrolled bodies only lengthen its compiles
    unroll = 1 if info.device_type == "cpu" else max(1, min(unroll, -(-units // tpr)))
    groups = -(-n // rows)  # no more groups per workgroup than the rows need
    wg = max(min(wg, (1 << (groups - 1).bit_length()) * tpr), info.max_subgroup_size, tpr)
    cfg = MatvecConfig(wg, rows, True, int_dot, tpr, unroll, fold=int_dot and fold and fmt.name in FOLD_FORMATS)
    return replace(cfg, stage=bool(stage) and stage_fits(dev, fmt, cfg, bucket))


def stage_bytes(fmt: QuantFormat, cfg: MatvecConfig, batch: int, norm: bool = False) -> int:
    """Shared memory of STAGE_X's arrays: per activation row and element of a round, the int8 value and half a
    byte of the 16-byte record per block of 32 (scale and two half sums; the value array rounded to even words);
    with `norm` (NORM_X) a float per activation row and subgroup of 8 lanes or more."""
    words = batch * cfg.tpr * cfg.unroll * UNIT_ELEMS[fmt.name] // 16
    return (words + words % 2) * 16 + words // 2 * 16 + (batch * (cfg.wg // 8) * 4 if norm else 0)


def stage_fits(dev: Device, fmt: QuantFormat, cfg: MatvecConfig, batch: int, norm: bool = False) -> bool:
    """Whether STAGE_X takes this launch: the integer path of the subgroup-rows launch, a round of units that
    covers whole blocks of activations and whole super-blocks of weights (its units then cover consecutive
    elements), and the arrays (for `batch` rows; `norm`: NORM_X's too) within the device's shared memory, 1 KiB
    left for the rest."""
    elems = cfg.tpr * cfg.unroll * UNIT_ELEMS.get(fmt.name, 1)
    whole = elems % max(32, fmt.block_size) == 0
    return (cfg.int_dot and cfg.tpr > 0 and fmt.name in INT_DOT_FORMATS and whole
            and stage_bytes(fmt, cfg, batch, norm) + 1024 <= dev.info.max_shared_memory)


# A matvec that normalizes its own input (NormedRows, -DNORM_X) takes the subgroup-rows launch with its activations
# staged: by activation rows bucket, (invocations per workgroup, rows per group, units in flight, group width (0:
# derived), fold where the format takes it). Every workgroup normalizes and quantizes its activation rows' whole K
# (from L2: 16 KiB per row at K = 4096, against about 2.3 KiB of Q4_0 weights per weight row), so a workgroup owns
# many weight rows (32 here) to keep that traffic below the weights'. Not measured on a GPU yet
# (VKGRAPH_NORM_PROLOGUE_SG replaces entries for a sweep): at K = 4096 one Q4_0 row is one round (32 lanes of 4
# units) up to 4 activation rows; at 8 two rounds, whose staged int8 rows fit 48 KiB.
NORM_PREFERRED: dict[int, tuple[int, int, int, int, bool]] = {
    1: (512, 2, 4, 32, True), 2: (512, 2, 4, 32, True), 4: (512, 2, 4, 32, True), 8: (512, 2, 2, 32, True)}
# Products of more rows keep the norm's kernel: their workgroups' reads of the activations (N / rows per workgroup
# times the rows' K floats, and the norm's weight) grow with N while the dispatch they save stays one. On an H200
# (8B Q4_0, one activation row, interim run of 2026-12-02) the q/k/v product (6144 rows) took 12.3 us with the norm
# against about 9.0 without (inferred from the step's totals), less than the 5.2 us rmsnorm_q8 it saves; gate/up
# (28672 rows, with the gated unit in its epilogue) 30.6 against 22.6, more.
NORM_MAX_ROWS = 16384
# The formats whose decode steps take the prologue (takes_norm), where it was measured to win (H200, 8B, one row,
# twelfth session: Q4_0 455.6 against 447.6 tok/s with glu_q8 apart, 464.9 against 464.4 with the gated unit in
# the epilogue, Q8_0 320.2 against 315.5); Q4_K lost with it (410.7 against 426.2:
# its q/k/v with the norm took 16.5 us against 9.5 + 5.2 apart), the others are not measured.
NORM_FORMATS = ("Q4_0", "Q8_0")


def norm_overrides() -> dict[int, tuple[int, int, int, int, bool]]:
    """VKGRAPH_NORM_PROLOGUE_SG: NORM_PREFERRED entries replaced without a code change, e.g.
    "1:256,2,4,32,1;8:512,1,2,16,0" (activation rows bucket: invocations per workgroup, rows per group, units in
    flight, group width (0: derived), fold (0 or 1))."""
    entries = launch_entries("VKGRAPH_NORM_PROLOGUE_SG", NORM_PREFERRED, (5,), "WG,ROWS,UNROLL,TPR,FOLD")
    return {bucket: (*nums[:4], bool(nums[4])) for bucket, nums in entries.items()}


def launch_entries(name: str, buckets: Any, lengths: tuple[int, ...], usage: str) -> dict[int, list[int]]:
    """The flag `name`'s launch entries "BUCKET:N,N,...;..." as {bucket: numbers}: a bucket of `buckets`, one of
    `lengths` numbers, the first three (workgroup size, rows, units in flight) positive, the group width (fourth)
    not negative and the switches after it 0 or 1; else ValueError naming the entry and `usage`."""
    out = {}
    for entry in filter(None, (e.strip() for e in flag(name).split(";"))):
        try:
            bucket, values = entry.split(":")
            nums = [int(v) for v in values.split(",")]
            if (int(bucket) not in buckets or len(nums) not in lengths or min(nums[:3]) < 1
                    or min(nums[3:], default=0) < 0 or max(nums[4:], default=0) > 1):
                raise ValueError
        except ValueError:
            raise ValueError(f"{name} entry {entry!r}: expected ROWS_BUCKET:{usage} with a bucket in "
                             f"{sorted(buckets)}") from None
        out[int(bucket)] = nums
    return out


def whole_rounds(fmt: QuantFormat, tpr: int, unroll: int) -> int:
    """`unroll` raised so that a staged round of tpr * unroll units covers whole blocks of 32 activations and whole
    super-blocks of the format."""
    span = max(32, fmt.block_size)
    step = span // math.gcd(span, tpr * UNIT_ELEMS[fmt.name])
    return -(-unroll // step) * step


def norm_config(dev: Device, fmt: QuantFormat, n: int, k: int, batch: int) -> MatvecConfig | None:
    """The launch of a matvec over NormedRows (NORM_PREFERRED, VKGRAPH_NORM_PROLOGUE_SG), or None where the device
    or the shape does not take one: up to MAX_BATCH activation rows, an INT_DOT_FORMATS weight of at most
    NORM_MAX_ROWS rows, K % 32 == 0, subgroup shuffles and arithmetic on subgroups of 8 lanes or more, rounds of
    whole super-blocks (units in flight raised to them) and the staged arrays within the device's shared memory."""
    info = dev.info
    if (not 1 <= batch <= MAX_BATCH or fmt.name not in INT_DOT_FORMATS or not info.integer_dot_product or k % 32
            or n > NORM_MAX_ROWS or not {"shuffle", "arithmetic"} <= set(info.subgroup_ops)
            or info.min_subgroup_size < 8):
        return None
    bucket = 1 << (batch - 1).bit_length()
    wg, rows, unroll, tpr, fold = norm_overrides().get(bucket, NORM_PREFERRED[bucket])
    units = k // UNIT_ELEMS[fmt.name]
    tpr = min(tpr, info.min_subgroup_size) if tpr else group_width(dev, units, unroll)
    if info.device_type == "cpu":
        # as _subgroup_rows_config: no latency to hide, shorter compiles; and lavapipe ran the tiny test model's
        # products 3.7x faster (56 against 9 ms at 8 activation rows) in workgroups of 64 than of 512
        unroll, wg = 1, min(wg, 64)
    unroll = whole_rounds(fmt, tpr, unroll)
    wg = max(min(wg, pow2_ceil(-(-n // rows)) * tpr, pow2_floor(info.max_workgroup_invocations)),
             info.max_subgroup_size, tpr)
    if unroll > 16:
        return None
    cfg = MatvecConfig(wg, rows, True, True, tpr, unroll, fold=fold and fmt.name in FOLD_FORMATS, stage=True)
    return cfg if stage_fits(dev, fmt, cfg, batch, norm=True) else None


def sg_overrides() -> dict[int, tuple[int, int, int, int, bool, bool]]:
    """VKGRAPH_MATVEC_SG: SG_PREFERRED and SG_INT_DOT_PREFERRED entries replaced without a code change, e.g.
    "1:128,2,4;32:256,4,1,16;8:128,4,2,0,1,1" (activation rows bucket: workgroup size, rows per group, units in
    flight[, group width (0 or left out: derived)[, fold, stage (0 or 1; left out: neither)]])."""
    out = {}
    for bucket, nums in launch_entries("VKGRAPH_MATVEC_SG", SG_PREFERRED, (3, 4, 6),
                                       "WG,ROWS,UNROLL[,TPR[,FOLD,STAGE]]").items():
        fold, stage = (bool(nums[4]), bool(nums[5])) if len(nums) == 6 else (False, False)
        out[bucket] = (nums[0], nums[1], nums[2], nums[3] if len(nums) >= 4 else 0, fold, stage)
    return out


# Where VKGRAPH_MATVEC_LAUNCH=auto keeps the integer path on the workgroup launch past one activation row, by
# format: up to this many rows at every K, and up to MAX_BATCH rows where K > LONG_K. Measured on an H200
# (2026-12-02, bench_matvec_launch.py, Q4_0 at the 8B products qkv/o/gate_up/down, GB/s): 2 rows, workgroup
# 1351/1189/2687/1615 against subgroup 1348/863/2504/1508; 4 rows 1210/979/1884/1632 against 1024/858/1861/1140;
# 8 rows down (K = 14336) 1078 against 929, the K = 4096 products within 5% either way (744/637/1114 against
# 782/663/1138). Q4_K at 8 rows (same day and script): down 996 against 705, the K = 4096 products slower
# (qkv/o/gate_up 629/456/880 against 716/565/950). Formats not measured yet keep the subgroup launch past one row.
AUTO_WORKGROUP_ROWS = {"Q4_0": 4, "Q4_K": 1}


def subgroup_rows_default(dev: Device, batch: int | None = None, fmt: QuantFormat | None = None, k: int = 0,
                          int_dot: bool = False) -> bool:
    """Whether choose_config takes the subgroup-rows launch for `batch` activation rows (None: some number of
    rows above one) of width `k` in format `fmt`: VKGRAPH_MATVEC_LAUNCH=subgroup, or auto where the device
    shuffles within subgroups and the call has more than one row, except where AUTO_WORKGROUP_ROWS keeps the
    integer path on the workgroup launch; workgroup never. On the H200 (2026-12-02) the workgroup launch was
    faster at one row for every 8B product (e.g. down 2486 against 1375 GB/s) and the subgroup one faster end to
    end at 8 and 32."""
    setting = flag("VKGRAPH_MATVEC_LAUNCH")
    if setting == "auto" and batch == 1:
        return False
    if setting == "auto" and batch and int_dot and fmt is not None and batch <= MAX_BATCH:
        rows = AUTO_WORKGROUP_ROWS.get(fmt.name, 0)
        if batch <= rows or (rows and k > LONG_K):
            return False
    return setting != "workgroup" and "shuffle" in dev.info.subgroup_ops


def _check_subgroup_rows(dev: Device, cfg: MatvecConfig) -> None:
    info = dev.info
    if "shuffle" not in info.subgroup_ops:
        raise ValueError(f"{info.name} has no subgroup shuffles: the subgroup-rows launch needs them (tpr=0)")
    if cfg.tpr & (cfg.tpr - 1) or cfg.tpr > info.min_subgroup_size:
        raise ValueError(f"tpr must be a power of two up to the device's smallest subgroup "
                         f"({info.min_subgroup_size}), got {cfg.tpr}")
    if cfg.wg % max(cfg.tpr, info.max_subgroup_size) or cfg.wg > info.max_workgroup_invocations:
        raise ValueError(f"wg must be a multiple of the subgroup size ({info.max_subgroup_size}) and of tpr, "
                         f"within the device's {info.max_workgroup_invocations}, got {cfg.wg}")
    _check_unroll(cfg)


def _check_unroll(cfg: MatvecConfig) -> None:
    if not 1 <= cfg.unroll <= 16:
        raise ValueError(f"unroll must be 1..16, got {cfg.unroll}")


def int_dot_default(dev: Device, fmt: QuantFormat) -> bool:
    """Whether choose_config takes the integer dot-product path: for INT_DOT_FORMATS where the device reports
    packed 4x8-bit dot products as hardware-accelerated (measured 1.4-3.5x faster than float activations on
    an H200, docs/kernels.md). VKGRAPH_INT_DOT=1 takes it wherever the device has the instructions at all,
    0 never."""
    if fmt.name not in INT_DOT_FORMATS or not dev.info.integer_dot_product:
        return False
    setting = flag("VKGRAPH_INT_DOT")
    if setting == "auto":
        return dev.info.integer_dot_product_accelerated
    return setting == "1"


def takes_int8(fmt: QuantFormat, rows: int, k: int) -> bool:
    """Whether `rows` activation rows of width k into a matvec of this format on the default device take the
    integer path (int_dot_default) in a form a producer may write directly as one Q8Acts buffer: K % 32 == 0,
    and past `rows_per_call` rows (several calls, each on a view of its rows) K % Q8_ALIGN == 0, so that every
    call's rows start on an offset any device can bind. Never with VKGRAPH_DECODE_FUSION=0."""
    dev = get_device()
    fits = decode_fusion() and k % 32 == 0 and (rows <= rows_per_call(dev) or k % Q8_ALIGN == 0)
    return rows >= 1 and fits and int_dot_default(dev, fmt)


def takes_norm(fmt: QuantFormat, rows: int, n: int, k: int) -> bool:
    """Whether `rows` activation rows of width k into an [n, k] matvec of this format on the default device may
    come as NormedRows: NORM_FORMATS, up to VKGRAPH_NORM_PROLOGUE rows, the integer path (int_dot_default), a launch
    that takes them (norm_config). Never with VKGRAPH_DECODE_FUSION=0."""
    dev = get_device()
    return (fmt.name in NORM_FORMATS and rows <= flag("VKGRAPH_NORM_PROLOGUE") and decode_fusion()
            and int_dot_default(dev, fmt) and norm_config(dev, fmt, n, k, rows) is not None)


def _check_act_dtype(act_dtype: str) -> int:
    """Bytes per activation of `act_dtype`; ValueError when the templates do not take it."""
    if act_dtype not in ACT_DTYPES:
        raise ValueError(f"act_dtype must be one of {sorted(ACT_DTYPES)}, got {act_dtype!r}")
    return np.dtype(ACT_DTYPES[act_dtype]).itemsize


def _kernel(dev: Device, weights: DeviceWeights, cfg: MatvecConfig, batch: int, act_dtype: str, *,
            has_bias: bool = False, has_residual: bool = False, expert_ids: bool = False, glu: str = "",
            norm_eps: float | None = None) -> Any:
    """The format's template compiled for this launch variant, cached on `weights`. `glu`: "silu" or "gelu_tanh"
    for the GLU_Q8 epilogue (matvec_glu_q8), "" for y; `norm_eps`: over NormedRows (the NORM_X prologue)."""
    key = (cfg, batch, act_dtype, has_bias, has_residual, expert_ids, glu, norm_eps)
    kern = weights.pipelines.get(key)
    if kern is None:
        defines = {}
        if glu:
            defines.update(GLU_Q8=1, **_glu_defines(dev, glu))
        if cfg.tpr:
            if expert_ids:
                raise ValueError("matvec_id takes the workgroup launch (tpr=0)")
            _check_subgroup_rows(dev, cfg)
            defines.update(SG_ROWS=1, TPR=cfg.tpr, UNROLL=cfg.unroll)
        else:
            _check_unroll(cfg)
            if cfg.unroll > 1:
                defines["UNROLL"] = cfg.unroll
        if cfg.int_dot:
            _check_int_dot(dev, weights.format)
            defines["INT_DOT"] = 1
        if cfg.fold:
            if not cfg.int_dot or weights.format.name not in FOLD_FORMATS:
                raise ValueError(f"fold takes the integer path of {FOLD_FORMATS}, not {weights.format.name} "
                                 f"(int_dot={cfg.int_dot})")
            defines["FOLD"] = 1
        norm = norm_eps is not None
        if norm:
            info = dev.info
            if not (cfg.stage and {"shuffle", "arithmetic"} <= set(info.subgroup_ops) and info.min_subgroup_size >= 8):
                raise ValueError("normalized rows (NormedRows) need the staged integer path of the subgroup-rows "
                                 "launch (stage) and subgroup shuffles and arithmetic on subgroups of 8 lanes or more")
            defines.update(NORM_X=1, SUBGROUP_SHUFFLE=1)
        if cfg.stage:
            if not stage_fits(dev, weights.format, cfg, batch, norm):
                need = stage_bytes(weights.format, cfg, batch, norm)
                raise ValueError(f"stage needs the integer path of the subgroup-rows launch, rounds of tpr * unroll "
                                 f"units over whole blocks and super-blocks, and {need} bytes of shared memory "
                                 f"within the device's {dev.info.max_shared_memory} - 1024")
            defines["STAGE_X"] = 1
        if expert_ids:
            defines["EXPERT_IDS"] = 1
        if act_dtype == "f16":
            defines["A_F16"] = 1
        if weights.format.name == "BF16":
            defines["W_BF16"] = 1
        spec = {"WG": cfg.wg, "ROWS": cfg.rows, "NB": batch, "USE_SUBGROUP": cfg.use_subgroup,
                "HAS_BIAS": has_bias, "HAS_RESIDUAL": has_residual, "SUBGROUP": dev.info.min_subgroup_size}
        if norm:
            spec["EPS"] = norm_eps
        # the variants counted and profiled apart from the plain products
        name = TEMPLATE[weights.format.name]
        label = name + ("+norm" if norm else "") + ("+glu_q8" if glu else "")
        kern = weights.pipelines[key] = catalog.compile(dev, name, spec=spec, defines=defines,
                                                      label=label if label != name else None)
    return kern


def matvec(dev: Device, weights: DeviceWeights, x: Any, batch: int = 1, *, act_dtype: str = "f32",
           out: Any | None = None, bias: Any | None = None, residual: Any | None = None,
           config: MatvecConfig | None = None) -> Any:
    """y[b, n] = sum_k W[n, k] x[b, k] (+ bias[n]) (+ residual[b, n]) for b < batch; returns y [batch, N].

    x holds `batch` rows of K activations (float32, or float16 with act_dtype="f16"), or is a `Q8Acts`: the
    rows already quantized for the integer path (e.g. by norms.rmsnorm_q8), which then needs no quantization
    kernel, or `NormedRows`: float32 rows the matvec normalizes and quantizes itself (norm_config's launch, or
    `config` with stage). bias is float32 [N], residual float32 [batch, N] (it may be `out` itself); y is
    float32. Records the dispatch; does not wait.
    """
    n, k = weights.shape
    act_bytes = _check_act_dtype(act_dtype)
    limit = MAX_BATCH if config is not None and not config.tpr else MAX_BATCH_SUBGROUP
    if not 1 <= batch <= limit:
        raise ValueError(f"batch must be 1..{limit} for this launch, got {batch} (more rows: several calls, or "
                         "dequantize and matmul)")
    norm_eps = None
    if isinstance(x, NormedRows):
        x.check(batch, k)
        _check_int_dot(dev, weights.format)
        config = config or norm_config(dev, weights.format, n, k, batch)
        if config is None or not config.int_dot:
            raise ValueError(f"{dev.info.name} has no launch for {batch} normalized rows of {weights.format.name} "
                             f"{weights.shape} (norm_config)")
        norm_eps = x.eps
    elif isinstance(x, Q8Acts):
        x.check(batch, k)
        if config is not None and not config.int_dot:
            raise ValueError("int8-quantized activations need the integer dot-product path (config.int_dot)")
        if config is None:
            config = choose_config(dev, weights.format, n, k, batch, int_dot=True)
    else:
        check_buffer("x", x, batch * k * act_bytes)
    if out is None:
        out = dev.alloc(batch * n * 4)
    check_buffer("out", out, batch * n * 4)
    if bias is not None:
        check_buffer("bias", bias, n * 4)
    if residual is not None:
        check_buffer("residual", residual, batch * n * 4)
    cfg = config or choose_config(dev, weights.format, n, k, batch)
    kern = _kernel(dev, weights, cfg, batch, act_dtype, has_bias=bias is not None,
                   has_residual=residual is not None, norm_eps=norm_eps)
    _launch(dev, weights, cfg, kern, x, batch, act_dtype, out, grid_2d(dev, -(-n // cfg.rows_per_workgroup)), bias=bias,
            residual=residual)
    return out


def _launch(dev: Device, weights: DeviceWeights, cfg: MatvecConfig, kern: Any, x: Any, x_rows: int, act_dtype: str,
            out: Any, groups: tuple[int, int, int], *, bias: Any = None, residual: Any = None, ids: Any = None,
            n_pairs: int = 0, x_div: int = 1, n_experts: int = 1, glu: Q8Acts | None = None) -> None:
    """Dispatch a compiled matvec template (unused read bindings get the weights, unused written ones `out`, so
    they order nothing that the dispatch does not write anyway); with cfg.int_dot the x_rows activation rows are
    quantized to int8 first, and the copies released once the matvec is recorded. `glu`: the GLU_Q8 epilogue's
    output."""
    w = weights.body
    acts = [x, w, w]
    quantized = cfg.int_dot and not isinstance(x, Q8Acts | NormedRows)
    if isinstance(x, Q8Acts):
        acts = [x.xq, x.xd, x.xs]
    elif isinstance(x, NormedRows):
        acts = [x.x, x.gain, w]
    elif cfg.int_dot:
        acts = list(quantize_activations(dev, x, x_rows, weights.shape[1], act_dtype))
    written = [glu.xq, glu.xd, glu.xs] if glu is not None else [out, out, out]
    catalog.dispatch(dev, kern, [w, weights.scales or w, acts[0], out, bias or w, residual or w, ids or w, *acts[1:],
                                 *written], groups,
                     push={"n_rows": weights.shape[0] // n_experts, "k": weights.shape[1],
                           "w_stride": weights.w_stride, "s_stride": weights.s_stride, "groups_x": groups[0],
                           "n_pairs": n_pairs, "x_div": x_div, "n_experts": n_experts})
    if quantized:
        for buf in acts:
            buf.release()


GLU_ACTS = ("silu", "gelu_tanh")
# invocations per workgroup of the GLU_Q8 epilogue's launch at most (bench_glu_epilogue.py --max-wg sweeps it).
# Groups of a subgroup's 32 lanes with 2 rows each would make 1024, one workgroup an SM where its registers allow
# no second, all waiting at the barrier for the slowest group. To fit, glu_config adds rows per group while an
# invocation's sums (rows x activation rows) stay within GLU_MAX_SUMS, then narrows the groups (to GLU_MIN_TPR
# lanes): on the H200 (2026-12-02, 8B Q4_0) 4 rows a group won at one activation row (4 sums; the gate/up call with
# the gated unit 22.6 us against 21.4 + 4.4 apart) and lost at 8 (32 sums: 62 us against 50 + 4.8).
GLU_MAX_WG = 512
GLU_MAX_SUMS = 8
GLU_MIN_TPR = 8


def glu_config(dev: Device, fmt: QuantFormat, f: int, k: int, batch: int, *, int_dot: bool | None = None,
               max_wg: int = GLU_MAX_WG) -> MatvecConfig | None:
    """The launch of a stacked gate/up product [2f, k] whose epilogue writes the down product's int8 activations
    (matvec_glu_q8), or None where that epilogue cannot run (f % 32, no subgroup shuffles, a workgroup that would
    not be whole subgroups). A workgroup there owns one block of 32 columns of h: its 32 gate rows and 32 up rows.
    The parameters are those choose_config gives the product (`int_dot` as there), in the subgroup-rows launch:
    a workgroup launch's workgroup becomes one group as wide as it (within the device's smallest subgroup),
    its rows per group rounded down to a power of two (a divisor of 32). Where 64 rows would need more than
    `max_wg` invocations (or the device's limit), the groups take more rows each within GLU_MAX_SUMS sums an
    invocation, then narrow (to GLU_MIN_TPR lanes), then take more rows; WG / tpr groups make the 64 rows."""
    info = dev.info
    if f < 32 or f % 32 or not 1 <= batch <= MAX_BATCH_SUBGROUP or "shuffle" not in info.subgroup_ops:
        return None
    cfg = choose_config(dev, fmt, 2 * f, k, batch, int_dot=int_dot, subgroup_rows=True if batch > MAX_BATCH else None)
    tpr = cfg.tpr or min(pow2_floor(cfg.wg), info.min_subgroup_size)
    rows = pow2_floor(min(cfg.rows, 32))
    limit = min(max_wg, info.max_workgroup_invocations)
    while rows < 32 and 64 // rows * tpr > limit:
        if 2 * rows * batch > GLU_MAX_SUMS and tpr > GLU_MIN_TPR:
            tpr //= 2
        else:
            rows *= 2
    wg = 64 // rows * tpr
    if wg % info.max_subgroup_size:
        return None
    glu = MatvecConfig(wg, rows, True, cfg.int_dot, tpr, cfg.unroll, fold=cfg.fold)
    # the stage arrays beside the epilogue's sums (and q8_lanes.glsl's exchange where it takes shared memory)
    spare = 256 * batch + (0 if info.min_subgroup_size >= 8 else 8 * wg)
    stage = cfg.stage and stage_fits(dev, fmt, glu, batch) and (
        stage_bytes(fmt, glu, batch) + 1024 + spare <= info.max_shared_memory)
    return replace(glu, stage=stage)


def glu_norm_config(dev: Device, fmt: QuantFormat, f: int, k: int, batch: int) -> MatvecConfig | None:
    """The launch of a stacked gate/up product [2f, k] over NormedRows whose epilogue writes the down product's
    int8 activations (matvec_glu_q8 with both): glu_config's integer-path launch (64 rows a workgroup, many as the
    prologue wants) with its activations staged, rounds raised to whole blocks and super-blocks, where norm_config's
    conditions hold and the staged arrays fit beside the epilogue's sums; None elsewhere."""
    info = dev.info
    if norm_config(dev, fmt, 2 * f, k, batch) is None:
        return None
    cfg = glu_config(dev, fmt, f, k, batch, int_dot=True)
    if cfg is None:
        return None
    cfg = replace(cfg, unroll=whole_rounds(fmt, cfg.tpr, cfg.unroll), stage=True)
    fits = stage_fits(dev, fmt, cfg, batch, norm=True) and (
        stage_bytes(fmt, cfg, batch, norm=True) + 1024 + 256 * batch <= info.max_shared_memory)
    return cfg if cfg.unroll <= 16 and fits else None


def _glu_defines(dev: Device, glu: str) -> dict[str, int]:
    if glu not in GLU_ACTS:
        raise ValueError(f"the GLU_Q8 epilogue's activation is one of {GLU_ACTS}, got {glu!r}")
    # a block's 8 invocations meet through shuffles where every subgroup holds whole blocks (the launch's
    # workgroup is whole subgroups: _check_subgroup_rows)
    return ({"SUBGROUP_SHUFFLE": 1} if dev.info.min_subgroup_size >= 8 else {}) | (
        {"GELU_TANH": 1} if glu == "gelu_tanh" else {})


def matvec_glu_q8(dev: Device, weights: DeviceWeights, x: Any, batch: int = 1, *, gelu_tanh: bool = False,
                  act_dtype: str = "f32", out: Any | None = None, config: MatvecConfig | None = None) -> Any:
    """h = act(x W_gate^T) * (x W_up^T) from a stacked gate/up matrix [2F, K] (gate rows first; act SiLU, or the
    tanh GELU), written by the product's own epilogue (-DGLU_Q8) as the down product's int8 activations: returns
    the buffer `out` (or a new one) holding Q8Acts.layout(batch, F), the blocks norms.glu_q8 writes from matvec's
    output under the same launch. x as for `matvec` (float rows, a Q8Acts for the integer path, or NormedRows
    normalized in the prologue). `config`: a glu_config (its workgroups 64 rows in the subgroup-rows launch; for
    NormedRows a glu_norm_config); None chooses one, ValueError where none runs. Records one dispatch (and the
    activations' quantization where float rows take the integer path)."""
    n, k = weights.shape
    f = n // 2
    act_bytes = _check_act_dtype(act_dtype)
    if n % 64:
        raise ValueError(f"the GLU_Q8 epilogue takes a stacked gate/up matrix of 2F rows, F % 32 == 0; got {n} rows")
    if not 1 <= batch <= MAX_BATCH_SUBGROUP:
        raise ValueError(f"batch must be 1..{MAX_BATCH_SUBGROUP} for the GLU_Q8 epilogue, got {batch}")
    norm = isinstance(x, NormedRows)
    if isinstance(x, Q8Acts | NormedRows):
        x.check(batch, k)
    else:
        check_buffer("x", x, batch * k * act_bytes)
    if norm:
        _check_int_dot(dev, weights.format)
        cfg = config or glu_norm_config(dev, weights.format, f, k, batch)
    else:
        cfg = config or glu_config(dev, weights.format, f, k, batch, int_dot=True if isinstance(x, Q8Acts) else None)
    if cfg is None:
        raise ValueError(f"no GLU_Q8 launch on {dev.info.name} for F={f} (see glu_config, glu_norm_config)")
    if not cfg.tpr or cfg.rows_per_workgroup != 64 or 32 % cfg.rows:
        raise ValueError(f"the GLU_Q8 epilogue takes the subgroup-rows launch with 64 rows per workgroup in groups "
                         f"of a divisor of 32 rows, got {cfg}")
    if isinstance(x, Q8Acts) and not cfg.int_dot:
        raise ValueError("int8-quantized activations need the integer dot-product path (config.int_dot)")
    if out is None:
        out = dev.alloc(Q8Acts.layout(batch, f)[0])
    acts = Q8Acts.in_buffer(out, batch, f)
    kern = _kernel(dev, weights, cfg, batch, act_dtype, glu="gelu_tanh" if gelu_tanh else "silu",
                   norm_eps=x.eps if norm else None)
    _launch(dev, weights, cfg, kern, x, batch, act_dtype, acts.xq, grid_2d(dev, f // 32), glu=acts)
    return out


def glu_takes(fmt: QuantFormat, f: int, k: int, rows: int, int8: bool, norm: bool = False) -> bool:
    """Whether a stacked gate/up product [2f, k] of this format on the default device may write the down product's
    int8 activations itself for `rows` activation rows (int8: they come as a Q8Acts; norm: as NormedRows) in one
    matvec_glu_q8 call: rows within VKGRAPH_GLU_EPILOGUE (the most rows it takes; 0: never) and one call of the
    default launch, a glu_config (a glu_norm_config)."""
    dev = get_device()
    if not 1 <= rows <= min(flag("VKGRAPH_GLU_EPILOGUE"), rows_per_call(dev)):
        return False
    if norm:
        return takes_norm(fmt, rows, 2 * f, k) and glu_norm_config(dev, fmt, f, k, rows) is not None
    if int8 and not (fmt.name in INT_DOT_FORMATS and dev.info.integer_dot_product):
        return False
    return glu_config(dev, fmt, f, k, rows, int_dot=True if int8 else None) is not None


def _check_int_dot(dev: Device, fmt: QuantFormat) -> None:
    if fmt.name not in INT_DOT_FORMATS:
        raise ValueError(f"the integer dot-product path takes {INT_DOT_FORMATS}, not {fmt.name}")
    if not dev.info.integer_dot_product:
        raise ValueError(f"{dev.info.name} has no shaderIntegerDotProduct; use int_dot=False")


def quantize_activations(dev: Device, x: Any, rows: int, k: int, act_dtype: str = "f32") -> tuple[Any, Any, Any]:
    """x [rows, K] (float32, or float16 with act_dtype="f16") to int8 per block of 32 for the integer
    dot-product matvec: (xq: int8 [rows, K], xd: float32 scale max|x|/127 per block, xs: int32 sum of the
    int8 values of each half block, 16 values). K % 32 == 0. Records the dispatch; does not wait."""
    act_bytes = _check_act_dtype(act_dtype)
    if k % 32:
        raise ValueError(f"activations are quantized in blocks of 32: K % 32 == 0 needed, got K={k}")
    check_buffer("x", x, rows * k * act_bytes)
    n_blocks = rows * k // 32
    xq, xd, xs = dev.alloc(rows * k), dev.alloc(n_blocks * 4), dev.alloc(n_blocks * 8)
    wg = 64
    kern = catalog.compile(dev, "quantize_q8", spec={"WG": wg}, defines={"A_F16": 1} if act_dtype == "f16" else None)
    groups = grid_2d(dev, -(-n_blocks // wg))
    catalog.dispatch(dev, kern, [x, xq, xd, xs], groups, push={"n_blocks": n_blocks, "groups_x": groups[0]})
    return xq, xd, xs


Q8_ALIGN = 256  # bytes: each part of a Q8Acts buffer starts on this boundary (any device's storage alignment)


@dataclass(frozen=True)
class Q8Acts:
    """Activations [rows, K] quantized for the integer dot-product path, as quantize_activations returns them:
    xq (int8 [rows, K]), xd (float32 per block of 32), xs (int32 per 16 values), each a buffer or view."""

    xq: Any
    xd: Any
    xs: Any

    @staticmethod
    def layout(rows: int, k: int) -> tuple[int, tuple[int, int, int]]:
        """(bytes, offsets of xq, xd and xs) of the three parts of `rows` rows kept in one buffer."""
        sizes = (rows * k, rows * k // 8, rows * k // 4)
        offsets, at = [], 0
        for size in sizes:
            offsets.append(at)
            at += -(-size // Q8_ALIGN) * Q8_ALIGN
        return at, (offsets[0], offsets[1], offsets[2])

    @classmethod
    def in_buffer(cls, buf: Any, rows: int, k: int) -> Q8Acts:
        """The parts of `rows` rows in one buffer laid out by `layout`."""
        nbytes, (q, d, s) = cls.layout(rows, k)
        check_buffer("quantized activations", buf, nbytes)
        return cls(buf.view(q, rows * k), buf.view(d, rows * k // 8), buf.view(s, rows * k // 4))

    def rows(self, r0: int, count: int, k: int) -> Q8Acts:
        """Rows r0 .. r0 + count (views: their offsets keep the device's storage alignment where K % 256 == 0)."""
        return Q8Acts(self.xq.view(r0 * k, count * k), self.xd.view(r0 * k // 8, count * k // 8),
                      self.xs.view(r0 * k // 4, count * k // 4))

    def check(self, rows: int, k: int) -> None:
        if k % 32:
            raise ValueError(f"int8 activations come in blocks of 32: K % 32 == 0 needed, got K={k}")
        for name, buf, nbytes in (("xq", self.xq, rows * k), ("xd", self.xd, rows * k // 8),
                                  ("xs", self.xs, rows * k // 4)):
            check_buffer(name, buf, nbytes)


@dataclass(frozen=True)
class NormedRows:
    """Activations given as RMSNorm's input: float32 rows x [rows, K], the norm's weight `gain` (float32 [K]) and
    `eps`. The matvec takes x / sqrt(mean(x^2) + eps) * gain as its activations, normalized and quantized to int8
    blocks (as norms.rmsnorm_q8 writes them) by every workgroup in its prologue: no kernel runs between the
    residual stream and the product."""

    x: Any
    gain: Any
    eps: float

    def check(self, rows: int, k: int) -> None:
        if k % 32:
            raise ValueError(f"normalized rows are quantized in blocks of 32: K % 32 == 0 needed, got K={k}")
        check_buffer("x", self.x, rows * k * 4)
        check_buffer("gain", self.gain, k * 4)


def upload_experts(dev: Device, experts: list[QuantizedTensor]) -> DeviceWeights:
    """Copy E matrices of one format and shape [N, K] to one device buffer as [E*N, K], for `matvec_id`.

    Rows of every format are independent in the matvec layout, so stacking is row concatenation."""
    return upload_weights(dev, stacked_experts(experts))


def stacked_experts(experts: list[QuantizedTensor]) -> QuantizedTensor:
    """E matrices of one format and shape [N, K] as one [E*N, K] (what `upload_experts` uploads)."""
    if not experts:
        raise ValueError("upload_experts needs at least one matrix")
    fmt, shape = experts[0].format, experts[0].shape
    for e in experts:
        if e.format.name != fmt.name or e.shape != shape:
            raise ValueError(f"experts must share format and shape: {fmt.name} {shape} vs {e.format.name} {e.shape}")
    return stack_rows(experts)


def matvec_id(dev: Device, weights: DeviceWeights, n_experts: int, x: Any, ids: Any, n_pairs: int, *,
              x_div: int = 1, act_dtype: str = "f32", out: Any | None = None,
              config: MatvecConfig | None = None) -> Any:
    """y[p, n] = sum_k W_e[n, k] x[p // x_div, k] with e = ids[p], for p < n_pairs; returns y [n_pairs, N].

    `weights` holds n_experts matrices [N, K] stacked (`upload_experts`); ids are int32 [n_pairs] (values past
    the last expert read the last one); x holds n_pairs / x_div rows (x_div = k: the k slots of a token share
    its activations; 1: one row per pair). Records one dispatch; does not wait.
    """
    rows_all, k = weights.shape
    if n_experts < 1 or rows_all % n_experts:
        raise ValueError(f"{rows_all} stacked rows do not split into {n_experts} experts")
    n = rows_all // n_experts
    act_bytes = _check_act_dtype(act_dtype)
    if n_pairs < 1 or x_div < 1 or n_pairs % x_div:
        raise ValueError(f"n_pairs ({n_pairs}) must be a positive multiple of x_div ({x_div})")
    check_buffer("x", x, n_pairs // x_div * k * act_bytes)
    check_buffer("ids", ids, n_pairs * 4)
    if out is None:
        out = dev.alloc(n_pairs * n * 4)
    check_buffer("out", out, n_pairs * n * 4)
    cfg = config or choose_config(dev, weights.format, n, k, 1, subgroup_rows=False)
    groups = grid_2d(dev, n_pairs * -(-n // cfg.rows))
    if groups[1] > dev.info.max_workgroup_count[1]:
        raise ValueError(f"{n_pairs} pairs of {n} rows need more workgroups than the device launches")
    kern = _kernel(dev, weights, cfg, 1, act_dtype, expert_ids=True)
    _launch(dev, weights, cfg, kern, x, n_pairs // x_div, act_dtype, out, groups, ids=ids, n_pairs=n_pairs,
            x_div=x_div, n_experts=n_experts)
    return out

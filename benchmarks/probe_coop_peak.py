"""Ceilings of VK_KHR_cooperative_matrix on this device, measured, against the generated matmul and torch.matmul.

    python benchmarks/probe_coop_peak.py [--sms 132] [--reps 3] [--sections matmul,reg,shared,stage,all]

Hand-written GLSL compute kernels, built through the device's normal pipeline and timed through replayed command
graphs (benchmarks/common: every section's pipelines built and its graphs captured first, then the clocks raised),
in TFLOP/s (2 * M * N * K per fragment product), beside the fraction of the dense float16 datasheet peak
(PEAK_TFLOPS; int8: twice it, in TOPS) and of torch.matmul's float16 4096^3 rate in the same process (PyTorch on
CUDA, where it imports; timed first and again last, the clocks raised 3 s before each).

- matmul: matmul_coop's 4096^3 float16 product in its tile for that shape (TILE, the fastest of its search) and
  in MORE_TILES, and TILE on outputs of one and two tiles per multiprocessor (`--sms`): the second's time over the
  first's says whether two of its workgroups run at once on a multiprocessor (about 1x) or one (about 2x).
- reg: coopMatMulAdd with every fragment in registers: per subgroup a grid of 1..16 independent accumulators, its
  A and B fragments loaded once from memory; per trip of the loop each accumulator takes A * B, then -A * B (so
  random operands keep the sums bounded, at a real product's power draw). One workgroup of 1..16 subgroups per
  multiprocessor (the warps resident per multiprocessor are the subgroups), float16 x float16 + float32 16x16x16.
- shared: the A and B fragments loaded from shared memory at every 16-deep step, as matmul_coop's tile loads them
  (its rows padded by 16 bytes, operands row- or column-major, 32-deep slices), no global traffic: the fragment-load
  ceiling of the tile's subgroup grid; with the two barriers per slice of its one-stage configuration (or one),
  unpadded rows for comparison, other subgroup grids, and 128 x 128 tiles at one and two workgroups per
  multiprocessor, 32- and 64-deep slices. Each step's fragment offsets change with the trip, so no load leaves the
  loop.
- stage: the tile's global -> shared staging for the 4096^3 product alone (16-byte loads into registers, stores to
  its padded shared layout, its two barriers per slice, its grouped tile order), no multiplies: GB/s of staged
  bytes (every workgroup's, most from the L2) and the TFLOP/s the product would reach if the multiplies were free;
  with one slice in flight (the tile's) and two, a workgroup per tile or a set number per multiprocessor (each
  walking tiles), loads alone (no shared stores), and the 128 x 128 x 64 tile.
- all: every fragment shape the device lists at subgroup scope for float16, bfloat16 and int8 operands, at two
  grids, eight workgroups per multiprocessor (as many resident as fit).

A summary ends the output. On a device without cooperative matrices (lavapipe) it says so and exits.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import capture_graph, cuda_torch, raise_clocks, raise_torch_clocks, replay_many_us, torch_time_us  # noqa: E402

from vkgraph.codegen.matmul_coop import BF16_FRAGMENTS, GROUP_M, Config  # noqa: E402
from vkgraph.runtime import get_device  # noqa: E402

PEAK_TFLOPS = 989.5  # dense float16 with float32 accumulation, H100/H200 SXM datasheet; int8: twice it
TILE = Config(128, 256, 32, 2, 4, 1)  # matmul_coop's fastest 4096^3 tile on an H200 (benchmarks/RESULTS.md)
# the same with two slices in flight, and 64-deep slices of 128 x 128 (half the barriers per multiply; 8 accumulators
# a subgroup, so two workgroups may fit a multiprocessor)
MORE_TILES = (Config(128, 256, 32, 2, 4, 1, 2), Config(128, 128, 64, 2, 4, 1))
GLSL = {"float16": "float16_t", "bfloat16": "float16_t", "int8": "int8_t", "float32": "float", "int32": "int32_t"}
SIZE = {"float16": 2, "bfloat16": 2, "int8": 1, "float32": 4, "int32": 4}
SRC_UNITS = 4096  # 16-byte units of random operand data the probes load fragments from
ROW, COL = "gl_CooperativeMatrixLayoutRowMajor", "gl_CooperativeMatrixLayoutColumnMajor"


@dataclass(frozen=True)
class Frag:
    """A fragment shape: C (m x n, type acc) += A (m x k, type ab) * B (k x n)."""

    m: int
    n: int
    k: int
    ab: str
    acc: str

    def label(self) -> str:
        return f"{self.m}x{self.n}x{self.k} {self.ab}->{self.acc}"

    def flop(self) -> int:
        return 2 * self.m * self.n * self.k

    def types(self) -> tuple[str, str, str]:
        """GLSL spellings of the A, B and accumulator fragment types."""
        ab, acc = GLSL[self.ab], GLSL[self.acc]
        return (f"coopmat<{ab}, gl_ScopeSubgroup, {self.m}, {self.k}, gl_MatrixUseA>",
                f"coopmat<{ab}, gl_ScopeSubgroup, {self.k}, {self.n}, gl_MatrixUseB>",
                f"coopmat<{acc}, gl_ScopeSubgroup, {self.m}, {self.n}, gl_MatrixUseAccumulator>")


F16 = Frag(16, 16, 16, "float16", "float32")


def header(local: int, frag: Frag | None = None, shared: int = 0) -> list[str]:
    lines = ["#version 450"]
    exts = ["GL_KHR_memory_scope_semantics", "GL_KHR_shader_subgroup_basic"]
    if frag is not None:
        exts += ["GL_KHR_cooperative_matrix", "GL_EXT_shader_explicit_arithmetic_types_float16",
                 "GL_EXT_shader_explicit_arithmetic_types_int8", "GL_EXT_shader_explicit_arithmetic_types_int32"]
    lines += [f"#extension {e} : require" for e in exts]
    if frag is not None and frag.ab == "bfloat16":
        lines.append(BF16_FRAGMENTS)
    lines.append(f"layout(local_size_x = {local}) in;")
    if shared:
        lines.append(f"shared uvec4 sm[{shared}];")
    return lines


def _sum_store(f: Frag, names: list[str], at: str) -> list[str]:
    """Store the sum of accumulators `names` at 16-byte unit `at` of dst (so none is dead code)."""
    _, _, c_t = f.types()
    out = [f"{c_t} s = {names[0]};"] + [f"s = s + {n};" for n in names[1:]]
    return out + [f"coopMatStore(s, dst, {at}, {f.n * SIZE[f.acc] // 16}, {ROW});"]


def out_units(f: Frag) -> int:
    """16-byte units one subgroup's stored sum takes."""
    return f.m * f.n * SIZE[f.acc] // 16


def reg_source(f: Frag, nsub: int, gm: int, gn: int, sg: int) -> str:
    """gm x gn accumulators per subgroup over gm A (and gm negated A) and gn B fragments held in registers; per trip
    of `iters` every accumulator takes A * B then -A * B. src holds the A fragments at 0, their negations at
    a_units * 4, the B fragments at a_units * 8 (16-byte units)."""
    a_t, b_t, c_t = f.types()
    isz = SIZE[f.ab]
    a_units, a_stride = f.m * f.k * isz // 16, f.k * isz // 16
    # B row-major where its rows are whole 16-byte units, else column-major (int8 16x8x32: 8-byte rows)
    b_col = f.n * isz % 16 != 0
    b_units, b_stride = f.k * f.n * isz // 16, (f.k if b_col else f.n) * isz // 16
    zero = "0" if f.acc == "int32" else "0.0"
    lines = header(nsub * sg, f) + [
        "layout(set = 0, binding = 0) readonly buffer Src { uvec4 src[]; };",
        "layout(set = 0, binding = 1) writeonly buffer Dst { uvec4 dst[]; };",
        "layout(push_constant) uniform Push { uint iters; };",
        "void main() {",
        f"uint sub = gl_WorkGroupID.x * {nsub}u + gl_SubgroupID;"]
    # one declaration a statement: NVIDIA's 580 driver crashed on several coopmat variables in one (matmul_coop)
    for i in range(gm):
        lines += [f"{a_t} a{i};", f"coopMatLoad(a{i}, src, {i * a_units}, {a_stride}, {ROW});",
                  f"{a_t} n{i};", f"coopMatLoad(n{i}, src, {(4 + i) * a_units}, {a_stride}, {ROW});"]
    for j in range(gn):
        lines += [f"{b_t} b{j};",
                  f"coopMatLoad(b{j}, src, {8 * a_units + j * b_units}, {b_stride}, {COL if b_col else ROW});"]
    acc = [f"c{i}_{j}" for i in range(gm) for j in range(gn)]
    lines += [f"{c_t} {c} = {c_t}({zero});" for c in acc]
    lines.append("for (uint it = 0u; it < iters; it++) {")
    for a in ("a", "n"):
        lines += [f"c{i}_{j} = coopMatMulAdd({a}{i}, b{j}, c{i}_{j});" for i in range(gm) for j in range(gn)]
    lines.append("}")
    lines += _sum_store(f, acc, f"sub * {out_units(f)}u")
    return "\n".join(lines + ["}"]) + "\n"


@dataclass(frozen=True)
class SharedTile:
    """A tile's shared layout and subgroup grid for the shared-memory probe: wm x wn subgroups each with gm x gn
    16x16 accumulators, a BK-deep slice of A (BM x BK) and B (BK x BN), each row- or column-major, rows padded by
    `pad` float16 values (matmul_coop: 8), `barriers` per slice (matmul_coop's one-stage tiles: 2)."""

    wm: int
    wn: int
    gm: int
    gn: int
    a_col: bool = False
    b_col: bool = False
    pad: int = 8
    barriers: int = 0
    bk: int = 32

    @property
    def bm(self) -> int:
        return self.wm * self.gm * 16

    @property
    def bn(self) -> int:
        return self.wn * self.gn * 16

    def label(self) -> str:
        lay = f"A {'col' if self.a_col else 'row'}, B {'col' if self.b_col else 'row'}"
        return (f"{self.bm}x{self.bn}x{self.bk} {self.wm}x{self.wn} subgroups of {self.gm}x{self.gn}, {lay}"
                f"{'' if self.pad else ', unpadded'}{f', {self.barriers} barriers/slice' if self.barriers else ''}")

    def layout(self, edge: int, col: bool, a: bool) -> tuple[int, int]:
        """(rows, row stride in 16-byte units) of an operand's slice with `edge` rows (A) or columns (B) across
        K; as matmul_coop lays them out: rows run along K when A is row-major or B column-major."""
        along_k = col != a
        inner = self.bk if along_k else edge
        return (edge if along_k else self.bk), (inner + self.pad) // 8

    def flop_per_trip(self) -> int:
        return self.wm * self.wn * self.gm * self.gn * (self.bk // 16) * F16.flop()


def shared_source(t: SharedTile, sg: int) -> str:
    """Per trip of `iters`, every 16-deep step of the slice: each subgroup loads its gm A and gn B fragments from
    shared memory (at offsets as matmul_coop computes them) and multiplies every pair; the slice's steps are taken
    in an order that alternates with the trip (so the loads depend on it). Shared memory is filled once from src."""
    a_t, b_t, c_t = F16.types()
    nsub = t.wm * t.wn
    a_rows, a_stride = t.layout(t.bm, t.a_col, True)
    b_rows, b_stride = t.layout(t.bn, t.b_col, False)
    a_size = a_rows * a_stride
    smem = a_size + b_rows * b_stride
    steps = t.bk // 16
    lines = header(nsub * sg, F16, smem) + [
        "layout(set = 0, binding = 0) readonly buffer Src { uvec4 src[]; };",
        "layout(set = 0, binding = 1) writeonly buffer Dst { uvec4 dst[]; };",
        "layout(push_constant) uniform Push { uint iters; };",
        "void main() {",
        "int lid = int(gl_LocalInvocationID.x);",
        "int sgid = int(gl_SubgroupID);",
        f"for (int e = lid; e < {smem}; e += {nsub * sg}) sm[e] = src[e % {SRC_UNITS}];",
        "barrier();",
        f"int arow = (sgid / {t.wn}) * {t.gm * 16};",
        f"int bcol = (sgid % {t.wn}) * {t.gn * 16};"]
    acc = [f"c{i}_{j}" for i in range(t.gm) for j in range(t.gn)]
    lines += [f"{c_t} {c} = {c_t}(0.0);" for c in acc]
    lines += ["for (uint it = 0u; it < iters; it++) {", f"int k0 = int(it % {steps}u) * 16;"]
    for s in range(steps):
        kk = f"((k0 + {s * 16}) % {t.bk})"
        lines.append(f"int kk{s} = {kk};")
        for i in range(t.gm):
            row = f"(arow + {i * 16})"
            at = f"kk{s} * {a_stride} + ({row} >> 3)" if t.a_col else f"{row} * {a_stride} + (kk{s} >> 3)"
            lines += [f"{a_t} fa{s}_{i};", f"coopMatLoad(fa{s}_{i}, sm, {at}, {a_stride}, {COL if t.a_col else ROW});"]
        for j in range(t.gn):
            col = f"(bcol + {j * 16})"
            at = f"{col} * {b_stride} + (kk{s} >> 3)" if t.b_col else f"kk{s} * {b_stride} + ({col} >> 3)"
            lines += [f"{b_t} fb{s}_{j};",
                      f"coopMatLoad(fb{s}_{j}, sm, {a_size} + {at}, {b_stride}, {COL if t.b_col else ROW});"]
        lines += [f"c{i}_{j} = coopMatMulAdd(fa{s}_{i}, fb{s}_{j}, c{i}_{j});"
                  for i in range(t.gm) for j in range(t.gn)]
    lines += ["barrier();"] * t.barriers + ["}"]
    lines += _sum_store(F16, acc, f"(gl_WorkGroupID.x * {nsub}u + gl_SubgroupID) * {out_units(F16)}u")
    return "\n".join(lines + ["}"]) + "\n"


def stage_source(cfg: Config, size: int, sg: int, pf: int = 1, store: bool = True) -> str:
    """cfg's global -> shared staging of a size^3 float16 product, A and B row-major, without multiplies: per slice
    each invocation reads its 16-byte chunks of A and B, and (store) after a barrier writes them to matmul_coop's
    padded layout, then reads one chunk back after a second barrier; pf slices in flight in registers. The tiles are
    taken in matmul_coop's grouped order, workgroup w taking tiles w, w + groups, .. (one each when dispatched with
    as many workgroups as tiles; with one per multiprocessor, the occupancy of a tile that fits once)."""
    nt = cfg.wm * cfg.wn * sg
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    a_stride, b_stride = (bk + 8) // 8, (bn + 8) // 8
    a_size = bm * a_stride
    smem = a_size + bk * b_stride
    per_a, per_b = bm * bk // 8 // nt, bk * bn // 8 // nt
    tiles_m, tiles_n, nk, row = size // bm, size // bn, size // bk, size // 8
    lines = header(nt, None, smem if store else 0) + [
        "layout(set = 0, binding = 0) readonly buffer A { uvec4 a[]; };",
        "layout(set = 0, binding = 1) readonly buffer B { uvec4 b[]; };",
        "layout(set = 0, binding = 2) writeonly buffer Dst { uvec4 dst[]; };",
        "void main() {",
        "int lid = int(gl_LocalInvocationID.x);",
        "uvec4 x = uvec4(0u);",
        f"for (int grp = int(gl_WorkGroupID.x); grp < {tiles_m * tiles_n}; grp += int(gl_NumWorkGroups.x)) {{",
        f"int gfirst = (grp / {GROUP_M * tiles_n}) * {GROUP_M};",
        f"int gsize = min({tiles_m} - gfirst, {GROUP_M});",
        "int tm = gfirst + (grp % gsize);",
        f"int tn = (grp % {GROUP_M * tiles_n}) / gsize;"]
    sets = ("r", "q")[:pf]
    for s in sets:
        lines += [f"uvec4 {s}a{c};" for c in range(per_a)] + [f"uvec4 {s}b{c};" for c in range(per_b)]

    # per operand: (name, chunks an invocation, 16-byte chunks a row of its slice, the slice's first row and column
    # in the global matrix (GLSL, of the slice kt), its offset and row stride in shared memory)
    operands = (("a", per_a, bk // 8, lambda kt: f"tm * {bm}", lambda kt: f"({kt}) * {bk // 8}", "", a_stride),
                ("b", per_b, bn // 8, lambda kt: f"({kt}) * {bk}", lambda kt: f"tn * {bn // 8}", f"{a_size} + ",
                 b_stride))

    def load(s: str, kt: str) -> list[str]:
        return [f"{s}{op}{c} = {op}[({row0(kt)} + (lid + {c * nt}) / {w}) * {row} + {col0(kt)} "
                f"+ (lid + {c * nt}) % {w}];" for op, per, w, row0, col0, _, _ in operands for c in range(per)]

    def use(s: str) -> list[str]:
        if not store:
            return [f"x ^= {s}{op}{c};" for op, per, *_ in operands for c in range(per)]
        return [f"sm[{at}((lid + {c * nt}) / {w}) * {stride} + (lid + {c * nt}) % {w}] = {s}{op}{c};"
                for op, per, w, _, _, at, stride in operands for c in range(per)]

    def step(kt: str, s: str) -> list[str]:
        """Slice kt (in registers s) used; slice kt + pf read into s. The chunk read back is another invocation's
        first A chunk of the slice (a slot every step writes: the padding is never written, so reading it would
        make the result depend on what shared memory held before)."""
        back = f"((lid * 5 + {kt}) % {nt})"
        read_back = ["barrier();", f"x ^= sm[{back} / {bk // 8} * {a_stride} + {back} % {bk // 8}];"] if store else []
        return (["barrier();"] if store else []) + use(s) + [f"if ({kt} + {pf} < {nk}) {{"] + \
            load(s, f"{kt} + {pf}") + ["}"] + read_back

    for i, s in enumerate(sets):
        lines += load(s, str(i))
    if pf == 1:
        lines += [f"for (int kt = 0; kt < {nk}; kt++) {{"] + step("kt", "r") + ["}"]
    else:
        lines += [f"for (int kt = 0; kt < {nk}; kt += 2) {{"] + step("kt", "r") + [f"if (kt + 1 < {nk}) {{"] + \
            step("(kt + 1)", "q") + ["}", "}"]
    lines += ["}", f"dst[gl_WorkGroupID.x * {nt} + lid] = x;"]
    return "\n".join(lines + ["}"]) + "\n"


def operand_bytes(f: Frag, rng: np.random.Generator) -> np.ndarray:
    """src for reg_source: 4 A fragments, their negations, 4 B fragments, random values of f's operand type."""
    na, nb = 4 * f.m * f.k, 4 * f.k * f.n
    if f.ab == "int8":
        vals = rng.integers(-64, 64, na + nb, dtype=np.int8)
    else:
        vals = rng.uniform(-1, 1, na + nb).astype(ml_dtypes.bfloat16 if f.ab == "bfloat16" else np.float16)
    a, b = vals[:na], vals[na:]
    return np.concatenate([a, -a, b]).view(np.uint8)


@dataclass
class Variant:
    label: str
    flop: float  # per call
    run: Callable[[], object]
    peak: float = PEAK_TFLOPS
    note: str = ""
    unit: str = "TFLOP/s"


def _iters(flop_target: float, per_trip: float) -> int:
    return max(1, round(flop_target / per_trip))


def time_section(dev: Any, title: str, variants: list[Variant], reps: int, per_graph: int,
                 torch_tf: float | None) -> dict[str, float]:
    """Capture every variant's graph (their pipelines are built by then), raise the clocks, replay all in turn and
    print each one's rate; returns the rates by label."""
    graphs = {v.label: capture_graph(dev, v.run, per_graph) for v in variants}
    try:
        raise_clocks(1.0)
        us = replay_many_us(dev, graphs, reps, per_graph)
    finally:
        for g in graphs.values():
            g.destroy()
    print(f"\n== {title}", flush=True)
    rates = {}
    for v in variants:
        rate = v.flop / us[v.label] / 1e6
        rates[v.label] = rate
        vs_torch = f"  {rate / torch_tf:5.2f}x torch" if torch_tf else ""
        print(f"{v.label:<76s} {rate:7.1f} {v.unit} {100 * rate / v.peak:5.1f}% of peak{vs_torch}"
              f"  ({us[v.label]:.0f} us){'  ' + v.note if v.note else ''}", flush=True)
    return rates


def matmul_variants(dev: Any, sms: int) -> list[Variant]:
    """matmul_coop's program for 4096^3 in TILE and in the other tiles whose ceilings the probes measure
    (MORE_TILES), and in TILE for outputs of sms and 2 * sms tiles (K 4096)."""
    from vkgraph import graph, realize
    from vkgraph.codegen import matmul_coop
    from vkgraph.dtype import dtypes
    from vkgraph.schedule import Kernel
    from vkgraph.view import ShapeTracker

    lim = realize.limits()
    rng = np.random.default_rng(0)
    d = dtypes.float16
    out = []
    tm = 4  # output tile rows per column of tiles in the occupancy shapes: sms / 4 columns (132: 33)
    tn = sms // tm
    for label, m, n, cfg in ([("4096^3", 4096, 4096, TILE), (f"{tm * tn} tiles", tm * TILE.bm, tn * TILE.bn, TILE),
                              (f"{2 * tm * tn} tiles", 2 * tm * TILE.bm, tn * TILE.bn, TILE)]
                             + [("4096^3", 4096, 4096, c) for c in MORE_TILES]):
        k = 4096
        srcs = [graph.buffer(realize.upload(rng.standard_normal(s, dtype=np.float32), d), 0, d, s)
                for s in ((m, k), (k, n))]
        mm = graph.matmul(srcs[0], srcs[1], d)
        kern = Kernel(mm, realize.allocate(d, mm.numel), ShapeTracker.contiguous(mm.shape))
        lowered = matmul_coop.lower_coop(kern, mm, lim, {}, cfg, d)
        steps = [(dev.pipeline(p.src, name=p.name), [ref.buf for ref, _, _ in p.bindings], p.groups, p.push or None)
                 for p in lowered.programs]
        out.append(Variant(f"matmul_coop {label}: {m}x{k} @ {k}x{n}, {cfg.label()}", 2 * m * n * k,
                           lambda steps=steps: [dev.dispatch(*st) for st in steps]))
    return out


def torch_rate(torch: Any, when: str) -> float:
    """torch.matmul's float16 4096^3 TFLOP/s (CUDA events, clocks raised for 3 s first), printed."""
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    raise_torch_clocks(torch, 3.0)
    rate = 2 * 4096**3 / torch_time_us(torch, lambda: x @ x, 20) / 1e6
    print(f"torch.matmul float16 4096^3 ({when}): {rate:.1f} TFLOP/s ({100 * rate / PEAK_TFLOPS:.1f}% of "
          f"{PEAK_TFLOPS})", flush=True)
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sms", type=int, default=132, help="multiprocessors (H200: 132)")
    ap.add_argument("--reps", type=int, default=3, help="rounds of replays (median)")
    ap.add_argument("--flop", type=float, default=2e12, help="work per call of each probe kernel")
    ap.add_argument("--sections", default="matmul,reg,shared,stage,all")
    a = ap.parse_args()
    sections = a.sections.split(",")
    dev = get_device()
    info = dev.info
    shapes = [s for s in info.cooperative_matrix if s.scope == "subgroup"]
    if not shapes:
        print(f"{info.name}: no cooperative matrices (VK_KHR_cooperative_matrix); nothing to measure")
        return
    sg = info.subgroup_size
    print(f"{info.name}: subgroup {sg}, shared memory per workgroup {info.max_shared_memory} bytes; "
          f"{a.sms} multiprocessors assumed; fragments: " + "; ".join(str(s) for s in shapes), flush=True)
    rng = np.random.default_rng(0)

    torch = cuda_torch()
    torch_tf = torch_rate(torch, "first") if torch is not None else None
    if torch is None:
        print("torch with CUDA not importable: no torch column")

    bufs = []

    def buf(data: np.ndarray | int) -> Any:
        b = dev.alloc(data if isinstance(data, int) else data.nbytes)
        if not isinstance(data, int):
            dev.upload(b, data)
        bufs.append(b)
        return b

    src16 = buf(rng.uniform(-1, 1, SRC_UNITS * 8).astype(np.float16))
    dst = buf(64 << 20)

    def reg_variant(f: Frag, nsub: int, gm: int, gn: int, groups: int, src: Any) -> Variant:
        kern = dev.pipeline(reg_source(f, nsub, gm, gn, sg), name=f"coop_reg_{nsub}_{gm}x{gn}")
        assert groups * nsub * out_units(f) * 16 <= dst.size
        iters = _iters(a.flop, groups * nsub * gm * gn * 2 * f.flop())
        flop = float(groups * nsub * gm * gn * 2 * f.flop() * iters)
        int8 = f.ab == "int8"
        return Variant(f"{f.label()}: {nsub} subgroups x {gm}x{gn} accumulators, {groups // a.sms}/SM",
                       flop, lambda: dev.dispatch(kern, [src, dst], (groups, 1, 1), push={"iters": iters}),
                       2 * PEAK_TFLOPS if int8 else PEAK_TFLOPS, unit="TOPS" if int8 else "TFLOP/s")

    summary: list[tuple[str, float]] = []  # (what, TFLOP/s): the ceilings beside the product, printed last
    try:
        if "matmul" in sections:
            vs = matmul_variants(dev, a.sms)
            rates = time_section(dev, "matmul_coop, float16 (TFLOP/s)", vs, a.reps, 10, torch_tf)
            one, two = (rates[v.label] for v in vs[1:3])
            print(f"twice the tiles took {2 * one / two:.2f}x the time (1.0: two workgroups of the tile run at once on "
                  "a multiprocessor; 2.0: one)")
            summary += [(v.label, rates[v.label]) for i, v in enumerate(vs) if i == 0 or i > 2]
        if "reg" in sections:
            src = buf(operand_bytes(F16, rng))
            grids = [(1, 1), (1, 2), (2, 2), (2, 4), (4, 4)]
            vs = [reg_variant(F16, nsub, gm, gn, a.sms, src) for nsub in (1, 2, 4, 8, 16) for gm, gn in grids
                  if nsub * gm * gn <= 128]
            rates = time_section(dev, "fragments in registers, one workgroup per multiprocessor", vs, a.reps, 2,
                                 torch_tf)
            best = max(rates, key=rates.get)
            tile_like = next(v.label for v in vs if ": 8 subgroups x 4x4" in v.label)
            summary += [(f"registers, best: {best}", rates[best]),
                        ("registers, as the tile's subgroups: " + tile_like, rates[tile_like])]
        if "shared" in sections:
            # (tile, workgroups per multiprocessor): TILE's subgroups first, then its barriers (one per slice as
            # in two-stage tiles, two as in one-stage ones), then MORE_TILES' 128 x 128 subgroups: with 32- and
            # 64-deep slices, one and two workgroups a multiprocessor (whether a second hides the barriers)
            tiles = [(SharedTile(2, 4, 4, 4), (1, 4)), (SharedTile(2, 4, 4, 4, barriers=2), (1,)),
                     (SharedTile(2, 4, 4, 4, barriers=1), (1,)), (SharedTile(2, 4, 4, 4, b_col=True), (1,)),
                     (SharedTile(2, 4, 4, 4, a_col=True), (1,)), (SharedTile(2, 4, 4, 4, pad=0), (1,)),
                     (SharedTile(2, 2, 4, 4), (1,)), (SharedTile(4, 4, 2, 4), (1,)), (SharedTile(4, 2, 4, 4), (1,)),
                     (SharedTile(2, 4, 4, 2), (1, 2)), (SharedTile(2, 4, 4, 2, barriers=2), (1, 2)),
                     (SharedTile(2, 4, 4, 2, barriers=2, bk=64), (1, 2))]
            vs = []
            for t, per_sms in tiles:
                kern = dev.pipeline(shared_source(t, sg), name="coop_shared")
                for per_sm in per_sms:
                    groups = per_sm * a.sms
                    iters = _iters(a.flop, groups * t.flop_per_trip())
                    vs.append(Variant(f"{t.label()}, {per_sm}/SM", float(groups * t.flop_per_trip() * iters),
                                      lambda kern=kern, groups=groups, iters=iters: dev.dispatch(
                                          kern, [src16, dst], (groups, 1, 1), push={"iters": iters})))
            rates = time_section(dev, "fragments loaded from shared memory every step, float16 -> float32 16x16x16",
                                 vs, a.reps, 2, torch_tf)
            summary += [(f"shared memory: {v.label}", rates[v.label]) for v in vs
                        if v is vs[0] or "barrier" in v.label]
        if "stage" in sections:
            size = 4096
            a_op = buf(rng.uniform(-1, 1, size * size).astype(np.float16))
            b_op = buf(rng.uniform(-1, 1, size * size).astype(np.float16))
            vs, staged_by = [], {}
            # (tile, slices in flight, shared stores, workgroups per multiprocessor: 0 for one per tile, as many
            # resident as fit)
            for cfg, pf, store, per_sm in ((TILE, 1, True, 0), (TILE, 1, True, 1), (TILE, 2, True, 1),
                                           (TILE, 2, True, 0), (TILE, 1, False, 1), (MORE_TILES[1], 1, True, 1),
                                           (MORE_TILES[1], 1, True, 2), (MORE_TILES[1], 1, True, 0)):
                tiles = (size // cfg.bm) * (size // cfg.bn)
                staged = tiles * size * (cfg.bm + cfg.bn) * 2
                groups = per_sm * a.sms or tiles
                kern = dev.pipeline(stage_source(cfg, size, sg, pf, store), name="coop_stage")
                what = (f"{'loads and shared stores' if store else 'loads alone'}, {pf} slice(s) in flight, "
                        f"{f'{per_sm}/SM' if per_sm else 'a workgroup per tile'}")
                staged_by[f"staging {size}^3 in {cfg.label()}: {what}"] = staged
                vs.append(Variant(f"staging {size}^3 in {cfg.label()}: {what}", 2.0 * size**3,
                                  lambda kern=kern, groups=groups: dev.dispatch(kern, [a_op, b_op, dst],
                                                                                (groups, 1, 1)),
                                  note=f"{staged / 1e9:.2f} GB staged a call"))
            rates = time_section(dev, "staging alone: TFLOP/s if the multiplies were free", vs, a.reps, 10, torch_tf)
            for v in vs:
                print(f"{v.label}: {staged_by[v.label] / (2.0 * size**3 / rates[v.label] / 1e6) / 1e3:.0f} GB/s "
                      "staged")
            summary += [(f"staging alone: {v.label}", rates[v.label]) for v in vs[:3]]
        if "all" in sections:
            vs = []
            for s in shapes:
                if s.a != s.b or s.a not in ("float16", "bfloat16", "int8") or s.c != s.result:
                    continue
                f = Frag(s.m, s.n, s.k, s.a, s.c)
                src = buf(operand_bytes(f, rng))
                vs += [reg_variant(f, nsub, gm, gn, 8 * a.sms, src) for nsub, gm, gn in ((4, 2, 4), (8, 4, 4))]
            time_section(dev, "every listed fragment shape, fragments in registers (int8: TOPS, of twice the peak)",
                         vs, a.reps, 2, torch_tf)
        if torch is not None:
            summary += [("torch.matmul 4096^3, first", torch_tf), ("torch.matmul 4096^3, last",
                                                                     torch_rate(torch, "last"))]
        vs_first = ", of torch.matmul 4096^3, first" if torch_tf else ""
        print(f"\n== summary, float16 TFLOP/s (of {PEAK_TFLOPS}{vs_first})")
        for what, rate in summary:
            vs_torch = f"  {rate / torch_tf:5.2f}x" if torch_tf else ""
            print(f"{what:<100s} {rate:7.1f} {100 * rate / PEAK_TFLOPS:5.1f}%{vs_torch}")
    finally:
        dev.synchronize()
        for b in bufs:
            b.release()


if __name__ == "__main__":
    main()

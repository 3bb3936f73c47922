"""Kernels to GLSL programs: how an iteration space maps onto workgroups, and the kernel bodies.

Three shapes of kernel:

- elementwise: one invocation per output element (several for large outputs), or per 4 elements moved as
  vec4 when every access is contiguous and 4-aligned; dispatch folded into y/z when the group count passes
  the device's limit;
- reduce: each output row (the reduced axes of one output position) is handled by one workgroup, whose
  invocations stride over the row and combine with subgroup arithmetic and a small shared array (or a
  shared-memory tree where the device lacks it), or by one invocation when rows are
  short and many. The reductions of a kernel run one after another over the same row, then the epilogue
  writes either one value per row or walks the row again. A row too long for one workgroup, with few
  rows, is split into two programs: partial results per chunk, then a reduction of the partials;
- matmul: 128x128 output tiles per workgroup with 8x8 results per invocation (64x64 with 4x4 for small sides),
  16-deep slices of both inputs staged through shared memory, accumulation in float32 (or the integer type),
  then the elementwise epilogue; on cooperative matrices where the device has them (matmul_coop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from ..caches import LRU
from ..dtype import DType, dtypes, max_value, min_value
from ..flags import flag
from ..graph import (
    ELEMENTWISE,
    BufferRef,
    Node,
    Op,
    ReduceOp,
    argkey,
    buffer,
    const,
    gather,
    iota,
    movement,
    reduce,
    runtime_values,
    substitute,
)
from ..graph import alu as alu_node
from ..schedule import Kernel
from ..view import Shape, ShapeTracker, View, prod, strides_for
from . import glsl, matmul_coop, symbolic
from .render import MAX_PUSH_FLOATS, MAX_PUSH_OFFSETS, PUSH_BYTES, RESERVED_FIELDS, Renderer, header
from .symbolic import Expr, Var, lit, unravel

GROUP_ID = "int(gl_WorkGroupID.x + gl_NumWorkGroups.x * (gl_WorkGroupID.y + gl_NumWorkGroups.y * gl_WorkGroupID.z))"
GROUP_ID64 = ("(int64_t(gl_WorkGroupID.x) + int64_t(gl_NumWorkGroups.x) * (int64_t(gl_WorkGroupID.y) + "
              "int64_t(gl_NumWorkGroups.y) * int64_t(gl_WorkGroupID.z)))")


@dataclass(frozen=True)
class Limits:
    """The device limits codegen respects (read from the runtime's DeviceInfo)."""

    max_invocations: int = 256
    max_group_count: tuple[int, int, int] = (65535, 65535, 65535)
    max_shared: int = 16384
    max_storage_range: int = 1 << 27
    max_buffers: int = 32  # storage buffers one generated kernel may bind
    # subgroup reductions need the arithmetic ops; the size range bounds how many subgroups a workgroup holds
    subgroup_arith: bool = False
    min_subgroup: int = 1
    max_subgroup: int = 1
    int64: bool = True  # shaderInt64: index arithmetic past 2^31 needs it
    # IEEE results as numpy's (VKGRAPH_IEEE, on by default): float temporaries marked `precise` and special float
    # constants hidden from the compiler (render.Renderer), and the float controls of glsl.FLOAT_MODES that the
    # device honours
    precise: bool = True
    float_modes: tuple[str, ...] = ()
    # cooperative matrices at subgroup scope, as (M, N, K, A, B, C, result) type names (empty: none); the
    # subgroup size they run at; the device (a key of tuned matmul tiles); 16-bit compute asked for float32
    # products ("float16" or "bfloat16": VKGRAPH_MATMUL_F32_COMPUTE), else "" (exact float32); the measured tile
    # configurations of this device, (shape class, (BM, BN, BK, WM, WN, stages)) (codegen.tune), which realize fills in
    coop: tuple[tuple[int, int, int, str, str, str, str], ...] = ()
    subgroup: int = 1
    device: str = ""
    f32_compute: str = ""
    tuned: tuple[tuple[str, tuple[int, ...]], ...] = ()

    # Drivers such as NVIDIA's report ~2^32 bindings per stage; a fused kernel never profits from more than
    # a few dozen, and descriptor sets that large cost more to write than the extra kernel launch.
    BINDING_CAP = 64

    def __hash__(self) -> int:
        # remembered (the generated one hashes every field, ~0.4 us): every realize hashes the limits twice, in
        # the key of its plan
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple([getattr(self, f.name) for f in fields(self)]))
            object.__setattr__(self, "_hash", h)
        return h

    @staticmethod
    def from_info(info: object) -> Limits:
        ieee = bool(flag("VKGRAPH_IEEE"))
        modes = tuple(m for m in glsl.FLOAT_MODES if m in info.float_controls) if ieee else ()
        coop = tuple((s.m, s.n, s.k, s.a, s.b, s.c, s.result) for s in getattr(info, "cooperative_matrix", ())
                     if s.scope == "subgroup" and not s.saturating)
        if not info.float16:  # the fragments are declared as float16_t
            coop = ()
        if not info.int8:  # 8-bit integer fragments need 8-bit arithmetic types in the shader
            coop = tuple(c for c in coop if not {"int8", "uint8"} & set(c[3:5]))
        return Limits(int(info.max_workgroup_invocations), tuple(int(x) for x in info.max_workgroup_count),
                      int(info.max_shared_memory), int(info.max_storage_buffer_range),
                      min(int(info.max_storage_buffers), Limits.BINDING_CAP),
                      "arithmetic" in info.subgroup_ops, int(info.min_subgroup_size), int(info.max_subgroup_size),
                      bool(info.int64), ieee, modes, coop, int(info.subgroup_size),
                      f"{info.name}/{info.driver_version}")


@dataclass
class Program:
    name: str
    src: str
    bindings: list[tuple[BufferRef, int, int | None]]  # per binding: buffer, byte offset, bytes (None: all)
    groups: tuple[int, int, int]
    push: dict[str, Any] = field(default_factory=dict)
    params: tuple[tuple[str, int, int], ...] = ()  # (push field, index in Lowered.leaves, which of its values)
    # for a kernel whose outer extent is a run-time value: (its push field, units per outer index, units per
    # workgroup), from which each run sets the field and the group count
    rows: tuple[str, int, int] | None = None


@dataclass
class Lowered:
    programs: list[Program]
    scratch: list[BufferRef]  # buffers the programs share, to allocate before and release after
    leaves: list[Node] = field(default_factory=list)  # the kernel's leaves whose values are push constants
    baked: list[Node] = field(default_factory=list)  # float constants with runtime values, compiled in instead


def fold_groups(total: int, lim: Limits) -> tuple[int, int, int]:
    """Spread a 1-D group count over x, y and z within the device's per-dimension limits."""
    mx, my, mz = lim.max_group_count
    if total <= mx:
        return (max(total, 1), 1, 1)
    gy = math.ceil(total / mx)
    if gy <= my:
        return (mx, gy, 1)
    gz = math.ceil(gy / my)
    if gz > mz:
        raise ValueError(f"{total} workgroups exceed the device's dispatch limits {lim.max_group_count}")
    return (mx, my, gz)


def _finish(r: Renderer, name: str, local: int, groups: int, lim: Limits, shared: list[str] = (),
            rows: tuple[str, int, int] | None = None) -> Program:
    body = "\n".join(r.lines)
    src = header(r, (local, 1, 1), list(shared)) + "\nvoid main() {\n" + body + "\n}\n"
    if not lim.int64 and "int64_t" in src:
        raise OverflowError(f"kernel {name} indexes past 2^31 elements, which needs 64-bit integers (shaderInt64); "
                            "this device lacks them: split the work into smaller tensors")
    return Program(name, src, [(ref, off, n) for ref, _, off, n in r.pieces()], fold_groups(groups, lim),
                   {n: v for n, _, v in r.push}, tuple(r.param_fields), rows)


def _renderer(lim: Limits, params: dict[int, int]) -> Renderer:
    return Renderer(lim.max_storage_range, params, lim.precise, lim.float_modes)


def _wg(lim: Limits, want: int = 256) -> int:
    """The largest power-of-two workgroup size up to `want` that the device allows."""
    return 1 << (max(min(want, lim.max_invocations), 1).bit_length() - 1)


# ---- a run-time outer extent -------------------------------------------------------------------------------------

# The outer extent a kernel with a run-time one is rendered with: index bounds then hold for every real extent
# (below it), so no simplification depends on the real one, and no literal of it reaches the shader. A kernel whose
# rows are longer takes less (the largest extent whose elements a 32-bit index reaches), so its index arithmetic
# stays 32-bit; the real extent must be below it.
OUTER = (1 << 28) - 57
_STATIC_OPS = {Op.MATMUL, Op.GATHER, Op.IOTA, Op.RAND, Op.CUSTOM, Op.CONTIGUOUS}


@dataclass
class _Dynamic:
    """How to render a kernel whose outer extent (the first axis of its iteration space: the rows of a model's
    activations) is the push constant `n_rows`. Nodes whose first axis is that extent render with OUTER there
    (`shapes`), their views with OUTER and strides that follow from the inner sizes (`sts`); buffers whose size
    follows the extent are `refs`. Everything else renders and keys as it is."""

    rows: int
    shapes: dict[Node, Shape]
    sts: dict[Node, ShapeTracker]
    refs: set[int]

    def shape(self, n: Node) -> Shape:
        return self.shapes.get(n, n.shape)

    def renderer(self, r: Renderer) -> Renderer:
        r.shapes, r.sts = self.shapes, self.sts
        return r

    def units(self, r: Renderer, per: int, per_group: int) -> tuple[str, tuple[str, int, int]]:
        """GLSL for rows * per (the elements, vec4s or output rows the kernel covers), and Program.rows."""
        field_ = r.push_const("int", self.rows, "n_rows")
        return r.define("int", f"{field_} * {per}", "units"), (field_[3:], per, per_group)


def _dynamic_view(n: Node, rows: int, outer: int) -> ShapeTracker | None:
    """The stand-in view of n (whose first axis is the rows), or None where its layout depends on the rows.

    Along the rows a view either walks whole rows of a source whose first axis is the rows too (stride: the
    source's row size) or repeats one source for every row (stride 0). With one row the stride says nothing
    (size-1 axes have stride 0); the source's first axis decides then, and the key records the choice."""
    if len(n.arg.views) != 1:
        return None
    v, src = n.arg.views[0], n.srcs[0]
    if v.mask is not None and v.mask[0] != (0, rows):
        return None  # a pad or crop along the rows
    if src.shape and src.shape[0] == rows:
        row = prod(src.shape[1:])
        if v.strides[0] != row and rows > 1:
            return None
        if src.op is not Op.BUFFER:
            # the source is indexed through its coordinates: each row of the view must stay in its source row
            # (masked lanes are clamped to the source's size, which the rows change)
            lo = v.offset + sum(min(0, (s - 1) * st) for s, st in zip(v.shape[1:], v.strides[1:], strict=True))
            hi = v.offset + sum(max(0, (s - 1) * st) for s, st in zip(v.shape[1:], v.strides[1:], strict=True))
            if v.mask is not None or lo < 0 or hi >= row:
                return None
        stride = row
    elif v.strides[0] == 0:
        stride = 0
    else:
        return None  # a transposed or reshaped source: its strides hold the rows
    mask = None if v.mask is None else ((0, outer),) + v.mask[1:]
    return ShapeTracker((View.make((outer,) + v.shape[1:], (stride,) + v.strides[1:], v.offset, mask),))


def _dynamic(k: Kernel, nodes: list[Node], lim: Limits) -> _Dynamic | None:
    """The stand-ins for kernel k with its outer extent as a run-time value, or None where it keeps baked shapes:
    1-D kernels, matmuls, gathers, RNG and iota, reductions over the first axis, stores through views (setitem), views
    whose layout depends on the rows (transposes, pads along them), buffers bound in pieces."""
    if any(n.op in _STATIC_OPS for n in nodes):
        return None
    reds = [n for n in nodes if n.op is Op.REDUCE]
    space = reds[0].srcs[0].shape if reds else k.root.shape
    if len(space) < 2 or space[0] < 1:  # a 1-D kernel keeps its size, and its vec4 accesses where it divides by 4
        return None
    rows = space[0]
    if reds and (0 in reds[0].arg[1] or any(r.srcs[0].shape != space or r.arg[1] != reds[0].arg[1] for r in reds)):
        return None
    root = k.root
    if (not root.shape or root.shape[0] != rows or k.st.shape != root.shape or not k.st.is_contiguous
            or k.out.numel != root.numel or k.out.nbytes > lim.max_storage_range):
        return None
    if any(n.op is Op.BUFFER and n.arg[0].nbytes > lim.max_storage_range for n in nodes):
        return None
    inner = max(prod(n.shape[1:]) for n in nodes if n.shape and n.shape[0] == rows)
    if inner == 0 or rows * inner >= symbolic.NARROW:
        return None
    outer = min(OUTER, (symbolic.NARROW - 1) // inner)
    shapes: dict[Node, Shape] = {}
    sts: dict[Node, ShapeTracker] = {}
    refs: set[int] = set()
    seen: set[int] = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n.op in (Op.CONST, Op.VAR):  # no loads: only the shape stands in
            if n.shape and n.shape[0] == rows:
                shapes[n] = (outer,) + n.shape[1:]
            continue
        if not n.shape or n.shape[0] != rows:
            return None
        shapes[n] = (outer,) + n.shape[1:]
        if n.op is Op.BUFFER:
            if n.arg[0].numel != n.numel:
                return None
            refs.add(id(n.arg[0]))
            continue
        if n.op is Op.VIEW:
            st = _dynamic_view(n, rows, outer)
            if st is None:
                return None
            sts[n] = st
            if st.views[0].strides[0] == 0:
                continue  # the same source for every row: it renders and keys as it is
        stack.extend(n.srcs)
    if any(r not in shapes for r in reds):
        return None
    return _Dynamic(rows, shapes, sts, refs)


def _group_index(r: Renderer, groups: int) -> bool:
    """Emit `grp`, the flat workgroup index of a launch of `groups` workgroups: an int64_t where the count passes
    32 bits. Returns whether it does."""
    wide = groups >= symbolic.NARROW
    r.emit(f"int64_t grp = {GROUP_ID64};" if wide else f"int grp = {GROUP_ID};")
    return wide


def _launch(r: Renderer, dyn: _Dynamic | None, units: int, per_row: int, per_group: int,
            groups: int) -> tuple[str, tuple[str, int, int] | None]:
    """Emit `grp`, the flat workgroup index, and the early return of the workgroups past the end: past `groups`,
    or with run-time rows past those covering rows * per_row units at per_group a workgroup. Returns GLSL for
    the units' count (`units` when static) and Program.rows."""
    _group_index(r, groups)
    if dyn is None:
        r.emit(f"if (grp >= {lit(groups)}) return;")
        return lit(units), None
    dyn.renderer(r)
    total, rows = dyn.units(r, per_row, per_group)
    r.emit(f"if (grp >= {total if per_group == 1 else f'({total} + {per_group - 1}) / {per_group}'}) return;")
    return total, rows


# ---- elementwise ------------------------------------------------------------------------------------------------


_VEC4 = {"float": "vec4", "int": "ivec4", "uint": "uvec4"}
_LEAVES = {Op.CONST, Op.RAND, Op.IOTA, Op.VAR}  # computed per element, no loads


def _aligned(st: ShapeTracker) -> bool:
    """st reads its shape as one contiguous, unmasked run starting at a multiple of 4 elements."""
    if len(st.views) != 1:
        return False
    v = st.views[0]
    return v.mask is None and v.offset % 4 == 0 and v.strides == strides_for(v.shape)


def _vec4_loads(k: Kernel, lim: Limits, dyn: _Dynamic | None = None) -> list[Node] | None:
    """The load nodes (buffers, and views of buffers) of an elementwise kernel whose every access, output
    included, is a contiguous, unmasked, 4-aligned run of 32-bit elements, so that invocations can move 4 at a
    time as vec4; None when any is not (16-bit types, pads, strided views, gathers, buffers bound in pieces).

    View offsets are push constants, but they take part in the lowering cache key, so a kernel lowered for an
    aligned offset is never reused for an unaligned one. With run-time rows, each row must hold a multiple of 4."""
    root = k.root
    if ((prod(root.shape[1:]) if dyn else root.numel) % 4 or k.out.dtype.store not in _VEC4 or not _aligned(k.st)
            or k.st.shape != root.shape or root.numel >= symbolic.NARROW // 2):
        return None
    loads: list[Node] = []
    for n in root.toposort():
        if n.op is Op.BUFFER:
            if n.shape != root.shape:  # only a view reads it, at the view's coordinates
                continue
            loads.append(n)
        elif n.op is Op.VIEW:
            if n.srcs[0].op is not Op.BUFFER or not _aligned(dyn.sts.get(n, n.arg) if dyn else n.arg):
                return None
            loads.append(n)
        elif n.op not in ELEMENTWISE and n.op not in _LEAVES:
            return None
    refs = [n.arg[0] if n.op is Op.BUFFER else n.srcs[0].arg[0] for n in loads] + [k.out]
    if any(ref.dtype.store not in _VEC4 or ref.nbytes > lim.max_storage_range for ref in refs):
        return None
    return loads


def _elementwise_vec4(k: Kernel, lim: Limits, params: dict[int, int], loads: list[Node],
                      dyn: _Dynamic | None) -> Lowered:
    """Each invocation loads 4 consecutive elements of every input as one vec4, computes the 4 results as
    scalars and stores them as one vec4: a quarter of the memory instructions of the scalar kernel."""
    r = _renderer(lim, params)
    shape = dyn.shape(k.root) if dyn else k.root.shape
    n = prod(shape)
    nv = n // 4
    wg = _wg(lim)
    groups = math.ceil(k.root.numel // 4 / wg)
    total, rows = _launch(r, dyn, nv, prod(shape[1:]) // 4, wg, groups)
    r.emit(f"int q = grp * {wg} + int(gl_LocalInvocationID.x);")

    def vec_index(ref: BufferRef, offset: int, write: bool = False) -> str:
        b = r.binding(ref, ref.dtype, write)
        r.block_types[b] = _VEC4[ref.dtype.store]
        off = r.offset(offset)  # aligned here; a push constant, so shift it to vec4 units in the shader
        return f"b{b}.data[{'q' if off.render() == '0' else f'q + ({off.render()} >> 2)'}]"

    with r.block(f"if (q < {total})" if nv % wg or dyn else "if (true)"):
        vecs = {}
        for ld in loads:
            ref, off = (ld.arg[0], 0) if ld.op is Op.BUFFER else (ld.srcs[0].arg[0], ld.arg.views[0].offset)
            vecs[ld] = r.define(_VEC4[ref.dtype.store], vec_index(ref, off), "l")
        lanes = []
        for j in range(4):
            r.emit(f"int g{j} = q * 4 + {j};")
            for ld, name in vecs.items():
                r.subst[ld] = f"{name}.{'xyzw'[j]}"
            coords = unravel(Var(f"g{j}", j, n - 4 + j), shape)
            lanes.append(glsl.store(k.out.dtype, r.value(k.root, coords)))
        out_t = _VEC4[k.out.dtype.store]
        r.emit(f"{vec_index(k.out, k.st.views[0].offset, True)} = {out_t}({', '.join(lanes)});")
    return Lowered([_finish(r, f"E4_{_size_name(shape, dyn)}", wg, groups, lim, rows=rows)], [])


def _size_name(shape: Shape, dyn: _Dynamic | None) -> str:
    """A program name's size part: the element count, or the row size after an n for run-time rows."""
    return f"n{prod(shape[1:])}" if dyn else str(prod(shape))


def _elementwise(k: Kernel, lim: Limits, params: dict[int, int], dyn: _Dynamic | None) -> Lowered:
    loads = _vec4_loads(k, lim, dyn)
    if loads is not None:
        return _elementwise_vec4(k, lim, params, loads, dyn)
    r = _renderer(lim, params)
    shape = dyn.shape(k.root) if dyn else k.root.shape
    n = prod(shape)
    wg = _wg(lim)
    # with run-time rows, one element per invocation at every size, so one program serves them all
    ept = 4 if not dyn and n >= wg * 4 * 256 else 1
    groups = math.ceil(k.root.numel / (wg * ept))
    total, rows = _launch(r, dyn, n, prod(shape[1:]), wg, groups)
    r.emit("int lid = int(gl_LocalInvocationID.x);")
    loop = f"for (int e = 0; e < {ept}; e++)" if ept > 1 else "if (true)"
    with r.block(loop):
        wide = groups * wg * ept > symbolic.NARROW  # the last workgroup's invocations past the end included
        g = "int64_t(grp)" if wide else "grp"
        base = f"({g} * {ept} + e) * {wg} + lid" if ept > 1 else f"{g} * {wg} + lid"
        r.emit(f"{'int64_t' if wide else 'int'} gid = {base};")
        with r.block(f"if (gid < {total})" if n % (wg * ept) or dyn else "if (true)"):
            coords = unravel(Var("gid", 0, n - 1, wide), shape)
            st = ShapeTracker.contiguous(shape) if dyn else k.st
            r.store(k.out, k.out.dtype, st, coords, r.value(k.root, coords))
    return Lowered([_finish(r, f"E_{_size_name(shape, dyn)}", wg, groups, lim, rows=rows)], [])


# ---- reductions -------------------------------------------------------------------------------------------------

_IDENTITY = {ReduceOp.SUM: lambda d: 0, ReduceOp.PROD: lambda d: 1, ReduceOp.MAX: min_value,
             ReduceOp.MIN: max_value, ReduceOp.ARGMAX: min_value, ReduceOp.ARGMIN: max_value}
_ARG = (ReduceOp.ARGMAX, ReduceOp.ARGMIN)


def _combine(rop: ReduceOp, d: DType, acc: str, v: str) -> str:
    if rop is ReduceOp.SUM:
        return f"{acc} = {acc} || {v};" if d.kind == "b" else f"{acc} += {v};"
    if rop is ReduceOp.PROD:
        return f"{acc} = {acc} && {v};" if d.kind == "b" else f"{acc} *= {v};"
    if d.kind == "b":
        return f"{acc} = {acc} {'||' if rop is ReduceOp.MAX else '&&'} {v};"
    return f"{acc} = {glsl.minmax(rop.name.lower(), acc, v, d)};"


def _better(rop: ReduceOp, d: DType, v: str, acc: str) -> str:
    """v should replace acc in argmax/argmin (a NaN wins both, so the first NaN's index is the answer, as in
    numpy)."""
    cmp = ">" if rop is ReduceOp.ARGMAX else "<"
    if d.kind == "b":
        v, acc = f"int({v})", f"int({acc})"
    if d.is_float:
        return f"({v} {cmp} {acc} || (isnan({v}) && !isnan({acc})))"
    return f"({v} {cmp} {acc})"


def _same(d: DType, b: str, a: str) -> str:
    """b ties with a in argmax/argmin, NaNs tying with each other (the lower index then wins, as in numpy)."""
    return f"({b} == {a} || (isnan({b}) && isnan({a})))" if d.is_float else f"({b} == {a})"


class _Reduction:
    """Emits one reduction over a row: per-invocation accumulate, then a shared-memory tree when grouped."""

    def __init__(self, r: Renderer, node: Node, wg: int, shared: list[str], lim: Limits, scale: int = 1):
        self.r, self.node, self.wg, self.shared = r, node, wg, shared
        self.scale = scale  # equal values each accumulated one stands for (a sum's folded axes: _fold_axes)
        self.rop: ReduceOp = node.arg[0]
        self.d: DType = node.srcs[0].dtype
        # subgroup ops take 32-bit scalars (bools and int64 keep the tree); the workgroup must hold whole
        # subgroups of any size the device may pick
        self.subgroups = (lim.subgroup_arith and wg > 1 and wg % lim.max_subgroup == 0
                          and self.d.glsl in ("float", "int", "uint"))
        self.n_subgroups = -(-wg // max(lim.min_subgroup, 1))
        self.t = "uint" if self.d.kind == "b" and wg > 1 else self.d.glsl  # shared memory holds no bools
        self.acc = r.define(self.d.glsl, glsl.literal(_IDENTITY[self.rop](self.d), self.d), "acc")
        self.idx = r.define("int", "0", "ai") if self.rop in _ARG else None

    def add(self, v: str, r_index: str) -> None:
        if self.idx is None:
            self.r.emit(_combine(self.rop, self.d, self.acc, v))
        else:
            with self.r.block(f"if ({_better(self.rop, self.d, v, self.acc)})"):
                self.r.emit(f"{self.acc} = {v}; {self.idx} = {r_index};")

    def finish(self) -> str:
        r, wg = self.r, self.wg
        if self.subgroups:
            res, res_i = self._subgroup_finish()
        elif wg > 1:
            # one scratch array per element type, reused by every reduction of the kernel (each ends with a
            # barrier after its result is read), so fused reductions never add up past the shared-memory limit
            sv = self._declare(self.t, f"sv_{self.t}", wg)
            si = self._declare("int", "si_int", wg) if self.idx is not None else None
            to_t = f"{self.t}({self.acc})" if self.t != self.d.glsl else self.acc
            r.emit(f"{sv}[lid] = {to_t};" + (f" {si}[lid] = {self.idx};" if si else ""))
            r.emit("barrier();")
            with r.block(f"for (int s = {wg // 2}; s > 0; s >>= 1)"):
                with r.block("if (lid < s)"):
                    a, b = self._from_t(f"{sv}[lid]"), self._from_t(f"{sv}[lid + s]")
                    if si is None:
                        tmp = r.define(self.d.glsl, a, "t")
                        r.emit(_combine(self.rop, self.d, tmp, b))
                        r.emit(f"{sv}[lid] = {self._to_t(tmp)};")
                    else:
                        better = _better(self.rop, self.d, b, a)
                        tie = f"({_same(self.d, b, a)} && {si}[lid + s] < {si}[lid])"
                        with r.block(f"if ({better} || {tie})"):
                            r.emit(f"{sv}[lid] = {sv}[lid + s]; {si}[lid] = {si}[lid + s];")
                r.emit("barrier();")
            res = r.define(self.d.glsl, self._from_t(f"{sv}[0]"), "red")
            res_i = r.define("int", f"{si}[0]", "redi") if si else None
            r.emit("barrier();")
        else:
            res, res_i = self.acc, self.idx
        if self.scale > 1 and self.rop is ReduceOp.SUM and self.d.kind != "b":
            res = r.define(self.d.glsl, glsl.alu(Op.MUL, self.d, [self.d, self.d], [res, _count(self.scale, self.d)],
                                                 r.need), "red")
        if self.scale > 1 and self.rop is ReduceOp.PROD and self.d.kind != "b":
            res = self._power(res, self.scale)
        self.value, self.index = res, res_i
        if res_i is not None:
            return r.define(self.node.dtype.glsl, glsl.cast(res_i, dtypes.int32, self.node.dtype, r.need), "red")
        if self.node.dtype is not self.d:
            return r.define(self.node.dtype.glsl, glsl.cast(res, self.d, self.node.dtype, r.need), "red")
        return res

    def _power(self, x: str, n: int) -> str:
        """x ** n by squaring (left to right over n's bits): 2 log2(n) multiplies in the dtype, each rounded (or
        wrapped) as numpy's product rounds each of its n; exact for 0, +-1, infinities and NaN."""
        r, d = self.r, self.d
        out = x
        for bit in bin(n)[3:]:
            out = r.define(d.glsl, glsl.alu(Op.MUL, d, [d, d], [out, out], r.need), "pw")
            if bit == "1":
                out = r.define(d.glsl, glsl.alu(Op.MUL, d, [d, d], [out, x], r.need), "pw")
        return out

    def _declare(self, t: str, name: str, size: int) -> str:
        decl = f"shared {t} {name}[{size}];"
        if decl not in self.shared:
            self.shared.append(decl)
        return name

    def _subgroup_step(self, v: str, i: str | None) -> tuple[str, str | None]:
        """The reduction of (v, i) over the invocations of this subgroup, in every one of them."""
        r, rop, d = self.r, self.rop, self.d
        fn = {ReduceOp.SUM: "subgroupAdd", ReduceOp.PROD: "subgroupMul", ReduceOp.MAX: "subgroupMax",
              ReduceOp.ARGMAX: "subgroupMax", ReduceOp.MIN: "subgroupMin", ReduceOp.ARGMIN: "subgroupMin"}[rop]
        if rop in (ReduceOp.SUM, ReduceOp.PROD) or not d.is_float:
            m = r.define(d.glsl, f"{fn}({v})", "sg")
            nan = None
        else:
            # subgroupMax/Min may drop a NaN as GLSL's max does, but max, min, argmax and argmin propagate it
            nan = r.define("bool", f"subgroupMax(isnan({v}) ? 1 : 0) != 0", "sgn")
            ident = glsl.literal(_IDENTITY[rop](d), d)
            m = r.define(d.glsl, f"{nan} ? {glsl.literal(math.nan, d)} : {fn}(isnan({v}) ? {ident} : {v})", "sg")
        if i is None:
            return m, None
        # the lowest index among the invocations holding the best value, as numpy picks the first
        best = f"({nan} ? isnan({v}) : {v} == {m})" if nan else f"{v} == {m}"
        return m, r.define("int", f"subgroupMin({best} ? {i} : 0x7fffffff)", "sgi")

    def _subgroup_finish(self) -> tuple[str, str | None]:
        """Each subgroup reduces with subgroup arithmetic, its first invocation leaves the partial in shared
        memory, and the first subgroup reduces the partials: two barriers instead of one per tree level."""
        r, d, n = self.r, self.d, self.n_subgroups
        r.ext |= {"GL_KHR_shader_subgroup_basic", "GL_KHR_shader_subgroup_arithmetic"}
        sv = self._declare(d.glsl, f"sg_{d.glsl}", n)
        si = self._declare("int", "sgi_int", n) if self.idx is not None else None
        v, i = self._subgroup_step(self.acc, self.idx)
        with r.block("if (gl_SubgroupInvocationID == 0u)"):
            r.emit(f"{sv}[gl_SubgroupID] = {v};" + (f" {si}[gl_SubgroupID] = {i};" if si else ""))
        r.emit("barrier();")
        with r.block("if (gl_SubgroupID == 0u)"):
            acc = r.define(d.glsl, glsl.literal(_IDENTITY[self.rop](d), d), "acc")
            idx = r.define("int", "0", "ai") if si else None
            with r.block("for (uint s = gl_SubgroupInvocationID; s < gl_NumSubgroups; s += gl_SubgroupSize)"):
                if si is None:
                    r.emit(_combine(self.rop, d, acc, f"{sv}[s]"))
                else:
                    b, a = f"{sv}[s]", acc
                    with r.block(f"if ({_better(self.rop, d, b, a)} || ({_same(d, b, a)} && {si}[s] < {idx}))"):
                        r.emit(f"{acc} = {b}; {idx} = {si}[s];")
            v, i = self._subgroup_step(acc, idx)
            with r.block("if (gl_SubgroupInvocationID == 0u)"):
                r.emit(f"{sv}[0] = {v};" + (f" {si}[0] = {i};" if si else ""))
        r.emit("barrier();")
        res = r.define(d.glsl, f"{sv}[0]", "red")
        res_i = r.define("int", f"{si}[0]", "redi") if si else None
        r.emit("barrier();")
        return res, res_i

    def _to_t(self, x: str) -> str:
        return f"{self.t}({x})" if self.t != self.d.glsl else x

    def _from_t(self, x: str) -> str:
        return f"({x} != 0u)" if self.t != self.d.glsl else x


def _full_coords(o: tuple[Expr, ...], rc: tuple[Expr, ...], axes: tuple[int, ...]) -> tuple[Expr, ...]:
    it = iter(rc)
    return tuple(next(it) if i in axes else c for i, c in enumerate(o))


# Along an axis where no reduced value changes (constants, broadcasts), a sum is one value times the axis's length,
# a product that value to the power of the length, and a max or min is that value: the kernel walks only the other
# axes (Tensor.ones(10**12).sum() reads nothing).
_FOLDABLE = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN)


def _varies(n: Node, axis: int, memo: dict[int, bool]) -> bool:
    """Whether n's value changes along `axis` of its shape (n lies in a reduction's source, above any view)."""
    hit = memo.get(id(n))
    if hit is None:
        if n.op in (Op.CONST, Op.VAR) or n.shape[axis] == 1:
            hit = False
        elif n.op is Op.VIEW:  # the view applied first decides whether the coordinate reaches any index
            v = n.arg.views[-1]
            hit = v.strides[axis] != 0 or (v.mask is not None and v.mask[axis] != (0, v.shape[axis]))
        elif n.op in ELEMENTWISE:
            hit = any(_varies(x, axis, memo) for x in n.srcs)
        else:
            hit = True
        memo[id(n)] = hit
    return hit


def _fold_axes(k: Kernel, reds: list[Node]) -> tuple[tuple[int, ...], int]:
    """The axes kernel k's reductions must walk, and how many equal values each value they see stands for (the
    product of the folded axes). Only where every reduction folds (not argmax/argmin) and the kernel writes one value
    per row (an epilogue that walks the row again needs every position)."""
    axes = reds[0].arg[1]
    if k.root.numel != prod(reds[0].shape) or any(r.arg[0] not in _FOLDABLE for r in reds):
        return axes, 1
    full = reds[0].srcs[0].shape
    keep = tuple(a for a in axes if any(_varies(r.srcs[0], a, {}) for r in reds))
    return keep, prod(full[a] for a in axes if a not in keep)


def _count(n: int, d: DType) -> str:
    """n as a literal of d, wrapped to its width for integers (the sum of n equal integers wraps the same way)."""
    if d.is_float:
        return glsl.literal(float(n), d)
    bits = 8 * d.itemsize
    v = n % (1 << bits)
    if d.kind == "i" and v >= 1 << (bits - 1):
        v -= 1 << bits
    return glsl.literal(v, d)


# A row longer than SERIAL_SPLIT elements splits even with many rows, and a split's chunks hold at most
# SERIAL * (workgroup size) elements: each invocation adds at most SERIAL values (4096 where the row does not
# split) one after another, then the partials combine as a tree; a float32 sum of 5e9 ones is then as exact as
# numpy's pairwise one, where a serial one stops at 2^24.
SERIAL = 1024
SERIAL_SPLIT = 1 << 20
SPLIT_ROW = 32768  # rows at least this long split where they are few (under 64)


def _reduce_plan(k: Kernel, reds: list[Node], lim: Limits, axes: tuple[int, ...]) -> tuple[bool, bool, int, int]:
    """How kernel k's reductions `reds`, walking `axes` (_fold_axes), run: (split into two programs or more, a
    workgroup per row, its size, local size)."""
    full = reds[0].srcs[0].shape
    rows = prod(reds[0].shape)
    rlen = prod(full[a] for a in axes)
    split = (k.root.numel == rows and len(reds) == 1
             and (rlen >= SPLIT_ROW and rows < 64 or rlen > SERIAL_SPLIT))
    grouped = rlen >= 128 or rows < 256
    # few long rows (a norm over a decode batch's hidden states; sampling's fused reductions over a vocabulary,
    # several in one kernel, which do not split) take the widest workgroup the device allows: one workgroup per
    # row is all the parallelism there is, and fewer serial loads per invocation cut the latency (11 us -> ~3 us
    # for 4096)
    wg = (_wg(lim, 1024) if rows <= 32 and rlen >= 2048 else _wg(lim)) if grouped else 1
    return split, grouped, wg, wg if grouped else _wg(lim, 64)


def _int_var(r: Renderer, name: str, expr: str, expr64: str, lo: int, hi: int, top: int) -> Var:
    """Declare `name` = expr, an index over [lo, hi] inside its bounds check, reaching `top` before it: an int64_t
    (computed by expr64) where top passes 32 bits."""
    wide = top >= symbolic.NARROW or not symbolic.narrow(lo, hi)
    r.emit(f"{'int64_t' if wide else 'int'} {name} = {expr64 if wide else expr};")
    return Var(name, lo, hi, wide)


def _reduce(k: Kernel, lim: Limits, params: dict[int, int], dyn: _Dynamic | None = None) -> Lowered:
    root = k.root
    reds = [n for n in root.toposort() if n.op is Op.REDUCE]
    shape_of = dyn.shape if dyn else (lambda n: n.shape)
    axes, scale = _fold_axes(k, reds)
    full = shape_of(reds[0].srcs[0])
    out_shape = shape_of(reds[0])
    rows = prod(out_shape)
    real_rows = prod(reds[0].shape)
    rshape = tuple(full[a] for a in axes)
    rlen = prod(rshape)
    if any(red.arg[0] in _ARG for red in reds) and rlen >= 1 << 31:
        raise OverflowError(f"argmax/argmin over {rlen} elements: the index of the result is 32-bit")
    row_root = root.numel == real_rows
    split, grouped, wg, local = _reduce_plan(k, reds, lim, axes)
    if split:
        return _split(k, reds[0], lim, params, axes, scale)
    groups = real_rows if grouped else math.ceil(real_rows / local)
    r = _renderer(lim, params)
    shared: list[str] = []
    nrows, prog_rows = _launch(r, dyn, rows, prod(out_shape[1:]), 1 if grouped else local, groups)
    r.emit("int lid = int(gl_LocalInvocationID.x);")
    if grouped:
        ovar = _int_var(r, "o", "grp", "grp", 0, rows - 1, groups)
    else:
        ovar = _int_var(r, "o", f"grp * {local} + lid", f"int64_t(grp) * {local} + lid", 0, rows - 1, groups * local)
    oc = unravel(ovar, out_shape)
    start, step = ("lid", wg) if grouped else ("0", 1)
    r_wide = rlen + step >= symbolic.NARROW
    rvar = Var("r", 0, rlen - 1, r_wide)
    rc = unravel(rvar, rshape)
    loop = f"for ({'int64_t' if r_wide else 'int'} r = {start}; r < {lit(rlen, r_wide)}; r += {step})"
    with r.block("if (true)" if grouped or (rows % local == 0 and not dyn) else f"if (o < {nrows})"):
        for red in reds:
            acc = _Reduction(r, red, wg, shared, lim, scale)
            with r.block(loop):
                acc.add(r.value(red.srcs[0], _full_coords(oc, rc, axes)), "int(r)" if r_wide else "r")
            r.subst[red] = acc.finish()
        out_st = ShapeTracker.contiguous(shape_of(root)) if dyn else k.st
        if row_root:
            with r.block("if (lid == 0)" if grouped else "if (true)"):
                coords = unravel(ovar, shape_of(root))
                r.store(k.out, k.out.dtype, out_st, coords, r.value(root, coords))
        else:
            with r.block(loop):
                coords = _full_coords(oc, rc, axes)
                r.store(k.out, k.out.dtype, out_st, coords, r.value(root, coords))
    name = f"R{len(reds)}_{_size_name(out_shape, dyn)}_{rlen}"
    return Lowered([_finish(r, name, local, groups, lim, shared, prog_rows)], [])


def _acc_dtype(d: DType) -> DType:
    return dtypes.float32 if d.is_float else d


UNROLL = 4


def _chunk(rlen: int, rshape: Shape, wg: int) -> int:
    """Elements of a row per workgroup in a split reduction: enough workgroups (up to 4096 a row) and at most SERIAL
    loads per invocation, rounded down to a multiple of the row's trailing axes where one fits, so that a chunk's
    start splits the index into those axes without (64-bit) division."""
    target = min(math.ceil(rlen / min(4096, math.ceil(rlen / 8192))), wg * SERIAL)
    whole = 1
    for s in reversed(rshape):
        if whole * s > target:
            break
        whole *= s
    return whole * (target // whole)


def _split(k: Kernel, red: Node, lim: Limits, params: dict[int, int], axes: tuple[int, ...], scale: int) -> Lowered:
    """Partial reductions over chunks of each row into scratch, then a reduction of the partials (split again while
    they are many)."""
    full = red.srcs[0].shape
    out_shape = red.shape
    rows = prod(out_shape)
    rshape = tuple(full[a] for a in axes)
    rlen = prod(rshape)
    wg = _wg(lim)
    chunk = _chunk(rlen, rshape, wg)
    parts = math.ceil(rlen / chunk)
    last = rlen - (parts - 1) * chunk
    groups = rows * parts
    arg = red.arg[0] in _ARG
    acc_d = red.srcs[0].dtype if arg else _acc_dtype(red.srcs[0].dtype)  # an argmax compares, it sums nothing
    scratch = BufferRef(acc_d, groups)
    index_scratch = BufferRef(dtypes.int32, groups) if arg else None
    r = _renderer(lim, params)
    shared: list[str] = []
    gwide = _group_index(r, groups)
    r.emit(f"if (grp >= {lit(groups)}) return;")
    r.emit("int lid = int(gl_LocalInvocationID.x);")
    cast = "int" if gwide else ""
    ovar = _int_var(r, "o", f"{cast}(grp / {lit(parts, gwide)})", f"grp / {lit(parts, True)}", 0, rows - 1, rows)
    part = _int_var(r, "part", f"{cast}(grp % {lit(parts, gwide)})", f"grp % {lit(parts, True)}", 0, parts - 1,
                    parts)
    oc = unravel(ovar, out_shape)
    src = red.srcs[0]
    if acc_d is not src.dtype:
        src = alu_node(Op.CAST, acc_d, src)
    partial = reduce(src, red.arg[0], axes)
    acc = _Reduction(r, partial, wg, shared, lim, scale)
    # the chunk's own length; the index of its element c is part * chunk + c
    cwide = chunk + UNROLL * wg >= symbolic.NARROW
    ct = "int64_t" if cwide else "int"
    r.emit(f"{ct} clen = {part.render()} == {parts - 1} ? {lit(last, cwide)} : {lit(chunk, cwide)};")
    r.emit(f"{ct} c = lid;")
    # four loads in flight per invocation before they are combined: the split reduction is bandwidth-bound
    with r.block(f"for (; c + {(UNROLL - 1) * wg} < clen; c += {UNROLL * wg})"):
        cv = Var("c", 0, max(chunk - 1 - (UNROLL - 1) * wg, 0), cwide)  # the loop test keeps c + 3 * wg in range
        vals = [r.value(src, _full_coords(oc, unravel(part * chunk + cv + j * wg, rshape), axes))
                for j in range(UNROLL)]
        for j, v in enumerate(vals):
            acc.add(v, f"c + {j * wg}" if j else "c")
    with r.block(f"for (; c < clen; c += {wg})"):
        cv = Var("c", 0, chunk - 1, cwide)
        acc.add(r.value(src, _full_coords(oc, unravel(part * chunk + cv, rshape), axes)), "c")
    res = acc.finish()
    gvar = (Var("grp", 0, groups - 1, gwide),)
    with r.block("if (lid == 0)"):
        if arg:
            r.store(scratch, acc_d, ShapeTracker.contiguous((groups,)), gvar, acc.value)
            r.store(index_scratch, dtypes.int32, ShapeTracker.contiguous((groups,)), gvar,
                    f"int({part.render()}) * {chunk} + {acc.index}")  # rlen < 2^31: _reduce checked
        else:
            r.store(scratch, acc_d, ShapeTracker.contiguous((groups,)), gvar, res)
    first = _finish(r, f"P_{rows}_{rlen}_{parts}", wg, groups, lim, shared)
    pnode = buffer(scratch, 0, acc_d, out_shape + (parts,))
    total = reduce(pnode, red.arg[0], (len(out_shape),), dtypes.int32 if arg else None)
    if arg:
        # the chunk holding the first best value (chunks in order, so ties and NaNs resolve as over the whole
        # row), then the row's index that chunk found
        row = movement(iota(rows), lambda st: st.reshape(out_shape + (1,)))
        at = alu_node(Op.ADD, dtypes.int32, alu_node(Op.MUL, dtypes.int32, row, const(parts, dtypes.int32,
                                                                                        row.shape)), total)
        flat = buffer(index_scratch, 0, dtypes.int32, (groups,))
        total = gather(flat, movement(at, lambda st: st.reshape((rows,))), 0)
    total = movement(total, lambda st: st.reshape(out_shape))
    if total.dtype is not red.dtype:
        total = alu_node(Op.CAST, red.dtype, total)
    second = _reduce(Kernel(substitute(k.root, {red: total}), k.out, k.st), lim, params)
    return Lowered([first] + second.programs, [scratch, *([index_scratch] if arg else []), *second.scratch])


# ---- matmul -----------------------------------------------------------------------------------------------------

BK = 16


def _tile(m: int, n: int, acc: DType, lim: Limits) -> tuple[int, int]:
    """(tile edge, results per invocation along each axis): 128 x 128 tiles with 8 x 8 results per invocation
    where both sides exceed 64 and the staged slices fit in shared memory (a quarter of the shared-memory reads
    per multiply-add of 64 x 64 tiles with 4 x 4), else 64 x 64 with 4 x 4."""
    if m > 64 and n > 64 and 2 * BK * 128 * acc.itemsize <= lim.max_shared and lim.max_invocations >= 256:
        return 128, 8
    return 64, 4


def _owned(tpt: int, edge: int, t: str, i: str) -> str:
    """The tile row (or column) of an invocation's i-th result, t its row (column) among edge / tpt: with 4 per
    invocation, strided by edge / 4; with 8, two runs of 4 consecutive ones half a tile apart, so neighbouring
    invocations read neighbouring 16-byte runs of shared memory."""
    if tpt == 4:
        return f"({t} + {edge // 4} * {i})"
    return f"((({i}) >> 2) * {edge // 2} + {t} * 4 + (({i}) & 3))"


def _column_major(src: Node) -> bool:
    """Whether a matmul operand reads its last two axes column-major (a transposed view such as w.T): unit
    stride along the next-to-last axis, through any casts."""
    n = src
    while n.op is Op.CAST:
        n = n.srcs[0]
    if n.op is not Op.VIEW or len(n.arg.views) != 1:
        return False
    st = n.arg.views[0].strides
    return len(st) >= 2 and abs(st[-2]) == 1 and abs(st[-1]) > 1


def _matmul(k: Kernel, mm: Node, lim: Limits, params: dict[int, int]) -> Lowered:
    a, b = mm.srcs
    batch = mm.shape[:-2]
    m_, n_, k_ = a.shape[-2], b.shape[-1], a.shape[-1]
    nb = prod(batch)
    t = mm.dtype.glsl
    acc_d = _acc_dtype(mm.dtype)
    BM, TPT = _tile(m_, n_, acc_d, lim)
    BN = BM
    tiles_m, tiles_n = math.ceil(m_ / BM), math.ceil(n_ / BN)
    groups = nb * tiles_m * tiles_n
    wg = (BM // TPT) * (BN // TPT)
    shared = [f"shared {acc_d.glsl} As[{BK}][{BM}];", f"shared {acc_d.glsl} Bs[{BK}][{BN}];"]
    r = _renderer(lim, params)
    zero = glsl.zero(acc_d)
    r.emit(f"int grp = {GROUP_ID};")
    r.emit(f"if (grp >= {groups}) return;")
    r.emit("int lid = int(gl_LocalInvocationID.x);")
    r.emit(f"int tn = grp % {tiles_n};")
    r.emit(f"int tm = (grp / {tiles_n}) % {tiles_m};")
    r.emit(f"int bt = grp / {tiles_n * tiles_m};")
    r.emit(f"int tx = lid % {BN // TPT};")
    r.emit(f"int ty = lid / {BN // TPT};")
    r.emit(f"{acc_d.glsl} acc[{TPT * TPT}];")
    r.emit(f"for (int i = 0; i < {TPT * TPT}; i++) acc[i] = {zero};")
    bc = unravel(Var("bt", 0, nb - 1), batch)

    def tile_load(src: Node, rows_name: str, cols_name: str, rexpr: str, cexpr: str, rlim: int, clim: int,
                  dst: str, total: int) -> None:
        with r.block(f"for (int e = lid; e < {total}; e += {wg})"):
            r.emit(f"int {rows_name} = {rexpr};")
            r.emit(f"int {cols_name} = {cexpr};")
            v = r.define(acc_d.glsl, zero, "x")
            with r.block(f"if ({rows_name} < {rlim} && {cols_name} < {clim})"):
                coords = bc + (Var(rows_name, 0, rlim - 1), Var(cols_name, 0, clim - 1))
                val = r.value(src, coords)
                r.emit(f"{v} = {glsl.cast(val, src.dtype, acc_d, r.need)};")
            r.emit(dst.format(v=v))

    with r.block(f"for (int k0 = 0; k0 < {k_}; k0 += {BK})"):
        # neighbouring invocations walk whichever tile axis the operand stores contiguously
        if _column_major(a):
            tile_load(a, "am", "ak", f"tm * {BM} + e % {BM}", f"k0 + e / {BM}", m_, k_,
                      f"As[e / {BM}][e % {BM}] = {{v}};", BM * BK)
        else:
            tile_load(a, "am", "ak", f"tm * {BM} + e / {BK}", f"k0 + e % {BK}", m_, k_,
                      f"As[e % {BK}][e / {BK}] = {{v}};", BM * BK)
        if _column_major(b):  # x @ w.T with w stored (N, K), as Linear weights usually are
            tile_load(b, "bk", "bn", f"k0 + e % {BK}", f"tn * {BN} + e / {BK}", k_, n_,
                      f"Bs[e % {BK}][e / {BK}] = {{v}};", BK * BN)
        else:
            tile_load(b, "bk", "bn", f"k0 + e / {BN}", f"tn * {BN} + e % {BN}", k_, n_,
                      f"Bs[e / {BN}][e % {BN}] = {{v}};", BK * BN)
        r.emit("barrier();")
        with r.block(f"for (int kk = 0; kk < {BK}; kk++)"):
            r.emit(f"{acc_d.glsl} av[{TPT}]; {acc_d.glsl} bv[{TPT}];")
            r.emit(f"for (int i = 0; i < {TPT}; i++) av[i] = As[kk][{_owned(TPT, BM, 'ty', 'i')}];")
            r.emit(f"for (int j = 0; j < {TPT}; j++) bv[j] = Bs[kk][{_owned(TPT, BN, 'tx', 'j')}];")
            r.emit(f"for (int i = 0; i < {TPT}; i++) for (int j = 0; j < {TPT}; j++) "
                   f"acc[i * {TPT} + j] += av[i] * bv[j];")
        r.emit("barrier();")
    with r.block(f"for (int i = 0; i < {TPT}; i++)"):
        with r.block(f"for (int j = 0; j < {TPT}; j++)"):
            r.emit(f"int m = tm * {BM} + {_owned(TPT, BM, 'ty', 'i')};")
            r.emit(f"int n = tn * {BN} + {_owned(TPT, BN, 'tx', 'j')};")
            with r.block(f"if (m < {m_} && n < {n_})"):
                r.subst[mm] = r.define(t, glsl.cast(f"acc[i * {TPT} + j]", acc_d, mm.dtype, r.need), "mm")
                coords = bc + (Var("m", 0, m_ - 1), Var("n", 0, n_ - 1))
                r.store(k.out, k.out.dtype, k.st, coords, r.value(k.root, coords))
    return Lowered([_finish(r, f"M_{nb}_{m_}_{n_}_{k_}_{BM}", wg, groups, lim, shared)], [])


def _runtime_leaves(nodes: list[Node]) -> tuple[list[Node], list[Node]]:
    """The leaves among nodes whose values the kernel takes as push constants, and the float constants that
    would be but are over the budget (literals then), both in the order of nodes.

    RNG seeds and Variables always are push constants; float constants get what is left of PUSH_BYTES after them
    and the offsets, at most MAX_PUSH_FLOATS. The budget follows from the nodes alone, so equal kernel structures
    make equal choices."""
    cand = [n for n in nodes if not n.srcs and runtime_values(n)]
    fixed = sum(4 * len(runtime_values(n)) for n in cand if n.op is not Op.CONST)
    budget = min(MAX_PUSH_FLOATS, (PUSH_BYTES - 4 * (MAX_PUSH_OFFSETS + RESERVED_FIELDS) - fixed) // 4)
    leaves, baked = [], []
    for n in cand:
        if n.op is Op.CONST:
            if budget <= 0:
                baked.append(n)
                continue
            budget -= 1
        leaves.append(n)
    return leaves, baked


def _signature(k: Kernel, nodes: list[Node], leaves: list[Node],
               dyn: _Dynamic | None) -> tuple[tuple, list[BufferRef]]:
    """The kernel's structure with buffers numbered by first use and runtime leaves as placeholders, and the
    buffers in that order. With run-time rows, shapes and views are the stand-ins (OUTER for the rows) and the
    buffers whose size follows the rows are keyed without it."""
    slots: dict[int, int] = {}
    refs: list[BufferRef] = []
    index: dict[int, int] = {}
    entries = []
    runtime = {id(n) for n in leaves}

    def slot(ref: BufferRef) -> int:
        if id(ref) not in slots:
            slots[id(ref)] = len(refs)
            refs.append(ref)
        return slots[id(ref)]

    shapes, sts, scaled = (dyn.shapes, dyn.sts, dyn.refs) if dyn else ({}, {}, set())
    for n in nodes:
        if n.op is Op.BUFFER:
            arg = ("buf", slot(n.arg[0]), "rows" if id(n.arg[0]) in scaled else n.arg[0].numel)
        else:
            arg = "param" if id(n) in runtime else argkey(sts.get(n, n.arg))
        index[id(n)] = len(entries)
        entries.append((n.op, n.dtype, arg, shapes.get(n, n.shape), tuple(index[id(s)] for s in n.srcs)))
    if dyn:
        entries.append(("out", slot(k.out), "rows", k.out.dtype, dyn.shape(k.root)))
    else:
        entries.append(("out", slot(k.out), k.out.numel, k.out.dtype, k.st))
    return tuple(entries), refs


# bindings hold slot numbers (ints) for the kernel's buffers, never buffers
_CACHE: LRU[tuple, Lowered] = LRU("lowerings", 2048)


def lower(k: Kernel, lim: Limits) -> Lowered:
    """GLSL programs for kernel k, remembered by the kernel's structure so a repeated graph skips rendering.

    RNG seeds and counters, Variables and float constants are push constants (`Lowered.leaves`, named per
    program in `Program.params`), so the same kernel over new such values is the same program text. So is the
    outer extent of elementwise and row-reduction kernels where `_dynamic` allows: one program, keyed without
    the extent, serves every number of rows."""
    nodes = k.root.toposort()
    leaves, baked = _runtime_leaves(nodes)
    dyn = _dynamic(k, nodes, lim)
    plan = None
    if dyn is not None:
        # the launch shape follows from the real rows, so it keys the program; split reductions keep baked shapes
        reds = [n for n in nodes if n.op is Op.REDUCE]
        plan = _reduce_plan(k, reds, lim, _fold_axes(k, reds)[0]) if reds else _vec4_loads(k, lim, dyn) is not None
        # the row count needs a push-constant field of its own beside the largest offsets and values
        fields = sum(len(runtime_values(n)) for n in leaves) + MAX_PUSH_OFFSETS + RESERVED_FIELDS + 1
        if (isinstance(plan, tuple) and plan[0]) or 4 * fields > PUSH_BYTES:
            dyn = plan = None
    key, refs = _signature(k, nodes, leaves, dyn)
    key = (key, lim, plan)
    hit = _CACHE.get(key)
    if hit is None:
        lowered = _lower(k, lim, {id(n): i for i, n in enumerate(leaves)}, dyn)
        lowered.leaves, lowered.baked = leaves, baked
        slot = {id(r): i for i, r in enumerate(refs)}
        programs = [Program(p.name, p.src, [(slot.get(id(ref), ref), off, n) for ref, off, n in p.bindings],
                            p.groups, p.push, p.params, p.rows) for p in lowered.programs]
        _CACHE.put(key, Lowered(programs, lowered.scratch))
        return lowered
    progs = []
    for p in hit.programs:
        push, groups = p.push, p.groups
        if p.params or p.rows:  # this kernel's own values in place of those the cached programs were rendered with
            push = dict(push)
            for name, i, part in p.params:
                push[name] = runtime_values(leaves[i])[part]
        if p.rows:  # and its own row count, which sizes the launch
            name, per, per_group = p.rows
            push[name] = dyn.rows
            groups = fold_groups(-(-dyn.rows * per // per_group), lim)
        bindings = [(refs[r] if isinstance(r, int) else r, off, n) for r, off, n in p.bindings]
        progs.append(Program(p.name, p.src, bindings, groups, push, p.params, p.rows))
    return Lowered(progs, hit.scratch, leaves, baked)


def _lower(k: Kernel, lim: Limits, params: dict[int, int], dyn: _Dynamic | None) -> Lowered:
    """GLSL programs (one, or two for a split reduction) that compute kernel k; `params` maps the ids of its
    runtime leaves to their positions in `Lowered.leaves`; `dyn`, where given, makes the rows run-time."""
    nodes = k.root.toposort()
    mms = [n for n in nodes if n.op is Op.MATMUL]
    if mms:
        compute = matmul_coop.compute_type(mms[0], lim)
        lowered = matmul_coop.lower_coop(k, mms[0], lim, params, compute=compute) if compute else None
        if lowered is not None:
            return lowered
        return _matmul(k, mms[0], lim, params)
    if any(n.op is Op.REDUCE for n in nodes):
        return _reduce(k, lim, params, dyn=dyn)
    return _elementwise(k, lim, params, dyn)

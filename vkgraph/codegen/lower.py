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
- matmul: 64x64 output tiles per workgroup, 16-deep slices of both inputs staged through shared memory,
  4x4 results per invocation, accumulation in float32 (or the integer type), then the elementwise epilogue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..dtype import DType, dtypes, max_value, min_value
from ..graph import (
    ELEMENTWISE,
    BufferRef,
    Node,
    Op,
    ReduceOp,
    argkey,
    buffer,
    movement,
    reduce,
    runtime_values,
    substitute,
)
from ..graph import alu as alu_node
from ..schedule import Kernel
from ..view import ShapeTracker, prod, strides_for
from . import glsl
from .render import MAX_PUSH_FLOATS, MAX_PUSH_OFFSETS, PUSH_BYTES, Renderer, header
from .symbolic import Expr, Var, unravel

GROUP_ID = "int(gl_WorkGroupID.x + gl_NumWorkGroups.x * (gl_WorkGroupID.y + gl_NumWorkGroups.y * gl_WorkGroupID.z))"


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

    # Drivers such as NVIDIA's report ~2^32 bindings per stage; a fused kernel never profits from more than
    # a few dozen, and descriptor sets that large cost more to write than the extra kernel launch.
    BINDING_CAP = 64

    @staticmethod
    def from_info(info: object) -> Limits:
        return Limits(int(info.max_workgroup_invocations), tuple(int(x) for x in info.max_workgroup_count),
                      int(info.max_shared_memory), int(info.max_storage_buffer_range),
                      min(int(info.max_storage_buffers), Limits.BINDING_CAP),
                      "arithmetic" in info.subgroup_ops, int(info.min_subgroup_size), int(info.max_subgroup_size))


@dataclass
class Program:
    name: str
    src: str
    bindings: list[tuple[BufferRef, int, int | None]]  # per binding: buffer, byte offset, bytes (None: all)
    groups: tuple[int, int, int]
    push: dict[str, Any] = field(default_factory=dict)
    params: tuple[tuple[str, int, int], ...] = ()  # (push field, index in Lowered.leaves, which of its values)


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


def _finish(r: Renderer, name: str, local: int, groups: int, lim: Limits, shared: list[str] = ()) -> Program:
    body = "\n".join(r.lines)
    src = header(r, (local, 1, 1), list(shared)) + "\nvoid main() {\n" + body + "\n}\n"
    return Program(name, src, [(ref, off, n) for ref, _, off, n in r.pieces()], fold_groups(groups, lim),
                   {n: v for n, _, v in r.push}, tuple(r.param_fields))


def _wg(lim: Limits, want: int = 256) -> int:
    wg = 1
    while wg * 2 <= min(want, lim.max_invocations):
        wg *= 2
    return wg


# ---- elementwise ------------------------------------------------------------------------------------------------


_VEC4 = {"float": "vec4", "int": "ivec4", "uint": "uvec4"}
_LEAVES = {Op.CONST, Op.RAND, Op.IOTA, Op.VAR}  # computed per element, no loads


def _aligned(st: ShapeTracker) -> bool:
    """st reads its shape as one contiguous, unmasked run starting at a multiple of 4 elements."""
    if len(st.views) != 1:
        return False
    v = st.views[0]
    return v.mask is None and v.offset % 4 == 0 and v.strides == strides_for(v.shape)


def _vec4_loads(k: Kernel, lim: Limits) -> list[Node] | None:
    """The load nodes (buffers, and views of buffers) of an elementwise kernel whose every access, output
    included, is a contiguous, unmasked, 4-aligned run of 32-bit elements, so that invocations can move 4 at a
    time as vec4; None when any is not (16-bit types, pads, strided views, gathers, buffers bound in pieces).

    View offsets are push constants, but they take part in the lowering cache key, so a kernel lowered for an
    aligned offset is never reused for an unaligned one."""
    root = k.root
    if root.numel % 4 or k.out.dtype.store not in _VEC4 or not _aligned(k.st) or k.st.shape != root.shape:
        return None
    loads: list[Node] = []
    for n in root.toposort():
        if n.op is Op.BUFFER:
            if n.shape != root.shape:  # only a view reads it, at the view's coordinates
                continue
            loads.append(n)
        elif n.op is Op.VIEW:
            if n.srcs[0].op is not Op.BUFFER or not _aligned(n.arg):
                return None
            loads.append(n)
        elif n.op not in ELEMENTWISE and n.op not in _LEAVES:
            return None
    refs = [n.arg[0] if n.op is Op.BUFFER else n.srcs[0].arg[0] for n in loads] + [k.out]
    if any(ref.dtype.store not in _VEC4 or ref.nbytes > lim.max_storage_range for ref in refs):
        return None
    return loads


def _elementwise_vec4(k: Kernel, lim: Limits, params: dict[int, int], loads: list[Node]) -> Lowered:
    """Each invocation loads 4 consecutive elements of every input as one vec4, computes the 4 results as
    scalars and stores them as one vec4: a quarter of the memory instructions of the scalar kernel."""
    r = Renderer(lim.max_storage_range, params)
    n = k.root.numel
    nv = n // 4
    wg = _wg(lim)
    groups = math.ceil(nv / wg)
    r.emit(f"int grp = {GROUP_ID};")
    r.emit(f"if (grp >= {groups}) return;")
    r.emit(f"int q = grp * {wg} + int(gl_LocalInvocationID.x);")

    def vec_index(ref: BufferRef, offset: int, write: bool = False) -> str:
        b = r.binding(ref, ref.dtype, write)
        r.block_types[b] = _VEC4[ref.dtype.store]
        off = r.offset(offset)  # aligned here; a push constant, so shift it to vec4 units in the shader
        return f"b{b}.data[{'q' if off.render() == '0' else f'q + ({off.render()} >> 2)'}]"

    with r.block(f"if (q < {nv})" if nv % wg else "if (true)"):
        vecs = {}
        for ld in loads:
            ref, off = (ld.arg[0], 0) if ld.op is Op.BUFFER else (ld.srcs[0].arg[0], ld.arg.views[0].offset)
            vecs[ld] = r.define(_VEC4[ref.dtype.store], vec_index(ref, off), "l")
        lanes = []
        for j in range(4):
            r.emit(f"int g{j} = q * 4 + {j};")
            for ld, name in vecs.items():
                r.subst[ld] = f"{name}.{'xyzw'[j]}"
            coords = unravel(Var(f"g{j}", j, n - 4 + j), k.root.shape)
            lanes.append(glsl.store(k.out.dtype, r.value(k.root, coords)))
        out_t = _VEC4[k.out.dtype.store]
        r.emit(f"{vec_index(k.out, k.st.views[0].offset, True)} = {out_t}({', '.join(lanes)});")
    return Lowered([_finish(r, f"E4_{n}", wg, groups, lim)], [])


def _elementwise(k: Kernel, lim: Limits, params: dict[int, int]) -> Lowered:
    loads = _vec4_loads(k, lim)
    if loads is not None:
        return _elementwise_vec4(k, lim, params, loads)
    r = Renderer(lim.max_storage_range, params)
    n = k.root.numel
    wg = _wg(lim)
    ept = 4 if n >= wg * 4 * 256 else 1
    groups = math.ceil(n / (wg * ept))
    r.emit(f"int grp = {GROUP_ID};")
    r.emit(f"if (grp >= {groups}) return;")
    r.emit("int lid = int(gl_LocalInvocationID.x);")
    loop = f"for (int e = 0; e < {ept}; e++)" if ept > 1 else "if (true)"
    with r.block(loop):
        base = f"(grp * {ept} + e) * {wg} + lid" if ept > 1 else f"grp * {wg} + lid"
        r.emit(f"int gid = {base};")
        with r.block(f"if (gid < {n})" if n % (wg * ept) else "if (true)"):
            coords = unravel(Var("gid", 0, n - 1), k.root.shape)
            r.store(k.out, k.out.dtype, k.st, coords, r.value(k.root, coords))
    return Lowered([_finish(r, f"E_{n}", wg, groups, lim)], [])


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
    """v should replace acc in argmax/argmin (NaN counts as the largest, as numpy does)."""
    cmp = ">" if rop is ReduceOp.ARGMAX else "<"
    if d.kind == "b":
        v, acc = f"int({v})", f"int({acc})"
    if d.is_float and rop is ReduceOp.ARGMAX:
        return f"({v} {cmp} {acc} || (isnan({v}) && !isnan({acc})))"
    return f"({v} {cmp} {acc})"


def _same(d: DType, b: str, a: str) -> str:
    """b ties with a in argmax/argmin, NaNs tying with each other (the lower index then wins, as in numpy)."""
    return f"({b} == {a} || (isnan({b}) && isnan({a})))" if d.is_float else f"({b} == {a})"


class _Reduction:
    """Emits one reduction over a row: per-invocation accumulate, then a shared-memory tree when grouped."""

    def __init__(self, r: Renderer, node: Node, wg: int, shared: list[str], lim: Limits):
        self.r, self.node, self.wg, self.shared = r, node, wg, shared
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
            sv = f"sv_{self.t}"
            decl = f"shared {self.t} {sv}[{wg}];"
            if decl not in self.shared:
                self.shared.append(decl)
            si = None
            if self.idx is not None:
                si = "si_int"
                decl = f"shared int {si}[{wg}];"
                if decl not in self.shared:
                    self.shared.append(decl)
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
        if res_i is not None:
            return r.define(self.node.dtype.glsl, glsl.cast(res_i, dtypes.int32, self.node.dtype, r.need), "red")
        if self.node.dtype is not self.d:
            return r.define(self.node.dtype.glsl, glsl.cast(res, self.d, self.node.dtype, r.need), "red")
        return res

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
        if rop in (ReduceOp.SUM, ReduceOp.PROD) or not d.is_float or rop is ReduceOp.ARGMIN:
            # argmin's accumulators are never NaN: NaN never compares less, and the identity is +inf
            m = r.define(d.glsl, f"{fn}({v})", "sg")
            nan = None
        else:
            # subgroupMax/Min may drop a NaN as GLSL's max does, but max, min and argmax propagate it
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


def _reduce(k: Kernel, lim: Limits, params: dict[int, int], allow_split: bool = True) -> Lowered:
    root = k.root
    reds = [n for n in root.toposort() if n.op is Op.REDUCE]
    full, axes = reds[0].srcs[0].shape, reds[0].arg[1]
    out_shape = reds[0].shape
    rows = prod(out_shape)
    rshape = tuple(full[a] for a in axes)
    rlen = prod(rshape)
    row_root = root.numel == rows
    if allow_split and row_root and len(reds) == 1 and reds[0].arg[0] not in _ARG and rlen >= 32768 and rows < 64:
        return _split(k, reds[0], lim, params)
    grouped = rlen >= 128 or rows < 256
    # few long rows (a norm over a decode batch's hidden states; sampling's fused reductions over a vocabulary,
    # which cannot split) take the widest workgroup the device allows: one workgroup per row is all the
    # parallelism there is, and fewer serial loads per invocation cut the latency (11 us -> ~3 us for 4096)
    wg = (_wg(lim, 1024) if rows <= 32 and rlen >= 2048 else _wg(lim)) if grouped else 1
    local = wg if grouped else _wg(lim, 64)
    groups = rows if grouped else math.ceil(rows / local)
    r = Renderer(lim.max_storage_range, params)
    shared: list[str] = []
    r.emit(f"int grp = {GROUP_ID};")
    r.emit(f"if (grp >= {groups}) return;")
    r.emit("int lid = int(gl_LocalInvocationID.x);")
    r.emit("int o = grp;" if grouped else f"int o = grp * {local} + lid;")
    ovar = Var("o", 0, rows - 1)
    oc = unravel(ovar, out_shape)
    rc = unravel(Var("r", 0, rlen - 1), rshape)
    start, step = ("lid", wg) if grouped else ("0", 1)
    with r.block("if (true)" if grouped or rows % local == 0 else f"if (o < {rows})"):
        for red in reds:
            acc = _Reduction(r, red, wg, shared, lim)
            with r.block(f"for (int r = {start}; r < {rlen}; r += {step})"):
                acc.add(r.value(red.srcs[0], _full_coords(oc, rc, axes)), "r")
            r.subst[red] = acc.finish()
        if row_root:
            with r.block("if (lid == 0)" if grouped else "if (true)"):
                coords = unravel(ovar, root.shape)
                r.store(k.out, k.out.dtype, k.st, coords, r.value(root, coords))
        else:
            with r.block(f"for (int r = {start}; r < {rlen}; r += {step})"):
                coords = _full_coords(oc, rc, axes)
                r.store(k.out, k.out.dtype, k.st, coords, r.value(root, coords))
    name = f"R{len(reds)}_{rows}_{rlen}"
    return Lowered([_finish(r, name, local, groups, lim, shared)], [])


def _acc_dtype(d: DType) -> DType:
    return dtypes.float32 if d.is_float else d


UNROLL = 4


def _split(k: Kernel, red: Node, lim: Limits, params: dict[int, int]) -> Lowered:
    """Partial reductions over chunks of each row into scratch, then a reduce kernel over the partials."""
    full, axes = red.srcs[0].shape, red.arg[1]
    out_shape = red.shape
    rows = prod(out_shape)
    rshape = tuple(full[a] for a in axes)
    rlen = prod(rshape)
    parts = min(4096, math.ceil(rlen / 8192))
    chunk = math.ceil(rlen / parts)
    wg = _wg(lim)
    acc_d = _acc_dtype(red.srcs[0].dtype)
    scratch = BufferRef(acc_d, rows * parts)
    r = Renderer(lim.max_storage_range, params)
    shared: list[str] = []
    r.emit(f"int grp = {GROUP_ID};")
    r.emit(f"if (grp >= {rows * parts}) return;")
    r.emit("int lid = int(gl_LocalInvocationID.x);")
    r.emit(f"int o = grp / {parts};")
    r.emit(f"int part = grp % {parts};")
    oc = unravel(Var("o", 0, rows - 1), out_shape)
    rc = unravel(Var("r", 0, rlen - 1), rshape)
    src = red.srcs[0]
    if acc_d is not src.dtype:
        src = alu_node(Op.CAST, acc_d, src)
    partial = reduce(src, red.arg[0], axes)
    acc = _Reduction(r, partial, wg, shared, lim)
    end = r.define("int", f"min({rlen}, (part + 1) * {chunk})", "end")
    r.emit(f"int r = part * {chunk} + lid;")
    # four loads in flight per invocation before they are combined: the split reduction is bandwidth-bound
    with r.block(f"for (; r + {(UNROLL - 1) * wg} < {end}; r += {UNROLL * wg})"):
        rv = Var("r", 0, max(rlen - 1 - (UNROLL - 1) * wg, 0))  # the loop test keeps r + 3 * wg in range
        vals = [r.value(src, _full_coords(oc, unravel(rv + k * wg, rshape), axes)) for k in range(UNROLL)]
        for v in vals:
            acc.add(v, "r")
    with r.block(f"for (; r < {end}; r += {wg})"):
        acc.add(r.value(src, _full_coords(oc, rc, axes)), "r")
    res = acc.finish()
    with r.block("if (lid == 0)"):
        r.store(scratch, acc_d, ShapeTracker.contiguous((rows * parts,)), (Var("grp", 0, rows * parts - 1),), res)
    first = _finish(r, f"P_{rows}_{rlen}_{parts}", wg, rows * parts, lim, shared)
    pnode = buffer(scratch, 0, acc_d, out_shape + (parts,))
    combine = {ReduceOp.SUM: ReduceOp.SUM, ReduceOp.PROD: ReduceOp.PROD, ReduceOp.MAX: ReduceOp.MAX,
               ReduceOp.MIN: ReduceOp.MIN}[red.arg[0]]
    total = movement(reduce(pnode, combine, (len(out_shape),)), lambda st: st.reshape(out_shape))
    if total.dtype is not red.dtype:
        total = alu_node(Op.CAST, red.dtype, total)
    second = _reduce(Kernel(substitute(k.root, {red: total}), k.out, k.st), lim, params, allow_split=False)
    return Lowered([first] + second.programs, [scratch] + second.scratch)


# ---- matmul -----------------------------------------------------------------------------------------------------

BM = BN = 64
BK = 16
TPT = 4  # results per invocation along m and along n


def _matmul(k: Kernel, mm: Node, lim: Limits, params: dict[int, int]) -> Lowered:
    a, b = mm.srcs
    batch = mm.shape[:-2]
    m_, n_, k_ = a.shape[-2], b.shape[-1], a.shape[-1]
    nb = prod(batch)
    tiles_m, tiles_n = math.ceil(m_ / BM), math.ceil(n_ / BN)
    groups = nb * tiles_m * tiles_n
    wg = (BM // TPT) * (BN // TPT)
    t = mm.dtype.glsl
    acc_d = _acc_dtype(mm.dtype)
    shared = [f"shared {acc_d.glsl} As[{BK}][{BM}];", f"shared {acc_d.glsl} Bs[{BK}][{BN}];"]
    r = Renderer(lim.max_storage_range, params)
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
        tile_load(a, "am", "ak", f"tm * {BM} + e / {BK}", f"k0 + e % {BK}", m_, k_,
                  f"As[e % {BK}][e / {BK}] = {{v}};", BM * BK)
        tile_load(b, "bk", "bn", f"k0 + e / {BN}", f"tn * {BN} + e % {BN}", k_, n_,
                  f"Bs[e / {BN}][e % {BN}] = {{v}};", BK * BN)
        r.emit("barrier();")
        with r.block(f"for (int kk = 0; kk < {BK}; kk++)"):
            r.emit(f"{acc_d.glsl} av[{TPT}]; {acc_d.glsl} bv[{TPT}];")
            r.emit(f"for (int i = 0; i < {TPT}; i++) av[i] = As[kk][ty + {BM // TPT} * i];")
            r.emit(f"for (int j = 0; j < {TPT}; j++) bv[j] = Bs[kk][tx + {BN // TPT} * j];")
            r.emit(f"for (int i = 0; i < {TPT}; i++) for (int j = 0; j < {TPT}; j++) "
                   f"acc[i * {TPT} + j] += av[i] * bv[j];")
        r.emit("barrier();")
    with r.block(f"for (int i = 0; i < {TPT}; i++)"):
        with r.block(f"for (int j = 0; j < {TPT}; j++)"):
            r.emit(f"int m = tm * {BM} + ty + {BM // TPT} * i;")
            r.emit(f"int n = tn * {BN} + tx + {BN // TPT} * j;")
            with r.block(f"if (m < {m_} && n < {n_})"):
                r.subst[mm] = r.define(t, glsl.cast(f"acc[i * {TPT} + j]", acc_d, mm.dtype, r.need), "mm")
                coords = bc + (Var("m", 0, m_ - 1), Var("n", 0, n_ - 1))
                r.store(k.out, k.out.dtype, k.st, coords, r.value(k.root, coords))
    return Lowered([_finish(r, f"M_{nb}_{m_}_{n_}_{k_}", wg, groups, lim, shared)], [])


def _runtime_leaves(nodes: list[Node]) -> tuple[list[Node], list[Node]]:
    """The leaves among nodes whose values the kernel takes as push constants, and the float constants that
    would be but are over the budget (literals then), both in the order of nodes.

    RNG seeds and Variables always are push constants; float constants get what is left of PUSH_BYTES after them
    and the offsets, at most MAX_PUSH_FLOATS. The budget follows from the nodes alone, so equal kernel structures
    make equal choices."""
    cand = [n for n in nodes if not n.srcs and runtime_values(n)]
    fixed = sum(4 * len(runtime_values(n)) for n in cand if n.op is not Op.CONST)
    budget = min(MAX_PUSH_FLOATS, (PUSH_BYTES - 4 * MAX_PUSH_OFFSETS - fixed) // 4)
    leaves, baked = [], []
    for n in cand:
        if n.op is Op.CONST:
            if budget <= 0:
                baked.append(n)
                continue
            budget -= 1
        leaves.append(n)
    return leaves, baked


def _signature(k: Kernel, nodes: list[Node], leaves: list[Node]) -> tuple[tuple, list[BufferRef]]:
    """The kernel's structure with buffers numbered by first use and runtime leaves as placeholders, and the
    buffers in that order."""
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

    for n in nodes:
        if n.op is Op.BUFFER:
            arg = ("buf", slot(n.arg[0]), n.arg[0].numel)
        else:
            arg = "param" if id(n) in runtime else argkey(n.arg)
        index[id(n)] = len(entries)
        entries.append((n.op, n.dtype, arg, n.shape, tuple(index[id(s)] for s in n.srcs)))
    entries.append(("out", slot(k.out), k.out.numel, k.out.dtype, k.st))
    return tuple(entries), refs


_CACHE: dict[tuple, Lowered] = {}  # bindings hold slot numbers (ints) for the kernel's buffers, never buffers
_CACHE_SIZE = 2048


def lower(k: Kernel, lim: Limits) -> Lowered:
    """GLSL programs for kernel k, remembered by the kernel's structure so a repeated graph skips rendering.

    RNG seeds and counters, Variables and float constants are push constants (`Lowered.leaves`, named per
    program in `Program.params`), so the same kernel over new such values is the same program text."""
    nodes = k.root.toposort()
    leaves, baked = _runtime_leaves(nodes)
    key, refs = _signature(k, nodes, leaves)
    key = (key, lim)
    hit = _CACHE.get(key)
    if hit is None:
        lowered = _lower(k, lim, {id(n): i for i, n in enumerate(leaves)})
        lowered.leaves, lowered.baked = leaves, baked
        slot = {id(r): i for i, r in enumerate(refs)}
        if len(_CACHE) >= _CACHE_SIZE:
            del _CACHE[next(iter(_CACHE))]
        _CACHE[key] = Lowered([Program(p.name, p.src, [(slot.get(id(ref), ref), off, n) for ref, off, n in p.bindings],
                                       p.groups, p.push, p.params) for p in lowered.programs], lowered.scratch)
        return lowered
    progs = []
    for p in hit.programs:
        push = p.push
        if p.params:  # this kernel's own values in place of those the cached programs were rendered with
            push = dict(push)
            for name, i, part in p.params:
                push[name] = runtime_values(leaves[i])[part]
        bindings = [(refs[r] if isinstance(r, int) else r, off, n) for r, off, n in p.bindings]
        progs.append(Program(p.name, p.src, bindings, p.groups, push, p.params))
    return Lowered(progs, hit.scratch, leaves, baked)


def _lower(k: Kernel, lim: Limits, params: dict[int, int]) -> Lowered:
    """GLSL programs (one, or two for a split reduction) that compute kernel k; `params` maps the ids of its
    runtime leaves to their positions in `Lowered.leaves`."""
    nodes = k.root.toposort()
    mms = [n for n in nodes if n.op is Op.MATMUL]
    if mms:
        return _matmul(k, mms[0], lim, params)
    if any(n.op is Op.REDUCE for n in nodes):
        return _reduce(k, lim, params)
    return _elementwise(k, lim, params)

"""Render a kernel's node graph as GLSL statements, one value per (node, coordinates).

`Renderer.value(node, coords)` returns the GLSL name of the node's value at the given symbolic coordinates,
emitting the statements that compute it. Views turn coordinates into buffer indices (and validity, for pads)
through `symbolic`; equal (node, coordinates) pairs are computed once per scope. Buffers become bindings in
order of first use, and the first view's offset of each load becomes a push constant, so slicing at a new
position reuses the compiled kernel. The same holds for the leaves given as runtime parameters (RNG seeds and
counters, Variables, float constants: see graph.runtime_values): each of their values is a push-constant field,
listed in `param_fields`, that the caller fills at each dispatch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..dtype import DType, dtypes
from ..graph import ELEMENTWISE, Node, Op, Variable, runtime_values
from ..view import ShapeTracker, prod
from . import glsl, symbolic
from .symbolic import Expr, Num, Var, in_range, itype, lit, num, ravel, unravel

Coords = tuple[Expr, ...]
PUSH_BYTES = 128  # the push-constant space every Vulkan device offers (maxPushConstantsSize's minimum)
MAX_PUSH_OFFSETS = 12  # further offsets are baked in
MAX_PUSH_FLOATS = 8  # float constants of a kernel past this, or past what PUSH_BYTES leaves, are literals
ZERO_FIELD = "z"  # the push-constant zero that hides special float constants (Renderer.special_float)
RESERVED_FIELDS = 1  # push-constant fields a kernel may need besides offsets, values and rows: ZERO_FIELD


class Renderer:
    def __init__(self, max_range: int = 1 << 62, params: dict[int, int] | None = None, precise: bool = False,
                 float_modes: tuple[str, ...] = ()) -> None:
        self.lines: list[str] = []
        # IEEE results as numpy's: float temporaries are `precise` (the driver may neither fold, reorder nor fuse
        # their arithmetic), special float constants are opaque to the compiler, and the shader asks for the
        # float controls in float_modes (see glsl.FLOAT_MODES)
        self.precise, self.float_modes = precise, float_modes
        self._zero: str | None = None
        self.depth = 1
        self.max_range = max_range  # bytes one binding may cover; larger buffers are bound in pieces
        self.bindings: list[tuple[object, DType]] = []  # (BufferRef, dtype) in order of first use
        self._binding: dict[int, int] = {}
        self.written: set[int] = set()
        self.push: list[tuple[str, str, Any]] = []  # (name, GLSL type, value)
        self.params = params or {}  # id(node) -> index, for the leaves rendered as runtime parameters
        self.param_fields: list[tuple[str, int, int]] = []  # (push field, parameter index, which of its values)
        self._param_names: dict[tuple[int, int], str] = {}
        self.need: set[str] = set()
        self.ext: set[str] = set()  # GLSL extensions the body uses beyond those its buffer types imply
        self.block_types: dict[int, str] = {}  # binding -> element type declared in place of its dtype's (vec4)
        self.subst: dict[Node, str] = {}
        # a kernel whose outer extent is a run-time value is rendered over stand-in shapes and views (see
        # lower._Dynamic): nodes and views missing here render with their own
        self.shapes: dict[Node, tuple[int, ...]] = {}
        self.sts: dict[Node, ShapeTracker] = {}
        self._scopes: list[dict] = [{}]
        self._n = 0

    # ---- emission -------------------------------------------------------------------------------------------
    def emit(self, line: str) -> None:
        self.lines.append("  " * self.depth + line)

    def tmp(self, prefix: str = "v") -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def define(self, gtype: str, expr: str, prefix: str = "v") -> str:
        name = self.tmp(prefix)
        self.emit(f"{'precise ' if self.precise and gtype == 'float' else ''}{gtype} {name} = {expr};")
        return name

    @contextmanager
    def block(self, header: str) -> Iterator[None]:
        """A `{ ... }` block whose computed values are forgotten when it closes."""
        self.emit(header + " {")
        self.depth += 1
        self._scopes.append({})
        try:
            yield
        finally:
            self._scopes.pop()
            self.depth -= 1
            self.emit("}")

    # ---- buffers and push constants -------------------------------------------------------------------------
    def binding(self, ref: object, dtype: DType, write: bool = False) -> int:
        i = self._binding.get(id(ref))
        if i is None:
            i = self._binding[id(ref)] = len(self.bindings)
            self.bindings.append((ref, dtype))
            self.need |= glsl.helpers_for_load_store(dtype)
        if write:
            self.written.add(i)
        return i

    def push_const(self, gtype: str, value: Any, prefix: str = "p") -> str:
        """A push-constant field; `value` is an int or float, or a runtime Variable read at each dispatch."""
        name = f"{prefix}{len(self.push)}"
        self.push.append((name, gtype, value if isinstance(value, Variable | float) else int(value)))
        return f"pc.{name}"

    def param(self, n: Node, part: int, gtype: str, prefix: str) -> str:
        """Value `part` of leaf n's runtime values: one push-constant field per leaf and value."""
        ref = self._param_names.get((id(n), part))
        if ref is None:
            if id(n) in self.params:
                self.param_fields.append((f"{prefix}{len(self.push)}", self.params[id(n)], part))
            ref = self._param_names[(id(n), part)] = self.push_const(gtype, runtime_values(n)[part], prefix)
        return ref

    def special_float(self, value: float) -> str:
        """A float constant the shader compiler cannot see: drivers fold literal arithmetic with zeros, infinities,
        NaN and subnormals against IEEE (`x * 0.0` is 0 for an infinite x, `0.0 / 0.0` garbage on lavapipe), even
        under `precise` and SignedZeroInfNanPreserve; OR-ing the bits with a push-constant zero keeps the value
        and hides it. One field (ZERO_FIELD) serves every such constant of the kernel."""
        if self._zero is None:
            self._zero = self.push_const("uint", 0, ZERO_FIELD)
        return f"uintBitsToFloat({self._zero} | {glsl.float_bits(value):#x}u)"

    def masked_zero(self, dtype: DType) -> str:
        """The zero a view reads where its mask leaves nothing valid (a pad's border sliced alone): a constant the
        compiler sees, so hidden like any special float (lavapipe turned `x / 0.0` from such a view into
        garbage)."""
        return self.special_float(0.0) if self.precise and dtype.is_float else glsl.zero(dtype)

    def offset(self, value: int) -> Expr:
        if value == 0:
            return Num(0)
        if sum(1 for p in self.push if p[0].startswith("o")) >= MAX_PUSH_OFFSETS or value >= symbolic.NARROW:
            return num(value)
        return Var(self.push_const("int", value, "o"), value, value)

    # ---- indexing -------------------------------------------------------------------------------------------
    def st_index(self, st: ShapeTracker, coords: Coords) -> tuple[Expr, list[str]]:
        """Flat index into the tracker's source and the validity conditions, without the first view's offset."""
        valid: list[str] = []
        idx: Expr = Num(0)
        views = st.views
        for k in range(len(views) - 1, -1, -1):
            v = views[k]
            if v.mask is not None:
                for c, (lo, hi) in zip(coords, v.mask, strict=True):
                    valid += in_range(c, lo, hi)
            idx = Num(v.offset if k else 0)
            for c, s in zip(coords, v.strides, strict=True):
                if s:
                    idx = idx + c * s
            if k:
                coords = unravel(_clamp(idx, views[k - 1].numel), views[k - 1].shape)
        return idx, valid

    def piece_elems(self, ref: object, dtype: DType) -> int | None:
        """Elements per piece when ref is too large for one binding, or has more elements than a 32-bit index
        reaches (a power of two), else None."""
        if ref.nbytes <= self.max_range and ref.numel <= symbolic.NARROW:
            return None
        return min((1 << (self.max_range.bit_length() - 1)) // dtype.itemsize, symbolic.NARROW // 2)

    def pieces(self) -> list[tuple[object, DType, int, int | None]]:
        """(ref, dtype, byte offset, byte count or None for all) per GLSL binding, in binding order."""
        out = []
        for ref, d in self.bindings:
            per = self.piece_elems(ref, d)
            if per is None:
                out.append((ref, d, 0, None))
                continue
            for start in range(0, ref.numel, per):
                out.append((ref, d, start * d.itemsize, min(per, ref.numel - start) * d.itemsize))
        return out

    def _access(self, b: int, idx: Expr) -> list[tuple[str, str]]:
        """(condition, element reference) pairs that reach element idx of buffer b."""
        ref, d = self.bindings[b]
        per = self.piece_elems(ref, d)
        if per is None:  # idx lies in the buffer, whose elements an int reaches
            return [("", f"b{b}.data[{idx.render() if idx.is_narrow else f'int({idx.render()})'}]")]
        n = -(-ref.numel // per)
        shift = per.bit_length() - 1
        if idx.is_narrow and not idx.wide_calc:
            p = self.define("int", f"{idx.render()} >> {shift}", "piece")
            local = f"({idx.render()} & {per - 1})"
        else:
            wide = self.define("int64_t", idx.render64(), "at")
            p = self.define("int", f"int({wide} >> {shift})", "piece")
            local = f"int({wide} & {per - 1}l)"
        return [(f"{p} == {k}" if k < n - 1 else "", f"b{b}_{k}.data[{local}]") for k in range(n)]

    def load(self, ref: object, dtype: DType, idx: Expr, valid: list[str]) -> str:
        b = self.binding(ref, dtype)
        if "false" in valid:
            return self.masked_zero(dtype)
        parts = self._access(b, idx)
        e = glsl.load(dtype, parts[-1][1])
        for cond, where in reversed(parts[:-1]):
            e = f"({cond} ? {glsl.load(dtype, where)} : {e})"
        if valid:
            e = f"(({' && '.join(valid)}) ? {e} : {glsl.zero(dtype)})"
        return self.define(dtype.glsl, e)

    def store(self, ref: object, dtype: DType, st: ShapeTracker, coords: Coords, value: str) -> None:
        """Write value at coords of st's shape, through st into the buffer (setitem stores through a view)."""
        b = self.binding(ref, dtype, write=True)
        idx, valid = self.st_index(st, coords)
        idx = idx + self.offset(st.views[0].offset)
        v = glsl.store(dtype, value)
        parts = self._access(b, idx)
        line = " else ".join((f"if ({c}) " if c else "") + f"{{ {w} = {v}; }}" for c, w in parts) \
            if len(parts) > 1 else f"{parts[0][1]} = {v};"
        self.emit(f"if ({' && '.join(valid)}) {{ {line} }}" if valid else line)

    # ---- values ---------------------------------------------------------------------------------------------
    def value(self, n: Node, coords: Coords) -> str:
        if n in self.subst:
            return self.subst[n]
        if n.op is Op.CONST:
            if id(n) in self.params:
                return self.param(n, 0, "float", "f")
            if self.precise and n.dtype.is_float and glsl.is_special(n.arg):
                return self.special_float(n.arg)
            return glsl.literal(n.arg, n.dtype)
        key = (n, tuple(c.render() for c in coords))
        for scope in reversed(self._scopes):
            if key in scope:
                return scope[key]
        out = self._compute(n, coords)
        self._scopes[-1][key] = out
        return out

    def _compute(self, n: Node, coords: Coords) -> str:
        if n.op is Op.BUFFER:
            return self.load(n.arg[0], n.dtype, ravel(coords, self.shapes.get(n, n.shape)), [])
        if n.op is Op.VIEW:
            return self._view(n, coords)
        if n.op is Op.RAND:
            self.need.add("rng")
            seed, ctr = self.param(n, 0, "uint", "r"), self.param(n, 1, "uint", "r")
            return self.define("float", f"rng({seed}, {ctr} + uint({ravel(coords, n.shape).render()}))")
        if n.op is Op.IOTA:
            return coords[0].render() if coords[0].is_narrow else f"int({coords[0].render()})"
        if n.op is Op.VAR:
            return self.define("int", self.param(n, 0, "int", "v"))
        if n.op in ELEMENTWISE:
            args = [self.value(s, coords) for s in n.srcs]
            srcs = [s.dtype for s in n.srcs]
            if n.op is Op.WHERE:
                srcs = [n.srcs[1].dtype]
            e = glsl.alu(n.op, n.dtype, srcs, args, self.need)
            if n.op not in (Op.CAST, Op.BITCAST, Op.WHERE):
                e = glsl.round_to(n.dtype, e, self.need)  # a float16 result holds a float16 value
            return self.define(n.dtype.glsl, e)
        if n.op is Op.GATHER:
            return self._gather(n, coords)
        raise NotImplementedError(f"{n.op.name} cannot be rendered inside this kernel")

    def _view(self, n: Node, coords: Coords) -> str:
        src, st = n.srcs[0], self.sts.get(n, n.arg)
        idx, valid = self.st_index(st, coords)
        if src.op is Op.BUFFER:
            return self.load(src.arg[0], src.dtype, idx + self.offset(st.views[0].offset), valid)
        if "false" in valid:
            return self.masked_zero(n.dtype)
        idx = idx + num(st.views[0].offset)
        shape = self.shapes.get(src, src.shape)
        inner = self.value(src, unravel(_clamp(idx, prod(shape)) if valid else idx, shape))
        if not valid:
            return inner
        return self.define(n.dtype.glsl, f"(({' && '.join(valid)}) ? {inner} : {glsl.zero(n.dtype)})")

    def _gather(self, n: Node, coords: Coords) -> str:
        x, idx = n.srcs
        axis, k = n.arg, len(idx.shape)
        iv = self.value(idx, coords[axis:axis + k])
        dim = x.shape[axis]
        t = itype(0, dim)
        i = self.define(t, f"{t}({iv})", "g")
        w = t != "int"
        g = self.define(t, f"clamp({i} < {lit(0, w)} ? {i} + {lit(dim, w)} : {i}, {lit(0, w)}, "
                           f"{lit(max(dim - 1, 0), w)})", "g")
        return self.value(x, coords[:axis] + (Var(g, 0, max(dim - 1, 0)),) + coords[axis + k:])


def _clamp(idx: Expr, numel: int) -> Expr:
    """idx when its bounds already fit [0, numel), else an opaque clamped copy (masked lanes compute garbage)."""
    if idx.lo >= 0 and idx.hi < numel:
        return idx
    top = max(numel - 1, 0)
    if idx.is_narrow and top < symbolic.NARROW:
        return Var(f"clamp({idx.render()}, 0, {top})", 0, top)
    e = f"clamp({idx.render64()}, 0l, {top}l)"
    return Var(e if top >= symbolic.NARROW else f"int({e})", 0, top)


def header(r: Renderer, local_size: tuple[int, int, int], shared: list[str]) -> str:
    """Version, extensions, bindings, push constants, shared memory and helpers for a rendered body."""
    types = {d for _, d in r.bindings}
    ext = []
    if any(d.itemsize == 1 for d in types):
        ext.append("GL_EXT_shader_8bit_storage")
    if any(d.itemsize == 2 for d in types):
        ext.append("GL_EXT_shader_16bit_storage")
    if dtypes.int64 in types or any("int64_t" in line for line in r.lines) or "int64_t" in "".join(shared):
        ext.append("GL_EXT_shader_explicit_arithmetic_types_int64")
    if r.float_modes:
        ext.append("GL_EXT_spirv_intrinsics")
    out = ["#version 450"] + [f"#extension {e} : require" for e in ext + sorted(r.ext)]
    out += [glsl.FLOAT_MODES[m] for m in r.float_modes]
    out.append("layout(local_size_x = {}, local_size_y = {}, local_size_z = {}) in;".format(*local_size))
    slot = 0
    for i, (ref, d) in enumerate(r.bindings):
        access = "" if i in r.written else "readonly "
        per = r.piece_elems(ref, d)
        names = [f"b{i}"] if per is None else [f"b{i}_{k}" for k in range(-(-ref.numel // per))]
        for name in names:
            store = r.block_types.get(i, d.store)
            out.append(f"layout(set = 0, binding = {slot}) {access}buffer B{slot} {{ {store} data[]; }} {name};")
            slot += 1
    if r.push:
        fields = " ".join(f"{t} {name};" for name, t, _ in r.push)
        out.append(f"layout(push_constant) uniform PC {{ {fields} }} pc;")
    out += shared
    helpers = glsl.helper_source(r.need)
    if helpers:
        out.append(helpers)
    return "\n".join(out)

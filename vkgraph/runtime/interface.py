"""What a GLSL compute kernel declares: bindings, push constants, specialization constants, local size.

Parsed from the source text (after `#include` expansion), so a kernel file is its own interface description:
the runtime builds descriptor layouts and packs push constants from it, and the template registry lists it.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CompileError, KernelInterfaceError

# std430 scalar types allowed in push constants and specialization constants: (struct code, size)
SCALAR_TYPES = {
    "int": ("i", 4), "uint": ("I", 4), "float": ("f", 4), "bool": ("I", 4),
    "int64_t": ("q", 8), "uint64_t": ("Q", 8), "double": ("d", 8),
}


@dataclass(frozen=True)
class Binding:
    index: int
    name: str
    readonly: bool
    writeonly: bool

    @property
    def written(self) -> bool:
        return not self.readonly


@dataclass(frozen=True)
class PushField:
    name: str
    type: str
    offset: int


@dataclass(frozen=True)
class SpecConstant:
    id: int
    name: str
    type: str
    default: str


@dataclass
class KernelInterface:
    bindings: list[Binding] = field(default_factory=list)
    push_fields: list[PushField] = field(default_factory=list)
    push_size: int = 0
    spec_constants: dict[str, SpecConstant] = field(default_factory=dict)
    local_size: tuple[int | str, int | str, int | str] = (1, 1, 1)

    def push_struct(self) -> struct.Struct:
        """A struct.Struct packing the push-constant block at its std430 offsets."""
        fmt = "<"
        pos = 0
        for f in self.push_fields:
            if f.offset > pos:
                fmt += f"{f.offset - pos}x"
            code, size = SCALAR_TYPES[f.type]
            fmt += code
            pos = f.offset + size
        if self.push_size > pos:
            fmt += f"{self.push_size - pos}x"
        return struct.Struct(fmt)


_BUFFER_RE = re.compile(
    r"layout\s*\(([^)]*)\)\s*((?:(?:restrict|readonly|writeonly|coherent|volatile)\s+)*)buffer\s+(\w+)")
_PUSH_RE = re.compile(r"layout\s*\(\s*push_constant\s*\)\s*uniform\s+\w+\s*\{([^}]*)\}")
_SPEC_RE = re.compile(r"layout\s*\(\s*constant_id\s*=\s*(\d+)\s*\)\s*const\s+(\w+)\s+(\w+)\s*=\s*([^;]+);")
_LOCAL_RE = re.compile(r"layout\s*\(([^)]*local_size[^)]*)\)\s*in\s*;")
_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def parse_interface(source: str) -> KernelInterface:
    """Read the kernel's declarations from (include-expanded) GLSL source."""
    text = _COMMENT_RE.sub("", source)
    iface = KernelInterface()
    seen: set[int] = set()
    for m in _BUFFER_RE.finditer(text):
        quals = dict(_kv(p) for p in m.group(1).split(","))
        if "binding" not in quals:
            continue
        idx = int(quals["binding"])
        if int(quals.get("set", 0)) != 0:
            raise KernelInterfaceError(f"buffer {m.group(3)}: only descriptor set 0 is supported")
        if idx in seen:
            raise KernelInterfaceError(f"binding {idx} declared twice")
        seen.add(idx)
        mods = m.group(2).split()
        iface.bindings.append(Binding(idx, m.group(3), "readonly" in mods, "writeonly" in mods))
    iface.bindings.sort(key=lambda b: b.index)
    for pos, b in enumerate(iface.bindings):
        if b.index != pos:
            raise KernelInterfaceError(f"bindings must be numbered 0..n-1 without gaps; found {b.index} at {pos}")

    pm = _PUSH_RE.search(text)
    if pm:
        offset = 0
        for decl in pm.group(1).split(";"):
            decl = decl.strip()
            if not decl:
                continue
            parts = decl.split()
            if len(parts) != 2 or parts[0] not in SCALAR_TYPES or "[" in decl:
                raise KernelInterfaceError(
                    f"push constant {decl!r}: only scalars of {sorted(SCALAR_TYPES)} are supported")
            size = SCALAR_TYPES[parts[0]][1]
            offset = (offset + size - 1) // size * size
            iface.push_fields.append(PushField(parts[1], parts[0], offset))
            offset += size
        iface.push_size = (offset + 3) // 4 * 4

    for m in _SPEC_RE.finditer(text):
        sid, typ, name, default = int(m.group(1)), m.group(2), m.group(3), m.group(4).strip()
        if typ not in ("int", "uint", "float", "bool"):
            raise KernelInterfaceError(f"specialization constant {name}: type {typ} not supported")
        iface.spec_constants[name] = SpecConstant(sid, name, typ, default)

    lm = _LOCAL_RE.search(text)
    if lm:
        vals: list[int | str] = [1, 1, 1]
        by_id = {c.id: c.name for c in iface.spec_constants.values()}
        for part in lm.group(1).split(","):
            key, val = _kv(part)
            for axis, dim in enumerate("xyz"):
                if key == f"local_size_{dim}":
                    vals[axis] = int(val)
                elif key == f"local_size_{dim}_id":
                    if int(val) not in by_id:
                        raise KernelInterfaceError(f"{key} = {val} names no specialization constant")
                    vals[axis] = by_id[int(val)]
        iface.local_size = (vals[0], vals[1], vals[2])
    return iface


def _kv(part: str) -> tuple[str, str]:
    if "=" in part:
        k, v = part.split("=", 1)
        return k.strip(), v.strip()
    return part.strip(), ""


_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def expand_includes(source: str, include_dirs: list[Path], _depth: int = 0, _seen: frozenset = frozenset()) -> str:
    """Inline `#include "file"` lines, searching include_dirs in order; each file once per kernel."""
    if _depth > 16:
        raise CompileError("#include nested more than 16 deep")

    def repl(m: re.Match) -> str:
        name = m.group(1)
        for d in include_dirs:
            path = Path(d) / name
            if path.is_file():
                key = str(path.resolve())
                if key in _seen:
                    return ""
                return expand_includes(path.read_text(), include_dirs, _depth + 1, _seen | {key})
        raise CompileError(f'#include "{name}": not found in {[str(d) for d in include_dirs]}')

    return _INCLUDE_RE.sub(repl, source)

"""The layers of docs/architecture.md, checked on the source: which unit of vkgraph may import which.

Data flows Tensor -> graph -> schedule -> codegen -> runtime. Each compiler stage imports only the stages before
it (the types of its input), the runtime imports nothing above it, and the drivers (realize, tensor, jit) join
stages to the runtime. Imports are read with ast, lazy ones inside functions included; those under
`if TYPE_CHECKING:` (annotations only) are not imports at run time and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vkgraph

PKG = Path(vkgraph.__file__).resolve().parent

# unit -> the units it may import. A unit is a top-level module or subpackage of vkgraph; "vkgraph" is the
# package's own __init__ (the public API).
ALLOWED: dict[str, set[str]] = {
    "flags": set(),
    "interrupts": set(),
    "caches": {"interrupts"},
    "dtype": set(),
    "view": {"caches"},
    "quant": set(),
    "runtime": {"flags", "caches", "interrupts"},
    "graph": {"dtype", "view", "interrupts"},
    "schedule": {"graph", "view", "dtype"},
    "codegen": {"schedule", "graph", "view", "dtype", "caches", "flags"},
    # the quantized prefill product reuses codegen's cooperative-matrix tiling (codegen never imports templates)
    "templates": {"runtime", "quant", "flags", "codegen", "dtype"},
    "realize": {"codegen", "schedule", "graph", "view", "dtype", "runtime", "flags", "caches", "interrupts"},
    "tensor": {"realize", "graph", "view", "dtype"},
    "jit": {"tensor", "realize", "graph", "runtime", "caches", "interrupts"},
    "warmup": {"jit", "tensor", "runtime", "flags"},  # runs a function once to fill the compile caches
    # model code speaks Tensors: templates enter as graph ops (nn/template_ops.py); no runtime, no buffers
    "nn": {"jit", "tensor", "realize", "templates", "quant", "dtype", "view", "flags"},
    # tensor parallel: model shards (nn) on several devices (runtime), one thread per rank
    "parallel": {"nn", "runtime", "tensor", "flags", "jit", "graph", "dtype", "templates"},
    "distributed": {"nn", "parallel", "tensor"},  # the same ranks as Ray actors, across processes and hosts
    "generate": {"nn", "runtime", "quant", "warmup", "parallel"},
    "serve": {"nn", "parallel"},  # the HTTP server over the engine
    "info": {"runtime"},
    "vkgraph": {"caches", "dtype", "graph", "jit", "runtime", "tensor", "warmup"},
}
# modules that are part of another unit: the Tensor API's gradient half (autograd), its math functions, its
# advanced indexing and einsum (each imports tensor, tensor imports most of them)
PART_OF = {"autograd": "tensor", "tensor_math": "tensor", "tensor_index": "tensor", "einsum": "tensor"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PKG.parent / rel).with_suffix(".py").is_file() or (PKG.parent / rel / "__init__.py").is_file()


def imports_of(path: Path, source: str | None = None) -> set[str]:
    """The vkgraph modules `path` (or `source` read as if it were that file) imports at run time."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                for n in node.orelse:
                    self.visit(n)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(a.name for a in node.names if a.name.split(".")[0] == "vkgraph")

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "vkgraph":
                return
            for a in node.names:  # `from . import x` names a module; `from .m import f` names m
                sub = f"{module}.{a.name}"
                found.add(sub if _is_module(sub) else module)

    Visitor().visit(ast.parse(path.read_text() if source is None else source, str(path)))
    return found


def unit(module: str) -> str:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "vkgraph"
    return PART_OF.get(name, name)


def _edges() -> dict[str, set[str]]:
    return {_module_name(p): imports_of(p) for p in sorted(PKG.rglob("*.py"))}


def test_every_unit_is_placed():
    units = {unit(m) for m in _edges()}
    assert units <= set(ALLOWED), f"place these in ALLOWED (and in docs/architecture.md): {units - set(ALLOWED)}"


def test_units_import_only_the_layers_they_build_on():
    bad = []
    for module, deps in _edges().items():
        u = unit(module)
        for d in deps:
            if unit(d) != u and unit(d) not in ALLOWED.get(u, set()):
                bad.append(f"{module} imports {d}")
    assert not bad, "\n".join(bad)


def _assert_no_cycle(edges: dict[str, set[str]], what: str) -> None:
    """Depth-first search over `edges`; raises AssertionError "<what>: a -> b -> a" at the first cycle."""
    state: dict[str, int] = {}

    def visit(u: str, path: list[str]) -> None:
        if state.get(u) == 1:
            raise AssertionError(f"{what}: {' -> '.join(path + [u])}")
        if state.get(u) == 2:
            return
        state[u] = 1
        for d in sorted(edges[u]):
            visit(d, path + [u])
        state[u] = 2

    for u in edges:
        visit(u, [])


def test_the_allowed_imports_have_no_cycle():
    _assert_no_cycle(ALLOWED, "cycle")


def test_a_forbidden_import_is_seen():
    """The checker itself: a lazy import of the runtime inside a codegen function counts, one under
    TYPE_CHECKING does not."""
    probe = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..runtime import Device\n"
             "def f():\n    from ..runtime.vk import lib\n    from . import glsl\n")
    assert imports_of(PKG / "codegen" / "lower.py", probe) == {"vkgraph.runtime.vk", "vkgraph.codegen.glsl"}


def _runtime_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((PKG / "runtime").glob("*.py")) if p.name != "__init__.py"}


def test_the_runtime_has_no_import_cycle():
    """Its units (vk, errors, memory, descriptors, hazards, submission, queue, capture, transfer, pipeline,
    compiler, device...) form a DAG: a cycle means two units that cannot be understood or tested apart."""
    mods = _runtime_modules()
    edges = {m: {d for d in imports_of(p) if d in mods} for m, p in mods.items()}
    _assert_no_cycle(edges, "import cycle")


def _private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every `obj._name` whose obj is not self or cls."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            out.append((node.lineno, node.attr))
    return out


def _defined(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def test_runtime_units_call_no_private_member_of_another():
    """A unit uses another's public methods only: `queue._new_descriptor_set` from a captured graph was the
    kind of coupling that made the runtime one knot. Private names on other objects must be this module's own
    (e.g. a Buffer returning itself to its pool, both in memory.py)."""
    bad = []
    for m, p in _runtime_modules().items():
        tree = ast.parse(p.read_text())
        own = _defined(tree)
        bad += [f"{m}:{line} uses ._{name[1:]}" for line, name in _private_uses(tree)
                if name not in own and name not in ("_vulkan",)]
    assert not bad, "\n".join(bad)

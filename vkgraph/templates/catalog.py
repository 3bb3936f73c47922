"""The registry of the hand-tuned templates: each `glsl/*.comp` of this package, described by its own declarations.

The sources ship inside the package (package data), so they are found through the package wherever it is
installed. A template's name is its file stem; its interface (bindings, push constants, specialization
constants, local size) is parsed from the source by the runtime's parser, so adding a file registers it.
Launchers compile and dispatch templates through `compile` and `dispatch` here, which counts dispatches by
template name so the tests can show that every template is exercised.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ..runtime import Device, Pipeline
from ..runtime.interface import KernelInterface, expand_includes, parse_interface

# the GLSL sources and their shared includes (`#include "common.glsl"` resolves here)
GLSL_DIR = Path(__file__).resolve().parent / "glsl"

# dispatches recorded per template name in this process
DISPATCHES: Counter[str] = Counter()


@dataclass(frozen=True)
class Template:
    name: str
    path: Path
    source: str
    interface: KernelInterface

    @property
    def binding_names(self) -> list[str]:
        return [b.name for b in self.interface.bindings]

    @property
    def push_names(self) -> list[str]:
        return [f.name for f in self.interface.push_fields]

    @property
    def spec_names(self) -> list[str]:
        return sorted(self.interface.spec_constants, key=lambda n: self.interface.spec_constants[n].id)


@cache
def registry() -> dict[str, Template]:
    """Every template in glsl/, by name."""
    out: dict[str, Template] = {}
    for path in sorted(GLSL_DIR.glob("*.comp")):
        source = path.read_text()
        out[path.stem] = Template(path.stem, path, source, parse_interface(expand_includes(source, [GLSL_DIR])))
    return out


def get(name: str) -> Template:
    try:
        return registry()[name]
    except KeyError:
        raise KeyError(f"no template {name!r}; known: {sorted(registry())}") from None


def compile(dev: Device, name: str, *, spec: dict[str, Any] | None = None,
            defines: dict[str, Any] | None = None, label: str | None = None) -> Pipeline:
    """The template compiled for `dev` (cached by the runtime on source, defines and spec). `label`: the name its
    dispatches are counted and profiled under, where a variant should stand apart from the template's name."""
    return dev.pipeline(get(name).source, spec=spec, defines=defines, name=label or name, include_dirs=[GLSL_DIR])


def dispatch(dev: Device, pipeline: Pipeline, buffers: list[Any], groups: tuple[int, int, int],
             push: dict[str, Any] | None = None) -> None:
    """Record a dispatch of a compiled template, counting it under the template's name."""
    dev.dispatch(pipeline, buffers, groups, push=push)
    DISPATCHES[pipeline.name] += 1

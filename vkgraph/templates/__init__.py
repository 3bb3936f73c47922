"""Hand-tuned GLSL templates, in one home: the GLSL sources (`glsl/`, package data), their registry
(`catalog`), and their launchers over runtime Buffers (`matvec`, `dequant`, `paged_attention`, `norms`).

`vkgraph.nn.template_ops` makes each launcher an op of the graph (a custom node) for model code.
"""

from .catalog import DISPATCHES, GLSL_DIR, Template, compile, dispatch, get, registry

__all__ = ["DISPATCHES", "GLSL_DIR", "Template", "compile", "dispatch", "get", "registry"]

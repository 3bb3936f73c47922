"""Kernel -> GLSL: index expressions from views, launch shapes within device limits, the rendered source."""

from . import matmul_coop, tune
from .lower import Limits, Lowered, Program, fold_groups, lower

__all__ = ["Limits", "Lowered", "Program", "fold_groups", "lower", "matmul_coop", "tune"]

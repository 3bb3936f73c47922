"""Kernel -> GLSL: index expressions from views, launch shapes within device limits, the rendered source."""

from .lower import Limits, Lowered, Program, fold_groups, lower

__all__ = ["Limits", "Lowered", "Program", "fold_groups", "lower"]

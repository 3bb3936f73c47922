"""Python entry points that dispatch the hand-tuned templates (vkgraph/templates) over runtime Buffers."""

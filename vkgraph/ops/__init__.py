"""Python entry points that dispatch the hand-tuned templates in kernels/ over runtime Buffers."""

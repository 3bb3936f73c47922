"""`python -m vkgraph.flags`: every environment variable vkgraph reads, with its default and current value.

A package's __main__ (rather than `if __name__ == "__main__"` in the module) because importing vkgraph imports
the flags first, and runpy warns when it re-runs a module already imported."""

from . import table

print(table())

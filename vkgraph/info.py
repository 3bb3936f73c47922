"""`python -m vkgraph.info`: the chosen device, its features and limits, as a table."""

from __future__ import annotations

from .runtime import get_device


def table() -> str:
    info = get_device().info
    rows = info.rows()
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


if __name__ == "__main__":
    print(table())

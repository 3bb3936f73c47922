"""An OpenAI-compatible server over vkgraph's continuous-batching engine: `python -m vkgraph.serve --model PATH`.

See docs/serving.md. `create_app` builds the FastAPI app over an `AsyncEngine` (the one engine, on its own thread).
"""

from .app import APIError, ServerState, create_app
from .async_engine import AsyncEngine, QueueFull, ShuttingDown

__all__ = ["APIError", "AsyncEngine", "QueueFull", "ServerState", "ShuttingDown", "create_app"]

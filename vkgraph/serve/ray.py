"""Replicas of the OpenAI-compatible server on Ray Serve, with prefix-aware routing.

    python -m vkgraph.serve.ray --model PATH --replicas 2 [--gpus-per-replica 1] [any `vkgraph.serve` option]
    serve run vkgraph.serve.ray:app_builder model=PATH replicas=2     (Ray's own CLI; key=value options)

Two deployments (docs/serving.md):
- `Replica` (N of them): each loads the model on its own Vulkan device and runs the whole server app
  (`create_app`: the same routes, errors, metrics and engine) behind a Ray method, `handle`, which feeds it one
  HTTP request as ASGI and streams the response back (status and headers, then body chunks).
- `Ingress`: Ray's HTTP proxy hands it every request; it forwards the request to a replica chosen by
  `PrefixAffinityRouter` (the same leading prompt text goes to the same replica, whose prefix cache then holds
  it; a full replica overflows to the others) and streams the answer back. A replica that dies before it has
  started answering (Ray then restarts it) is retried on another, so such requests are not lost.

Ray does placement, health checks and restarts; a replica's device is the GPU Ray assigned it (`num_gpus`).
"""

# no `from __future__ import annotations`: FastAPI must see the route's real annotations (Request) after Ray
# Serve's ingress has rebuilt the method
import argparse
import asyncio
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from .__main__ import build_parser, build_state
from .app import create_app

log = logging.getLogger("vkgraph.serve.ray")
ROUTING_CHARS = 1024  # leading prompt characters that pick a replica
RETRIES = 3  # replicas tried for a request whose replica died before answering


@dataclass
class ForwardedRequest:
    """One HTTP request as the ingress hands it to a replica. `prompt` is the text the router routes by."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt: str


def routing_text(body: bytes) -> str:
    """The leading prompt text of a completions or chat body ("" for anything else): a string prompt, token
    ids written out, or the messages' contents in order."""
    try:
        req = json.loads(body) if body else None
    except ValueError:
        return ""
    if not isinstance(req, dict):
        return ""
    prompt = req.get("prompt", req.get("messages"))
    if isinstance(prompt, str):
        return prompt[:ROUTING_CHARS]
    parts: list[str] = []
    for p in prompt if isinstance(prompt, list) else ():
        if isinstance(p, dict):
            c = p.get("content")
            p = c if isinstance(c, str) else "".join(x.get("text", "") for x in c or () if isinstance(x, dict))
        parts.append(p if isinstance(p, str) else json.dumps(p))
        if sum(map(len, parts)) >= ROUTING_CHARS:
            break
    return "\x00".join(parts)[:ROUTING_CHARS]


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Ranks replicas by rendezvous hashing of the request's leading prompt text: each text has one preferred
    replica (the same while the replica set is), so requests sharing a long prefix meet its cached KV blocks;
    the others follow in a fixed order, which Ray tries when the preferred one is at `max_ongoing_requests`.
    A request without text (GET /health, /metrics) goes to any replica."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        text = _pending_text(pending_request)
        if not text:
            return [candidate_replicas]
        key = text.encode()

        def score(r: RunningReplica) -> bytes:
            return hashlib.sha256(key + b"\x00" + r.replica_id.unique_id.encode()).digest()

        return [[r] for r in sorted(candidate_replicas, key=score, reverse=True)]


def _pending_text(pending: PendingRequest | None) -> str:
    # by attribute, not isinstance: the ingress holds a pickled copy of ForwardedRequest, a class of its own
    for a in pending.args if pending is not None else ():
        text = getattr(a, "prompt", None)
        if isinstance(text, str):
            return text
    return ""


@serve.deployment(request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter),
                  max_ongoing_requests=256, health_check_period_s=5)
class Replica:
    """One server (model, engine, routes) on the Vulkan device Ray gave this replica."""

    def __init__(self, argv: list[str]) -> None:
        gpus = ray.get_gpu_ids()
        if gpus:  # Ray's GPU ids, taken as Vulkan device indices (both list one vendor's GPUs in bus order)
            os.environ["VKGRAPH_DEVICE"] = str(int(gpus[0]))
        self.args = build_parser().parse_args(argv)
        logging.basicConfig(level=self.args.log_level.upper())
        self.state = build_state(self.args)
        self.app = create_app(self.state)
        self.name = serve.get_replica_context().replica_id.unique_id  # answers name their replica in a header

    async def check_health(self) -> None:
        """Ray's health check: an engine thread that has died makes the replica unhealthy (Ray restarts it)."""
        if not self.state.engine.alive:
            raise RuntimeError("the engine thread has stopped")

    async def handle(self, req: ForwardedRequest) -> AsyncIterator[tuple[int, list[tuple[str, str]]] | bytes]:
        """Run the request through the server app: yields (status, headers) once, then the body in chunks. If
        the caller stops listening, the app sees its client disconnect (its request is aborted)."""
        sent: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body_given = False

        async def receive() -> dict:
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": req.method,
                 "scheme": "http", "path": req.path, "raw_path": req.path.encode(), "query_string": req.query,
                 "root_path": "", "headers": req.headers, "client": ("ray-ingress", 0), "server": ("replica", 0)}
        task = asyncio.ensure_future(self.app(scope, receive, sent.put))
        try:
            while True:
                msg = await _next_message(sent, task)
                if msg is None:
                    return
                if msg["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg["headers"]]
                    yield msg["status"], headers + [("x-vkgraph-replica", self.name)]
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield bytes(msg["body"])
                    if not msg.get("more_body"):
                        return
        finally:
            gone.set()
            try:
                await asyncio.wait_for(task, 30)
            except Exception:  # noqa: BLE001 - the response is over either way (a timeout included)
                task.cancel()

    def __del__(self) -> None:
        """Ray Serve's shutdown of this replica: finish or cancel what is in flight, then stop the engine."""
        state = getattr(self, "state", None)
        if state is not None:
            state.engine.shutdown(self.args.shutdown_timeout)


async def _next_message(sent: asyncio.Queue, task: asyncio.Future) -> dict | None:
    """The app's next ASGI message, or None once it has ended without one (its exception is raised)."""
    get = asyncio.ensure_future(sent.get())
    await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    task.result()
    return None if sent.empty() else sent.get_nowait()


async def _body(gen: Any) -> AsyncIterator[bytes]:
    try:
        async for chunk in gen:
            yield chunk
    finally:
        gen.cancel()  # the client went away (or the body ended): the replica's app sees a disconnect


# Ray Serve pickles the ingress app when the class below is defined: what its route uses must exist before it
ingress_app = FastAPI(title="vkgraph (Ray Serve)")


@serve.deployment(max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})  # it only forwards bytes
@serve.ingress(ingress_app)
class Ingress:
    """Forwards every request to a replica (prefix-aware) and streams the answer back."""

    def __init__(self, replica: Any) -> None:
        self.replica = replica.options(stream=True)

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        req = ForwardedRequest(request.method, "/" + path, request.url.query.encode(), list(request.headers.raw),
                               body, routing_text(body) if request.method == "POST" else "")
        for attempt in range(RETRIES):
            gen = self.replica.handle.remote(req)
            try:
                status, headers = await gen.__anext__()
            except (ActorDiedError, ActorUnavailableError, RayActorError) as e:
                log.warning("replica failed before answering (attempt %d of %d): %s", attempt + 1, RETRIES, e)
                continue
            keep = [(k, v) for k, v in headers if k.lower() not in ("content-length", "transfer-encoding")]
            media = dict(keep).get("content-type")
            return StreamingResponse(_body(gen), status_code=status, headers=dict(keep), media_type=media)
        return JSONResponse({"error": {"message": f"no replica answered after {RETRIES} attempts",
                                       "type": "server_error", "param": None, "code": "replica_unavailable"}},
                            status_code=503)


def app_builder(args: dict[str, str]) -> Any:
    """For `serve run vkgraph.serve.ray:app_builder model=PATH replicas=2 gpus_per_replica=1 ...`: every other
    key=value becomes the server option --key value (underscores as dashes; value "true" alone as a flag)."""
    args = dict(args)
    replicas = int(args.pop("replicas", 1))
    gpus = float(args.pop("gpus_per_replica", 0))
    argv: list[str] = []
    for k, v in args.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if str(v).lower() == "true" else [str(v)])
    return build_app(argv, replicas=replicas, gpus_per_replica=gpus)


def build_app(argv: list[str], *, replicas: int, gpus_per_replica: float = 0, cpus_per_replica: float = 1) -> Any:
    """The Ray Serve application: `replicas` Replica deployments behind one Ingress."""
    build_parser().parse_args(argv)  # refuse bad options here, not in every replica
    replica = Replica.options(num_replicas=replicas,
                              ray_actor_options={"num_gpus": gpus_per_replica, "num_cpus": cpus_per_replica})
    return Ingress.bind(replica.bind(argv))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vkgraph.serve.ray",
                                 description="vkgraph's server as Ray Serve replicas (other options: as "
                                             "python -m vkgraph.serve; --host and --port are the Ray proxy's)")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--gpus-per-replica", type=float, default=0,
                    help="Ray GPUs per replica (1 on a GPU host: each replica owns one device)")
    ap.add_argument("--cpus-per-replica", type=float, default=1)
    ap.add_argument("--ray-address", help="an existing Ray cluster (default: start one here)")
    a, rest = ap.parse_known_args(argv)
    server = build_parser().parse_args(rest)
    ray.init(address=a.ray_address)
    serve.start(http_options={"host": server.host, "port": server.port})
    serve.run(build_app(rest, replicas=a.replicas, gpus_per_replica=a.gpus_per_replica,
                        cpus_per_replica=a.cpus_per_replica), name="vkgraph", route_prefix="/")
    print(f"serving {server.model} on http://{server.host}:{server.port} with {a.replicas} replica(s); "
          "Ctrl-C stops", file=sys.stderr)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the replicas as Ctrl-C does
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    raise SystemExit(main())

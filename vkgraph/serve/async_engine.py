"""The one continuous-batching engine behind many concurrent HTTP requests.

`Engine` is not thread-safe, so one thread owns it: it takes commands (add, abort) from a queue between steps,
runs `step()` while there is work, and hands each request's events to the asyncio loop that waits for them.
The HTTP side never touches the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..nn.engine import Engine, Event
from ..nn.sampling import SamplingParams

log = logging.getLogger("vkgraph.serve")


class QueueFull(RuntimeError):
    """More requests in flight than the server accepts; the client should retry later."""


class ShuttingDown(QueueFull):
    """The server is stopping and takes no new requests."""


@dataclass
class Stream:
    """Events of one engine request, delivered on the asyncio loop that submitted it."""

    request_id: int
    prompt_tokens: int
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.perf_counter)


class AsyncEngine:
    """Owns an `Engine` on its own thread. `max_pending` bounds the requests in flight (running and waiting);
    beyond it `submit` raises `QueueFull` at once, which is the server's backpressure. `on_step(engine, events,
    seconds)` is called on that thread after each step, and with no events and None after commands."""

    def __init__(self, engine: Engine, *, max_pending: int = 256,
                 on_step: Callable[[Engine, list[Event], float | None], None] | None = None) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, Stream]] = {}
        self._lock = threading.Lock()  # guards _streams and _in_flight
        self._in_flight = 0  # accepted by submit and not yet finished: counted before the engine sees them
        self._stop = threading.Event()
        self._closing = False  # set by shutdown(): no new requests
        self._thread = threading.Thread(target=self._run, name="vkgraph-engine", daemon=True)
        self._thread.start()

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (it ends only after `shutdown`, or if something killed it)."""
        return self._thread.is_alive()

    @property
    def pending(self) -> int:
        return self._in_flight

    async def submit(self, prompt: Sequence[int], params: SamplingParams, *, max_tokens: int,
                     stop: Sequence[str] = (), stop_token_ids: Sequence[int] | None = None,
                     logprobs: int | None = None) -> Stream:
        """Queue a request; `ValueError` for one the engine refuses (too long, bad ids), `QueueFull` when full."""
        if self._closing:
            raise ShuttingDown("the server is shutting down")
        with self._lock:
            if self._in_flight >= self.max_pending:
                raise QueueFull(f"{self.max_pending} requests are in flight; retry later")
            self._in_flight += 1
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", (list(prompt), params, max_tokens, tuple(stop), stop_token_ids, logprobs,
                                    asyncio.get_running_loop()), fut))
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: int) -> None:
        """Cancel a request (its client went away): its KV blocks are freed before the next step."""
        self._commands.put(("abort", request_id, None))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting requests, let those in flight finish for up to `timeout` seconds, then abort the rest
        (their streams end with an "abort" event) and stop the thread."""
        deadline = time.monotonic() + timeout
        self._closing = True
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._commands.put(("wake", None, None))
        self._thread.join(timeout=max(1.0, deadline - time.monotonic() + 5))

    # ---- the engine thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            block = not self.engine.has_work() and not self._stop.is_set()
            try:
                cmd = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
            except queue.Empty:
                cmd = None
            had_commands = cmd is not None
            while cmd is not None:
                self._command(*cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if had_commands and self.on_step is not None:  # aborts free blocks between steps too
                self.on_step(self.engine, [], None)
            if self._stop.is_set():
                self._abort_all()
                return
            if self.engine.has_work():
                t0 = time.perf_counter()
                try:
                    events = self.engine.step()
                except Exception:  # the engine rolled back; the requests it touched report "error" next step
                    log.exception("engine step failed")
                    continue
                self._deliver(events)
                if self.on_step is not None:
                    self.on_step(self.engine, events, time.perf_counter() - t0)

    def _command(self, kind: str, payload: Any, fut: concurrent.futures.Future | None) -> None:
        if kind == "add":
            prompt, params, max_tokens, stop, stop_ids, logprobs, loop = payload
            try:
                rid = self.engine.add_request(prompt, params, max_tokens=max_tokens, stop=stop,
                                              stop_token_ids=stop_ids, logprobs=logprobs)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                with self._lock:
                    self._in_flight -= 1
                fut.set_exception(e)
                return
            stream = Stream(rid, len(prompt))
            with self._lock:
                self._streams[rid] = (loop, stream)
            fut.set_result(stream)
        elif kind == "abort":
            with self._lock:
                entry = self._streams.pop(payload, None)
                if entry is not None:
                    self._in_flight -= 1
            self.engine.abort(payload)
            if entry is not None:  # whoever still waits on the stream (a request handler) learns it ended
                try:
                    entry[0].call_soon_threadsafe(_put_all, [(entry[1], Event(payload, None, "", "abort"))])
                except RuntimeError:  # that loop has closed
                    pass

    def _deliver(self, events: list[Event]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Event]]] = {}
        with self._lock:
            for ev in events:
                entry = self._streams.get(ev.request_id)
                if entry is None:
                    continue
                by_loop.setdefault(entry[0], []).append((entry[1], ev))
                if ev.finished:
                    del self._streams[ev.request_id]
                    self._in_flight -= 1
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop has closed
                pass

    def _abort_all(self) -> None:
        with self._lock:
            streams = list(self._streams.items())
            self._streams.clear()
            self._in_flight -= len(streams)
        for rid, (loop, stream) in streams:
            self.engine.abort(rid)
            try:
                loop.call_soon_threadsafe(_put_all, [(stream, Event(rid, None, "", "abort"))])
            except RuntimeError:
                pass


def _put_all(items: list[tuple[Stream, Event]]) -> None:
    for stream, ev in items:
        stream.events.put_nowait(ev)

"""The OpenAI-compatible HTTP routes over one `AsyncEngine`.

/v1/completions, /v1/chat/completions (streamed as server-sent events or not), /v1/models, /health, /metrics.
Errors have OpenAI's shape ({"error": {"message", "type", "param", "code"}}) and status: 400 for a bad request
(malformed body, a prompt longer than the context), 404 for an unknown model, 429 when the queue is full, 503
while shutting down, 500 when the engine failed on the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ..nn.chat import ChatTemplate
from ..nn.engine import Event
from ..nn.sampling import SamplingParams
from ..nn.tokenizer import Tokenizer
from .async_engine import AsyncEngine, QueueFull, ShuttingDown, Stream
from .logprobs import CompletionLogprobs, TokenNames, chat_logprobs
from .metrics import Metrics
from .protocol import ChatRequest, CompletionRequest, _Sampling


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(_error_body(self.message, self.type, self.param, self.code), status_code=self.status)


def _error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    max_context: int
    metrics: Metrics
    chat_template: ChatTemplate | None = None
    shutdown_timeout: float = 30.0
    token_names: TokenNames = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.token_names = TokenNames(self.tokenizer)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn has stopped taking connections and waited for open ones; finish or cancel what is left
        await asyncio.get_running_loop().run_in_executor(None, state.engine.shutdown, state.shutdown_timeout)

    app = FastAPI(title="vkgraph", lifespan=lifespan)
    app.state.vkgraph = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errs)
        return JSONResponse(_error_body(msg or "invalid request", "invalid_request_error", param), status_code=400)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.in_flight.set(state.engine.pending)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        _check_model(state, name)
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        prompts = _completion_prompts(state.tokenizer, body.prompt)
        return await _serve(state, request, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        _check_model(state, body.model)
        if state.chat_template is None:
            raise APIError(400, f"model {state.model_name} has no chat template; use /v1/completions",
                           param="messages")
        try:
            text = state.chat_template.render([{"role": m.role, "content": m.text()} for m in body.messages])
        except Exception as e:  # noqa: BLE001 - the template's own errors are the request's fault
            raise APIError(400, f"chat template failed: {e}", param="messages") from None
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        return await _serve(state, request, body, [state.tokenizer.encode(text, add_special_tokens=False)],
                            chat=True)

    return app


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "vkgraph",
            "max_model_len": state.max_context}


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


def _completion_prompts(tok: Tokenizer, prompt: object) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [tok.encode(p) for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt):
        return [list(p) for p in prompt]
    raise APIError(400, "prompt must be a string, a list of token ids, or a list of either, and not empty",
                   param="prompt")


def _params(body: _Sampling) -> SamplingParams:
    if getattr(body, "echo", False):
        raise APIError(400, "echo is not supported by this server", param="echo")
    if getattr(body, "top_logprobs", None) is not None and not getattr(body, "logprobs", False):
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    if body.seed is not None and not 0 <= body.seed < 2**63:
        raise APIError(400, f"seed must be in [0, 2**63), got {body.seed}", param="seed")
    return SamplingParams(body.temperature, body.top_k, body.top_p, body.min_p, body.repetition_penalty)


async def _submit_all(state: ServerState, body: _Sampling, prompts: list[list[int]]) -> list[Stream]:
    params = _params(body)
    streams: list[Stream] = []
    try:
        for prompt in prompts:
            max_tokens = body.max_tokens or max(1, state.max_context - len(prompt))
            for j in range(body.n):  # with a seed, choice j draws from seed + j: reproducible, and distinct
                p = params if body.seed is None else dataclasses.replace(params, seed=(body.seed + j) % 2**64)
                streams.append(await state.engine.submit(prompt, p, max_tokens=max_tokens, stop=body.stop_list(),
                                                         logprobs=body.logprob_count()))
    except ShuttingDown as e:
        _abort(state, streams)
        raise APIError(503, str(e), "server_error", code="shutting_down") from None
    except QueueFull as e:
        _abort(state, streams)
        raise APIError(429, str(e), "rate_limit_exceeded", code="queue_full") from None
    except ValueError as e:
        _abort(state, streams)
        code = "context_length_exceeded" if "context" in str(e) else None
        raise APIError(400, str(e), param="messages" if code is None else "max_tokens", code=code) from None
    for p in prompts:
        state.metrics.prompt_tokens.inc(len(p) * body.n)
    return streams


def _abort(state: ServerState, streams: list[Stream]) -> None:
    for s in streams:
        state.engine.abort(s.request_id)


async def _events(state: ServerState, streams: list[Stream]) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) of every stream as they come; at the end each stream has finished. Streams not
    finished when the consumer stops (a disconnect cancels it) are aborted, freeing their KV blocks."""
    getters = {asyncio.ensure_future(s.events.get()): i for i, s in enumerate(streams)}
    last = [s.created for s in streams]
    first = [True] * len(streams)
    try:
        while getters:
            done, _ = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = getters.pop(task)
                ev = task.result()
                now = time.perf_counter()
                if ev.token is not None:
                    (state.metrics.ttft if first[i] else state.metrics.itl).observe(now - last[i])
                    first[i], last[i] = False, now
                if ev.finished:
                    state.metrics.e2e.observe(now - streams[i].created)
                else:
                    getters[asyncio.ensure_future(streams[i].events.get())] = i
                yield i, ev
    finally:
        for task, i in getters.items():
            task.cancel()
            state.engine.abort(streams[i].request_id)


async def _watch_disconnect(request: Request, state: ServerState, streams: list[Stream]) -> None:
    while not await request.is_disconnected():  # a cheap check: whether the server saw the connection close
        await asyncio.sleep(0.05)
    _abort(state, streams)


def _finish_error(ev: Event) -> APIError | None:
    if ev.finished == "error":
        return APIError(500, "the engine failed on this request", "server_error", code="engine_error")
    if ev.finished == "abort":
        return APIError(503, "the request was cancelled (its client went away, or the server is shutting down)",
                        "server_error", code="cancelled")
    return None


async def _serve(state: ServerState, request: Request, body: _Sampling, prompts: list[list[int]],
                 chat: bool) -> Response:
    streams = await _submit_all(state, body, prompts)
    route = "chat" if chat else "completions"
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(_sse(state, streams, body, rid, created, chat, route, include_usage),
                                 media_type="text/event-stream")
    texts = [""] * len(streams)
    reasons: list[str | None] = [None] * len(streams)
    tokens: list[list[Event]] = [[] for _ in streams]  # events of generated tokens: their count and logprobs
    watcher = asyncio.ensure_future(_watch_disconnect(request, state, streams))
    try:
        async for i, ev in _events(state, streams):
            texts[i] += ev.text
            if ev.token is not None:
                tokens[i].append(ev)
            if ev.finished:
                err = _finish_error(ev)
                if err is not None:
                    state.metrics.requests.labels(route, ev.finished).inc()
                    _abort(state, streams)
                    raise err
                reasons[i] = ev.finished
    finally:
        watcher.cancel()
    state.metrics.requests.labels(route, "ok").inc()
    want = body.logprob_count() is not None
    choices = [_choice(i, t, r, chat, _logprobs(state, chat, evs) if want else None)
               for i, (t, r, evs) in enumerate(zip(texts, reasons, tokens))]
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(map(len, tokens))
    return JSONResponse({
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
        "model": state.model_name, "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens}})


def _choice(i: int, text: str, reason: str | None, chat: bool, logprobs: dict | None) -> dict:
    if chat:
        return {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": reason}
    return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}


def _logprobs(state: ServerState, chat: bool, events: list[Event]) -> dict:
    if chat:
        return chat_logprobs(state.token_names, events)
    return CompletionLogprobs(state.token_names, state.tokenizer).add(events)


async def _sse(state: ServerState, streams: list[Stream], body: _Sampling, rid: str, created: int, chat: bool,
               route: str, include_usage: bool) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    counts = [0] * len(streams)
    want = body.logprob_count() is not None  # then every token has a chunk, to carry its logprobs
    builders = [CompletionLogprobs(state.token_names, state.tokenizer) for _ in streams] if want and not chat else []

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        out = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": choices}
        if include_usage:
            out["usage"] = usage
        return f"data: {json.dumps(out)}\n\n"

    if chat:
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(len(streams))])
    outcome = "ok"
    async for i, ev in _events(state, streams):
        counts[i] += ev.token is not None
        err = _finish_error(ev) if ev.finished else None
        if err is not None:
            outcome = ev.finished
            _abort(state, streams)
            yield f"data: {json.dumps(_error_body(err.message, err.type, None, err.code))}\n\n"
            break
        reason = ev.finished if ev.finished else None
        if not ev.text and reason is None and not (want and ev.token is not None):
            continue
        lp = None
        if want and ev.token is not None:
            lp = chat_logprobs(state.token_names, [ev]) if chat else builders[i].add([ev])
        if chat:
            yield chunk([{"index": i, "delta": {"content": ev.text}, "logprobs": lp, "finish_reason": reason}])
        else:
            yield chunk([{"index": i, "text": ev.text, "logprobs": lp, "finish_reason": reason}])
    state.metrics.requests.labels(route, outcome).inc()
    if include_usage and outcome == "ok":
        prompt_tokens = sum(s.prompt_tokens for s in streams) // body.n
        yield chunk([], {"prompt_tokens": prompt_tokens, "completion_tokens": sum(counts),
                         "total_tokens": prompt_tokens + sum(counts)})
    yield "data: [DONE]\n\n"

"""The FastAPI app: OpenAI-compatible routes, SSE streaming, /metrics, /health and OpenAI-shaped errors; the
playground page at / (static files in server/static/) and what it reads, GET /draftwise/info.

`create_app(engine, served_model_name, api_key=None, max_body_bytes=...)` serves an engine_host.EngineProcess (the
engine in its own process: `draftwise serve`) or an already loaded `api.LLM`, which then runs on a thread of this
process (tests build it around a tiny model without uvicorn); both over the same pipe (engine_host.py, runner.py).
The server side knows the engine only through its EngineFront (tokenizer, limits, spec config); routes only
submit, await events and format them. Request bodies are decoded, validated (validation.py) and tokenized in a small
worker pool, never on the event loop, and checked against the context before they are queued; each request
has a deadline (`request_timeout`); `app.state.drain(timeout)` is the graceful shutdown (shutdown.py calls
it). Every request first passes guard.py (host, origin, API key, JSON-only bodies). Knows no argv or
environment: the CLI passes everything in.
"""
from __future__ import annotations

import asyncio
import hmac
import os
from concurrent.futures import ThreadPoolExecutor
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

import jinja2
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftwise.config import ConfigError
from draftwise.server import protocol, tools, validation
from draftwise.server.errors import APIError, error_body, error_response, from_api_error
from draftwise.server.guard import LOOPBACK_HOSTS, Guard, cache_scope
from draftwise.server.metrics import ServerMetrics
from draftwise.server.engine_host import EngineProcess, EngineThread
from draftwise.server.runner import EngineRunner, RestartPolicy
from draftwise.server.limits import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING, DEFAULT_REQUEST_TIMEOUT_S,
                                     RequestLimits)

log = logging.getLogger("draftwise.server")

STATIC_DIR = Path(__file__).parent / "static"  # the playground page (package data)
DISCONNECT_POLL_S = 0.5  # non-streaming requests: how often to check whether the client is still there
PREP_WORKERS = 2  # threads that decode, validate and tokenize request bodies


def create_app(engine, served_model_name: str, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, limits: RequestLimits | None = None,
               max_waiting: int = DEFAULT_MAX_WAITING, request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S,
               allowed_hosts=LOOPBACK_HOSTS, allowed_origins=(), suffix_cache_scope: str = "key",
               max_queued_per_key: int | None = None, max_running_per_key: int | None = None,
               restart_policy: RestartPolicy | None = None, memory_guard=None) -> FastAPI:
    host = engine if isinstance(engine, EngineProcess) else EngineThread(engine)
    llm = host.front  # what this process knows of the engine (never the model itself)
    metrics = ServerMetrics(served_model_name, llm.max_num_seqs, llm.spec_config.k_max)
    runner = EngineRunner(host, metrics, max_waiting=max_waiting, max_queued_per_key=max_queued_per_key,
                          max_running_per_key=max_running_per_key, restart_policy=restart_policy,
                          memory_guard=memory_guard)
    metrics.watch_keys(runner.key_counts)
    if memory_guard is not None:  # the ceiling counts this process and the engine's (whichever child is current)
        if memory_guard.pids is None:
            memory_guard.pids = lambda: [os.getpid()] + ([] if runner.host.in_process else runner.host.pids())
        metrics.watch_memory(memory_guard)
    pool = ThreadPoolExecutor(PREP_WORKERS, thread_name_prefix="draftwise-prep")

    @asynccontextmanager
    async def lifespan(app):
        runner.start()
        yield
        runner.stop()
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="draftwise", lifespan=lifespan)
    app.state.runner, app.state.metrics, app.state.front = runner, metrics, llm
    app.state.llm = engine if host.in_process else None  # the LLM itself when it runs in this process
    _add_error_handlers(app)
    if allowed_origins:  # CORS is off unless origins are listed
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], expose_headers=["X-Request-Id"])
    app.add_middleware(Guard, api_key=api_key, allowed_hosts=tuple(allowed_hosts),
                       allowed_origins=tuple(allowed_origins))
    auth = [Depends(_api_key_checker(api_key))]
    cache_scope("", suffix_cache_scope)  # an unknown mode fails here, not on the first request
    ctx = _Ctx(llm, runner, served_model_name, max_body_bytes, limits or RequestLimits(), request_timeout, pool,
               suffix_cache_scope)
    app.openapi = lambda: _openapi(app)

    async def drain(timeout: float) -> None:
        """Graceful shutdown: refuse new requests (503), let those in flight finish for up to `timeout` s, then end
        the rest with an error (a stream gets an error event and [DONE])."""
        runner.draining = True
        deadline = time.monotonic() + timeout
        while runner.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if runner.in_flight:
            log.warning("shutdown: %d requests still in flight after %g s; ending them", runner.in_flight, timeout)
            runner.fail_all(503, "the server is shutting down", code="shutting_down")

    app.state.drain = drain

    @app.get("/health")
    async def health():
        """200 {"status": "ok", "state": "ready", "restarts": N, "engine_pid": PID (None: the engine on a thread)}
        while the engine serves; 503 otherwise, its `state` in the body: "starting" / "restarting" (with
        Retry-After), "failed" (for good: the message names the cause), "stopped", or draining (shutting down).
        Before the app exists (the model still loading under `draftwise serve`), boot.BootApp answers "starting"."""
        state = runner.state
        if runner.draining:
            return _health_503("the server is shutting down", "draining")
        if state == "restarting":
            return _health_503(f"the engine is restarting ({runner.down_message})", state,
                               {"Retry-After": str(runner.retry_after_s())})
        if state == "starting":
            return _health_503("the engine is starting", state, {"Retry-After": str(runner.retry_after_s())})
        if not runner.alive:
            return _health_503(runner.down_message, state if state != "ready" else "failed")
        return {"status": "ok", "state": "ready", "restarts": runner.restarts,
                "engine_pid": getattr(runner.host, "pid", None)}

    @app.get("/v1/models", dependencies=auth)
    async def models():
        card = {"id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "draftwise",
                "max_model_len": llm.max_model_len}
        info = getattr(llm, "model_info", None) or {}  # the resolved formats (weights/dtype "auto" → what ran)
        card["draftwise"] = {k: info[k] for k in ("weights", "dtype", "plan") if k in info}
        return {"object": "list", "data": [card]}

    @app.get("/draftwise/info", dependencies=auth)
    async def info():
        """What this server runs (the playground shows it read-only)."""
        return {"model": served_model_name, "speculative_config": llm.spec_config.to_dict(),
                "max_model_len": llm.max_model_len, "max_num_seqs": llm.max_num_seqs,
                "max_lookahead": llm.k_max}

    @app.get("/", include_in_schema=False)
    async def playground():  # public, like /static: the page asks for the API key itself
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/metrics", dependencies=auth)
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", dependencies=auth, openapi_extra=_body_schema(protocol.CompletionRequest))
    async def completions(request: Request):
        return await ctx.handle(request, chat=False)

    @app.post("/v1/chat/completions", dependencies=auth, openapi_extra=_body_schema(protocol.ChatRequest))
    async def chat_completions(request: Request):
        return await ctx.handle(request, chat=True)

    return app


class _Ctx:
    """What the generation routes share: the runner, the served name and response assembly (`llm`: the
    engine_host.EngineFront)."""

    def __init__(self, llm, runner: EngineRunner, served_model_name: str, max_body_bytes: int,
                 limits: RequestLimits, request_timeout: float | None, pool: ThreadPoolExecutor, scope_mode: str = "key"):
        self.llm, self.runner, self.name, self.max_body_bytes = llm, runner, served_model_name, max_body_bytes
        self.limits, self.request_timeout, self.pool = limits, request_timeout, pool
        self.scope_mode = scope_mode  # --suffix-cache-scope: whose earlier outputs may guess a request

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")

    async def handle(self, request: Request, chat: bool):
        """Admission check, body, then decode + validate + tokenize in the worker pool, then generate."""
        loop = asyncio.get_running_loop()
        deadline = None if self.request_timeout is None else loop.time() + self.request_timeout
        authorization = request.headers.get("authorization", "")
        key = cache_scope(authorization, "key")  # the admission key: one per API key, always
        hold = self.runner.early_retry_hold_s(key)  # came back before its Retry-After: read before this refusal
        refusal = self.runner.admission_error(key)  # before reading a body the server would refuse anyway
        if refusal is not None:
            if refusal.status == 429 and hold > 0:
                await asyncio.sleep(hold)
            raise refusal
        with self.runner.preparing():  # announced to the engine by the adds sent meanwhile (AddCommand.more)
            body = await _read_body(request, self.max_body_bytes)
            scope = cache_scope(authorization, self.scope_mode)
            prepared, req, choice = await loop.run_in_executor(self.pool, self.prepare, body, chat, scope)
        return await self.generate(request, prepared, req, chat, deadline, choice, key)

    def prepare(self, body: bytes, chat: bool, scope: str = ""):
        """Worker thread: strict JSON, field policy and limits, then tokens, then the context check."""
        obj = validation.loads(body, self.limits.max_json_depth)
        req = protocol.parse(protocol.ChatRequest if chat else protocol.CompletionRequest, obj)
        self.check_model(req.model)
        validation.check_limits(req, self.limits)
        context = self.llm.max_model_len
        choice = None
        if chat:
            choice = tools.read_tool_choice(req.tools, req.tool_choice, req.parallel_tool_calls)
            messages = tools.template_messages(protocol.chat_messages(req))
            try:
                ids = self.llm.tokenizer.encode_chat(messages, add_generation_prompt=req.add_generation_prompt,
                                                     continue_final_message=req.continue_final_message,
                                                     tools=list(choice.tools) if choice else None)
            except (ConfigError, jinja2.TemplateError) as e:
                raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None
            # OpenAI's chat default is "as many as fit": whatever the context leaves after the prompt
            params = protocol.sampling_params(req, max(1, context - len(ids)),
                                              constraint=choice.constraint(self.llm.tokenizer) if choice else None)
            prompt, field = {"prompt_token_ids": ids}, "messages"
        else:
            prompt, field = protocol.completion_prompt(req), "prompt"
            params = protocol.sampling_params(req, protocol.DEFAULT_COMPLETION_MAX_TOKENS)
        # n > 1: one engine request per sample (seed + index); the prefix cache shares the prompt's K/V
        prepared = [self.runner.prepare(prompt, one, speculate=req.draftwise.speculation,
                                        provenance=req.stream and req.draftwise.provenance, scope=scope)
                    for one in params.samples()]
        n = len(prepared[0][0].prompt_ids)
        if n >= context:
            raise APIError(400, f"the prompt ({n} tokens) does not fit the context length of {context} tokens",
                           param=field, code="context_length_exceeded")
        if n + params.max_tokens > context:
            raise APIError(400, f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                                f"tokens exceeds the context length of {context} tokens", param="max_tokens",
                           code="context_length_exceeded")
        return prepared, req, choice

    def _timeout(self, deadline: float | None) -> float | None:
        return None if deadline is None else deadline - asyncio.get_running_loop().time()

    def _timed_out(self) -> APIError:
        return APIError(504, f"the request did not finish within the server's request timeout of "
                             f"{self.request_timeout:g} s", code="timeout")

    async def generate(self, request: Request, prepared: list, req, chat: bool, deadline: float | None = None,
                       choice: tools.ToolChoice | None = None, key: str = ""):
        """Queue the request's n samples (under admission `key`) (one queue; Events carry their index), wait until each is admitted (an
        error is the response's status), then stream or collect."""
        q: asyncio.Queue = asyncio.Queue()
        rids, early = [], []  # early: outputs that arrived before every sample was admitted
        try:
            for i, one in enumerate(prepared):
                rids.append(self.runner.enqueue(one, q, i, key)[0])
            admitted = 0
            while admitted < len(prepared):
                ev = await asyncio.wait_for(q.get(), self._timeout(deadline))
                if ev.error:
                    raise ev.error
                if ev.admitted:
                    admitted += 1
                else:
                    early.append(ev)
        except asyncio.TimeoutError:
            self._abort(rids)
            raise self._timed_out() from None
        except BaseException:
            self._abort(rids)
            raise
        # the early outputs go back in front of whatever arrived after the last admission (order is text order)
        later = [q.get_nowait() for _ in range(q.qsize())]
        for ev in early + later:
            q.put_nowait(ev)
        fmt = protocol.ResponseFormat(chat, self.name, self._token_text)
        choices = [_Choice(i, choice) for i in range(len(prepared))]
        if req.stream:
            return StreamingResponse(self._sse(rids, q, fmt, choices, req.include_usage, req.draftwise.provenance,
                                               deadline),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await self._collect(request, rids, q, fmt, choices, deadline))

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.runner.abort(rid)

    def _token_text(self, token_id: int) -> str:
        return self.llm.tokenizer.decode([token_id], skip_special_tokens=False)

    def _merged(self, choices: list["_Choice"]):
        """The samples' RequestOutputs as one (usage counts the prompt once and sums the outputs)."""
        return self.llm.merge_outputs([c.output for c in choices])

    async def _collect(self, request: Request, rids: list[str], q: asyncio.Queue, fmt: protocol.ResponseFormat,
                       choices: list["_Choice"], deadline: float | None = None):
        done = False
        next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            while True:
                left = self._timeout(deadline)
                if left is not None and left <= 0:
                    raise self._timed_out()  # `finally` aborts the request and frees its slot
                try:
                    ev = await asyncio.wait_for(q.get(), DISCONNECT_POLL_S if left is None else
                                                min(DISCONNECT_POLL_S, left))
                except asyncio.TimeoutError:
                    ev = None
                if time.monotonic() >= next_check:  # tokens may arrive faster than the poll: check by the clock
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        return None  # nobody to answer; `finally` frees the slot
                if ev is None:
                    continue
                if ev.error:
                    raise ev.error
                c = choices[ev.index]
                c.parts.append(ev.text)
                if ev.finished:
                    c.output, c.finish_reason = ev.output, ev.finish_reason
                if all(c.output is not None for c in choices):
                    done = True
                    out = self._merged(choices)
                    return fmt.body([c.body(fmt) for c in choices], protocol.usage(out), _extra(out))
        finally:
            if not done:
                self._abort(rids)

    async def _sse(self, rids: list[str], q: asyncio.Queue, fmt: protocol.ResponseFormat, choices: list["_Choice"],
                   include_usage: bool, provenance: bool = False, deadline: float | None = None):
        """OpenAI's chunks (each with its choice's index); with `provenance`, every engine step is a chunk (even
        one whose text is held back) carrying its token provenance, and the finish chunk carries the request's
        figures (as `_extra`). Under tools, text goes through the choice's ToolCallStream."""
        done = False
        try:
            for chunk in fmt.first_chunks(include_usage, len(choices)):
                yield protocol.sse_line(chunk)
            while True:
                try:
                    ev = await asyncio.wait_for(q.get(), self._timeout(deadline))
                except asyncio.TimeoutError:  # past the deadline: free the slot, end with an error and [DONE]
                    self._abort(rids)
                    done, err = True, self._timed_out()
                    yield protocol.sse_line(error_body(err.status, err.message, err.param, err.code))
                    break
                if ev.error:  # headers are sent: report in-band, the way OpenAI streams report errors
                    done = True
                    self._abort(rids)
                    err = ev.error
                    yield protocol.sse_line(error_body(err.status, err.message, err.param, err.code))
                    break
                c = choices[ev.index]
                if c.calls is None and ev.text and ev.provenance is None and ev.logprobs is None:
                    yield fmt.text_line(ev.text, include_usage, c.index)  # the usual step: text only
                    pieces = ()
                else:
                    pieces = c.pieces(ev.text, provenance and ev.num_new_tokens or ev.logprobs)
                for i, piece in enumerate(pieces):
                    first = i == 0  # this step's provenance and logprobs go on its first chunk
                    yield protocol.sse_line(fmt.chunk(piece.get("content", ""), None, include_usage,
                                                      ev.provenance if first else None, c.index,
                                                      ev.logprobs if first else None, piece.get("tool_calls")))
                if ev.finished:
                    c.output = ev.output
                    for piece in c.tail():
                        yield protocol.sse_line(fmt.chunk(piece.get("content", ""), None, include_usage, None,
                                                          c.index, None, piece.get("tool_calls")))
                    yield protocol.sse_line(fmt.chunk("", c.finish(ev.finish_reason), include_usage,
                                                      _extra(ev.output) if provenance else None, c.index))
                    if all(c.output is not None for c in choices):
                        done = True
                        if include_usage:
                            yield protocol.sse_line(fmt.usage_chunk(protocol.usage(self._merged(choices))))
                        break
            yield "data: [DONE]\n\n"
        finally:  # client gone (the generator is cancelled or closed): free the KV slots now
            if not done:
                self._abort(rids)


class _Choice:
    """One sample's response while it arrives: its text, and under tools the parsing of its calls."""

    def __init__(self, index: int, choice: tools.ToolChoice | None):
        self.index, self.choice = index, choice
        self.parts: list[str] = []
        self.output = None  # api.RequestOutput once finished
        self.finish_reason: str | None = None
        # a required / named choice is constrained to valid calls: their arguments stream as they arrive
        self.calls = None if choice is None else tools.ToolCallStream(choice, trusted=choice.mode != "auto")

    def pieces(self, text: str, always: bool) -> list[dict]:
        """A step's delta pieces ({"content"} / {"tool_calls"}); one empty piece when `always` (provenance or
        logprobs to carry) and there is nothing else."""
        if not text:
            out = []
        else:
            out = [{"content": text}] if self.calls is None else self.calls.feed(text)
        return out or ([{}] if always else [])

    def tail(self) -> list[dict]:
        return self.calls.finish() if self.calls is not None else []

    def finish(self, reason: str | None) -> str | None:
        """The streamed finish reason: after the calls the stream parsed (_finish_reason)."""
        return _finish_reason(reason, self.calls is not None and bool(self.calls.calls))

    def body(self, fmt: protocol.ResponseFormat) -> dict:
        """The finished choice of a whole response: tool calls parsed out of the text under tools."""
        text, out = "".join(self.parts), self.output.outputs[0]
        content, calls = (text, []) if self.choice is None else tools.parse_calls(text, self.choice)
        return fmt.choice(self.index, content, _finish_reason(self.finish_reason, bool(calls)), out.logprobs,
                          calls or None)


def _health_503(message: str, state: str, headers: dict | None = None) -> JSONResponse:
    """/health's 503: the OpenAI-shaped error, plus the engine's state."""
    body = error_body(503, message, code="engine_unavailable")
    body["state"] = state
    return JSONResponse(body, status_code=503, headers=headers)


def _finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """"tool_calls" when the output ended by itself after calls; "length" stays (a call may be cut short)."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def _extra(out) -> dict:
    return {"ttft_s": out.ttft_s, "e2e_s": out.total_s, "spec": out.spec}


def _body_schema(model) -> dict:
    """The OpenAPI request body of a route that reads raw JSON (its model's schema goes in `_openapi`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema plus the request models the generation routes validate by hand (protocol.py)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (protocol.CompletionRequest, protocol.ChatRequest):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
        app.openapi_schema = schema
    return app.openapi_schema


async def _read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing more than `limit` bytes (413) before reading it all when the size is declared."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _api_key_checker(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    return check


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return from_api_error(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        return error_response(400, str(e.errors()[:1]))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):  # the trace goes to the log, the client gets an id
        rid = request.scope.get("state", {}).get("request_id", "-")
        log.exception("unhandled error (request id %s)", rid)
        # this handler runs outside the middleware (starlette's ServerErrorMiddleware): set the id header here
        return error_response(500, f"internal error (request id {rid}; the server log has the details)",
                              code="internal_error", headers={"X-Request-Id": rid})

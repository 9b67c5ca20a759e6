"""The FastAPI app: OpenAI-compatible routes, SSE streaming, /metrics, /health and OpenAI-shaped errors.

`create_app(llm, served_model_name, api_key=None, max_body_bytes=...)` wraps an already loaded `api.LLM` (or
anything with its shape: .engine, .tokenizer, .new_request, .to_output, .max_model_len), so tests build it
around a tiny model without uvicorn. The engine runs on its own thread (runner.py); routes only submit,
await events and format them. Knows no argv or environment: the CLI passes everything in.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager

import jinja2
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftwise.config import ConfigError
from draftwise.server import protocol
from draftwise.server.errors import APIError, error_body, error_response, from_api_error
from draftwise.server.metrics import ServerMetrics
from draftwise.server.runner import EngineRunner

log = logging.getLogger("draftwise.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DISCONNECT_POLL_S = 0.5  # non-streaming requests: how often to check whether the client is still there


def create_app(llm, served_model_name: str, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    metrics = ServerMetrics(served_model_name, llm.engine.num_free_slots + len(llm.engine.running),
                            llm.engine.k_policy.max_k)
    runner = EngineRunner(llm, metrics)

    @asynccontextmanager
    async def lifespan(app):
        runner.start()
        yield
        runner.stop()

    app = FastAPI(title="draftwise", lifespan=lifespan)
    app.state.runner, app.state.metrics, app.state.llm = runner, metrics, llm
    _add_error_handlers(app)
    auth = [Depends(_api_key_checker(api_key))]
    ctx = _Ctx(llm, runner, served_model_name, max_body_bytes)

    @app.get("/health")
    async def health():
        if not runner.alive:
            return error_response(503, "the engine thread is not running")
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=auth)
    async def models():
        card = {"id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "draftwise",
                "max_model_len": llm.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics", dependencies=auth)
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        req = protocol.parse(protocol.CompletionRequest, await _read_json(request, max_body_bytes))
        ctx.check_model(req.model)
        prompt = protocol.completion_prompt(req)
        params = protocol.sampling_params(req, protocol.DEFAULT_COMPLETION_MAX_TOKENS)
        return await ctx.generate(request, prompt, params, req, chat=False)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        req = protocol.parse(protocol.ChatRequest, await _read_json(request, max_body_bytes))
        ctx.check_model(req.model)
        try:
            ids = llm.tokenizer.encode_chat(protocol.chat_messages(req))
        except (ConfigError, jinja2.TemplateError) as e:
            raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None
        # OpenAI's chat default is "as many as fit": whatever the context leaves after the prompt
        params = protocol.sampling_params(req, max(1, llm.max_model_len - len(ids)))
        return await ctx.generate(request, {"prompt_token_ids": ids}, params, req, chat=True)

    return app


class _Ctx:
    """What the generation routes share: the runner, the served name and response assembly."""

    def __init__(self, llm, runner: EngineRunner, served_model_name: str, max_body_bytes: int):
        self.llm, self.runner, self.name, self.max_body_bytes = llm, runner, served_model_name, max_body_bytes

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")

    async def generate(self, request: Request, prompt, params, req, chat: bool):
        rid, q = self.runner.submit(prompt, params)
        try:
            first = await q.get()
        except asyncio.CancelledError:
            self.runner.abort(rid)
            raise
        if first.error:
            raise first.error
        fmt = protocol.ResponseFormat(chat, self.name)
        if req.stream:
            return StreamingResponse(self._sse(rid, q, fmt, req.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await self._collect(request, rid, q, fmt))

    async def _collect(self, request: Request, rid: str, q: asyncio.Queue, fmt: protocol.ResponseFormat):
        parts, done = [], False
        next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
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
                parts.append(ev.text)
                if ev.finished:
                    done = True
                    out = ev.output
                    use = protocol.usage(len(out.prompt_token_ids), out.num_output_tokens)
                    return fmt.body("".join(parts), ev.finish_reason, use, _extra(out))
        finally:
            if not done:
                self.runner.abort(rid)

    async def _sse(self, rid: str, q: asyncio.Queue, fmt: protocol.ResponseFormat, include_usage: bool):
        done = False
        try:
            for chunk in fmt.first_chunks(include_usage):
                yield _sse_line(chunk)
            while True:
                ev = await q.get()
                if ev.error:  # headers are sent: report in-band, the way OpenAI streams report errors
                    done = True
                    yield _sse_line(error_body(ev.error.status, ev.error.message, ev.error.param, ev.error.code))
                    break
                if ev.text:
                    yield _sse_line(fmt.chunk(ev.text, None, include_usage))
                if ev.finished:
                    done = True
                    yield _sse_line(fmt.chunk("", ev.finish_reason, include_usage))
                    if include_usage:
                        out = ev.output
                        yield _sse_line(fmt.usage_chunk(protocol.usage(len(out.prompt_token_ids),
                                                                       out.num_output_tokens)))
                    break
            yield "data: [DONE]\n\n"
        finally:  # client gone (the generator is cancelled or closed): free the KV slot now
            if not done:
                self.runner.abort(rid)


def _sse_line(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _extra(out) -> dict:
    return {"ttft_s": out.ttft_s, "e2e_s": out.total_s, "spec": out.spec}


async def _read_json(request: Request, limit: int):
    """The body as JSON, refusing more than `limit` bytes (413) before reading it all when the size is declared."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"malformed JSON in the request body: {e}") from None


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
    async def internal_error(request, e: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}: {e}")

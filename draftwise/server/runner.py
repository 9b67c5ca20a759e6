"""The engine thread: the one place the server touches the Engine (which is not thread safe).

The event loop submits requests and aborts through a thread-safe inbox; a single thread drains it between
steps, runs engine.step() while there is work (blocking on the inbox when idle) and hands each request's
text deltas to its asyncio.Queue via loop.call_soon_threadsafe. Continuous batching is the engine's: new
requests join at the next step, finished or aborted ones free their KV slot before the next step.
Knows no HTTP: routes turn Events into responses.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass

from draftwise.config import ConfigError
from draftwise.engine import ContextLengthError
from draftwise.server.errors import APIError

log = logging.getLogger("draftwise.server")


@dataclass
class Event:
    """What the engine thread tells one request: admitted, new text, finished (with the output) or failed."""

    text: str = ""
    num_new_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    output: object | None = None  # api.RequestOutput once finished
    error: APIError | None = None
    admitted: bool = False


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request: object  # engine.Request
    stream: object  # output.TextStream


class EngineRunner:
    def __init__(self, llm, metrics):
        self.llm, self.engine, self.metrics = llm, llm.engine, metrics
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="draftwise-engine", daemon=True)
        self.last_error: str | None = None

    # ---- event-loop side --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._inbox.put(None)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, prompt, params) -> tuple[str, asyncio.Queue]:
        """Queue a request for the engine thread; its first Event says admitted or error."""
        try:
            req, stream = self.llm.new_request(prompt, params)
        except ConfigError as e:
            raise APIError(400, str(e), param="prompt") from None
        q: asyncio.Queue = asyncio.Queue()
        self._inbox.put(("add", _Sink(asyncio.get_running_loop(), q, req, stream)))
        return req.request_id, q

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    # ---- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while self._drain(block=not self.engine.has_unfinished()):
            if self.engine.has_unfinished():
                self._step()
            self.metrics.sync_engine(self.engine)
        for rid in list(self._sinks):  # shutting down: nobody will read these
            self._abort(rid)

    def _drain(self, block: bool) -> bool:
        """Handle every queued command; False once asked to stop."""
        try:
            item = self._inbox.get(block=block)
            while item is not None:
                self._handle(*item)
                item = self._inbox.get_nowait()
            return False
        except queue.Empty:
            return True

    def _handle(self, kind: str, arg) -> None:
        if kind == "abort":
            self._abort(arg)
            return
        sink: _Sink = arg
        try:
            self.engine.add_request(sink.request)
        except ConfigError as e:
            too_long = isinstance(e, ContextLengthError)
            self._post(sink, Event(error=APIError(400, str(e), param="max_tokens" if too_long else "prompt",
                                                  code="context_length_exceeded" if too_long else None)))
            return
        except Exception as e:  # a bug must not take the engine thread down
            log.exception("add_request failed")
            self._post(sink, Event(error=APIError(500, f"internal error: {type(e).__name__}: {e}")))
            return
        self._sinks[sink.request.request_id] = sink
        self.metrics.on_admitted(len(sink.request.prompt_ids))
        self._post(sink, Event(admitted=True))

    def _abort(self, request_id: str) -> None:
        sink = self._sinks.pop(request_id, None)
        if sink is None:  # already finished (the abort raced the last token)
            return
        self.engine.abort(request_id)
        self.metrics.on_finished("abort", None, None, len(sink.request.output_ids))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug must not take the server down: fail what is in flight, keep serving
            log.exception("engine step failed")
            self.last_error = f"{type(e).__name__}: {e}"
            self._fail_all(f"internal error in the engine: {self.last_error}")
            return
        for out in outputs:
            sink = self._sinks.get(out.request.request_id)
            if sink is None:
                continue
            try:
                self._deliver(sink, out)
            except Exception as e:  # e.g. detokenization: fail this request only
                log.exception("delivering output failed")
                self._fail(out.request.request_id, f"internal error: {type(e).__name__}: {e}")

    def _deliver(self, sink: _Sink, out) -> None:
        req, n = out.request, len(out.new_token_ids)
        self.metrics.on_tokens(n)
        if n and len(req.output_ids) == n and req.first_token_time is not None:
            self.metrics.on_first_token(req.first_token_time - req.arrival_time)
        text = sink.stream.delta()
        if not out.finished:
            if text or n:
                self._post(sink, Event(text=text, num_new_tokens=n))
            return
        text += sink.stream.finish()
        output = self.llm.to_output(req, sink.stream.text)
        del self._sinks[req.request_id]  # only now: if anything above raised, _fail still finds the sink
        self.metrics.on_finished(req.finish_reason, output.total_s, output.ttft_s, len(req.output_ids))
        self._post(sink, Event(text=text, num_new_tokens=n, finished=True, finish_reason=req.finish_reason,
                               output=output))

    def _fail_all(self, message: str) -> None:
        for rid in list(self._sinks):
            self._fail(rid, message)

    def _fail(self, request_id: str, message: str) -> None:
        sink = self._sinks.pop(request_id, None)
        if sink is None:
            return
        try:
            self.engine.abort(request_id)
        except Exception:  # the engine is already in trouble; the request is failed either way
            log.exception("abort after a failure")
        self.metrics.on_finished("error", None, None, len(sink.request.output_ids))
        self._post(sink, Event(error=APIError(500, message)))

    @staticmethod
    def _post(sink: _Sink, event: Event) -> None:
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed (server shutting down)
            pass

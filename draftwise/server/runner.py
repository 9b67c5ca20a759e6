"""The engine thread: the one place the server steps the LLM (its engine is not thread safe).

The event loop submits requests and aborts through a thread-safe inbox; a single thread drains it between
steps, runs llm.step() while there is work (blocking on the inbox when idle) and hands each request's text
deltas to its asyncio.Queue: all Events of one step in one loop.call_soon_threadsafe (one wake-up of the loop
per step, whatever the number of requests). The GIL switch interval is shortened (ENGINE_SWITCH_INTERVAL_S) so
the loop thread's work never holds a step back for long. Continuous batching is the engine's: new requests
join at the next step, finished or aborted ones free their KV slot before the next step. A request's outputs
of one step become one Event; a request that asked for token provenance (server/provenance.py) gets its
step's per-token pieces and draft figures on that Event.

Admission control lives here too: requests wait in per-API-key queues (admission.py: round-robin, bounded,
429 with a Retry-After from the key's queue) and enter the engine only when it has a free slot, so the
engine's own FIFO never reorders them; 503 at once when the engine thread is down or the server is draining;
every request submitted gets exactly one terminal Event (finished or error), whatever happens to the thread.
A step that raises is retried once, then fails what is in flight; a request the engine itself finishes with
finish_reason "error" fails alone. 500s carry a request id, never exception text (the traceback goes to the
log). Knows no HTTP: routes turn Events into responses.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass

from draftwise.config import ConfigError, ContextLengthError
from draftwise.server.admission import FairAdmission
from draftwise.server.errors import APIError
from draftwise.server.provenance import TokenProvenance

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
    provenance: dict | None = None  # this step's token provenance, when the request asked for it (provenance.py)
    index: int = 0  # which of the request's n samples this is about (the sink's index)
    logprobs: list | None = None  # the new tokens' sampling.TokenLogprob, when the request asked for logprobs


@dataclass(eq=False)
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request: object  # engine.Request
    stream: object  # output.TextStream
    provenance: TokenProvenance | None = None
    index: int = 0  # the sample's index among the request's n (events carry it)
    key: str = ""  # the admission key (guard.cache_scope of the request's Authorization header)
    started: float | None = None  # perf_counter() when it got an engine slot (None: still queued)


# The engine thread drops the GIL in every kernel call (hundreds per step) and must take it back after each; while
# the event loop thread holds it (handing a step's events to routes, framing SSE, answering 429s), a waiting thread
# gets it only when the holder blocks or after this interval. CPython's 5 ms default let the loop stretch steps of
# the 1.5B by a third under load; 0.5 ms bounds that wait (docs/PERFORMANCE.md, server overhead). Process-wide.
ENGINE_SWITCH_INTERVAL_S = 0.0005


class EngineRunner:
    def __init__(self, llm, metrics, max_waiting: int | None = None, max_queued_per_key: int | None = None,
                 max_running_per_key: int | None = None):
        self.llm, self.metrics = llm, metrics
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="draftwise-llm", daemon=True)
        self.last_error: str | None = None
        self._lock = threading.Lock()  # guards admission, _in_flight and _closed
        # requests wait here (per API key, round-robin) until the engine has a free slot: the engine's own queue
        # stays empty, so the order requests start in is this one's
        self.admission = FairAdmission(llm.max_num_seqs, max_waiting, max_queued_per_key, max_running_per_key)
        self._in_flight = 0  # submitted, no terminal Event yet
        self._closed = False  # the engine thread has stopped: nothing more is accepted
        self.draining = False  # shutting down: nothing new is accepted, what is in flight finishes
        self._step_failures = 0  # consecutive llm.step() exceptions
        self._outbox: list = []  # engine thread only: (loop, queue, Event) posted, not yet handed over (_flush)
        self._step_end: float | None = None  # perf_counter() when the last step returned (None: idle since)

    # ---- event-loop side --------------------------------------------------------------------------
    def start(self) -> None:
        sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._inbox.put(None)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, prompt, params, speculate: bool = True, provenance: bool = False) -> tuple[str, asyncio.Queue]:
        """Queue a request for the engine thread; its first Event says admitted or error. `speculate=False`
        decodes it plainly; `provenance=True` puts each step's token provenance on its Events."""
        return self.enqueue(self.prepare(prompt, params, speculate, provenance))

    def prepare(self, prompt, params, speculate: bool = True, provenance: bool = False, scope: str = "") -> tuple:
        """Tokenize and build the engine request (any thread: the server runs this in its worker pool); `scope`:
        its cache scope (guard.cache_scope)."""
        try:
            req, stream = self.llm.new_request(prompt, params)
        except ConfigError as e:
            raise APIError(400, str(e), param=e.param or "prompt") from None
        req.speculate = speculate
        req.cache_scope = scope
        tracker = None
        if provenance:
            tracker = TokenProvenance(stream, self.llm.spec_config.method if speculate else "none")
            req.on_token = tracker.add
        return req, stream, tracker

    def enqueue(self, prepared: tuple, q: asyncio.Queue | None = None, index: int = 0,
                key: str = "") -> tuple[str, asyncio.Queue]:
        """Queue a prepared request under its admission `key` (event loop): 503 when the engine is down or
        draining, 429 when the key's queue or the server's is full. The n samples of one request share a queue
        `q`; their Events carry `index`."""
        req, stream, tracker = prepared
        q = asyncio.Queue() if q is None else q
        sink = _Sink(asyncio.get_running_loop(), q, req, stream, tracker, index, key)
        with self._lock:
            refusal = self._down()
            if refusal is not None:
                raise refusal
            refused, dropped = self.admission.offer(key, sink)
            if refused is not None:
                raise _busy(refused)
            self._in_flight += 1
            if dropped is not None:  # a longer queue's newest request made room: it gets the 429
                out, why = dropped
                self._in_flight -= 1
                out.loop.call_soon_threadsafe(out.queue.put_nowait, Event(error=_busy(why), index=out.index))
        self._inbox.put(("wake", None))
        return req.request_id, q

    def admission_error(self, key: str = "") -> APIError | None:
        """Why a new request from `key` would be refused right now (None: it would be queued); a 429 is counted
        against the key."""
        with self._lock:
            down = self._down()
            if down is not None:
                return down
            refused = self.admission.check(key)
        return None if refused is None else _busy(refused)

    def early_retry_hold_s(self, key: str) -> float:
        """Seconds to hold a 429 for `key` (it came back before its Retry-After; admission.py)."""
        with self._lock:
            return self.admission.early_retry_hold_s(key)

    def _down(self) -> APIError | None:
        if self._closed or not self._thread.is_alive():
            return APIError(503, "the engine thread is not running", code="engine_unavailable")
        if self.draining:
            return APIError(503, "the server is shutting down", code="shutting_down")
        return None

    def key_counts(self) -> dict[str, tuple[int, int, int]]:
        """Admission key -> (queued, admitted, rejected), for /metrics."""
        with self._lock:
            return self.admission.counts()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def fail_all(self, status: int, message: str, code: str | None = None) -> None:
        """End every request in flight with this error (graceful shutdown once its timeout has passed)."""
        self._inbox.put(("fail_all", APIError(status, message, code=code)))

    def _release(self, sink: _Sink, finished: bool = False) -> None:
        """`sink` (which held an engine slot) is done; `finished`: it ran to its end (its slot time is a measure
        for Retry-After)."""
        slot_s = time.perf_counter() - sink.started if finished and sink.started is not None else None
        with self._lock:
            self._in_flight -= 1
            self.admission.finished(sink.key, slot_s)

    # ---- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                idle = not self.llm.has_unfinished()
                if idle:
                    self._step_end = None  # the wait for work is not overhead
                go_on = self._drain(block=idle)
                if go_on:
                    self._admit()
                self._flush()
                if not go_on:
                    break
                if self.llm.has_unfinished():
                    self._step()
                    self._admit()  # into the slots this step freed, to join the next step
                    self._flush()
                self.metrics.sync(self.llm.status())
        except BaseException:  # the thread ends either way; _close tells every request (503 from now on)
            log.exception("the engine thread died")
        finally:
            self._close()

    def _close(self) -> None:
        """The thread is ending: refuse new work, and give every request still here its terminal Event."""
        with self._lock:
            self._closed = True
        gone = APIError(503, "the engine thread stopped", code="engine_unavailable")
        self._fail_everything(gone)
        self._flush()

    def _fail_everything(self, error: APIError) -> None:
        """End every request, running or queued, with `error`."""
        for rid in list(self._sinks):
            self._fail(rid, error)
        with self._lock:
            queued = self.admission.drain_all()
            self._in_flight -= len(queued)
        for sink in queued:
            self._post(sink, Event(error=error))

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
        elif kind == "fail_all":
            self._fail_everything(arg)
        # "wake": a request was queued; _admit (after the drain) looks

    def _engine_has_room(self) -> bool:
        """Whether the engine takes one more request now: a free KV slot, and K/V blocks (EngineStatus.kv_blocks_free:
        free, or held only by the prefix cache) beyond what the prompts already waiting inside the engine need —
        else requests stay in the admission queue (fair order; its length is what the 429 counts). The one place
        admission asks the engine."""
        if len(self._sinks) >= self.llm.max_num_seqs:
            return False
        st = self.llm.status()
        if not st.kv_block_size:
            return True
        queued = sum(-(-len(r.context_ids) // st.kv_block_size) for r in self.llm.engine.waiting)
        return st.kv_blocks_free > queued

    def _admit(self) -> None:
        """Move queued requests into the engine while it has room, in the admission's (round-robin) order."""
        while self._engine_has_room():
            with self._lock:
                nxt = self.admission.pop()
            if nxt is None:
                return
            self._start(nxt[1])

    def _start(self, sink: _Sink) -> None:
        try:
            self.llm.add_request(sink.request)
        except ConfigError as e:
            too_long = isinstance(e, ContextLengthError)
            self._release(sink)
            self._post(sink, Event(error=APIError(400, str(e), param="max_tokens" if too_long else "prompt",
                                                  code="context_length_exceeded" if too_long else None)))
            return
        except Exception:  # a bug must not take the engine thread down
            rid = sink.request.request_id
            log.exception("add_request failed (request id %s)", rid)
            self._release(sink)
            self._post(sink, Event(error=internal_error(rid)))
            return
        sink.started = time.perf_counter()
        self._sinks[sink.request.request_id] = sink
        self.metrics.on_admitted(len(sink.request.prompt_ids))
        self._post(sink, Event(admitted=True))

    def _abort(self, request_id: str) -> None:
        sink = self._sinks.pop(request_id, None)
        if sink is None:  # still queued, or already finished (the abort raced the last token)
            with self._lock:
                queued = self.admission.remove_where(lambda s: s.request.request_id == request_id)
                if queued is not None:
                    self._in_flight -= 1
            return
        self._release(sink)
        self.llm.abort(request_id)
        self.metrics.on_finished("abort", None, None, len(sink.request.output_ids))

    def _step(self) -> None:
        t0 = time.perf_counter()
        if self._step_end is not None:  # since the last step: delivery, commands, metrics
            self.metrics.overhead_s.observe(t0 - self._step_end)
        try:
            outputs = self.llm.step()
            self._step_end = time.perf_counter()
            self.metrics.step_s.observe(self._step_end - t0)
        except Exception as e:  # a bug must not take the server down: retry once, then fail what is in flight
            self._step_failures += 1
            self.last_error = f"{type(e).__name__}: {e}"
            rids = ", ".join(self._sinks) or "none"
            if self._step_failures == 1:
                log.exception("engine step failed; retrying once (requests in flight: %s)", rids)
                return
            log.exception("engine step failed again; failing the requests in flight: %s", rids)
            self._step_failures = 0
            for rid in list(self._sinks):
                self._fail(rid, internal_error(rid))
            return
        self._step_failures = 0
        by_request: dict[str, list] = {}  # a request admitted this step has two outputs: prefill, first decode
        for out in outputs:
            by_request.setdefault(out.request.request_id, []).append(out)
        for rid, outs in by_request.items():
            sink = self._sinks.get(rid)
            if sink is None:
                continue
            try:
                self._deliver(sink, outs)
            except Exception:  # e.g. detokenization: fail this request only
                log.exception("delivering output failed (request id %s)", rid)
                self._fail(rid, internal_error(rid))

    def _deliver(self, sink: _Sink, outs: list) -> None:
        """One Event for the request's outputs of this step (their text is one delta: the tokens are all in)."""
        out = outs[-1]
        req, n = out.request, sum(len(o.new_token_ids) for o in outs)
        self.metrics.on_tokens(n)
        if n and len(req.output_ids) == n and req.first_token_time is not None:
            self.metrics.on_first_token(req.first_token_time - req.arrival_time)
        if req.finish_reason == "error":  # the engine failed this request alone (Request.error)
            log.error("the engine failed request %s: %s", req.request_id, getattr(req, "error", None))
            self._fail(req.request_id, internal_error(req.request_id))
            return
        text = sink.stream.delta()
        lp = req.logprobs[len(req.logprobs) - n:] if req.params.logprobs is not None else None
        if not out.finished:
            if text or n:
                self._post(sink, Event(text=text, num_new_tokens=n, provenance=_provenance(sink, outs, text),
                                       logprobs=lp))
            return
        text += sink.stream.finish()
        prov = _provenance(sink, outs, text)
        output = self.llm.to_output(req, sink.stream.text)
        del self._sinks[req.request_id]  # only now: if anything above raised, _fail still finds the sink
        self._release(sink, finished=True)
        self.metrics.on_finished(req.finish_reason, output.total_s, output.ttft_s, len(req.output_ids))
        self._post(sink, Event(text=text, num_new_tokens=n, finished=True, finish_reason=req.finish_reason,
                               output=output, provenance=prov, logprobs=lp))

    def _fail(self, request_id: str, error: APIError) -> None:
        sink = self._sinks.pop(request_id, None)
        if sink is None:
            return
        self._release(sink)
        try:
            self.llm.abort(request_id)
        except Exception:  # the engine is already in trouble; the request is failed either way
            log.exception("abort after a failure")
        self.metrics.on_finished("error", None, None, len(sink.request.output_ids))
        self._post(sink, Event(error=error))

    def _post(self, sink: _Sink, event: Event) -> None:
        """Queue an Event for its request; _flush hands the step's Events over (one wake-up of the loop)."""
        event.index = sink.index
        self._outbox.append((sink.loop, sink.queue, event))

    def _flush(self) -> None:
        """Hand the Events posted since the last flush to their event loops: one call_soon_threadsafe per loop,
        whatever the number of requests (each wake-up makes the loop thread take the GIL from the engine)."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, q, event in self._outbox:
            by_loop.setdefault(loop, []).append((q, event))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed (server shutting down)
                pass


def _put_all(items: list) -> None:
    """On the event loop: each (asyncio.Queue, Event) of one engine step."""
    for q, event in items:
        q.put_nowait(event)


def _busy(refusal) -> APIError:
    """The 429 of an admission.Refusal, with its Retry-After."""
    return APIError(429, f"{refusal.message}; retry after {refusal.retry_after_s} s", code="queue_full",
                    headers={"Retry-After": str(refusal.retry_after_s)})


def internal_error(request_id: str) -> APIError:
    """A 500 that names the request id the log has the traceback under, and nothing else."""
    return APIError(500, f"internal error (request id {request_id}; the server log has the details)",
                    code="internal_error")


def _provenance(sink: _Sink, outs: list, text: str) -> dict | None:
    if sink.provenance is None:
        return None
    return sink.provenance.chunk(text, [(len(o.new_token_ids), o.k, o.num_accepted) for o in outs])

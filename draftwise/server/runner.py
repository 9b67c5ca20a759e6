"""The server's side of the engine: admission, the request shadows, and text and Events for the routes.

The engine runs elsewhere (engine_host.py: in a child process under `draftwise serve`, or on a thread of this
process around an LLM already built) and talks over one pipe: requests and aborts go down, one message per engine
step comes back. The event loop watches that pipe (loop.add_reader: one wake-up of this process per engine step,
no thread in between), applies each step's token ids to the requests' shadows (their output ids, and their text
through output.TextStream: detokenization and stop strings happen here, off the engine's path) and puts each
request's text delta on its asyncio.Queue (a request on another event loop gets its Events through that loop's
call_soon_threadsafe, all of one step in one call). A request's outputs of one step become one Event; a request
that asked for token provenance (server/provenance.py) gets its step's per-token pieces and draft figures on that
Event.

Admission control lives here too: requests wait in per-API-key queues (admission.py: round-robin, bounded, 429
with a Retry-After from the key's queue) and go to the engine only when it has a free slot (`_engine_has_room`),
so the engine's own FIFO never reorders them; 503 at once when the engine is down or the server is draining;
every request submitted gets exactly one terminal Event (finished or error), whatever happens to the engine. A
step that raises is retried once by the engine, then what is in flight fails; a request the engine itself
finishes with finish_reason "error" fails alone; an engine process that dies fails what is in flight with a 503
naming how it ended (exit code or signal), and the server stays up answering 503 (/health too) until it is
restarted (it does not restart the engine itself). Other 500s carry
a request id, never exception text (the traceback goes to the log). Knows no HTTP: routes turn Events into
responses.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass

from draftwise.config import ConfigError
from draftwise.server.admission import FairAdmission
from draftwise.server.engine_host import AddCommand, EngineSnapshot, StepItem
from draftwise.server.errors import APIError
from draftwise.server.provenance import TokenProvenance

log = logging.getLogger("draftwise.server")


@dataclass
class Event:
    """What the engine tells one request: admitted, new text, finished (with the output) or failed."""

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
    request: object  # engine.Request: the shadow (its output ids, logprobs and finish are copied from the engine's)
    stream: object  # output.TextStream
    provenance: TokenProvenance | None = None
    index: int = 0  # the sample's index among the request's n (events carry it)
    key: str = ""  # the admission key (guard.cache_scope of the request's Authorization header)
    started: float | None = None  # perf_counter() when it got an engine slot (None: still queued)


# With the engine on a thread of this process (EngineThread), it drops the GIL in every kernel call and must take
# it back after each; CPython's 5 ms default switch interval let the loop thread stretch its steps by a third.
# 0.5 ms bounds that wait. Not set with the engine in its own process (nothing to share).
ENGINE_SWITCH_INTERVAL_S = 0.0005


class EngineRunner:
    def __init__(self, host, metrics, max_waiting: int | None = None, max_queued_per_key: int | None = None,
                 max_running_per_key: int | None = None):
        self.host, self.metrics = host, metrics  # engine_host.EngineProcess / EngineThread
        self.front = host.front
        self._conn = host.conn
        self._sinks: dict[str, _Sink] = {}  # requests the engine has (or was sent), under _lock
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop reading the engine's pipe (start())
        self._reading = False  # the loop watches the pipe: from start() until the engine's end (or stop())
        self.last_error: str | None = None
        self._lock = threading.RLock()  # guards admission, _sinks, _in_flight, _outbox and _closed
        # commands go down the pipe from their own thread: the event loop never blocks on a full pipe (the loop
        # blocking while the engine blocks sending it a step would deadlock both)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="draftwise-commands", daemon=True)
        # requests wait here (per API key, round-robin) until the engine has a free slot: the engine's own queue
        # stays empty, so the order requests start in is this one's
        self.admission = FairAdmission(self.front.max_num_seqs, max_waiting, max_queued_per_key, max_running_per_key)
        self._in_flight = 0  # submitted, no terminal Event yet
        self._closed = False  # the engine has stopped: nothing more is accepted
        self._stopping = False  # stop() was called: the engine's end is expected
        self._down_message = "the engine is not running"
        self.draining = False  # shutting down: nothing new is accepted, what is in flight finishes
        self._outbox: list = []  # (loop, queue, Event) posted, not yet handed over (_flush)
        self._kv_blocks: tuple[int, int] | None = None  # (kv_blocks_free, kv_block_size) of the last step snapshot
        self._spec_stats = None  # SpecStats of the last snapshot that carried them (engine_host: sent when moved)

    # ---- event-loop side --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine and watch its pipe from the running event loop (call it on that loop)."""
        if self.host.in_process:
            sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
        self._loop = asyncio.get_running_loop()
        self.host.start()
        self._sender.start()
        self._reading = True
        self._loop.add_reader(self._conn.fileno(), self._on_readable)

    def stop(self, timeout: float = 10.0) -> None:
        """Tell the engine to stop and wait for its last messages and its end (a child process is killed after
        `timeout`); what is still in flight then ends with a 503."""
        self._stopping = True
        was_reading = self._stop_reading()
        self._send(("stop",))
        self._commands.put(None)
        deadline = time.monotonic() + timeout
        try:
            while was_reading:  # what the engine sends until it has stopped, read here (the loop no longer does)
                if not self._conn.poll(max(deadline - time.monotonic(), 0)):
                    break
                if not self._dispatch(self._conn.recv()):
                    break
                self._admit()
                self._flush()
        except (EOFError, OSError):
            pass
        self.host.join(max(deadline - time.monotonic(), 0.1))
        self._close()

    @property
    def alive(self) -> bool:
        return self._reading and not self._closed

    @property
    def down_message(self) -> str:
        """Why the engine is not running (how a child process ended, when it did)."""
        return self._down_message

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, prompt, params, speculate: bool = True, provenance: bool = False) -> tuple[str, asyncio.Queue]:
        """Queue a request for the engine; its first Event says admitted or error. `speculate=False` decodes it
        plainly; `provenance=True` puts each step's token provenance on its Events."""
        return self.enqueue(self.prepare(prompt, params, speculate, provenance))

    def prepare(self, prompt, params, speculate: bool = True, provenance: bool = False, scope: str = "") -> tuple:
        """Tokenize and build the request's shadow (any thread: the server runs this in its worker pool); `scope`:
        its cache scope (guard.cache_scope)."""
        try:
            req, stream = self.front.new_request(prompt, params)
        except ConfigError as e:
            raise APIError(400, str(e), param=e.param or "prompt") from None
        req.speculate = speculate
        req.cache_scope = scope
        tracker = None
        if provenance:
            tracker = TokenProvenance(stream, self.front.spec_config.method if speculate else "none")
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
        self._admit()
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
        if self._closed or not self._reading:
            return APIError(503, self._down_message, code="engine_unavailable")
        if self.draining:
            return APIError(503, "the server is shutting down", code="shutting_down")
        return None

    def key_counts(self) -> dict[str, tuple[int, int, int]]:
        """Admission key -> (queued, admitted, rejected), for /metrics."""
        with self._lock:
            return self.admission.counts()

    def abort(self, request_id: str) -> None:
        """The client is gone (or timed out): free its slot now, or take it out of its queue."""
        with self._lock:
            sink = self._sinks.pop(request_id, None)
            if sink is None:  # still queued, or already finished (the abort raced the last token)
                queued = self.admission.remove_where(lambda s: s.request.request_id == request_id)
                if queued is not None:
                    self._in_flight -= 1
                return
            self._release(sink)
        self._send(("abort", request_id))
        self.metrics.on_finished("abort", None, None, len(sink.request.output_ids))
        self._admit()

    def fail_all(self, status: int, message: str, code: str | None = None) -> None:
        """End every request in flight with this error (graceful shutdown once its timeout has passed)."""
        self._fail_everything(APIError(status, message, code=code))
        self._flush()

    def _release(self, sink: _Sink, finished: bool = False) -> None:
        """`sink` (which held an engine slot) is done; `finished`: it ran to its end (its slot time is a measure
        for Retry-After). Under _lock."""
        slot_s = time.perf_counter() - sink.started if finished and sink.started is not None else None
        self._in_flight -= 1
        self.admission.finished(sink.key, slot_s)

    def _send(self, msg) -> None:
        """Queue a command for the engine (any thread; never blocks)."""
        self._commands.put(msg)

    def _send_loop(self) -> None:
        while True:
            msg = self._commands.get()
            if msg is None:
                return
            try:
                self._conn.send(msg)
            except (OSError, ValueError):  # the engine is gone (the loop sees its end of file)
                pass

    # ---- admission (any thread) -------------------------------------------------------------------
    def _engine_has_room(self) -> bool:
        """Whether the engine takes one more request now: a free KV slot, and K/V blocks (the last step snapshot's
        kv_blocks_free: free, or held only by the prefix cache) beyond what the prompts sent and not yet answered
        may still take (counted whole: a conservative bound, since a prefilling one has reserved some already) —
        else requests stay in the admission queue (fair order; its length is what the 429 counts). With nothing in
        the engine it always has room (the engine preempts within its pool). The one place admission asks the
        engine. Under _lock."""
        if len(self._sinks) >= self.front.max_num_seqs:
            return False
        kv = self._kv_blocks
        if kv is None or not kv[1] or not self._sinks:
            return True
        free, size = kv
        pending = sum(-(-len(s.request.prompt_ids) // size) for s in self._sinks.values() if not s.request.output_ids)
        return free > pending

    def _admit(self) -> None:
        """Send queued requests to the engine while it has room, in the admission's (round-robin) order."""
        while True:
            with self._lock:
                if self._closed or not self._engine_has_room():
                    return
                nxt = self.admission.pop()
                if nxt is None:
                    return
                sink = nxt[1]
                req = sink.request
                self._sinks[req.request_id] = sink
                cmd = AddCommand(req.request_id, req.prompt_ids, req.params, req.speculate, req.cache_scope,
                                 req.arrival_time)
            self._send(("add", cmd))

    # ---- the engine's messages (on the event loop) ---------------------------------------------------
    def _on_readable(self) -> None:
        """The engine's pipe has data: handle one message, then hand its Events over (another message already
        there calls this again at once: the loop's readiness is level-triggered; no Connection.poll(), which
        builds a selector per call)."""
        try:
            if not self._dispatch(self._conn.recv()):
                self._stop_reading()
                self._close()
                return
        except (EOFError, OSError):
            self._stop_reading()
            if not self._stopping:
                self._down_message = self.host.exit_description()
                log.error("%s", self._down_message)
            self._close()
            return
        except BaseException:  # reading ends either way; _close tells every request (503 from now on)
            log.exception("handling the engine's messages failed")
            self._stop_reading()
            self._close()
            return
        self._admit()
        self._flush()

    def _stop_reading(self) -> bool:
        """Stop watching the pipe; whether it was watched."""
        was, self._reading = self._reading, False
        if was and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._conn.fileno())
            except (OSError, ValueError, RuntimeError):  # the pipe or the loop is already closed
                pass
        return was

    def _dispatch(self, msg) -> bool:
        """Handle one engine message; False when it says the engine has stopped."""
        kind = msg[0]
        if kind == "step":
            self._on_step(*msg[1:])
        elif kind == "added":
            self._on_added(msg[1])
        elif kind == "add_failed":
            self._on_add_failed(*msg[1:])
        elif kind == "status":
            self.metrics.sync(self._snapshot(msg[1]))
        elif kind == "failed":
            self._on_failed(*msg[1:])
        elif kind == "stopped":
            return False
        return True

    def _close(self) -> None:
        """The engine is gone: refuse new work, and give every request still here its terminal Event."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._fail_everything(APIError(503, "the engine stopped" if self._stopping else self._down_message,
                                       code="engine_unavailable"))
        self._flush()

    def _fail_everything(self, error: APIError) -> None:
        """End every request, running or queued, with `error` (aborting them in the engine)."""
        with self._lock:
            running = list(self._sinks.values())
            self._sinks.clear()
            for sink in running:
                self._release(sink)
            queued = self.admission.drain_all()
            self._in_flight -= len(queued)
            for sink in running + queued:
                self._post(sink, Event(error=error))
        for sink in running:
            self.metrics.on_finished("error", None, None, len(sink.request.output_ids))
            self._send(("abort", sink.request.request_id))

    def _on_added(self, rid: str) -> None:
        with self._lock:
            sink = self._sinks.get(rid)
            if sink is None:  # aborted before the engine took it (the engine has dropped it too)
                return
            sink.started = time.perf_counter()
            self._post(sink, Event(admitted=True))
        self.metrics.on_admitted(len(sink.request.prompt_ids))

    def _on_add_failed(self, rid: str, status: int, message: str, param, code) -> None:
        with self._lock:
            sink = self._sinks.pop(rid, None)
            if sink is None:
                return
            self._release(sink)
            if status == 500:
                log.error("the engine could not take request %s: %s", rid, message)
                self._post(sink, Event(error=internal_error(rid)))
            else:
                self._post(sink, Event(error=APIError(status, message, param=param, code=code)))

    def _on_failed(self, rids: list, message: str) -> None:
        """A step failed twice: the engine dropped these requests."""
        self.last_error = message
        log.error("engine step failed again (%s); failing the requests in flight: %s", message,
                  ", ".join(rids) or "none")
        for rid in rids:
            self._fail(rid, internal_error(rid))

    def _snapshot(self, packed: tuple) -> EngineSnapshot:
        snapshot = EngineSnapshot.unpack(packed, self._spec_stats)
        self._spec_stats = snapshot.spec_stats
        return snapshot

    def _on_step(self, step_s: float, gap_s: float | None, packed_items: list[tuple], packed_snapshot: tuple) -> None:
        self.metrics.step_s.observe(step_s)
        if gap_s is not None:  # between two steps: commands, the step message, metrics
            self.metrics.overhead_s.observe(gap_s)
        snapshot = self._snapshot(packed_snapshot)
        for packed in packed_items:
            item = StepItem(*packed)
            with self._lock:
                sink = self._sinks.get(item.request_id)
            if sink is None:  # aborted: its tokens are nobody's
                continue
            try:
                self._deliver(sink, item)
            except Exception:  # e.g. detokenization: fail this request only
                log.exception("delivering output failed (request id %s)", item.request_id)
                self._fail(item.request_id, internal_error(item.request_id))
        with self._lock:
            self._kv_blocks = (snapshot.kv_blocks_free, snapshot.kv_block_size)
        self.metrics.sync(snapshot)

    def _deliver(self, sink: _Sink, item: StepItem) -> None:
        """Apply a step's tokens to the request's shadow; one Event for them (their text is one delta)."""
        req, n = sink.request, len(item.new_token_ids)
        req.output_ids.extend(item.new_token_ids)
        if req.on_token is not None:
            for tok in item.new_token_ids:
                req.on_token(tok)
        if item.logprobs:
            req.logprobs.extend(item.logprobs)
        req.first_token_time = item.first_token_time
        self.metrics.on_tokens(n)
        if n and len(req.output_ids) == n and req.first_token_time is not None:
            self.metrics.on_first_token(req.first_token_time - req.arrival_time)
        if item.finished:
            req.finish_reason, req.error, req.finish_time = item.finish_reason, item.error, item.finish_time
            req.num_cached_tokens = item.num_cached_tokens
            if item.spec_stats is not None:
                req.spec_stats = item.spec_stats
        if req.finish_reason == "error":  # the engine failed this request alone (Request.error)
            log.error("the engine failed request %s: %s", req.request_id, req.error)
            self._fail(req.request_id, internal_error(req.request_id), in_engine=False)
            return
        text = sink.stream.delta()
        lp = item.logprobs if req.params.logprobs is not None else None
        if not item.finished:
            if text or n:
                self._post_now(sink, Event(text=text, num_new_tokens=n, provenance=_provenance(sink, item, text),
                                           logprobs=lp))
            return
        text += sink.stream.finish()
        prov = _provenance(sink, item, text)
        output = self.front.to_output(req, sink.stream.text)
        with self._lock:
            if self._sinks.pop(req.request_id, None) is None:  # aborted meanwhile
                return
            self._release(sink, finished=True)
            self._post(sink, Event(text=text, num_new_tokens=n, finished=True, finish_reason=req.finish_reason,
                                   output=output, provenance=prov, logprobs=lp))
        self.metrics.on_finished(req.finish_reason, output.total_s, output.ttft_s, len(req.output_ids))

    def _fail(self, request_id: str, error: APIError, in_engine: bool = True) -> None:
        with self._lock:
            sink = self._sinks.pop(request_id, None)
            if sink is None:
                return
            self._release(sink)
            self._post(sink, Event(error=error))
        if in_engine:
            self._send(("abort", request_id))
        self.metrics.on_finished("error", None, None, len(sink.request.output_ids))

    def _post_now(self, sink: _Sink, event: Event) -> None:
        with self._lock:
            self._post(sink, event)

    def _post(self, sink: _Sink, event: Event) -> None:
        """Queue an Event for its request (under _lock); _flush hands them over (one wake-up of the loop)."""
        event.index = sink.index
        self._outbox.append((sink.loop, sink.queue, event))

    def _flush(self) -> None:
        """Hand the Events posted since the last flush to their queues: directly on the running loop, through one
        call_soon_threadsafe per other loop, whatever the number of requests."""
        with self._lock:
            if not self._outbox:
                return
            outbox, self._outbox = self._outbox, []
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:  # not on an event loop (stop() from a thread)
            here = None
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, q, event in outbox:
            by_loop.setdefault(loop, []).append((q, event))
        for loop, items in by_loop.items():
            if loop is here:
                _put_all(items)  # this loop's own requests: no wake-up needed
                continue
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


def _provenance(sink: _Sink, item: StepItem, text: str) -> dict | None:
    if sink.provenance is None:
        return None
    return sink.provenance.chunk(text, item.pieces)

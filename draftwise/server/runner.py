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
finishes with finish_reason "error" fails alone. Other 500s carry a request id, never exception text (the
traceback goes to the log).

Supervision: an engine process that dies (end of file on its pipe) is restarted at once from the same factory
(engine_host.EngineProcess.respawn, on a thread: the event loop keeps serving) — after a backoff when children
keep dying young, and not past `RestartPolicy.max_restarts` deaths within its window: then the server answers
503 naming the cause for good. Meanwhile `state` is "restarting" (/health 503 with Retry-After), new requests
queue, and every request the engine had is kept: once the new child is ready, each is replayed as its prompt
plus the tokens its client already has (AddCommand.output_ids: counted as output, so greedy and seeded output
continue exactly where they were; sampling.py, engine_host._resume), its shadow and text stream untouched, so
the client sees one continuous stream. A request that was in the engine for more than `max_replays` deaths is
failed (503) rather than replayed again (it may be what kills it); one whose client leaves while the engine
restarts is dropped and counted. An in-process engine (EngineThread) is not restarted: its end fails what is in
flight with a 503 naming it, and the server answers 503 from then on. Knows no HTTP: routes turn Events into
responses.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
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
    replays: int = 0  # engine deaths it was in the engine for (each one replayed it into the next)


@dataclass
class RestartPolicy:
    """When a dead engine process is restarted: at once, or after a backoff doubling from `backoff_s` (to at most
    `max_backoff_s`) while children keep dying within `stable_s` of becoming ready; never again once more than
    `max_restarts` deaths fell within `window_s` (0: never restart). A request is replayed after at most
    `max_replays` deaths, then failed. A new child must load within `start_timeout_s`. `standby`: a spare child
    with its LLM built waits beside the engine (engine_host.EngineProcess.prepare_standby), so a restart only
    tells it to go."""

    max_restarts: int = 10
    window_s: float = 300.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 30.0
    max_replays: int = 3
    start_timeout_s: float = 600.0
    standby: bool = False  # keep a standby child (its LLM built) for the next restart (`draftwise serve`: on)

    def backoff(self, fast_deaths: int) -> float:
        """Seconds to wait before a restart after `fast_deaths` deaths in a row of children that died young."""
        return 0.0 if fast_deaths <= 1 else min(self.backoff_s * 2 ** (fast_deaths - 2), self.max_backoff_s)


# With the engine on a thread of this process (EngineThread), it drops the GIL in every kernel call and must take
# it back after each; CPython's 5 ms default switch interval let the loop thread stretch its steps by a third.
# 0.5 ms bounds that wait. Not set with the engine in its own process (nothing to share).
ENGINE_SWITCH_INTERVAL_S = 0.0005


class EngineRunner:
    def __init__(self, host, metrics, max_waiting: int | None = None, max_queued_per_key: int | None = None,
                 max_running_per_key: int | None = None, restart_policy: RestartPolicy | None = None,
                 memory_guard=None):
        self.host, self.metrics = host, metrics  # engine_host.EngineProcess / EngineThread
        self.memory_guard = memory_guard  # memory_limit.MemoryGuard: holds admission near the memory ceiling
        self.restart_policy = restart_policy or RestartPolicy()
        self.state = "starting"  # starting -> ready -> (restarting -> ready)* ; failed: for good; stopped
        self._ready = False  # a live engine takes commands (admission sends requests only then)
        self._deaths: deque = deque()  # monotonic() of recent engine deaths (the restart limit's window)
        self._fast_deaths = 0  # deaths in a row of children that died within stable_s of becoming ready
        self._ready_at: float | None = None  # monotonic() when the current child became ready
        self._died_at: float | None = None  # monotonic() of the death the current restart answers (the first)
        self.restarts = 0  # children started after a death
        self.last_restart_s: float | None = None  # death to the new child ready and replayed, the last time
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
        self._preparing = 0  # HTTP requests being read or tokenized, not yet queued (`preparing`; AddCommand.more)
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
        self.state, self._ready, self._ready_at = "ready", True, time.monotonic()
        self.metrics.set_engine_state(self.state)
        self._prepare_standby()

    def _prepare_standby(self) -> None:
        """Start the next restart's standby child (on the event loop: a long-lived thread), when it is wanted."""
        policy = self.restart_policy
        if policy.standby and policy.max_restarts > 0 and hasattr(self.host, "prepare_standby"):
            try:
                self.host.prepare_standby()
            except Exception:  # noqa: BLE001 — a restart then spawns a fresh child
                log.exception("starting a standby engine process failed")

    def stop(self, timeout: float = 10.0) -> None:
        """Tell the engine to stop and wait for its last messages and its end (a child process is killed after
        `timeout`); what is still in flight then ends with a 503."""
        self._stopping = True
        self.state = "stopped"
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
        return self.state == "ready" and self._reading and not self._closed

    def retry_after_s(self) -> int:
        """Seconds a client should wait while the engine is not ready: what the last restart took (else 5)."""
        last = self.last_restart_s if self.last_restart_s is not None else 5.0
        since = time.monotonic() - self._died_at if self._died_at is not None else 0.0
        return max(1, int(last - since + 0.999))

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

    @contextmanager
    def preparing(self):
        """Around a route's reading and tokenizing of one request (before `enqueue`): while it lasts, the adds sent
        to the engine announce it (AddCommand.more), so an idle engine waits for it instead of prefilling the
        requests before it without it (engine_host.admit_wait)."""
        with self._lock:
            self._preparing += 1
        try:
            yield
        finally:
            with self._lock:
                self._preparing -= 1

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
        if self._closed or (not self._reading and self.state != "restarting"):  # restarting: requests queue
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
            if self.state == "restarting":  # its client left while it waited for the new engine: not replayed
                self.metrics.on_replay_dropped()
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
        """Queue a command for the engine (any thread; never blocks). It goes to the engine of now: one that dies
        meanwhile never passes it to its successor (a replay resends what the new one needs)."""
        self._commands.put((self._conn, msg))

    def _send_loop(self) -> None:
        while True:
            item = self._commands.get()
            if item is None:
                return
            conn, msg = item
            try:
                conn.send(msg)
            except (OSError, ValueError):  # the engine is gone (the loop sees its end of file)
                pass

    # ---- admission (any thread) -------------------------------------------------------------------
    def _engine_has_room(self) -> bool:
        """Whether the engine takes one more request now: a free KV slot, and K/V blocks (the last step snapshot's
        kv_blocks_free: free, or held only by the prefix cache) beyond what the prompts sent and not yet answered
        may still take (counted whole: a conservative bound, since a prefilling one has reserved some already) —
        else requests stay in the admission queue (fair order; its length is what the 429 counts). With nothing in
        the engine it always has room (the engine preempts within its pool); none while the measured RSS is near
        the memory ceiling (memory_limit.MemoryGuard) and something runs. The one place admission asks the
        engine. Under _lock."""
        if len(self._sinks) >= self.front.max_num_seqs:
            return False
        if self._sinks and self.memory_guard is not None and self.memory_guard.holds():
            return False  # near the memory ceiling: what runs finishes first (alone, a request always starts)
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
                if self._closed or not self._ready or not self._engine_has_room():
                    return
                nxt = self.admission.pop()
                if nxt is None:
                    return
                sink = nxt[1]
                req = sink.request
                self._sinks[req.request_id] = sink
                # the requests still being prepared that the engine will have room for: it waits for those
                cmd = _add_command(req, more=min(self._preparing, self.front.max_num_seqs - len(self._sinks)))
            self._send(("add", cmd))

    # ---- the engine's messages (on the event loop) ---------------------------------------------------
    def _on_readable(self) -> None:
        """The engine's pipe has data: handle one message, then hand its Events over (another message already
        there calls this again at once: the loop's readiness is level-triggered; no Connection.poll(), which
        builds a selector per call)."""
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self._engine_ended()
            return
        except Exception:  # a message cut short by the child's death
            log.exception("reading the engine's pipe failed")
            self._engine_ended()
            return
        try:
            if not self._dispatch(msg):
                self._stop_reading()
                self._close()
                return
        except BaseException:  # reading ends either way; _close tells every request (503 from now on)
            log.exception("handling the engine's messages failed")
            self._stop_reading()
            self._close()
            return
        self._admit()
        self._flush()

    # ---- supervision (on the event loop, but the new child's loading, on a thread) --------------------
    def _engine_ended(self) -> None:
        """The engine's pipe reached its end: a stop we asked for, or a death (restarted when it can be)."""
        self._stop_reading()
        self._ready = False
        if self._stopping:
            self._close()
            return
        self._down_message = self.host.exit_description()
        log.error("%s", self._down_message)
        if not getattr(self.host, "restartable", False) or self.restart_policy.max_restarts <= 0:
            self._fail_for_good(self.host.exit_cause())
            return
        self._on_death(self.host.exit_cause(), self._down_message)

    def _fail_for_good(self, cause: str) -> None:
        """No restart: count the death, say so in /health and /metrics, answer 503 (`_down_message`) from now on."""
        self.state = "failed"
        self.metrics.on_engine_death(cause, restarted=False)
        self.metrics.set_engine_state(self.state)
        self._close()

    def _on_death(self, cause: str, description: str) -> None:
        """Count the death; restart (after the backoff) unless over the limit; fail requests replayed too often."""
        policy, now = self.restart_policy, time.monotonic()
        lived = now - self._ready_at if self._ready_at is not None else 0.0
        self._ready_at = None
        self._fast_deaths = self._fast_deaths + 1 if lived < policy.stable_s else 1
        self._deaths.append(now)
        while self._deaths and self._deaths[0] < now - policy.window_s:
            self._deaths.popleft()
        if len(self._deaths) > policy.max_restarts:
            self._down_message = (f"{description}; the engine died {len(self._deaths)} times within "
                                  f"{policy.window_s:g} s (the limit is {policy.max_restarts}): not restarting it")
            log.error("%s", self._down_message)
            self._fail_for_good(cause)
            return
        self.metrics.on_engine_death(cause, restarted=True)
        if self.state != "restarting":
            self._died_at = now
        self.state = "restarting"
        self.metrics.set_engine_state(self.state)
        with self._lock:
            self._kv_blocks = None  # the new engine's pool says what is free
            doomed = []
            for rid, sink in self._sinks.items():
                if cause == "start_failed":  # a child that never took them: not their deaths
                    continue
                sink.replays += 1
                if sink.replays > policy.max_replays:
                    doomed.append(rid)
            live = len(self._sinks) - len(doomed)
        for rid in doomed:  # it may be what kills the engine: not again
            self._fail(rid, APIError(503, f"the engine died {policy.max_replays + 1} times while running this "
                                          f"request ({description}); not replaying it again",
                                     code="engine_unavailable"), in_engine=False)
        self._flush()
        delay = policy.backoff(self._fast_deaths)
        log.warning("restarting the engine%s (death %d within %g s; %d requests to replay)",
                    f" in {delay:.1f} s" if delay else "", len(self._deaths), policy.window_s, live)
        self._loop.call_later(delay, self._respawn)

    def _respawn(self) -> None:
        """After the backoff (on the event loop): start a new child from the old one's factory — from this
        long-lived thread, since the child's PR_SET_PDEATHSIG fires when the thread that spawned it ends — then
        wait for its model on a thread of its own."""
        if self._stopping or self._closed:
            return
        try:
            host = self.host.respawn(self.restart_policy.start_timeout_s)
        except Exception as e:  # noqa: BLE001 — a failed start is one more death
            self._on_death("start_failed", f"the engine could not be restarted: {e}")
            return
        threading.Thread(target=self._await_respawned, args=(host,), name="draftwise-respawn", daemon=True).start()

    def _await_respawned(self, host) -> None:
        """A thread: wait until the new child has loaded its model, then hand it to the event loop."""
        try:
            host.front  # noqa: B018 — waits until the model is loaded (ConfigError when it cannot be)
            if self._stopping:
                raise RuntimeError("the server is stopping")
            self._loop.call_soon_threadsafe(self._on_respawned, host)
        except Exception as e:  # noqa: BLE001 — a failed start is one more death
            host.kill()
            if self._stopping:
                return
            desc = f"the engine could not be restarted: {e}"
            try:
                self._loop.call_soon_threadsafe(self._on_death, "start_failed", desc)
            except RuntimeError:  # the event loop is closed (shutting down)
                pass

    def _on_respawned(self, host) -> None:
        """The new child is ready: read its pipe, then replay every request the old one had, in their order."""
        if self._stopping or self._closed:
            host.kill()
            return
        old, self.host, self._conn = self.host, host, host.conn
        try:
            old.conn.close()
        except OSError:
            pass
        self._reading = True
        self._loop.add_reader(self._conn.fileno(), self._on_readable)
        with self._lock:
            replay = list(self._sinks.values())
            self.state, self._ready = "ready", True
            commands = [_add_command(s.request) for s in replay]
        for cmd in commands:
            self._send(("add", cmd))
        now = time.monotonic()
        self.last_restart_s = now - self._died_at
        self._died_at, self._ready_at = None, now
        self.restarts += 1
        self.metrics.on_engine_restarted(self.last_restart_s, len(replay))
        self.metrics.set_engine_state(self.state)
        log.warning("the engine is back (pid %s) %.1f s after it died (ready %.1f s after it was asked; its LLM "
                    "built in %.1f s); replaying %d requests", getattr(host, "pid", "-"), self.last_restart_s,
                    getattr(host, "start_s", 0) or 0, host.front.load_time_s, len(replay))
        self._admit()
        self._flush()
        self._prepare_standby()

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
            if sink.started is not None:  # a replay: its client was told long ago
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
        if req.first_token_time is None:  # a replay's engine reports its own first token: the first one stands
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


def _add_command(req, more: int = 0) -> AddCommand:
    """What the engine gets for a request: a replay carries the output its client already has; `more`: the
    requests on their way after it (AddCommand.more)."""
    return AddCommand(req.request_id, req.prompt_ids, req.params, req.speculate, req.cache_scope, req.arrival_time,
                      list(req.output_ids), more)


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

"""The engine's side of the server: who owns the LLM, how it is stepped, and the pipe it talks over.

`serve_engine(llm, conn)` is the step loop: it takes commands from `conn` (a multiprocessing Connection) between
steps (blocking on it when idle, then a few ms more for requests sent together, longer for those an add says are
still on their way: `admit_wait`), steps the LLM
while there is work, and sends ONE message per step with every request's new token ids, finish, logprobs and the
step's speculation figures, plus a snapshot of the engine's counters for /metrics. It owns the LLM, its grammar
states (structured outputs are compiled and advanced here) and its suffix caches; it knows nothing of HTTP, text
deltas or admission. Detokenization for the response happens on the other side (runner.py); this side detokenizes
only requests with stop strings (the engine must stop at one).

Two hosts run that loop: `EngineProcess(factory)` in a child process that builds the LLM itself (what `draftwise
serve` uses: the engine never shares a GIL with the event loop), and `EngineThread(llm)` on a thread of this
process around an LLM already built (tests, embedding), over the same pipe protocol. The child dies with its
parent (PR_SET_PDEATHSIG, and an end of file on the pipe), ignores SIGINT / SIGTERM (the parent drains, then
tells it to stop), and a child that dies is seen as an end of file by the parent: runner.py restarts it
(`EngineProcess.respawn()`: a child with the same factory) and replays what was in flight, or, past its restart
limit, answers 503 naming the exit. A restart costs a message, not a start: once an engine is ready the server
keeps a standby child (`prepare_standby()`: the same factory, its LLM built in advance — imports ~6 s and load
~1.5 s of a child's ~7.5 s start on a quiet 2-core machine — then waiting); `respawn()` tells it to go (a fresh
child when there is none, or it died). Idle and loaded it holds ~0.4 GB RSS (weights are mapped from the prepared
file: untouched until its first forward; the memory ceiling counts it through `pids()`). `exit_description()` /
`exit_cause()` name how a child ended: exit code or signal name, and "oom" when the kernel's OOM-kill counter (the cgroup's memory.events, else
/proc/vmstat) moved while the child ran and it died by SIGKILL.

A replayed request arrives as an AddCommand with `output_ids`: the tokens the client already has. The engine
takes them as the request's output so far (engine.Request.context_ids: prefilled with the prompt, counted as
output by max_tokens, min_tokens, penalties and the position-addressed sampler), and this side advances a fresh
grammar state and stop-string detector through them; nothing of the dead child (caches, grammar states) is
trusted.

Messages, engine -> server: ("ready", EngineFront fields) once (process host only), ("added", rid) or ("add_failed",
rid, status, message, param, code) per request, ("step", step_s, gap_s, [StepItem.pack()], EngineSnapshot.pack())
per step, ("failed", [rid], message) when a step failed twice, ("status", EngineSnapshot.pack()) after aborts,
("stopped",). Server -> engine: ("add", AddCommand), ("abort", rid), ("stop",). The per-step parts travel as plain
tuples (a dataclass pickles at several times the cost: tens of microseconds per step on each side), and the
snapshot's spec_stats only when its counters moved (None: as last sent; a step moves the k histogram).
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field

from draftwise.config import ConfigError, ContextLengthError

log = logging.getLogger("draftwise.server")

PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class AddCommand:
    """A request as the engine gets it: tokens and params (the server tokenized and checked the context)."""

    request_id: str
    prompt_ids: list[int]
    params: object  # sampling.SamplingParams (its structured_outputs are compiled on the engine's side)
    speculate: bool = True
    cache_scope: str = ""
    arrival_time: float = 0.0  # perf_counter() when the server built it (CLOCK_MONOTONIC: one clock for both sides)
    output_ids: list[int] = field(default_factory=list)  # a replay: the tokens already emitted (counted as output)
    # requests the server was still reading or tokenizing when it sent this one (at most the slots left): an idle
    # engine waits for them (ADMIT_ANNOUNCED_MAX_S at most) so they share its first prefill
    more: int = 0


@dataclass
class StepItem:
    """One request's part of a step: the tokens it gained (a request admitted this step may have had two engine
    outputs, prefill and first decode: `pieces` keeps each one's (tokens, k, accepted) for provenance)."""

    request_id: str
    new_token_ids: list[int]
    pieces: list[tuple[int, int, int]]  # (len(new_token_ids), k, num_accepted) per engine StepOutput
    logprobs: list | None  # sampling.TokenLogprob of new_token_ids, when the request asked for logprobs
    first_token_time: float | None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    finish_time: float | None = None
    spec_stats: object | None = None  # SpecStats, once finished
    num_cached_tokens: int = 0

    def pack(self) -> tuple:
        """The fields in order (the wire form; StepItem(*packed) rebuilds it)."""
        return tuple(self.__dict__.values())  # a dataclass's __init__ sets its fields in declaration order


@dataclass
class PrefixCounters:
    queries: int = 0
    hits: int = 0


@dataclass
class EngineSnapshot:
    """api.EngineStatus as numbers (metrics.sync reads the same fields)."""

    running: int
    waiting: int
    free_slots: int
    spec_stats: object  # SpecStats, a copy
    prefix_cache: PrefixCounters | None
    kv_blocks_free: int = 0
    kv_blocks: int = 0
    kv_block_size: int = 0

    def pack(self, with_spec_stats: bool = True) -> tuple:
        """The wire form (unpack() rebuilds it); spec_stats None unless `with_spec_stats`."""
        pc = self.prefix_cache
        return (self.running, self.waiting, self.free_slots, self.spec_stats if with_spec_stats else None,
                None if pc is None else (pc.queries, pc.hits), self.kv_blocks_free, self.kv_blocks, self.kv_block_size)

    @classmethod
    def unpack(cls, packed: tuple, last_spec_stats) -> "EngineSnapshot":
        """From pack()'s tuple; a spec_stats left out is `last_spec_stats` (the last one received)."""
        running, waiting, free, stats, pc, free_blocks, blocks, block_size = packed
        return cls(running, waiting, free, last_spec_stats if stats is None else stats,
                   None if pc is None else PrefixCounters(*pc), free_blocks, blocks, block_size)


@dataclass
class EngineFront:
    """What the server knows of the engine: its tokenizer and limits, and how to build a request's shadow (the
    Request whose output_ids and text the server side keeps up to date from the step messages)."""

    tokenizer: object
    max_model_len: int
    max_num_seqs: int
    k_max: int
    spec_config: object  # SpecConfig
    model_info: dict = field(default_factory=dict)
    load_time_s: float = 0.0
    plan_lines: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, llm) -> "EngineFront":
        from draftwise.cli_args import plan_lines

        try:
            lines = list(plan_lines(llm))
        except Exception:  # a model built by hand (tests) may not carry everything a plan line reads
            lines = []
        return cls(llm.tokenizer, llm.max_model_len, llm.max_num_seqs, llm.k_max, llm.spec_config,
                   dict(getattr(llm, "model_info", None) or {}), getattr(llm, "load_time_s", 0.0), lines)

    def new_request(self, prompt, params):
        """(engine.Request, output.TextStream): the server's shadow of a request (tokenized here)."""
        from draftwise.api import LLM, Request  # api re-exports engine.Request (entry reaches the engine via api)
        from draftwise.output import TextStream

        if params.n != 1:
            raise ConfigError("new_request builds one sample: split n > 1 with SamplingParams.samples()")
        text, ids = LLM._prompt_ids(self, prompt)  # reads only self.tokenizer
        stream = TextStream.for_params(self.tokenizer, params)
        return Request(uuid.uuid4().hex[:16], ids, params, on_token=stream.add, prompt_text=text), stream

    def to_output(self, req, text: str):
        from draftwise.api import LLM

        return LLM.to_output(self, req, text)  # reads only self.spec_config

    @staticmethod
    def merge_outputs(samples):
        from draftwise.api import LLM

        return LLM.merge_outputs(samples)


# ---- the step loop (the engine's side) --------------------------------------------------------------------------
# An idle engine, woken by a command, waits up to ADMIT_WINDOW_S for the next one after each arrival (no longer than
# ADMIT_WINDOW_MAX_S in all) before its first step, so clients that send together are prefilled together: the
# server tokenizes requests one after another, a few ms apart, and a step started on the first alone put the rest
# a whole prefill behind it (waves of 1 + 3 or 2 + 2 at 4 clients, by chance, PERFORMANCE.md's fifth-session
# entry). On a loaded machine the server's requests come further apart than that window (4.5-12 ms between
# adds at load average 3-6, srv7's step records in the sixth session: 1 + 3 waves again), so each add also says how many
# requests the server was still reading or tokenizing when it sent it (AddCommand.more): while the last add
# announced more, the idle engine waits for them, ADMIT_ANNOUNCED_MAX_S at most from the first command (a request
# that fails validation never comes: the bound). A busy engine never waits: what arrived during a step is
# admitted before the next.
ADMIT_WINDOW_S = 0.005
ADMIT_WINDOW_MAX_S = 0.025
ADMIT_ANNOUNCED_MAX_S = 0.1


def serve_engine(llm, conn) -> None:
    """Step `llm` for the server at the other end of `conn` until told to stop or the pipe closes."""
    live: dict[str, object] = {}  # request id -> engine.Request
    snap = _Snapshots(llm)
    failures = 0  # consecutive step exceptions
    last_end = None  # perf_counter() when the last step ended (None: idle since)
    while True:
        idle = not llm.has_unfinished()
        if idle:
            last_end = None
        try:
            if idle or conn.poll():
                cmd, aborted, announced = conn.recv(), False, 0
                woken = time.perf_counter() if idle else None  # the idle engine's window starts
                while True:
                    if cmd[0] == "stop":
                        conn.send(("stopped",))
                        return
                    _handle(llm, conn, live, cmd)
                    aborted = aborted or cmd[0] == "abort"
                    if cmd[0] == "add":
                        announced = cmd[1].more
                    wait = 0.0 if woken is None else admit_wait(time.perf_counter() - woken, announced)
                    if not conn.poll(wait):
                        break
                    cmd = conn.recv()
                if aborted:  # slots freed with no step to follow: /metrics should see it now
                    _send(conn, ("status", snap.next()))
        except (EOFError, OSError):  # the server is gone: nothing to serve
            return
        if not llm.has_unfinished():
            continue
        t0 = time.perf_counter()
        gap = None if last_end is None else t0 - last_end
        try:
            outputs = llm.step()
        except Exception as e:  # retry once, then fail what is in flight (the server stays up)
            failures += 1
            log.exception("engine step failed%s (requests: %s)", "; retrying once" if failures == 1 else " again",
                          ", ".join(live) or "none")
            if failures == 1:
                continue
            failures = 0
            rids = list(live)
            for rid in rids:
                _abort(llm, live, rid)
            _send(conn, ("failed", rids, f"{type(e).__name__}: {e}"))
            continue
        failures = 0
        last_end = time.perf_counter()
        _send(conn, ("step", last_end - t0, gap, [it.pack() for it in _items(outputs, live)], snap.next()))


def admit_wait(since_woken_s: float, announced: int) -> float:
    """Seconds an engine woken from idle `since_woken_s` ago waits for the next command before its first step:
    while the last add announced `announced` > 0 requests still on their way, up to ADMIT_ANNOUNCED_MAX_S from
    waking; else ADMIT_WINDOW_S after each arrival, up to ADMIT_WINDOW_MAX_S from waking."""
    if announced > 0:
        return max(0.0, ADMIT_ANNOUNCED_MAX_S - since_woken_s)
    return max(0.0, min(ADMIT_WINDOW_S, ADMIT_WINDOW_MAX_S - since_woken_s))


def _send(conn, msg) -> None:
    try:
        conn.send(msg)
    except (BrokenPipeError, OSError):
        pass  # the server is gone; the next recv ends the loop


def _handle(llm, conn, live: dict, cmd) -> None:
    """One command other than stop."""
    if cmd[0] == "add":
        _add(llm, conn, live, cmd[1])
    elif cmd[0] == "abort":
        _abort(llm, live, cmd[1])


def _add(llm, conn, live: dict, add: AddCommand) -> None:
    try:
        req, _ = llm.new_request({"prompt_token_ids": add.prompt_ids}, add.params)
        req.request_id, req.arrival_time = add.request_id, add.arrival_time
        req.speculate, req.cache_scope = add.speculate, add.cache_scope
        if not add.params.stop:  # text is the server's; only a stop string needs it here (to end the request)
            req.on_token = None
        if add.output_ids:
            _resume(req, add.output_ids)
        llm.add_request(req)
    except ConfigError as e:
        too_long = isinstance(e, ContextLengthError)
        _send(conn, ("add_failed", add.request_id, 400, str(e), "max_tokens" if too_long else (e.param or "prompt"),
                     "context_length_exceeded" if too_long else None))
        return
    except Exception as e:  # a bug must not take the engine down
        log.exception("add_request failed (request id %s)", add.request_id)
        _send(conn, ("add_failed", add.request_id, 500, f"{type(e).__name__}: {e}", None, None))
        return
    live[add.request_id] = req
    _send(conn, ("added", add.request_id))


def _resume(req, output_ids: list[int]) -> None:
    """A replayed request: its output so far is `output_ids`; a fresh grammar state and stop-string detector are
    advanced through them (built here, never carried over from the child that died)."""
    if len(output_ids) >= req.params.max_tokens:
        raise ConfigError(f"a replay of {len(output_ids)} tokens leaves nothing of max_tokens "
                          f"({req.params.max_tokens}) to generate")
    req.output_ids = list(output_ids)
    if req.grammar is not None:
        req.matcher = req.grammar.matcher()
        for tok in output_ids:
            if not req.matcher.advance(tok):
                raise ConfigError(f"replay: token {tok} is not allowed by the request's grammar")
    if req.on_token is not None:
        for tok in output_ids:
            if req.on_token(tok):
                raise ConfigError("replay: the output so far already ends at a stop string")


def _abort(llm, live: dict, rid: str) -> None:
    live.pop(rid, None)
    try:
        llm.abort(rid)
    except Exception:  # the engine is in trouble; the request is gone either way
        log.exception("abort failed (request id %s)", rid)


def _items(outputs, live: dict) -> list[StepItem]:
    """The step's outputs grouped per request, in the order the engine gave them."""
    by_rid: dict[str, list] = {}
    for out in outputs:
        by_rid.setdefault(out.request.request_id, []).append(out)
    items = []
    for rid, outs in by_rid.items():
        req = outs[-1].request
        new = [t for o in outs for t in o.new_token_ids]
        n = len(new)
        lp = list(req.logprobs[len(req.logprobs) - n:]) if n and req.params.logprobs is not None else None
        item = StepItem(rid, new, [(len(o.new_token_ids), o.k, o.num_accepted) for o in outs], lp,
                        req.first_token_time)
        if outs[-1].finished or req.finished:  # the request's own state wins (an engine may fail it mid-step)
            live.pop(rid, None)
            item.finished, item.finish_reason, item.error = True, req.finish_reason, req.error
            item.finish_time, item.spec_stats = req.finish_time, req.spec_stats
            item.num_cached_tokens = req.num_cached_tokens
        items.append(item)
    return items


def _snapshot(llm) -> EngineSnapshot:
    s = llm.status()
    pc = None if s.prefix_cache is None else PrefixCounters(int(s.prefix_cache.queries), int(s.prefix_cache.hits))
    return EngineSnapshot(s.running, s.waiting, s.free_slots, s.spec_stats, pc, s.kv_blocks_free, s.kv_blocks,
                          s.kv_block_size)


class _Snapshots:
    """The engine's snapshots in wire form, spec_stats included only when the counters /metrics reads moved."""

    def __init__(self, llm):
        self.llm = llm
        self._sent = None  # the spec counters last sent

    def next(self) -> tuple:
        snapshot = _snapshot(self.llm)
        st = snapshot.spec_stats
        mark = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.num_forced_tokens,
                st.num_accepted_forced_tokens, sum(st.k_histogram.values()))  # plain steps move the k histogram
        moved, self._sent = mark != self._sent, mark
        return snapshot.pack(with_spec_stats=moved)


# ---- the hosts ---------------------------------------------------------------------------------------------------
class EngineThread:
    """serve_engine on a thread of this process, around an LLM already built (tests; embedding in a program)."""

    in_process = True

    def __init__(self, llm):
        self.llm = llm
        self.front = EngineFront.of(llm)
        self.conn, self._their_end = mp.Pipe()
        self._thread = threading.Thread(target=self._run, name="draftwise-llm", daemon=True)

    def _run(self) -> None:
        try:
            serve_engine(self.llm, self._their_end)
        except BaseException:
            log.exception("the engine thread died")
        finally:
            self._their_end.close()

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def exit_description(self) -> str:
        return "the engine thread stopped"

    def exit_cause(self) -> str:
        return "thread"

    restartable = False  # its LLM lives in this process: nothing to restart it from


class EngineProcess:
    """serve_engine in a child process that builds its LLM with `factory()` (picklable: a module-level function or
    a functools.partial of one). The constructor starts it and returns (the caller may import and build the app
    meanwhile); `front` waits until the model is loaded: ConfigError when the child fails to load it.
    `standby=True` builds the LLM at once but reports ready only when `activate()` tells it to go."""

    in_process = False

    restartable = True

    def __init__(self, factory, start_timeout_s: float | None = None, standby: bool = False, tokenizer=None):
        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited threads, locks or OpenMP pools
        self.factory = factory
        # a child of the same factory as an engine before it: this side has its tokenizer, so the child does not
        # send it (pickling a 150k-token vocabulary there and parsing it here took ~3 s of a restart under load)
        self._tokenizer = tokenizer
        self._oom_kills_at_start = oom_kill_count()
        self.conn, their_end = ctx.Pipe()
        self.process = ctx.Process(target=_child_main, args=(their_end, factory, os.getpid(), standby,
                                                             tokenizer is None),
                                   name="draftwise-engine", daemon=True)
        self._t0 = time.perf_counter()
        self.process.start()
        their_end.close()  # ours is gone: the child's end of file when we die is the pipe's
        self.start_timeout_s = start_timeout_s
        self._front: EngineFront | None = None
        self.start_s: float | None = None  # from spawning (a standby: from activate()) to the model ready
        self.standby: EngineProcess | None = None  # the child the next respawn() activates (prepare_standby)

    def activate(self, start_timeout_s: float | None = None) -> "EngineProcess":
        """A standby becomes the engine: it reports ready (at once when its LLM is built; `front` waits for it)."""
        self.start_timeout_s = start_timeout_s
        self._oom_kills_at_start = oom_kill_count()
        self._t0 = time.perf_counter()
        self.conn.send(("go",))
        return self

    def prepare_standby(self) -> None:
        """Start a standby child for the next respawn(), unless a live one is there (call it from a long-lived
        thread: a child's PR_SET_PDEATHSIG follows the thread that spawned it)."""
        if self.standby is None or not self.standby.process.is_alive():
            self.standby = EngineProcess(self.factory, standby=True, tokenizer=self.front.tokenizer)

    def pids(self) -> list[int]:
        """The engine's pid and its standby's (what the memory ceiling counts)."""
        spare = self.standby
        return [self.pid] + ([spare.pid] if spare is not None and spare.process.is_alive() else [])

    @property
    def front(self) -> EngineFront:
        if self._front is None:
            self._front = self._wait_ready()
        return self._front

    def _wait_ready(self) -> EngineFront:
        if self.start_timeout_s is not None and not self.conn.poll(self.start_timeout_s):
            self.kill()
            raise ConfigError(f"the engine process did not load the model within {self.start_timeout_s:g} s")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise ConfigError(f"the engine process exited while loading the model (exit code "
                              f"{self.process.exitcode}; its error is printed above)") from None
        if msg[0] != "ready":
            self.process.join(5)
            raise ConfigError(f"the engine process could not load the model: {msg[1]}")
        self.start_s = time.perf_counter() - self._t0
        fields = msg[1]
        if fields["tokenizer"] is None:  # not sent: the one this side already has (the same factory's)
            fields["tokenizer"] = self._tokenizer
        return EngineFront(**fields)

    @property
    def pid(self) -> int:
        return self.process.pid

    def respawn(self, start_timeout_s: float | None = None) -> "EngineProcess":
        """A child with the same factory: the standby when a live one is there (its model is loaded already), else a
        new one (the caller waits for its `front`: the model loaded, within `start_timeout_s`, else this one's)."""
        timeout = start_timeout_s if start_timeout_s is not None else self.start_timeout_s
        spare, self.standby = self.standby, None
        if spare is not None:
            if spare.process.is_alive():
                try:
                    return spare.activate(timeout)
                except (OSError, ValueError):  # it died meanwhile
                    pass
            spare.kill()
        return EngineProcess(self.factory, timeout, tokenizer=self._front.tokenizer if self._front else None)

    def start(self) -> None:
        """Already running (the constructor waited for the model)."""

    def join(self, timeout: float) -> None:
        self._kill_standby()
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("the engine process did not stop within %g s; killing it", timeout)
            self.kill()

    def kill(self) -> None:
        self._kill_standby()
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def _kill_standby(self) -> None:
        spare, self.standby = self.standby, None
        if spare is not None:
            spare.kill()

    def exit_cause(self) -> str:
        """How the child ended, as a short label (/metrics): "oom", a signal's name ("SIGKILL", "SIGSEGV"),
        "exit_<code>", or "running"."""
        self.process.join(1)
        code = self.process.exitcode
        if code is None:
            return "running"
        if code < 0:
            if -code == signal.SIGKILL and self._oom_killed():
                return "oom"
            return signal_name(-code)
        return f"exit_{code}"

    def _oom_killed(self) -> bool:
        before, now = self._oom_kills_at_start, oom_kill_count()
        return before is not None and now is not None and now > before

    def exit_description(self) -> str:
        self.process.join(1)
        code = self.process.exitcode
        if code is not None and code < 0:
            how = f"signal {-code}, {signal_name(-code)}"
            if -code == signal.SIGKILL and self._oom_killed():
                how += "; killed by the kernel's OOM killer (its oom_kill counter rose)"
        else:
            how = f"exit code {code}"
        return f"the engine process (pid {self.process.pid}) stopped unexpectedly ({how})"


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal_{num}"


def oom_kill_count() -> int | None:
    """Processes the kernel's OOM killer has killed: this cgroup's count (v2 memory.events, v1
    memory.oom_control), else the machine's (/proc/vmstat); None when none can be read."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.strip().split(":", 2) for line in f]
    except OSError:
        lines = []
    files = [f"/sys/fs/cgroup{p.rstrip('/')}/memory.events" for h, c, p in lines if h == "0" and c == ""]
    files += [f"/sys/fs/cgroup/memory{p.rstrip('/')}/memory.oom_control" for h, c, p in lines if "memory" in c.split(",")]
    # in a container the cgroup's own files are often mounted at the root
    files += ["/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control", "/proc/vmstat"]
    for path in files:
        try:
            with open(path) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def _child_main(conn, factory, parent_pid: int, standby: bool = False, send_tokenizer: bool = True) -> None:
    """The child process: die with the parent, leave signals to it, load the model, serve. A standby loads it, then
    waits for ("go",) before it reports ready (or its load's failure). Without `send_tokenizer` the ready message's
    tokenizer is None (the server has it)."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C / systemd's SIGTERM: the parent drains first
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(format="draftwise engine: %(levelname)s %(message)s")
    try:
        llm, failure = factory(), None
    except BaseException as e:  # noqa: BLE001 — reported to the server (a standby: once told to go)
        llm, failure = None, e
    if standby:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the server is gone, or it let the standby go
            return
        if msg[0] != "go":
            return
    if failure is not None:
        conn.send(("load_failed", f"{type(failure).__name__}: {failure}"))
        return
    front = EngineFront.of(llm)
    fields = {f: getattr(front, f) for f in front.__dataclass_fields__}
    if not send_tokenizer:
        fields["tokenizer"] = None
    conn.send(("ready", fields))
    serve_engine(llm, conn)


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux prctl; elsewhere the pipe's end of file ends the loop)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

"""Prometheus metrics for the server, named like vLLM's (`draftwise:` instead of `vllm:`).

Owns one CollectorRegistry per app (so tests can build several apps in one process) with request counts,
TTFT / E2E / time-per-output-token histograms, prompt and generation token counters, running / waiting
gauges, free KV slots, the engine's time per step in and between llm.step() calls (measured in the engine
process), the server process's RSS (ProcessCollector), and the spec-decode counters in the shared stats
vocabulary (num_drafts, num_draft_tokens, num_accepted_tokens, num_forced_tokens, num_accepted_forced_tokens,
accepted per position), the prefix cache's tokens queried / reused, and per API key (hashed) the admission's
queue depth, admitted and rejected counts; the engine's supervision (runner.py): its state, deaths and
restarts by cause, restart times, requests replayed into a new engine and those dropped because their client
left meanwhile. Fed from the engine's messages (runner.py); knows nothing of HTTP.
"""
from __future__ import annotations

import hashlib

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "draftwise:"
# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for it read these the same way
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
                5.0, 10.0)  # one engine step (ours: vLLM has no such histogram)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ENGINE_STATES = ("starting", "ready", "restarting", "failed", "stopped")
# + the grammar's forced tokens (structured outputs), a subset of the draft tokens, and how many were accepted
_SPEC_FIELDS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_forced_tokens",
                "num_accepted_forced_tokens")


class ServerMetrics:
    def __init__(self, model_name: str, max_num_seqs: int, k_max: int = 0):
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        lab = ["model_name"]
        self._model = model_name

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, lab, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, lab, registry=r).labels(model_name)

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests holding a KV slot (being decoded).")
        self.waiting = gauge("num_requests_waiting", "Requests queued for a free KV slot.")
        self.slots_free = gauge("kv_slots_free", "Free KV-cache sequence slots.")
        gauge("kv_slots_total", "KV-cache sequence slots (--max-num-seqs).").set(max_num_seqs)
        self.slots_free.set(max_num_seqs)
        self.success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated (output) tokens.")
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token.", TTFT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last output token.", E2E_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "(E2E - TTFT) / (output tokens - 1).",
                         TPOT_BUCKETS)
        self.step_s = hist("engine_step_seconds", "Engine thread: time in one llm.step().", STEP_BUCKETS)
        self.overhead_s = hist("engine_overhead_seconds", "Engine thread, per step while it has work: time outside "
                               "llm.step() (handing outputs over, commands, metrics).", STEP_BUCKETS)
        self.spec_counters = {f: counter(f"spec_decode_{f}", f"Speculative decoding: {f.replace('_', ' ')}.")
                     for f in _SPEC_FIELDS}
        self.per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                               "Accepted draft tokens by position in the draft (0 = first guess).",
                               ["model_name", "position"], registry=r)
        for i in range(k_max):  # expose zeros up front, as vLLM does
            self.per_pos.labels(model_name, str(i))
        # issue 44: the k histogram (a row's k per decode step, 0 = plain) and the batch's one decision per step
        self.k_steps = Counter(PREFIX + "spec_decode_k_steps", "Rows of decode steps by the k they guessed "
                               "(0 = a plain row): the k histogram.", ["model_name", "k"], registry=r)
        self.decisions = Counter(PREFIX + "spec_decode_batch_decisions", "Decode steps by the k policy's one "
                                 "decision for the batch: rows that guessed (speculating) of the rows stepped (batch).",
                                 ["model_name", "speculating", "batch"], registry=r)
        self._seen_k: dict = {}
        self._seen_decisions: dict = {}
        self.prefix_counters = {  # vLLM's prefix_cache_queries / prefix_cache_hits: tokens, not requests
            "queries": counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            "hits": counter("prefix_cache_hits", "Prompt tokens whose K/V the prefix cache held (not recomputed)."),
        }
        # supervision: the engine process's deaths (by cause: "oom", a signal's name, "exit_<code>",
        # "start_failed") and what restarting cost
        self.engine_deaths = Counter(PREFIX + "engine_deaths", "Engine process deaths by cause.",
                                     ["model_name", "cause"], registry=r)
        self.engine_restarts = Counter(PREFIX + "engine_restarts", "Engine restarts begun, by the cause of the "
                                       "death they answer.", ["model_name", "cause"], registry=r)
        self.engine_restart_s = hist("engine_restart_seconds", "From an engine death to a new engine ready with "
                                     "its requests replayed.", E2E_BUCKETS)
        self.replayed = counter("requests_replayed", "Requests replayed into a restarted engine.")
        self.replay_dropped = counter("requests_replay_dropped", "Requests dropped while the engine restarted "
                                      "(their client left).")
        self._state = Gauge(PREFIX + "engine_state", "1 for the engine's current state.", ["model_name", "state"],
                            registry=r)
        self.set_engine_state("starting")
        self._seen = {f: 0 for f in _SPEC_FIELDS}
        self._seen_prefix = {f: 0 for f in self.prefix_counters}
        self._seen_pos: list[int] = []

    # ---- fed by the engine's messages -----------------------------------------------------------
    def on_admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, num_tokens: int) -> None:
        self.generation_tokens.inc(num_tokens)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_finished(self, reason: str, e2e_s: float | None, ttft_s: float | None, num_output: int) -> None:
        self.success.labels(self._model, reason).inc()
        if reason == "abort" or e2e_s is None:
            return
        self.e2e.observe(e2e_s)
        if ttft_s is not None and num_output > 1:
            self.tpot.observe((e2e_s - ttft_s) / (num_output - 1))

    def set_engine_state(self, state: str) -> None:
        for st in ENGINE_STATES:
            self._state.labels(self._model, st).set(1 if st == state else 0)

    def on_engine_death(self, cause: str, restarted: bool) -> None:
        self.engine_deaths.labels(self._model, cause).inc()
        if restarted:
            self.engine_restarts.labels(self._model, cause).inc()

    def on_engine_restarted(self, seconds: float, num_replayed: int) -> None:
        self.engine_restart_s.observe(seconds)
        self.replayed.inc(num_replayed)

    def on_replay_dropped(self) -> None:
        self.replay_dropped.inc()

    def sync(self, status) -> None:
        """Gauges from the engine's queues (`status`: api.LLM.status()); spec and prefix-cache counters advanced
        by what its spec_stats and prefix_cache gained since last time."""
        self.running.set(status.running)
        self.waiting.set(status.waiting)
        self.slots_free.set(status.free_slots)
        stats = status.spec_stats
        _advance(self.spec_counters, self._seen, stats)
        per_pos = list(stats.accepted_per_position)
        for i, now in enumerate(per_pos):
            before = self._seen_pos[i] if i < len(self._seen_pos) else 0
            if now > before:
                self.per_pos.labels(self._model, str(i)).inc(now - before)
        self._seen_pos = [int(x) for x in per_pos]
        _advance_by_label(self.k_steps, self._model, self._seen_k, stats.k_histogram, lambda k: (str(k),))
        _advance_by_label(self.decisions, self._model, self._seen_decisions, getattr(stats, "decisions", {}),
                          lambda d: (str(d[0]), str(d[1])))
        if status.prefix_cache is not None:
            _advance(self.prefix_counters, self._seen_prefix, status.prefix_cache)

    def watch_keys(self, counts) -> None:
        """Per-key admission figures at each scrape: `counts()` -> {key: (queued, admitted, rejected)}
        (runner.key_counts). Keys are shown hashed (key_label), never as sent."""
        self.registry.register(_KeyCollector(counts))

    def watch_memory(self, guard) -> None:
        """The memory ceiling at each scrape (memory_limit.MemoryGuard): limit, measured RSS, admissions held."""
        self.registry.register(_MemoryCollector(guard))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def key_label(key: str) -> str:
    """An admission key as /metrics shows it: "anonymous", or 12 hex digits of a hash of it."""
    key = key.removeprefix("key:")
    return hashlib.sha256(key.encode()).hexdigest()[:12] if key else "anonymous"


class _KeyCollector:
    """draftwise:key_queue_depth, key_admitted_total, key_rejected_total, labelled by the hashed key."""

    def __init__(self, counts):
        self.counts = counts

    def describe(self):
        return []  # registered without a describe pass: collect() runs at scrape time only

    def collect(self):
        depth = GaugeMetricFamily(PREFIX + "key_queue_depth", "Requests of one API key queued for a slot.",
                                  labels=["key"])
        admitted = CounterMetricFamily(PREFIX + "key_admitted", "Requests of one API key that got a slot.",
                                       labels=["key"])
        rejected = CounterMetricFamily(PREFIX + "key_rejected", "Requests of one API key refused with 429.",
                                       labels=["key"])
        for key, (queued, n_admitted, n_rejected) in self.counts().items():
            label = [key_label(key)]
            depth.add_metric(label, queued)
            admitted.add_metric(label, n_admitted)
            rejected.add_metric(label, n_rejected)
        yield from (depth, admitted, rejected)


class _MemoryCollector:
    """draftwise:memory_limit_bytes, memory_rss_bytes (server + engine, last measured), memory_rss_peak_bytes,
    memory_admission_holds (times admission waited because the RSS was near the ceiling)."""

    def __init__(self, guard):
        self.guard = guard

    def describe(self):
        return []

    def collect(self):
        g = self.guard
        yield GaugeMetricFamily(PREFIX + "memory_limit_bytes", "The server's memory ceiling (--memory-limit).",
                                value=g.limit)
        yield GaugeMetricFamily(PREFIX + "memory_rss_bytes", "RSS of the server and engine processes, last "
                                "measured.", value=g.rss())
        yield GaugeMetricFamily(PREFIX + "memory_rss_peak_bytes", "Highest RSS measured.", value=g.peak_rss)
        yield CounterMetricFamily(PREFIX + "memory_admission_holds", "Admission checks that held a request back "
                                  "because the RSS was near the ceiling.", value=g.holds_count)


def _advance_by_label(counter, model: str, seen: dict, counts: dict, labels) -> None:
    """`counter` advanced, per key of `counts` (labelled by labels(key)), by what the count gained since `seen`."""
    for key, now in counts.items():
        if now > seen.get(key, 0):
            counter.labels(model, *labels(key)).inc(now - seen.get(key, 0))
            seen[key] = now


def _advance(counters: dict, seen: dict, source) -> None:
    """Each counter advanced by what `source`'s attribute of the same name gained since `seen` (updated)."""
    for f, c in counters.items():
        now = int(getattr(source, f))
        if now > seen[f]:
            c.inc(now - seen[f])
            seen[f] = now

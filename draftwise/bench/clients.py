"""Clients: run one batch of benchmark requests under one condition and time each request.

Two implementations of one small interface (`prepare`, `run_batch`, `manifest`, `memory`):
  - InProcessClient drives draftwise's engine directly: one target model in memory, one proposer per
    method (built once, with the largest k of the sweep), switched between conditions; a batch of C requests
    is submitted together and the engine stepped until all finish (continuous batching), so concurrency C
    is real. Times come from the engine's Request (arrival → first token → finish), the definitions in docs/ARCHITECTURE.md.
    Every request arrives new: its prompt is forgotten by the prefix caches, and each batch gets its own
    suffix-cache scope, so method suffix never guesses from the output of the same prompt run in another condition
    or concurrency level (it would accept nearly every guess: a benchmark artefact, not a speed-up).
  - HTTPClient talks to any OpenAI-compatible server (`/v1/completions`, `/v1/chat/completions`) with
    streaming SSE: TTFT is the first chunk carrying text. A stream that ends with an `error` event (or a body
    holding an `error` object, even with HTTP 200) is an error, never a success. Acceptance comes from the server's /metrics,
    read before and after each batch, when it exposes vLLM's `vllm:spec_decode_*` counters (vLLM
    v1/spec_decode/metrics.py) or ours (`draftwise:spec_decode_*`, same names).
Multi-turn items (MT-Bench `turns`) are answered turn by turn with the model's own previous answers.
Knows nothing of conditions' order, statistics or files.
"""
from __future__ import annotations

import itertools
import json
import re
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from draftwise.config import ConfigError
from draftwise.bench.workloads import Item


@dataclass
class Condition:
    """One arm of the comparison: a speculation method and k (or a named endpoint)."""

    method: str = "none"
    k: int | str = 0  # guesses per step, or "auto" (the engine's cost-model policy)
    draft: str | None = None
    endpoint: str | None = None  # HTTP mode: the server that runs this condition
    label: str | None = None
    engine: str | None = None  # None: draftwise's own; "vllm": a vLLM server per condition (bench/vllm.py)
    draft_weights: str | None = None  # the draft's --weights when the sweep varies it (None: the client's default)

    @property
    def id(self) -> str:
        if self.label:
            return self.label
        base = "none" if self.method == "none" else f"{self.method}-k{self.k}"
        base += f"-draft:{self.draft_weights}" if self.draft_weights else ""
        return f"{self.engine}:{base}" if self.engine else base

    def spec_config(self) -> dict | None:
        """The speculative config; "grammar+ngram" / "grammar+draft_model" put the second method in `then`."""
        if self.method == "none":
            return None
        if self.method == "suffix-chain":  # suffix speculation without branches: what the tree adds, measured
            return {"method": "suffix", "num_speculative_tokens": self.k, "suffix_tree": False}
        first, _, then = self.method.partition("+")
        d = {"method": first, "num_speculative_tokens": self.k}
        plan = {"draft_weights": self.draft_weights} if self.draft_weights else {}
        if then:
            d["then"] = {"method": then, "model": self.draft, **plan} if then == "draft_model" else {"method": then}
        elif self.method == "draft_model":
            d.update(model=self.draft, **plan)
        return d


@dataclass
class Call:
    """One generation call: either a raw prompt or chat messages, and sampling knobs."""

    prompt: str | None
    messages: list[dict] | None
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    structured_outputs: dict | None = None  # vLLM's shape ({"json": schema}); sent as `structured_outputs`


@dataclass
class Result:
    text: str = ""
    num_prompt_tokens: int | None = None
    num_output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    spec: dict | None = None  # per-request counters when the client can attribute them
    error: str | None = None
    tokens_estimated: bool = False  # HTTP without usage: counted SSE chunks

    def to_dict(self) -> dict:
        return asdict(self)


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def run_items(run_calls, items: list[Item], calls: list[Call]) -> list[Result]:
    """Run a batch; items with `turns` go turn by turn (each turn batched with the other items' same turn)."""
    convs = [list(it.messages) if it.turns is None and it.messages else [] for it in items]
    n_turns = [len(it.turns) if it.turns else 1 for it in items]
    merged: list[Result | None] = [None] * len(items)
    for t in range(max(n_turns)):
        idx = [i for i in range(len(items)) if t < n_turns[i]]
        batch = []
        for i in idx:
            c = calls[i]
            if items[i].turns:
                convs[i].append({"role": "user", "content": items[i].turns[t]})
                batch.append(Call(None, list(convs[i]), c.max_tokens, c.temperature, c.top_p, c.seed, c.stop,
                                  c.structured_outputs))
            else:
                batch.append(c)
        for i, r in zip(idx, run_calls(batch)):
            if items[i].turns:
                convs[i].append({"role": "assistant", "content": r.text})
            merged[i] = r if merged[i] is None else _join(merged[i], r)
    return merged


def _join(a: Result, b: Result) -> Result:
    """A conversation's figures: TTFT of its first turn, sums of latency and tokens, texts joined."""
    spec_stats = None
    if a.spec and b.spec:
        spec_stats = {k: a.spec.get(k, 0) + b.spec.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        pa, pb = a.spec.get("accepted_per_position", []), b.spec.get("accepted_per_position", [])
        spec_stats["accepted_per_position"] = [x + y for x, y in zip(pa + [0] * (len(pb) - len(pa)), pb + [0] * (len(pa) - len(pb)))]
    return Result(a.text + "\n\n" + b.text, a.num_prompt_tokens, a.num_output_tokens + b.num_output_tokens, a.ttft_s,
                  (a.e2e_s or 0) + (b.e2e_s or 0), b.finish_reason, None, spec_stats, a.error or b.error,
                  a.tokens_estimated or b.tokens_estimated)


# ---- in-process -----------------------------------------------------------------------------------
class InProcessClient:
    """Drive a draftwise LLM's engine; conditions share the target weights and switch speculation through
    `LLM.set_speculation` (each proposer built once, the draft loaded once). The LLM must have been built
    with a look-ahead (`k_max`) covering the largest k of the conditions."""

    def __init__(self, llm, draft: str | None = None, draft_dtype: str | None = None, draft_weights: str | None = None):
        self.llm = llm
        self.draft, self.draft_dtype, self.draft_weights = draft, draft_dtype, draft_weights
        self._batches = itertools.count()  # each batch's suffix-cache scope (_run_calls)

    @property
    def draft_info(self) -> dict | None:
        return self.llm.draft_info

    def prepare(self, conditions: list[Condition]) -> None:
        """Build every condition's proposer up front (loading the draft model once), so no batch pays for it."""
        for c in conditions:
            self.llm.set_speculation(self._spec_config(c))
        self.llm.set_speculation(self._spec_config(conditions[0]))

    def _spec_config(self, condition: Condition) -> dict | None:
        d = condition.spec_config()
        for part in (d, (d or {}).get("then")):
            if part and part["method"] == "draft_model":
                part["model"] = part.get("model") or self.draft
                if not part["model"]:
                    raise ConfigError("method draft_model needs a draft model (--draft)")
                # a condition's own draft_weights (a sweep over the draft's plan) wins over the client's
                part.update(draft_dtype=self.draft_dtype, draft_weights=part.get("draft_weights") or self.draft_weights)
                for k in [k for k, v in part.items() if v is None]:
                    del part[k]
        return d

    def run_batch(self, condition: Condition, items: list[Item], calls: list[Call]) -> tuple[list[Result], dict]:
        self.llm.set_speculation(self._spec_config(condition))  # between batches the engine is idle
        return run_items(self._run_calls, items, calls), {}

    def _run_calls(self, calls: list[Call]) -> list[Result]:
        from draftwise.sampling import SamplingParams

        llm, pairs = self.llm, []
        for c in calls:
            prompt = c.prompt if c.messages is None else {"prompt_token_ids": llm.tokenizer.encode_chat(c.messages)}
            params = SamplingParams(temperature=c.temperature, top_p=c.top_p, max_tokens=c.max_tokens, seed=c.seed,
                                    stop=c.stop, structured_outputs=c.structured_outputs)
            pairs.append(llm.new_request(prompt, params))
        for cache in llm.prefix_caches().values():  # every request arrives new: it reuses only what it shares
            for req, _ in pairs:  # with other prompts (a system prompt), never its own run in another condition
                cache.forget(req.prompt_ids)
        scope = f"bench-batch-{next(self._batches)}"  # nor guesses from its own output in another condition or
        for req, _ in pairs:  # concurrency level (method suffix's cache of earlier outputs; one engine runs them all)
            req.cache_scope = scope
        start = time.perf_counter()
        for req, _ in pairs:
            req.arrival_time = start  # the batch arrives at once
        llm.run([req for req, _ in pairs])
        return [self._result(req, stream) for req, stream in pairs]

    @staticmethod
    def _result(req, stream) -> Result:
        stream.finish()
        return Result(text=stream.text, num_prompt_tokens=len(req.prompt_ids), num_output_tokens=len(req.output_ids),
                      ttft_s=req.first_token_time - req.arrival_time if req.first_token_time else None,
                      e2e_s=req.finish_time - req.arrival_time if req.finish_time else None,
                      finish_reason=req.finish_reason, token_ids=list(req.output_ids),
                      spec=req.spec_stats.to_dict(), error=req.error)

    def identity(self) -> dict:
        """What must not change between a run and its resumption (protocol.json)."""
        c = self.llm.config
        return {"model": c.model, "dtype": c.dtype, "weights": c.weights, "device": c.device, "threads": c.threads,
                "max_model_len": self.llm.max_model_len, "max_num_seqs": c.max_num_seqs,
                "draft": self.draft, "draft_dtype": self.draft_dtype, "draft_weights": self.draft_weights,
                "prefix_caching": "target" in self.llm.prefix_caches()}

    def manifest(self) -> dict:
        llm = self.llm
        g = llm.thread_guard  # a guard that changed the thread count mid-run says so here
        return {"mode": "in-process", "target": llm.model_info, "draft": self.draft_info,
                "max_model_len": llm.max_model_len, "max_num_seqs": llm.config.max_num_seqs,
                "device": llm.config.device, "seed": llm.config.seed,
                "thread_guard": None if g is None else {"requested": g.requested, "threads": g.threads,
                                                        "changes": g.changes},
                "prefix_caches": {name: {"queried_tokens": pc.queries, "reused_tokens": pc.hits, "entries": len(pc),
                                         "bytes": pc.nbytes} for name, pc in llm.prefix_caches().items()},
                "prefix_cache_policy": "each request's own prompt forgotten before it runs: only prefixes shared "
                                       "with other prompts are reused"}

    def memory(self) -> dict:
        out = {"peak_rss_bytes": peak_rss_bytes()}
        if self.llm.config.device == "cuda":
            import torch

            out["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
        return out


# ---- OpenAI-compatible HTTP ---------------------------------------------------------------------------
SPEC_PREFIXES = ("vllm:spec_decode_", "draftwise:spec_decode_")
MAX_STOP = 4  # stop strings an OpenAI-compatible server accepts per request (OpenAI's limit; vLLM enforces it)
_METRIC_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)')


def parse_spec_metrics(text: str) -> dict | None:
    """Spec-decode counters from Prometheus text: totals and accepted-per-position; None when absent."""
    totals = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    found = False
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        prefix = next((p for p in SPEC_PREFIXES if name.startswith(p)), None)
        if prefix is None or name.endswith("_created"):
            continue
        field_name = name[len(prefix):].removesuffix("_total")
        if field_name == "num_accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
                found = True
        elif field_name in totals:
            totals[field_name] += value
            found = True
    if not found:
        return None
    totals["accepted_per_position"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else []
    return totals


def parse_rss(text: str) -> float | None:
    m = re.search(r"^process_resident_memory_bytes\s+([0-9.eE+]+)", text, re.M)
    return float(m.group(1)) if m else None


def spec_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    d = {k: int(round(after[k] - before[k])) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    pa, pb = after["accepted_per_position"], before["accepted_per_position"]
    d["accepted_per_position"] = [int(round(a - (pb[i] if i < len(pb) else 0))) for i, a in enumerate(pa)]
    return d


class HTTPClient:
    """An OpenAI-compatible server per condition (`--endpoint [LABEL=]URL`), timed from the client side."""

    def __init__(self, api_key: str | None = None, model: str | None = None, timeout_s: float = 600.0, transport=None,
                 return_token_ids: bool = False):
        import httpx

        self.return_token_ids = return_token_ids  # vLLM's `return_token_ids`: outputs compared token for token

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=timeout_s, transport=transport)
        # without a key of the user's, each batch sends one of its own: a server that scopes its suffix cache by key
        # (draftwise serve's default) then never guesses a prompt from its warm-up's or another batch's output
        self._batch_keys = None if api_key else itertools.count()
        self.model = model
        self._models: dict[str, str] = {}
        self._rss: dict[str, float] = {}

    @staticmethod
    def base(url: str) -> str:
        url = url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url

    def prepare(self, conditions: list[Condition]) -> None:
        for c in conditions:
            base = self.base(c.endpoint)
            if self.model:
                self._models[base] = self.model
                continue
            try:
                r = self.http.get(base + "/v1/models")
                r.raise_for_status()
                self._models[base] = r.json()["data"][0]["id"]
            except Exception as e:  # noqa: BLE001 — any failure here means the endpoint is unusable
                raise ConfigError(f"endpoint {c.endpoint}: cannot list models ({e}); pass --served-model") from None

    def _metrics(self, base: str) -> str | None:
        try:
            r = self.http.get(base + "/metrics")
            return r.text if r.status_code == 200 else None
        except Exception:  # noqa: BLE001 — /metrics is optional
            return None

    def run_batch(self, condition: Condition, items: list[Item], calls: list[Call]) -> tuple[list[Result], dict]:
        base = self.base(condition.endpoint)
        before = self._metrics(base)
        results = run_items(lambda cs: self._run_calls(base, cs), items, calls)
        after = self._metrics(base)
        extra = {}
        delta = spec_delta(parse_spec_metrics(before or ""), parse_spec_metrics(after or ""))
        if delta is not None:
            extra["batch_spec"] = delta
        rss = parse_rss(after or "")
        if rss:
            self._rss[condition.id] = max(rss, self._rss.get(condition.id, 0))
            extra["server_rss_bytes"] = rss
        return results, extra

    def _run_calls(self, base: str, calls: list[Call]) -> list[Result]:
        key = None if self._batch_keys is None else {"Authorization": f"Bearer bench-batch-{next(self._batch_keys)}"}
        if len(calls) == 1:
            return [self._stream(base, calls[0], key)]
        with ThreadPoolExecutor(len(calls)) as pool:
            return list(pool.map(lambda c: self._stream(base, c, key), calls))

    def _stream(self, base: str, call: Call, headers: dict | None = None) -> Result:
        chat = call.messages is not None
        body = {"model": self._models[base], "max_tokens": call.max_tokens, "temperature": call.temperature,
                "top_p": call.top_p, "stream": True, "stream_options": {"include_usage": True}}
        if call.seed is not None:
            body["seed"] = call.seed
        if self.return_token_ids:
            body["return_token_ids"] = True
        if call.stop:
            body["stop"] = call.stop[:MAX_STOP]  # the rest is cut here, after the stream (OpenAI and vLLM take 4)
        body.update({"messages": call.messages} if chat else {"prompt": call.prompt})
        if call.structured_outputs:
            body["structured_outputs"] = call.structured_outputs  # vLLM's field; draftwise serve takes it too
        url = base + ("/v1/chat/completions" if chat else "/v1/completions")
        res, _, _ = stream_sse(self.http, url, body, chat, request_headers=headers)
        ids = res.token_ids or []
        res.token_ids = None
        cut = min((i for i in (res.text.find(x) for x in call.stop[MAX_STOP:]) if i >= 0), default=-1)
        if cut >= 0:  # a stop string beyond the server's limit: the text ends there, as the engine's would
            res.text, res.finish_reason, ids = res.text[:cut], "stop", []  # ids past the cut are unknown here
        if self.return_token_ids and ids:
            res.token_ids = ids
        return res

    def identity(self) -> dict:
        return {"endpoints": sorted(self._models) or None, "model": self.model}

    def manifest(self) -> dict:
        return {"mode": "endpoint", "endpoints": {b: m for b, m in self._models.items()}}

    def memory(self) -> dict:
        out = {"client_peak_rss_bytes": peak_rss_bytes()}
        if self._rss:
            out["server_rss_bytes_by_condition"] = dict(self._rss)
        return out


def stream_sse(http, url: str, body: dict, chat: bool = False, on_text=None,
               request_headers: dict | None = None) -> tuple[Result, int | None, dict]:
    """POST `body` to `url` as a stream (`stream: true` is set) and read its server-sent events: (Result, HTTP status
    or None when the request failed before one, the response headers). The one SSE reader of the bench, the
    scripts and the server tests. A stream that ends with an `error` event (or finish_reason "error"), a non-200
    status, or a whole JSON body holding an `error` object is an error (Result.error), never a success; the text
    and finish reason received before it are kept. `on_text(text)`: called per chunk that carries text (progress);
    `chat`: the text is in choices[].delta.content; `request_headers`: this request's own, beside the client's.
    Token ids (vLLM's `return_token_ids`) land in Result.token_ids; output tokens are counted from usage when the
    server sends it, else from the chunks (tokens_estimated)."""
    res, chunks, parts, ids = Result(), 0, [], []
    status, headers = None, {}
    t0 = time.perf_counter()
    try:
        with http.stream("POST", url, json=dict(body, stream=True), headers=request_headers) as r:
            status, headers = r.status_code, dict(r.headers)
            if r.status_code != 200:
                r.read()
                return Result(error=f"HTTP {r.status_code}: {r.text[:300]}", e2e_s=time.perf_counter() - t0), \
                    status, headers
            if r.headers.get("content-type", "").startswith("application/json"):
                r.read()  # a whole JSON body instead of a stream: an error object, or one full completion
                return _body_result(r.json(), chat, time.perf_counter() - t0), status, headers
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):  # the server failed mid-stream: an error, whatever came before it
                    res.error = f"stream error: {_error_message(obj['error'])}"
                    break
                if obj.get("usage"):
                    res.num_prompt_tokens = obj["usage"].get("prompt_tokens")
                    res.num_output_tokens = obj["usage"].get("completion_tokens") or 0
                for ch in obj.get("choices") or []:
                    ids += ch.get("token_ids") or []
                    text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                    if text:
                        if res.ttft_s is None:
                            res.ttft_s = time.perf_counter() - t0
                        parts.append(text)
                        chunks += 1
                        if on_text is not None:
                            on_text(text)
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
            if res.finish_reason == "error" and res.error is None:
                res.error = "stream error: finish_reason error"
    except Exception as e:  # noqa: BLE001 — a failed request is recorded, not fatal to the run
        res.error = f"{type(e).__name__}: {e}"
    res.e2e_s = time.perf_counter() - t0
    res.text = "".join(parts)
    res.token_ids = ids or None
    if not res.num_output_tokens and chunks:
        res.num_output_tokens, res.tokens_estimated = chunks, True
    return res, status, headers


def _error_message(err) -> str:
    """The message of an OpenAI-style error object ({"message": ...}) or whatever else the server sent."""
    return str(err.get("message") or err) if isinstance(err, dict) else str(err)


def _body_result(obj: dict, chat: bool, e2e_s: float) -> Result:
    """A non-stream response body: an `error` object is an error even with HTTP 200; otherwise one completion."""
    if not isinstance(obj, dict) or obj.get("error"):
        return Result(error=f"body error: {_error_message(obj.get('error') if isinstance(obj, dict) else obj)}",
                      e2e_s=e2e_s)
    choice = (obj.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    usage = obj.get("usage") or {}
    reason = choice.get("finish_reason")
    return Result(text=text or "", num_prompt_tokens=usage.get("prompt_tokens"),
                  num_output_tokens=usage.get("completion_tokens") or 0, e2e_s=e2e_s, finish_reason=reason,
                  error="body error: finish_reason error" if reason == "error" else None)

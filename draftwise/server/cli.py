"""`draftwise serve`: start the engine process (it loads the model), listen at once (boot.py: /health says
"starting" until the model is loaded), then serve the app.

Owns the serve flags and the one environment read of the server (DRAFTWISE_API_KEY, when --api-key is not
given); everything below receives plain values.
"""
from __future__ import annotations

import argparse
import functools
import os

from draftwise.cli_args import SIZE_HELP, add_model_args, arg_type, llm_from_args
from draftwise.config import ConfigError
from draftwise.server import limits as L
from draftwise.server.memory_limit import limit_arg

API_KEY_ENV = "DRAFTWISE_API_KEY"
SERVER_NICE = 0  # --server-nice default (docs/PERFORMANCE.md: the server beside a 2-thread engine on 2 cores)


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: local only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (or set ${API_KEY_ENV})")
    p.add_argument("--suffix-cache-scope", default="key", choices=["key", "global"],
                   help="method suffix: whose earlier outputs may guess a request — 'key': only its own API key's "
                        "(default; acceptance timing would otherwise tell one tenant what another generated), "
                        "'global': every request's (opt in where all clients are one tenant)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--server-nice", type=int, default=SERVER_NICE,
                   help="nice increment of the HTTP process once the engine process has started (which keeps its "
                        "priority): with as many cores as engine threads, the server's per-step work (text, SSE) "
                        "then yields to the engine's threads instead of stretching their steps; 0 = same priority "
                        "(default: %(default)s)")
    p.add_argument("--engine", default="draftwise", choices=["draftwise", "vllm"],
                   help="vllm: run a vLLM server instead (our flags translated; `make vllm` installs it)")
    p.add_argument("--vllm", default=None, metavar="PYTHON",
                   help="--engine vllm: the python of vLLM's environment (default: $DRAFTWISE_VLLM, else .venv-vllm)")
    p.add_argument("vllm_args", nargs="*", metavar="-- VLLM_ARG",
                   help="--engine vllm: arguments after `--` go to `vllm serve` untouched")
    g = p.add_argument_group("limits (docs/server.md: Running it safely)")
    d = L.RequestLimits()
    g.add_argument("--max-body-bytes", type=int, default=L.DEFAULT_MAX_BODY_BYTES,
                   help="largest request body accepted, 413 above (default: %(default)s)")
    g.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                   help="prompt characters (all message contents for chat), checked before tokenizing (default: "
                        "%(default)s)")
    g.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                   help="entries in `stop` (default: %(default)s)")
    g.add_argument("--max-stop-length", type=int, default=d.max_stop_length,
                   help="characters in one stop string (default: %(default)s)")
    g.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids,
                   help="entries in `stop_token_ids` (default: %(default)s)")
    g.add_argument("--max-json-depth", type=int, default=d.max_json_depth,
                   help="nesting of objects and arrays in a request body (default: %(default)s)")
    g.add_argument("--max-waiting", type=int, default=L.DEFAULT_MAX_WAITING,
                   help="requests queued beyond the --max-num-seqs slots; 429 with Retry-After above "
                        "(default: %(default)s)")
    g.add_argument("--max-queued-per-key", type=int, default=None,
                   help="requests one API key (anonymous requests: one key) may have queued for a slot; 429 with "
                        "a Retry-After from its queue above. Keys are served round-robin (default: --max-waiting)")
    g.add_argument("--max-running-per-key", type=int, default=None,
                   help="requests of one API key decoded at once; more wait in its queue (default: --max-num-seqs)")
    g.add_argument("--request-timeout", type=float, default=L.DEFAULT_REQUEST_TIMEOUT_S,
                   help="seconds a request may take, queueing included; then it is aborted (504, or an error "
                        "event and [DONE] on a stream) (default: %(default)s)")
    g.add_argument("--shutdown-timeout", type=float, default=L.DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM: 503 for new requests, this many seconds for those in flight, then each "
                        "remaining stream ends with an error event and [DONE] (default: %(default)s)")
    g.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names accepted ('*' = any; default: localhost, 127.0.0.1, ::1 and "
                        "--host)")
    g.add_argument("--allowed-origins", default=None,
                   help="comma-separated browser origins allowed cross-origin (CORS; '*' = any; default: none)")
    g.add_argument("--memory-limit", default="auto", type=arg_type(limit_arg),
                   help="memory ceiling for the server and its engine: a size (8GiB, 6000MiB, 8GB; " + SIZE_HELP +
                        "), 'auto' (the cgroup's "
                        "limit, else the RAM available at start) or 'none'. The K/V pool (--kv-cache-memory) is "
                        "capped so `draftwise memory --rss`'s predicted peak stays under it, and admission holds new "
                        "requests while the measured RSS is near it (they queue; 429 with Retry-After once the "
                        "queue is full) (default: %(default)s)")
    r = p.add_argument_group("supervision (the engine process restarted under the server)")
    r.add_argument("--max-restarts", type=int, default=10,
                   help="engine process deaths within --restart-window that are answered with a restart (what "
                        "was in flight is replayed); one more and the server answers 503 naming the cause; 0 = "
                        "never restart (default: %(default)s)")
    r.add_argument("--restart-window", type=float, default=300.0,
                   help="seconds over which --max-restarts counts deaths (default: %(default)s)")
    r.add_argument("--engine-standby", default=True, action=argparse.BooleanOptionalAction,
                   help="keep a standby engine process with the model loaded (idle: ~0.4 GB RSS for the 1.5B, "
                        "the weights' pages are shared; set aside under --memory-limit), so a restart only tells it "
                        "to go (default: on)")
    p.set_defaults(func=cmd_serve)


def resolve_api_key(flag: str | None, environ) -> str | None:
    """--api-key wins; else $DRAFTWISE_API_KEY; an empty value means no key."""
    return flag or environ.get(API_KEY_ENV) or None


def cmd_serve(args) -> int:
    if args.engine == "vllm":
        from draftwise.bench import vllm

        return vllm.serve(args, resolve_api_key(args.api_key, os.environ))
    if args.vllm_args:
        raise ConfigError(f"arguments after `--` ({' '.join(args.vllm_args)}) are for --engine vllm")
    from draftwise.server.engine_host import EngineProcess

    guard = memory_ceiling(args)  # before the engine starts: it may cap args.kv_cache_memory
    # the engine in its own process: it loads the model there and steps it without sharing a GIL with HTTP;
    # started first, so its imports and loading overlap this process's
    engine = EngineProcess(functools.partial(llm_from_args, args))
    lower_priority(args.server_nice)  # after the child started: it keeps the priority it was born with
    from draftwise.server.app import create_app
    from draftwise.server.boot import BootApp
    from draftwise.server.guard import LOOPBACK_HOSTS
    from draftwise.server.runner import RestartPolicy
    from draftwise.server.shutdown import serve

    api_key = resolve_api_key(args.api_key, os.environ)
    limits = L.RequestLimits(max_stop_strings=args.max_stop_strings, max_stop_length=args.max_stop_length,
                             max_stop_token_ids=args.max_stop_token_ids, max_prompt_chars=args.max_prompt_chars,
                             max_json_depth=args.max_json_depth)

    def make_app():  # once the engine has loaded its model (boot.BootApp calls it)
        return create_app(engine, args.served_model_name or args.model, api_key=api_key,
                          max_body_bytes=args.max_body_bytes, limits=limits, max_waiting=args.max_waiting,
                          request_timeout=args.request_timeout or None,
                          allowed_hosts=allowed_hosts(args.allowed_hosts, args.host, LOOPBACK_HOSTS),
                          allowed_origins=_split(args.allowed_origins), suffix_cache_scope=args.suffix_cache_scope,
                          max_queued_per_key=args.max_queued_per_key, max_running_per_key=args.max_running_per_key,
                          restart_policy=RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window,
                                                       standby=args.engine_standby),
                          memory_guard=guard)

    def ready(app):
        llm = app.state.front
        print(f"draftwise: serving {args.model!r} on http://{args.host}:{args.port}/v1 "
              f"(speculation: {llm.spec_config.method}, max_num_seqs {args.max_num_seqs}, context "
              f"{llm.max_model_len}, api key {'required' if api_key else 'off'}); loaded in {llm.load_time_s:.1f}s "
              f"(engine process {engine.pid} ready after {engine.start_s:.1f}s)", flush=True)
        print("\n".join(llm.plan_lines), flush=True)

    # listening at once: /health says "starting" (503, Retry-After) until the engine has loaded its model
    boot = BootApp(lambda: engine.front, make_app, on_ready=ready, abandon=engine.kill)
    print(f"draftwise: listening on http://{args.host}:{args.port} (loading the model: /health is 503 "
          f"\"starting\" until it is ready)", flush=True)
    serve(boot, args.host, args.port, args.shutdown_timeout, log_level=args.log_level)
    if boot.failed is not None:
        raise boot.failed if isinstance(boot.failed, ConfigError) else ConfigError(str(boot.failed))
    return 0


def memory_ceiling(args):
    """--memory-limit: the MemoryGuard admission asks (None: no ceiling), after capping args.kv_cache_memory so
    the predicted peak RSS (bench/memory.predict_peak_rss: one full prefill chunk, K/V of target and draft; plus
    this process's RSS measured now and what serving adds to it, the standby engine, the allocator's retained
    heap) fits under it. A prediction that cannot be made (an uncached model, a path the catalog does not know) leaves the
    pool as asked and keeps the measured-RSS check."""
    from draftwise.config import parse_kv_cache_memory, parse_spec_config
    from draftwise.server import memory_limit as M

    asked_kv = getattr(args, "kv_cache_memory", None)
    if hasattr(asked_kv, "describe"):  # cli_args.ByteSize: the text and the bytes it was read as
        print(f"draftwise: --kv-cache-memory {asked_kv.describe()}", flush=True)
    limit, source = M.resolve_limit(args.memory_limit)
    standby = args.engine_standby and args.max_restarts > 0
    if limit is None:
        print(f"draftwise: no memory ceiling ({source})", flush=True)
        return None
    spec = parse_spec_config(getattr(args, "speculative_config", None))
    try:
        from draftwise.api import PREFILL_CHUNK_TOKENS
        from draftwise.bench.memory import available_memory, predict_peak_rss

        prediction = predict_peak_rss(args.model, spec.model if spec.method == "draft_model" else None,
                                      prompt_tokens=PREFILL_CHUNK_TOKENS, max_tokens=1, concurrency=1,
                                      k=max(1, spec.k_max), kv_cache_dtype=args.kv_cache_dtype)
        asked = parse_kv_cache_memory(args.kv_cache_memory)
        if isinstance(asked, float):  # a fraction of the RAM available
            asked = int(asked * (available_memory()[0] or 0)) or None
    except Exception as e:  # noqa: BLE001 — the ceiling still holds through the measured RSS
        print(f"draftwise: memory limit {limit / 2**30:.2f} GiB ({source}); no prediction ({e}): the K/V pool is "
              f"as asked, admission watches the measured RSS", flush=True)
        return M.MemoryGuard(limit)
    plan = M.plan_kv_memory(limit, prediction, asked, server_bytes=M.server_reserve(M.rss_bytes(os.getpid())),
                            standby_bytes=M.STANDBY_BYTES if standby else 0,
                            heap_bytes=M.retained_heap_bytes())  # ConfigError when the model alone does not fit
    args.kv_cache_memory = plan.kv_cache_memory
    print(f"draftwise: {plan.describe()} ({source})", flush=True)
    return M.MemoryGuard(limit)


def lower_priority(increment: int) -> None:
    """Lower this process's priority by `increment` (nice; never raised: that needs privileges). Linux gives each
    thread its own nice value: call it from the main thread before any other starts (they inherit it)."""
    if increment < 0:
        raise ConfigError(f"--server-nice must be >= 0 (raising a priority needs privileges), got {increment}")
    if increment:
        try:
            os.nice(increment)
        except OSError as e:  # not fatal: the server runs at its priority
            print(f"draftwise: could not lower the server's priority ({e})", flush=True)


def _split(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def allowed_hosts(flag: str | None, bind_host: str, loopback: tuple[str, ...]) -> tuple[str, ...]:
    """--allowed-hosts wins; else the loopback names plus the bound host (unless it is a wildcard address)."""
    if flag:
        return _split(flag)
    return loopback + (() if bind_host in ("0.0.0.0", "::", "") else (bind_host,))

"""Sub-commands of the benchmark lab: `bench`, `tune`, `memory` and `demo` (what `make demo` runs).

Owns their arguments and printing: progress on stderr, the table and verdicts on stdout, and for `bench`
and `tune` the JSON summary as the last stdout line. The work lives in lab.py, tune.py and memory.py, which
keep only pure functions.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from draftwise.bench.workloads import BUILTIN
from draftwise.cli_args import add_model_args, int_list, k_list, llm_from_args, weights_arg
from draftwise.config import DTYPE_CHOICES, ConfigError, parse_spec_config
from draftwise.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET


def add_bench_args(p) -> None:
    add_model_args(p, speculative=False)
    p.add_argument("--workload", default="chat", help=" | ".join(BUILTIN) + " | FILE.jsonl (comma-separated for several)")
    p.add_argument("--turns", default="first", choices=["first", "all"], help="MT-Bench files: first turn, or all")
    p.add_argument("--methods", default="none,ngram,draft_model")
    p.add_argument("--num-speculative-tokens", default="2,4,6",
                   help="comma list of k; 'auto' = the cost-model policy that picks k per step (or plain decoding)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model for method draft_model")
    p.add_argument("--draft-dtype", default=None, choices=list(DTYPE_CHOICES), help="default: the target's --dtype")
    p.add_argument("--draft-weights", default=None, type=weights_list_arg,
                   help="as --weights, for the draft (default auto: the fastest plan, lossy allowed, as a draft's "
                        "precision never changes the output); a comma list (e.g. auto,faithful) sweeps the draft's "
                        "plans as conditions")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--requests", type=int, default=30, help="measured requests per condition and group")
    p.add_argument("--concurrency", default=None, help="e.g. 1,4 (default: each workload's own; longform 1,4)")
    p.add_argument("--max-tokens", type=int, default=None, help="output limit (default: the workload's)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--endpoint", action="append", default=[],
                   help="[LABEL=]URL of an OpenAI-compatible server (repeat; label 'none' = the baseline)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model", default=None, help="model name to send to the endpoint(s)")
    p.add_argument("--watts", type=float, default=None, help="measured average wall power, for energy per request")
    p.add_argument("--price-per-kwh", type=float, default=None)
    p.add_argument("--out", default="bench-out", help="directory for journal and reports (a rerun resumes)")
    p.add_argument("--fresh", action="store_true", help="discard an existing journal in --out")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-humaneval", action="store_true", help="skip running HumanEval completions' tests")
    add_engine_args(p)


def weights_list_arg(text: str) -> list[str]:
    """argparse type of --draft-weights: one --weights value or a comma list of them (a sweep)."""
    return [weights_arg(w.strip()) for w in text.split(",") if w.strip()]


def add_engine_args(p) -> None:
    p.add_argument("--engine", default="draftwise",
                   help="draftwise | vllm | draftwise,vllm: whose engine runs the conditions (vllm: one vLLM server "
                        "per condition, from vLLM's own environment; `make vllm` installs it)")
    p.add_argument("--vllm", default=None, metavar="PYTHON",
                   help="the python of vLLM's environment (default: $DRAFTWISE_VLLM, else .venv-vllm from `make vllm`)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG", dest="vllm_args",
                   help="one more argument for every `vllm serve` started (repeatable, as --vllm-arg=-O0: vLLM "
                        "without graph compilation, quicker to start, slower to run); kept in the report's commands")


def engines_of(text: str) -> list[str]:
    engines = [e.strip() for e in text.split(",") if e.strip()]
    bad = [e for e in engines if e not in ("draftwise", "vllm")]
    if bad or not engines or len(set(engines)) != len(engines):
        raise ConfigError(f"--engine {text!r}: one or both of draftwise, vllm (comma-separated)")
    return engines


def sweep_conditions(args, methods: list[str]):
    """The sweep's conditions for each engine of --engine (vLLM's as `vllm:...`)."""
    from draftwise.bench.lab import conditions_from

    conds = []
    for engine in engines_of(args.engine):
        conds += conditions_from(methods, k_list(args.num_speculative_tokens), args.draft,
                                 None if engine == "draftwise" else engine,
                                 args.draft_weights if engine == "draftwise" else None)
    return conds


def vllm_client(args, conditions):
    from draftwise.bench import vllm

    vinfo = vllm.info(vllm.find_python(args.vllm))
    dtype = args.dtype if args.dtype in ("bfloat16", "float16", "float32") else "bfloat16"
    return vllm.VLLMClient(vinfo, args.model, args.draft, Path(args.out), max_model_len=args.max_model_len or 4096,
                           seed=args.seed, dtype=dtype, extra=args.vllm_args)


def options_from_args(args, conditions):
    from draftwise.bench.lab import BenchOptions
    from draftwise.bench.runner import Sampling
    from draftwise.bench.workloads import load_workload

    workloads = [load_workload(w.strip(), args.turns) for w in args.workload.split(",") if w.strip()]
    sampling = Sampling(args.temperature, args.top_p, args.seed, args.max_tokens)
    return BenchOptions(workloads, conditions, Path(args.out), args.warmup, args.requests,
                        int_list(args.concurrency) if args.concurrency else None, sampling, args.watts,
                        args.price_per_kwh, args.fresh, True, not args.no_plots, not args.no_humaneval)


def endpoint_conditions(endpoints: list[str]):
    from draftwise.bench.clients import Condition

    conds = []
    for i, e in enumerate(endpoints):
        label, _, url = e.rpartition("=") if "=" in e.split("://")[0] else ("", "", e)
        conds.append(Condition(endpoint=url, label=label or ("none" if i == 0 else f"endpoint{i}")))
    if len({c.id for c in conds}) != len(conds):
        raise ConfigError("--endpoint labels must be distinct")
    return conds


def make_client(args, conditions):
    if args.endpoint:
        if engines_of(args.engine) != ["draftwise"]:
            raise ConfigError("--endpoint benchmarks servers you started; --engine vllm starts its own")
        from draftwise.bench.clients import HTTPClient

        return HTTPClient(args.api_key, args.served_model)
    clients = {}
    if any(c.engine == "vllm" for c in conditions):
        clients["vllm"] = vllm_client(args, conditions)  # first: a missing vLLM fails before the model loads
    own = [c for c in conditions if not c.engine]
    if own:
        from draftwise.bench.clients import InProcessClient

        conc = max(int_list(args.concurrency) if args.concurrency else [4 if "longform" in args.workload else 1])
        k_max = max([parse_spec_config(c.spec_config()).k_max for c in own] + [0])
        llm = llm_from_args(args, max_num_seqs=max(conc, 1), speculative_config=None, k_max=k_max)
        one = args.draft_weights[0] if args.draft_weights and len(args.draft_weights) == 1 else None
        clients["draftwise"] = InProcessClient(llm, args.draft, args.draft_dtype, one)  # several: per condition
    if len(clients) == 1:
        return next(iter(clients.values()))
    from draftwise.bench.vllm import EnginesClient

    return EnginesClient(clients)


def cmd_bench(args) -> int:
    from draftwise.bench import report
    from draftwise.bench.lab import run_bench

    if args.endpoint:
        conditions = endpoint_conditions(args.endpoint)
    else:
        conditions = sweep_conditions(args, [m.strip() for m in args.methods.split(",")])
    opts = options_from_args(args, conditions)
    client = make_client(args, conditions)
    rep = run_bench(client, opts)
    print(report.text_table(rep))
    for d in rep["protocol_deviations"]:
        print("note: " + d)
    for cond, line in refused_lines(rep):
        print(f"refused: {cond}: {line}")
    print(f"report: {Path(args.out) / 'report.html'}")
    print(json.dumps(report.summary(rep, Path(args.out))))
    return 0


def cmd_demo(args) -> int:
    """A quick bench on the default pair: few requests (below protocol, marked so), well under 10 minutes."""
    args.workload, args.turns = "chat,code", "first"
    args.methods, args.num_speculative_tokens = "none,ngram,draft_model", "auto"
    args.warmup, args.requests, args.concurrency = 1, args.requests, None
    args.temperature, args.top_p = 0.0, 1.0
    args.endpoint, args.api_key, args.served_model = [], None, None
    args.engine, args.vllm = "draftwise", None
    args.watts, args.price_per_kwh, args.fresh, args.no_plots, args.no_humaneval = None, None, True, False, False
    # target and draft in the kernels the autotuner measures fastest on this machine (--weights/--dtype auto),
    # unless given explicitly
    print(f"draftwise demo: {args.model} with draft {args.draft}; {args.requests} measured requests per condition "
          f"and group, {args.max_tokens} output tokens — below the 5 + 30 protocol, so treat the verdict as a "
          "smoke test; numbers on a shared 2-core machine are noisy.", file=sys.stderr)
    t0 = time.perf_counter()
    rc = cmd_bench(args)
    print(f"demo finished in {time.perf_counter() - t0:.0f} s; full report: {Path(args.out) / 'report.html'}",
          file=sys.stderr)
    return rc


def refused_lines(rep: dict) -> list[tuple[str, str]]:
    """(condition, vLLM's error line) for every condition vLLM refused to serve."""
    m = rep["manifest"]["client"]
    refused = m.get("refused") or (m.get("vllm") or {}).get("refused") or {}
    return sorted(refused.items())


def cmd_tune(args) -> int:
    from draftwise.bench import report as report_mod
    from draftwise.bench.lab import run_bench
    from draftwise.bench.tune import choose, pays_up_to_concurrency, spec_config_for, vllm_line

    engines = engines_of(args.engine)
    if len(engines) != 1:
        raise ConfigError("tune picks one engine's configuration: --engine draftwise or --engine vllm")
    conditions = sweep_conditions(args, ["none"] + [m.strip() for m in args.methods.split(",") if m.strip() != "none"])
    client = make_client(args, conditions)
    rep = run_bench(client, options_from_args(args, conditions))
    print(report_mod.text_table(rep))
    for cond, line in refused_lines(rep):
        print(f"refused: {cond}: {line}")
    pick = choose(rep)
    by_id = {c.id: c for c in conditions}
    for cond, s in sorted(pick["scores"].items(), key=lambda kv: -(kv[1]["score"] or 0)):
        f = {k: "-" if v is None else f"{v:.3f}" for k, v in s.items() if k != "n"}  # None: no paired prompt
        print(f"{cond:18s} median {f['median']}  MAD {f['mad']}  median-MAD {f['score']}  "
              f"95% CI {f['ci_low']}-{f['ci_high']}  n={s['n']}")
    w = by_id.get(pick["winner"])
    spec_config = spec_config_for(w.__dict__ if w else None)
    upto = pays_up_to_concurrency(rep, pick["winner"]) if spec_config else None
    levels = sorted({int(s.rpartition("@c")[2]) for s in rep["segments"] if s.rpartition("@c")[2].isdigit()})
    if spec_config:
        print(f"winner: {pick['winner']}")
        if len(levels) > 1:
            print(f"speculation pays up to concurrency {upto} here (measured {', '.join(map(str, levels))})" if upto
                  else f"speculation does not pay at concurrency {levels[0]} on its own (measured "
                       f"{', '.join(map(str, levels))}): pooled over levels only")
    else:
        print("winner: none — no condition beats plain decoding on a typical prompt; serve without speculation")
    if engines == ["vllm"]:
        # the winning condition's own server command, exactly as it ran (not a translation)
        plain = next(c.id for c in conditions if c.method == "none")
        line = client.commands.get(w.id if w else plain) or client.commands.get(plain)
        print("the vLLM server that produced the winning numbers:")
    else:
        print(f"draftwise serve --model {args.model}"
              + (f" --speculative-config '{json.dumps(spec_config)}'" if spec_config else ""))
        line = vllm_line(args.model, spec_config)
    print(line)
    # the recommendation: the winner's config and up to which concurrency it paid (None: unmeasured or nowhere)
    recommended = {"speculative_config": spec_config, "pays_up_to_concurrency": upto, "concurrency_measured": levels}
    (Path(args.out) / "tune.json").write_text(json.dumps({**pick, **recommended, "vllm": line}, indent=1))
    print(json.dumps({"winner": pick["winner"], **recommended, "vllm": line}))
    return 0


def cmd_memory(args) -> int:
    from draftwise.bench.memory import HEADROOM, available_memory, estimate, format_estimate, format_rss, predict_peak_rss

    if args.rss:  # peak RSS of one run with generate's defaults: measured runtime + predicted weights, K/V
        p = predict_peak_rss(args.model, args.draft, args.prompt_tokens, args.max_tokens, args.concurrency,
                             args.num_speculative_tokens, refresh=args.recalibrate)
        print(json.dumps(p) if args.json else format_rss(p))
        return 0

    e = estimate(args.model, args.draft, args.max_model_len, args.concurrency, args.dtype, args.weights,
                 args.draft_dtype, args.num_speculative_tokens, device=args.device, draft_weights=args.draft_weights)
    if args.device == "cuda":
        e["available_bytes"], e["available_kind"] = available_memory("cuda")
        e["fits"] = e["total_bytes"] <= HEADROOM * e["available_bytes"]
    print(json.dumps(e) if args.json else format_estimate(e))
    if not e["fits"]:
        print("warning: the estimate exceeds 90% of available memory", file=sys.stderr)
    return 0


def register_memory(sub) -> None:
    p = sub.add_parser("memory", help="weights + both KV caches + overhead vs available memory")
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=None)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--concurrency", type=int, default=1, help="KV slots (the engine's --max-num-seqs)")
    p.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES),
                   help="activation dtype, as generate's (auto: what the chosen kernels want)")
    p.add_argument("--draft-dtype", default=None, choices=list(DTYPE_CHOICES))
    p.add_argument("--draft-weights", default=None, type=weights_arg,
                   help="the draft's plan, as speculative-config's draft_weights (default: its own auto, the fastest)")
    p.add_argument("--weights", default="auto", type=weights_arg,
                   help="as generate's; auto: the kernels the autotuner picks here (its cached choice, else measured "
                        "now, a few seconds per model, and cached for the load)")
    p.add_argument("--num-speculative-tokens", type=int, default=8)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rss", action="store_true",
                   help="predict the peak RSS of --concurrency requests of --prompt-tokens + --max-tokens tokens "
                        "(generate's defaults; the runtime baseline is measured once here and cached)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--recalibrate", action="store_true", help="with --rss: measure the runtime baseline again")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_memory)


def register(sub) -> None:
    b = sub.add_parser("bench", help="benchmark speculation vs plain decoding on a workload; ends with a verdict")
    add_bench_args(b)
    b.set_defaults(func=cmd_bench)

    d = sub.add_parser("demo", help="a quick bench on the default target/draft pair (what `make demo` runs)")
    add_bench_args(d)
    d.set_defaults(func=cmd_demo, out="demo-out", requests=3, max_tokens=24)

    t = sub.add_parser("tune", help="sweep methods x num_speculative_tokens; print the winner (also as vLLM)")
    add_bench_args(t)
    t.set_defaults(func=cmd_tune, methods="ngram,draft_model,suffix", num_speculative_tokens="1,2,3,4,5,6,8",
                   out="tune-out")

    register_memory(sub)

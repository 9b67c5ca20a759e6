"""Sub-commands of the benchmark lab: `bench`, `tune`, `memory` and `demo` (what `make demo` runs).

Owns their arguments and printing: progress on stderr, the table and verdicts on stdout, and for `bench`
the JSON summary as the last stdout line. The work lives in lab.py, tune.py and memory.py.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from draftwise.cli import DEFAULT_DRAFT
from draftwise.config import WEIGHT_FORMATS, ConfigError


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"expected comma-separated integers, got {s!r}") from None


def add_bench_args(p) -> None:
    from draftwise.cli import add_model_args

    add_model_args(p, spec=False)
    p.add_argument("--workload", default="chat", help="chat | code | longform | FILE.jsonl (comma-separated for several)")
    p.add_argument("--turns", default="first", choices=["first", "all"], help="MT-Bench files: first turn, or all")
    p.add_argument("--methods", default="none,ngram,draft_model")
    p.add_argument("--num-speculative-tokens", default="2,4,6")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model for method draft_model")
    p.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--draft-weights", default=None, choices=list(WEIGHT_FORMATS))
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


def options_from_args(args, conditions):
    from draftwise.bench.lab import BenchOptions
    from draftwise.bench.runner import Sampling
    from draftwise.bench.workloads import load_workload

    workloads = [load_workload(w.strip(), args.turns) for w in args.workload.split(",") if w.strip()]
    sampling = Sampling(args.temperature, args.top_p, args.seed, args.max_tokens)
    return BenchOptions(workloads, conditions, Path(args.out), args.warmup, args.requests,
                        _ints(args.concurrency) if args.concurrency else None, sampling, args.watts,
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
        from draftwise.bench.clients import HTTPClient

        return HTTPClient(args.api_key, args.served_model)
    from draftwise.bench.clients import InProcessClient
    from draftwise.cli import llm_from_args

    conc = max(_ints(args.concurrency) if args.concurrency else [4 if "longform" in args.workload else 1])
    llm = llm_from_args(args, max_num_seqs=max(conc, 1), speculative_config=None)
    return InProcessClient(llm, args.draft, args.draft_dtype, args.draft_weights)


def cmd_bench(args) -> int:
    from draftwise.bench import report
    from draftwise.bench.lab import conditions_from, run_bench

    if args.endpoint:
        conditions = endpoint_conditions(args.endpoint)
    else:
        conditions = conditions_from([m.strip() for m in args.methods.split(",")], _ints(args.num_speculative_tokens),
                                     args.draft)
    opts = options_from_args(args, conditions)
    rep = run_bench(make_client(args, conditions), opts)
    print(report.text_table(rep))
    for d in rep["protocol_deviations"]:
        print("note: " + d)
    print(f"report: {Path(args.out) / 'report.html'}")
    print(json.dumps(report.summary(rep, Path(args.out))))
    return 0


def cmd_demo(args) -> int:
    """A quick bench on the default pair: few requests (below protocol, marked so), well under 10 minutes."""
    args.workload, args.turns = "chat,code", "first"
    args.methods, args.num_speculative_tokens = "none,ngram,draft_model", "3"
    args.warmup, args.requests, args.concurrency = 1, args.requests, None
    args.temperature, args.top_p = 0.0, 1.0
    args.endpoint, args.api_key, args.served_model = [], None, None
    args.watts, args.price_per_kwh, args.fresh, args.no_plots, args.no_humaneval = None, None, True, False, False
    # the fastest formats measured on this CPU (scripts/compare.py): int4 decode with dense prefill, int4 draft
    args.draft_dtype, args.draft_weights = None, args.draft_weights or "int4"
    print(f"draftwise demo: {args.model} with draft {args.draft}; {args.requests} measured requests per condition "
          f"and group, {args.max_tokens} output tokens — below the 5 + 30 protocol, so treat the verdict as a "
          "smoke test; numbers on a shared 2-core machine are noisy.", file=sys.stderr)
    t0 = time.perf_counter()
    rc = cmd_bench(args)
    print(f"demo finished in {time.perf_counter() - t0:.0f} s; full report: {Path(args.out) / 'report.html'}",
          file=sys.stderr)
    return rc


def register(sub) -> None:
    b = sub.add_parser("bench", help="benchmark speculation vs plain decoding on a workload; ends with a verdict")
    add_bench_args(b)
    b.set_defaults(func=cmd_bench)

    d = sub.add_parser("demo", help="a quick bench on the default target/draft pair (what `make demo` runs)")
    add_bench_args(d)
    d.set_defaults(func=cmd_demo, out="demo-out", requests=3, max_tokens=24, dtype="bfloat16", weights="int4+dense")

    from draftwise.bench import memory, tune

    tune.register(sub, add_bench_args)
    memory.register(sub)

"""Speculation through the server: one `draftwise serve` per method (plain, ngram, draft model, suffix; k auto),
then `draftwise bench --endpoint` against all of them, so each method is measured as a served user sees it (HTTP,
streaming, the engine in its own process) in one interleaved run.

The servers start one at a time (scripts/_server.py's DraftwiseServer: each healthy before the next starts): a server
times its kernels and its step-cost grid while it loads (kernels/autotune.py, kernels/step_cost.py), and servers
loading together time each other's load instead (measured 2026-12-07: chat at 4 clients, the draft model 0.94x plain
with acceptance 0.48 when started together, 1.00x with 0.71 one at a time; docs/PERFORMANCE.md). Every argument after
`--` goes to `draftwise bench`. The servers are stopped when the bench ends, or fails.

    python scripts/bench_served_methods.py -- --workload code,chat --concurrency 4 --requests 30 --out /tmp/served
    python scripts/bench_served_methods.py --methods none,suffix --logs /tmp/logs -- --workload chat --requests 8
    python scripts/bench_served_methods.py --methods none,none -- --workload chat --concurrency 4 --requests 30

A method named again gets a server of its own, labelled with its start position (`none`, `none-2`): two plain servers
measure what two identical servers differ by on this machine, the floor under every served ratio (an A/A check;
2026-12-07: 0.94-1.04x over eleven runs of chat at 4 clients, docs/PERFORMANCE.md).

Not a test: it measures (exit status: the bench's).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _server import ROOT, DraftwiseServer


def spec_config(method: str, draft: str) -> dict | None:
    """The --speculative-config of a method, k auto (None: plain)."""
    if method == "none":
        return None
    if method in ("ngram", "suffix"):
        return {"method": method, "num_speculative_tokens": "auto"}
    if method == "draft_model":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": "auto"}
    raise SystemExit(f"bench_served_methods: unknown method {method!r} (none, ngram, draft_model, suffix)")


def main() -> int:
    argv = sys.argv[1:]
    ours, bench = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="none,ngram,draft_model,suffix")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="the draft model of method draft_model")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--logs", default=None, help="the servers' logs (default: a temporary directory)")
    args = ap.parse_args(ours)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    configs, seen = {}, collections.Counter()  # label -> config; unknown methods refused before anything starts
    for m in methods:
        seen[m] += 1
        configs[m if seen[m] == 1 else f"{m}-{seen[m]}"] = spec_config(m, args.draft)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="served-"))
    logs.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as servers:
        endpoints = []
        for m, cfg in configs.items():
            flags = ["--max-num-seqs", str(args.max_num_seqs), "--no-engine-standby"]
            flags += ["--speculative-config", json.dumps(cfg)] if cfg else []
            print(f"bench_served_methods: starting {m} (log {logs / f'serve_{m}.log'})", file=sys.stderr, flush=True)
            server = servers.enter_context(DraftwiseServer(flags, log=logs / f"serve_{m}.log"))
            endpoints += ["--endpoint", f"{m}={server.url}"]
        cmd = [sys.executable, "-m", "draftwise.cli", "bench", *endpoints, *bench]
        return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode


if __name__ == "__main__":
    sys.exit(main())

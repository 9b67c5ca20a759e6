#!/usr/bin/env python
"""Aggregate output tok/s of the server at concurrency 1, 2 and 4, with and without speculation.

For each --spec (a speculative-config JSON, or "none") it starts `draftwise serve` on a free local port, warms
up, then sends the same prompts (greedy) at each concurrency level and reports aggregate tok/s (all output
tokens / wall time of the level), acceptance from /metrics, the speed-up against the first spec at the same
concurrency, and whether the greedy texts equal the first spec's (they should: speculation is lossless).

    .venv/bin/python scripts/bench_concurrency.py --model qwen2.5-coder-0.5b-instruct \
        --spec none --spec '{"method":"ngram","num_speculative_tokens":3}'

Not a test, and not the bench lab (draftwise/bench does paired statistics and confidence intervals).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import DraftwiseServer  # noqa: E402  (start, /health, /metrics, stop)

# Edit-style prompts: the answer repeats much of the prompt, which is where prompt lookup (ngram) can help.
PROMPTS = [
    "Add type hints to this function and return only the code:\n\ndef area(width, height):\n    return width * height\n",
    "Rename the variable `x` to `count` and return only the code:\n\nx = 0\nfor item in items:\n    if item:\n        x += 1\nprint(x)\n",
    "Add a docstring to this function and return only the code:\n\ndef is_even(n):\n    return n % 2 == 0\n",
    "Convert this loop to a list comprehension and return only the code:\n\nsquares = []\nfor i in range(10):\n    squares.append(i * i)\n",
]


def serve_args(args, spec_config: str) -> list[str]:
    flags = ["--model", args.model, "--max-num-seqs", str(max(args.concurrency)), "--max-model-len",
             str(args.max_model_len), "--dtype", args.dtype, "--log-level", "warning"]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    if args.weights:
        flags += ["--weights", args.weights]
    if spec_config != "none":
        flags += ["--speculative-config", spec_config]
    return flags


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)

    async def one(client, prompt):
        async with sem:
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "temperature": 0}
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            j = r.json()
            return j["choices"][0]["message"]["content"], j["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(client, p) for p in prompts))
        wall = time.perf_counter() - t0
    tokens = sum(n for _, n in outs)
    return {"concurrency": concurrency, "texts": [t for t, _ in outs], "output_tokens": tokens, "wall_s": wall,
            "aggregate_tok_s": tokens / wall}


def bench_spec(args, spec_config: str) -> list[dict]:
    with DraftwiseServer(serve_args(args, spec_config), load_timeout_s=args.startup_timeout) as server:
        url, model = server.url, server.model()
        asyncio.run(run_level(url, model, PROMPTS[:1], 1, 8))  # warm-up
        rows = []
        for c in args.concurrency:
            before = server.spec_counters()
            row = asyncio.run(run_level(url, model, PROMPTS[: args.num_prompts], c, args.max_tokens))
            after = server.spec_counters()
            d = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
            row["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None
            row["mean_acceptance_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None
            row["spec"] = spec_config
            rows.append(row)
            print(f"  [{spec_config}] c={c}: {row['aggregate_tok_s']:.2f} tok/s ({row['output_tokens']} tokens in "
                  f"{row['wall_s']:.1f}s)", flush=True)
        return rows


def report(rows: list[dict], base_spec: str) -> None:
    base = {r["concurrency"]: r for r in rows if r["spec"] == base_spec}
    print(f"\n| speculative config | concurrency | output tokens | wall s | aggregate tok/s | vs {base_spec} | "
          "acceptance rate | mean acceptance length | same greedy text |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = base.get(r["concurrency"])
        speedup = f"{r['aggregate_tok_s'] / b['aggregate_tok_s']:.2f}x" if b else "-"
        same = "yes" if b and b["texts"] == r["texts"] else ("-" if not b else "NO")
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        mal = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        print(f"| {r['spec']} | {r['concurrency']} | {r['output_tokens']} | {r['wall_s']:.1f} | "
              f"{r['aggregate_tok_s']:.2f} | {speedup} | {acc} | {mal} | {same} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--spec", action="append", default=None,
                    help='"none" or a speculative-config JSON (repeatable; the first is the baseline)')
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--num-prompts", type=int, default=4, help="prompts sent at every concurrency level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--json-out", default=None, help="also write the rows (with texts) to this file")
    ap.add_argument("--baseline", default=None,
                    help="a --json-out file of an earlier run whose first spec is the baseline (runs stay short)")
    args = ap.parse_args(argv)
    spec_configs = args.spec or ["none", json.dumps({"method": "ngram", "num_speculative_tokens": 3})]
    if args.num_prompts > len(PROMPTS):
        ap.error(f"--num-prompts at most {len(PROMPTS)}")
    print(f"model {args.model}, {args.num_prompts} prompts x max_tokens {args.max_tokens}, greedy, "
          f"concurrency {args.concurrency}, dtype {args.dtype}, threads {args.threads or 'default'}", flush=True)
    rows = [r for spec_config in spec_configs for r in bench_spec(args, spec_config)]
    earlier = []
    if args.baseline:
        with open(args.baseline) as f:
            earlier = json.load(f)
    report(earlier + rows, (earlier or rows)[0]["spec"])
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

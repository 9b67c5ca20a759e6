"""Speculative decoding speed on the default pair: plain vs n-gram vs draft model at k = 2, 4, 6.

One target load; each condition runs the same prompts one at a time (concurrency 1, greedy, fixed output
length) through the engine with its own proposer. Prints tok/s, speed-up over plain, acceptance rate and
mean acceptance length, per prompt group (code with repeated patterns ("repeated"), HumanEval ("novel"), chat). Not a test.

    .venv/bin/python scripts/bench_spec.py --dtype bfloat16 --per-group 3 --max-tokens 64
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from draftwise import LLM, SamplingParams
from draftwise.bench.workloads import load_workload
from draftwise.engine import Request
from draftwise.spec_decode.stats import SpecStats


def prompt_ids(llm, item) -> list[int]:
    if item.prompt is not None:
        return llm.tokenizer.encode(item.prompt)
    return llm.tokenizer.encode_chat(item.messages or [{"role": "user", "content": item.turns[0]}])


def run(llm, prompts, params):
    """Each prompt alone (concurrency 1) under the LLM's current speculation: tok/s, merged stats, outputs."""
    tokens, elapsed, outs, stats = 0, 0.0, [], SpecStats()
    for ids in prompts:
        req = Request("b", ids, params)
        t0 = time.perf_counter()
        llm.run([req])
        elapsed += time.perf_counter() - t0
        tokens += len(req.output_ids)
        outs.append(req.output_ids)
        stats.merge(req.spec_stats)
    return tokens / elapsed, stats, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--draft-weights", default=None)
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument("--methods", default="ngram,draft_model")
    ap.add_argument("--per-group", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--auto", action="store_true", help="also run num_speculative_tokens=auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    k_values = [int(k) for k in args.ks.split(",")]
    llm = LLM(args.model, dtype=args.dtype, weights=args.weights, max_num_seqs=1, max_model_len=1024,
              k_max=max(k_values + [8 if args.auto else 0]),
              enable_prefix_caching=False)  # the same prompts run under every condition: each prefills whole
    items = {g: [] for g in ("repeated", "novel", "chat")}
    for it in load_workload("code").items + load_workload("chat").items:
        if it.group in items and len(items[it.group]) < args.per_group:
            items[it.group].append(it)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    conds = [("none", None)] + [(m, k) for m in args.methods.split(",") for k in k_values]
    if args.auto:
        conds += [(m, "auto") for m in args.methods.split(",")]
    print(f"target {args.model} ({args.dtype}, weights {args.weights or 'same'}), draft {args.draft}, "
          f"{args.threads} threads, greedy, {args.max_tokens} output tokens, {args.per_group} prompts per group, concurrency 1")
    print(f"{'group':14s} {'method':12s} {'k':>4s} {'tok/s':>7s} {'speedup':>8s} {'accept':>7s} {'mean len':>8s}  same-output")
    for group, its in items.items():
        prompts = [prompt_ids(llm, it) for it in its]
        base = None
        for method, k in conds:
            draft = {"model": args.draft, "draft_weights": args.draft_weights} if method == "draft_model" else {}
            llm.set_speculation({"method": method, "num_speculative_tokens": k,
                                 **{key: v for key, v in draft.items() if v}} if method != "none" else None)
            tps, stats, outs = run(llm, prompts, params)
            if base is None:
                base = (tps, outs)
            d = stats.to_dict()
            acc = d.get("acceptance_rate")
            mal = d.get("mean_acceptance_length")
            fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            print(f"{group:14s} {method:12s} {str(k or 0):>4s} {tps:7.2f} {tps / base[0]:7.2f}x "
                  f"{fmt(acc):>7} {fmt(mal):>8}  "
                  f"{outs == base[1]}" + (f"  k-hist {json.dumps(d['k_histogram'])}" if k == "auto" else ""), flush=True)


if __name__ == "__main__":
    main()

"""Acceptance of the draft model with a trimmed head (`draft_vocab_size`, FR-Spec; spec_decode/draft_model.py) on
the packaged pair: for each head size, greedy speculative decoding with k guesses over the first prompts of the
chat and code_repeated workloads, and the acceptance rate, the mean acceptance length and the head's weights.
Greedy acceptance is deterministic, so this needs no quiet machine (it prints no timings); it loads both models
(a few minutes on 2 cores). Prints the machine probe first, like scripts/verify_cost.py.

    .venv/bin/python scripts/draft_vocab.py --sizes full,65536,32768,16384 --k 4 --max-tokens 64 --prompts 6
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from draftwise import LLM, SamplingParams
from draftwise.api import load_model
from draftwise.kernels.probe import format_probe, probe
from draftwise.spec_decode.stats import SpecStats

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")  # what the rates derive from
DATA = Path(__file__).resolve().parent.parent / "draftwise" / "bench" / "data"


def prompts(tokenizer, name: str, n: int) -> list[dict]:  # the first n of a workload file, as token ids
    out = []
    for line in (DATA / name).read_text().splitlines()[:n]:
        obj = json.loads(line)
        ids = tokenizer.encode_chat(obj["messages"]) if "messages" in obj else tokenizer.encode(obj["prompt"])
        out.append({"prompt_token_ids": ids})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--sizes", default="full,65536,32768,16384", help="draft_vocab_size values; full = none")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=6, help="from each of chat.jsonl and code_repeated.jsonl")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(format_probe(probe()), flush=True)
    target, tok, info = load_model(args.model, "auto", weights="auto")
    draft = load_model(args.draft, "auto", weights="auto")  # loaded once, shared by every head size
    llm = LLM.from_parts(target, tok, name=args.model, dtype=info["dtype"], max_num_seqs=2 * args.prompts,
                         k_max=args.k,
                         load_draft=lambda name, dtype, weights: draft)
    c = draft[0].config
    print(f"target {args.model} ({info['weights']}); draft {args.draft} ({draft[2].get('weights')}, vocab "
          f"{c.vocab_size}, hidden {c.hidden_size}, eos {c.eos_token_ids}); k={args.k}, greedy, "
          f"{args.max_tokens} max tokens", flush=True)
    work = {"chat": prompts(tok, "chat.jsonl", args.prompts),
            "code_repeated": prompts(tok, "code_repeated.jsonl", args.prompts)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(f"{'draft_vocab_size':>16s} {'head params':>12s} {'workload':>14s} {'drafts':>7s} {'acc. rate':>9s} "
          f"{'mean acc. len':>13s} {'output == first size':>20s}")
    first: dict[str, list] = {}  # each workload's token ids under the first size: greedy output never changes
    for size in args.sizes.split(","):
        n = None if size == "full" else int(size)
        llm.set_speculation({"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k,
                             "draft_vocab_size": n})
        head = llm.proposer.head
        rows = c.vocab_size if head is None else head.rows_read
        total = SpecStats()
        for name, ps in work.items():
            stats = SpecStats()
            outs = llm.generate(ps, params)
            for out in outs:
                stats.merge(SpecStats(**{k: out.spec[k] for k in COUNTERS}))
            total.merge(stats)
            ids = first.setdefault(name, [o.outputs[0].token_ids for o in outs])
            same = ids == [o.outputs[0].token_ids for o in outs]
            print(f"{size:>16s} {rows * c.hidden_size:12,d} {name:>14s} {stats.num_drafts:7d} "
                  f"{stats.acceptance_rate:9.3f} {stats.mean_acceptance_length:13.3f} {same!s:>20s}", flush=True)
        print(f"{size:>16s} {rows * c.hidden_size:12,d} {'both':>14s} {total.num_drafts:7d} "
              f"{total.acceptance_rate:9.3f} {total.mean_acceptance_length:13.3f}", flush=True)


if __name__ == "__main__":
    main()

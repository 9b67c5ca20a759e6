"""Decode tok/s of 4 repeated-code prompts answered together, plain and with n-gram speculation, on the packaged 1.5B.

Usage: DW_ROOT=<checkout whose draftwise is timed> python scripts/decode_concurrency.py [CONCURRENCY] [MAX_TOKENS]
The prompts are the code workload's "repeated" group (draftwise/bench/data/code_repeated.jsonl, read from this
checkout so two checkouts time the same text), greedy, ignore_eos, one batched `generate` call per method after a
warm-up call; prints one JSON line: aggregate output tok/s per method and whether the texts equal plain's.
Run two checkouts alternately under the bench lock to compare them (issue 34: concurrency 4 with ngram before/after)."""
import json
import os
import sys
import time

sys.path.insert(0, os.environ["DW_ROOT"])
import torch  # noqa: E402

from draftwise.api import LLM  # noqa: E402
from draftwise.sampling import SamplingParams  # noqa: E402

here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "draftwise", "bench", "data", "code_repeated.jsonl")
concurrency = int(sys.argv[1]) if len(sys.argv) > 1 else 4
max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
with open(here) as f:
    prompts = [json.loads(line)["prompt"] for line in f if line.strip()][:concurrency]
if len(prompts) < concurrency:
    sys.exit(f"{here} has {len(prompts)} prompts, fewer than the concurrency {concurrency}")
out = {"root": os.environ["DW_ROOT"], "threads": torch.get_num_threads(), "concurrency": concurrency,
       "max_tokens": max_tokens, "max_isa": os.environ.get("DRAFTWISE_MAX_ISA", "")}
params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
texts = {}
for method, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4})):
    llm = LLM("qwen2.5-coder-1.5b-instruct", speculative_config=spec, max_num_seqs=concurrency, max_model_len=2048,
              enable_prefix_caching=False, thread_guard=False)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up: plan, threads
    t0 = time.perf_counter()
    res = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    texts[method] = [r.outputs[0].text for r in res]
    n = sum(len(r.outputs[0].token_ids) for r in res)
    out[f"{method}_tok_s"] = round(n / wall, 2)
    del llm
out["ngram_equals_plain"] = texts["ngram"] == texts["plain"]
print(json.dumps(out), flush=True)

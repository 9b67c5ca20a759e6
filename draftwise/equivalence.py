"""`draftwise verify`: evidence that speculation leaves the target's output unchanged for a user's own pair.

(a) Greedy: every prompt decoded with and without speculation; identical, or diverged — and then the target's
top-2 logit margin at the first differing position (a near-tie explains a numeric divergence; a large margin
is a bug). (b) Sampling: the joint distribution of the first three sampled tokens under many seeds, compared by
a chi-square goodness-of-fit test with the target's exact probabilities for those cells (token 1 comes from the
prompt forward; tokens 2 and 3 come from speculative steps, so draft positions 1 and 2 are exercised).
Knows the engine and API; knows no HTTP.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from draftwise.engine import Engine, Request
from draftwise.kv_cache import KVCache
from draftwise.sampling import SamplingParams, process_logits
from draftwise.spec.proposer import NoProposer

DEFAULT_PROMPTS = [
    "def fibonacci(n):",
    "Write a Python function that checks whether a string is a palindrome.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "Explain what a hash map is in two sentences.",
    "import json\n\ndef load_config(path):",
]
ALPHA = 0.01


@dataclass
class GreedyCase:
    prompt: str
    identical: bool
    position: int | None = None  # first differing output position
    margin: float | None = None  # target's top-1 minus top-2 logit there


def run_engine(llm, proposer, k: int, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    eng = Engine(llm.model, proposer, k, llm.config.max_num_seqs, llm.max_model_len,
                 tuple(llm.tokenizer.eos_token_ids), seed=llm.config.seed)
    reqs = [Request(f"v{i}", ids, p) for i, (ids, p) in enumerate(zip(prompt_ids, params))]
    for r in reqs:
        eng.add_request(r)
    while eng.has_unfinished():
        eng.step()
    return [r.output_ids for r in reqs]


def next_logits(model, contexts: list[list[int]]) -> torch.Tensor:  # -> [N, V] float32
    c = model.config
    cache = KVCache(c.num_layers, 1, c.num_kv_heads, max(len(x) for x in contexts) + 1, c.head_dim, model.dtype,
                    model.device)
    rows = []
    for ctx in contexts:
        cache.free(0)
        ids = torch.tensor([ctx], device=model.device)
        pos = torch.arange(len(ctx), device=model.device)[None]
        rows.append(model(ids, pos, cache, torch.tensor([0], device=model.device), last_only=True)[0, -1].float())
    return torch.stack(rows)


def greedy_check(llm, prompts: list[list[int]], texts: list[str], max_tokens: int) -> list[GreedyCase]:
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * len(prompts)
    k = llm.config.speculative.max_speculative_tokens
    spec = run_engine(llm, llm.proposer, k, prompts, params)
    plain = run_engine(llm, NoProposer(), 0, prompts, params)
    cases = []
    for ids, text, a, b in zip(prompts, texts, spec, plain):
        if a == b:
            cases.append(GreedyCase(text, True))
            continue
        pos = next(i for i in range(min(len(a), len(b)) + 1) if i >= min(len(a), len(b)) or a[i] != b[i])
        top2 = next_logits(llm.model, [ids + b[:pos]])[0].topk(2).values
        cases.append(GreedyCase(text, False, pos, float(top2[0] - top2[1])))
    return cases


def sampling_check(llm, prompt_ids: list[int], num_samples: int, params: SamplingParams) -> dict:
    """Chi-square of the first-3-token joint distribution of speculative samples vs exact target probabilities."""
    from scipy.stats import chisquare

    p = params
    k = llm.config.speculative.max_speculative_tokens
    # max_tokens 4: after token 1 the engine may guess 2 tokens, so tokens 2 and 3 come from draft positions 1-2
    seeded = [SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=4, seed=s,
                             ignore_eos=True) for s in range(num_samples)]
    outs = [tuple(o[:3]) for o in run_engine(llm, llm.proposer, k, [prompt_ids] * num_samples, seeded)]
    probs = exact_cells(llm.model, prompt_ids, p, min_expected=5.0 / num_samples)
    observed = [sum(1 for o in outs if o == cell) for cell in probs]
    expected = [q * num_samples for q in probs.values()]
    observed.append(num_samples - sum(observed))
    expected.append(num_samples - sum(expected))
    if expected[-1] < 1e-9:  # the listed cells cover everything: no "other" cell
        observed, expected = observed[:-1], expected[:-1]
    stat, pvalue = chisquare(observed, expected)
    return {"test": "chi-square goodness of fit, joint distribution of the first 3 sampled tokens",
            "samples": num_samples, "cells": len(observed), "statistic": float(stat), "p_value": float(pvalue),
            "alpha": ALPHA, "passed": bool(pvalue > ALPHA),
            "params": {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k}}


def exact_cells(model, prompt_ids: list[int], p: SamplingParams, min_expected: float) -> dict[tuple, float]:
    """Exact probabilities of the 3-token continuations whose probability is at least `min_expected`."""
    proc = lambda logits: process_logits(logits, p.temperature, p.top_k, p.top_p)  # noqa: E731
    cells: dict[tuple, float] = {(): 1.0}
    for _ in range(3):
        prefixes = list(cells)
        dists = proc(next_logits(model, [prompt_ids + list(x) for x in prefixes]))  # [N, V]
        nxt = {}
        for prefix, dist in zip(prefixes, dists):
            mass = cells[prefix]
            for tok in torch.nonzero(dist * mass >= min_expected).flatten().tolist():
                nxt[prefix + (tok,)] = mass * float(dist[tok])
        cells = nxt
    return cells


def cmd_verify(args) -> int:
    from draftwise.cli import llm_from_args

    llm = llm_from_args(args)
    if not llm.config.speculative.enabled:
        from draftwise.config import ConfigError

        raise ConfigError("verify needs --speculative-config (what would it compare?)")
    texts = load_prompts(args.prompts) if args.prompts else DEFAULT_PROMPTS
    prompts = [llm.tokenizer.encode(t) for t in texts]
    cases = greedy_check(llm, prompts, texts, args.max_tokens)
    print(f"(a) greedy: {len(cases)} prompts x {args.max_tokens} tokens, "
          f"{json.dumps(llm.config.speculative.to_dict())} vs plain, dtype {args.dtype}")
    for c in cases:
        verdict = "identical" if c.identical else f"DIVERGED at output token {c.position}, top-2 margin {c.margin:.4f}"
        print(f"  {verdict:60s} {c.prompt[:50]!r}")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    result = sampling_check(llm, prompts[0], args.samples, params)
    print(f"(b) sampling: {result['test']}; {result['samples']} seeds, {result['cells']} cells, "
          f"chi2 = {result['statistic']:.2f}, p = {result['p_value']:.4f}, alpha = {ALPHA} -> "
          f"{'PASS' if result['passed'] else 'FAIL'}")
    greedy_ok = all(c.identical or (c.margin is not None and c.margin < 1e-3) for c in cases)
    summary = {"greedy": [c.__dict__ for c in cases], "sampling": result, "passed": greedy_ok and result["passed"]}
    print(json.dumps(summary))
    return 0 if summary["passed"] else 1


def load_prompts(path: str) -> list[str]:
    from draftwise.config import ConfigError

    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"{path}:{n}: expected a JSON object with a \"prompt\" string") from None
    return out


def register(sub) -> None:
    from draftwise.cli import add_model_args

    v = sub.add_parser("verify", help="check that speculation preserves the target (greedy + sampling)")
    add_model_args(v)
    v.add_argument("--prompts", default=None, help="JSONL file with a \"prompt\" per line")
    v.add_argument("--max-tokens", type=int, default=32)
    v.add_argument("--samples", type=int, default=400, help="seeded samples for the distribution test")
    v.add_argument("--temperature", type=float, default=1.0)
    v.add_argument("--top-p", type=float, default=1.0)
    v.add_argument("--top-k", type=int, default=0)
    v.set_defaults(func=cmd_verify)

"""The checks behind `draftwise verify` (the command lives in cli.py): evidence that speculation leaves the target's output unchanged for a user's own pair.

(a) Greedy: every prompt decoded with and without speculation; identical, or diverged — and then the target's
top-2 logit margin at the first differing position (a near-tie explains a numeric divergence; a large margin
is a bug). (b) Sampling: the joint distribution of the first three sampled tokens under many seeds, compared by
a chi-square goodness-of-fit test with the target's exact probabilities for those cells (token 1 comes from the
prompt forward; tokens 2 and 3 come from speculative steps, so draft positions 1 and 2 are exercised).
Drives an api.LLM (switching its speculation off and back on); knows no HTTP or argv.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from draftwise.kv_cache import KVCache
from draftwise.sampling import SamplingParams, process_logits

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


def run_engine(llm, spec_config, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Output ids of each prompt under `spec_config` (None = plain); the LLM's own config is restored after."""
    before = llm.spec_config
    llm.set_speculation(spec_config)
    try:
        outs = llm.generate(prompt_ids, params)
    finally:
        llm.set_speculation(before)
    return [o.outputs[0].token_ids for o in outs]


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
    speculative = run_engine(llm, llm.spec_config, prompts, params)
    plain = run_engine(llm, None, prompts, params)
    cases = []
    for ids, text, a, b in zip(prompts, texts, speculative, plain):
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
    # max_tokens 4: after token 1 the engine may guess 2 tokens, so tokens 2 and 3 come from draft positions 1-2
    seeded = [SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=4, seed=s,
                             ignore_eos=True) for s in range(num_samples)]
    outs = [tuple(o[:3]) for o in run_engine(llm, llm.spec_config, [prompt_ids] * num_samples, seeded)]
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

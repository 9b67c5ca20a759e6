"""What speculation costs where it is configured but no row guesses: a same-process A/B of decode steps between
plain decoding and an auto-k policy whose every decision is made, then overridden to k = 0 (so both decode the same
tokens, checked), over one LLM (`set_speculation` between blocks; the same KV cache and kernels), interleaved blocks
of `--concurrency` chat prompts. Reports per decode step at the full batch: the step's thread CPU time (one torch
thread, so the forward's work is this thread's), wall time, and the Python around the forward that speculation
adds: the policy's decision (`choose_batch`), its online correction (`observe_step`) and the proposer's
bookkeeping (propose / accept / begin / end). Under load, compare the parts, not the step medians: a forward's
spread is larger than what this measures.

    python scripts/unused_speculation.py --method draft_model --concurrency 4 --rounds 6 --max-tokens 32

A script, not part of the package (nothing under draftwise/ imports it).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from draftwise.api import LLM
from draftwise.bench.workloads import load_workload
from draftwise.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from draftwise.sampling import SamplingParams


class ForcedPlain:
    """The policy decides as it would (its state moves as it would), then every row runs plain."""

    def __init__(self, inner, spent: dict):
        self.inner, self.k_max, self.spent = inner, inner.k_max, spent

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def choose_batch(self, reqs, caps=None):
        t = time.thread_time()
        self.inner.choose_batch(reqs, caps)
        self.spent["choose_batch"] = self.spent.get("choose_batch", 0.0) + time.thread_time() - t
        return [0] * len(reqs)

    def observe_step(self, *args):
        t = time.thread_time()
        self.inner.observe_step(*args)
        self.spent["observe_step"] = self.spent.get("observe_step", 0.0) + time.thread_time() - t


def timed_methods(obj, names, spent: dict) -> None:
    for name in names:
        f = getattr(obj, name)

        def g(*a, _f=f, _n=name, **k):
            t = time.thread_time()
            try:
                return _f(*a, **k)
            finally:
                spent[_n] = spent.get(_n, 0.0) + time.thread_time() - t
        setattr(obj, name, g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="draft_model", choices=["draft_model", "ngram", "suffix"])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = {"method": args.method, "num_speculative_tokens": "auto"}
    if args.method == "draft_model":
        spec["model"] = DEFAULT_DRAFT
    C = args.concurrency
    llm = LLM(DEFAULT_TARGET, speculative_config=spec, max_num_seqs=C, threads=1)
    eng = llm.engine
    prompts = [llm.tokenizer.encode_chat(it.messages) for it in load_workload("chat").items]
    spent: dict[str, float] = {}
    steps: dict[str, list] = {"plain": [], "unused": []}
    current = ["plain"]
    decode = eng._decode_step

    def timed(reqs):
        t0, w0 = time.thread_time(), time.perf_counter()
        out = decode(reqs)
        steps[current[0]].append((len(reqs), time.thread_time() - t0, time.perf_counter() - w0))
        return out
    eng._decode_step = timed

    def run(cond: str, batch) -> list[list[int]]:
        current[0] = cond
        if cond == "plain":
            llm.set_speculation(None)
        else:
            llm.set_speculation(spec)
            if not isinstance(eng.k_policy, ForcedPlain):
                eng.k_policy = ForcedPlain(eng.k_policy, spent)
                timed_methods(eng.proposer, ("propose", "accept", "begin", "end"), spent)
        reqs = [llm.new_request(p, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))[0]
                for p in batch]
        llm.run(reqs)
        return [r.output_ids for r in reqs]

    for cond in steps:  # warm-up
        run(cond, prompts[:C])
    for s in steps.values():
        s.clear()
    spent.clear()
    loads = []
    for rnd in range(args.rounds):
        batch = prompts[(rnd * C) % len(prompts):][:C]
        loads.append(os.getloadavg()[0])
        order = ("plain", "unused") if rnd % 2 == 0 else ("unused", "plain")
        outs = {cond: run(cond, batch) for cond in order}
        assert outs["plain"] == outs["unused"], "speculation forced to k = 0 changed a token"
    for cond, s in steps.items():
        full = [x for x in s if x[0] == C]
        cpu, wall = [x[1] * 1e3 for x in full], [x[2] * 1e3 for x in full]
        print(f"{cond:7s} {len(full)} steps at B = {C}: CPU ms median {statistics.median(cpu):.2f} mean "
              f"{statistics.mean(cpu):.2f}, wall ms median {statistics.median(wall):.2f}")
    n = max(len(steps["unused"]), 1)
    print("speculation's Python a step (ms): " + ", ".join(f"{k} {v * 1e3 / n:.3f}" for k, v in sorted(spent.items())))
    print(f"method {args.method}, load average during the rounds {min(loads):.2f}-{max(loads):.2f}")


if __name__ == "__main__":
    main()

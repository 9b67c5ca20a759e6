"""The thread guard under contention: N copies of the engine generating at once on this machine, each with the
guard on or off (kernels/threads.py); prints each copy's output tok/s (greedy, 3 prompts x 96 tokens, 2 threads
requested). Not a test; the ratio of the two modes is what counts.

    .venv/bin/python scripts/thread_guard.py --processes 2        # both modes, one after the other
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

PROMPTS = ["def quicksort(xs):", "Explain how a hash map works.", "class Stack:"]


def child(model: str, guard: bool, threads: int, max_tokens: int) -> None:
    import torch

    from draftwise import LLM, SamplingParams

    llm = LLM(model, threads=threads, max_num_seqs=1, max_model_len=1024, thread_guard=guard)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0, n = time.perf_counter(), 0
    for p in PROMPTS:
        n += llm.generate([p], params)[0].num_output_tokens
    dt = time.perf_counter() - t0
    g = llm.engine.thread_guard
    print(f"guard {'on' if guard else 'off'}: {n / dt:.1f} tok/s ({n} tokens in {dt:.1f} s), torch threads at the end "
          f"{torch.get_num_threads()}, guard changes {g.changes if g else '-'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model, args.child == "on", args.threads, args.max_tokens)
        return
    from draftwise.kernels.probe import format_probe, probe

    print(format_probe(probe()), flush=True)
    for mode in ("off", "on"):
        print(f"{args.processes} processes at once, guard {mode}:", flush=True)
        procs = [subprocess.Popen([sys.executable, __file__, "--child", mode, "--model", args.model, "--threads",
                                   str(args.threads), "--max-tokens", str(args.max_tokens)]) for _ in range(args.processes)]
        for p in procs:
            p.wait()


if __name__ == "__main__":
    main()

"""Where a decode step's time goes: torch.profiler over plain greedy decoding (not a test).

    .venv/bin/python scripts/profile_decode.py --model qwen2.5-coder-1.5b-instruct --weights int4+dense --tokens 16
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from draftwise import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", default="int4+dense")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=14)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, weights=args.weights, max_num_seqs=1, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": llm.tokenizer.encode("def quicksort(xs):")}
    llm.generate([prompt], params)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = llm.generate([prompt], params)[0]
    wall = time.perf_counter() - t0
    decode = (out.total_s - out.ttft_s) / (out.num_output_tokens - 1)
    print(f"{args.model} {args.dtype}/{args.weights}, {args.threads} threads: {1e3 * decode:.1f} ms per decoded token "
          f"(under the profiler; {wall:.2f} s for {out.num_output_tokens} tokens)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()

"""N concurrent requests with prompts of exactly L tokens on one engine: do they complete, and at what cost.

Usage: python scripts/long_context.py --requests 8 --prompt-tokens 16384 [--max-tokens 16] [--model NAME]
       [--kv-cache-dtype auto] [--kv-cache-memory 4GiB] [--log FILE]
Prompts are bench/workloads.py longprompt_text (distinct seeds: no shared prefix) cut to exactly L tokens, greedy,
prefix cache off. Prints one JSON line: per request TTFT and total seconds, finish reason, output tokens and
preemptions; the pool's blocks (total, most held at once, sampled every 0.5 s), the process's peak RSS
(getrusage) and the K/V dtype. A memory and completion check, not a timing: run it niced, outside the bench lock.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=16384)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--kv-cache-memory", default=None)
    ap.add_argument("--log", default=None, help="also append progress lines to this file")
    args = ap.parse_args()

    from draftwise.api import LLM
    from draftwise.bench.workloads import longprompt_text
    from draftwise.sampling import SamplingParams

    def say(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S', time.gmtime())} UTC] {msg}"
        print(line, file=sys.stderr, flush=True)
        if args.log:
            with open(args.log, "a") as f:
                f.write(line + "\n")

    t0 = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=args.requests, enable_prefix_caching=False,
              kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=args.kv_cache_memory)
    cache = llm.engine.cache
    say(f"loaded in {time.perf_counter() - t0:.1f} s: K/V {llm.kv_cache_dtype}, pool {cache.num_blocks} blocks of "
        f"{cache.block_size}, context {llm.engine.max_model_len if hasattr(llm.engine, 'max_model_len') else '?'}")
    prompts = []
    for i in range(args.requests):
        ids = llm.tokenizer.encode(longprompt_text(int(args.prompt_tokens * 1.3), seed=1000 + i),
                                   add_special_tokens=False)[:args.prompt_tokens]
        if len(ids) != args.prompt_tokens:
            raise SystemExit(f"prompt {i}: only {len(ids)} tokens of text; raise the text length")
        prompts.append(ids)
    held = {"max": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            held["max"] = max(held["max"], cache.num_blocks - cache.num_free_blocks)

    threading.Thread(target=sample, daemon=True).start()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [llm.new_request(p, params) for p in prompts]
    start = time.perf_counter()
    finished = []

    def on_finished(req) -> None:
        finished.append(req)
        say(f"request {len(finished)}/{args.requests} finished after {time.perf_counter() - start:.1f} s "
            f"({req.num_preemptions} preemptions)")

    llm.run([r for r, _ in reqs], on_finished=on_finished)
    done.set()
    held["max"] = max(held["max"], cache.num_blocks - cache.num_free_blocks)
    outs = [llm._finish_output(r, s) for r, s in reqs]
    result = {
        "model": args.model, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "kv_cache_dtype": str(llm.kv_cache_dtype).removeprefix("torch."),
        "pool_blocks": cache.num_blocks, "block_size": cache.block_size, "max_blocks_held": held["max"],
        "wall_s": round(time.perf_counter() - start, 1),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3),
        "per_request": [{"ttft_s": round(o.ttft_s or -1, 1), "total_s": round(o.total_s or -1, 1),
                         "finish": o.outputs[0].finish_reason, "output_tokens": len(o.outputs[0].token_ids),
                         "preemptions": r.num_preemptions} for o, (r, _) in zip(outs, reqs)],
    }
    say(json.dumps(result))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

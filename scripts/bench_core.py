"""Core decoding speed of a packaged model, draftwise beside HF transformers on the same weights.

Prints, per dtype: plain decode tok/s (greedy, fixed output length), the latency of one target forward over 1
and over 6 new tokens at a ~128-token context, and the same three figures for HF transformers built from the
identical tensors; then the cached reload time (a fresh process loading the converted checkpoint).
Not a test: timing only, run it on a quiet machine.

    .venv/bin/python scripts/bench_core.py --model qwen2.5-coder-1.5b-instruct --dtypes float32,bfloat16
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from draftwise import LLM, SamplingParams
from draftwise.kv_cache import KVCache

PROMPT = "def merge_sort(xs):\n    \"\"\"Sort a list with merge sort and return a new list.\"\"\"\n"


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ours(llm: LLM, ctx_ids: list[int], max_tokens: int, repeats: int) -> dict:
    m = llm.model
    c = m.config
    cache = KVCache(c.num_layers, 1, c.num_kv_heads, len(ctx_ids) + 16, c.head_dim, m.dtype)
    slot = torch.tensor([0])
    m(torch.tensor([ctx_ids]), torch.arange(len(ctx_ids))[None], cache, slot)
    n = len(ctx_ids)

    def fwd(width):
        def run():
            cache.truncate(0, n)
            m(torch.ones(1, width, dtype=torch.int64), n + torch.arange(width)[None], cache, slot)
        return run

    out = {"forward_1_ms": 1e3 * median_time(fwd(1), repeats), "forward_6_ms": 1e3 * median_time(fwd(6), repeats)}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ctx_ids}], params)  # warm-up
    r = llm.generate([{"prompt_token_ids": ctx_ids}], params)[0]
    out["decode_tok_s"] = (max_tokens - 1) / (r.total_s - r.ttft_s)
    return out


def hf_reference(llm: LLM, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, file = llm.model_info["path"].rsplit("/", 1)
    cfg = AutoConfig.from_pretrained(folder, gguf_file=file)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    hf.load_state_dict(llm.model.state_dict(), strict=False)
    hf.tie_weights()
    return hf


@torch.inference_mode()
def theirs(hf, ctx_ids: list[int], max_tokens: int, repeats: int) -> dict:
    from transformers import DynamicCache

    ids = torch.tensor([ctx_ids])
    out = {}
    for width in (1, 6):
        def run():
            cache = DynamicCache(config=hf.config)
            hf(ids, past_key_values=cache, use_cache=True)
            t0 = time.perf_counter()
            hf(torch.ones(1, width, dtype=torch.int64), past_key_values=cache, use_cache=True)
            return time.perf_counter() - t0
        run()
        out[f"forward_{width}_ms"] = 1e3 * statistics.median(run() for _ in range(repeats))
    gen = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
    hf.generate(ids, **gen)
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
    t1 = time.perf_counter()
    hf.generate(ids, **gen)
    t2 = time.perf_counter()
    out["decode_tok_s"] = (max_tokens - 1) / ((t2 - t1) - (t1 - t0))
    return out


def reload_time(model: str) -> float:
    code = ("import time; t=time.perf_counter(); from draftwise.api import load_model; "
            f"load_model({model!r}, 'bfloat16'); print(time.perf_counter()-t)")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"model {args.model}, torch {torch.__version__}, {args.threads} threads, context 128 tokens, "
          f"decode {args.max_tokens} tokens greedy, forward latency = median of {args.repeats}")
    print(f"{'dtype':9s} {'engine':13s} {'decode tok/s':>12s} {'fwd 1 tok ms':>13s} {'fwd 6 tok ms':>13s} {'6/1':>5s}")
    for dtype in args.dtypes.split(","):
        llm = LLM(args.model, dtype=dtype, max_num_seqs=1, max_model_len=512)
        ctx = (llm.tokenizer.encode(PROMPT) * 20)[:128]
        rows = [("draftwise", ours(llm, ctx, args.max_tokens, args.repeats))]
        if not args.no_hf:
            hf = hf_reference(llm, {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
            rows.append(("transformers", theirs(hf, ctx, args.max_tokens, args.repeats)))
            del hf
        for name, r in rows:
            print(f"{dtype:9s} {name:13s} {r['decode_tok_s']:12.2f} {r['forward_1_ms']:13.1f} "
                  f"{r['forward_6_ms']:13.1f} {r['forward_6_ms'] / r['forward_1_ms']:5.2f}", flush=True)
        if len(rows) == 2:
            print(f"{dtype:9s} draftwise/transformers decode speed: {rows[0][1]['decode_tok_s'] / rows[1][1]['decode_tok_s']:.2f}x")
        del llm
    print(f"cached reload (fresh process, load_model bf16): {reload_time(args.model):.1f} s")


if __name__ == "__main__":
    main()

"""Side by side in one run (issue 6): draftwise configurations, llama.cpp (llama-cpp-python) plain and prompt
lookup, HF transformers plain and assisted generation — same GGUF file, same prompt token ids, same threads,
greedy, same output limit. Prints output tok/s per request (output tokens / end-to-end time, median over
prompts) per workload group, and each engine's ratio to llama.cpp plain. Not a test; llama-cpp-python and
transformers are optional (`pip install -e .[compare]`); a missing one is skipped and said so.

    .venv/bin/python scripts/compare.py --groups repeated,chat --per-group 3 --max-tokens 128

Without --ours it runs draftwise's defaults (`--dtype auto --weights auto`: the kernels the autotuner picked on
this machine) plain, with n-gram lookup and with the draft model (draft also auto), and with adaptive k. The
machine probe (instruction sets, measured memory bandwidth) is printed beside the table.
    .venv/bin/python scripts/compare.py --ours '{"name":"dw plain int4+dense","weights":"int4+dense","dtype":"bfloat16"}'
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from draftwise.bench.workloads import load_workload


def item_ids(tok, item) -> list[int]:
    if item.prompt is not None:
        return tok.encode(item.prompt)
    return tok.encode_chat(item.messages or [{"role": "user", "content": item.turns[0]}])


def timed(fn) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = fn()
    return n, time.perf_counter() - t0


def run_ours(conf: dict, model: str, prompts: dict, max_tokens: int, threads: int) -> dict:
    from draftwise import LLM, SamplingParams

    llm = LLM(model, dtype=conf.get("dtype", "auto"), weights=conf.get("weights", "auto"), threads=threads,
              speculative_config=conf.get("spec"), max_num_seqs=1, max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": next(iter(prompts.values()))[0]}], params)  # warm-up
    out = {}
    for group, plist in prompts.items():
        rates = []
        for ids in plist:
            r = llm.generate([{"prompt_token_ids": ids}], params)[0]
            rates.append(r.num_output_tokens / r.total_s)
        out[group] = statistics.median(rates)
    return out


def run_llamacpp(path: str, prompts: dict, max_tokens: int, threads: int, lookup: int | None) -> dict:
    from llama_cpp import Llama

    kw = {}
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False, **kw)

    def gen(ids):
        llm.reset()
        r = llm.create_completion(ids, max_tokens=max_tokens, temperature=0.0, top_k=1)
        return r["usage"]["completion_tokens"]

    gen(next(iter(prompts.values()))[0])
    return {g: statistics.median(n / t for n, t in (timed(lambda: gen(ids)) for ids in plist))
            for g, plist in prompts.items()}


def run_hf(llm_model, hf, prompts: dict, max_tokens: int, **gen_kw) -> dict:
    kw = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0, **gen_kw)

    def gen(ids):
        x = torch.tensor([ids])
        with torch.inference_mode():
            return hf.generate(x, attention_mask=torch.ones_like(x), **kw).shape[1] - x.shape[1]

    gen(next(iter(prompts.values()))[0])
    return {g: statistics.median(n / t for n, t in (timed(lambda: gen(ids)) for ids in plist))
            for g, plist in prompts.items()}


def hf_from(model_name: str, dtype: torch.dtype):
    """HF transformers model with the GGUF's config and draftwise's converted tensors (identical weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from draftwise.api import load_model

    ours, _, info = load_model(model_name, "float32")
    folder, file = info["path"].rsplit("/", 1)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=file), dtype=dtype).eval()
    hf.load_state_dict(ours.state_dict(), strict=False)
    hf.tie_weights()
    return hf, info["path"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--groups", default="repeated,chat")
    ap.add_argument("--per-group", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ours", action="append", default=[], help="JSON: name, dtype, weights, spec")
    ap.add_argument("--lookup-k", type=int, default=4)
    ap.add_argument("--skip", default="", help="comma list of: llamacpp,hf")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from draftwise.kernels.probe import format_probe, probe
    from draftwise.models.sources import load_checkpoint

    machine = format_probe(probe())
    print(machine, flush=True)
    ckpt = load_checkpoint(args.model)
    tok, info = ckpt.tokenizer, ckpt.info
    if not args.ours:
        draft = {"method": "draft_model", "model": args.draft}
        args.ours = [json.dumps(c) for c in (
            {"name": "draftwise auto plain"},
            {"name": f"draftwise auto ngram k={args.lookup_k}",
             "spec": {"method": "ngram", "num_speculative_tokens": args.lookup_k}},
            {"name": "draftwise auto ngram k=auto", "spec": {"method": "ngram", "num_speculative_tokens": "auto"}},
            {"name": "draftwise auto draft k=4", "spec": {**draft, "num_speculative_tokens": 4}},
            {"name": "draftwise auto draft k=auto", "spec": {**draft, "num_speculative_tokens": "auto"}},
        )]
    groups = args.groups.split(",")
    items = [i for w in ("code", "chat") for i in load_workload(w).items if i.group in groups]
    prompts = {g: [item_ids(tok, i) for i in items if i.group == g][: args.per_group] for g in groups}
    results: dict[str, dict] = {}
    skip = set(args.skip.split(","))
    if "llamacpp" not in skip:
        try:
            results["llama.cpp plain"] = run_llamacpp(info["path"], prompts, args.max_tokens, args.threads, None)
            results[f"llama.cpp prompt lookup k={args.lookup_k}"] = run_llamacpp(
                info["path"], prompts, args.max_tokens, args.threads, args.lookup_k)
        except ImportError as e:
            print(f"llama.cpp skipped: {e}")
    for conf in args.ours:
        c = json.loads(conf)
        results[c.get("name", conf)] = run_ours(c, args.model, prompts, args.max_tokens, args.threads)
        print(f"  done: {c.get('name', conf)} {results[c.get('name', conf)]}", flush=True)
    if "hf" not in skip:
        hf, _ = hf_from(args.model, torch.bfloat16)
        results["transformers bf16 plain"] = run_hf(None, hf, prompts, args.max_tokens)
        results[f"transformers bf16 prompt lookup k={args.lookup_k}"] = run_hf(
            None, hf, prompts, args.max_tokens, prompt_lookup_num_tokens=args.lookup_k)
        draft, _ = hf_from(args.draft, torch.bfloat16)
        results["transformers bf16 assisted (0.5B draft)"] = run_hf(None, hf, prompts, args.max_tokens,
                                                                     assistant_model=draft)
    ref = results.get("llama.cpp plain")
    print("\n" + machine)
    print(f"{args.model} ({info['path'].rsplit('/', 1)[-1]}), {args.threads} threads, greedy, {args.max_tokens} "
          f"output tokens, {args.per_group} prompts/group; output tok/s per request (median); ratio vs llama.cpp plain")
    print(f"{'engine':44s}" + "".join(f"{g:>26s}" for g in groups))
    for name, r in results.items():
        cells = "".join(f"{r[g]:14.2f}" + (f" ({r[g] / ref[g]:5.2f}x)  " if ref else " " * 11) for g in groups)
        print(f"{name:44s}{cells}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""Where a draft-model speculation step's time goes, per output token: the draft's forwards (a catch-up over the
unseen tokens, then one 1-row forward per further guess), drawing guesses, the target's verification forward,
and the rest of the step (verify, emit, Python); with the k each step asked for, the widths verified, the draft
forwards per output token and the acceptance per position. Not a test; wall times follow the machine's load,
the counts do not.

    PYTHONPATH=. python scripts/profile_draft_path.py --group chat --k auto --draft-p-min 0
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from draftwise import LLM, SamplingParams
from draftwise.bench.workloads import load_workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--group", default="chat", help="a prompt group of the code / chat workloads (chat, repeated)")
    ap.add_argument("--per-group", type=int, default=3)
    ap.add_argument("--k", default="auto", help="num_speculative_tokens: an integer or auto")
    ap.add_argument("--draft-p-min", type=float, default=None, help="default: the config's DRAFT_P_MIN")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, threads=args.threads, max_num_seqs=1, max_model_len=2048, k_max=16,
              enable_prefix_caching=False)
    spec = {"method": "draft_model", "model": args.draft,
            "num_speculative_tokens": args.k if args.k == "auto" else int(args.k)}
    if args.draft_p_min is not None:
        spec["draft_p_min"] = args.draft_p_min
    llm.set_speculation(spec)
    print("draft plan:", llm.draft_info["plan"]["summary"])
    tok = llm.tokenizer
    items = [i for w in ("code", "chat") for i in load_workload(w).items if i.group == args.group][: args.per_group]
    prompts = [tok.encode(i.prompt) if i.prompt is not None
               else tok.encode_chat(i.messages or [{"role": "user", "content": i.turns[0]}]) for i in items]
    eng, prop = llm.engine, llm.engine.proposer
    cur: dict = {}
    steps: list[dict] = []
    forward, draw, propose, verify_forward, step = prop._forward, prop._draw, prop.propose, eng._verify_forward, eng.step

    def timed(key, fn):
        def wrapped(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            cur[key] += time.perf_counter() - t
            if key == "draft_forward":
                cur["forwards"] += 1
            if key == "verify":
                cur["width"] = out.shape[1]
            return out
        return wrapped

    def one_step():
        cur.clear()
        cur.update(draft_forward=0.0, draw=0.0, propose=0.0, verify=0.0, forwards=0, width=0)
        t = time.perf_counter()
        outs = step()
        cur["step"] = time.perf_counter() - t
        steps.append(dict(cur))
        return outs

    prop._forward, prop._draw = timed("draft_forward", forward), timed("draw", draw)
    eng.proposer.propose, eng._verify_forward = timed("propose", propose), timed("verify", verify_forward)
    eng.step = one_step
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params)  # warm-up
    before = {k: list(v) if isinstance(v, list) else v for k, v in vars(eng.stats).items()}
    total = collections.Counter()
    widths = collections.Counter()
    for ids in prompts:
        steps.clear()
        t0 = time.perf_counter()
        n = llm.generate([{"prompt_token_ids": ids}], params)[0].num_output_tokens
        wall = time.perf_counter() - t0
        dec = steps[1:]  # steps[0]: the prompt's prefill
        tot = {k: sum(s[k] for s in dec) for k in ("step", "propose", "draft_forward", "draw", "verify", "forwards")}
        widths.update(s["width"] for s in dec)
        total.update({**tot, "tokens": n, "steps": len(dec)})
        per = {k: tot[k] / n * 1e3 for k in tot}
        print(f"prompt of {len(ids)} tokens: {n} tokens in {wall:.2f} s ({n / wall:.1f} tok/s), {len(dec)} steps; "
              f"per output token ms: step {per['step']:.1f} = propose {per['propose']:.1f} (draft forwards "
              f"{per['draft_forward']:.1f}, draws {per['draw']:.1f}) + verify {per['verify']:.1f} + rest "
              f"{per['step'] - per['propose'] - per['verify']:.1f}; draft forwards "
              f"{tot['forwards'] / n:.2f}/token, median one {statistics.median(s['draft_forward'] / s['forwards'] for s in dec if s['forwards']) * 1e3:.1f} ms")
    n = total["tokens"]
    stats = vars(eng.stats)
    acc = [a - b for a, b in zip(stats["accepted_per_position"], before.get("accepted_per_position", []) + [0] * 99)]
    drafted = [a - b for a, b in zip(stats["drafted_per_position"], before.get("drafted_per_position", []) + [0] * 99)]
    print(f"all: {n} tokens, {total['steps']} steps ({n / total['steps']:.2f} tokens/step), verified widths "
          f"{dict(sorted(widths.items()))}, draft forwards {total['forwards'] / n:.2f}/token; acceptance per "
          f"position {[round(a / d, 2) for a, d in zip(acc, drafted) if d]} of {[d for d in drafted if d]} guesses")


if __name__ == "__main__":
    main()

"""k auto against plain decoding on a mixture-of-experts GGUF (default: scripts/moe_shapes.py's synthetic file with
Qwen3-30B-A3B's layer shapes): the same greedy request through LLM.generate with no speculation and with n-gram /
suffix speculation at num_speculative_tokens "auto" (the engine's step-cost grid, measured at load by real
forwards, prices each verification width), the conditions alternated --rounds times; prints tok/s per condition,
the k each step chose (k histogram) and the acceptance. The outputs must be identical (greedy speculation == plain);
k auto "does not lose" when its tok/s is not below plain's beyond the noise of the rounds. Not a test.

    PYTHONPATH=. .venv/bin/python scripts/moe_k_auto.py --cache-dir /tmp/moe_cache --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default="/tmp/qwen3-30b-a3b-shapes.gguf")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    import torch

    from draftwise.api import LLM
    from draftwise.sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.path, max_num_seqs=1, max_model_len=512, k_max=16, cache_dir=args.cache_dir)
    V = llm.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(3, V, (12,), generator=g).tolist()
    prompt = (motif * 8)[:96]  # repetitive: n-gram and suffix find continuations to guess
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    conditions = {"plain": None, "ngram k auto": {"method": "ngram", "num_speculative_tokens": "auto"},
                  "suffix k auto": {"method": "suffix", "num_speculative_tokens": "auto"}}
    times: dict[str, list[float]] = {c: [] for c in conditions}
    outs, stats = {}, {}
    for r in range(args.rounds + 1):  # round 0: warm-up (the grid is measured when speculation is first set)
        for name, spec in conditions.items():
            llm.set_speculation(spec)
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
            dt = time.perf_counter() - t0
            if r:
                times[name].append(out.num_output_tokens / dt)
            outs[name], stats[name] = out.outputs[0].token_ids, out.spec
    plain = statistics.median(times["plain"])
    print(f"threads {torch.get_num_threads()}, prompt {len(prompt)} tokens, {args.max_tokens} greedy tokens, "
          f"median of {args.rounds} rounds")
    print("| condition | tok/s | x plain | k histogram (k: steps) | accepted / drafted |")
    print("|---|---|---|---|---|")
    for name in conditions:
        s = stats[name] or {}
        hist = s.get("k_histogram", {})
        acc = f"{s.get('num_accepted_tokens', 0)} / {s.get('num_draft_tokens', 0)}" if s else "-"
        tps = statistics.median(times[name])
        print(f"| {name} | {tps:.2f} | {tps / plain:.2f} | {hist or '-'} | {acc} |")
    same = all(outs[n] == outs["plain"] for n in conditions)
    print(f"outputs identical to plain: {same}")


if __name__ == "__main__":
    main()

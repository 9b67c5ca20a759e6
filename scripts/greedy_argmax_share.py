"""What choosing greedy tokens costs a decode: the time spent inside `sampling.greedy_ids` per output token, with the
glue's argmax (kernels/glue.py) and with torch.argmax, alternated round by round in one process over one LLM, and
the decode wall around it; outputs must be identical. The time inside is what to compare: on a busy host the wall's
spread is larger than the difference (a tok/s A/B on 2026-12-07 could not see it).

    python scripts/greedy_argmax_share.py --method ngram --concurrency 4 --workload code --rounds 3

A script, not part of the package (nothing under draftwise/ imports it).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from draftwise.api import LLM
from draftwise.bench.workloads import load_workload
from draftwise.kernels import glue
from draftwise.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from draftwise.sampling import SamplingParams
from draftwise.spec_decode import draft_model as draft_mod, verify as verify_mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="none", choices=["none", "ngram", "suffix", "draft_model"])
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--workload", default="chat", help="chat or code (its repeated group)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    spec = None if args.method == "none" else {"method": args.method, "num_speculative_tokens": "auto"}
    if args.method == "draft_model":
        spec["model"] = DEFAULT_DRAFT
    llm = LLM(model=DEFAULT_TARGET, speculative_config=spec)

    inside = {"s": 0.0, "rows": 0}
    greedy_ids = verify_mod.greedy_ids

    def timed(logits):  # [..., V] -> [...]
        t = time.perf_counter()
        out = greedy_ids(logits)
        inside["s"] += time.perf_counter() - t
        inside["rows"] += logits.numel() // logits.shape[-1]
        return out

    verify_mod.greedy_ids = draft_mod.greedy_ids = timed  # every greedy token of the engine passes here
    items = [it for it in load_workload(args.workload).items if it.group != "novel"][: 4 * args.concurrency]
    prompts = [it.messages or it.prompt for it in items]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def run(batch):
        return llm.chat(batch, params) if isinstance(batch[0], list) else llm.generate(batch, params)

    run(prompts[: args.concurrency])  # warm-up
    argmaxes = {"glue": glue.argmax, "torch": lambda x: x.argmax(-1)}
    per: dict[str, list[tuple[float, float, float]]] = {name: [] for name in argmaxes}
    texts: dict[str, list[str]] = {}
    for r in range(args.rounds):
        for name in (("torch", "glue") if r % 2 == 0 else ("glue", "torch")):
            glue.argmax = argmaxes[name]  # greedy_ids calls glue.argmax through the module
            inside.update(s=0.0, rows=0)
            t, n, out = time.perf_counter(), 0, []
            for i in range(0, len(prompts), args.concurrency):
                for o in run(prompts[i: i + args.concurrency]):
                    n += len(o.outputs[0].token_ids)
                    out.append(o.outputs[0].text)
            wall = time.perf_counter() - t
            if texts.setdefault(name, out) != out:
                raise SystemExit(f"{name}: round {r} decoded other text than round 0")
            per[name].append((wall / n * 1e3, inside["s"] / n * 1e3, inside["rows"] / n))
    glue.argmax = argmaxes["glue"]
    med = {name: [statistics.median(v[j] for v in rows) for j in range(3)] for name, rows in per.items()}
    print(json.dumps({
        "workload": args.workload, "method": args.method, "concurrency": args.concurrency, "rounds": args.rounds,
        "identical": texts["torch"] == texts["glue"], "argmax_rows_per_token": round(med["glue"][2], 2),
        "ms_per_token_wall": {k: round(v[0], 2) for k, v in med.items()},
        "ms_per_token_in_argmax": {k: round(v[1], 3) for k, v in med.items()},
        "argmax_share_of_wall": {k: round(v[1] / v[0], 4) for k, v in med.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

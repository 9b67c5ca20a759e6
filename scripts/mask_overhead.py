"""Grammar-mask overhead per generated token under structured outputs.

Runs the `structured` workload's prompts with their schemas through plain constrained decoding (and optionally a
speculative config) on the given target and reports, per generated token, the engine's time in grammar work
(masks along the draft, masking logits, advancing the matcher: SpecStats.mask_time_s) against the wall time of
the decode, in ms and as a share. Not a test; run on a quiet machine.

    .venv/bin/python scripts/mask_overhead.py --requests 10 [--speculative-config '{"method": "grammar"}']
"""
from __future__ import annotations

import argparse
import json
import time

from draftwise.api import LLM
from draftwise.bench.workloads import load_workload
from draftwise.kernels.probe import format_probe, probe
from draftwise.models.catalog import DEFAULT_TARGET
from draftwise.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_TARGET)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--speculative-config", default=None)
    args = ap.parse_args()
    print(format_probe(probe()), flush=True)
    llm = LLM(args.model, dtype=args.dtype, weights=args.weights, threads=args.threads,
              speculative_config=args.speculative_config, max_num_seqs=1)
    items = load_workload("structured").items[: args.requests]
    rows = []
    for it in items:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=it.structured_outputs)
        prompt = {"prompt_token_ids": llm.tokenizer.encode_chat(it.messages)}
        before = llm.engine.stats.mask_time_s
        t0 = time.perf_counter()
        out = llm.generate(prompt, params)[0]
        wall = time.perf_counter() - t0
        mask = llm.engine.stats.mask_time_s - before
        decode = wall - (out.ttft_s or 0.0)  # the prefill is not a decode step
        n = out.num_output_tokens
        rows.append({"item": it.item_id, "tokens": n, "finish": out.outputs[0].finish_reason,
                     "mask_ms_per_token": 1e3 * mask / n, "decode_ms_per_token": 1e3 * decode / max(1, n - 1),
                     "mask_share": mask / wall})
        print(json.dumps(rows[-1]))
    tokens = sum(r["tokens"] for r in rows)
    mask_ms = sum(r["mask_ms_per_token"] * r["tokens"] for r in rows) / tokens
    step_ms = sum(r["decode_ms_per_token"] * (r["tokens"] - 1) for r in rows) / sum(r["tokens"] - 1 for r in rows)
    print(json.dumps({"tokens": tokens, "mask_ms_per_token": round(mask_ms, 3), "step_ms_per_token": round(step_ms, 1),
                      "mask_share_of_step": round(mask_ms / step_ms, 4)}))


if __name__ == "__main__":
    main()

"""What one verification costs: the target's forward time by rows (1 = a plain decode step, k + 1 = verifying k
guesses) with the weight formats `auto` chose on this machine, after a 128-token context. Prints the machine
probe, the chosen kernels, ms per forward (median over rounds of the median of `--repeats`), the ratio of those
medians to one row, and the paired ratio (median and quartiles over rounds of each round's ratio: the widths of a
round run seconds apart, so a drifting host moves both sides together). Issue 10's goal: 9 rows <= 1.5x one row.
Not a test; run on a quiet machine.

    .venv/bin/python scripts/verify_cost.py --model qwen2.5-coder-1.5b-instruct --rounds 9
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from draftwise.api import load_model
from draftwise.kernels.probe import format_probe, probe
from draftwise.kv_cache import KVCache


def forward_ms(model, rows: int, context: int, repeats: int) -> float:  # median ms of one [1, rows] forward
    c = model.config
    cache = KVCache(c.num_layers, 1, c.num_kv_heads, context + rows + 1, c.head_dim, model.dtype, model.device)
    slot = torch.tensor([0])
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, context)), torch.arange(context)[None], cache, slot)
        times = []
        for _ in range(repeats + 1):
            cache.truncate(0, context)
            ids = torch.randint(0, 1000, (1, rows))
            t0 = time.perf_counter()
            model(ids, context + torch.arange(rows)[None], cache, slot, num_tokens=[rows])  # as the engine verifies
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,12,16")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(format_probe(probe()), flush=True)
    model, _, info = load_model(args.model, args.dtype, weights=args.weights)
    plan = model.plan
    print(f"{args.model}: dtype {info['dtype']}, weights {info['weights']}, step kernel {plan.step}, "
          f"prefill kernel {plan.prefill}; {args.threads} threads, context {args.context} tokens, "
          f"median over rounds of the median of {args.repeats}")
    widths = [int(r) for r in args.rows.split(",")]
    # rounds interleave the widths (one short median per width per round), so a host whose speed drifts during
    # the run slows every width alike instead of skewing the ratios; the figure is the median over rounds
    per = {r: [] for r in widths}
    for _ in range(args.rounds):
        for r in widths:
            per[r].append(forward_ms(model, r, args.context, args.repeats))
    print(f"{'rows':>5s} {'ms/forward':>11s} {'x 1 row':>8s} {'ms/row':>8s} {'paired':>7s} {'[p25, p75]':>13s}"
          f"   ({args.rounds} rounds)")
    base = statistics.median(per[widths[0]])
    for r in widths:
        ms = statistics.median(per[r])
        # paired: each round's ratio to the first width measured in that same round (seconds apart), so a host
        # that drifts between rounds moves both sides of a ratio together; median and quartiles over rounds
        ratios = sorted(a / b for a, b in zip(per[r], per[widths[0]]))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"{r:5d} {ms:11.1f} {ms / base:8.2f} {ms / r:8.1f} {statistics.median(ratios):7.2f} "
              f"[{q[0]:.2f}, {q[2]:.2f}]", flush=True)

if __name__ == "__main__":
    main()

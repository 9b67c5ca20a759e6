"""Linear kernels side by side on this machine: the probe, then ms per call by rows M for every implementation
that runs here, on the projection shapes of Qwen2.5-Coder-1.5B (hidden 1536, intermediate 8960, 12 heads,
2 kv heads, head_dim 128, 28 layers, vocab 151936): the sum over one forward's projections (28 layers +
lm_head), the ratios vs M=1, and optionally the per-projection detail. Not a test; numbers are noisy on a
shared machine, so it repeats the whole measurement and reports medians.

    .venv/bin/python scripts/bench_kernels.py [--repeat 3] [--detail] [--warm] [--only q4x8,int4] [--threads N]
        [--samples 15] [--json F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from draftwise.kernels import q4x8
from draftwise.kernels.autotune import choose, decoder_shapes, format_table, measure
from draftwise.kernels.linear import LINEARS, Q4x8Linear, available
from draftwise.kernels.probe import flag_summary, format_probe, probe


def forced(path: str):
    class Forced(Q4x8Linear):
        name = f"q4x8[{path}]"

        def __init__(self, weight, bias=None):
            super().__init__(weight, bias, path=path)

    return Forced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="whole measurements; the table shows medians")
    ap.add_argument("--detail", action="store_true", help="also print ms per call for each projection shape")
    ap.add_argument("--warm", action="store_true", help="don't rotate weight copies (weights stay in cache)")
    ap.add_argument("--only", default="", help="comma-separated implementation names")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--samples", type=int, default=15, help="calls per (kernel, shape, rows); the fastest counts")
    ap.add_argument("--cpu-time", action="store_true",
                    help="1 thread, timed by the thread's CPU time: robust on a machine crowded by other jobs")
    ap.add_argument("--json", default="", help="write the median table and choice here")
    args = ap.parse_args()
    if args.cpu_time:
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)

    p = probe()
    print(format_probe(p))
    registry = dict(LINEARS)
    names = available(p)
    if "q4x8" in names:
        paths = q4x8.cpu_paths()
        if "avx512" in paths and "avx2" in paths:  # what an AVX2-only CPU would run, measured here
            registry["q4x8[avx2]"] = forced("avx2")
            names.append("q4x8[avx2]")
    if args.only:
        names = [n for n in args.only.split(",") if n in registry]
    shapes = decoder_shapes(1536, 8960, 12, 2, 128, 28, 151936)
    print("shapes: " + ", ".join(f"{s.name} {s.N}x{s.K} x{s.count}" for s in shapes))
    tables = []
    for i in range(args.repeat):
        print(f"measurement {i + 1}/{args.repeat} ...", file=sys.stderr, flush=True)
        tables.append(measure(shapes, names, cold=not args.warm, registry=registry, samples=args.samples,
                              clock=time.thread_time if args.cpu_time else time.perf_counter))
    table = dict(tables[-1])
    table["ms"] = {n: {r: statistics.median(t["ms"][n][r] for t in tables) for r in table["rows"]}
                   for n in table["ms"]}
    table["per_shape"] = {n: {s: {r: statistics.median(t["per_shape"][n][s][r] for t in tables) for r in c}
                              for s, c in table["per_shape"][n].items()} for n in table["per_shape"]}
    choice = choose({**table, "ms": {n: c for n, c in table["ms"].items() if not n.startswith("q4x8[")}})
    print()
    print(f"ms per forward's projections (28 layers + lm_head), median of {args.repeat}, "
          f"{'warm cache' if args.warm else 'weights streamed from memory'}"
          f"{', thread CPU time' if args.cpu_time else ', wall time'}:")
    print(format_table(table, choice, p))
    if args.detail:
        print("\nms per call by projection (median):")
        for n, per in table["per_shape"].items():
            for s, c in per.items():
                print(f"  {n:<22} {s:<18} " + " ".join(f"M={r}:{v:.3f}" for r, v in c.items()))
    print(f"\n[{flag_summary(p)}; {p['cpu']}; {p['torch_threads']} threads; torch {p['torch_version']}; "
          f"measured read bandwidth {p.get('bandwidth_gbs', 0):.1f} GB/s]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"probe": p, "table": table, "choice": choice}, f, indent=1)


if __name__ == "__main__":
    main()

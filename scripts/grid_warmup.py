"""How a freshly loaded model's step-cost grid moves in the first seconds of a process: the same small grid
(kernels/step_cost.measure_grid, B 1..--batches, widths 1..--widths) timed --repeats times back to back right after
`LLM(model)`, each line with the seconds since the load began. A k policy compares these cells (plain steps: width 1;
guessing steps: wider), so a warm-up that moves the narrow cells and not the wide ones misprices guessing for as
long as the load-time grid stands (docs/PERFORMANCE.md, 2026-12-07 second session, issue 44).

    python scripts/grid_warmup.py --model qwen2.5-coder-1.5b-instruct --repeats 5

A script, not part of the package (nothing under draftwise/ imports it).
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--widths", type=int, default=2)
    args = ap.parse_args()

    from draftwise.api import LLM
    from draftwise.kernels import step_cost
    from draftwise.kernels.probe import format_probe, probe

    print(format_probe(probe(bandwidth=False)).splitlines()[0])
    t0 = time.perf_counter()
    model = LLM(args.model).engine.target
    print(f"loaded in {time.perf_counter() - t0:.1f} s")
    for _ in range(args.repeats):
        grid = step_cost.measure_grid(model, args.batches, args.widths, "all")
        cells = "  ".join(f"({b},{w}) {1e3 * s:5.1f}" for (b, w), s in sorted(grid.items()))
        print(f"{time.perf_counter() - t0:5.1f} s after load: ms per step  {cells}")


if __name__ == "__main__":
    main()

"""What transparent huge pages buy: the target's forward time by rows with its weights in ordinary 4 KiB pages
(as torch allocated them) and in one 2 MiB-page mapping (kernels/hugepages.py, what DRAFTWISE_HUGE_PAGES=1 does),
the same model object switched between the two sets of storages, interleaved in one process. Prints the probe,
how much of the process the kernel backs with huge pages, and the median and minimum ms per forward of each.
Not a test; run on a quiet machine.

    .venv/bin/python scripts/huge_pages.py --rounds 8
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
from verify_cost import forward_ms

from draftwise.api import load_model
from draftwise.kernels import hugepages
from draftwise.kernels.probe import format_probe, probe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,9")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(format_probe(probe()), flush=True)
    os.environ["DRAFTWISE_HUGE_PAGES"] = "0"  # load into torch's own allocations (the default), then copy once
    model, _, info = load_model(args.model)
    small = {(id(o), k, n): t for o, k, n, t in hugepages.tensors_of(model)}
    hugepages.place_in_huge_pages(model, mode="madvise")
    hugepages.collapse_pending(background=False)  # measure once the kernel collapsed it
    huge = {(id(o), k, n): t for o, k, n, t in hugepages.tensors_of(model)}
    print(f"{args.model}: kernels {info.get('kernels', {}).get('step')}; huge pages now back "
          f"{(hugepages.huge_bytes() or 0) / 2**20:.0f} MiB of this process; {args.threads} threads, context 128")

    def use(tensors: dict) -> None:
        for o, k, n, _ in hugepages.tensors_of(model):
            if k == "param":
                o._parameters[n].data = tensors[(id(o), k, n)]
            else:
                o._buffers[n] = tensors[(id(o), k, n)]

    rows = [int(r) for r in args.rows.split(",")]
    res: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, tensors in (("4 KiB pages", small), ("2 MiB pages", huge)):
            use(tensors)
            for r in rows:
                res.setdefault((name, r), []).append(forward_ms(model, r, 128, args.repeats))
    print(f"{'pages':12s} " + " ".join(f"{f'{r} rows med/min ms':>22s}" for r in rows))
    for name in ("4 KiB pages", "2 MiB pages"):
        print(f"{name:12s} " + " ".join(f"{statistics.median(res[(name, r)]):10.1f} / {min(res[(name, r)]):9.1f}"
                                        for r in rows))
    print("ratio 2M/4K  " + " ".join(
        f"{statistics.median(res[('2 MiB pages', r)]) / statistics.median(res[('4 KiB pages', r)]):10.2f} / "
        f"{min(res[('2 MiB pages', r)]) / min(res[('4 KiB pages', r)]):9.2f}" for r in rows))


if __name__ == "__main__":
    main()

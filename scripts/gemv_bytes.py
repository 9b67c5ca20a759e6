"""One-row GEMV speed per packed byte: the block kernels' M = 1 call (a decode step's projection) on the 1.5B's
decode shapes, each weight held in enough copies (>= 96 MiB in all) that every call streams its bytes from DRAM, as
decode does. Reports, per kernel and shape, GB/s on the packed bytes the call reads (`weight_bytes`) beside the
streaming sum's read on the same thread count (probe.measure_stream_bandwidth), and with one thread the thread's
own CPU time per call too (time.thread_time: what a loaded machine distorts least; at 1 thread torch runs the op
in the calling thread).

Usage (one checkout per process: compare two with DW_ROOT / PYTHONPATH, interleaved):
    PYTHONPATH=. python scripts/gemv_bytes.py [--kernels q4c,q4c_sub8,q4x8] [--threads 1,2] [--passes 20] [--json]

Kernels: q4c (Q4_0 / IQ4_NL: fp16 scales), q4c_sub8 (IQ4_XS: int8 per 32 x fp16 per 256), q8_0, q5m (Q5_1's fp16
d and m), q4x8 (the Q4_K kernel). Weights are random (the kernels' time does not depend on the values)."""
from __future__ import annotations

import argparse
import json
import time

import torch

from draftwise.kernels import library
from draftwise.kernels.linear import LINEARS
from draftwise.kernels.probe import measure_stream_bandwidth

SHAPES = {"qkv 2048x1536": (2048, 1536), "o 1536x1536": (1536, 1536), "gate|up 17920x1536": (17920, 1536),
          "down 1536x8960": (1536, 8960), "16x1536": (16, 1536), "16x8960": (16, 8960)}  # the last two: one block,
# with --copies 2 cache-resident: the call is its activation quantization and the op's fixed cost
MIN_BYTES = 96 << 20  # every shape's copies together: past the L3, so each call reads DRAM


def _fp16_scales(shape, gen) -> torch.Tensor:  # [N, G] float32 values that are fp16, like a file's d
    return (torch.rand(shape, generator=gen) * 0.02 + 0.001).half().float()


def make(kind: str, N: int, K: int, seed: int) -> torch.nn.Module:
    """A random [N, K] weight on kernel `kind` (its packed form as a file's blocks give it)."""
    gen = torch.Generator().manual_seed(seed)
    G = K // 32
    if kind == "q4x8":
        return LINEARS["q4x8"](weight=torch.randn(N, K, generator=gen) * 0.05)
    if kind in ("q4c", "q4c_sub8"):
        v = torch.randint(-8, 8, (N, K), generator=gen, dtype=torch.int8)
        if kind == "q4c":
            return LINEARS["q4c"](parts={"v": v, "d": _fp16_scales((N, G), gen)})
        sub = torch.randint(-32, 32, (N, G), generator=gen, dtype=torch.int8)
        sup = _fp16_scales((N, G // 8), gen)
        d = sub.float() * sup.repeat_interleave(8, 1)
        return LINEARS["q4c"](parts={"v": v, "d": d, "d_sub": sub, "d_super": sup})
    if kind == "q8_0":
        v = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8)
        return LINEARS["q8_0"](parts={"v": v, "d": _fp16_scales((N, G), gen)})
    if kind == "q5m":
        v = torch.randint(0, 32, (N, K), generator=gen, dtype=torch.int8)
        return LINEARS["q5m"](parts={"v": v, "d": _fp16_scales((N, G), gen), "m": -_fp16_scales((N, G), gen)})
    raise ValueError(f"unknown kernel {kind!r}")


def copies(kind: str, N: int, K: int, count: int | None = None) -> list[torch.nn.Module]:
    """`count` random [N, K] weights on `kind`, default enough to hold MIN_BYTES together (at least 2)."""
    first = make(kind, N, K, 0)
    count = count or max(2, -(-MIN_BYTES // first.weight_bytes))
    return [first] + [make(kind, N, K, i) for i in range(1, count)]


def time_calls(mods: list[torch.nn.Module], passes: int, threads: int) -> dict:
    """Seconds per call (wall, and the calling thread's CPU at 1 thread), best pass of `passes` over the copies."""
    nbytes, K = mods[0].weight_bytes, mods[0].in_features
    x = torch.randn(1, K)
    torch.set_num_threads(threads)
    for m in mods:
        m(x)
    best_wall = best_cpu = float("inf")
    for _ in range(passes):
        w0, c0 = time.perf_counter(), time.thread_time()
        for m in mods:
            m(x)
        w1, c1 = time.perf_counter(), time.thread_time()
        best_wall = min(best_wall, (w1 - w0) / len(mods))
        best_cpu = min(best_cpu, (c1 - c0) / len(mods))
    out = {"bytes": nbytes, "copies": len(mods), "wall_s": best_wall, "wall_gbs": nbytes / best_wall / 1e9}
    if threads == 1:
        out.update(cpu_s=best_cpu, cpu_gbs=nbytes / best_cpu / 1e9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default="q4c,q4c_sub8,q4x8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    ap.add_argument("--passes", type=int, default=20)
    ap.add_argument("--copies", type=int, default=None, help="copies of each weight (default: >= 96 MiB of them)")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = ap.parse_args()
    library.load()
    rows = []
    threads = [int(s) for s in args.threads.split(",")]
    stream = {t: measure_stream_bandwidth(threads=t) for t in threads}
    for kind in args.kernels.split(","):
        for name in args.shapes.split(","):
            mods = copies(kind, *SHAPES[name], args.copies)
            for t in threads:
                r = time_calls(mods, args.passes, t)
                rows.append({"kernel": kind, "shape": name, "threads": t, "stream_gbs": stream[t], **r})
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'kernel':9} {'shape':20} thr {'us/call':>8} {'GB/s':>6} {'of stream':>9} {'cpu us':>7} {'cpu GB/s':>8}")
    for r in rows:
        cpu = f"{r['cpu_s'] * 1e6:7.1f} {r['cpu_gbs']:8.1f}" if "cpu_s" in r else ""
        print(f"{r['kernel']:9} {r['shape']:20} {r['threads']:3} {r['wall_s'] * 1e6:8.1f} {r['wall_gbs']:6.1f} "
              f"{r['wall_gbs'] / r['stream_gbs']:9.1%} {cpu}")
    print("streaming sum:", ", ".join(f"{t} thr {s:.1f} GB/s" for t, s in
                                      sorted({(r["threads"], r["stream_gbs"]) for r in rows})))


if __name__ == "__main__":
    main()

"""Time one prefill attention call the way a long prompt makes it: the packaged 1.5B's heads (12 query heads, 2 kv
heads, head_dim 128, bf16 K/V), one chunk of T queries at positions FIRST.. over the keys before and in it, on the
path 'auto' takes here (AMX bf16 tiles where the CPU has them). Prints ms per call for each repeat. Not a test.

Usage: DW_ROOT=<checkout> python scripts/time_attention.py [--first 2048] [--rows 2048] [--repeats 6] [--threads 2]
Run two checkouts alternately to compare them (host speed swings: compare within one hold, docs/PERFORMANCE.md)."""
import argparse
import os
import sys
import time

sys.path.insert(0, os.environ.get("DW_ROOT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))
import torch  # noqa: E402

from draftwise.kernels import attention, q4x8  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--first", type=int, default=2048, help="position of the chunk's first query")
ap.add_argument("--rows", type=int, default=2048, help="queries in the chunk")
ap.add_argument("--repeats", type=int, default=6)
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()
q4x8.load()
torch.set_num_threads(args.threads)
g = torch.Generator().manual_seed(0)
H, Hkv, D = 12, 2, 128
C = (args.first + args.rows + 255) // 256 * 256  # cache capacity
keys = torch.randn(1, Hkv, C, D, generator=g).to(torch.bfloat16)
values = torch.randn(1, Hkv, C, D, generator=g).to(torch.bfloat16)
q = torch.randn(1, args.rows, H, D, generator=g).transpose(1, 2)  # [B, H, T, D] as the decoder lays it out
slots = torch.zeros(1, 1, dtype=torch.int64)
positions = (args.first + torch.arange(args.rows))[None]
times = []
for _ in range(args.repeats):
    t0 = time.perf_counter()
    attention.attend_rows(q, keys, values, slots, positions, [args.rows], D ** -0.5)
    times.append((time.perf_counter() - t0) * 1e3)
print(f"{os.environ.get('DW_ROOT', '.')}: attention, {args.rows} queries at {args.first}.. ({'amx' if attention.amx() else 'simd'}"
      f" path, {args.threads} threads), ms per call: " + " ".join(f"{t:.0f}" if t >= 10 else f"{t:.2f}" for t in times), flush=True)

"""The CUDA path in one run, for a lent GPU machine (no model hub there, so no packaged checkpoint either).

1. The probes: the host CPU and the CUDA device (name, capability, measured device-memory bandwidth).
2. The kernel autotuner on the packaged default target's projection shapes (qwen2.5-coder-1.5b: hidden 1536,
   intermediate 8960, 12 query / 2 K/V heads of 128, 28 layers, vocab 151936; read from its GGUF metadata),
   device="cuda": the full sweep (rows 1, 2, 4, 8, 16, 128; every implementation that runs there) and the
   trimmed load-time tuning that `--weights auto` runs; the table and the choice.
3. End to end through the user's path: a random-weight checkpoint of the same shapes (the tiny test tokenizer's
   vocabulary instead of 151936) written as an HF directory, `LLM(model=dir, device="cuda")` with the default
   `--weights auto`: the plan the autotuner chose, then greedy decoding plain and with n-gram speculation
   (k = 4 and k auto), tok/s each (median of the prompts), acceptance, and whether every speculative output
   equals the plain one token for token.

Usage: python scripts/gpu_check.py [--max-tokens 128] [--out results.json]
Knows nothing of how the device tool ships it; prints a report and writes the numbers as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from draftwise.kernels import autotune  # noqa: E402
from draftwise.kernels.probe import cuda_probe, format_probe, probe  # noqa: E402

TARGET = dict(hidden=1536, heads=12, kv_heads=2, head_dim=128, intermediate=8960, layers=28)
TARGET_VOCAB = 151936
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def factorial(n):\n    if n < 2:\n        return 1\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps. The quick brown fox",
    "Speculative decoding drafts tokens and verifies them in one pass. Speculative decoding",
    "print(sum(range(10)))  # numbers 0123456789\nprint(sum(range(20)))",
]


def section(title: str) -> None:
    print(f"\n==== {title} ====", flush=True)


def tune(out: dict, device: str) -> None:
    shapes = autotune.decoder_shapes(TARGET["hidden"], TARGET["intermediate"], TARGET["heads"], TARGET["kv_heads"],
                                     TARGET["head_dim"], TARGET["layers"], TARGET_VOCAB)
    for label, fast in (("full sweep", False), ("load-time tuning (what --weights auto runs)", True)):
        section(f"autotuner, device {device}, qwen2.5-coder-1.5b shapes: {label}")
        t0 = time.perf_counter()
        result = autotune.autotune(shapes, refresh=True, progress=False, fast=fast, device=device)
        took = time.perf_counter() - t0
        print(autotune.format_table(result["table"], result["choice"], result["probe"]))
        print(f"tuning took {took:.1f} s; cache key {result['key']}")
        out["fast" if fast else "full"] = {"seconds": took, "ms": result["table"]["ms"],
                                           "row_exact": result["table"]["row_exact"],
                                           "choice": {k: result["choice"][k] for k in ("step", "prefill")}}


def end_to_end(out: dict, max_tokens: int, device: str, layers: int, profile: bool = True) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _end_to_end(Path(tmp), out, max_tokens, device, layers, profile)


def _end_to_end(tmp: Path, out: dict, max_tokens: int, device: str, layers: int, profile: bool) -> None:
    from draftwise.api import LLM
    from draftwise.sampling import SamplingParams
    from tests.tiny_checkpoints import write_tiny_hf_dir

    section(f"end to end: LLM(model=<random 1.5B-shaped qwen2 dir, {layers} layers>, device={device!r}), weights auto")
    d = tmp / "qwen2-1.5b-shaped-random"
    t0 = time.perf_counter()
    write_tiny_hf_dir(d, "qwen2", dims={**TARGET, "layers": layers}, scale=0.02)
    print(f"wrote the checkpoint in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    llm = LLM(model=str(d), device=device, max_num_seqs=4, k_max=8)
    info = llm.model_info
    print(f"loaded in {time.perf_counter() - t0:.1f} s (autotune included): weights {info.get('weights')}, "
          f"dtype {info.get('dtype')}, plan {info.get('plan')}")
    out["load"] = {"weights": info.get("weights"), "dtype": info.get("dtype"), "plan": info.get("plan")}
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    runs, plain = {}, None
    for label, cfg in (("plain", None), ("ngram k4", {"method": "ngram", "num_speculative_tokens": 4}),
                       ("ngram k auto", {"method": "ngram", "num_speculative_tokens": "auto"})):
        llm.set_speculation(cfg)
        outs = [llm.generate([p], sp)[0] for p in PROMPTS]
        ids = [o.outputs[0].token_ids for o in outs]
        tps = statistics.median(o.num_output_tokens / o.total_s for o in outs)
        acc = [o.spec.get("acceptance_rate") for o in outs if o.spec and o.spec.get("acceptance_rate") is not None]
        same = None if plain is None else sum(a == b for a, b in zip(ids, plain))
        plain = plain or ids
        runs[label] = {"tok_s": tps, "acceptance": statistics.mean(acc) if acc else None, "equal_to_plain": same}
        print(f"{label:<14} {tps:8.1f} tok/s (median of {len(outs)} prompts, {max_tokens} tokens each)"
              + (f", acceptance {statistics.mean(acc):.2f}" if acc else "")
              + ("" if same is None else f", {same}/{len(outs)} outputs equal to plain"), flush=True)
    base = runs["plain"]["tok_s"]
    for label, r in runs.items():
        r["x_plain"] = r["tok_s"] / base
    print("ratios to plain: " + ", ".join(f"{k} {r['x_plain']:.2f}x" for k, r in runs.items()))
    out["generate"] = runs
    if profile:
        profile_decode(llm, sp)


def profile_decode(llm, sp) -> None:
    """Where a plain decode step's time goes here: torch.profiler over one prompt, top ops by host time."""
    from dataclasses import replace

    from torch.profiler import ProfilerActivity, profile

    section("profile: plain decoding, 32 tokens, top ops by self host time")
    llm.set_speculation(None)
    n = 32
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([PROMPTS[1]], replace(sp, max_tokens=n))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the numbers here as JSON")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--skip-tune", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of this script")
    ap.add_argument("--layers", type=int, default=TARGET["layers"], help="decoder layers of the random checkpoint")
    args = ap.parse_args()
    cache = tempfile.TemporaryDirectory()  # the autotuner's and the kernels' cache: this run's own, removed after
    os.environ.setdefault("DRAFTWISE_CACHE_DIR", cache.name)
    section("probes")
    print(format_probe(probe(bandwidth=False)))
    dev = cuda_probe() if args.device == "cuda" else probe(bandwidth=False)
    if args.device == "cuda":
        print(format_probe(dev))
    out: dict = {"probe": dev}
    try:
        if not args.skip_tune:
            tune(out, args.device)
        if not args.skip_e2e:
            end_to_end(out, args.max_tokens, args.device, args.layers, not args.no_profile)
    finally:
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1, default=str))
        cache.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""draftwise against llama.cpp (llama-cpp-python) on one GGUF, by default a mixture-of-experts one: the synthetic
file with Qwen3-30B-A3B's layer shapes that scripts/moe_shapes.py writes (128 experts top-8, the Q4_K_M type mix,
layers cut); --path takes any GGUF both engines load (a dense file has no experts: the ceiling counts every layer).

Each engine runs in its own child process under /usr/bin/time -v (its peak RSS), the two alternated --rounds times
(draftwise, llama.cpp, draftwise, ...) so a busy machine slows both alike; the load average is recorded around
every child. A child, on the same token ids for both engines (seeded random ids of the file's vocabulary):
  * logits: the next-token logits after a --logit-prompt-token prompt (compared in the parent: the top-10 sets'
    overlap, and over the union of both top-10 sets the max |draftwise - llama.cpp| of the logits, beside the
    logits' spread over the vocabulary for scale);
  * decode: a --context-token prompt, then --decode tokens fed one forward each (teacher-forced: both engines read
    the same ids whatever they would have picked), logits of the last row only; tok/s = tokens / wall seconds,
    and the process CPU seconds per token beside it (both engines spin their worker threads, so CPU time
    overstates work for both; it is the less contention-sensitive of the two on a shared machine);
  * prefill: a fresh --prefill-token prompt, timed from the first token in to the last token's logits (draftwise in
    the engine's chunks, engine.PREFILL_CHUNK_TOKENS; llama.cpp in its n_batch / n_ubatch of 512).
draftwise runs the model as api.load_model builds it (weights auto = faithful for this file; the forwards are the
engine's: one [1, T] forward per step, num_tokens given; the heap policy api.LLM sets once loaded, kernels/heap.py,
so a prompt chunk's temporaries are reused rather than faulted in afresh); llama.cpp with n_ctx = prefill + 256, mmap on, its
default KV cache (f16). Both at --threads threads. Not a test: a measurement for the lead to rerun on a quiet
machine.

Every run also prints a 'ceiling' line: the bytes one decode step must read (draftwise/bench/memory.py's step
bytes, the definition scripts/compare.py prints too: each layer's attention projections, router and norms, top-k /
experts of the stacked experts' gate, up and down, the output head and one row of the token table; the K/V cache of
a short context is left out), in the file's types (what llama.cpp reads) and as the loaded draftwise plan holds
them (each linear's stored layout: q4x8 4.75 bits where Q4_K is 4.5; the router's float64 copy), and the machine's streaming read bandwidth at
--threads threads (kernels/probe.py's streaming sum in C, measured after the rounds): bandwidth / bytes is the most
tokens a second either engine can decode, the measured tok/s beside it as a share of that.

    PYTHONPATH=. .venv/bin/python scripts/moe_vs_llamacpp.py --cache-dir /tmp/moe_cache --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def token_ids(vocab: int, n: int, seed: int) -> list[int]:
    """n seeded random ids of the vocabulary's ordinary range (3..vocab-1: past the tiny vocabulary's specials)."""
    import numpy as np

    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def ceiling_line(path: str, threads: int, summary: dict) -> str:
    """The roofline of a decode step on `path` at `threads` threads (module docstring), with each engine's
    measured decode in `summary` as a share of its ceiling."""
    from draftwise.bench.memory import file_step_bytes
    from draftwise.kernels.probe import measure_bandwidth, measure_stream_bandwidth

    f = file_step_bytes(path)
    ours = next((r["step_bytes"] for r in summary.get("_runs", []) if r.get("step_bytes")), None)
    gbs, how = measure_stream_bandwidth(threads=threads), "streaming sum in C, kernels/probe.py"
    if gbs is None:
        import torch

        torch.set_num_threads(threads)
        gbs, how = measure_bandwidth(), "torch matvec, kernels/probe.py (no C compiler here)"
    top_file = gbs * 1e9 / f.total
    parts = ", ".join(f"{name} {v / 1e6:.1f}" for name, v in f.parts.items())
    line = (f"ceiling: a decode step reads {f.total / 1e6:.1f} MB as the file stores it ({parts})"
            + (f" and {ours / 1e6:.1f} MB as draftwise packs it" if ours else "")
            + f"; streaming read {gbs:.1f} GB/s at {threads} threads ({how}, load average "
            f"{os.getloadavg()[0]:.1f}) -> at most {top_file:.0f} tok/s on the file's bytes (llama.cpp)"
            + (f", {gbs * 1e9 / ours:.0f} tok/s on draftwise's" if ours else ""))
    if "llama.cpp" in summary:
        ll = summary["llama.cpp"]["decode_tok_s"]
        line += f"; llama.cpp {ll:.1f} tok/s = {100 * ll / top_file:.0f}% of its ceiling"
        if ours:
            line += f", 1.3x it = {1.3 * ll:.1f} tok/s = {130 * ll * ours / (gbs * 1e9):.0f}% of draftwise's"
    if "draftwise" in summary and ours:
        dw = summary["draftwise"]["decode_tok_s"]
        line += f"; draftwise {dw:.1f} tok/s = {100 * dw * ours / (gbs * 1e9):.0f}% of its ceiling"
    return line


def capacity(args) -> int:
    """Positions either engine's cache must hold: the longest of the three timed sequences, and some room (llama.cpp's
    n_ctx was the prefill + 256 before: a decode of more than 192 tokens after the 64-token context overflowed it)."""
    return max(args.prefill, args.context + args.decode, args.logit_prompt) + 16


def child_draftwise(args) -> dict:
    import torch

    from draftwise.api import load_model
    from draftwise.bench.memory import plan_step_bytes
    from draftwise.engine import PREFILL_CHUNK_TOKENS
    from draftwise.kernels import heap
    from draftwise.kv_cache import KVCache

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, _, _ = load_model(args.path, weights="auto", cache_dir=args.cache_dir)
    load_s = time.perf_counter() - t0
    heap.keep_temporaries_on_heap()  # as api.LLM does once loaded: a prompt's temporaries reused, not faulted in afresh
    c = model.config
    V = c.vocab_size
    cap = capacity(args)
    cache = KVCache(c.num_layers, 1, c.num_kv_heads, cap, c.head_dim, model.dtype)
    slot = torch.tensor([0])

    def forward(ids: list[int], start: int, last_only: bool = True) -> torch.Tensor:  # -> [V] of the last row
        x = torch.tensor([ids])
        out = model(x, torch.arange(start, start + len(ids))[None], cache, slot, num_tokens=[len(ids)],
                    last_only=last_only)
        return out[0, -1]

    with torch.inference_mode():
        ids = token_ids(V, args.logit_prompt, args.seed)
        logits = forward(ids, 0).float()
        cache.truncate(0, 0)
        ctx = token_ids(V, args.context + args.decode, args.seed + 1)
        forward(ctx[:args.context], 0)
        w0, c0 = time.perf_counter(), cpu_seconds()
        for i in range(args.decode):
            forward(ctx[args.context + i:args.context + i + 1], args.context + i)
        decode_s, decode_cpu = time.perf_counter() - w0, cpu_seconds() - c0
        cache.truncate(0, 0)
        prompt = token_ids(V, args.prefill, args.seed + 2)
        w0, c0 = time.perf_counter(), cpu_seconds()
        for s in range(0, args.prefill, PREFILL_CHUNK_TOKENS):
            forward(prompt[s:s + PREFILL_CHUNK_TOKENS], s)
        prefill_s, prefill_cpu = time.perf_counter() - w0, cpu_seconds() - c0
    return {"engine": "draftwise", "plan": model.plan.describe(), "load_s": load_s, "vocab": V,
            "step_bytes": plan_step_bytes(model),
            "logits": logits.tolist(), "decode_s": decode_s, "decode_cpu_s": decode_cpu, "prefill_s": prefill_s,
            "prefill_cpu_s": prefill_cpu, "threads": torch.get_num_threads()}


def child_llamacpp(args) -> dict:
    import numpy as np
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=args.path, n_ctx=capacity(args), n_threads=args.threads, n_threads_batch=args.threads,
                n_batch=512, verbose=False)
    load_s = time.perf_counter() - t0
    V = llm.n_vocab()

    def logits_now() -> list[float]:  # the last evaluated token's logits [V]
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(V,)).astype(np.float64).tolist()

    ids = token_ids(V, args.logit_prompt, args.seed)
    llm.reset()
    llm.eval(ids)
    logits = logits_now()
    llm.reset()
    ctx = token_ids(V, args.context + args.decode, args.seed + 1)
    llm.eval(ctx[:args.context])
    w0, c0 = time.perf_counter(), cpu_seconds()
    for i in range(args.decode):
        llm.eval(ctx[args.context + i:args.context + i + 1])
    decode_s, decode_cpu = time.perf_counter() - w0, cpu_seconds() - c0
    llm.reset()
    prompt = token_ids(V, max(args.prefill, 1), args.seed + 2)[:args.prefill]
    w0, c0 = time.perf_counter(), cpu_seconds()
    if prompt:
        llm.eval(prompt)
    prefill_s, prefill_cpu = time.perf_counter() - w0, cpu_seconds() - c0
    return {"engine": "llama.cpp", "load_s": load_s, "vocab": V, "logits": logits, "decode_s": decode_s,
            "decode_cpu_s": decode_cpu, "prefill_s": prefill_s, "prefill_cpu_s": prefill_cpu,
            "threads": args.threads}


def run_child(engine: str, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", engine, "--path", args.path,
           "--threads", str(args.threads), "--context", str(args.context), "--decode", str(args.decode),
           "--prefill", str(args.prefill), "--logit-prompt", str(args.logit_prompt), "--seed", str(args.seed)]
    if args.cache_dir:
        cmd += ["--cache-dir", args.cache_dir]
    load_before = os.getloadavg()[0]
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    if p.returncode != 0:
        raise SystemExit(f"{engine} child failed:\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["peak_rss_gb"] = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1)) * 1024 / 1e9
    out["load_avg"] = (load_before, os.getloadavg()[0])
    return out


def compare_logits(a: list[float], b: list[float], top: int = 10) -> dict:
    """Top-`top` set overlap, and max |a - b| over the union of both top sets (with the logits' spread for scale)."""
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    ta, tb = set(np.argsort(-a)[:top].tolist()), set(np.argsort(-b)[:top].tolist())
    union = sorted(ta | tb)
    return {"top_overlap": len(ta & tb), "top": top, "max_abs_diff_top": float(np.abs(a[union] - b[union]).max()),
            "max_abs_diff_all": float(np.abs(a - b).max()), "argmax_same": int(a.argmax()) == int(b.argmax()),
            "logit_std": float(a.std()), "logit_range": float(a.max() - a.min())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default="/tmp/qwen3-30b-a3b-shapes.gguf")
    ap.add_argument("--layers", type=int, default=4, help="layers of the file written when --path does not exist")
    ap.add_argument("--cache-dir", default=None, help="draftwise's prepared-weights cache (default: its own)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=4096, help="prompt tokens of the prefill timing (0: none)")
    ap.add_argument("--logit-prompt", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("draftwise", "llama.cpp"), default=None, help="run one engine")
    ap.add_argument("--child", choices=("draftwise", "llama.cpp"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps((child_draftwise if args.child == "draftwise" else child_llamacpp)(args)), flush=True)
        return
    if not Path(args.path).exists():
        from scripts.moe_shapes import write_gguf

        write_gguf(Path(args.path), args.layers)
    engines = [args.only] if args.only else ["draftwise", "llama.cpp"]
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(args.rounds):
        for e in engines:
            got = run_child(e, args)
            runs[e].append(got)
            print(f"round {r + 1} {e:9s}: decode {args.decode / got['decode_s']:.2f} tok/s "
                  f"({1e3 * got['decode_cpu_s'] / args.decode:.0f} CPU-ms/token), prefill {args.prefill} "
                  f"{got['prefill_s']:.1f} s ({got['prefill_cpu_s']:.1f} CPU-s), peak RSS {got['peak_rss_gb']:.2f} GB, "
                  f"load {got['load_s']:.1f} s, load average {got['load_avg'][0]:.1f} -> {got['load_avg'][1]:.1f}",
                  flush=True)
    summary = {}
    for e, rs in runs.items():
        summary[e] = {"decode_tok_s": statistics.median(args.decode / r["decode_s"] for r in rs),
                      "decode_cpu_ms_per_token": statistics.median(1e3 * r["decode_cpu_s"] / args.decode for r in rs),
                      "prefill_s": statistics.median(r["prefill_s"] for r in rs),
                      "prefill_cpu_s": statistics.median(r["prefill_cpu_s"] for r in rs),
                      "peak_rss_gb": max(r["peak_rss_gb"] for r in rs),
                      "load_avg": [r["load_avg"] for r in rs]}
    if len(engines) == 2:
        dw, ll = summary["draftwise"], summary["llama.cpp"]
        summary["logits"] = compare_logits(runs["draftwise"][0]["logits"], runs["llama.cpp"][0]["logits"])
        summary["ratios"] = {"decode_x": dw["decode_tok_s"] / ll["decode_tok_s"],
                             "decode_cpu_x": ll["decode_cpu_ms_per_token"] / dw["decode_cpu_ms_per_token"],
                             "prefill_x": ll["prefill_s"] / dw["prefill_s"] if args.prefill else None,
                             "prefill_cpu_x": ll["prefill_cpu_s"] / dw["prefill_cpu_s"] if args.prefill else None,
                             "rss_x": dw["peak_rss_gb"] / ll["peak_rss_gb"]}
    summary["plan"] = runs.get("draftwise", [{}])[0].get("plan")
    summary["ceiling"] = ceiling_line(args.path, args.threads, {**summary, "_runs": runs.get("draftwise", [])})
    print(json.dumps(summary, indent=1))
    print(summary["ceiling"])


if __name__ == "__main__":
    main()

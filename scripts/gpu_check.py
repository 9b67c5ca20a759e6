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

4. The static step (issue 37: models/static_step.py, spec_decode/static_spec.py), compiled once per bucket at load
   (CUDA: mode reduce-overhead, i.e. CUDA graphs): versions (device, driver, torch, CUDA), compile time and memory,
   ms per verification width 1..16 and the ratio to one row, the bandwidth floor from a measured copy, tok/s plain /
   n-gram k 4 / n-gram auto / suffix / draft model (a random 0.5B-shaped draft: acceptance near zero, so auto
   falls back to plain), acceptance, outputs equal to plain, concurrency 4, and plain PyTorch references of the
   same shapes (one CUDA graph per width; torch.compile). Runs before step 3.

Usage: python scripts/gpu_check.py [--max-tokens 128] [--out results.json]
       python scripts/gpu_check.py --device cpu --layers 2 --skip-tune --skip-e2e   (the table as a dry run)
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


# ---- the static step's table (issue 37) ---------------------------------------------------------------------
DRAFT = dict(hidden=896, heads=14, kv_heads=2, head_dim=64, intermediate=4864, layers=24)  # the packaged 0.5B
STATIC_CAPACITY = 512


def random_decoder(dims: dict, layers: int, vocab: int, dtype: torch.dtype, device: str, seed: int):
    """A qwen2 Decoder of these shapes with random weights (std 0.02, norms 1, tied head: the real vocab's)."""
    from draftwise.config import ModelConfig
    from draftwise.models.transformer import Decoder

    cfg = ModelConfig("qwen2", vocab, dims["hidden"], dims["intermediate"], layers, dims["heads"], dims["kv_heads"],
                      dims["head_dim"], rope_theta=1e6, attention_bias=True, tie_word_embeddings=True,
                      max_position_embeddings=32768)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Decoder(cfg).named_parameters() if n != "lm_head.weight"}
    g = torch.Generator().manual_seed(seed)

    def tensors():
        for name, shape in shapes.items():
            yield name, torch.ones(shape) if "norm" in name else torch.randn(shape, generator=g) * 0.02

    return Decoder.from_tensors(cfg, tensors(), dtype=dtype, device=device)


def versions(device: str) -> dict:
    import platform
    import subprocess

    v = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    if device == "cuda":
        v["device"] = torch.cuda.get_device_name()
        v["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        try:
            v["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            v["driver"] = None
        v["cudnn"] = torch.backends.cudnn.version()
    else:
        v["device"] = probe(bandwidth=False).get("cpu", platform.processor())
        v["driver"] = "n/a (cpu)"
    return v


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeat: int | None = None) -> float:
    """Median seconds of fn() over `repeat` calls (default: 10 on CUDA, 3 on a CPU dry run) after a warm-up call."""
    repeat = repeat or (10 if device == "cuda" else 3)
    fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: str) -> float:
    """GB/s of a device-to-device copy (read + write counted) of a buffer far larger than the caches."""
    n = (1 << 30 if device == "cuda" else 1 << 28) // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), device, 5) / 1e9


def peak_memory(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated (peak)"
    import resource

    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB RSS (peak)"


def byte_prompts(n: int) -> list[list[int]]:
    """The prompts as byte ids (no tokenizer for random weights; repetitive text stays repetitive)."""
    return [list(p.encode())[:200] for p in PROMPTS[:n]]


def static_table(out: dict, device: str, layers: int, max_tokens: int, compile_mode: str) -> None:
    """Every row of issue 37's table through models/static_step.py + spec_decode/static_spec.py."""
    from draftwise.models.static_step import StaticStep
    from draftwise.spec_decode.static_spec import WIDTH_BUCKETS, StaticSpecDecoder, bucket
    from draftwise.spec_decode.suffix import SuffixProposer

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    section(f"static step: random qwen2.5-coder-1.5b-shaped target ({layers} layers, vocab {TARGET_VOCAB}), "
            f"{dtype}, device {device}, compile {compile_mode}")
    table = out.setdefault("static", {})
    v = versions(device)
    table["versions"] = v
    print("versions: " + ", ".join(f"{k} {v[k]}" for k in ("device", "driver", "torch", "cuda")))
    t0 = time.perf_counter()
    target = random_decoder(TARGET, layers, TARGET_VOCAB, dtype, device, 0)
    draft = random_decoder(DRAFT, layers, TARGET_VOCAB, dtype, device, 1)
    print(f"built the random target and 0.5B-shaped draft in {time.perf_counter() - t0:.1f} s")
    step = StaticStep(target, 4, STATIC_CAPACITY, "sdpa")
    draft_step = StaticStep(draft, 4, STATIC_CAPACITY, "sdpa")
    # compiled once per bucket at load: the model forward of both steps (the step's glue around it is tensor ops)
    if compile_mode != "none":
        step.compile(None if compile_mode == "default" else compile_mode)
        draft_step.compile(None if compile_mode == "default" else compile_mode)
    compile_s = {}
    t_load = time.perf_counter()
    for batch in (1, 4):
        for width in WIDTH_BUCKETS:
            ids = torch.zeros(batch, width, dtype=torch.int64, device=device)
            pos = torch.arange(width, device=device)[None].repeat(batch, 1)
            slots = torch.full((batch,), step.scratch_slot, device=device)
            t0 = time.perf_counter()
            step(ids, pos, slots)
            sync(device)
            compile_s[f"target B{batch} W{width}"] = time.perf_counter() - t0
        for width in (1, 2):
            ids = torch.zeros(batch, width, dtype=torch.int64, device=device)
            pos = torch.arange(width, device=device)[None].repeat(batch, 1)
            t0 = time.perf_counter()
            draft_step(ids, pos, torch.full((batch,), draft_step.scratch_slot, device=device))
            sync(device)
            compile_s[f"draft B{batch} W{width}"] = time.perf_counter() - t0
    load_s = time.perf_counter() - t_load
    table["compile"] = {"seconds_total": load_s, "per_bucket": compile_s, "memory": peak_memory(device)}
    print(f"compile (first call per bucket, {len(compile_s)} buckets): {load_s:.1f} s in all, slowest "
          f"{max(compile_s.values()):.1f} s; memory {peak_memory(device)}")

    # ms per verification width (batch 1), the model step alone
    section("static step: ms per forward by width (batch 1; a width runs in its bucket)")
    costs = {}
    for w in WIDTH_BUCKETS:
        ids = torch.zeros(1, w, dtype=torch.int64, device=device)
        pos = torch.arange(w, device=device)[None] + 8
        costs[w] = timed(lambda: step(ids, pos, torch.tensor([0], device=device)), device) * 1e3
    rows = {}
    for w in range(1, 17):
        b = bucket(w, WIDTH_BUCKETS)
        rows[w] = {"bucket": b, "ms": costs[b], "x_one_row": costs[b] / costs[1]}
        print(f"width {w:>2} (bucket {b:>2}): {costs[b]:8.3f} ms  {costs[b] / costs[1]:5.2f}x one row")
    table["widths"] = rows
    weight_bytes = sum(p.numel() * p.element_size() for n, p in target.named_parameters()
                       if n != "model.embed_tokens.weight" or target.config.tie_word_embeddings)
    bw = copy_bandwidth(device)
    floor = weight_bytes / (bw * 1e9) * 1e3
    table["bandwidth"] = {"copy_GBs": bw, "weight_bytes": weight_bytes, "floor_ms": floor}
    print(f"bandwidth floor: {weight_bytes / 2**30:.2f} GiB of weights per token / {bw:.0f} GB/s measured copy "
          f"= {floor:.3f} ms per token; plain step {costs[1]:.3f} ms = {costs[1] / floor:.1f}x the floor")

    # end to end: tok/s per method (batch 1, prompt by prompt), acceptance, equality with plain
    section(f"static step: greedy decoding, {max_tokens} tokens per prompt, tok/s (median of prompts)")
    prompts = byte_prompts(4)
    methods = [("plain", None, 0, {}), ("ngram k4", "ngram", 4, {}), ("ngram auto", "ngram", "auto", {}),
               ("suffix k8", "host", 8, {"proposer": SuffixProposer()}),
               ("draft model k4", "draft_model", 4, {"draft": draft_step}),
               ("draft model auto", "draft_model", "auto", {"draft": draft_step})]
    runs, plain = {}, None
    for label, method, k, extra in methods:
        runner = StaticSpecDecoder(step, (), method, k if method else 4, **extra)
        if k == "auto":  # (a CPU dry run times batch 1 once: the draft's rounds are slow there)
            runner.calibrate(batches=(1, 4), rounds=3) if device == "cuda" else runner.calibrate(batches=(1,), rounds=1)
        outs, rates = [], []
        for p in prompts:
            t0 = time.perf_counter()
            o = runner.generate([p], max_tokens)[0]
            sync(device)
            rates.append(len(o) / (time.perf_counter() - t0))
            outs.append(o)
        acc = runner.num_accepted / runner.num_guessed if runner.num_guessed else None
        same = None if plain is None else sum(a == b for a, b in zip(outs, plain))
        plain = plain or outs
        tps = statistics.median(rates)
        runs[label] = {"tok_s": tps, "acceptance": acc, "equal_to_plain": same,
                       "ms_per_token": 1e3 / tps}
        print(f"{label:<17} {tps:9.1f} tok/s  {1e3 / tps:8.3f} ms/token"
              + ("" if acc is None else f"  acceptance {acc:.2f}")
              + ("" if same is None else f"  {same}/{len(outs)} outputs equal to plain"), flush=True)
    base = runs["plain"]["tok_s"]
    print("ratios to plain: " + ", ".join(f"{k} {r['tok_s'] / base:.2f}x" for k, r in runs.items()))
    table["generate"] = runs

    section("static step: concurrency 4 (4 prompts at once, aggregate output tok/s)")
    conc = {}
    for label, method, k in (("plain", None, 4), ("ngram k4", "ngram", 4)):
        runner = StaticSpecDecoder(step, (), method, k)
        t0 = time.perf_counter()
        outs = runner.generate(prompts, max_tokens)
        sync(device)
        conc[label] = sum(map(len, outs)) / (time.perf_counter() - t0)
        print(f"{label:<17} {conc[label]:9.1f} tok/s aggregate")
    table["concurrency_4"] = conc

    reference_rows(table, device, layers, dtype, compile_mode)


def reference_rows(table: dict, device: str, layers: int, dtype: torch.dtype, compile_mode: str) -> None:
    """Plain PyTorch (no draftwise code): the same shapes, a static cache, one forward per width; captured as one
    CUDA graph per width, and through torch.compile. ms per token at widths 1 and 9 (batch 1)."""
    import torch.nn.functional as F

    section("reference: plain PyTorch, same shapes, static cache (ms per forward, batch 1)")
    d, L, V = TARGET, layers, TARGET_VOCAB
    g = torch.Generator().manual_seed(2)
    w = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).to(device=device, dtype=dtype)  # noqa: E731
    H, Hkv, D, C = d["heads"], d["kv_heads"], d["head_dim"], STATIC_CAPACITY
    layers_w = [dict(qkv=w((H + 2 * Hkv) * D, d["hidden"]), o=w(d["hidden"], H * D),
                     gu=w(2 * d["intermediate"], d["hidden"]), down=w(d["hidden"], d["intermediate"]))
                for _ in range(L)]
    embed = w(V, d["hidden"])
    kc = [torch.zeros(1, Hkv, C, D, device=device, dtype=dtype) for _ in range(L)]
    vc = [torch.zeros(1, Hkv, C, D, device=device, dtype=dtype) for _ in range(L)]
    kpos = torch.arange(C, device=device)

    def forward(ids, pos):  # ids, pos [1, T]
        x = embed[ids]
        T = ids.shape[1]
        for lw, k_cache, v_cache in zip(layers_w, kc, vc):
            h = F.rms_norm(x, (x.shape[-1],))
            q, k, v = F.linear(h, lw["qkv"]).split((H * D, Hkv * D, Hkv * D), -1)
            q = q.view(1, T, H, D).transpose(1, 2)
            k_cache.index_copy_(2, pos[0], k.view(1, T, Hkv, D).transpose(1, 2))
            v_cache.index_copy_(2, pos[0], v.view(1, T, Hkv, D).transpose(1, 2))
            mask = kpos <= pos[0, :, None]
            a = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)
            x = x + F.linear(a.transpose(1, 2).reshape(1, T, -1), lw["o"])
            gu = F.linear(F.rms_norm(x, (x.shape[-1],)), lw["gu"])
            gate, up = gu.chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, lw["down"])
        return F.linear(F.rms_norm(x, (x.shape[-1],)), embed)

    ref = {}
    with torch.no_grad():
        for width in (1, 9):
            ids = torch.zeros(1, width, dtype=torch.int64, device=device)
            pos = torch.arange(width, device=device)[None] + 8
            ref[f"eager W{width}"] = timed(lambda: forward(ids, pos), device) * 1e3
            if device == "cuda":
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(3):
                        forward(ids, pos)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    forward(ids, pos)
                ref[f"cuda graph W{width}"] = timed(graph.replay, device) * 1e3
            else:
                ref[f"cuda graph W{width}"] = None
            if compile_mode != "none":
                torch._dynamo.reset()
                compiled = torch.compile(forward, fullgraph=True, dynamic=False)
                ref[f"torch.compile W{width}"] = timed(lambda: compiled(ids, pos), device) * 1e3
            else:
                ref[f"torch.compile W{width}"] = None
    for key, ms in ref.items():
        print(f"{key:<20} " + (f"{ms:8.3f} ms" if ms is not None else
                               "n/a (" + ("no CUDA" if "graph" in key else "--compile none") + ")"))
    table["reference"] = ref


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the numbers here as JSON")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--skip-tune", action="store_true")
    ap.add_argument("--skip-static", action="store_true", help="skip the static step's table (issue 37)")
    ap.add_argument("--compile", default=None, choices=["none", "default", "reduce-overhead"],
                    help="how the static step is compiled (default: reduce-overhead on cuda, none on cpu)")
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
        if not args.skip_static:
            mode = args.compile or ("reduce-overhead" if args.device == "cuda" else "none")
            static_table(out, args.device, args.layers, args.max_tokens, mode)
        if not args.skip_e2e:
            end_to_end(out, args.max_tokens, args.device, args.layers, not args.no_profile)
    finally:
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1, default=str))
        cache.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

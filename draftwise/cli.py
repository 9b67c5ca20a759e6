"""Command line: argparse (dashes) → config values (underscores) → api / server / bench / equivalence.

Owns argument parsing, printing and exit codes; user errors (ConfigError and friends) print one line on stderr
and exit 2 without a traceback. The work itself lives in the modules each sub-command calls; flags shared by several commands live in
cli_args.py, and each subsystem's commands in its package's cli.py (server/cli.py, bench/cli.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from draftwise.bench import cli as bench_cli
from draftwise.cli_args import (add_model_args, add_sampling_args, llm_from_args, plan_lines, sampling_from_args,
                                weights_arg)
from draftwise.config import ConfigError
from draftwise.models.catalog import DEFAULT_TARGET
from draftwise.server import cli as server_cli

# ---- generate -----------------------------------------------------------------------------------
def cmd_generate(args) -> int:
    if (args.prompt is None) == (args.messages is None):
        raise ConfigError("give exactly one of --prompt TEXT or --messages JSON")
    params = sampling_from_args(args)
    if args.json_schema is not None:
        params = dataclasses.replace(params, structured_outputs={"json": _read_json_schema(args.json_schema)})
    llm = llm_from_args(args)
    if args.messages is not None:
        try:
            messages = json.loads(args.messages)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--messages is not valid JSON: {e}") from None
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ConfigError('--messages must be a JSON list of {"role": ..., "content": ...} objects')
        prompt = {"prompt_token_ids": llm.tokenizer.encode_chat(messages)}
    else:
        prompt = args.prompt
    final = None
    for item in llm.stream(prompt, params):
        if isinstance(item, str):
            if not args.json:
                sys.stdout.write(item)
                sys.stdout.flush()
        else:
            final = item
    if args.json:
        out = final.outputs[0]
        print(json.dumps({
            "text": out.text, "prompt_ids": final.prompt_token_ids, "output_ids": out.token_ids,
            "num_prompt_tokens": len(final.prompt_token_ids), "num_output_tokens": len(out.token_ids),
            "ttft_s": final.ttft_s, "total_s": final.total_s, "tokens_per_s": final.tokens_per_s,
            "finish_reason": out.finish_reason, "spec": final.spec,
            "model": {k: llm.model_info.get(k) for k in ("name", "weights", "dtype", "plan")},
            "draft": ({k: llm.draft_info.get(k) for k in ("name", "weights", "dtype", "plan")}
                      if llm.draft_info else None),
            "kv_cache_dtype": str(llm.kv_cache_dtype).removeprefix("torch."),  # as --kv-cache-dtype auto picked it
        }))
    else:
        sys.stdout.write("\n")
        print("\n".join(plan_lines(llm)), file=sys.stderr)
    return 0


def _read_json_schema(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ConfigError(f"--json-schema: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--json-schema: {path} is not valid JSON: {e}") from None


def cmd_models(args) -> int:
    from draftwise.paths import default_cache_dir
    from draftwise.models.catalog import list_models

    rows = list_models(default_cache_dir())
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        status = "assembled" if r["assembled"] else "installed" if r["installed"] else "not installed"
        print(f"{r['name']:30s} {r['architecture']:7s} {r['size'] / 1e9:5.2f} GB  {status:13s} {r['description']}")
    return 0


# ---- kernels / env --------------------------------------------------------------------------------
def cmd_env(args) -> int:
    import torch

    from draftwise.kernels.probe import cuda_probe, format_probe, probe

    p = probe(bandwidth=not args.no_bandwidth)
    gpu = cuda_probe(bandwidth=not args.no_bandwidth) if torch.cuda.is_available() else None
    if args.json:
        print(json.dumps(p if gpu is None else {**p, "cuda": gpu}))
    else:
        print(format_probe(p) + ("" if gpu is None else "\n" + format_probe(gpu)))
    return 0


def cmd_kernels(args) -> int:
    """The probe, the autotuner's timing table on the model's real shapes, and its choice (cached per machine)."""
    import torch

    from draftwise.kernels import autotune
    from draftwise.kernels.probe import format_probe
    from draftwise.api import check_device
    from draftwise.models.sources import load_checkpoint

    check_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.model)
    cfg = ckpt.config  # config and tokenizer only: no weights are read
    result = autotune.autotune(autotune.shapes_from_config(cfg), refresh=args.refresh, fast=not args.full,
                               device=args.device)
    if args.json:
        print(json.dumps(result))
        return 0
    print(format_probe(autotune.run_probe(args.device)))
    print(f"model {args.model}: {len(cfg.layer_types) or cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{'trimmed load-time tuning (as --weights auto runs it)' if not args.full else 'full sweep'}; "
          f"cache key {result['key']}")
    print(autotune.format_table(result["table"], result["choice"]))
    if args.device == "cpu":  # q4x8's prefill side: the GEMV against the wide (AMX) GEMM at prompt widths
        from draftwise.kernels import q4x8

        try:
            print(q4x8.format_prefill_table(q4x8.prefill_table(autotune.shapes_from_config(cfg))))
        except q4x8.KernelBuildError as e:
            print(f"q4x8 prefill table: the kernel cannot run here ({e})")
        try:  # every kernel's wide side and switch width (kernels/blocktypes.py's rows with one)
            from draftwise.kernels import library

            print(library.format_wide_sides(library.wide_sides()))
        except q4x8.KernelBuildError as e:
            print(f"wide sides: the kernels cannot run here ({e})")
    busy = [v for v in (result.get("busy_before"), result.get("busy_cores")) if v is not None]
    print(f"{'read from the cache; ' if result.get('cached') else ''}timed {result.get('measured_at', '?')}"
          + (f" with {max(busy):.1f} other cores busy" if busy else "")
          + ("; PROVISIONAL: timed under load, re-timed at the next quiet start (or --refresh)"
             if result.get("provisional") else ""))
    print(_faithful_note(ckpt, cfg, list(result["table"]["ms"])))
    if not args.no_step_cost:
        print(_step_cost_grids(args))
    return 0


def _step_cost_grids(args) -> str:
    """The step-cost grids the adaptive k policy reads (kernels/step_cost.py): the model's (a verification: every
    row's logits) and, with --draft, the draft's (its forwards: each row's last logits), read from the per-machine
    cache or measured now (loads the weights: --weights auto's plan)."""
    from draftwise.api import load_model
    from draftwise.kernels import step_cost

    out = []
    for name, role, logits in [(args.model, "target", "all")] + ([(args.draft, "draft", "last")] if args.draft else []):
        model, _, _ = load_model(name, device=args.device, role=role)
        grid = step_cost.load_or_measure(model, logits=logits, refresh=args.refresh)
        out.append(step_cost.format_grid(grid, f"step cost, {role} {name} ({model.plan.label})"))
    return "\n".join(out)


def _faithful_note(ckpt, cfg, candidates: list[str]) -> str:
    """For a quantized GGUF: what `auto` runs (every tensor as stored) and which timed candidates are lossy, each
    with its KL from the last `draftwise quality` run on this file where one was recorded (nothing is measured)."""
    from draftwise.bench.quality import recorded
    from draftwise.kernels.plan import KernelPlan, faithful_by_default
    from draftwise.models.quant import type_census

    types = ckpt.tensor_types() if "converted_path" in ckpt.info else None
    census = type_census(types, cfg) if types else None
    if not faithful_by_default(census):
        return "a dense checkpoint: --weights auto takes the choice above"
    faithful = KernelPlan("q4x8", "q4x8", "float32", faithful=True, stored_types=census)
    kl = recorded(ckpt.info["path"]) if ckpt.info.get("path") else {}

    def measured(label: str) -> str:
        r = kl.get(label)
        return (f"mean KL {r['mean_kl']:.5f}, p99 {r['p99_kl']:.4f}, top-1 {100 * r['top1_agreement']:.1f}% against "
                f"the file's dense model (draftwise quality, {r['measured_at']})") if r else ""

    lines = [f"this GGUF stores {faithful.types_text().replace('->', ' -> ')}: --weights auto runs the faithful plan "
             "(each tensor by the kernel of its stored type), not the table's choice"
             + (f"; {measured('faithful')}" if measured("faithful") else "")]
    if faithful.fallback_types:  # kernels/blocktypes.py: stored types no kernel holds, with what the fallback costs
        lines.append(f"SLOW PATH: no kernel of its own for {faithful.fallback_text()}")
    for name in candidates:
        lossy = KernelPlan(name, name, "float32", stored_types=census).lossy_types
        if lossy:
            lines.append(f"{name}: LOSSY here (requantizes the file's {', '.join(lossy)} tensors); "
                         + (measured(name) or f"`draftwise quality --weights auto,{name}` measures the cost in KL"))
    return "\n".join(lines)


def register_kernels(sub) -> None:
    e = sub.add_parser("env", help="what this machine can do: instruction sets, threads, memory bandwidth")
    e.add_argument("--no-bandwidth", action="store_true", help="skip the ~0.5 s bandwidth measurement")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_env)
    k = sub.add_parser("kernels", help="time the linear-layer kernels on a model's shapes; print the table and "
                                       "the choice --weights auto uses")
    k.add_argument("--model", default=DEFAULT_TARGET, help="catalog name, .gguf file or HF checkpoint dir")
    k.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    k.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="time this device's kernels")
    k.add_argument("--full", action="store_true", help="every implementation at rows 1,2,4,8,16,128 (slower)")
    k.add_argument("--refresh", action="store_true", help="measure again instead of reading the cache")
    k.add_argument("--json", action="store_true")
    k.add_argument("--draft", default=None, help="also print this draft model's step-cost grid")
    k.add_argument("--no-step-cost", action="store_true",
                   help="skip the step-cost grid (ms per step, B 1..8 x width 1..16; loads the model's weights)")
    k.set_defaults(func=cmd_kernels)


# ---- verify -------------------------------------------------------------------------------------
def cmd_equivalence(args) -> int:
    from draftwise.equivalence import ALPHA, DEFAULT_PROMPTS, greedy_check, load_prompts, sampling_check
    from draftwise.sampling import SamplingParams

    llm = llm_from_args(args)
    if not llm.spec_config.enabled:
        raise ConfigError("verify needs --speculative-config (what would it compare?)")
    texts = load_prompts(args.prompts) if args.prompts else DEFAULT_PROMPTS
    prompts = [llm.tokenizer.encode(t) for t in texts]
    cases = greedy_check(llm, prompts, texts, args.max_tokens)
    print(f"(a) greedy: {len(cases)} prompts x {args.max_tokens} tokens, "
          f"{json.dumps(llm.spec_config.to_dict())} vs plain, dtype {args.dtype}")
    for c in cases:
        verdict = "identical" if c.identical else f"DIVERGED at output token {c.position}, top-2 margin {c.margin:.4f}"
        print(f"  {verdict:60s} {c.prompt[:50]!r}")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    result = sampling_check(llm, prompts[0], args.samples, params)
    print(f"(b) sampling: {result['test']}; {result['samples']} seeds, {result['cells']} cells, "
          f"chi2 = {result['statistic']:.2f}, p = {result['p_value']:.4f}, alpha = {ALPHA} -> "
          f"{'PASS' if result['passed'] else 'FAIL'}")
    greedy_ok = all(c.identical or (c.margin is not None and c.margin < 1e-3) for c in cases)
    summary = {"greedy": [c.__dict__ for c in cases], "sampling": result, "passed": greedy_ok and result["passed"]}
    print(json.dumps(summary))
    return 0 if summary["passed"] else 1


def register_equivalence(sub) -> None:
    v = sub.add_parser("verify", help="check that speculation preserves the target (greedy + sampling)")
    add_model_args(v)
    v.add_argument("--prompts", default=None, help="JSONL file with a \"prompt\" per line")
    v.add_argument("--max-tokens", type=int, default=32)
    v.add_argument("--samples", type=int, default=400, help="seeded samples for the distribution test")
    v.add_argument("--temperature", type=float, default=1.0)
    v.add_argument("--top-p", type=float, default=1.0)
    v.add_argument("--top-k", type=int, default=0)
    v.set_defaults(func=cmd_equivalence)


# ---- quality ------------------------------------------------------------------------------------
def cmd_quality(args) -> int:
    from draftwise.bench.quality import format_quality, quality

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    for w in weights + ([args.reference] if args.reference != "dense" else []):
        weights_arg(w)
    result = quality(args.model, weights, args.reference, args.text, args.tokens, not args.no_llama_cpp,
                     args.threads)
    print(json.dumps(result) if args.json else format_quality(result))
    return 0


def register_quality(sub) -> None:
    q = sub.add_parser("quality", help="mean / p99 KL, top-1 agreement and perplexity of plans against the file's "
                                       "dense model (--weights fp32), and llama.cpp's when importable")
    q.add_argument("--model", default=DEFAULT_TARGET, help="catalog name, .gguf file or HF checkpoint dir")
    q.add_argument("--weights", default="auto", help="comma-separated plans to measure, e.g. auto,q4x8")
    q.add_argument("--reference", default="dense",
                   help="dense (default: the file's float32 weights rebuilt per layer from its blocks, 1/4 of fp32's "
                        "memory) or a --weights plan such as fp32")
    q.add_argument("--text", default=None, help="a UTF-8 text file (default: the shipped ~1k-token code + prose)")
    q.add_argument("--tokens", type=int, default=1024, help="tokens of the text to score")
    q.add_argument("--threads", type=int, default=None, help="torch (and llama.cpp) CPU threads")
    q.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even when llama_cpp is importable")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_quality)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="draftwise", description="Local LLM engine with speculative decoding")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt (streams; --json for one JSON object)")
    add_model_args(g)
    g.add_argument("--prompt", default=None)
    g.add_argument("--messages", default=None, help='chat messages as JSON: [{"role":"user","content":"..."}]')
    add_sampling_args(g)
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain the output to this JSON schema (structured outputs; the output always parses "
                        "and validates, or finish_reason says length)")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list the packaged models and what is installed")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)

    register_equivalence(sub)
    register_kernels(sub)
    register_quality(sub)
    server_cli.register(sub)
    bench_cli.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

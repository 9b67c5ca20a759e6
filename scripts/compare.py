"""Side by side in one run: draftwise configurations, llama.cpp (llama-cpp-python) plain and prompt
lookup, HF transformers plain and assisted generation — same GGUF file, same prompt token ids, same threads,
greedy, same output limit. Not a test; llama-cpp-python and transformers are optional (`pip install -e
.[compare]`); a missing one is skipped and said so.

Interleaved, because a shared machine's speed drifts (we have seen +-30% within minutes): every engine is loaded
first, then for each round and each prompt every engine runs that prompt, in an order rotated per prompt, so
each engine's run of a prompt sits next to llama.cpp plain's run of the same prompt. Reported per workload
group: output tok/s per request (output tokens / end-to-end seconds, prefill included; median over prompts x
rounds) and the median of the PAIRED ratios to llama.cpp plain (same prompt, same round), with their min-max.

    .venv/bin/python scripts/compare.py --groups repeated,chat --per-group 3 --rounds 2 --max-tokens 128

Without --ours it runs draftwise's defaults (`--dtype auto --weights auto`: the kernels the autotuner picked on
this machine) plain, with n-gram lookup and with the draft model (the draft on its default plan: the autotuner's
fastest, lossy allowed, since a draft's precision never changes the output), and with adaptive k, all on
one loaded model (LLM.set_speculation switches between them). --formats adds fixed weight formats (each loaded
once, plain and with each --format-spec) beside auto for the "auto vs the best fixed format" table. On a GGUF,
auto is the faithful plan (every tensor as the file stores it); --lossy (default q4x8: every linear requantized to
4 bits, today's speed at the file's quality cost) adds that plan plain, with n-gram k=auto and with its draft on
the same lossy plan, labelled "(lossy)", so the table shows what faithfulness costs (`draftwise quality` shows what
it buys). The machine probe (instruction sets, measured memory bandwidth) is printed beside the tables.
    .venv/bin/python scripts/compare.py --skip llamacpp,hf --formats q4x8,int4,bf16

After the table, the roofline of plain decoding: a `ceiling` line per weight layout (the bytes one decode step
reads, draftwise/bench/memory.py's step bytes, the definition scripts/moe_vs_llamacpp.py prints too: every weight
tensor of the layers, a mixture's experts for their top-k share, the output head and one embedding row, as the GGUF
stores them, which llama.cpp reads as they are, or as each loaded draftwise plan holds them; the K/V cache left
out, a few MB at these lengths) divided into the probe's streaming-read bandwidth at the run's threads (`stream_gbs`; the
torch matvec's `bandwidth_gbs` where no C compiler built the streaming read) gives the tok/s no engine can pass
on that layout with plain decoding; each engine's measured rate is printed as % of its own layout's ceiling
(speculative rows may pass 100%: they take several tokens per read of the weights; prefill is inside the measured
rate, so plain rows sit a little under their decode-only share).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftwise.bench.memory import file_step_bytes, plan_step_bytes
from draftwise.bench.workloads import load_workload



def item_ids(tok, item) -> list[int]:
    if item.prompt is not None:
        return tok.encode(item.prompt)
    return tok.encode_chat(item.messages or [{"role": "user", "content": item.turns[0]}])


@dataclass
class Runner:
    name: str
    run: Callable[[list[int]], int]  # prompt ids -> output tokens generated (greedy, max_tokens)
    rates: dict = field(default_factory=dict)  # (group, prompt index, round) -> output tok/s
    layout: str | None = None  # whose bytes a decode step of this engine reads (a key of the ceiling's layouts)

    def timed(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        n = self.run(ids)
        return n / (time.perf_counter() - t0)


def ours(llm_cache: dict, model: str, conf: dict, max_tokens: int, threads: int) -> Runner:
    from draftwise import LLM, SamplingParams

    fmt = (conf.get("dtype", "auto"), conf.get("weights", "auto"))
    if fmt not in llm_cache:
        # no prefix cache: every run prefills its whole prompt, as llama.cpp does after its reset()
        llm_cache[fmt] = LLM(model, dtype=fmt[0], weights=fmt[1], threads=threads, max_num_seqs=1,
                             max_model_len=2048, k_max=16, enable_prefix_caching=False)
    llm = llm_cache[fmt]
    spec_config = conf.get("spec")
    llm.set_speculation(spec_config)  # builds (and calibrates) the proposer now, not inside the first timed run
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def run(ids):
        llm.set_speculation(spec_config)
        return llm.generate([{"prompt_token_ids": ids}], params)[0].num_output_tokens

    return Runner(conf.get("name", json.dumps(conf)), run, layout=f"draftwise {fmt[1]} (dtype {fmt[0]})")


def ceiling(runners: list["Runner"], groups: list[str], layouts: dict[str, tuple[int, str]], probe: dict,
            threads: int) -> dict:
    """Print the roofline of plain decoding per layout (bytes a step reads / streaming-read bandwidth) and each
    engine's measured rate per group as % of its layout's ceiling; returns the same as a dict."""
    gbs, how = ((probe["stream_gbs"], "streaming sum in C") if "stream_gbs" in probe
                else (probe["bandwidth_gbs"], "torch matvec"))
    out = {"read_gbs": gbs, "read_measured_by": how, "threads": threads, "layouts": {}, "engines": {}}
    print(f"\nceiling: memory read {gbs:.1f} GB/s ({how}, {threads} threads, measured at the start of this run); "
          f"bytes one decode step reads (bench/memory.py step bytes; K/V not counted):")
    for name, (nbytes, what) in layouts.items():
        tok_s = gbs * 1e9 / nbytes
        out["layouts"][name] = {"bytes": nbytes, "what": what, "ceiling_tok_s": tok_s}
        print(f"ceiling  {name:36s} {nbytes / 1e9:6.3f} GB -> {tok_s:6.2f} tok/s  ({what})")
    for r in runners:
        if r.layout not in layouts:
            continue
        top = out["layouts"][r.layout]["ceiling_tok_s"]
        cells = {g: statistics.median(v for k, v in r.rates.items() if k[0] == g) / top for g in groups}
        out["engines"][r.name] = {"layout": r.layout, **{g: c for g, c in cells.items()}}
        print(f"  {r.name:42s} of {r.layout:36s}" + "".join(f"  {g} {100 * c:5.1f}%" for g, c in cells.items()))
    return out


def llamacpp(path: str, max_tokens: int, threads: int, lookup: int | None) -> Runner:
    from llama_cpp import Llama

    kw = {}
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False, **kw)

    def run(ids):
        llm.reset()
        r = llm.create_completion(ids, max_tokens=max_tokens, temperature=0.0, top_k=1)
        return r["usage"]["completion_tokens"]

    return Runner(f"llama.cpp prompt lookup k={lookup}" if lookup else "llama.cpp plain", run, layout="file (llama.cpp)")


def hf_runner(name: str, hf, max_tokens: int, **gen_kw) -> Runner:
    kw = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0, **gen_kw)

    def run(ids):
        x = torch.tensor([ids])
        with torch.inference_mode():
            return hf.generate(x, attention_mask=torch.ones_like(x), **kw).shape[1] - x.shape[1]

    return Runner(name, run)


def hf_from(model_name: str, dtype: torch.dtype):
    """HF transformers model with the GGUF's config and draftwise's converted tensors (identical weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from draftwise.api import load_model

    ours_model, _, info = load_model(model_name, "float32")
    folder, file = info["path"].rsplit("/", 1)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=file), dtype=dtype).eval()
    hf.load_state_dict(ours_model.state_dict(), strict=False)
    hf.tie_weights()
    return hf, info["path"]


def interleave(runners: list[Runner], prompts: dict[str, list[list[int]]], rounds: int) -> None:
    """Every runner runs every prompt once per round, the order rotated per (round, prompt)."""
    for r in runners:  # warm-up: first-call costs (thread pools, caches) stay out of the table
        r.timed(next(iter(prompts.values()))[0])
    jobs = [(g, i, ids) for g, plist in prompts.items() for i, ids in enumerate(plist)]
    for rnd in range(rounds):
        for j, (g, i, ids) in enumerate(jobs):
            shift = (rnd * len(jobs) + j) % len(runners)
            for r in runners[shift:] + runners[:shift]:
                r.rates[(g, i, rnd)] = r.timed(ids)
            print(f"  round {rnd + 1}/{rounds}, {g} prompt {i + 1}: "
                  + ", ".join(f"{r.name} {r.rates[(g, i, rnd)]:.1f}" for r in runners), flush=True)


def table(runners: list[Runner], groups: list[str], ref: Runner | None) -> dict:
    out = {}
    print(f"{'engine':44s}" + "".join(f"{g:>34s}" for g in groups))
    for r in runners:
        cells, out[r.name] = "", {}
        for g in groups:
            keys = [k for k in r.rates if k[0] == g]
            rate = statistics.median(r.rates[k] for k in keys)
            out[r.name][g] = {"tok_s": rate}
            if ref is None:
                cells += f"{rate:14.2f}" + " " * 20
                continue
            ratios = sorted(r.rates[k] / ref.rates[k] for k in keys)
            med = statistics.median(ratios)
            out[r.name][g].update(ratio=med, ratio_min=ratios[0], ratio_max=ratios[-1])
            cells += f"{rate:14.2f} {med:5.2f}x [{ratios[0]:4.2f},{ratios[-1]:4.2f}]"
        print(f"{r.name:44s}{cells}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--groups", default="repeated,chat")
    ap.add_argument("--per-group", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="each prompt runs this many times per engine")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ours", action="append", default=[], help="JSON: name, dtype, weights, spec")
    ap.add_argument("--formats", default="", help="comma list of fixed --weights values beside auto (e.g. q4x8,int4,bf16,"
                                                 "q4x8+bf16), each with --dtype auto")
    ap.add_argument("--format-spec", action="append", default=[],
                    help="JSON spec config each --formats entry also runs (default: ngram with --lookup-k)")
    ap.add_argument("--lossy", default="q4x8", help="a lossy --weights plan run beside auto (faithful on a GGUF), "
                                                    "plain, n-gram k=auto and draft k=auto; '' for none")
    ap.add_argument("--lookup-k", type=int, default=4)
    ap.add_argument("--skip", default="", help="comma list of: llamacpp,lookup (llama.cpp's prompt lookup only),hf")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from draftwise.kernels.probe import format_probe, probe
    from draftwise.models.sources import load_checkpoint

    machine_probe = probe()
    machine = format_probe(machine_probe)
    print(machine, flush=True)
    ckpt = load_checkpoint(args.model)
    tok, info = ckpt.tokenizer, ckpt.info
    draft = {"method": "draft_model", "model": args.draft}
    ngram = {"method": "ngram", "num_speculative_tokens": args.lookup_k}
    if not args.ours:
        args.ours = [json.dumps(c) for c in (
            {"name": "draftwise auto plain"},
            {"name": f"draftwise auto ngram k={args.lookup_k}", "spec": ngram},
            {"name": "draftwise auto ngram k=auto", "spec": {"method": "ngram", "num_speculative_tokens": "auto"}},
            {"name": "draftwise auto draft k=4", "spec": {**draft, "num_speculative_tokens": 4}},
            {"name": "draftwise auto draft k=auto", "spec": {**draft, "num_speculative_tokens": "auto"}},
        )]
    if args.lossy:
        lossy = {"dtype": "auto", "weights": args.lossy}
        args.ours += [json.dumps(c) for c in (
            {"name": f"draftwise {args.lossy} (lossy) plain", **lossy},
            {"name": f"draftwise {args.lossy} (lossy) ngram k=auto", **lossy,
             "spec": {"method": "ngram", "num_speculative_tokens": "auto"}},
            {"name": f"draftwise {args.lossy} (lossy) draft k=auto", **lossy,
             "spec": {**draft, "num_speculative_tokens": "auto", "draft_weights": args.lossy}},
        )]
    specs = [json.loads(s) for s in args.format_spec] or [ngram]
    for fmt in [f for f in args.formats.split(",") if f]:
        base = {"dtype": "auto", "weights": fmt}
        args.ours.append(json.dumps({"name": f"draftwise {fmt} plain", **base}))
        for s in specs:
            label = f"{s['method']} k={s.get('num_speculative_tokens')}"
            args.ours.append(json.dumps({"name": f"draftwise {fmt} {label}", **base, "spec": s}))

    groups = args.groups.split(",")
    items = [i for w in ("code", "chat") for i in load_workload(w).items if i.group in groups]
    prompts = {g: [item_ids(tok, i) for i in items if i.group == g][: args.per_group] for g in groups}
    skip = set(args.skip.split(","))
    runners: list[Runner] = []
    if "llamacpp" not in skip:
        try:
            runners.append(llamacpp(info["path"], args.max_tokens, args.threads, None))
            if "lookup" not in skip:
                runners.append(llamacpp(info["path"], args.max_tokens, args.threads, args.lookup_k))
        except ImportError as e:
            print(f"llama.cpp skipped: {e}")
    llms: dict = {}
    for conf in args.ours:
        c = json.loads(conf)
        print(f"  loading: {c.get('name', conf)}", flush=True)
        runners.append(ours(llms, args.model, c, args.max_tokens, args.threads))
        llm = llms[(c.get('dtype', 'auto'), c.get('weights', 'auto'))]
        print(f"    plan: {llm.model.plan.describe()}", flush=True)
        if c.get("spec", {}).get("method") == "draft_model" and llm.draft_info:
            print(f"    draft plan: {llm.draft_info['plan']['summary']}", flush=True)
    if "hf" not in skip:
        hf, _ = hf_from(args.model, torch.bfloat16)
        runners.append(hf_runner("transformers bf16 plain", hf, args.max_tokens))
        runners.append(hf_runner(f"transformers bf16 prompt lookup k={args.lookup_k}", hf, args.max_tokens,
                                 prompt_lookup_num_tokens=args.lookup_k))
        hf_draft, _ = hf_from(args.draft, torch.bfloat16)
        runners.append(hf_runner("transformers bf16 assisted (0.5B draft)", hf, args.max_tokens,
                                 assistant_model=hf_draft))
    interleave(runners, prompts, args.rounds)

    ref = next((r for r in runners if r.name == "llama.cpp plain"), None)
    if ref is None:  # no llama.cpp: ratios against our auto plain
        ref = next((r for r in runners if r.name == "draftwise auto plain"), None)
    print("\n" + machine)
    print(f"{args.model} ({info['path'].rsplit('/', 1)[-1]}), {args.threads} threads, greedy, {args.max_tokens} "
          f"output tokens, {args.per_group} prompts/group x {args.rounds} rounds, interleaved; output tok/s per "
          f"request (median) and the median [min, max] of paired ratios vs {ref.name if ref else '-'}")
    results = table(runners, groups, ref)
    layouts = {}
    if info["path"].endswith(".gguf"):
        stored = file_step_bytes(info["path"])
        layouts["file (llama.cpp)"] = (stored.total, stored.what)
    for (dtype, weights), llm in llms.items():
        layouts[f"draftwise {weights} (dtype {dtype})"] = (plan_step_bytes(llm.model),
                                                          f"as packed: {llm.model.plan.describe()}")
    roof = ceiling(runners, groups, layouts, machine_probe, args.threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "reference": ref.name if ref else None, "results": results,
                       "ceiling": roof}, f, indent=1)


if __name__ == "__main__":
    main()

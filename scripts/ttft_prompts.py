"""Time to first token of exact-length prompts on the packaged 1.5B, prefix cache off, one request at a time.

Usage: DW_ROOT=<checkout whose draftwise is timed> python scripts/ttft_prompts.py 512,2048,4096 [DECODE_TOKENS]
The prompts are bench/workloads.py longprompt_text (read from this checkout, so two checkouts time the same text)
cut to exactly N tokens; prints one JSON line: ttft_N seconds per size (and a rough decode tok/s if asked).
Run two checkouts alternately under the bench lock to compare them (docs/PERFORMANCE.md, "Prompts")."""
import sys, time, json, os
sys.path.insert(0, os.environ["DW_ROOT"])
import torch
from draftwise.api import LLM
from draftwise.sampling import SamplingParams
import importlib.util
spec = importlib.util.spec_from_file_location("wl", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "draftwise", "bench", "workloads.py"))
wl = importlib.util.module_from_spec(spec); sys.modules["wl"] = wl; spec.loader.exec_module(wl)
sizes = [int(s) for s in sys.argv[1].split(",")]
decode = int(sys.argv[2]) if len(sys.argv) > 2 else 0
llm = LLM("qwen2.5-coder-1.5b-instruct", max_model_len=max(sizes) + 300, enable_prefix_caching=False, max_num_seqs=1)
tok = llm.engine.tokenizer if hasattr(llm.engine, "tokenizer") else llm.tokenizer
out = {"root": os.environ["DW_ROOT"], "threads": torch.get_num_threads()}
for n in sizes:
    ids = tok.encode(wl.longprompt_text(int(n * 1.3), seed=n), add_special_tokens=False)[:n]
    assert len(ids) == n, len(ids)
    t0 = time.perf_counter()
    llm.generate(ids, SamplingParams(max_tokens=1, temperature=0.0))
    out[f"ttft_{n}"] = round(time.perf_counter() - t0, 2)
if decode:
    ids = tok.encode(wl.longprompt_text(300, seed=1), add_special_tokens=False)[:256]
    t0 = time.perf_counter(); r = llm.generate(ids, SamplingParams(max_tokens=1, temperature=0.0)); t1 = time.perf_counter()
    r = llm.generate(ids, SamplingParams(max_tokens=decode + 1, temperature=0.0, ignore_eos=True)); t2 = time.perf_counter()
    out["decode_tok_s"] = round(decode / ((t2 - t1) - (t1 - t0)), 1)
print(json.dumps(out), flush=True)

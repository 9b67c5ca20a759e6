"""Time to first token of exact-length prompts on the packaged 1.5B, prefix cache off, one request at a time.

Usage: DW_ROOT=<checkout whose draftwise is timed> python scripts/ttft_prompts.py 512,2048,4096 [DECODE_TOKENS]
       DW_ROOT=<checkout> DW_ENGINE=llamacpp PYTHONPATH=<llama-cpp-python site> python scripts/ttft_prompts.py ...
The prompts are bench/workloads.py longprompt_text (read from this checkout, so two checkouts time the same text)
cut to exactly N tokens; prints one JSON line: ttft_N seconds per size (and a rough decode tok/s if asked).
DW_ENGINE=llamacpp times llama.cpp (llama-cpp-python) on the same token ids and the same GGUF (the checkout's
tokenizer and packaged file; n_batch 512, threads = torch's), for the same-run comparison.
Run two checkouts alternately under the bench lock to compare them (docs/PERFORMANCE.md, "Prompts")."""
import sys, time, json, os
sys.path.insert(0, os.environ["DW_ROOT"])
import torch
import importlib.util
spec = importlib.util.spec_from_file_location("wl", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "draftwise", "bench", "workloads.py"))
wl = importlib.util.module_from_spec(spec); sys.modules["wl"] = wl; spec.loader.exec_module(wl)
sizes = [int(s) for s in sys.argv[1].split(",")]
decode = int(sys.argv[2]) if len(sys.argv) > 2 else 0
engine = os.environ.get("DW_ENGINE", "draftwise")
out = {"root": os.environ["DW_ROOT"], "engine": engine, "threads": torch.get_num_threads(),
       "max_isa": os.environ.get("DRAFTWISE_MAX_ISA", "")}
if engine == "llamacpp":
    from llama_cpp import Llama
    from draftwise.models.sources import load_checkpoint

    ckpt = load_checkpoint("qwen2.5-coder-1.5b-instruct")
    tok = ckpt.tokenizer
    th = torch.get_num_threads()
    lc = Llama(model_path=ckpt.info["path"], n_threads=th, n_threads_batch=th, n_ctx=max(sizes) + 300, n_batch=512,
               verbose=False)

    def first_token(ids, max_tokens=1):
        lc.reset()
        lc.create_completion(ids, max_tokens=max_tokens, temperature=0.0, top_k=1)
else:
    from draftwise.api import LLM
    from draftwise.sampling import SamplingParams

    llm = LLM("qwen2.5-coder-1.5b-instruct", max_model_len=max(sizes) + 300, enable_prefix_caching=False, max_num_seqs=1)
    tok = llm.engine.tokenizer if hasattr(llm.engine, "tokenizer") else llm.tokenizer

    def first_token(ids, max_tokens=1):
        llm.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
for n in sizes:
    ids = tok.encode(wl.longprompt_text(int(n * 1.3), seed=n), add_special_tokens=False)[:n]
    assert len(ids) == n, len(ids)
    t0 = time.perf_counter()
    first_token(ids)
    out[f"ttft_{n}"] = round(time.perf_counter() - t0, 2)
if decode:
    ids = tok.encode(wl.longprompt_text(300, seed=1), add_special_tokens=False)[:256]
    t0 = time.perf_counter(); first_token(ids); t1 = time.perf_counter()
    first_token(ids, decode + 1); t2 = time.perf_counter()
    out["decode_tok_s"] = round(decode / ((t2 - t1) - (t1 - t0)), 1)
print(json.dumps(out), flush=True)

"""Peak RSS of one 64-token chat answer: draftwise (this checkout, and optionally another) against llama.cpp on the
same GGUF, in one run, each condition a fresh child process under `/usr/bin/time -v`.

Usage: PYTHONPATH=<dir with llama_cpp> python scripts/rss_vs_llamacpp.py [--other-root /work/main] [--max-tokens 64]
Conditions: draftwise generate with defaults (the packaged 1.5B), the same with the 0.5B draft (k 4), llama.cpp
(llama-cpp-python) with n_ctx 4096 and with its default n_ctx, all on the same chat message, greedy. Prints one
line per condition (peak RSS in GB, output tokens) and a JSON summary with the ratios to llama.cpp's n_ctx 4096.
A memory measurement, not a timing: CPU contention does not change it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MESSAGE = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}]
DRAFT = {"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4}

LLAMA_CHILD = r"""
import json, sys
from llama_cpp import Llama
path, n_ctx, max_tokens, message = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
kw = {} if n_ctx == 0 else {"n_ctx": n_ctx}
llm = Llama(model_path=path, n_threads=2, n_threads_batch=2, verbose=False, **kw)
out = llm.create_chat_completion(messages=message, max_tokens=max_tokens, temperature=0.0)
print(json.dumps({"output_tokens": out["usage"]["completion_tokens"], "n_ctx": llm.n_ctx()}))
"""


def timed(cmd: list[str], env: dict, cwd: Path) -> tuple[float, str]:
    """(peak RSS in GB, stdout) of a command under /usr/bin/time -v."""
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env, cwd=cwd)
    if p.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed: {p.stderr[-1500:]}")
    kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1))
    return kb * 1024 / 1e9, p.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other-root", default=None, help="another checkout's draftwise to measure beside this one")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from draftwise.models import catalog

    gguf = str(catalog.assembled_path(catalog.get_entry("qwen2.5-coder-1.5b-instruct"),
                                      Path.home() / ".cache" / "draftwise"))
    rows = {}
    roots = [("this", ROOT)] + ([("other", Path(args.other_root))] if args.other_root else [])
    for label, root in roots:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
        for name, spec in (("plain", None), ("+0.5B draft", DRAFT)):
            cmd = [sys.executable, "-m", "draftwise.cli", "generate", "--model", "qwen2.5-coder-1.5b-instruct",
                   "--messages", json.dumps(MESSAGE), "--max-tokens", str(args.max_tokens), "--ignore-eos", "--json"]
            if spec:
                cmd += ["--speculative-config", json.dumps(spec)]
            gb, out = timed(cmd, env, root)
            got = json.loads(out.strip().splitlines()[-1])
            rows[f"draftwise ({label}) {name}"] = {"peak_rss_gb": round(gb, 3),
                                                   "output_tokens": got["num_output_tokens"],
                                                   "kv_cache_dtype": got.get("kv_cache_dtype"),
                                                   "weights": got["model"]["weights"]}
            print(f"{'draftwise (' + label + ') ' + name:34s} {gb:6.3f} GB", flush=True)
    for n_ctx in (4096, 0):
        gb, out = timed([sys.executable, "-c", LLAMA_CHILD, gguf, str(n_ctx), str(args.max_tokens),
                         json.dumps(MESSAGE)], dict(os.environ), ROOT)
        got = json.loads(out.strip().splitlines()[-1])
        key = f"llama.cpp n_ctx {got['n_ctx']}" + (" (its default)" if n_ctx == 0 else "")
        rows[key] = {"peak_rss_gb": round(gb, 3), "output_tokens": got["output_tokens"]}
        print(f"{key:34s} {gb:6.3f} GB", flush=True)
    ref = rows["llama.cpp n_ctx 4096"]["peak_rss_gb"]
    for r in rows.values():
        r["vs_llama_cpp_4096"] = round(r["peak_rss_gb"] / ref, 3)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

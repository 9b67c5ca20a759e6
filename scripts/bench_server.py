#!/usr/bin/env python
"""The server's overhead: the same greedy requests through the library (api.LLM in this process) and through a
`draftwise serve` this script starts, side by side, as tok/s and the ratio server / library per row.

Rows: each method (plain, ngram, suffix) x concurrency (1, 4) x {not streamed, streamed}. Concurrency c sends the
first c prompts at once; the library runs the same c prompts as one batched `LLM.generate`. tok/s = all output
tokens / wall from the first request sent to the last byte received. Each row is measured --repeats times,
library and server interleaved (so machine noise hits both), and the median is printed; the first request of each
kind is a warm-up, not counted. Each measurement (each path, row and repeat) runs under its own cache scope -- a
fresh API key on the server (`--suffix-cache-scope key`), the same scope set on the library's requests -- so method
suffix starts every measurement from an empty cache on both paths (its cache learns from outputs: without this
the path measured second would find the first one's text). Every server output is compared with the library's (greedy: they must be equal;
the `same` column says so).

    .venv/bin/python scripts/bench_server.py                      # packaged 1.5B, 128 tokens, all rows
    .venv/bin/python scripts/bench_server.py --model gemma-3-270m --methods plain --repeats 1   # a quick run

The server runs as its own process (`python -m draftwise.cli serve`, from this checkout) on a free loopback port,
with the same model flags; it is stopped with SIGTERM at the end. Its /metrics engine-loop figures
(draftwise:engine_step_seconds, draftwise:engine_overhead_seconds) are printed per method beside the library's
own time per step: where the server's time went. Not a test: it measures; it asserts nothing (exit 1 only when an output differs or a request fails).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _server import DraftwiseServer  # noqa: E402  (start, /health, /metrics, stop)

PROMPTS = [
    "def quicksort(xs):\n    \"\"\"Sort a list of integers with quicksort and return a new list.\"\"\"\n",
    "# A Python class for a bank account with deposit, withdraw and a transaction history\nclass BankAccount:\n",
    "def parse_csv_line(line, sep=','):\n    \"\"\"Split one CSV line into fields, honouring double quotes.\"\"\"\n",
    "# Binary search tree with insert, delete and in-order traversal\nclass Node:\n",
]
METHODS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": "auto"},
}


def model_flags(args) -> list[str]:
    flags = ["--model", args.model, "--max-num-seqs", str(args.max_num_seqs), "--max-model-len",
             str(args.max_model_len)]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    if args.weights:
        flags += ["--weights", args.weights]
    return flags


def Server(args, spec: dict | None) -> DraftwiseServer:
    """The `draftwise serve` of these rows (scripts/_server.py): the model flags, served as "bench", healthy."""
    serve_args = [*model_flags(args), "--log-level", "warning", "--served-model-name", "bench"]
    if spec is not None:
        serve_args += ["--speculative-config", json.dumps(spec)]
    return DraftwiseServer(serve_args + list(args.serve_args), load_timeout_s=args.load_timeout)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc; 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def body(prompt: str, max_tokens: int, stream: bool) -> dict:
    b = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if stream:
        b |= {"stream": True, "stream_options": {"include_usage": True}}
    return b


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int, stream: bool) -> tuple[str, int]:
    """(text, completion tokens) of one request."""
    if not stream:
        r = await client.post("/v1/completions", json=body(prompt, max_tokens, False))
        r.raise_for_status()
        js = r.json()
        return js["choices"][0]["text"], int(js["usage"]["completion_tokens"])
    parts, tokens = [], 0
    async with client.stream("POST", "/v1/completions", json=body(prompt, max_tokens, True)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            for c in chunk.get("choices", []):
                parts.append(c.get("text") or "")
    return "".join(parts), tokens


async def server_run(url: str, prompts: list[str], max_tokens: int, stream: bool,
                     scope: str) -> tuple[float, int, list[str]]:
    """(wall s, output tokens, texts) of the prompts sent at once under API key `scope` (its own suffix cache)."""
    headers = {"Authorization": f"Bearer {scope}"}
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(client, p, max_tokens, stream) for p in prompts))
        wall = time.perf_counter() - t0
    return wall, sum(n for _, n in res), [t for t, _ in res]


def client_run(url: str, prompts: list[str], max_tokens: int, stream: bool, scope: str,
               nice: int = 0) -> tuple[float, int, list[str], float]:
    """server_run on a thread of its own (wall s, output tokens, texts, the client's CPU s); `nice` > 0 lowers
    that thread's priority only (Linux: a thread's nice value is its own; this process's library runs keep theirs),
    standing in for a client on another machine: its CPU then yields to the server's and the engine's."""
    out: dict = {}

    def run():
        if nice > 0:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        c0 = time.thread_time()
        try:
            out["result"] = asyncio.run(server_run(url, prompts, max_tokens, stream, scope))
        except BaseException as e:  # re-raised on the caller's thread
            out["error"] = e
        out["cpu"] = time.thread_time() - c0

    t = threading.Thread(target=run, name="bench-client")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return (*out["result"], out["cpu"])


def library_run(llm, prompts: list[str], max_tokens: int, scope: str) -> tuple[float, int, list[str]]:
    """What `LLM.generate` does (the prompts as one batch), its requests under cache scope `scope`."""
    from draftwise.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    pairs = [llm.new_request(p, params) for p in prompts]
    for req, _ in pairs:
        req.cache_scope = scope
    llm.run([req for req, _ in pairs])
    outs = [llm._finish_output(req, stream) for req, stream in pairs]
    wall = time.perf_counter() - t0
    return wall, sum(len(o.outputs[0].token_ids) for o in outs), [o.outputs[0].text for o in outs]


def metric_sum(text: str, name: str) -> tuple[float, float]:
    """(_sum, _count) of a histogram in a /metrics text (0, 0 when absent)."""
    def get(suffix):
        m = re.search(rf"^draftwise:{name}_{suffix}{{[^}}]*}} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0
    return get("sum"), get("count")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--weights", default=None, help="passed to both paths (default: auto)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=2048, help="both paths (smaller KV caches)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", default="plain,ngram,suffix", help=f"comma-separated of {list(METHODS)}")
    ap.add_argument("--concurrency", default="1,4", help="comma-separated request counts sent at once (<= 4)")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per row (median printed)")
    ap.add_argument("--load-timeout", type=float, default=300.0, help="seconds the server may take to load")
    ap.add_argument("--serve-arg", dest="serve_args", action="append", default=[],
                    help="extra `draftwise serve` argument (repeatable, e.g. --serve-arg=--no-thread-guard)")
    ap.add_argument("--no-thread-guard", action="store_true",
                    help="both paths keep their torch threads whatever the load (each path's thread guard counts the "
                         "other's engine as load: on a busy machine they can settle on different thread counts)")
    ap.add_argument("--client-nice", type=int, default=0,
                    help="run the HTTP client (server rows) at this nice value (a thread of its own; the library rows "
                         "keep this process's priority): on a 2-core box the client's CPU otherwise competes with "
                         "the engine, which a client on another machine would not (default: 0)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.no_thread_guard:
        args.serve_args = [*args.serve_args, "--no-thread-guard"]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"unknown method(s) {bad}; choose from {list(METHODS)}")
    concs = [int(c) for c in args.concurrency.split(",")]
    if any(not 1 <= c <= len(PROMPTS) for c in concs):
        ap.error(f"--concurrency values must be 1..{len(PROMPTS)}")

    from draftwise.api import LLM

    rows, ok = [], True
    print(f"{'method':7} {'conc':>4} {'mode':10} {'library tok/s':>13} {'server tok/s':>12} {'ratio':>6} same",
          flush=True)
    for method in methods:
        spec = METHODS[method]
        llm = LLM(args.model, speculative_config=spec, max_num_seqs=args.max_num_seqs, threads=args.threads,
                  max_model_len=args.max_model_len, thread_guard=not args.no_thread_guard,
                  **({"weights": args.weights} if args.weights else {}))
        lib_steps = {"n": 0, "s": 0.0}  # the library's steps after the warm-up, and their time
        inner = llm.engine.step

        def counted_step():
            t = time.perf_counter()
            out = inner()
            lib_steps["s"] += time.perf_counter() - t
            lib_steps["n"] += 1
            return out

        server = Server(args, spec)
        try:
            # warm-up: one request of each kind on each path (kernels, caches, first-request costs)
            library_run(llm, PROMPTS[:max(concs)], args.max_tokens, "warm-up")
            for stream in (False, True):
                asyncio.run(server_run(server.url, PROMPTS[:max(concs)], args.max_tokens, stream, "warm-up"))
            m0 = server.metrics()
            engine_pids = children(server.proc.pid)  # the engine process(es) the server spawned
            cpu0 = [cpu_s(server.proc.pid)] + [cpu_s(p) for p in engine_pids]
            llm.engine.step = counted_step
            client_cpu = {False: 0.0, True: 0.0}  # CPU seconds the client (this process) spent on the server rows
            for c in concs:
                prompts = PROMPTS[:c]
                lib, srv = [], {False: [], True: []}
                same = {False: True, True: True}
                for rep in range(args.repeats):
                    scope = f"{method}-c{c}-r{rep}"  # every measurement its own (empty) suffix cache
                    wall, n, lib_texts = library_run(llm, prompts, args.max_tokens, scope + "-library")
                    lib.append(n / wall)
                    for stream in (False, True):
                        wall, n, texts, cpu = client_run(server.url, prompts, args.max_tokens, stream,
                                                         f"{scope}-{'streamed' if stream else 'whole'}",
                                                         args.client_nice)
                        client_cpu[stream] += cpu
                        srv[stream].append(n / wall)
                        if texts != lib_texts and same[stream]:
                            i = next(j for j, (a, b) in enumerate(zip(texts, lib_texts)) if a != b)
                            at = next((j for j, (a, b) in enumerate(zip(texts[i], lib_texts[i])) if a != b),
                                      min(len(texts[i]), len(lib_texts[i])))
                            print(f"  prompt {i}: the server's text differs from the library's at character {at}: "
                                  f"{texts[i][at:at + 40]!r} vs {lib_texts[i][at:at + 40]!r}", flush=True)
                        same[stream] &= texts == lib_texts
                for stream in (False, True):
                    lib_tps, srv_tps = statistics.median(lib), statistics.median(srv[stream])
                    mode = "streamed" if stream else "whole"
                    ok &= same[stream]
                    rows.append({"method": method, "concurrency": c, "mode": mode, "library_tok_s": lib_tps,
                                 "server_tok_s": srv_tps, "ratio": srv_tps / lib_tps, "same_text": same[stream],
                                 "library_all": lib, "server_all": srv[stream]})
                    print(f"{method:7} {c:>4} {mode:10} {lib_tps:>13.2f} {srv_tps:>12.2f} {srv_tps / lib_tps:>6.3f} "
                          f"{'yes' if same[stream] else 'NO'}", flush=True)
            m1 = server.metrics()
            cpu1 = [cpu_s(server.proc.pid)] + [cpu_s(p) for p in engine_pids]
            step_s, steps = (a - b for a, b in zip(metric_sum(m1, "engine_step_seconds"),
                                                   metric_sum(m0, "engine_step_seconds")))
            over_s, overs = (a - b for a, b in zip(metric_sum(m1, "engine_overhead_seconds"),
                                                   metric_sum(m0, "engine_overhead_seconds")))
            per = f" ({1000 * (cpu1[0] - cpu0[0]) / steps:.2f} ms per engine step)" if steps else ""
            print(f"  {method}: CPU s during the measured rows: server process {cpu1[0] - cpu0[0]:.2f}{per}, engine "
                  f"process {sum(cpu1[1:]) - sum(cpu0[1:]):.1f}, the client {client_cpu[False]:.2f} whole / "
                  f"{client_cpu[True]:.2f} streamed (nice {args.client_nice}; on a 2-core box it competes with the "
                  f"engine too)", flush=True)
            if steps:
                print(f"  {method}: library {lib_steps['n']} steps, {1000 * lib_steps['s'] / lib_steps['n']:.2f} ms "
                      f"per llm.step(); server {steps:.0f} steps, {1000 * step_s / steps:.2f} ms per llm.step(), "
                      f"{1000 * over_s / max(overs, 1):.2f} ms between steps (engine process)", flush=True)
        except (httpx.HTTPError, RuntimeError) as e:
            print(f"request failed: {type(e).__name__}: {e}", flush=True)
            ok = False
        finally:
            server.stop()
            del llm
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

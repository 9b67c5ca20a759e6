#!/usr/bin/env python
"""Load test for a running draftwise (or any OpenAI-compatible) server: N concurrent clients for a fixed time.

Each client sends requests back to back until the time is up (requests in flight then finish). Reports
requests OK / failed, p50 / p95 latency, aggregate output tok/s (all completion tokens / wall time) and the
server's RSS before and after each run, read from /proc/PID/status when --pid is given, else from the
server's /metrics (process_resident_memory_bytes). --runs 2 runs twice back to back to show RSS growth.

    .venv/bin/python scripts/load_test.py --url http://127.0.0.1:8000 --clients 32 --duration 60 --runs 2

Not a test: it measures; it asserts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time

import httpx

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Rewrite this loop as a list comprehension: result = []\nfor x in xs:\n    if x > 0:\n        result.append(x * 2)",
    "List three differences between TCP and UDP.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "What does the SQL keyword JOIN do?",
    "Write a bash one-liner that counts lines in all .py files under the current directory.",
]


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


def read_rss(url: str, headers: dict, pid: int | None) -> int | None:
    """Server RSS in bytes: /proc/PID/status (VmRSS) or the server's own process_resident_memory_bytes."""
    if pid is not None:
        with open(f"/proc/{pid}/status") as f:
            m = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) * 1024 if m else None
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    m = re.search(r"^process_resident_memory_bytes\s+([0-9.e+]+)", text, re.M)
    return int(float(m.group(1))) if m else None


def request_body(endpoint: str, model: str, prompt: str, max_tokens: int, temperature: float) -> dict:
    if endpoint == "chat":
        return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": temperature}
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}


async def one_request(client: httpx.AsyncClient, path: str, body: dict) -> tuple[bool, float, int, str]:
    """(ok, latency_s, completion_tokens, error) for one non-streaming request."""
    t0 = time.perf_counter()
    try:
        r = await client.post(path, json=body)
        dt = time.perf_counter() - t0
        if r.status_code != 200:
            return False, dt, 0, f"HTTP {r.status_code}: {r.text[:200]}"
        return True, dt, int(r.json()["usage"]["completion_tokens"]), ""
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return False, time.perf_counter() - t0, 0, f"{type(e).__name__}: {e}"


async def client_loop(i: int, client, path, deadline, make_body, results: list) -> None:
    n = 0
    while time.perf_counter() < deadline:
        prompt = PROMPTS[(i + n) % len(PROMPTS)]
        results.append(await one_request(client, path, make_body(prompt)))
        n += 1


async def run_load(url: str, headers: dict, clients: int, duration: float, path: str, make_body,
                   timeout: float) -> dict:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    results: list = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(i, client, path, t0 + duration, make_body, results)
                               for i in range(clients)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r[0]]
    lat = [r[1] for r in ok]
    errors = sorted({r[3] for r in results if not r[0]})
    tokens = sum(r[2] for r in ok)
    return {"clients": clients, "requests_ok": len(ok), "requests_failed": len(results) - len(ok),
            "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
            "latency_mean_s": statistics.fmean(lat) if lat else None, "output_tokens": tokens,
            "wall_s": wall, "aggregate_tok_s": tokens / wall if wall else None, "errors": errors[:5]}


def served_model(url: str, headers: dict) -> str:
    r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def fmt(v, unit="", digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds each client keeps sending")
    ap.add_argument("--runs", type=int, default=1, help="consecutive runs (RSS is read before and after each)")
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    ap.add_argument("--pid", type=int, default=None, help="server pid: read RSS from /proc instead of /metrics")
    ap.add_argument("--json", action="store_true", help="print one JSON object per run")
    args = ap.parse_args(argv)

    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or served_model(url, headers)
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"

    def make_body(prompt):
        return request_body(args.endpoint, model, prompt, args.max_tokens, args.temperature)

    failed = 0
    for run in range(1, args.runs + 1):
        rss0 = read_rss(url, headers, args.pid)
        res = asyncio.run(run_load(url, headers, args.clients, args.duration, path, make_body, args.timeout))
        time.sleep(1.0)  # let the server settle (finished requests released) before reading memory
        rss1 = read_rss(url, headers, args.pid)
        res.update(run=run, model=model, endpoint=args.endpoint, max_tokens=args.max_tokens,
                   rss_before_mb=rss0 / 2**20 if rss0 else None, rss_after_mb=rss1 / 2**20 if rss1 else None)
        failed += res["requests_failed"]
        if args.json:
            print(json.dumps(res))
        else:
            print(f"run {run}: {res['clients']} clients x {args.duration:.0f}s ({args.endpoint}, max_tokens "
                  f"{args.max_tokens}): ok {res['requests_ok']}  failed {res['requests_failed']}  "
                  f"latency p50 {fmt(res['latency_p50_s'], 's')} p95 {fmt(res['latency_p95_s'], 's')}  "
                  f"aggregate {fmt(res['aggregate_tok_s'], ' tok/s', 1)} ({res['output_tokens']} tokens in "
                  f"{res['wall_s']:.1f}s)  server RSS {fmt(res['rss_before_mb'], ' MB', 0)} -> "
                  f"{fmt(res['rss_after_mb'], ' MB', 0)}", flush=True)
            for e in res["errors"]:
                print(f"   error: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

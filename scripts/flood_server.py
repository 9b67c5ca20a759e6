#!/usr/bin/env python
"""The flood test: well-behaved API keys beside flooding ones on a small server; is every key served its turn?

Starts `draftwise serve` (this checkout, loopback, --max-num-seqs 2 by default, --max-queued-per-key 1) and runs
two phases on it: unflooded (the well-behaved keys alone) for --baseline-s, then flooded for --duration-s. A
well-behaved key keeps one request in flight and, on a 429, waits its Retry-After; a flooding key keeps
--flood-connections requests in flight and sends again the moment one ends, 429 or not. Every loop stops at its
phase's deadline (and after --max-requests per client); every request has a timeout (a hang if it passes).

Reported, and checked (exit 1 when one fails):
- each well-behaved key's completions within --tolerance (20%) of its fair share: each completion is owed equally
  to the keys with work at that moment (a request in flight, or one a Retry-After holds back);
- 0 errors (anything but 200 and 429), 0 hangs;
- total throughput (output tokens / s) flooded >= --min-throughput-ratio (0.9) x unflooded.

    .venv/bin/python scripts/flood_server.py --model qwen2.5-coder-0.5b-instruct
    .venv/bin/python scripts/flood_server.py --model gemma-3-270m --duration-s 20 --baseline-s 10   # quick
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_server import Server  # noqa: E402  (bench_server's flags over scripts/_server.py's driver)
from draftwise.server.admission import fair_shares  # noqa: E402

PROMPT = "Write a short Python function that returns the sum of a list of numbers."


class Phase:
    """One phase's client-side record: completions with the keys that had work, errors, hangs, tokens."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.in_flight: dict[str, int] = {}
        self.held: set[str] = set()  # keys waiting out a Retry-After
        self.log: list[tuple[str, frozenset]] = []
        self.count: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self.errors: list[str] = []
        self.hangs = 0
        self.tokens = 0
        self.t0 = time.perf_counter()
        self.wall = 0.0

    def with_work(self) -> frozenset:
        return frozenset(k for k, n in self.in_flight.items() if n) | frozenset(self.held)


async def request(client: httpx.AsyncClient, phase: Phase, key: str, body: dict, timeout: float):
    """One request: returns the Retry-After (s) of a 429, or None."""
    phase.in_flight[key] = phase.in_flight.get(key, 0) + 1
    try:
        r = await asyncio.wait_for(client.post("/v1/completions", json=body,
                                               headers={"Authorization": f"Bearer {key}"}), timeout)
    except asyncio.TimeoutError:
        phase.hangs += 1
        return None
    except httpx.HTTPError as e:
        phase.errors.append(f"{type(e).__name__}: {e}")
        return None
    finally:
        phase.in_flight[key] -= 1
    if r.status_code == 200:
        phase.log.append((key, phase.with_work() | {key}))
        phase.count[key] = phase.count.get(key, 0) + 1
        phase.tokens += int(r.json()["usage"]["completion_tokens"])
        return None
    if r.status_code == 429:
        phase.rejected[key] = phase.rejected.get(key, 0) + 1
        return float(r.headers.get("retry-after", "1"))
    phase.errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
    return None


async def polite(client, phase: Phase, key: str, body: dict, args) -> None:
    for _ in range(args.max_requests):
        if time.perf_counter() >= phase.deadline:
            return
        wait = await request(client, phase, key, body, args.timeout)
        if wait is not None:
            phase.held.add(key)
            await asyncio.sleep(min(wait, max(0.0, phase.deadline - time.perf_counter())))
            phase.held.discard(key)


async def flooder(client, phase: Phase, key: str, body: dict, args) -> None:
    for _ in range(args.max_requests):
        if time.perf_counter() >= phase.deadline:
            return
        await request(client, phase, key, body, args.timeout)


async def run_phase(url: str, seconds: float, good: list[str], flood: list[str], body: dict, args) -> Phase:
    phase = Phase(time.perf_counter() + seconds)
    conns = len(good) + len(flood) * args.flood_connections
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        tasks = [polite(client, phase, k, body, args) for k in good]
        tasks += [flooder(client, phase, k, body, args) for k in flood for _ in range(args.flood_connections)]
        await asyncio.gather(*tasks)
    phase.wall = time.perf_counter() - phase.t0
    return phase


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--weights", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=2, help="the server's slots")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-queued-per-key", type=int, default=1)
    ap.add_argument("--good-keys", type=int, default=2)
    ap.add_argument("--flood-keys", type=int, default=40)
    ap.add_argument("--flood-connections", type=int, default=2, help="requests each flooding key keeps in flight")
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (ignore_eos)")
    ap.add_argument("--duration-s", type=float, default=60.0, help="the flooded phase")
    ap.add_argument("--baseline-s", type=float, default=30.0, help="the unflooded phase (well-behaved keys only)")
    ap.add_argument("--timeout", type=float, default=120.0, help="a request taking longer is a hang")
    ap.add_argument("--max-requests", type=int, default=100_000, help="per client and phase (a bound on loops)")
    ap.add_argument("--tolerance", type=float, default=0.2)
    ap.add_argument("--min-throughput-ratio", type=float, default=0.9)
    ap.add_argument("--load-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    args.serve_args = ["--max-queued-per-key", str(args.max_queued_per_key)]
    args.repeats = 0
    good = [f"polite-{i}" for i in range(args.good_keys)]
    flood = [f"flood-{i}" for i in range(args.flood_keys)]
    body = {"model": "bench", "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0.0,
            "ignore_eos": True}

    server = Server(args, None)
    try:
        asyncio.run(run_phase(server.url, 3.0, good, [], body, args))  # warm-up
        base = asyncio.run(run_phase(server.url, args.baseline_s, good, [], body, args))
        flooded = asyncio.run(run_phase(server.url, args.duration_s, good, flood, body, args))
    finally:
        server.stop()

    base_tps, flood_tps = base.tokens / base.wall, flooded.tokens / flooded.wall
    shares = fair_shares(flooded.log)
    print(f"unflooded: {len(base.log)} completions, {base_tps:.2f} tok/s; flooded ({args.flood_keys} flooding keys x "
          f"{args.flood_connections} connections, {args.max_num_seqs} slots, {args.duration_s:g} s): "
          f"{len(flooded.log)} completions, {flood_tps:.2f} tok/s, ratio {flood_tps / base_tps:.3f}")
    ok = True
    for k in good:
        got, owed = shares.get(k, (0, 0.0))
        dev = (got - owed) / owed if owed else float("inf")
        fair = abs(dev) <= args.tolerance
        ok &= fair
        print(f"  {k}: {got} completions, fair share {owed:.1f} ({dev:+.1%}), {flooded.rejected.get(k, 0)} 429s "
              f"{'ok' if fair else 'UNFAIR'}")
    fl = [shares.get(k, (0, 0.0)) for k in flood]
    print(f"  flooding keys: {sum(g for g, _ in fl)} completions, fair share {sum(o for _, o in fl):.1f}, "
          f"{sum(flooded.rejected.values()) - sum(flooded.rejected.get(k, 0) for k in good)} 429s")
    errors, hangs = base.errors + flooded.errors, base.hangs + flooded.hangs
    print(f"  errors {len(errors)}{': ' + errors[0] if errors else ''}; hangs {hangs}")
    ok &= not errors and not hangs and flood_tps >= args.min_throughput_ratio * base_tps
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

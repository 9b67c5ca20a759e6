"""The bench on a tiny random model: in-process (the engine, conditions switched in one process, concurrency 2)
and endpoint mode against our own server over real HTTP (streaming TTFT, acceptance from /metrics).
Reuses the server tests' tiny model, tokenizer and uvicorn harness. No downloads."""
import json

import pytest

from draftwise.bench.clients import Condition, HTTPClient, InProcessClient, parse_spec_metrics
from draftwise.bench.lab import BenchOptions, conditions_from, run_bench
from draftwise.bench.workloads import Item, Workload
from tests.harness import MODEL, PROMPTS, Server, tiny_llm

from draftwise.server.app import create_app


def tiny_workload():
    items = [Item(f"p{i}", "tiny", prompt=p) for i, p in enumerate(PROMPTS)]
    items.append(Item("chat0", "tiny", messages=[{"role": "user", "content": "w1 w2 w3 w1 w2"}]))
    return Workload("tiny", items, max_tokens=12)


def test_in_process_conditions_share_one_engine(tmp_path):
    conds = conditions_from(["none", "ngram", "draft_model"], [2, 3], "tiny-draft")
    client = InProcessClient(tiny_llm(max_num_seqs=2, k_max=3), draft="tiny-draft")
    opts = BenchOptions([tiny_workload()], conds, tmp_path / "out", warmup=1, requests=5, concurrency=[2],
                        progress=False, plots=False)
    rep = run_bench(client, opts)
    seg = rep["segments"]["tiny@c2"]
    assert set(seg["conditions"]) == {c.id for c in conds}
    for cid, fig in seg["conditions"].items():
        assert fig["n"] == 5 and fig["errors"] == 0 and fig["ttft_s"]["median"] > 0
        assert fig["e2e_s"]["median"] >= fig["ttft_s"]["median"]
        if cid != "none":
            assert fig["spec"]["num_drafts"] > 0
            assert 0 <= fig["spec"]["acceptance_rate"] <= 1
            assert 1 <= len(fig["spec"]["acceptance_by_position"]) <= int(cid[-1])  # drafts may be shorter than k
    # greedy speculation reproduces plain greedy output token for token, under every condition
    assert all(q["share"] == 1.0 for q in seg["quality"]["identical"].values())
    assert rep["manifest"]["client"]["draft"] == {"name": "tiny-draft"}
    assert rep["manifest"]["client"]["thread_guard"] is None  # from_parts: no kernels info, no guard


def test_parse_spec_metrics_vllm_and_ours():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total x", "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{model_name="m"} 10.0',
        'vllm:spec_decode_num_drafts_created{model_name="m"} 1.7e9',
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 40.0',
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 25.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 7.0',
    ])
    m = parse_spec_metrics(text)
    assert m["num_drafts"] == 10 and m["num_draft_tokens"] == 40 and m["num_accepted_tokens"] == 25
    assert m["accepted_per_position"] == [9.0, 7.0]
    assert parse_spec_metrics(text.replace("vllm:", "draftwise:"))["num_drafts"] == 10
    assert parse_spec_metrics("process_resident_memory_bytes 1e9") is None


@pytest.fixture(scope="module")
def servers():
    spec_config = {"method": "ngram", "num_speculative_tokens": 3}
    with Server(create_app(tiny_llm(), MODEL)) as plain, Server(create_app(tiny_llm(spec_config), MODEL)) as ngram:
        yield plain, ngram


def test_endpoint_mode_against_our_server(servers, tmp_path):
    plain, ngram = servers
    conds = [Condition(endpoint=plain.url, label="none"), Condition(endpoint=ngram.url + "/v1", label="ngram-k3")]
    opts = BenchOptions([tiny_workload()], conds, tmp_path / "out", warmup=1, requests=5, concurrency=[1, 2],
                        progress=False, plots=False)
    rep = run_bench(HTTPClient(), opts)
    for seg_name in ("tiny@c1", "tiny@c2"):
        seg = rep["segments"][seg_name]
        none, ngram = seg["conditions"]["none"], seg["conditions"]["ngram-k3"]
        assert none["n"] == 5 and none["errors"] == 0 and not none["tokens_estimated"]
        assert none["ttft_s"]["median"] > 0 and none["output_tokens"] > 0
        assert none["spec"]["num_drafts"] == 0  # the plain server exposes its counters at zero
        assert ngram["spec"]["num_drafts"] > 0 and 0 <= ngram["spec"]["acceptance_rate"] <= 1
        assert ngram["memory"]["server_rss_bytes"] > 0
        assert seg["quality"]["identical"]["ngram-k3"]["share"] == 1.0
        assert seg["speedups"]["ngram-k3"]["tok_s"]["n"] == 5
    assert rep["manifest"]["client"]["mode"] == "endpoint"
    recs = [json.loads(x) for x in (tmp_path / "out" / "journal.jsonl").read_text().splitlines()]
    assert {r["condition"] for r in recs} == {"none", "ngram-k3"}


def _fake_endpoint(body: str, content_type: str = "text/event-stream"):
    """An httpx transport answering every completion with `body` (an SSE stream or a JSON body)."""
    import httpx

    return httpx.MockTransport(lambda request: httpx.Response(200, headers={"content-type": content_type},
                                                              content=body.encode()))


def _sse(*events) -> str:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)


def test_http_client_counts_an_in_stream_error_as_an_error():
    """Issue 11, item 10: a stream whose last event is `data: {"error": ...}` (the server failed mid-request), or
    a 200 body holding an `error` object, is an error — not a success with the text that came before it."""
    from draftwise.bench.clients import Call

    call = Call("p", None, 8)
    chunk = {"choices": [{"index": 0, "text": "partial", "finish_reason": None}]}
    error = {"error": {"message": "engine failed: out of memory", "type": "server_error"}}
    ok = {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}],
          "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
    cases = {
        "stream error": (_sse(chunk, error, "[DONE]"), "text/event-stream"),
        "stream error, no [DONE]": (_sse(chunk, error), "text/event-stream"),
        "body error": (json.dumps(error), "application/json"),
        "fine": (_sse(chunk, ok, "[DONE]"), "text/event-stream"),
    }
    results = {}
    for name, (body, ctype) in cases.items():
        client = HTTPClient(model="m", transport=_fake_endpoint(body, ctype))
        client._models["http://x"] = "m"
        results[name] = client._stream("http://x", call)
    for name in ("stream error", "stream error, no [DONE]", "body error"):
        assert results[name].error and "engine failed: out of memory" in results[name].error, name
    assert results["fine"].error is None and results["fine"].text == "partial!"
    assert results["fine"].num_output_tokens == 2


def test_k_auto_is_a_bench_condition(tmp_path):
    from draftwise.bench.tune import vllm_line
    from draftwise.cli_args import k_list
    from draftwise.config import ConfigError

    assert k_list("2, 4,auto") == [2, 4, "auto"]
    with pytest.raises(ConfigError, match="'auto'"):
        k_list("2,fast")
    conds = conditions_from(["none", "ngram"], ["auto"], None)
    assert conds[1].id == "ngram-kauto" and conds[1].spec_config() == {"method": "ngram", "num_speculative_tokens": "auto"}
    assert "--speculative-config" not in vllm_line("qwen2.5-coder-1.5b-instruct", conds[1].spec_config())
    client = InProcessClient(tiny_llm(max_num_seqs=1, k_max=8), draft="tiny-draft")
    opts = BenchOptions([tiny_workload()], conds, tmp_path / "out", warmup=1, requests=3, concurrency=[1],
                        progress=False, plots=False)
    seg = run_bench(client, opts)["segments"]["tiny@c1"]
    assert seg["conditions"]["ngram-kauto"]["n"] == 3 and seg["conditions"]["ngram-kauto"]["errors"] == 0
    assert seg["quality"]["identical"]["ngram-kauto"]["share"] == 1.0


def test_a_sweep_over_the_drafts_plans_loads_each_and_keeps_them_apart(tmp_path):
    """`--draft-weights auto,faithful` (tune, bench): one condition per draft plan for draft_model (not for the
    others), distinct ids, each condition's draft loaded with its own weights, and tune's winner carries them."""
    from draftwise.api import LLM
    from draftwise.bench import tune
    from tests.harness import noisy_draft, tiny_decoder, tiny_tokenizer, VOCAB

    asked = []
    tok = tiny_tokenizer()

    def load_draft(name, dtype, weights):
        asked.append(weights)
        return noisy_draft(), tok, {"name": name, "weights": weights}

    llm = LLM.from_parts(tiny_decoder("qwen2", 0, VOCAB), tok, name=MODEL, max_num_seqs=2, k_max=2,
                         load_draft=load_draft)
    conds = conditions_from(["none", "ngram", "draft_model"], [2], "tiny-draft", draft_weights=["auto", "faithful"])
    assert [c.id for c in conds] == ["none", "ngram-k2", "draft_model-k2-draft:auto", "draft_model-k2-draft:faithful"]
    rep = run_bench(InProcessClient(llm, draft="tiny-draft"),
                    BenchOptions([tiny_workload()], conds, tmp_path / "out", warmup=0, requests=2, concurrency=[1],
                                 progress=False, plots=False))
    assert sorted(asked) == ["auto", "faithful"]  # each plan's draft loaded once
    assert set(rep["segments"]["tiny@c1"]["conditions"]) == {c.id for c in conds}
    cond = next(c for c in conds if c.draft_weights == "faithful").__dict__
    assert tune.spec_config_for(cond) == {"method": "draft_model", "num_speculative_tokens": 2,
                                          "model": "tiny-draft", "draft_weights": "faithful"}
    assert conditions_from(["draft_model"], [2], "d", draft_weights=["q4x8"])[0].draft_weights is None  # one: client's


def test_in_process_batches_never_share_a_suffix_cache_scope():
    """Each batch runs under its own suffix-cache scope: the same prompt run again (another condition or concurrency
    level, one engine for all) must not be guessed from its earlier run's output. Planted: the same prompt twice in
    one scope accepts (nearly) every guess the second time, so scopes shared across batches would show."""
    from draftwise.bench.clients import Call

    client = InProcessClient(tiny_llm(max_num_seqs=1, k_max=4))
    client.llm.set_speculation({"method": "suffix", "num_speculative_tokens": 4})
    call = Call(PROMPTS[0], None, 24)
    seen = []
    new_request = client.llm.new_request

    def spy(prompt, params):
        req, stream = new_request(prompt, params)
        seen.append(req)
        return req, stream

    client.llm.new_request = spy
    first, second = client._run_calls([call])[0], client._run_calls([call])[0]
    assert first.token_ids == second.token_ids
    assert len({r.cache_scope for r in seen}) == 2
    accepted = [r.spec["num_accepted_tokens"] for r in (first, second)]
    assert accepted[1] == accepted[0], accepted  # the second run learned nothing from the first

    # the planted leak: both runs in one scope; the second run now guesses its own earlier output and accepts more
    client._batches = iter(["shared", "shared"])
    leak = [client._run_calls([call])[0] for _ in range(2)]
    assert leak[1].spec["num_accepted_tokens"] > leak[0].spec["num_accepted_tokens"], leak


def test_http_client_sends_each_batch_under_its_own_key_unless_given_one():
    """Without --api-key each batch goes under a key of its own (a key-scoped suffix cache then never guesses a
    prompt from another batch's output); with one, every request carries the user's key."""
    import httpx

    from draftwise.bench.clients import Call

    def run(api_key):
        seen = []

        def answer(request):
            seen.append(request.headers.get("authorization"))
            body = _sse({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}, "[DONE]")
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())

        client = HTTPClient(api_key=api_key, model="m", transport=httpx.MockTransport(answer))
        client._models["http://x"] = "m"
        for _ in range(2):
            client._run_calls("http://x", [Call("p", None, 4), Call("q", None, 4)])
        return seen

    own = run(None)
    assert len(own) == 4 and own[0] == own[1] and own[2] == own[3] and own[0] != own[2], own
    assert run("secret") == ["Bearer secret"] * 4

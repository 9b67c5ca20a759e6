"""The playground page and the `draftwise` request extension behind it (token provenance, per-request opt-out of
speculation), on the tiny random model over real HTTP.

No browser: the official `openai` client parses streams unchanged with provenance off and still parses them with
it on (extra field ignored); a chunk's token texts concatenate to its text; provenance counts agree with the
request's spec stats; greedy text is identical with speculation opted out; multi-byte characters and stop strings
are attributed to tokens without losing or duplicating text. Browser (Playwright driving Debian's Chromium
headless): send a prompt and see the streamed text, accepted draft tokens highlighted (ngram on a repetitive
prompt), Stop frees the KV slot (/metrics), a bad API key, a bad field and a busy server (429) show readable
errors, side by side, 360 px width. Chromium or Playwright missing: skip locally, fail under CI (`make setup` installs both).
"""
from __future__ import annotations

import json
import os
import shutil
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from draftwise.output import TextStream
from draftwise.server.app import STATIC_DIR, create_app
from draftwise.server.provenance import TokenProvenance
from draftwise.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.harness import MODEL, PROMPTS, Server, metric, tiny_llm

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
DRAFT = {"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 4}
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server():
    """ngram speculation, an API key (the page must work with one), room for a long generation to stop."""
    with Server(create_app(tiny_llm(NGRAM, max_model_len=16384), MODEL, api_key=KEY)) as s:
        yield s


def client(server):
    return server.client(KEY)


def sse_chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, headers=AUTH, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def wait_for_idle(server, timeout=10.0) -> dict:
    deadline = time.time() + timeout
    while True:
        m = server.metrics(AUTH)
        if metric(m, "draftwise:num_requests_running") == 0 and metric(m, "draftwise:kv_slots_free") == 4:
            return m
        assert time.time() < deadline, "slot not freed"
        time.sleep(0.05)


# ---- the extension, no browser ------------------------------------------------------------------------
def test_stream_without_provenance_is_plain_openai(server):
    """No `draftwise` field (or provenance off): OpenAI's chunk keys only, and the openai client's text."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stream": True,
            "ignore_eos": True}
    plain = sse_chunks(server, "/v1/completions", body)
    off = sse_chunks(server, "/v1/completions", dict(body, draftwise={"provenance": False}))
    for chunks in (plain, off):
        assert all(set(ch) == {"id", "object", "created", "model", "choices"} for ch in chunks)
    strip = [[{k: v for k, v in ch.items() if k not in ("id", "created")} for ch in chunks] for chunks in (plain, off)]
    assert strip[0] == strip[1]
    streamed = client(server).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert all(not (ch.model_extra or {}) for ch in chunks)
    assert "".join(ch.choices[0].text for ch in chunks) == "".join(ch["choices"][0]["text"] for ch in plain)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_provenance_chunks_parse_with_openai_client(server, chat):
    c = client(server)
    extra = {"ignore_eos": True, "draftwise": {"provenance": True}}
    if chat:
        stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                           max_tokens=24, temperature=0, stream=True, extra_body=extra)
    else:
        stream = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True,
                                      extra_body=extra)
    chunks = list(stream)

    def text_of(ch):
        return (ch.choices[0].delta.content or "") if chat else ch.choices[0].text

    steps, text = [], ""
    for ch in chunks:
        ext = (ch.model_extra or {}).get("draftwise")
        if ext is None or "steps" not in ext:
            continue
        assert ext["method"] == "ngram"
        assert "".join(t["text"] for s in ext["steps"] for t in s["tokens"]) == text_of(ch)
        steps.extend(ext["steps"])
        text += text_of(ch)
    assert text == "".join(text_of(ch) for ch in chunks) and text
    final = chunks[-1]
    assert final.choices[0].finish_reason == "length"
    summary = final.model_extra["draftwise"]
    spec_stats = summary["spec"]
    assert summary["ttft_s"] > 0 and summary["e2e_s"] >= summary["ttft_s"]
    assert sum(len(s["tokens"]) for s in steps) == 24
    accepted = [t["accepted"] for s in steps for t in s["tokens"]]
    assert sum(accepted) == spec_stats["num_accepted_tokens"] > 0  # a repetitive prompt: ngram guesses right
    assert sum(s["k"] for s in steps) == spec_stats["num_draft_tokens"]
    hist: dict[str, int] = {}
    for s in steps[1:]:  # the first step is the prefill's token, not a decoding step
        hist[str(s["k"])] = hist.get(str(s["k"]), 0) + 1
    assert hist == spec_stats["k_histogram"]
    for s in steps:  # accepted guesses come first in a step, then at most one token of the target's own
        flags = [t["accepted"] for t in s["tokens"]]
        assert flags == sorted(flags, reverse=True) and flags.count(False) <= 1 and sum(flags) <= s["k"]


@pytest.mark.parametrize("spec_config", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
def test_speculation_opt_out_is_plain_and_greedy_identical(spec_config):
    """Two requests in flight at once, one opted out: the same greedy text; the opted-out one never drafts."""
    with Server(create_app(tiny_llm(spec_config), MODEL)) as s:
        c = s.client()

        def one(speculation):
            return c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32, temperature=0,
                                        extra_body={"ignore_eos": True, "draftwise": {"speculation": speculation}})

        with ThreadPoolExecutor(2) as pool:
            on, off = pool.map(one, [True, False])
    assert on.choices[0].text == off.choices[0].text and on.choices[0].text
    on_spec, off_spec = on.model_extra["draftwise"]["spec"], off.model_extra["draftwise"]["spec"]
    assert on_spec["num_drafts"] > 0
    assert off_spec["num_drafts"] == 0 and set(off_spec["k_histogram"]) == {"0"}


def test_bad_extension_field_names_it(server):
    for ext in ({"speculation": "no"}, {"provenanse": True}, "yes"):
        resp = httpx.post(server.url + "/v1/completions", headers=AUTH,
                          json={"model": MODEL, "prompt": "w1", "max_tokens": 2, "draftwise": ext})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "draftwise", resp.text


def test_page_is_public_info_needs_the_key(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for asset in ("app.js", "style.css"):
        assert asset in page.text and httpx.get(f"{server.url}/static/{asset}").status_code == 200
    assert httpx.get(server.url + "/draftwise/info").status_code == 401
    info = httpx.get(server.url + "/draftwise/info", headers=AUTH).json()
    assert info["model"] == MODEL and info["speculative_config"]["method"] == "ngram"
    assert (info["max_model_len"], info["max_num_seqs"]) == (16384, 4)


def test_static_files_are_package_data():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    files = sorted(p.name for p in STATIC_DIR.iterdir())
    assert files == ["app.js", "index.html", "style.css"]
    assert "static/*" in data["draftwise.server"]


# ---- token pieces: multi-byte characters, stop strings, tokens the stream never saw -----------------------
def feed(tok: Tokenizer, ids: list[int], size: int, stop=None) -> tuple[TextStream, list[str], list[list[str]]]:
    """Runs ids through a TextStream in steps of 1..size tokens, as the engine thread does (tokens after a stop
    string are not emitted); returns the stream, each step's delta and each step's pieces."""
    stream = TextStream(tok, stop)
    prov = TokenProvenance(stream, "ngram")
    deltas, pieces, i, step = [], [], 0, 0
    while i < len(ids) and not stream.stopped:
        step = step % size + 1
        n = 0
        for t in ids[i:i + step]:
            n += 1
            if prov.add(t):
                break
        i += n
        delta = stream.delta()
        if i >= len(ids) or stream.stopped:
            delta += stream.finish()
        deltas.append(delta)
        pieces.append([t["text"] for t in prov.chunk(delta, [(n, 0, 0)])["steps"][0]["tokens"]])
        assert len(pieces[-1]) == n
    return stream, deltas, pieces


def test_pieces_follow_multibyte_characters(tiny_gguf_path):
    tok = Tokenizer.from_gguf(tiny_gguf_path)
    text = "héllo 😀 wörld, 你好 🇫🇷!"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    expected = [detok.add(t) for t in ids]  # each token's own text: "" until its character completes
    assert "" in expected  # the case under test: characters that span several tokens
    stream, deltas, pieces = feed(tok, ids, 4)
    assert "".join(deltas) == stream.text == text
    assert [p for step in pieces for p in step] == expected
    assert all("".join(p) == d for p, d in zip(pieces, deltas))
    assert not any("\ufffd" in p for step in pieces for p in step)


def test_pieces_with_a_stop_string_and_an_unseen_last_token(tiny_gguf_path):
    tok = Tokenizer.from_gguf(tiny_gguf_path)
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    stream, deltas, pieces = feed(tok, ids, 3, stop=["gamma"])
    assert stream.stopped and stream.text == "alpha beta "
    assert "".join(deltas) == stream.text
    assert all("".join(p) == d for p, d in zip(pieces, deltas))
    # EOS ends a request before the stream sees it: its piece is empty and the chunk's text is unchanged
    stream = TextStream(tok)
    prov = TokenProvenance(stream, "ngram")
    prov.add(ids[0])
    ext = prov.chunk(stream.delta(), [(2, 0, 0)])
    assert [t["text"] for t in ext["steps"][0]["tokens"]] == [tok.decode(ids[:1]), ""]


# ---- the page in a browser --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    missing = []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing.append("the playwright package (requirements-dev.txt)")
    if not os.path.exists(CHROMIUM) or shutil.which(CHROMIUM) is None:
        missing.append(f"Chromium at {CHROMIUM} (apt-get install chromium)")
    if missing:
        message = "browser tests need " + " and ".join(missing) + "; `make setup` installs them"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = ctx.new_page()
    pg.set_default_timeout(60_000)
    pg.goto(server.url + "/")
    yield pg
    ctx.close()


def use_key(page, key: str) -> None:
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Use").click()


def ready(page, prompt: str, max_tokens: int) -> None:
    from playwright.sync_api import expect

    use_key(page, KEY)
    expect(page.locator("#info-model")).to_have_text(MODEL)
    page.get_by_label("Completion").check()
    page.get_by_label("Max tokens").fill(str(max_tokens))
    page.get_by_label("Prompt", exact=True).fill(prompt)


def test_send_streams_and_highlights_accepted_tokens(page, server):
    from playwright.sync_api import expect

    ready(page, PROMPTS[0], 24)
    expect(page.locator("#info-spec")).to_contain_text("ngram, k=3")
    page.get_by_label("Prompt", exact=True).press("Control+Enter")  # keyboard send
    expect(page.locator("#status")).to_contain_text("Done (", timeout=60_000)
    expected = client(server).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24,
                                                 temperature=0).choices[0].text
    assert page.locator("#output").inner_text() == expected and expected
    assert page.locator("#output .acc").count() >= 1  # accepted draft guesses are highlighted
    for fig in ("#fig-tps", "#fig-ttft", "#fig-accept", "#fig-mal"):
        assert page.locator(fig).inner_text() != "–", fig
    assert page.locator("#k-hist .bar").count() >= 1
    assert page.evaluate("() => !location.href.includes('sekret') && sessionStorage.getItem('draftwise.apiKey')") \
        == KEY


def test_stop_aborts_and_frees_the_slot(page, server):
    from playwright.sync_api import expect

    wait_for_idle(server)
    before = metric(server.metrics(AUTH), "draftwise:request_success_total", finished_reason="abort")
    ready(page, PROMPTS[0], 16000)  # tens of seconds on the tiny model: Stop comes long before the end
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#output")).to_contain_text("w", timeout=60_000)  # streamed text, mid-generation
    expect(page.get_by_role("button", name="Stop")).to_be_enabled()
    m = server.metrics(AUTH)
    assert metric(m, "draftwise:num_requests_running") == 1 and metric(m, "draftwise:kv_slots_free") == 3
    page.get_by_role("button", name="Stop").click()
    expect(page.locator("#status")).to_have_text("Stopped.")
    m = wait_for_idle(server)
    assert metric(m, "draftwise:request_success_total", finished_reason="abort") == before + 1


def test_bad_api_key_and_bad_field_show_errors(page):
    from playwright.sync_api import expect

    expect(page.locator("#error")).to_contain_text("401")  # no key yet: the page says the server wants one
    use_key(page, "wrong")
    expect(page.locator("#error")).to_contain_text("refused the API key (401)")
    ready(page, PROMPTS[1], 4)
    expect(page.locator("#error")).to_be_hidden()
    page.get_by_label("Top-p").fill("5")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#error")).to_contain_text("Bad request (400): field “top_p”")


def test_busy_server_shows_429(browser):
    """One slot, no queue: while another client's stream holds the slot, the page's request gets a readable 429."""
    from playwright.sync_api import expect

    with Server(create_app(tiny_llm(max_num_seqs=1, max_model_len=16384), MODEL, max_waiting=0)) as s:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 16000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as held:
            lines = held.iter_lines()
            next(lines)  # admitted: the only slot is taken; keep reading it while the page tries
            reader = ThreadPoolExecutor(1).submit(lambda: sum(1 for _ in lines))
            ctx = browser.new_context()
            pg = ctx.new_page()
            pg.set_default_timeout(60_000)
            pg.goto(s.url + "/")
            pg.get_by_label("Prompt", exact=True).fill(PROMPTS[1])
            assert metric(s.metrics(), "draftwise:num_requests_running") == 1
            pg.get_by_role("button", name="Send").click()
            expect(pg.locator("#error")).to_contain_text("The server is busy (429)")
            expect(pg.locator("#error")).to_contain_text("Try again in 1 s")
            ctx.close()
            assert not reader.done()  # the slot was held all along


def test_side_by_side_greedy_is_identical(page):
    from playwright.sync_api import expect

    ready(page, PROMPTS[2], 16)
    page.get_by_role("button", name="Side by side: off vs on").click()
    expect(page.locator("#compare-verdict")).to_have_text("identical text", timeout=60_000)
    off, on = page.locator("#cmp-off").inner_text(), page.locator("#cmp-on").inner_text()
    assert off == on and on
    assert page.locator("#cmp-off .acc").count() == 0  # speculation off: nothing was guessed
    expect(page.locator("#cmp-on-meta")).to_contain_text("tok/s")


def test_usable_at_360px(browser, server):
    ctx = browser.new_context(viewport={"width": 360, "height": 740})
    pg = ctx.new_page()
    pg.goto(server.url + "/")
    pg.wait_for_load_state("networkidle")
    assert pg.evaluate("() => document.documentElement.scrollWidth") <= 360
    for label in ("API key", "Prompt", "Temperature", "Top-p", "Max tokens", "Seed"):
        box = pg.get_by_label(label, exact=True).bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 360, label
    ctx.close()

"""Structured outputs through the engine: greedy constrained speculation equals greedy constrained plain decoding
token for token (json_schema, regex, choice × ngram, draft_model, grammar, grammar+ngram, grammar+draft_model ×
k = 1..8), sampling keeps the masked target distribution (chi-square against an exact enumeration), finish
reasons, the grammar proposer and its config, and the forced-token counters.

Models: a random qwen2 decoder over a tiny byte-level BPE vocabulary (tests/harness.json_llm), so JSON,
regexes and choices are spellable; the draft is a noisy copy of the target."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from draftwise.config import ConfigError, parse_spec_config
from draftwise.kv_cache import KVCache
from draftwise.sampling import SamplingParams, process_logits
from draftwise.spec_decode.grammar import GrammarProposer
from draftwise.spec_decode.ngram import NgramProposer
from draftwise.spec_decode.proposer import EMPTY_DRAFT_IDS, Draft
from draftwise.structured import mask_logits, parse_structured_outputs
from tests.harness import json_llm, one_torch_thread  # noqa: F401 (a fixture)

PERSON = {  # bounded: every string and number has a maximum length, so a random model completes it
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "mood": {"enum": ["positive", "negative", "neutral"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "mood", "active"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": {"json": PERSON, "disable_any_whitespace": True},
    # pretty-printed JSON as a regex (a random model would fill free JSON whitespace forever): the layout and keys
    # are forced between the values, so the grammar proposer interleaves forced stretches with n-gram guesses
    "layout": {"regex": r'\{\n  "name": "[a-z]{1,5}",\n  "age": [0-9]{1,2},\n  "mood": "(positive|negative)"\n\}'},
    "regex": {"regex": r"(\d{3}-\d{4}|[a-z]{2,6}@[a-z]{3,5}\.(com|org))"},
    "choice": {"choice": ["positive", "negative", "neutral", "mixed"]},
}
METHODS = {
    "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "draft_model": {"method": "draft_model", "model": "noisy-draft"},
    "grammar": {"method": "grammar"},
    "grammar+ngram": {"method": "grammar", "then": {"method": "ngram", "prompt_lookup_min": 1}},
    "grammar+draft_model": {"method": "grammar", "then": {"method": "draft_model", "model": "noisy-draft"}},
}
PROMPTS = ['{"name": "Ada", "age": 36, "mood": "positive", "active": true} user', "user positive or negative",
           "system 2024-05-01 mixed"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm():
    return json_llm(k_max=8, max_num_seqs=4)


def _run(llm, so, spec_config=None, max_tokens=48, **kw):
    llm.set_speculation(spec_config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so, **kw)
    return llm.generate(PROMPTS, params)


def _check_valid(name, text):
    if name == "json_schema":
        jsonschema.validate(json.loads(text), PERSON)
    elif name == "choice":
        assert text in CONSTRAINTS["choice"]["choice"]
    else:
        import re

        assert re.fullmatch(CONSTRAINTS[name]["regex"], text), text


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_greedy_constrained_speculation_equals_constrained_plain(llm, constraint, method):
    so = CONSTRAINTS[constraint]
    plain = _run(llm, so)
    for out in plain:
        assert out.outputs[0].finish_reason == "stop"  # bounded constraints complete well within max_tokens
        _check_valid(constraint, out.outputs[0].text)
    drafted = accepted = forced = 0
    for k in range(1, 9):
        spec_config = dict(METHODS[method], num_speculative_tokens=k)
        outs = _run(llm, so, spec_config)
        for p, s in zip(plain, outs):
            assert s.outputs[0].token_ids == p.outputs[0].token_ids, (constraint, method, k, s.outputs[0].text)
            assert s.outputs[0].finish_reason == p.outputs[0].finish_reason
            drafted += s.spec["num_draft_tokens"]
            accepted += s.spec["num_accepted_tokens"]
            forced += s.spec["num_forced_tokens"]
            assert s.spec["num_accepted_forced_tokens"] <= s.spec["num_forced_tokens"]
    if constraint != "choice" or method.startswith("grammar"):  # a 1-3 token choice rarely repeats the prompt
        assert drafted > 0 and accepted > 0  # not vacuous: guesses were verified and some kept
    if method.startswith("grammar") and constraint != "regex":
        assert forced > 0  # keys, separators and choice tails are forced
    if not method.startswith("grammar"):
        assert forced == 0


def test_finish_reasons(llm):
    so = CONSTRAINTS["json_schema"]
    done = _run(llm, so, {"method": "grammar", "num_speculative_tokens": 4})
    for out in done:
        assert out.outputs[0].finish_reason == "stop"  # the grammar completed: no EOS needed
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    cut = _run(llm, so, {"method": "grammar", "num_speculative_tokens": 4}, max_tokens=3)
    for out in cut:
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
        with pytest.raises(json.JSONDecodeError):
            json.loads(out.outputs[0].text)  # incomplete: the grammar could not finish within max_tokens


def test_ignore_eos_still_stops_when_the_grammar_is_done(llm):
    for out in _run(llm, CONSTRAINTS["choice"], {"method": "ngram", "num_speculative_tokens": 3}, ignore_eos=True):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in CONSTRAINTS["choice"]["choice"]


def test_unconstrained_requests_share_the_batch(llm):
    """A constrained and a free request in one batch: each is decoded as it would be alone."""
    llm.set_speculation({"method": "grammar", "num_speculative_tokens": 4, "then": {"method": "ngram"}})
    free = SamplingParams(temperature=0.0, max_tokens=12)
    bound = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=CONSTRAINTS["json_schema"])
    both = llm.generate(PROMPTS[:2], [free, bound])
    alone = [llm.generate(PROMPTS[0], free)[0], llm.generate(PROMPTS[1], bound)[0]]
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in alone]
    assert both[0].spec["num_forced_tokens"] == 0  # without a grammar the grammar proposer forces nothing
    jsonschema.validate(json.loads(both[1].outputs[0].text), PERSON)


# ---- sampling: the masked target distribution, exactly -------------------------------------------------
CHOICES = ["yes", "no", "neutral", "ne"]  # "ne" is a prefix of "neutral": EOS competes with "utral"
NUM_SAMPLES = 1500


def _exact(llm, prompt_ids, params) -> dict[tuple, float]:
    """P(output ids) of plain sampling from the masked, processed target: every path the grammar allows."""
    model, vocab = llm.model, llm.model.config.vocab_size
    grammar = llm.compile_grammar(params)
    cache = KVCache(model.config.num_layers, 1, model.config.num_kv_heads, 64, model.config.head_dim,
                    model.dtype, model.device)
    eos = set(llm.eos_token_ids)
    out: dict[tuple, float] = {}

    def walk(matcher, ids, prob):
        cache.free(0)
        seq = torch.tensor([prompt_ids + ids])
        logits = model(seq, torch.arange(seq.shape[1])[None], cache, torch.tensor([0]))[0, -1]  # [V]
        p = process_logits(mask_logits(logits, matcher.allowed(vocab)), params.temperature)  # [V]
        for tok in torch.nonzero(p > 0).flatten().tolist():
            m = matcher.copy()
            assert m.advance(tok)
            if tok in eos or m.is_finished():
                out[tuple(ids + [tok])] = out.get(tuple(ids + [tok]), 0.0) + prob * float(p[tok])
            else:
                walk(m, ids + [tok], prob * float(p[tok]))

    walk(grammar.matcher(), [], 1.0)
    return out


@pytest.mark.parametrize("spec_config", [
    {"method": "draft_model", "model": "noisy-draft", "num_speculative_tokens": 3},
    {"method": "grammar", "num_speculative_tokens": 3, "then": {"method": "draft_model", "model": "noisy-draft"}},
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
], ids=["draft_model", "grammar+draft_model", "ngram"])
def test_sampling_keeps_the_masked_target_distribution(spec_config):
    llm = json_llm(spec_config, max_num_seqs=32, k_max=3, seed=7)
    prompt = "user:neutral,ne,yes,no,neutral"  # the choices' own tokens, so n-gram lookup has guesses
    ids = llm.tokenizer.encode(prompt)
    params = SamplingParams(temperature=1.0, max_tokens=12, structured_outputs={"choice": CHOICES})
    exact = _exact(llm, ids, params)
    assert abs(sum(exact.values()) - 1) < 1e-5 and len(exact) > 4 and max(exact.values()) < 0.9
    outs = llm.generate([{"prompt_token_ids": ids}] * NUM_SAMPLES, params)
    seqs = [tuple(o.outputs[0].token_ids) for o in outs]
    assert all(o.outputs[0].text in CHOICES for o in outs)
    assert sum(o.spec["num_accepted_tokens"] for o in outs) > 0  # speculation ran
    cells = sorted(exact, key=exact.get, reverse=True)
    expected = np.array([exact[c] for c in cells]) * NUM_SAMPLES
    observed = np.array([seqs.count(c) for c in cells])
    assert observed.sum() == NUM_SAMPLES  # no path outside the enumeration
    big = expected >= 5  # pool the rare paths into one cell
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:
        obs, exp = obs[:-1].copy(), exp[:-1].copy()
        obs[-1] += observed[~big].sum()
        exp[-1] += expected[~big].sum()
    pvalue = chisquare(obs, exp * obs.sum() / exp.sum()).pvalue  # exact sums for scipy (float32 probabilities)
    print(f"{spec_config['method']}: {len(obs)} cells, p = {pvalue:.4g}")
    assert pvalue > 0.001


# ---- the grammar proposer and its config -------------------------------------------------------------
def test_grammar_proposer_proposes_forced_tokens_then_the_other_method(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=CONSTRAINTS["json_schema"])
    matcher = llm.compile_grammar(params).matcher()
    prompt = llm.tokenizer.encode(PROMPTS[0])
    p = GrammarProposer(NgramProposer(1, 3))
    p.begin(0, prompt, params, None, matcher)
    d = p.propose([0], [6])[0]
    forced = matcher.forced_tokens(6)
    assert forced and d.num_forced == len(forced) and d.token_ids[: len(forced)].tolist() == forced
    assert llm.tokenizer.decode(forced).startswith('{"name":')
    after = matcher.copy()
    after.advance_many(forced)
    nxt = int(after.allowed(llm.model.config.vocab_size).nonzero()[0])
    p.accept(0, len(forced), nxt)  # the target kept the forced tokens and emitted an allowed one
    assert p.grammars[0].num_tokens == len(forced) + 1 and matcher.num_tokens == 0  # its own copy
    p.end(0)
    free = GrammarProposer(NgramProposer(1, 3))
    prompt = llm.tokenizer.encode('{"name": "Ada", "age": 3} {"name": "Ada", "age')
    free.begin(1, prompt, SamplingParams(temperature=0.0), None, None)
    d = free.propose([1], [4])[0]
    assert d.num_forced == 0  # no grammar: only the n-gram's guesses (the prompt repeats itself)
    plain = NgramProposer(1, 3)
    plain.begin(1, prompt, SamplingParams(temperature=0.0), None)
    assert d.token_ids.tolist() == plain.propose([1], [4])[0].token_ids.tolist() != []


class OracleProposer:
    """A `then` proposer that knows the output (`full`, token ids): after a draft that is a prefix of it, it
    guesses the next tokens of `full` up to the next index in `stops`, then one wrong token; it records its calls."""

    vocab_limit = None

    def __init__(self, full: list[int], stops: list[int], wrong: int):
        self.full, self.stops, self.wrong = full, stops, wrong
        self.calls, self.accepted = [], []

    def begin(self, slot, prompt_ids, params, generator, grammar=None, scope=""):
        pass

    def propose(self, slots, k_per_seq, after=None):
        self.calls.append((list(k_per_seq), [list(a) for a in after]))
        out = []
        for k, a in zip(k_per_seq, after):
            n = len(a)
            ids = []
            if k > 0 and self.full[:n] == a:
                ids = self.full[n:next((s for s in self.stops if s > n), n)] + [self.wrong]
            ids = ids[:k]
            out.append(Draft(torch.tensor(ids, dtype=torch.int64) if ids else EMPTY_DRAFT_IDS))
        return out

    def accept(self, slot, num_accepted, token_id):
        self.accepted.append((num_accepted, token_id))

    def end(self, slot):
        pass


def _ends(tok, full: list[int], text: str) -> int:  # the shortest prefix of `full` whose text ends with `text`
    return next(i for i in range(1, len(full) + 1) if tok.decode(full[:i]).endswith(text))


def _regex_case(llm, regex: str, text: str):
    """(tokenizer, params, a fresh matcher, `text`'s token ids, the tokens the grammar forces at the start)."""
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"regex": regex})
    matcher = llm.compile_grammar(params).matcher()
    return llm.tokenizer, params, matcher, llm.tokenizer.encode(text), matcher.forced_tokens(60)


def test_grammar_proposer_interleaves_forced_tokens_with_the_other_methods_allowed_guesses(llm):
    text = "say:hello;to;the;world;and;bye;now"
    tok, params, matcher, full, lead = _regex_case(llm, "say:(hello|howdy);to;the;world;and;(bye|ciao);now", text)
    assert lead and full[: len(lead)] == lead and not tok.decode(lead).endswith("hello")  # forced up to a choice
    wrong = tok.encode("x")[0]
    oracle = OracleProposer(full, [_ends(tok, full, "hello"), _ends(tok, full, "bye")], wrong)
    p = GrammarProposer(oracle)
    p.begin(0, tok.encode("user"), params, None, matcher)
    k = len(full) + 5
    d = p.propose([0], [k])[0]
    ids = d.token_ids.tolist()
    # forced lead, the oracle's "...hello" (cut at its wrong token), forced ";to;the;world;and;", the oracle's
    # "bye" (cut), forced ";now"; then the oracle has nothing but a wrong token
    assert ids == full and tok.decode(ids) == text
    guessed = set(range(len(lead), oracle.stops[0])) | set(range(len(oracle.calls[1][1][0]), oracle.stops[1]))
    assert guessed and set(d.forced) == set(range(len(ids))) - guessed  # the oracle's guesses are not "forced"
    assert tok.decode([ids[i] for i in d.forced if oracle.stops[0] <= i < oracle.stops[1]]).startswith(";to;the;")
    # asked after the lead, after ";and;", after ";now" (only a wrong guess), then told the final draft
    assert [c[1][0] for c in oracle.calls[:3]] == [lead, full[: len(oracle.calls[1][1][0])], full]
    assert tok.decode(oracle.calls[1][1][0]).endswith(";and;") and oracle.calls[3] == ([0], [full])
    assert len(oracle.calls) == 4
    mid = matcher.copy()
    assert mid.advance_many(ids) == len(ids)
    nxt = int(mid.allowed(llm.model.config.vocab_size).nonzero()[0])  # the grammar is complete: an EOS
    p.accept(0, len(ids), nxt)
    assert oracle.accepted == [(len(ids), nxt)] and p.grammars[0].num_tokens == len(ids) + 1


def test_grammar_proposer_asks_the_other_method_once_when_its_guesses_fill_k(llm):
    tok, params, matcher, full, lead = _regex_case(llm, "say:(hello|howdy);to;the;world", "say:hello;to;the;world")
    oracle = OracleProposer(full, [len(full)], tok.encode("x")[0])
    p = GrammarProposer(oracle)
    p.begin(0, tok.encode("user"), params, None, matcher)
    k = len(lead) + 1  # room for one guess of the oracle's
    d = p.propose([0], [k])[0]
    assert d.token_ids.tolist() == full[:k] and list(d.forced) == list(range(len(lead)))
    assert oracle.calls == [([1], [lead])]  # filled k: asked once, and what it guessed is the draft: no re-telling


def test_grammar_proposer_learns_layout_and_never_content(llm):
    tok = llm.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs={"json": PERSON})  # free whitespace
    pretty = '{\n  "name": "Ada",\n  "age": 36,\n  "mood": "positive",\n  "active": true\n}'
    ids = tok.encode(pretty)
    grammar = llm.compile_grammar(params)
    assert grammar.matcher().advance_many(ids) == len(ids)
    fresh = GrammarProposer()
    fresh.begin(1, tok.encode("user"), params, None, grammar.matcher())
    before = fresh.propose([1], [len(ids)])[0].token_ids.tolist()
    p = GrammarProposer()
    p.begin(0, tok.encode("user"), params, None, grammar.matcher())
    for t in ids:  # the target wrote `pretty` one token per step
        p.propose([0], [0])
        p.accept(0, 0, t)
    p.end(0)
    layout = grammar.matcher().layout_ids
    assert p.layout
    learned = set(p.layout.next) | {t for c in [*p.layout.next.values(), *p.layout.at.values()] for t in c}
    assert learned and learned <= layout
    p.begin(1, tok.encode("user"), params, None, grammar.matcher())
    d = p.propose([1], [len(ids)])[0]
    got = d.token_ids.tolist()
    assert ids[: len(got)] == got and len(got) > len(before)  # the learned layout, up to the first value
    assert tok.decode(got).startswith('{\n  "name": "') and "Ada" not in tok.decode(got)
    assert all(t in layout for i, t in enumerate(got) if i not in d.forced)  # only forced tokens carry content
    hot = SamplingParams(temperature=1.0, max_tokens=80, structured_outputs={"json": PERSON})
    p.begin(2, tok.encode("user"), hot, None, grammar.matcher())
    # a sampled request is guided only by its own output's layout: its seed alone decides its tokens
    assert p.propose([2], [len(ids)])[0].token_ids.tolist() == before


def test_free_whitespace_json_greedy_speculation_equals_plain(llm):
    """A random target fills free JSON whitespace (`\\r` after `\\r`): the learned layout proposes long runs of it."""
    so = {"json": PERSON}
    plain = _run(llm, so)
    proposed = 0
    for k in (1, 3, 8):
        outs = _run(llm, so, {"method": "grammar", "num_speculative_tokens": k, "then": {"method": "ngram"}})
        for p, s in zip(plain, outs):
            assert s.outputs[0].token_ids == p.outputs[0].token_ids, (k, s.outputs[0].text)
            proposed += s.spec["num_draft_tokens"] - s.spec["num_forced_tokens"]
    assert proposed > 0


def test_grammar_config_parsing():
    c = parse_spec_config({"method": "grammar", "num_speculative_tokens": 6, "then": {"method": "ngram"}})
    assert c.then.method == "ngram" and c.then.num_speculative_tokens == 0 and c.k_max == 6
    assert c.to_dict()["then"] == {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert parse_spec_config({"method": "grammar", "num_speculative_tokens": 2, "then": "ngram"}).then.method == "ngram"
    assert parse_spec_config({"method": "grammar", "num_speculative_tokens": 2}).then is None
    for bad, words in [
        ({"method": "ngram", "num_speculative_tokens": 2, "then": {"method": "ngram"}}, "only applies to method grammar"),
        ({"method": "grammar", "num_speculative_tokens": 2, "then": {"method": "grammar"}}, "then"),
        ({"method": "grammar", "num_speculative_tokens": 2, "then": {"method": "ngram", "num_speculative_tokens": 2}},
         "num_speculative_tokens"),
        ({"method": "grammar", "num_speculative_tokens": 2, "then": {"method": "draft_model"}}, "model"),
        ({"method": "grammar", "num_speculative_tokens": 2, "then": 3}, "then"),
        ({"method": "grammar", "num_speculative_tokens": 2, "then": {"method": "ngram", "bogus": 1}}, "bogus"),
    ]:
        with pytest.raises(ConfigError, match=words):
            parse_spec_config(bad)


def test_sampling_params_structured_outputs():
    sp = SamplingParams(structured_outputs={"regex": "a+"})
    assert sp.structured_outputs == parse_structured_outputs({"regex": "a+"})
    assert SamplingParams(structured_outputs={}).structured_outputs is None
    with pytest.raises(ConfigError, match="regex"):
        SamplingParams(structured_outputs={"regex": "(unclosed"})
    with pytest.raises(ConfigError, match="bogus"):
        SamplingParams(structured_outputs={"bogus": 1})


def test_grammar_proposer_shares_the_draft_model(llm):
    """grammar+draft_model reuses the draft_model arm's proposer (the draft loads once)."""
    llm.set_speculation({"method": "draft_model", "model": "noisy-draft", "num_speculative_tokens": 2})
    draft = llm.proposer
    llm.set_speculation({"method": "grammar", "num_speculative_tokens": 2,
                         "then": {"method": "draft_model", "model": "noisy-draft"}})
    assert llm.proposer.then is draft

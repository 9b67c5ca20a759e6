"""AdaptiveK's policy logic with injected costs and acceptances (no timing asserts): the cost model's choices,
the batch decision against planted step-cost grids (never speculating where the grid says it loses, padded widths,
stopping and starting again as the online correction follows the load), the grid's own correction, acceptance
learned per request rather than from other workloads, the proposer's catch-up cost spread over the output its
request's kind typically ends with (finished requests only), and the probe cadence while plain decoding wins."""
import itertools
import random

import pytest
from dataclasses import dataclass, field

from draftwise.kernels.step_cost import RESID_RANGE, StepCost
from draftwise.sampling import SamplingParams
from draftwise.spec_decode import adaptive
from draftwise.spec_decode.adaptive import EXPLORE_EVERY, AdaptiveK

# measured shape on the default pair (Zen 4, 2 threads): 9 verified rows ~1.8x one row, a guess ~0.38 of a step
VERIFY = {w: 0.045 + 0.0045 * (w - 1) for w in range(1, 10)}
DRAFT = {k: 0.017 * k for k in range(9)}


@dataclass
class _Req:
    request_id: str = "r"
    prompt_ids: list = field(default_factory=lambda: [1] * 8)
    output_ids: list = field(default_factory=lambda: [1])
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0, max_tokens=96))
    cache_scope: str = ""
    finish_reason: str | None = "stop"  # what end() is told (the engine sets it before): "stop" unless a test says


def _policy(**kw) -> AdaptiveK:
    return AdaptiveK(8, VERIFY, DRAFT, **kw)


def _steps(policy, req, n, accepted):
    """n steps: each asks the policy for k and reports `accepted(k)` of them kept."""
    k_per_step = []
    for _ in range(n):
        k = policy.choose(req)
        k_per_step.append(k)
        if k:
            policy.observe(req, k, min(k, accepted(k)))
    return k_per_step


def test_cost_model_choices():
    req = _Req()
    # verification that costs 10x per extra token: guessing cannot pay, k = 0 (plain decoding)
    costly = AdaptiveK(6, {w: 0.01 * (1 + 10 * (w - 1)) for w in range(1, 8)})
    for _ in range(20):
        costly.observe(req, 6, 6)
    assert costly.choose(req) == 0
    # free verification, cheap draft, every guess accepted: the longest guess wins
    free = AdaptiveK(6, {w: 0.01 for w in range(1, 8)}, {k: 0.0001 * k for k in range(7)})
    for _ in range(20):
        free.observe(req, 6, 6)
    assert free.choose(req) == 6
    # same costs, but guesses always rejected at the first position: k = 0
    bad = AdaptiveK(6, {w: 0.01 for w in range(1, 8)}, {k: 0.002 * k for k in range(7)})
    for _ in range(50):
        bad.observe(req, 6, 0)
    assert bad.choose(req) == 0
    assert bad.acceptance(req) < 0.05


def test_a_request_s_own_evidence_outweighs_other_requests():
    """Hundreds of fully accepted steps of earlier requests (another workload) must not keep a request whose
    own guesses are rejected speculating: a few steps of its own evidence switch it to plain decoding."""
    p = _policy()
    for i in range(10):
        other = _Req(f"code{i}")
        _steps(p, other, 30, accepted=lambda k: k)
        p.end(other)
    chat = _Req("chat")
    assert p.choose(chat) > 0  # the engine's history is the prior: guess at first
    k_per_step = _steps(p, chat, 12, accepted=lambda k: 0)
    assert k_per_step[-4:] == [0, 0, 0, 0]


def test_recent_steps_weigh_more_than_old_ones():
    """A request whose guesses were all accepted for 60 steps, then all rejected (a code block ends, prose
    follows): k falls at once and reaches plain decoding within a dozen steps."""
    p = _policy()
    req = _Req(params=SamplingParams(max_tokens=500))
    assert _steps(p, req, 60, accepted=lambda k: k)[-1] >= 4
    k_per_step = _steps(p, req, 12, accepted=lambda k: 0)
    assert k_per_step == sorted(k_per_step, reverse=True) and k_per_step[1] < k_per_step[0] and k_per_step[-1] == 0


def _history(policy, accepted_of_3=(2, 3, 1), times=6, length=500):
    """Another request's steps of 3 guesses: acceptance ~0.75 per guess, the engine's prior for the next; it ends
    after `length` output tokens (the typical length the next requests' catch-up is spread over)."""
    other = _Req("other", output_ids=[1] * length, params=SamplingParams(max_tokens=500))
    for _ in range(times):
        for n in accepted_of_3:
            policy.observe(other, 3, n)
    policy.end(other)


def test_catching_up_is_charged_and_spread_over_what_is_left():
    """Acceptance that pays in the steady state, for a proposer that must first read a 400-token prompt (2 ms
    a token, ~18 plain steps): worth it with 500 tokens to go, not with 30; free for a proposer that reads
    nothing (n-gram)."""
    p = _policy(catch_up_cost=0.002)
    _history(p)
    near_end = _Req("near_end", prompt_ids=[1] * 400, params=SamplingParams(max_tokens=31))
    long = _Req("long", prompt_ids=[1] * 400, params=SamplingParams(max_tokens=500))
    assert p.choose(long) == 0  # a first decision (the prefill's guesses) pays the whole prompt's catch-up
    assert p.choose(near_end) == 0 and p.choose(near_end) == 0
    assert p.choose(long) > 0  # from then on spread over what is left
    free = _policy(catch_up_cost=0.0)
    _history(free)
    assert free.choose(_Req("near_end", prompt_ids=[1] * 400, params=SamplingParams(max_tokens=31))) > 0


def test_a_catch_up_is_spread_over_the_output_requests_typically_end_with():
    """Requests that end at a stop or EOS long before max_tokens leave few tokens to spread a catch-up over: where
    finished requests ended after ~20 tokens, a 400-token prompt's catch-up does not pay for a request allowed 500,
    where it does once they ran to 500. Planted: the length ignored (max_tokens left, as before) guesses."""
    def decisions(length, ignore_length=False):
        p = _policy(catch_up_cost=0.002)
        _history(p, length=length)
        if ignore_length:
            p.lengths.clear()
            p._kind_lengths.clear()
        req = _Req("long", prompt_ids=[1] * 400, params=SamplingParams(max_tokens=500))
        return [p.choose(req) for _ in range(3)]

    assert decisions(500)[1:] != [0, 0]
    short = decisions(20)
    assert short == [0, 0, 0], short
    assert decisions(20, ignore_length=True)[1:] != [0, 0]
    p = _policy()
    _history(p, length=20)
    assert p.remaining(_Req("a", output_ids=[1] * 5, params=SamplingParams(max_tokens=500))) == 15
    assert p.remaining(_Req("b", output_ids=[1] * 30, params=SamplingParams(max_tokens=500))) == 30  # past it
    assert p.remaining(_Req("c", output_ids=[1] * 5, params=SamplingParams(max_tokens=8))) == 3  # never past max



def _finish(policy, rid, length, params, scope="", reason="stop"):
    """A request of this kind (params, scope) ending after `length` output tokens, for `reason`."""
    policy.end(_Req(rid, output_ids=[1] * length, params=params, cache_scope=scope, finish_reason=reason))


CODE = SamplingParams(max_tokens=256, stop=["\ndef ", "\nclass "])  # a completion that stops early
CHAT = SamplingParams(max_tokens=500)  # an answer that runs to its limit


def test_the_typical_length_follows_the_request_s_kind(monkeypatch):
    """Two kinds of request share the engine: code completions stopping after 20 tokens and chat answers running
    to 500, finishing in turns. Each kind's catch-up is spread over its own typical output: a 400-token prompt's
    draft catch-up pays for the chat request and not for the code one. Planted: one engine-wide length (the kinds
    ignored) misprices one of them, whichever kind finished last."""
    def engine(kinds=True):
        if not kinds:
            monkeypatch.setattr(adaptive, "length_kinds", lambda req: ())
        p = _policy(catch_up_cost=0.002)
        _history(p, length=500)
        for i in range(4):
            _finish(p, f"chat{i}", 500, CHAT, reason="length")
            _finish(p, f"code{i}", 20, CODE)
        return p

    def case(p, params):
        out = _Req("o", output_ids=[1] * 5, params=params)
        req = _Req(f"new{params.max_tokens}", prompt_ids=[1] * 400, params=params)
        return p.remaining(out), [p.choose(req) for _ in range(3)]

    p = engine()
    assert case(p, CODE) == (15, [0, 0, 0])
    chat_left, chat_ks = case(p, CHAT)
    assert chat_left == 495 and chat_ks[1:] != [0, 0]
    blind = engine(kinds=False)
    assert case(blind, CODE)[0] != 15 and case(blind, CHAT)[0] != 495
    assert case(blind, CHAT)[1][1:] == [0, 0]  # the chat request priced at both kinds' mix (~250 tokens): plain
    monkeypatch.undo()

    # one shape, two scopes (API keys) whose requests end differently: each key its own, once it has
    # LENGTH_SAMPLES of them; a new key (and a key with fewer) the shape's across keys; a new shape the engine's
    p = _policy()
    for i in range(adaptive.LENGTH_SAMPLES):
        _finish(p, f"a{i}", 20, CODE, scope="key:a")
        _finish(p, f"b{i}", 200, CODE, scope="key:b")
    code_at = lambda scope: p.expected_length(_Req("q", params=CODE, cache_scope=scope))
    assert code_at("key:a") == pytest.approx(20) and code_at("key:b") == pytest.approx(200)
    shape = code_at("key:new")
    assert 20 < shape < 200 and shape == adaptive._harmonic(p._kind_lengths[adaptive.length_kinds(_Req(params=CODE))[1]])
    _finish(p, "c0", 100, CODE, scope="key:c")
    assert code_at("key:c") == code_at("key:new") != 100  # one sample is too few
    other = SamplingParams(max_tokens=64)
    assert p.expected_length(_Req("q", params=other)) == p.typical_length != shape


def test_an_aborted_or_failed_request_leaves_the_typical_length_alone(monkeypatch):
    """Where a request was cancelled or failed says nothing of where it would have ended: neither its kind's
    typical length nor the engine's moves. Planted: every end counted moves both."""
    def lengths(finished=adaptive.FINISHED):
        monkeypatch.setattr(adaptive, "FINISHED", finished)
        p = _policy()
        for i in range(adaptive.LENGTH_SAMPLES):
            _finish(p, f"chat{i}", 500, CHAT, reason="length")
        before = p.expected_length(_Req(params=CHAT)), p.typical_length
        _finish(p, "cut", 3, CHAT, reason="abort")
        _finish(p, "broke", 7, CHAT, reason="error")
        return before, (p.expected_length(_Req(params=CHAT)), p.typical_length)

    before, after = lengths()
    assert before == after == (500, 500)
    before, after = lengths(("stop", "length", "abort", "error"))
    assert after[0] < before[0] and after[1] < before[1]


def test_plain_steps_leave_the_proposer_behind():
    """After plain steps the proposer has the emitted tokens to catch up on (the draft model reads only when
    asked to guess); a verified guess brings it up to date."""
    p = _policy(catch_up_cost=0.002)
    req = _Req(prompt_ids=[1] * 10)
    for _ in range(3):
        assert p.choose(req) == 0  # a cold engine: α = 0.5 does not pay here
    assert p._behind["r"] == 10 + 1 + 3
    p.observe(req, 2, 1)
    assert p._behind["r"] == 1


def test_probes_while_plain_wins_come_less_and_less_often():
    p = _policy()
    req = _Req(params=SamplingParams(max_tokens=10_000))
    k_per_step = _steps(p, req, 200, accepted=lambda k: 0)
    probes = [i for i, k in enumerate(k_per_step) if k]
    assert probes == [EXPLORE_EVERY - 1, 3 * EXPLORE_EVERY - 1, 7 * EXPLORE_EVERY - 1]  # after 15, 31, 63 plain steps
    assert all(k_per_step[i] == adaptive.PROBE_K for i in probes)


def test_the_last_requests_set_the_next_one_s_prior():
    """The engine's α is what the last few finished requests saw: after code requests a new request starts
    guessing; after two requests whose guesses were rejected, the next one starts plain."""
    p = _policy()
    for i in range(5):
        code = _Req(f"code{i}")
        _steps(p, code, 40, accepted=lambda k: k)
        p.end(code)
    assert p.acceptance(_Req("next")) > 0.9 and p.choose(_Req("next")) > 0
    for i in range(2):
        chat = _Req(f"chat{i}")
        _steps(p, chat, 40, accepted=lambda k: 0)
        p.end(chat)
    assert p.acceptance(_Req("after")) < 0.4 and p.choose(_Req("after")) == 0


def test_guessing_starts_above_margin_and_stops_below_plain():
    """Hysteresis: at a predicted gain between 1.0x and MARGIN a request that is guessing keeps guessing
    (stopping is free, restarting pays the catch-up), one that is not does not start."""
    p = _policy()
    alpha = next(a / 100 for a in range(50, 100) if 1.0 < _gain(p, a / 100) < adaptive.MARGIN)
    p.engine_alpha = alpha
    idle, busy = _Req("idle"), _Req("busy")
    p._plain_run["idle"], p._plain_run["busy"], p._behind["idle"] = 3, 0, 1
    assert p.choose(idle) == 0 and p.choose(busy) > 0


def _gain(p, alpha):
    return max(p.expected_rate(k, alpha) for k in range(1, 9)) / p.expected_rate(0, alpha)


def test_auto_through_the_api_calibrates_once_and_stays_exact():
    """`num_speculative_tokens: "auto"` assembled by LLM.set_speculation: one policy per config (cached) over the
    LLM's one target grid, greedy output equal to plain decoding's, every step in the k histogram, and the engine's
    steps correcting the grid (no extra forwards)."""
    from tests.harness import PROMPTS, tiny_llm

    llm = tiny_llm(max_num_seqs=2, k_max=8)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    for spec_config in ({"method": "ngram", "num_speculative_tokens": "auto"},
                 {"method": "draft_model", "model": "d", "num_speculative_tokens": "auto"}):
        llm.set_speculation(spec_config)
        policy = llm.engine.k_policy
        assert isinstance(policy, AdaptiveK) and policy.verify_cost(1, 9) >= policy.verify_cost(1, 1) > 0
        outs = llm.generate(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert all(sum(o.spec["k_histogram"].values()) > 0 for o in outs)
        assert policy.target is llm.step_cost(llm.model) and policy.target.observations > 0
        llm.set_speculation(None)
        llm.set_speculation(spec_config)
        assert llm.engine.k_policy is policy


# ---- the batch decision against planted grids ------------------------------------------------------------------

def _grid(fn, batches=range(1, 9), widths=range(1, 17)) -> StepCost:
    """A planted grid: fn(B, width) -> seconds at every cell (all of them "measured")."""
    return StepCost({(b, w): fn(b, w) for b in batches for w in widths})


# memory-bound at one row (width nearly free), compute-bound from ~4 rows (every token of every row costs)
ROW_BOUND = _grid(lambda b, w: 0.050 + 0.0004 * b * w + (0.006 * b * w if b >= 4 else 0.0))


def _brute(policy, alphas, caps):
    """The best k per row by exhaustive search (small batches)."""
    return max((list(ks) for ks in itertools.product(*(range(c + 1) for c in caps))),
               key=lambda ks: policy.batch_rate(ks, alphas))


def test_the_policy_never_speculates_where_the_planted_grid_says_it_loses():
    """At every batch size 1..8 and many acceptances: the chosen ks predict at least plain's rate on the planted
    grid (priced ragged, as the engine verifies: a guessing mix is chosen only where it predicts more than plain),
    and wherever no k per row beats plain (exhaustively, batches up to 4), every row is plain."""
    rng = random.Random(0)
    for trial in range(200):
        B = rng.randint(1, 8)
        alphas = [rng.uniform(0.0, 0.95) for _ in range(B)]
        p = AdaptiveK(8 if B > 4 else 4, ROW_BOUND)
        ks, rate, plain = p.best_ks(alphas, [p.k_max] * B)
        assert rate >= plain
        assert p.batch_rate(ks, alphas) == rate
        if any(ks):
            assert rate > plain
        if B <= 4 and p.batch_rate(_brute(p, alphas, [4] * B), alphas) <= plain:
            assert ks == [0] * B, (trial, B, alphas, ks)
    lows = [0.3] * 6
    p = AdaptiveK(8, ROW_BOUND)
    assert p.batch_rate([2] * 6, lows) < p.batch_rate([0] * 6, lows)  # the planted grid: guessing loses at 6 rows
    assert p.choose_batch([_Req(f"r{i}") for i in range(6)], [8] * 6) == [0] * 6
    assert p.best_ks([0.3], [8])[0][0] > 0  # ... and pays for one row alone


def test_the_batch_decision_is_near_the_exhaustive_optimum():
    """Small batches: the search (top-m rows by acceptance at a shared K, then each row's own k) reaches the best
    rate an exhaustive search over every k per row finds, within 1%, with a draft model's per-depth cost."""
    rng = random.Random(1)
    draft = _grid(lambda b, w: 0.010 + 0.001 * b * w)
    for _ in range(40):
        B = rng.randint(1, 3)
        alphas = [rng.uniform(0.0, 0.95) for _ in range(B)]
        caps = [rng.randint(0, 5) for _ in range(B)]
        p = AdaptiveK(5, ROW_BOUND, draft, catch_up_cost=0.0)
        ks, rate, _ = p.best_ks(alphas, caps)
        assert all(k <= c for k, c in zip(ks, caps))
        assert rate >= 0.99 * p.batch_rate(_brute(p, alphas, caps), alphas)


def test_a_padded_step_lets_rows_ride_along_with_the_widest():
    """A batch holding a token tree is padded to the widest row (`padded`): with one row guessing 6 anyway, the
    others' guesses cost no verification, so a free proposer (n-gram) has every row guess (cost by padded width).
    Ragged (the engine's chains), the same guesses cost their tokens: the unlikely rows guess less."""
    flat = _grid(lambda b, w: 0.050 + 0.004 * w + 0.001 * b)  # width costs, rows nearly free
    alphas = [0.95, 0.2, 0.2, 0.2]
    p = AdaptiveK(6, flat)
    p.padded = True
    ks, _, _ = p.best_ks(alphas, [6] * 4)
    assert ks[0] == 6 and all(k == 6 for k in ks[1:])
    # a planted cost that charged each row only its own tokens would leave the unlikely rows plain: the padded
    # grid's rate must differ from such a ragged one
    ragged = sum(adaptive._expected(a, k) for a, k in zip(alphas, [6, 0, 0, 0]))
    assert p.batch_rate([6, 6, 6, 6], alphas) > ragged / flat.cost(4, 7)
    r = AdaptiveK(6, flat)
    ks, _, _ = r.best_ks(alphas, [6] * 4)
    assert ks[0] == 6 and sum(ks[1:]) < 18
    # 10 tokens: 4 rows of 2.5 (the exact tokens, not the whole width 3 above them)
    assert r.batch_rate([6, 0, 0, 0], alphas) == pytest.approx(ragged / flat.cost(4, 2.5), rel=1e-12)


# compute-bound at 4 rows: a step costs about its tokens (0.01 s each) over a fixed 0.02 s
TOKEN_BOUND = _grid(lambda b, w: 0.020 + 0.010 * b * w)


def _accepting(p: AdaptiveK, reqs, alphas):
    """Plant each request's α (the policy's estimate of it, as if from its own guesses) and return them."""
    table = {r.request_id: a for r, a in zip(reqs, alphas)}
    p.engine_alpha = 0.5
    p.req_counts.update({r.request_id: (1.0, a) for r, a in zip(reqs, alphas)})
    p.acceptance = lambda r: table[r.request_id]
    return [p.acceptance(r) for r in reqs]


def test_mixed_k_that_pays_only_priced_ragged_is_chosen():
    """Two likely rows and two unlikely ones on a token-bound grid: the likely rows guessing 4 and the others plain
    is 12 tokens, the cell (4, 3), and pays (> MARGIN x plain); priced padded (4, 5) it loses, and so does every row
    guessing. The ragged policy picks mixed k with rows at 0; one told the engine pads picks plain."""
    reqs = [_Req(f"r{i}", params=SamplingParams(max_tokens=10_000)) for i in range(4)]
    ragged, padded = AdaptiveK(4, TOKEN_BOUND), AdaptiveK(4, TOKEN_BOUND)
    padded.padded = True
    alphas = _accepting(ragged, reqs, [0.99, 0.99, 0.1, 0.1])
    assert alphas == _accepting(padded, reqs, [0.99, 0.99, 0.1, 0.1])
    ks = ragged.choose_batch(reqs, [4] * 4)
    assert ks[0] > 0 and ks[1] > 0 and ks[2] == ks[3] == 0, ks
    rate, plain = ragged.batch_rate(ks, alphas), ragged.batch_rate([0] * 4, alphas)
    assert rate > adaptive.MARGIN * plain
    assert rate == (sum(adaptive._expected(a, k) for a, k in zip(alphas, ks))
                    / TOKEN_BOUND.cost(4, 1 + -(-sum(ks) // 4)))  # priced at the ragged cell
    assert padded.batch_rate(ks, alphas) < plain  # the same ks priced padded lose
    assert padded.choose_batch(reqs, [4] * 4) == [0] * 4
    assert padded.best_ks(alphas, [4] * 4)[0] == [0] * 4
    # the search reaches what an exhaustive one finds over these rows (ragged)
    assert ragged.best_ks(alphas, [4] * 4)[1] >= 0.99 * ragged.batch_rate(_brute(ragged, alphas, [4] * 4), alphas)


def test_mixed_k_that_loses_even_ragged_stays_plain():
    """The same grid with acceptances too low for any mix to pay even priced ragged: every row plain, and every
    mixed k (rows at 0 included) predicts less than plain."""
    reqs = [_Req(f"r{i}", params=SamplingParams(max_tokens=10_000)) for i in range(4)]
    p = AdaptiveK(4, TOKEN_BOUND)
    alphas = _accepting(p, reqs, [0.6, 0.6, 0.1, 0.1])
    plain = p.batch_rate([0] * 4, alphas)
    assert all(p.batch_rate(list(ks), alphas) < plain
               for ks in itertools.product(range(5), repeat=4) if any(ks))
    assert p.best_ks(alphas, [4] * 4)[0] == [0] * 4
    assert p.choose_batch(reqs, [4] * 4) == [0] * 4


def test_the_search_prices_ragged_near_the_exhaustive_optimum():
    """Batches of 1..4 on the row-bound and token-bound grids with a draft model: the search's rate (ragged) is
    within 2% of the exhaustive best, and never below plain's."""
    rng = random.Random(3)
    draft = _grid(lambda b, w: 0.008 + 0.001 * b * w)
    for grid in (ROW_BOUND, TOKEN_BOUND):
        for _ in range(30):
            B = rng.randint(1, 4)
            alphas = [rng.uniform(0.0, 0.99) for _ in range(B)]
            caps = [rng.randint(0, 4) for _ in range(B)]
            p = AdaptiveK(4, grid, draft, catch_up_cost=0.0)
            ks, rate, plain = p.best_ks(alphas, caps)
            assert rate >= plain and all(k <= c for k, c in zip(ks, caps))
            assert rate >= 0.98 * p.batch_rate(_brute(p, alphas, caps), alphas), (B, alphas, caps, ks)


def test_a_step_reported_wider_than_its_ragged_cell_prices_padded():
    """observe_step tells the policy how the engine verified: a guessing batch reported at its widest row (a token
    tree, padded) prices padded widths from then on; one reported at its ragged cell, ragged again."""
    p = AdaptiveK(4, TOKEN_BOUND)
    p.observe_step(4, 5, TOKEN_BOUND.cost(4, 5), 0.001, [4, 0, 0, 0])
    assert p.padded and p.verify_width([4, 0, 0, 0]) == 5
    p.observe_step(4, 2, TOKEN_BOUND.cost(4, 2), 0.001, [4, 0, 0, 0])
    assert not p.padded and p.verify_width([4, 0, 0, 0]) == 2
    p.observe_step(4, 5, TOKEN_BOUND.cost(4, 5), 0.001, [4, 4, 4, 4])  # every row as wide: nothing to tell
    assert not p.padded


def test_catch_up_is_priced_from_the_draft_s_prompt_width_cells():
    """A draft grid with one row measured at prompt widths (64, 128) prices a 100-token catch-up between them
    (cheap a token: the wide kernels), not by extrapolating widths 1..16 (dear a token); a first guess after a
    100-token prompt and before a short answer pays on such a grid where the extrapolated price said it does not."""
    narrow = lambda b, w: 0.010 + 0.002 * b * w  # noqa: E731 — 2 ms a token up to 16 tokens
    cells = {(b, w): narrow(b, w) for b in (1, 2, 4, 8) for w in (1, 2, 4, 8, 16)}
    with_prompt = StepCost({**cells, (1, 64): 0.060, (1, 128): 0.090})  # ~0.5 ms a token from 16 on
    without = StepCost(cells)
    assert abs(with_prompt.catch_up(100) - (0.060 + (0.090 - 0.060) * (101 - 64) / 64 - narrow(1, 1))) < 1e-9
    assert abs(without.catch_up(100) - 0.002 * 100) < 1e-9  # extrapolated from widths 8..16: 2 ms a token
    assert with_prompt.catch_up(10) == without.catch_up(10)  # inside 1..16 both read the same cells
    target = _grid(lambda b, w: 0.060 + 0.0005 * b * w)
    cheap, dear = AdaptiveK(4, target, with_prompt), AdaptiveK(4, target, without)
    assert cheap.catch_up_time(100) < 0.4 * dear.catch_up_time(100)
    req = _Req("r", prompt_ids=[1] * 100, params=SamplingParams(max_tokens=8))  # a short answer left
    for p in (cheap, dear):
        p.engine_alpha = 0.8
        p.choose_batch([req], [4])  # the first decision pays the whole prompt; the second spreads it
    assert cheap.choose_batch([req], [4])[0] > 0
    assert dear.choose_batch([req], [4])[0] == 0


def test_speculation_stops_when_the_load_makes_it_lose_and_starts_again_when_it_pays():
    """The engine's own step times move the grid (no re-timing forwards): when wide steps get dear (a neighbour
    takes the cores a wide step needs), the batch goes plain, probes included (guessing would lose even at
    PROBE_ALPHA); when they are cheap again, it guesses again: at once where it still runs wide steps, and from plain
    steps alone as the dear residual goes stale (no probe needed)."""
    cheap = _grid(lambda b, w: 0.050 + 0.002 * b * w)
    reqs = [_Req(f"r{i}", params=SamplingParams(max_tokens=10_000)) for i in range(4)]
    for restart in ("wide steps observed", "plain steps only"):
        p = AdaptiveK(4, _grid(lambda b, w: 0.050 + 0.002 * b * w))
        p.engine_alpha = 0.8
        assert any(p.choose_batch(reqs, [4] * 4))
        for _ in range(40):  # the engine reports wide steps 4x dearer than the grid said
            p.observe_step(4, 5, 4 * (0.050 + 4 * 0.040), 0.0, [4] * 4)
            p.observe_step(4, 1, 0.054, 0.0, [0] * 4)
        plain_run = []
        for _ in range(3 * EXPLORE_EVERY):
            plain_run.append(p.choose_batch(reqs, [4] * 4))
        assert plain_run == [[0] * 4] * len(plain_run)  # no probe either: none could find an α that pays here
        if restart == "wide steps observed":
            for _ in range(60):  # cheap again
                p.observe_step(4, 5, 0.050 + 0.002 * 20, 0.0, [4] * 4)
                p.observe_step(4, 1, 0.058, 0.0, [0] * 4)
            assert any(p.choose_batch(reqs, [4] * 4))
        else:
            for t in range(400):  # the machine as measured again; the engine runs plain steps only
                p.observe_step(4, 1, cheap.cost(4, 1), 0.0, [0] * 4)
                if any(p.choose_batch(reqs, [4] * 4)):
                    break
            assert t < 399, "the stale residual of the dear widths never let speculation start again"


def test_the_grid_follows_the_load_online():
    """observe(): one cell's steps move the load factor of every cell (a cell never visited follows the load);
    cells whose load changed unlike the others' get residuals (within RESID_RANGE), shared with their neighbours."""
    g = _grid(lambda b, w: 0.01 * b + 0.001 * w, batches=(1, 2, 4, 8), widths=(1, 2, 4, 8, 16))
    before = g.cost(8, 16)
    for _ in range(60):
        g.observe(1, 1, 2 * g.predicted_base(1, 1))
    assert abs(g.scale - 2.0) < 0.05 and abs(g.cost(8, 16) / before - 2.0) < 0.1
    for _ in range(100):  # narrow steps as measured, wide ones 3x dearer (fewer threads): residuals tell them apart
        g.observe(4, 1, g.predicted_base(4, 1))
        g.observe(4, 16, 3 * g.predicted_base(4, 16))
    assert abs(g.cost(4, 1) / g.predicted_base(4, 1) - 1) < 0.15
    assert abs(g.cost(4, 16) / g.predicted_base(4, 16) - 3) < 0.45
    assert g.cost(4, 12) / g.predicted_base(4, 12) > 1.5  # a width between, never run, got dearer too
    assert all(RESID_RANGE[0] <= r <= RESID_RANGE[1] for r in g.resid.values())


def _fresh(g: StepCost) -> StepCost:
    """The same grid state (base, residuals, load factor) without anything remembered from earlier reads."""
    f = StepCost(dict(g.base))
    f.resid, f.scale = dict(g.resid), g.scale
    return f


def test_the_grid_read_between_observations_is_what_a_fresh_read_gives(monkeypatch):
    """StepCost remembers its reads between observe() calls (a k policy reads the same cells many times a decision):
    every read after a step's correction is bitwise what the same state read afresh gives, at measured and
    interpolated cells, widths and batches, corrected or not. A planted observe that keeps the old reads is caught."""
    def check(keep: bool) -> bool:
        g = _grid(lambda b, w: 0.01 * b + 0.001 * w, batches=(1, 2, 4, 8), widths=(1, 2, 4, 8, 16))
        cells = [(b, w) for b in (1, 3, 4, 8, 9) for w in (1, 1.5, 2, 3, 16, 40)]
        same = True
        for step in range(30):
            for b, w in cells:
                g.cost(b, w), g.predicted_base(b, w)  # remembered until the next observe
            if keep:
                memo = dict(g._memo)
            g.observe(4 if step % 2 else 1, 1 + step % 5, (1 + step % 3) * g.predicted_base(4, 1))
            if keep:
                g._memo.update(memo)
            f = _fresh(g)
            same &= all(g.cost(b, w) == f.cost(b, w) and g.predicted_base(b, w) == f.predicted_base(b, w)
                        and g.predicted_base(b, w, corrected=True) == f.predicted_base(b, w, corrected=True)
                        for b, w in cells)
        return same

    assert check(keep=False)
    assert not check(keep=True)


def test_a_burst_during_measurement_does_not_make_a_cell_dearer_than_a_larger_one():
    """Load only adds time: a cell timed slower than a larger cell is repaired down to it (the envelope)."""
    base = {(b, w): 0.01 * b + 0.001 * w for b in (1, 2, 4, 8) for w in (1, 2, 4, 8, 16)}
    base[(2, 4)] = 5.0  # a neighbour's time slice stalled this forward
    g = StepCost(base)
    assert g.base[(2, 4)] == min(base[(b, w)] for b in (2, 4, 8) for w in (4, 8, 16))
    assert all(g.base[(b, w)] <= g.base[(b2, w2)] for (b, w) in g.base for (b2, w2) in g.base if b <= b2 and w <= w2)


def test_the_suffix_proposer_reads_the_live_grid_not_a_copy():
    """A correction of the grid (the engine's steps) reaches the suffix proposer's tree sizing at once: it holds
    the policy's own grid object, read at each propose at the batch's size."""
    from draftwise.spec_decode.suffix import SuffixProposer

    g = _grid(lambda b, w: 0.050 + 0.001 * w)
    s = SuffixProposer()
    s.step_cost = AdaptiveK(8, g).target
    probs = [0.9, 0.8, 0.7, 0.6]
    assert s.tree_size(probs, batch=4) == 4
    for _ in range(80):  # wide steps get 20x dearer (clamped residuals + the scale at width 1 stays)
        g.observe(4, 5, 20 * g.predicted_base(4, 5))
        g.observe(4, 1, g.predicted_base(4, 1))
    assert s.tree_size(probs, batch=4) < 4


def test_the_draft_s_cost_follows_the_measured_proposing_time():
    """Guessing steps' proposing seconds move the draft's scale (a draft model) or its seconds (a model-free
    proposer); one step's outlier (a long prompt read at a request's first guess) moves it a bounded amount."""
    draft = _grid(lambda b, w: 0.010 + 0.001 * b * w)
    p = AdaptiveK(4, ROW_BOUND, draft)
    predicted = p.draft_time([4, 4])
    for _ in range(60):
        p.observe_step(2, 5, ROW_BOUND.cost(2, 5), 2 * predicted, [4, 4])
    assert abs(p.draft_time([4, 4]) / predicted - 2) < 0.1
    before = p.draft_scale
    p.observe_step(2, 5, ROW_BOUND.cost(2, 5), 1000 * predicted, [4, 4])
    assert p.draft_scale <= before * adaptive.DRAFT_RATIO_RANGE[1] ** adaptive.DRAFT_EWMA * 1.001
    lookup = AdaptiveK(4, ROW_BOUND)  # n-gram: free until measured
    assert lookup.draft_time([3]) == 0.0
    for _ in range(60):
        lookup.observe_step(1, 4, ROW_BOUND.cost(1, 4), 0.002, [3])
    assert abs(lookup.draft_time([3]) - 0.002) < 0.0002


def test_a_model_free_proposer_s_lookups_are_priced_per_guessing_row():
    """A proposer without a model (n-gram, suffix) looks each guessing row up on its own: its measured seconds are
    learned per guessing row and charged once per row that guesses. On a planted grid where a 4 ms lookup pays for
    one row alone (20 -> 27 tokens/s) but not for eight (8 rows' lookups, 32 ms, against a 50 ms plain step), the
    batch of eight stays plain; priced once per step whatever the rows (the old EWMA), all eight would guess."""
    grid = _grid(lambda b, w: 0.050 + 0.001 * b * (w - 1))
    p = AdaptiveK(4, grid)
    for _ in range(80):  # what the engine reports: one row's lookup
        p.observe_step(1, 2, grid.cost(1, 2), 0.004, [1])
    assert abs(p.draft_time([1] * 8) - 8 * p.draft_time([1])) < 1e-12 and p.draft_time([0, 0]) == 0.0
    rows = [_Req(f"r{i}") for i in range(8)]
    p.engine_alpha = 0.5
    assert p.choose_batch(rows[:1], [4])[0] > 0  # one row alone: the lookup pays
    lows = [0.5] * 8
    assert p.batch_rate([1] * 8, lows) < p.batch_rate([0] * 8, lows)
    assert p.choose_batch(rows, [4] * 8) == [0] * 8
    for _ in range(80):  # four rows' lookups (4 x 4 ms) teach the same seconds a row
        p.observe_step(4, 2, grid.cost(4, 2), 0.016, [1, 1, 1, 1])
    assert abs(p.propose_row_s - 0.004) < 0.0002


def test_no_probe_where_even_the_hoped_for_acceptance_cannot_pay_the_catch_up():
    """A draft model's probe reads the request's whole unseen context (prompt + every plain step's token): where that
    catch-up, spread over what is left, makes guessing lose even at PROBE_ALPHA (a short answer after a long prompt),
    no row probes and every step is plain; with a long answer left the same rows probe on their cadence."""
    draft = _grid(lambda b, w: 0.010 + 0.004 * b * w)  # catch-up ~4 ms a context token
    p = AdaptiveK(8, ROW_BOUND, draft)
    assert p.catch_up_cost > 0.003
    short = [_Req(f"s{i}", prompt_ids=[1] * 300, params=SamplingParams(max_tokens=32)) for i in range(4)]
    ks = []
    for t in range(31):
        for r in short:
            r.output_ids = [1] * (t + 1)
        ks.append(p.choose_batch(short, [8] * 4))
    assert ks == [[0] * 4] * 31
    assert p.k_histogram == {0: 4 * 31}
    long = [_Req(f"l{i}", prompt_ids=[1] * 300, params=SamplingParams(max_tokens=4000)) for i in range(4)]
    probed = []
    for t in range(3 * EXPLORE_EVERY):
        ks = p.choose_batch(long, [8] * 4)
        probed.append(any(ks))
        for r, k in zip(long, ks):
            if k:
                p.observe(r, k, 0)
    assert any(probed)


def test_the_draft_s_costs_follow_the_load_the_target_s_plain_steps_measure():
    """A batch decoding plainly never runs the draft, yet the load its steps measure (the target grid's factor)
    prices the draft's forwards and catch-up: 3x dearer plain steps make a restart's draft work 3x dearer, so under
    load the policy decides as on the quiet grid. A draft priced at load time (3x too cheap beside the target's
    steps) would start guessing where the catch-up of a long prompt does not pay."""
    draft = _grid(lambda b, w: 0.004 + 0.002 * b * w)

    def policy(load: float, draft_follows: bool = True) -> AdaptiveK:
        p = AdaptiveK(4, _grid(lambda b, w: 0.050 + 0.0005 * b * w), draft)
        p.engine_alpha = 0.7
        for _ in range(80):  # plain steps at `load` x what the grid was timed at; the draft never asked
            p.observe_step(1, 1, load * p.target.predicted_base(1, 1), 0.0, [0])
        if not draft_follows:
            p.draft_scale = 1 / p.target.scale  # the draft's cost as timed at load
        return p

    quiet, loaded = policy(1.0), policy(3.0)
    assert abs(loaded.draft_time([2, 2]) / quiet.draft_time([2, 2]) - 3) < 0.1
    assert abs(loaded.catch_up_cost / quiet.catch_up_cost - 3) < 0.1

    def second_decision(p, max_tokens):  # the first pays the whole prompt; the second spreads it over what is left
        req = _Req("r", prompt_ids=[1] * 200, params=SamplingParams(max_tokens=max_tokens))
        p.choose_batch([req], [4])
        k = p.choose_batch([req], [4])[0]
        p.end(req)
        return k

    lengths = range(8, 400, 8)
    assert [second_decision(loaded, n) for n in lengths] == [second_decision(quiet, n) for n in lengths]
    stale = policy(3.0, draft_follows=False)
    assert any(second_decision(stale, n) and not second_decision(quiet, n) for n in lengths)


def test_rows_probe_together_so_a_batch_pays_few_wide_steps():
    """Four plain rows (guessing never pays on this grid) probe in the same steps: a probe widens the whole padded
    step, so the rows whose probe is at least half due ride along; each row still probes on its doubling cadence."""
    p = AdaptiveK(8, ROW_BOUND)
    reqs = [_Req(f"r{i}", params=SamplingParams(max_tokens=10_000)) for i in range(4)]
    steps = []
    for t in range(200):
        if t == 5:
            reqs.append(_Req("late", params=SamplingParams(max_tokens=10_000)))  # joins mid-way, its gap out of step
        ks = p.choose_batch(reqs, [8] * len(reqs))
        steps.append(ks)
        for r, k in zip(reqs, ks):
            if k:
                p.observe(r, k, 0)
    wide = [ks for ks in steps if any(ks)]
    per_row = [sum(1 for ks in steps if len(ks) > i and ks[i]) for i in range(5)]
    assert all(n >= 3 for n in per_row)  # every row keeps probing
    assert len(wide) < sum(per_row)  # ... in shared steps
    assert all(k in (0, adaptive.PROBE_K) for ks in steps[20:] for k in ks)  # after the prior's first guesses


def _decisions(monkeypatch, bound) -> tuple[list, int]:
    """best_ks over seeded random batches (1..8 rows, acceptances, caps, behind / remaining, a draft model's grid or
    a model-free proposer's seconds, padded or ragged) with `bound` as the search's skip test; and in how many
    trials the bound was at most plain's rate (the search skipped)."""
    bounds = []
    monkeypatch.setattr(adaptive, "_guessing_bound", lambda *a: (bounds.append(bound(*a)), bounds[-1])[1])
    rng, out, skipped = random.Random(7), [], 0
    draft = _grid(lambda b, w: 0.010 + 0.001 * b * w)
    for trial in range(300):
        B = rng.randint(1, 8)
        p = AdaptiveK(8, ROW_BOUND, draft if trial % 2 else None)
        p.propose_row_s = rng.choice([0.0, 0.002, 0.02])
        p.padded = trial % 5 == 0
        alphas = [rng.choice([rng.uniform(0.0, 0.5), rng.uniform(0.0, 0.99)]) for _ in range(B)]
        caps = [rng.choice([0, 2, 8]) for _ in range(B)]
        behind = [rng.choice([1, 1, 40, 300]) for _ in range(B)]
        remaining = [rng.choice([1, 20, 200]) for _ in range(B)]
        bounds.clear()
        out.append(p.best_ks(alphas, caps, behind, remaining))
        skipped += bool(bounds) and bounds[0] <= out[-1][2]
    return out, skipped


REAL_BOUND = adaptive._guessing_bound


def test_the_bound_that_skips_the_search_never_changes_a_decision(monkeypatch):
    """best_ks skips its search where `_guessing_bound` says no guessing mix can beat plain (a wide batch of
    unlikely rows: the step's decision then costs one bound, not the search): over random batches the decisions
    are the same with the bound as with a bound that never skips; the bound does skip (a good share of the trials),
    and a planted bound that skips wrongly (always 0) changes decisions, so this comparison can fail."""
    never, _ = _decisions(monkeypatch, lambda *a: float("inf"))
    real, skipped = _decisions(monkeypatch, REAL_BOUND)
    assert real == never
    assert 30 <= skipped < 300
    planted, _ = _decisions(monkeypatch, lambda *a: 0.0)
    assert planted != never


# the server's c = 4 chat (2026-12-06's sixth session: no row guessed): a token past one a row costs, the draft's
# forwards and a ~120-token prompt's catch-up (its draft never read it) from the draft's grid, the prior acceptance
CHAT_TARGET = _grid(lambda b, w: 0.05 * (1 + 0.1 * max(0.0, b * w - b - 1)))
CHAT_DRAFT = _grid(lambda b, w: 0.012 + 0.0005 * b * w, widths=(1, 2, 4, 8, 16, 64))


def _loose_bound(order, caps, k_top, e, verify, forward, cu, draft_time, padded=False, *_) -> float:
    """The bound before 2026-12-07's first session (planted): every row's longest guess over one guess's step."""
    n = len(e)
    cheapest = verify[2] if padded else adaptive._at(verify, 1 + 1 / n)
    tokens = n + sum(max(e[i][: min(k_top, caps[i]) + 1]) - 1.0 for i in order)
    draft = (min(forward[1:]) if forward is not None
             else min(draft_time([k] + [0] * (n - 1)) for k in range(1, k_top + 1)))
    return tokens / (cheapest + draft + min(cu[i] * e[i][1] for i in order))


def _priced(monkeypatch, alphas: list[float]) -> tuple[list[int], int]:
    """best_ks on the chat batch: its ks and how many mixes it priced (rate evaluations: plain's and the answer's
    are 2; the search prices dozens)."""
    p = AdaptiveK(8, CHAT_TARGET, CHAT_DRAFT)
    n = len(alphas)
    priced = []
    width = AdaptiveK.verify_width
    with monkeypatch.context() as m:
        m.setattr(AdaptiveK, "verify_width", lambda self, ks: (priced.append(ks), width(self, ks))[1])
        ks, _, _ = p.best_ks(alphas, [8] * n, [120] * n, [100] * n)
    return ks, len(priced)


@pytest.mark.parametrize("batch", [4, 8])
def test_a_batch_that_does_not_guess_is_decided_without_the_search(monkeypatch, batch):
    """Speculation configured but unused must cost what plain decoding costs: where no row of a chat-like batch
    guesses (the prior acceptance 0.3 / 0.5, each row behind its prompt), best_ks decides from `_guessing_bound`
    alone, pricing no guessing mix. Before 2026-12-07's first session the bound (every row's longest guess over one
    guess's step) never skipped there: the search, and the probe check's second one, ran every step (0.74 ms a
    step at c = 4 chat, 1.5 ms at c = 8 on this machine's recorded decisions). The planted old bound is caught, and
    the decision is the search's (a bound that never skips)."""
    for alpha in (0.3, 0.5):
        alphas = [alpha] * batch
        ks, priced = _priced(monkeypatch, alphas)
        monkeypatch.setattr(adaptive, "_guessing_bound", lambda *a: float("inf"))
        searched, searched_priced = _priced(monkeypatch, alphas)
        monkeypatch.setattr(adaptive, "_guessing_bound", _loose_bound)
        _, loose_priced = _priced(monkeypatch, alphas)
        monkeypatch.setattr(adaptive, "_guessing_bound", REAL_BOUND)
        assert ks == searched == [0] * batch  # no row guesses (the search says so too)
        assert priced <= 2 < searched_priced, (alpha, priced)
        assert loose_priced > 2  # the planted loose bound searches: this test can fail


def _token_cost(b: int, tokens: float) -> float:
    """A planted truth of a ragged step: what its tokens cost (B rows): one more token than the rows is free
    (memory-bound), each beyond costs a tenth of a plain step (the sixth session's step records at c = 4: 8
    tokens at B = 4 cost 1.5-1.65x 4 tokens; at B = 1..4 a row's single guess cost nothing measurable)."""
    return 0.05 * (1 + 0.1 * max(0.0, tokens - b - 1))


def _taught(width_of) -> AdaptiveK:
    """A policy over the truth's load-time grid (B rows x w tokens each), then taught by 100 pairs of engine steps at
    B = 8, a plain one and one where a single row guessed 1 token, each reported at `width_of(k per row)`."""
    p = AdaptiveK(8, _grid(lambda b, w: _token_cost(b, b * w)))
    for _ in range(100):
        p.observe_step(8, width_of([0] * 8), _token_cost(8, 8), 0.0, [0] * 8)
        one = [1] + [0] * 7
        p.observe_step(8, width_of(one), _token_cost(8, 9), 0.0, one)
    return p


def test_steps_where_one_row_guesses_do_not_teach_the_grid_that_every_row_guessing_is_free():
    """The engine reports a ragged step at its exact tokens (ragged_width: B rows of Σ(1 + k_i) / B): the policy
    learns from steps where one row of 8 guessed (9 tokens, as cheap as 8) that such a guess is nearly free, and
    still prices 8 rows guessing one each (16 tokens, 1.7x a plain step in truth) at what the grid measured, so at
    acceptance 0.3 every row stays plain, as the truth says it should. A planted width rounded up to the whole cell
    (the old reporting) teaches the cell (8, 2) the 9-token steps' cost and every row guesses: caught."""
    lows = [0.3] * 8
    assert _token_cost(8, 16) * 8 / (8 * (1 + 0.3)) > _token_cost(8, 8)  # the truth: guessing one each loses
    exact = _taught(adaptive.ragged_width)
    assert exact.best_ks(lows, [8] * 8)[0] == [0] * 8
    assert exact.batch_rate([1] * 8, lows) < exact.batch_rate([0] * 8, lows)
    assert exact.verify_cost(8, 2) > 1.5 * exact.verify_cost(8, 1)  # 16 tokens: the truth's 1.7x, nearly
    rounded = _taught(lambda ks: 1 + -(-sum(ks) // len(ks)))
    assert rounded.best_ks(lows, [8] * 8)[0] != [0] * 8
    assert rounded.verify_cost(8, 2) < 1.1 * rounded.verify_cost(8, 1)


def _old_remaining(self, req) -> int:
    """The rule before 2026-12-07 (planted): max_tokens left, or an average of the kind's lengths less what it has
    (an EWMA then; its arithmetic mean here), half of it once past."""
    n, left = len(req.output_ids), req.params.max_tokens - len(req.output_ids)
    lengths = self.recent_lengths(req)
    if not lengths:
        return max(left, 1)
    typical = sum(lengths) / len(lengths)
    return max(1, min(left, round(typical - n if n < typical else typical / 2)))


def _mean_seconds_a_token(p: AdaptiveK, alpha: float, k: int, n: int, lengths: list[int], behind: int) -> float:
    """Ground truth for one request at n output tokens whose answer ends at one of `lengths` (equally likely,
    those past n): its seconds a remaining token, averaged over where it ends, if it guesses k from now on (paying
    its catch-up once) or decodes plainly (k = 0), on the policy's own grid and draft prices."""
    ahead = [length - n for length in lengths if length > n]
    if k == 0:
        return p.target.cost(1, 1)
    step = p.target.cost(1, 1 + k) + p.draft_time([k])
    per_token = step / adaptive._expected(alpha, k)
    return sum(per_token + p.catch_up_time(behind - 1) / r for r in ahead) / len(ahead)


def test_a_catch_up_is_priced_against_where_the_kind_s_short_answers_end(monkeypatch):
    """A kind whose recent answers mix long ones (another workload sharing it: 137 tokens) with short ones
    (8-46): wherever the policy has a request guess after its prompt (its draft reads the prompt first), the
    request's seconds a token averaged over where such answers end (the ground truth, `_mean_seconds_a_token`)
    are less than plain decoding's. Planted: the catch-up spread over the lengths' arithmetic mean (the old
    EWMA-style rule) guesses where that average says it loses."""
    def violations(old=False):
        if old:
            monkeypatch.setattr(AdaptiveK, "remaining", _old_remaining)
        bad, guessed = 0, 0
        for history in ([137] * 5 + [12, 30, 46], [137] * 4 + [8, 20, 46, 14], [137] * 6 + [9, 40]):
            for alpha in (0.6, 0.75, 0.9):
                for n in range(1, 40, 3):
                    p = AdaptiveK(4, _grid(lambda b, w: 0.050 + 0.004 * b * w),
                                  _grid(lambda b, w: 0.006 + 0.002 * b * w))
                    p.engine_alpha = alpha
                    for i, length in enumerate(history):
                        _finish(p, f"h{i}", length, CODE)
                    req = _Req("q", prompt_ids=[1] * 100, output_ids=[1] * n, params=CODE)
                    p.req_counts["q"] = (1e-9, alpha * 1e-9)  # its α is the prior's (it has no guesses of its own)
                    behind = 100 + n
                    p._behind["q"], p._plain_run["q"] = behind, 1
                    k = p.choose(req)
                    guessed += k > 0
                    if k and (_mean_seconds_a_token(p, alpha, k, n, history, behind)
                              >= _mean_seconds_a_token(p, alpha, 0, n, history, behind)):
                        bad += 1
        monkeypatch.undo()
        return bad, guessed

    bad, guessed = violations()
    assert bad == 0 and guessed > 0, (bad, guessed)  # it still guesses where the short answers leave it room
    assert violations(old=True)[0] > 0


def test_a_batch_of_new_rows_follows_the_running_rows_evidence_not_another_workload_s():
    """8 new requests after a workload whose guesses were accepted 0.76 of the time (the engine's α), on a grid
    where 8 rows guessing pays at 0.76 and loses at their own 0.2: they may open guessing on the engine's α, but
    once the running rows' guesses are rejected every row's prior follows that evidence and the batch decodes
    plainly within a step or two. Planted: the prior the engine's α alone (each row waits for its own evidence to
    outweigh it) guesses on many more row-steps."""
    def guessing_row_steps(live_prior=True):
        p = AdaptiveK(4, _grid(lambda b, w: 0.040 + 0.004 * b * w), _grid(lambda b, w: 0.002 + 0.0002 * b * w))
        if not live_prior:
            p.prior_for = lambda req: (p.engine_alpha, adaptive.PRIOR_GUESSES)
        p.engine_alpha = 0.76
        reqs = [_Req(f"r{i}", params=SamplingParams(max_tokens=10_000)) for i in range(8)]
        assert p.best_ks([0.76] * 8, [4] * 8)[0] != [0] * 8  # the planted grid: the old prior guesses
        assert p.best_ks([0.2] * 8, [4] * 8)[0] == [0] * 8  # ... their own acceptance does not
        for r in reqs:
            p._behind[r.request_id] = 1  # past the prefill's decision, nothing to catch up (an n-gram)
        rng, guessed = random.Random(1), 0
        for _ in range(12):
            ks = p.choose_batch(reqs, [4] * 8)
            for r, k in zip(reqs, ks):
                if k:
                    guessed += 1
                    accepted = 0
                    while accepted < k and rng.random() < 0.2:
                        accepted += 1
                    p.observe(r, k, accepted)
        return guessed

    new = guessing_row_steps()
    assert 0 < new <= 2 * 8, new
    assert guessing_row_steps(live_prior=False) > 2 * new


def test_the_running_rows_evidence_is_the_new_rows_prior_and_leaves_with_them():
    """prior_for pools the other running requests' own guesses (not the request's own twice) behind the engine's
    α; a request that ends takes its evidence out of the pool."""
    p = _policy()
    p.engine_alpha = 0.8
    a, b, c = _Req("a"), _Req("b"), _Req("c")
    assert p.prior_for(c) == (0.8, adaptive.PRIOR_GUESSES)
    for _ in range(10):
        p.observe(a, 4, 0)
    assert p.prior_for(c)[0] < 0.4 and p.prior_for(a)[0] == pytest.approx(0.8)  # its own not counted as its prior
    p.observe(b, 4, 4)
    reached_b, accepted_b = p.req_counts["b"]
    p.end(a)
    assert p._live == pytest.approx([reached_b, accepted_b])
    p.end(b)
    assert p._live == [0.0, 0.0]


def test_a_draft_grid_timed_under_another_load_is_priced_at_the_load_ratio_timed_now(monkeypatch):
    """A draft grid timed while other processes were busy (provisional, 3x the quiet target grid's load) is not
    priced 3x: calibrate times both models now, together, and the draft's scale starts at their ratio, so the
    policy guesses where the true costs say guessing pays (planted: the grids as loaded, the old rule, price a
    draft forward 3x and keep every row plain; then the online scale, learned only from guessing steps, never
    moves). Two quiet grids are taken as they are (no forward timed)."""
    from types import SimpleNamespace

    from draftwise.kernels import step_cost

    def grid(per_token: float, width_step: float, provisional: bool = False) -> StepCost:
        return StepCost({(b, w): per_token * (1 + 0.05 * (b - 1)) * (1 + width_step * (w - 1))
                         for b in (1, 2, 4, 8) for w in (1, 2, 4, 8, 16, 64)}, provisional=provisional)

    target_now, draft_now, busy = 0.040, 0.010, 3.0  # one (1, 1) forward of each, timed now
    target = SimpleNamespace(grid=grid(target_now, 0.25), now=target_now)
    draft = SimpleNamespace(grid=grid(busy * draft_now, 0.1, provisional=True), now=draft_now)
    timed = []
    monkeypatch.setattr(step_cost, "load_or_measure", lambda model, *a, **k: model.grid)
    monkeypatch.setattr(step_cost, "measure_grid", lambda model, *a, **k: (timed.append(model), {(1, 1): model.now})[1])
    policy = AdaptiveK.calibrate(target, 8, SimpleNamespace(model=draft))
    assert policy.draft_time([1]) == pytest.approx(draft_now, rel=1e-6)
    assert policy.catch_up_time(63) == pytest.approx(draft.grid.catch_up(63) / busy, rel=1e-6)
    truth = AdaptiveK(8, target.grid, grid(draft_now, 0.1))  # the draft's cells in the target grid's units
    alphas, caps = [0.9] * 4, [8] * 4
    want = truth.best_ks(alphas, caps)[0]
    assert any(want) and policy.best_ks(alphas, caps)[0] == want
    assert not any(AdaptiveK(8, target.grid, draft.grid).best_ks(alphas, caps)[0])  # the old rule: all plain
    timed.clear()
    draft.grid = grid(busy * draft_now, 0.1)  # quiet (not provisional): as measured, nothing timed
    assert AdaptiveK.calibrate(target, 8, SimpleNamespace(model=draft)).draft_scale == 1.0 and not timed


def _paired_run(monkeypatch, alpha: float, pair_every: int, dear: float = 1.3, steps: int = 600) -> tuple[float, int]:
    """A batch of 4 decoding `steps` against a planted truth (a ragged step of w tokens a row: 38.5 ms x (1 + 0.33 (w -
    1)), the engine's 4-row steps at c = 4; a guess 6 ms of proposing a row-token) over a load-time grid that got the
    shape wrong: its plain cells `dear`x the truth, its guessing cells right (one timing after a load put (4, 2) /
    (4, 1) anywhere in 1.24-1.61 on the Zen 4 VM, 2026-12-07 second session). Rows accept with `alpha`; the engine's
    prior starts at 0.8 (another workload's). -> (realized tokens/s over the last two thirds / plain's, paired steps)."""
    monkeypatch.setattr(adaptive, "PAIR_EVERY", pair_every)
    truth = lambda w: 0.0385 * (1 + 0.33 * (w - 1))  # noqa: E731
    p = AdaptiveK(4, _grid(lambda b, w: truth(w) * (dear if w == 1 else 1.0)), {k: 0.006 * k for k in range(5)})
    p.engine_alpha = 0.8
    rng = random.Random(0)
    reqs = [_Req(f"r{i}", params=SamplingParams(max_tokens=100_000)) for i in range(4)]
    tokens = seconds = 0.0
    for step in range(steps):
        ks = p.choose_batch(reqs, [4] * 4)
        width, propose = adaptive.ragged_width(ks), p.draft_steps[max(ks)]
        emitted = 0
        for req, k in zip(reqs, ks):
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            if k:
                p.observe(req, k, accepted)
            emitted += accepted + 1
        p.observe_step(4, width, truth(width), propose, ks)
        if step >= steps // 3:
            tokens, seconds = tokens + emitted, seconds + truth(width) + propose
    return tokens / seconds / (4 / truth(1)), p.paired_steps


def test_paired_plain_steps_price_plain_at_the_guessing_steps_load(monkeypatch):
    """A speculating batch runs plain steps rarely, so its plain cell's price was the load-time grid's shape times the
    load factor its guessing steps set: a grid timed with plain 1.3x too dear kept a batch guessing at 0.90x plain
    (chat at c = 4 realized 0.88x where the policy predicted 1.08x). Every PAIR_EVERY-th close guessing decision now
    runs plain (the gap doubling while those steps cost what they were priced at) and the plain cell, visited now and
    then, keeps what it was taught (step_cost FRESH_STEPS): the batch stops guessing where it loses. Planted: no
    paired steps (PAIR_EVERY 0), the old rule, must lose; where guessing pays, the paired steps cost < 1%."""
    old, none = _paired_run(monkeypatch, 0.35, 0)
    new, paired = _paired_run(monkeypatch, 0.35, 8)
    assert none == 0 and old < 0.93, old
    assert paired > 0 and new >= 0.98, new
    pays_old, _ = _paired_run(monkeypatch, 0.7, 0)
    pays_new, _ = _paired_run(monkeypatch, 0.7, 8)
    assert pays_old > 1.1 and pays_new >= pays_old - 0.01, (pays_old, pays_new)


def test_a_cell_visited_now_and_then_keeps_what_it_was_taught():
    """Between visits closer than FRESH_STEPS a cell's residual holds (others relax back to the measured shape as
    before): a plain cell taught 0.8x its base at every 16th step stays within 3% of it (relaxing every step, as
    before, kept it 11% dearer: about half of what each visit taught, in log)."""
    from draftwise.kernels.step_cost import FRESH_STEPS

    g = _grid(lambda b, w: 0.04 * (1 + 0.3 * (w - 1)), batches=(4,), widths=(1, 2, 4))
    for step in range(400):
        if step % 16 == 0:
            g.observe(4, 1, 0.8 * g.predicted_base(4, 1))  # the truth: plain at 0.8x its base
        else:
            g.observe(4, 2, g.predicted_base(4, 2))
    assert abs(g.cost(4, 1) / g.cost(4, 2) - 0.8 / 1.3) < 0.03, g.cost(4, 1) / g.cost(4, 2)
    for _ in range(FRESH_STEPS + 200):  # then never again: it relaxes back toward the grid's shape
        g.observe(4, 2, g.predicted_base(4, 2))
    assert g.cost(4, 1) / g.cost(4, 2) > 0.9 / 1.3


def test_the_draft_s_forwards_are_priced_by_rows_as_they_run():
    """A draft grid timed with the wrong shape by rows (a 4-row forward 1.3x dearer than the grid's ratio to a 1-row
    one): steps of one row guessing and steps of four, mixed, teach each its own price. One scale for the draft
    (the old rule, planted by not teaching the grid) can fit only their mix: it prices one of the two 10%+ off."""
    truth = {1: 0.008, 4: 0.0104 * 1.3}  # seconds of one draft forward of b rows
    grid = _grid(lambda b, w: 0.008 + 0.0008 * (b - 1) * w, batches=(1, 2, 4, 8), widths=(1, 2, 4))

    def taught(teach: bool) -> AdaptiveK:
        p = AdaptiveK(4, ROW_BOUND, _grid(lambda b, w: grid.cost(b, w), batches=(1, 2, 4, 8), widths=(1, 2, 4)))
        if not teach:
            p._teach_draft_grid = lambda ks, s: None
        for t in range(300):
            ks = [2] if t % 2 else [2, 2, 2, 2]
            p.observe_step(len(ks), 3, ROW_BOUND.cost(len(ks), 3), 2 * truth[len(ks)], ks)
        return p

    new = taught(True)
    assert abs(new.draft_time([2]) / (2 * truth[1]) - 1) < 0.05, new.draft_time([2]) / (2 * truth[1])
    assert abs(new.draft_time([2] * 4) / (2 * truth[4]) - 1) < 0.05, new.draft_time([2] * 4) / (2 * truth[4])
    old = taught(False)
    off = [abs(old.draft_time(ks) / (2 * truth[len(ks)]) - 1) for ks in ([2], [2] * 4)]
    assert max(off) > 0.1, off


def test_the_hot_paths_read_what_their_definitions_say():
    """The decision's hot paths, each against its definition over random inputs: forward_rows (guess j is one draft
    forward over the rows guessing >= j) counted in one pass, a grid's cell read from the two measured batch rows
    around it (the others are not computed) equal to the interpolation over every row, bit for bit, corrected or
    not, inside the grid and past its edges."""
    rng = random.Random(3)
    for _ in range(500):
        ks = [rng.choice([0, 0, 1, 2, 3, 8, 16]) for _ in range(rng.randint(0, 8))]
        assert adaptive.forward_rows(ks) == [sum(k >= j for k in ks) for j in range(1, max(ks, default=0) + 1)]
    from draftwise.kernels.step_cost import _interp
    grid = StepCost({(b, w): 0.02 + 0.003 * b + 0.001 * b * w * rng.uniform(0.8, 1.2)
                     for b in (1, 2, 3, 4, 6, 8) for w in (1, 2, 4, 8, 16)})
    for _ in range(50):  # residuals on some cells
        grid.observe(rng.randint(1, 8), rng.choice([1, 2, 3.5, 9]), rng.uniform(0.02, 0.1))
    for b in range(1, 11):
        for w in (0.5, 1, 1.25, 2, 3, 7.5, 16, 40):
            for corrected in (False, True):
                every = _interp(grid.batches, [grid._row(bb, w, corrected) for bb in grid.batches], b)
                grid._memo.clear()
                assert grid.predicted_base(b, w, corrected) == every

"""AdaptiveK's policy logic with injected costs and acceptances (no timing asserts): the cost model's choices,
calibration that survives a burst of load, acceptance learned per request rather than from other workloads,
the proposer's catch-up cost, and the probe cadence while plain decoding wins."""
from dataclasses import dataclass, field

from draftwise.sampling import SamplingParams
from draftwise.spec_decode import adaptive
from draftwise.spec_decode.adaptive import CATCH_UP, EXPLORE_EVERY, AdaptiveK

# measured shape on the default pair (Zen 4, 2 threads): 9 verified rows ~1.8x one row, a guess ~0.38 of a step
VERIFY = {w: 0.045 + 0.0045 * (w - 1) for w in range(1, 10)}
DRAFT = {k: 0.017 * k for k in range(9)}


@dataclass
class _Req:
    request_id: str = "r"
    prompt_ids: list = field(default_factory=lambda: [1] * 8)
    output_ids: list = field(default_factory=lambda: [1])
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0, max_tokens=96))


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


def test_calibration_keeps_each_cost_s_fastest_round():
    """Bursts of load (20x) over widths 1-4 of the first round and all of the last, and over the proposer in the
    last, change nothing: each cost is its fastest round, so the verification widths keep their true ratios."""
    calls = {"verify": 0, "proposer": 0}

    def time_verify(width):
        calls["verify"] += 1
        burst = 20.0 if calls["verify"] <= 4 or calls["verify"] > 18 else 1.0
        return VERIFY[width] * burst

    def proposer():
        calls["proposer"] += 1
        burst = 20.0 if calls["proposer"] == 3 else 1.0
        return [DRAFT[k] * burst for k in range(1, 9)], (DRAFT[1] + 15 * 0.002) * burst

    p = AdaptiveK.from_timers(8, time_verify, proposer, rounds=3)
    assert calls == {"verify": 27, "proposer": 3}
    assert all(abs(p.verify_cost[w] - VERIFY[w]) < 1e-12 for w in VERIFY)
    assert all(abs(p.draft_cost[k] - DRAFT[k]) < 1e-12 for k in DRAFT)
    assert abs(p.catch_up_cost - 15 * 0.002 / (CATCH_UP - 1)) < 1e-12


class _Windows:
    """BusyWindows with a script: the others' busy cores each window reports (None: no window has passed)."""

    def __init__(self, readings):
        self.readings = list(readings)

    def sample(self, force=False):
        return self.readings.pop(0) if self.readings else None


def test_a_calibration_under_load_is_retimed_when_the_load_changes():
    """Calibrated while another process held a core (wide forwards 4x dearer, so guessing never pays), the policy
    first keeps speculation off; two quiet windows in a row re-time the target and speculation comes on. A single
    quiet window (a blip) changes nothing, and a load that comes back re-times again."""
    state = {"busy": True}

    def time_verify(width):
        return VERIFY[width] * (1 + 3.0 * (width > 1)) if state["busy"] else VERIFY[width]

    windows = _Windows([1.0, None, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])  # first: the calibration's own reading
    p = AdaptiveK.from_timers(8, time_verify, lambda: ([DRAFT[k] for k in range(1, 9)], DRAFT[1]), rounds=2,
                              windows=windows)
    assert p.calibrated_load == 1.0
    p.engine_alpha = 0.8  # a workload that guesses well, once guessing is cheap
    req = _Req(output_ids=[1] * 8)
    assert p.choose(req) == 0  # no window yet
    state["busy"] = False
    assert p.choose(req) == 0 and p.recalibrations == 0  # one quiet window: a blip
    assert p.choose(req) == 0 and p.recalibrations == 0  # busy again: the drift starts over
    p.choose(req)  # quiet once ...
    assert p.recalibrations == 0
    assert p.choose(req) > 0 and p.recalibrations == 1 and p.calibrated_load == 0.0  # ... twice: re-timed, on
    assert abs(p.verify_cost[9] - VERIFY[9]) < 1e-12
    state["busy"] = True
    p.choose(req)
    p.choose(req)
    assert p.recalibrations == 2 and p.calibrated_load == 1.0 and p.verify_cost[9] > 3 * VERIFY[9]


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


def _history(policy, accepted_of_3=(2, 3, 1), times=6):
    """Another request's steps of 3 guesses: acceptance ~0.75 per guess, the engine's prior for the next."""
    other = _Req("other")
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
    assert p.choose(_Req("near_end", prompt_ids=[1] * 400, params=SamplingParams(max_tokens=31))) == 0
    assert p.choose(_Req("long", prompt_ids=[1] * 400, params=SamplingParams(max_tokens=500))) > 0
    free = _policy(catch_up_cost=0.0)
    _history(free)
    assert free.choose(_Req("near_end", prompt_ids=[1] * 400, params=SamplingParams(max_tokens=31))) > 0


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
    """`num_speculative_tokens: "auto"` assembled by LLM.set_speculation: calibrated once per config (cached),
    greedy output equal to plain decoding's, every step in the k histogram."""
    from tests.harness import PROMPTS, tiny_llm

    llm = tiny_llm(max_num_seqs=2, k_max=8)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    for spec_config in ({"method": "ngram", "num_speculative_tokens": "auto"},
                 {"method": "draft_model", "model": "d", "num_speculative_tokens": "auto"}):
        llm.set_speculation(spec_config)
        policy = llm.engine.k_policy
        assert isinstance(policy, AdaptiveK) and policy.verify_cost[9] >= policy.verify_cost[1] > 0
        outs = llm.generate(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert all(sum(o.spec["k_histogram"].values()) > 0 for o in outs)
        llm.set_speculation(None)
        llm.set_speculation(spec_config)
        assert llm.engine.k_policy is policy

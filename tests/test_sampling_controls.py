"""Sampling controls under speculation: penalties, logit_bias, min_p and min_tokens keep greedy speculative
output token for token equal to plain decoding (n-gram and draft-model proposers, k = 1..8), min_tokens holds
EOS back, seeded sampling with every control on reproduces, and `adjust_logits` row i depends only on the
history through guess i. Logprobs: the target's rows, equal with and without guesses."""
import pytest
import torch

from draftwise.config import ConfigError
from draftwise.sampling import SamplingParams, adjust_logits, process_logits, token_logprobs
from draftwise.spec_decode.draft_model import DraftModelProposer
from draftwise.spec_decode.ngram import NgramProposer
from draftwise.spec_decode.proposer import NoProposer
from tests.harness import engine_run, one_torch_thread  # noqa: F401 (a fixture)
from tests.tiny_models import tiny_decoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_LEN = 96
VOCAB = 64
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7], [5, 5, 5, 5, 6, 5, 5, 5, 5], [10, 20, 30, 40, 50, 60, 10, 20]]
CONTROLS = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.7),
    "repetition": dict(repetition_penalty=1.8),
    "logit_bias": dict(logit_bias={"3": 4.0, 7: -100.0, 11: 2.5}),
    "min_p": dict(min_p=0.2),
    "all": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={3: 2.0},
                min_p=0.05, min_tokens=5),
}


@pytest.fixture(scope="module")
def target():
    return tiny_decoder("qwen2", seed=0, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def noisy():
    draft = tiny_decoder("qwen2", seed=0, vocab_size=VOCAB)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return draft


def run(target, proposer, k, params, eos=(0,), prompts=PROMPTS):
    outs, eng, reqs = engine_run(target, proposer, k, prompts, params, max_len=MAX_LEN, eos=eos)
    return outs, reqs, eng


def proposer(kind, noisy, eos=(0,)):
    if kind == "ngram":
        return NgramProposer(1, 3)
    return DraftModelProposer(noisy, num_slots=4, capacity=MAX_LEN + 16, target_vocab_size=VOCAB, eos_token_ids=eos)


_plain_cache: dict = {}


def plain(target, params, eos=(0,)):
    key = (repr(params), eos)
    if key not in _plain_cache:
        _plain_cache[key] = run(target, NoProposer(), 0, params, eos)[0]
    return _plain_cache[key]


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("kind", ["ngram", "draft"])
@pytest.mark.parametrize("control", list(CONTROLS))
def test_greedy_speculative_equals_plain_with_each_control(target, noisy, control, kind, k):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **CONTROLS[control])
    outs, _, eng = run(target, proposer(kind, noisy), k, params)
    assert outs == plain(target, params)
    assert eng.stats.num_drafts > 0
    if control != "min_p":  # not vacuous: the control changes greedy output (min_p never moves the argmax)
        assert plain(target, params) != plain(target, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_min_tokens_holds_eos_back_exactly(target, noisy, kind):
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    eos = (plain(target, free)[0][0],)  # the first greedy token of prompt 0: its plain output stops at once
    short = plain(target, SamplingParams(temperature=0.0, max_tokens=24), eos)
    assert len(short[0]) == 1
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=12)
    held = plain(target, params, eos)
    assert all(len(o) >= 12 for o in held) and all(eos[0] not in o[:11] for o in held)
    for k in (1, 3, 8):
        assert run(target, proposer(kind, noisy, eos), k, params, eos)[0] == held


@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
def test_seeded_sampling_with_controls_reproduces(target, noisy, kind):
    params = SamplingParams(temperature=0.9, max_tokens=20, seed=5, ignore_eos=True, **CONTROLS["all"])

    def once():
        prop = NoProposer() if kind == "none" else proposer(kind, noisy)
        return run(target, prop, 0 if kind == "none" else 4, params)[0]

    a = once()
    assert a == once() and any(len(set(o)) > 1 for o in a)


def test_adjust_logits_row_i_sees_the_history_through_guess_i():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, generator=g)  # [k + 1, V]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.4,
                            logit_bias={2: 1.0}, min_tokens=3)
    prompt, output, guesses = [1, 4], [4, 5], [5, 6, 6]
    rows = adjust_logits(logits, params, prompt, output, guesses, stop_ids={9})
    for i in range(4):  # each row alone, with its own history, is bitwise the same row
        alone = adjust_logits(logits[i: i + 1], params, prompt, output + guesses[:i], [], stop_ids={9})
        assert torch.equal(rows[i], alone[0])
    # by hand: row 2 follows output [4, 5] + [5, 6]
    want = logits[2].clone()
    want[2] += 1.0  # 4 tokens precede row 2 (min_tokens 3): id 9 is no longer held back
    for t in (1, 4, 5, 6):
        want[t] = want[t] / 1.4 if want[t] > 0 else want[t] * 1.4
    counts = {4: 1, 5: 2, 6: 1}
    for t, c in counts.items():
        want[t] -= 0.3 * c + 0.5
    assert torch.allclose(rows[2], want)
    assert rows[0][9] == float("-inf") and rows[1][9] == logits[1][9]  # only row 0 has < 3 tokens before it


def test_min_p_drops_tokens_below_the_fraction_of_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = process_logits(logits, 1.0, min_p=0.2)  # keeps p >= 0.1
    assert probs[0, 3] == 0 and probs[0, 2] > 0
    assert torch.allclose(probs.sum(-1), torch.ones(1))


def test_untouched_params_leave_logits_as_they_are():
    logits = torch.randn(3, 10)
    assert adjust_logits(logits, SamplingParams(), [1, 2], [3], [4, 5]) is logits


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                 dict(min_p=1.5), dict(logit_bias={"x": 1}), dict(logit_bias={1: 101}),
                                 dict(min_tokens=-1), dict(min_tokens=40, max_tokens=20), dict(logprobs=21),
                                 dict(n=0)])
def test_bad_values_name_the_field(bad):
    with pytest.raises(ConfigError, match=list(bad)[0]):
        SamplingParams(**bad)


# ---- logprobs --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_logprobs_with_speculation_equal_plain(target, noisy, kind):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    _, base, _ = run(target, NoProposer(), 0, params)
    for k in (2, 5):
        _, reqs, _ = run(target, proposer(kind, noisy), k, params)
        for a, b in zip(base, reqs):
            assert a.output_ids == b.output_ids and len(b.logprobs) == len(b.output_ids)
            assert [x.token_id for x in b.logprobs] == b.output_ids
            for x, y in zip(a.logprobs, b.logprobs):  # the same target rows (this dense fp32 tiny model)
                assert x.top[0][0] == y.top[0][0] == y.token_id  # greedy: the emitted token is the top one
                assert abs(x.logprob - y.logprob) < 1e-5  # dense fp32 is not row-exact: q4x8 below is bitwise
                assert [i for i, _ in x.top] == [i for i, _ in y.top]


def test_token_logprobs_are_log_softmax_of_the_row():
    logits = torch.randn(2, 10)
    out = token_logprobs(logits, [3, 7], 2)
    lp = torch.log_softmax(logits, -1)
    assert out[0].logprob == pytest.approx(float(lp[0, 3])) and out[1].logprob == pytest.approx(float(lp[1, 7]))
    assert [i for i, _ in out[0].top] == lp[0].topk(2).indices.tolist()

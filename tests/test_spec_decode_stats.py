"""SpecStats: counters and derived rates against hand-computed values."""
from __future__ import annotations

import json

import pytest

from draftwise.spec_decode.stats import SpecStats


def _example() -> SpecStats:
    stats = SpecStats()
    stats.record(3, 2, draft_time_s=0.5, verify_time_s=0.25)  # kept positions 0, 1 of 3
    stats.record(3, 3)  # all kept
    stats.record(5, 0)  # nothing kept, longest draft so far
    stats.record(0, 0)  # speculation off this step: not a draft
    return stats


def test_record_counts():
    stats = _example()
    assert stats.num_drafts == 3
    assert stats.num_draft_tokens == 3 + 3 + 5
    assert stats.num_accepted_tokens == 2 + 3 + 0
    assert stats.accepted_per_position == [2, 2, 1, 0, 0]
    assert stats.drafted_per_position == [3, 3, 3, 1, 1]
    assert stats.k_histogram == {3: 2, 5: 1, 0: 1}
    assert stats.draft_time_s == 0.5 and stats.verify_time_s == 0.25


def test_derived_rates():
    stats = _example()
    assert stats.acceptance_rate == pytest.approx(5 / 11)
    assert stats.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    assert stats.acceptance_rate_per_position == pytest.approx([2 / 3, 2 / 3, 1 / 3, 0.0, 0.0])


def test_empty_rates_are_none():
    stats = SpecStats()
    assert stats.acceptance_rate is None and stats.mean_acceptance_length is None
    stats.record(0, 0)
    assert stats.acceptance_rate is None and stats.mean_acceptance_length is None
    assert stats.k_histogram == {0: 1}


def test_record_rejects_impossible_counts():
    with pytest.raises(ValueError):
        SpecStats().record(2, 3)
    with pytest.raises(ValueError):
        SpecStats().record(2, -1)


def test_merge_adds_everything_and_grows_positions():
    total = SpecStats()
    total.record(2, 1, draft_time_s=1.0)
    other = SpecStats()
    other.record(4, 4, verify_time_s=2.0)
    other.record(2, 0)
    assert total.merge(other) is total
    assert total.num_drafts == 3
    assert total.num_draft_tokens == 8
    assert total.num_accepted_tokens == 5
    assert total.accepted_per_position == [2, 1, 1, 1]
    assert total.drafted_per_position == [3, 3, 1, 1]
    assert total.k_histogram == {2: 2, 4: 1}
    assert (total.draft_time_s, total.verify_time_s) == (1.0, 2.0)
    assert other.num_drafts == 2  # the argument is untouched


def test_merge_equals_recording_into_one():
    steps = [(3, 1), (3, 3), (1, 0), (0, 0), (4, 2)]
    one, left, right = SpecStats(), SpecStats(), SpecStats()
    for i, (k, accepted) in enumerate(steps):
        one.record(k, accepted)
        (left if i % 2 else right).record(k, accepted)
    assert left.merge(right).to_dict() == one.to_dict()


def test_to_dict_is_json_ready():
    data = json.loads(json.dumps(_example().to_dict()))
    assert data == {
        "num_drafts": 3,
        "num_draft_tokens": 11,
        "num_accepted_tokens": 5,
        "accepted_per_position": [2, 2, 1, 0, 0],
        "drafted_per_position": [3, 3, 3, 1, 1],
        "draft_time_s": 0.5,
        "verify_time_s": 0.25,
        "k_histogram": {"0": 1, "3": 2, "5": 1},
        "acceptance_rate": pytest.approx(5 / 11),
        "mean_acceptance_length": pytest.approx(8 / 3),
        "acceptance_rate_per_position": pytest.approx([2 / 3, 2 / 3, 1 / 3, 0.0, 0.0]),
        "num_forced_tokens": 0,
        "num_accepted_forced_tokens": 0,
        "forced_acceptance_rate": None,
        "mask_time_s": 0.0,
    }


def test_forced_tokens_are_counted_apart():
    s = SpecStats()
    s.record(5, 3, forced=(0, 1, 2, 3))  # 4 forced tokens at the front, the first 3 accepted
    s.record(2, 2, forced=(1,))
    s.record(3, 0)
    s.record(6, 3, forced=(2, 4, 5))  # forced between other guesses: only position 2 was kept
    assert (s.num_forced_tokens, s.num_accepted_forced_tokens) == (8, 5)
    assert s.forced_acceptance_rate == pytest.approx(5 / 8) and s.num_draft_tokens == 16
    merged = SpecStats().merge(s)
    assert merged.to_dict() == s.to_dict()
    with pytest.raises(ValueError):
        s.record(2, 1, forced=(0, 2))  # position 2 of a 2-token draft
    with pytest.raises(ValueError):
        s.record(3, 1, forced=(1, 1))

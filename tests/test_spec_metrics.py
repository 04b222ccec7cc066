"""SpecMetrics: τ and acceptance rates from the engine's per-request counters, pooled over requests."""

import pytest

from sparkspec.spec_decode.metrics import SpecMetrics


def test_from_request_counters_and_pooling():
    a = SpecMetrics.from_request("dspark", 3, {"spec_steps": 2, "spec_drafted": 6, "spec_accepted": 4,
                                               "spec_accepted_per_position": [2, 1, 1]})  # steps accepted 3, 1
    b = SpecMetrics.from_request("dspark", 3, {"spec_steps": 1, "spec_drafted": 2, "spec_accepted": 0,
                                               "spec_accepted_per_position": [0, 0]})
    assert a.acceptance_length == (4 + 2) / 2 and b.acceptance_length == 1.0
    total = SpecMetrics.aggregate([a, b])
    assert (total.num_steps, total.num_draft_tokens, total.num_accepted_tokens) == (3, 8, 4)
    assert total.acceptance_length == pytest.approx(7 / 3)
    assert total.acceptance_rate == 0.5
    assert total.accept_rate_per_position == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert 1 + sum(total.accept_rate_per_position) == pytest.approx(total.acceptance_length)
    assert total.conditional_accept_rate == pytest.approx([2 / 3, 1 / 2, 1.0])
    d = total.to_dict()
    assert d["acceptance_length"] == round(7 / 3, 4) and d["accepted_per_position"] == [2, 1, 1]


def test_record_matches_the_engine_counting():
    m = SpecMetrics("ngram", 2)
    m.record(0, 0)  # a decode row without drafts is not a verification step
    m.record(4, 2)  # longer than k: the per-position list grows
    assert (m.num_steps, m.accepted_per_position) == (1, [1, 1, 0, 0])
    with pytest.raises(ValueError):
        m.record(1, 2)


def test_no_steps():
    m = SpecMetrics.aggregate([], "mtp", 1)
    assert (m.acceptance_length, m.acceptance_rate, m.accept_rate_per_position) == (1.0, 0.0, [0.0])

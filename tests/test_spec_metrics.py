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


STEPS = [(0, 0), (2, 2), (2, 0), (4, 2), (1, 1)]  # (drafts verified, accepted) of one request's steps, k = 2


def test_record_matches_the_engine_counting(tiny_checkpoint):
    """The engine's two counters (per request: `RequestOutput.metrics`; engine-wide: `EngineStats`), driven through
    the engine's own `record` over the same steps, read back as the SpecMetrics that `record` builds."""
    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.llm_engine import LLMEngine
    from sparkspec.engine.sequence import Sequence
    from sparkspec.loading.checkpoint import load_checkpoint
    from sparkspec.sampling_params import SamplingParams

    ck = load_checkpoint(tiny_checkpoint, device="cpu", dtype="float32")
    eng = LLMEngine(ck.model, None, EngineConfig(max_num_seqs=2, speculative="ngram", num_spec_tokens=2))
    seq = Sequence(0, [5, 6, 7], SamplingParams(max_tokens=8))
    m = SpecMetrics("ngram", 2)
    for drafts, accepted in STEPS:
        eng.spec.record(seq, drafts, accepted, eng.stats)
        m.record(drafts, accepted)
    # a decode row without drafts is not a step; a step longer than k grows the per-position list
    assert (m.num_steps, m.num_draft_tokens, m.num_accepted_tokens, m.accepted_per_position) == (4, 9, 5, [3, 2, 0, 0])
    assert SpecMetrics.from_request("ngram", 2, eng.output(seq, []).metrics) == m
    st = eng.stats
    assert (st.num_spec_steps, st.num_drafted, st.num_accepted, st.accepted_per_position) == \
        (m.num_steps, m.num_draft_tokens, m.num_accepted_tokens, m.accepted_per_position)
    with pytest.raises(ValueError):
        m.record(1, 2)


def test_engine_counters_agree_over_a_generation(tiny_checkpoint_with_drafters):
    """Real steps (DSpark drafts, k = 3, every step drafts): the per-request counters pooled equal the engine-wide
    ones."""
    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.llm_engine import LLMEngine
    from sparkspec.loading.checkpoint import load_checkpoint
    from sparkspec.sampling_params import SamplingParams

    ck = load_checkpoint(tiny_checkpoint_with_drafters, device="cpu", dtype="float32")
    eng = LLMEngine(ck.model, None, EngineConfig(max_num_seqs=3, speculative="dspark", num_spec_tokens=3,
                                                 spec_budget="fixed"), ck.drafter_tensors)
    prompts = [[5, 6, 7, 8] * 5, [9, 10] * 8, [11, 12, 13] * 6]
    outs = eng.generate(prompts, [SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=s)
                                  for s in range(3)])
    pooled = SpecMetrics.aggregate([SpecMetrics.from_request("dspark", 3, o.metrics) for o in outs])
    st = eng.stats
    assert pooled.num_steps >= 3 * 3  # 16 tokens in steps of at most 4 each
    per_position = st.accepted_per_position + [0] * (3 - len(st.accepted_per_position))
    assert (st.num_spec_steps, st.num_drafted, st.num_accepted, per_position) == \
        (pooled.num_steps, pooled.num_draft_tokens, pooled.num_accepted_tokens, pooled.accepted_per_position)


def test_no_steps():
    m = SpecMetrics.aggregate([], "mtp", 1)
    assert (m.acceptance_length, m.acceptance_rate, m.accept_rate_per_position) == (1.0, 0.0, [0.0])

"""(b) Partial acceptance + rollback at every draft position, full acceptance + bonus, and exact rollback of
every cache: after verification each cache equals the one built from the committed tokens alone.

Caches checked by name: target sliding-window KV, compressor partial state, compressed entries, indexer
partial state, indexer keys (all in `SequenceCache`), DSpark context windows, MTP state.
"""

import dataclasses

import pytest
import torch
from spec_helpers import (  # noqa: F401
    ReplayProposer,
    drafter_tensors,
    mixed_prompts,
    one_thread,
    plain_generate,
    random_target,
    run_steps,
    tiny_setup,
)

from sparkspec.models.deepseek_v4 import Batch
from sparkspec.sampling_params import SamplingParams
from sparkspec.spec_decode import SpeculativeGenerator, build_proposer
from sparkspec.spec_decode.proposer import CommittedRows

pytestmark = pytest.mark.usefixtures("one_thread")

PARAMS = SamplingParams(max_tokens=22, ignore_eos=True)


class RecordingSampler:
    def __init__(self, inner):
        self.inner, self.verdicts = inner, []

    def __call__(self, logits, spans, drafts, params, generators):
        out = self.inner(logits, spans, drafts, params, generators)
        self.verdicts += [(d.num_tokens, v) for d, v in zip(drafts, out)]
        return out


@pytest.fixture(scope="module")
def base():
    torch.set_num_threads(1)
    cfg, model, tensors = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, [2, 10, 13, 15, 29], seed=7)
    return cfg, model, tensors, prompts, plain_generate(model, prompts, PARAMS)


@pytest.mark.parametrize("k,error_at", [(k, e) for k in (1, 2, 3, 4) for e in [*range(k), None]])
def test_replay_drafter_accepts_exactly_up_to_the_error(base, k, error_at):
    cfg, model, _, prompts, reference = base
    errors = set() if error_at is None else {error_at, k - 1}  # a later error never matters
    gen = SpeculativeGenerator(model, None, ReplayProposer(reference, k, errors, cfg.vocab_size))
    gen.rejection_sampler = rec = RecordingSampler(gen.rejection_sampler)
    seqs = gen.generate(prompts, PARAMS)
    assert [s.output_ids for s in seqs] == reference
    full = error_at is None
    for num_drafts, v in rec.verdicts:
        assert v.num_accepted == (num_drafts if full else min(error_at, num_drafts))
        assert v.is_bonus == (v.num_accepted == num_drafts)
        assert len(v.token_ids) == v.num_accepted + 1
    m = gen.spec_metrics
    for i in range(k):
        expected = m.drafted_per_position[i] if full or i < error_at else 0
        assert m.accepted_per_position[i] == expected
    if full:  # every step emits k + 1 tokens until the budget caps k near max_tokens
        assert m.acceptance_length > k
        assert any(v.is_bonus and n == k for n, v in rec.verdicts)


# ---- exact rollback of every cache ----

@pytest.fixture(scope="module")
def rolled_back(base):
    """Every step verifies 5 rows and commits 1 (error at draft 0), so rejected rows cross ratio-4 and ratio-16
    compression boundaries again and again; the run stops mid-generation with caches still alive."""
    cfg, model, _, prompts, reference = base
    k = 4
    gen = SpeculativeGenerator(model, None, ReplayProposer(reference, k, {0}, cfg.vocab_size))
    starts = []
    seqs = gen.start(prompts, PARAMS)
    for _ in range(12):
        starts += [s.cache.num_tokens for s in seqs if not s.finished]
        gen.spec_step([s for s in seqs if not s.finished])
    assert any((n + k) // 16 > n // 16 for n in starts)  # a rejected row completed a ratio-16 entry
    assert all(s.cache.num_tokens == len(s.prompt_ids) + len(s.output_ids) - 1 for s in seqs)
    fresh = [model.new_cache() for _ in seqs]
    committed = [s.prompt_ids + s.output_ids[:-1] for s in seqs]
    spans, off = [], 0
    for c in committed:
        spans.append((off, off + len(c)))
        off += len(c)
    with torch.inference_mode():
        model(torch.tensor([t for c in committed for t in c]), Batch(spans, [0] * len(seqs), fresh))
    return model, seqs, fresh


def _compare(model, seqs, fresh, attr: str) -> int:
    checked = 0
    for s, ref in zip(seqs, fresh):
        assert s.cache.num_tokens == ref.num_tokens
        for layer, a, b in zip(model.layers, s.cache.layers, ref.layers):
            x, y = getattr(a, attr), getattr(b, attr)
            if x is None:
                continue
            assert x.n == y.n, (attr, layer.layer_id)
            torch.testing.assert_close(x.view(), y.view(), rtol=1e-5, atol=1e-5)
            checked += x.n
    return checked


@pytest.mark.parametrize("cache,attrs", [
    ("target_sliding_kv", ["kv"]),
    ("compressor_partial_state", ["comp_kv", "comp_score"]),
    ("compressed_entries", ["compressed"]),
    ("indexer_partial_state", ["idx_kv", "idx_score"]),
    ("indexer_keys", ["idx_keys"]),
])
def test_rollback_target_cache(rolled_back, cache, attrs):
    model, seqs, fresh = rolled_back
    assert sum(_compare(model, seqs, fresh, a) for a in attrs) > 0, cache


def _committed_forward(model, seqs, capture):
    committed = [s.prompt_ids + s.output_ids[:-1] for s in seqs]
    spans, off = [], 0
    for c in committed:
        spans.append((off, off + len(c)))
        off += len(c)
    ids = torch.tensor([t for c in committed for t in c])
    with torch.inference_mode():
        out = model(ids, Batch(spans, [0] * len(seqs), [model.new_cache() for _ in seqs]), **capture)
    return ids, spans, out


def test_rollback_dspark_context_windows(base):
    """The drafter's per-stage context windows hold exactly the last `window` committed positions."""
    cfg, model, tensors, prompts, _ = base
    proposer = build_proposer("dspark", model, tensors, 4)
    gen = SpeculativeGenerator(model, None, proposer)
    seqs = run_steps(gen, prompts, PARAMS, 6)  # random drafter: almost every draft is rejected
    assert sum(s.spec_metrics.num_draft_tokens - s.spec_metrics.num_accepted_tokens for s in seqs) > 0
    _, spans, out = _committed_forward(model, seqs, gen.capture)
    W = cfg.sliding_window
    for s, (a, e) in zip(seqs, spans):
        state = proposer.states[s.seq_id]
        assert state.num_committed == s.cache.num_tokens == e - a
        with torch.inference_mode():
            main_x = proposer.drafter.main_x(out.taps[a:e])
            ref = proposer.drafter.context_kv(main_x, torch.arange(e - a))
        for got, want in zip(state.ctx_kv, ref):
            assert got.shape[0] == min(W, e - a)
            torch.testing.assert_close(got, want[-W:], rtol=1e-5, atol=1e-5)


def test_rollback_mtp_state():
    """Two MTP layers: after drafting chains (never stored) and rejections, the state equals the one built by
    observing the committed tokens in one go."""
    cfg, _, _ = tiny_setup()
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=2)
    model = random_target(cfg, seed=3)
    proposer = build_proposer("mtp", model, drafter_tensors(cfg, 4, "mtp"), 3)
    gen = SpeculativeGenerator(model, None, proposer)
    prompts = mixed_prompts(cfg.vocab_size, [5, 14, 17], seed=8)
    seqs = run_steps(gen, prompts, PARAMS, 8)
    assert sum(s.spec_metrics.num_draft_tokens for s in seqs) > sum(s.spec_metrics.num_accepted_tokens for s in seqs)
    ids, spans, out = _committed_forward(model, seqs, gen.capture)
    ref = build_proposer("mtp", model, drafter_tensors(cfg, 4, "mtp"), 3)
    ref.start(seqs)
    with torch.inference_mode():
        ref.observe(CommittedRows(seqs, spans, [0] * len(seqs), ids, None, out.final_streams))
    for s in seqs:
        got, want = proposer.states[s.seq_id], ref.states[s.seq_id]
        assert got.num_committed == want.num_committed == s.cache.num_tokens
        for j in range(2):
            assert torch.equal(got.pos[j], want.pos[j])
            torch.testing.assert_close(got.kv[j], want.kv[j], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.last_out[j], want.last_out[j], rtol=1e-5, atol=1e-5)

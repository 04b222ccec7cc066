"""The Gumbel-max rows' proposal rule (`sampling.sample_draft`'s `gumbel_temperature` s: drafts are
argmax(log q_s + G)): a non-default s changes the drafts and the acceptance, never the emitted tokens, which stay
plain decoding's for the seed; rejection and greedy rows ignore it. Deterministic (fixed seeds)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparkspec.ops.sampling import STREAM_DRAFT, SamplingTensors, gumbel_sample, sample_draft
from sparkspec.sampling_params import SamplingParams as SP
from sparkspec.spec_decode.rejection import RejectionSampler

DEVICE = torch.device("cpu")


def st_of(params: list[SP], seeds: torch.Tensor, gumbel: torch.Tensor | bool = True) -> SamplingTensors:
    return SamplingTensors(
        torch.tensor([p.device_temperature for p in params], dtype=torch.float32, device=DEVICE),
        torch.tensor([p.top_k for p in params], dtype=torch.int64, device=DEVICE),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=DEVICE),
        seeds.to(DEVICE, torch.int64), all(p.greedy for p in params), any(p.top_k > 0 for p in params),
        any(p.top_p < 1 for p in params), gumbel)


PARAMS = [SP(temperature=1.0), SP(), SP(temperature=0.7, top_k=6), SP(temperature=1.2, top_p=0.8)] * 2


def test_rule_moves_gumbel_drafts_only():
    """s scales the Gumbel rows' drafter logits: s = 1 is the plain Gumbel-max draw, another s is the draw of
    logits / s; greedy rows keep the argmax and rejection rows their draw and their q, whatever s."""
    R, V = len(PARAMS), 64
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(R, V, generator=g) * 2).to(DEVICE)
    seeds, pos = torch.arange(R, device=DEVICE) + 7, torch.arange(R, device=DEVICE) * 3 + 11
    which = torch.tensor([True, True, True, True, False, False, False, False], device=DEVICE)
    st = st_of(PARAMS, seeds, which)
    base_ids, base_q = sample_draft(logits, st, pos, STREAM_DRAFT)
    assert torch.equal(base_ids[which], gumbel_sample(logits, st, pos)[0][which])
    moved = False
    for s in (0.3, 0.6, 1.7, 3.0):
        ids, q = sample_draft(logits, st, pos, STREAM_DRAFT, s)
        assert torch.equal(ids[which], gumbel_sample(logits / s, st, pos)[0][which])
        assert torch.equal(ids[~which], base_ids[~which]) and torch.equal(q, base_q)  # rejection rows: untouched
        assert ids[st.greedy].tolist() == logits[st.greedy].argmax(-1).tolist()
        all_gumbel = dataclasses.replace(st, gumbel=True)
        ids_all, q_all = sample_draft(logits, all_gumbel, pos, STREAM_DRAFT, s)
        assert q_all is None and torch.equal(ids_all[which], ids[which])
        moved |= bool((ids[which] != base_ids[which]).any())
    assert moved  # the rule does change drafts, so the losslessness tests below are not vacuous


def test_no_host_sync_with_a_rule():
    from test_invariant_sampling import OpLog

    R, V = 4, 9
    logits = torch.randn(R, V, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    params = [SP(temperature=1.0), SP(temperature=0.6, top_k=3, top_p=0.9), SP(), SP(temperature=1.0)]
    with OpLog() as log:
        for gum in (True, torch.tensor([True, False, True, False], device=DEVICE)):
            sample_draft(logits, st_of(params, torch.arange(R, device=DEVICE), gum), torch.arange(R, device=DEVICE),
                         STREAM_DRAFT, 0.7)
    syncs = {"_local_scalar_dense", "nonzero", "is_nonzero", "item", "equal", "masked_select", "unique"}
    assert len(log.ops) > 10 and not syncs & set(log.ops)


# ---------------------------------------------------------------- lossless: synthetic Markov pair


def decode(P, Q, st, first, pos0, steps, k, s):
    """Markov target P[prev] and drafter Q[prev] (logits [V, V]); k = 0: plain decoding; else each step drafts k
    tokens with the rule s and verifies them -> (tokens [R, steps], accepted drafts in all)."""
    R = first.shape[0]
    done = [[] for _ in range(R)]
    accepted = 0
    while min(len(x) for x in done) < steps:
        prev = torch.tensor([x[-1] if x else int(first[r]) for r, x in enumerate(done)], device=DEVICE)
        pos = pos0 + torch.tensor([len(x) for x in done], device=DEVICE)
        drafts, d = [], prev
        for i in range(k):
            d, _ = sample_draft(Q[d], st, pos + i, STREAM_DRAFT, s)
            drafts.append(d)
        drafts = torch.stack(drafts, 1) if k else torch.empty(R, 0, dtype=torch.int64, device=DEVICE)
        ctx = torch.cat([prev.unsqueeze(1), drafts], 1)  # [R, k+1] the token before each verify row
        out, L = RejectionSampler()(P[ctx], drafts, None, st, pos)
        for r in range(R):
            done[r].extend(out[r, : int(L[r]) + 1].tolist())
        accepted += int(L.sum())
    return torch.tensor([x[:steps] for x in done]), accepted


@pytest.mark.parametrize("params", [SP(temperature=1.0), SP(temperature=0.7, top_k=8, top_p=0.9)],
                         ids=["t1", "filtered"])
def test_any_rule_emits_plain_decodings_tokens(params):
    """Drafts under s = 0.4 / 2.5 (and the default) are accepted at other rates, and every emitted token is plain
    Gumbel decoding's for the seed; another seed (the target's own draw changed) gives other tokens."""
    R, V, steps = 6, 24, 48
    g = torch.Generator().manual_seed(2)
    P = (torch.randn(V, V, generator=g) * 2).to(DEVICE)
    Q = (0.6 * P.cpu() + 0.8 * torch.randn(V, V, generator=g)).to(DEVICE)  # a drafter near the target
    seeds = torch.arange(R, device=DEVICE) * 13 + 5
    st = st_of([params] * R, seeds)
    first, pos0 = torch.arange(R, device=DEVICE) % V, torch.arange(R, device=DEVICE) * 4 + 9
    plain, _ = decode(P, Q, st, first, pos0, steps, 0, 1.0)
    rates = set()
    for s in (1.0, 0.4, 2.5):
        got, accepted = decode(P, Q, st, first, pos0, steps, 3, s)
        assert torch.equal(got, plain), s
        assert accepted > 0
        rates.add(accepted)
    assert len(rates) == 3  # each rule drafted differently
    other, _ = decode(P, Q, st_of([params] * R, seeds + 1), first, pos0, steps, 3, 0.4)
    assert not torch.equal(other, plain)


# ---------------------------------------------------------------- lossless: the demo pair in the engine


@pytest.fixture(scope="module")
def demo():
    from sparkspec.loading.checkpoint import load_checkpoint
    from sparkspec.paths import DEFAULT_MODEL

    ckpt = load_checkpoint(DEFAULT_MODEL, device="cpu")
    prompts = ["What is 17 times 23?", "def fibonacci(n):", "Tell me a story."]
    ids = [ckpt.tokenizer.encode(ckpt.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
           for p in prompts]
    return ckpt, ids


def demo_run(ckpt, ids, method, s=None):
    """Seeded T = 1 tokens of each prompt (one batch) and the engine's accepted-draft count."""
    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.llm_engine import LLMEngine
    from sparkspec.spec_decode.build import build_proposer

    config = EngineConfig(speculative=method, spec_budget="fixed", max_num_seqs=4, max_model_len=256,
                          sampling_scheme="gumbel")
    proposer = None if s is None else build_proposer(method, ckpt.model, ckpt.drafter_tensors, None, s)
    engine = LLMEngine(ckpt.model, ckpt.tokenizer, config, ckpt.drafter_tensors, proposer=proposer)
    params = [SP(temperature=1.0, seed=21 + i, max_tokens=32, ignore_eos=True) for i in range(len(ids))]
    tokens = [o.token_ids for o in engine.generate(ids, params)]
    return tokens, engine.stats.num_accepted


@pytest.mark.parametrize("method", ["dspark", "mtp"])
def test_demo_rule_keeps_plain_decodings_tokens(demo, method):
    """DSpark / MTP drafting with s = 0.5 and 2 (built through `build_proposer`) emits plain decoding's seeded
    tokens, while accepting a different number of drafts than the default rule."""
    ckpt, ids = demo
    plain, _ = demo_run(ckpt, ids, "none")
    default, acc_default = demo_run(ckpt, ids, method)
    assert default == plain
    for s in (0.5, 2.0):
        got, acc = demo_run(ckpt, ids, method, s)
        assert got == plain, s
        assert acc != acc_default, s  # the rule was in force: other drafts, other acceptance


def test_build_proposer_checks_the_rule(demo):
    from sparkspec.spec_decode.build import build_proposer

    ckpt, _ = demo
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="gumbel_draft_temperature"):
            build_proposer("dspark", ckpt.model, ckpt.drafter_tensors, None, bad)
    assert build_proposer("mtp", ckpt.model, ckpt.drafter_tensors, None, 0.8).gumbel_draft_temperature == 0.8

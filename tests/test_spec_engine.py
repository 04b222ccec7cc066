"""Lossless speculative decoding through the engine (the path the server, `generate`, `eval` and `bench` run).

Temperature 0: every method and k returns exactly the token ids of plain decoding, in mixed batches with
chunked prefill and with preemption forced by a small KV budget. The drafts must really be accepted: a replay
drafter proposes the target's own greedy continuation with an error injected at a chosen position (so every
step accepts exactly that many drafts: partial acceptance and rollback at every position), and the shipped
demo drafters are run on the demo target. fp64 keeps argmax ties out of the random-model comparisons.
"""

from __future__ import annotations

import pytest
import torch
from spec_helpers import mixed_prompts, one_thread, tiny_setup  # noqa: F401

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.sampling_params import SamplingParams
from sparkspec.spec_decode import build_proposer
from sparkspec.spec_decode.methods import DRAFT_METHODS
from sparkspec.spec_decode.proposer import HostProposer

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = [1, 2, 3, 5, 6, 7, 9, 11, 12, 14, 15, 16, 17, 18, 20, 24, 27, 30, 31, 33, 36, 40]
MAX_TOKENS = [28, 20, 28, 13]  # cycled over the prompts


class ReplayProposer(HostProposer):
    """Test drafter: replays the target's own greedy continuation, with the draft at step-relative position
    `error` (if any) replaced by a wrong token, so each step accepts exactly min(error, k) drafts."""

    method = "replay"

    def __init__(self, prompts: list[list[int]], reference: list[list[int]], k: int, error: int | None, vocab: int):
        super().__init__(k)
        self.reference = {tuple(p): r for p, r in zip(prompts, reference)}
        self.error, self.vocab = error, vocab

    def propose_ids(self, token_ids, k):
        out = []
        for ids in token_ids:
            prompt = next(p for p in self.reference if tuple(ids[: len(p)]) == p and len(ids) > len(p))
            o = len(ids) - len(prompt)  # outputs so far; the next drafts continue the reference at o
            true = self.reference[prompt][o : o + k]
            out.append([(t + 1) % self.vocab if i == self.error else t for i, t in enumerate(true)])
        return out


def engine(model, tensors=None, proposer=None, method="none", k=None, **kw) -> LLMEngine:
    kw.setdefault("max_num_batched_tokens", 64)  # prompts up to 40 tokens next to decode rows: chunked prefill
    cfg = EngineConfig(max_num_seqs=16, speculative=method, num_spec_tokens=k, spec_budget="fixed", **kw)
    return LLMEngine(model, None, cfg, tensors, proposer)


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    cfg, model, tensors = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, LENGTHS)
    params = [SamplingParams(max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)], ignore_eos=True) for i in range(len(prompts))]
    reference = [o.token_ids for o in engine(model).generate(prompts, params)]
    return cfg, model, tensors, prompts, params, reference


def test_plain_engine_equals_one_request_at_a_time(setup):
    _, model, _, prompts, params, reference = setup
    for i in (0, 9, 21):
        assert engine(model, max_num_batched_tokens=8).generate([prompts[i]], params[i])[0].token_ids == reference[i]


@pytest.mark.parametrize("method", DRAFT_METHODS)
@pytest.mark.parametrize("k", [1, 2, 3, 4])  # 4 = the tiny preset's dspark_block_size
def test_greedy_equals_plain_decoding(setup, method, k):
    _, model, tensors, prompts, params, reference = setup
    eng = engine(model, tensors, method=method, k=k)
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == reference
    if method != "ngram":  # model drafters draft on every decode step
        assert eng.stats.num_drafted > 0.5 * eng.stats.num_spec_steps * k


@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("error", [None, 0, 1, 2, 3])
def test_replay_drafter_partial_acceptance_at_every_position(setup, k, error):
    cfg, model, _, prompts, params, reference = setup
    eng = engine(model, proposer=ReplayProposer(prompts, reference, k, error, cfg.vocab_size))
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == reference
    s = eng.stats
    assert s.num_spec_steps > 0
    per_position = s.accepted_per_position + [0] * (k - len(s.accepted_per_position))
    if error is None or error >= k:  # full acceptance (and a bonus token) every step
        assert s.num_accepted == s.num_drafted
    else:  # exactly `error` drafts accepted per step: positions before it accepted, none after
        assert all(per_position[j] > 0 for j in range(error)) and not any(per_position[error:])
    if error is None or error >= 2:
        assert s.num_accepted > 0.5 * s.num_drafted


@pytest.mark.parametrize("method", ["dspark", "mtp", "replay"])
def test_preemption_recomputes_exactly(setup, method):
    """A KV budget far below what the batch needs forces preemption and recompute mid-generation."""
    cfg, model, tensors, prompts, params, reference = setup
    proposer = ReplayProposer(prompts, reference, 3, 2, cfg.vocab_size) if method == "replay" else None
    method = method if proposer is None else "none"
    block_bytes = engine(model, tensors, proposer, method=method, k=3).kv_plan.bytes_per_block
    eng = engine(model, tensors, proposer, method=method, k=3, kv_cache_memory=14 * block_bytes)  # ~2 requests
    outs = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    if method == "replay":
        assert eng.stats.num_accepted > 0.25 * eng.stats.num_drafted


@pytest.mark.parametrize("method", ["none", "dspark", "mtp"])
def test_seeded_sampling_is_independent_of_the_batch(setup, method):
    """A seeded request gives the same tokens alone and among other requests (counter-based randomness)."""
    _, model, tensors, prompts, _, _ = setup
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = engine(model, tensors, method=method, k=3).generate([prompts[5]], params)[0].token_ids
    others = [SamplingParams(max_tokens=9, temperature=1.0, ignore_eos=True)] * 6
    batch = engine(model, tensors, method=method, k=3).generate(prompts[:5] + [prompts[5]] + prompts[6:7],
                                                              others[:5] + [params] + others[5:6])
    assert batch[5].token_ids == alone


@pytest.fixture(scope="module")
def demo():
    from sparkspec.loading.checkpoint import load_checkpoint
    from sparkspec.paths import DEFAULT_MODEL

    return load_checkpoint(DEFAULT_MODEL, dtype="float32")


@pytest.mark.parametrize("method", ["dspark", "mtp"])
def test_demo_drafters_are_accepted_and_lossless(demo, method):
    """The shipped drafters on the shipped target: drafts are accepted often (so the equality says something),
    and the text is plain decoding's."""
    prompts = ["Write a haiku about the sea.", "What is 12 times 7?", "def fibonacci(n):"]
    tok = demo.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
           for p in prompts]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = [o.token_ids for o in LLMEngine(demo.model, demo.tokenizer).generate(ids, params)]
    eng = LLMEngine(demo.model, demo.tokenizer, EngineConfig(speculative=method, num_spec_tokens=4,
                                                              spec_budget="fixed"), demo.drafter_tensors)
    assert [o.token_ids for o in eng.generate(ids, params)] == plain
    assert eng.stats.num_accepted > 0.25 * eng.stats.num_drafted


def test_host_and_device_drafters_share_one_interface(setup):
    _, model, tensors, *_ = setup
    assert build_proposer("ngram", model, {}, 2).on_device is False
    assert build_proposer("dspark", model, tensors, 2).on_device is True


def test_requests_left_out_of_a_step_drop_drafts_whose_q_was_overwritten():
    """The drafter's q lives in one buffer that every proposing step rewrites: a request the token budget left
    out of such a step must not verify against another request's q later."""
    from sparkspec.engine.sequence import Sequence
    from sparkspec.engine.spec_policy import SpecPolicy

    a, b, c = (Sequence(i, [5, 6, 7], SamplingParams(max_tokens=4)) for i in range(3))
    a.spec.draft_ids, a.spec.draft_row = [9, 9], 0  # sampled this step: keeps its new row
    b.spec.draft_ids, b.spec.draft_row = [8], 1  # left out, with a q row: loses its drafts
    c.spec.draft_ids, c.spec.draft_row = [7], -1  # left out, one-hot drafts: keeps them
    SpecPolicy.forget_overwritten([a, b, c], {a})
    assert (a.spec.draft_ids, a.spec.draft_row) == ([9, 9], 0)
    assert (b.spec.draft_ids, b.spec.draft_row, b.spec.confidences) == ([], -1, None)
    assert (c.spec.draft_ids, c.spec.draft_row) == ([7], -1)


def test_an_idle_engine_files_no_step_with_the_wait(setup, tmp_path):
    """The engine tells the adaptive budget when its last request has finished (`VerificationBudget.idle`), so the
    5 s before the next batch arrives is no step's wall time. The budget's clock is a fake one that advances 1 ms
    per read: every step filed is a few ms whatever the host's speed; without the engine's call, the step before
    the wait would be filed at ~5 s (under `StepTimes.max_seconds`); so would the one after a last request that
    is aborted (a server steps no more then)."""
    cfg, model, tensors, prompts, params, _ = setup
    ec = EngineConfig(max_num_seqs=4, speculative="dspark", num_spec_tokens=3, spec_budget="adaptive",
                      cost_cache_dir=str(tmp_path), max_num_batched_tokens=64)
    eng = LLMEngine(model, None, ec, tensors)
    budget = eng.spec.budget

    class Clock:
        now = 0.0

        def __call__(self):
            self.now += 0.001
            return self.now

    clock = budget.clock = Clock()
    budget.gc_clock, budget.trace = None, []
    eng.generate(prompts[:4], params[:4])
    clock.now += 5.0
    eng.generate(prompts[4:8], params[4:8])
    eng.add_request(prompts[8], params[8], request_id="aborted")  # a server's last request, aborted mid-way
    for _ in range(3):
        eng.step()
    assert eng.abort_request("aborted") and not eng.has_unfinished()
    clock.now += 5.0
    eng.generate(prompts[9:11], params[9:11])
    filed = [e["ms"] for e in budget.trace if e.get("filed") or e.get("joined")]
    assert len(filed) > 10 and max(filed) < 10.0


@pytest.mark.parametrize("method", ["dspark", "mtp"])
def test_no_drafts_are_proposed_on_a_step_where_every_request_ends(setup, method):
    """Requests of one length end together: the step where the last of them ends proposes nothing (no request would
    read its drafts); every other step that samples proposes k, and the tokens are plain decoding's."""
    cfg, model, tensors, prompts, params, reference = setup
    eng = engine(model, tensors, method=method, k=3)
    propose, told = eng.spec.num_drafts_to_propose, []

    def recorded(items, *a, **kw):
        k = propose(items, *a, **kw)
        ends = [len(it.seq.output_ids) + it.seq.num_inflight + 1 >= it.seq.params.max_tokens
                for it in items if it.samples]
        told.append((k, ends))
        return k

    eng.spec.num_drafts_to_propose = recorded
    same = [SamplingParams(max_tokens=13, ignore_eos=True) for _ in prompts[:6]]
    out = [o.token_ids for o in eng.generate(prompts[:6], same)]
    assert out == [r[:13] for r in reference[:6]]
    assert told[-1] == (0, [True] * len(told[-1][1])) and len(told[-1][1]) >= 1
    assert all(k == 3 for k, ends in told[:-1] if ends and not all(ends))
    assert [k for k, ends in told if ends and all(ends)] == [0] * sum(1 for _, e in told if e and all(e))

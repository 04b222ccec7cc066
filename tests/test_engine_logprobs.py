"""Engine-level OpenAI features (no server): logprobs of the target's distribution for every emitted token,
accepted drafts included (equal to plain decoding's at T = 0, and at T = 1 to the model's scores of the sampled
text), prompt logprobs across chunked prefill and preemption, n samples, max_tokens 0, the per-request draft
cap, and a logprobs step whose op count does not grow with the batch."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import mixed_prompts, one_thread, tiny_setup  # noqa: F401
from test_engine import OracleProposer, ckpt, engine, prompts, reference  # noqa: F401
from test_step_ops import SYNC_OPS, OpCounter

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.kv_plan import cache_bytes_per_token
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.sampling_params import SamplingParams
from sparkspec.spec_decode.methods import DRAFT_METHODS

TOP = 3
LP = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=TOP)


def close(a: list[dict], b: list[dict], tol: float = 1e-4) -> bool:
    """Same tokens in the same order, values within tol."""
    return all(list(x) == list(y) and all(abs(x[t] - y[t]) < tol for t in x) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def plain_logprobs(ckpt, prompts):  # noqa: F811
    return [o.logprobs for o in engine(ckpt).generate(prompts, LP)]


@pytest.mark.parametrize("spec", [*DRAFT_METHODS, "oracle"])
def test_logprobs_under_speculation_equal_plain_greedy(ckpt, prompts, reference, plain_logprobs, spec):  # noqa: F811
    """The oracle drafter is often right, so most emitted tokens come from verify rows 1..L."""
    refs = {tuple(p): r for p, r in zip(prompts, reference)}
    proposer = OracleProposer(4, refs, ckpt.config.vocab_size) if spec == "oracle" else None
    eng = engine(ckpt, proposer, speculative="none" if proposer else spec, spec_budget="fixed",
                 num_spec_tokens=None if proposer else 3)
    outs = eng.generate(prompts, LP)
    assert [o.token_ids for o in outs] == reference
    if spec == "oracle":
        assert eng.stats.num_accepted > len(prompts) * 3
    for o, ref in zip(outs, plain_logprobs):
        assert len(o.logprobs) == len(o.token_ids) and close(o.logprobs, ref)
        for tok, d in zip(o.token_ids, o.logprobs):
            top = list(d.values())[:TOP]
            assert top == sorted(top, reverse=True) and tok in d
            assert d[tok] == max(d.values())  # greedy: the token is the argmax


@pytest.mark.parametrize("spec", ["dspark", "mtp"])
def test_sampled_logprobs_are_the_models_scores(ckpt, spec):  # noqa: F811
    """T = 1 (no top-k / top-p): the logprob of each sampled token, accepted drafts included, is the model's
    log-softmax at that position, i.e. the prompt logprobs of prompt + output scored by a plain engine."""
    eng = engine(ckpt, speculative=spec, spec_budget="fixed", num_spec_tokens=3)
    prompt = [0, 17, 99, 250, 7, 17, 99]
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, logprobs=2)
    outs = [eng.generate([prompt], SamplingParams(**{**params.__dict__, "seed": s}))[0] for s in range(3)]
    assert eng.stats.num_accepted > 0
    scorer = engine(ckpt)
    for o in outs:
        scored = scorer.generate([prompt + o.token_ids], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
        assert scored.token_ids == [] and scored.finish_reason == "length"
        assert close(o.logprobs, scored.prompt_logprobs[len(prompt):])


def test_logprobs_follow_top_k_and_temperature(ckpt):  # noqa: F811
    """Sampled rows report the processed distribution: -inf outside the top-k, and the kept ones renormalised."""
    eng = engine(ckpt)
    o = eng.generate([[0, 5, 9, 44]], SamplingParams(max_tokens=6, temperature=0.7, top_k=2, seed=1, logprobs=4,
                                                     ignore_eos=True))[0]
    for tok, d in zip(o.token_ids, o.logprobs):
        values = list(d.values())
        assert values[2:] == [float("-inf")] * 2 and abs(sum(torch.tensor(values[:2]).exp()) - 1) < 1e-5
        assert tok in list(d)[:2]


def test_prompt_logprobs_across_chunks_and_preemption(ckpt, prompts):  # noqa: F811
    """Chunked prefill scores the prompt chunk by chunk; a preempted request's recompute scores nothing again."""
    params = SamplingParams(max_tokens=10, ignore_eos=True, prompt_logprobs=2)
    whole = engine(ckpt, max_num_batched_tokens=512).generate(prompts, params)
    chunked = engine(ckpt, max_num_batched_tokens=5).generate(prompts, params)
    per_block = 4 * sum(cache_bytes_per_token(ckpt.config).values())
    longest = max(len(p) for p in prompts) + params.max_tokens
    tight = engine(ckpt, block_size=4, kv_cache_memory=per_block * (-(-longest // 4) + 2), max_num_seqs=6,
                   max_num_batched_tokens=64)
    preempted = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    for a, b, c, p in zip(whole, chunked, preempted, prompts):
        assert len(a.prompt_logprobs) == len(p) and a.prompt_logprobs[0] is None
        assert all(tok in d for tok, d in zip(p[1:], a.prompt_logprobs[1:]))
        assert close(a.prompt_logprobs[1:], b.prompt_logprobs[1:]) and close(a.prompt_logprobs[1:],
                                                                              c.prompt_logprobs[1:])


def test_n_samples(ckpt):  # noqa: F811
    eng = engine(ckpt, speculative="dspark", spec_budget="fixed")
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, n=3, ignore_eos=True, logprobs=0)
    a, b = eng.generate([[0, 5, 9]], params)[0], eng.generate([[0, 5, 9]], params)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    assert all(len(o.logprobs) == 8 for o in a.outputs)
    one = eng.generate([[0, 5, 9]], SamplingParams(**{**params.__dict__, "n": 1}))[0]
    assert one.token_ids == a.outputs[0].token_ids == a.token_ids and one.outputs[0].index == 0


def test_per_request_draft_cap(ckpt, prompts):  # noqa: F811
    eng = engine(ckpt, speculative="dspark", spec_budget="fixed", num_spec_tokens=3)
    caps = [0, 1, None]
    for p, cap in zip(prompts, caps):
        eng.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True, num_spec_tokens=cap))
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.metrics
    off, one, free = (done[str(i)] for i in range(3))
    assert off["spec_drafted"] == 0 and off["spec_steps"] == 0
    assert one["spec_drafted"] == one["spec_steps"] > 0
    assert free["spec_drafted"] > free["spec_steps"]
    with pytest.raises(ValueError, match="^num_spec_tokens = 4"):
        eng.add_request(prompts[0], SamplingParams(num_spec_tokens=4))
    with pytest.raises(ValueError, match="^num_spec_tokens = 1"):
        engine(ckpt).add_request(prompts[0], SamplingParams(num_spec_tokens=1))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("method", ["none", "dspark"])
def test_logprob_step_ops_do_not_grow_with_the_batch(method):
    def ops(batch: int) -> int:
        _, model, tensors = tiny_setup()
        eng = LLMEngine(model, None, EngineConfig(max_num_seqs=64, speculative=method, num_spec_tokens=3,
                                                  spec_budget="fixed"), tensors)
        params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, logprobs=5)
        for p in mixed_prompts(model.cfg.vocab_size, [9 + i % 13 for i in range(batch)], seed=batch):
            eng.add_request(p, params)
        while any(not s.output_ids for s in eng.requests.values()):
            eng.step()
        eng.step()
        counter = OpCounter()
        with counter:
            eng.step()
        assert not [op for op in counter.ops if op.startswith(SYNC_OPS)], "a host sync inside the step"
        return sum(counter.ops.values())

    assert ops(32) <= 1.2 * ops(1)

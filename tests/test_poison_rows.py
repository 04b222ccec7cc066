"""No row can fail another (issue 18, part 1), through the engine with every speculative method.

* Tiny temperatures (1e-45 .. 1e-6: fp32 denormals included, where `logits / T` used to overflow into a NaN
  softmax and an out-of-range id) are greedy: such rows give exactly the greedy tokens, and the good rows of
  their batch exactly what they give without them.
* A numerically broken model: the embedding row of one token id X is NaN, so every distribution computed after
  X is NaN (target, KV cache, drafter context and the MTP draft chain alike). A request that meets X fails
  alone, with the reason, while the rest of each step commits; the freed blocks serve later requests exactly.
* Through `AsyncLLMEngine`: such a request gets RequestFailedError, and 16 of them in a row (more than
  MAX_CONSECUTIVE_STEP_FAILURES) leave the engine running, because a failure of one row never counts.

References are the same engine configuration without the poison rows (seeded sampling does not depend on the
batch); greedy rows are also compared with plain decoding of the clean model.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from spec_helpers import mixed_prompts, one_thread, tiny_setup  # noqa: F401

from sparkspec.engine.async_engine import MAX_CONSECUTIVE_STEP_FAILURES, AsyncLLMEngine, RequestFailedError
from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.engine.step_result import NONFINITE_ERROR
from sparkspec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_TEMPERATURES = [1e-45, 1e-40, 1e-38, 1e-30, 1e-6]
EDGE_FILTERS = [dict(), dict(top_k=1), dict(top_p=5e-324), dict(top_k=2**63 - 1, top_p=1e-300), dict(top_k=-1),
                dict(top_p=0.5, top_k=3)]
SPEC = [("none", None), ("dspark", 1), ("dspark", 2), ("dspark", 4), ("mtp", 1), ("mtp", 3), ("ngram", 2),
        ("ngram", 4)]
MAX_TOKENS = 12


def engine(model, tensors, method: str = "none", k: int | None = None) -> LLMEngine:
    cfg = EngineConfig(max_num_seqs=16, speculative=method, num_spec_tokens=k, spec_budget="fixed",
                       max_num_batched_tokens=64)
    return LLMEngine(model, None, cfg, tensors)


def good_params() -> list[SamplingParams]:
    """Greedy and seeded sampled rows, with and without filters."""
    return [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kw) for kw in (
        dict(), dict(temperature=0.8, seed=1), dict(temperature=1.0, top_p=0.9, seed=2),
        dict(temperature=0.7, top_k=5, seed=3), dict(temperature=1e-5, seed=4))]


def tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    cfg, model, tensors = tiny_setup()
    good = mixed_prompts(cfg.vocab_size, [3, 8, 14, 20, 9])
    tiny = mixed_prompts(cfg.vocab_size, [2 + i for i in range(len(TINY_TEMPERATURES))], seed=5)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    tiny_reference = tokens(engine(model, tensors).generate(tiny, greedy))  # plain decoding, clean model
    return cfg, model, tensors, good, tiny, tiny_reference


@pytest.mark.parametrize(("method", "k"), SPEC)
def test_tiny_temperatures_are_greedy_and_fail_no_one(setup, method, k):
    _, model, tensors, good, tiny, tiny_reference = setup
    eng = engine(model, tensors, method, k)
    reference = tokens(eng.generate(good, good_params()))
    for f in EDGE_FILTERS:
        tiny_params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=t, seed=9, **f)
                       for t in TINY_TEMPERATURES]
        prompts = [p for pair in zip(good, tiny) for p in pair]  # good and tiny rows alternate in every step
        params = [p for pair in zip(good_params(), tiny_params) for p in pair]
        outs = eng.generate(prompts, params)
        assert all(o.finish_reason == "length" for o in outs), f
        assert tokens(outs[0::2]) == reference, f
        assert tokens(outs[1::2]) == tiny_reference, f


# ---------------------------------------------------------------- a model that is NaN after one token id


@pytest.fixture(scope="module")
def poisoned(setup):
    """The target with the embedding row of token X set to NaN, X a token the poison request P emits at output
    index m (first there) and that no good prompt holds or good row emits -> (model, P, X, m, P's greedy ids)."""
    cfg, model, tensors, good, _, _ = setup
    P = mixed_prompts(cfg.vocab_size, [13], seed=7)[0]
    ref_P = engine(model, tensors).generate([P], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
    seen = {t for ids in good for t in ids} | {t for ids in tokens(engine(model, tensors).generate(good, good_params()))
                                               for t in ids} | set(P)
    m = next(m for m in range(2, MAX_TOKENS - 2) if ref_P[m] not in seen | set(ref_P[:m]))
    X = ref_P[m]
    bad = copy.deepcopy(model)
    with torch.no_grad():
        bad.embed.weight[X] = float("nan")
    return bad, P, X, m, ref_P


@pytest.mark.parametrize(("method", "k"), [("none", None), ("dspark", 2), ("dspark", 4), ("mtp", 1), ("mtp", 3),
                                           ("ngram", 3)])
def test_a_nan_request_fails_alone(setup, poisoned, method, k):
    """P fails after emitting X (a prefix of its greedy tokens, the step that meets X not committed); a prompt that
    ends in X fails at its first step with no tokens; every good row gives exactly its tokens without them, in
    the same step and after (on blocks the failed requests held)."""
    _, _, tensors, good, _, _ = setup
    bad, P, X, m, ref_P = poisoned
    eng = engine(bad, tensors, method, k)
    reference = eng.generate(good, good_params())
    assert all(o.finish_reason == "length" for o in reference)  # X never reaches a good row
    ends_in_X = good[2][:5] + [X]
    prompts = good[:2] + [P] + good[2:4] + [ends_in_X] + good[4:]
    params = good_params()[:2] + [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)] + good_params()[2:4] \
        + [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=5)] + good_params()[4:]
    outs = eng.generate(prompts, params)
    failed = [outs.pop(5), outs.pop(2)]
    assert tokens(outs) == tokens(reference) and all(o.error is None for o in outs)
    for o in failed:
        assert o.finished and o.finish_reason == "error" and o.error == NONFINITE_ERROR
        assert o.outputs[0].finish_reason == "error"
    in_P, in_X = failed[1].token_ids, failed[0].token_ids
    assert in_X == []
    assert in_P == ref_P[: len(in_P)] and len(in_P) <= m + 1
    if method == "none":  # X is emitted, then its own row is NaN
        assert in_P == ref_P[: m + 1]
    assert eng.stats.num_failed == 2
    assert tokens(eng.generate(good, good_params())) == tokens(reference)
    assert eng.kv_usage == 0 and not eng.requests


# ---------------------------------------------------------------- through AsyncLLMEngine


async def collect(aeng: AsyncLLMEngine, prompt: list[int], params: SamplingParams):
    """-> the final output, or the exception the stream raised."""
    last = None
    try:
        async for out in aeng.generate(prompt, params):
            last = out
    except RequestFailedError as e:
        return e
    return last


@pytest.mark.parametrize(("method", "k"), [("none", None), ("dspark", 4)])
def test_async_engine_poison_requests_in_a_row_and_alongside_good_ones(setup, poisoned, method, k):
    _, _, tensors, good, tiny, tiny_reference = setup
    bad, P, X, m, ref_P = poisoned
    eng = engine(bad, tensors, method, k)
    reference = tokens(eng.generate(good, good_params()))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    aeng = AsyncLLMEngine(eng)
    aeng.start()

    async def main():
        in_a_row = [await collect(aeng, good[i % len(good)][:4] + [X], greedy) for i in range(16)]
        assert 16 > MAX_CONSECUTIVE_STEP_FAILURES
        tiny_T = [await collect(aeng, tiny[i], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                              temperature=t, seed=i))
                  for i, t in enumerate(TINY_TEMPERATURES)]
        after = await collect(aeng, good[1], good_params()[1])
        jobs = [collect(aeng, p, sp) for p, sp in zip(good, good_params())]
        jobs += [collect(aeng, P, greedy)] + [collect(aeng, tiny[0][:1] + [X], greedy) for _ in range(4)]
        return in_a_row, tiny_T, after, await asyncio.gather(*jobs)

    try:
        in_a_row, tiny_T, after, together = asyncio.run(main())
        assert aeng.is_running and aeng.num_failed_steps == 0 and aeng._failures_in_a_row == 0
    finally:
        aeng.shutdown()
    for e in in_a_row + together[len(good):]:
        assert isinstance(e, RequestFailedError) and str(e) == NONFINITE_ERROR
    assert tokens(tiny_T) == tiny_reference and after.token_ids == reference[1]
    assert tokens(together[: len(good)]) == reference

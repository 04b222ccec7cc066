"""Mixed steps where graphs are captured: one mixed graph where it holds them (tests/test_mixed_graphs.py), else
split (`ModelRunner.split_mixed`): decode / verify rows run as their graph and the joining prompt chunks as a
second part of the same engine step. Requests join a closed loop one
by one (as `bench offline` feeds the engine), so many steps carry a prompt chunk next to decode rows. The split
steps (graphs built but run eagerly on the CPU) must give exactly the tokens of the dynamic, unsplit steps, and
their logprobs up to rounding (a row's logits come from a different batch): greedy, seeded sampling (the drafts'
q go through the shared q buffer, laid out per part), and under a small token budget (chunked prompts next to
verify rows)."""

from __future__ import annotations

import pytest
from spec_helpers import mixed_prompts, one_thread, static_step_engine, tiny_setup  # noqa: F401

from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
LENGTHS = [3, 9, 17, 30, 5, 12, 7, 21]


def make_engine(model, tensors, method: str, static: bool, **kw) -> LLMEngine:
    """Steps in turn (steps launched ahead split the same way: tests/test_async_scheduling.py)."""
    return static_step_engine(model, tensors, method, static, max_num_seqs=4, **kw)


def closed_loop(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], concurrency: int
                ) -> dict[str, tuple]:
    """Keep `concurrency` requests in flight; a new one joins as soon as one finishes -> id -> (tokens, logprobs)."""
    pending = list(zip(prompts, params))[::-1]
    done, inflight, num = {}, 0, 0
    while pending or inflight:
        while pending and inflight < concurrency:
            p, sp = pending.pop()
            eng.add_request(p, sp, request_id=str(num))
            num += 1
            inflight += 1
        for out in eng.step():
            if out.finished:
                inflight -= 1
                done[out.request_id] = (out.token_ids, out.logprobs)
    return done


def count_splits(eng: LLMEngine) -> list[int]:
    """[1] per split step from now on."""
    splits, split = [], eng.runner.execute_split

    def wrapped(*a, **kw):
        splits.append(1)
        return split(*a, **kw)

    eng.runner.execute_split = wrapped
    return splits


def params_for(kind: str) -> list[SamplingParams]:
    n = len(LENGTHS)
    if kind == "greedy":
        return [SamplingParams(max_tokens=6 + 3 * (i % 4), ignore_eos=True) for i in range(n)]
    out = [SamplingParams(max_tokens=6 + 3 * (i % 4), temperature=0.8, seed=40 + i, ignore_eos=True)
           for i in range(n)]
    if kind == "mixed":  # greedy next to sampled, top-k, and logprobs (an eager part)
        out[1] = SamplingParams(max_tokens=9, ignore_eos=True)
        out[2] = SamplingParams(max_tokens=8, temperature=1.0, top_k=5, seed=3, ignore_eos=True)
        out[5] = SamplingParams(max_tokens=7, temperature=0.9, seed=5, logprobs=2, ignore_eos=True)
    return out


@pytest.mark.parametrize("method", ["none", "dspark", "mtp"])
@pytest.mark.parametrize("kind", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("budget", [None, 20])
def test_split_steps_equal_unsplit_steps(method, kind, budget):
    cfg, model, tensors = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, LENGTHS, seed=9)
    params = params_for(kind)
    kw = {} if budget is None else {"max_num_batched_tokens": budget}
    want = closed_loop(make_engine(model, tensors, method, False, **kw), prompts, params, 3)
    eng = make_engine(model, tensors, method, True, **kw)
    splits = count_splits(eng)
    got = closed_loop(eng, prompts, params, 3)
    assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in want.items()}
    for r, (_, lps) in got.items():  # the same tokens and alternatives; values as a different batch rounds them
        ref = want[r][1]
        assert (lps is None) == (ref is None)
        for d, e in zip(lps or [], ref or []):
            assert list(d) == list(e) and list(d.values()) == pytest.approx(list(e.values()), abs=1e-4)
    mixed = eng.runner.num_mixed_steps
    assert len(splits) + mixed >= 3, "requests joining a running batch split their steps or ran as mixed graphs"
    if method != "none":
        assert eng.stats.num_spec_steps > 0


def test_split_mixed_groups():
    from sparkspec.engine.model_runner import ModelRunner
    from sparkspec.engine.scheduler import ScheduledSeq
    from sparkspec.engine.sequence import Sequence

    def item(prompt_len: int, cached: int, n: int) -> ScheduledSeq:
        s = Sequence(0, list(range(2, 2 + prompt_len)), SamplingParams())
        s.num_cached_tokens = cached
        return ScheduledSeq(s, n)

    decode, chunk, last, short = item(5, 4, 1), item(30, 0, 10), item(30, 20, 10), item(8, 0, 8)
    split = ModelRunner.split_mixed
    assert split([decode, chunk, decode, last]) == [[0, 2], [1, 3]]  # no prefill graphs: prompts together
    assert split([decode, chunk, decode, last, short], 16) == [[0, 2], [3], [4], [1]]  # a chunk never samples
    assert split([decode, decode], 16) is None  # all decode rows: one graph step
    assert split([chunk, last]) is None and split([last], 16) is None  # one part
    assert split([short, last], 16) == [[0], [1]]  # prompts that two prefill graphs take: two parts
    assert split([short, last], 16, lambda lengths: [[0, 1]]) is None  # one prefill graph holds both: one step
    assert split([decode, short, chunk, last], 16, lambda lengths: [[1, 0]]) == [[0], [3, 1], [2]]

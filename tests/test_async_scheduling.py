"""Async scheduling (`LLMEngine.step`): the next decode step is launched before the one on the device is read.
The tokens must be those of the engine that steps in turn, whatever finishes a request meanwhile (EOS, length,
an abort), however requests join, and with preemption. On CPU the graph steps run eagerly (`eager=True`), with
the same packing, device-side token hand-over and deferred read as on a GPU."""

from __future__ import annotations

import pytest
from spec_helpers import mixed_prompts, one_thread, tiny_setup  # noqa: F401

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
LENGTHS = [3, 9, 17, 30, 5, 12]


def engine(model, overlap: bool, prefill_graph_tokens: int | None = None, **kw) -> LLMEngine:
    """`prefill_graph_tokens`: the longest prefill graph (default: the token budget; less: longer prompts that
    sample run eagerly)."""
    cfg = EngineConfig(max_num_seqs=8, enforce_eager=True, async_scheduling=overlap, **kw)
    eng = LLMEngine(model, None, cfg)
    eng.runner.use_graphs(cfg.max_num_seqs, eng.max_model_len, 0, eager=True,
                          max_num_batched_tokens=prefill_graph_tokens or cfg.max_num_batched_tokens)
    return eng


def count_launches(eng: LLMEngine) -> list[int]:
    """Appends 1 for every step launched ahead (a `launch` that took the step)."""
    seen, launch = [], eng.runner.launch

    def counted(items):
        out = launch(items)
        if out is not None:
            seen.append(1)
        return out

    eng.runner.launch = counted
    return seen


def params_for(temperature: float) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=temperature, top_k=0 if i % 2 else 20, seed=40 + i,
                           ignore_eos=True)
            for i, n in enumerate((14, 9, 21, 3, 17, 1))]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tokens_equal_the_engine_that_steps_in_turn(temperature):
    cfg, model, _ = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, LENGTHS, seed=3)
    params = params_for(temperature)
    want = [o.token_ids for o in engine(model, False).generate(prompts, params)]
    eng = engine(model, True)
    launched = count_launches(eng)
    got = eng.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert [o.finish_reason for o in got] == ["length"] * len(prompts)
    # every step ran ahead: the prefill, and every decode step while requests end by length one after another (a
    # request whose last token is in flight is left out of the next step instead of ending the overlap)
    assert len(launched) == eng.stats.num_steps >= 20
    assert eng.scheduler.block_manager.usage == 0 and not eng.has_unfinished()
    assert all(s.num_inflight == 0 for s in eng.requests.values())


def test_eos_found_while_the_next_step_runs():
    """EOS ends a request in the step the engine reads while the next one (which holds its row) is on the
    device: that row is computed and dropped; the output stops at EOS as in turn."""
    cfg, model, _ = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, LENGTHS, seed=5)
    free = [SamplingParams(max_tokens=24, ignore_eos=True) for _ in prompts]
    ref = [o.token_ids for o in engine(model, False).generate(prompts, free)]
    eos = ref[2][9]  # a token that request 2 produces mid-way (others may too)
    outs = {}
    for overlap in (False, True):
        eng = engine(model, overlap)
        eng.eos_ids = {eos}
        launched = count_launches(eng)
        got = eng.generate(prompts, [SamplingParams(max_tokens=24) for _ in prompts])
        outs[overlap] = [(o.token_ids, o.finish_reason) for o in got]
        assert eng.scheduler.block_manager.usage == 0
    assert outs[True] == outs[False]
    assert outs[True][2][1] == "stop" and outs[True][2][0][-1] == eos and len(outs[True][2][0]) <= 10
    assert launched


def count_prompt_launches(eng: LLMEngine) -> list[int]:
    """Appends, for every step launched ahead that carries a prompt chunk, the number of its chunks."""
    seen, launch = [], eng.runner.launch

    def counted(items):
        out = launch(items)
        chunks = sum(1 for it in items if it.num_tokens > 1 or not it.seq.output_ids and not it.seq.num_inflight)
        if out is not None and chunks:
            seen.append(chunks)
        return out

    eng.runner.launch = counted
    return seen


def test_requests_joining_and_an_abort():
    """Requests that join while others decode are launched ahead with them (their prompt chunks beside the decode
    rows); an aborted request's row in flight is dropped and nothing leaks. The tokens are unchanged."""
    cfg, model, _ = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, LENGTHS, seed=6)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    want = [o.token_ids for o in engine(model, False).generate(prompts, [params] * len(prompts))]
    eng = engine(model, True)
    launched = count_launches(eng)
    with_prompts = count_prompt_launches(eng)
    ids = [eng.add_request(p, params).request_id for p in prompts[:3]]
    done, step = {}, 0
    while eng.has_unfinished() or len(ids) < len(prompts):
        step += 1
        if step in (4, 7, 9) and len(ids) < len(prompts):
            ids.append(eng.add_request(prompts[len(ids)], params).request_id)
        if step == 6:
            assert eng.abort_request(ids[1])
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    for i, rid in enumerate(ids):
        if i == 1:  # aborted: gone without a final output, or with finish_reason "abort"
            assert rid not in done or done[rid].finish_reason == "abort"
            continue
        assert done[rid].token_ids == want[i], i
    assert len(launched) >= 10
    assert len(with_prompts) >= 3, "the first prefill and the three joining prompts ran ahead"
    assert eng.scheduler.block_manager.usage == 0 and not eng.has_unfinished()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mixed_steps_launched_ahead(temperature):
    """A closed loop (a request joins as one ends) with prompts of every kind: short ones (a prefill graph beside
    the decode graph), several in one step, longer ones (eager: past the longest prefill graph) and long ones cut
    into chunks (the chunks that sample nothing run eagerly). Those steps are launched ahead with the decode rows,
    each part handing its sampled tokens to the next step on the device; the tokens are those of the engine in
    turn, every request's slot and block freed. (The eager static steps keep their outputs from run to run, as
    replayed graphs do: two prompt groups of one shape in one step overwrite the first's before the copy back.)"""
    cfg, model, _ = tiny_setup()
    lengths = [3, 40, 9, 17, 70, 5, 12, 33, 2, 25]
    prompts = mixed_prompts(cfg.vocab_size, lengths, seed=13)
    params = [SamplingParams(max_tokens=4 + (7 * i) % 13, temperature=temperature, seed=80 + i, ignore_eos=True)
              for i in range(len(prompts))]

    def closed_loop(eng: LLMEngine) -> list[list[int]]:
        out, queue, live = {}, list(range(len(prompts))), 0
        while queue or eng.has_unfinished():
            while queue and live < 4:
                i = queue.pop(0)
                eng.add_request(prompts[i], params[i], request_id=str(i))
                live += 1
            for o in eng.step():
                if o.finished:
                    out[int(o.request_id)] = o.token_ids
                    live -= 1
        return [out[i] for i in range(len(prompts))]

    want = closed_loop(engine(model, False, max_num_batched_tokens=32))
    eng = engine(model, True, prefill_graph_tokens=16, max_num_batched_tokens=32)
    with_prompts = count_prompt_launches(eng)
    assert closed_loop(eng) == want
    assert len(with_prompts) >= 8, with_prompts
    assert eng.scheduler.block_manager.usage == 0 and not eng.has_unfinished()
    assert all(s.num_inflight == 0 for s in eng.requests.values())


def test_preemption_while_a_step_is_in_flight():
    """A KV pool too small for every request: the scheduler preempts while a step is in flight; the victim's
    token in flight is still committed and its recompute continues from it. Tokens equal the engine in turn."""
    cfg, model, _ = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, [20, 22, 18, 25], seed=7)
    params = [SamplingParams(max_tokens=40, temperature=0.7, seed=9 + i, ignore_eos=True) for i in range(4)]
    per_block = engine(model, False, max_model_len=96).kv_plan.bytes_per_block
    kw = dict(max_model_len=96, kv_cache_memory=per_block * 12)
    ref_eng = engine(model, False, **kw)
    want = [o.token_ids for o in ref_eng.generate(prompts, params)]
    eng = engine(model, True, **kw)
    launched = count_launches(eng)
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert ref_eng.scheduler.num_preemptions and eng.scheduler.num_preemptions, "the pool forced preemptions"
    assert launched
    assert eng.scheduler.block_manager.usage == 0


def test_off_switch_and_speculation():
    cfg, model, _ = tiny_setup()
    eng = engine(model, False)
    launched = count_launches(eng)
    eng.generate(mixed_prompts(cfg.vocab_size, [5, 7], seed=1), SamplingParams(max_tokens=8, ignore_eos=True))
    assert not launched


@pytest.mark.parametrize("method", ["dspark", "mtp"])
def test_drafting_engine_overlaps_its_plain_stretches(method):
    """A drafting engine's steps that verify and propose nothing (the adaptive budget's plain arm) are launched
    ahead too; the drafter's context is still written on them (inside the step), so the drafts after a plain
    stretch are as good as in turn. Greedy and seeded (Gumbel-max) tokens equal plain decoding whatever the
    budget decides; here a scripted budget switches between stretches of both arms."""
    cfg, model, tensors = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, LENGTHS, seed=11)
    params = [SamplingParams(max_tokens=18, temperature=t, seed=60 + i, ignore_eos=True)
              for i, t in enumerate((0.0, 1.0, 0.0, 0.7, 1.0, 0.0))]
    want = [o.token_ids for o in engine(model, False).generate(prompts, params)]
    ecfg = EngineConfig(max_num_seqs=8, enforce_eager=True, speculative=method, num_spec_tokens=3,
                        spec_budget="fixed")
    eng = LLMEngine(model, None, ecfg, tensors)
    eng.runner.use_graphs(ecfg.max_num_seqs, eng.max_model_len, 3, eager=True,
                          max_num_batched_tokens=ecfg.max_num_batched_tokens)
    decisions = iter([0] * 6 + [3] * 3 + [0] * 5 + [3] * 2 + [0] * 100)
    eng.spec.budget.next_num_drafts = lambda *a, **kw: next(decisions, 0)
    launched = count_launches(eng)
    skipped, skip = [], eng.spec.budget.skip_step  # the launches the budget does not file, by their place in a run
    eng.spec.budget.skip_step = lambda: (skipped.append(eng._launched_in_a_row), skip())[1]
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert len(launched) >= 6 and eng.stats.num_drafted > 0
    assert eng.scheduler.block_manager.usage == 0
    # the first launch of each plain stretch returns at once and the second waits for it: neither is a plain step's
    # wall time, later ones are (more than one stretch ran: the script switches arms)
    assert set(skipped) == {1, 2} and skipped.count(1) >= 2 and len(launched) > len(skipped)
    assert all(a == 1 for a, b in zip(skipped, skipped[1:]) if b == 2)


@pytest.mark.parametrize("method", ["dspark", "mtp"])
def test_cost_table_times_plain_steps_as_they_are_launched(method):
    """Where the engine launches plain steps ahead, the adaptive budget's table times them that way too, per
    request count of its grid (as the engine does at start, before any request), and the engine then decodes as
    one that measured nothing."""
    cfg, model, tensors = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, LENGTHS[:4], seed=5)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    got = {}
    for measure in (False, True):
        ecfg = EngineConfig(max_num_seqs=4, enforce_eager=True, speculative=method, num_spec_tokens=3,
                            spec_budget="fixed")
        eng = LLMEngine(model, None, ecfg, tensors)
        eng.runner.use_graphs(ecfg.max_num_seqs, eng.max_model_len, 3, eager=True,
                              max_num_batched_tokens=ecfg.max_num_batched_tokens)
        if measure:
            table = eng.spec.measure_costs(eng.runner, repeats=1, overlapped=True)
            assert [r for r, _ in table.plain] == sorted(table.target) == [1, 2, 4]
            assert all(s > 0 for _, s in table.plain)
            assert eng.spec.measure_costs(eng.runner, repeats=1).plain == []  # stepping in turn: nothing launched
        got[measure] = [o.token_ids for o in eng.generate(prompts, params)]
    assert got[True] == got[False]

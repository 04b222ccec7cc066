"""Plain steps (decode rows and joining prompts) skip the device drafter's context write while the adaptive
budget's plain arm holds, and drafting waits for `window` steps that write before it starts again
(`VerificationBudget.context_window`).

Why: on the H200 demo pair at c = 1, a DSpark engine held on its plain arm ran at 0.95x the plain engine; the
context write on every plain step (the target's taps, the drafter's KV projection and its scatter) is that arm's one
device cost. The write only matters for the `window` rows that the first drafts after a plain stretch read."""

from __future__ import annotations

import copy

import pytest
import torch
from spec_helpers import mixed_prompts, one_thread, run_recording_drafts, static_step_engine, tiny_setup  # noqa: F401
from test_budget_coast import H200_C1, drive, levels
from test_budget_regime import FakeClock, accepting, flat_table, run_loop

from sparkspec.engine.budget import VerificationBudget
from sparkspec.sampling_params import SamplingParams

K = 4
W = 64  # the demo drafter's window


def c1_loop(budget: VerificationBudget, clock: FakeClock, num_steps: int, spec_tokens=lambda n: 2.76,
            plain_seconds=lambda n: 0.00067) -> tuple[list[int], list[bool]]:
    """c = 1 at the H200 demo pair's costs: a plain step `plain_seconds(step)` (0.67 ms) for 1 token, a drafting
    one 2.15 ms for `spec_tokens(step)` (2.76: fixed k at 0.86x plain decoding) -> (k, writes_context) per
    decision."""
    writes: list[bool] = []

    def seconds(n, verified, proposed):
        writes.append(budget.writes_context)  # (the decision of step n was just made)
        return 0.00215 if verified or proposed else plain_seconds(n)

    ks = run_loop(budget, clock, 1, seconds, num_steps,
                  tokens=lambda n, verified, proposed: spec_tokens(n) if verified or proposed else 1)
    return ks, writes


def assert_warm_before_drafting(ks: list[int], writes: list[bool], window: int) -> None:
    """Every decision that drafts follows `window` decisions that wrote the context (drafting ones write; an engine
    starts with nothing skipped)."""
    for i, k in enumerate(ks):
        if k:
            assert writes[i] and all(writes[max(0, i - window) : i]), (i, writes[max(0, i - window) : i])


@pytest.mark.parametrize("max_age", [2.0, 0.3])
def test_settled_plain_decoding_skips_the_context_and_warms_it_before_each_probe(max_age):
    """Plain decoding wins at c = 1 (drafting at 0.86x): once both arms are measured, most plain steps skip the write;
    each probe of drafting still runs, after `window` steps that write: at its interval (the writes resume ahead
    of it), or once drafting's samples are `max_age` seconds old (0.3 s: ~450 steps; the probe waits for them).
    Without a window, every step writes."""
    runs = {}
    for window in (0, W):
        clock = FakeClock()
        budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock, context_window=window,
                                    max_age=max_age)
        accepting(budget, 2)
        runs[window] = c1_loop(budget, clock, 8000)
    ks, writes = runs[W]
    assert_warm_before_drafting(ks, writes, W)
    assert sum(not w for w in writes[3000:]) / 5000 > 0.8  # the write skipped on most steps
    starts = [i for i in range(3000, 8000) if ks[i] and not ks[i - 1]]
    starts0 = [i for i in range(3000, 8000) if runs[0][0][i] and not runs[0][0][i - 1]]
    assert len(starts) >= 3 and len(starts) >= len(starts0) - 1, (starts, starts0)  # the probes go on
    assert sum(k > 0 for k in ks[3000:]) <= 3 * len(starts) + 3  # probes only
    assert all(runs[0][1])  # no window: every step writes


@pytest.mark.parametrize("change", ["drafting gains", "plain slows"])
def test_a_switch_to_drafting_waits_for_the_context(change):
    """At step 4000 drafting turns from 0.86x to 2x plain decoding: its tokens a step grow (the budget finds out at a
    probe of drafting) or plain steps slow down 2.3x (the plain arm's own samples say so, while its steps skip the
    context). Either way it drafts from then on, every drafting stretch after `window` steps that wrote."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock, context_window=W)
    accepting(budget, 2)
    if change == "drafting gains":
        ks, writes = c1_loop(budget, clock, 9000, spec_tokens=lambda n: 2.76 if n < 4000 else 6.4)
    else:
        ks, writes = c1_loop(budget, clock, 9000, plain_seconds=lambda n: 0.00067 if n < 4000 else 0.00155)
    assert_warm_before_drafting(ks, writes, W)
    assert not all(writes[2000:4000])  # it was cold before the change
    assert sum(k > 0 for k in ks[7000:]) / 2000 > 0.95  # then drafting holds
    assert all(writes[7000:])


def test_prompt_steps_skip_too_and_a_probe_due_by_age_still_starts():
    """`bench offline`'s c = 1 levels (a request of 64 tokens joining every 64 steps; 60 s between levels, so each
    level finds drafting's samples stale, its age limit grown by its backoff included): once plain decoding has
    settled, a prompt's step skips the write as a
    decode step does; the probe due by age warms the window through the prompt steps in its way (they write then)
    and runs in every level."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock, context_window=W)
    accepting(budget, 2)
    steps = levels(12, 256, 60.0, **H200_C1)
    out = drive(budget, clock, steps)
    ks, writes = [k for k, _, _ in out], [w for _, w, _ in out]
    assert_warm_before_drafting(ks, writes, W)
    prompts = [i for i, s in enumerate(steps) if s["prompt"] and i >= 512]
    assert sum(not writes[i] for i in prompts) >= len(prompts) // 3  # settled: prompt steps skip too
    for lv in range(2, 12):
        level = ks[lv * 256 : (lv + 1) * 256]
        start = next(i for i, k in enumerate(level) if k)  # the level's probe of drafting
        assert W < start < 256 - 3 and all(writes[lv * 256 + start - W : lv * 256 + start])
        assert any(steps[lv * 256 + i]["prompt"] for i in range(start - W, start))  # a prompt step warmed it


@pytest.mark.parametrize("free_steps,heavy", [(0, False), (40, False), (0, True)])
def test_requests_joining_on_every_step_still_measure_both_arms_and_skip_the_context(free_steps, heavy):
    """The H200 demo pair at c = 256 with output lengths 32-96: about four requests end, and four join, on every
    step (here one per 64 tokens produced: 4 a plain step, 8-9 a drafting one), after `free_steps` steps that carry
    none (a level's requests start together). A plain step costs 4 ms + 0.3 ms a chunk for 256 tokens, a drafting
    one 12 ms + 1 ms a chunk for 563. Once 16 steps in a row carried chunks, the steps are filed as what they cost
    without them, so both arms are measured, plain decoding holds its place, and its steps skip the drafter's
    context. Before, no step was filed: the cost table (which says draft here) decided every step, and every step
    wrote. `heavy`: the chunks outweigh the decode rows (`has_prompt`), so a probe of drafting starts on a prompt's
    step (before, none did, and drafting was never measured)."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock, context_window=W)
    accepting(budget, 2)
    state = {"produced": 0, "joining": 0}
    writes: list[bool] = []

    def tokens(n, verified, proposed):
        made = 563 if verified else 256
        before = state["produced"]
        state["produced"] += made
        state["joining"] = 0 if n + 1 < free_steps else state["produced"] // 64 - before // 64
        return made

    def seconds(n, verified, proposed):
        writes.append(budget.writes_context)
        chunks = state["joining"]
        return 0.012 + 0.001 * chunks if verified or proposed else 0.004 + 0.0003 * chunks

    ks = run_loop(budget, clock, 256, seconds, 3000, tokens=tokens, chunks=lambda n: state["joining"],
                  has_prompt=lambda n: heavy and state["joining"] > 0)
    assert budget.measured(256)
    assert clock.now - budget.step_times.newest_at(256, "plain") < 0.1  # filed while requests join
    assert budget.measured_theta(256, "plain") == pytest.approx(256 / 0.0052)  # joins included, once
    assert budget.measured_theta(256, "plain") > 1.25 * budget.measured_theta(256, "spec")
    if free_steps:  # plain decoding's cost per chunk is known from the free steps: it is taken off its samples
        assert budget.step_times.seconds(256, "plain") == pytest.approx(0.004)
        # and drafting's, scaled by its step's share without them (`StepLog.chunk_cost`): 12 ms, within the 3 %
        # that this scaling leaves (1 ms a chunk against 0.3 x 12.3 / 4)
        assert budget.step_times.seconds(256, "spec") == pytest.approx(0.012, rel=0.05)
    assert sum(k > 0 for k in ks[1000:]) <= 20  # probes only
    assert sum(not w for w in writes[1000:]) / 2000 > 0.9


def scripted_run(method: str, static: bool, skip: bool, warm: int, overlap: bool = False, cuda: bool = False
                 ) -> tuple[list, dict, dict, dict]:
    """A run of 5 prompts (greedy and sampled with seeds): 2 steps (prompts), 12 plain steps that skip the
    drafter's context (`skip`; else they write it), `warm` plain steps that write it, then drafting with k = 3 ->
    (outputs, {(request, pending position): drafts}, {request: positions of the skipping steps' rows}, {request:
    its context rows by position}). The fifth request joins after 5 steps, its prompt beside the others' decode
    rows in a skipping step. `cuda`: fp32 on the GPU, its steps as captured CUDA graphs (the skipping ones captured
    on first use; the mixed ones, which never are, captured here)."""
    cfg, model, tensors = tiny_setup()
    if cuda:
        from sparkspec.engine.config import EngineConfig
        from sparkspec.engine.llm_engine import LLMEngine

        model = copy.deepcopy(model).to("cuda").keep_fp32()
        eng = LLMEngine(model, None, EngineConfig(max_num_seqs=5, speculative=method, num_spec_tokens=3,
                                                  spec_budget="fixed", async_scheduling=overlap,
                                                  max_num_batched_tokens=128), tensors)
        graphs = eng.runner.graphs
        graphs.capture_all([k._replace(context=False) for k in list(graphs.graphs)
                            if k.num_prompts and not k.draft_cols])
    else:
        eng = static_step_engine(model, tensors, method, static, max_num_seqs=5, async_scheduling=overlap)
    assert eng.spec.proposer.window == cfg.sliding_window
    propose, steps, skipped = eng.spec.num_drafts_to_propose, [], {}

    def num_drafts_to_propose(items, stats=None, num_running=None, **kw):
        propose(items, stats, num_running, **kw)  # (the budget's bookkeeping)
        n = len(steps)
        steps.append(n)
        cold = 2 <= n < 14
        eng.spec.budget.writes_context = not (skip and cold)
        if skip and cold:
            for it in items:  # (a prompt chunk: its rows)
                nc = it.seq.num_cached_tokens
                skipped.setdefault(it.seq.request_id, []).extend(range(nc, nc + it.num_tokens))
        return 3 if n >= 14 + warm else 0

    eng.spec.num_drafts_to_propose = num_drafts_to_propose
    prompts = mixed_prompts(cfg.vocab_size, [7, 19, 33, 12, 21], seed=3)
    params = [SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.8 * (i % 2), seed=40 + i)
              for i in range(len(prompts))]  # greedy and seeded sampled requests
    outputs, made, blocks = run_recording_drafts(eng, prompts, params, late={4: 5})
    bs, pools = eng.runner.cache.block_size, eng.spec.proposer.pools
    rows = {}
    for rid, ids in blocks.items():
        n = len(prompts[int(rid)]) + 40  # positions every run has written by its end
        at = [ids[p // bs] * bs + p % bs for p in range(n)]
        rows[rid] = [pool[at].clone() for pool in pools]
    return outputs, made, skipped, rows


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("static,overlap", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("method", ["dspark", "mtp"])
def test_skipped_rows_are_the_cold_steps_and_warm_up_restores_every_draft(method, static, overlap):
    """Against a run whose every step writes: the same tokens; the context differs exactly at the rows of the steps
    that skipped it (each request's positions there, a joining prompt's included); and after `window` steps that
    write, every draft made is the same, at the same positions (eager steps, the static steps a GPU replays as
    graphs, and those launched ahead by async scheduling)."""
    ref_out, ref_made, _, ref_rows = scripted_run(method, static, skip=False, warm=16, overlap=overlap)
    out, made, skipped, rows = scripted_run(method, static, skip=True, warm=16, overlap=overlap)
    assert out == ref_out
    assert made == ref_made and len(made) >= 20
    assert sorted(skipped) == ["0", "1", "2", "3", "4"] and all(len(skipped[r]) == 12 for r in "0123")
    assert skipped["4"][:21] == list(range(21)) and 21 < len(skipped["4"]) < 21 + 12  # its prompt, then decode rows
    for rid, pos in skipped.items():
        for pools, ref_pools in zip(rows[rid], ref_rows[rid]):
            differs = sorted((pools != ref_pools).any(-1).nonzero().flatten().tolist())
            assert differs == pos, (rid, differs, pos)


@pytest.mark.usefixtures("one_thread")
def test_only_the_adaptive_budget_of_a_device_drafter_may_skip_the_context(tmp_path):
    """The budget's window is the device drafter's (DSpark, MTP: the target's sliding window); a fixed budget, which
    never runs a plain arm, and a host drafter, which keeps no context, have none (every step writes)."""
    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.llm_engine import LLMEngine

    cfg, model, tensors = tiny_setup()
    for method, budget, window in (("dspark", "adaptive", cfg.sliding_window), ("mtp", "adaptive", cfg.sliding_window),
                                   ("dspark", "fixed", 0), ("ngram", "adaptive", 0)):
        eng = LLMEngine(model, None, EngineConfig(max_num_seqs=2, speculative=method, num_spec_tokens=3,
                                                  spec_budget=budget, enforce_eager=True,
                                                  cost_cache_dir=str(tmp_path)), tensors)
        assert eng.spec.budget.context_window == window, (method, budget)
        assert eng.spec.may_skip_context == (window > 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("method", ["dspark", "mtp"])
def test_skipping_graphs_leave_exactly_their_rows(method, overlap):
    """The same on the GPU with captured graphs (fp32), in turn and launched ahead: a skipping step replays the
    plain engine's graph (no taps, no context write), and nothing else changes."""
    ref_out, ref_made, _, ref_rows = scripted_run(method, True, skip=False, warm=16, overlap=overlap, cuda=True)
    out, made, skipped, rows = scripted_run(method, True, skip=True, warm=16, overlap=overlap, cuda=True)
    assert out == ref_out, first_difference(dict(enumerate(out)), dict(enumerate(ref_out)))
    assert made == ref_made and len(made) >= 20, first_difference(made, ref_made)
    for rid, pos in skipped.items():
        for pools, ref_pools in zip(rows[rid], ref_rows[rid]):
            differs = sorted((pools != ref_pools).any(-1).nonzero().flatten().tolist())
            assert differs == pos, (rid, sorted(set(differs) ^ set(pos)))


def first_difference(got: dict, want: dict) -> tuple:
    """(key, got, want) of the first key, in order, whose values differ (a failure's message)."""
    key = next((k for k in sorted(set(got) | set(want)) if got.get(k) != want.get(k)), None)
    return key, got.get(key), want.get(key)

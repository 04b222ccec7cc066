"""The adaptive budget's regime decision (draft or plain) from whole-step wall times: synthetic cost tables and
step-time observations, a fake clock, no engine."""

import pytest

from sparkspec.engine.acceptance import survival
from sparkspec.engine.budget import VerificationBudget
from sparkspec.engine.cost_table import CostTable
from sparkspec.engine.step_log import is_wave
from sparkspec.engine.step_times import GCClock, StepTimes, bucket_of

K = 4


def flat_table(seconds: float = 0.001, draft: float = 0.0001) -> CostTable:
    """A device that costs the same for 1 or 1 + k rows per request: the table alone always says draft."""
    return CostTable({r: [(r, seconds), (r * (1 + K), seconds)] for r in (1, 4, 16, 64, 256)},
                     [(r, draft) for r in (1, 4, 16, 64, 256)])


def accepting(budget: VerificationBudget, num_accepted: int, times: int = 300) -> None:
    for _ in range(times):
        budget.observe(K, num_accepted)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_loop(budget: VerificationBudget, clock: FakeClock, num_reqs: int, seconds, num_steps: int, tokens=None,
             has_prompt=None, chunks=None) -> list[int]:
    """Drive the budget as `SpecPolicy` does: each step opens on the clock, verifies what the previous decision
    proposed, decides k; `seconds(step, verified, proposed)` is the step's wall time (the step index lets a test
    decide which steps carry a prompt), `tokens(step, verified, proposed)` what it produced (told to the budget
    where given), `has_prompt(step)` whether the engine tells it carries a prompt chunk, `chunks(step)` how many
    (the engine tells them beside `num_reqs` decode rows). -> k per step."""
    ks, proposed = [], 0
    for n in range(num_steps):
        budget.step_boundary()
        verified = sum(budget.lengths([proposed] * num_reqs, [None] * num_reqs, num_reqs, num_reqs)) if proposed \
            else 0
        prompt = has_prompt is not None and has_prompt(n)
        num_chunks = chunks(n) if chunks is not None else 0
        k = budget.next_num_drafts(num_reqs, num_reqs, num_reqs, prompt, is_wave(num_chunks, num_reqs))
        budget.note_step(num_reqs, verified, k, prompt, 130 * num_chunks, num_chunks, num_reqs)
        clock.now += seconds(n, verified > 0, k > 0)
        if tokens is not None:
            budget.note_tokens(tokens(n, verified > 0, k > 0))
        ks.append(k)
        proposed = k
    return ks


def run_engine(budget: VerificationBudget, clock: FakeClock, num_reqs: int, step_seconds, num_steps: int
               ) -> list[int]:
    """`run_loop` where every step costs `step_seconds(verified, proposed)`."""
    return run_loop(budget, clock, num_reqs, lambda n, verified, proposed: step_seconds(verified, proposed),
                    num_steps)


def test_bucket_and_median_of_step_times():
    assert [bucket_of(r) for r in (1, 2, 3, 11, 12, 15, 16, 23)] == [0, 1, 2, 3, 4, 4, 4, 5]
    st = StepTimes(window=4)
    for s in (0.002, 0.002, 5.0, 0.003, 0.0, 100.0):  # a compile pause is trimmed; 0 and idle gaps are dropped
        st.observe(16, "plain", s)
    assert st.count(15, "plain") == 4 and st.seconds(16, "plain") == pytest.approx(0.007 / 3)
    assert st.seconds(16, "spec") is None and st.count(64, "plain") == 0


def test_measured_host_time_turns_drafting_off():
    """The table (device only) says drafting pays; the engine's wall time says a drafting step costs 3x a plain
    one while producing ~2.4x the tokens: once both arms are measured the budget decodes plain."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)
    accepting(budget, 2)  # positions 0-1 accepted, 2 rejected: tau ~ 1 + 1 + 1 - a little
    assert budget.plan_num_drafts(16, 16) == K  # the cost table alone
    ks = run_engine(budget, clock, 16, lambda v, p: 0.009 if (v or p) else 0.003, 200)
    assert budget.measured(16)
    theta = budget.modelled_throughput(16)
    assert theta["plain"] > theta["spec"] and budget.plan_num_drafts(16, 16) == 0
    tail = ks[100:]
    assert sum(k > 0 for k in tail) / len(tail) < 0.15, "only probes draft"
    assert 0 < sum(k > 0 for k in tail)  # and the probes do run, keeping the estimate fresh


def test_measured_fixed_host_time_keeps_drafting():
    """Where a step's wall time is mostly fixed host overhead, drafting amortises it: k > 0 is kept."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)
    accepting(budget, 3)
    ks = run_engine(budget, clock, 1, lambda v, p: 0.0016 if (v or p) else 0.0014, 200)
    assert budget.measured(1) and budget.plan_num_drafts(1, 1) == K
    tail = ks[100:]
    assert sum(k == 0 for k in tail) / len(tail) < 0.15


def test_regime_follows_the_better_arm_per_concurrency():
    """One engine sees c = 1, 16, 64, 256 in turn. Synthetic step wall times (host per request + per produced
    token, device flat): at each c the choice after probing is the argmax of the modelled throughput, and that
    argmax is the arm that really is faster here."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)
    accepting(budget, 2)
    tau = 1 + sum(survival(budget.estimator.rates(K)))  # expected tokens per request of a drafting step
    assert tau > 2.5

    def wall(c):
        def seconds(verified, proposed):  # 1 ms fixed; 20 us per request; spec: +300 us per request at c >= 16
            extra = (0.0003 if c >= 16 else 0.00002) * c if (verified or proposed) else 0.0
            return 0.001 + 0.00002 * c + extra
        return seconds

    for c in (1, 16, 64, 256):
        run_engine(budget, clock, c, wall(c), 120)
        theta = budget.modelled_throughput(c)
        choice = "spec" if budget.plan_num_drafts(c, c) else "plain"
        assert choice == max(theta, key=theta.get), (c, theta)
        true_plain, true_spec = c / wall(c)(False, False), c * tau / wall(c)(True, True)
        assert choice == ("spec" if true_spec > true_plain else "plain"), (c, true_spec, true_plain)
    assert budget.plan_num_drafts(1, 1) == K and budget.plan_num_drafts(256, 256) == 0


def test_nothing_measured_falls_back_to_the_cost_table():
    """No wall times yet: the cost table decides, exactly as before the regime model."""
    slow_verify = CostTable({r: [(r, 0.001), (r * (1 + K), 0.02)] for r in (1, 16)}, [(1, 0.0), (16, 0.0)])
    budget = VerificationBudget("adaptive", K, slow_verify, padded=True)
    accepting(budget, 3)
    assert budget.plan_num_drafts(16, 16) == 0 and budget.lengths([K] * 16, [None] * 16, 16, 16) == [0] * 16
    assert budget.modelled_throughput(16)["plain"] > budget.modelled_throughput(16)["spec"]
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True)
    accepting(budget, 3)
    assert budget.plan_num_drafts(16, 16) == K and budget.lengths([K, 2], [None, None], 2, 2) == [K, 2]


def test_probes_measure_the_arm_not_chosen_and_proposed_drafts_are_verified():
    """The table says plain (verify steps are slow); drafting is probed at its interval (not right away: the
    device-only table favours drafting, so a table that says plain is trusted until then), the drafts the probe
    proposes are all verified (padded), and with fast measured spec steps the budget switches to drafting."""
    clock = FakeClock()
    slow_verify = CostTable({r: [(r, 0.001), (r * (1 + K), 0.02)] for r in (1, 4)}, [(1, 0.0), (4, 0.0)])
    budget = VerificationBudget("adaptive", K, slow_verify, padded=True, clock=clock)
    accepting(budget, 3)
    assert budget.plan_num_drafts(4, 4) == 0
    ks = run_engine(budget, clock, 4, lambda v, p: 0.0011 if (v or p) else 0.001, 160)
    first = ks.index(K)
    assert 2 * budget.probe_every <= first <= 2 * budget.probe_every + 1  # the table's margin: every 2 x 32
    assert budget.step_times.count(4, "spec") >= 2 and budget.plan_num_drafts(4, 4) == K
    assert sum(k > 0 for k in ks[first + 30:]) > 0.9 * len(ks[first + 30:])


def test_probes_back_off_while_they_confirm_the_choice():
    """A steady workload where drafting wins by far: each probe of plain decoding confirms the choice, so the
    interval doubles (up to max_backoff), and the share of probe steps falls; when plain decoding becomes faster,
    the next probe finds it and the budget switches."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)
    accepting(budget, 3)
    ks = run_engine(budget, clock, 4, lambda v, p: 0.001 if (v or p) else 0.0009, 3000)
    starts = [i for i in range(len(ks)) if ks[i] == 0 and (i == 0 or ks[i - 1] == K)]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    regular = [g for g in gaps if g > budget.probe_len + 1]  # (the first probes run back to back)
    every = 2 * budget.probe_every  # (x 2: plain decoding is > 25 % behind)
    assert regular[:4] == [every, 2 * every, 4 * every, 8 * every] and regular[-1] == every * budget.max_backoff, gaps
    assert sum(k == 0 for k in ks[1000:]) / 2000 < 0.02  # ~3 of every 512 decisions
    # drafting now loses: the next probe (at most an interval of every x max_backoff away) finds it
    ks = run_engine(budget, clock, 4, lambda v, p: 0.004 if (v or p) else 0.0009, every * budget.max_backoff + 200)
    assert ks[-100:] == [0] * 100


def test_fixed_mode_and_transitions():
    budget = VerificationBudget("fixed", K)
    assert budget.next_num_drafts(16, 16) == K and budget.lengths([K, 1], [None, None], 2, 2) == [K, 1]
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)
    budget.step_boundary()
    budget.note_step(8, 0, K)  # a transition (proposes, verified nothing): not filed
    clock.now += 1.0
    budget.step_boundary()
    budget.note_step(8, K * 8, K)
    clock.now += 0.002
    budget.step_boundary()
    assert budget.step_times.count(8, "spec") == 1 and budget.step_times.count(8, "plain") == 0
    assert budget.step_times.seconds(8, "spec") == pytest.approx(0.002)
    with pytest.raises(ValueError, match="probe_len"):
        VerificationBudget("adaptive", K, flat_table(), probe_len=1)


def test_arms_that_schedule_different_request_counts_compare_produced_tokens():
    """At c = 256 under a token budget, a drafting step reserves 1 + k rows per request and so runs only half of
    the requests, while a plain step runs all of them. The budget buckets both arms by the requests the engine
    runs and compares the tokens each arm produced per second: plain (256 tokens / 7.9 ms) beats drafting
    (128 requests x ~3 tokens / 20 ms), although per scheduled request drafting looks ahead."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)
    accepting(budget, 2)
    running, ks, proposed = 256, [], 0
    for _ in range(200):
        budget.step_boundary()
        scheduled = running // 2 if proposed else running  # the budget's cap on 1 + k rows per request
        k = budget.next_num_drafts(scheduled, scheduled, running)
        budget.note_step(running, scheduled * proposed, k)
        clock.now += 0.020 if proposed else 0.0079
        budget.note_tokens(scheduled * 3 if proposed else scheduled)
        ks.append(k)
        proposed = k
    assert budget.measured(running)
    theta = budget.modelled_throughput(running, running, running)
    assert theta["plain"] == pytest.approx(256 / 0.0079) and theta["spec"] == pytest.approx(128 * 3 / 0.020)
    tail = ks[100:]
    assert sum(k > 0 for k in tail) / len(tail) < 0.15, "plain decoding, only probes draft"


@pytest.mark.parametrize("file_prompt_steps", [False, True])
def test_prefill_burst_does_not_condemn_the_arm_first_probed_there(file_prompt_steps):
    """The H200 demo pair at c = 256: a level opens with a burst of prompt steps (~50 ms each: prefill chunks
    beside the decode rows of the requests already running), the cost table says draft, and the first probe of
    plain decoding lands in the burst. After it, plain decoding runs 256 tokens in 5.9 ms and a drafting step
    ~700 in 25 ms. Steps that carry a prompt chunk are not filed, so plain decoding is judged by its decode steps
    and wins. Filed (the engine telling no prompt, as before), its burst samples stay in its window, the drafting
    arm's roll out of its own, and drafting keeps the level (the engine measured plain at 10.7 k tok/s there)."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)
    accepting(budget, 2)
    R = 256

    def cost(n, verified, proposed):  # -> (seconds, tokens): a burst step, a drafting step, a plain step
        if n < 16:
            return (0.055, 296) if verified else (0.048, 116)
        return (0.025, 700) if verified else (0.0059, R)

    ks = run_loop(budget, clock, R, lambda *a: cost(*a)[0], 120, tokens=lambda *a: cost(*a)[1],
                  has_prompt=lambda n: n < 16 and not file_prompt_steps)
    drafting = sum(k > 0 for k in ks[40:]) / len(ks[40:])
    if file_prompt_steps:
        assert drafting > 0.5  # the defect this guards against, reproduced
    else:
        assert drafting < 0.15, "plain decoding, only probes draft"


def test_a_new_bucket_starts_where_the_one_below_ended():
    """Plain decoding measured ahead at 16 requests: at 64 (not measured yet; the device-only table says draft)
    the budget starts plain and probes drafting only every 4 x probe_every decisions. Where drafting won below,
    the table decides as before."""
    for plain_wins in (True, False):
        clock = FakeClock()
        budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)
        accepting(budget, 2)
        for _ in range(6):
            for arm, seconds, tokens in (("plain", 0.002, 16), ("spec", 0.004, 48 if not plain_wins else 24)):
                budget.step_times.observe(16, arm, seconds, tokens)
        assert budget.measured(16) and not budget.measured(64)
        ks = [budget.next_num_drafts(64, 64) for _ in range(40)]
        if plain_wins:
            assert budget.plain_won_below(64) and ks == [0] * 40
        else:
            assert not budget.plain_won_below(64) and ks[-10:] == [K] * 10  # the table's choice after the probes


# H200, demo pair, bf16 graphs (`bench offline`'s levels, one trace): per c, a plain step's ms and tokens, a drafting
# step's ms and mean produced tokens, and the drafter's share of a drafting step (ms)
H200_STEPS = {1: (1.02, 1, 2.2, 3.1, 0.9), 16: (1.5, 16, 3.3, 44, 1.2), 64: (1.55, 64, 5.8, 198, 1.5),
              256: (4.3, 256, 17.2, 740, 4.0)}


def test_short_levels_at_the_h200_step_costs_stay_within_5_percent_of_the_better_arm():
    """`bench offline`'s four levels in turn (c = 1, 16, 64, 256; an untimed warm-up of 8·c tokens, then max(2c, 4)
    requests x 64 tokens) on one budget, with the step costs traced on the H200 and the steps filed as async
    scheduling files them (the first two plain steps of a stretch are not: `skip_step`); transitions cost a plain
    step plus the drafter, or a drafting step without it. The device-only table says draft at every c. Drafting
    wins at c = 1 and 16, plain decoding at 64 and 256; the levels are ~40-130 steps long, so a budget that probes
    the losing arm too long, or too often, falls below 0.95 (before the probe backoff: 0.938 at c = 64)."""
    clock = FakeClock()
    sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    table = CostTable({r: [(r, 0.0008 + r * 2e-6), (r * 8, 0.0012 + r * 1e-5)] for r in sizes},
                      [(r, 0.0005 + r * 2e-6) for r in sizes])
    budget = VerificationBudget("adaptive", 7, table, padded=True, clock=clock, plain_probe_extra=2)
    for _ in range(300):
        budget.observe(7, 2)

    def level(c: int, num_tokens: int) -> float:
        plain_ms, plain_tok, spec_ms, spec_tok, draft_ms = H200_STEPS[c]
        made, start, proposed, launched = 0.0, clock.now, 0, 0
        while made < num_tokens:
            budget.step_boundary()
            k = budget.next_num_drafts(c, c, c)
            budget.note_step(c, 7 * c if proposed else 0, k)
            launched = launched + 1 if not proposed and not k else 0
            if 1 <= launched <= 2:
                budget.skip_step()
            ms, tok = {(True, True): (spec_ms, spec_tok), (True, False): (spec_ms - draft_ms, spec_tok),
                       (False, True): (plain_ms + draft_ms, plain_tok), (False, False): (plain_ms, plain_tok)}[
                (proposed > 0, k > 0)]
            clock.now += ms / 1e3
            budget.note_tokens(round(tok))
            made, proposed = made + tok, k
        return made / (clock.now - start)

    for c, (plain_ms, plain_tok, spec_ms, spec_tok, _) in H200_STEPS.items():
        level(c, 8 * c)
        better = max(plain_tok / plain_ms, spec_tok / spec_ms) * 1e3
        assert level(c, max(2 * c, 4) * 64) >= 0.95 * better, c


@pytest.mark.parametrize("spec_tokens", [2, 5])
def test_plain_is_probed_early_only_where_drafting_does_not_lead_by_far(spec_tokens):
    """c = 1 (the demo's first command on a CPU): the table says draft. Drafting runs first until it has samples of
    its own; plain decoding is then probed at once only where drafting's measured tokens per second are below twice
    the table's plain decoding (here 1 token / 15 ms): at 5 tokens a 25 ms step, drafting keeps every early step,
    and no step is given to plain decoding before its interval; at 2 tokens, plain decoding is probed at once."""
    clock = FakeClock()
    table = CostTable({1: [(1, 0.015), (1 + K, 0.020)]}, [(1, 0.005)])
    budget = VerificationBudget("adaptive", K, table, padded=True, clock=clock)
    ks = run_loop(budget, clock, 1, lambda n, v, p: 0.025 if (v or p) else 0.015, 30,
                  tokens=lambda n, v, p: spec_tokens if v else 1)
    assert ks[:4] == [K] * 4  # drafting's own samples first (the first step only proposes)
    if spec_tokens == 5:
        assert ks == [K] * 30
    else:
        assert 0 in ks[4:8]


@pytest.mark.parametrize("fixed", [False, True])
def test_plain_probes_measure_the_overlapped_step_not_the_pipeline_fill(fixed):
    """H200 demo pair, c = 64 (one trace): a drafting step 5.4 ms for ~200 tokens (37 k tok/s); plain decoding,
    launched ahead, 1.3 ms for 64 tokens (49 k tok/s) once the overlap runs, but the second launch of a stretch waits
    for the first like a step in turn (2.2 ms) and the first returns at once (0.1 ms). The engine used to skip only
    the first launch, so a 3-decision probe filed the 2.2 ms step (29 k tok/s) and the budget kept drafting: 0.53x
    plain decoding in that run. Now the first two launches are skipped and probes of plain run two decisions longer:
    the budget settles on plain decoding and the level runs within 5 % of it."""
    clock = FakeClock()
    sizes = (1, 4, 16, 64, 256)
    table = CostTable({r: [(r, 0.0008 + r * 2e-6), (r * 8, 0.0012 + r * 1e-5)] for r in sizes},
                      [(r, 0.0005 + r * 2e-6) for r in sizes])  # the device alone: says draft
    budget = VerificationBudget("adaptive", 7, table, padded=True, clock=clock, plain_probe_extra=2 if fixed else 0)
    for _ in range(300):
        budget.observe(7, 2)
    c, made, proposed, launched = 64, 0.0, 0, 0
    while made < 64 * 200:
        budget.step_boundary()
        k = budget.next_num_drafts(c, c, c)
        budget.note_step(c, 7 * c if proposed else 0, k)
        if proposed or k:  # a drafting step, or a transition into or out of drafting: in turn
            launched = 0
            ms, tok = (5.4, 200) if proposed else (1.9, 64)
        else:
            launched += 1
            if launched <= (2 if fixed else 1):
                budget.skip_step()
            ms = (0.1, 2.2)[launched - 1] if launched <= 2 else 1.3
            tok = 0 if launched == 1 else 64  # (the first launch is read by the second)
        clock.now += ms / 1e3
        budget.note_tokens(tok)
        made, proposed = made + tok, k
    speed = made / clock.now
    plain = 64 / 1.3e-3
    assert (speed >= 0.95 * plain) == fixed, (speed, plain)


def test_measured_near_tie_keeps_plain_decoding():
    """Both arms measured, drafting ahead by less than `spec_margin` (H200 demo pair, c = 256: 49.6 k against 48.3 k
    tok/s): plain decoding is kept; ahead by more, drafting is chosen. The cost table alone still decides by any
    lead."""
    for lead, want in ((1.03, 0), (1.08, K)):
        budget = VerificationBudget("adaptive", K, flat_table(), padded=True, spec_margin=1.05)
        for _ in range(6):
            budget.step_times.observe(256, "plain", 0.005, 256)
            budget.step_times.observe(256, "spec", 0.015, round(3 * 256 * lead))
        assert budget.measured(256)
        assert budget.plan_num_drafts(256, 256) == want, lead
    assert VerificationBudget("adaptive", K, flat_table(), padded=True).plan_num_drafts(16, 16) == K


def test_launched_plain_steps_decide_before_anything_is_measured():
    """The H200 demo pair at c = 1: a plain step timed in turn costs 1.26 ms (its packing and copy back included),
    launched ahead 0.66 ms; a drafting step 2.1 ms for ~2.4 tokens at the prior acceptance. Timed in turn the table
    says draft (1.1 k tok/s against 0.8 k) and every level began by drafting; with the launched time it says plain."""
    target = {1: [(1, 0.00126), (1 + K, 0.0019)]}
    in_turn = CostTable(target, [(1, 0.0002)])
    launched = CostTable(target, [(1, 0.0002)], plain=[(1, 0.00066)])
    assert VerificationBudget("adaptive", K, in_turn, padded=True).next_num_drafts(1, 1) == K
    assert VerificationBudget("adaptive", K, launched, padded=True).next_num_drafts(1, 1) == 0
    # a step that carries prompt tokens is never launched ahead: it is priced in turn
    assert launched.plain_seconds(1, 1) == 0.00066 and launched.plain_seconds(1, 5) == in_turn.target_seconds(1, 5)
    assert launched.plain_seconds(4, 4) == pytest.approx(4 * 0.00066)  # past the largest measured: scaled
    assert CostTable.from_json(launched.to_json()).plain == [(1, 0.00066)]
    written_before = {k: v for k, v in in_turn.to_json().items() if k != "plain"}  # a table cached without it
    assert CostTable.from_json(written_before).plain == []


def test_cached_throughput_follows_each_new_sample():
    """`StepTimes.throughput` is kept between samples; a new sample of the arm must replace it."""
    st = StepTimes(window=4)
    for s in (0.002, 0.002, 0.004):
        st.observe(1, "plain", s, 2)
    assert st.throughput(1, "plain") == pytest.approx(4 / 0.004)  # the longest dropped
    st.observe(1, "plain", 0.001, 3)
    assert st.throughput(1, "plain") == pytest.approx(7 / 0.005)
    st.observe(1, "spec", 0.001, None)
    assert st.throughput(1, "spec") is None and st.throughput(1, "plain") == pytest.approx(7 / 0.005)


def test_static_plan_follows_the_acceptance_estimate():
    """`static_plan` is kept until the acceptance estimate moves: after many rejections the table's drafting arm
    must lose what it was worth."""
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True)
    k, tau, _, _ = budget.static_plan(4, 4)
    accepting(budget, 0)
    k2, tau2, _, _ = budget.static_plan(4, 4)
    assert k == k2 == K and tau2 < 0.5 * tau


def test_a_step_is_the_prompts_where_its_chunks_outweigh_its_decode_rows():
    """`SpecPolicy` tells the budget a step is a prompt's (not filed, no probe starts there) only where its prompt
    chunks hold more tokens than it has decode rows: a few short chunks beside many decode rows, as a steady stream
    of requests brings on most steps at high concurrency, are the arm's own cost and are filed."""
    from sparkspec.engine.scheduler import ScheduledSeq
    from sparkspec.engine.sequence import Sequence
    from sparkspec.engine.spec_policy import SpecPolicy
    from sparkspec.sampling_params import SamplingParams

    def decode(i):
        s = Sequence(i, [5, 6, 7], SamplingParams(max_tokens=8))
        s.output_ids, s.num_cached_tokens = [9], 3
        return ScheduledSeq(s, 1)

    def chunk(i, n):
        return ScheduledSeq(Sequence(i, list(range(4, 4 + n)), SamplingParams(max_tokens=8)), n)

    told = []

    class Spy:
        def next_num_drafts(self, num_reqs, num_base_tokens, num_running, has_prompt, wave=False):
            told.append(("decide", has_prompt))
            return 0

        def note_step(self, num_reqs, num_verified, num_proposed, has_prompt, prompt_tokens, num_chunks, num_decode):
            told.append(("file", has_prompt, prompt_tokens, num_chunks, num_decode))

    policy = object.__new__(SpecPolicy)
    policy.budget, policy._num_verified = Spy(), 0
    rows = [decode(i) for i in range(8)]
    for items, heavy, chunks in ((rows, False, []), (rows + [chunk(8, 3), chunk(9, 5)], False, [3, 5]),
                                 (rows + [chunk(8, 9)], True, [9]), ([chunk(8, 2)], True, [2])):
        told.clear()
        policy.num_drafts_to_propose(items)
        num_decode = len(items) - len(chunks)
        assert told == [("decide", heavy), ("file", heavy, sum(chunks), len(chunks), num_decode)]


@pytest.mark.parametrize("leave_out_gc", [True, False])
def test_garbage_collection_is_left_out_of_the_filed_steps(leave_out_gc):
    """A plain step costs 1 ms for 16 tokens, a drafting step 3.6 ms for 48 (plain decoding is 1.2x faster); a 10 ms
    collection strikes every third step, whichever arm runs. Filed with the collections, plain decoding (the arm
    that runs most steps, so most collections) looks 3x slower than it is and the budget drafts; with the time in
    the collector left out (`GCClock`) both arms are filed at what they cost and plain decoding is kept."""
    clock = FakeClock()
    gc_clock = GCClock(clock)
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock,
                                gc_clock=gc_clock if leave_out_gc else None)
    accepting(budget, 2)

    def seconds(n, verified, proposed):
        step = 0.0036 if (verified or proposed) else 0.001
        if n % 3 == 0:  # the collector's clock counts its 10 ms as the step's wall time does
            gc_clock.seconds += 0.010
            step += 0.010
        return step

    ks = run_loop(budget, clock, 16, seconds, 400, tokens=lambda n, v, p: 48 if (v or p) else 16)
    drafting = sum(k > 0 for k in ks[200:]) / 200
    if leave_out_gc:
        assert budget.step_times.seconds(16, "plain") == pytest.approx(0.001)
        assert drafting < 0.15
    else:
        assert drafting > 0.5


def test_the_shared_gc_clock_counts_real_collections():
    import gc

    fake = FakeClock()
    timed = GCClock(fake)
    fake.now = 1.0
    timed._callback("start", {"generation": 0})
    fake.now = 1.25
    timed._callback("stop", {"generation": 0})
    assert timed.seconds == 0.25
    clock = GCClock.shared()
    assert GCClock.shared() is clock and gc.callbacks.count(clock._callback) == 1
    before = clock.seconds
    junk = [[i] for i in range(20000)]
    gc.collect()
    del junk
    assert clock.seconds > before


def test_reads_within_one_step_add_up():
    """Two results read within one step's interval (the step launched before, then one run in turn) are both that
    interval's tokens: the second does not replace the first."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)
    budget.step_boundary()
    budget.note_step(4, 0, 0)
    clock.now += 0.002
    budget.note_tokens(4)
    budget.note_tokens(3)
    budget.step_boundary()
    assert list(budget.step_times.windows[(bucket_of(4), "plain")].tokens) == [7]
    assert budget.step_times.throughput(4, "plain") == pytest.approx(7 / 0.002)


@pytest.mark.parametrize("told_chunks", [True, False])
def test_joining_requests_are_charged_to_the_arm_they_slow(told_chunks):
    """The H200 demo pair at c = 16, output 64, prompts of 130 tokens (more than the step's 16 decode rows): a
    drafting step costs 2.9 ms for 44 tokens, 1.6 ms more where a request joins (its prompt is a second graph, with
    the drafter); a plain one 1.2 ms for 16 tokens, 0.2 ms more. Each request that ends (every 64 tokens) brings the
    next one. Between joins drafting leads (15.2 k against 13.3 k tok/s); all told plain decoding does (64 tokens
    per 5.0 ms against 5.8: 12.8 k against 11.0 k tok/s). Told the chunks, the budget charges each arm its cost per
    joining request (`JoinCosts`) and decodes plainly; not told (steps with prompts not filed, as before), it
    drafts."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)
    accepting(budget, 2)
    state = {"produced": 0, "joining": 0}

    def tokens(n, verified, proposed):
        made = 44 if verified else 16
        before = state["produced"]
        state["produced"] += made
        state["joining"] = state["produced"] // 64 - before // 64  # requests that ended: their next ones join
        return made

    def seconds(n, verified, proposed):
        joins = state["joining"]
        return (0.0029 + 0.0016 * (joins > 0)) if (verified or proposed) else (0.0012 + 0.0002 * (joins > 0))

    ks = run_loop(budget, clock, 16, seconds, 800, tokens=tokens, has_prompt=lambda n: state["joining"] > 0,
                  chunks=(lambda n: state["joining"]) if told_chunks else None)
    drafting = sum(k > 0 for k in ks[400:]) / 400
    if told_chunks:
        assert budget.join_costs.chunks_per_token() == pytest.approx(1 / 64, rel=0.05)
        assert budget.join_costs.per_chunk(16, "spec") == pytest.approx(0.0016, rel=0.1)
        assert budget.join_costs.per_chunk(16, "plain") == pytest.approx(0.0002, rel=0.1)
        theta = budget.modelled_throughput(16)
        assert theta["plain"] > theta["spec"]
        assert drafting < 0.15
    else:
        assert drafting > 0.5


def test_an_arm_not_seen_joining_is_charged_the_other_arms_cost_per_chunk_scaled():
    """Plain steps cost 1 ms for 16 tokens and 1.5 ms where a request joins; drafting steps 3 ms for 48 tokens and
    were never seen with a request joining. Drafting is charged plain decoding's 0.5 ms per chunk times 3 (its
    step's seconds over plain's: a prompt runs as a part of the arm's step), spread over the tokens as the chunks
    came (one per 64 tokens here); a wave (more chunks than a quarter of the decode rows) is not a join."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock, min_samples=1)

    def step(verified, proposed, seconds, tokens, chunks=0):
        budget.step_boundary()
        budget.note_step(16, verified, proposed, chunks > 4, 20 * chunks, chunks, 16)
        clock.now += seconds
        budget.note_tokens(tokens)

    for _ in range(8):
        step(0, 0, 0.001, 16)
    step(0, 0, 0.0015, 16, chunks=1)
    step(0, 0, 0.001, 16)
    step(0, 0, 0.009, 16, chunks=12)  # a wave: not a join
    for _ in range(3):
        step(0, K, 0.003, 16)  # the first is a transition
        step(16 * K, K, 0.003, 48)
    budget.step_boundary()
    assert budget.join_costs.per_chunk(16, "plain") == pytest.approx(0.0005)
    assert budget.join_costs.per_chunk(16, "spec") is None
    tokens = 11 * 16 + 3 * 16 + 3 * 48
    rho = budget.join_costs.chunks_per_token()
    assert rho == pytest.approx(13 / tokens)  # every chunk counts towards the rate, the wave's too
    spec_seconds = budget.step_times.seconds(16, "spec")
    assert spec_seconds == pytest.approx(0.003)
    assert budget.measured_theta(16, "spec") == pytest.approx(1 / (0.003 / 48 + 0.0015 * rho))
    assert budget.measured_theta(16, "plain") == pytest.approx(1 / (0.001 / 16 + 0.0005 * rho))


def test_a_run_of_steps_with_joining_requests_ends_at_idle_and_needs_decode_rows():
    """Steps with chunks are filed as steps without them only within a run of 16 or more (`StepLog.joins_every_step`)
    and beside decode rows: a prompt-only step is a request's prefill, not a join beside a running batch; and the
    engine going idle ends the run (the next burst's first steps carry its prompts)."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)

    def step(reqs, chunks, decode, seconds=0.002):
        budget.step_boundary()
        budget.note_step(reqs, 0, 0, False, 10 * chunks, chunks, decode)
        clock.now += seconds
        budget.note_tokens(decode + chunks)

    def joining_run():
        for _ in range(20):
            step(64, 1, 63)
        assert budget.log.joins_every_step

    joining_run()
    step(1, 1, 0, 0.01)  # a prompt alone
    step(2, 1, 1)
    budget.step_boundary()
    assert budget.step_times.count(64, "plain") == 20 - 16  # the steps after the first 16
    assert budget.step_times.count(1, "plain") == 0 and budget.step_times.count(2, "plain") == 1
    joining_run()
    budget.idle()
    clock.now += 1.0
    step(2, 1, 1)  # one request running, one joining: the first step of a new run
    budget.step_boundary()
    assert not budget.log.joins_every_step and budget.step_times.count(2, "plain") == 1


@pytest.mark.parametrize("told_idle", [True, False])
def test_the_wait_for_work_is_no_steps_time(told_idle):
    """Levels of steps at one request (plain: 1 ms for one token; drafting: 4 ms for two) end, and the engine
    waits 2 s for the next request each time (below `StepTimes.max_seconds`, so only `idle` keeps it out). Told
    that the engine went idle, the budget files no step longer than the steps run, and plain decoding at one
    request at what it runs; not told, the wait lands on the last step before it."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)
    budget.trace = []
    accepting(budget, 2)
    for _level in range(4):
        run_loop(budget, clock, 1, lambda n, verified, proposed: 0.004 if verified or proposed else 0.001, 30,
                 tokens=lambda n, verified, proposed: 2 if verified or proposed else 1)
        if told_idle:
            budget.idle()
        clock.now += 2.0
    filed = [e["ms"] for e in budget.trace if e.get("filed") or e.get("joined")]
    if told_idle:
        assert max(filed) == pytest.approx(4.0)
        assert budget.step_times.throughput(1, "plain") == pytest.approx(1000.0)
    else:
        assert max(filed) > 2000


def test_samples_taken_beside_the_other_arm_are_timed_at_the_hosts_speed_now():
    """A probe of drafting (40 tokens in 2 ms) pairs its samples with plain decoding's throughput of the steps just
    before (16 k tokens per second); the host then runs twice as slow, and only plain decoding is sampled (8 k):
    drafting's samples count as taking 4 ms now. Samples taken with no recent sample of the other arm are left as
    measured, and so is an arm whose samples were taken beside a reference that has not moved."""
    st = StepTimes()
    for _ in range(20):
        st.observe(16, "plain", 0.001, 16)
    for _ in range(4):
        st.observe(16, "spec", 0.002, 40)
    assert st.corrected_throughput(16, "spec") == pytest.approx(20000)  # the host has not moved yet
    for _ in range(64):
        st.observe(16, "plain", 0.002, 16)
    assert st.throughput(16, "plain") == pytest.approx(8000) == st.corrected_throughput(16, "plain")
    assert st.throughput(16, "spec") == pytest.approx(20000)
    assert st.corrected_throughput(16, "spec") == pytest.approx(10000)
    for _ in range(3):  # a new probe at the host's speed now: its samples' reference is plain decoding now
        st.observe(16, "spec", 0.004, 40)
    assert st.corrected_throughput(16, "spec") == pytest.approx(10000)
    alone = StepTimes()  # drafting sampled long before plain decoding's samples: its own last ones, as measured
    t = 0.0
    for arm, n, sec, start in (("plain", 4, 0.001, 0.0), ("spec", 40, 0.002, 0.0), ("plain", 64, 0.004, 10.0)):
        t = max(t, start)
        for _ in range(n):
            t += sec
            alone.observe(16, arm, sec, 16, at=t)
    assert list(alone.windows[(bucket_of(16), "spec")].refs).count(None) == 40 - 16
    assert alone.corrected_throughput(16, "spec", now=t) == pytest.approx(16 / 0.002)


def test_an_arm_is_timed_by_its_young_samples():
    """Each arm's step seconds come from its samples of the last `young` seconds, or its last `ref_len` where fewer
    are that young; its tokens per step from its window. So an arm that runs again is timed by its new stretch,
    not by the older one still in its window, and an arm only probed by its last probes."""
    st = StepTimes()
    for i in range(64):  # a stretch on a slow host
        st.observe(16, "plain", 0.002, 16, at=i * 0.002)
    for i in range(16):
        st.observe(16, "spec", 0.004, 40, at=1.0 + i * 0.004)
    for i in range(2):  # a probe on a fast host, paired with drafting's 4 ms then and now: as measured
        st.observe(16, "plain", 0.001, 16, at=2.0 + i * 0.001)
    recent = (2 * 0.001 + 6 * 0.002 - 0.002) / 7  # too few young samples: the last 8, the longest left out
    assert st.corrected_throughput(16, "plain", now=2.01) == pytest.approx(16 / recent)
    now = (6 * 0.002 + 2 * 0.001) / 8  # drafting's samples, paired with plain's 2 ms steps, at plain's mean now
    assert st.corrected_throughput(16, "spec", now=2.01) == pytest.approx(40 / (0.004 * now / 0.002))
    for i in range(20):  # plain decoding runs again: its 20 young samples, not the 44 of the slow stretch
        st.observe(16, "plain", 0.001, 16, at=3.0 + i * 0.001)
    assert st.corrected_throughput(16, "plain", now=3.02) == pytest.approx(16 / 0.001)
    assert st.corrected_throughput(16, "plain") == pytest.approx(  # no clock: every sample counts
        16 / ((42 * 0.002 + 22 * 0.001 - 0.002) / 63))


@pytest.mark.parametrize("young", [0.5, float("inf")])
def test_a_probe_on_a_faster_host_is_not_drowned_by_the_stretch_before(young):
    """c = 1 on the H200 demo pair, where a plain step is bound by the host and a drafting one (2.5 tokens) by the
    device. Plain decoding leads and runs (0.8 ms a step against drafting's 2.45 ms); the host slows (plain 1.2 ms)
    and plain decoding runs on; then the host runs faster than ever (plain 0.67 ms, drafting 2.15 ms: plain leads
    by 1.28x). Drafting's probe samples, paired with plain steps of 1.2 ms, now count at 1.37 ms (the drift
    correction moves them with the host, which a device-bound step does not follow), and the budget drafts.
    Plain decoding's probes then take 0.67 ms: timed by its young samples (0.5 s) it is chosen again within a few
    probes (300 steps); timed by its window (the probes' samples against up to 62 of the slow stretch) it stays
    behind for good."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock, max_age=float("inf"))
    budget.step_times.young = young
    accepting(budget, 2)

    def seconds(n, verified, proposed):
        if verified or proposed:
            return 0.00215 if n >= 1500 else 0.00245
        return 0.00067 if n >= 1500 else 0.0012 if n >= 300 else 0.0008

    ks = run_loop(budget, clock, 1, seconds, 2600, tokens=lambda n, v, p: 2 + n % 2 if (v or p) else 1)
    assert sum(k > 0 for k in ks[:1500]) <= 40  # plain decoding runs: probes only
    late = sum(k > 0 for k in ks[1800:])
    if young < 1:
        assert late <= 20, late  # probes only
    else:
        assert late > 700, late


@pytest.mark.parametrize("correct", [True, False])
def test_a_slower_host_does_not_make_the_older_arm_look_faster(correct, monkeypatch):
    """Plain decoding (16 tokens per ms) beats drafting (48 tokens per 3.6 ms) by 1.2x at any host speed. After
    400 steps the host runs twice as slow. Plain decoding's samples follow at once; drafting's stay from the fast
    host until its next probe. Corrected for the drift, the budget keeps plain decoding; not corrected, drafting
    looks 1.7x faster and the budget drafts until its own slow samples outnumber the fast ones."""
    if not correct:
        monkeypatch.setattr(StepTimes, "corrected_throughput", lambda self, n, arm, now=None: self.throughput(n, arm))
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)
    accepting(budget, 2)

    def seconds(n, verified, proposed):
        return (0.0036 if verified or proposed else 0.001) * (2 if n >= 400 else 1)

    ks = run_loop(budget, clock, 16, seconds, 800, tokens=lambda n, v, p: 48 if (v or p) else 16)
    slow = sum(k > 0 for k in ks[400:])
    if correct:
        assert slow <= 2 * budget.probe_len  # probes only
    else:
        assert slow > 4 * budget.probe_len


def test_drafting_acceptance_noise_does_not_move_the_plain_arm():
    """c = 1 on the H200 demo pair: a plain step takes 0.66 ms for one token, a drafting step 1.85 ms for 1 to 8
    tokens. Here drafting is lucky for its first 80 steps (8 tokens a step: 4.3 k tokens/s), then not (1.5 tokens a
    step: 810 tokens/s, plain decoding's 1,515 are 1.9x that). Plain decoding's first samples are paired with the
    lucky steps; the drift correction reads the steps' seconds, which did not move, not their tokens, which did.
    Paired with drafting's tokens per second instead, plain decoding was read at ~300 tokens/s from then on and the
    budget drafted on every step (on the H200, plain at 195-574 tokens/s, drafting on 95 % of the steps)."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)
    accepting(budget, 2)
    ks = run_loop(budget, clock, 1, lambda n, verified, proposed: 0.00185 if verified or proposed else 0.00066, 600,
                  tokens=lambda n, verified, proposed: (8 if n < 80 else 1 + n % 2) if verified or proposed else 1)
    assert sum(k > 0 for k in ks[200:]) / 400 < 0.05  # (drafting's window holds lucky steps until ~140)


@pytest.mark.parametrize("max_age", [0.1, None])
def test_an_arm_whose_samples_are_old_is_probed_again(max_age):
    """Plain steps of 10 ms for 256 tokens, drafting ones of 30 ms for 500 (a level at c = 256 on the H200):
    drafting loses, each probe confirms it, and its interval grows to 32 x 16 x 2 decisions (~10 s of steps).
    The age after which drafting's samples are stale grows by the same factor (`_age_limit`): with `max_age`
    0.1 s, drafting is probed again once its samples are 3.2 s old (~320 decisions), not every 0.1 s; without,
    only at its interval."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock,
                                max_age=max_age if max_age is not None else float("inf"))
    accepting(budget, 2)
    ks = run_loop(budget, clock, 256, lambda n, verified, proposed: 0.030 if verified or proposed else 0.010, 6000,
                  tokens=lambda n, verified, proposed: 500 if verified or proposed else 256)
    starts = [i for i in range(3000, 6000) if ks[i] and not ks[i - 1]]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert sum(k > 0 for k in ks[3000:]) <= 3 * (len(starts) + 1)  # probes only
    if max_age is not None:
        assert len(starts) >= 8 and all(300 <= g < 320 + 2 * budget.probe_every for g in gaps), gaps
    else:
        assert len(starts) <= 3 and min(gaps) >= 32 * budget.max_backoff * 2


@pytest.mark.parametrize("refresh", [1, 8])
@pytest.mark.parametrize("lead", [0.95, 1.1])
def test_rates_kept_for_a_few_decisions_choose_as_computed_ones(refresh, lead):
    """c = 16 with noisy steps (±4 % seconds, 36-52 drafting tokens a step): drafting 5 % behind plain decoding,
    or 10 % ahead. With the measured rates computed on every decision (`refresh` 1) or kept for 8, the budget
    settles on the better arm (probes aside) and switches only for its probes."""
    import random

    rng = random.Random(0)
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock, refresh=refresh)
    accepting(budget, 2)
    n = 3000
    noise = [rng.uniform(0.96, 1.04) for _ in range(n)]
    drafted = [rng.randint(36, 52) for _ in range(n)]
    ks = run_loop(budget, clock, 16, lambda i, v, p: (0.0032 if v or p else 0.0012) * noise[i], n,
                  tokens=lambda i, v, p: round(drafted[i] * lead / 1.03) if v or p else 16)
    share = sum(k > 0 for k in ks[500:]) / (n - 500)
    switches = sum((a > 0) != (b > 0) for a, b in zip(ks, ks[1:]))
    assert share > 0.97 if lead > 1 else share < 0.02, share
    assert switches <= 32, switches  # the probes' ins and outs


@pytest.mark.parametrize("steady", [True, False])
def test_near_ties_do_not_switch_on_noise(steady):
    """c = 16 with noisy steps (±4 % seconds, 36-52 drafting tokens a step) where drafting leads by ~7 %: just past
    the 5 % margin (`spec_margin`), so one computation of the rates says drafting and the next may not. With the
    switch margin (the arm not running must beat the margin by 3 % more, and the running one keeps its place
    until it falls 3 % under it) and a change confirmed by the next computation, the budget settles on drafting in
    every seed and switches only for its probes. Without either (`steady` False), some seed switches 30+ times and
    some drafts on under 90 % of its steps (on the H200 demo pair at c = 16: 13 switches in one level on leads of
    1.02-1.08x, each with its transition steps)."""
    import random

    kw = {} if steady else {"confirm": False, "switch_margin": 1.0}
    shares, switches = [], []
    for seed in range(3):
        rng = random.Random(seed)
        clock = FakeClock()
        budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock, **kw)
        accepting(budget, 2)
        n = 3000
        noise = [rng.uniform(0.96, 1.04) for _ in range(n)]
        drafted = [rng.randint(36, 52) for _ in range(n)]
        ks = run_loop(budget, clock, 16, lambda i, v, p, noise=noise: (0.0032 if v or p else 0.0012) * noise[i], n,
                      tokens=lambda i, v, p, drafted=drafted: round(drafted[i] * 1.07 / 1.03) if v or p else 16)
        shares.append(sum(k > 0 for k in ks[500:]) / (n - 500))
        switches.append(sum((a > 0) != (b > 0) for a, b in zip(ks, ks[1:])))
    if steady:
        assert min(shares) > 0.97 and max(switches) <= 24, (shares, switches)  # the probes' ins and outs
    else:
        assert min(shares) < 0.9 and max(switches) > 30, (shares, switches)


def test_a_drafting_probe_stops_at_a_wave_of_prompts():
    """c = 256, one output length: plain decoding runs in lockstep waves (two prompt steps, then 64 decode steps),
    and drafting loses by 4x. A probe of drafting that reaches a wave's prompt steps stops there (those steps are
    not filed, and drafting them costs the most: on the H200 demo pair, 28-36 ms a step against 4-20); the next
    runs on decode steps, so drafting's samples stay fresh."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock, max_age=0.3)
    accepting(budget, 2)
    wave = 66
    prompt = lambda n: n % wave < 2  # noqa: E731
    ks = run_loop(budget, clock, 256, lambda n, v, p: (0.017 if v or p else 0.004) * (4 if prompt(n) else 1),
                  wave * 60, tokens=lambda n, v, p: 256 * 2 if v or p else 256, has_prompt=prompt,
                  chunks=lambda n: 128 if prompt(n) else 0)
    on_prompts = [n for n, k in enumerate(ks) if k and prompt(n) and n >= wave]  # (the first: the cost table's)
    assert budget.measured(256) and not on_prompts, on_prompts
    drafting = [n for n, k in enumerate(ks) if k]
    assert len(drafting) >= 10  # the probes go on (due by age every ~0.3 s: ~15 of them here)
    assert budget.step_times.count(256, "spec") >= 8


@pytest.mark.parametrize("told", [True, False])
def test_a_drafting_probe_waits_while_the_batch_would_end_in_it(told):
    """c = 256, one output length: every wave's requests end together after 64 decode steps. Told how soon they end
    (`ends_soon`), the budget starts no probe of drafting within `probe_len x (k + 1)` tokens of a wave's end: a
    probe there proposes drafts no request reads and files nothing (on the H200 demo pair drafting was never
    measured at c = 256, and the cost table kept deciding). Not told, some probes start there."""
    clock = FakeClock()  # (stale after 0.01 s times the interval's factor: a probe in most waves)
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock, max_age=0.01)
    accepting(budget, 2)
    wave, at = 66, [0]
    reach = budget.probe_len * (K + 1)

    def prompt(n):
        at[0] = n
        return n % wave < 2

    if told:
        budget.ends_soon = lambda within: wave - at[0] % wave <= within
    ks = run_loop(budget, clock, 256, lambda n, v, p: (0.017 if v or p else 0.004) * (4 if prompt(n) else 1),
                  wave * 60, tokens=lambda n, v, p: 256 * 2 if v or p else 256, has_prompt=prompt,
                  chunks=lambda n: 128 if prompt(n) else 0)
    starts = [n % wave for n in range(wave, len(ks)) if ks[n] and not ks[n - 1]]
    late = [i for i in starts if wave - i <= reach]
    assert len(starts) >= 8, starts
    if told:
        assert not late, late
        assert budget.measured(256) and budget.step_times.count(256, "spec") >= 8
    else:
        assert late, starts

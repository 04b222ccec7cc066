"""The adaptive budget's step times count costs that recur on a fraction of the steps, so the regime follows
real throughput; fake clock, no engine. (The engine no longer files steps that carry a prompt chunk, which cost
both arms alike since the split: `test_budget_regime.py`; a recurring cost of one arm, here put on every few
steps, must still count.)"""

import pytest
from test_budget_regime import FakeClock, K, accepting, flat_table, run_loop

from sparkspec.engine.acceptance import survival
from sparkspec.engine.budget import VerificationBudget
from sparkspec.engine.step_times import StepTimes


def test_step_times_mean_counts_recurring_costs_and_trims_one_pause():
    st = StepTimes(window=10)
    for i in range(10):  # every 5th step carries a prompt: 20x the others
        st.observe(16, "spec", 0.040 if i % 5 == 4 else 0.002)
    assert st.seconds(16, "spec") == pytest.approx((8 * 0.002 + 0.040) / 9)  # one slow sample trimmed, not both
    st.observe(1, "plain", 0.001)
    st.observe(1, "plain", 0.003)
    assert st.seconds(1, "plain") == pytest.approx(0.002)  # few samples: the plain mean
    for _ in range(9):
        st.observe(4, "plain", 0.001)
    st.observe(4, "plain", 3.0)  # one JIT compile
    assert st.seconds(4, "plain") == pytest.approx(0.001)


@pytest.mark.parametrize("join_every", [3, 4, 5])
def test_recurring_slow_spec_steps_turn_drafting_off(join_every):
    """The H200 demo at c = 16 before the split: graph steps of both arms cost about the same, so the median says
    drafting wins ~2.9x; but every few steps a request joins and that step costs ~15x more while drafting (eager
    target + drafter) and ~2.5x more plain (eager target). Real throughput says plain; so must the budget."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)
    accepting(budget, 2)
    tau = 1 + sum(survival(budget.estimator.rates(K)))

    def seconds(n, verified, proposed):
        spec = verified or proposed
        if n % join_every == 0:
            return 0.045 if spec else 0.006
        return 0.003 if spec else 0.0025

    R = 16
    spec_mean = ((join_every - 1) * 0.003 + 0.045) / join_every
    plain_mean = ((join_every - 1) * 0.0025 + 0.006) / join_every
    assert R * tau / spec_mean < R / plain_mean  # the truth: plain decoding is faster
    assert R * tau / 0.003 > R / 0.0025  # what the medians said
    ks = run_loop(budget, clock, R, seconds, 400)
    assert budget.plan_num_drafts(R, R) == 0
    tail = ks[200:]
    # only probes draft: 3 decisions every 32 x backoff, and a few more where a probe happened to miss the join steps
    # and won (a median-based choice drafted on every step)
    assert sum(k > 0 for k in tail) / len(tail) < 0.2, "only probes draft"


def test_recurring_costs_shared_by_both_arms_keep_drafting():
    """After the split a joining prompt costs both arms about the same: drafting still wins and is kept."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock)
    accepting(budget, 2)

    def seconds(n, verified, proposed):
        base = 0.003 if (verified or proposed) else 0.0025
        return base + (0.001 if n % 5 == 0 else 0.0)  # a one-request prefill graph next to the decode graph

    ks = run_loop(budget, clock, 16, seconds, 400)
    assert budget.plan_num_drafts(16, 16) == K
    tail = ks[200:]
    assert sum(k == 0 for k in tail) / len(tail) < 0.15

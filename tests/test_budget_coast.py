"""A settled arm's decisions are made again without the model (`VerificationBudget._coast`) until one could differ:
the decisions, the context writes and the probes must be exactly those of a budget that decides every step in full,
whatever the workload does, and a settled stretch must coast on most of its steps."""

from __future__ import annotations

import random

import pytest
from test_budget_regime import FakeClock, accepting, flat_table

from sparkspec.engine.budget import VerificationBudget
from sparkspec.engine.cost_table import CostTable

K = 4


def drive(budget: VerificationBudget, clock: FakeClock, steps: list[dict]) -> list[tuple]:
    """Run `steps` as `SpecPolicy` does (each: `reqs`, and optional `prompt`, `gap` seconds of idle before it,
    `plain_s`, `spec_s`, `spec_tokens`) -> per decision (k, writes_context, the window's warm count)."""
    out, proposed = [], 0
    for s in steps:
        if s.get("gap"):
            budget.idle()
            clock.now += s["gap"]
            proposed = 0
        budget.step_boundary()
        r = s["reqs"]
        verified = sum(budget.lengths([proposed] * r, [None] * r, r, r)) if proposed else 0
        prompt = s.get("prompt", False)
        k = budget.next_num_drafts(r, r, r, prompt)
        budget.note_step(r, verified, k, prompt, 130 if prompt else 0, int(prompt), r)
        drafting = verified > 0 or k > 0
        clock.now += s["spec_s"] if drafting else s["plain_s"]
        budget.note_tokens(s["spec_tokens"] if drafting else r)
        if verified:
            budget.observe(verified, min(verified, 2))
        out.append((k, budget.writes_context, budget._warm))
        proposed = k
    return out


def count_full(budget: VerificationBudget) -> list[int]:
    """[decisions made in full from now on] (each reads the model: `_model`)."""
    calls, model = [0], budget._model

    def counted(*a, **kw):
        calls[0] += 1
        return model(*a, **kw)

    budget._model = counted
    return calls


def levels(num: int, per: int, gap: float, **step) -> list[dict]:
    """`bench offline`'s c = 1 levels: `per` steps each, `gap` seconds apart, a request of 64 tokens joining every
    64 steps (its prompt's step)."""
    return [dict(step, gap=gap if i == 0 and lv else 0.0, prompt=i % 64 == 0) for lv in range(num) for i in range(per)]


H200_C1 = {"reqs": 1, "plain_s": 0.00066, "spec_s": 0.00215, "spec_tokens": 2.76}


def scenarios():
    rng = random.Random(7)
    yield "c1 levels", levels(12, 256, 3.0, **H200_C1), {}
    yield "c1 age 0.3", [dict(H200_C1) for _ in range(6000)], {"max_age": 0.3}
    yield "drafting gains", [dict(H200_C1, spec_tokens=2.76 if i < 3000 else 6.4) for i in range(7000)], {}
    yield "plain slows", [dict(H200_C1, plain_s=0.00066 if i < 3000 else 0.00155) for i in range(7000)], {}
    noisy = []
    for _ in range(4000):
        f = rng.uniform(0.96, 1.04)
        noisy.append({"reqs": 16, "plain_s": 0.0012 * f, "spec_s": 0.0032 * f,
                      "spec_tokens": round(rng.randint(36, 52) * 1.07 / 1.03)})
    yield "near tie c16", noisy, {}
    wide = [{"reqs": 16, "plain_s": 0.0012, "spec_s": 0.0022, "spec_tokens": 60} for _ in range(3000)]
    yield "drafting leads", wide, {}
    moving = []
    for i in range(5000):
        r = rng.choice((12, 13, 14, 16, 19, 20))
        moving.append({"reqs": r, "plain_s": 0.0001 * r, "spec_s": 0.00028 * r, "spec_tokens": 2.5 * r,
                       "prompt": rng.random() < 0.05, "gap": 2.5 if i % 700 == 699 else 0.0})
    yield "moving batch", moving, {}
    # requests join on most steps (each a prompt's: 130 tokens beside 64 decode rows), in runs that pass
    # `StepLog.every_step_after` and runs that do not
    joining = [{"reqs": 64, "plain_s": 0.0016, "spec_s": 0.0045, "spec_tokens": 150, "prompt": rng.random() < 0.93}
               for _ in range(5000)]
    yield "joins on most steps", joining, {}


def table_not_padded() -> CostTable:
    target = {r: [(r * (1 + e), 1e-4 * r * (1 + 0.2 * e)) for e in range(K + 1)] for r in (1, 2, 4, 8, 16, 32)}
    return CostTable(target, [(1, 5e-5), (32, 5e-4)])


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("window", [0, 64])
def test_coasting_decides_as_the_full_rule(padded, window):
    for name, steps, kw in scenarios():
        runs, full = {}, {}
        for coast in (False, True):
            clock = FakeClock()
            budget = VerificationBudget("adaptive", K, flat_table() if padded else table_not_padded(), padded=padded,
                                        clock=clock, context_window=window, coast=coast, **kw)
            accepting(budget, 2)
            calls = count_full(budget)
            runs[coast] = drive(budget, clock, steps)
            full[coast] = calls[0]
        first = next((i for i, (a, b) in enumerate(zip(runs[False], runs[True])) if a != b), None)
        assert first is None, (name, first, runs[False][first], runs[True][first])
        assert full[True] <= full[False]


def test_a_settled_stretch_coasts_on_most_steps():
    """c = 1, plain decoding settled (drafting at 0.86x): only the probes' decisions are made in full; the rates
    are still computed once every `refresh` (8) decisions, and the coast goes on through them."""
    clock = FakeClock()
    budget = VerificationBudget("adaptive", K, flat_table(), padded=True, clock=clock, context_window=64)
    accepting(budget, 2)
    drive(budget, clock, [dict(H200_C1) for _ in range(2000)])
    calls, rates, theta = count_full(budget), [0], budget.measured_theta

    def counted_theta(*a, **kw):
        rates[0] += 1
        return theta(*a, **kw)

    budget.measured_theta = counted_theta
    ks = drive(budget, clock, [dict(H200_C1) for _ in range(4000)])
    assert sum(k for k, _, _ in ks) > 0  # the probes go on
    assert calls[0] < 80, calls[0]  # (one in 8 before coasts went on through a refresh)
    assert 4000 / 8 - 10 <= rates[0] / 2 <= 4000 / 8 + 40, rates[0]  # both arms' rates, once a refresh
    # and where it is off, every decision is made in full
    budget.coast, budget._coast, calls[0] = False, None, 0
    drive(budget, clock, [dict(H200_C1) for _ in range(1000)])
    assert calls[0] == 1000


def test_young_window_sums_equal_the_loop():
    """`_Window.young_step_seconds` reads the window's running sums where every sample is young and none has a
    reference (the arm that runs, between probes), else walks the samples: the two agree, and the walk still
    serves windows with old samples or references."""
    from sparkspec.engine.step_times import _Window

    rng = random.Random(3)
    w = _Window(64, 8)
    for i in range(200):  # past the window's size: evictions (of the longest sample too) move the sums
        w.add(rng.uniform(0.5e-3, 2e-3) * (5 if i % 37 == 0 else 1), 1, None, at=i * 1e-3)
    walked = sorted(w.seconds)[:-1]
    assert w.num_refs == 0
    assert w.young_step_seconds(0.2, 0.5, 8, None, 3) == pytest.approx(sum(walked) / 63, rel=1e-12)
    # old samples: only the young ones (the last 8 here), the longest left out
    last = list(w.seconds)[-8:]
    assert w.young_step_seconds(10.0, 0.5, 8, None, 3) == pytest.approx((sum(last) - max(last)) / 7, rel=1e-12)
    w.add(1e-3, 1, 2e-3, at=0.2)  # a sample beside the other arm: timed at its step now (4 ms: twice as long)
    assert w.num_refs == 1
    vals = list(w.seconds)[:-1] + [1e-3 * 4e-3 / 2e-3]
    assert w.young_step_seconds(0.2, 0.5, 8, 4e-3, 3) == pytest.approx((sum(vals) - max(vals)) / 63, rel=1e-12)
    for i in range(64):  # the reference leaves the window
        w.add(1e-3, 1, None, at=0.2 + i * 1e-3)
    assert w.num_refs == 0 and w.young_step_seconds(0.3, 0.5, 8, None, 3) == pytest.approx(1e-3, rel=1e-12)

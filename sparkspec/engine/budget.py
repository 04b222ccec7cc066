"""Adaptive verification: how many of each request's drafts to verify in one step (pure Python).

Terms and DSpark Algorithm 1 (which drafts of each request to verify, with its early stop that keeps the
verification exact): `acceptance.py`.

Whole-step wall time (why the cost table alone drafted where drafting does not pay). The cost table times
`runner.execute` of pure decode steps at a short context: the device plus the runner's packing (and, where the
engine launches plain steps ahead, plain steps launched back to back: `CostTable.plain`). What the engine
pays per step is more: scheduling, the choice of drafts, commit / emit / detokenisation (Python per request and
per produced token), and, in a closed loop where requests keep arriving, steps that carry a prefill chunk and so
run eagerly instead of as a CUDA graph (the eager drafter is many small launches). On the H200 demo at c = 16
(`bench offline --profile-host`) a DSpark step spent 9.1 ms on the host against 1.2 ms for a plain one, and
adaptive ran at 0.45x plain decoding.
So the regime decision ("propose and verify drafts" = arm `spec`, or "plain decoding" = arm `plain`) reads the
wall time the engine actually sees: `StepTimes` keeps, per request-count bucket and arm, the (trimmed) mean of the
last intervals between the starts of consecutive steps (everything the engine and its caller do per step) without
a prompt chunk; `JoinCosts` keeps what the steps with one cost each arm over that, per chunk, and the chunks per
produced token (requests joining: `note_step`; `step_log.py` files each step with one of them; where requests join
on every step, as they do at c = 256 with output lengths that vary, a step with chunks is filed as the arm's step
less its chunks' cost), and
    Theta_arm = 1 / (seconds / produced token over the arm's samples + seconds per chunk x chunks per token)
(the engine tells each step's tokens),
else Theta_plain = R / T_plain(R), Theta_spec = tau_spec(R) / T_spec(R) with tau_spec from the online acceptance
estimate (R (1 + sum_j a_j) on padded steps). The choice is the argmax, where measured with margins: drafting must
lead by `spec_margin` (what its samples leave out), the arm not running by `switch_margin` more, and a near-tie's
change must hold over two computations of the rates (each switch costs transition steps). The engine buckets
steps by the requests it runs, not by those a step schedules: under the token budget a drafting step (1 + k rows
per request) may schedule fewer requests than a plain one at the same concurrency, and the two arms must meet in
one bucket.
Until both arms of a bucket are observed, the cost table decides (as before), and short probes of the arm not
chosen (a few steps every `probe_every` decisions) keep both arms' times and the acceptance estimate fresh. The
regime decision reads past steps only, never the drafts at hand, so verification stays lossless. Where an arm has
settled, its decision is repeated without the model until the first decision that could differ (a probe due, the
context's window, rates refreshed that change the choice: `_Coast`): the same decisions at a fraction of the host
time a step.

The drafter's context: a device drafter writes every step's rows into its pools, and its drafts read the
`context_window` rows before their position. Where plain decoding holds its place, plain steps (decode rows and
prompt chunks) skip the write (`writes_context`), and writes resume `context_window` decisions before drafting's
next regular probe; a switch to drafting, or a probe due by age, waits for that many steps that write. So the
settled plain arm costs what the plain engine's step costs, and no draft reads a row a skipping step left stale (but
one in a block taken from the prefix cache: `block_manager.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from sparkspec.engine.acceptance import AcceptanceEstimator, survival, verify_lengths
from sparkspec.engine.cost_table import CostTable
from sparkspec.engine.step_log import StepLog
from sparkspec.engine.step_times import ARMS, OTHER_ARM, Arm, GCClock, JoinCosts, StepTimes, bucket_of

BudgetMode = Literal["adaptive", "fixed"]
BUDGET_MODES = ("adaptive", "fixed")


@dataclass
class _Probe:
    """Per bucket: decisions made, when the last probe started, how many ran, the one in progress (its arm and
    the decisions it has left), the arm chosen when it started, and the interval's backoff factor."""

    num_decisions: int = 0
    last_start: int = -(10**9)
    num_started: int = 0
    arm: Arm | None = None
    left: int = 0
    best_before: Arm | None = None
    backoff: int = 1
    # both arms' measured tokens per second (`VerificationBudget.refresh`) and the decision they were computed at
    rates: dict[Arm, float | None] | None = None
    rates_at: int = 0
    measured: bool = False  # both arms are measured (`VerificationBudget.measured`: once so, for good)
    # the arm chosen outside probes (None: none yet), and where the measured rates last said the other arm (the
    # `rates_at` of that computation; None: they agree): `VerificationBudget.confirm`
    current: Arm | None = None
    challenged_at: int | None = None


@dataclass(slots=True)
class _Coast:
    """A settled arm's decision, made again without the model while it cannot differ (`VerificationBudget._coast_from`):
    for the bucket's decisions before `until`, while the clock is at most `deadline` (the other arm's samples grow
    stale then), in the same bucket (`sig`; on steps not padded also the same request and token counts and the same
    acceptance estimate: Algorithm 1's k moves with them there, and a k of 0 zeroes the spec arm). `k` and `cold`
    are what it decided.

    Why: a decision in full reads both arms' rates, the probe rules and the context's state. Inside a c = 1 engine
    on a 2-core CPU whose pure-Python speed (`bench offline --calibrate-host`) is the H200 host's, it took ~23 us a
    step, 7 us in a micro-benchmark (that CPU also runs the model between two decisions, which leaves its caches
    cold; the H200's host only launches graphs, and likely lies between the two). At c = 1 on the H200 demo pair
    a plain step of 0.66 ms is bound by the host about as much as by the device (on a slower host, more), so each
    us of a drafting engine's own host work a step counts there. Coasting makes all but the probes' decisions a few
    comparisons, and one in `refresh` (8) also computes the rates (`VerificationBudget._refresh_coast`): on that
    CPU `next_num_drafts` went from ~23 to ~11 us a step, and the speculation policy's host time from ~54 to ~40
    (three runs each, interleaved); the micro-benchmark's budget work a step, 6.3 to 4.7 us. Going on through a
    refresh (the coast used to end at each, and the decision in full then took ~70 us with cold caches) took
    `next_num_drafts` from ~11.7 to ~9.6 us a step inside that engine, and the policy's host time from ~39 to ~34.
    """

    probe: _Probe
    until: int
    deadline: float
    sig: int | tuple[int, int, int, int]
    k: int
    cold: bool
    # the decision before which a probe could start or the context's state change (`until` is the earlier of it and
    # the next refresh of the rates), and the probe interval the decision found; None: `until` is final (a coast
    # of plain decoding that waits for the drafter's window: `_coast_from`)
    bound: int = 0
    every: int | None = None


class VerificationBudget:
    """Chooses l_r for every decode request of a step and k for the next one. `fixed` verifies every draft;
    `adaptive` runs Algorithm 1, or, on `padded` steps, verifies every draft or none.

    Padded steps (CUDA graphs): a decode step runs as a graph of R requests x q rows, q in {1, 1 + k}, so a
    step that verifies one draft costs the same as one that verifies k for every request. Algorithm 1's token
    cost does not hold there, and with the early stop it would never pay the jump to q = 1 + k for a first item
    that is worth less than the jump. The padded rule compares the expected tokens per second of "draft and
    verify k for every request" against plain decoding.

    Regime (the module docstring): `next_num_drafts` decides, once per step, whether the next step drafts at all,
    from the measured whole-step wall times (`StepTimes`, fed by `step_boundary` / `note_step`) once both arms of
    the request-count bucket are observed, else from the cost table; it also runs the probes. Padded steps verify
    every draft that such a decision had proposed (the drafter's time is already spent, and the arm's wall time
    includes the verify step). Everything reads past steps only, never the drafts at hand: lossless."""

    def __init__(self, mode: BudgetMode, num_spec_tokens: int, cost: CostTable | None = None, padded: bool = False,
                 clock: Callable[[], float] = time.perf_counter, min_samples: int = 2, probe_every: int = 32,
                 probe_len: int = 3, max_first_probes: int = 4, max_backoff: int = 16, trusted_margin: float = 2.0,
                 plain_probe_extra: int = 0, spec_margin: float = 1.05, gc_clock: GCClock | None = None,
                 max_age: float = 2.0, refresh: int = 8, confirm: bool = True, switch_margin: float = 1.03,
                 context_window: int = 0, coast: bool = True):
        if mode not in BUDGET_MODES:
            raise ValueError(f"spec budget {mode!r}: expected one of {BUDGET_MODES}")
        if mode == "adaptive" and cost is None:
            raise ValueError("adaptive verification needs a cost table")
        if probe_len < 2:
            raise ValueError(f"probe_len = {probe_len}: a probe needs >= 2 steps (the first is a transition)")
        self.mode = mode
        self.num_spec_tokens = num_spec_tokens
        self.cost = cost
        self.padded = padded
        self.estimator = AcceptanceEstimator(max(num_spec_tokens, 1))
        # the steps' wall times (`StepLog`); time in the garbage collector left out (none left out with a test's clock)
        self.log = StepLog(clock, gc_clock if gc_clock is not None else
                           GCClock.shared() if clock is time.perf_counter else None)
        self.min_samples = min_samples  # per arm and bucket before the measured times replace the cost table
        self.probe_every = probe_every  # decisions between probes of the arm not chosen
        # decisions a probe lasts: its first step is a transition, not a sample (and under async scheduling the
        # first step of a plain stretch is not one either: `skip_step`)
        self.probe_len = probe_len
        # a probe of plain decoding lasts this many decisions more: where the engine launches plain steps ahead, the
        # first two of a plain stretch are not filed (`skip_step`), and a 3-decision probe would file only the
        # second launch, which waits for the first as a step in turn does. That sample is what made plain decoding
        # look slower than drafting on the H200 demo pair at c = 64: probes filed 2.0-2.3 ms a step against
        # 1.25-1.4 ms in long plain stretches, and the budget drafted at 0.53x plain decoding's speed.
        self.plain_probe_len = probe_len + plain_probe_extra
        # where both arms are measured, drafting is chosen only if its tokens per second lead plain decoding's by this
        # factor. Its samples leave out what drafting also costs: the transitions into and out of it, and waves of
        # prompts, where verify rows take the token budget from the chunks (not filed for either arm). On the
        # H200 demo pair at c = 256 the arms measured 47.9 k and 48.3 k tok/s, the budget drafted on the noise, and
        # the level ran at 0.70x plain decoding. A near-tie so decided costs at most this margin (5 %: the issue's
        # bound) where drafting truly leads by less.
        self.spec_margin = spec_margin
        self.max_first_probes = max_first_probes  # back-to-back probes of an arm that has no samples yet
        # a probe that confirms the choice doubles the interval, up to this factor. 16, not 8: a probe of drafting
        # where plain decoding wins costs more than its steps (on the H200 demo pair at c = 64, ~4 steps of 3.5 ms
        # against 1.3 ms, and requests of one length leave their lockstep, so they end, and their successors
        # join, on different steps); at 8 the interval (256 decisions) put a probe in every 256-step level of
        # `bench offline`. The price: a change of workload is found up to 32 x 16 = 512 decisions later (1,024
        # where one arm leads by > 25 %: ~1.3 s of 1.3 ms steps at c = 64)
        self.max_backoff = max_backoff
        self.trusted_margin = trusted_margin  # drafting's measured lead over the table's plain: no first probes
        # the arm not chosen is probed once its newest sample is this many seconds old (and `probe_every` decisions
        # have passed), whatever its backoff: the host's speed moves on that scale (on the H200 a fixed workload
        # took 1.8 to 6.0 ms from one level to the next), and a drafting step, bound by the device, moves less
        # with it than a plain one, bound by the host, so `StepTimes.corrected_throughput` cannot carry all of it.
        # Decisions count the engine's steps only: across the levels of `bench offline` (or a server's quiet
        # spells) an arm's samples grew seconds old in a few hundred decisions, and at c = 1 drafting was chosen
        # for three levels on plain samples of a slow second (1.1 ms a step, against 0.74 ms as then run).
        self.max_age = max_age
        # a bucket's measured tokens per second (both arms: `measured_theta`) are computed again after this many of
        # its decisions, or at once where a probe has just ended; in between the last ones hold. They move by one
        # step's samples a decision, and computing them was most of the budget's host cost a step (on a CPU its
        # work per step took 19.6 us, 6.5 us with them kept; on the H200 the drafting engine spent +93 us a step at
        # c = 1 over a plain one)
        self.refresh = refresh
        # near-ties, where both arms are measured. The arm not running must beat `spec_margin` by `switch_margin`
        # more (drafting: lead by 1.05 x 1.03), and the running one keeps its place until it falls that much under
        # it (drafting runs on until its lead is under 1.05 / 1.03); and a change waits for the next computation of
        # the rates (`refresh` decisions on, with the running arm's newer samples) to say it too (`confirm`),
        # unless the new lead is past `clear_lead`. On the H200 demo pair at c = 16 (one length) the budget
        # switched 13 times in one level on leads of 1.02-1.08x, and back within 8-30 decisions; each switch costs
        # its transition steps (and breaks a batch in lockstep), more than a few % of lead earns in so few steps
        self.confirm = confirm
        self.switch_margin = switch_margin
        self.clear_lead = 1.25  # past this lead no near-tie: a switch at once, and the loser probed half as often
        # the drafter's context (a device drafter's pools: one row per position, `DeviceProposer.window` of them read
        # before each pending position; 0: no context, every step writes). Where plain decoding holds its place
        # (both arms measured, no challenge, no probe within `context_window` decisions), a plain step (decode rows
        # and prompt chunks) leaves its rows unwritten (`writes_context`): the write is the plain arm's one device
        # cost (on the H200 demo pair at c = 1 a DSpark engine held on plain decoding ran at 0.95x the plain
        # engine). Drafting, a probe of it included, then starts only after `context_window` steps in a row that
        # wrote (`_warm`), so that its first drafts read the rows they would have read had every step written
        self.context_window = context_window
        self._warm = context_window  # steps in a row that wrote the context, up to `context_window`
        self.writes_context = True  # the decided step writes the drafter's context (`next_num_drafts`)
        self._probes: dict[int, _Probe] = {}
        self._plans: dict[tuple[int, int], tuple[int, float, float, float]] = {}  # `static_plan`, by its arguments
        self._plans_version = -1  # the estimator's version `_plans` were computed at
        self._proposing = False  # the last `next_num_drafts` asked for drafts: padded steps verify them all
        # a settled arm's decisions, until the first one that could differ (`_Coast`); None: decide in full. Off:
        # every decision is made in full (the coasting test compares the two)
        self.coast = coast
        self._coast: _Coast | None = None
        # within(n) -> whether half the step's requests or more end within n tokens (their `max_tokens`); None:
        # not known. A probe of drafting due then waits (`next_num_drafts`)
        self.ends_soon: Callable[[int], bool] | None = None

    # ---- whole-step wall time (`StepLog`) ----
    @property
    def step_times(self) -> StepTimes:
        return self.log.step_times

    @property
    def join_costs(self) -> JoinCosts:
        return self.log.join_costs

    @property
    def clock(self) -> Callable[[], float]:
        return self.log.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:  # (lockstep ranks read rank 0's: `lockstep.StepClock`)
        self.log.clock = clock

    @property
    def trace(self) -> list[dict] | None:
        """A list to append every decision and every filed step to (`bench offline --trace-budget`); None: off."""
        return self.log.trace

    @trace.setter
    def trace(self, trace: list[dict] | None) -> None:
        self.log.trace = trace
        self._coast = None  # (a traced decision is made in full)

    def step_boundary(self) -> None:
        """A step starts (`StepLog.boundary`)."""
        self.log.boundary()

    def idle(self) -> None:
        """The engine has no request left (`StepLog.idle`)."""
        self.log.idle()

    def note_step(self, num_reqs: int, num_verified: int, num_proposed: int, has_prompt: bool = False,
                  prompt_tokens: int = 0, num_chunks: int = 0, num_decode: int = 0) -> None:
        """What the step in progress does (`StepLog.note_step`)."""
        self.log.note_step(num_reqs, num_verified, num_proposed, has_prompt, prompt_tokens, num_chunks, num_decode)

    def skip_step(self) -> None:
        """The step in progress is not filed (`StepLog.skip_step`)."""
        self.log.skip_step()

    def note_tokens(self, num_tokens: int) -> None:
        """Tokens the step in progress produced (`StepLog.note_tokens`)."""
        self.log.note_tokens(num_tokens)

    # ---- modelled throughput ----
    def speculation_pays(self, num_reqs: int) -> bool:
        """Padded steps, cost table: whether drafting k and verifying them all beats plain decoding."""
        k = self.num_spec_tokens
        tau = num_reqs * (1 + sum(survival(self.estimator.rates(k))))
        spec_s = self.cost.target_seconds(num_reqs, num_reqs * (1 + k)) + self.cost.draft_seconds(num_reqs)
        plain_s = self.cost.plain_seconds(num_reqs, num_reqs)
        return tau / max(spec_s, 1e-9) > num_reqs / max(plain_s, 1e-9)

    def static_plan(self, num_reqs: int, num_base_tokens: int) -> tuple[int, float, float, float]:
        """The cost table's view -> (k of the spec arm, expected tokens of a spec step, its seconds, plain seconds).
        k = 0: the table finds no draft worth verifying (non-padded only). Kept until the acceptance estimate
        changes (in a plain stretch it does not, and this is asked on every step)."""
        if self._plans_version != self.estimator.version:
            self._plans.clear()
            self._plans_version = self.estimator.version
        key = (num_reqs, num_base_tokens)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._static_plan(num_reqs, num_base_tokens)
        return plan

    def _static_plan(self, num_reqs: int, num_base_tokens: int) -> tuple[int, float, float, float]:
        k = self.num_spec_tokens
        a = survival(self.estimator.rates(k))
        plain_s = self.cost.plain_seconds(num_reqs, num_base_tokens)  # no drafter call
        if self.padded:
            spec_s = self.cost.target_seconds(num_reqs, num_reqs * (1 + k)) + self.cost.draft_seconds(num_reqs)
            return k, num_reqs * (1 + sum(a)), spec_s, plain_s
        sps = self.cost.steps_per_second(num_reqs)  # includes the drafter's time
        ls = verify_lengths([a] * num_reqs, sps, num_base_tokens, num_reqs)
        tau = num_reqs + sum(sum(a[:n]) for n in ls)
        return max(ls), tau, 1.0 / sps(num_base_tokens + sum(ls)), plain_s

    def measured(self, num_reqs: int) -> bool:
        """Both arms of this request count's bucket have enough wall-time samples to replace the cost table."""
        count, n = self.step_times.count, self.min_samples
        return count(num_reqs, "plain") >= n and count(num_reqs, "spec") >= n

    def modelled_throughput(self, num_reqs: int, num_base_tokens: int | None = None, num_running: int | None = None
                            ) -> dict[Arm, float]:
        """Expected tokens per second of each arm at `num_reqs` sampling requests (measurements bucketed by
        `num_running`, default num_reqs): measured where `measured`, else the cost table's. The spec arm is worth 0
        where the table verifies no draft."""
        return self._model(num_reqs, num_reqs if num_base_tokens is None else num_base_tokens, num_running)[0]

    def _model(self, num_reqs: int, num_base_tokens: int, num_running: int | None = None,
               st: _Probe | None = None) -> tuple[dict[Arm, float], int]:
        """-> (Theta per arm, k of the spec arm: every draft on padded steps, else what Algorithm 1 would verify,
        at least 1). One pass over the cost table (Algorithm 1 over R x k items where steps are not padded).
        `num_running`: the bucket's request count (default: num_reqs). `st`: the bucket's state, where the
        measured rates are kept for `refresh` decisions."""
        k = self._plan_k(num_reqs, num_base_tokens)
        k_spec = self.num_spec_tokens if self.padded else max(k, 1)
        key = num_reqs if num_running is None else num_running
        if self._measured(key, st):
            theta = self._measured_model(key, st, k)
            if theta is not None:
                return theta, k_spec
            _, tau, _, _ = self.static_plan(num_reqs, num_base_tokens)
            spec_s, plain_s = self.step_times.seconds(key, "spec"), self.step_times.seconds(key, "plain")
        else:
            _, tau, spec_s, plain_s = self.static_plan(num_reqs, num_base_tokens)
        theta = {"plain": num_reqs / max(plain_s, 1e-9), "spec": tau / max(spec_s, 1e-9) if k else 0.0}
        return theta, k_spec

    def _plan_k(self, num_reqs: int, num_base_tokens: int) -> int:
        """The spec arm's k by the cost table's plan (`static_plan`): every draft on padded steps, whatever the
        acceptance estimate (no plan is computed for it, where a drafting stretch moves the estimate every step)."""
        return self.num_spec_tokens if self.padded else self.static_plan(num_reqs, num_base_tokens)[0]

    def _measured_model(self, key: int, st: _Probe | None, k: int) -> dict[Arm, float] | None:
        """Theta per arm from the bucket's measured rates, kept in `st` for `refresh` decisions (computed again
        after that); the spec arm is worth 0 where `k` is. None: an arm's produced tokens are not known."""
        if st is not None and st.rates is not None and st.num_decisions - st.rates_at < self.refresh:
            rates = st.rates
        else:
            rates = {arm: self.measured_theta(key, arm) for arm in ARMS}
            if st is not None:
                st.rates, st.rates_at = rates, st.num_decisions
        if rates["plain"] is None or rates["spec"] is None:
            return None
        return {"plain": rates["plain"], "spec": rates["spec"] if k else 0.0}  # produced tokens a second, as measured

    def _measured(self, key: int, st: _Probe | None) -> bool:
        """`measured`, remembered in the bucket's state once true (its windows only grow)."""
        if st is None:
            return self.measured(key)
        if not st.measured:
            st.measured = self.measured(key)
        return st.measured

    def measured_theta(self, num_reqs: int, arm: Arm) -> float | None:
        """The arm's produced tokens per second in `num_reqs`' bucket, joining requests included (`JoinCosts`):
        1 / (seconds per token of its steps without a prompt chunk + its seconds per chunk x chunks per token).
        An arm not yet seen with a request joining is charged the other arm's cost per chunk, scaled by their
        steps' seconds (a prompt runs as a part of the arm's step: with the drafter where it drafts). Where the
        arm's samples were taken beside the other arm, timed at the host's speed now
        (`StepTimes.corrected_throughput`). None: no tokens known."""
        rate = self.step_times.corrected_throughput(num_reqs, arm, self.log.now)
        if rate is None:
            return None
        cost = self.log.chunk_cost(num_reqs, arm) or 0.0
        return 1.0 / (1.0 / max(rate, 1e-9) + cost * self.join_costs.chunks_per_token())

    def plan_num_drafts(self, num_reqs: int, num_base_tokens: int) -> int:
        """The modelled choice, no probes, no state: k if the spec arm's Theta beats plain decoding, else 0
        (0: the next step skips the drafter, no speculation tax)."""
        if self.mode == "fixed" or num_reqs == 0:
            return self.num_spec_tokens
        theta, k = self._model(num_reqs, num_base_tokens)
        return k if self._spec_leads(theta, num_reqs) else 0

    def next_num_drafts(self, num_reqs: int, num_base_tokens: int, num_running: int | None = None,
                        has_prompt: bool = False, wave: bool = False) -> int:
        """Once per engine step: `plan_num_drafts`, except during a probe of the other arm.

        Regular probes: every `probe_every` decisions of a bucket (the first too: counted from the bucket's first
        decision), twice that where one arm is > 25 % ahead, four times where the bucket below found plain decoding
        ahead, times a backoff factor. Each probe after which the choice is the same as before it doubles the
        factor (up to `max_backoff`); one after which the choice changed resets it to 1. So a steady workload
        spends ever fewer steps on the arm that loses, and a change is still found. And once the arm's newest
        sample is `max_age` seconds old (at least `probe_every` decisions after the last probe): the host's speed
        moves on that scale, and what the samples say moves with it; drafting's age limit grows with its
        interval's factor (`_age_limit`).

        First probes: right away (up to `max_first_probes` times), plain decoding is probed while it has fewer
        samples than `StepTimes` trims, once drafting has that many of its own, unless drafting's measured tokens
        per second are `trusted_margin` (2x) or more the table's plain decoding (the table leaves the host out,
        which flatters plain decoding; the acceptance estimate behind the table's drafting still sits near its
        prior then). Drafting gets no first probes: the cost table times the device alone, which favours
        drafting, so where even the table says plain, drafting waits for its interval (on the H200 demo pair at
        c = 256 the first probes of drafting cost ~17 ms a step against ~4 ms for plain decoding, in a level of
        ~130 steps). A probe lasts `probe_len` decisions (of plain decoding: `plain_probe_len`).

        Where both arms are measured, a change of choice by a lead of `clear_lead` (1.25x) or less waits for the
        next computation of the rates to say it too (`confirm`); the probes' backoff restarts when it changes.

        `num_running`: the request count that buckets the measurements (`note_step`'s). No probe starts on a step
        that carries a prompt chunk (`has_prompt`): the next one most likely does too (prompts arrive in bursts),
        and such steps are not filed (`note_step`), so the probe would measure nothing; unless requests join on
        every step (`StepLog.joins_every_step`), where they are. A probe of drafting in
        progress stops at a `wave` of prompts (more chunks than a quarter of the decode rows: `StepLog.note_step`)."""
        if self.mode == "fixed" or num_reqs == 0:
            return self.num_spec_tokens
        key = num_reqs if num_running is None else num_running
        bucket = bucket_of(key)
        c = self._coast
        counted = False  # this decision is counted already (a coast's refresh that changed something)
        if c is not None:  # a settled arm: the decision is the last one until `c.until` (`_Coast`)
            st = c.probe
            n = st.num_decisions + 1
            if self.log.now <= c.deadline and c.sig == self._sig(bucket, num_reqs, num_base_tokens):
                if n >= c.until and c.every is not None and n < c.bound:
                    counted = True
                    st.num_decisions = n
                    if self._refresh_coast(c, key, num_reqs, num_base_tokens):
                        c.until = min(n + self.refresh, c.bound)
                        counted = False
                if n < c.until:
                    st.num_decisions = n
                    self._note_write(c.cold)
                    self._proposing = c.k > 0
                    return c.k
            self._coast = None
        st = self._probes.get(bucket)
        if st is None:
            st = self._probes[bucket] = _Probe()
        if not counted:
            st.num_decisions += 1
        ended = st.best_before is not None and not st.left
        if ended:  # (what the probe measured counts at once)
            st.rates = None
        theta, k_spec = self._model(num_reqs, num_base_tokens, key, st)
        measured = self._measured(key, st)
        best: Arm = "spec" if self._spec_leads(theta, key, measured, st.current) else "plain"
        prior = best == "spec" and not measured and self.plain_won_below(key)
        if prior:
            best = "plain"
        held = False
        if measured and self.confirm and st.current is not None:
            if best == st.current:
                st.challenged_at = None
            elif theta[best] > self.clear_lead * theta[OTHER_ARM[best]]:  # no noise: switch at once
                st.challenged_at, st.backoff = None, 1
            elif st.challenged_at is None or st.challenged_at == st.rates_at:
                st.challenged_at, best, held = st.rates_at, st.current, True  # the first word: not yet
            else:  # the next computation says it too: switch (the choice changed, so the probes restart)
                st.challenged_at, st.backoff = None, 1
        st.current = best if measured else None  # (the cost table's choice is no word to confirm against)
        if ended:  # the probe has ended: did it change the choice?
            st.backoff = min(2 * st.backoff, self.max_backoff) if best == st.best_before else 1
            st.best_before = None
        if st.last_start < 0 and st.num_started == 0:
            st.last_start = st.num_decisions  # a new bucket's first regular probe waits its interval too
        other = OTHER_ARM[best]
        every = self._probe_interval(st, theta, best, prior)  # (a clear loser, or one rejected below: less often)
        ready = self._warm >= self.context_window  # the drafter's window rows are all written
        warming = False  # drafting (or a probe of it) waits for `ready`
        # a probe may start on this step, and a coast from it: not on a prompt's step, where the next one most likely
        # carries prompts too and is not filed, unless requests join on every step (then such steps are filed)
        may_start = not has_prompt or self.log.joins_every_step
        if not st.left:
            since = st.num_decisions - st.last_start
            # stale: the arm's samples are `max_age` seconds old (only such probes and regular ones move the backoff:
            # the first ones measure, they confirm nothing)
            newest = self.step_times.newest_at(key, other)
            stale = newest is not None and self.log.now - newest > self._age_limit(other, every)
            due = since >= every or (stale and since >= self.probe_every)
            if other == "spec" and due and not ready:
                # the probe starts once the context is written (it stays due meanwhile); a prompt's step writes
                # too: at c = 1 with requests of 64 tokens (a window of 64) each request's prompt step skipped the
                # write and restarted the wait, so a probe due by age never started
                warming = True
            elif may_start:
                # until the arm has the samples that let its slowest one be dropped (the first after a switch of
                # arm is often slow: on the H200 demo pair at c = 64, 4.1 ms against 2.0 for plain decoding's next
                # two) (only once drafting has samples of its own, and not where its measured tokens per second lead
                # the table's plain decoding, which leaves the host out and so flatters plain, by `trusted_margin`;
                # at c = 1 on a CPU each early probe step of plain decoding gave 1 token where drafting gave ~4.7)
                enough = max(self.min_samples, self.step_times.min_trim)
                unseen = other == "plain" and self.step_times.count(key, other) < enough \
                    and self.step_times.count(key, best) >= enough and not self._leads_by(key, theta["plain"])
                start = due or (unseen and st.num_started < self.max_first_probes and since > self.probe_len)
                if start and other == "spec" and self.ends_soon is not None \
                        and self.ends_soon(self.probe_len * (self.num_spec_tokens + 1)):
                    # the batch would end in the probe: it stays due. With one output length at c = 256 on the
                    # H200 demo pair, the requests end together, and probes that began in a wave's last steps
                    # proposed drafts that no request read and filed no drafting step, so drafting was never
                    # measured there (the cost table went on deciding, and no step skipped the context write)
                    start = False
                if start:
                    st.arm, st.last_start = other, st.num_decisions
                    st.left = self.plain_probe_len if other == "plain" else self.probe_len
                    st.best_before = best if due else None
                    st.num_started += 1
        arm = best
        if st.left and wave and st.arm == "spec" and best == "plain":
            # a probe of drafting stops at a wave of prompts: such a step is not filed, and drafting costs the most
            # there. On the H200 demo pair at c = 256 (one length, in lockstep waves) a probe began at a wave's last
            # step and ran into the next wave's prompts: 28, 36 and 18 ms a step against 4, 20 and 8 for plain
            # decoding, and filed nothing. It confirmed nothing either (the backoff stays); the interval, or the age
            # of drafting's samples, brings the next one
            st.left, st.best_before = 0, None
        if st.left:
            st.left -= 1
            arm = st.arm
        if arm == "spec" and not ready:  # a switch to drafting (a probe of it starts only once ready)
            arm, warming = "plain", True
        k = k_spec if arm == "spec" else 0
        self._proposing = k > 0
        # plain decoding holds its place, measured and unchallenged, and drafting's next regular probe is more than
        # `context_window` decisions away (a probe due by age, or a switch, waits for `ready`). A step with prompt
        # chunks skips their rows too (`ModelRunner.writes_context`): with output lengths that vary a request joins
        # on most steps, and on the H200 demo pair at c = 64 (lengths 32-96) a DSpark engine that wrote on those
        # steps ran at 0.93-0.96x the plain engine while it drafted on none
        cold = bool(self.context_window) and not k and not warming and not st.left and measured \
            and st.current == "plain" and st.challenged_at is None \
            and st.last_start + every - st.num_decisions > self.context_window
        self._note_write(cold)
        if self.coast and self.trace is None and may_start and (arm == best or warming):
            self._coast = self._coast_from(st, key, bucket, num_reqs, num_base_tokens, measured, best, other, every,
                                           k, cold, warming)
        if self.trace is not None:
            self.trace.append({"decided": arm, "running": key, "k": k, "best": best, "prior": prior, "held": held,
                               "probe": st.arm if arm != best and not warming else None, "measured": measured,
                               "has_prompt": has_prompt, "cold": cold, "warming": warming,
                               "theta": {a: round(t, 1) for a, t in theta.items()}})
        return k

    def _note_write(self, cold: bool) -> None:
        """The decided step writes the drafter's context unless `cold`; `_warm` counts such steps in a row."""
        self.writes_context = not cold
        self._warm = 0 if cold else min(self._warm + 1, self.context_window)

    def _refresh_coast(self, c: _Coast, key: int, num_reqs: int, num_base_tokens: int) -> bool:
        """A coast's decision at which the bucket's rates are due again (`refresh`; `st.num_decisions` counts it):
        they are computed and kept, as `_model` would, and the coast goes on where the decision in full would be
        the coast's again: the same arm chosen against the running one (no challenge) and the same probe interval
        (which arm leads by `clear_lead` moves it). Otherwise the decision is made in full, on these rates.

        Why: a coast used to end at every refresh, one decision in 8, and a decision in full runs some thirty
        functions: with the caches made cold between decisions, as the model's step leaves them inside an engine,
        one took ~70 us against ~2 us for a coasting one (`sparkspec bench budget` on a 2-core CPU: the budget's
        work a step at c = 1 went from 27.0 to 21.9 us with this)."""
        st = c.probe
        theta = self._measured_model(key, st, self._plan_k(num_reqs, num_base_tokens))  # (due: computed and kept)
        if theta is None:
            return False
        best: Arm = "spec" if self._spec_leads(theta, key, True, st.current) else "plain"
        return best == st.current and self._probe_interval(st, theta, best) == c.every

    def _age_limit(self, other: Arm, every: int) -> float:
        """Seconds after which the samples of `other`, the arm not chosen, are stale (a probe of it is due):
        `max_age`, and for drafting that times the factor its probe interval `every` has grown by (the backoff
        its probes confirmed, a clear loss): a drafting step, bound by the device, moves little with the host's
        speed, and its probe is the costly one. On the H200 demo pair at c = 256 (drafting at ~0.5x plain
        decoding) each level of `bench offline` found drafting's samples stale and probed it: three steps of
        ~12 ms against ~3, and requests of one length left their lockstep (joining on many steps, not in waves):
        0.81-0.88x plain decoding, where a budget held on plain ran at 0.97x (0.98 with this)."""
        return self.max_age * (every // self.probe_every) if other == "spec" else self.max_age

    def _probe_interval(self, st: _Probe, theta: dict[Arm, float], best: Arm, prior: bool = False) -> int:
        """Decisions between regular probes of the arm not chosen (`next_num_drafts`): `probe_every` times the
        backoff, twice that where `best` leads by `clear_lead`, four times where the bucket below rejected drafting
        (`prior`)."""
        margin = theta[best] / max(theta[OTHER_ARM[best]], 1e-9)
        return self.probe_every * st.backoff * (4 if prior else 2 if margin > self.clear_lead else 1)

    def _coast_from(self, st: _Probe, key: int, bucket: int, num_reqs: int, num_base_tokens: int, measured: bool,
                    best: Arm, other: Arm, every: int, k: int, cold: bool, warming: bool) -> _Coast | None:
        """After a decision in full: how long the same decision holds (`_Coast`), or None where the next one may differ
        anyway. It holds while the arm is settled (both arms measured, no probe in progress or just ended, no
        challenge, the rates all measured and kept: `refresh`) and nothing that a decision reads moves: no regular
        probe due (`every`), the other arm's samples not yet `max_age` old, the context write's state (`cold`)
        unchanged (or, `warming`, until the window is written), no first probe of plain decoding possible where
        drafting runs (`max_first_probes` spent, or plain decoding has its samples: drafting's stretch files none).
        A prompt's step (`has_prompt`) starts no probe (but where requests join on every step:
        `StepLog.joins_every_step`), so it coasts too, but none starts a coast (but there): the steps after it
        may start one."""
        rates = st.rates
        if not measured or st.left or st.best_before is not None or st.challenged_at is not None \
                or best != st.current or rates is None or rates["plain"] is None or rates["spec"] is None \
                or (best == "spec" and st.num_started < self.max_first_probes
                    and self.step_times.count(key, "plain") < max(self.min_samples, self.step_times.min_trim)):
            return None
        if warming:  # plain decoding, writing, until the window is written (a probe or a switch then starts)
            until = min(st.rates_at + self.refresh, st.num_decisions + 1 + self.context_window - self._warm)
            return _Coast(st, until, float("inf"), self._sig(bucket, num_reqs, num_base_tokens), 0, False, until) \
                if st.num_decisions + 1 < until else None
        bound = st.last_start + every
        if cold:
            bound = min(bound, st.last_start + every - self.context_window)
        deadline = float("inf")
        newest = self.step_times.newest_at(key, other)
        if newest is not None:
            age_limit = self._age_limit(other, every)
            if self.log.now - newest > age_limit:  # stale: a probe is due once `probe_every` decisions have passed
                bound = min(bound, st.last_start + self.probe_every)
            else:
                deadline = newest + age_limit
        until = min(st.rates_at + self.refresh, bound)
        if st.num_decisions + 1 >= until:
            return None
        return _Coast(st, until, deadline, self._sig(bucket, num_reqs, num_base_tokens), k, cold, bound, every)

    def _sig(self, bucket: int, num_reqs: int, num_base_tokens: int) -> int | tuple[int, int, int, int]:
        """What a coasting decision must be asked with (`_Coast.sig`)."""
        return bucket if self.padded else (bucket, num_reqs, num_base_tokens, self.estimator.version)

    def _spec_leads(self, theta: dict[Arm, float], key: int, measured: bool | None = None,
                    current: Arm | None = None) -> bool:
        """Drafting is the better arm: by `spec_margin` where both arms of `key`'s bucket are measured (`measured`,
        where the caller knows), else (the cost table's estimate) by any amount. `current`: the arm the bucket
        runs, which the other must beat by `switch_margin` more."""
        if measured is None:
            measured = self.measured(key)
        if not measured:
            return theta["spec"] > theta["plain"]
        margin = self.spec_margin
        if current is not None:
            margin = margin * self.switch_margin if current == "plain" else margin / self.switch_margin
        return theta["spec"] > margin * theta["plain"]

    def _leads_by(self, key: int, plain_theta: float) -> bool:
        """Whether drafting's measured tokens per second in `key`'s bucket lead `plain_theta` (the table's plain
        decoding while plain is not measured) by `trusted_margin` (False where drafting's tokens are not known)."""
        spec = self.step_times.throughput(key, "spec")
        return spec is not None and spec >= self.trusted_margin * plain_theta

    def plain_won_below(self, num_reqs: int) -> bool:
        """At the largest smaller request-count bucket where both arms are measured, plain decoding produced more
        tokens per second. Drafting pays less as the batch grows (the verify rows' share of a busier device
        grows), so a bucket not measured yet starts where the one below ended, not at the cost table: that
        table times the device alone and says "draft" at every request count on the H200 demo pair, where plain
        decoding with async scheduling runs ~1.5-2x faster than drafting from c = 64 up, and a short level then
        spent its first steps drafting and probing."""
        for b in range(bucket_of(num_reqs) - 1, -1, -1):
            r = 2**b
            if self.measured(r):
                plain, spec = self.measured_theta(r, "plain"), self.measured_theta(r, "spec")
                return plain is not None and spec is not None and plain > spec
        return False

    # ---- verification ----
    def survivals(self, confidences: Sequence[Sequence[float] | None], num_drafts: Sequence[int]) -> list[list[float]]:
        """Confidence-head survival where a drafter gives one, else the online per-position estimate."""
        out = []
        for conf, k in zip(confidences, num_drafts):
            out.append(survival(conf[:k]) if conf is not None else survival(self.estimator.rates(k)))
        return out

    def lengths(self, num_drafts: Sequence[int], confidences: Sequence[Sequence[float] | None],
                num_base_tokens: int, num_base_produced: int) -> list[int]:
        if self.mode == "fixed":
            return list(num_drafts)
        if self.padded:
            pays = self._proposing or self.speculation_pays(len(num_drafts))
            return list(num_drafts) if pays else [0] * len(num_drafts)
        sps = self.cost.steps_per_second(len(num_drafts))
        return verify_lengths(self.survivals(confidences, num_drafts), sps, num_base_tokens, num_base_produced)

    def observe(self, num_verified: int, num_accepted: int) -> None:
        self.estimator.observe(num_verified, num_accepted)

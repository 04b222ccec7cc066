"""The engine's steps as the adaptive budget measures them (pure Python; `budget.py` decides from them).

A step's wall time is the interval between the starts of two consecutive steps (`StepLog.boundary`): everything
the engine and its caller did for it, host included, less the time the garbage collector took in it
(`GCClock`). The engine tells what the step does (`note_step`: its bucket's request count, drafts verified and
proposed, its prompt chunks) and what it produced (`note_tokens`); the step is then filed under its arm
(`StepTimes`), or, where it carried a joining request's chunk, with `JoinCosts`, or not at all (a transition, a
wave of prompts, a launch async scheduling skips), with why in the trace (`bench offline --trace-budget`). Where
requests join on every step, no step is free of a chunk to time an arm by: such steps are then filed as the step
they would have been without their chunks (`StepLog.every_step_after`).
"""

from __future__ import annotations

from collections.abc import Callable

from sparkspec.engine.step_times import OTHER_ARM, Arm, GCClock, JoinCosts, StepTimes


def is_wave(num_chunks: int, num_decode: int) -> bool:
    """A step's prompt chunks are a wave of prompts, not requests joining a running batch: more than one, and more
    than a quarter of its decode rows (`StepLog.note_step`)."""
    return num_chunks > max(1, num_decode // 4)


class StepLog:
    """Files each step's wall time under its arm as the next step starts; owns `StepTimes` and `JoinCosts`."""

    def __init__(self, clock: Callable[[], float], gc_clock: GCClock | None = None, every_step_after: int = 16):
        self.step_times = StepTimes()
        self.join_costs = JoinCosts()
        self.clock = clock
        # time in the garbage collector, left out of the filed steps (None: nothing left out)
        self.gc_clock = gc_clock
        self._gc_at_start = 0.0
        self.now = 0.0  # clock at the step in progress's start
        self._step_start: float | None = None
        self._last_step: tuple[int, bool, bool, bool] | None = None  # (bucket requests, verified any, proposed
        # any, carried a prompt chunk)
        self._last_tokens: int | None = None  # tokens the step in progress produced (`note_tokens`)
        self._last_prompt_tokens = 0  # prompt (or recompute) chunk tokens the step in progress carried
        self._last_chunks = 0  # and their chunks (requests joining, or a long prompt's next part)
        self._last_decode = 0  # and its decode rows
        # a list to append every filed (or unfiled) step to, shared with the budget's decisions; None: off
        self.trace: list[dict] | None = None
        # after this many steps in a row that carried chunks, a step with chunks beside decode rows (not a wave;
        # a prompt alone is a request's prefill, not a join; the run ends when the engine goes idle) is filed with
        # `StepTimes` as its seconds less what its chunks cost (`chunk_cost`), not with `JoinCosts`. Where requests
        # join on every step, no step is free of one: on the H200 demo pair at c = 256 with output lengths 32-96,
        # about four requests end, and four join, on every step. `JoinCosts` files a step with chunks against the
        # arm's step without one, which was never timed there, so neither arm was ever measured: the cost table
        # decided every step, and the drafter's context was written on every step (the write is skipped only once
        # both arms are measured: 0-4 % of the steps skipped it, where c = 64 skipped it on 21-77 %). 16: with
        # one request joining a step on average (c = 64, output 64), 16 in a row carry one about once in 1,500 steps
        # (a drafting stretch, more tokens a step, reaches it more often: its steps are then filed so too)
        self.every_step_after = every_step_after
        self._chunk_run = 0  # steps in a row, up to the last one filed, that carried chunks

    def boundary(self) -> None:
        """A step starts: the interval since the previous start, less the time the garbage collector took in it
        (`GCClock`), is that step's wall time, filed under its arm (steps that verified and proposed drafts: spec;
        neither: plain; a transition between them: not filed): with `StepTimes` where it carried no prompt chunk,
        else with `JoinCosts`, as its seconds over the arm's step without one, or, after `every_step_after` steps
        in a row with chunks, with `StepTimes` as its seconds less its chunks' cost (`chunk_cost`; where no cost per
        chunk is known, nothing less: the chunks then count in the arm's step time, which holds where each arm
        carries its share of joins). Every step's chunks and tokens go to `JoinCosts`' rate."""
        now = self.clock()
        in_gc = self.gc_clock.seconds if self.gc_clock is not None else 0.0
        if self._step_start is not None:
            seconds = now - self._step_start - (in_gc - self._gc_at_start)  # (`GCClock`)
            chunks, tokens, last = self._last_chunks, self._last_tokens, self._last_step
            why = "skipped"  # (the trace's word for a step not filed; None: filed with `StepTimes`)
            less = 0.0  # seconds taken off a step filed without its chunks (`joins_every_step`)
            if last is not None:
                num_reqs, verified, proposed, has_prompt = last
                arm: Arm = "spec" if verified else "plain"
                if verified != proposed:
                    why = "transition"
                elif chunks:
                    if is_wave(chunks, self._last_decode):
                        why = "prompt"  # a wave of prompts
                    elif self.joins_every_step and self._last_decode:
                        why = None  # requests join on every step: the step without its chunks
                        less = (self.chunk_cost(num_reqs, arm, seconds, chunks) or 0.0) * chunks
                        self.step_times.observe(num_reqs, arm, seconds - less, tokens, now)
                    elif (free := self.step_times.seconds(num_reqs, arm)) is None:
                        why = "prompt"  # nothing to measure them against yet
                    else:
                        why = "joined"
                        self.join_costs.observe(num_reqs, arm, seconds - free, chunks)
                elif has_prompt:
                    why = "prompt"
                else:
                    why = None
                    self.step_times.observe(num_reqs, arm, seconds, tokens, now)
            if tokens is not None and 0.0 < seconds <= self.step_times.max_seconds:
                self.join_costs.note_rate(chunks, tokens)
            if self.trace is not None:  # every step: those not filed too, with why (a later estimator's data)
                event = self._event(last, why, seconds, in_gc - self._gc_at_start)
                if why is None and chunks:  # (filed less what its chunks cost: `less`)
                    event["chunks_ms"] = round(1e3 * less, 3)
                self.trace.append(event)
            self._chunk_run = self._chunk_run + 1 if chunks else 0
        self._step_start, self._last_step, self._last_tokens, self._gc_at_start = now, None, None, in_gc
        self._last_chunks = 0
        self.now = now

    @property
    def joins_every_step(self) -> bool:
        """Requests have joined on every step of late: the next step with chunks is filed as the step without them
        (`every_step_after`), so a probe may start on a prompt's step (`VerificationBudget.next_num_drafts`)."""
        return self._chunk_run >= self.every_step_after

    def chunk_cost(self, num_reqs: int, arm: Arm, seconds: float | None = None, num_chunks: int = 0
                   ) -> float | None:
        """Seconds a prompt chunk adds to the arm's step in `num_reqs`' bucket: its own cost per chunk
        (`JoinCosts`), else the other arm's times the ratio of their steps without one (a prompt runs as a part of
        the arm's step: with the drafter where it drafts). Where the arm has no such step timed yet, a step of
        `seconds` that carried `num_chunks` gives its part without them: free = seconds / (1 + the other's cost per
        chunk x chunks / the other's step). None: not known."""
        cost = self.join_costs.per_chunk(num_reqs, arm)
        if cost is not None:
            return cost
        other = OTHER_ARM[arm]
        cost = self.join_costs.per_chunk(num_reqs, other)
        if cost is None:
            return None
        theirs = self.step_times.seconds(num_reqs, other)  # (asked only now: a mean over the window each)
        if not theirs:
            return None
        mine = self.step_times.seconds(num_reqs, arm)
        if mine is None:
            if seconds is None:
                return None
            mine = seconds / (1.0 + cost * num_chunks / theirs)
        return cost * mine / theirs

    def _event(self, last: tuple[int, bool, bool, bool] | None, why: str | None, seconds: float, gc_seconds: float
               ) -> dict:
        """The trace's record of a step (`boundary`)."""
        event: dict = {"unfiled": "skipped"}
        if last is not None:
            num_reqs, verified, proposed, _ = last
            event = {"running": num_reqs, "verified": verified, "proposed": proposed,
                     "prompt_tokens": self._last_prompt_tokens, "chunks": self._last_chunks}
            arm = "spec" if verified else "plain"
            if why is None:
                event["filed"] = arm
            elif why == "joined":
                event["joined"] = arm
            else:
                event["unfiled"] = why
        return event | {"ms": round(1e3 * seconds, 3), "gc_ms": round(1e3 * gc_seconds, 3),
                        "tokens": self._last_tokens}

    def idle(self) -> None:
        """The engine has no request left: the step in progress ends now, and no interval runs until the next step
        opens one. Before, the wait for work was filed as part of the last step before it: in `bench offline`, the
        gap between two levels (the level's summary, the next level's warm-up) went to the bucket of the last
        request still running, and on the H200 demo pair plain decoding at one request was filed at 38.5 tokens a
        second against ~1,500 as run (a server between bursts does the same, with gaps up to `StepTimes.max_seconds`).
        Drafting then led by 20 % there and drafted in the tail of every level, where a plain step costs a third
        of a drafting one."""
        self.boundary()
        self._step_start = None
        self._chunk_run = 0  # (the next burst's first steps carry its prompts: a wave, or one request joining)

    def note_step(self, num_reqs: int, num_verified: int, num_proposed: int, has_prompt: bool = False,
                  prompt_tokens: int = 0, num_chunks: int = 0, num_decode: int = 0) -> None:
        """What the step that `step_boundary` opened does: its bucket's request count (the requests the engine
        runs, or those that sample), drafts verified, drafts to propose, and whether it is a prompt's step: the
        engine says so where its prompt chunks hold more tokens than it has decode rows (`SpecPolicy`).

        `prompt_tokens` and `num_chunks`: the step's prompt (or recompute) chunks, beside `num_decode` decode rows.
        A step that carries chunks is filed with `JoinCosts` (what it took over the arm's step without one, per
        chunk), unless its chunks are a wave (more than a quarter of its decode rows, and more than one): all of a
        level's requests arriving at once, or, with one output length in lockstep, all of them ending at once. A
        wave's steps are mostly prefill, and their cost per chunk is not what a request joining a running batch
        costs (steps with many chunks share one prefill graph); filed, they did harm: at a level's start the arm
        not chosen keeps the few samples its first probe took there (on the H200 demo pair at c = 256, plain
        decoding held 47.7, 15.1 and 5.9 ms steps, measured at 10.7 k tok/s against drafting's 27 k, and was not
        chosen again in the level).

        Steps that carry chunks used to be filed with the arm's other steps where the chunks held no more tokens
        than the step had decode rows, and not at all otherwise. Both hid what joining costs drafting: with
        prompts of 130 tokens beside 16 decode rows none was filed, and where a drafting probe ran between the
        joins of a batch in lockstep, none was seen (`JoinCosts` says what that cost at c = 16 on the H200)."""
        self._last_step = (num_reqs, num_verified > 0, num_proposed > 0, has_prompt)
        self._last_prompt_tokens, self._last_chunks, self._last_decode = prompt_tokens, num_chunks, num_decode

    def skip_step(self) -> None:
        """The step in progress is not filed. Async scheduling launches the first step of a plain stretch and
        returns before reading anything, so the interval to the next step's start is the launch alone; the second
        launch then reads the first, which the device started only just before, so its interval is a step in turn
        (the engine skips both). Tokens are read (`note_tokens`) one step late: each later launched step is filed
        with the tokens of the step before it, which a plain stretch makes nearly the same."""
        self._last_step = None

    def note_tokens(self, num_tokens: int) -> None:
        """Tokens the step in progress produced (after its commit). With them the measured arms compare tokens
        per second as produced, which also holds where the arms schedule different request counts: a drafting
        step reserves 1 + k rows per request, so under the token budget it may run fewer requests than a plain
        step at the same concurrency.

        Several reads within one step's interval add up: where a step reads the one launched before it and then
        runs one in turn, or reads the last step in flight with nothing to schedule, the interval's wall time holds
        both. Before, the second read replaced the first, and the plain arm, which reads one step late, was filed
        short of the tokens its time produced (a CPU closed loop at c = 8, plain decoding: 8.00 tokens per filed
        step against 8.28 with both reads counted), while drafting, which reads in turn, was filed in full."""
        self._last_tokens = num_tokens if self._last_tokens is None else self._last_tokens + num_tokens

"""What engine steps cost, as the engine runs them: wall time per step of each arm of the adaptive budget (draft and
verify, or plain decoding) per request-count bucket (`StepTimes`), what requests joining add to each (`JoinCosts`),
and the time Python's cyclic collector takes in them (`GCClock`). Pure Python; `budget.VerificationBudget` decides
from them."""

from __future__ import annotations

import functools
import gc
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Literal


class GCClock:
    """Seconds spent in Python's cyclic garbage collector since the process installed this clock (one `gc.callbacks`
    entry for every budget in the process; two calls per collection). A collection lands on whichever step is
    running: on the H200 demo pair at c = 256, 7 or 8 of ~450 filed plain steps a level held more than 2 ms of it,
    up to 17 ms (the budget trace's `gc_ms`), against a median step of 4.7 ms. Such time says nothing about the arm,
    so `StepTimes` is fed steps without it."""

    _installed: GCClock | None = None

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.seconds = 0.0
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = self.clock()
        else:
            self.seconds += self.clock() - self._start

    @classmethod
    def shared(cls) -> GCClock:
        if cls._installed is None:
            cls._installed = cls()
            gc.callbacks.append(cls._installed._callback)
        return cls._installed


Arm = Literal["plain", "spec"]
ARMS: tuple[Arm, Arm] = ("plain", "spec")
OTHER_ARM: dict[Arm, Arm] = {"plain": "spec", "spec": "plain"}


@functools.cache
def bucket_of(num_reqs: int) -> int:
    """Request-count bucket: the nearest power of two in log scale (15 and 16 share one, 11 and 12 do not)."""
    return round(math.log2(max(num_reqs, 1)))


class StepTimes:
    """Wall seconds per engine step, per (request-count bucket, arm): the mean of the last `window` samples
    without the largest one once there are `min_trim` (deterministic given the samples). Where the engine also
    tells a step's produced tokens, `throughput` is the arm's tokens / seconds over the same samples.

    A mean, not a median: what an arm costs is its total time over its steps, and some costs recur on a
    fraction of the steps only. In a closed loop a request joins every few steps, and before mixed steps were
    split (`ModelRunner.split_mixed`) each such step ran eagerly: on the H200 demo pair at c = 16, 12 of 60 DSpark
    steps carried a prompt and `execute` averaged 10.8 ms against ~2 ms for a graph step (so ~45 ms per eager
    step). The median of the spec arm was its graph step, so drafting looked 2x ahead of plain
    decoding while it ran at 0.45x. Dropping the one largest sample still absorbs a single JIT compile or GC
    pause (a recurring cost has more samples in the window than the one dropped). Steps that carry prompt chunks
    are filed apart (`JoinCosts`, `VerificationBudget.note_step`).

    64 samples, not 16: requests of one length that started together end together, and the steps around their
    ends (rows left out while their last token is in flight, the read of the last step with nothing scheduled)
    recur once a request's life, 64 steps at 64 tokens. A window of 16 held such a stretch a quarter of the time,
    and the plain arm's estimate swung by more than the 5 % margin (`VerificationBudget.spec_margin`) with it:
    replayed over the H200 demo pair's traces at c = 64 (one length, second round), drafting led by the margin on
    85 of 495 decisions with 16 samples, 22 with 32 and none with 64. Run on the H200 (one length, c = 1 / 16 /
    64 / 256), the budget drafted on 1 / 55 / 2 / 1 % of the second round's decisions with 64 samples and 1 / 28 /
    8 / 1 % with 32, and its throughput at c = 64 and 256 was 0.93 and 0.92 of plain decoding's against 0.64 and
    0.79. (What the budget reads, `corrected_throughput`, takes each arm's step seconds from its samples of the last
    half second, which for the arm that runs is its whole window, and from its last 8 for an arm only probed.)"""

    def __init__(self, window: int = 64, max_seconds: float = 10.0, min_trim: int = 3, recent: int = 16,
                 ref_len: int = 8, young: float = 0.5):
        self.window = window
        self.min_trim = min_trim
        self.max_seconds = max_seconds  # longer intervals are idle gaps (a server between bursts), not steps
        # per (bucket, arm): the samples, their produced tokens and (drift: `corrected_throughput`) their
        # references: the other arm's mean seconds over its last `ref_len` samples where that arm was filed within
        # the bucket's last `recent` samples, else None
        self.windows: dict[tuple[int, Arm], _Window] = {}
        self.recent, self.ref_len = recent, ref_len
        # `corrected_throughput` times an arm by its samples of the last `young` seconds, or its last `ref_len`
        self.young = young
        self.num_filed: dict[int, int] = {}  # per bucket, the samples filed so far (both arms)
        self.newest: dict[tuple[int, Arm], int] = {}  # per key, that count at its newest sample

    def observe(self, num_reqs: int, arm: Arm, seconds: float, tokens: int | None = None,
                at: float | None = None) -> None:
        """File a step of `seconds` that produced `tokens`, taken at clock `at` (None: its age is not known, and it
        counts as young: `corrected_throughput`)."""
        if not 0.0 < seconds <= self.max_seconds:
            return
        bucket = bucket_of(num_reqs)
        key, other = (bucket, arm), (bucket, OTHER_ARM[arm])
        n = self.num_filed[bucket] = self.num_filed.get(bucket, 0) + 1
        ref = self._recent_seconds(other) if n - self.newest.get(other, -self.recent) <= self.recent else None
        w = self.windows.get(key)
        if w is None:
            w = self.windows[key] = _Window(self.window, self.ref_len)
        w.add(seconds, tokens, ref, at)
        self.newest[key] = n

    def _recent_seconds(self, key: tuple[int, Arm]) -> float | None:
        """The mean seconds of the key's last `ref_len` samples (None: none)."""
        w = self.windows.get(key)
        return w.recent_sum / min(len(w.samples), self.ref_len) if w is not None and w.samples else None

    def newest_at(self, num_reqs: int, arm: Arm) -> float | None:
        """The clock at the arm's newest sample in the bucket (None: none, or filed without a clock)."""
        w = self.windows.get((bucket_of(num_reqs), arm))
        return w.samples[-1][3] if w is not None and w.samples else None

    def count(self, num_reqs: int, arm: Arm) -> int:
        w = self.windows.get((bucket_of(num_reqs), arm))
        return len(w.samples) if w is not None else 0

    def seconds(self, num_reqs: int, arm: Arm) -> float | None:
        w = self.windows.get((bucket_of(num_reqs), arm))
        if w is None or not w.samples:
            return None
        n = len(w.samples)
        if n >= self.min_trim:
            return (w.sum_seconds - w.top()[0]) / (n - 1)
        return w.sum_seconds / n

    def throughput(self, num_reqs: int, arm: Arm) -> float | None:
        """Produced tokens per second of the arm's samples (the longest dropped, as in `seconds`); None unless
        every sample has its tokens. O(1): the budget asks on every step (a c = 1 step has ~450 us of host time
        in all on the H200)."""
        w = self.windows.get((bucket_of(num_reqs), arm))
        if w is None or not w.samples or w.missing:
            return None
        tokens, seconds = w.sum_tokens, w.sum_seconds
        if len(w.samples) >= self.min_trim:
            top = w.top()
            tokens, seconds = tokens - top[1], seconds - top[0]
        return tokens / max(seconds, 1e-12)

    def corrected_throughput(self, num_reqs: int, arm: Arm, now: float | None = None) -> float | None:
        """Produced tokens per second of the arm at the host's speed now: tokens per step over its window, over the
        mean step seconds of its samples of the last `young` seconds before clock `now` (or its last `ref_len`,
        where fewer are that young; the longest left out once there are `min_trim`), each sample taken beside the
        other arm (a probe's, and the steps just after one) timed at the host's speed now: its seconds x the other
        arm's mean step now / its mean step then (the sample's reference; both over that arm's last `ref_len`
        samples). Step seconds, not tokens per second, carry the drift: a drafting step's tokens move with
        acceptance (1 to 8 at c = 1 on the demo pair), its seconds by a few % at one host speed. None: no tokens
        known. O(samples chosen).

        Why: the host's speed moves while the engine runs. On the H200 demo pair a fixed pure-Python workload took
        1.8 to 6.0 ms from one level of `bench offline` to the next, and every host phase of a step moved with it.
        The arm not chosen is sampled only by probes, so its samples can be levels older than the chosen arm's: in a
        trace at c = 16 drafting's 7 samples, taken while a plain step took 1.12 ms (a drafting one 2.6 ms), were
        compared with plain decoding's of a slower stretch (1.3 ms a step); drafting led by 5-16 %, and the budget
        drafted on 43 % of the steps of a level that plain decoding ran 1.18x faster. A probe pairs the two arms
        within a few steps: its samples' ratio to the other arm then is what the drift leaves alone.

        Why young samples, not the window: the window holds what the arm measured when it last ran (up to 64
        samples), and a probe adds two. The other arm's seconds do not carry the drift to those older samples where
        one arm is bound by the host and the other by the device (a plain step, and a drafting one at small
        batches). On the H200 demo pair at c = 1 plain decoding ran its stretch at 1.2 ms a step on a slow host, and
        its later probes took 0.61-0.69 ms while drafting's step moved from 2.45 to 2.15 ms; the window, 2 probe
        samples against 62 of the stretch, read plain decoding at ~900 tokens a second against drafting's 1,150,
        and the budget drafted for three levels that plain decoding ran at 1.06x. By age, not by which arm runs: a
        first version timed the arm only probed by its last samples and the running one by its window, and an arm
        that began to run again, its window half full of an older stretch, read ~20 % slower than it had while
        probed; the budget then switched back, and at c = 16 switched on every probe."""
        bucket = bucket_of(num_reqs)
        w = self.windows.get((bucket, arm))
        if w is None or not w.samples or w.missing:
            return None
        ref_now = self._recent_seconds((bucket, OTHER_ARM[arm]))
        seconds = w.young_step_seconds(now, self.young, self.ref_len, ref_now, self.min_trim)
        return w.sum_tokens / len(w.samples) / max(seconds, 1e-12)


class _Window:
    """One (request-count bucket, arm)'s last samples with their running sums, so that `StepTimes.seconds` and
    `throughput` cost O(1): a window's longest sample is looked for again only after the one that held it has left.
    Each sample (`samples`): (seconds, produced tokens or None, reference seconds or None, clock at filing or None:
    `StepTimes.corrected_throughput`). One deque of tuples and slots: the budget files a sample every step, with the
    caches cold after the model's step (on a 2-core CPU, four deques took ~1 us more a step than one)."""

    __slots__ = ("ref_len", "recent_sum", "samples", "sum_seconds", "sum_tokens", "missing", "num_refs", "_top")

    def __init__(self, size: int, ref_len: int):
        self.ref_len = ref_len
        self.recent_sum = 0.0  # the last `ref_len` samples' seconds, summed
        self.samples: deque[tuple[float, int | None, float | None, float | None]] = deque(maxlen=size)
        self.sum_seconds = 0.0
        self.sum_tokens = 0
        self.missing = 0  # samples without tokens
        self.num_refs = 0  # samples with a reference (`young_step_seconds`)
        self._top: tuple[float, int] | None = (0.0, 0)  # (seconds, tokens) of the longest sample; None: look again

    @property
    def seconds(self) -> list[float]:
        return [s[0] for s in self.samples]

    @property
    def tokens(self) -> list[int | None]:
        return [s[1] for s in self.samples]

    @property
    def refs(self) -> list[float | None]:
        return [s[2] for s in self.samples]

    def add(self, seconds: float, tokens: int | None, ref: float | None, at: float | None = None) -> None:
        samples = self.samples
        n = len(samples)
        if n >= self.ref_len:
            self.recent_sum -= samples[-self.ref_len][0]
        tok = tokens or 0
        if n == samples.maxlen:
            old_s, old_t, old_r, _ = samples[0]
            old_tok = old_t or 0
            self.sum_seconds -= old_s
            self.sum_tokens -= old_tok
            self.missing -= old_t is None
            self.num_refs -= old_r is not None
            if self._top == (old_s, old_tok):
                self._top = None
        samples.append((seconds, tokens, ref, at))
        self.recent_sum += seconds
        self.sum_seconds += seconds
        self.sum_tokens += tok
        if tokens is None:
            self.missing += 1
        if ref is not None:
            self.num_refs += 1
        top = self._top
        if top is not None and (seconds, tok) > top:
            self._top = (seconds, tok)

    def young_step_seconds(self, now: float | None, young: float, at_least: int, ref_now: float | None,
                           min_trim: int) -> float:
        """Mean step seconds of the samples taken within `young` seconds before `now` (all, where `now` or a
        sample's time is None), or of the last `at_least` where fewer are; each with a reference timed at `ref_now`
        (the other arm's mean step now; None: as measured); the longest left out once there are `min_trim`. O(1)
        where every sample is young and none has a reference (the arm that runs, between probes): the window's
        sums, as `StepTimes.seconds`."""
        samples = self.samples
        oldest = samples[0][3]
        if not self.num_refs and (now is None or oldest is None or now - oldest <= young):
            n = len(samples)
            return (self.sum_seconds - self.top()[0]) / (n - 1) if n >= min_trim else self.sum_seconds / n
        vals = []
        for s, _, r, t in reversed(samples):
            if len(vals) >= at_least and now is not None and t is not None and now - t > young:
                break
            vals.append(s / r * ref_now if r and ref_now else s)
        total, m = sum(vals), len(vals)
        if m >= min_trim:
            total, m = total - max(vals), m - 1
        return total / m

    def top(self) -> tuple[float, int]:
        if self._top is None:
            self._top = max(((s, t or 0) for s, t, _, _ in self.samples), default=(0.0, 0))
        return self._top


class JoinCosts:
    """What requests joining cost each arm: per (request-count bucket, arm), the seconds the last `window` steps
    that carried prompt chunks took over the arm's step without one (`StepTimes.seconds` when filed), per chunk;
    and, over both arms, the chunks per produced token of the last `rate_window` steps (one per request for
    prompts that fit one step: 1 / the mean output length).

    Why a term of its own: a joining request costs the arms differently, and how often one joins depends on the arm.
    On the H200 demo pair at c = 16 (output 64), a DSpark step that carried a prompt took 4.5 ms against 2.9 ms
    without (its prompt part is a second graph, with the drafter), a plain one 1.5 against 1.3 ms. Plain decoding
    of one length in lockstep takes all 16 prompts in one step every 64 steps; drafting desynchronises the batch,
    and a request joins on a third of its steps. The arm's steps without a prompt, where drafting was probed,
    read 14-15 k tok/s for drafting and 12-13 k for plain decoding, while they ran at 10.8-11.5 k and 12.9-14.0 k.
    So `VerificationBudget` compares tokens per second with this cost spread over the tokens:
        Theta_arm = 1 / (1 / Theta_arm without joins + cost per chunk_arm * chunks per token)."""

    def __init__(self, window: int = 32, rate_window: int = 512):
        self.window = window
        self.extra: dict[tuple[int, Arm], deque[tuple[float, int]]] = {}
        self._per_chunk: dict[tuple[int, Arm], float | None] = {}
        self.rates: deque[tuple[int, int]] = deque(maxlen=rate_window)  # (chunks, tokens) per step
        self._chunks = self._tokens = 0  # sums over `rates`

    def observe(self, num_reqs: int, arm: Arm, extra_seconds: float, num_chunks: int) -> None:
        key = (bucket_of(num_reqs), arm)
        self.extra.setdefault(key, deque(maxlen=self.window)).append((extra_seconds, num_chunks))
        self._per_chunk.pop(key, None)

    def per_chunk(self, num_reqs: int, arm: Arm) -> float | None:
        """Extra seconds per chunk in the arm's steps that carried one (>= 0; None: none seen in the bucket)."""
        key = (bucket_of(num_reqs), arm)
        if key not in self._per_chunk:
            d = self.extra.get(key)
            self._per_chunk[key] = None if not d else max(
                0.0, math.fsum(e for e, _ in d) / max(sum(n for _, n in d), 1))
        return self._per_chunk[key]

    def note_rate(self, num_chunks: int, num_tokens: int) -> None:
        if len(self.rates) == self.rates.maxlen:
            old_chunks, old_tokens = self.rates[0]
            self._chunks -= old_chunks
            self._tokens -= old_tokens
        self.rates.append((num_chunks, num_tokens))
        self._chunks += num_chunks
        self._tokens += num_tokens

    def chunks_per_token(self) -> float:
        return self._chunks / self._tokens if self._tokens else 0.0

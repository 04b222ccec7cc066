"""`bench offline --profile-host`: where an engine step's wall time goes, measured from outside the engine.

`HostProfiler.attach(engine)` wraps, on that engine instance only, the pieces `LLMEngine.step` calls (the
scheduler's `schedule` and `release_after_step`, the speculation policy's `choose` / `num_drafts_to_propose`, the
runner's `execute` (and `launch`: a step launched ahead by async scheduling), the engine's `commit` / `emit`) and
the one device->host copy (`step_io.Download.fetch`, or `PendingFetch.wait` for a step launched ahead, which
blocks until the device has finished the step). Nothing in the engine changes and nothing is wrapped without the
flag, so the timed path costs nothing when profiling is off. Pieces an engine does not have are skipped.

Definitions (per concurrency level; `steps` = `LLMEngine.step` calls that scheduled something):
  * host us / step      (wall inside `step` - device wait) / steps: the time the host spends per step
  * host us / req       host us / step divided by the mean number of requests scheduled per step
  * device wait         time blocked in the copy back (the host waits for the device): a lower bound on busy
  * device busy         CUDA: per step, the span between CUDA events recorded on the stream when `execute` starts
                        and when it returns (after the copy), summed / level wall time; an upper bound on the
                        device's busy time (launch gaps inside the step count as busy). CPU: the device is the host
                        and busy = time in `execute` / wall.
  * phases              us per step in each wrapped piece, `other` = the rest of `step` (no device wait),
                        `outside` = the caller's loop between steps (adding requests, reading outputs)
  * gc                  us per step in Python's cyclic garbage collector (`gc.callbacks`), wherever it struck;
                        `gc_collections` per generation, `gc_full_ms` the mean full (generation-2) collection
  * forwards            per step: graph replays (`graph_replays`, a split step replays several) and eager forwards
                        (`eager_forwards`, with `eager_us`: host us per step inside them, where launch-bound eager
                        steps show up; both inside `execute`)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

PHASES = ("schedule", "choose", "propose_plan", "execute", "device_wait", "commit", "release", "emit")


class HostProfiler:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.num_steps = 0
        self.num_scheduled = 0  # sum over steps of the requests scheduled
        self.step_seconds = 0.0
        self.events: list = []  # (start, end) CUDA event pairs, one per execute
        self.num_replays = 0
        self.num_eager = 0
        self.eager_seconds = 0.0
        self._cuda = False
        self._executing = False  # inside the runner's execute / launch
        self.wait_outside_execute = 0.0  # device wait that no other phase contains (async scheduling's reads)
        self.gc_seconds = [0.0, 0.0, 0.0]  # time in the cyclic collector during the level, per generation
        self.gc_counts = [0, 0, 0]
        self._gc_start = 0.0

    def _gc_callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = self.clock()
        else:
            g = info["generation"]
            self.gc_counts[g] += 1
            self.gc_seconds[g] += self.clock() - self._gc_start

    def _inside_execute(self, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            self._executing = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._executing = False

        return wrapper

    def _timed(self, phase: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += self.clock() - t0

        return wrapper

    @contextmanager
    def attach(self, engine):
        """Wrap `engine`'s step pieces for the duration of the block; they are removed on exit."""
        from sparkspec.engine import step_io

        patched: list[tuple[object, str]] = []  # instance attributes we set, deleted on exit

        def wrap(obj, name: str, make: Callable[[Callable], Callable]) -> None:
            if obj is None or not callable(getattr(obj, name, None)) or name in vars(obj):
                return  # absent, or already an instance attribute we should not shadow
            setattr(obj, name, make(getattr(obj, name)))
            patched.append((obj, name))

        def step_wrapper(fn):
            def step(*args, **kwargs):
                t0 = self.clock()
                try:
                    out = fn(*args, **kwargs)
                finally:
                    dt = self.clock() - t0
                if self._last_scheduled:  # an empty step (nothing to run) is not a step
                    self.num_steps += 1
                    self.num_scheduled += self._last_scheduled
                    self.step_seconds += dt
                self._last_scheduled = 0
                return out

            return step

        def schedule_wrapper(fn):
            timed = self._timed("schedule", fn)

            def schedule(*args, **kwargs):
                out = timed(*args, **kwargs)
                self._last_scheduled = len(getattr(out, "scheduled", ()) or ())
                return out

            return schedule

        device = getattr(getattr(engine, "runner", None), "device", None)
        self._cuda = device is not None and device.type == "cuda"

        def execute_wrapper(fn):
            timed = self._inside_execute(self._timed("execute", fn))
            if not self._cuda:
                return timed
            import torch

            def execute(*args, **kwargs):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                try:
                    return timed(*args, **kwargs)
                finally:
                    end.record()
                    self.events.append((start, end))

            return execute

        def wait_wrapper(fn):
            def wait(*args, **kwargs):  # a wait outside `execute` (a step launched ahead) is not in its time
                t0 = self.clock()
                try:
                    return fn(*args, **kwargs)
                finally:
                    dt = self.clock() - t0
                    self.seconds["device_wait"] += dt
                    if not self._executing:
                        self.wait_outside_execute += dt

            return wait

        def counted(kind: str):
            def make(fn):
                def run(*args, **kwargs):
                    t0 = self.clock()
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        if kind == "eager":
                            self.num_eager += 1
                            self.eager_seconds += self.clock() - t0
                        else:
                            self.num_replays += 1

                return run

            return make

        self._last_scheduled = 0
        runner = getattr(engine, "runner", None)
        wrap(runner, "forward", counted("eager"))
        wrap(getattr(runner, "graphs", None), "run", counted("graph"))
        wrap(engine, "step", step_wrapper)
        wrap(engine.scheduler, "schedule", schedule_wrapper)
        wrap(engine.scheduler, "release_after_step", lambda f: self._timed("release", f))
        wrap(getattr(engine, "spec", None), "choose", lambda f: self._timed("choose", f))
        wrap(getattr(engine, "spec", None), "num_drafts_to_propose", lambda f: self._timed("propose_plan", f))
        wrap(getattr(engine, "runner", None), "execute", execute_wrapper)
        wrap(getattr(engine, "runner", None), "launch", execute_wrapper)  # async scheduling: a step launched ahead
        wrap(engine, "commit", lambda f: self._timed("commit", f))
        wrap(engine, "emit", lambda f: self._timed("emit", f))
        fetch = step_io.Download.fetch  # a class attribute: every step makes its own Download
        step_io.Download.fetch = wait_wrapper(fetch)
        wait = step_io.PendingFetch.wait  # the read of a step launched ahead (outside `execute`)
        step_io.PendingFetch.wait = wait_wrapper(wait)
        import gc

        gc.callbacks.append(self._gc_callback)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._gc_callback)
            step_io.Download.fetch = fetch
            step_io.PendingFetch.wait = wait
            for obj, name in reversed(patched):
                delattr(obj, name)

    def summary(self, wall_seconds: float) -> dict:
        """The level's numbers (see the module docstring); `wall_seconds`: the level's wall time."""
        n = max(self.num_steps, 1)
        wait = self.seconds["device_wait"]
        host = max(self.step_seconds - wait, 0.0)
        reqs = self.num_scheduled / n
        if self._cuda and self.events:
            import torch

            torch.cuda.synchronize()
            busy = sum(s.elapsed_time(e) for s, e in self.events) / 1000.0
        else:
            busy = self.seconds["execute"]
        wall = max(wall_seconds, 1e-9)
        phases = {p: round(1e6 * s / n, 1) for p, s in self.seconds.items()}
        # the device wait inside `execute` is in its time already; the wait for a step launched ahead is not
        phases["other"] = round(1e6 * max(self.step_seconds - sum(self.seconds[p] for p in PHASES
                                                                   if p != "device_wait")
                                          - self.wait_outside_execute, 0.0) / n, 1)
        phases["outside"] = round(1e6 * max(wall_seconds - self.step_seconds, 0.0) / n, 1)
        return {
            "num_steps": self.num_steps,
            "reqs_per_step": round(reqs, 2),
            "host_us_per_step": round(1e6 * host / n, 1),
            "host_us_per_req": round(1e6 * host / n / max(reqs, 1e-9), 2),
            "device_wait_frac": round(min(wait / wall, 1.0), 4),
            "device_busy_frac": round(min(busy / wall, 1.0), 4),
            "device_busy_method": "cuda-events" if self._cuda and self.events else "execute-time",
            "phase_us_per_step": phases,
            "graph_replays_per_step": round(self.num_replays / n, 2),
            "eager_forwards_per_step": round(self.num_eager / n, 2),
            "eager_us_per_step": round(1e6 * self.eager_seconds / n, 1),
            # inside the phases above, wherever a collection struck: Python's cyclic collector, per step and in all
            "gc_us_per_step": round(1e6 * sum(self.gc_seconds) / n, 1),
            "gc_collections": list(self.gc_counts),
            "gc_full_ms": round(1e3 * self.gc_seconds[2] / max(self.gc_counts[2], 1), 2),
        }


def host_speed_us(repeats: int = 5, size: int = 20_000) -> float:
    """The best of `repeats` timings of a fixed pure-Python workload (a dict of `size` small lists built and read
    back), in µs: how fast the host runs Python right now. `bench offline --calibrate-host` times it before and after
    every level. On the H200's host it took 1.8 to 6.0 ms from one level to the next, and a level's tokens per
    second moved with it (every phase of a step is Python on the host): compare levels whose calibrations agree."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        d = {i: [i, i + 1] for i in range(size)}
        sum(len(v) for v in d.values())
        best = min(best, time.perf_counter() - t0)
    return round(1e6 * best, 1)

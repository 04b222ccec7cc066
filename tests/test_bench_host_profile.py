"""`bench offline --profile-host`: the wrappers' arithmetic on a fake engine with a fake clock, that they leave
nothing behind, and the fields and their sanity on the demo checkpoint."""

import json
from types import SimpleNamespace

import pytest

from sparkspec.bench.host_profile import HostProfiler
from sparkspec.engine import step_io


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeScheduler:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def schedule(self):
        self.clock.now += 10e-6
        return SimpleNamespace(scheduled=[1, 2, 3, 4])  # 4 requests per step

    def release_after_step(self):
        self.clock.now += 1e-6
        return []


class FakeGraphs:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def run(self):  # a graph replay
        self.clock.now += 6e-6


class FakeRunner:
    device = SimpleNamespace(type="cpu")

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

        self.graphs = FakeGraphs(clock)
        self.num_calls = 0

    def forward(self):
        self.clock.now += 6e-6

    def execute(self):
        self.clock.now += 24e-6  # pack and launch
        self.num_calls += 1
        (self.forward if self.num_calls % 2 else self.graphs.run)()  # eager on odd steps, a graph on even ones
        d = step_io.Download()
        d.fetch()  # the copy back: patched to take 50 us below
        return None


class FakeEngine:
    def __init__(self, clock: Clock) -> None:
        self.clock, self.scheduler, self.runner, self.spec = clock, FakeScheduler(clock), FakeRunner(clock), None

    def step(self):
        self.scheduler.schedule()
        self.runner.execute()
        self.commit()
        self.scheduler.release_after_step()
        self.emit()
        self.clock.now += 4e-6  # unwrapped work inside the step
        return []

    def commit(self):
        self.clock.now += 20e-6

    def emit(self):
        self.clock.now += 5e-6


def test_profiler_arithmetic_and_detach(monkeypatch):
    clock = Clock()
    engine = FakeEngine(clock)

    def slow_fetch(self):
        clock.now += 50e-6
        return {}

    monkeypatch.setattr(step_io.Download, "fetch", slow_fetch)
    prof = HostProfiler(clock)
    with prof.attach(engine):
        assert "step" in vars(engine) and "execute" in vars(engine.runner)
        t0 = clock.now
        for _ in range(10):
            engine.step()
            clock.now += 100e-6  # the caller's loop between steps
        wall = clock.now - t0
    assert "step" not in vars(engine) and "schedule" not in vars(engine.scheduler)
    assert step_io.Download.fetch is slow_fetch  # the class attribute is restored
    s = prof.summary(wall)
    step_us = 10 + 30 + 50 + 20 + 1 + 5 + 4
    assert s["num_steps"] == 10 and s["reqs_per_step"] == 4
    assert s["host_us_per_step"] == pytest.approx(step_us - 50, abs=0.2)
    assert s["host_us_per_req"] == pytest.approx((step_us - 50) / 4, abs=0.1)
    assert s["device_wait_frac"] == pytest.approx(50 / (step_us + 100), abs=1e-3)
    assert s["device_busy_frac"] == pytest.approx(80 / (step_us + 100), abs=1e-3)  # cpu: time in execute
    ph = s["phase_us_per_step"]
    assert ph["schedule"] == pytest.approx(10) and ph["commit"] == pytest.approx(20)
    assert ph["other"] == pytest.approx(4, abs=0.2) and ph["outside"] == pytest.approx(100, abs=0.2)
    assert s["graph_replays_per_step"] == 0.5 and s["eager_forwards_per_step"] == 0.5
    assert s["eager_us_per_step"] == pytest.approx(3, abs=0.1)  # 6 us on every other step
    assert "forward" not in vars(engine.runner) and "run" not in vars(engine.runner.graphs)


class AheadEngine(FakeEngine):
    """Async scheduling's shape: the step reads the step launched before it (`PendingFetch.wait`) outside the
    runner's execute."""

    def step(self):
        self.scheduler.schedule()
        self.runner.execute()
        step_io.PendingFetch.wait(None)  # patched to take 70 us below
        self.commit()
        self.scheduler.release_after_step()
        self.emit()
        self.clock.now += 4e-6
        return []


def test_a_wait_outside_execute_is_not_other(monkeypatch):
    """The read of a step launched ahead waits outside `execute`: it is device wait, not unwrapped host work (it
    was counted in `other`, which then grew with the device's step time)."""
    clock = Clock()
    engine = AheadEngine(clock)

    def fetch(self):
        clock.now += 50e-6
        return {}

    def wait(self):
        clock.now += 70e-6
        return {}

    monkeypatch.setattr(step_io.Download, "fetch", fetch)
    monkeypatch.setattr(step_io.PendingFetch, "wait", wait)
    prof = HostProfiler(clock)
    with prof.attach(engine):
        t0 = clock.now
        for _ in range(10):
            engine.step()
        wall = clock.now - t0
    assert step_io.PendingFetch.wait is wait
    s = prof.summary(wall)
    ph = s["phase_us_per_step"]
    assert ph["device_wait"] == pytest.approx(120, abs=0.2)
    assert ph["other"] == pytest.approx(4, abs=0.2)
    step_us = 10 + 30 + 50 + 70 + 20 + 1 + 5 + 4
    assert s["host_us_per_step"] == pytest.approx(step_us - 120, abs=0.2)


def test_profile_host_on_the_demo(tmp_path, capsys):
    import gc

    from sparkspec.cli import main
    from sparkspec.paths import DEFAULT_MODEL

    out, trace = tmp_path / "b.json", tmp_path / "trace.json"
    rc = main(["bench", "offline", "--model", str(DEFAULT_MODEL), "--settings", "none,dspark:adaptive",
               "--concurrency", "1,2", "--output-len", "8", "--min-requests", "2", "--requests-per-client", "1",
               "--max-prompt-tokens", "48", "--num-prompts", "4", "--profile-host", "--json", str(out),
               "--trace-budget", str(trace)])
    assert rc == 0
    assert gc.get_freeze_count() == 0  # each setting's engine was frozen after its start, and thawed when released
    captured = capsys.readouterr()
    assert "host us/step" in captured.out and "gc us/step" in captured.out
    # the budget's trace: one entry per drafting level, each decision an arm with its k, each filed step timed
    levels = json.loads(trace.read_text())
    assert [(t["setting"], t["concurrency"]) for t in levels] == [("dspark adaptive", 1), ("dspark adaptive", 2)]
    assert "budget trace dspark adaptive c=1:" in captured.err
    for t in levels:
        decided = [e for e in t["events"] if "decided" in e]
        filed = [e for e in t["events"] if "filed" in e]
        assert decided and all((e["k"] > 0) == (e["decided"] == "spec") for e in decided)
        assert all(e["probe"] is None or e["probe"] == e["decided"] != e["best"] for e in decided)
        assert all(e["ms"] > 0 and e["filed"] in ("plain", "spec") for e in filed)
        # every step is timed: filed under an arm, or not, with why (a step opens at each decision)
        unfiled = [e for e in t["events"] if "unfiled" in e]
        assert all(e["unfiled"] in ("prompt", "transition", "skipped") and e["ms"] >= 0 for e in unfiled)
        joined = [e for e in t["events"] if "joined" in e]  # steps that carried a request joining (`JoinCosts`)
        assert all(e["chunks"] >= 1 and e["joined"] in ("plain", "spec") for e in joined)
        assert all(e["chunks"] == 0 or "chunks_ms" in e for e in filed)  # (less their cost: `StepLog`)
        assert len(filed) + len(unfiled) + len(joined) >= len(decided) - 1
    data = json.loads(out.read_text())
    assert data["meta"]["profile_host"] is True
    rows = data["results"]
    assert len(rows) == 4
    for r in rows:
        assert 2 <= r["num_steps"] <= r["output_tokens"] + r["num_requests"]
        assert 1 <= r["reqs_per_step"] <= r["concurrency"]
        # host time is part of the wall time (duration_s is rounded to 1 ms in the JSON)
        assert 0 < r["host_us_per_req"] <= r["host_us_per_step"] + 0.1
        assert r["host_us_per_step"] <= 1e6 * (r["duration_s"] + 5e-4) / r["num_steps"]
        assert r["host_us_per_req"] == pytest.approx(r["host_us_per_step"] / r["reqs_per_step"], rel=0.01)
        assert 0 <= r["device_wait_frac"] <= r["device_busy_frac"] <= 1
        ph = r["phase_us_per_step"]
        assert all(v >= 0 for v in ph.values()) and ph["execute"] > 0 and ph["schedule"] > 0
        if r["setting"] != "none":
            assert ph["choose"] > 0 and ph["propose_plan"] > 0
        assert len(r["gc_collections"]) == 3 and r["gc_us_per_step"] >= 0
        assert "budget_trace" not in r  # the trace goes to its own file


def test_the_trace_summary_counts_each_kind_of_step():
    from sparkspec.bench.offline import summarize_trace

    events = [{"decided": "plain", "probe": None}, {"decided": "spec", "probe": "spec"},
              {"filed": "plain", "ms": 4.0, "tokens": 256, "chunks": 0},
              {"filed": "plain", "ms": 6.0, "tokens": 250, "chunks": 4, "chunks_ms": 1.2},
              {"joined": "plain", "ms": 5.0, "chunks": 3}, {"unfiled": "transition", "ms": 9.0}]
    assert summarize_trace(events) == ("1 plain; 1 probe spec; filed plain 2 x 5.00 ms, 253.0 tokens (1 less their "
                                       "chunks); joined plain 1 x 5.00 ms, 3.0 chunks; not filed 1 transition (9 ms "
                                       "in all)")


def test_without_the_flag_rows_have_no_profile(tmp_path):
    from sparkspec.cli import main
    from sparkspec.paths import DEFAULT_MODEL

    out = tmp_path / "b.json"
    rc = main(["bench", "offline", "--model", str(DEFAULT_MODEL), "--settings", "none", "--concurrency", "1",
               "--output-len", "4", "--min-requests", "1", "--requests-per-client", "1", "--max-prompt-tokens", "48",
               "--num-prompts", "2", "--json", str(out)])
    assert rc == 0
    row = json.loads(out.read_text())["results"][0]
    assert "host_us_per_step" not in row and "phase_us_per_step" not in row


def test_profiler_times_the_cyclic_collector_while_attached():
    """Collections inside the block are counted per generation and timed; the callback goes with the block."""
    import gc

    prof = HostProfiler()
    engine = FakeEngine(Clock())
    with prof.attach(engine):
        gc.collect(0)
        gc.collect(2)
    assert prof.gc_counts[0] >= 1 and prof.gc_counts[2] >= 1 and sum(prof.gc_seconds) > 0
    assert prof._gc_callback not in gc.callbacks
    gc.collect()
    assert prof.gc_counts[2] == 1  # nothing counted after the block


def test_freeze_startup_heap_moves_live_objects_out_of_collections():
    import gc

    from sparkspec.engine.llm import freeze_startup_heap

    threshold = gc.get_threshold()
    try:
        assert freeze_startup_heap() == gc.get_freeze_count() > 1000
        assert gc.get_threshold() == (max(threshold[0], 50_000), *threshold[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
    assert gc.get_freeze_count() == 0

"""`sparkspec bench budget`: the adaptive budget driven on a fake clock, its calls timed warm and with cold caches."""

from __future__ import annotations

import json

from sparkspec.bench.budget_host import medians
from sparkspec.cli import main


def test_bench_budget_table_and_json(tmp_path, capsys):
    out = tmp_path / "budget.json"
    rc = main(["bench", "budget", "--workloads", "c1-plain", "--steps", "400", "--warmup", "1500", "--rounds", "1",
               "--evict-mb", "2", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| workload | coast | caches |" in printed and printed.count("| c1-plain |") == 4
    data = json.loads(out.read_text())
    assert data["meta"]["kind"] == "budget" and data["meta"]["rounds"] == 1
    rows = {(r["coast"], r["caches"]): r for r in data["results"]}
    assert set(rows) == {("on", "warm"), ("on", "cold"), ("off", "warm"), ("off", "cold")}
    for r in rows.values():
        assert r["rounds"] == 1 and r["steps"] == 400
        parts = [r[f"{c}_us"] for c in ("step_boundary", "next_num_drafts", "note_step", "note_tokens")]
        assert all(p > 0 for p in parts) and abs(r["total_us"] - sum(parts)) < 0.05
    # without coasting every decision reads the model; with it, only the probes' (a settled plain stretch at c = 1)
    assert rows[("off", "warm")]["full_decisions"] == rows[("off", "cold")]["full_decisions"] == 400
    assert rows[("on", "warm")]["full_decisions"] == rows[("on", "cold")]["full_decisions"] < 400 / 8
    # the fake clock makes the decisions: the same whatever the caches, and the same with coasting off (it only
    # repeats a decision that could not differ); the probes draft a few steps
    shares = {r["drafting_share"] for r in rows.values()}
    assert len(shares) == 1 and 0 < shares.pop() < 0.05


def test_bench_budget_rejects_bad_input(capsys):
    assert main(["bench", "budget", "--coast", "maybe"]) == 2
    assert "--coast 'maybe'" in capsys.readouterr().err
    assert main(["bench", "budget", "--workloads", "c3"]) == 2
    assert "--workloads 'c3'" in capsys.readouterr().err
    assert main(["bench", "budget", "--steps", "0"]) == 2
    assert "--steps 0" in capsys.readouterr().err


def test_bench_budget_medians_over_rounds():
    """Each time column is the median of the rounds' (the total too, not the sum of the parts' medians)."""
    rows = [{"workload": "c1-plain", "coast": "on", "caches": "cold", "round": i, "step_boundary_us": b,
             "next_num_drafts_us": n, "note_step_us": 1.0, "note_tokens_us": 1.0, "total_us": b + n + 2.0,
             "full_decisions": 7} for i, (b, n) in enumerate([(10.0, 9.0), (12.0, 5.0), (11.0, 10.0)])]
    (m,) = medians(rows)
    assert (m["step_boundary_us"], m["next_num_drafts_us"], m["total_us"]) == (11.0, 9.0, 21.0)
    assert m["rounds"] == 3 and m["full_decisions"] == 7 and "round" not in m

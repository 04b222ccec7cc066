"""`bench offline --rounds N`: the settings' order rotates each round and each setting keeps its best round."""

import argparse

import sparkspec.bench.offline as offline


def test_rounds_rotate_the_order_and_keep_each_settings_best(monkeypatch):
    orders, speed = [], {("none", 0): 10.0, ("none", 1): 30.0, ("dspark fixed", 0): 25.0, ("dspark fixed", 1): 5.0,
                         ("dspark adaptive", 0): 7.0, ("dspark adaptive", 1): 8.0}

    def fake_run(args):
        orders.append(args.settings)
        r = len(orders) - 1
        return [{"setting": offline.Setting.parse(t).label, "concurrency": c,
                 "tok_s_total": speed[(offline.Setting.parse(t).label, r)] + c}
                for t in args.settings.split(",") for c in (1, 4)]

    monkeypatch.setattr(offline, "run_offline", fake_run)
    args = argparse.Namespace(settings="none,dspark:fixed,dspark:adaptive", rounds=2, process_per_setting=False)
    best, every = offline.run_rounds(args)
    assert orders == ["none,dspark:fixed,dspark:adaptive", "dspark:fixed,dspark:adaptive,none"]
    assert len(every) == 12 and sorted({row["round"] for row in every}) == [0, 1]
    assert [(row["setting"], row["concurrency"], row["round"]) for row in best] == [
        ("none", 1, 1), ("none", 4, 1), ("dspark fixed", 1, 0), ("dspark fixed", 4, 0),
        ("dspark adaptive", 1, 1), ("dspark adaptive", 4, 1)]
    assert best[0]["tok_s_total"] == 31.0


def test_one_round_keeps_every_row_as_it_ran(monkeypatch):
    """The default (one round) is the rows as they ran: a setting given twice keeps both of its rows."""
    monkeypatch.setattr(offline, "run_offline", lambda args: [
        {"setting": offline.Setting.parse(t).label, "concurrency": 1, "tok_s_total": float(i)}
        for i, t in enumerate(args.settings.split(","))])
    best, every = offline.run_rounds(argparse.Namespace(settings="none,none", rounds=1, process_per_setting=False))
    assert best == every and [row["tok_s_total"] for row in best] == [0.0, 1.0]


def test_rounds_below_one_is_a_usage_error(tmp_path, capsys):
    from sparkspec.cli import main

    assert main(["bench", "offline", "--model", str(tmp_path), "--rounds", "0"]) == 2
    assert "--rounds 0" in capsys.readouterr().err


def test_paired_ratios_compare_each_round_with_its_best_rival():
    """Round by round, each setting over the best other setting of that round; median, min and max over rounds. A
    setting that is lucky once (best-of-N would take its 30 against the rival's 20) reads as the median of its
    pairings."""
    every = [{"setting": s, "concurrency": 4, "round": r, "tok_s_total": v}
             for r, vals in enumerate([(10.0, 20.0, 9.0), (30.0, 20.0, 33.0), (10.0, 12.0, 11.0)])
             for s, v in zip(("none", "fixed", "adaptive"), vals)]
    every.append({"setting": "none", "concurrency": 1, "round": 0, "tok_s_total": 5.0})  # no rival: left out
    got = {r["setting"]: r for r in offline.paired_ratios(every)}
    assert set(got) == {"none", "fixed", "adaptive"} and all(r["concurrency"] == 4 for r in got.values())
    assert got["adaptive"] == {"setting": "adaptive", "concurrency": 4, "rounds": 3, "median": 0.917, "min": 0.45,
                               "max": 1.1, "vs": {"none": {"median": 1.1, "min": 0.9, "max": 1.1},
                                                  "fixed": {"median": 0.917, "min": 0.45, "max": 1.65}}}
    assert got["none"]["median"] == 0.833 and got["fixed"]["max"] == 2.0
    table = offline.format_ratios(list(got.values()))
    assert "0.92 [0.45, 1.10]" in table and table.splitlines()[0].split() == ["c=4"]
    against = offline.format_ratios(list(got.values()), against=True).splitlines()
    assert len(against) == 1 + 6 and any(line.split()[:3] == ["adaptive", "/", "fixed"] and "0.92 [0.45, 1.65]" in line
                                         for line in against)


def test_paired_ratios_against_each_rival_do_not_lean_on_a_tie():
    """Adaptive runs at 10 tokens/s in every round; plain decoding and fixed k each swing ±10 % around it, apart.
    Over the best rival of each round adaptive reads 9 % behind (the larger of two draws); against each rival alone
    it reads even."""
    every = [{"setting": s, "concurrency": 16, "round": r, "tok_s_total": v}
             for r, (none, fixed) in enumerate(((11.0, 9.0), (9.0, 11.0), (9.0, 9.0), (11.0, 11.0), (10.0, 10.0)))
             for s, v in (("none", none), ("fixed", fixed), ("adaptive", 10.0))]
    got = {r["setting"]: r for r in offline.paired_ratios(every)}["adaptive"]
    assert got["median"] == 0.909
    assert got["vs"]["none"]["median"] == 1.0 and got["vs"]["fixed"]["median"] == 1.0

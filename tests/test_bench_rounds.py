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

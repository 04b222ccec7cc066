"""`sparkspec bench grammar`: the table and JSON of the host cost of structured output's masks."""

from __future__ import annotations

import json

from sparkspec.cli import main


def test_bench_grammar_writes_rows(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert main(["bench", "grammar", "--tokenizers", "demo", "--batch-sizes", "1,3", "--num-drafts", "0,2",
                 "--repeats", "2", "--json", str(out)]) == 0
    assert "| tokenizer |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["results"]
    assert [(r["batch"], r["drafts"]) for r in rows] == [(1, 0), (1, 2), (3, 0), (3, 2)]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["vocab"] > 1000
        assert abs(r["us_per_request"] * r["batch"] - 1000 * r["ms_per_step"]) <= 0.5 + 0.05 * r["batch"]


def test_bench_grammar_bad_list_is_exit_2(capsys):
    assert main(["bench", "grammar", "--batch-sizes", "1,x"]) == 2
    assert "sparkspec bench grammar" in capsys.readouterr().err

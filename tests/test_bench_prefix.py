"""`sparkspec bench prefix`: a chat's second turn with prefix caching on and off (no timing is asserted)."""

from __future__ import annotations

import json

from sparkspec.cli import main


def test_bench_prefix_rows(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["bench", "prefix", "--spec", "none", "--prefix-tokens", "200", "--output-len", "3",
                 "--device", "cpu", "--json", str(out)]) == 0
    assert "| method |" in capsys.readouterr().out
    on, off = json.loads(out.read_text())["results"]
    assert on["prefix_caching"] and not off["prefix_caching"]
    assert on["turn1_tokens"] <= 200 and on["turn2_tokens"] > on["shared_tokens"] >= on["turn1_tokens"] - 1
    assert 0 < on["turn2_cached_tokens"] <= on["shared_tokens"] and off["turn2_cached_tokens"] == 0
    assert on["ttft1_s"] > 0 and on["ttft2_s"] > 0

"""`sparkspec bench latency` runs end to end on CPU (tiny configs): rows, JSON, the speculative split, and the
transformers comparison on the same weights."""

from __future__ import annotations

import json

import pytest
import torch

from sparkspec.bench.latency import step_bytes, transformers_pair
from sparkspec.cli import main
from sparkspec.config import ModelConfig
from sparkspec.models.forward_batch import forward_sequences


def run(args, tmp_path) -> list[dict]:
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--dtype", "float32", "--input-len", "12", "--output-len", "6",
                 "--json", str(out), *args]) == 0
    return json.loads(out.read_text())["results"]


def test_plain_rows(tmp_path):
    rows = run(["--preset", "tiny", "--batch-sizes", "1,3"], tmp_path)
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["ms_per_step"] > 0 and r["tok_s"] > 0 and r["x_floor"] > 0 for r in rows)


def test_speculative_rows_split_draft_and_verify(tiny_checkpoint_with_drafters, tmp_path):
    rows = run(["--model", str(tiny_checkpoint_with_drafters), "--batch-sizes", "2", "--spec", "dspark",
                "--num-spec-tokens", "3"], tmp_path)
    r = rows[0]
    assert r["tau"] >= 1 and r["verify_ms"] > 0 and r["draft_ms"] >= 0 and r["draft_share"] >= 0


def test_transformers_pair_shares_weights():
    pytest.importorskip("transformers")
    cfg = ModelConfig.preset("tiny")
    hf, ours = transformers_pair(cfg, torch.device("cpu"), torch.float32)
    ids = torch.randint(2, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(forward_sequences(ours, ids, [24]).logits, hf(ids.unsqueeze(0)).logits[0],
                                   rtol=0, atol=1e-4)


def test_floor_counts_more_experts_and_kv_for_bigger_batches():
    from sparkspec.models.deepseek_v4 import DeepseekV4Model

    with torch.device("meta"):
        model = DeepseekV4Model(ModelConfig.preset("bench-1b"))
    assert step_bytes(model, 1, 512) < step_bytes(model, 8, 512) < step_bytes(model, 64, 512)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert step_bytes(model, 1, 512) < 0.5 * total  # one token reads 4 of 32 experts per layer, not all of them

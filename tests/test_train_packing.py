"""The target trainer's batch: windows cut at document starts (document masking), the numpy batch build, the
held-out loss in bits per byte, and the torch.compile'd op references."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sparkspec.config import ModelConfig
from sparkspec.models.cache import KVCache
from sparkspec.models.forward_batch import build_batch, forward_sequences, sequences_batch
from sparkspec.ops import registry
from sparkspec.ops.registry import compiled_native
from sparkspec.train.target import IGNORE, bits_per_byte, evaluate_lm, init_target, pack_windows

BOS = 0


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.preset("tiny")
    cfg.torch_dtype = "float32"
    return init_target(cfg, 0).eval()


def stream_of(docs: list[list[int]]) -> np.ndarray:
    return np.asarray([t for d in docs for t in [BOS, *d]], dtype=np.uint16)


def test_windows_are_cut_before_every_document_start():
    stream = stream_of([[5, 6, 7], [8, 9], [10, 11, 12, 13]])  # 0 5 6 7 0 8 9 0 10 11 12 13
    b = pack_windows(stream, np.array([1, 4]), 6, BOS)
    # window 1: 5 6 7 | 0 8 9   (labels 6 7 IGNORE | 8 9 0->IGNORE)
    # window 2: 0 8 9 | 0 10 11 (labels 8 9 IGNORE | 10 11 12)
    assert b.lengths.tolist() == [3, 3, 3, 3]
    assert b.ids.tolist() == [5, 6, 7, 0, 8, 9, 0, 8, 9, 0, 10, 11]
    assert b.labels.tolist() == [6, 7, IGNORE, 8, 9, IGNORE, 8, 9, IGNORE, 10, 11, 12]
    assert b.num_targets == 9


def test_without_bos_a_window_is_one_sequence():
    stream = np.arange(20, dtype=np.uint16)
    b = pack_windows(stream, np.array([0, 5]), 8, None)
    assert b.lengths.tolist() == [8, 8]
    assert b.labels.tolist() == list(range(1, 9)) + list(range(6, 14))


def test_packed_loss_is_the_documents_losses_computed_apart(model):
    """Document masking: no row of a packed batch sees another document, and each starts at position 0."""
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (9, 17, 6)]
    stream = stream_of(docs)
    b = pack_windows(stream, np.array([0]), len(stream) - 1, BOS)
    with torch.no_grad():
        packed = b.loss(model, reduction="sum")
        alone = 0.0
        for d in docs:
            ids = torch.tensor([BOS, *d])
            logits = forward_sequences(model, ids[:-1], [len(d)]).logits
            alone += F.cross_entropy(logits, ids[1:], reduction="sum")
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-4)


def test_sequences_batch_equals_build_batch(model):
    lengths = [5, 12, 1, 33]
    ids = torch.randint(0, 60, (sum(lengths),))
    cache, tables = KVCache.for_lengths(model, lengths)
    assert [len(t) for t in tables] == [1, 1, 1, 3] and cache.num_blocks == 6
    fast = sequences_batch(cache, ids, tables, lengths, None, model.compress_ratios)
    slow = build_batch(cache, ids, tables, [0] * len(lengths), lengths, None, model.compress_ratios)
    for name in ("input_ids", "positions", "req_idx", "cu_seqlens_q", "seq_lens", "block_tables"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    assert fast.emit_rows.keys() == slow.emit_rows.keys()
    for r in fast.emit_rows:
        assert torch.equal(fast.emit_rows[r], slow.emit_rows[r])
    assert fast.max_seq_len == slow.max_seq_len and fast.logits_rows is None


def test_heldout_loss_in_bits_per_byte(model, tmp_path):
    stream = stream_of([list(range(4, 40)), list(range(5, 50))])
    np.save(tmp_path / "heldout.npy", stream)
    (tmp_path / "counts.json").write_text(json.dumps({"heldout_tokens": 400, "heldout_bytes": 1000}))
    loss = evaluate_lm(model, stream, 2, 16, torch.device("cpu"), BOS)
    assert 0 < loss < 10
    assert bits_per_byte(2.0, tmp_path / "heldout.npy") == pytest.approx(2.0 / np.log(2) * 0.4, abs=1e-4)
    assert bits_per_byte(2.0, tmp_path / "other.npy") is None


def test_compiled_reference_matches_and_falls_back(monkeypatch, caplog):
    x = torch.randn(6, 4, 8, requires_grad=True)
    fn = torch.randn(24, 32)
    args = (fn, torch.ones(3), torch.zeros(24), 1e-6, 1e-6, 5)
    ref = registry._NATIVE["mhc_pre"](x, *args)
    registry._COMPILED.pop("mhc_pre", None)
    got = compiled_native("mhc_pre", backend="eager")(x, *args)  # dynamo traces the reference
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    got[0].sum().backward()
    assert x.grad is not None

    def broken(*a, **k):
        def run(*a, **k):
            raise RuntimeError("no compiler here")
        return run

    registry._COMPILED.pop("mhc_pre", None)
    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="sparkspec.ops"):
        call = compiled_native("mhc_pre")
        first, second = call(x, *args), call(x, *args)
    registry._COMPILED.pop("mhc_pre", None)
    torch.testing.assert_close(first[0], ref[0])
    torch.testing.assert_close(second[0], ref[0])
    assert sum("torch.compile of op mhc_pre failed" in r.message for r in caplog.records) == 1


def test_native_table_compiles_only_accelerator_tensors():
    table = registry.OpTable()
    table.set_native(True, compiled=("mhc_post",))
    assert table.resolve("mhc_post", "cpu") is registry._NATIVE["mhc_post"]
    assert table.resolve("mhc_post", "cuda").__name__ == "compiled_mhc_post"
    assert table.resolve("mhc_pre", "cuda") is registry._NATIVE["mhc_pre"]
    registry._COMPILED.pop("mhc_post", None)


def test_train_target_end_to_end_reports_heldout_bits_per_byte(tmp_path):
    """`sparkspec train target` on a tiny stream: a loadable checkpoint, a log with tokens/s and held-out bits per
    byte; `write=False` (scaling runs) writes nothing."""
    from sparkspec.loading.checkpoint import load_checkpoint
    from sparkspec.train.target import train_target

    g = np.random.default_rng(0)
    docs = [list(g.integers(4, 60, size=int(n))) for n in g.integers(20, 90, size=40)]
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "pretrain.npy", stream_of(docs[:34]))
    np.save(data / "heldout.npy", stream_of(docs[34:]))
    held = stream_of(docs[34:]).size
    (data / "counts.json").write_text(json.dumps({"heldout_tokens": held, "heldout_bytes": 3 * held}))
    cfg = ModelConfig.preset("tiny")
    res = train_target(cfg, data / "pretrain.npy", tmp_path / "out", None, steps=6, minutes=None, batch_size=2,
                       seq_len=32, lr=3e-3, device="cpu", save_every=0)
    assert res["steps"] == 6 and res["tokens_seen"] == 6 * 64 and res["tokens_per_s"] > 0
    assert res["val_bits_per_byte"] == pytest.approx(res["val_loss"] / np.log(2) / 3, abs=1e-3)
    log = json.loads((tmp_path / "out" / "train_log_target.json").read_text())
    assert log["val_loss"] == res["val_loss"] and "tokens_per_s" in log["log"][-1]
    assert load_checkpoint(tmp_path / "out", device="cpu").config.num_hidden_layers == cfg.num_hidden_layers
    dry = train_target(ModelConfig.preset("tiny"), data / "pretrain.npy", tmp_path / "dry", None, steps=2,
                       minutes=None, batch_size=2, seq_len=32, lr=3e-3, device="cpu", save_every=0, write=False)
    assert dry["val_loss"] > 0 and not (tmp_path / "dry").exists()

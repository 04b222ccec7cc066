"""The target model: incremental decoding == full forward, ragged batches, cache rollback, drafter taps."""

from __future__ import annotations

import pytest
import torch
from conftest import Caches, make_model, random_ids, run_full

TOL = 1e-4
SEQ_LEN = 70  # window 8, ratios 4 and 8: 17 blocks of 4, 8 blocks of 8, many windows


@pytest.fixture(scope="module")
def model():
    return make_model(seed=0)


@pytest.fixture(scope="module")
def ids(model):
    return random_ids(SEQ_LEN, model.cfg.vocab_size, seed=1)


@pytest.fixture(scope="module")
def full_logits(model, ids):
    with torch.no_grad():
        return run_full(model, ids).logits  # [T, V]


def run_chunks(model, ids, chunks, caches=None):
    """Feed `ids` through one sequence's cache in consecutive chunks -> (logits of every position [T, V], caches)."""
    caches = caches or Caches(model)
    out, pos = [], caches.lengths[0]
    for n in chunks:
        out.append(caches.forward(ids[pos:pos + n], [n]).logits)
        pos += n
    return torch.cat(out), caches


def close(a, b, tol=TOL):
    torch.testing.assert_close(a, b, atol=tol, rtol=0)


@torch.no_grad()
def test_prefill_then_token_by_token_equals_full_forward(model, ids, full_logits):
    got, caches = run_chunks(model, ids, [13] + [1] * (SEQ_LEN - 13))
    assert caches.lengths == [SEQ_LEN]
    close(got, full_logits)


@torch.no_grad()
@pytest.mark.parametrize("chunks", [[1] * 20 + [50], [3, 5, 8, 1, 7, 16, 30], [32, 32, 6]])
def test_chunked_prefill_equals_full_forward(model, ids, full_logits, chunks):
    got, _ = run_chunks(model, ids, chunks)
    close(got, full_logits)


@torch.no_grad()
@pytest.mark.parametrize("block_size", [4, 8, 32])
def test_block_size_does_not_change_logits(model, ids, full_logits, block_size):
    """Block 4 and 8 hold less than one ratio-8 window; block 32 holds several: entry addressing is right."""
    got, _ = run_chunks(model, ids, [30, 1, 1, 38], Caches(model, block_size=block_size))
    close(got, full_logits)


@torch.no_grad()
def test_logits_rows_select_rows(model, ids, full_logits):
    out = run_full(model, ids, logits_rows=[0, 7, SEQ_LEN - 1])
    close(out.logits, full_logits[[0, 7, SEQ_LEN - 1]])  # GPU GEMMs of other shapes round differently


@torch.no_grad()
def test_ragged_batch_equals_one_at_a_time(model):
    lengths = [5, 37, 70, 1]
    seqs = [random_ids(n, model.cfg.vocab_size, seed=10 + i) for i, n in enumerate(lengths)]
    alone = [run_full(model, s).logits for s in seqs]
    caches = Caches(model, num_seqs=len(seqs))
    out = caches.forward(torch.cat(seqs), lengths).logits
    off = 0
    for n, want in zip(lengths, alone):
        close(out[off:off + n], want)
        off += n
    assert caches.lengths == lengths


@torch.no_grad()
def test_mixed_prefill_and_decode_batch(model, ids, full_logits):
    """One sequence decodes one token while another prefills a chunk, in the same forward."""
    other = random_ids(20, model.cfg.vocab_size, seed=3)
    caches = Caches(model, num_seqs=2)
    caches.forward(ids[:40], [40], seqs=[0])
    caches.forward(other[:9], [9], seqs=[1])
    out = caches.forward(torch.cat([ids[40:41], other[9:20]]), [1, 11]).logits
    close(out[0], full_logits[40])
    close(out[1:], run_full(model, other).logits[9:20])


@torch.no_grad()
@pytest.mark.parametrize("keep", [30, 32, 29], ids=["before-boundary", "on-boundary", "mid-block"])
def test_rollback_across_compression_boundary(model, ids, keep):
    """A rejected draft that crossed ratio-4 and ratio-8 boundaries leaves no trace once the sequence continues
    from `keep` (rollback is moving a length: nothing else is undone)."""
    clean, _ = run_chunks(model, ids, [keep, 1, 1, 9])
    _, caches = run_chunks(model, ids, [keep])
    garbage = random_ids(7, model.cfg.vocab_size, seed=99)  # positions keep .. keep+6 cross 32 and 36
    caches.forward(garbage, [7])
    caches.lengths[0] = keep
    after, _ = run_chunks(model, ids, [1, 1, 9], caches)
    assert torch.equal(after, clean[keep:])


@torch.no_grad()
@pytest.mark.parametrize("tap_layers", [(0,), (1,), (1, 2), (0, 3)])
def test_taps_are_layer_outputs_averaged_over_hc_streams(model, ids, tap_layers):
    seen = {}
    def keep(i, out):  # a layer followed by another returns (streams, that layer's attention pre)
        seen[i] = out[0] if isinstance(out, tuple) else out

    hooks = [model.layers[i].register_forward_hook(lambda m, a, out, i=i: keep(i, out)) for i in tap_layers]
    try:
        out = run_full(model, ids[:20], tap_layers=tap_layers)
    finally:
        for h in hooks:
            h.remove()
    T, H = 20, model.cfg.hidden_size
    assert out.taps.shape == (T, len(tap_layers), H)
    for k, i in enumerate(tap_layers):
        assert seen[i].shape == (T, model.cfg.hc_mult, H)
        close(out.taps[:, k], seen[i].float().mean(dim=1), tol=1e-6)


@torch.no_grad()
def test_no_taps_by_default(model, ids):
    out = run_full(model, ids[:10])
    assert out.taps is None and out.final_streams is None


@torch.no_grad()
def test_final_streams_are_the_residual_before_hc_head(model, ids):
    seen = {}
    hook = model.layers[-1].register_forward_hook(lambda m, a, out: seen.__setitem__("x", out))
    try:
        out = run_full(model, ids[:10], capture_final_streams=True)
    finally:
        hook.remove()
    n, H = model.cfg.hc_mult, model.cfg.hidden_size
    assert out.final_streams.shape == (10, n * H)
    close(out.final_streams, seen["x"].flatten(1), tol=0)
    close(model.logits_from_hidden(model.collapse(seen["x"])), out.logits, tol=1e-6)


@torch.no_grad()
def test_taps_do_not_change_logits(model, ids, full_logits):
    out = run_full(model, ids, tap_layers=(1, 2), capture_final_streams=True)
    close(out.logits, full_logits, tol=0)


@torch.no_grad()
def test_bf16_model_keeps_fp32_parameters_and_rope():
    m = make_model(seed=0).to(torch.bfloat16).keep_fp32()
    assert m.layers[0].hc_attn_fn.dtype == torch.float32 and m.layers[1].attn.attn_sink.dtype == torch.float32
    assert m.layers[0].attn.wq_a.weight.dtype == torch.bfloat16
    assert m.layers[1].attn.rotary.inv_freq.dtype == torch.float32
    ids = random_ids(20, m.cfg.vocab_size, seed=4)
    assert torch.isfinite(run_full(m, ids).logits).all()

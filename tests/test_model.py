"""The target model: incremental decoding == full forward, ragged batches, cache rollback, drafter taps."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, make_model, random_ids, run_full

from sparkspec.models.deepseek_v4 import Batch

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


def run_chunks(model, ids, chunks, cache=None):
    """Feed `ids` through one cache in consecutive chunks -> logits of every position [T, V]."""
    cache = cache or model.new_cache()
    out, pos = [], cache.num_tokens
    for n in chunks:
        piece = ids[pos:pos + n]
        out.append(model(piece, Batch([(0, n)], [pos], [cache])).logits)
        pos += n
    return torch.cat(out), cache


def close(a, b, tol=TOL):
    torch.testing.assert_close(a, b, atol=tol, rtol=0)


@torch.no_grad()
def test_prefill_then_token_by_token_equals_full_forward(model, ids, full_logits):
    got, cache = run_chunks(model, ids, [13] + [1] * (SEQ_LEN - 13))
    assert cache.num_tokens == SEQ_LEN
    close(got, full_logits)


@torch.no_grad()
@pytest.mark.parametrize("chunks", [[1] * 20 + [50], [3, 5, 8, 1, 7, 16, 30], [32, 32, 6]])
def test_chunked_prefill_equals_full_forward(model, ids, full_logits, chunks):
    got, _ = run_chunks(model, ids, chunks)
    close(got, full_logits)


@torch.no_grad()
def test_logits_rows_select_rows(model, ids, full_logits):
    rows = torch.tensor([0, 7, SEQ_LEN - 1], device=DEVICE)
    out = model(ids, Batch([(0, SEQ_LEN)], [0], [model.new_cache()]), logits_rows=rows)
    close(out.logits, full_logits[rows], tol=1e-6)


@torch.no_grad()
def test_ragged_batch_equals_one_at_a_time(model):
    lengths = [5, 37, 70, 1]
    seqs = [random_ids(n, model.cfg.vocab_size, seed=10 + i) for i, n in enumerate(lengths)]
    alone = [run_full(model, s).logits for s in seqs]
    caches = [model.new_cache() for _ in seqs]
    spans, off = [], 0
    for n in lengths:
        spans.append((off, off + n))
        off += n
    out = model(torch.cat(seqs), Batch(spans, [0] * len(seqs), caches)).logits
    for (s, e), want in zip(spans, alone):
        close(out[s:e], want)
    assert [c.num_tokens for c in caches] == lengths


@torch.no_grad()
def test_mixed_prefill_and_decode_batch(model, ids, full_logits):
    """One sequence decodes one token while another prefills a chunk, in the same forward."""
    other = random_ids(20, model.cfg.vocab_size, seed=3)
    c1, c2 = model.new_cache(), model.new_cache()
    run_chunks(model, ids, [40], cache=c1)
    run_chunks(model, other, [9], cache=c2)
    batch = Batch([(0, 1), (1, 12)], [40, 9], [c1, c2])
    out = model(torch.cat([ids[40:41], other[9:20]]), batch).logits
    close(out[0], full_logits[40])
    close(out[1:], run_full(model, other).logits[9:20])


@torch.no_grad()
@pytest.mark.parametrize("keep", [30, 32, 29], ids=["before-boundary", "on-boundary", "mid-block"])
def test_truncate_rollback_across_compression_boundary(model, ids, keep):
    """A rejected draft that crossed ratio-4 and ratio-8 boundaries leaves no trace after truncate."""
    clean, _ = run_chunks(model, ids, [keep, 1, 1, 9])
    cache = model.new_cache()
    run_chunks(model, ids, [keep], cache=cache)
    garbage = random_ids(7, model.cfg.vocab_size, seed=99)  # positions keep .. keep+6 cross 32 and 36
    model(garbage, Batch([(0, 7)], [keep], [cache]))
    cache.truncate(keep)
    assert cache.num_tokens == keep
    for lc in cache.layers:
        assert lc.kv.n == keep
        if lc.compressed is not None:
            assert lc.compressed.n == keep // lc.ratio
    after, _ = run_chunks(model, ids, [1, 1, 9], cache=cache)
    assert torch.equal(after, clean[keep:])


@torch.no_grad()
def test_truncate_beyond_cache_is_an_error(model, ids):
    _, cache = run_chunks(model, ids, [5])
    with pytest.raises(ValueError, match="cannot truncate to 6 tokens"):
        cache.truncate(6)


@torch.no_grad()
@pytest.mark.parametrize("tap_layers", [(0,), (1,), (1, 2), (0, 3)])
def test_taps_are_layer_outputs_averaged_over_hc_streams(model, ids, tap_layers):
    seen = {}
    hooks = [model.layers[i].register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out))
             for i in tap_layers]
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

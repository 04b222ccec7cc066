"""Paged caches: PagedRows behaves exactly like GrowingRows, blocks go back to the pool on truncate / free,
incremental decoding through the pools equals the full forward, exhausted pools raise OutOfBlocks, and the
engine's pools drain back to empty after finish, preemption and abort."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DEVICE, make_model, random_ids, run_full

from sparkspec.models.cache import BlockPool, CachePools, GrowingRows, OutOfBlocks, PagedRows, SequenceCache
from sparkspec.models.deepseek_v4 import Batch

WIDTH = 5


def pool(num_blocks=64, block_rows=4, dtype=torch.float32) -> BlockPool:
    return BlockPool(num_blocks, block_rows, WIDTH, dtype, DEVICE)


@pytest.fixture(scope="module")
def model():
    return make_model(seed=0)


@pytest.mark.parametrize("block_rows", [1, 3, 4, 16])
def test_paged_rows_equal_growing_rows(block_rows):
    rng = random.Random(block_rows)
    p = pool(block_rows=block_rows)
    paged, grown = PagedRows(p), GrowingRows(WIDTH, torch.float32, DEVICE, capacity=2)
    for step in range(200):
        op = rng.random()
        if op < 0.5:
            start = rng.randint(max(0, paged.n - 3), paged.n)  # append, or overwrite a short tail
            rows = torch.randn(rng.randint(1, 9), WIDTH, device=DEVICE)
            paged.write(start, rows)
            grown.write(start, rows)
        elif op < 0.7:
            n = rng.randint(0, paged.n)
            paged.truncate(n)
            grown.truncate(n)
        assert paged.n == grown.n
        assert len(paged.block_ids) == -(-paged.n // block_rows)  # no block held beyond the valid rows
        assert p.num_free_blocks == p.num_blocks - len(paged.block_ids)
        lo = rng.randint(0, paged.n)
        hi = rng.randint(lo, paged.n)
        assert torch.equal(paged.view(lo, hi), grown.view(lo, hi)), f"step {step}: view({lo}, {hi})"
        assert torch.equal(paged.view(), grown.view())


def test_truncate_and_free_return_blocks():
    p = pool(num_blocks=8, block_rows=4)
    a, b = PagedRows(p), PagedRows(p)
    a.write(0, torch.ones(10, WIDTH))  # 3 blocks
    b.write(0, torch.ones(4, WIDTH))  # 1 block
    assert p.num_free_blocks == 4
    a.truncate(8)
    assert p.num_free_blocks == 5 and len(a.block_ids) == 2
    a.truncate(5)
    assert p.num_free_blocks == 5  # 5 rows still need 2 blocks
    a.free()
    b.free()
    assert p.num_free_blocks == 8 and a.n == b.n == 0


def test_view_past_valid_rows_is_an_error():
    r = PagedRows(pool())
    r.write(0, torch.ones(3, WIDTH))
    with pytest.raises(IndexError, match="past the 3 valid rows"):
        r.view(0, 4)


def test_out_of_blocks_when_pool_is_exhausted():
    p = pool(num_blocks=2, block_rows=4)
    r = PagedRows(p)
    r.write(0, torch.ones(8, WIDTH))
    with pytest.raises(OutOfBlocks, match="exhausted"):
        r.write(8, torch.ones(1, WIDTH))
    r.truncate(4)
    r.write(4, torch.ones(4, WIDTH))  # a freed block is reusable


@torch.no_grad()
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_incremental_decode_equals_full_forward(model, block_size):
    ids = random_ids(70, model.cfg.vocab_size, seed=1)
    full = run_full(model, ids).logits
    pools = CachePools(model, block_size, lambda ratio: 200)
    caches = [SequenceCache(model, pools=pools) for _ in range(2)]  # two sequences interleave their blocks
    got = [[], []]
    for chunk in [13] + [1] * 10 + [7, 3] + [1] * 37:
        spans = [(0, chunk), (chunk, 2 * chunk)]
        starts = [c.num_tokens for c in caches]
        x = torch.cat([ids[s : s + chunk] for s in starts])
        logits = model(x, Batch(spans, starts, caches)).logits
        got[0].append(logits[:chunk])
        got[1].append(logits[chunk:])
    for g in got:
        torch.testing.assert_close(torch.cat(g), full, atol=1e-4, rtol=0)
    for c in caches:
        c.truncate(33)  # roll back across ratio-4 and ratio-8 boundaries
        c.free()
    assert pools.num_used_blocks == 0


@torch.no_grad()
def test_paged_rollback_matches_growing(model):
    ids = random_ids(40, model.cfg.vocab_size, seed=2)
    pools = CachePools(model, 4, lambda ratio: 64)
    outs = []
    for cache in (model.new_cache(), SequenceCache(model, pools=pools)):
        model(ids[:30], Batch([(0, 30)], [0], [cache]))
        model(random_ids(7, model.cfg.vocab_size, seed=9), Batch([(0, 7)], [30], [cache]))  # rejected drafts
        cache.truncate(30)
        outs.append(model(ids[30:], Batch([(0, 10)], [30], [cache])).logits)
    assert torch.equal(outs[0], outs[1])


def test_engine_pools_drain_after_finish_preemption_and_abort(tiny_checkpoint_with_drafters):
    from sparkspec.checkpoint import load_checkpoint
    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.kv_cache import cache_bytes_per_token
    from sparkspec.engine.llm_engine import LLMEngine
    from sparkspec.sampling_params import SamplingParams

    ckpt = load_checkpoint(tiny_checkpoint_with_drafters)
    per_block = 4 * sum(cache_bytes_per_token(ckpt.config).values())
    eng = LLMEngine(ckpt.model, ckpt.tokenizer, EngineConfig(
        block_size=4, kv_cache_memory=per_block * 12, max_num_seqs=4, max_num_batched_tokens=32,
        speculative="ngram", spec_budget="fixed"))
    pools, bm = eng.runner.pools, eng.scheduler.block_manager
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8, 9, 10, 5 + i, 6, 7] for i in range(5)]
    for p in prompts:
        eng.add_request(p, params)
    while eng.has_unfinished():
        eng.step()
        for seq in eng.scheduler.running:  # storage never exceeds the charge
            if seq.cache is not None:
                held = len(seq.cache.layers[0].kv.block_ids)
                assert held <= len(seq.block_ids) - bm.blocks_per_seq
    assert eng.scheduler.num_preemptions > 0
    assert pools.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    seq = eng.add_request(prompts[0], params)
    eng.step()
    assert pools.num_used_blocks > 0
    eng.abort_request(seq.request_id)
    assert pools.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks

"""Prefix caching in the block manager and the scheduler: plain Python, no torch. Hash chains, reference counts,
LRU eviction, whole-group registration, hits rounded to G, the MTP next-token key, admission waits for a
prefill under way, and preemption / abort of a sequence whose blocks others share."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from test_scheduler import run_step

from sparkspec.engine.block_manager import BlockManager, hit_granularity
from sparkspec.engine.scheduler import Scheduler, SchedulerConfig
from sparkspec.engine.sequence import Sequence


@dataclass
class Params:
    max_tokens: int = 4
    num_spec_tokens: int | None = None
    prompt_logprobs: int | None = None


def seq(i: int, ids: list[int], max_tokens: int = 4, **kw) -> Sequence:
    return Sequence(i, list(ids), Params(max_tokens, **kw))


def computed(bm: BlockManager, s: Sequence, n: int) -> Sequence:
    """`s` holding blocks for n computed positions (plus its pending token), registered."""
    bm.allocate(s, n)
    s.num_cached_tokens = n
    bm.register(s)
    return s


def check_accounting(bm: BlockManager, holders: list[Sequence]) -> None:
    """Every block is exactly one of: held (refcount = holders), evictable (cached), free (not cached)."""
    held: dict[int, int] = {}
    for s in holders:
        for b in s.block_ids:
            held[b] = held.get(b, 0) + 1
    for b in range(bm.num_blocks):
        assert bm.ref_counts[b] == held.get(b, 0)
        assert (b in bm.evictable) == (b not in held and b in bm.block_hashes)
        assert (b in bm.free_block_ids) == (b not in held and b not in bm.block_hashes)
    assert {bm.block_hashes[b] for b in bm.block_hashes} == set(bm.cached)
    assert all(bm.block_hashes[b] == h for h, b in bm.cached.items())


def test_granularity_is_the_lcm_of_block_size_and_ratios():
    assert hit_granularity(16, (4, 16)) == 16
    assert hit_granularity(16, (4, 128)) == 128
    assert hit_granularity(64, (4, 128)) == 128
    assert hit_granularity(16, ()) == 16
    with pytest.raises(ValueError, match="granularity"):
        BlockManager(8, 4, granularity=6)


@pytest.mark.parametrize("shared,expected", [(0, 0), (3, 0), (4, 4), (7, 4), (8, 8), (11, 8), (12, 12)])
def test_hit_is_whole_groups_of_the_matched_blocks_and_leaves_the_last_token(shared, expected):
    bm = BlockManager(32, 2, enable_prefix_caching=True, granularity=4)
    owner = computed(bm, seq(0, range(100, 113)), 12)  # 12 computed positions: 3 groups of 2 blocks
    other = seq(1, list(range(100, 100 + shared)) + [7] * (13 - shared))
    hit, blocks = bm.lookup(other)
    assert hit == expected and blocks == owner.block_ids[: expected // 2]
    same = seq(2, range(100, 112))  # the owner's first 12 tokens exactly: the last one is computed again
    assert bm.lookup(same)[0] == 8


def test_blocks_are_registered_a_whole_group_at_a_time_and_only_once():
    bm = BlockManager(32, 2, enable_prefix_caching=True, granularity=4)
    a = seq(0, range(10, 30))
    bm.allocate(a, 7)
    a.num_cached_tokens = 7  # group 0 (positions 0..3) complete, group 1 not
    bm.register(a)
    assert set(bm.block_hashes) == set(a.block_ids[:2])
    b = computed(bm, seq(1, range(10, 30)), 8)  # group 0 computed again: b's copy stays unregistered
    assert set(bm.block_hashes) == set(a.block_ids[:2]) | set(b.block_ids[2:4])  # b's group 1 is new
    hit, blocks = bm.lookup(seq(2, range(10, 30)))  # the same content, whoever computed it
    assert hit == 8 and blocks == a.block_ids[:2] + b.block_ids[2:4]
    check_accounting(bm, [a, b])


def test_shared_blocks_are_reference_counted_and_stay_cached_after_free():
    bm = BlockManager(12, 2, enable_prefix_caching=True, granularity=2)
    a = computed(bm, seq(0, range(10, 20)), 8)
    b = seq(1, list(range(10, 16)) + [1, 2, 3])
    hit, blocks = bm.lookup(b)
    assert hit == 6
    assert bm.can_allocate(b, b.num_tokens, blocks)
    bm.take(b, blocks)
    bm.allocate(b, b.num_tokens)
    assert b.block_ids[:3] == a.block_ids[:3] and all(bm.ref_counts[x] == 2 for x in blocks)
    check_accounting(bm, [a, b])
    bm.free(a)  # b keeps the shared blocks; a's own registered block is cached, nobody holds it
    check_accounting(bm, [b])
    assert list(bm.evictable) == [a.block_ids[3]] if a.block_ids else True
    bm.free(b)
    check_accounting(bm, [])
    assert bm.num_free_blocks == 12 and bm.usage == 0.0


def test_eviction_takes_plain_free_blocks_first_then_the_least_recently_used():
    bm = BlockManager(6, 2, enable_prefix_caching=True, granularity=2)
    a = computed(bm, seq(0, range(10, 30)), 4)  # blocks 0, 1 registered
    c = computed(bm, seq(1, range(50, 70)), 4)  # blocks 2, 3 registered
    bm.free(c)
    bm.free(a)  # free order: c's tail, c's head, a's tail, a's head: least recent first
    assert list(bm.evictable) == [3, 2, 1, 0] and list(bm.free_block_ids) == [4, 5]
    d = seq(2, range(80, 90))
    bm.allocate(d, 6)  # 3 blocks: the two plain ones, then the least recently used cached one (c's tail)
    assert d.block_ids == [4, 5, 3] and 3 not in bm.block_hashes
    assert bm.lookup(seq(3, range(50, 70)))[0] == 2  # c lost its second block: one block hit left
    assert bm.lookup(seq(4, range(10, 30)))[0] == 4
    check_accounting(bm, [d])


def test_taking_an_evictable_block_counts_against_the_free_blocks():
    bm = BlockManager(4, 2, enable_prefix_caching=True, granularity=2)
    bm.free(computed(bm, seq(0, range(10, 18)), 4))  # 2 cached blocks, nobody holds them: 4 free in all
    b = seq(1, list(range(10, 14)) + [1, 2, 3, 4])  # 8 tokens, hit 4: 2 shared + 2 new blocks
    hit, blocks = bm.lookup(b)
    assert hit == 4 and bm.num_free_blocks == 4
    assert bm.can_allocate(b, 8, blocks) and not bm.can_allocate(b, 9, blocks)  # 3 new blocks: only 2 left
    bm.take(b, blocks)
    bm.allocate(b, 8)
    assert bm.num_free_blocks == 0
    check_accounting(bm, [b])


def test_the_next_token_key_needs_the_token_after_the_hit_to_match():
    """MTP: a block's hash also covers the token after it (its row of the block's last position reads it)."""
    bm = BlockManager(32, 2, enable_prefix_caching=True, granularity=4, key_next_token=True)
    owner = computed(bm, seq(0, range(10, 30)), 12)  # registered through 12 (token 12 is known)
    assert bm.lookup(seq(1, list(range(10, 18)) + [99, 98, 97]))[0] == 4  # differs at 8: the row of 7 is not its
    assert bm.lookup(seq(2, list(range(10, 19)) + [99, 98]))[0] == 8
    plain = BlockManager(32, 2, enable_prefix_caching=True, granularity=4)
    computed(plain, seq(0, range(10, 30)), 12)
    assert plain.lookup(seq(1, list(range(10, 18)) + [99, 98, 97]))[0] == 8
    check_accounting(bm, [owner])


def test_off_means_no_hits_and_no_registration():
    bm = BlockManager(16, 2)
    a = computed(bm, seq(0, range(10, 20)), 8)
    assert not bm.block_hashes and bm.lookup(seq(1, range(10, 20))) == (0, [])
    bm.free(a)
    assert bm.num_free_blocks == 16 and not bm.evictable


# ---- through the scheduler (test_scheduler's fake runner commits what is scheduled) ----
def make(num_blocks=64, block_size=2, granularity=4, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, enable_prefix_caching=True,
                                                          granularity=granularity))


def test_admission_takes_the_hit_and_prefills_from_it():
    sched = make(max_num_batched_tokens=64)
    a = seq(0, range(10, 31))  # 21 tokens
    sched.add(a)
    outs = []
    while not a.is_finished:
        outs.append(run_step(sched))
    b = seq(1, list(range(10, 28)) + [1, 2, 3])  # shares 18 tokens: hit 16
    sched.add(b)
    out = run_step(sched)
    outs.append(out)
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(b, 5)]
    assert (out.num_queried_tokens, out.num_hit_tokens) == (21, 16)
    assert (sum(o.num_queried_tokens for o in outs), sum(o.num_hit_tokens for o in outs)) == (42, 16)


def test_samples_of_one_prompt_wait_for_the_first_prefill_then_share_it():
    sched = make(max_num_batched_tokens=8)  # a 20-token prompt takes 3 chunks
    prompt = list(range(10, 30))
    samples = [seq(i, prompt, max_tokens=3) for i in range(3)]
    for s in samples:
        sched.add(s)
    first = run_step(sched)
    assert [s.seq for s in first.scheduled] == [samples[0]]  # the others wait for its groups
    outs = [first]
    while not all(s.is_finished for s in samples):
        outs.append(run_step(sched))
    # each later sample: 16 of its 20 tokens (the last computed)
    assert sum(o.num_hit_tokens for o in outs) == 2 * 16
    bm = sched.block_manager
    check_accounting(bm, [])


def test_prompt_logprobs_requests_take_no_hit():
    sched = make()
    a = seq(0, range(10, 30))
    sched.add(a)
    while not a.is_finished:
        run_step(sched)
    b = seq(1, range(10, 30), prompt_logprobs=1)
    sched.add(b)
    out = run_step(sched)
    assert out.scheduled[0].num_tokens == 20 and out.num_hit_tokens == 0


def test_preempting_and_aborting_a_sequence_whose_blocks_others_share():
    sched = make(num_blocks=16, max_num_batched_tokens=64)
    bm = sched.block_manager
    a, b = seq(0, range(10, 26), max_tokens=12), seq(1, list(range(10, 26)) + [5], max_tokens=12)
    sched.add(a)
    run_step(sched)  # a computes 16 positions: 2 groups registered
    sched.add(b)
    run_step(sched)
    assert b.block_ids[:4] == a.block_ids[:4] and all(bm.ref_counts[x] == 2 for x in a.block_ids[:4])
    c = seq(2, range(60, 70), max_tokens=8)
    sched.add(c)
    steps = 0
    while sched.num_preemptions == 0:  # a, b and c outgrow 16 blocks: the youngest is preempted
        run_step(sched)
        steps += 1
        assert steps < 50
    check_accounting(bm, sched.running)
    sched.abort(a)  # a leaves while b still holds their shared blocks
    assert all(bm.ref_counts[x] >= 1 for x in b.block_ids)
    check_accounting(bm, sched.running)
    while sched.has_unfinished():
        run_step(sched)
        steps += 1
        assert steps < 200
    assert b.is_finished and c.is_finished
    check_accounting(bm, [])
    assert bm.num_free_blocks == 16

"""The persistent batch (`engine/input_batch.py`): a graph decode / verify step packed by numpy over slot arrays
is the same upload, int for int, as the list packer (`StepPlanner.pack_lists`, the oracle) on random steps where
requests join, advance, cross block boundaries, trim rejected drafts, leave, and are preempted and rejoin; slots
are reused once requests leave; the block tables are re-copied exactly when the block manager's stamp moves."""

from __future__ import annotations

import random

import numpy as np
import pytest
from spec_helpers import tiny_setup

from sparkspec.engine.block_manager import BlockManager
from sparkspec.engine.input_batch import InputBatch
from sparkspec.engine.model_runner import ModelRunner
from sparkspec.engine.scheduler import ScheduledSeq
from sparkspec.engine.sequence import Sequence
from sparkspec.engine.step_plan import StepPlanner
from sparkspec.sampling_params import SamplingParams

BLOCK_SIZE, NUM_BLOCKS, MAX_SEQS, K = 4, 200, 8, 3


def planner(device_drafts: int = 0, needs_next_ids: bool = False, num_slots: int | None = None) -> StepPlanner:
    """A planner over the tiny model's eagerly run static graphs (R in 1, 2, 4, 8; q in 1, 1 + K)."""
    cfg, model, _ = tiny_setup()
    runner = ModelRunner(model, None, max_num_seqs=MAX_SEQS)
    runner.allocate(NUM_BLOCKS, BLOCK_SIZE)
    runner.use_graphs(MAX_SEQS, 64, K, eager=True)
    pl = StepPlanner(cfg.vocab_size, device_drafts, needs_next_ids)
    pl.use_graphs(runner.graphs, MAX_SEQS)
    if num_slots is not None:
        g = runner.graphs
        pl.batch = InputBatch(num_slots, g.width, g.cache.scratch_block, g.ratios, device_drafts, needs_next_ids)
    return pl


def random_params(rng: random.Random, profile: str) -> SamplingParams:
    if profile == "greedy" or (profile == "mixed" and rng.random() < 0.4):
        return SamplingParams(max_tokens=64, temperature=0.0)
    filtered = profile != "sample" and rng.random() < 0.5
    return SamplingParams(max_tokens=64, temperature=rng.choice([0.5, 1.0, 1.3]), seed=rng.randrange(2**40),
                          top_k=rng.choice([0, 5]) if filtered else 0,
                          top_p=rng.choice([1.0, 0.9]) if filtered else 1.0)


def new_seq(rng: random.Random, seq_id: int, profile: str) -> Sequence:
    seq = Sequence(seq_id, [rng.randrange(4, 500) for _ in range(rng.randint(1, 20))], random_params(rng, profile),
                   seed=rng.randrange(2**62))
    seq.output_ids = [rng.randrange(4, 500) for _ in range(rng.randint(0, 6))]
    seq.num_cached_tokens = seq.num_tokens - 1  # a decode row: the pending token is all that is uncomputed
    return seq


def assert_same_step(pl: StepPlanner, items, drafts, rows, k_next) -> None:
    got = pl.plan(items, drafts, rows, k_next)
    want = pl.pack_lists(items, drafts, rows, k_next)
    assert isinstance(got.flat, np.ndarray), "the step fell back to the list path"
    assert want.key is not None and got.flat.tolist() == want.flat
    assert (got.key, got.K, got.mode, got.num_drafts, got.keep_drafts, got.sampling) == \
        (want.key, want.K, want.mode, want.num_drafts, want.keep_drafts, want.sampling)


@pytest.mark.parametrize("num_slots", [3, 16])  # 3: slots are collected and the arrays grow
@pytest.mark.parametrize("device_drafts,needs_next_ids", [(0, False), (K, False), (K, True)])
def test_numpy_pack_equals_list_pack_on_random_steps(num_slots, device_drafts, needs_next_ids):
    rng = random.Random(num_slots * 10 + device_drafts + needs_next_ids)
    pl = planner(device_drafts, needs_next_ids, num_slots)
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    live, ids = [], iter(range(10**6))
    for _ in range(60):
        profile = rng.choice(["greedy", "sample", "filter", "mixed"])
        for s in [s for s in live if rng.random() < 0.1 or s.num_tokens > 40]:  # leave (or max_model_len)
            live.remove(s)
            bm.free(s)
        for s in [s for s in live if rng.random() < 0.05]:  # preempted, then recomputed: a new block table
            bm.free(s)
            bm.allocate(bm_dummy := Sequence(-1, [0], SamplingParams()), rng.randint(1, 9))  # other blocks first
            bm.allocate(s, s.num_tokens)
            bm.free(bm_dummy)
        while len(live) < MAX_SEQS and rng.random() < 0.5:  # join
            live.append(new_seq(rng, next(ids), profile))
            bm.allocate(live[-1], live[-1].num_tokens)
        if not live:
            continue
        for s in live:  # advance (a verify step accepted some drafts), or only trim what the last step reserved
            if rng.random() < 0.6:
                s.output_ids += [rng.randrange(4, 500) for _ in range(rng.randint(1, K + 1))]
                s.num_cached_tokens = s.num_tokens - 1
            bm.trim(s, s.num_tokens)
        step_seqs = rng.sample(live, rng.randint(1, len(live)))
        verify = rng.random() < 0.6
        items = []
        for s in step_seqs:
            lookahead = K if verify else 0
            bm.allocate(s, s.num_tokens + lookahead)  # drafts' slots: may take a block, trimmed next step
            items.append(ScheduledSeq(s, 1, lookahead, bm.table_version(s) if rng.random() < 0.9 else -1))
        drafts = [[rng.randrange(4, 500) for _ in range(rng.randint(0, it.num_lookahead))] for it in items]
        rows = [rng.randrange(-1, MAX_SEQS) for _ in items]
        assert_same_step(pl, items, drafts, rows, rng.choice([0, K]) if device_drafts else 0)
    assert pl.batch.num_slots >= 3


def decode_items(bm: BlockManager, seqs: list[Sequence]) -> list[ScheduledSeq]:
    return [ScheduledSeq(s, 1, 0, bm.table_version(s)) for s in seqs]


def test_slots_are_reused_after_requests_leave():
    rng = random.Random(1)
    pl = planner(num_slots=2)
    batch = pl.batch
    a, b, c = (new_seq(rng, i, "greedy") for i in range(3))
    assert batch.slots_for([a, b]).tolist() == [0, 1]
    assert batch.slots_for([b, a]).tolist() == [1, 0]  # stable, whatever the order of the step
    assert batch.slots_for([a, c]).tolist() == [0, 1]  # b left: its slot went to c
    assert b not in batch.slot_of and batch.num_slots == 2
    assert batch.slots_for([a, b, c]).tolist() == [0, 2, 1]  # all three run: the arrays grow
    assert batch.num_slots == 4


def test_a_preempted_request_rejoins_with_its_new_block_table():
    rng = random.Random(2)
    pl = planner()
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    seqs = [new_seq(rng, i, "mixed") for i in range(3)]
    for s in seqs:
        bm.allocate(s, s.num_tokens)
    assert_same_step(pl, decode_items(bm, seqs), [[]] * 3, [-1] * 3, 0)
    victim = seqs[2]
    slot, old = pl.batch.slot_of[victim], list(victim.block_ids)
    bm.free(victim)  # preempted; then recomputed and decoding again, on other blocks
    bm.allocate(seqs[0], seqs[0].num_tokens + 12)
    bm.allocate(victim, victim.num_tokens)
    assert victim.block_ids != old
    assert_same_step(pl, decode_items(bm, seqs), [[]] * 3, [-1] * 3, 0)
    assert pl.batch.slot_of[victim] == slot
    assert pl.batch.block_tables[slot, : len(victim.block_ids)].tolist() == victim.block_ids


def test_block_tables_are_copied_when_the_stamp_moves_only():
    rng = random.Random(3)
    pl = planner()
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    s = new_seq(rng, 0, "greedy")
    bm.allocate(s, s.num_tokens)
    pl.plan(decode_items(bm, [s]), [[]], [-1], 0)
    slot, first = pl.batch.slot_of[s], s.block_ids[0]
    s.block_ids[0] = first + 1  # behind the manager's back: the stamp says nothing changed, the row is kept
    pl.plan(decode_items(bm, [s]), [[]], [-1], 0)
    assert pl.batch.block_tables[slot, 0] == first
    pl.plan([ScheduledSeq(s, 1, 0, -1)], [[]], [-1], 0)  # no stamp: always re-copied
    assert pl.batch.block_tables[slot, 0] == first + 1


def test_block_manager_stamps_every_table_change():
    bm = BlockManager(20, 4)
    s = Sequence(0, [1] * 5, SamplingParams())
    assert bm.table_version(s) == -1
    bm.allocate(s, 5)
    v = bm.table_version(s)
    bm.allocate(s, 8)  # fits in the blocks it holds
    bm.trim(s, 8)
    assert bm.table_version(s) == v
    bm.allocate(s, 9)
    assert bm.table_version(s) > v
    v = bm.table_version(s)
    bm.trim(s, 8)
    assert bm.table_version(s) > v
    bm.free(s)
    assert bm.table_version(s) == -1


def test_steps_the_persistent_batch_does_not_pack_go_to_the_lists():
    rng = random.Random(4)
    pl = planner()
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    plain, wants = new_seq(rng, 0, "greedy"), new_seq(rng, 1, "greedy")
    wants.params = SamplingParams(max_tokens=8, logprobs=2)
    prefill = Sequence(2, [5] * 9, SamplingParams())
    for s in (plain, wants, prefill):
        bm.allocate(s, s.num_tokens)
    pack = pl.batch.pack_decode
    assert pack(decode_items(bm, [plain, wants]), [[], []], [-1, -1], 0, pl.graphs.key_for) is None  # logprobs
    assert pack([ScheduledSeq(prefill, 9)], [[]], [-1], 0, pl.graphs.key_for) is None  # a prefill chunk
    assert pack([ScheduledSeq(prefill, 1)], [[]], [-1], 0, pl.graphs.key_for) is None  # a chunk that does not sample
    assert pack(decode_items(bm, [plain]), [[1] * (K + 1)], [-1], 0, pl.graphs.key_for) is None  # no key verifies 4
    p = pl.plan(decode_items(bm, [plain, wants]), [[], []], [-1, -1], 0)
    assert p.key is None and p.flat is None  # eager: the list path's named parts


def test_collection_keeps_the_slot_of_a_request_with_a_token_in_flight():
    """Slots are collected when none is free, but not the slot of a request whose token in flight sits in the
    runner's `last_tokens` there (a step launched ahead sampled it; the token budget left the request out of this
    step): its next step reads it at that slot."""
    rng = random.Random(3)
    batch = InputBatch(2, 8, 0, (4,))
    a, b, c = (new_seq(rng, i, "greedy") for i in range(3))
    first = batch.slots_for([a, b])
    a.num_inflight = 1
    third = batch.slots_for([c])  # none free: b's slot is collected, a's is kept
    assert batch.slot_of[a] == first[0] and b not in batch.slot_of and third[0] == first[1]
    a.num_inflight = 0
    batch.slots_for([b])  # none free again: now a's goes too
    assert a not in batch.slot_of and c not in batch.slot_of and b in batch.slot_of

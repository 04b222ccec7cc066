"""Scheduler and block manager: plain Python, no torch, no model. A fake runner plays the model's part."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from sparkspec.engine.block_manager import BlockManager
from sparkspec.engine.scheduler import QueueFullError, Scheduler, SchedulerConfig
from sparkspec.engine.sequence import Sequence, SequenceStatus


@dataclass
class Params:
    max_tokens: int = 4
    num_spec_tokens: int | None = None  # no per-request draft cap


def make(num_blocks=64, block_size=4, blocks_per_seq=0, **cfg):
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, blocks_per_seq))


def seq(i, prompt_len=6, max_tokens=4):
    return Sequence(i, list(range(10, 10 + prompt_len)), Params(max_tokens))


def run_step(sched, accept=0):
    """Fake runner: compute scheduled chunks, append a token when a chunk reaches the end (+ `accept` drafts)."""
    return apply(sched, sched.schedule(), accept)


def apply(sched, out, accept=0):
    """The fake runner's step on a schedule already made."""
    for s in out.scheduled:
        sq = s.seq
        reached_end = s.samples
        sq.num_cached_tokens += s.num_tokens
        if reached_end:
            extra = min(accept, s.num_lookahead)
            sq.num_cached_tokens += extra
            sq.output_ids += [7] * (1 + extra)
            sq.spec.draft_ids = [7] * sched.config.num_lookahead_tokens  # a drafter that always proposes k
            if len(sq.output_ids) >= sq.params.max_tokens:
                del sq.output_ids[sq.params.max_tokens:]
                sq.num_cached_tokens = min(sq.num_cached_tokens, sq.num_tokens - 1)
                sq.finish("length")
    sched.release_after_step()
    return out


def drain(sched, max_steps=500, **kw):
    steps = 0
    while sched.has_unfinished():
        run_step(sched, **kw)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def test_admission_respects_max_num_seqs_and_token_budget():
    sched = make(max_num_seqs=2, max_num_batched_tokens=8)
    seqs = [seq(i, prompt_len=6) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    # seq 0 gets its whole prompt (6), seq 1 a chunk of 2, seq 2 waits (max_num_seqs and budget)
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(0, 6), (1, 2)]
    assert sum(s.num_tokens + s.num_lookahead for s in out.scheduled) == 8
    assert seqs[2].status == SequenceStatus.WAITING


def test_chunked_prefill_mixes_with_decode():
    sched = make(max_num_batched_tokens=5)
    a, b = seq(0, prompt_len=4), seq(1, prompt_len=12)
    sched.add(a)
    run_step(sched)  # a's prompt, first token sampled
    sched.add(b)
    out = run_step(sched)
    assert [(x.seq.seq_id, x.num_tokens, x.samples) for x in out.scheduled] == [(0, 1, True), (1, 4, False)]
    out = run_step(sched)
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(0, 1), (1, 4)]


def test_chunked_prefill_off_waits_for_room():
    sched = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    sched.add(seq(0, prompt_len=6))
    sched.add(seq(1, prompt_len=6))
    out = sched.schedule()
    assert [x.num_tokens for x in out.scheduled] == [6]
    with pytest.raises(ValueError, match="chunked prefill is off"):
        sched.add(seq(2, prompt_len=9))


def test_everything_finishes_and_all_blocks_return():
    sched = make(num_blocks=20, max_num_seqs=4, max_num_batched_tokens=16)
    seqs = [seq(i, prompt_len=3 + i, max_tokens=5) for i in range(10)]
    for s in seqs:
        sched.add(s)
    drain(sched)
    assert all(s.finish_reason == "length" and len(s.output_ids) == 5 for s in seqs)
    assert sched.block_manager.num_free_blocks == 20


def test_preempts_youngest_and_recomputes():
    # 6 blocks of 4 tokens; each sequence needs up to 3 blocks (8 prompt + 4 output = 12 tokens).
    sched = make(num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [seq(i, prompt_len=7, max_tokens=4) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = run_step(sched)  # admits 0 and 1 (2 blocks each); 2 cannot fit its prompt + 1 yet -> waits
    assert [x.seq.seq_id for x in out.scheduled] == [0, 1, 2][: len(out.scheduled)]
    preempted = []
    while sched.has_unfinished():
        out = run_step(sched)
        preempted += [p.seq_id for p in out.preempted]
    assert preempted, "expected a preemption"
    assert all(p != 0 for p in preempted), "the oldest request must never be the victim"
    victim = seqs[preempted[0]]
    assert victim.num_preemptions >= 1
    # recompute keeps what was produced: every request ends with exactly max_tokens outputs
    assert all(len(s.output_ids) == 4 and s.finish_reason == "length" for s in seqs)
    assert sched.block_manager.num_free_blocks == 6


def test_preempted_request_recomputes_prompt_and_outputs():
    sched = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    old, young = seq(0, prompt_len=7, max_tokens=8), seq(1, prompt_len=3, max_tokens=8)
    sched.add(old)
    sched.add(young)
    for _ in range(3):
        out = run_step(sched)
        if out.preempted:
            break
    else:
        while not out.preempted:
            out = run_step(sched)
    assert out.preempted == [young]
    assert young.num_cached_tokens == 0 and young.block_ids == [] and young.spec.draft_ids == []
    produced = list(young.output_ids)
    assert produced, "the victim had produced tokens before preemption"
    while young.status != SequenceStatus.RUNNING:
        out = run_step(sched)
    first = next(x for x in out.scheduled if x.seq is young)
    assert first.num_tokens == len(young.prompt_ids) + len(produced)  # prompt + outputs recomputed
    assert young.output_ids[: len(produced)] == produced


def test_request_that_can_never_fit_is_refused_clearly():
    sched = make(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(seq(0, prompt_len=15, max_tokens=4))
    with pytest.raises(ValueError, match="context length"):
        sched.add(seq(1, prompt_len=90, max_tokens=20))
    with pytest.raises(ValueError, match="empty"):
        sched.add(seq(2, prompt_len=0))


def test_queue_full():
    sched = make(max_waiting=2)
    sched.add(seq(0))
    sched.add(seq(1))
    with pytest.raises(QueueFullError):
        sched.add(seq(2))


@pytest.mark.parametrize("where", ["waiting", "running", "mid_prefill"])
def test_abort_frees_blocks(where):
    sched = make(num_blocks=16, max_num_batched_tokens=4)
    s = seq(0, prompt_len=10)
    sched.add(s)
    if where != "waiting":
        run_step(sched)
        if where == "running":
            while s.num_uncomputed_tokens > 1:  # a prompt chunk is left
                run_step(sched)
        assert s.block_ids
    sched.abort(s)
    assert s.finish_reason == "abort" and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 16
    sched.abort(s)  # idempotent


def test_lookahead_reserved_and_trimmed():
    sched = make(num_blocks=32, block_size=2, num_lookahead_tokens=3, max_num_batched_tokens=64)
    s = seq(0, prompt_len=4, max_tokens=10)
    sched.add(s)
    run_step(sched)  # prefill -> first token
    out = sched.schedule()
    assert out.scheduled[0].num_lookahead == 3
    assert len(s.block_ids) == sched.block_manager.blocks_for(s.num_cached_tokens + 1 + 3)
    s.num_cached_tokens += 1
    s.output_ids.append(5)  # every draft rejected: only the bonus token
    sched.release_after_step()
    assert len(s.block_ids) == sched.block_manager.blocks_for(s.num_tokens)


def test_lookahead_capped_by_remaining_tokens():
    sched = make(num_lookahead_tokens=4)
    s = seq(0, prompt_len=4, max_tokens=3)
    sched.add(s)
    run_step(sched)
    # 1 produced, 2 more allowed: the pending token + 1 draft yield at most 2 new tokens
    assert sched.schedule().scheduled[0].num_lookahead == 1


def test_speculative_acceptance_finishes_faster():
    a, b = make(num_lookahead_tokens=3), make(num_lookahead_tokens=3)
    for sched in (a, b):
        for i in range(4):
            sched.add(seq(i, max_tokens=12))
    assert drain(a, accept=3) < drain(b, accept=0)


def test_blocks_per_seq_charged_once():
    bm = BlockManager(10, 4, blocks_per_seq=2)
    s = seq(0)
    assert bm.blocks_for(5) == 4
    bm.allocate(s, 5)
    bm.allocate(s, 8)
    assert len(s.block_ids) == 4 and bm.usage == pytest.approx(0.4)
    bm.free(s)
    assert bm.num_free_blocks == 10


def test_policy_modules_do_not_import_torch():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    code = ("import sys; import sparkspec.engine.scheduler, sparkspec.engine.block_manager, sparkspec.engine.budget; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_unsplit_prompts_wait_whole_for_the_next_step():
    """A prompt that one prefill graph holds is never split into a chunk that does not sample: it waits for a
    step with room for all of it, and an empty step always has that room. Longer prompts still fill the budget."""
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=32, unsplit_prompt_len=16)
    s = make(**cfg)
    for n in (20, 6, 14):
        s.add(seq(n, n))
    first = s.schedule()
    # 20 + 6 tokens fit 32; the 14-token prompt would get a 6-token chunk: it waits whole
    assert [(it.seq.seq_id, it.num_tokens) for it in first.scheduled] == [(20, 20), (6, 6)]
    s2 = make(**cfg)
    s2.add(seq(30, 30))
    s2.add(seq(40, 40))
    assert [(it.seq.seq_id, it.num_tokens) for it in s2.schedule().scheduled] == [(30, 30), (40, 2)]
    lone = make(**cfg)
    lone.add(seq(7, 16))
    assert [it.num_tokens for it in lone.schedule().scheduled] == [16]  # an empty step takes it whole


def test_rows_without_drafts_reserve_no_lookahead():
    """Only a row that holds drafts reserves verify slots (as many as it holds): rows whose drafter skipped the
    step cost the budget one token, so plain-arm steps of a speculative engine fit as many rows as plain decoding."""
    sched = make(num_lookahead_tokens=7, max_num_batched_tokens=16, max_num_seqs=16)
    seqs = [seq(i, prompt_len=1, max_tokens=20) for i in range(12)]
    for s in seqs:
        sched.add(s)
    run_step(sched)  # the 12 one-token prompts, each gets its first token and 7 drafts
    for s in seqs[2:]:
        s.spec.draft_ids = []  # the drafter skipped them
    seqs[1].spec.draft_ids = [3, 4]  # two drafts only
    out = sched.schedule()
    assert [(it.seq.seq_id, it.num_lookahead) for it in out.scheduled] == [(0, 7), (1, 2)] + [
        (i, 0) for i in range(2, 7)]  # 8 + 3 + 5 rows = 16



@pytest.mark.parametrize("num_blocks", [5, 4])
def test_a_request_whose_last_token_is_in_flight_is_not_scheduled_nor_preempted(num_blocks):
    """Async scheduling: the step launched ahead holds request a's last token. The next schedule leaves a out (it
    ends when that step is read). With a block to spare, b (older) takes it; with none, b waits for a's blocks
    rather than preempting a (whose token would then be committed into a request back in the queue), and nobody
    is admitted meanwhile."""
    s = make(num_blocks=num_blocks, block_size=4)
    b, a, c = seq(1, prompt_len=7, max_tokens=9), seq(0, prompt_len=7, max_tokens=2), seq(2, prompt_len=3)
    s.add(b)
    s.add(a)
    run_step(s)  # both prefilled (2 blocks each) with their first output token
    for q in (b, a):  # then a step launched ahead: each has its next token in flight (a's is its last)
        q.num_cached_tokens += 1
        q.num_inflight = 1
    s.add(c)
    out = s.schedule()  # b's next token is its 10th: a third block
    assert a in s.running and a not in [it.seq for it in out.scheduled] and not out.preempted
    if num_blocks == 5:
        assert [it.seq for it in out.scheduled] == [b]
    else:
        assert out.is_empty and c in s.waiting


def test_step_counts_match_the_items_scheduled():
    """`SchedulerOutput.num_sampling / num_decode / num_prompt_tokens` (what the speculation policy reads instead of
    a pass over the items) equal their definitions over the scheduled items, through chunked prefills, decode rows,
    lookahead and preemption with recompute."""
    sched = make(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=10, num_lookahead_tokens=2)
    for i in range(6):
        sched.add(seq(i, prompt_len=5 + 3 * i, max_tokens=6))
    kinds, steps = set(), 0
    while sched.has_unfinished():
        out = sched.schedule()
        items = out.scheduled
        decode = [s for s in items if s.num_tokens == 1 and s.samples and s.seq.output_ids]
        want = (sum(s.samples for s in items), len(decode),
                sum(s.num_tokens for s in items if not any(s is d for d in decode)))
        assert (out.num_sampling, out.num_decode, out.num_prompt_tokens) == want
        apply(sched, out, accept=1)
        kinds |= {"chunk" for s in items if not s.samples} | {"decode" for _ in decode} | \
            {"preempted" for _ in out.preempted}
        steps += 1
        assert steps < 500
    assert kinds == {"chunk", "decode", "preempted"}

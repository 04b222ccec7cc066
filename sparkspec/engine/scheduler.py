"""Continuous batching (pure Python): which sequences run this step, and how many tokens each.

One step's batch is flat and ragged. Running sequences are served first, oldest first: a sequence with more
than its pending token left (a prompt, or a recompute after preemption) gets a prefill chunk of up to the
remaining token budget; a decoding sequence gets its pending token plus `lookahead` slots for draft tokens
(the verify rows; the verification budget may use fewer). Then waiting sequences are admitted in arrival
order while the sequence limit, the token budget and the free blocks allow (a whole prompt must fit before
its first chunk is admitted, so admission does not immediately cause preemption).

When a running sequence cannot get the blocks it needs, the youngest running sequence is preempted: its
blocks and caches are dropped and it goes back to the front of the queue; it is recomputed later (prompt and
the tokens it has produced so far; nothing it produced is lost). A request that could not fit even alone is
refused by `add` with a message, so preemption always makes progress.

Prefix caching (`BlockManager.lookup`, see block_manager.py for what a hit may cover): a sequence being admitted
(new, or rejoining after preemption) first takes the longest cached prefix of its tokens, then prefills from
there (`num_cached_tokens` = the hit). Its blocks are registered a whole group at a time after the steps that
commit them, and when it leaves (finished, aborted, preempted), so that later requests and its own recompute
find them. A sequence that would gain a longer hit from a prefill under way (another sample of the same request,
a shared system prompt) waits for it rather than computing the same prefix twice. Requests that ask for
prompt logprobs take no hit (their prompt must be scored).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sparkspec.engine.block_manager import BlockManager
from sparkspec.engine.sequence import Sequence, SequenceStatus


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting`; the caller should retry later (HTTP 429)."""


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 2048  # target tokens per step (prefill chunks + decode + verify rows)
    max_model_len: int = 2048  # prompt + output positions per sequence
    num_lookahead_tokens: int = 0  # draft slots reserved behind each decode token (k_max)
    max_waiting: int = 1024  # queue length beyond which `add` raises QueueFullError
    enable_chunked_prefill: bool = True
    # a prompt with at most this many tokens left is admitted whole or waits for the next step, never split into a
    # chunk that does not sample: whole, it runs in a prefill graph; a chunk that does not sample runs eagerly
    # (~20 ms of host launches on the H200 demo pair, ~10 graph steps). 0: chunks always fill the budget.
    unsplit_prompt_len: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_waiting"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} = {v!r}: expected a positive integer")
        if not isinstance(self.num_lookahead_tokens, int) or self.num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens = {self.num_lookahead_tokens!r}: expected an integer >= 0")
        if self.max_num_batched_tokens < 1 + self.num_lookahead_tokens:
            raise ValueError(f"max_num_batched_tokens = {self.max_num_batched_tokens}: expected >= 1 + "
                             f"num_lookahead_tokens ({1 + self.num_lookahead_tokens})")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens of seq.all_ids computed this step, from seq.num_cached_tokens
    num_lookahead: int = 0  # draft slots reserved behind the pending token (decode rows only)
    table_version: int = -1  # `BlockManager.table_version` of seq.block_ids when scheduled (-1: unknown)

    @property
    def samples(self) -> bool:
        """Does this chunk reach the end of all_ids (so its last row yields a new token)? A token in flight
        (async scheduling) counts: it is the pending one."""
        return self.seq.num_cached_tokens + self.num_tokens == self.seq.num_tokens + self.seq.num_inflight


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_queried_tokens: int = 0  # prefix cache: tokens of the requests admitted for the first time this step
    num_hit_tokens: int = 0  # ... and those of them found in the cache (not computed)
    # what the speculation policy reads of a step (`SpecPolicy.step_counts`), counted as it is scheduled: items that
    # sample (decode rows, last chunks), decode rows, and the tokens of prompt (or recompute) chunks
    num_sampling: int = 0
    num_decode: int = 0
    num_prompt_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first, youngest last
        self._reserved: list[Sequence] = []  # sequences the last `schedule` gave draft slots (trimmed after it)
        self.num_preemptions = 0

    # ---- requests in and out ----
    def check(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ValueError if a request of this size can never run (checked before it is queued)."""
        c = self.config
        total = num_prompt_tokens + max_tokens
        if num_prompt_tokens < 1:
            raise ValueError("the prompt is empty")
        if total > c.max_model_len:
            raise ValueError(f"{num_prompt_tokens} prompt tokens + max_tokens {max_tokens} = {total} exceeds the "
                             f"maximum context length {c.max_model_len}")
        if not c.enable_chunked_prefill and num_prompt_tokens > c.max_num_batched_tokens:
            raise ValueError(f"{num_prompt_tokens} prompt tokens exceed max_num_batched_tokens="
                             f"{c.max_num_batched_tokens} and chunked prefill is off")
        need = self.block_manager.blocks_for(total)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"{num_prompt_tokens} prompt tokens + max_tokens {max_tokens} need {need} KV blocks; "
                             f"the cache has {self.block_manager.num_blocks} in all (raise --kv-cache-memory)")

    def add(self, seq: Sequence) -> None:
        self.check(len(seq.prompt_ids), seq.params.max_tokens)
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting (max_waiting={self.config.max_waiting})")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """Stop a request wherever it is and free its blocks (idempotent)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.release(seq)
        if not seq.is_finished:
            seq.finish(reason)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----
    def lookahead_for(self, seq: Sequence, budget: int) -> int:
        """Draft slots for a decode row: the drafts it holds, at most k_max (or the request's own cap), and no
        more than the tokens the request may still produce. A row that holds no drafts (the drafter skipped the
        last step: the adaptive budget's plain arm, or nothing to propose) reserves none, so it costs the token
        budget one row, not 1 + k: at c = 256 with k = 7 and a 1,024-token budget, reserving k for every row
        capped a step at 128 decode rows whichever arm ran."""
        # verifying the pending token + l drafts yields up to l + 1 new tokens
        room = min(seq.params.max_tokens - len(seq.output_ids), self.config.max_model_len - seq.num_tokens) - 1
        k = min(self.config.num_lookahead_tokens, len(seq.spec.draft_ids))
        return max(0, min(k, k if seq.spec_cap is None else seq.spec_cap, room, budget))

    def schedule(self) -> SchedulerOutput:
        c, bm = self.config, self.block_manager
        out = SchedulerOutput()
        budget = c.max_num_batched_tokens
        i, starved = 0, False  # starved: a running request waits for blocks (admit nobody this step)
        bs, extra, versions = bm.block_size, bm.blocks_per_seq, bm.table_versions
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_inflight and self.finishing(seq):
                i += 1  # its last token is in flight: it ends when that step is read, nothing to schedule
                continue
            nc = seq.num_cached_tokens
            left = len(seq.prompt_ids) + len(seq.output_ids) + seq.num_inflight - nc  # uncomputed tokens
            n = min(left, budget)
            is_decode = n == left == 1 and (seq.output_ids or seq.num_inflight)  # pending token = last output
            # (no drafts held, no slots: `lookahead_for` would say 0; the adaptive budget's plain stretches skip it)
            lookahead = self.lookahead_for(seq, budget - n) \
                if is_decode and c.num_lookahead_tokens and seq.spec.draft_ids else 0
            if lookahead:
                self._reserved.append(seq)
            if -(-(nc + n + lookahead) // bs) + extra <= len(seq.block_ids):  # its blocks suffice (most steps)
                out.scheduled.append(ScheduledSeq(seq, n, lookahead, versions.get(seq.seq_id, -1)))
                self.count(out, n, left, is_decode)
                budget -= n + lookahead
                i += 1
                continue
            while not bm.can_allocate(seq, seq.num_cached_tokens + n + lookahead):
                victim = self.running[-1]  # the youngest; never one already scheduled (those are running[:i])
                if victim is not seq and victim.num_inflight and self.finishing(victim):
                    starved = True  # its blocks come back once the step in flight is read: wait for them
                    break
                self.running.pop()
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, seq.num_cached_tokens + n + lookahead)
                out.scheduled.append(ScheduledSeq(seq, n, lookahead, bm.table_version(seq)))
                self.count(out, n, left, is_decode)
                budget -= n + lookahead
                i += 1
                continue
            break
        caching = bm.enable_prefix_caching
        while self.waiting and not out.preempted and not starved and len(self.running) < c.max_num_seqs \
                and budget > 0:
            seq = self.waiting[0]
            hit, hit_blocks = 0, []
            if caching and getattr(seq.params, "prompt_logprobs", None) is None:
                hit, hit_blocks = bm.lookup(seq)
                if bm.will_cover(seq, self.running):
                    break  # a running prefill is computing more of its prefix: take it next step
            uncomputed = seq.num_tokens - hit
            n = min(uncomputed, budget)
            if n < uncomputed and not c.enable_chunked_prefill and not seq.output_ids:
                break  # (a recompute after preemption is always chunked: it may exceed the budget)
            if n < uncomputed <= min(c.unsplit_prompt_len, c.max_num_batched_tokens) and out.scheduled:
                break  # whole next step (it fits an empty step's budget, so this cannot starve it)
            if not bm.can_allocate(seq, seq.num_tokens, hit_blocks):
                break
            self.waiting.popleft()
            if caching:
                bm.take(seq, hit_blocks)
                seq.num_cached_tokens = hit
                if not seq.num_preemptions:
                    seq.num_prefix_hit_tokens = hit
                    out.num_queried_tokens += seq.num_tokens
                    out.num_hit_tokens += hit
            bm.allocate(seq, seq.num_cached_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, 0, bm.table_version(seq)))
            self.count(out, n, uncomputed, False)
            budget -= n
        return out

    @staticmethod
    def count(out: SchedulerOutput, n: int, left: int, is_decode) -> None:
        """A scheduled item of `n` tokens out of the `left` it has uncomputed (equal: it samples)."""
        if n == left:
            out.num_sampling += 1
        if is_decode:
            out.num_decode += 1
        else:
            out.num_prompt_tokens += n

    def finishing(self, seq: Sequence) -> bool:
        """The tokens `seq` has and has in flight reach its length limit (async scheduling: the step launched ahead
        holds its last token)."""
        return seq.num_tokens_left <= 0 or seq.num_tokens + seq.num_inflight >= self.config.max_model_len

    def preempt(self, seq: Sequence) -> None:
        """Drop a running sequence's caches; it re-enters the queue first and is recomputed later."""
        self.release(seq)
        seq.num_cached_tokens = 0
        seq.spec.draft_ids, seq.spec.draft_row, seq.spec.confidences = [], -1, None
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def release(self, seq: Sequence) -> None:
        """Give back the sequence's blocks (its rows in every pool); those of its committed groups stay cached
        (not those of a request that failed: its rows may not be finite)."""
        if seq.finish_reason != "error":
            self.block_manager.register(seq)
        self.block_manager.free(seq)

    def release_after_step(self) -> list[Sequence]:
        """After a step: free the blocks of finished sequences and those held for rejected drafts -> the finished
        sequences (no longer running)."""
        finished, bm = [], self.block_manager
        if any(s.is_finished for s in self.running):
            finished = [s for s in self.running if s.is_finished]
            self.running[:] = [s for s in self.running if not s.is_finished]  # one pass, order kept
            for seq in finished:
                self.release(seq)
        bs, extra = bm.block_size, bm.blocks_per_seq
        for seq in self._reserved:  # only rows that reserved draft slots can hold blocks past their tokens
            if not seq.is_finished and len(seq.block_ids) > -(-seq.num_tokens // bs) + extra:
                bm.trim(seq, seq.num_tokens)
        self._reserved = []
        if bm.enable_prefix_caching:
            G, registered = bm.granularity, bm.num_registered
            for seq in self.running:  # this runs for every running sequence every step
                if seq.num_cached_tokens >= registered.get(seq.seq_id, 0) + G:  # a group completed
                    bm.register(seq)
        return finished

    # ---- stats ----
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

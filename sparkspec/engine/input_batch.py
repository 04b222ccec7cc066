"""The persistent batch: what a graph decode / verify step uploads, kept in numpy arrays by slot (pure host).
Legend: C slots, W block-table columns, n requests of the step, R = the graph's padded batch (n real requests,
then dummies), q rows per request, K = q - 1 draft columns, T = R·q rows.

A running request holds a slot while it runs; its slot row keeps what does not change from step to step: its
block table (re-copied only when the block manager's `table_version` of it moved: a block appended or trimmed,
or the table rebuilt after preemption) and its sampling constants (seed, temperature, top-k, top-p, flags).
What does change every step (the cached length, the pending token, the drafts the engine verifies) is read
from the items, once, into arrays; the step's whole upload (the graph's batch head, then the named parts of
`StepPlanner.add_request_parts`, in that order) is then numpy over those arrays: O(n) Python attribute reads
and O(changed tables) row copies per step, the rest vectorised.

Slots are a cache keyed by the Sequence object (identity): a request met for the first time takes a free slot
and fills it; slots are collected only when none is free (every slot whose request is not in the step is freed:
a request that comes back later just fills a slot again), so requests that leave cost nothing per step. A
preempted request that rejoins keeps its slot and its constants; its table's stamp changed, so the row is
re-copied. An item with no stamp (-1: built outside the scheduler) is re-copied every step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from sparkspec.engine.cuda_graphs import GraphKey
from sparkspec.engine.packed_step import PackedStep
from sparkspec.engine.scheduler import ScheduledSeq

KeyFn = Callable[[int, int, str, int], "GraphKey | None"]  # GraphRunner.key_for


def padded(values: np.ndarray, size: int, pad, dtype=np.int64) -> np.ndarray:
    """[size]: `values` first, then `pad` (a graph's per-request part: the real requests, then its dummies)."""
    out = np.full(size, pad, dtype)
    out[: len(values)] = values
    return out


class InputBatch:
    def __init__(self, num_slots: int, width: int, scratch_block: int, ratios: tuple[int, ...],
                 device_drafts: int = 0, needs_next_ids: bool = False):
        """`width`: the graphs' block-table columns; `device_drafts`: k of the device drafter (0: none)."""
        self.width, self.scratch, self.ratios = width, scratch_block, ratios
        self.device_drafts, self.needs_next_ids = device_drafts, needs_next_ids
        self.slot_of: dict = {}  # Sequence -> its slot
        self.seqs: list = []  # [C] the Sequence holding each slot (None: free)
        self.free: list[int] = []
        self.block_tables = np.zeros((0, width), np.int64)  # [C, W] block ids, then the scratch block
        self.table_versions = np.zeros(0, np.int64)  # [C] the stamp the row was copied at (-1: none)
        self.seeds = np.zeros(0, np.int64)  # [C]
        self.top_k = np.zeros(0, np.int64)  # [C]
        self.temperature = np.zeros(0, np.float64)  # [C] SamplingParams.device_temperature (0: greedy)
        self.top_p = np.zeros(0, np.float64)  # [C]
        self.is_greedy = np.zeros(0, bool)  # [C]
        self.is_filtered = np.zeros(0, bool)  # [C] top-k or top-p at a temperature > 0
        self.wants_logprobs = np.zeros(0, bool)  # [C] such steps run eagerly (the list path)
        self.seeded = np.zeros(0, np.int64)  # [C] 1: the request gave a seed (the "auto" scheme's Gumbel-max rows)
        self.grow(num_slots)
        self._static: dict[tuple[int, int], tuple] = {}  # (R, q) -> the parts that depend on the shape only

    @property
    def num_slots(self) -> int:
        return len(self.seqs)

    def grow(self, num_slots: int) -> None:
        """At least `num_slots` slots (arrays extended; held rows kept)."""
        old = self.num_slots
        if num_slots <= old:
            return
        add = num_slots - old

        def ext(a, fill):
            return np.concatenate([a, np.full((add, *a.shape[1:]), fill, a.dtype)])

        self.block_tables = ext(self.block_tables, self.scratch)
        self.table_versions = ext(self.table_versions, -1)
        self.seeds, self.top_k = ext(self.seeds, 0), ext(self.top_k, 0)
        self.temperature, self.top_p = ext(self.temperature, 0.0), ext(self.top_p, 1.0)
        self.is_greedy, self.is_filtered = ext(self.is_greedy, True), ext(self.is_filtered, False)
        self.wants_logprobs = ext(self.wants_logprobs, False)
        self.seeded = ext(self.seeded, 0)
        self.seqs += [None] * add
        self.free += range(num_slots - 1, old - 1, -1)  # popped from the end: lowest slot first

    # ---- slots ----
    def slots_for(self, seqs: list) -> np.ndarray:
        """-> [n] the slot of each sequence, filling a slot for each one met for the first time."""
        get = self.slot_of.get
        slots = [get(s, -1) for s in seqs]
        if -1 in slots:
            live = None
            for r, s in enumerate(seqs):
                if slots[r] < 0:
                    if not self.free:
                        live = live or set(seqs)
                        self.collect(live)
                    if not self.free:
                        self.grow(2 * self.num_slots)
                    slots[r] = self.join(s)
        return np.asarray(slots, dtype=np.int64)

    def join(self, seq) -> int:
        """Give `seq` a free slot and fill its constants (its table is copied by the next `sync_tables`)."""
        slot = self.free.pop()
        sp = seq.params
        self.slot_of[seq], self.seqs[slot] = slot, seq
        self.table_versions[slot] = -1
        self.seeds[slot], self.top_k[slot] = seq.seed, sp.top_k
        self.temperature[slot], self.top_p[slot] = sp.device_temperature, sp.top_p
        self.is_greedy[slot] = sp.greedy
        self.is_filtered[slot] = (sp.top_k > 0 or sp.top_p < 1) and not sp.greedy
        self.wants_logprobs[slot] = sp.logprobs is not None
        self.seeded[slot] = sp.seed is not None
        return slot

    def release(self, slot: int) -> None:
        del self.slot_of[self.seqs[slot]]
        self.seqs[slot] = None
        self.free.append(slot)

    def collect(self, live: set) -> None:
        """Free every slot whose request is not in `live` (the step being packed) and has no token in flight (a
        step launched ahead left it in the runner's `last_tokens` at the slot, for the request's next step: one
        the token budget left out of this step, behind a long prompt chunk, still reads it there)."""
        for slot, seq in enumerate(self.seqs):
            if seq is not None and seq not in live and not seq.num_inflight:
                self.release(slot)

    def sync_tables(self, items: list[ScheduledSeq], slots: np.ndarray) -> bool:
        """Re-copy the block tables whose stamp moved (or that have none) -> False if one is wider than W."""
        stamps = np.asarray([it.table_version for it in items], dtype=np.int64)
        stale = np.flatnonzero((self.table_versions[slots] != stamps) | (stamps < 0))
        for r in stale.tolist():
            ids, slot = items[r].seq.block_ids, slots[r]
            if len(ids) > self.width:
                return False
            row = self.block_tables[slot]
            row[: len(ids)] = ids
            row[len(ids) :] = self.scratch
            self.table_versions[slot] = stamps[r]
        return True

    # ---- the step ----
    def shape_parts(self, R: int, q: int) -> tuple:
        """Parts of a (R, q) step that depend on its shape only: req_idx [T], cu_seqlens_q [R+1], first rows [R]
        (= pending rows and `reqs`·q), row ids [T], column ids [q]."""
        got = self._static.get((R, q))
        if got is None:
            ar = np.arange(R, dtype=np.int64)
            got = self._static[(R, q)] = (np.repeat(ar, q), np.arange(R + 1, dtype=np.int64) * q, ar * q, ar,
                                          np.arange(R * q, dtype=np.int64), np.arange(q, dtype=np.int64))
        return got

    def decode_lengths(self, seqs: list) -> np.ndarray | None:
        """-> [n] the cached length of each decode row's request, or None where one is a chunk that does not reach
        the end of its request (it does not sample)."""
        num_cached = np.asarray([s.num_cached_tokens for s in seqs], dtype=np.int64)  # [n]
        num_tokens = np.asarray([len(s.prompt_ids) + len(s.output_ids) + s.num_inflight for s in seqs],
                                dtype=np.int64)  # (a token in flight is the pending one: read on the device)
        return None if (num_cached + 1 != num_tokens).any() else num_cached

    def mode_of(self, slots: np.ndarray) -> str:
        """The sampling mode of the requests at `slots` (`step_plan.sampling_mode`)."""
        return "greedy" if self.is_greedy[slots].all() else "filter" if self.is_filtered[slots].any() else "sample"

    def pack_decode(self, items: list[ScheduledSeq], drafts: list[list[int]], draft_rows: list[int],
                    num_next_drafts: int, key_for: KeyFn) -> PackedStep | None:
        """The PackedStep of a graph step where every item is a decode / verify row (its pending token, then its
        drafts), with `flat` laid out as `GraphRunner.pack` + `StepPlanner.add_request_parts` lay it; None when
        the step is not one (a prefill chunk, logprobs, no captured key): the list path packs it."""
        n = len(items)
        if not n or [it.num_tokens for it in items].count(1) != n:  # (a list: cheaper than a generator)
            return None
        seqs = [it.seq for it in items]
        num_cached = self.decode_lengths(seqs)
        if num_cached is None:
            return None
        slots = self.slots_for(seqs)
        if self.wants_logprobs[slots].any():
            return None
        num_drafts = np.fromiter(map(len, drafts), np.int64, n)  # [n]
        keep = num_next_drafts if self.device_drafts else 0
        key = key_for(n, 1 + int(num_drafts.max()), self.mode_of(slots), self.device_drafts if keep else 0)
        if key is None or key.q != key.draft_cols + 1 or not self.sync_tables(items, slots):
            return None
        head, per_req, next_ids = self.decode_region(seqs, slots, num_cached, drafts, num_drafts, draft_rows, key,
                                                     self.width)
        p = PackedStep(items, drafts, sampling=list(range(n)), K=key.draft_cols, mode=key.mode,
                       num_drafts=key.num_drafts, keep_drafts=keep, key=key)
        p.flat = np.concatenate([*head, *(a.ravel() for a in per_req[:-1]), next_ids, per_req[-1]])
        p.slots = slots
        return p

    def decode_region(self, seqs: list, slots: np.ndarray, num_cached: np.ndarray, drafts: list[list[int]],
                      num_drafts: np.ndarray, draft_rows: list[int], key: GraphKey, width: int
                      ) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        """The arrays of `key`'s R decode / verify requests (n real, then dummies), block tables `width` wide ->
        (the batch head: ids, positions, request rows, cu_seqlens_q, seq_lens, tables, emit rows per ratio; the
        per-request parts of `StepPlanner.add_request_parts` but next_ids, in its order, first dimension R; next_ids
        per row). Tables must be synced (`sync_tables`)."""
        n = len(seqs)
        R, q, K = key.num_reqs, key.q, key.draft_cols
        req_idx, cu, first, reqs, row_ids, col_ids = self.shape_parts(R, q)
        pending = np.asarray([(s.output_ids or s.prompt_ids)[-1] for s in seqs], dtype=np.int64)  # all_ids[-1]

        draft_ids = np.full((R, K), -1, np.int64)  # [R, K] -1 past each request's drafts
        if K and num_drafts.any():
            has = col_ids[None, :K] < num_drafts[:, None]  # [n, K]
            draft_ids[:n][has] = np.fromiter(itertools.chain.from_iterable(drafts), np.int64, int(num_drafts.sum()))
        ids = np.zeros((R, q), np.int64)  # [R, q] pending token, drafts, 0 pads (dummies: 0)
        ids[:n, 0] = pending
        ids[:, 1:] = np.maximum(draft_ids, 0)
        starts = np.zeros(R, np.int64)  # [R] dummies start at 0
        starts[:n] = num_cached
        positions = (starts[:, None] + col_ids).ravel()  # [T]
        tables = np.full((R, width), self.scratch, np.int64)  # [R, W] dummies: only the scratch block
        tables[:n, : self.width] = self.block_tables[slots]
        emits = [np.where((positions + 1) % ratio == 0, row_ids, -1) for ratio in self.ratios]

        lens = np.zeros(R, np.int64)
        lens[:n] = num_drafts
        gather = first[:, None] + np.minimum(col_ids[None, :], lens[:, None])  # [R, K+1] logits rows verified
        q_rows = np.full(R, -1, np.int64)
        q_rows[:n] = np.where(num_drafts > 0, np.asarray(draft_rows, dtype=np.int64), -1)

        temperature = padded(self.temperature[slots], R, 0.0, np.float64).view(np.int64)
        top_p = padded(self.top_p[slots], R, 1.0, np.float64).view(np.int64)
        next_ids = np.zeros(R * q if self.needs_next_ids else 0, np.int64)  # decode rows: nothing known after
        head = [ids.ravel(), positions, req_idx, cu, starts + q, tables.ravel(), *emits]  # (no logits rows)
        per_request = [gather, draft_ids, q_rows, padded(self.top_k[slots], R, 0), padded(self.seeds[slots], R, 0),
                       padded(num_cached + 1, R, 0), reqs, first, temperature, top_p, padded(self.seeded[slots], R, 0)]
        return head, per_request, next_ids

"""The host plan of one step (pure host: no device is touched): scheduled items -> a `PackedStep`, the rows, the
logits rows and every int the device needs, laid out as the eager forward or the captured graph reads them.
Legend: R requests in the batch, S requests that sample this step, K most drafts verified, q rows per request of
a graph step.

Two builders make the same layout. A decode / verify step that runs as a captured graph (every request a
decode row, no logprobs, no grammar) is packed by the persistent batch (`input_batch.py`: numpy over arrays
kept by slot); every other step (prefills, mixed steps, logprobs, prompt logprobs, structured output) by
`StepPlanner.pack_lists`, Python over the items, which is also the oracle the persistent batch is tested
against.
"""

from __future__ import annotations

import itertools

import numpy as np

from sparkspec.engine.cuda_graphs import (
    MIXED_PROMPTS,
    GraphKey,
    GraphRunner,
    mixed_rows_needed,
    prompt_slot_rows,
    request_rows,
)
from sparkspec.engine.input_batch import InputBatch, padded
from sparkspec.engine.packed_step import PackedStep
from sparkspec.engine.scheduler import ScheduledSeq
from sparkspec.engine.step_io import Upload, float_bits

# query lengths prefills are padded to (short prompts: one graph instead of an eager forward)
PREFILL_LENS = (16, 32, 64, 128, 256, 512)


def prompt_rows(seq, start: int, num_tokens: int) -> range:
    """Positions t of a chunk [start, start + num_tokens) whose row scores prompt token t + 1 and whose logprob
    the request still lacks (`seq.prompt_logprobs` holds tokens 0..m-1: row m - 1 comes next)."""
    if seq.params.prompt_logprobs is None or seq.prompt_logprobs is None:
        return range(0)
    return range(max(start, len(seq.prompt_logprobs) - 1), min(start + num_tokens, len(seq.prompt_ids) - 1))


def sampling_mode(params: list) -> str:
    """The step's sampling mode: what the sampler may skip for every request of the step."""
    if all(sp.greedy for sp in params):
        return "greedy"
    return "filter" if any((sp.top_k > 0 or sp.top_p < 1) and not sp.greedy for sp in params) else "sample"


class StepPlanner:
    """Packs steps for one runner. `device_drafts`: k of the device drafter (0: none, or a host drafter);
    `needs_next_ids`: the drafter reads the token after every row (MTP)."""

    def __init__(self, vocab_size: int, device_drafts: int = 0, needs_next_ids: bool = False):
        self.vocab_size = vocab_size
        self.device_drafts = device_drafts
        self.needs_next_ids = needs_next_ids
        self.graphs: GraphRunner | None = None  # the captured shapes (None: every step runs eagerly)
        self.batch: InputBatch | None = None  # the persistent batch of graph decode steps

    def use_graphs(self, graphs: GraphRunner, max_num_seqs: int) -> None:
        self.graphs = graphs
        self.batch = InputBatch(2 * max_num_seqs, graphs.width, graphs.cache.scratch_block, graphs.ratios,
                                self.device_drafts, self.needs_next_ids)

    def plan(self, items: list[ScheduledSeq], drafts: list[list[int]], draft_rows: list[int], num_next_drafts: int,
             structured: bool = False) -> PackedStep:
        """The step's PackedStep: from the persistent batch when it is a graph decode / verify step, else from
        the lists. A graph step's `flat` is its whole upload (batch head, then the parts)."""
        if self.batch is not None and not structured:
            p = self.batch.pack_decode(items, drafts, draft_rows, num_next_drafts, self.graphs.key_for)
            if p is not None:
                return p
        return self.pack_lists(items, drafts, draft_rows, num_next_drafts, structured)

    def graph_key(self, p: PackedStep, structured: bool = False) -> GraphKey | None:
        """The captured step a pure decode / verify step without logprobs or structured output runs as, or None
        (eager)."""
        items = p.items
        if self.graphs is None or structured or p.prompt_items or not all(it.samples for it in items) \
                or any(sp.logprobs is not None for sp in p.params):
            return None
        num_drafts = self.device_drafts if p.num_drafts else 0
        key = self.graphs.key_for(len(items), max(len(ids) for ids in p.item_ids), p.mode, num_drafts)
        return None if key is None or key.draft_cols < p.K else key  # a prefill key verifies no drafts

    def pack_lists(self, items: list[ScheduledSeq], drafts: list[list[int]], draft_rows: list[int],
                   num_next_drafts: int, structured: bool = False) -> PackedStep:
        """Any step, from Python lists: rows, logits rows, and every int the device needs, packed by name."""
        p = PackedStep(items, drafts)
        logits_rows, first_lrow, rows = [], {}, 0
        prompt_lrows, prompt_next = [], []
        for i, (it, d) in enumerate(zip(items, drafts)):
            seq, nc = it.seq, it.seq.num_cached_tokens
            scored = prompt_rows(seq, nc, it.num_tokens)
            if scored:
                p.prompt_items.append((i, scored.start, len(scored)))
                prompt_lrows += range(len(logits_rows), len(logits_rows) + len(scored))
                prompt_next += seq.prompt_ids[scored.start + 1 : scored.stop + 1]
                logits_rows += range(rows + scored.start - nc, rows + scored.stop - nc)
            if it.samples:
                p.sampling.append(i)
                first_lrow[i] = len(logits_rows)
                logits_rows += range(rows + it.num_tokens - 1, rows + it.num_tokens + len(d))
            p.item_ids.append(seq.token_ids(nc, nc + it.num_tokens) + d)
            rows += it.num_tokens + len(d)
        p.logits_rows = logits_rows
        params = p.params
        p.K = max((len(drafts[i]) for i in p.sampling), default=0)
        p.mode = sampling_mode(params)
        p.num_drafts = p.keep_drafts = num_next_drafts if self.device_drafts and p.sampling else 0
        p.key = self.graph_key(p, structured)
        R = len(p.sampling)
        first = [0]  # first forward row of every item (and the total)
        for ids in p.item_ids:
            first.append(first[-1] + len(ids))
        item_rows = [len(ids) for ids in p.item_ids]
        if p.key is not None:  # the static layout: request i owns rows i·q .. i·q + q - 1, logits for every row
            R, q = p.key.num_reqs, p.key.q
            p.K, p.num_drafts = p.key.draft_cols, p.key.num_drafts
            first = [i * q for i in range(R + 1)]
            first_lrow = {i: i * q + (items[i].num_tokens - 1 if i < len(items) else 0) for i in range(R)}
            item_rows = [q] * len(items)
        if self.needs_next_ids:  # MTP reads the token after every row (past them: 0)
            p.next_host = [t for it, n in zip(items, item_rows) for t in self.next_tokens(it, n)]
            if p.key is not None:
                p.next_host += [0] * ((R - len(items)) * p.key.q)  # a graph's dummy requests
        V = self.vocab_size
        p.logprob_rows = [r for r, sp in enumerate(params) if sp.logprobs is not None]
        p.num_top = min(max((sp.logprobs for sp in params if sp.logprobs is not None), default=0), V)
        p.num_prompt_top = min(max((items[i].seq.params.prompt_logprobs for i, _, _ in p.prompt_items), default=0), V)
        self.add_request_parts(p, R, first, first_lrow, draft_rows)
        if p.key is None:  # eager extras (a graph step has none of them)
            p.upload.add("logprob_rows", p.logprob_rows)
            p.upload.add("prompt_rows", prompt_lrows)
            p.upload.add("prompt_next", prompt_next)
        else:
            head = self.graphs.pack(p.key, p.item_ids, [it.seq.block_ids for it in items],
                                    [it.seq.num_cached_tokens for it in items])
            p.flat = head + p.upload.flat()
        return p

    @staticmethod
    def add_request_parts(p: PackedStep, R: int, first: list[int], first_lrow: dict[int, int],
                          draft_rows: list[int]) -> None:
        """The per-request parts of `p.upload` for its sampling requests, then requests S..R-1: a graph's dummy
        requests, which own their rows, sample greedily and verify nothing (with no sampling requests at all,
        the static inputs a graph is captured on). `first`: first forward row of every request (and the total);
        `first_lrow`: logits row of each request's first verified token. `InputBatch.pack_decode` writes the same
        parts with numpy: change both."""
        items, drafts, params = p.items, p.drafts, p.params
        S = len(p.sampling)
        reqs = p.sampling + list(range(S, R))
        num_drafts = [len(drafts[i]) for i in p.sampling] + [0] * (R - S)
        pads = R - S
        up = p.upload
        up.add("gather", [first_lrow[i] + min(j, n) for i, n in zip(reqs, num_drafts) for j in range(p.K + 1)])
        up.add("draft_ids", [t for i in p.sampling for t in drafts[i] + [-1] * (p.K - len(drafts[i]))]
               + [-1] * (p.K * pads))
        up.add("q_rows", [draft_rows[i] if drafts[i] else -1 for i in p.sampling] + [-1] * pads)
        up.add("top_k", [sp.top_k for sp in params] + [0] * pads)
        up.add("seeds", [items[i].seq.seed for i in p.sampling] + [0] * pads)
        up.add("positions", [items[i].seq.num_cached_tokens + items[i].num_tokens for i in p.sampling] + [0] * pads)
        up.add("reqs", reqs)
        up.add("pending_rows", [first[i] + (items[i].num_tokens if i < len(items) else 1) - 1 for i in reqs])
        up.add("temperature", float_bits([sp.device_temperature for sp in params] + [0.0] * pads))
        up.add("top_p", float_bits([sp.top_p for sp in params] + [1.0] * pads))
        up.add("next_ids", p.next_host)
        up.add("gumbel", [int(sp.seed is not None) for sp in params] + [0] * pads)  # "auto": seeded rows' scheme

    @staticmethod
    def next_tokens(it: ScheduledSeq, num_rows: int) -> list[int]:
        """The token after each of an item's `num_rows` rows, where known (its chunk's), then 0."""
        nc = it.seq.num_cached_tokens
        after = it.seq.token_ids(nc + 1, nc + it.num_tokens + 1)
        return after + [0] * (num_rows - len(after))

    def dummy_upload(self, key: GraphKey) -> Upload:
        """The parts of a step of dummy requests only (the static inputs a graph is captured on)."""
        p = PackedStep([], [])
        p.key, p.K = key, key.draft_cols
        first = [0, *itertools.accumulate(request_rows(key))]
        if self.needs_next_ids:
            p.next_host = [0] * first[-1]
        n = len(first) - 1
        self.add_request_parts(p, n, first, dict(enumerate(first[:n])), [])
        return p.upload

    def pack_mixed(self, items: list[ScheduledSeq], drafts: list[list[int]], draft_rows: list[int],
                   num_next_drafts: int) -> tuple[list[int], PackedStep] | None:
        """A step of decode / verify rows beside prompt chunks that sample, as one mixed graph (`cuda_graphs.py`)
        -> (the items in the plan's order: decode rows, then prompts; the plan), or None where one does not hold
        it (no decode row or no prompt, a chunk that samples nothing, logprobs, prompt logprobs, a grammar, more
        or longer prompts than a mixed graph takes, a key not captured yet).

        The decode region comes from the persistent batch (`InputBatch.decode_region`); the prompts' rows, by
        lists, follow it back to back, and every per-request part lists the real requests first (decode, then
        prompts), the dummies after them, so `read_step` and the hand-over of sampled tokens read it as any
        step. A prompt samples at its last row, which each of its K + 1 verified rows repeats (it verifies no
        drafts)."""
        graphs, batch = self.graphs, self.batch
        num_tokens = [it.num_tokens for it in items]
        n = num_tokens.count(1)  # (every check before the key costs O(prompts), not O(items): most steps fail one)
        if batch is None or n == len(items) or not n or len(items) - n > MIXED_PROMPTS \
                or mixed_rows_needed(sum(num_tokens) - n, len(items) - n) > max(graphs.mixed_rows, default=0):
            return None
        decode = [i for i, t in enumerate(num_tokens) if t == 1]  # (each must sample: `decode_lengths`)
        prompts = [i for i, t in enumerate(num_tokens) if t != 1]
        pro = [items[i] for i in prompts]
        if any(not it.samples or it.seq.num_inflight or it.seq.grammar is not None
               or it.seq.params.prompt_logprobs is not None for it in pro):
            return None
        dec = [items[i] for i in decode]
        dseqs, pseqs = [it.seq for it in dec], [it.seq for it in pro]
        num_cached = batch.decode_lengths(dseqs)
        if num_cached is None:
            return None
        slots = batch.slots_for(dseqs + pseqs)  # (one call: filling a slot may free those not in the call)
        m = len(pro)
        if batch.wants_logprobs[slots].any():
            return None
        ddrafts = [drafts[i] for i in decode]
        num_drafts = np.fromiter(map(len, ddrafts), np.int64, n)
        keep = num_next_drafts if self.device_drafts else 0
        lengths = [it.num_tokens for it in pro]
        key = graphs.mixed_key_for(n, 1 + int(num_drafts.max()), batch.mode_of(slots),
                                   self.device_drafts if keep else 0, lengths)
        if key is None or not graphs.ready(key) or not batch.sync_tables(dec, slots[:n]):
            return None
        width = graphs.width_for(key)
        if any(len(s.block_ids) > width for s in pseqs):
            return None
        head, per_req, next_ids = batch.decode_region(dseqs, slots[:n], num_cached, ddrafts, num_drafts,
                                                      [draft_rows[i] for i in decode], key, width)
        phead, pper_req, pnext = self.prompt_region(pro, slots[n:], key, width, lengths)
        flat = [np.concatenate([d, e]) for d, e in zip(head, phead)]
        for d, e in zip(per_req, pper_req):  # real decode rows, real prompts, dummy decode rows, dummy prompts
            flat.append(np.concatenate([d[:n], e[:m], d[n:], e[m:]]).ravel())
        flat.insert(len(flat) - 1, np.concatenate([next_ids, pnext]))  # next_ids: per row, before the flags
        p = PackedStep(dec + pro, ddrafts + [[] for _ in pro], sampling=list(range(n + m)), K=key.draft_cols,
                       mode=key.mode, num_drafts=key.num_drafts, keep_drafts=keep, key=key)
        p.flat, p.slots = np.concatenate(flat), slots
        return decode + prompts, p

    def prompt_region(self, pro: list[ScheduledSeq], slots: np.ndarray, key: GraphKey, width: int,
                      lengths: list[int]) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        """The prompt slots of mixed graph `key` holding chunks `pro` (then dummies) -> the arrays of
        `InputBatch.decode_region` for them: the head's, the per-request parts (first dimension P), next_ids."""
        batch, R, P, K = self.batch, key.num_reqs, key.num_prompts, key.draft_cols
        m, T0 = len(pro), key.num_reqs * key.q  # the region's first row
        rows = np.asarray(prompt_slot_rows(key, lengths), np.int64)  # [P]
        starts = np.zeros(P, np.int64)
        starts[:m] = [it.seq.num_cached_tokens for it in pro]
        offsets = np.concatenate([[0], np.cumsum(rows)])  # [P+1] within the region
        slot_of_row = np.repeat(np.arange(P), rows)  # [Tp]
        positions = starts[slot_of_row] + np.arange(key.prompt_rows) - offsets[:-1][slot_of_row]
        ids = np.zeros(key.prompt_rows, np.int64)
        tables = np.full((P, width), batch.scratch, np.int64)
        for j, it in enumerate(pro):
            nc = it.seq.num_cached_tokens
            ids[offsets[j] : offsets[j] + it.num_tokens] = it.seq.token_ids(nc, nc + it.num_tokens)
            tables[j, : len(it.seq.block_ids)] = it.seq.block_ids
        row_ids = T0 + np.arange(key.prompt_rows)
        emits = [np.where((positions + 1) % ratio == 0, row_ids, -1) for ratio in batch.ratios]
        last = T0 + offsets[:-1] + padded(lengths, P, 1) - 1  # [P] sampled rows: each chunk's last (a dummy's one)
        head = [ids, positions, R + slot_of_row, T0 + offsets[1:], starts + rows, tables.ravel(), *emits]
        per_request = [np.repeat(last[:, None], K + 1, 1), np.full((P, K), -1, np.int64), np.full(P, -1, np.int64),
                       padded(batch.top_k[slots], P, 0), padded(batch.seeds[slots], P, 0),
                       padded(starts[:m] + lengths, P, 0), R + np.arange(P), last,
                       padded(batch.temperature[slots], P, 0.0, np.float64).view(np.int64),
                       padded(batch.top_p[slots], P, 1.0, np.float64).view(np.int64), padded(batch.seeded[slots], P, 0)]
        next_ids = np.zeros(0, np.int64)
        if self.needs_next_ids:  # the token after each row, where known (a prompt's own), then 0
            next_ids = np.zeros(key.prompt_rows, np.int64)
            for j, it in enumerate(pro):
                next_ids[offsets[j] : offsets[j] + rows[j]] = self.next_tokens(it, int(rows[j]))
        return head, per_request, next_ids

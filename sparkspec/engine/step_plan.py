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

from sparkspec.engine.cuda_graphs import GraphKey, GraphRunner
from sparkspec.engine.input_batch import InputBatch
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
        """The parts of a step of `key.num_reqs` dummy requests (the static inputs a graph is captured on)."""
        p = PackedStep([], [])
        p.key, p.K = key, key.draft_cols
        R, q = key.num_reqs, key.q
        if self.needs_next_ids:
            p.next_host = [0] * (R * q)
        self.add_request_parts(p, R, [i * q for i in range(R + 1)], {i: i * q for i in range(R)}, [])
        return p.upload

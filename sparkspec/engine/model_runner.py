"""Executes one scheduled step on the device: verify -> accept -> propose, then ONE device->host copy.
Legend: T tokens, R requests in the batch, S requests that sample this step, K most drafts verified, V vocab.

Every scheduled sequence contributes its chunk `all_ids[num_cached : num_cached + n]` (a prefill chunk, a
recompute chunk, or the pending token of a decode row), followed on decode rows by the drafts chosen for
verification. The host plan (`step_plan.py`, pure host; graph decode steps from the persistent batch of
`input_batch.py`) packs everything into one upload (one host->device copy), the target runs once,
the rejection sampler turns the logits of every sampling row into emitted tokens on the device, a device
drafter proposes the next drafts from the same rows, and one copy brings back accepted counts, tokens, the
next drafts and a per-request flag, computed on the device, that the request's distribution was finite (a
request whose was not fails alone; see `RejectionSampler.verify`). Nothing in between waits for the device.
On CUDA a decode / verify step replays one captured graph of all of it (`cuda_graphs.py`); prefill and mixed
steps run the same functions eagerly. What runs on the device (forward, accept, draft) is `device_step.py`; this
file plans, dispatches, launches ahead and reads back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from sparkspec.engine.config import DEFAULT_SAMPLING_SCHEME
from sparkspec.engine.cuda_graphs import MIXED_PROMPTS
from sparkspec.engine.device_step import DeviceStep
from sparkspec.engine.grammar import LazyMasks
from sparkspec.engine.packed_step import PackedStep
from sparkspec.engine.scheduler import ScheduledSeq
from sparkspec.engine.step_io import Download, PendingFetch
from sparkspec.engine.step_plan import PREFILL_LENS, StepPlanner
from sparkspec.engine.step_result import StepResult, proposes_q, read_parts, read_step
from sparkspec.models.cache import KVCache, cache_dtype
from sparkspec.models.deepseek_v4 import DeepseekV4Model
from sparkspec.models.forward_batch import to_device
from sparkspec.ops.sampling import (
    gather_logprobs,
    logprobs_for,
)


@dataclass
class InFlightStep:
    """A launched step whose copy back has not been read (`ModelRunner.launch`): its parts (item indices, plan) in
    launch order, one part where the step is a decode graph, and their one copy back."""

    parts: list[tuple[list[int], PackedStep]]
    pending: PendingFetch
    q_store: torch.Tensor | None
    reordered: bool = False  # one part whose items are not in the step's order (a mixed graph's)

    @property
    def sampling(self) -> list[int]:
        """Items whose last row yields a token (the ones that now have a token in flight)."""
        return [group[i] for group, p in self.parts for i in p.sampling]

    def result(self) -> StepResult:
        """Waits for the step's copy back -> what `execute` returns for it."""
        host = self.pending.wait()
        if len(self.parts) == 1 and not self.reordered:
            return read_step(self.parts[0][1], host, self.q_store)
        return read_parts(self.parts, host, self.q_store)


class ModelRunner(DeviceStep):
    """Plans a step on the host, runs its device half (`DeviceStep`) as a captured graph or eagerly, and reads
    the one copy back; launches plain steps ahead for async scheduling."""

    def __init__(self, model: DeepseekV4Model, proposer=None, max_num_seqs: int = 256,
                 sampling_scheme: str = DEFAULT_SAMPLING_SCHEME):
        super().__init__(model, proposer, sampling_scheme)
        self.max_num_seqs = max_num_seqs
        self.planner = StepPlanner(model.cfg.vocab_size, proposer.num_spec_tokens if self.drafts_on_device else 0,
                                   bool(self.capture.get("capture_final_streams")))
        self.graphs = None  # GraphRunner: decode / verify steps as CUDA graphs (see `cuda_graphs.py`)
        self.last_tokens: torch.Tensor | None = None  # [slots] the token each slot's last `launch` sampled
        self.num_mixed_steps = 0  # steps run as one mixed graph (decode rows beside joining prompts)
        self._context_writes = True

    @property
    def context_writes(self) -> bool:
        """Whether the next plain steps' rows (decode rows and prompt chunks) are written into the device drafter's
        context. The engine turns it off while the adaptive budget's plain arm holds
        (`VerificationBudget.writes_context`): a step that verifies and proposes nothing then runs as the plain
        engine's step (no taps, no context write). A step with drafts to verify or to propose writes every row
        whatever this says."""
        return self._context_writes

    @context_writes.setter
    def context_writes(self, on: bool) -> None:
        self._context_writes = on
        if self.graphs is not None:
            self.graphs.decode_context = on

    def use_graphs(self, max_num_seqs: int, max_model_len: int, num_spec_tokens: int, eager: bool = False,
                   max_num_batched_tokens: int = 0, cold_decode: bool = False) -> None:
        """Decode (q = 1) and verify (q = 1 + num_spec_tokens) steps, and prefills of R requests padded to the
        lengths of PREFILL_LENS up to `max_num_batched_tokens` (R·q up to that too), run as graphs, captured now
        for the greedy and plain sampling modes (with and without drafting; prefills of several requests in the
        greedy mode only, the rest on first use: each capture costs ~0.2 s of start-up on the H200); `eager`
        builds the same static steps and runs them eagerly (tests of the padding on CPU). `cold_decode`: the
        plain steps that skip the drafter's context (`context_writes`) are captured too, decode, prefill and mixed:
        each graph that plain decoding runs gets a twin without the taps and the write (`GraphKey.context`)."""
        from sparkspec.engine.cuda_graphs import GraphRunner

        query_lens = (1, 1 + num_spec_tokens) if num_spec_tokens else (1,)
        prefill_lens = tuple(q for q in PREFILL_LENS if q <= max(max_num_batched_tokens, 1))
        self.graphs = GraphRunner(self.cache, self.ratios, self.graph_step, self.planner.dummy_upload, max_num_seqs,
                                  max_model_len, query_lens, eager=eager,
                                  preserve=() if self.q_store is None else (self.q_store,), prefill_lens=prefill_lens,
                                  prefill_rows=max_num_batched_tokens)
        self.planner.use_graphs(self.graphs, max_num_seqs)
        drafts = (0, self.proposer.num_spec_tokens) if self.drafts_on_device else (0,)
        shapes = [(R, q) for R in self.graphs.sizes for q in self.graphs.query_lens]
        shapes += [(R, q) for R, q in self.graphs.prefill_shapes() if R == 1]
        keys = [self.graphs.key_for(R, q, mode, d) for R, q in shapes for mode in ("greedy", "sample") for d in drafts]
        keys += [self.graphs.key_for(R, q, "greedy", d) for R, q in self.graphs.prefill_shapes() if R > 1
                 for d in drafts]
        # mixed graphs (decode rows beside joining prompts) are used only once captured, never captured on first
        # use mid-serving: plain decoding's in both sampling modes, and a drafting engine's verify-and-propose step
        keys += self.graphs.mixed_keys([(1, 0)], ("greedy", "sample"))
        if cold_decode and self.drafts_on_device:  # every plain step's graph, twinned: no taps, no context write
            keys += [k._replace(context=False) for k in keys if not k.num_drafts and not k.draft_cols]
        if num_spec_tokens:
            keys += self.graphs.mixed_keys([(1 + num_spec_tokens, drafts[-1])], ("greedy",))
        self.graphs.capture_all(keys)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """The pools every block id of the engine's block manager addresses (target and drafter)."""
        self.cache = KVCache(self.model, num_blocks, block_size)
        if self.proposer is not None:
            self.proposer.allocate(num_blocks, block_size, self.device, cache_dtype(self.model))  # as the plan prices
        for name, (shape, dtype) in self.buffers().items():
            setattr(self, name, torch.zeros(shape, dtype=dtype, device=self.device))

    def buffers(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What `allocate` makes besides the block pools, name -> (shape, dtype): priced by the engine's KV plan."""
        if not self.drafts_on_device:
            return {}
        rows = self.max_num_seqs + MIXED_PROMPTS  # a mixed graph's sampling requests: R decode rows and its prompts
        return {"q_store": ((rows, self.proposer.num_spec_tokens, self.model.cfg.vocab_size), torch.float32)}

    @torch.inference_mode()
    def execute(
        self,
        items: list[ScheduledSeq],
        drafts: list[list[int]],  # per item: draft tokens verified behind its pending token
        draft_rows: list[int],  # per item: its drafts' row in `q_store`, -1 = one-hot q (greedy or host drafter)
        num_next_drafts: int,  # k for the device drafter at the end of this step (0 = do not draft)
        token_masks: Mapping[int, torch.Tensor] | None = None,  # item -> [n+1, W] int32 grammar bitmask (LazyMasks)
    ) -> StepResult:
        """pack (host) -> forward -> accept -> draft -> the one copy back -> read. A decode / verify step replays
        the captured graph of all of it; other steps run the same functions eagerly.

        Logprobs (only when a request of the step asks; host flags; such steps run eagerly): rows 0..L of a
        request that wants them go through `logprobs_for` (the distribution it samples from, never the
        drafter's), and prompt rows that score prompt tokens for `prompt_logprobs` (the raw log-softmax: those
        tokens were not sampled) are added to `logits_rows`; both ride in the step's one copy.

        Structured output (`token_masks`; such steps run eagerly too): the verified rows of those requests get
        -inf outside their grammar's mask before the sampler, in a second host->device copy (the bitmasks). The
        masks are read only once the forward is launched: `LazyMasks` makes them then, while the device runs.

        A step that mixes decode rows with prompt chunks (a request joins while others decode), or prompts that
        need more than one prefill graph, runs in parts where graphs are captured (`split_mixed`): the decode /
        verify rows as their graph, then the short prompts as prefill graphs, then any other chunks eagerly."""
        if self.graphs is not None:
            mixed = None if token_masks is not None else self.planner.pack_mixed(items, drafts, draft_rows,
                                                                                 num_next_drafts)
            if mixed is not None:  # decode rows and joining prompts: one graph
                order, p = mixed
                self.num_mixed_steps += 1
                part, down = Download(), Download()
                self.run_graph(p, part)
                down.absorb(part, "0")
                return read_parts([(order, p)], down.fetch(), self.q_store)
            groups = self.split_mixed(items, max(self.graphs.prefill_lens, default=0), self.graphs.prefill_groups)
            if groups is not None:
                return self.execute_split(groups, items, drafts, draft_rows, num_next_drafts,
                                          token_masks)
        return self.execute_one(items, drafts, draft_rows, num_next_drafts, token_masks)

    @staticmethod
    def split_mixed(items: list[ScheduledSeq], max_prefill_len: int = 0,
                    group_prompts: Callable[[list[int]], list[list[int]]] | None = None) -> list[list[int]] | None:
        """The parts of a step: its decode rows (first: only they verify drafts), then its sampling prompts of at
        most `max_prefill_len` tokens in the groups `group_prompts` makes of their lengths (each group one
        prefill graph; default: each prompt alone), then the other chunks together (eager). None: one part.
        Why: one prompt chunk in a step made the whole step eager, and an eager step cost ~20x its graph on the
        H200 demo pair (an eager DSpark step: target, sampler and drafter as separate launches; an eager prefill
        of 1,024 tokens: ~20 ms of host launches against ~2 ms on the device); in a closed loop a request joins
        every few steps."""
        if [it.num_tokens for it in items].count(1) == len(items):  # (a list: cheaper than a generator)
            return None  # decode rows only (the common step: no per-item checks), or a 1-token chunk among them
        decode, short, rest = [], [], []
        for i, it in enumerate(items):
            if it.num_tokens == 1 and it.samples:
                decode.append(i)
            elif it.samples and it.num_tokens <= max_prefill_len:
                short.append(i)
            else:
                rest.append(i)
        if short:
            lengths = [items[i].num_tokens for i in short]
            grouped = group_prompts(lengths) if group_prompts else [[j] for j in range(len(short))]
            short = [[short[j] for j in g] for g in grouped]
        groups = ([decode] if decode else []) + short + ([rest] if rest else [])
        return groups if len(groups) > 1 else None

    def execute_split(self, groups: list[list[int]], items: list[ScheduledSeq],
                      drafts: list[list[int]], draft_rows: list[int],
                      num_next_drafts: int, token_masks: Mapping[int, torch.Tensor] | None) -> StepResult:
        """Run each group of items as its own step, decode rows first, and merge the results as one step's.

        Every part is dispatched before any is read, and the parts come back in one copy: the host packs the next
        part while the device runs the one before. Read part by part (one copy back, and one wait, each), a mixed
        DSpark step on the H200 demo pair at c = 16 cost ~2 ms more than a decode step (4.9 against 2.9 ms),
        where a mixed plain step, launched this way, cost 0.2 ms more.

        The q rows: a part that proposes sampled drafts writes their q to `q_store` rows 0..S_part-1, and only
        the first part (the decode rows) verifies drafts, reading the previous step's rows before it writes. So
        each part's new rows are copied aside once it has run (a device copy; nothing waits), and laid out at
        the end at their places in the merged order of sampling requests (parts in order): row = the request's
        place among the whole step's sampling requests, as for one step. The parts' tokens do not depend on
        each other: they touch different requests, whose caches and drafter rows are disjoint."""
        parts: list[tuple[list[int], PackedStep]] = []
        saved: list[tuple[int, torch.Tensor]] = []  # (first merged row, the part's q rows [S_part, k, V])
        down, num_sampled = Download(), 0
        for j, group in enumerate(groups):
            masks = None
            if isinstance(token_masks, LazyMasks):  # still unmade: each part makes them after its forward
                masks = token_masks.subset(group)
            elif token_masks is not None:
                masks = {j: token_masks[i] for j, i in enumerate(group) if i in token_masks} or None
            p, part = self.dispatch([items[i] for i in group], [drafts[i] for i in group],
                                    [draft_rows[i] for i in group], num_next_drafts, masks)
            down.absorb(part, str(j))
            if proposes_q(p, self.q_store):
                saved.append((num_sampled, self.q_store[: len(p.sampling)].clone()))
            parts.append((group, p))
            num_sampled += len(p.sampling)
        for start, q in saved:
            self.q_store[start : start + q.shape[0]].copy_(q)
        return read_parts(parts, down.fetch(), self.q_store)

    def execute_one(self, items: list[ScheduledSeq], drafts: list[list[int]], draft_rows: list[int],
                    num_next_drafts: int,
                    token_masks: Mapping[int, torch.Tensor] | None = None) -> StepResult:
        """One step as one forward: its graph, or eagerly."""
        p, down = self.dispatch(items, drafts, draft_rows, num_next_drafts, token_masks)
        return read_step(p, down.fetch(), self.q_store)

    def dispatch(self, items: list[ScheduledSeq], drafts: list[list[int]], draft_rows: list[int],
                 num_next_drafts: int, token_masks: Mapping[int, torch.Tensor] | None = None
                 ) -> tuple[PackedStep, Download]:
        """One step as one forward, queued on the device -> (its plan, its copy back, not started)."""
        p = self.plan(items, drafts, draft_rows, num_next_drafts, token_masks is not None)
        down = Download()
        if p.key is not None:
            self.run_graph(p, down)
            return p, down
        context = self.writes_context(p)
        batch, out, dev = self.forward(p, context)
        if p.prompt_items:  # prompt tokens: the model's raw distribution
            lp = torch.log_softmax(out.logits[dev["prompt_rows"]].float(), -1)
            down.add("prompt", *gather_logprobs(lp, dev["prompt_next"], p.num_prompt_top))
        if not p.sampling:  # a prefill chunk: context only
            if context:
                self.observe_context(batch, out, dev)
            return p, down
        if token_masks is not None:
            dev["token_bitmask"] = self.bitmask_rows(p, token_masks).to(self.device, non_blocking=True)
        res = self.decode(batch, out, dev, len(p.sampling), p.K, p.mode, p.num_drafts, context=context)
        if p.logprob_rows:  # rows 0..K of the requests that ask (rows past L are read back but dropped)
            lp_t, K1 = dev["logprob_rows"], p.K + 1
            lp = logprobs_for(res.logits[lp_t].flatten(0, 1), res.sampling.index_select(lp_t).repeat_interleave(K1))
            down.add("sampled", *gather_logprobs(lp, res.tokens[lp_t].flatten(), p.num_top))
        self.add_fetch(down, res, len(p.sampling))
        return p, down

    def run_graph(self, p: PackedStep, down: Download) -> None:
        """Replays step `p`'s graph on its upload and adds its results to `down`."""
        _, res = self.graphs.run(p.key, to_device(p.flat, self.device))
        self.add_fetch(down, res, len(p.sampling))

    @torch.inference_mode()
    def launch(self, items: list[ScheduledSeq]) -> InFlightStep | None:
        """A plain step (no drafts, no logprobs, no grammar), launched and not waited for (async scheduling): its
        parts run (`split_mixed`: the decode rows as their graph, then prompts as prefill graphs, then other
        chunks eagerly), their one copy back is started, and the tokens they sample are left on the device for
        the step after it, which may be launched before this one's result is read. None where a part cannot be
        taken (nothing has run then: the engine runs the step by `execute`, after reading the step in flight).

        Rows whose pending token is still in flight (`Sequence.num_inflight`: sampled by the step launched
        before) get it on the device: every part writes the tokens it samples into `last_tokens` at its requests'
        slots of the persistent batch, and the decode part's upload carries, behind the graph's own parts, its
        slots and the rows to fill from them (one copy up, two small kernels; the graph reads its ids from the
        filled upload). A prompt chunk's ids are all on the host (its request has nothing in flight).

        Why mixed steps too: with output lengths that vary, a request joins on most steps at high concurrency,
        and a step that carried a prompt ran in turn, the device idle while the host committed, scheduled and
        packed (on the H200 demo pair at c = 256, 79 % of the steps)."""
        batch, n = self.planner.batch, len(items)
        if batch is None or not n:
            return None
        mixed = self.planner.pack_mixed(items, [[] for _ in items], [-1] * n, 0)
        groups = [] if mixed is not None else self.split_mixed(items, max(self.graphs.prefill_lens, default=0),
                                                                self.graphs.prefill_groups)
        if groups is None:
            groups = [list(range(n))]
        if len(groups) > 1:  # one call: filling a slot may free those of requests not in the call
            batch.slots_for([it.seq for it in items if it.samples])
        plans = [] if mixed is None else [mixed]
        self.num_mixed_steps += mixed is not None
        for group in groups:
            sub = [items[i] for i in group]
            none = [[] for _ in sub]
            if [it.num_tokens for it in sub].count(1) == len(sub):  # decode rows (or 1-token chunks)
                p = batch.pack_decode(sub, none, [-1] * len(sub), 0, self.graphs.key_for)
                if p is None or p.key.q != 1:
                    return None
            else:
                if any(it.seq.num_inflight or it.seq.grammar is not None for it in sub):
                    return None
                p = self.planner.pack_lists(sub, none, [-1] * len(sub), 0)
                if p.prompt_items or p.logprob_rows:
                    return None
            plans.append((group, p))
        if self.last_tokens is None or self.last_tokens.numel() < batch.num_slots:
            grown = torch.zeros(batch.num_slots, dtype=torch.long, device=self.device)
            if self.last_tokens is not None:
                grown[: self.last_tokens.numel()] = self.last_tokens
            self.last_tokens = grown
        down = Download()
        if len(plans) == 1 and mixed is None:
            self.launch_part(plans[0][1], down)
        else:
            for j, (_, p) in enumerate(plans):
                part = Download()
                self.launch_part(p, part)
                down.absorb(part, str(j))
        return InFlightStep(plans, down.start(), self.q_store, mixed is not None)

    def launch_part(self, p: PackedStep, down: Download) -> None:
        """Runs one part of a launched step (`launch`), hands the tokens it samples over in `last_tokens` and adds
        its results to `down`."""
        S = len(p.sampling)
        if p.slots is not None:  # decode rows, packed by the persistent batch: pending tokens filled on the device
            n = len(p.items)  # (a mixed graph's prompts follow its decode rows: none has a token in flight)
            fill = np.flatnonzero(np.fromiter((it.seq.num_inflight for it in p.items), np.int64, n))  # item = row
            L = len(p.flat)
            dev = to_device(np.concatenate([p.flat, p.slots, fill, p.slots[fill]]), self.device)
            slots, rows, src = dev[L : L + n], dev[L + n : L + n + len(fill)], dev[L + n + len(fill) :]
            if len(fill):
                dev[:L].index_copy_(0, rows, self.last_tokens.index_select(0, src))  # ids: the upload's first part
            _, res = self.graphs.run(p.key, dev)
        else:  # prompt chunks: every id on the host
            slots_np = self.planner.batch.slots_for([p.items[i].seq for i in p.sampling])
            if p.key is not None:
                L = len(p.flat)
                dev = to_device(np.concatenate([np.asarray(p.flat, np.int64), slots_np]), self.device)
                _, res = self.graphs.run(p.key, dev)
                slots = dev[L:]
            else:
                p.upload.add("last_slots", slots_np.tolist())
                context = self.writes_context(p)
                batch, out, dev = self.forward(p, context)
                if not S:
                    if context:
                        self.observe_context(batch, out, dev)
                    return
                res = self.decode(batch, out, dev, S, p.K, p.mode, p.num_drafts, context=context)
                slots = dev["last_slots"]
        self.last_tokens.index_copy_(0, slots, res.tokens[:S, 0])  # q = 1: the token sampled is the pending one
        self.add_fetch(down, res, S)

    def plan(self, items: list[ScheduledSeq], drafts: list[list[int]], draft_rows: list[int], num_next_drafts: int,
             structured: bool = False) -> PackedStep:
        """The host side of a step (`StepPlanner.plan`)."""
        return self.planner.plan(items, drafts, draft_rows, num_next_drafts, structured)

    def writes_context(self, p: PackedStep) -> bool:
        """Whether step `p` writes the device drafter's context: always, but a plain step (decode rows and prompt
        chunks, nothing verified or proposed) while `context_writes` is off."""
        if p.key is not None:
            return p.key.context
        return self._context_writes or bool(p.num_drafts or p.K)

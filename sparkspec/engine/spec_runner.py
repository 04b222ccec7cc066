"""Speculation at batch level: propose -> budget -> verify -> commit / roll back -> observe, for one engine step.

Rows of one step (one flattened ragged target forward):
  * prefill / recompute chunks (no drafts; the chunk that reaches the end of a prompt samples a token),
  * decode rows `[b, d_0 .. d_{l_r - 1}]` with a per-request l_r; l_r = 0 is a plain decode row, and when the
    budget plans no drafts for anyone the drafter is not called at all that step.
Drafters, the rejection sampler and the drafter protocol come from `sparkspec.spec_decode` (see `spec_decode/proposer.py`);
this file decides who drafts how much and keeps the engine's bookkeeping (cache rollback, stats).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import torch

from sparkspec.engine.budget import CostTable, VerificationBudget, load_or_measure, machine_key
from sparkspec.engine.config import EngineConfig
from sparkspec.engine.model_runner import ModelRunner
from sparkspec.engine.scheduler import ScheduledSeq, SchedulerOutput
from sparkspec.engine.sequence import Sequence
from sparkspec.sampling_params import SamplingParams
from sparkspec.spec_decode import RejectionSampler, Verdict, build_proposer
from sparkspec.spec_decode.proposer import EMPTY_DRAFT, CommittedRows, Draft

log = logging.getLogger("sparkspec.engine")
PROBE_EVERY = 16  # when the budget plans no drafts, still draft once every this many steps to keep estimates fresh


class EngineCommittedRows(CommittedRows):
    """Committed rows whose next token comes from the sequence itself (also right for mid-prompt chunks)."""

    def next_ids(self, r: int) -> torch.Tensor:
        (s, e), start, seq = self.spans[r], self.start_positions[r], self.seqs[r]
        ids = seq.all_ids[start + 1 : start + 1 + (e - s)]
        return torch.tensor(ids, device=self.input_ids.device, dtype=self.input_ids.dtype)


def truncate_draft(d: Draft, n: int) -> Draft:
    if n >= d.num_tokens:
        return d
    if n == 0:
        return EMPTY_DRAFT
    return Draft(d.token_ids[:n], None if d.probs is None else d.probs[:n],
                 None if d.confidences is None else d.confidences[:n])


class SpecRunner:
    def __init__(self, runner: ModelRunner, config: EngineConfig, drafter_tensors: dict, proposer=None):
        self.runner = runner
        self.model = runner.model
        self.config = config
        self.proposer = proposer or build_proposer(config.speculative, self.model, drafter_tensors,
                                                   config.num_spec_tokens)
        self.num_spec_tokens = self.proposer.num_spec_tokens
        self.sampler = RejectionSampler()
        self.capture = {"tap_layers": self.proposer.tap_layers,
                        "capture_final_streams": self.proposer.needs_final_streams}
        cost = self.cost_table() if config.spec_budget == "adaptive" else None
        self.budget = VerificationBudget(config.spec_budget, self.num_spec_tokens, cost)
        self._skipped = 0

    # ---- one step ----
    @torch.inference_mode()
    def run(self, sched: SchedulerOutput, append: Callable[[Sequence, list[int]], None], stats=None
            ) -> dict[Sequence, list[int]]:
        """Run the step and append produced tokens through `append` -> {seq: tokens produced this step}."""
        items = sched.scheduled
        self.track(sched)
        drafts = self.propose(items, stats)
        out, spans, input_ids = self.runner.forward(items, [d.token_ids for d in drafts], **self.capture)
        verdicts = self.verify(items, drafts, out.logits)
        starts = [it.seq.num_cached_tokens for it in items]
        committed, produced = self.commit(items, drafts, verdicts, spans, append, stats)
        done = [it.seq for it in items if it.seq.is_finished]
        if done:
            self.proposer.finish(done)
        keep = [i for i, it in enumerate(items) if not it.seq.is_finished]
        if keep:  # the drafter only ever sees committed rows
            self.proposer.observe(EngineCommittedRows(
                seqs=[items[i].seq for i in keep], spans=[committed[i] for i in keep],
                start_positions=[starts[i] for i in keep], input_ids=input_ids,
                taps=out.taps, final_streams=out.final_streams))
        return produced

    def track(self, sched: SchedulerOutput) -> None:
        """Drop drafter state of preempted requests; start it for requests (re)entering the batch."""
        if sched.preempted:
            self.proposer.finish(sched.preempted)
        fresh = [it.seq for it in sched.scheduled if it.seq.drafter_state is None]
        for it in sched.scheduled:
            self.runner.prepare(it.seq)
        for seq in fresh:
            seq.drafter_state = self.proposer.method
        if fresh:
            self.proposer.start(fresh)

    def verify(self, items: list[ScheduledSeq], drafts: list[Draft], logits: torch.Tensor) -> dict[int, Verdict]:
        """Rejection-sample every item that samples (logits rows: its last chunk row, then its draft rows)."""
        sampling = [i for i, it in enumerate(items) if it.samples]
        logit_spans, off = [], 0
        for i in sampling:
            logit_spans.append((off, off + 1 + drafts[i].num_tokens))
            off += 1 + drafts[i].num_tokens
        seqs = [items[i].seq for i in sampling]
        verdicts = self.sampler(logits, logit_spans, [drafts[i] for i in sampling], [s.params for s in seqs],
                                [s.generator for s in seqs])
        return dict(zip(sampling, verdicts))

    def commit(self, items, drafts, verdicts, spans, append, stats):
        """Advance caches by the chunk + accepted drafts, truncate rejected rows, append tokens.
        -> (committed forward rows per item, {seq: tokens produced})."""
        committed, produced = {}, {}
        for i, it in enumerate(items):
            seq, (s, _) = it.seq, spans[i]
            seq.num_cached_tokens += it.num_tokens
            committed[i] = (s, s + it.num_tokens)
            v = verdicts.get(i)
            if v is None:
                continue
            seq.num_cached_tokens += v.num_accepted
            seq.cache.truncate(seq.num_cached_tokens)  # roll back rejected draft rows
            committed[i] = (s, s + it.num_tokens + v.num_accepted)
            num_drafts = drafts[i].num_tokens
            if num_drafts:
                seq.spec.record(num_drafts, v.num_accepted)
                self.budget.observe(num_drafts, v.num_accepted)
                if stats is not None:
                    stats.record_spec(num_drafts, v.num_accepted)
            append(seq, v.token_ids)
            produced[seq] = v.token_ids
        return committed, produced

    def propose(self, items: list[ScheduledSeq], stats=None) -> list[Draft]:
        """Drafts per item (EMPTY_DRAFT for prefill chunks), already cut to the verification budget."""
        drafts: list[Draft] = [EMPTY_DRAFT] * len(items)
        decode = [i for i, it in enumerate(items) if it.num_lookahead > 0]
        if not decode:
            return drafts
        base_tokens = sum(it.num_tokens for it in items)
        k_plan = self.budget.plan_num_drafts(len(items), base_tokens)
        if k_plan == 0:
            self._skipped += 1
            if self._skipped % PROBE_EVERY:
                if stats is not None:
                    stats.num_drafter_skipped_steps += 1
                return drafts  # no drafter work at all this step
            k_plan = 1
        ks = [min(items[i].num_lookahead, k_plan) for i in decode]
        proposed = self.proposer.propose([items[i].seq for i in decode], ks)
        proposed = [truncate_draft(d, k) for d, k in zip(proposed, ks)]
        confs = [None if d.confidences is None else d.confidences.float().tolist() for d in proposed]
        num_sampling = sum(1 for it in items if it.samples)
        lengths = self.budget.lengths([d.num_tokens for d in proposed], confs, base_tokens, num_sampling)
        for i, d, n in zip(decode, proposed, lengths):
            drafts[i] = truncate_draft(d, n)
        return drafts

    # ---- cost table ----
    def cost_table(self) -> CostTable:
        cfg = self.model.cfg
        shape = json.dumps(cfg.to_dict(), sort_keys=True)
        p = next(self.model.parameters())
        key = machine_key(shape, str(p.dtype), str(p.device), torch.__version__, self.proposer.method,
                          str(self.num_spec_tokens), str(self.config.max_num_seqs))
        from pathlib import Path

        cache_dir = Path(self.config.cost_cache_dir) if self.config.cost_cache_dir else None

        def measure() -> CostTable:
            log.info("measuring the step-cost table for adaptive verification (cached per machine)")
            return self.measure_costs()

        return load_or_measure(key, measure, cache_dir)

    def measure_costs(self) -> CostTable:
        """Target forward time vs (requests, verify tokens) and drafter time vs requests, at a short context."""
        grid, r = [], 1
        while r < self.config.max_num_seqs:
            grid.append(r)
            r *= 2
        grid.append(self.config.max_num_seqs)
        target = self.runner.measure_target_cost(grid, self.num_spec_tokens)
        draft = [(r, self.measure_draft_seconds(r)) for r in grid]
        return CostTable(target, draft)

    @torch.inference_mode()
    def measure_draft_seconds(self, num_reqs: int, context_len: int = 32, repeats: int = 3) -> float:
        vocab = self.model.cfg.vocab_size
        gen = torch.Generator().manual_seed(num_reqs)
        seqs = [Sequence(-1 - i, torch.randint(2, vocab, (context_len,), generator=gen).tolist(),
                         SamplingParams(max_tokens=self.num_spec_tokens + 2, ignore_eos=True))
                for i in range(num_reqs)]
        for s in seqs:
            s.cache = self.model.new_cache()  # timing probes stay out of the engine's block pools
            self.runner.prepare(s)
        self.proposer.start(seqs)
        items = [ScheduledSeq(s, context_len) for s in seqs]
        out, spans, ids = self.runner.forward(items, [[] for _ in seqs], **self.capture)
        for s, tok in zip(seqs, out.logits.argmax(-1).tolist()):
            s.num_cached_tokens = context_len
            s.output_ids.append(tok)
        self.proposer.observe(EngineCommittedRows(seqs, spans, [0] * num_reqs, ids, out.taps, out.final_streams))
        times = []
        for _ in range(repeats):
            self.runner._sync()
            t0 = time.perf_counter()
            self.proposer.propose(seqs, [self.num_spec_tokens] * num_reqs)
            self.runner._sync()
            times.append(time.perf_counter() - t0)
        self.proposer.finish(seqs)
        return sorted(times)[len(times) // 2]

"""Speculation policy for the engine: which drafts each request verifies, how many to propose next, and the
acceptance bookkeeping. The device work (verify, accept, propose) happens in `device_step.py`.

Per request, the drafts proposed at the end of step n (and their confidences) arrive on the host with step n's
results; step n+1 verifies a prefix of them: the verification budget (`budget.py`; DSpark Algorithm 1 in
`acceptance.py`) picks its length from the confidences and the measured step costs. A request with no drafts is
a plain decode row.

Whether the next step drafts at all is the budget's regime decision, from the wall time the engine actually spends
per step: `choose` opens each step on the budget's clock (the interval since the previous `choose` is everything
the engine and its caller did for that step, host included), and `num_drafts_to_propose` tells it what the step
verifies and proposes (`budget.py` explains the model and its probes).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from sparkspec.engine.budget import VerificationBudget
from sparkspec.engine.config import EngineConfig
from sparkspec.engine.cost_table import CostTable, load_or_measure, machine_key
from sparkspec.engine.scheduler import ScheduledSeq
from sparkspec.engine.sequence import Sequence
from sparkspec.engine.step_log import is_wave
from sparkspec.spec_decode.build import build_proposer

log = logging.getLogger("sparkspec.engine")


class SpecPolicy:
    """What the engine decides about speculation on the host, step by step; it owns the proposer and the budget."""

    def __init__(self, model, config: EngineConfig, drafter_tensors: dict, proposer=None):
        self.model = model
        self.config = config
        self.proposer = proposer or build_proposer(config.speculative, model, drafter_tensors, config.num_spec_tokens)
        self.num_spec_tokens = self.proposer.num_spec_tokens
        self.budget: VerificationBudget | None = None
        self._num_verified = 0  # drafts `choose` picked for the step in progress (told to the budget)
        self._items: list[ScheduledSeq] | tuple = ()  # the step being decided (`ends_soon`)

    def start(self, runner, overlapped: bool = False) -> None:
        """Once the pools exist: measure (or load) the step costs the adaptive budget decides from. `overlapped`:
        the engine launches plain steps ahead (async scheduling), so a plain stretch's first two steps are not
        filed and a probe of plain decoding lasts two decisions longer (`VerificationBudget.plain_probe_len`)."""
        cost = self.cost_table(runner, overlapped) if self.config.spec_budget == "adaptive" else None
        self.budget = VerificationBudget(self.config.spec_budget, self.num_spec_tokens, cost,
                                         padded=runner.graphs is not None, plain_probe_extra=2 if overlapped else 0,
                                         context_window=self.proposer.window if self.may_skip_context else 0)
        self.budget.ends_soon = self.ends_soon

    @property
    def may_skip_context(self) -> bool:
        """The adaptive budget may let plain decode steps skip the device drafter's context write
        (`VerificationBudget.context_window`)."""
        return self.config.spec_budget == "adaptive" and self.proposer.on_device and self.proposer.window > 0

    # ---- before the step ----
    def choose(self, items: list[ScheduledSeq], held: bool = True) -> tuple[list[list[int]], list[int]]:
        """Drafts each item verifies (a prefix of what its request holds) and their rows in the runner's
        `q_store` (the one owner of the drafts' q; -1: one-hot). `held` False: the engine knows that no request
        holds drafts (a plain stretch launched ahead), and nothing is looked up per item."""
        self.budget.step_boundary()
        self._num_verified = 0
        if not held:
            return [[] for _ in items], [-1] * len(items)
        drafts: list[list[int]] = [[] for _ in items]
        decode = [i for i, it in enumerate(items) if it.num_lookahead > 0 and it.seq.spec.draft_ids]
        if decode:
            base_tokens = sum(it.num_tokens for it in items)
            avail = [items[i].seq.spec.draft_ids[: min(items[i].num_lookahead, self.cap(items[i].seq))]
                     for i in decode]
            confs = [items[i].seq.spec.confidences for i in decode]
            num_sampling = sum(1 for it in items if it.samples)
            lengths = self.budget.lengths([len(d) for d in avail], confs, base_tokens, num_sampling)
            for i, d, n in zip(decode, avail, lengths):
                drafts[i] = d[:n]
        self._num_verified = sum(len(d) for d in drafts)
        rows = [it.seq.spec.draft_row for it in items]
        return drafts, rows

    def cap(self, seq: Sequence) -> int:
        """Most drafts `seq` may verify: the engine's k, or less when the request asks (`num_spec_tokens`)."""
        return self.num_spec_tokens if seq.spec_cap is None else min(seq.spec_cap, self.num_spec_tokens)

    @staticmethod
    def step_counts(items: list[ScheduledSeq]) -> tuple[int, int, int]:
        """(items that sample, decode rows, tokens of prompt or recompute chunks): what the scheduler counts as it
        schedules (`SchedulerOutput.num_sampling` ...), for items the engine has filtered since."""
        num_sampling = num_decode = prompt_tokens = 0
        for it in items:
            seq, n, samples = it.seq, it.num_tokens, it.samples
            num_sampling += samples
            if n == 1 and samples and (seq.output_ids or seq.num_inflight):
                num_decode += 1
            else:
                prompt_tokens += n
        return num_sampling, num_decode, prompt_tokens

    def num_drafts_to_propose(self, items: list[ScheduledSeq], stats=None, num_running: int | None = None,
                              counts: tuple[int, int, int] | None = None) -> int:
        """k for the next step: drafts to propose at the end of this step (0: the drafter is not called).
        `num_running`: the requests the engine runs (buckets the budget's measurements; default: those sampling).
        `counts`: `step_counts(items)` where the engine has them from the scheduler (at c = 256 on the H200 the
        pass over the items cost ~100 us a step)."""
        num_sampling, num_decode, prompt_tokens = counts if counts is not None else self.step_counts(items)
        # the step is the prompt's, not the arm's, where its chunks outweigh its decode rows (a wave of prompts
        # joining); a few short chunks beside many decode rows are what a steady stream of requests looks like
        # (`VerificationBudget.note_step`)
        has_prompt = prompt_tokens > num_decode
        key = num_sampling if num_running is None else max(num_running, 1)
        num_chunks = len(items) - num_decode  # prompt (or recompute) chunks: requests joining
        wave = is_wave(num_chunks, num_decode)  # (a wave's steps are not filed)
        self._items = items  # (`ends_soon`, which the budget may ask)
        k = self.budget.next_num_drafts(num_sampling, num_sampling, key, has_prompt, wave) if num_sampling else 0
        self._items = ()
        if k and self.all_end(items):  # no request would read the drafts
            k = 0
        if not num_sampling:  # (a step of prompt chunks only: it writes their rows anyway)
            self.budget.writes_context = True
        elif stats is not None and not self.budget.writes_context:
            stats.num_context_skipped_steps += 1
        self.budget.note_step(key, self._num_verified, k, has_prompt, prompt_tokens, num_chunks, num_decode)
        if num_sampling and k == 0 and stats is not None:
            stats.num_drafter_skipped_steps += 1
        return k

    @staticmethod
    def all_end(items: list[ScheduledSeq]) -> bool:
        """Every request that samples in the step ends there: its token reaches `max_tokens` (a request's other ends,
        EOS or a stop string, cannot be known before). Why: with one output length at c = 256 on the H200 demo pair,
        requests end together, and drafting's step at a wave's end (a probe's first, say) cost 28 ms against 4 ms
        for a plain one. The pass stops at the first request that goes on, most often the first."""
        for it in items:
            if it.samples and it.seq.num_tokens_left > 1:
                return False
        return True

    def ends_soon(self, within: int) -> bool:
        """Half the requests that sample in the step being decided, or more, reach `max_tokens` within `within`
        tokens (`VerificationBudget.ends_soon`). O(requests), asked only where a probe of drafting is due."""
        num = ending = 0
        for it in self._items:
            if it.samples:
                num += 1
                ending += it.seq.num_tokens_left <= within
        return num > 0 and 2 * ending >= num

    # ---- after the step ----
    def note_tokens(self, num_tokens: int) -> None:
        """Tokens the step produced (every request's, after the stop checks): the budget's measured throughput."""
        self.budget.note_tokens(num_tokens)

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int, stats=None) -> None:
        if not num_drafts:
            return
        seq.spec.metrics.record(num_drafts, num_accepted)
        self.budget.observe(num_drafts, num_accepted)
        if stats is not None:
            stats.spec.record(num_drafts, num_accepted)

    def keep(self, seq: Sequence, drafts: list[int], confidences: list[float] | None, row: int) -> None:
        """`row`: where the drafts' q sits in the runner's `q_store` (-1: one-hot, greedy or host drafts)."""
        seq.spec.draft_ids, seq.spec.confidences, seq.spec.draft_row = drafts, confidences, row

    @staticmethod
    def forget_overwritten(running: list[Sequence], sampled: set[Sequence]) -> None:
        """A step that proposed with q rewrote the rows of the runner's `q_store`: requests that did not sample in it
        (the token budget ran out before them) drop their drafts, whose q is gone. They draft afresh."""
        for seq in running:
            if seq not in sampled and seq.spec.draft_row >= 0:
                seq.spec.draft_ids, seq.spec.draft_row, seq.spec.confidences = [], -1, None

    def propose_host(self, seqs: list[Sequence], k: int) -> None:
        """Host drafters (n-gram, tests) draft from the committed token ids."""
        if not seqs or not k:
            return
        for seq, d in zip(seqs, self.proposer.propose_ids([s.prompt_ids + s.output_ids for s in seqs], k)):
            self.keep(seq, d, None, -1)

    # ---- cost table ----
    def cost_table(self, runner, overlapped: bool = False) -> CostTable:
        cfg = self.model.cfg
        shape = json.dumps(cfg.to_dict(), sort_keys=True)
        p = self.model.embed.weight  # the compute dtype (a bf16 model's first parameter is fp32 mHC)
        key = machine_key(shape, str(p.dtype), str(p.device), torch.__version__, self.proposer.method,
                          str(self.num_spec_tokens), str(self.config.max_num_seqs),
                          "graphs" if runner.graphs is not None else "eager",
                          "launched" if overlapped else "in-turn", "step-v4")
        cache_dir = Path(self.config.cost_cache_dir) if self.config.cost_cache_dir else None

        def measure() -> CostTable:
            log.info("measuring the step-cost table for adaptive verification (cached per machine)")
            return self.measure_costs(runner, overlapped=overlapped)

        return load_or_measure(key, measure, cache_dir)

    @torch.inference_mode()
    def measure_costs(self, runner, context_len: int = 32, repeats: int = 3, overlapped: bool = False) -> CostTable:
        """Step time vs (requests, verify tokens), and the drafter's share, at a short context, measured through
        `runner.execute` exactly as the engine runs a decode step (CUDA graphs included when they are on). Runs
        on the engine's own pools before any request is admitted (block ids from 0).

        `overlapped` (the engine launches plain steps ahead): plain decode steps are also timed as a plain stretch
        runs them, launched back to back and each read one step late (`time_launched`). Timed in turn, a plain step
        also pays its packing and its copy back, which the overlap hides: on the H200 demo pair at c = 1 the table
        then put plain decoding at ~800 tok/s where it ran at ~1,500, and each level began by drafting."""
        k = self.num_spec_tokens
        # a small KV cache (a short --max-model-len) holds less than one probe at the default context: probe shorter
        context_len = max(1, min(context_len, runner.cache.num_blocks * runner.cache.block_size - 2 * k - 2))
        per_seq = self.probe_blocks(runner, context_len)
        if per_seq > runner.cache.num_blocks:
            raise ValueError(f"the KV cache ({runner.cache.num_blocks} blocks of {runner.cache.block_size}) cannot "
                             "hold one request to measure the adaptive budget's step costs: raise --kv-cache-memory or "
                             "--max-model-len, or use --spec-budget fixed")
        grid, r = [], 1
        while r <= min(self.config.max_num_seqs, runner.cache.num_blocks // per_seq):
            grid.append(r)
            r *= 2
        target, draft, launched_plain = {}, [], []
        for r in grid:
            items = self.probe_requests(runner, r, context_len)
            points = []
            for e in range(k + 1):
                drafts = [[2 + j for j in range(e)] for _ in items]
                points.append((r * (1 + e), self.time_step(runner, items, drafts, 0, repeats)))
            target[r] = points
            launched = self.time_launched(runner, items, repeats) if overlapped else None
            if launched is not None:
                launched_plain.append((r, launched))
            if self.proposer.on_device:
                plain = self.time_step(runner, items, [[] for _ in items], 0, repeats)
                draft.append((r, max(self.time_step(runner, items, [[] for _ in items], k, repeats) - plain, 0.0)))
        return CostTable(target, draft, plain=launched_plain)

    def probe_blocks(self, runner, context_len: int) -> int:
        """Blocks a probe request holds: its context, then room for two rounds of drafts."""
        return -(-(context_len + 2 * self.num_spec_tokens + 2) // runner.cache.block_size)

    def probe_requests(self, runner, num_reqs: int, context_len: int) -> list[ScheduledSeq]:
        """`num_reqs` decode rows after a prefilled context of `context_len` random tokens, on blocks from 0."""
        per_seq = self.probe_blocks(runner, context_len)
        from sparkspec.sampling_params import SamplingParams

        seqs = []
        for i in range(num_reqs):
            ids = torch.randint(2, self.model.cfg.vocab_size, (context_len + 1,)).tolist()
            s = Sequence(-1 - i, ids[:-1], SamplingParams(max_tokens=4, ignore_eos=True))
            s.block_ids = list(range(i * per_seq, (i + 1) * per_seq))
            seqs.append(s)
        runner.execute([ScheduledSeq(s, context_len) for s in seqs], [[] for _ in seqs], [-1] * num_reqs, 0)
        for s, tok in zip(seqs, ids[-1:] * num_reqs):
            s.num_cached_tokens, s.output_ids = context_len, [tok]
        return [ScheduledSeq(s, 1, self.num_spec_tokens) for s in seqs]

    @staticmethod
    def time_launched(runner, items: list[ScheduledSeq], repeats: int, depth: int = 8) -> float | None:
        """Median seconds per step of `depth` plain decode steps launched back to back, each read after the next one
        is launched, as async scheduling runs a plain stretch; None where `runner.launch` does not take the step.
        Every step rewrites the same positions (the probe requests do not advance)."""
        first = runner.launch(items)
        if first is None:
            return None
        first.result()  # compiles / warms up, not timed
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            prev = runner.launch(items)
            for _ in range(depth - 1):
                nxt = runner.launch(items)
                prev.result()
                prev = nxt
            prev.result()
            times.append((time.perf_counter() - t0) / depth)
        times.sort()
        return times[len(times) // 2]

    @staticmethod
    def time_step(runner, items: list[ScheduledSeq], drafts: list[list[int]], k_next: int, repeats: int) -> float:
        """Median seconds of one `runner.execute` (which ends with its device->host copy)."""
        times = []
        for _ in range(repeats + 1):  # the first run compiles / warms up and is dropped
            t0 = time.perf_counter()
            runner.execute(items, drafts, [-1] * len(items), k_next)
            times.append(time.perf_counter() - t0)
        times = sorted(times[1:])
        return times[len(times) // 2]

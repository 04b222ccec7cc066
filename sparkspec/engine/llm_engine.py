"""LLMEngine: requests in, tokens out, one step at a time. The step reads: schedule -> choose drafts (budget) ->
execute (verify -> accept -> propose next drafts, one device->host copy) -> commit -> free -> emit."""

from __future__ import annotations

import itertools
import math
import random
import time

import torch

from sparkspec.engine.block_manager import BlockManager, hit_granularity
from sparkspec.engine.config import EngineConfig, apply_batch_invariant
from sparkspec.engine.grammar import LazyMasks
from sparkspec.engine.kv_plan import KVCachePlan, plan_kv_cache
from sparkspec.engine.model_runner import InFlightStep, ModelRunner
from sparkspec.engine.output_text import OutputTexts
from sparkspec.engine.outputs import EngineStats, RequestOutput, group_samples, request_output
from sparkspec.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from sparkspec.engine.sequence import Sequence, TokenSource
from sparkspec.engine.step_result import StepResult
from sparkspec.models.cache import cache_dtype
from sparkspec.ops.rng import uniform_at
from sparkspec.ops.sampling import STREAM_GRAMMAR, bitmask_allowed, inverse_cdf
from sparkspec.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, drafter_tensors=None,
                 proposer=None):
        """`proposer`: a ready drafter (a `sparkspec.spec_decode.Proposer`: device or host) to use instead of
        building `config.speculative`'s."""
        self.config = config = config or EngineConfig()
        apply_batch_invariant(config)  # before anything runs or is captured
        self.model = model
        self.tokenizer = tokenizer
        cfg = model.cfg
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.eos_ids = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.spec = None
        if config.speculative != "none" or proposer is not None:
            from sparkspec.engine.spec_policy import SpecPolicy

            self.spec = SpecPolicy(model, config, drafter_tensors or {}, proposer)
        self.runner = ModelRunner(model, self.spec.proposer if self.spec else None, config.max_num_seqs,
                                  sampling_scheme=config.sampling_scheme)
        num_lookahead = self.spec.num_spec_tokens if self.spec else 0
        device = "cpu" if self.runner.device.type == "cpu" else str(self.runner.device)
        self.kv_plan: KVCachePlan = plan_kv_cache(  # priced in the dtypes and shapes `allocate` uses
            cfg, dtype=cache_dtype(model), block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len, kv_cache_memory=config.kv_cache_memory,
            memory_fraction=config.memory_fraction, device=device,
            drafter_bytes_per_token=self.spec.proposer.bytes_per_position() if self.spec else 0,
            buffer_bytes={name: math.prod(shape) * dtype.itemsize
                          for name, (shape, dtype) in self.runner.buffers().items()})
        self.runner.allocate(self.kv_plan.num_blocks, self.kv_plan.block_size)  # block ids ARE pool rows
        if self.runner.device.type == "cuda" and not config.enforce_eager:  # HIP builds report "cuda" too
            self.runner.use_graphs(config.max_num_seqs, self.max_model_len, num_lookahead,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   cold_decode=self.spec is not None and self.spec.may_skip_context)
        bm = BlockManager(self.kv_plan.num_blocks, self.kv_plan.block_size,  # prefix hits: see block_manager.py
                          enable_prefix_caching=config.enable_prefix_caching,
                          granularity=hit_granularity(self.kv_plan.block_size, model.compress_ratios),
                          key_next_token=self.spec is not None and self.spec.proposer.needs_final_streams)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max(config.max_num_batched_tokens,
                                                                         1 + num_lookahead),
            max_model_len=self.max_model_len, num_lookahead_tokens=num_lookahead, max_waiting=config.max_waiting,
            enable_chunked_prefill=config.enable_chunked_prefill,
            unsplit_prompt_len=max(self.runner.graphs.prefill_lens, default=0) if self.runner.graphs else 0), bm)
        # async scheduling (`step`): the decode step launched and not yet read, with its items
        self.async_scheduling = config.async_scheduling is not False
        self._inflight: tuple[list[ScheduledSeq], InFlightStep] | None = None
        self._launched_in_a_row = 0  # steps launched ahead since the engine last stepped in turn
        if self.spec is not None:
            self.spec.start(self.runner, overlapped=self.async_scheduling and self.runner.graphs is not None)
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        self.texts = OutputTexts(self.tokenizer)  # detokenisation and stop strings
        self._rng = random.Random()
        self._grammars = None  # GrammarBackend, built on the first structured request
        # step() returns an output for every request that produced tokens (streams, the server: their text kept
        # up to date each step) or, when off, only for finished requests (`generate`, offline benchmarks: a
        # request's text is then decoded once, when it finishes, unless its stop strings need it earlier)
        self.emit_unfinished = True

    def grammars(self):
        """The structured-output backend (xgrammar over this tokenizer and the model's vocabulary)."""
        if self._grammars is None:
            from sparkspec.engine.grammar import GrammarBackend

            self._grammars = GrammarBackend(self.tokenizer, self.model.cfg.vocab_size, sorted(self.eos_ids))
        return self._grammars

    # ---- requests ----
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass prompt token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = list(prompt)
        vocab = self.model.cfg.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r}: expected an integer in [0, {vocab})")
        return ids

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run here (empty, too long, larger than the whole KV cache,
        more drafts than the engine verifies)."""
        self.scheduler.check(len(prompt_ids), params.max_tokens)
        self.check_spec(params)
        if params.structured is not None:
            self.grammars().compile(params.structured)  # an invalid schema is refused here (cached for later)

    def check_spec(self, params: SamplingParams) -> None:
        limit = self.spec.num_spec_tokens if self.spec is not None else 0
        if params.num_spec_tokens and params.num_spec_tokens > limit:
            raise ValueError(f"num_spec_tokens = {params.num_spec_tokens}: expected at most {limit} (the engine's "
                             + ("drafts per step)" if limit else "speculation is off)"))

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"n = {params.n}: add_request takes one sample (SamplingParams.samples() splits them)")
        self.check_spec(params)
        prompt_ids = self.encode_prompt(prompt)
        grammar = self.grammars().matcher(params.structured) if params.structured is not None else None
        seq_id = next(self._ids)
        request_id = request_id if request_id is not None else str(seq_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(seq_id, prompt_ids, params, request_id=request_id, seed=seed)
        seq.grammar = grammar
        seq.logprobs = [] if params.logprobs is not None else None
        seq.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self.scheduler.add(seq)  # raises ValueError / QueueFullError before anything is recorded
        self.requests[request_id] = seq
        self.texts.start(seq)
        self.stats.num_requests += 1
        self.stats.num_prompt_tokens += len(prompt_ids)
        return seq

    def abort_request(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.texts.forget(request_id)
        if not seq.is_finished:
            self.stats.num_aborted += 1
        self.scheduler.abort(seq)
        self.note_idle()  # (a server steps no more once nothing is left: the wait would land on the step before)
        return True

    def has_unfinished(self) -> bool:
        return self._inflight is not None or self.scheduler.has_unfinished()

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        """One engine step (`take_step`). A step that leaves no request behind tells the adaptive budget that the
        engine is idle (`VerificationBudget.idle`): the wait for the next request is no step's time."""
        outputs = self.take_step()
        self.note_idle()
        return outputs

    def note_idle(self) -> None:
        """Tell the adaptive budget when no request is left (after a step, or an abort)."""
        if self.spec is not None and self.spec.budget is not None and not self.has_unfinished():
            self.spec.budget.idle()

    def take_step(self) -> list[RequestOutput]:
        """schedule -> choose drafts -> execute (verify, accept, propose; one copy back) -> commit -> free -> emit.

        Async scheduling (on by default where graphs are captured): while no request needs logprobs, a grammar or
        drafts verified (and, with a drafter, the budget proposes none for the step: its plain arm), a step
        schedules and launches the next step (decode rows, and the chunks of prompts that join) BEFORE it reads
        the one on the device, then commits and emits that one while the device runs the next. The host's
        per-request work (commit, stop checks, emit, scheduling, packing) then hides behind the device instead of
        adding to it. What makes it exact: a request's token in flight is counted by `Sequence.num_inflight` (the
        scheduler sees the pending token, the upload its position), the launched step reads it on the device
        (`ModelRunner.launch`), and a row of a request that the step in flight finished (EOS, a stop string, an
        abort) is computed and dropped: its result is never committed, its rows past the request's end are never
        read; a request whose last token is in flight is not scheduled again. A step `launch` cannot take ends the
        overlap: the step in flight is read first, and the engine steps in turn until the batch can overlap
        again. The tokens are those of the synchronous engine (tests/test_async_scheduling.py); outputs come one
        step later."""
        if self._inflight is not None and not self.can_overlap():
            self._launched_in_a_row = 0
            return self.finish_inflight()
        sched = self.scheduler.schedule()
        self.stats.num_prefix_cache_queries += sched.num_queried_tokens
        self.stats.num_prefix_cache_hits += sched.num_hit_tokens
        if sched.is_empty:
            self._launched_in_a_row = 0
            return self.finish_inflight() if self._inflight is not None else []
        items = sched.scheduled
        decided = None  # the speculation policy's choice for this step, once made
        if self.async_scheduling and self.runner.graphs is not None \
                and (self._inflight is not None or self.can_overlap()):
            launched = None
            if self.spec is not None:  # a drafting engine overlaps its plain stretches (the budget's plain arm)
                decided = self.decide(items, sched)
            if decided is None or (not any(decided[0]) and not decided[2]):
                launched = self.runner.launch(items)
            if launched is not None:
                for i in launched.sampling:  # (before the chunks advance: `samples` reads the cached length)
                    items[i].seq.num_inflight += 1
                for it in items:
                    it.seq.num_cached_tokens += it.num_tokens
                previous, self._inflight = self._inflight, (items, launched)
                self._launched_in_a_row += 1
                if self.spec is not None and self._launched_in_a_row <= 2:
                    # not a plain step's wall time: the first launch returns at once, the second waits for the
                    # first on a device that got no head start (on the H200 demo pair at c = 64: ~2.1 ms against
                    # ~1.3 ms once the overlap runs), so neither is filed (`VerificationBudget.skip_step`)
                    self.spec.budget.skip_step()
                if previous is None:
                    return []
                return self.finish_inflight(previous)
        self._launched_in_a_row = 0
        outputs = []
        if self._inflight is not None:  # this step cannot be launched ahead: read the one in flight first
            outputs = self.finish_inflight()
            live = [i for i, it in enumerate(items) if not it.seq.is_finished]
            if not live:
                return outputs
            if decided is not None and len(live) < len(items):
                decided = ([decided[0][i] for i in live], [decided[1][i] for i in live], decided[2])
            items = [items[i] for i in live]
        return outputs + self.run_step(items, decided)

    def decide(self, items: list[ScheduledSeq], sched: SchedulerOutput | None = None
               ) -> tuple[list[list[int]], list[int], int]:
        """The speculation policy's choice for a step: (drafts each item verifies, their q rows, k to propose).
        `sched`: the scheduler's output that `items` are, unfiltered, in a step that may be launched ahead (no
        running request holds drafts then: `can_overlap`); its counts spare the policy a pass over the items."""
        if self.spec is None:
            return [[] for _ in items], [-1] * len(items), 0
        drafts, rows = self.spec.choose(items, held=sched is None)
        counts = None if sched is None else (sched.num_sampling, sched.num_decode, sched.num_prompt_tokens)
        k = self.spec.num_drafts_to_propose(items, self.stats, len(self.scheduler.running), counts=counts)
        self.runner.context_writes = self.spec.budget.writes_context  # (the budget's plain arm, settled: off)
        return drafts, rows, k

    def can_overlap(self) -> bool:
        """Whether the next step may be scheduled and launched before the one in flight is read: no running
        request holds drafts to verify or needs logprobs or a grammar. A request whose last token is in flight is
        left out of the next step (`Scheduler.finishing`: it ends when the step in flight is read), and requests
        that wait may join: their prompt chunks are launched too (`ModelRunner.launch` refuses a step it cannot
        take: one with a grammar or logprobs, or a recompute behind a token in flight)."""
        for seq in self.scheduler.running:
            p = seq.params
            if seq.spec.draft_ids or seq.grammar is not None or p.logprobs is not None \
                    or p.prompt_logprobs is not None:
                return False
        return True

    def finish_inflight(self, inflight: tuple[list[ScheduledSeq], InFlightStep] | None = None
                        ) -> list[RequestOutput]:
        """Read a launched step (default: the one in flight), commit it and emit its outputs. Rows of requests
        that finished meanwhile (the step before finished them, or they were aborted) are dropped."""
        if inflight is None:
            inflight, self._inflight = self._inflight, None
        items, launched = inflight
        result = launched.result()
        for i in launched.sampling:
            items[i].seq.num_inflight -= 1
        live = [i for i, it in enumerate(items) if not it.seq.is_finished]
        if len(live) < len(items):
            result = StepResult({j: result.rows[i] for j, i in enumerate(live) if i in result.rows}, False, {},
                                result.prompt_logprobs)
            items = [items[i] for i in live]
        produced = self.commit(items, [[] for _ in items], result, 0, advanced=True)
        if self.spec is not None:  # (read one step late: the budget files it with the step launched since)
            self.spec.note_tokens(sum(map(len, produced.values())))
        self.stats.num_finished += len(self.scheduler.release_after_step())
        return self.emit(items, produced)

    def run_step(self, items: list[ScheduledSeq], decided: tuple[list[list[int]], list[int], int] | None = None
                 ) -> list[RequestOutput]:
        """One step in turn: choose drafts (unless `decided`), execute, commit, free, emit."""
        drafts, rows, k_next = decided if decided is not None else self.decide(items)
        masks = self.grammar_masks(items, drafts, rows)
        result = self.runner.execute(items, drafts, rows, k_next, masks)
        produced = self.commit(items, drafts, result, k_next)
        if self.spec is not None:
            self.spec.note_tokens(sum(map(len, produced.values())))
        self.stats.num_finished += len(self.scheduler.release_after_step())  # their blocks, rejected drafts' blocks
        return self.emit(items, produced)

    def grammar_masks(self, items: list[ScheduledSeq], drafts: list[list[int]], rows: list[int]
                      ) -> LazyMasks | None:
        """Token bitmasks of the verified rows of every structured request that samples this step (item -> [n+1, W]
        int32), made when the runner first reads them, after it has launched the step's forward (`LazyMasks`).
        `drafts` is edited now: deterministic drafts are cut at the first one the grammar refuses, refused
        sampled drafts are redrawn from their masked q (`sparkspec.engine.grammar` says why both are lossless).
        None: no such request."""
        structured = []
        for i, it in enumerate(items):
            grammar = it.seq.grammar
            if grammar is None or not it.samples:
                continue
            sampled = rows[i] >= 0 and not it.seq.params.greedy  # an exact q sits in the runner's q_store row
            redraw = self.grammar_redraw(it, rows[i]) if sampled else None
            drafts[i], num_redrawn = grammar.check_drafts(drafts[i], not sampled, redraw)
            self.stats.num_grammar_redrawn += num_redrawn
            structured.append(i)
        if not structured:
            return None
        return LazyMasks(lambda: {i: items[i].seq.grammar.row_masks(drafts[i]) for i in structured}, structured)

    def grammar_redraw(self, it: ScheduledSeq, row: int):
        """-> redraw(i, mask) for the sampled drafts of `it`: a draw from q_i masked by the grammar and renormalised,
        with the request's seed at d_i's position on STREAM_GRAMMAR, or None where q_i has no allowed mass."""
        seq, q_host = it.seq, []

        def redraw(i: int, mask: torch.Tensor) -> int | None:
            if not q_host:  # one copy of the request's q rows, on its first redraw of the step
                q_host.append(self.runner.q_store[row].double().cpu())
            q = q_host[0][i]
            qm = torch.where(bitmask_allowed(mask, q.shape[-1]), q, 0.0)  # [V]
            if not (qm > 0).any():
                return None
            position = seq.num_cached_tokens + it.num_tokens + i  # where d_i sits
            u = uniform_at(torch.tensor([seq.seed]), torch.tensor([position]), STREAM_GRAMMAR, 0, torch.float64)
            return int(inverse_cdf(qm.unsqueeze(0), u)[0])

        return redraw

    def commit(self, items: list[ScheduledSeq], drafts: list[list[int]], result: StepResult, k_next: int,
               advanced: bool = False) -> dict[Sequence, list[int]]:
        """Sequences advance by their chunk and accepted drafts (the caches need nothing: rows past a sequence's
        length are never read), produced tokens are appended with the stop checks, and drafts for the next step
        are kept. -> {seq: tokens appended}. `advanced`: the sequences already advanced by their chunks when
        the step was launched (async scheduling).

        Most rows take the lean path (`append_tokens`: no grammar to advance): their stop point is found once per
        row, not token by token; the step's counters are summed once. Text is extended here only where it is
        read before the request ends (`needs_text`)."""
        stats, spec, rows, prompt_lps = self.stats, self.spec, result.rows, result.prompt_logprobs
        stats.num_steps += 1
        if spec is not None and result.proposed_q:
            spec.forget_overwritten(self.scheduler.running, {items[i].seq for i in rows})
        produced, host_drafting = {}, []
        num_decode_rows = num_new = 0
        # a plain step (nothing verified, nothing proposed: the budget's plain arm) keeps no drafts: the policy's
        # per-row bookkeeping is skipped, bar dropping drafts a row held and did not verify
        drafting = spec is not None and (k_next > 0 or any(drafts))
        host_proposer = drafting and not spec.proposer.on_device
        now = time.perf_counter()  # the step's first-token time, for every request it gives a first token
        append_tokens, needs_text, target = self.append_tokens, self.needs_text, TokenSource.TARGET
        for i, it in enumerate(items):  # (hot at high concurrency: lookups hoisted)
            seq, n = it.seq, it.num_tokens
            before = seq.num_cached_tokens - (n if advanced else 0)
            if seq.output_ids and before + n == len(seq.prompt_ids) + len(seq.output_ids):  # it.samples
                num_decode_rows += 1
            if not advanced:
                seq.num_cached_tokens += n
            if prompt_lps and i in prompt_lps:
                seq.prompt_logprobs += prompt_lps[i]
            row = rows.get(i)
            if row is None:
                continue
            if row.error is not None:  # this request alone fails; its tokens of this step are not committed
                self.fail(seq, row.error)
                continue
            num_drafts = len(drafts[i])
            seq.num_cached_tokens += row.num_accepted
            if drafting:
                spec.record(seq, num_drafts, row.num_accepted, stats)
                spec.keep(seq, row.next_drafts, row.next_confidences,
                          result.draft_row[i] if result.proposed_q else -1)
            elif seq.spec.draft_ids:
                spec.keep(seq, [], None, -1)
            if seq.grammar is None and seq.params.max_tokens > 0:
                new = append_tokens(seq, row.token_ids, now)
                num_new += len(new)
                if needs_text(seq):
                    self.texts.update(seq)
            else:
                before = len(seq.output_ids)
                self.append(seq, row.token_ids)
                new = seq.output_ids[before:]
            produced[seq] = new
            if num_drafts:
                seq.token_sources += TokenSource.of_step(num_drafts, row.num_accepted)[: len(new)]
            elif new:
                seq.token_sources.append(target)
            if seq.logprobs is not None:
                seq.logprobs += row.logprobs[: len(new)]
            if host_proposer and not seq.is_finished and seq.spec_cap != 0:
                host_drafting.append(seq)
        stats.num_decode_rows += num_decode_rows
        stats.num_generation_tokens += num_new
        if host_drafting:
            spec.propose_host(host_drafting, k_next)
        return produced

    def append_tokens(self, seq: Sequence, tokens: list[int], now: float) -> list[int]:
        """The lean `append` (a request without a grammar, max_tokens > 0): the produced tokens up to the first of
        EOS, max_tokens and the context limit, appended at once -> those tokens. The caller counts them and
        extends the text. Same rules as `append`: EOS on the last allowed token is "stop"."""
        out, p = seq.output_ids, seq.params
        room = min(p.max_tokens - len(out), self.max_model_len - seq.num_tokens)  # tokens it may still take
        new = tokens if len(tokens) <= room else tokens[: max(room, 1)]  # a token always lands (as `append`)
        reason = None
        if not p.ignore_eos and not self.eos_ids.isdisjoint(new):
            new = new[: next(j for j, t in enumerate(new) if t in self.eos_ids) + 1]
            reason = "stop"
        elif len(new) >= room:
            reason = "length"
        if new and not out:
            seq.first_token_time = now
        out += new
        if reason is not None:
            seq.finish(reason)
        return new

    def fail(self, seq: Sequence, error: str) -> None:
        """Finish `seq` with finish_reason "error" and `error` as its output's reason (its blocks are freed with
        the finished ones)."""
        seq.finish("error")
        seq.error = error
        self.stats.num_failed += 1

    def emit(self, items: list[ScheduledSeq], produced: dict[Sequence, list[int]]) -> list[RequestOutput]:
        """The outputs of the step's requests that produced tokens or finished (only the finished ones when
        `emit_unfinished` is off); finished ones are forgotten. Finished requests get their whole text first,
        decoded in one batch where no text was kept along the way."""
        finished = [it.seq for it in items if it.seq.is_finished]
        if finished:
            self.texts.finish(finished)
        outputs = []
        for it in items:
            seq = it.seq
            if seq.is_finished:
                outputs.append(self.output(seq, produced.get(seq, [])))
                self.requests.pop(seq.request_id, None)
                self.texts.forget(seq.request_id)
            elif self.emit_unfinished and seq in produced:
                outputs.append(self.output(seq, produced[seq]))
        return outputs

    def append(self, seq: Sequence, tokens: list[int]) -> None:
        """Append produced tokens, stopping at EOS, max_tokens, the context limit or a stop string (the general
        path, token by token: grammars advance per token; `append_tokens` is the lean one)."""
        p = seq.params
        if p.max_tokens == 0:  # the prompt was only scored
            seq.finish("length")
            tokens = []
        if tokens and seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        for tok in tokens:
            if seq.grammar is not None and not seq.grammar.accept(tok):  # the masks make this unreachable
                self.fail(seq, f"token {tok} is refused by the response_format grammar")
                break
            seq.output_ids.append(tok)
            self.stats.num_generation_tokens += 1
            if seq.grammar is not None and seq.grammar.is_terminated:  # complete, and the model stopped
                seq.finish("stop")
            elif tok in self.eos_ids and not p.ignore_eos:
                seq.finish("stop")
            elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish("length")
            if seq.is_finished:
                break
        self.texts.update(seq)

    def needs_text(self, seq: Sequence) -> bool:
        """Is `seq.text` read before the request ends? Stop strings are searched in it; a stream shows it every
        step. Otherwise the text is decoded once, when the request finishes (`OutputTexts.finish`)."""
        return self.emit_unfinished or self.texts.has_stops(seq)

    def output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        return request_output(seq, new, self.texts.visible(seq))

    # ---- offline convenience ----
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[RequestOutput]:
        """One output per prompt, in order; with `n` > 1 its `outputs` holds the n samples (each one engine
        request, `SamplingParams.samples()`) and its top-level fields are sample 0's.

        A request that fails alone (its distribution is not finite: a numerically broken model) does not stop
        the batch: its output has finish_reason "error", `error` says why, and its tokens are those committed
        before the failing step; every other prompt's output is as if it had not been there."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        encoded = []
        for i, (p, sp) in enumerate(zip(prompts, params)):  # refuse the whole batch before running any of it
            try:
                ids = self.encode_prompt(p)
                self.check_request(ids, sp)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            encoded.append(ids)
        pending = [(ids, s, g) for g, (ids, sp) in enumerate(zip(encoded, params)) for s in sp.samples()][::-1]
        groups: list[list[str]] = [[] for _ in prompts]
        final = {}
        emit_unfinished, self.emit_unfinished = self.emit_unfinished, False  # only final outputs are read
        try:
            while pending or self.has_unfinished():
                while pending and self.scheduler.num_waiting < self.scheduler.config.max_waiting:
                    ids, sp, g = pending.pop()
                    groups[g].append(self.add_request(ids, sp).request_id)
                for out in self.step():
                    if out.finished:
                        final[out.request_id] = out
        finally:
            self.emit_unfinished = emit_unfinished
        return [group_samples([final[r] for r in rids]) for rids in groups]

    # ---- stats ----
    @property
    def kv_usage(self) -> float:
        return self.scheduler.block_manager.usage

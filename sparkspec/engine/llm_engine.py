"""LLMEngine: requests in, tokens out, one step at a time. The step reads: schedule -> run (propose -> budget ->
verify -> commit / roll back) -> append tokens and stop checks -> release finished requests -> emit outputs."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from sparkspec.engine.block_manager import BlockManager
from sparkspec.engine.config import EngineConfig
from sparkspec.engine.kv_cache import KVCachePlan, plan_kv_cache
from sparkspec.engine.model_runner import ModelRunner
from sparkspec.engine.scheduler import Scheduler, SchedulerConfig
from sparkspec.engine.sequence import Sequence
from sparkspec.models.cache import CachePools
from sparkspec.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    new_token_ids: list[int]  # produced by this step
    text: str  # output text so far (stop strings cut; a possibly incomplete tail held back until finished)
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)  # arrival/first-token/finish times, spec counters


@dataclass
class EngineStats:
    """Monotone counters since start (read by /metrics and the benchmarks)."""

    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_decode_rows: int = 0  # request-steps after the first token: plain decode rows + verify blocks (tau's denominator)
    num_spec_steps: int = 0  # request-steps with at least one verified draft
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_drafter_skipped_steps: int = 0  # steps where the budget planned no drafts at all

    def record_spec(self, num_drafts: int, num_accepted: int) -> None:
        self.num_spec_steps += 1
        self.num_drafted += num_drafts
        self.num_accepted += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1


class LLMEngine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, drafter_tensors=None,
                 proposer=None):
        """`proposer`: a ready `sparkspec.spec_decode.Proposer` to use instead of building `config.speculative`'s."""
        self.config = config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        cfg = model.cfg
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.eos_ids = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.runner = ModelRunner(model)
        self.spec = None
        num_lookahead = 0
        if config.speculative != "none" or proposer is not None:
            from sparkspec.engine.spec_runner import SpecRunner

            self.spec = SpecRunner(self.runner, config, drafter_tensors or {}, proposer)
            num_lookahead = self.spec.num_spec_tokens
        device = "cpu" if self.runner.device.type == "cpu" else str(self.runner.device)
        self.kv_plan: KVCachePlan = plan_kv_cache(
            cfg, block_size=config.block_size, max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
            kv_cache_memory=config.kv_cache_memory, memory_fraction=config.memory_fraction, device=device,
            spec_method=config.speculative, num_spec_tokens=num_lookahead)
        bm = BlockManager(self.kv_plan.num_blocks, self.kv_plan.block_size, self.kv_plan.blocks_per_seq)
        self.runner.pools = CachePools(  # sized so that whatever the block manager admits fits (see kv_cache.py)
            model, self.kv_plan.block_size, lambda ratio: self.kv_plan.num_pool_blocks(ratio, config.max_num_seqs))
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max(config.max_num_batched_tokens,
                                                                         1 + num_lookahead),
            max_model_len=self.max_model_len, num_lookahead_tokens=num_lookahead, max_waiting=config.max_waiting,
            enable_chunked_prefill=config.enable_chunked_prefill), bm)
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._max_stop_len: dict[str, int] = {}

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
        """Raise ValueError if the request can never run here (empty, too long, larger than the whole KV cache)."""
        self.scheduler.check(len(prompt_ids), params.max_tokens)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:
        params = params or SamplingParams()
        prompt_ids = self.encode_prompt(prompt)
        seq_id = next(self._ids)
        request_id = request_id if request_id is not None else str(seq_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(seq_id, prompt_ids, params, request_id=request_id)
        self.scheduler.add(seq)  # raises ValueError / QueueFullError before anything is recorded
        self.requests[request_id] = seq
        self._max_stop_len[request_id] = max((len(s) for s in params.stop), default=0)
        self.stats.num_requests += 1
        self.stats.num_prompt_tokens += len(prompt_ids)
        return seq

    def abort_request(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self._max_stop_len.pop(request_id, None)
        if not seq.is_finished:
            self.stats.num_aborted += 1
        if self.spec is not None and seq.drafter_state is not None:
            self.spec.proposer.finish([seq])
        self.scheduler.abort(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        self.stats.num_decode_rows += sum(1 for it in sched.scheduled if it.samples and it.seq.output_ids)
        if self.spec is not None:
            new_tokens = self.spec.run(sched, self.append, self.stats)
        else:
            new_tokens = self.runner.run_plain(sched.scheduled)
            for seq, tokens in new_tokens.items():
                self.append(seq, tokens)
        self.stats.num_steps += 1
        outputs = []
        for seq in self.scheduler.update():
            self.stats.num_finished += 1
        for it in sched.scheduled:
            seq = it.seq
            if seq in new_tokens or seq.is_finished:
                outputs.append(self.output(seq, new_tokens.get(seq, [])))
                if seq.is_finished:
                    self.requests.pop(seq.request_id, None)
                    self._max_stop_len.pop(seq.request_id, None)
        return outputs

    def append(self, seq: Sequence, tokens: list[int]) -> None:
        """Append produced tokens, stopping at EOS, max_tokens, the context limit or a stop string."""
        p = seq.params
        if tokens and seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        for tok in tokens:
            seq.output_ids.append(tok)
            self.stats.num_generation_tokens += 1
            if tok in self.eos_ids and not p.ignore_eos:
                seq.finish("stop")
            elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish("length")
            if seq.is_finished:
                break
        self.update_text(seq)

    def update_text(self, seq: Sequence) -> None:
        if self.tokenizer is None:
            return
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        hits = [text.index(s) for s in seq.params.stop if s in text]
        if hits:
            text = text[: min(hits)]
            if not seq.is_finished:
                seq.finish("stop")
        seq.text = text

    def visible_text(self, seq: Sequence) -> str:
        """Text safe to show while streaming: no incomplete UTF-8 tail, no possible start of a stop string."""
        text = seq.text
        if seq.is_finished:
            return text
        text = text.rstrip("\ufffd")
        hold = self._max_stop_len.get(seq.request_id, 0) - 1
        return text[: len(text) - hold] if hold > 0 else text

    def output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        sp = seq.spec
        metrics = {"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time,
                   "finish_time": seq.finish_time, "num_preemptions": seq.num_preemptions,
                   "spec_steps": sp.num_steps, "spec_drafted": sp.num_drafted, "spec_accepted": sp.num_accepted,
                   "spec_accepted_per_position": list(sp.accepted_per_position)}
        return RequestOutput(seq.request_id, seq.prompt_ids, list(seq.output_ids), list(new), self.visible_text(seq),
                             seq.is_finished, seq.finish_reason, seq.num_cached_tokens, metrics)

    # ---- offline convenience ----
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[RequestOutput]:
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
        pending = list(zip(encoded, params))[::-1]
        order, final = [], {}
        while pending or self.has_unfinished():
            while pending and self.scheduler.num_waiting < self.scheduler.config.max_waiting:
                order.append(self.add_request(*pending.pop()).request_id)
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in order]

    # ---- stats ----
    @property
    def kv_usage(self) -> float:
        return self.scheduler.block_manager.usage

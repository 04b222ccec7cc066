"""A request's state inside the engine (pure Python).

Token bookkeeping, one invariant: the model cache of a running sequence holds `all_ids[:num_cached_tokens]`.
A chunk scheduled for the sequence is `all_ids[num_cached_tokens : num_cached_tokens + n]`; when a chunk reaches
the end of `all_ids` its last row is sampled, so prefill, decode and recompute after preemption are the same
operation (a decode step is a chunk of one token: the pending last output). Draft tokens are never in `all_ids`:
they ride behind the decode token as `lookahead` rows and only accepted ones are appended.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from sparkspec.spec_decode.metrics import SpecMetrics


class TokenSource:
    """How an output token came, one int per token (`Sequence.token_sources`): a draft the target accepted, at
    its draft position 1..k; the bonus token the target samples after accepting every draft of a step; or a token
    the target sampled itself (a plain decode step, a prefill's first token, the correction after a rejection).
    Ints, not names: one per generated token, kept for every request."""

    TARGET = 0
    BONUS = -1

    @staticmethod
    def of_step(num_drafts: int, num_accepted: int) -> list[int]:
        """Sources of the num_accepted + 1 tokens one sampled row emits."""
        last = TokenSource.BONUS if num_drafts and num_accepted == num_drafts else TokenSource.TARGET
        return list(range(1, num_accepted + 1)) + [last]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecState:
    """Per-request speculative state: the drafts proposed for the next verify step, and acceptance counters."""

    draft_ids: list[int] = field(default_factory=list)  # [k] proposed tokens following the pending token
    draft_row: int = -1  # row of the drafter's q tensor holding their distributions (-1: one-hot q)
    confidences: list[float] | None = None  # [k] P(draft j accepted | drafts < j accepted), if the drafter has a head
    metrics: SpecMetrics = field(default_factory=SpecMetrics)  # this request's verify steps (`SpecMetrics.record`)


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: Any  # SamplingParams
    request_id: str = ""
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached_tokens: int = 0  # positions of all_ids held by the model cache
    # tokens sampled by a launched step whose result the engine has not read yet (async scheduling: the step
    # after it is scheduled and launched first, its rows read those tokens on the device; LLMEngine.step)
    num_inflight: int = 0
    block_ids: list[int] = field(default_factory=list)  # blocks charged to this sequence (see block_manager)
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None  # why it failed (finish_reason 'error')
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0  # prompt positions its first admission found in the prefix cache (not computed)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    text: str = ""  # detokenized output (stop strings cut), maintained by the engine
    spec: SpecState = field(default_factory=SpecState)
    seed: int = 0  # the request's seed, or one drawn at random on arrival: all its randomness derives from it
    detokenizer: Any = None  # IncrementalDetokenizer (engine-owned; None without a tokenizer)
    grammar: Any = None  # RequestGrammar (engine/grammar.py) when params.structured is set
    logprobs: list | None = None  # [len(output_ids)] {id: logprob} per output token, when params.logprobs is set
    token_sources: list[int] = field(default_factory=list)  # [len(output_ids)] how each came (see TokenSource)
    prompt_logprobs: list | None = None  # [None, {..}, ...] per prompt token scored so far (params.prompt_logprobs)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (a decode step reads one token of a long sequence)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_cached_tokens

    @property
    def num_tokens_left(self) -> int:
        """Tokens it may still produce under `max_tokens`, those in flight counted as produced (async scheduling)."""
        return self.params.max_tokens - len(self.output_ids) - self.num_inflight

    @property
    def spec_cap(self) -> int | None:
        """Most drafts this request verifies per step (None: no cap of its own; 0: speculation off)."""
        return self.params.num_spec_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()

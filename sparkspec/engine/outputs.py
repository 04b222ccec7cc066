"""What the engine returns per request and step (vLLM's names: `RequestOutput`, `CompletionOutput`), and its
monotone counters (`EngineStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparkspec.engine.sequence import Sequence
from sparkspec.spec_decode.metrics import SpecMetrics


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's name): `index` 0..n-1 among the request's samples."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """A request's state after a step. Logprobs, when asked for, are per token {id: logprob}: the N most likely
    tokens highest first, then the token itself if it is not among them (see `logprobs_for` for which
    distribution). `outputs` holds the samples: one (this request) from `step`, all n from `generate`, whose
    top-level fields are sample 0's."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    new_token_ids: list[int]  # produced by this step
    text: str  # output text so far (stop strings cut; a possibly incomplete tail held back until finished)
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)  # arrival/first-token/finish times, spec counters
    logprobs: list[dict[int, float]] | None = None  # [len(token_ids)] when SamplingParams.logprobs is set
    prompt_logprobs: list[dict[int, float] | None] | None = None  # [len(prompt)], None first, once all are scored
    outputs: list[CompletionOutput] = field(default_factory=list)
    token_sources: list[int] = field(default_factory=list)  # [len(token_ids)] `TokenSource` of each output token
    error: str | None = None  # why the request failed (finish_reason "error"); its other requests were unaffected


@dataclass
class EngineStats:
    """Monotone counters since start (read by /metrics and the benchmarks)."""

    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_failed: int = 0  # finished with "error": their own row failed (e.g. a distribution that is not finite)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    # request-steps after the first token: plain decode rows + verify blocks (tau's denominator)
    num_decode_rows: int = 0
    num_drafter_skipped_steps: int = 0  # steps where the budget planned no drafts at all
    # of which those planned without the device drafter's context write (the budget's plain arm, settled; its
    # prompt chunks' rows too: `ModelRunner.writes_context`)
    num_context_skipped_steps: int = 0
    num_grammar_redrawn: int = 0  # sampled drafts a response_format grammar refused, redrawn from their masked q
    num_prefix_cache_queries: int = 0  # prompt tokens of admitted requests looked up in the prefix cache
    num_prefix_cache_hits: int = 0  # ... of them found there (not computed)
    spec: SpecMetrics = field(default_factory=SpecMetrics)  # every request's verify steps, pooled

    @property
    def num_spec_steps(self) -> int:
        """Request-steps with at least one verified draft."""
        return self.spec.num_steps

    @property
    def num_drafted(self) -> int:
        return self.spec.num_draft_tokens

    @property
    def num_accepted(self) -> int:
        return self.spec.num_accepted_tokens

    @property
    def accepted_per_position(self) -> list[int]:
        return self.spec.accepted_per_position


def request_output(seq: Sequence, new: list[int], text: str) -> RequestOutput:
    """`seq`'s state as an output: `new` the tokens this step produced, `text` what may be shown of its text."""
    sp = seq.spec.metrics
    metrics = {"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time,
               "finish_time": seq.finish_time, "num_preemptions": seq.num_preemptions,
               "num_cached_prompt_tokens": seq.num_prefix_hit_tokens,
               "spec_steps": sp.num_steps, "spec_drafted": sp.num_draft_tokens,
               "spec_accepted": sp.num_accepted_tokens,
               "spec_accepted_per_position": list(sp.accepted_per_position)}
    token_ids = list(seq.output_ids)
    logprobs = list(seq.logprobs) if seq.logprobs is not None else None
    scored = seq.prompt_logprobs if seq.prompt_logprobs and len(seq.prompt_logprobs) == len(seq.prompt_ids) \
        else None  # complete: never changed again (a recompute scores nothing)
    return RequestOutput(seq.request_id, seq.prompt_ids, token_ids, list(new), text, seq.is_finished,
                         seq.finish_reason, seq.num_cached_tokens, metrics, logprobs, scored,
                         [CompletionOutput(0, token_ids, text, seq.finish_reason, logprobs)],
                         list(seq.token_sources), seq.error)


def group_samples(samples: list[RequestOutput]) -> RequestOutput:
    """Sample 0's output with every sample in `outputs`, indexed 0..n-1."""
    first = samples[0]
    first.outputs = [CompletionOutput(i, o.token_ids, o.text, o.finish_reason, o.logprobs)
                     for i, o in enumerate(samples)]
    return first

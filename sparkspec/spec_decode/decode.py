"""Speculative generation: plain `Generator` + propose -> verify -> commit / roll back -> observe.

One step for a batch of requests (request r has N_r committed tokens and pending token b_r at position N_r):
1. propose: k_r drafts d_0..d_{k_r-1} (k_r <= num_spec_tokens, and never more than the tokens it may still
   emit; k_r = 0 gives a plain decode row);
2. verify: ONE target forward over the ragged rows [b_r, d_0..d_{k_r-1}] at positions N_r..N_r+k_r, then the
   rejection sampler (Leviathan et al., arXiv 2211.17192) accepts L_r drafts and emits a recovered or bonus
   token;
3. commit / roll back: the target cache is truncated to N_r + L_r + 1 positions (sliding-window KV,
   compressor partial state, compressed entries and indexer keys of rejected rows vanish, see
   `models/cache.py`); the emitted tokens are appended (EOS / max_tokens / stop strings end the request);
4. observe: the drafter receives the committed rows' captured outputs only.
"""

from __future__ import annotations

import torch

from sparkspec.generation import Generator, Sequence
from sparkspec.models.deepseek_v4 import Batch, DeepseekV4Model, ModelOutput
from sparkspec.sampling_params import SamplingParams
from sparkspec.spec_decode.metrics import SpecMetrics
from sparkspec.spec_decode.proposer import CommittedRows, Draft, Proposer
from sparkspec.spec_decode.rejection import RejectionSampler


class SpeculativeGenerator(Generator):
    """`generate(prompts, params) -> list[Sequence]`, each with `.spec_metrics`; `self.spec_metrics` aggregates
    the last call."""

    def __init__(self, model: DeepseekV4Model, tokenizer, proposer: Proposer, num_spec_tokens: int | None = None,
                 max_batch_tokens: int = 4096):
        super().__init__(model, tokenizer, max_batch_tokens)
        k = proposer.num_spec_tokens if num_spec_tokens is None else num_spec_tokens
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"num_spec_tokens = {k!r}: expected an integer >= 0")
        self.proposer, self.num_spec_tokens = proposer, k
        self.rejection_sampler = RejectionSampler()
        self.spec_metrics = SpecMetrics(proposer.method, k)

    @property
    def capture(self) -> dict:
        return {"tap_layers": self.proposer.tap_layers, "capture_final_streams": self.proposer.needs_final_streams}

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        seqs = self.start(prompts, params)
        while True:
            active = [s for s in seqs if not s.finished]
            if not active:
                break
            self.spec_step(active)
        self.finish(seqs)
        return seqs

    @torch.inference_mode()
    def start(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """New requests: prefill their prompts and let the drafter observe them (each has one output token)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        seqs = self.new_sequences(prompts, params)
        for s in seqs:
            s.spec_metrics = SpecMetrics(self.proposer.method, self.num_spec_tokens)
        self.proposer.start(seqs)
        for group, spans, out in self.prefill(seqs, **self.capture):
            ids = torch.tensor([t for s in group for t in s.prompt_ids], device=self.device)
            self.observe(group, spans, [0] * len(group), ids, out)
        return seqs

    def finish(self, seqs: list[Sequence]) -> None:
        self.proposer.finish(seqs)
        self.finalize(seqs)
        self.spec_metrics = self.aggregate_metrics(seqs)

    def aggregate_metrics(self, seqs: list[Sequence]) -> SpecMetrics:
        return SpecMetrics.aggregate([s.spec_metrics for s in seqs], self.proposer.method, self.num_spec_tokens)

    @torch.inference_mode()
    def spec_step(self, seqs: list[Sequence]) -> None:
        """One propose -> verify -> commit / roll back -> observe step for unfinished requests."""
        budget = [max(0, min(self.num_spec_tokens, s.params.max_tokens - len(s.output_ids) - 1)) for s in seqs]
        drafts = self.proposer.propose(seqs, budget)
        drafts = [d if d.num_tokens <= k else Draft(d.token_ids[:k], None if d.probs is None else d.probs[:k],
                                                    None if d.confidences is None else d.confidences[:k])
                  for d, k in zip(drafts, budget)]
        rows, spans = [], []
        for s, d in zip(seqs, drafts):
            spans.append((len(rows), len(rows) + 1 + d.num_tokens))
            rows += [s.output_ids[-1]] + d.token_ids
        ids = torch.tensor(rows, device=self.device)
        starts = [s.cache.num_tokens for s in seqs]
        out = self.model(ids, Batch(spans, starts, [s.cache for s in seqs]), **self.capture)
        verdicts = self.rejection_sampler(out.logits, spans, drafts, [s.params for s in seqs],
                                          [s.generator for s in seqs])
        committed = []
        for s, d, v, start, (a, _) in zip(seqs, drafts, verdicts, starts, spans):
            s.cache.truncate(start + v.num_accepted + 1)  # roll back the rejected rows
            s.spec_metrics.record(d.num_tokens, v.num_accepted)
            self.append(s, v.token_ids)
            committed.append((a, a + v.num_accepted + 1))
        self.observe(seqs, committed, starts, ids, out)

    def observe(self, seqs: list[Sequence], spans: list[tuple[int, int]], starts: list[int], ids: torch.Tensor,
                out: ModelOutput) -> None:
        """Hand the committed rows of unfinished requests to the drafter; free finished requests' state."""
        keep = [i for i, s in enumerate(seqs) if not s.finished]
        done = [s for s in seqs if s.finished]
        if done:
            self.proposer.finish(done)
        if keep:
            self.proposer.observe(CommittedRows(
                seqs=[seqs[i] for i in keep], spans=[spans[i] for i in keep], start_positions=[starts[i] for i in keep],
                input_ids=ids, taps=out.taps, final_streams=out.final_streams))

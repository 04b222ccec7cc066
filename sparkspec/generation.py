"""Offline batched generation on the target model (plain decoding; speculative decoding plugs in via
`sparkspec.spec_decode`). One step = one target forward over a flattened ragged batch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sparkspec.models.cache import SequenceCache
from sparkspec.models.deepseek_v4 import Batch, DeepseekV4Model
from sparkspec.ops import ops
from sparkspec.sampling_params import SamplingParams


@dataclass
class Sequence:
    """One request's state. Invariant: the cache holds prompt + output[:-1]; output[-1] is pending."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    cache: SequenceCache
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    start_time: float = field(default_factory=time.perf_counter)
    end_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g


def sampling_tensors(seqs: list[Sequence], rows_per_seq: list[int], device: torch.device):
    """Per-row temperature / top-k / top-p tensors for `process_logits`."""
    t = torch.tensor([s.params.temperature for s, n in zip(seqs, rows_per_seq) for _ in range(n)], device=device)
    k = torch.tensor([s.params.top_k for s, n in zip(seqs, rows_per_seq) for _ in range(n)], device=device)
    p = torch.tensor([s.params.top_p for s, n in zip(seqs, rows_per_seq) for _ in range(n)], device=device)
    return t, k, p


class Generator:
    """Runs batches of token-id prompts to completion on one target model."""

    def __init__(self, model: DeepseekV4Model, tokenizer=None, max_batch_tokens: int = 4096):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_batch_tokens = max_batch_tokens
        self.eos_ids = set(model.cfg.eos_token_ids)

    # ---- helpers shared with the speculative path ----
    def new_sequences(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Sequence]:
        max_pos = self.model.cfg.max_position_embeddings
        seqs = []
        for i, (ids, p) in enumerate(zip(prompts, params)):
            if not ids:
                raise ValueError(f"prompt {i}: empty prompt")
            if len(ids) + p.max_tokens > max_pos:
                raise ValueError(f"prompt {i}: {len(ids)} prompt tokens + max_tokens {p.max_tokens} exceeds "
                                 f"max_position_embeddings={max_pos}")
            bad = [t for t in ids if not 0 <= t < self.model.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt {i}: token id {bad[0]} outside [0, {self.model.cfg.vocab_size})")
            seqs.append(Sequence(i, list(ids), p, self.model.new_cache(), make_generator(p, self.device)))
        return seqs

    def sample_rows(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """One token per sequence from logits [B, V] (B = len(seqs))."""
        t, k, p = sampling_tensors(seqs, [1] * len(seqs), self.device)
        probs = ops.process_logits(logits, t, k, p)
        return ops.sample(probs, [s.generator for s in seqs]).tolist()

    def prefill(self, seqs: list[Sequence], **capture) -> list:
        """Run every prompt into its cache (chunks of <= max_batch_tokens); sample each first token."""
        outputs = []
        todo = list(seqs)
        while todo:
            group, total = [], 0
            while todo and (not group or total + len(todo[0].prompt_ids) <= self.max_batch_tokens):
                s = todo.pop(0)
                group.append(s)
                total += len(s.prompt_ids)
            ids = torch.tensor([t for s in group for t in s.prompt_ids], device=self.device)
            spans, off = [], 0
            for s in group:
                spans.append((off, off + len(s.prompt_ids)))
                off += len(s.prompt_ids)
            last = torch.tensor([e - 1 for _, e in spans], device=self.device)
            out = self.model(ids, Batch(spans, [0] * len(group), [s.cache for s in group]), logits_rows=last,
                             **capture)
            for s, tok in zip(group, self.sample_rows(group, out.logits)):
                self.append(s, [tok])
            outputs.append((group, spans, out))
        return outputs

    def append(self, s: Sequence, tokens: list[int]) -> None:
        """Append accepted tokens, stopping at EOS, max_tokens or a stop string."""
        for tok in tokens:
            s.output_ids.append(tok)
            if tok in self.eos_ids and not s.params.ignore_eos:
                s.finish_reason = "stop"
            elif len(s.output_ids) >= s.params.max_tokens:
                s.finish_reason = "length"
            if s.params.stop and self.tokenizer is not None:
                text = self.tokenizer.decode(s.output_ids)
                hit = [text.index(x) for x in s.params.stop if x in text]
                if hit:
                    s.finish_reason = "stop"
            if s.finished:
                s.end_time = time.perf_counter()
                break

    def decode_step(self, seqs: list[Sequence]) -> None:
        ids = torch.tensor([s.output_ids[-1] for s in seqs], device=self.device)
        spans = [(i, i + 1) for i in range(len(seqs))]
        out = self.model(ids, Batch(spans, [s.cache.num_tokens for s in seqs], [s.cache for s in seqs]))
        for s, tok in zip(seqs, self.sample_rows(seqs, out.logits)):
            self.append(s, [tok])

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        seqs = self.new_sequences(prompts, params)
        self.prefill(seqs)
        while True:
            active = [s for s in seqs if not s.finished]
            if not active:
                break
            self.decode_step(active)
        self.finalize(seqs)
        return seqs

    def finalize(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            if s.end_time is None:
                s.end_time = time.perf_counter()
            if self.tokenizer is not None:
                text = self.tokenizer.decode(s.output_ids, skip_special_tokens=True)
                for x in s.params.stop:
                    if x in text:
                        text = text[: text.index(x)]
                s.text = text

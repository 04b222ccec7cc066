"""Executes one scheduled step on the target model: flatten -> forward -> sample. Legend: T tokens, R rows, V vocab.

Every scheduled sequence contributes the chunk `all_ids[num_cached : num_cached + n]` (a prefill chunk, a
recompute chunk, or the pending token of a decode row), followed on decode rows by the drafts chosen for
verification. One target forward runs over the flattened ragged batch. Plain rows sample their last position;
verify rows go through the speculative path (`spec_runner.py`).
"""

from __future__ import annotations

import time

import torch

from sparkspec.engine.scheduler import ScheduledSeq
from sparkspec.engine.sequence import Sequence
from sparkspec.generation import make_generator, sampling_tensors
from sparkspec.models.cache import CachePools, SequenceCache
from sparkspec.models.deepseek_v4 import Batch, DeepseekV4Model, ModelOutput
from sparkspec.ops import ops


class ModelRunner:
    def __init__(self, model: DeepseekV4Model, pools: CachePools | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.pools = pools  # the engine's paged storage (None: private growable caches)

    def prepare(self, seq: Sequence) -> None:
        """Give a (newly admitted or recomputing) sequence its cache and sampling generator."""
        if seq.cache is None:
            seq.cache = SequenceCache(self.model, pools=self.pools)
            if seq.num_cached_tokens:
                raise AssertionError(f"sequence {seq.seq_id}: no cache but {seq.num_cached_tokens} cached tokens")
        if seq.generator is None and seq.params.seed is not None:
            seq.generator = make_generator(seq.params, self.device)

    def forward(self, items: list[ScheduledSeq], drafts: list[list[int]], **capture
                ) -> tuple[ModelOutput, list[tuple[int, int]], torch.Tensor]:
        """One target forward. `drafts[i]` are appended behind item i's chunk. -> (output, spans, input_ids [T]).
        Logits are computed for the last chunk row of every sampling item plus all its draft rows."""
        ids, spans, starts, caches, rows = [], [], [], [], []
        for it, d in zip(items, drafts):
            seq = it.seq
            self.prepare(seq)
            nc = seq.num_cached_tokens
            chunk = seq.all_ids[nc : nc + it.num_tokens] + list(d)
            s = len(ids)
            ids += chunk
            spans.append((s, len(ids)))
            starts.append(nc)
            caches.append(seq.cache)
            if it.samples:
                rows += range(s + it.num_tokens - 1, len(ids))
        input_ids = torch.tensor(ids, device=self.device)
        logits_rows = torch.tensor(rows, device=self.device, dtype=torch.long)
        out = self.model(input_ids, Batch(spans, starts, caches), logits_rows=logits_rows, **capture)
        return out, spans, input_ids

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """One token per sequence from logits [R, V] (R = len(seqs))."""
        if not seqs:
            return []
        t, k, p = sampling_tensors(seqs, [1] * len(seqs), self.device)
        probs = ops.process_logits(logits, t, k, p)
        return ops.sample(probs, [s.generator for s in seqs]).tolist()

    @torch.inference_mode()
    def run_plain(self, items: list[ScheduledSeq]) -> dict[Sequence, list[int]]:
        """Plain step: every sampling row yields one token. Commits the computed chunk positions."""
        out, _, _ = self.forward(items, [[] for _ in items])
        sampling = [it.seq for it in items if it.samples]
        tokens = self.sample(sampling, out.logits)
        for it in items:
            it.seq.num_cached_tokens += it.num_tokens
        return {s: [t] for s, t in zip(sampling, tokens)}

    # ---- cost table (adaptive verification) ----
    @torch.inference_mode()
    def measure_target_cost(self, num_reqs_grid: list[int], max_extra: int, context_len: int = 32,
                            repeats: int = 3) -> dict[int, list[tuple[int, float]]]:
        """Median forward time for R requests each verifying 1 + e tokens (e = 0..max_extra) at `context_len`."""
        table: dict[int, list[tuple[int, float]]] = {}
        vocab = self.model.cfg.vocab_size
        for r in num_reqs_grid:
            caches = [self.model.new_cache() for _ in range(r)]
            ctx = torch.randint(2, vocab, (r * context_len,), device=self.device)
            spans = [(i * context_len, (i + 1) * context_len) for i in range(r)]
            self.model(ctx, Batch(spans, [0] * r, caches), logits_rows=torch.tensor([0], device=self.device))
            points = []
            for e in range(max_extra + 1):
                n = 1 + e
                ids = torch.randint(2, vocab, (r * n,), device=self.device)
                spans = [(i * n, (i + 1) * n) for i in range(r)]
                rows = torch.arange(r * n, device=self.device)
                times = []
                for _ in range(repeats):
                    for c in caches:
                        c.truncate(context_len)
                    self._sync()
                    t0 = time.perf_counter()
                    self.model(ids, Batch(spans, [context_len] * r, caches), logits_rows=rows)
                    self._sync()
                    times.append(time.perf_counter() - t0)
                points.append((r * n, sorted(times)[len(times) // 2]))
            table[r] = points
        return table

    def _sync(self) -> None:
        """Wait for the accelerator (timings only; the step itself never syncs explicitly)."""
        if self.device.type == "cpu":
            return
        if hasattr(torch, "accelerator"):
            torch.accelerator.synchronize(self.device)
        else:
            torch.cuda.synchronize(self.device)

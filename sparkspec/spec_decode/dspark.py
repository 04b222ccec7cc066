"""DSpark drafting at inference (DSpark paper, deepseek-ai/DeepSpec: parallel backbone + sequential Markov
head; the math lives in `sparkspec.models.dspark`). Legend: R requests, k drafts, W window, D latent, V vocab.

Context: every stage keeps one K=V row per position (`main_x` of the target's taps through the stage's
`wkv` / `kv_norm` / RoPE) in a paged pool addressed by the target's block tables; `observe` writes the rows of
every step, committed or not (see `proposer.py` for why that needs no rollback).

`propose` runs one block of k rows `[b, noise * (k-1)]` at positions N..N+k-1 for all requests at once (N =
committed positions, b = pending token), reading the W context rows before N and all k block rows
(non-causal), then the Markov head left to right: q_i = processed(U_i + bias(d_{i-1})), d_i drawn from q_i
with the request's seed at position N+1+i (greedy requests: the argmax). q is returned as the exact draft
distribution for verification.
"""

from __future__ import annotations

import torch

from sparkspec.models.deepseek_v4 import DeepseekV4Model, store
from sparkspec.models.dspark import DSparkDraftModel
from sparkspec.ops.sampling import STREAM_DRAFT, probs_for, sample
from sparkspec.spec_decode.proposer import DraftBatch, Proposer, StepRows


class DSparkProposer(Proposer):
    method = "dspark"

    def __init__(self, target: DeepseekV4Model, drafter: DSparkDraftModel, num_spec_tokens: int):
        super().__init__(num_spec_tokens)
        self.target, self.drafter = target, drafter
        self.tap_layers = tuple(target.cfg.dspark_target_layer_ids)
        self.window = drafter.window

    def bytes_per_position(self) -> int:
        p = next(self.drafter.parameters())
        return self.drafter.num_layers * self.target.cfg.head_dim * p.element_size()

    def allocate(self, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        D = self.target.cfg.head_dim
        self.pools = [torch.zeros((num_blocks + 1) * block_size + 1, D, dtype=dtype, device=device)
                      for _ in range(self.drafter.num_layers)]
        head = self.drafter.last.confidence_head
        if head is not None and head.temperature is not None:  # read inside captured steps: no copy there
            head.temperature = head.temperature.to(device)

    def observe(self, step: StepRows) -> None:
        b = step.batch
        ctx = self.drafter.context_kv(self.drafter.main_x(step.output.taps), b.positions)  # per stage [T, D]
        rows = b.state_rows()  # [T] per-position pool rows
        for pool, kv in zip(self.pools, ctx):
            store(pool, rows, kv)

    def propose(self, step: StepRows, k: int) -> DraftBatch:
        d, R, W = self.drafter, step.reqs.shape[0], self.window
        dev = step.pending_ids.device
        ctx_kv = [self.gather_window(pool, step, W).flatten(0, 1) for pool in self.pools]  # per stage [R·W, D]
        ctx_pos = step.pending_pos.unsqueeze(1) - W + torch.arange(W, device=dev)  # [R, W]
        ctx_rows = torch.where(ctx_pos >= 0, torch.arange(R * W, device=dev).view(R, W), -1)
        block_ids = torch.full((R, k), d.noise_token_id, dtype=torch.long, device=dev)
        block_ids[:, 0] = step.pending_ids
        out = d.forward_block(self.target.embed, self.target.head, block_ids, step.pending_pos, ctx_kv, ctx_rows)
        prev, tokens, probs, confs = step.pending_ids, [], [], []
        greedy = step.sampling.all_greedy  # q would be one-hot on the argmax: skip building it
        for i in range(k):  # the Markov head, strictly left to right
            logits = d.markov_logits(out.base_logits[:, i], prev)  # [R, V]
            conf = d.confidence_logits(out.hidden[:, i], prev)  # [R] or None
            if greedy:
                prev = logits.argmax(-1)
            else:
                q = probs_for(logits, step.sampling)  # [R, V] the exact draft distribution
                prev = sample(q, step.sampling.seeds, step.pending_pos + 1 + i, STREAM_DRAFT)
                probs.append(q)
            tokens.append(prev)
            if conf is not None:
                confs.append(d.confidence(conf, i))
        return DraftBatch(torch.stack(tokens, 1), None if greedy else torch.stack(probs, 1),
                          torch.stack(confs, 1) if confs else None)

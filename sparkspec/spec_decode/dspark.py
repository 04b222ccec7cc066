"""DSpark drafting at inference (DSpark paper, deepseek-ai/DeepSpec: parallel backbone + sequential Markov
head; the math lives in `sparkspec.models.dspark`). Legend: R requests, k drafts, W window, D latent, V vocab.

Context: every stage keeps one K=V row per position (`main_x` of the target's taps through the stage's
`wkv` / `kv_norm` / RoPE) in a paged pool addressed by the target's block tables; `observe` writes the rows of
every step, committed or not (see `proposer.py` for why that needs no rollback, and for the plain steps that skip
it).

`propose` runs one block of k rows `[b, noise * (k-1)]` at positions N..N+k-1 for all requests at once (N =
committed positions, b = pending token), reading the W context rows before N and all k block rows
(non-causal), then the Markov head left to right: q_i = processed(U_i + bias(d_{i-1})), d_i drawn from q_i
with the request's seed at position N+1+i (greedy requests: the argmax; Gumbel-max requests: argmax(log q_i +
G) with the target's own noise at that position, `sampling.sample_draft`). q is returned as the exact draft
distribution for verification; a row whose q is not finite drafts a fixed id with a one-hot q instead
(`sampling.sample_draft`), so verification stays lossless and every draft id is in range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparkspec.models.deepseek_v4 import DeepseekV4Model
from sparkspec.models.dspark import DSparkDraftModel, calibrated_confidences
from sparkspec.ops.sampling import DEFAULT_GUMBEL_DRAFT_TEMPERATURE, STREAM_DRAFT, sample_draft
from sparkspec.spec_decode.proposer import DeviceProposer, DraftBatch, StepRows


class DSparkProposer(DeviceProposer):
    method = "dspark"

    def __init__(self, target: DeepseekV4Model, drafter: DSparkDraftModel, num_spec_tokens: int,
                 gumbel_draft_temperature: float = DEFAULT_GUMBEL_DRAFT_TEMPERATURE):
        super().__init__(num_spec_tokens, gumbel_draft_temperature)
        self.target, self.drafter = target, drafter
        self.tap_layers = tuple(target.cfg.dspark_target_layer_ids)
        self.window = drafter.window

    def bytes_per_position(self) -> int:
        return self.drafter.num_layers * self.target.cfg.head_dim * self.target.embed.weight.element_size()

    def allocate(self, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        D = self.target.cfg.head_dim
        self.pools = [torch.zeros((num_blocks + 1) * block_size + 1, D, dtype=dtype, device=device)
                      for _ in range(self.drafter.num_layers)]
        self.heads = self.markov_confidence_weights(device)

    def markov_confidence_weights(self, device: torch.device
                                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """The two heads as the left-to-right loop uses them, fp32 on the device: (markov_w2 with the confidence
        weights of the predecessor embedding as one more row [V (+1), r], the confidence weights of h [1, H] or
        None, per-position calibration temperatures [k], the survival maps [k, K] or None). One GEMV per position
        then gives both the Markov bias and the predecessor's share of the confidence logit."""
        last, k = self.drafter.last, self.num_spec_tokens
        w = last.markov_head.markov_w2.weight.float()  # [V, r]
        head, w_h, survival_map = last.confidence_head, None, None
        temperature = torch.ones(k, device=device)
        if head is not None:
            proj = head.proj.weight.float()  # [1, H + r]: [h ; markov_w1[prev]]
            H = proj.shape[1] - w.shape[1]
            w, w_h = torch.cat([w, proj[:, H:]]), proj[:, :H]
            if head.temperature is not None:
                t = head.temperature.float().to(device)
                temperature = t[torch.arange(k, device=device).clamp(max=t.numel() - 1)]
            if head.survival_map is not None:
                survival_map = head.survival_map.float().to(device)
        return w.to(device), None if w_h is None else w_h.to(device), temperature, survival_map

    def observe(self, step: StepRows) -> None:
        b = step.batch
        self.drafter.store_context(self.drafter.main_x(step.output.taps), b, self.pools, b.state_rows())

    def propose(self, step: StepRows, k: int) -> DraftBatch:
        d, R, W = self.drafter, step.reqs.shape[0], self.window
        dev = step.pending_ids.device
        rows, windows = self.gather_windows(step, W)  # [R, W] (-1 before position 0), per stage [R, W, D]
        ctx_kv = [w.flatten(0, 1) for w in windows]  # per stage [R·W, D]
        ctx_rows = torch.where(rows >= 0, torch.arange(R * W, device=dev).view(R, W), -1)
        block_ids = torch.cat([step.pending_ids.unsqueeze(1),
                               step.pending_ids.new_full((R, k - 1), d.noise_token_id)], dim=1)  # [R, k]
        out = d.forward_block(self.target.embed, self.target.head, block_ids, step.pending_pos, ctx_kv, ctx_rows)
        w_prev, w_h, temperature, survival_map = self.heads
        V = out.base_logits.shape[-1]
        w1 = d.last.markov_head.markov_w1
        prev, tokens, probs, conf_z = step.pending_ids, [], [], []
        greedy = step.sampling.all_greedy  # q would be one-hot on the argmax: skip building it
        for i in range(k):  # the Markov head, strictly left to right
            y = F.linear(w1(prev).float(), w_prev)  # [R, V (+1)]: Markov bias (and confidence share) of prev
            logits = out.base_logits[:, i] + y[:, :V]  # [R, V]
            if w_h is not None:
                conf_z.append(y[:, V])
            if greedy:
                prev = logits.argmax(-1)
            else:
                # [R], [R, V] the exact draft distribution (one-hot on a fixed id where it is not finite); no q
                # when every request uses the Gumbel-max scheme (its verification never reads one)
                prev, q = sample_draft(logits, step.sampling, step.pending_pos + 1 + i, STREAM_DRAFT,
                                       self.gumbel_draft_temperature)
                if q is not None:
                    probs.append(q)
            tokens.append(prev)
        confidences = None
        if w_h is not None:  # z_i = proj_h · h_i + proj_e · markov_w1[prev_i], then the calibration
            z = F.linear(out.hidden.float(), w_h).squeeze(-1) + torch.stack(conf_z, 1)  # [R, k]
            # a NaN confidence (a broken drafter row) would reach the host budget: read it as "rejected"
            confidences = calibrated_confidences(z, temperature, survival_map).nan_to_num(0.0)
        return DraftBatch(torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None, confidences)

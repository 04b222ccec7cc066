"""Executes one scheduled step on the device: verify -> accept -> propose, then ONE device->host copy.
Legend: T tokens, R requests in the batch, S requests that sample this step, K most drafts verified, V vocab.

Every scheduled sequence contributes its chunk `all_ids[num_cached : num_cached + n]` (a prefill chunk, a
recompute chunk, or the pending token of a decode row), followed on decode rows by the drafts chosen for
verification. The host packs everything into one `ForwardBatch` (one host->device copy), the target runs once,
the rejection sampler turns the logits of every sampling row into emitted tokens on the device, a device
drafter proposes the next drafts from the same rows, and one copy brings back accepted counts, tokens and the
next drafts. Nothing in between waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from sparkspec.engine.scheduler import ScheduledSeq
from sparkspec.models.cache import KVCache
from sparkspec.models.deepseek_v4 import DeepseekV4Model
from sparkspec.models.forward_batch import build_batch
from sparkspec.ops.sampling import SamplingTensors
from sparkspec.spec_decode.proposer import StepRows
from sparkspec.spec_decode.rejection import RejectionSampler


@dataclass
class SampledRow:
    """One sampling request's result, on the host."""

    num_accepted: int  # L: drafts accepted
    token_ids: list[int]  # the L + 1 emitted tokens
    next_drafts: list[int]  # drafts proposed for the next step (empty when none were asked for)
    next_confidences: list[float] | None


@dataclass
class StepResult:
    rows: dict[int, SampledRow]  # item index -> result, for the items that sample
    draft_probs: torch.Tensor | None  # [S, k, V] device q of the next drafts (row = `draft_row` of each item)
    draft_row: dict[int, int]  # item index -> row of draft_probs


def _as_int64_bits(values: list[float]) -> list[int]:
    """Floats shipped inside the int64 batch copy (read back with `.view(torch.float64)`)."""
    return np.asarray(values, dtype=np.float64).view(np.int64).tolist()


class ModelRunner:
    def __init__(self, model: DeepseekV4Model, proposer=None):
        self.model = model
        self.proposer = proposer
        self.device = next(model.parameters()).device
        self.cache: KVCache | None = None
        self.sampler = RejectionSampler()
        self.ratios = model.compress_ratios
        self.capture = {} if proposer is None else {"tap_layers": proposer.tap_layers,
                                                    "capture_final_streams": proposer.needs_final_streams}

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """The pools every block id of the engine's block manager addresses (target and drafter)."""
        self.cache = KVCache(self.model, num_blocks, block_size)
        if self.proposer is not None:
            self.proposer.allocate(num_blocks, block_size, self.device, next(self.model.parameters()).dtype)

    @torch.inference_mode()
    def execute(
        self,
        items: list[ScheduledSeq],
        drafts: list[list[int]],  # per item: draft tokens verified behind its pending token
        draft_probs: torch.Tensor | None,  # [S', k', V] q of the drafts from the previous step, or None
        draft_rows: list[int],  # per item: its row in draft_probs, -1 = one-hot q (greedy or host drafter)
        num_next_drafts: int,  # k for the device drafter at the end of this step (0 = do not draft)
    ) -> StepResult:
        # ---- host: pack the step ----
        ids, tables, starts, nums, logits_rows, sampling, next_host = [], [], [], [], [], [], []
        for i, (it, d) in enumerate(zip(items, drafts)):
            seq, nc = it.seq, it.seq.num_cached_tokens
            chunk = seq.prompt_ids[nc : nc + it.num_tokens] if nc + it.num_tokens <= len(seq.prompt_ids) \
                else (seq.prompt_ids + seq.output_ids)[nc : nc + it.num_tokens]
            if it.samples:
                sampling.append(i)
                logits_rows += range(len(ids) + it.num_tokens - 1, len(ids) + it.num_tokens + len(d))
            ids += chunk
            ids += d
            if self.capture.get("capture_final_streams"):  # MTP reads the token after every row
                after = (seq.prompt_ids + seq.output_ids)[nc + 1 : nc + it.num_tokens + 1]
                next_host += after + [0] * (it.num_tokens + len(d) - len(after))
            tables.append(seq.block_ids)
            starts.append(nc)
            nums.append(it.num_tokens + len(d))
        S = len(sampling)
        K = max((len(drafts[i]) for i in sampling), default=0)
        gather, draft_ids, first_row, qrow = [], [], [], []
        off = 0
        for i in sampling:
            k = len(drafts[i])
            gather += [off + min(j, k) for j in range(K + 1)]  # pad with the last row: never read
            draft_ids += drafts[i] + [-1] * (K - k)
            first_row.append(off)
            qrow.append(draft_rows[i] if k else -1)
            off += k + 1
        params = [items[i].seq.params for i in sampling]
        seeds = [items[i].seq.seed for i in sampling]
        positions = [items[i].seq.num_cached_tokens + items[i].num_tokens for i in sampling]  # where d_0 sits
        req_rows = list(sampling)
        first = np.cumsum([0] + nums).tolist()  # first forward row of every item
        row_of_pending = [first[i] + items[i].num_tokens - 1 for i in sampling]
        floats = _as_int64_bits([p.temperature for p in params] + [p.top_p for p in params])
        extra = gather + draft_ids + qrow + [p.top_k for p in params] + seeds + positions + req_rows \
            + row_of_pending + floats + next_host
        batch = build_batch(self.cache, ids, tables, starts, nums, logits_rows, self.ratios, extra)
        out = self.model(batch, **self.capture)
        ex = batch._memo["extra"]
        parts, o = [], 0
        for n in (S * (K + 1), S * K, S, S, S, S, S, S, 2 * S, len(next_host)):
            parts.append(ex[o : o + n])
            o += n
        gather_t, draft_t, qrow_t, top_k, seeds_t, pos_t, req_t, pend_row_t, float_t, next_t = parts
        if not S:
            if self.proposer is not None and self.proposer.on_device:  # a prefill chunk: context only
                empty = batch.positions[:0]
                self.proposer.observe(StepRows(batch, out, next_t, empty, empty, empty, empty, None))
            return StepResult({}, None, {})

        # ---- device: accept ----
        temp_top_p = float_t.view(torch.float64).float()
        st = SamplingTensors(temp_top_p[:S], top_k, temp_top_p[S:], seeds_t, all(p.greedy for p in params),
                             any(p.top_k > 0 and not p.greedy for p in params),
                             any(p.top_p < 1 and not p.greedy for p in params))
        logits = out.logits[gather_t].view(S, K + 1, -1)  # [S, K+1, V]
        draft_t = draft_t.view(S, K)
        q = None
        if K and not st.all_greedy:
            onehot = F.one_hot(draft_t.clamp(min=0), logits.shape[-1]).float()  # [S, K, V]
            if draft_probs is not None:
                prev = draft_probs[qrow_t.clamp(min=0), :K].float()
                q = torch.where((qrow_t >= 0).view(S, 1, 1), prev, onehot)
            else:
                q = onehot
        tokens, num_accepted = self.sampler(logits, draft_t, q, st, pos_t)  # [S, K+1], [S]

        # ---- device: draft for the next step ----
        results = [num_accepted.double(), tokens.double().flatten()]
        next_probs, k_next = None, 0
        if self.proposer is not None and self.proposer.on_device:
            # the token after each row: the next input, or on verify rows the emitted token (past them: garbage;
            # only MTP reads it)
            next_ids = next_t
            if len(next_host):
                verify_rows = pend_row_t.unsqueeze(1) + torch.arange(K + 1, device=tokens.device)  # [S, K+1]
                ok = tokens >= 0  # j <= L: inside the request's own rows; the rest repeat column 0's write
                rows = torch.where(ok, verify_rows, pend_row_t.unsqueeze(1))
                next_ids = next_t.index_put((rows,), torch.where(ok, tokens, tokens[:, :1]))
            pending = tokens.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [S] the new pending token
            step = StepRows(batch, out, next_ids, req_t, pending, pos_t + num_accepted, pend_row_t + num_accepted, st)
            self.proposer.observe(step)
            k_next = num_next_drafts
            if k_next:
                proposal = self.proposer.propose(step, k_next)
                results.append(proposal.token_ids.double().flatten())
                if proposal.confidences is not None:
                    results.append(proposal.confidences.double().flatten())
                next_probs = proposal.probs

        # ---- the one device->host copy ----
        host = torch.cat(results).cpu().tolist()
        L = [int(x) for x in host[:S]]
        toks = host[S : S + S * (K + 1)]
        nxt = host[S + S * (K + 1) : S + S * (K + 1) + S * k_next]
        conf = host[S + S * (K + 1) + S * k_next :]
        rows = {}
        for r, i in enumerate(sampling):
            emitted = [int(t) for t in toks[r * (K + 1) : r * (K + 1) + L[r] + 1]]
            rows[i] = SampledRow(L[r], emitted, [int(t) for t in nxt[r * k_next : (r + 1) * k_next]],
                                 conf[r * k_next : (r + 1) * k_next] if conf else None)
        return StepResult(rows, next_probs, {i: r for r, i in enumerate(sampling)})

    def synchronize(self) -> None:
        """Wait for the accelerator (timings only; the step itself never waits)."""
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

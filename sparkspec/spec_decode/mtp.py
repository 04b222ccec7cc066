"""MTP drafting at inference (DeepSeek-V3 report §2.2 multi-token prediction used as a drafter; the layer
math lives in `sparkspec.models.mtp`). Legend: R requests, T rows of the step, W window, D latent, n hc
streams, H hidden.

The MTP layer's K=V rows live in a paged pool, one row per position, addressed by the target's block tables.
`observe` runs the layer over every row of the step (input: the target's final streams at row i and the
embedding of the token after it), writing its K=V rows; its output at the last committed row predicts d_0.
Draft step j >= 1 runs the layer on its own previous output at position N-1+j. Those rows are the chain's
own: they sit in a local buffer behind the W gathered context rows and never touch the pool.

Every draft step uses the first MTP layer (`mtp.S` with the lowest S), as DeepSeek does when it drafts more
tokens than it has MTP layers.
"""

from __future__ import annotations

import torch

from sparkspec.models.deepseek_v4 import DeepseekV4Model
from sparkspec.models.mtp import MTPDraftModel
from sparkspec.ops import ops
from sparkspec.ops.indices import paged_attention_indices
from sparkspec.ops.sampling import DEFAULT_GUMBEL_DRAFT_TEMPERATURE, STREAM_DRAFT, sample_draft
from sparkspec.spec_decode.proposer import DeviceProposer, DraftBatch, StepRows


class MTPProposer(DeviceProposer):
    method = "mtp"
    needs_final_streams = True

    def __init__(self, target: DeepseekV4Model, drafter: MTPDraftModel, num_spec_tokens: int,
                 gumbel_draft_temperature: float = DEFAULT_GUMBEL_DRAFT_TEMPERATURE):
        super().__init__(num_spec_tokens, gumbel_draft_temperature)
        self.target, self.drafter = target, drafter
        self.window = drafter.window
        self._streams: torch.Tensor | None = None  # [T] layer output of the last observed step

    def bytes_per_position(self) -> int:
        return self.target.cfg.head_dim * self.target.embed.weight.element_size()

    def allocate(self, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        rows = (num_blocks + 1) * block_size + 1  # + the scratch block and the trash row
        self.pools = [torch.zeros(rows, self.target.cfg.head_dim, dtype=dtype, device=device)]

    def observe(self, step: StepRows) -> None:
        b, pool = step.batch, self.pools[0]

        def attend(a, h, pos):  # pos: the batch's positions, so the batch's rotation (computed once per forward)
            rot = a.rotary.rotations(b, "tokens", lambda: pos)
            q, _ = a.project_q(h, pos, rot)
            a.project_kv(h, pos, rot, out=pool, out_rows=b.state_rows())  # the rows go to the pool in the RoPE launch
            idx = paged_attention_indices(pos, b.req_idx, b.block_tables, b.block_size, self.window, 1, None, 0)
            return a.project_out(ops.sparse_attention(q, pool, idx, a.attn_sink, a.scale), pos, rot)

        self._streams = self.drafter.forward_rows(0, self.target.embed, step.output.final_streams, step.next_ids,
                                                  b.positions, attend)

    def propose(self, step: StepRows, k: int) -> DraftBatch:
        R, W, dev = step.reqs.shape[0], self.window, step.pending_ids.device
        ctx = self.gather_windows(step, W)[1][0]  # [R, W, D] positions N-W .. N-1
        buf = torch.cat([ctx, ctx.new_zeros(R, max(k - 1, 0), ctx.shape[2])], dim=1)  # + the chain's rows
        width = buf.shape[1]
        streams = self._streams[step.last_rows]  # [R, n·H] layer output at position N - 1
        window = torch.arange(W, device=dev)
        base = (torch.arange(R, device=dev) * width).unsqueeze(1)  # [R, 1]
        tokens, probs = [], []
        for j in range(k):
            if j > 0:
                pos = step.pending_pos - 1 + j  # [R]

                def attend(a, h, pos, j=j):
                    q, _ = a.project_q(h, pos)
                    buf[:, W + j - 1] = a.project_kv(h, pos).to(buf.dtype)
                    rows = torch.where(pos.unsqueeze(1) - W + 1 + window >= 0, base + j + window, -1)  # [R, W]
                    o = ops.sparse_attention(q, buf.flatten(0, 1), rows, a.attn_sink, a.scale)
                    return a.project_out(o, pos)

                streams = self.drafter.forward_rows(0, self.target.embed, streams, tokens[-1], pos, attend)
            logits = self.drafter.logits(0, streams, self.target.norm, self.target.head)  # [R, V]
            if step.sampling.all_greedy:  # q would be one-hot on the argmax
                tokens.append(logits.argmax(-1))
                continue
            # a row whose q is not finite drafts a fixed id with a one-hot q (`sample_draft`): lossless, in range;
            # Gumbel-max requests draw with the target's noise at the draft's position and need no q
            token, q = sample_draft(logits, step.sampling, step.pending_pos + 1 + j, STREAM_DRAFT,
                                    self.gumbel_draft_temperature)
            tokens.append(token)
            if q is not None:
                probs.append(q)
        return DraftBatch(torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None)

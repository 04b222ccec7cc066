"""The classic DeepSeek-V4 multi-token-prediction (MTP) drafter (DeepSeek-V3 report §2.2, in the V4 form: a
full V4 block with its own hc head over e_proj / h_proj of the embedding and the target's streams).

Legend: T rows, R pool rows, n hc streams, H hidden, D latent width, V vocabulary.

An MTP row at position i reads the token t_{i+1} that follows it and a "previous" residual stream, and
predicts t_{i+2}:

    x = h_proj(hnorm(prev_streams)) + e_proj(enorm(embed(t_{i+1})))[:, None]     # [T, n, H], streams kept
    x = V4 block (layer num_hidden_layers + stage: sliding window only, routed MoE) over the MTP's own KV
    logits = head(norm(hc_head(x)))    # own hc_head; the target's shared head; own `norm` if the checkpoint
                                       # has `mtp.S.norm.weight`, else the target's norm

* Layer 0's `prev_streams` at row i are the TARGET's final streams (before hc_head) at position i.
* Layer j >= 1 at row i reads layer j-1's output streams at row i-1 — DeepSeek-V3's depth-(j+1) module
  with rows numbered by the position of the token before their input token, so that every layer's row at i
  predicts t_{i+2}. Row 0 of a layer j >= 1 has no predecessor and reads zero streams.
* The embedding is zeroed at position 0 (as vLLM's V4 MTP does).
* Drafting k tokens: d_0 comes from layer 0's row at the last committed position N-1; draft step j >= 1 runs
  layer min(j, num_layers - 1) at position N-1+j on its own previous output streams and d_{j-1} (one MTP layer
  is reused for every step when the checkpoint has fewer layers than k).

Checkpoint layout: `mtp.S.{enorm,hnorm,e_proj,h_proj}.weight`, `mtp.S.hc_head_{fn,base,scale}`, optional
`mtp.S.norm.weight`, and the V4 block (`attn.*`, `ffn.*`, `attn_norm`, `ffn_norm`, `hc_attn_*`, `hc_ffn_*`).
`mtp.S.emb.*` / `mtp.S.head.*` copies, if present, are ignored (embedding and head are the target's).
**When a checkpoint carries both drafters**, the DSpark stages are `mtp.0..n_dspark-1` (they own
`main_proj`) and the MTP layers follow at `mtp.n_dspark..` (they own `e_proj`); each drafter is detected by
its own tensors (`sparkspec.loading.drafters`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sparkspec.config import ModelConfig
from sparkspec.models.deepseek_v4 import FP32_PARAM_SUFFIXES, Attention, Block, RMSNorm, head_logits
from sparkspec.models.fused_linear import dense
from sparkspec.ops import ops


class MTPLayer(Block):
    def __init__(self, cfg: ModelConfig, stage: int, has_norm: bool = True):
        super().__init__(cfg, cfg.num_hidden_layers + stage)
        H, n = cfg.hidden_size, cfg.hc_mult
        self.enorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps)
        self.e_proj = nn.Linear(H, H, bias=False)
        self.h_proj = nn.Linear(H, H, bias=False)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * H))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.norm = RMSNorm(H, cfg.rms_norm_eps) if has_norm else None


class MTPDraftModel(nn.Module):
    """Classic MTP layers stored at `mtp.{first_stage + j}`; embedding/head (and norm, if absent) are the target's."""

    def __init__(self, cfg: ModelConfig, num_layers: int | None = None, first_stage: int = 0, has_norm: bool = True):
        super().__init__()
        self.cfg = cfg
        self.num_layers = num_layers or cfg.num_nextn_predict_layers
        if self.num_layers < 1:
            raise ValueError(f"config field 'num_nextn_predict_layers' = {cfg.num_nextn_predict_layers!r}: "
                             "expected >= 1 MTP layer")
        self.first_stage = first_stage
        self.window = cfg.sliding_window
        self.mtp = nn.ModuleDict({str(first_stage + j): MTPLayer(cfg, first_stage + j, has_norm)
                                  for j in range(self.num_layers)})

    def layer(self, step: int) -> MTPLayer:
        """The layer that runs draft step `step` (the last layer is reused past the checkpoint's depth)."""
        return self.mtp[str(self.first_stage + min(step, self.num_layers - 1))]

    def forward_rows(
        self,
        step: int,
        embed: nn.Embedding,  # the target's shared embedding
        prev_streams: torch.Tensor,  # [T, n·H] the target's (or this layer's previous) output streams
        next_ids: torch.Tensor,  # [T] the token following each row's position
        positions: torch.Tensor,  # [T]
        # (attn, normed h, positions) -> [T, H]
        attend: Callable[[Attention, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Rows of layer `layer(step)` -> output streams [T, n·H]. `attend` decides where the layer's K=V rows
        go and which rows each query reads (the caller's pool and index lists)."""
        cfg, layer = self.cfg, self.layer(step)
        T, n, H = prev_streams.shape[0], cfg.hc_mult, cfg.hidden_size
        e = embed(next_ids).to(layer.e_proj.weight.dtype)
        e = e.masked_fill((positions == 0).unsqueeze(1), 0.0)  # [T, H]
        x = dense(layer.h_proj, layer.hnorm(prev_streams.view(T, n, H).to(e.dtype)))
        x = x + dense(layer.e_proj, layer.enorm(e)).unsqueeze(1)
        x = layer(x.contiguous(), positions, next_ids, lambda h: attend(layer.attn, h, positions))  # [T, n, H]
        return x.flatten(1)

    def logits(self, step: int, streams: torch.Tensor, target_norm: nn.Module, head: nn.Linear) -> torch.Tensor:
        """streams [T, n·H] of layer(step) -> logits [T, V] fp32."""
        cfg, layer = self.cfg, self.layer(step)
        x = streams.view(streams.shape[0], cfg.hc_mult, cfg.hidden_size)
        h = ops.hc_head(x, layer.hc_head_fn, layer.hc_head_scale, layer.hc_head_base, cfg.rms_norm_eps, cfg.hc_eps)
        norm = layer.norm if layer.norm is not None else target_norm
        return head_logits(head, norm(h).float())

    def keep_fp32(self) -> MTPDraftModel:
        for name, p in self.named_parameters():
            if name.endswith(FP32_PARAM_SUFFIXES):
                p.data = p.data.float()
        return self

"""The DSpark block drafter in its DeepSeek-V4 form (DSpark paper, deepseek-ai/DeepSpec `DSpark_paper.pdf`;
the stage layout of the official V4 checkpoints: stages `mtp.0..n-1`, described below).

Legend: B blocks, k rows per block, T = B·k block rows, C context rows, m tapped target layers,
n hc streams, H hidden, D latent width (K = V), V vocabulary, r Markov rank.

Terms:
* **taps** — the target's residual streams after each 0-based layer in `dspark_target_layer_ids`, averaged
  over the hc streams ([T, m, H]; produced by `DeepseekV4Model.forward(tap_layers=...)`).
* **main_x** — `main_norm(main_proj(cat(taps)))` [T, H]: one row per COMMITTED target token.
* **context K/V** — each stage projects main_x through its OWN `wkv`/`kv_norm` + RoPE at the context
  positions. A block only ever reads the last `sliding_window` context positions.
* **block** — `[anchor, noise, ..., noise]` at positions P+1..P+k, where P is the last committed position
  and the anchor is the token the target sampled for P+1. Attention is NON-causal inside the block: every row
  reads the context window, all k block rows and the sink (index lists from `ops.indices`).
* **base logits** `U_i = head(norm(hc_head(h_i)))` — the drafter's own `norm`/`hc_head` (last stage), the
  target's shared `head` (and `embed` for the block ids). Row i predicts the token at P+2+i.
* **Markov head** — `logits_i = U_i + markov_w2 · markov_w1[prev_i]`, prev_0 = anchor, prev_{i+1} = d_i;
  strictly left to right at inference, teacher-forced in training.
* **confidence** — `sigmoid(proj([h_i ; markov_w1[prev_i]]))` (no bias), when the checkpoint has it.

Checkpoint layout (stages `mtp.0..n-1`, n = `cfg.num_dspark_layers`): every stage is a full V4 block
(`attn.*`, `ffn.*`, `attn_norm`, `ffn_norm`, `hc_attn_*`, `hc_ffn_*`) numbered as layer
`num_hidden_layers + i` (sliding-window only, routed MoE); stage 0 also owns `main_proj`, `main_norm`; the last
stage owns `norm`, `hc_head_{fn,base,scale}`, `markov_head.markov_w{1,2}` and optionally
`confidence_head.proj`. When a checkpoint also carries classic MTP layers, they follow at
`mtp.n..` (see `sparkspec.models.mtp`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sparkspec.config import ModelConfig
from sparkspec.models.deepseek_v4 import FP32_PARAM_SUFFIXES, Block, RMSNorm, head_logits
from sparkspec.models.fused_linear import dense
from sparkspec.ops import ops
from sparkspec.ops.indices import dspark_block_indices


def context_rows(ctx_ranges: torch.Tensor, window: int) -> torch.Tensor:
    """Blocks whose contexts are concatenated: ctx_ranges [B, 2] (start, end) rows -> the last `window` rows of
    each range [B, W], oldest first, -1 where the range is shorter."""
    rows = ctx_ranges[:, 1:2] - window + torch.arange(window, device=ctx_ranges.device)  # [B, W]
    return torch.where(rows >= ctx_ranges[:, 0:1], rows, -1)


def require_dspark_config(cfg: ModelConfig) -> None:
    for name in ("dspark_block_size", "dspark_target_layer_ids", "dspark_markov_rank", "dspark_noise_token_id"):
        if getattr(cfg, name) in (None, []):
            raise ValueError(f"config field '{name}' is missing: the checkpoint's config has no DSpark drafter")
    if cfg.num_dspark_layers < 1:
        raise ValueError(f"config field 'n_mtp_layers' = {cfg.n_mtp_layers!r}: expected >= 1 DSpark stage")


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)  # [V, r] predecessor embedding
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)  # [V, r] bias projection


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1, bias=False)  # [1, H + r]
        # [k] per-position temperatures (sequential temperature scaling), loaded when the checkpoint has
        # `confidence_head.temperature`; None = uncalibrated (T = 1)
        self.temperature: torch.Tensor | None = None
        # [k, K] per-position monotone maps from the block feature to the prefix survival (`survival_confidences`),
        # loaded from `confidence_head.survival_map`; when present they replace the temperatures
        self.survival_map: torch.Tensor | None = None


def block_feature(z: torch.Tensor) -> torch.Tensor:
    """Raw confidence logits of a block [..., k] -> one calibration feature per block [...]: the geometric mean
    of the raw confidences σ(z_i), in [0, 1]."""
    return torch.nn.functional.logsigmoid(z.float()).mean(-1).exp()


def survival_confidences(z: torch.Tensor, survival_map: torch.Tensor) -> torch.Tensor:
    """Calibrated conditional confidences from raw logits z [..., k] through per-position maps [k', K].

    Every position reads the same block feature f (`block_feature`: acceptances within a block are strongly
    correlated, a block that locks onto the target accepts everything, so every draft's logit says something
    about every position). Position i's map (its values at K evenly spaced f, linear in between; non-increasing
    in i, as `sparkspec train calibrate` fits them) gives the survival a_i of the first i + 1 drafts; the
    conditional confidences a_i / a_{i-1} multiply back into exactly those survivals in the engine."""
    k, K = z.shape[-1], survival_map.shape[-1]
    pos = torch.arange(k, device=z.device).clamp(max=survival_map.shape[0] - 1)
    table = survival_map.float()[pos]  # [k, K]
    x = (block_feature(z) * (K - 1)).unsqueeze(-1).expand(*z.shape)  # [..., k]
    lo = x.floor().clamp(0, K - 2)
    frac = x - lo
    lo = lo.long()
    cols = pos.expand_as(lo)
    a = (table[cols, lo] * (1 - frac) + table[cols, lo + 1] * frac).clamp(0, 1)
    a = torch.cummin(a, dim=-1).values
    before = torch.cat([torch.ones_like(a[..., :1]), a[..., :-1]], dim=-1)
    return torch.where(before > 0, a / before.clamp(min=1e-12), torch.zeros_like(a)).clamp(0, 1)


def calibrated_confidences(z: torch.Tensor, temperature: torch.Tensor | None,
                           survival_map: torch.Tensor | None) -> torch.Tensor:
    """Raw confidence logits of whole blocks [..., k] -> the conditional confidences the engine receives: through
    the survival maps [k', K] when the checkpoint has them, else σ(z_i / T_i) (`temperature` [>= k] per position,
    or None: uncalibrated)."""
    if survival_map is not None:
        return survival_confidences(z, survival_map)
    return torch.sigmoid(z if temperature is None else z / temperature[: z.shape[-1]])


class DSparkStage(Block):
    """One draft layer (a V4 block numbered `num_hidden_layers + stage`) plus the tensors its stage owns."""

    def __init__(self, cfg: ModelConfig, stage: int, num_stages: int):
        super().__init__(cfg, cfg.num_hidden_layers + stage)
        H, n = cfg.hidden_size, cfg.hc_mult
        if stage == 0:
            self.main_proj = nn.Linear(len(cfg.dspark_target_layer_ids) * H, H, bias=False)
            self.main_norm = RMSNorm(H, cfg.rms_norm_eps)
        if stage == num_stages - 1:
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
            self.hc_head_fn = nn.Parameter(torch.zeros(n, n * H))
            self.hc_head_base = nn.Parameter(torch.zeros(n))
            self.hc_head_scale = nn.Parameter(torch.ones(1))
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank)
            self.confidence_head: ConfidenceHead | None = ConfidenceHead(H + cfg.dspark_markov_rank)

    def block_attention(
        self,
        h: torch.Tensor,  # [T, H] normed block rows
        positions: torch.Tensor,  # [T]
        ctx_kv: torch.Tensor,  # [C, D] this stage's context K=V rows
        indices: torch.Tensor,  # [T, W] rows of [ctx_kv ; block kv], -1 padded
    ) -> torch.Tensor:
        a = self.attn
        q, _ = a.project_q(h, positions)
        pool = torch.cat([ctx_kv.to(h.dtype), a.project_kv(h, positions)], dim=0)  # [C + T, D]
        o = ops.sparse_attention(q, pool, indices, a.attn_sink, a.scale)
        return a.project_out(o, positions)


@dataclass
class DSparkBlockOutput:
    hidden: torch.Tensor  # [B, k, H] hc-collapsed, pre-norm (feeds the confidence head)
    base_logits: torch.Tensor  # [B, k, V] fp32, U_i
    markov_logits: torch.Tensor | None = None  # [B, k, V] fp32, U_i + Markov bias of prev_ids[:, i]
    confidence_logits: torch.Tensor | None = None  # [B, k] fp32 raw logits (sigmoid = confidence)


class DSparkDraftModel(nn.Module):
    """The DSpark drafter: `mtp.{0..n-1}` stages; the embedding and LM head are the target's (passed in)."""

    def __init__(self, cfg: ModelConfig, num_layers: int | None = None):
        super().__init__()
        require_dspark_config(cfg)
        self.cfg = cfg
        self.num_layers = num_layers or cfg.num_dspark_layers
        self.block_size = cfg.dspark_block_size
        self.noise_token_id = cfg.dspark_noise_token_id
        self.window = cfg.sliding_window
        self.mtp = nn.ModuleList(DSparkStage(cfg, i, self.num_layers) for i in range(self.num_layers))

    @property
    def first(self) -> DSparkStage:
        return self.mtp[0]

    @property
    def last(self) -> DSparkStage:
        return self.mtp[-1]

    @property
    def has_confidence(self) -> bool:
        return self.last.confidence_head is not None

    # ---- context ----
    def main_x(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [T, m, H] (declared layer order) -> main_x [T, H]."""
        s = self.first
        return s.main_norm(dense(s.main_proj, taps.flatten(1).to(s.main_proj.weight.dtype)))

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """main_x [T, H] at `positions` [T] -> per stage context K=V rows [T, D] (own wkv/kv_norm + RoPE)."""
        return [stage.attn.project_kv(main_x, positions) for stage in self.mtp]

    def store_context(self, main_x: torch.Tensor, batch, pools: list[torch.Tensor], rows: torch.Tensor) -> None:
        """`context_kv` at the batch's positions written straight into each stage's pool at `rows`: the RoPE launch
        stores them (no separate copy), and the rotation is the batch's, computed once per forward for every module
        with the same frequencies (the stages, and the target's layers that share them)."""
        pos = batch.positions
        for stage, pool in zip(self.mtp, pools):
            rot = stage.attn.rotary.rotations(batch, "tokens", lambda: pos)
            stage.attn.project_kv(main_x, pos, rot, out=pool, out_rows=rows)

    # ---- heads ----
    def markov_logits(self, base_logits: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """U [..., V] + markov_w2 · markov_w1[prev] -> [..., V] fp32."""
        mh = self.last.markov_head
        e = mh.markov_w1(prev_ids).float()  # [..., r]
        return base_logits.float() + F.linear(e, mh.markov_w2.weight.float())

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """proj([h ; markov_w1[prev]]) -> [...] fp32 raw logits, or None without a confidence head."""
        if not self.has_confidence:
            return None
        e = self.last.markov_head.markov_w1(prev_ids).float()
        x = torch.cat([hidden.float(), e], dim=-1)
        return F.linear(x, self.last.confidence_head.proj.weight.float()).squeeze(-1)

    def confidence(self, logits: torch.Tensor, position: int) -> torch.Tensor:
        """Confidence of block position `position` (0-based) scaled alone: sigmoid(z / T_position)."""
        t = self.last.confidence_head.temperature
        if t is not None:
            logits = logits / t[min(position, t.numel() - 1)].to(logits.device)
        return torch.sigmoid(logits)

    # ---- the block forward (training and inference) ----
    def forward_block(
        self,
        embed: nn.Embedding,  # the target's shared embedding
        head: nn.Linear,  # the target's shared LM head
        block_ids: torch.Tensor,  # [B, k] anchor then noise (training may pass any ids)
        start_positions: torch.Tensor,  # [B] position of row 0 (the anchor) = last committed position + 1
        ctx_kv: list[torch.Tensor],  # per stage [C, D] context rows (from `context_kv`) of every block
        ctx_rows: torch.Tensor,  # [B, W] rows of ctx_kv each block reads, oldest first, -1 = none
        prev_ids: torch.Tensor | None = None,  # [B, k] Markov predecessors (teacher forcing); None = U only
    ) -> DSparkBlockOutput:
        """One parallel pass of all stages over B blocks of k rows (DSpark paper: parallel backbone, then the
        sequential head). Batched over any number of blocks; the inference loop and the trainer both call it."""
        cfg = self.cfg
        B, k = block_ids.shape
        dev = block_ids.device
        ids = block_ids.reshape(-1)  # [T]
        positions = (start_positions.unsqueeze(1) + torch.arange(k, device=dev)).reshape(-1)  # [T]
        indices = dspark_block_indices(ctx_rows, ctx_kv[0].shape[0], k)  # [T, W + k]
        x = embed(ids).to(self.first.attn_norm.weight.dtype)
        x = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()  # [T, n, H]
        for stage, kv in zip(self.mtp, ctx_kv):
            x = stage(x, positions, ids, lambda h, s=stage, kv=kv: s.block_attention(h, positions, kv, indices))
        last = self.last
        hidden = ops.hc_head(x, last.hc_head_fn, last.hc_head_scale, last.hc_head_base, cfg.rms_norm_eps, cfg.hc_eps)
        base = head_logits(head, last.norm(hidden).float()).view(B, k, -1)  # [B, k, V]
        hidden = hidden.view(B, k, -1)
        out = DSparkBlockOutput(hidden=hidden, base_logits=base)
        if prev_ids is not None:
            out.markov_logits = self.markov_logits(base, prev_ids)
            out.confidence_logits = self.confidence_logits(hidden, prev_ids)
        return out

    def keep_fp32(self) -> DSparkDraftModel:
        """Cast mHC, sink, router-bias, Markov and confidence parameters back to fp32 after a `.to(bf16)`."""
        for name, p in self.named_parameters():
            if name.endswith(FP32_PARAM_SUFFIXES) or "markov_head" in name or "confidence_head" in name:
                p.data = p.data.float()
        return self

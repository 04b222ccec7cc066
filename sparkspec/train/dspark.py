"""`sparkspec train dspark`: distil a DSpark drafter from its target, following DeepSpec (DSpark paper §3.3,
§4.1; deepseek-ai/DeepSpec `deepspec/modeling/dspark/loss.py`).

Terms (k = dspark_block_size, slot i = 0..k-1):
* anchor a — a random answer position of a target-regenerated sequence x with x[a+1] also an answer token;
  the block is [x[a], noise, ..., noise] at positions a..a+k-1 and reads the target context rows < a.
* slot i predicts x[a+i+1]; its target distribution p_t,i is the target's next-token distribution at row a+i.
* Markov head with ground-truth predecessors: prev_i = x[a+i] (teacher forcing, no sampling loop).
* loss = 0.1·CE(x*) + 0.9·‖p_d − p_t‖₁ + 1.0·BCE(confidence, detach(clamp(1 − ½‖p_d − p_t‖₁, 0, 1))), each term a
  mean over supervised slots weighted by w_i = exp(−i/4) (i 0-based: exp(−(k−1)/4) with k 1-based).
* The embedding and LM head are the target's, frozen; every drafter weight is trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sparkspec.config import ModelConfig
from sparkspec.loading.drafters import dspark_from_tensors
from sparkspec.loading.random_init import init_dspark_tensors
from sparkspec.models.dspark import DSparkDraftModel, context_rows
from sparkspec.train import common
from sparkspec.train.features import Sequences, TargetFeatures

LOSS_DECAY = 4.0
ALPHA_CE, ALPHA_L1, ALPHA_CONF = 0.1, 0.9, 1.0


def position_weights(k: int, decay: float = LOSS_DECAY, device=None) -> torch.Tensor:
    """w_i = exp(-i / decay), i = 0..k-1 -> [k]."""
    return torch.exp(-torch.arange(k, dtype=torch.float32, device=device) / decay)


def dspark_loss(
    draft_logits: torch.Tensor,  # [N, k, V] Markov-corrected, teacher-forced
    confidence_logits: torch.Tensor | None,  # [N, k] raw logits
    target_logits: torch.Tensor,  # [N, k, V]
    labels: torch.Tensor,  # [N, k] ground-truth next tokens x[a+i+1]
    mask: torch.Tensor,  # [N, k] bool: slot supervised
    decay: float = LOSS_DECAY,
) -> dict[str, torch.Tensor]:
    """DeepSpec's DSpark loss -> {"loss", "ce", "l1", "conf", "accept"} (accept = weighted mean of the soft
    acceptance label, a training-time estimate of per-slot acceptance at T = 1)."""
    k = draft_logits.shape[1]
    w = position_weights(k, decay, draft_logits.device).unsqueeze(0) * mask.float()  # [N, k]
    denom = w.sum().clamp(min=1e-6)
    logp_d = torch.log_softmax(draft_logits.float(), dim=-1)
    p_d, p_t = logp_d.exp(), torch.softmax(target_logits.float(), dim=-1)
    l1 = (p_d - p_t).abs().sum(-1)  # [N, k]  full L1 = 2·TV
    ce = -logp_d.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    accept = (1 - 0.5 * l1).clamp(0, 1).detach()  # analytic acceptance probability of speculative sampling
    terms = {"ce": (w * ce).sum() / denom, "l1": (w * l1).sum() / denom, "accept": (w * accept).sum() / denom}
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept, reduction="none")
        terms["conf"] = (w * bce).sum() / denom
    else:
        terms["conf"] = torch.zeros((), device=draft_logits.device)
    terms["loss"] = ALPHA_CE * terms["ce"] + ALPHA_L1 * terms["l1"] + ALPHA_CONF * terms["conf"]
    return terms


@dataclass
class BlockBatch:
    """Anchored blocks sampled from a few sequences, with everything `forward_block` and the loss need."""

    seq_rows: torch.Tensor  # [C] flat row ids (into Sequences/TargetFeatures) of the context sequences
    ctx_positions: torch.Tensor  # [C]
    ctx_ranges: torch.Tensor  # [N, 2] context rows (into seq_rows order) before each anchor
    block_ids: torch.Tensor  # [N, k]
    start_positions: torch.Tensor  # [N]
    prev_ids: torch.Tensor  # [N, k]
    labels: torch.Tensor  # [N, k]
    target_rows: torch.Tensor  # [N, k] flat rows whose target distribution supervises each slot
    mask: torch.Tensor  # [N, k] bool


def sample_blocks(seqs: Sequences, seq_ids: list[int], k: int, anchors: int, noise_id: int,
                  gen: torch.Generator) -> BlockBatch:
    """Up to `anchors` random anchors per sequence among answer positions a with x[a+1] also an answer token
    (sampled without replacement, sorted); slots past the sequence end are masked."""
    rows, positions, ranges, blocks, starts, prevs, labels, trows, masks = [], [], [], [], [], [], [], [], []
    offset = 0
    for s in seq_ids:
        lo, hi = seqs.span(s)
        n, p = hi - lo, int(seqs.prompt_lens[s])
        rows.append(torch.arange(lo, hi))
        positions.append(torch.arange(n))
        valid = torch.arange(p, n - 1)  # anchor a: answer token with an answer token after it
        if valid.numel() == 0:
            offset += n
            continue
        pick = valid[torch.randperm(valid.numel(), generator=gen)[:anchors]].sort().values  # [A]
        slot = pick.unsqueeze(1) + torch.arange(k)  # [A, k] positions a+i
        nxt = slot + 1
        ok = nxt < n
        ids = seqs.ids[lo:hi]
        blk = torch.full((pick.numel(), k), noise_id, dtype=torch.long)
        blk[:, 0] = ids[pick]
        blocks.append(blk)
        starts.append(pick)
        prevs.append(torch.where(slot < n, ids[slot.clamp(max=n - 1)], torch.zeros_like(slot)))
        labels.append(torch.where(ok, ids[nxt.clamp(max=n - 1)], torch.full_like(nxt, -1)))
        trows.append(lo + slot.clamp(max=n - 1))
        masks.append(ok)
        ranges.append(torch.stack([torch.full_like(pick, offset), offset + pick], dim=1))
        offset += n
    return BlockBatch(torch.cat(rows), torch.cat(positions), torch.cat(ranges), torch.cat(blocks), torch.cat(starts),
                      torch.cat(prevs), torch.cat(labels), torch.cat(trows), torch.cat(masks))


def block_forward(drafter: DSparkDraftModel, target, feats: TargetFeatures, bb: BlockBatch,
                  dev: torch.device) -> tuple:
    """-> (DSparkBlockOutput with Markov + confidence logits, target logits [N, k, V])."""
    taps = feats.taps[bb.seq_rows.to(dev)]
    main_x = drafter.main_x(taps)
    ctx_kv = drafter.context_kv(main_x, bb.ctx_positions.to(dev))
    out = drafter.forward_block(target.embed, target.head, bb.block_ids.to(dev), bb.start_positions.to(dev),
                                ctx_kv, context_rows(bb.ctx_ranges.to(dev), drafter.window), bb.prev_ids.to(dev))
    with torch.no_grad():
        hidden = feats.hidden[bb.target_rows.to(dev).reshape(-1)]
        target_logits = target.logits_from_hidden(hidden).view(*bb.target_rows.shape, -1)
    return out, target_logits


def init_drafter(cfg: ModelConfig, seed: int) -> DSparkDraftModel:
    """Random init as `sparkspec init` writes it, with the Markov bias started near zero (a DFlash-like start,
    as in DeepSpec)."""
    tensors = init_dspark_tensors(cfg, torch.Generator().manual_seed(seed))
    for name, t in tensors.items():
        if name.endswith("markov_head.markov_w2.weight"):
            t.mul_(0.05)
        elif name.endswith(("attn.wo_b.weight", ".w2.weight")):
            t.mul_(1.0 / math.sqrt(2 * cfg.num_dspark_layers))
    return dspark_from_tensors(cfg, tensors)


def train_dspark(model_dir: Path, data: Path, out_dir: Path, steps: int, minutes: float | None = None,
                 batch_size: int = 16, max_len: int = 640, anchors: int = 64, lr: float = 6e-4, seed: int = 0,
                 device: str | None = None, save_every: int = 500, compile: bool | None = None) -> dict:
    from sparkspec.train.features import compute_features, load_frozen_target, load_sequences, save_drafter

    dev = common.pick_device(device)
    common.use_native_ops(compile=dev.type != "cpu" if compile is None else compile)
    gen = common.seed_everything(seed)
    ck = load_frozen_target(Path(model_dir), dev)
    cfg, target = ck.config, ck.model
    k = cfg.dspark_block_size
    seqs = load_sequences(Path(data), max_len)
    feats = compute_features(target, seqs, tuple(cfg.dspark_target_layer_ids))
    drafter = init_drafter(cfg, seed).to(dev).train()
    opt = common.adamw(drafter.parameters(), lr)
    loop = common.TrainLoop("dspark", drafter, opt, lr, steps, minutes, dev, Path(out_dir) / "dspark_state",
                            save_every)
    batches = common.epoch_batches(seqs.num_seqs, batch_size, gen)

    def loss_terms() -> dict[str, torch.Tensor]:
        bb = sample_blocks(seqs, next(batches), k, anchors, cfg.dspark_noise_token_id, gen)
        out, target_logits = block_forward(drafter, target, feats, bb, dev)
        return dspark_loss(out.markov_logits, out.confidence_logits, target_logits, bb.labels.to(dev),
                           bb.mask.to(dev))

    loop.run(loss_terms)
    step, log = loop.step, loop.log
    stages = [f"mtp.{i}." for i in range(drafter.num_layers)]
    save_drafter(Path(model_dir), Path(out_dir), ck, drafter.state_dict(), stages)
    (Path(out_dir) / "dspark_state" / common.STATE_FILE).unlink(missing_ok=True)
    meta = {"steps": step, "time_s": round(loop.budget.elapsed, 1), "sequences": seqs.num_seqs,
            "train_tokens": int(seqs.ids.numel()), "batch_size": batch_size, "anchors": anchors, "lr": lr,
            "block_size": k, "params_m": round(sum(p.numel() for p in drafter.parameters()) / 1e6, 3)}
    log.write(Path(out_dir) / "train_log_dspark.json", **meta)
    return {**log.summary(), **meta}

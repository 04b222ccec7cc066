"""`sparkspec train mtp`: train the classic MTP layer(s) of a target on the same regenerated data and with the
same distillation objective as DSpark (0.1·CE + 0.9·‖p_mtp − p_target‖₁, no confidence head), so the two
drafters differ only in architecture.

Rows (see `sparkspec.models.mtp`): the MTP row at position i reads the target's final streams at i and the token
x[i+1], and predicts x[i+2]; its target distribution is the target's at row i+1. Drafting k > num_layers tokens
reuses the last layer on its own output, so training unrolls `unroll` steps: step j's row i reads step j-1's
output at row i-1 and attends to step j-1's K=V rows of earlier positions (what `MTPProposer` does when
drafting), with loss weight exp(-j/4) like DSpark's slot weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from sparkspec.loading.drafters import mtp_from_tensors
from sparkspec.loading.random_init import init_mtp_tensors
from sparkspec.models.mtp import MTPDraftModel
from sparkspec.ops import ops
from sparkspec.ops.indices import swa_index_width
from sparkspec.train import common
from sparkspec.train.dspark import ALPHA_CE, ALPHA_L1, LOSS_DECAY
from sparkspec.train.features import Sequences, TargetFeatures


def mtp_first_stage(cfg) -> int:
    """MTP layers follow the DSpark stages when the checkpoint has both."""
    return cfg.num_dspark_layers if cfg.has_dspark else 0


def init_mtp(cfg, seed: int) -> MTPDraftModel:
    first = mtp_first_stage(cfg)
    tensors = init_mtp_tensors(cfg, torch.Generator().manual_seed(seed), first)
    for name, t in tensors.items():
        if name.endswith(("attn.wo_b.weight", ".w2.weight")):
            t.mul_(1.0 / math.sqrt(2))
    return mtp_from_tensors(cfg, tensors)


def causal_window_indices(query_pos: torch.Tensor, pool_pos: torch.Tensor, window: int) -> torch.Tensor:
    """query_pos [T], pool_pos [R] -> [T, swa_index_width(window)] pool rows with pos in (q - window, q], -1 pad."""
    ok = (pool_pos.unsqueeze(0) <= query_pos.unsqueeze(1)) & (pool_pos.unsqueeze(0) > query_pos.unsqueeze(1) - window)
    rows = torch.where(ok, torch.arange(pool_pos.numel(), device=pool_pos.device), -1)  # [T, R]
    width = swa_index_width(window)
    rows = rows.sort(dim=1, descending=True).values[:, :width]  # valid rows first (at most `window` of them)
    return F.pad(rows, (0, width - rows.shape[1]), value=-1)


def ragged_attend(pools: list[tuple[torch.Tensor, torch.Tensor]], spans: list[tuple[int, int]], window: int,
                  new_kv: dict):
    """The `attend` of `MTPDraftModel.forward_rows` for training: row i of sequence r attends (sliding window,
    causally) to the sequence's `pools[r]` rows (K=V [R, D], positions [R]) and its own rows of this step.
    Plain autograd-friendly tensors instead of the engine's paged pools; this step's K=V go to `new_kv["kv"]`."""

    def attend(a, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, _ = a.project_q(h, positions)
        kv = new_kv["kv"] = a.project_kv(h, positions)  # [T, D]
        all_kv, index_rows, offset = [], [], 0
        for (pool_kv, pool_pos), (s, e) in zip(pools, spans):
            pk = torch.cat([pool_kv.to(kv.dtype), kv[s:e]])
            idx = causal_window_indices(positions[s:e], torch.cat([pool_pos, positions[s:e]]), window)
            index_rows.append(torch.where(idx >= 0, idx + offset, idx))
            all_kv.append(pk)
            offset += pk.shape[0]
        o = ops.sparse_attention(q, torch.cat(all_kv), torch.cat(index_rows), a.attn_sink, a.scale)
        return a.project_out(o, positions)

    return attend


def mtp_loss(model: MTPDraftModel, target, feats: TargetFeatures, seqs: Sequences, seq_ids: list[int],
             dev: torch.device, unroll: int = 2) -> dict[str, torch.Tensor]:
    rows, positions, next_ids, labels, trow, mask, spans = [], [], [], [], [], [], []
    off = 0
    for s in seq_ids:
        lo, hi = seqs.span(s)
        n, p = hi - lo, int(seqs.prompt_lens[s])
        i = torch.arange(n - 1)  # rows 0..n-2 (each needs x[i+1])
        rows.append(lo + i)
        positions.append(i)
        next_ids.append(seqs.ids[lo + 1 : hi])
        lab = torch.full((n - 1,), -1, dtype=torch.long)
        lab[: n - 2] = seqs.ids[lo + 2 : hi]
        labels.append(lab)
        trow.append(lo + (i + 1).clamp(max=n - 1))
        mask.append((i + 2 < n) & (i + 2 >= p))  # supervise answer tokens only
        spans.append((off, off + n - 1))
        off += n - 1
    rows, positions, next_ids = torch.cat(rows).to(dev), torch.cat(positions).to(dev), torch.cat(next_ids).to(dev)
    labels, trow, mask = torch.cat(labels).to(dev), torch.cat(trow).to(dev), torch.cat(mask).to(dev)
    with torch.no_grad():
        p_t = torch.softmax(target.logits_from_hidden(feats.hidden[trow]).float(), dim=-1)
    D = target.cfg.head_dim
    empty = [(torch.zeros(0, D, device=dev), torch.zeros(0, dtype=torch.long, device=dev)) for _ in spans]
    prev = feats.streams[rows].float()
    totals = {"ce": 0.0, "l1": 0.0, "accept": 0.0}
    wsum = 0.0
    pools = empty
    for j in range(unroll):
        new_kv: dict = {}
        out = model.forward_rows(j, target.embed, prev, next_ids, positions,
                                 ragged_attend(pools, spans, model.window, new_kv))
        kv = new_kv["kv"]
        logp = torch.log_softmax(model.logits(j, out, target.norm, target.head).float(), dim=-1)
        m = mask.float()
        denom = m.sum().clamp(min=1)
        l1 = ((logp.exp() - p_t).abs().sum(-1) * m).sum() / denom
        ce = (-logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * m).sum() / denom
        w = math.exp(-j / LOSS_DECAY)
        totals["ce"] = totals["ce"] + w * ce
        totals["l1"] = totals["l1"] + w * l1
        totals["accept"] = totals["accept"] + w * (1 - 0.5 * l1.detach())
        wsum += w
        # next step: row i reads this step's output at row i-1 (zeros at each sequence's first row) and the
        # K=V rows of positions < i (shifted by one so the causal window stops at i-1)
        prev = torch.cat([torch.cat([torch.zeros_like(out[s : s + 1]), out[s : e - 1]]) for s, e in spans])
        pools = [(kv[s:e], positions[s:e] + 1) for s, e in spans]
    terms = {k: v / wsum for k, v in totals.items()}
    terms["loss"] = ALPHA_CE * terms["ce"] + ALPHA_L1 * terms["l1"]
    return terms


def train_mtp(model_dir: Path, data: Path, out_dir: Path, steps: int, minutes: float | None = None,
              batch_size: int = 16, max_len: int = 640, lr: float = 1e-3, seed: int = 0, device: str | None = None,
              save_every: int = 500, unroll: int = 2, compile: bool | None = None) -> dict:
    from sparkspec.train.features import compute_features, load_frozen_target, load_sequences, save_drafter

    dev = common.pick_device(device)
    common.use_native_ops(compile=dev.type != "cpu" if compile is None else compile)
    gen = common.seed_everything(seed)
    ck = load_frozen_target(Path(model_dir), dev)
    cfg, target = ck.config, ck.model
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError("config field 'num_nextn_predict_layers' = 0: the checkpoint declares no MTP layer")
    seqs = load_sequences(Path(data), max_len)
    feats = compute_features(target, seqs, (), with_streams=True)
    model = init_mtp(cfg, seed).to(dev).train()
    opt = common.adamw(model.parameters(), lr)
    loop = common.TrainLoop("mtp", model, opt, lr, steps, minutes, dev, Path(out_dir) / "mtp_state", save_every)
    batches = common.epoch_batches(seqs.num_seqs, batch_size, gen)
    loop.run(lambda: mtp_loss(model, target, feats, seqs, next(batches), dev, unroll))
    step, log = loop.step, loop.log
    first = mtp_first_stage(cfg)
    stages = [f"mtp.{first + j}." for j in range(model.num_layers)]
    save_drafter(Path(model_dir), Path(out_dir), ck, model.state_dict(), stages)
    (Path(out_dir) / "mtp_state" / common.STATE_FILE).unlink(missing_ok=True)
    meta = {"steps": step, "time_s": round(loop.budget.elapsed, 1), "sequences": seqs.num_seqs, "unroll": unroll,
            "batch_size": batch_size, "lr": lr,
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 3)}
    log.write(Path(out_dir) / "train_log_mtp.json", **meta)
    return {**log.summary(), **meta}

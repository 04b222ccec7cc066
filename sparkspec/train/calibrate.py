"""`sparkspec train calibrate`: calibration of the DSpark confidence head: per-position isotonic maps from one
block feature to the prefix survival (shipped), with Sequential Temperature Scaling (STS, DSpark paper §3.2.1)
and its Platt variant measured beside them.

Terms: for a drafted block, z_k is the confidence logit of position k (1-based) and the prefix label
y_k = 1[drafts 1..k all accepted]. The deployed prefix-survival estimate is a_k = Π_{i≤k} σ(z_i / T_i).
STS fits T_1..T_k left to right: T_k = argmin over a log grid of ECE(Π_{i<k} σ(z_i/T_i) · σ(z_k/τ), y_k),
earlier temperatures frozen. Temperature scaling keeps the ranking; it only fixes the absolute level. Acceptances
within a block are strongly correlated (a block that locks onto the target accepts everything), which a product
of per-position scalings cannot express: the shipped survival maps instead send one feature of the whole block (the
geometric mean of its raw confidences) through a monotone (isotonic) map per position k fitted to y_k, so every
position's survival is calibrated directly (`models.dspark.survival_confidences`).

Rollouts: held-out sequences the target regenerated GREEDILY. At temperature 0 the target accepts draft x_k
iff it equals the target's own greedy token, which is the sequence's next token while every earlier draft
matched, so a draft-then-verify rollout from any answer position needs no extra target forward: the drafter
runs exactly as at inference (Markov head fed its own drafts), and y_k = 1[d_1..d_k = x*_{a+1..a+k}].
Fit on one half of the sequences, report ECE before/after on the other half.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from sparkspec.models.dspark import context_rows
from sparkspec.train import common

NUM_BINS = 20


def ece(pred: torch.Tensor, label: torch.Tensor, num_bins: int = NUM_BINS) -> float:
    """Expected calibration error over equal-width bins: Σ_b (n_b/N)·|mean pred_b − mean label_b|."""
    if pred.numel() == 0:
        return 0.0
    pred, label = pred.double().flatten(), label.double().flatten()
    b = (pred * num_bins).long().clamp(0, num_bins - 1)
    sp = torch.bincount(b, weights=pred, minlength=num_bins)
    sl = torch.bincount(b, weights=label, minlength=num_bins)
    return float(((sp - sl).abs()).sum() / pred.numel())


def temperature_grid(lo: float = 0.1, hi: float = 10.0, num: int = 200) -> torch.Tensor:
    return torch.logspace(torch.log10(torch.tensor(lo)), torch.log10(torch.tensor(hi)), num)


def prefix_survival(z: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """z [N, k] confidence logits, temps [k] -> a [N, k] = cumprod σ(z_i / T_i)."""
    return torch.sigmoid(z / temps).cumprod(dim=1)


def fit_sts(z: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, grid: torch.Tensor | None = None,
            bias_grid: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sequential temperature scaling. z, y [N, k]; valid [N, k] bool (block reached position k) -> temps [k].

    With `bias_grid`, each position also gets an additive logit offset searched jointly with its temperature
    (sequential Platt scaling, still order-preserving within a position) -> (temps [k], biases [k])."""
    grid = temperature_grid() if grid is None else grid
    biases_to_try = [0.0] if bias_grid is None else bias_grid.tolist()
    k = z.shape[1]
    temps, biases = torch.ones(k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64)
    z = z.double()
    for j in range(k):
        rows = valid[:, j]
        if not rows.any():
            continue
        before = torch.sigmoid(z[rows, :j] / temps[:j] + biases[:j]).prod(dim=1) if j else \
            torch.ones(int(rows.sum()), dtype=torch.float64)
        best = (float("inf"), 1.0, 0.0)
        for b in biases_to_try:
            for t in grid.tolist():
                e = ece(before * torch.sigmoid(z[rows, j] / t + b), y[rows, j])
                if e < best[0]:
                    best = (e, t, b)
        temps[j], biases[j] = best[1], best[2]
    return temps.float() if bias_grid is None else (temps.float(), biases.float())


MAP_KNOTS = 41  # values of each position's survival map, at block features 0, 1/40, ..., 1


def isotonic(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares non-decreasing fit of y on x (pool adjacent violators) -> (block mean x, block mean y), both
    non-decreasing: the fitted step function, for `np.interp`."""
    order = np.argsort(x, kind="stable")
    means: list[float] = []
    counts: list[int] = []
    xsum: list[float] = []
    for xi, yi in zip(x[order].tolist(), y[order].tolist()):
        means.append(yi)
        counts.append(1)
        xsum.append(xi)
        while len(means) > 1 and means[-2] > means[-1]:
            n = counts[-2] + counts[-1]
            means[-2:] = [(means[-2] * counts[-2] + means[-1] * counts[-1]) / n]
            xsum[-2:], counts[-2:] = [xsum[-2] + xsum[-1]], [n]
    return np.asarray(xsum) / np.asarray(counts), np.asarray(means)


def fit_survival_map(z: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, knots: int = MAP_KNOTS) -> torch.Tensor:
    """Per position k, the isotonic map from the block feature f (`models.dspark.block_feature`) to the prefix
    label y_k, sampled at `knots` evenly spaced f and made non-increasing in k -> [k, knots]
    (`models.dspark.survival_confidences` applies it)."""
    from sparkspec.models.dspark import block_feature

    f = block_feature(z).double().numpy()
    grid = np.linspace(0.0, 1.0, knots)
    table = np.ones((z.shape[1], knots))
    for j in range(z.shape[1]):
        rows = valid[:, j].numpy()
        if rows.any():
            xs, ys = isotonic(f[rows], y[rows, j].double().numpy())
            table[j] = np.interp(grid, xs, ys)
        elif j:
            table[j] = table[j - 1]
    return torch.from_numpy(np.minimum.accumulate(table, axis=0)).float()


def ece_survival_map(z: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, table: torch.Tensor) -> list[float]:
    """ECE per position of the prefix survival the engine computes from the mapped conditional confidences."""
    from sparkspec.models.dspark import survival_confidences

    a = survival_confidences(z, table).double().cumprod(dim=1)  # what the engine's budget multiplies
    return [round(ece(a[valid[:, j], j], y[valid[:, j], j]), 5) for j in range(z.shape[1])]


def ece_per_position(z: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, temps: torch.Tensor,
                     biases: torch.Tensor | None = None) -> list[float]:
    a = prefix_survival(z.double() + (0 if biases is None else biases.double() * temps.double()), temps.double())
    return [round(ece(a[valid[:, j], j], y[valid[:, j], j]), 5) for j in range(z.shape[1])]


@torch.no_grad()
def greedy_rollouts(drafter, target, feats, seqs, seq_ids: list[int], anchors: int, gen: torch.Generator,
                    dev: torch.device, chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drafts from random answer anchors of greedy sequences -> (z [N, k], y [N, k], valid [N, k])."""
    from sparkspec.train.dspark import sample_blocks

    cfg = drafter.cfg
    k = cfg.dspark_block_size
    zs, ys, vs = [], [], []
    for c in range(0, len(seq_ids), chunk):
        bb = sample_blocks(seqs, seq_ids[c : c + chunk], k, anchors, cfg.dspark_noise_token_id, gen)
        taps = feats.taps[bb.seq_rows.to(dev)]
        ctx_kv = drafter.context_kv(drafter.main_x(taps), bb.ctx_positions.to(dev))
        out = drafter.forward_block(target.embed, target.head, bb.block_ids.to(dev), bb.start_positions.to(dev),
                                    ctx_kv, context_rows(bb.ctx_ranges.to(dev), drafter.window))
        prev = bb.block_ids[:, 0].to(dev)
        labels = bb.labels.to(dev)
        z, hit = [], []
        for i in range(k):
            d = drafter.markov_logits(out.base_logits[:, i], prev).argmax(-1)
            z.append(drafter.confidence_logits(out.hidden[:, i], prev))
            hit.append(d == labels[:, i])
            prev = d
        zs.append(torch.stack(z, 1).float().cpu())
        ys.append(torch.stack(hit, 1).long().cumprod(1).float().cpu())
        vs.append(bb.mask)
    return torch.cat(zs), torch.cat(ys), torch.cat(vs)


def calibrate_checkpoint(model_dir: Path, data: Path, anchors: int = 32, max_seqs: int = 256, max_len: int = 640,
                         temperature: float = 0.0, seed: int = 0, device: str | None = None) -> dict:
    """Fit the calibrations on half of the held-out greedy sequences, report ECE per position on the other half,
    and store them in the checkpoint plus `calibration.json`: `mtp.{last}.confidence_head.survival_map` [k, K]
    (per-position isotonic maps of the block feature to the prefix survival: what inference applies), and, for
    comparison, `.temperature` [k] (STS: c_k = σ(z_k / T_k)) and `.platt_temperature` / `.platt_bias` [k]
    (c_k = σ(z_k / T_k + b_k))."""
    from sparkspec.loading.drafters import dspark_from_tensors
    from sparkspec.train.features import compute_features, load_frozen_target, load_sequences, save_drafter

    if temperature != 0.0:
        raise ValueError(f"--temperature {temperature}: only greedy (0) rollouts are supported offline")
    dev = common.pick_device(device)
    gen = common.seed_everything(seed)
    model_dir = Path(model_dir)
    ck = load_frozen_target(model_dir, dev)
    cfg, target = ck.config, ck.model
    drafter = dspark_from_tensors(cfg, ck.drafter_tensors)
    if not drafter.has_confidence:
        raise ValueError(f"{model_dir}: the DSpark drafter has no confidence head to calibrate")
    p = next(target.parameters())
    drafter = drafter.to(device=p.device, dtype=p.dtype).keep_fp32().eval()
    seqs = load_sequences(Path(data), max_len, temperature=0.0)
    ids = torch.randperm(seqs.num_seqs, generator=gen)[:max_seqs].tolist()
    feats = compute_features(target, seqs, tuple(cfg.dspark_target_layer_ids))
    fit_ids, test_ids = ids[0::2], ids[1::2]
    z_fit, y_fit, v_fit = greedy_rollouts(drafter, target, feats, seqs, fit_ids, anchors, gen, dev)
    z_test, y_test, v_test = greedy_rollouts(drafter, target, feats, seqs, test_ids, anchors, gen, dev)
    temps = fit_sts(z_fit, y_fit, v_fit)
    platt_t, platt_b = fit_sts(z_fit, y_fit, v_fit, temperature_grid(0.1, 10.0, 60), torch.linspace(-3, 3, 61))
    survival_map = fit_survival_map(z_fit, y_fit, v_fit)
    ones = torch.ones_like(temps)
    k = cfg.dspark_block_size
    report = {
        "rollouts": "greedy (T=0), held-out regenerated sequences, random answer anchors",
        "fit_blocks": int(z_fit.shape[0]), "test_blocks": int(z_test.shape[0]),
        "temperatures": [round(float(t), 4) for t in temps],
        "ece_before": ece_per_position(z_test, y_test, v_test, ones),
        "ece_after": ece_per_position(z_test, y_test, v_test, temps),
        "platt_temperatures": [round(float(t), 4) for t in platt_t],
        "platt_biases": [round(float(b), 4) for b in platt_b],
        "ece_after_platt": ece_per_position(z_test, y_test, v_test, platt_t, platt_b),
        "ece_after_survival_map": ece_survival_map(z_test, y_test, v_test, survival_map),
        "shipped": "survival_map",
        "mean_pred_before": [round(float(x), 4) for x in
                             (prefix_survival(z_test.double(), ones.double()) * v_test).sum(0) / v_test.sum(0)],
        "mean_label": [round(float(x), 4) for x in (y_test * v_test).sum(0) / v_test.sum(0)],
        "tau_greedy_offline": round(float(1 + (y_test * v_test).sum() / max(int(v_test[:, 0].sum()), 1)), 4),
    }
    name = f"mtp.{drafter.num_layers - 1}.confidence_head"
    tensors = {**{k_: v for k_, v in ck.drafter_tensors.items()}, f"{name}.temperature": temps.float(),
               f"{name}.platt_temperature": platt_t.float(), f"{name}.platt_bias": platt_b.float(),
               f"{name}.survival_map": survival_map}
    ck.drafter_tensors = {}
    save_drafter(model_dir, model_dir, ck, tensors, ())
    (model_dir / "calibration.json").write_text(json.dumps(report, indent=1) + "\n")
    assert len(report["temperatures"]) == k
    return report

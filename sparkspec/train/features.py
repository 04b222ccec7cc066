"""Distillation data: target-regenerated sequences and the target's features over them.

The target runs once over every training sequence at the start of a drafter run (inference mode, the same
dtype the engine serves it in) and its tapped layer outputs, final hidden state and, for MTP, final residual
streams stay in device memory; target logits are re-derived from the hidden state with the shared norm +
head only at the rows a loss needs (the paper's "hidden-state communication" trick, §5.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sparkspec.models.deepseek_v4 import DeepseekV4Model
from sparkspec.models.forward_batch import forward_sequences


@dataclass
class Sequences:
    """Token sequences (prompt + regenerated answer) packed flat; answer tokens carry the loss."""

    ids: torch.Tensor  # [N] int64, all sequences concatenated
    cu_lens: torch.Tensor  # [S+1] int64 row offsets
    prompt_lens: torch.Tensor  # [S] int64
    temperatures: torch.Tensor  # [S] fp32 temperature each answer was sampled at

    @property
    def num_seqs(self) -> int:
        return self.prompt_lens.numel()

    def span(self, s: int) -> tuple[int, int]:
        return int(self.cu_lens[s]), int(self.cu_lens[s + 1])


def load_sequences(path: Path, max_len: int, min_answer: int = 8, temperature: float | None = None) -> Sequences:
    """Regenerated JSONL rows -> Sequences (prompt + answer truncated to max_len; short answers dropped)."""
    from sparkspec.train.data import read_jsonl

    ids, lens, plens, temps = [], [], [], []
    for r in read_jsonl(path):
        if temperature is not None and float(r.get("temperature", 0)) != temperature:
            continue
        p, a = r["prompt_token_ids"], r["output_token_ids"]
        seq = (p + a)[:max_len]
        if len(seq) - len(p) < min_answer:
            continue
        ids.extend(seq)
        lens.append(len(seq))
        plens.append(len(p))
        temps.append(float(r.get("temperature", 0.0)))
    if not lens:
        raise ValueError(f"{path}: no sequence with at least {min_answer} answer tokens within max_len={max_len}")
    cu = torch.zeros(len(lens) + 1, dtype=torch.long)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return Sequences(torch.tensor(ids), cu, torch.tensor(plens), torch.tensor(temps))


@dataclass
class TargetFeatures:
    taps: torch.Tensor | None  # [N, m, H] mean-over-hc outputs of the tapped layers (device, model dtype)
    hidden: torch.Tensor  # [N, H] hc_head output (pre-norm)
    streams: torch.Tensor | None = None  # [N, n·H] final residual streams (MTP input)


@torch.inference_mode()
def compute_features(target: DeepseekV4Model, seqs: Sequences, tap_layers: tuple[int, ...],
                     with_streams: bool = False, max_batch_tokens: int = 32768) -> TargetFeatures:
    dev = next(target.parameters()).device
    ids_all = seqs.ids.to(dev)
    taps, hidden, streams = [], [], []
    s = 0
    while s < seqs.num_seqs:
        group, total = [], 0
        while s < seqs.num_seqs and (not group or total + seqs.span(s)[1] - seqs.span(s)[0] <= max_batch_tokens):
            group.append(seqs.span(s))
            total += group[-1][1] - group[-1][0]
            s += 1
        lo, hi = group[0][0], group[-1][1]
        out = forward_sequences(target, ids_all[lo:hi], [b - a for a, b in group], logits_rows=[0],
                                tap_layers=tap_layers, capture_final_streams=with_streams)
        dtype = next(target.parameters()).dtype
        if tap_layers:
            taps.append(out.taps.to(dtype))
        hidden.append(out.hidden.to(dtype))
        if with_streams:
            streams.append(out.final_streams.to(dtype))
    return TargetFeatures(torch.cat(taps) if taps else None, torch.cat(hidden),
                          torch.cat(streams) if with_streams else None)


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def load_frozen_target(model_dir: Path, device: torch.device):
    """The target as the engine serves it (bf16 on accelerators, fp32 on CPU), frozen."""
    from sparkspec.loading.checkpoint import load_checkpoint

    ck = load_checkpoint(model_dir, device=device)
    freeze(ck.model)
    return ck


def save_drafter(model_dir: Path, out_dir: Path, ck, new_tensors: dict[str, torch.Tensor], replace_prefixes,
                 shard_mb: int = 14) -> Path:
    """Rewrite the checkpoint with `new_tensors` replacing every existing drafter tensor whose stage is in
    `replace_prefixes` (e.g. ("mtp.0.", "mtp.1.")); the other drafter's tensors are kept."""
    from sparkspec.loading.save import write_checkpoint

    kept = {k: v for k, v in ck.drafter_tensors.items() if not k.startswith(tuple(replace_prefixes))}
    clash = sorted(set(kept) & set(new_tensors))
    if clash:
        raise ValueError(f"drafter tensor '{clash[0]}' written twice")
    extra = {**kept, **{k: v.detach().float().cpu() for k, v in new_tensors.items()}}
    state = {k: v for k, v in ck.model.state_dict().items()}
    dtype = "bfloat16" if ck.config.torch_dtype == "bfloat16" else "float32"
    tok = model_dir if (model_dir / "tokenizer.json").is_file() else None
    return write_checkpoint(state, ck.config, out_dir, tokenizer_dir=tok, extra_tensors=extra,
                            shard_size_bytes=shard_mb << 20, dtype=dtype)

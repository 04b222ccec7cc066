"""Replayed acceptance: DSpark's τ under the Gumbel-max scheme (any proposal rule) and under rejection sampling, on
the SAME target sequences, without running speculative decoding. Legend: A anchors, k drafts, V vocabulary.

Why it is exact (the engine's τ to the third decimal on the demo pair):
* Gumbel-max rows are drafter-invariant (`rejection.py`): every speculative run of a seeded request emits plain
  decoding's sequence x. A verify step pending at position a (anchor) drafts from the DSpark block at a with the
  Markov head fed the accepted prefix, which is x itself: the teacher-forced block (`train.dspark.block_forward`)
  at every anchor gives every step the engine could take. The engine's steps are the chain a0 = prompt length,
  a <- a + L(a) + 1, L(a) the leading drafts equal to x.
* Rejection sampling emits a target sample too, and given it, slot i (prefix accepted) was an accepted draft with
  chance min(p(x_i), q(x_i)) / p(x_i) = min(1, q(x_i) / p(x_i)), with fresh randomness per slot. Simulating those
  acceptances on the Gumbel run's sequences gives rejection's τ paired with Gumbel's: the sequences' own sampling
  noise, most of the noise of two independent runs (±4 % in τ for 20 prompts x 128 tokens), cancels in the ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkspec.ops.sampling import (
    DEFAULT_GUMBEL_DRAFT_TEMPERATURE,
    STREAM_DRAFT,
    SamplingTensors,
    probs_for,
    sample_draft,
)


@dataclass
class ReplayBlocks:
    """One sequence's teacher-forced DSpark blocks at every anchor a = prompt length .. n - 2."""

    anchors: torch.Tensor  # [A] int64 position of each block's pending token
    labels: torch.Tensor  # [A, k] int64 x[a + 1 + i], -1 past the end
    draft_logits: torch.Tensor  # [A, k, V] fp32 the Markov head's logits with the true predecessors
    target_logits: torch.Tensor  # [A, k, V] fp32 the target's logits at row a + i (its token x[a + 1 + i])

    @property
    def mask(self) -> torch.Tensor:  # [A, k] bool
        return self.labels >= 0


@torch.inference_mode()
def dspark_blocks(target, drafter, ids: list[int], prompt_len: int) -> ReplayBlocks:
    """The blocks of one sequence (prompt + answer ids) for `drafter` (a `DSparkDraftModel` on the target's
    device)."""
    from sparkspec.train.dspark import block_forward, sample_blocks
    from sparkspec.train.features import Sequences, compute_features

    seqs = Sequences(torch.tensor(ids), torch.tensor([0, len(ids)]), torch.tensor([prompt_len]), torch.zeros(1))
    feats = compute_features(target, seqs, tuple(target.cfg.dspark_target_layer_ids))
    anchors = len(ids)  # every answer position (sample_blocks keeps them sorted)
    bb = sample_blocks(seqs, [0], drafter.block_size, anchors, drafter.noise_token_id, torch.Generator())
    out, target_logits = block_forward(drafter, target, feats, bb, next(target.parameters()).device)
    return ReplayBlocks(bb.start_positions, torch.where(bb.mask, bb.labels, -1),
                        out.markov_logits.float().cpu(), target_logits.float().cpu())


def engine_room(b: ReplayBlocks, k: int, cut_by_max_tokens: bool) -> torch.Tensor:
    """Drafts the engine verifies at each anchor -> [A]: k, but a request stopped by max_tokens drafts no more than
    it may still emit minus the bonus (the scheduler's `lookahead_for`), i.e. n - 2 - a for n tokens in all. A
    request stopped by EOS needs no cap: its drafts past the EOS are never accepted (the labels end there)."""
    if not cut_by_max_tokens:
        return torch.full_like(b.anchors, k)
    n = int(b.anchors[-1]) + 2  # the last anchor is n - 2
    return (n - 2 - b.anchors).clamp(0, k)


def chain(lengths: torch.Tensor, room: torch.Tensor) -> tuple[int, int]:
    """Accepted lengths L [A] at every anchor, drafts verified there [A] -> (accepted drafts, verify steps) of the
    engine's chain a0 = first anchor, a <- a + min(L, room) + 1; a step without drafts is a plain decode, not a
    verify step (SpecMetrics' τ = (accepted + steps) / steps)."""
    L, R = lengths.tolist(), room.tolist()
    a, accepted, steps = 0, 0, 0
    while a < len(L):
        n = min(L[a], R[a])
        accepted, steps, a = accepted + n, steps + (R[a] > 0), a + n + 1
    return accepted, steps


def gumbel_lengths(b: ReplayBlocks, st: SamplingTensors,
                   draft_temperature: float = DEFAULT_GUMBEL_DRAFT_TEMPERATURE) -> torch.Tensor:
    """L [A] under the Gumbel-max scheme: the drafts `sample_draft` gives Gumbel rows (the engine's own code, with
    the noise of each draft's position), accepted while equal to x. `st`: the request's one row, gumbel True."""
    A, k, V = b.draft_logits.shape
    offsets = (b.anchors.unsqueeze(1) + 1 + torch.arange(k)).reshape(-1)  # [A·k] each draft's position
    d, _ = sample_draft(b.draft_logits.reshape(-1, V), st.repeat_interleave(A * k), offsets, STREAM_DRAFT,
                        draft_temperature)
    return ((d.view(A, k) == b.labels) & b.mask).long().cumprod(1).sum(1)


def rejection_lengths(b: ReplayBlocks, st: SamplingTensors, reps: int, gen: torch.Generator) -> torch.Tensor:
    """L [reps, A] under rejection sampling, simulated given the sequence (see the module docstring)."""
    A, k, V = b.draft_logits.shape
    x = b.labels.clamp(min=0).reshape(-1, 1)
    rows = st.repeat_interleave(A * k)
    p = probs_for(b.target_logits.reshape(-1, V), rows).gather(1, x)  # [A·k, 1]
    q = probs_for(b.draft_logits.reshape(-1, V), rows).gather(1, x)
    r = torch.where(p > 0, torch.minimum(q / p.clamp(min=1e-30), torch.ones_like(p)), 0.0).view(A, k) * b.mask
    return (torch.rand(reps, A, k, generator=gen) < r).long().cumprod(2).sum(2)

"""Lossless verification of drafts: speculative (rejection) sampling, Leviathan et al., arXiv 2211.17192
(also Chen et al., arXiv 2302.01318), batched over requests and draft positions with no host sync.
Legend: R requests, K draft columns (request r uses the first n_r = num_drafts[r]), V vocabulary.

The target scores `[b, d_0, .., d_{n-1}]` in one forward; its row i gives p_i, the target's distribution for
the token after d_{i-1} (after b for i = 0), processed with the request's temperature / top-k / top-p.
q_i is the exact distribution d_i was drawn from (one-hot on d_i when the drafter gives none).

Terms:
* **accepted** — the longest prefix d_0..d_{L-1} that passes: greedy requests (temperature 0) accept d_i
  while d_i == argmax p_i; sampled requests accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), i.e.
  when u_i * q_i(d_i) < p_i(d_i) for a uniform u_i.
* **recovered** — at the first rejected position L < n, the emitted token: the target argmax (greedy), or a
  draw from the residual normalise(max(p_L - q_L, 0)) (sampled; p_L itself if the residual has no mass).
* **bonus** — when all n drafts are accepted (L = n), one more token from row n: argmax p_n or a draw
  from p_n. A request with n = 0 is a plain decode row: its only token is the bonus.

Each step emits L + 1 tokens whose joint distribution equals sampling the target token by token, for ANY
drafter, as long as q is exact (Leviathan et al., Theorem 1).

Randomness: the token at absolute position t uses the counter RNG at offset t only — u_i from
STREAM_ACCEPT, recovered draws from STREAM_RESIDUAL, bonus draws from STREAM_TARGET (so a 0-draft row gives
exactly `sample(probs_for(logits, st), st.seeds, positions, STREAM_TARGET)`, the argmax when greedy). Numbers at
offsets past the emitted token were computed but did not influence the output, so reusing them in the next step
keeps every position's randomness fresh; and a seeded request's tokens do not depend on the rest of the batch.

Drafter-invariant scheme (Daliri, Musco, Suresh, "Coupling without communication and drafter-invariant
speculative decoding", arXiv 2408.07978), for rows with `st.gumbel`: the target's token at position t is the
Gumbel-max draw g_t = argmax_v(log p_t(v) + G(seed, t, v)) (`sampling.gumbel_sample`; G from STREAM_GUMBEL
only, keyed by the seed and t), and a drafter draws d_t = argmax_v(log q_t(v) + G(seed, t, v)) with the same
noise. Verification accepts d_i iff d_i == g_i (given the accepted prefix, row i is that prefix's p), and
emits g_L at L. So the emitted tokens are g_0, g_1, .. of plain decoding with the same seed, token for token,
whatever the drafter, k, the budget or the batch (given the same logits); q is never read (any draft is
lossless), and each token ~ p by the Gumbel-max property. A draft is accepted with probability
Pr[argmax(log p + G) = argmax(log q + G)] >= (1 - TV(p, q)) / (1 + TV(p, q)), against 1 - TV for rejection
sampling. Greedy rows are argmax verification in both schemes.

Non-finite rows (`sampling.is_finite_dist`: NaN / inf logits, e.g. a numerically broken model): a draft is
never accepted at a row whose p is not finite, so L stops at the first such row, and the request is flagged
(`verify`'s is_finite) exactly when the token it emits at L would come from one. That is the row plain
decoding would have sampled from: the flag does not depend on the drafts. Rows past L (rejected drafts'
contexts) are never looked at. Every emitted id is in [0, V) even then; the engine fails the flagged request
alone and commits the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkspec.ops.rng import uniform_at
from sparkspec.ops.sampling import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    STREAM_TARGET,
    SamplingTensors,
    gumbel_sample,
    inverse_cdf,
    is_finite_dist,
    probs_for,
)


@dataclass
class IndexedDraftProbs:
    """The q of every request's drafts, read where the sampler needs it, never copied out as a dense [R, K, V]:
    request r's drafts have q = `store[rows[r]]` (the device drafter's exact q of its last proposal), or, where
    rows[r] < 0 (greedy drafts, host drafters such as n-gram), q one-hot on the drafts (q(d) = 1).
    Rejection sampling reads q at the drafted tokens ([R, K]) and the rejected draft's whole row ([R, V]) only."""

    store: torch.Tensor  # [N, k, V] fp32, k >= K
    rows: torch.Tensor  # [R] int64, -1 = one-hot

    def at_drafts(self, d: torch.Tensor) -> torch.Tensor:
        """q_i(d_i) -> [R, K] (1 on one-hot rows). d: [R, K] ids, clamped to [0, V)."""
        R, K = d.shape
        has = self.rows >= 0
        q = self.store[self.rows.clamp(min=0).unsqueeze(1), torch.arange(K, device=d.device).unsqueeze(0), d]
        return torch.where(has.unsqueeze(1), q, 1.0)

    def residual(self, p_L: torch.Tensor, at: torch.Tensor, d_at: torch.Tensor) -> torch.Tensor:
        """max(p_L - q_at, 0) -> [R, V]: q_at = store[rows, at], or one-hot on d_at (p_L without d_at)."""
        has = self.rows >= 0
        dense = (p_L - self.store[self.rows.clamp(min=0), at]).clamp(min=0)
        one_hot = p_L.scatter(1, d_at.unsqueeze(1), 0.0)
        return torch.where(has.unsqueeze(1), dense, one_hot)


class RejectionSampler:
    """Verification of every request's drafts in one call, by the scheme each row's `SamplingTensors.gumbel`
    names (rejection sampling or the drafter-invariant Gumbel-max scheme; see the module docstring)."""

    def __call__(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """`verify` without the finiteness flag -> (output_ids [R, K+1], num_accepted [R])."""
        out, L, _ = self.verify(*args, **kwargs)
        return out, L

    def verify(
        self,
        target_logits: torch.Tensor,  # [R, K+1, V] fp32
        draft_ids: torch.Tensor,  # [R, K] int64, -1 padded: request r's drafts in columns 0..n_r-1
        draft_probs: torch.Tensor | IndexedDraftProbs | None,  # [R, K, V] fp32 q_i, or indexed rows of the
        # drafter's q store; None: one-hot drafts (deterministic drafter); never read on Gumbel rows
        st: SamplingTensors,  # R requests
        positions: torch.Tensor,  # [R] int64: absolute position of the first verified token (where d_0 sits)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (output_ids [R, K+1] int64: d_0..d_{L-1} then the recovered / bonus token, -1 after;
        num_accepted [R] int64 = L; is_finite [R] bool: False when row L's distribution is not finite, whose
        request must fail: its ids are in range but meaningless)."""
        R, K1, V = target_logits.shape
        K = K1 - 1
        dev = target_logits.device
        cols = torch.arange(K1, device=dev)  # [K+1]
        n = (draft_ids >= 0).sum(1)  # [R] number of drafts
        d = draft_ids.clamp(min=0)  # [R, K]
        argmax = target_logits.argmax(-1)  # [R, K+1]
        rows = torch.arange(R, device=dev)

        if st.all_greedy:
            is_finite = is_finite_dist(target_logits)  # [R, K+1]
            accept = d == argmax[:, :K]
        elif st.all_gumbel:  # g_i: the target's own Gumbel-max token at each verified position
            g, ok = gumbel_sample(target_logits.reshape(R * K1, V), st.repeat_interleave(K1),
                                  (positions.unsqueeze(1) + cols).reshape(-1))
            g, is_finite = g.view(R, K1), ok.view(R, K1)
            accept = d == g[:, :K]
        else:
            p = probs_for(target_logits.reshape(R * K1, V), st.repeat_interleave(K1)).view(R, K1, V)
            is_finite = is_finite_dist(target_logits, p)  # [R, K+1]
            p_d = p[:, :K].gather(2, d.unsqueeze(2)).squeeze(2)  # [R, K]
            if isinstance(draft_probs, IndexedDraftProbs):
                q_d = draft_probs.at_drafts(d)  # [R, K]
            else:
                q_d = draft_probs.gather(2, d.unsqueeze(2)).squeeze(2) if draft_probs is not None else 1.0
            # one RNG call for every stream at every verified position: u[stream, r, i] at offset positions[r] + i
            streams = torch.arange(max(STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_TARGET) + 1, device=dev)
            u = uniform_at(st.seeds.view(1, R, 1), positions.view(1, R, 1) + cols, streams.view(-1, 1, 1), 0,
                           torch.float64)  # [streams, R, K+1]
            accept = torch.where(st.greedy.unsqueeze(1), d == argmax[:, :K], u[STREAM_ACCEPT, :, :K] * q_d < p_d)
            if st.any_gumbel:  # per-request scheme: both computed, each row takes its own
                g = gumbel_sample(target_logits.reshape(R * K1, V), st.repeat_interleave(K1),
                                  (positions.unsqueeze(1) + cols).reshape(-1))[0].view(R, K1)
                accept = torch.where(st.gumbel.unsqueeze(1), d == g[:, :K], accept)
        accept &= (cols[:K] < n.unsqueeze(1)) & is_finite[:, :K]
        L = accept.long().cumprod(1).sum(1)  # [R] leading accepts
        token = argmax[rows, L]  # [R] greedy: recovered and bonus are both argmax p_L

        if st.all_greedy:
            pass
        elif st.all_gumbel:
            token = g[rows, L]  # greedy rows' g is the argmax
        else:
            p_L = p[rows, L]  # [R, V]
            at = L.clamp(max=max(K - 1, 0))  # [R] the rejected draft's column (any column when bonus)
            if K == 0:
                residual = p_L  # every row is a bonus row
            elif isinstance(draft_probs, IndexedDraftProbs):
                residual = draft_probs.residual(p_L, at, d[rows, at])
            elif draft_probs is not None:
                residual = (p_L - draft_probs[rows, at]).clamp(min=0)
            else:  # q_L one-hot on d_L: max(p_L - q_L, 0) is p_L without d_L
                residual = p_L.scatter(1, d[rows, at].unsqueeze(1), 0.0)
            bonus = L == n  # [R]
            # `not > 0` rather than `<= 0`: a NaN residual (a q that is not finite) also falls back to p_L
            dist = torch.where((bonus | ~(residual.sum(1) > 0)).unsqueeze(1), p_L, residual)
            u_tok = torch.where(bonus, u[STREAM_TARGET, rows, L], u[STREAM_RESIDUAL, rows, L])  # [R]
            token = torch.where(st.greedy, token, inverse_cdf(dist, u_tok))
            if st.any_gumbel:
                token = torch.where(st.gumbel, g[rows, L], token)

        drafts = torch.cat([d, d.new_zeros(R, 1)], 1)  # [R, K+1]
        out = torch.where(cols < L.unsqueeze(1), drafts, torch.where(cols == L.unsqueeze(1), token.unsqueeze(1), -1))
        return out, L, is_finite[rows, L]

"""Lossless verification of drafts: speculative (rejection) sampling, Leviathan et al., arXiv 2211.17192
(also Chen et al., arXiv 2302.01318). Legend: k drafts of one request, V vocabulary, R rows of the forward.

The target scores `[b, d_0, .., d_{k-1}]` in one forward; its row i gives p_i, the target's distribution for
the token after d_{i-1} (after b for i = 0), processed with the request's temperature / top-k / top-p.
q_i is the exact distribution d_i was drawn from (one-hot on d_i when the drafter gives none).

Terms:
* **accepted** — the longest prefix d_0..d_{L-1} that passes: greedy requests (temperature 0) accept d_i
  while d_i == argmax p_i; sampled requests accept d_i with probability min(1, p_i(d_i) / q_i(d_i)).
* **recovered** — at the first rejected position L < k, the emitted token: the target argmax (greedy), or a
  draw from the residual normalise(max(p_L - q_L, 0)) (sampled; p_L itself if the residual has no mass).
* **bonus** — when all k drafts are accepted, one more token from row k: argmax p_k or a draw from p_k.

Each step emits L + 1 tokens whose joint distribution equals sampling the target token by token, for ANY
drafter, as long as q is exact (Leviathan et al., Theorem 1). All randomness of a request comes from its own
torch.Generator (seeded requests are reproducible).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkspec.ops import ops
from sparkspec.sampling_params import SamplingParams
from sparkspec.spec_decode.proposer import Draft


@dataclass
class Verdict:
    num_accepted: int  # L
    token_ids: list[int]  # d_0..d_{L-1} then the recovered or bonus token (L + 1 tokens)
    is_bonus: bool  # the last token came from row k after full acceptance


class RejectionSampler:
    def __call__(
        self,
        logits: torch.Tensor,  # [R, V] target logits of every verify row
        spans: list[tuple[int, int]],  # request r owns rows s..e-1 = [b, d_0..d_{k-1}] (e - s = k + 1)
        drafts: list[Draft],
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[Verdict]:
        argmax = logits.argmax(dim=-1).tolist()
        sampled = [r for r, p in enumerate(params) if not p.greedy]
        probs_of: dict[int, torch.Tensor] = {}
        if sampled:
            rows = torch.cat([torch.arange(*spans[r], device=logits.device) for r in sampled])
            per_row = [(params[r], spans[r][1] - spans[r][0]) for r in sampled]
            t = torch.tensor([p.temperature for p, n in per_row for _ in range(n)], device=logits.device)
            k = torch.tensor([p.top_k for p, n in per_row for _ in range(n)], device=logits.device)
            tp = torch.tensor([p.top_p for p, n in per_row for _ in range(n)], device=logits.device)
            probs = ops.process_logits(logits[rows], t, k, tp)  # [sum(k_r + 1), V]
            off = 0
            for r, (_, n) in zip(sampled, per_row):
                probs_of[r] = probs[off : off + n]
                off += n
        out = []
        for r, (draft, (s, e)) in enumerate(zip(drafts, spans)):
            if e - s != draft.num_tokens + 1:
                raise ValueError(f"request {r}: {e - s} verify rows for {draft.num_tokens} drafts")
            if r in probs_of:
                out.append(self.verify_sampled(probs_of[r], draft, generators[r]))
            else:
                out.append(self.verify_greedy(argmax[s:e], draft))
        return out

    @staticmethod
    def verify_greedy(target_argmax: list[int], draft: Draft) -> Verdict:
        """target_argmax [k + 1]: accept while d_i == argmax p_i; then emit argmax p_L."""
        L = 0
        while L < draft.num_tokens and draft.token_ids[L] == target_argmax[L]:
            L += 1
        return Verdict(L, draft.token_ids[:L] + [target_argmax[L]], L == draft.num_tokens)

    @staticmethod
    def verify_sampled(p: torch.Tensor, draft: Draft, generator: torch.Generator | None) -> Verdict:
        """p [k + 1, V] processed target distributions; q = draft.probs [k, V] or one-hot."""
        k = draft.num_tokens
        if k:
            d = torch.tensor(draft.token_ids, device=p.device)
            i = torch.arange(k, device=p.device)
            p_d = p[i, d]  # [k]
            q_d = draft.probs[i, d].to(p.dtype) if draft.probs is not None else torch.ones_like(p_d)
            u = torch.rand(k, generator=generator, device=p.device)
            accepted = (u * q_d < p_d).tolist()  # u < p/q without dividing by q
            L = accepted.index(False) if False in accepted else k
        else:
            L = 0
        if L == k:  # bonus
            return Verdict(L, draft.token_ids + [int(ops.sample(p[k : k + 1], [generator])[0])], True)
        if draft.probs is not None:
            q = draft.probs[L].to(p.dtype)
        else:
            q = torch.zeros_like(p[L])
            q[draft.token_ids[L]] = 1.0
        residual = (p[L] - q).clamp(min=0)
        mass = residual.sum()
        residual = residual / mass if mass > 0 else p[L]
        token = int(ops.sample(residual.unsqueeze(0), [generator])[0])
        return Verdict(L, draft.token_ids[:L] + [token], False)

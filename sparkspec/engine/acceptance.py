"""What verifying drafts is expected to yield, and which to verify: DSpark Algorithm 1 (pure Python; the adaptive
budget, `budget.py`, decides with it).

Terms (DSpark paper, deepseek-ai/DeepSpec `DSpark_paper.pdf`, §3.2.2 and Algorithm 1; Leviathan et al.
arXiv 2211.17192 for the acceptance rule):
  * c_{r,j}  confidence of draft j of request r: the predicted probability that draft j is accepted given that
             drafts 1..j-1 were (DSpark's confidence head; for drafters without one, an online per-position
             acceptance estimate, the same for every request).
  * a_{r,j}  survival = c_{r,1} * ... * c_{r,j}: the probability that draft j is accepted; non-increasing in j.
  * l_r      drafts of request r verified this step (0 = a plain decode row).
  * B        target tokens in the step = base tokens (prefill chunks + one anchor row per decode request)
             + sum_r l_r.
  * tau      expected tokens produced = base tokens that sample + sum_r sum_{j <= l_r} a_{r,j}.
  * SPS(B)   steps per second at B tokens, from a cost table measured at engine start (target forward time vs
             tokens, drafter time vs requests), cached per machine.
Objective: Theta = tau * SPS(B), expected tokens per second. Algorithm 1 admits (r, j) items in order of
decreasing a (ties: smaller j first, so admissions stay prefixes) while Theta improves, and STOPS at the first
item that does not improve it. The early stop is what keeps rejection sampling exact: whether draft j is verified
then depends only on items ranked above it, never on c_{r,j+1}, which the drafter computed from the value of
draft j (paper App. A gives a counterexample for the global argmax; tests/test_engine.py checks it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def survival(confidences: Sequence[float]) -> list[float]:
    """a_j = prod_{i<=j} c_i, with each c clamped to [0, 1]."""
    out, a = [], 1.0
    for c in confidences:
        a *= min(max(float(c), 0.0), 1.0)
        out.append(a)
    return out


def verify_lengths(survivals: Sequence[Sequence[float]], steps_per_second: Callable[[int], float],
                   num_base_tokens: int, num_base_produced: float) -> list[int]:
    """DSpark Algorithm 1 with early stop -> l_r per request (each l_r <= len(survivals[r]))."""
    items = sorted(((a, j, r) for r, row in enumerate(survivals) for j, a in enumerate(row, 1) if a > 0),
                   key=lambda x: (-x[0], x[1]))
    lengths = [0] * len(survivals)
    num_tokens, tau = num_base_tokens, float(num_base_produced)
    best = tau * steps_per_second(num_tokens)
    for a, j, r in items:
        num_tokens += 1
        tau += a
        theta = tau * steps_per_second(num_tokens)
        if theta <= best:
            break  # early stop: required for losslessness
        best = theta
        assert j == lengths[r] + 1, "survival must be non-increasing within a request"
        lengths[r] = j
    return lengths


class AcceptanceEstimator:
    """Per-position conditional acceptance rate, updated online (exponentially weighted counts)."""

    def __init__(self, num_positions: int, prior: float = 0.6, prior_weight: float = 4.0, decay: float = 0.995):
        self.decay = decay
        self.accepted = [prior * prior_weight] * num_positions
        self.tested = [prior_weight] * num_positions
        self.version = 0  # bumped by every `observe`: what was computed from `rates` at another version is stale

    def observe(self, num_verified: int, num_accepted: int) -> None:
        """Drafts 1..m were accepted and draft m+1 (if verified) rejected; later ones were never tested."""
        self.version += 1
        for j in range(min(num_accepted + 1, num_verified, len(self.tested))):
            self.accepted[j] = self.accepted[j] * self.decay + (j < num_accepted)
            self.tested[j] = self.tested[j] * self.decay + 1

    def rates(self, k: int | None = None) -> list[float]:
        n = len(self.tested) if k is None else min(k, len(self.tested))
        return [self.accepted[j] / self.tested[j] for j in range(n)]

"""Adaptive verification: how many of each request's drafts to verify in one step (pure Python).

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

import bisect
import hashlib
import json
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

BudgetMode = Literal["adaptive", "fixed"]
BUDGET_MODES = ("adaptive", "fixed")


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

    def observe(self, num_verified: int, num_accepted: int) -> None:
        """Drafts 1..m were accepted and draft m+1 (if verified) rejected; later ones were never tested."""
        for j in range(min(num_accepted + 1, num_verified, len(self.tested))):
            self.accepted[j] = self.accepted[j] * self.decay + (j < num_accepted)
            self.tested[j] = self.tested[j] * self.decay + 1

    def rates(self, k: int | None = None) -> list[float]:
        n = len(self.tested) if k is None else min(k, len(self.tested))
        return [self.accepted[j] / self.tested[j] for j in range(n)]


@dataclass
class CostTable:
    """Measured step times. `target[R]` = [(tokens, seconds)] for R requests in the step; `draft` = [(R, seconds)]."""

    target: dict[int, list[tuple[int, float]]]
    draft: list[tuple[int, float]] = field(default_factory=list)
    key: str = ""

    def __post_init__(self) -> None:
        self._curves: dict[int, tuple[list[int], list[float]]] = {}
        for r, points in self.target.items():
            xs = [p[0] for p in sorted(points)]
            ys = [p[1] for p in sorted(points)]
            for i in range(1, len(ys)):  # force monotone: more tokens never cost less
                ys[i] = max(ys[i], ys[i - 1])
            self._curves[r] = (xs, ys)

    def target_seconds(self, num_reqs: int, num_tokens: int) -> float:
        r = min(self._curves, key=lambda x: (abs(x - num_reqs), x))  # nearest measured request count
        xs, ys = self._curves[r]
        if num_tokens <= xs[0] or len(xs) == 1:
            return ys[0] * (num_tokens / xs[0] if num_tokens > xs[0] else 1.0)
        i = min(bisect.bisect_left(xs, num_tokens), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (num_tokens - x0) / max(x1 - x0, 1)  # extrapolates linearly past the last point

    def draft_seconds(self, num_reqs: int) -> float:
        if not self.draft:
            return 0.0
        pts = sorted(self.draft)
        best = min(pts, key=lambda p: abs(p[0] - num_reqs))
        return best[1] * max(num_reqs, 1) / max(best[0], 1) if num_reqs > pts[-1][0] else best[1]

    def steps_per_second(self, num_reqs: int) -> Callable[[int], float]:
        d = self.draft_seconds(num_reqs)
        return lambda num_tokens: 1.0 / max(self.target_seconds(num_reqs, num_tokens) + d, 1e-9)

    def to_json(self) -> dict:
        return {"key": self.key, "target": {str(r): pts for r, pts in self.target.items()}, "draft": self.draft}

    @classmethod
    def from_json(cls, d: dict) -> CostTable:
        return cls({int(r): [tuple(p) for p in pts] for r, pts in d["target"].items()},
                   [tuple(p) for p in d.get("draft", [])], d.get("key", ""))


def machine_key(*parts: str) -> str:
    """Identify (machine, model shape, method) so a cached cost table is only reused where it was measured."""
    cpu = platform.processor() or platform.machine()
    text = "|".join([platform.node(), cpu, str(os.cpu_count()), *parts])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cost_cache_dir() -> Path:
    return Path(os.environ.get("SPARKSPEC_CACHE", Path.home() / ".cache" / "sparkspec"))


def load_or_measure(key: str, measure: Callable[[], CostTable], cache_dir: Path | None = None) -> CostTable:
    path = (cache_dir or cost_cache_dir()) / f"cost-{key}.json"
    if path.is_file():
        try:
            cached = CostTable.from_json(json.loads(path.read_text()))
            if cached.target:
                return cached
        except (ValueError, KeyError, TypeError):
            pass  # a corrupt (or empty: measured without room for one request) cache is re-measured
    table = measure()
    table.key = key
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table.to_json()))
    except OSError:
        pass  # caching is an optimisation
    return table


class VerificationBudget:
    """Chooses l_r for every decode request of a step. `fixed` verifies every draft; `adaptive` runs Algorithm 1,
    or, on `padded` steps, chooses between verifying every draft and none.

    Padded steps (CUDA graphs): a decode step runs as a graph of R requests x q rows, q in {1, 1 + k}, so a
    step that verifies one draft costs the same as one that verifies k for every request. Algorithm 1's token
    cost does not hold there, and with the early stop it would never pay the jump to q = 1 + k for a first item
    that is worth less than the jump. The padded rule compares, per step, the expected tokens per second of
    "draft and verify k for every request" against plain decoding, from the measured (R, q) step times and the
    online per-position acceptance rates. It reads only past steps, never the drafts at hand, so verification
    stays lossless."""

    def __init__(self, mode: BudgetMode, num_spec_tokens: int, cost: CostTable | None = None, padded: bool = False):
        if mode not in BUDGET_MODES:
            raise ValueError(f"spec budget {mode!r}: expected one of {BUDGET_MODES}")
        if mode == "adaptive" and cost is None:
            raise ValueError("adaptive verification needs a cost table")
        self.mode = mode
        self.num_spec_tokens = num_spec_tokens
        self.cost = cost
        self.padded = padded
        self.estimator = AcceptanceEstimator(max(num_spec_tokens, 1))

    def speculation_pays(self, num_reqs: int) -> bool:
        """Padded steps: whether drafting k and verifying them all beats plain decoding for `num_reqs` requests."""
        k = self.num_spec_tokens
        tau = num_reqs * (1 + sum(survival(self.estimator.rates(k))))
        spec_s = self.cost.target_seconds(num_reqs, num_reqs * (1 + k)) + self.cost.draft_seconds(num_reqs)
        plain_s = self.cost.target_seconds(num_reqs, num_reqs)
        return tau / max(spec_s, 1e-9) > num_reqs / max(plain_s, 1e-9)

    def survivals(self, confidences: Sequence[Sequence[float] | None], num_drafts: Sequence[int]) -> list[list[float]]:
        """Confidence-head survival where a drafter gives one, else the online per-position estimate."""
        out = []
        for conf, k in zip(confidences, num_drafts):
            out.append(survival(conf[:k]) if conf is not None else survival(self.estimator.rates(k)))
        return out

    def lengths(self, num_drafts: Sequence[int], confidences: Sequence[Sequence[float] | None],
                num_base_tokens: int, num_base_produced: int) -> list[int]:
        if self.mode == "fixed":
            return list(num_drafts)
        if self.padded:
            return list(num_drafts) if self.speculation_pays(len(num_drafts)) else [0] * len(num_drafts)
        sps = self.cost.steps_per_second(len(num_drafts))
        return verify_lengths(self.survivals(confidences, num_drafts), sps, num_base_tokens, num_base_produced)

    def plan_num_drafts(self, num_reqs: int, num_base_tokens: int) -> int:
        """Per-batch-size draft schedule: drafts worth proposing when every request looks like the online average.
        0 means this step skips the drafter altogether (no speculation tax)."""
        if self.mode == "fixed" or num_reqs == 0:
            return self.num_spec_tokens
        if self.padded:
            return self.num_spec_tokens if self.speculation_pays(num_reqs) else 0
        a = survival(self.estimator.rates(self.num_spec_tokens))
        sps = self.cost.steps_per_second(num_reqs)  # includes the drafter's time
        ls = verify_lengths([a] * num_reqs, sps, num_base_tokens, num_reqs)
        if max(ls) == 0:
            return 0
        tau = num_reqs + sum(sum(a[:n]) for n in ls)
        theta_draft = tau * sps(num_base_tokens + sum(ls))
        theta_plain = num_reqs / max(self.cost.target_seconds(num_reqs, num_base_tokens), 1e-9)  # no drafter call
        return max(ls) if theta_draft > theta_plain else 0

    def observe(self, num_verified: int, num_accepted: int) -> None:
        self.estimator.observe(num_verified, num_accepted)

"""Acceptance metrics of speculative decoding, per request and pooled over requests.

The only definitions of these numbers in the project (`generate --json`, `eval`, `bench offline` use them):

* a **step** is one verification of a request after its prefill: the target forward over the pending token
  followed by >= 1 draft tokens. The engine counts them per request (`RequestOutput.metrics["spec_steps"]`);
  decode rows where the budget planned no drafts are not steps;
* **acceptance length** τ = tokens emitted per step = (accepted + steps) / steps. Each step emits its accepted
  drafts plus the one token the target itself samples (the bonus or the corrected token), so τ counts that
  token and no speculation gives τ = 1 (the DSpark / EAGLE convention). Pooled over requests, τ sums
  accepted and steps first (a long request weighs more than a short one);
* **acceptance rate** = accepted / drafted draft tokens;
* **accept rate @ i** (1-based) = steps whose first i drafts were all accepted / steps (prefix survival,
  DeepSpec's `accept_rate@k`; drafts are accepted as a prefix, so the engine's `accepted_per_position[i-1]`
  is that count). Hence τ = 1 + Σ_i accept_rate@i. When a step drafts fewer than i tokens (n-gram, or a
  budget cut) it counts as not surviving to i.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    """The counters, and the numbers above from them. `record` counts one step; the engine keeps one per request
    (`Sequence.spec.metrics`) and one over all requests (`EngineStats.spec`)."""

    method: str = "none"
    num_spec_tokens: int = 0  # k; 0: not fixed (the engine's counters grow with the longest step verified)
    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k] steps whose draft i was accepted

    def __post_init__(self) -> None:
        k = max(self.num_spec_tokens, len(self.accepted_per_position))
        self.accepted_per_position = list(self.accepted_per_position) + [0] * (k - len(self.accepted_per_position))

    @classmethod
    def from_request(cls, method: str, num_spec_tokens: int, metrics: Mapping) -> SpecMetrics:
        """From one request's engine counters (`RequestOutput.metrics`)."""
        return cls(method, num_spec_tokens, int(metrics.get("spec_steps", 0)), int(metrics.get("spec_drafted", 0)),
                   int(metrics.get("spec_accepted", 0)), list(metrics.get("spec_accepted_per_position", [])))

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One step that verified `num_drafts` drafts and accepted the first `num_accepted` (a step without
        drafts is not a step; see the module docstring)."""
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"accepted {num_accepted} of {num_drafts} drafts")
        if num_drafts == 0:
            return
        self.num_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_length(self) -> float:
        """τ = (accepted + steps) / steps (1.0 when there was no step)."""
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps if self.num_steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def accept_rate_per_position(self) -> list[float]:
        """accept_rate@i for i = 1..k: steps whose drafts 1..i were all accepted / steps."""
        return [a / self.num_steps if self.num_steps else 0.0 for a in self.accepted_per_position]

    @property
    def conditional_accept_rate(self) -> list[float]:
        """accept_rate@i / accept_rate@(i-1): P(draft i accepted | drafts < i accepted) (DSpark paper, Fig. 2)."""
        surv = self.accept_rate_per_position
        return [s / p if p else 0.0 for s, p in zip(surv, [1.0] + surv[:-1])]

    @classmethod
    def aggregate(cls, items: Iterable[SpecMetrics], method: str | None = None,
                  num_spec_tokens: int | None = None) -> SpecMetrics:
        """Pool counters over requests (sums, so τ is tokens per step over all steps of all requests)."""
        items = list(items)
        k = num_spec_tokens if num_spec_tokens is not None else max((m.num_spec_tokens for m in items), default=0)
        total = cls(method or (items[0].method if items else "none"), k)
        for m in items:
            total.num_steps += m.num_steps
            total.num_draft_tokens += m.num_draft_tokens
            total.num_accepted_tokens += m.num_accepted_tokens
            if len(m.accepted_per_position) > len(total.accepted_per_position):
                total.accepted_per_position += [0] * (len(m.accepted_per_position) - len(total.accepted_per_position))
            for i, a in enumerate(m.accepted_per_position):
                total.accepted_per_position[i] += a
        return total

    def to_dict(self) -> dict:
        """The `spec` object of `sparkspec generate --json`."""
        return {
            "method": self.method,
            "num_spec_tokens": self.num_spec_tokens,
            "num_steps": self.num_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_length": round(self.acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "accepted_per_position": list(self.accepted_per_position),
        }

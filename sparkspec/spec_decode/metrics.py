"""Acceptance metrics, per request and aggregated.

A **step** is one target forward of a request after its prefill (a verify row block [b, d_0..d_{k-1}], or a
plain decode row when it had no drafts). Acceptance length τ = mean over steps of (accepted + 1), the
DSpark / EAGLE convention (it counts the recovered or bonus token, so no speculation gives τ = 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    method: str
    num_spec_tokens: int
    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k] steps whose draft i was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [k] steps that drafted position i

    def __post_init__(self) -> None:
        k = self.num_spec_tokens
        self.accepted_per_position = self.accepted_per_position or [0] * k
        self.drafted_per_position = self.drafted_per_position or [0] * k

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One step that verified `num_drafts` drafts and accepted the first `num_accepted`."""
        if not 0 <= num_accepted <= num_drafts <= self.num_spec_tokens:
            raise ValueError(f"accepted {num_accepted} of {num_drafts} drafts (k = {self.num_spec_tokens})")
        self.num_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_drafts):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    @property
    def acceptance_length(self) -> float:
        """τ = mean(accepted + 1) over steps (1.0 when there was no step)."""
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps if self.num_steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Conditional acceptance of position i: accepted / drafted at i."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @classmethod
    def aggregate(cls, items: list[SpecMetrics], method: str | None = None,
                  num_spec_tokens: int | None = None) -> SpecMetrics:
        k = num_spec_tokens if num_spec_tokens is not None else max((m.num_spec_tokens for m in items), default=0)
        total = cls(method or (items[0].method if items else "none"), k)
        for m in items:
            total.num_steps += m.num_steps
            total.num_draft_tokens += m.num_draft_tokens
            total.num_accepted_tokens += m.num_accepted_tokens
            for i in range(min(k, m.num_spec_tokens)):
                total.accepted_per_position[i] += m.accepted_per_position[i]
                total.drafted_per_position[i] += m.drafted_per_position[i]
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

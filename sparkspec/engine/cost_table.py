"""The step-cost table the adaptive budget starts from (`budget.VerificationBudget`): target forward seconds vs
tokens per request count, the drafter's seconds, and plain decode steps as async scheduling launches them, measured
at engine start (`SpecPolicy.measure_costs`) and cached per machine, model shape and method. Pure Python."""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class CostTable:
    """Measured step times. `target[R]` = [(tokens, seconds)] for R requests in the step; `draft` = [(R, seconds)];
    `plain` = [(R, seconds)] of a plain decode step as the engine runs a plain stretch under async scheduling
    (launched back to back, each read one step late: the host's packing hides behind the device), empty where the
    engine steps in turn (plain decoding then costs `target[R]` at R tokens)."""

    target: dict[int, list[tuple[int, float]]]
    draft: list[tuple[int, float]] = field(default_factory=list)
    key: str = ""
    plain: list[tuple[int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._curves: dict[int, tuple[list[int], list[float]]] = {}
        self._nearest: dict[int, tuple[list[int], list[float]]] = {}
        for r, points in self.target.items():
            xs = [p[0] for p in sorted(points)]
            ys = [p[1] for p in sorted(points)]
            for i in range(1, len(ys)):  # force monotone: more tokens never cost less
                ys[i] = max(ys[i], ys[i - 1])
            self._curves[r] = (xs, ys)

    def curve(self, num_reqs: int) -> tuple[list[int], list[float]]:
        """(tokens, seconds) of the nearest measured request count (memoised: Algorithm 1 asks once per item)."""
        got = self._nearest.get(num_reqs)
        if got is None:
            r = min(self._curves, key=lambda x: (abs(x - num_reqs), x))
            got = self._nearest[num_reqs] = self._curves[r]
        return got

    def target_seconds(self, num_reqs: int, num_tokens: int) -> float:
        xs, ys = self.curve(num_reqs)
        if num_tokens <= xs[0] or len(xs) == 1:
            return ys[0] * (num_tokens / xs[0] if num_tokens > xs[0] else 1.0)
        i = min(bisect.bisect_left(xs, num_tokens), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (num_tokens - x0) / max(x1 - x0, 1)  # extrapolates linearly past the last point

    def draft_seconds(self, num_reqs: int) -> float:
        return self._per_request(self.draft, num_reqs) if self.draft else 0.0

    def plain_seconds(self, num_reqs: int, num_tokens: int) -> float:
        """A plain step of `num_reqs` decode rows (`num_tokens` in all: more than num_reqs where prompt chunks ride
        along: their prefill, which the table does not time launched)."""
        if self.plain and num_tokens == num_reqs:
            return self._per_request(self.plain, num_reqs)
        return self.target_seconds(num_reqs, num_tokens)

    @staticmethod
    def _per_request(points: list[tuple[int, float]], num_reqs: int) -> float:
        """The nearest measured request count's seconds, scaled linearly past the largest one."""
        pts = sorted(points)
        best = min(pts, key=lambda p: abs(p[0] - num_reqs))
        return best[1] * max(num_reqs, 1) / max(best[0], 1) if num_reqs > pts[-1][0] else best[1]

    def steps_per_second(self, num_reqs: int) -> Callable[[int], float]:
        d = self.draft_seconds(num_reqs)
        return lambda num_tokens: 1.0 / max(self.target_seconds(num_reqs, num_tokens) + d, 1e-9)

    def to_json(self) -> dict:
        return {"key": self.key, "target": {str(r): pts for r, pts in self.target.items()}, "draft": self.draft,
                "plain": self.plain}

    @classmethod
    def from_json(cls, d: dict) -> CostTable:
        return cls({int(r): [tuple(p) for p in pts] for r, pts in d["target"].items()},
                   [tuple(p) for p in d.get("draft", [])], d.get("key", ""), [tuple(p) for p in d.get("plain", [])])


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

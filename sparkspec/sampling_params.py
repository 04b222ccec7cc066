"""Per-request sampling parameters (validated; the names follow the OpenAI / vLLM convention)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # <= 0 disables
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens = {self.max_tokens!r}: expected an integer >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature = {self.temperature!r}: expected >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p!r}: expected a number in (0, 1]")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k = {self.top_k!r}: expected an integer")
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

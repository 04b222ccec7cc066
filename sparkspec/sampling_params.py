"""Per-request sampling parameters (validated; the names follow the OpenAI / vLLM convention)."""

from __future__ import annotations

from dataclasses import dataclass, field

SEED_MIN, SEED_END = -(2**63), 2**64  # the range torch.Generator.manual_seed accepts (int64 or uint64)


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
        if not isinstance(self.top_k, int) or not -(2**63) <= self.top_k < 2**63:  # it becomes an int64 tensor
            raise ValueError(f"top_k = {self.top_k!r}: expected a 64-bit integer")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed < SEED_END):
            # the range torch's manual_seed takes; outside it, packing the seed raised inside the engine step
            raise ValueError(f"seed = {self.seed!r}: expected an integer in [-2**63, 2**64)")
        if self.seed is not None and self.seed >= 2**63:
            # kept as int64, as the engine packs seeds into int64 tensors: the same two's complement reading
            # torch gives a uint64 seed, so 2**64 - 1 and -1 are one seed, as they are for manual_seed
            self.seed -= 2**64
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

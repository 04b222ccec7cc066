"""Per-request sampling parameters (validated; the names follow the OpenAI / vLLM convention)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

SEED_MIN, SEED_END = -(2**63), 2**64  # the range torch.Generator.manual_seed accepts (int64 or uint64)
MAX_N = 16  # samples per request
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's chat limit)
# Below this temperature a request is greedy (vLLM's bound): logits / T must stay finite in fp32, where the
# sampler divides (at T = 1e-40, T is denormal and any logit above ~3.4e-2 overflows to inf, and the softmax is NaN)
MIN_TEMPERATURE = 1e-5


def _count(value, name: str, low: int, high: int | None = None) -> None:
    """ValueError naming `name` unless value is an int in [low, high]."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        what = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} = {value!r}: expected an integer {what}")


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: the seed itself for sample 0 (so n = 1 is
    unchanged), else a 64-bit hash of (seed, index) as int64 — reproducible, and distinct between samples."""
    if index == 0:
        return seed
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest(), "little")
    return h - 2**64 if h >= 2**63 else h


STRUCTURED_TYPES = ("json_object", "json_schema", "regex", "grammar", "choice", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain the output to JSON (`json_object`: any JSON object or value xgrammar's builtin JSON grammar
    takes), to a JSON schema (`json_schema`, `schema` a dict or its JSON text), or to a grammar given as text in
    `schema`: `regex`, `grammar` (EBNF, xgrammar's dialect), `choice` (one of a list of strings; `schema` the
    list or its JSON text) or `structural_tag` (xgrammar's structural tag JSON: the server's forced tool calls).
    `strict` is OpenAI's flag, recorded only: the output always follows the schema. Hashable (grammars are
    cached by it)."""

    type: Literal["json_object", "json_schema", "regex", "grammar", "choice", "structural_tag"]
    schema: Any = None
    strict: bool | None = None

    def __post_init__(self) -> None:
        if self.type not in STRUCTURED_TYPES:
            raise ValueError(f"response_format.type = {self.type!r}: expected one of {', '.join(STRUCTURED_TYPES)}")
        if self.type in ("regex", "grammar"):
            if not isinstance(self.schema, str) or not self.schema:
                raise ValueError(f"structured_outputs.{self.type}: expected a non-empty string")
        elif self.type in ("choice", "structural_tag"):
            try:
                value = json.loads(self.schema) if isinstance(self.schema, str) else self.schema
            except ValueError:
                value = None
            ok = isinstance(value, dict) if self.type == "structural_tag" else (
                isinstance(value, list) and value and all(isinstance(c, str) for c in value))
            if not ok:
                what = "a list of strings" if self.type == "choice" else "a structural tag object"
                raise ValueError(f"structured_outputs.{self.type}: expected {what}")
            object.__setattr__(self, "schema", json.dumps(value))
        elif self.type == "json_schema":
            try:
                schema = json.loads(self.schema) if isinstance(self.schema, str) else self.schema
            except ValueError:
                schema = None
            if not isinstance(schema, dict):
                raise ValueError("response_format.json_schema.schema: expected a JSON object")
            # as text: hashable; the key order is kept, since it is the order the output follows
            object.__setattr__(self, "schema", json.dumps(schema))

    @property
    def schema_json(self) -> str:
        return self.schema


@dataclass
class SamplingParams:
    """`n`: independent samples of the prompt (`LLMEngine.generate` groups them in `RequestOutput.outputs`);
    `logprobs`: N -> the log-probability of every generated token plus the N most likely alternatives
    (0: the token's only); `prompt_logprobs`: N -> the same for prompt tokens 1.. (token 0 has none);
    `num_spec_tokens`: most drafts verified per step for this request (None: the engine's; 0: no speculation).
    `max_tokens` may be 0 (the prompt is only scored, e.g. for `prompt_logprobs`).

    `structured`: constrain the output by a grammar (`StructuredOutput`; `sparkspec.engine.grammar`), lossless
    under speculation; the request finishes with "stop" when the grammar is complete and the model stops.

    `temperature`: any value >= 0 is served; below `MIN_TEMPERATURE` (1e-5, as in vLLM) the request is greedy,
    exactly as at 0 (the argmax; top_k / top_p do not apply), since a smaller T overflows `logits / T` in fp32."""

    max_tokens: int = 64
    temperature: float = 0.0  # below MIN_TEMPERATURE (0 included) = greedy
    top_p: float = 1.0
    top_k: int = 0  # <= 0 disables
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    num_spec_tokens: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        _count(self.max_tokens, "max_tokens", 0)
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
        _count(self.n, "n", 1, MAX_N)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _count(getattr(self, name), name, 0, MAX_LOGPROBS)
        if self.num_spec_tokens is not None:
            _count(self.num_spec_tokens, "num_spec_tokens", 0)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured = {self.structured!r}: expected a StructuredOutput")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def device_temperature(self) -> float:
        """The temperature packed for the device: 0 for a greedy request, so host and device agree on it."""
        return 0.0 if self.greedy else float(self.temperature)

    def samples(self) -> list[SamplingParams]:
        """One n = 1 copy per sample; with a seed, sample i gets `sample_seed(seed, i)`."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else sample_seed(self.seed, i))
                for i in range(self.n)]

"""EngineConfig: everything the engine needs besides the checkpoint, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sparkspec.spec_decode.methods import SPEC_METHODS, SpecMethod

SamplingScheme = Literal["auto", "rejection", "gumbel"]
SAMPLING_SCHEMES: tuple[str, ...] = ("auto", "rejection", "gumbel")
DEFAULT_SAMPLING_SCHEME: SamplingScheme = "auto"  # EngineConfig's, and every command's --sampling-scheme
SAMPLING_SCHEME_HELP = ("auto (the default: gumbel for requests with a seed, rejection for the others), rejection "
                        "(Leviathan et al.: the higher acceptance) or gumbel (Gumbel-max with noise keyed by seed and "
                        "position: the same tokens whatever the drafter, k or the batch)")


@dataclass
class EngineConfig:
    # batching
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 1024  # target tokens per step (prefill chunks + decode + verify rows)
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_waiting: int = 256  # queued requests beyond which new ones are refused (HTTP 429)
    enable_chunked_prefill: bool = True
    # KV cache budget (see engine/kv_plan.py for what a block is)
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: memory_fraction, else max_num_seqs x max_model_len
    memory_fraction: float | None = None
    enable_prefix_caching: bool = True  # share cached prompt prefixes across requests (engine/block_manager.py)
    # speculation
    speculative: SpecMethod = "none"
    num_spec_tokens: int | None = None  # None: the drafter's natural length (DSpark block size, MTP layers, 4)
    spec_budget: Literal["adaptive", "fixed"] = "adaptive"
    cost_cache_dir: str | None = None  # where the measured step-cost table is cached (default ~/.cache/sparkspec)
    # how sampled requests (T > 0) draw and verify (spec_decode/rejection.py): "rejection" = inverse-CDF draws
    # and rejection sampling (same distribution; seeded tokens depend on the drafts); "gumbel" = Gumbel-max
    # with noise keyed by (seed, position): the same tokens as plain decoding whatever the drafter, k or budget;
    # "auto" = gumbel for requests that give a seed (reproducing is what a seed promises), rejection for the rest
    # (its acceptance is higher: README, drafter-invariant sampling)
    sampling_scheme: SamplingScheme = DEFAULT_SAMPLING_SCHEME
    # execution
    enforce_eager: bool = False  # True: no CUDA / HIP graphs (they are captured for decode / verify steps otherwise)
    # async scheduling (LLMEngine.step): the next decode step is scheduled and launched before the host reads the
    # one on the device, so the host's commit / emit / scheduling overlaps the device. None: on wherever it
    # applies (captured graphs; plain steps with their joining prompts' chunks, also a drafting engine's steps
    # that neither verify nor propose drafts; steps with drafts, logprobs or grammars run in turn); False: off
    # (debugging; the tokens are the same either way)
    async_scheduling: bool | None = None
    # batch-invariant kernels (ops/batch_invariant.py): a request's tokens do not depend on the rows its steps share
    # with other requests (fixed-tile GEMMs instead of cuBLAS, pinned norm / mHC / head / FP8 / MoE tiles); off by
    # default until its cost is measured. Process-wide: `apply_batch_invariant(config)` sets it when an engine starts
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} = {v!r}: expected a positive integer")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len = {self.max_model_len!r}: expected an integer >= 2")
        if self.speculative not in SPEC_METHODS:
            raise ValueError(f"speculative = {self.speculative!r}: expected one of {SPEC_METHODS}")
        if self.num_spec_tokens is not None and (not isinstance(self.num_spec_tokens, int) or self.num_spec_tokens < 1):
            raise ValueError(f"num_spec_tokens = {self.num_spec_tokens!r}: expected an integer >= 1")
        if self.spec_budget not in ("adaptive", "fixed"):
            raise ValueError(f"spec_budget = {self.spec_budget!r}: expected 'adaptive' or 'fixed'")
        if self.sampling_scheme not in SAMPLING_SCHEMES:
            raise ValueError(f"sampling_scheme = {self.sampling_scheme!r}: expected one of {SAMPLING_SCHEMES}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant = {self.batch_invariant!r}: expected True or False")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction = {self.memory_fraction!r}: expected a number in (0, 1]")


NO_ASYNC_SCHEDULING_HELP = ("step in turn: read each decode step before scheduling the next (by default, where graphs "
                            "are captured and nothing drafts, the next step is launched first; same tokens)")
BATCH_INVARIANT_HELP = ("batch-invariant kernels: a request's greedy tokens do not depend on its batch or on "
                        "speculation (fixed-tile GEMMs instead of cuBLAS; slower, see README)")


def apply_batch_invariant(config: EngineConfig) -> None:
    """Turn the process-wide batch-invariant mode on when `config` asks for it (before the engine captures graphs or
    runs). It never turns it off: the mode is process-wide and an engine built without it must not change what an
    engine (or a test) that turned it on sees; `sparkspec.ops.batch_invariant.set_batch_invariant(False)` does."""
    if config.batch_invariant:
        from sparkspec.ops.batch_invariant import set_batch_invariant

        set_batch_invariant(True)

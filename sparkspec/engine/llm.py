"""LLM: the offline API. `LLM(model=DIR, speculative="dspark").generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from pathlib import Path

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine, RequestOutput
from sparkspec.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | Path, speculative: str = "none", num_spec_tokens: int | None = None,
                 spec_budget: str = "adaptive", device: str | None = None, dtype: str | None = None, **engine_kw):
        """`model`: a checkpoint directory; `speculative`: none | dspark | mtp | ngram; other keywords go to
        `EngineConfig` (max_num_seqs, max_num_batched_tokens, kv_cache_memory, block_size, ...)."""
        from sparkspec.checkpoint import load_checkpoint

        self.checkpoint = load_checkpoint(model, device=device, dtype=dtype)
        engine_kw.setdefault("max_waiting", 1 << 20)
        config = EngineConfig(speculative=speculative, num_spec_tokens=num_spec_tokens, spec_budget=spec_budget,
                              **engine_kw)
        self.engine = LLMEngine(self.checkpoint.model, self.checkpoint.tokenizer, config,
                                self.checkpoint.drafter_tensors)

    @property
    def tokenizer(self):
        return self.checkpoint.tokenizer

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Prompts are text (tokenised with BOS) or token-id lists; one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self.engine.generate(list(prompts), sampling_params or SamplingParams())

    def chat(self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None) -> RequestOutput:
        tok = self.tokenizer
        if tok is None:
            raise ValueError("this checkpoint has no tokenizer")
        ids = tok.encode(tok.apply_chat_template(messages))
        return self.engine.generate([ids], sampling_params or SamplingParams())[0]

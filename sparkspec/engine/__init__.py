"""The serving engine: continuous batching, KV block accounting, batch-level speculation, adaptive verification.

    from sparkspec.engine import LLM
    outs = LLM(model="checkpoints/demo", speculative="dspark").generate(["Hello"], SamplingParams(max_tokens=32))

The scheduler, block manager and budget are plain Python (no torch import); the names below load lazily.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "sparkspec.engine.llm",
    "LLMEngine": "sparkspec.engine.llm_engine",
    "RequestOutput": "sparkspec.engine.outputs",
    "AsyncLLMEngine": "sparkspec.engine.async_engine",
    "EngineConfig": "sparkspec.engine.config",
    "Scheduler": "sparkspec.engine.scheduler",
    "SchedulerConfig": "sparkspec.engine.scheduler",
    "QueueFullError": "sparkspec.engine.scheduler",
    "BlockManager": "sparkspec.engine.block_manager",
    "VerificationBudget": "sparkspec.engine.budget",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sparkspec.engine' has no attribute {name!r}")

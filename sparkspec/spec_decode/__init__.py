"""Speculative decoding: drafters (DSpark, MTP, n-gram), lossless verification, metrics. The engine
(`sparkspec.engine`) runs them:

    proposer = build_proposer("dspark", model, drafter_tensors, num_spec_tokens=None)
    outputs = LLMEngine(model, tokenizer, proposer=proposer).generate(prompts, params)

`methods.py` and `metrics.py` are plain Python (no torch import); the names below load lazily.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "SPEC_METHODS": "sparkspec.spec_decode.methods",
    "DRAFT_METHODS": "sparkspec.spec_decode.methods",
    "SpecMethod": "sparkspec.spec_decode.methods",
    "SpecMetrics": "sparkspec.spec_decode.metrics",
    "Proposer": "sparkspec.spec_decode.proposer",
    "DeviceProposer": "sparkspec.spec_decode.proposer",
    "HostProposer": "sparkspec.spec_decode.proposer",
    "DraftBatch": "sparkspec.spec_decode.proposer",
    "StepRows": "sparkspec.spec_decode.proposer",
    "RejectionSampler": "sparkspec.spec_decode.rejection",
    "build_proposer": "sparkspec.spec_decode.build",
    "default_num_spec_tokens": "sparkspec.spec_decode.build",
    "DEFAULT_NGRAM_TOKENS": "sparkspec.spec_decode.build",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sparkspec.spec_decode' has no attribute {name!r}")

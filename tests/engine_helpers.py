"""Shared helpers for the engine / server tests: one tiny random checkpoint per test session."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path


@functools.lru_cache(maxsize=None)
def tiny_checkpoint(drafter: str | None = "dspark", seed: int = 0) -> Path:
    """A tiny-preset checkpoint (random weights, BPE tokenizer, chat template) written once per session."""
    from sparkspec.checkpoint import init_checkpoint

    out = Path(tempfile.mkdtemp(prefix="sparkspec-tiny-")) / "tiny"
    init_checkpoint("tiny", out, seed=seed, drafter=drafter)
    return out

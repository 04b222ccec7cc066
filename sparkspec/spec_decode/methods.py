"""The speculative methods, named once: the CLI's `--spec` choices, `EngineConfig`, `build_proposer`, the benches and
the tests read them here. Pure Python, so a parser can offer them without importing torch."""

from __future__ import annotations

from typing import Literal, get_args

SpecMethod = Literal["none", "dspark", "mtp", "ngram"]
SPEC_METHODS: tuple[str, ...] = get_args(SpecMethod)  # "none": no speculation
DRAFT_METHODS: tuple[str, ...] = SPEC_METHODS[1:]  # the methods that draft

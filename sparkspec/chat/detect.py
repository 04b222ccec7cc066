"""Which chat format a checkpoint speaks: its Jinja `chat_template`, or DeepSeek-V4's encoding (the official
V4 repositories ship no template: the format is published as a Python encoder)."""

from __future__ import annotations

from typing import Literal

from sparkspec.chat.dsv4_markers import REQUIRED_MARKERS
from sparkspec.tokenizer import Tokenizer

ChatFormat = Literal["deepseek-v4", "jinja"]
CHAT_FORMATS = ("deepseek-v4", "jinja")


def has_dsv4_markers(tokenizer: Tokenizer) -> bool:
    """Every marker the V4 encoder writes is one token of this vocabulary."""
    return all(tokenizer.token_to_id(m) is not None for m in REQUIRED_MARKERS)


def detect_chat_format(tokenizer: Tokenizer) -> ChatFormat | None:
    """"jinja" when the tokenizer has a chat template (it wins: the checkpoint chose it), "deepseek-v4" when it
    has none but has the V4 markers, None when it can do neither (completions only)."""
    if tokenizer.chat_template is not None:
        return "jinja"
    return "deepseek-v4" if has_dsv4_markers(tokenizer) else None


def resolve_chat_format(tokenizer: Tokenizer, requested: str = "auto") -> ChatFormat | None:
    """`--chat-format auto | deepseek-v4 | jinja` -> the format to use; an explicit one the tokenizer cannot
    serve is a ValueError naming `chat_format`."""
    if requested == "auto":
        return detect_chat_format(tokenizer)
    if requested == "deepseek-v4" and not has_dsv4_markers(tokenizer):
        missing = [m for m in REQUIRED_MARKERS if tokenizer.token_to_id(m) is None]
        raise ValueError(f"chat_format: deepseek-v4 needs the V4 marker tokens; {tokenizer.source} lacks "
                         f"{', '.join(missing)}")
    if requested == "jinja" and tokenizer.chat_template is None:
        raise ValueError(f"chat_format: jinja needs a chat_template; {tokenizer.source} has none")
    if requested not in CHAT_FORMATS:
        raise ValueError(f"chat_format: expected auto, {' or '.join(CHAT_FORMATS)}, got {requested!r}")
    return requested  # type: ignore[return-value]

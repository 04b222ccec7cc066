"""The marker tokens of the DeepSeek-V4 chat format (each one id of the V4 vocabulary).

Only these strings, written by the encoder itself, become marker ids; the same text inside a message is
tokenised as plain text (see `Prompt.token_ids`).
"""

from __future__ import annotations

import re

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"  # tool-call markup: "<" + DSML + "invoke ...>" etc.; the angle brackets are plain text

# Quick-instruction tasks (a message's "task" field) -> the marker that asks for them.
TASK_MARKERS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

ALL_MARKERS = (BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK_START, THINK_END, DSML, *TASK_MARKERS.values())
# What a tokenizer must have for `detect_chat_format` to call it DeepSeek-V4.
REQUIRED_MARKERS = (BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK_START, THINK_END, DSML)

# Splits the encoder's own template text at its markers (longest first: "</think>" before "<think>" is moot,
# but a task marker must not lose to a shorter prefix).
MARKER_PATTERN = re.compile("(" + "|".join(map(re.escape, sorted(ALL_MARKERS, key=len, reverse=True))) + ")")

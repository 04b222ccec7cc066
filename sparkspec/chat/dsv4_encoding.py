"""The DeepSeek-V4 chat encoding: messages (+ OpenAI tools) -> the prompt text, byte for byte what DeepSeek's
reference encoder (`encoding/encoding_dsv4.py` of deepseek-ai/DeepSeek-V4-Pro) writes, and its token ids.

A conversation, in chat mode:

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜><｜User｜>...

Terms:
- mode: "chat" closes the thinking block at once (`<｜Assistant｜></think>`); "thinking" opens it
  (`<｜Assistant｜><think>`) and an assistant turn is `{reasoning}</think>{content}`.
- drop_thinking (thinking mode): assistant turns before the last user turn lose their reasoning (and
  developer messages there are dropped). Off whenever a message declares tools: agents need it all.
- reasoning effort: "max" puts a preamble before everything (thinking mode only); "high" is the default
  effort and writes nothing.
- the generation prompt is implicit: a conversation that ends with a user turn ends with the assistant
  marker and the thinking marker the mode asks for; one that ends with an assistant turn ends with EOS.
- a message's `task` (quick instructions: action, query, ...) appends that task's marker.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Literal

from tokenizers import Tokenizer as HFTokenizer

from sparkspec.chat import dsml
from sparkspec.chat.dsv4_markers import (
    ASSISTANT,
    BOS,
    EOS,
    LATEST_REMINDER,
    MARKER_PATTERN,
    TASK_MARKERS,
    THINK_END,
    THINK_START,
    USER,
)
from sparkspec.chat.dsv4_messages import (
    attach_tools,
    drop_earlier_thinking,
    last_user_index,
    merge_tool_results,
    order_tool_results,
    validate_messages,
)
from sparkspec.tokenizer import Tokenizer

Mode = Literal["chat", "thinking"]
ReasoningEffort = Literal["high", "max"]
MODES = ("chat", "thinking")
REASONING_EFFORTS = ("high", "max")

# The "max" preamble, verbatim as the model was trained on it.
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt: `segments` = [(text, is_marker)], markers one per segment, text never split at a
    marker the messages wrote. `text` is the prompt; `token_ids` its ids."""

    segments: tuple[tuple[str, bool], ...]

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.segments)

    def token_ids(self, tokenizer: Tokenizer) -> list[int]:
        """Ids under `tokenizer` (a V4 vocabulary): each marker is its id; the text between two markers is
        encoded with no added-token matching, so "<｜User｜>" typed in a message stays text and cannot forge a
        turn. Without such text the ids equal `tokenizer.encode(self.text)`."""
        runs: list[str] = []  # text stretches between markers, then one entry per marker
        kinds: list[bool] = []
        for text, is_marker in self.segments:
            if not is_marker and kinds and not kinds[-1]:
                runs[-1] += text
            elif text:
                runs.append(text)
                kinds.append(is_marker)
        texts = [r for r, k in zip(runs, kinds) if not k]
        # encode_batch releases the GIL: a long chat must not stall the server's event loop
        encoded = iter(_plain_text_tokenizer(tokenizer).encode_batch(texts, add_special_tokens=False))
        ids: list[int] = []
        for run, is_marker in zip(runs, kinds):
            if is_marker:
                marker_id = tokenizer.token_to_id(run)
                if marker_id is None:
                    raise ValueError(f"tokenizer {tokenizer.source}: no token for the DeepSeek-V4 marker {run!r}")
                ids.append(marker_id)
            else:
                ids.extend(next(encoded).ids)
        return ids


_PLAIN: weakref.WeakKeyDictionary[Tokenizer, HFTokenizer] = weakref.WeakKeyDictionary()


def _plain_text_tokenizer(tokenizer: Tokenizer) -> HFTokenizer:
    """A copy of the tokenizer without its added tokens: V4's markers are added tokens that are not flagged
    special, so `encode_special_tokens` would still match them; without the added tokens every string is
    plain text to the byte-level BPE (a copy: other threads encode with the original meanwhile)."""
    plain = _PLAIN.get(tokenizer)
    if plain is None:
        import json

        spec = json.loads(tokenizer.tok.to_str())
        spec["added_tokens"] = []
        plain = _PLAIN[tokenizer] = HFTokenizer.from_str(json.dumps(spec))
    return plain


class _Builder:
    def __init__(self) -> None:
        self.segments: list[tuple[str, bool]] = []

    def format(self, text: str) -> None:
        """The encoder's own text: its markers become marker segments."""
        for n, part in enumerate(MARKER_PATTERN.split(text)):
            if part:
                self.segments.append((part, n % 2 == 1))

    def data(self, text: str) -> None:
        """Text from the messages: never a marker."""
        if text:
            self.segments.append((text, False))

    def pieces(self, pieces: list[dsml.Piece]) -> None:
        for text, is_format in pieces:
            self.format(text) if is_format else self.data(text)


def encode_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                    mode: Mode = "chat", drop_thinking: bool = True,
                    reasoning_effort: ReasoningEffort | None = None, add_bos: bool = True) -> Prompt:
    """Messages (roles system, user, assistant, tool, developer, latest_reminder; OpenAI fields) and OpenAI
    `tools` -> the prompt. Bad input: ValueError naming the field (`messages[2].role`, `reasoning_effort`)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort: expected one of {', '.join(REASONING_EFFORTS)}, got {reasoning_effort!r}")
    validate_messages(messages)
    turns = order_tool_results(merge_tool_results(attach_tools(messages, tools)))
    keep_thinking = not drop_thinking or any(m.get("tools") for m in turns)
    if mode == "thinking" and not keep_thinking:
        turns = drop_earlier_thinking(turns)
    out = _Builder()
    if add_bos:
        out.format(BOS)
    if mode == "thinking" and reasoning_effort == "max":
        out.format(REASONING_EFFORT_MAX)
    last_user = last_user_index(turns)
    for i in range(len(turns)):
        _render_turn(out, turns, i, mode == "thinking", keep_thinking, last_user)
    return Prompt(tuple(out.segments))


def _render_declarations(out: _Builder, m: dict[str, Any]) -> None:
    """Tools and response format of a system / developer message."""
    if m.get("tools"):
        out.format("\n\n")
        out.pieces(dsml.render_tools_section(m["tools"]))
    if m.get("response_format"):
        out.format("\n\n" + RESPONSE_FORMAT)
        out.data(dsml.to_json(m["response_format"]))


def _tool_result_text(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "\n\n".join(p.get("text", "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]"
                       for p in content)


def _render_turn(out: _Builder, turns: list[dict[str, Any]], i: int, thinking: bool, keep_thinking: bool,
                 last_user: int) -> None:
    m, role = turns[i], turns[i]["role"]
    if role == "system":
        out.data(m.get("content") or "")
        _render_declarations(out, m)
    elif role == "developer":
        out.format(USER)
        out.data(m["content"])
        _render_declarations(out, m)
    elif role == "user":
        out.format(USER)
        for n, part in enumerate(m["parts"]):
            if n:
                out.format("\n\n")
            if part[0] == "text":
                out.data(part[1])
            else:
                out.format("<tool_result>")
                out.data(_tool_result_text(part[2]))
                out.format("</tool_result>")
    elif role == "latest_reminder":
        out.format(LATEST_REMINDER)
        out.data(m["content"])
    else:  # assistant
        after_task = i > 0 and turns[i - 1].get("task") is not None  # a task's answer has no thinking block
        if thinking and not after_task and (keep_thinking or i > last_user):
            out.data(m.get("reasoning_content") or "")
            out.format(THINK_END)
        out.data(m.get("content") or "")
        if m.get("tool_calls"):
            out.format("\n\n")
            out.pieces(dsml.render_tool_calls(m["tool_calls"]))
        if not m.get("wo_eos", False):
            out.format(EOS)

    # What follows a turn: nothing when the next one opens itself (user, developer, system), else the task
    # marker or, after a user / developer turn, the assistant marker and the mode's thinking marker.
    if i + 1 < len(turns) and turns[i + 1]["role"] not in ("assistant", "latest_reminder"):
        return
    task = m.get("task")
    if task == "action":
        out.format(ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_MARKERS[task])
    elif task is not None:
        out.format(TASK_MARKERS[task])
    elif role in ("user", "developer"):
        opens_thinking = thinking and (keep_thinking or i >= last_user)
        out.format(ASSISTANT + (THINK_START if opens_thinking else THINK_END))

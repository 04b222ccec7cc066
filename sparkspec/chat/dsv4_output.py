"""What a DeepSeek-V4 model wrote -> OpenAI's assistant message: `reasoning_content`, `content` and
`tool_calls`, from the whole text (`parse_completion`) or piece by piece while it streams (`StreamParser`).

The generated text (the prompt already ends with `<think>` or `</think>`; [block] = a DSML call block):

    thinking mode:  {reasoning}</think>{content}[\\n\\n{block}][<｜end▁of▁sentence｜>]
    chat mode:      {content}[\\n\\n{block}][<｜end▁of▁sentence｜>]

Rules (both functions apply the same ones, so a stream's deltas add up to the whole-text parse):
- text from an EOS on is ignored (a detokenizer that skips special tokens never shows it);
- thinking mode: reasoning runs to the first `</think>`; without one, all of it is reasoning;
- a call block is `<｜DSML｜tool_calls>` ... `</｜DSML｜tool_calls>`; the blank line before it is not content;
  a block that is not well formed, or never closed, stays in the content verbatim (never an error);
  text after a block is content, and a later block is parsed too;
- with `parse_tools=False` (no tools offered, `tool_choice: none`) markup is content.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sparkspec.chat.dsml import CALLS_CLOSE, CALLS_OPEN, parse_tool_calls
from sparkspec.chat.dsv4_markers import EOS, THINK_END

# What may start a call block: the model writes "\n\n" + CALLS_OPEN; the newlines are optional when parsing
# (and never content), so a stream holds back any of these beginnings.
_BLOCK_STARTS = ("\n\n" + CALLS_OPEN, "\n" + CALLS_OPEN, CALLS_OPEN)


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class ParsedCompletion:
    """An assistant message: reasoning_content is None in chat mode; tool_calls in OpenAI's shape."""

    content: str = ""
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        """"tool_calls" when the model called tools, else None (the engine's reason stands)."""
        return "tool_calls" if self.tool_calls else None


def _strip_blank_line(text: str) -> str:
    """The content before a call block without the (up to two) newlines that separate it."""
    return text[:-2] if text.endswith("\n\n") else text[:-1] if text.endswith("\n") else text


def parse_completion(text: str, *, thinking: bool, parse_tools: bool = True,
                     new_id: Callable[[], str] = new_tool_call_id) -> ParsedCompletion:
    """The whole generated text -> the assistant message (see the module docstring for the rules)."""
    eos = text.find(EOS)
    text = text if eos < 0 else text[:eos]
    out = ParsedCompletion()
    if thinking:
        end = text.find(THINK_END)
        if end < 0:
            out.reasoning_content = text
            return out
        out.reasoning_content, text = text[:end], text[end + len(THINK_END):]
    content, pos = [], 0
    while parse_tools:
        start = text.find(CALLS_OPEN, pos)
        close = -1 if start < 0 else text.find(CALLS_CLOSE, start)
        if close < 0:
            break
        close += len(CALLS_CLOSE)
        calls = parse_tool_calls(text[start:close])
        if calls is None:
            content.append(text[pos:close])
        else:
            content.append(_strip_blank_line(text[pos:start]))
            out.tool_calls += [_tool_call(name, arguments, new_id()) for name, arguments in calls]
        pos = close
    content.append(text[pos:])
    out.content = "".join(content)
    return out


@dataclass
class Delta:
    """New output since the last `feed`: text to append to reasoning_content / content, and whole tool calls
    (OpenAI stream shape: each with its `index`, `id`, `type`, `function.name` and full `function.arguments`)."""

    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning_content or self.content or self.tool_calls)


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that some marker starts with (it may yet become that marker)."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


class StreamParser:
    """Incremental `parse_completion`: `feed` text pieces as they are detokenised, get `Delta`s; `finish`
    at the end flushes what was held back. The deltas of any split of a text add up to the whole-text parse.

    Text that may be the start of a marker (`</think>`, a call block, EOS) is held back until it is decided;
    a call block is held whole until it closes, then sent as tool calls (or, malformed, as content), so a
    client never sees a call retracted. State: "reasoning" -> "content" -> "done" (EOS seen)."""

    def __init__(self, *, thinking: bool, parse_tools: bool = True,
                 new_id: Callable[[], str] = new_tool_call_id):
        self.parse_tools = parse_tools
        self.new_id = new_id
        self.state = "reasoning" if thinking else "content"
        self.num_tool_calls = 0
        self._pending = ""  # not yet sent: a possible marker start, or an open call block
        self._before_block = ""  # the newlines held just before an open call block
        self._in_block = False
        self._scanned = 0  # of an open block: how far the search for its end has looked

    def feed(self, text: str) -> Delta:
        delta = Delta()
        if self.state != "done" and text:
            self._pending += text
            self._advance(delta, final=False)
        return delta

    def finish(self) -> Delta:
        delta = Delta()
        if self.state != "done":
            self._advance(delta, final=True)
            self.state = "done"
        return delta

    def _advance(self, delta: Delta, final: bool) -> None:
        while True:
            if self.state == "reasoning":
                if not self._step_reasoning(delta, final):
                    return
            elif self.state == "content":
                if not (self._step_block(delta, final) if self._in_block else self._step_content(delta, final)):
                    return
            else:
                return

    def _cut_eos(self) -> bool:
        """Drop text from an EOS on; True when there was one (the stream is over)."""
        eos = self._pending.find(EOS)
        if eos >= 0:
            self._pending = self._pending[:eos]
        return eos >= 0

    def _step_reasoning(self, delta: Delta, final: bool) -> bool:
        ended = self._cut_eos()
        end = self._pending.find(THINK_END)
        if end >= 0:
            delta.reasoning_content += self._pending[:end]
            self._pending = self._pending[end + len(THINK_END):]
            self.state = "content"
            if ended:  # EOS came after </think>: what lies between is content
                self._pending += EOS
            return True
        hold = 0 if final or ended else _held_suffix(self._pending, (THINK_END, EOS))
        delta.reasoning_content += self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        if ended:
            self.state = "done"
        return False

    def _step_content(self, delta: Delta, final: bool) -> bool:
        ended = self._cut_eos()
        start = self._pending.find(CALLS_OPEN) if self.parse_tools else -1
        if start >= 0:
            before = self._pending[:start]
            kept = _strip_blank_line(before)
            delta.content += kept
            self._before_block = before[len(kept):]
            self._pending = self._pending[start:]
            self._in_block = True
            if ended:
                self._pending += EOS
            return True
        markers = (*_BLOCK_STARTS, EOS) if self.parse_tools else (EOS,)
        hold = 0 if final or ended else _held_suffix(self._pending, markers)
        delta.content += self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        if ended:
            self.state = "done"
        return False

    def _step_block(self, delta: Delta, final: bool) -> bool:
        eos = self._pending.find(EOS, max(0, self._scanned - len(EOS)))
        ended = eos >= 0
        if ended:
            self._pending = self._pending[:eos]
        close = self._pending.find(CALLS_CLOSE, max(0, self._scanned - len(CALLS_CLOSE)))
        self._scanned = len(self._pending)
        if close < 0:
            if final or ended:  # never closed: the block was content after all
                delta.content += self._before_block + self._pending
                self._pending, self._before_block, self._in_block, self._scanned = "", "", False, 0
                self.state = "done"
            return False
        close += len(CALLS_CLOSE)
        block, self._pending = self._pending[:close], self._pending[close:]
        calls = parse_tool_calls(block)
        if calls is None:
            delta.content += self._before_block + block
        else:
            for name, arguments in calls:
                delta.tool_calls.append({"index": self.num_tool_calls, **_tool_call(name, arguments, self.new_id())})
                self.num_tool_calls += 1
        self._before_block, self._in_block, self._scanned = "", False, 0
        if ended:
            self._pending += EOS
        return True

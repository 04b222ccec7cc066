"""Messages in, messages the DeepSeek-V4 renderer can walk out: validation (a ValueError naming the field),
the placement of OpenAI's top-level `tools`, tool results merged into user turns, earlier reasoning dropped.

The format has no tool role on the wire: a `tool` message becomes a `<tool_result>` block of a user turn;
consecutive tool results (and a user message that follows them) share one user turn, and the results of
one assistant turn are put in the order of its `tool_calls`. Consecutive user messages share a turn too.
"""

from __future__ import annotations

import json
from typing import Any

from sparkspec.chat.dsv4_markers import TASK_MARKERS

ROLES = ("system", "user", "assistant", "tool", "developer", "latest_reminder")
TEXT_ROLES = ("system", "user", "developer", "latest_reminder")  # content must be a string


def _fail(field: str, message: str) -> None:
    raise ValueError(f"{field}: {message}")


def _check_tools(tools: Any, field: str) -> None:
    if not isinstance(tools, list):
        _fail(field, f"expected a list of tools, got {type(tools).__name__}")
    for j, tool in enumerate(tools):
        where = f"{field}[{j}]"
        if not isinstance(tool, dict):
            _fail(where, "expected an object")
        if tool.get("type", "function") != "function":
            _fail(f"{where}.type", f"expected 'function', got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            _fail(f"{where}.function", "expected an object")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            _fail(f"{where}.function.name", "expected a non-empty string")


def _check_tool_calls(calls: Any, field: str) -> None:
    if not isinstance(calls, list):
        _fail(field, f"expected a list, got {type(calls).__name__}")
    for j, call in enumerate(calls):
        where = f"{field}[{j}]"
        if not isinstance(call, dict):
            _fail(where, "expected an object")
        if call.get("type", "function") != "function":
            _fail(f"{where}.type", f"expected 'function', got {call.get('type')!r}")
        if call.get("id") is not None and not isinstance(call["id"], str):
            _fail(f"{where}.id", "expected a string")
        fn = call.get("function")
        if not isinstance(fn, dict):
            _fail(f"{where}.function", "expected an object")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            _fail(f"{where}.function.name", "expected a non-empty string")
        arguments = fn.get("arguments")
        if not isinstance(arguments, str):
            _fail(f"{where}.function.arguments", "expected a JSON string")
        try:
            value = json.loads(arguments)
        except ValueError:
            continue  # rendered as one raw string parameter, as the reference encoder does
        if not isinstance(value, dict):
            _fail(f"{where}.function.arguments", f"expected a JSON object, got {type(value).__name__}")


def _check_tool_content(content: Any, field: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        _fail(field, f"expected a string or a list of content parts, got {type(content).__name__}")
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            _fail(f"{field}[{j}]", "expected an object")
        if part.get("type") == "text" and not isinstance(part.get("text"), str):
            _fail(f"{field}[{j}].text", "expected a string")


def validate_messages(messages: Any) -> None:
    """Raise ValueError naming the first bad field (`messages[2].role`, `messages[1].tool_calls[0].id`, ...)."""
    if not isinstance(messages, list) or not messages:
        _fail("messages", "expected a non-empty list of messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            _fail(where, f"expected an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            _fail(f"{where}.role", f"expected one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content")
        if role in TEXT_ROLES and not isinstance(content, str):
            if not (role == "system" and content is None):
                _fail(f"{where}.content", f"expected a string, got {type(content).__name__}")
        if role == "developer" and not content:
            _fail(f"{where}.content", "a developer message needs content")
        if role == "tool":
            _check_tool_content(content, f"{where}.content")
            if m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
                _fail(f"{where}.tool_call_id", "expected a string")
        if role == "assistant":
            if content is not None and not isinstance(content, str):
                _fail(f"{where}.content", f"expected a string or null, got {type(content).__name__}")
            if m.get("reasoning_content") is not None and not isinstance(m["reasoning_content"], str):
                _fail(f"{where}.reasoning_content", "expected a string or null")
            if m.get("tool_calls") is not None:
                _check_tool_calls(m["tool_calls"], f"{where}.tool_calls")
            if not isinstance(m.get("wo_eos", False), bool):
                _fail(f"{where}.wo_eos", "expected a boolean")
        if m.get("tools") is not None:
            if role not in ("system", "developer"):
                _fail(f"{where}.tools", "tools belong on a system or developer message")
            _check_tools(m["tools"], f"{where}.tools")
        if m.get("response_format") is not None and role not in ("system", "developer"):
            _fail(f"{where}.response_format", "a response format belongs on a system or developer message")
        if m.get("task") is not None and m["task"] not in TASK_MARKERS:
            _fail(f"{where}.task", f"expected one of {', '.join(TASK_MARKERS)}, got {m['task']!r}")


def attach_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI's top-level `tools` go where the format declares tools: on the first message when it is a
    system message, else on a new empty system message put first."""
    if not tools:
        return messages
    _check_tools(tools, "tools")
    for i, m in enumerate(messages):
        if m.get("tools"):
            _fail("tools", f"given both as a request field and on messages[{i}]")
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "tools": tools}, *messages[1:]]
    return [{"role": "system", "content": "", "tools": tools}, *messages]


def merge_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`tool` messages -> `<tool_result>` parts of user turns. A user turn is kept as `parts`: a list of
    ("text", str) and ("tool", tool_call_id, content)."""
    merged: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        last = merged[-1] if merged else None
        if role == "tool":
            part = ("tool", m.get("tool_call_id") or "", m.get("content", ""))
            if last is not None and last["role"] == "user":
                last["parts"].append(part)
            else:
                merged.append({"role": "user", "parts": [part]})
        elif role == "user":
            if last is not None and last["role"] == "user" and last.get("task") is None:
                last["parts"].append(("text", m["content"]))
            else:
                merged.append({**m, "parts": [("text", m["content"])]})
        else:
            merged.append(dict(m))
    return merged


def order_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Within each user turn, put the tool results in the order of the latest assistant's `tool_calls`
    (results of unknown ids rank as the first call; ties keep their order). Text parts keep their places."""
    rank: dict[str, int] = {}
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            ids = [c.get("id") or c["function"].get("id") for c in m["tool_calls"]]
            rank = {call_id: n for n, call_id in enumerate(ids) if call_id}
        elif m["role"] == "user":
            results = [p for p in m["parts"] if p[0] == "tool"]
            if len(results) > 1 and rank:
                ordered = iter(sorted(results, key=lambda p: rank.get(p[1], 0)))
                m["parts"] = [next(ordered) if p[0] == "tool" else p for p in m["parts"]]
    return messages


def last_user_index(messages: list[dict[str, Any]]) -> int:
    """Index of the last user or developer message (-1 without one)."""
    return next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] in ("user", "developer")), -1)


def drop_earlier_thinking(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Before the last user turn: assistants lose their reasoning and developer messages are dropped."""
    last = last_user_index(messages)
    out = []
    for i, m in enumerate(messages):
        if i >= last or m["role"] in ("user", "system", "latest_reminder"):
            out.append(m)
        elif m["role"] == "assistant":
            out.append({k: v for k, v in m.items() if k != "reasoning_content"})
    return out

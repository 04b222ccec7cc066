"""DSML, the tool-call markup of DeepSeek-V4: the tools section of a system / developer prompt, an
assistant's calls rendered as markup, and that markup parsed back into OpenAI `tool_calls`.

A call block, as the model writes it after its content:

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

`string="true"`: the value is the raw string; `string="false"`: the value is JSON (number, boolean, null,
array, object). Parsing is strict about the tags and lenient about the whitespace between them; anything
else is "not a call block" (None), which the output parser turns into content.
"""

from __future__ import annotations

import json
import re
from typing import Any

from sparkspec.chat.dsv4_markers import DSML, THINK_END, THINK_START

CALLS_OPEN = f"<{DSML}tool_calls>"
CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAMETER_CLOSE = f"</{DSML}parameter>"
_INVOKE_OPEN = re.compile(f'<{re.escape(DSML)}invoke name="([^"]*)">')
_PARAMETER_OPEN = re.compile(f'<{re.escape(DSML)}parameter name="([^"]*)" string="(true|false)">')
_SPACE = re.compile(r"\s*")

# The tools section, verbatim as the model was trained on it ({schemas}: one JSON object per line).
TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f'"{CALLS_OPEN}" block like the following:\n\n'
    f"{CALLS_OPEN}\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_CLOSE}\n'
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f"{CALLS_CLOSE}\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside "
    f"{THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


def to_json(value: Any) -> str:
    """JSON as the format writes it: non-ASCII kept, default separators (", " and ": ")."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # as the reference encoder: retry escaped, else let it raise
        return json.dumps(value, ensure_ascii=True)


# A rendered stretch: (text, is_format). Format text is the encoder's own (its markers become marker ids);
# the rest comes from the messages (names, values, schemas) and is always tokenised as plain text.
Piece = tuple[str, bool]


def render_tools_section(tools: list[dict[str, Any]]) -> list[Piece]:
    """OpenAI `tools` ([{"type": "function", "function": {...}}]) -> the tools section (the `function`
    objects as JSON, one per line, keys in the caller's order)."""
    head, tail = TOOLS_SECTION.split("{schemas}")
    return [(head, True), ("\n".join(to_json(t["function"]) for t in tools), False), (tail, True)]


def render_arguments(arguments: str) -> list[Piece]:
    """A call's JSON `arguments` string -> its parameter lines. Arguments that are not JSON render as one
    string parameter named "arguments", as the reference encoder does."""
    try:
        values = json.loads(arguments)
    except ValueError:
        values = {"arguments": arguments}
    out: list[Piece] = []
    for n, (name, value) in enumerate(values.items()):
        is_string = isinstance(value, str)
        out += [("\n" if n else "", True), (f'<{DSML}parameter name="', True), (name, False),
                (f'" string="{"true" if is_string else "false"}">', True),
                (value if is_string else to_json(value), False), (PARAMETER_CLOSE, True)]
    return out


def render_tool_calls(tool_calls: list[dict[str, Any]]) -> list[Piece]:
    """OpenAI `tool_calls` of an assistant message -> the call block (without the blank line before it)."""
    out: list[Piece] = [(CALLS_OPEN, True)]
    for call in tool_calls:
        out += [(f'\n<{DSML}invoke name="', True), (call["function"]["name"], False), ('">\n', True),
                *render_arguments(call["function"]["arguments"]), ("\n" + INVOKE_CLOSE, True)]
    return out + [("\n" + CALLS_CLOSE, True)]


def parse_tool_calls(block: str) -> list[tuple[str, str]] | None:
    """One call block (from CALLS_OPEN to CALLS_CLOSE, both included) -> [(name, JSON arguments)], or None
    when it is not well formed (no invoke, an unknown tag, a duplicate parameter, an unclosed element).

    A `string="false"` value that is not valid JSON is kept as a string (the call is still the model's
    intent); the arguments are re-serialised with `to_json`, so they are always valid JSON."""
    if not (block.startswith(CALLS_OPEN) and block.endswith(CALLS_CLOSE)):
        return None
    body, pos, calls = block[len(CALLS_OPEN): len(block) - len(CALLS_CLOSE)], 0, []
    pos = _SPACE.match(body, pos).end()
    while pos < len(body):
        invoke = _INVOKE_OPEN.match(body, pos)
        if invoke is None:
            return None
        pos, arguments = invoke.end(), {}
        while True:
            pos = _SPACE.match(body, pos).end()
            if body.startswith(INVOKE_CLOSE, pos):
                pos += len(INVOKE_CLOSE)
                break
            parameter = _PARAMETER_OPEN.match(body, pos)
            if parameter is None:
                return None
            end = body.find(PARAMETER_CLOSE, parameter.end())
            name, is_string = parameter.group(1), parameter.group(2) == "true"
            if end < 0 or name in arguments:
                return None
            value = body[parameter.end(): end]
            if not is_string:
                try:
                    value = json.loads(value)
                except ValueError:
                    pass
            arguments[name] = value
            pos = end + len(PARAMETER_CLOSE)
        calls.append((invoke.group(1), to_json(arguments)))
        pos = _SPACE.match(body, pos).end()
    return calls or None

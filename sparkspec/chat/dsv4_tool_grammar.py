"""Forced tool calls in DeepSeek-V4's DSML: the structural tag (xgrammar's JSON format) that lets the model write
only a call block, for `tool_choice: "required"` (one or more calls of the request's tools) or a named function
(exactly one call of it).

What it allows is what the encoder renders for an assistant turn whose content is empty (`dsml.render_tool_calls`
after the blank line), so a forced answer reads like the calls the model was trained on:

    [reasoning</think>]\n\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="P" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="Q" string="false">JSON value of Q's schema</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

Parameters come in the order of the function schema's `properties`; those in `required` must appear, the others
may; properties the schema does not name cannot. A property whose schema says `"type": "string"` (or an enum of
strings) is written as raw text (`string="true"`), one whose type leaves string out as JSON validated by its own
schema (`string="false"`), and one that allows both (no type, or a list of types with "string") either way. The
thinking mode's reasoning comes first, unconstrained, up to `</think>`.
"""

from __future__ import annotations

import json
from typing import Any

from sparkspec.chat.dsml import CALLS_CLOSE, CALLS_OPEN, INVOKE_CLOSE, PARAMETER_CLOSE
from sparkspec.chat.dsv4_markers import DSML, THINK_END


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def _optional(element: dict) -> dict:
    return {"type": "or", "elements": [element, _const("")]}


def _string_kinds(schema: Any) -> tuple[bool, bool]:
    """-> (may be written raw as string="true", may be written as JSON with string="false")."""
    if not isinstance(schema, dict):
        return True, True
    kind = schema.get("type")
    if kind is None and isinstance(schema.get("enum"), list):
        is_str = [isinstance(v, str) for v in schema["enum"]]
        return any(is_str), not all(is_str)
    if kind is None:
        return True, True
    kinds = kind if isinstance(kind, list) else [kind]
    return "string" in kinds, any(k != "string" for k in kinds)


def _parameter(name: str, schema: Any) -> dict:
    """One parameter line (its newline after it), as raw text, as JSON, or either."""
    raw, as_json = _string_kinds(schema)
    options = []
    if raw:
        options.append({"type": "tag", "begin": f'<{DSML}parameter name="{name}" string="true">',
                        "content": {"type": "any_text"}, "end": PARAMETER_CLOSE + "\n"})
    if as_json:
        js = {k: v for k, v in schema.items() if k != "description"} if isinstance(schema, dict) else {}
        if isinstance(js.get("type"), list):  # the JSON form carries the non-string types only
            js["type"] = [k for k in js["type"] if k != "string"] or js["type"]
        options.append({"type": "tag", "begin": f'<{DSML}parameter name="{name}" string="false">',
                        "content": {"type": "json_schema", "json_schema": js or True}, "end": PARAMETER_CLOSE + "\n"})
    return options[0] if len(options) == 1 else {"type": "or", "elements": options}


def _invoke(function: dict) -> dict:
    """One call of `function` (an OpenAI tool's `function` object)."""
    params = function.get("parameters") or {}
    props = params.get("properties") or {} if isinstance(params, dict) else {}
    required = set(params.get("required") or []) if isinstance(params, dict) else set()
    body = [_parameter(n, s) if n in required else _optional(_parameter(n, s)) for n, s in props.items()]
    # render_tool_calls writes "\n" + INVOKE_CLOSE after the last parameter (a blank line when there is none)
    body.append(_optional(_const("\n")))
    return {"type": "tag", "begin": f'\n<{DSML}invoke name="{function["name"]}">\n',
            "content": {"type": "sequence", "elements": body}, "end": INVOKE_CLOSE}


def forced_tool_calls(tools: list[dict], name: str | None, thinking: bool) -> str:
    """The structural tag (JSON text) of a forced answer: calls of any of `tools` (one or more) when `name` is
    None, else exactly one call of the function `name`."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise ValueError(f"tool_choice.function.name: {name!r} is not one of the request's tools")
    elements = []
    if thinking:
        elements.append({"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": THINK_END})
    elements += [_const("\n\n" + CALLS_OPEN),
                 {"type": "tags_with_separator", "tags": [_invoke(f) for f in chosen], "separator": "",
                  "at_least_one": True, "stop_after_first": name is not None},
                 _const("\n" + CALLS_CLOSE)]
    return json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": elements}},
                      ensure_ascii=False)

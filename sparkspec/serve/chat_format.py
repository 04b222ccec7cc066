"""The chat formats of /v1/chat/completions: a request's messages and chat fields -> the prompt token ids, and how
the model's output is read back into an assistant message (`ChatOutput`).

`serve --chat-format auto | deepseek-v4 | jinja` picks the format once (auto: DeepSeek-V4's encoding for a
checkpoint whose tokenizer has the V4 markers and no Jinja template, else the checkpoint's template).

- "deepseek-v4": `sparkspec.chat.encode_messages` (byte for byte DeepSeek's reference encoder); marker text inside
  a message stays text (`Prompt.token_ids`). Roles system, user, assistant (with `tool_calls`,
  `reasoning_content`), tool (with `tool_call_id`), developer, latest_reminder. The output is parsed into
  `reasoning_content` (thinking mode), `content` and `tool_calls` (`sparkspec.chat.parse_completion`, or its
  `StreamParser` while streaming); malformed markup stays content.
- "jinja": the checkpoint's template, roles system / user / assistant (developer renders as system); the output is
  content. The V4-only fields below are a 400 naming the field unless they carry their neutral value (the template
  would silently ignore them otherwise).

Request fields, as vLLM names them for DeepSeek:
  chat_template_kwargs  {"thinking": bool = false, "drop_thinking": bool = true}; other keys are a 400
  reasoning_effort      "high" | "max" (the encoder's values), thinking mode only
  tools                 OpenAI function tools, declared where the format puts them (the system prompt)
  tool_choice           "auto" (the default): calls are parsed when tools are given; "none": tools stay in the
                        prompt (earlier turns render as they did) and the output is not parsed for calls;
                        "required" (one or more calls) or a named function (exactly one call of it): the output
                        is constrained to a DSML call block by a grammar (`chat.forced_tool_calls`, structured
                        output: lossless under speculation like response_format, with which it cannot combine)
Content-part lists (`[{"type": "text", "text": ...}]`) are flattened (texts joined with nothing); a tool message's
parts go to the encoder as they are (it joins them with a blank line, as the reference does). Other part types
are a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparkspec.chat import (
    REASONING_EFFORTS,
    ChatFormat,
    ParsedCompletion,
    StreamParser,
    encode_messages,
    parse_completion,
)
from sparkspec.chat.dsv4_tool_grammar import forced_tool_calls
from sparkspec.sampling_params import StructuredOutput
from sparkspec.serve.protocol import ChatCompletionRequest, RequestError, short
from sparkspec.tokenizer import Tokenizer

CHAT_TEMPLATE_KWARGS = {"thinking": False, "drop_thinking": True}  # key -> its default (the neutral value)
TOOL_KEYS, FUNCTION_KEYS = {"type", "function"}, {"name", "description", "parameters", "strict"}


@dataclass(frozen=True)
class ChatOutput:
    """How the model's output becomes an assistant message: `thinking` (the prompt opened a reasoning block, so
    the output starts as reasoning_content) and `parse_tools` (DSML call blocks become tool_calls)."""

    thinking: bool
    parse_tools: bool
    structured: StructuredOutput | None = None  # a forced tool call's grammar (tool_choice required / named)

    def parse(self, text: str) -> ParsedCompletion:
        return parse_completion(text, thinking=self.thinking, parse_tools=self.parse_tools)

    def stream_parser(self) -> StreamParser:
        return StreamParser(thinking=self.thinking, parse_tools=self.parse_tools)


def _bad(field: str, message: str, code: str | None = None) -> RequestError:
    return RequestError(f"'{field}': {message}", field, code=code)


def chat_prompt(req: ChatCompletionRequest, chat_format: ChatFormat | None,
                tokenizer: Tokenizer | None) -> tuple[list[int], ChatOutput | None]:
    """-> (prompt token ids, how to read the output: None for plain content). RequestError for a bad field."""
    if chat_format is None or tokenizer is None:
        raise RequestError("this model has no chat format (no chat template, no DeepSeek-V4 markers); use "
                           "/v1/completions", "messages")
    thinking, drop_thinking = template_kwargs(req.chat_template_kwargs)
    if req.reasoning_effort is not None and req.reasoning_effort not in REASONING_EFFORTS:
        raise _bad("reasoning_effort", f"expected one of {', '.join(REASONING_EFFORTS)}, got "
                                       f"{short(req.reasoning_effort)}")
    tools = check_tools(req.tools)
    parse_tools, forced = check_tool_choice(req.tool_choice, tools)
    if chat_format == "jinja":
        return _jinja_prompt(req, tokenizer, thinking, drop_thinking, tools), None
    if req.reasoning_effort is not None and not thinking:
        raise _bad("reasoning_effort", "applies to thinking mode only; send chat_template_kwargs "
                                       '{"thinking": true}')
    messages = [v4_message(m, i) for i, m in enumerate(req.messages)]
    try:
        prompt = encode_messages(messages, tools or None, mode="thinking" if thinking else "chat",
                                 drop_thinking=drop_thinking, reasoning_effort=req.reasoning_effort)
        ids = prompt.token_ids(tokenizer)
    except ValueError as e:  # the encoder names the field: "messages[2].tool_calls[0].function.name: ..."
        field, _, message = str(e).partition(": ")
        raise _bad(field, message) from None
    structured = None
    if forced is not None:
        if req.response_format is not None and req.response_format != {"type": "text"} \
                or req.structured_outputs is not None:
            raise _bad("tool_choice", "a forced tool call cannot be combined with response_format or "
                                      "structured_outputs")
        name = None if forced == "required" else forced
        structured = StructuredOutput("structural_tag", forced_tool_calls(tools, name, thinking))
    return ids, ChatOutput(thinking=thinking, parse_tools=parse_tools, structured=structured)


def template_kwargs(kwargs: Any) -> tuple[bool, bool]:
    """`chat_template_kwargs` -> (thinking, drop_thinking)."""
    if kwargs is None:
        return CHAT_TEMPLATE_KWARGS["thinking"], CHAT_TEMPLATE_KWARGS["drop_thinking"]
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", 'expected an object such as {"thinking": true}')
    for key, value in kwargs.items():
        field = f"chat_template_kwargs.{short(key, quote=False)}"
        if key not in CHAT_TEMPLATE_KWARGS:
            raise _bad(field, f"unsupported key (this server takes {', '.join(CHAT_TEMPLATE_KWARGS)})",
                       "unsupported_parameter")
        if not isinstance(value, bool):
            raise _bad(field, f"expected a boolean, got {short(value)}")
    merged = {**CHAT_TEMPLATE_KWARGS, **kwargs}
    return merged["thinking"], merged["drop_thinking"]


def check_tools(tools: Any) -> list[dict]:
    """OpenAI function tools ([{"type": "function", "function": {"name", "description", "parameters"}}])."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("tools", f"expected a list of tools, got {type(tools).__name__}")
    names = set()
    for j, tool in enumerate(tools):
        where = f"tools[{j}]"
        if not isinstance(tool, dict):
            raise _bad(where, "expected an object")
        unknown = sorted(set(tool) - TOOL_KEYS, key=str)
        if unknown:
            raise _bad(f"{where}.{short(unknown[0], quote=False)}", "unsupported field", "unsupported_parameter")
        if tool.get("type") != "function":
            raise _bad(f"{where}.type", f"expected 'function', got {short(tool.get('type'))}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function", "expected an object")
        unknown = sorted(set(fn) - FUNCTION_KEYS, key=str)
        if unknown:
            raise _bad(f"{where}.function.{short(unknown[0], quote=False)}", "unsupported field",
                       "unsupported_parameter")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.function.name", "expected a non-empty string")
        if name in names:
            raise _bad(f"{where}.function.name", f"{short(name)} is declared twice")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"{where}.function.description", "expected a string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"{where}.function.parameters", "expected a JSON Schema object")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise _bad(f"{where}.function.strict", "expected a boolean")
    return tools


def check_tool_choice(choice: Any, tools: list[dict]) -> tuple[bool, str | None]:
    """-> (whether the output is parsed for tool calls, the forced call: None, "required" or a function name)."""
    if choice is None or choice == "auto":
        return bool(tools), None
    if choice == "none":
        return False, None
    if choice == "required":
        if not tools:
            raise _bad("tool_choice", "'required' needs tools")
        return True, "required"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if set(choice) != {"type", "function"} or choice["type"] != "function" or not isinstance(fn, dict) \
                or set(fn) != {"name"} or not isinstance(fn["name"], str):
            raise _bad("tool_choice", 'expected {"type": "function", "function": {"name": ...}}')
        if fn["name"] not in {t["function"]["name"] for t in tools}:
            raise _bad("tool_choice.function.name", f"{short(fn['name'])} is not one of the request's tools")
        return True, fn["name"]
    raise _bad("tool_choice", f"expected 'auto', 'none', 'required' or a named function, got {short(choice)}")


def _text_parts(content: list, field: str) -> list[dict]:
    for j, part in enumerate(content):
        where = f"{field}[{j}]"
        if not isinstance(part, dict):
            raise _bad(where, "expected a content part object")
        if part.get("type") != "text":
            raise _bad(f"{where}.type", f"only text content parts are supported, got {short(part.get('type'))}",
                       "unsupported_parameter")
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise _bad(where, 'expected {"type": "text", "text": "..."}')
    return content


def content_text(content: Any, field: str) -> str | None:
    """A message's content as one string (text parts joined); None stays None."""
    if isinstance(content, list):
        return "".join(p["text"] for p in _text_parts(content, field))
    return content


def v4_message(m, i: int) -> dict[str, Any]:
    """A request message -> the encoder's dict (OpenAI fields; None fields left out)."""
    field = f"messages[{i}].content"
    content = _text_parts(m.content, field) if m.role == "tool" and isinstance(m.content, list) \
        else content_text(m.content, field)
    out = {"role": m.role, "content": content, "tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id,
           "reasoning_content": m.reasoning_content}
    return {k: v for k, v in out.items() if v is not None or k == "content"}


def _jinja_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer, thinking: bool, drop_thinking: bool,
                  tools: list[dict]) -> list[int]:
    only_v4 = "is only supported with the deepseek-v4 chat format (this model uses its Jinja chat template)"
    if thinking:
        raise _bad("chat_template_kwargs.thinking", only_v4, "unsupported_parameter")
    if not drop_thinking:
        raise _bad("chat_template_kwargs.drop_thinking", only_v4, "unsupported_parameter")
    for name in ("reasoning_effort", "tools"):
        if getattr(req, name):
            raise _bad(name, only_v4, "unsupported_parameter")
    messages = []
    for i, m in enumerate(req.messages):
        if m.role in ("tool", "latest_reminder"):
            raise _bad(f"messages[{i}].role", f"{m.role!r} {only_v4}", "unsupported_parameter")
        for name in ("tool_calls", "tool_call_id", "reasoning_content"):
            if getattr(m, name) is not None:
                raise _bad(f"messages[{i}].{name}", only_v4, "unsupported_parameter")
        text = content_text(m.content, f"messages[{i}].content")
        if text is None:
            raise _bad(f"messages[{i}].content", "expected a string or a list of text parts")
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    try:
        return tokenizer.encode_chat(messages)
    except ValueError as e:
        raise RequestError(str(e), "messages") from None

"""DeepSeek-V4 chat encoding (sparkspec.chat): prompt text byte for byte against DeepSeek's reference encoder
(its published test vectors, and sparkspec's own conversations in tests/data/dsv4_chat/cases.json, whose
expected texts that encoder wrote: see make_cases.py there), then the options and the validation errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from sparkspec.chat import encode_messages, parse_completion

DATA = Path(__file__).parent / "data" / "dsv4_chat"
OFFICIAL = DATA / "official"
CASES = json.loads((DATA / "cases.json").read_text())
# (vector number, mode) as the reference's own test suite runs them
OFFICIAL_VECTORS = [(1, "thinking"), (2, "thinking"), (3, "thinking"), (4, "chat")]
OWN_CASES = [(c["name"], key) for c in CASES for key in c["expected"]]
BY_NAME = {c["name"]: c for c in CASES}


def official_messages(n: int) -> list[dict]:
    data = json.loads((OFFICIAL / f"test_input_{n}.json").read_text())
    if isinstance(data, dict):  # vector 1 keeps its tools apart: they belong on the system message
        data["messages"][0]["tools"] = data["tools"]
        return data["messages"]
    return data


def options(key: str) -> dict:
    mode, drop, effort = key.split("/")
    return {"mode": mode, "drop_thinking": drop == "drop", "reasoning_effort": None if effort == "None" else effort}


@pytest.mark.parametrize("n, mode", OFFICIAL_VECTORS)
def test_official_vector(n, mode):
    expected = (OFFICIAL / f"test_output_{n}.txt").read_text()
    assert encode_messages(official_messages(n), mode=mode).text == expected


def test_official_vector_1_parses_back():
    """The reference suite's parse checks: the tool-calling turn and the final turn of vector 1."""
    prompt = (OFFICIAL / "test_output_1.txt").read_text()
    opener = "<｜Assistant｜><think>"
    first = prompt.find(opener) + len(opener)
    turn = parse_completion(prompt[first: prompt.find("<｜User｜>", first)], thinking=True)
    assert turn.reasoning_content == "The user wants to know the weather in Beijing. I should use the get_weather tool."
    assert turn.content == ""
    assert [c["function"]["name"] for c in turn.tool_calls] == ["get_weather"]
    assert json.loads(turn.tool_calls[0]["function"]["arguments"]) == {"location": "Beijing", "unit": "celsius"}
    final = parse_completion(prompt[prompt.rfind(opener) + len(opener):], thinking=True)
    assert final.reasoning_content == "Got the weather data. Let me format a nice response."
    assert "22°C" in final.content and final.tool_calls == []


def test_number_of_byte_for_byte_cases():
    assert len(OFFICIAL_VECTORS) + len(OWN_CASES) == 4 + 504


@pytest.mark.parametrize("name, key", OWN_CASES)
def test_own_case(name, key):
    case = BY_NAME[name]
    assert encode_messages(case["messages"], case.get("tools"), **options(key)).text == case["expected"][key]


def test_messages_are_not_mutated():
    for case in CASES:
        before = copy.deepcopy(case["messages"])
        encode_messages(case["messages"], case.get("tools"), mode="thinking")
        assert case["messages"] == before


# ---- the options, one at a time ----
CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning_content": "r1", "content": "Hello"},
        {"role": "user", "content": "Bye"}]
B, U, A, E = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"


def test_chat_mode_closes_thinking_and_drops_reasoning():
    assert encode_messages(CHAT).text == f"{B}{U}Hi{A}</think>Hello{E}{U}Bye{A}</think>"


def test_thinking_mode_opens_thinking_on_the_last_turn():
    assert encode_messages(CHAT, mode="thinking").text == f"{B}{U}Hi{A}</think>Hello{E}{U}Bye{A}<think>"


def test_keep_thinking_keeps_earlier_reasoning():
    assert encode_messages(CHAT, mode="thinking", drop_thinking=False).text == \
        f"{B}{U}Hi{A}<think>r1</think>Hello{E}{U}Bye{A}<think>"


def test_tools_keep_thinking_even_when_asked_to_drop():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    text = encode_messages(CHAT, tools, mode="thinking", drop_thinking=True).text
    assert "<think>r1</think>Hello" in text


def test_reasoning_effort_max_only_in_thinking_mode():
    preamble = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    assert encode_messages(CHAT, mode="thinking", reasoning_effort="max").text.startswith(B + preamble)
    assert preamble not in encode_messages(CHAT, mode="chat", reasoning_effort="max").text
    assert encode_messages(CHAT, mode="thinking", reasoning_effort="high").text == \
        encode_messages(CHAT, mode="thinking").text


def test_add_bos_off():
    assert encode_messages(CHAT, add_bos=False).text == encode_messages(CHAT).text[len(B):]


def test_top_level_tools_go_on_the_leading_system_message():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with_system = encode_messages([{"role": "system", "content": "S"}, *CHAT], tools).text
    assert with_system.startswith(f"{B}S\n\n## Tools\n\n")
    without = encode_messages(CHAT, tools).text
    assert without.startswith(f"{B}\n\n## Tools\n\n") and '{"name": "f", "parameters": {}}' in without


# ---- validation: ValueError with one line naming the field ----
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
BAD = [
    ([], {}, "messages"),
    ("hi", {}, "messages"),
    ([{"role": "robot", "content": "x"}], {}, "messages[0].role"),
    ([{"content": "x"}], {}, "messages[0].role"),
    (["x"], {}, "messages[0]"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], {}, "messages[1].content"),
    ([{"role": "user", "content": None}], {}, "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}]}], {}, "messages[0].content"),
    ([{"role": "latest_reminder", "content": None}], {}, "messages[0].content"),
    ([{"role": "developer", "content": ""}], {}, "messages[0].content"),
    ([{"role": "assistant", "content": 1}], {}, "messages[0].content"),
    ([{"role": "assistant", "content": "", "reasoning_content": 5}], {}, "messages[0].reasoning_content"),
    ([{"role": "assistant", "content": "", "tool_calls": {}}], {}, "messages[0].tool_calls"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]}], {},
     "messages[0].tool_calls[0].function"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "", "arguments": "{}"}}]}], {},
     "messages[0].tool_calls[0].function.name"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}], {},
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}], {},
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": 7, "function": {"name": "f", "arguments": "{}"}}]}], {},
     "messages[0].tool_calls[0].id"),
    ([{"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f", "arguments": "{}"}}]}], {},
     "messages[0].tool_calls[0].type"),
    ([{"role": "assistant", "content": "", "wo_eos": "yes"}], {}, "messages[0].wo_eos"),
    ([{"role": "tool", "content": 5}], {}, "messages[0].content"),
    ([{"role": "tool", "content": [{"type": "text", "text": 1}]}], {}, "messages[0].content[0].text"),
    ([{"role": "tool", "content": "x", "tool_call_id": 3}], {}, "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x", "tools": [TOOL]}], {}, "messages[0].tools"),
    ([{"role": "system", "content": "x", "tools": [{"type": "function"}]}], {}, "messages[0].tools[0].function"),
    ([{"role": "system", "content": "x", "tools": [{"function": {"name": 3}}]}], {},
     "messages[0].tools[0].function.name"),
    ([{"role": "user", "content": "x", "response_format": {"type": "json_object"}}], {},
     "messages[0].response_format"),
    ([{"role": "user", "content": "x", "task": "summarise"}], {}, "messages[0].task"),
    ([{"role": "user", "content": "x"}], {"tools": "f"}, "tools"),
    ([{"role": "user", "content": "x"}], {"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ([{"role": "system", "content": "x", "tools": [TOOL]}], {"tools": [TOOL]}, "tools"),
    ([{"role": "user", "content": "x"}], {"mode": "reasoning"}, "mode"),
    ([{"role": "user", "content": "x"}], {"reasoning_effort": "low"}, "reasoning_effort"),
]


@pytest.mark.parametrize("messages, kwargs, field", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_names_the_field(messages, kwargs, field):
    kwargs = dict(kwargs)
    tools = kwargs.pop("tools", None)
    with pytest.raises(ValueError) as e:
        encode_messages(messages, tools, **kwargs)
    message = str(e.value)
    assert message.startswith(field + ": ") and "\n" not in message

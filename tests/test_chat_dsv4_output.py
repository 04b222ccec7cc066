"""DeepSeek-V4 output parsing (sparkspec.chat): reasoning / content / DSML tool calls from the whole text, the
stream parser fed in every split equals it, malformed markup degrades to content, and a parsed call encoded
back into the conversation gives the reference encoding of the next turn."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from sparkspec.chat import StreamParser, encode_messages, parse_completion

EOS = "<｜end▁of▁sentence｜>"
D = "｜DSML｜"


def block(*invokes: str) -> str:
    return f"<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"


def invoke(name: str, *params: tuple[str, bool, str]) -> str:
    lines = [f'<{D}parameter name="{k}" string="{"true" if s else "false"}">{v}</{D}parameter>' for k, s, v in params]
    return f'<{D}invoke name="{name}">\n' + "\n".join(lines) + f"\n</{D}invoke>"


WEATHER = invoke("get_weather", ("city", True, "Paris"), ("days", False, "3"))
SEARCH = invoke("search", ("q", True, "a <b> & \"c\"\nline"), ("opts", False, '{"n": [1, 2], "x": null}'),
                ("flag", False, "true"))


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter):04x}"


def calls(parsed) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


# ---- whole text ----
def test_thinking_splits_reasoning_and_content():
    p = parse_completion(f"Let me think.</think>The answer is 4.{EOS}", thinking=True)
    assert (p.reasoning_content, p.content, p.tool_calls, p.finish_reason) == \
        ("Let me think.", "The answer is 4.", [], None)


def test_chat_mode_has_no_reasoning():
    p = parse_completion("Plain answer</think> with a stray marker", thinking=False)
    assert p.reasoning_content is None and p.content == "Plain answer</think> with a stray marker"


def test_unfinished_thinking_is_all_reasoning():
    p = parse_completion("still thinking", thinking=True)
    assert (p.reasoning_content, p.content) == ("still thinking", "")


def test_text_after_eos_is_ignored():
    assert parse_completion(f"a{EOS}b", thinking=False).content == "a"
    assert parse_completion(f"r{EOS}</think>c", thinking=True).reasoning_content == "r"


def test_tool_calls_with_typed_parameters():
    p = parse_completion(f"r</think>Checking.\n\n{block(WEATHER, SEARCH)}{EOS}", thinking=True, new_id=ids())
    assert p.content == "Checking." and p.finish_reason == "tool_calls"
    assert calls(p) == [("get_weather", {"city": "Paris", "days": 3}),
                        ("search", {"q": 'a <b> & "c"\nline', "opts": {"n": [1, 2], "x": None}, "flag": True})]
    assert [c["id"] for c in p.tool_calls] == ["call_0000", "call_0001"]
    assert all(c["type"] == "function" for c in p.tool_calls)


def test_default_ids_are_call_hex():
    p = parse_completion(block(WEATHER), thinking=False)
    (call_id,) = [c["id"] for c in p.tool_calls]
    assert call_id.startswith("call_") and int(call_id[5:], 16) >= 0 and len(call_id) == 29


def test_no_parameters_and_loose_whitespace():
    text = f"<{D}tool_calls>  <{D}invoke name=\"now\">\n\n</{D}invoke>\n\n</{D}tool_calls>"
    assert calls(parse_completion(text, thinking=False)) == [("now", {})]


def test_string_false_that_is_not_json_stays_a_string():
    p = parse_completion(block(invoke("f", ("x", False, "not json"))), thinking=False)
    assert calls(p) == [("f", {"x": "not json"})]


def test_string_true_keeps_json_looking_text_as_text():
    assert calls(parse_completion(block(invoke("f", ("x", True, "42"))), thinking=False)) == [("f", {"x": "42"})]


def test_text_after_a_block_is_content_and_a_second_block_parses():
    text = f"a\n\n{block(WEATHER)} tail\n\n{block(SEARCH)}"
    p = parse_completion(text, thinking=False)
    assert p.content == "a tail" and [n for n, _ in calls(p)] == ["get_weather", "search"]


def test_parse_tools_off_leaves_markup_as_content():
    text = f"x\n\n{block(WEATHER)}"
    p = parse_completion(text, thinking=False, parse_tools=False)
    assert p.content == text and p.tool_calls == []


MALFORMED = [
    f"<{D}tool_calls>\n{WEATHER}",  # never closed
    block(),  # no invoke
    block(f'<{D}invoke name="f">\n</{D}invoke'),  # invoke not closed
    block(f'<{D}invoke name="f">\n<{D}parameter name="x" string="maybe">1</{D}parameter>\n</{D}invoke>'),
    block(f'<{D}invoke name="f">\n<{D}parameter name="x" string="true">1\n</{D}invoke>'),  # parameter unclosed
    block(invoke("f", ("x", True, "1"), ("x", True, "2"))),  # duplicate parameter
    block(f"<{D}invoke>\n</{D}invoke>"),  # no name
    block("free text " + WEATHER),
    block(WEATHER, "garbage"),
    block(f"<{D}tool_calls>\n{WEATHER}"),  # nested open
    f"<{D}tool_calls></{D}tool_calls>",
]


@pytest.mark.parametrize("bad", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_markup_degrades_to_content(bad):
    text = f"reason</think>before\n\n{bad}"
    p = parse_completion(text + EOS, thinking=True)
    assert p.reasoning_content == "reason" and p.tool_calls == [] and p.content == f"before\n\n{bad}"


def test_a_malformed_block_does_not_hide_a_good_one_after_it():
    p = parse_completion(f"{block()}\n\n{block(WEATHER)}", thinking=False)
    assert p.content == block() and [n for n, _ in calls(p)] == ["get_weather"]


# ---- streaming: any split adds up to the whole-text parse ----
TEXTS = [
    ("Let me think.</think>The answer is 4." + EOS, True),
    ("no end of thinking", True),
    ("r</think>", True),
    ("</think>\n\n" + block(WEATHER), True),
    ("r</th", True),
    ("r</think>c</think>d", True),
    ("partial marker </thin k> done</think>x", True),
    (f"r{EOS}</think>ignored", True),
    ("answer with newline\n", False),
    ("answer\n\n\n" + block(WEATHER) + EOS, False),
    ("a\n" + block(WEATHER, SEARCH), False),
    ("a" + block(SEARCH) + "after" + EOS + "junk", False),
    (f"a\n\n{block(WEATHER)} tail\n\n{block(SEARCH)}", False),
    ("<｜DSML｜not a block <｜ and </ and \n\n<", False),
    (f"x\n\n{block(WEATHER)[:-5]}", False),  # cut inside the closing tag
    (f"x\n\n{block(WEATHER)}{EOS}", False),
    (f"x\n\n<{D}tool_calls>\n{WEATHER}{EOS}more", False),
    (f"r</think>c{EOS}", True),
    ("", True),
    ("", False),
    *[(f"r</think>y\n\n{bad}", True) for bad in MALFORMED],
    *[(f"{bad}z", False) for bad in MALFORMED],
]


def stream(text: str, pieces: list[int], thinking: bool, parse_tools: bool = True):
    parser = StreamParser(thinking=thinking, parse_tools=parse_tools, new_id=ids())
    reasoning, content, tool_calls = "", "", []
    pos, deltas = 0, []
    for n in pieces:
        deltas.append(parser.feed(text[pos: pos + n]))
        pos += n
    deltas.append(parser.finish())
    assert parser.feed("late") == type(deltas[0])()  # nothing after finish
    for d in deltas:
        reasoning += d.reasoning_content
        content += d.content
        tool_calls += d.tool_calls
    for n, c in enumerate(tool_calls):
        assert c.pop("index") == n
    return reasoning, content, tool_calls


def whole(text: str, thinking: bool, parse_tools: bool = True):
    p = parse_completion(text, thinking=thinking, parse_tools=parse_tools, new_id=ids())
    return p.reasoning_content or "", p.content, p.tool_calls


@pytest.mark.parametrize("parse_tools", [True, False])
@pytest.mark.parametrize("text, thinking", TEXTS, ids=range(len(TEXTS)))
def test_stream_one_character_at_a_time_equals_whole(text, thinking, parse_tools):
    assert stream(text, [1] * len(text), thinking, parse_tools) == whole(text, thinking, parse_tools)


@pytest.mark.parametrize("text, thinking", TEXTS, ids=range(len(TEXTS)))
def test_stream_random_pieces_equals_whole(text, thinking):
    rng = random.Random(len(text))
    for _ in range(20):
        pieces, left = [], len(text)
        while left > 0:
            pieces.append(min(left, rng.randint(1, 12)))
            left -= pieces[-1]
        assert stream(text, pieces, thinking) == whole(text, thinking)


def test_stream_sends_reasoning_before_it_ends_and_holds_marker_starts():
    parser = StreamParser(thinking=True)
    assert parser.feed("I think").reasoning_content == "I think"
    assert parser.feed(" so</thi").reasoning_content == " so"  # "</thi" may be </think>
    d = parser.feed("nk>Yes\n")
    assert (d.reasoning_content, d.content) == ("", "Yes")  # "\n" may open a call block
    d = parser.feed(f"\n<{D}tool_calls>\n{WEATHER}")
    assert not d  # a block is sent whole, once closed
    d = parser.feed(f"\n</{D}tool_calls>")
    assert [c["function"]["name"] for c in d.tool_calls] == ["get_weather"] and d.tool_calls[0]["index"] == 0
    assert not parser.finish()


def test_stream_malformed_block_comes_out_as_content_once_closed():
    parser = StreamParser(thinking=False)
    assert parser.feed("ok\n\n" + block()[:-3]).content == "ok"
    assert parser.feed(block()[-3:]).content == "\n\n" + block()


# ---- round trip: a parsed call, then its result, encodes as the reference does ----
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string"}, "days": {"type": "integer"}}}}}


@pytest.mark.parametrize("mode", ["chat", "thinking"])
def test_round_trip_tool_call_then_tool_result(mode):
    messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    prompt = encode_messages(messages, [WEATHER_TOOL], mode=mode).text
    assert prompt.endswith("<｜Assistant｜>" + ("<think>" if mode == "thinking" else "</think>"))
    reasoning = "I should call get_weather." if mode == "thinking" else ""
    generated = (reasoning + "</think>" if mode == "thinking" else "") + "\n\n" + block(WEATHER) + EOS
    parsed = parse_completion(generated, thinking=mode == "thinking", new_id=lambda: "call_abc")
    assert parsed.finish_reason == "tool_calls" and parsed.content == ""
    assistant = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
    if parsed.reasoning_content is not None:
        assistant["reasoning_content"] = parsed.reasoning_content
    turn = [*messages, assistant, {"role": "tool", "tool_call_id": "call_abc", "content": '{"temp": 21}'}]
    next_prompt = encode_messages(turn, [WEATHER_TOOL], mode=mode).text
    # the model's own turn comes back verbatim (it continues from the tokens it wrote), then the result
    opener = "<｜Assistant｜>" + ("<think>" if mode == "thinking" else "</think>")
    assert next_prompt == prompt + generated + "<｜User｜><tool_result>{\"temp\": 21}</tool_result>" + opener


def test_round_trip_against_reference_case():
    """The parse of the assistant turn of the reference-encoded case `tool_round_trip`, put back, re-encodes it."""
    from test_chat_dsv4 import BY_NAME

    case = BY_NAME["tool_round_trip"]
    expected = case["expected"]["thinking/drop/None"]
    start = expected.index("<｜Assistant｜><think>") + len("<｜Assistant｜><think>")
    generated = expected[start: expected.index(EOS, start) + len(EOS)]
    parsed = parse_completion(generated, thinking=True, new_id=lambda: "call_1")
    messages = [*case["messages"][:2],
                {"role": "assistant", "reasoning_content": parsed.reasoning_content, "content": parsed.content,
                 "tool_calls": parsed.tool_calls}, case["messages"][3]]
    assert encode_messages(messages, mode="thinking").text == expected

"""QA of this session's server paths on the demo pair (`--spec dspark`, prefix caching on, its Jinja chat template),
through HTTP: prefix-cache hits shared by many clients while half of them disconnect, n = 4 on one prompt with a
disconnect, structured output that is bad (a regex xgrammar refuses, a choice list too long to compile), that can
never finish (it ends at max_tokens), or that compiles slowly (off the event loop), forced tool calls on a Jinja
chat format (a clean 400), and seeded streams under `sampling_scheme="gumbel"` compared with their references.

Greedy streams are compared token for token (reproducible whatever the batch); seeded sampled ones only under
Gumbel, whose draws do not depend on the drafts (the rejection scheme's draws follow the adaptive k). No test
reads the clock; every wait has a generous safety net."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from test_server import Server, wait_idle
from test_server_fuzz import DEMO, LIMITS, SAFETY_S, choices_of, good_body
from test_server_robustness import sse_events

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.grammar import MAX_CHOICES
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.loading.checkpoint import load_checkpoint

MODEL = "tiny"
# ~40 sentences: several prefix-cache groups, so a second request of it is a hit
LONG_PROMPT = " ".join(f"Line {i} of the shared document says the same thing again." for i in range(40))


def demo_server(**config) -> Server:
    ckpt = load_checkpoint(DEMO)
    engine = LLMEngine(ckpt.model, ckpt.tokenizer, EngineConfig(max_num_seqs=32, max_waiting=512,
                                                                speculative="dspark", **config), ckpt.drafter_tensors)
    return Server(engine, LIMITS, model=MODEL)


@pytest.fixture(scope="module")
def server():
    with demo_server() as s:
        yield s


def stream(url: str, path: str, body: dict) -> dict:
    with httpx.Client(base_url=url, timeout=SAFETY_S) as http, \
            http.stream("POST", path, json=good_body(body)) as r:
        assert r.status_code == 200, r.read()
        return choices_of(sse_events(r))


def leave_mid_stream(url: str, path: str, body: dict) -> None:
    with httpx.Client(base_url=url, timeout=SAFETY_S) as http, \
            http.stream("POST", path, json=good_body(body)) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, timeout=SAFETY_S)


def assert_idle(server) -> None:
    """Every request gone and every KV block free or evictable (no reference leaked by an abort)."""
    wait_idle(server.engine, SAFETY_S)
    bm = server.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def in_threads(*jobs) -> list:
    """Run the jobs at once (a barrier releases them together); -> their results, or raises the first error."""
    barrier, results, errors = threading.Barrier(len(jobs)), [None] * len(jobs), []

    def go(i, job):
        barrier.wait(SAFETY_S)
        try:
            results[i] = job()
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=go, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SAFETY_S)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("path,prompt", [("/v1/completions", {"prompt": LONG_PROMPT}),
                                         ("/v1/chat/completions",
                                          {"messages": [{"role": "user", "content": LONG_PROMPT}]})])
def test_prefix_hits_shared_by_clients_half_of_whom_leave(server, path, prompt):
    body = {**prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    reference = stream(server.url, path, body)  # also fills the prefix cache
    hits_before = server.engine.stats.num_prefix_cache_hits
    for _ in range(3):
        stayed = in_threads(*[lambda: stream(server.url, path, body)] * 4,
                            *[lambda: leave_mid_stream(server.url, path, {**body, "max_tokens": 400})] * 4)
        assert stayed[:4] == [reference] * 4
    assert server.engine.stats.num_prefix_cache_hits > hits_before
    assert_idle(server)


def test_prefix_hits_with_leaving_clients_under_preemption():
    """A KV cache of 125 blocks: 8 clients of a 37-block prompt, each asking 25 blocks more, cannot all run, so
    sequences holding shared cached blocks are preempted and recomputed (taking the cache again) while others
    leave; the clients that stay still get the reference, and no block is leaked."""
    with demo_server(kv_cache_memory=16_000_000) as small:
        path, body = "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 400, "temperature": 0,
                                         "ignore_eos": True}
        reference = stream(small.url, path, body)
        for _ in range(2):
            got = in_threads(*[lambda: stream(small.url, path, body)] * 5,
                             *[lambda: leave_mid_stream(small.url, path, body)] * 3)
            assert got[:5] == [reference] * 5
        assert small.engine.scheduler.num_preemptions > 0
        assert small.engine.stats.num_prefix_cache_hits > 0
        assert_idle(small)


def test_n4_on_a_shared_prompt_with_a_disconnect(server):
    body = {"prompt": LONG_PROMPT + " And then", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    one = stream(server.url, "/v1/completions", body)[0]
    leaving = {**body, "n": 4, "temperature": 1.0, "max_tokens": 400}
    got = in_threads(lambda: stream(server.url, "/v1/completions", {**body, "n": 4}),
                     lambda: leave_mid_stream(server.url, "/v1/completions", leaving))[0]
    assert got == {i: one for i in range(4)}  # greedy: every choice is the n = 1 answer
    assert_idle(server)


@pytest.mark.parametrize("field,value", [("regex", "("), ("regex", "[a-"), ("grammar", "root ::= "),
                                         ("grammar", "root ::= undefined_rule")])
def test_structured_output_that_does_not_compile_is_a_400(server, field, value):
    r = post(server.url, "/v1/completions", {"prompt": "x", "max_tokens": 2,
                                             "structured_outputs": {field: value}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"structured_outputs.{field}"


@pytest.mark.parametrize("choices", [[f"option {i}" for i in range(MAX_CHOICES + 1)], [f"option {i}" for i in
                                     range(20_000)], ["x" * 70_000]])
def test_a_choice_list_too_long_to_compile_is_a_400(server, choices):
    r = post(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "pick"}],
                                                  "max_tokens": 4, "structured_outputs": {"choice": choices}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs.choice"


def test_a_choice_list_within_the_limit_is_answered_with_one_of_it(server):
    choices = [f"option {i}" for i in range(300)]
    r = post(server.url, "/v1/completions", {"prompt": "pick", "max_tokens": 16, "temperature": 1.0,
                                             "structured_outputs": {"choice": choices}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in choices


def test_a_grammar_that_can_never_finish_ends_at_max_tokens(server):
    body = {"prompt": "a", "max_tokens": 12, "temperature": 1.0, "structured_outputs": {"grammar": 'root ::= "a" root'}}
    c = post(server.url, "/v1/completions", body).json()["choices"][0]
    assert c["finish_reason"] == "length" and c["text"] and set(c["text"]) == {"a"}
    got = stream(server.url, "/v1/completions", body)[0]
    assert got[2] == "length" and set(got[1]) == {"a"}
    leave_mid_stream(server.url, "/v1/completions", {**body, "max_tokens": 400})
    assert_idle(server)


def test_grammars_compile_off_the_event_loop(server):
    """A compile takes up to a second (the backend's first build several): on the event loop it would stall every
    stream and /health. The admission's check then finds the grammar cached."""
    backend = server.engine.grammars()
    compile_ = backend.compile
    compiled_on_loop = []

    def recording(fmt):
        misses = compile_.cache_info().misses
        out = compile_(fmt)
        if compile_.cache_info().misses > misses:  # this call compiled
            compiled_on_loop.append(asyncio._get_running_loop() is not None)
        return out
    backend.compile = recording
    try:
        for i, (path, extra) in enumerate([("/v1/completions", {"prompt": "x"}),
                                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]):
            r = post(server.url, path, {**extra, "max_tokens": 2, "structured_outputs": {"regex": f"q{i}[0-9]+"}})
            assert r.status_code == 200, r.text
    finally:
        backend.compile = compile_
    assert compiled_on_loop == [False, False]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("fields,param", [
    ({"tools": TOOLS, "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools"),
])
def test_forced_tool_calls_on_a_jinja_template_are_a_clean_400(server, fields, param):
    for stream_ in (False, True):
        r = post(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "weather?"}],
                                                      "max_tokens": 8, "stream": stream_, **fields})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


@pytest.fixture(scope="module")
def gumbel_server():
    with demo_server(sampling_scheme="gumbel") as s:
        yield s


SEEDED = [("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0, "seed": 7,
                               "ignore_eos": True}),
          ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 3,
                               "ignore_eos": True}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 20,
                                    "temperature": 1.0, "top_k": 50, "seed": 11, "ignore_eos": True}),
          ("/v1/completions", {"prompt": "Write", "max_tokens": 40, "temperature": 1.0, "seed": 2,
                               "structured_outputs": {"regex": "[a-z ]{10,60}\\."}})]


def test_seeded_gumbel_streams_equal_their_references_under_load(gumbel_server):
    url = gumbel_server.url
    references = [stream(url, path, body) for path, body in SEEDED]  # alone on an idle server
    # drafter-invariant: the same tokens without speculation
    assert [stream(url, path, {**body, "speculative": {"enabled": False}}) for path, body in SEEDED] == references
    noise = [lambda i=i: stream(url, "/v1/completions", {"prompt": f"noise {i}", "max_tokens": 30 + 7 * i,
                                                         "temperature": 1.0, "ignore_eos": True}) for i in range(5)]
    leaving = [lambda: leave_mid_stream(url, "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 400})] * 2
    for _ in range(2):
        got = in_threads(*[lambda p=p, b=b: stream(url, p, b) for p, b in SEEDED], *noise, *leaving)
        assert got[: len(SEEDED)] == references
    assert_idle(gumbel_server)
